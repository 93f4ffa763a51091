"""The closes of finished episodes' sessions (``rollout.hold_kv``), sent many to a request.

An episode whose engines held its KV as a session's must close that session on each of them
when it ends, or the KV stays held until the engine needs the room. One ``/close_session``
an episode cost more than the holding saved (about 270 us of the engine's and the generator's
CPU each, some 19,000 a run of ``configs/calculator.yaml``). ``SessionCloser`` gathers the
closes per engine and sends them together (``EngineClient.close_sessions``: one
``/close_sessions`` to a built-in engine, one ``/close_session`` each to SGLang): as soon as
``batch`` are waiting for an engine, else ``delay_s`` after the first (its KV is held that much
longer, no more). A close that fails is counted (``session_close_failures``); the engine
gone, what it held went with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["SessionCloser"]


class SessionCloser:
    """``close(engine, session)`` queues a close; ``flush()`` sends what waits (at the end)."""

    def __init__(
        self,
        client_of: Callable[[str], Any],
        *,
        batch: int = 64,
        delay_s: float = 0.05,
        counts: dict[str, int] | None = None,
    ) -> None:
        self.client_of = client_of  # engine -> its EngineClient (None: gone from the run)
        self.batch, self.delay_s = batch, delay_s
        # the requests sent (a batch each) and the closes that failed, also added to ``counts``
        # (the generator's metrics) as session_close_requests and session_close_failures
        self.counts = counts if counts is not None else {}
        self.failures = 0
        self.requests = 0
        self._waiting: dict[str, list[str]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._sending: set[asyncio.Task[None]] = set()

    def close(self, engine: str, session: str) -> None:
        """Queue the close of ``session`` on ``engine``."""
        waiting = self._waiting.setdefault(engine, [])
        waiting.append(session)
        if len(waiting) >= self.batch:
            self._send(engine)
        elif engine not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[engine] = loop.call_later(self.delay_s, self._send, engine)

    async def flush(self) -> None:
        """Send every waiting close and wait for all sent."""
        for engine in list(self._waiting):
            self._send(engine)
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def _send(self, engine: str) -> None:
        timer = self._timers.pop(engine, None)
        if timer is not None:
            timer.cancel()
        sessions = self._waiting.pop(engine, None)
        if not sessions:
            return
        task = asyncio.get_running_loop().create_task(self._closed(engine, sessions))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _closed(self, engine: str, sessions: list[str]) -> None:
        client = self.client_of(engine)
        if client is None:  # the engine left the run: what it held went with it
            return
        self.requests += 1
        self._count("session_close_requests", 1)
        failed = await client.close_sessions(sessions)
        if failed:
            self.failures += failed
            self._count("session_close_failures", failed)

    def _count(self, key: str, n: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def cancel(self) -> None:
        """Drop what waits (closing: the engines are going too)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._waiting.clear()
        for task in self._sending:
            task.cancel()
