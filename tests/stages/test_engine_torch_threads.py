"""Where an engine runs torch's start-up work (``stages.engine.torch_threads``): on a thread
that ends with it, so that the scheduler's thread is the only one that keeps an OpenMP team
(another live thread's idle team throttles every barrier of the scheduler's passes)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stages.engine.torch_threads import in_passing_thread
from tests.stages.tiny_model import make_tiny_model


def test_a_passing_thread_hands_back_the_value_or_the_error_and_ends() -> None:
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x * 2

    assert in_passing_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails() -> None:
        raise ValueError("what the caller sees")

    with pytest.raises(ValueError, match="what the caller sees"):
        in_passing_thread(fails)


# run as ``inflight engine`` runs it, in a process of its own (its start changes process state)
_START = """
import sys, threading
from stages.engine import server
seen = []
def load(args):
    seen.append(threading.current_thread())
    raise OSError("a checkpoint that does not read")
server.load_served = load
code = server.main(["--model-path", sys.argv[1], "--port", "0"])
print(code, seen[0] is not threading.main_thread(), seen[0].is_alive())
"""


@pytest.mark.timeout(120)
def test_the_engine_loads_its_model_off_the_main_thread(tmp_path: Path) -> None:
    """``inflight engine``'s start: the model is loaded on a thread that is gone by the time the
    engine would serve (here the load fails, as an unreadable checkpoint does: exit code 2)."""
    model = make_tiny_model(tmp_path / "model", vocab=64)
    done = subprocess.run(
        [sys.executable, "-c", _START, str(model)],
        capture_output=True, text=True, timeout=100, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.stdout.split()[-3:] == ["2", "True", "False"], done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_the_in_process_engine_without_a_loader_loads_on_a_thread_that_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``InProcessEngine`` given no loader: not asyncio's default executor, whose threads
    live on with the team torch's load made there, but a thread that ends with the load."""
    import asyncio

    import structlog

    from stages.engine import server
    from stages.engine.in_process import InProcessEngine

    seen: list[threading.Thread] = []

    def load(args: object) -> None:
        seen.append(threading.current_thread())
        raise OSError("a checkpoint that does not read")

    monkeypatch.setattr(server, "load_served", load)
    model = make_tiny_model(tmp_path / "model", vocab=64)
    engine = InProcessEngine(
        ["--model-path", str(model), "--port", "0"], log=structlog.get_logger()
    )

    async def start() -> bool:  # whether the thread that loaded is still there, meanwhile
        with pytest.raises(OSError, match="does not read"):
            await engine.start()
        return seen[0].is_alive()

    assert asyncio.run(start()) is False
    assert seen[0] is not threading.main_thread()
