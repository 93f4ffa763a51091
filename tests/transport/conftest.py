"""Fixtures for transport tests: a ZeroMQ context that must terminate, short ipc paths, a
capturing logger, a bounded polling helper, tests over both wires (ZeroMQ and in-process), and
a hand-made producer."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
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


def over_both_wires(module: str) -> Any:
    """An autouse fixture ``wire`` ("zmq" or "in_process") for the test module ``module``: with
    "in_process", the module's ``sender`` makes producers whose consumers are in this process."""

    @pytest.fixture(autouse=True, params=["zmq", "in_process"])
    def wire(request: Any, monkeypatch: Any) -> str:
        if request.param == "in_process":
            from tests.transport import test_channel

            def local_sender(ctx: Any, peers: list[str], **kw: Any) -> Any:
                return test_channel.sender(ctx, peers, local=[True] * len(peers), **kw)

            monkeypatch.setattr(f"{module}.sender", local_sender)
        return request.param

    return wire


RAW_HELLO = {"identity": "raw.0", "session": "s1", "to": None, "epoch": 0, "sent": 0}


def raw_producer(ctx: zmq.asyncio.Context, addr: str) -> zmq.asyncio.Socket:
    """A hand-made producer (routing id ``raw.0/s1``), to send what a Sender never would."""
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.routing_id = b"raw.0/s1"
    raw.connect(addr)
    return raw


async def raw_hello(raw: zmq.asyncio.Socket) -> tuple[bytes, dict]:
    """``raw``'s HELLO (``RAW_HELLO``); the receiver's answer: its tag and body."""
    await raw.send_multipart([b"H", msgpack.packb(RAW_HELLO)])
    tag, body = await asyncio.wait_for(raw.recv_multipart(), 3)
    return tag, msgpack.unpackb(body)
