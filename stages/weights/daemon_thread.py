"""Blocking weight-group work (joins, broadcasts, packing) in daemon threads, awaited by asyncio.

A join or collective can block for its whole timeout on a peer that died (a TCP store's
client retries a dead host for minutes). A daemon thread never holds up its process's exit
then, and one left waiting never holds up the next piece of work, as a pool's one worker would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["in_daemon_thread"]

T = TypeVar("T")


def in_daemon_thread(
    fn: Callable[[], T], *, name: str, discard: Callable[[T], Any] | None = None
) -> asyncio.Future[T]:
    """Run blocking ``fn`` in a daemon thread named ``name``; its outcome lands in the returned
    future. ``discard`` gets a result that nobody awaits any more (the future was cancelled, or
    its loop closed), to release what it holds."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    # CUDA's current device is per thread: NCCL and gathers must run on the caller's device.
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            if exc is None and discard is not None:
                discard(result)
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        result, exc = None, None
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result = fn()
        except BaseException as e:  # handed to the awaiting coroutine, never dropped
            exc = e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            # The loop is closed: nobody awaits this any more.
            if exc is None and discard is not None:
                discard(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
