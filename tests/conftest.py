"""Test-suite hooks."""


def pytest_unconfigure(config):
    """Leave at once after the report: some tests leave daemon threads inside gloo collectives
    (the publisher's design: a collective abandoned after a failure ends at its timeout), and
    C++ thread teardown at interpreter exit can then abort a run whose tests all passed."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(getattr(config, "_inflight_exitstatus", 0))


def pytest_sessionfinish(session, exitstatus):
    session.config._inflight_exitstatus = int(exitstatus)
