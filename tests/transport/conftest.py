"""Fixtures for transport tests: a ZeroMQ context that must terminate, short ipc paths, a
capturing logger, and a bounded polling helper."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import structlog.testing
import zmq
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    # Every test must close what it opened: term() blocks while a socket is open, so run it in
    # a thread and fail loudly instead of hanging (the way pyzmq's own tests do).
    done = threading.Thread(target=context.term, daemon=True)
    done.start()
    done.join(timeout=5)
    if done.is_alive():
        context.destroy(linger=0)
        pytest.fail("ZeroMQ context did not terminate: a socket was left open")


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    # Not tmp_path: pytest's paths can exceed the 107-byte limit of Unix socket paths.
    path = Path(tempfile.mkdtemp(prefix="inflight-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def log() -> structlog.testing.CapturingLogger:
    return structlog.testing.CapturingLogger()


def events(log: structlog.testing.CapturingLogger, name: str) -> list[dict]:
    """Key-values of every captured event called ``name``."""
    return [call.kwargs for call in log.calls if call.args and call.args[0] == name]


async def eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)
