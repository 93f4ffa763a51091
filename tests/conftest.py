"""Test-suite hooks."""


def pytest_configure(config):
    """A worker of the suite's two (pytest-xdist) computes on one thread: two workers' torch
    thread pools of two threads each on 2 cores spin against each other (a 4 s test took 42 s
    beside a busy neighbour). Processes the tests start choose their own threads."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    else:
        _compile_sources()


def _compile_sources() -> None:
    """Write the bytecode of Inflight's own modules (and the tests') once, before the suite
    starts its hundreds of processes (engines, stages, learners). Under
    ``PYTHONDONTWRITEBYTECODE`` (set on some machines, the project's development machine among
    them) none is ever cached, and each process compiled every module it imported from source
    again: 0.32 s (0.10-0.49) of the CPU an engine's imports take. Cached bytecode is still
    read there; a module edited later is compiled again by its next import, as usual."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for package in ("pipeline", "stages", "transport", "tests"):
        compileall.compile_dir(root / package, quiet=2, workers=1)


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
