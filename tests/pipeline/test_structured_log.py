"""pipeline.structured_log: what a process's JSON-lines log file contains."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import structlog

from pipeline.structured_log import (
    close_process_logging,
    configure_process_logging,
    set_process_level,
)

REPO = Path(__file__).resolve().parents[2]
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@pytest.fixture(autouse=True)
def _close_logging():
    yield
    close_process_logging()


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_event_carries_identity_and_the_version_at_emission(tmp_path):
    version = [3]
    path = tmp_path / "logs" / "square.0.jsonl"  # logs/ does not exist yet
    log = configure_process_logging(path, stage="square", replica=0, version=lambda: version[0])
    log.info("replica_started", port=5555)
    version[0] = 4  # a weight update lands mid-run
    structlog.get_logger().warning("weights_applied", bucket=2)  # a module-level style logger
    structlog.contextvars.bind_contextvars(task="gen")
    try:
        log.info("metrics", **{"in.items.depth": 3, "loss": 0.5})
    finally:
        structlog.contextvars.clear_contextvars()
    log.info("sneaky", stage="other", version=99)  # reserved keys stay the process's own
    close_process_logging()

    events = read_events(path)
    assert [e["event"] for e in events] == [
        "replica_started",
        "weights_applied",
        "metrics",
        "sneaky",
    ]
    assert [e["version"] for e in events] == [3, 4, 4, 4]
    assert [e["level"] for e in events] == ["info", "warning", "info", "info"]
    for e in events:
        assert TS.fullmatch(e["ts"]), e["ts"]
        assert (e["stage"], e["replica"]) == ("square", 0)
        assert list(e)[:6] == ["ts", "level", "event", "stage", "replica", "version"]
    assert events[0]["port"] == 5555
    assert events[2]["in.items.depth"] == 3 and events[2]["task"] == "gen"
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)


def test_exceptions_become_an_exception_string(tmp_path):
    path = tmp_path / "learner.1.jsonl"
    log = configure_process_logging(path, stage="learner", replica=1)
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        log.exception("step_failed", step=7)
    log.warning("retrying", exc_info=ValueError("bad batch"))
    log.error("no_exception_active", exc_info=True)
    close_process_logging()

    failed, retrying, plain = read_events(path)
    assert failed["level"] == "error" and failed["step"] == 7
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert "ZeroDivisionError: division by zero" in failed["exception"]
    assert "ValueError: bad batch" in retrying["exception"]
    assert "exception" not in plain and "exc_info" not in plain


def test_stdlib_logging_lands_in_the_same_file(tmp_path):
    path = tmp_path / "generator.0.jsonl"
    root_handlers = list(logging.getLogger().handlers)
    version = [1]
    configure_process_logging(path, stage="generator", replica=0, version=lambda: version[0])
    logging.getLogger("transformers.modeling_utils").warning("tied %s", "weights")
    version[0] = 2
    logging.getLogger("deepspeed").debug("below the level")
    logging.getLogger("custom").log(5, "a TRACE record")  # below debug: filtered, not a crash
    try:
        raise RuntimeError("loop broke")
    except RuntimeError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    logging.getLogger("deepspeed").critical("out of memory")
    close_process_logging()
    assert logging.getLogger().handlers == root_handlers

    events = read_events(path)
    assert {e["event"] for e in events} == {"stdlib_log"}
    assert [(e["logger"], e["level"], e["version"]) for e in events] == [
        ("transformers.modeling_utils", "warning", 1),
        ("asyncio", "error", 2),
        ("deepspeed", "critical", 2),
    ]
    assert events[0]["message"] == "tied weights"
    assert "RuntimeError: loop broke" in events[1]["exception"]


def test_a_line_per_http_request_is_left_to_debug_logs(tmp_path):
    """httpx logs every request at INFO (each call of an openai agent): not in an info log,
    its warnings are; a debug log keeps them all."""
    for level, expected in (("info", ["refused"]), ("debug", ["POST /v1", "refused"])):
        path = tmp_path / f"{level}.jsonl"
        configure_process_logging(path, stage="generator", replica=0, level=level)
        logging.getLogger("httpx").info("POST /v1")
        logging.getLogger("httpx").warning("refused")
        close_process_logging()
        assert [e["message"] for e in read_events(path)] == expected


def test_cpu_kernel_fallbacks_are_information_without_cuda(tmp_path, monkeypatch):
    """transformers warns that a linear-attention model's CUDA kernels fall back to PyTorch:
    without CUDA nothing can be installed, so an info log keeps it at info, not warning."""
    import torch

    path = tmp_path / "engine.jsonl"
    configure_process_logging(path, stage="generator", replica=0, level="info")
    fallback = (
        "`causal_conv1d_fn` is falling back to its reference PyTorch implementation because "
        "`causal_conv1d` is either not installed or doesn't support the device of the inputs."
    )
    hub = logging.getLogger("transformers.integrations.hub_kernels")
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        hub.warning(fallback)
    hub.warning("something else")
    close_process_logging()
    assert [(e["level"], e["message"][:17]) for e in read_events(path)] == [
        ("info", "`causal_conv1d_fn"),
        ("warning", "`causal_conv1d_fn"),
        ("warning", "something else"),
    ]


def test_level_filtering_and_console_view(tmp_path, capsys):
    path = tmp_path / "scorer.0.jsonl"
    log = configure_process_logging(
        path, stage="scorer", replica=0, level="warning", console=True, console_level="debug"
    )
    log.debug("tiny_detail")
    log.info("scored", reward=0.25)
    log.warning("slow_reward", seconds=3.5)
    close_process_logging()

    assert [e["event"] for e in read_events(path)] == ["slow_reward"]
    console = capsys.readouterr().err.splitlines()
    assert [line.split()[1:5] for line in console] == [
        ["DEBUG", "scorer.0", "v0", "tiny_detail"],
        ["INFO", "scorer.0", "v0", "scored"],
        ["WARN", "scorer.0", "v0", "slow_reward"],
    ]
    assert console[1].endswith("reward=0.25")
    assert "\x1b" not in "".join(console)  # stderr is not a terminal here


def test_the_level_changes_while_the_process_runs(tmp_path):
    """What ``/configure_logging``'s ``log_level`` does to an engine's log."""
    path = tmp_path / "engine.0.jsonl"
    configure_process_logging(path, stage="engine", replica=0, level="info")
    log = structlog.get_logger("stages.engine.server")  # as a module holds it
    log.debug("hidden")
    logging.getLogger("lib").debug("hidden_too")
    set_process_level("debug")
    log.debug("shown")
    logging.getLogger("lib").debug("shown_too")
    set_process_level("ERROR")
    log.warning("quiet")
    with pytest.raises(ValueError, match="loud"):
        set_process_level("loud")
    log.error("loud_enough")
    close_process_logging()
    events = read_events(path)
    assert [e.get("message", e["event"]) for e in events] == ["shown", "shown_too", "loud_enough"]


def test_reconfiguring_switches_files_and_stale_loggers_are_dropped(tmp_path):
    first, second = tmp_path / "a.0.jsonl", tmp_path / "b.0.jsonl"
    old = configure_process_logging(first, stage="a", replica=0)
    old.info("one")
    new = configure_process_logging(second, stage="b", replica=0)
    new.info("two")
    structlog.get_logger().info("three")
    old.info("stale")  # its file is closed: dropped, never written to a reused descriptor
    close_process_logging()
    close_process_logging()  # idempotent

    assert [(e["stage"], e["event"]) for e in read_events(first)] == [("a", "one")]
    assert [(e["stage"], e["event"]) for e in read_events(second)] == [("b", "two"), ("b", "three")]


def test_odd_values_and_a_broken_version_callback_still_log(tmp_path):
    path = tmp_path / "x.0.jsonl"

    def broken_version() -> int:
        raise LookupError("no learner yet")

    log = configure_process_logging(path, stage="x", replica=0, version=broken_version)
    log.info("odd", where=tmp_path, obj=object())
    log.info("tuple_keys", table={(1, 2): "x"})
    close_process_logging()

    odd, tuple_keys = read_events(path)
    assert odd["where"] == str(tmp_path) and odd["obj"].startswith("<object object")
    assert odd["version"] is None and "no learner yet" in odd["version_error"]
    assert tuple_keys["event"] == "tuple_keys" and "log_error" in tuple_keys


def test_unknown_level_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="verbose"):
        configure_process_logging(tmp_path / "x.0.jsonl", stage="x", replica=0, level="verbose")


@pytest.mark.timeout(30)
def test_threads_never_interleave_lines(tmp_path):
    path = tmp_path / "x.0.jsonl"
    log = configure_process_logging(path, stage="x", replica=0)
    payload = "y" * 20_000  # larger than any stdio buffer

    def spam(n: int) -> None:
        for i in range(100):
            log.info("chunk", thread=n, i=i, payload=payload)

    threads = [threading.Thread(target=spam, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    close_process_logging()

    events = read_events(path)  # every line parses
    assert len(events) == 400 and all(e["payload"] == payload for e in events)


@pytest.mark.timeout(60)
def test_a_process_logs_without_closing(tmp_path):
    # A replica may die without close_process_logging: every event must already be on disk.
    script = textwrap.dedent(
        """
        import logging, os, sys, warnings
        from pathlib import Path
        from pipeline.structured_log import configure_process_logging

        log = configure_process_logging(Path(sys.argv[1]), stage="learner", replica=1)
        log.info("replica_started", pid=os.getpid())
        logging.getLogger("deepspeed").warning("zero stage %d", 3)
        warnings.warn("old api", UserWarning)
        os._exit(3)
        """
    )
    path = tmp_path / "logs" / "learner.1.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], cwd=REPO, capture_output=True, timeout=50
    )
    assert done.returncode == 3, done.stderr
    events = read_events(path)
    assert [e["event"] for e in events] == ["replica_started", "stdlib_log", "stdlib_log"]
    assert events[1]["message"] == "zero stage 3"
    assert events[2]["logger"] == "py.warnings" and "UserWarning: old api" in events[2]["message"]
    assert all((e["stage"], e["replica"]) == ("learner", 1) for e in events)
