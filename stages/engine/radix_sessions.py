"""Which requests may hold KV for a session (SGLang 0.5.23's ``--enable-session-radix-cache``,
``UnifiedSessionRefTracker``): a session's generations and the sessions closed lately.

A request that names a session (``session_id``, or a non-streaming ``session_params`` session's
id) is given the session's current generation when the scheduler takes it, opening the session
if need be (``ensure``: a session opens on its first request, no ``/open_session`` needed). When
it finishes (not aborted), its sequence's KV is held for the session only if the session still
has that generation (``current``): a request that was running when its session was closed, and
finishes after, holds nothing, even if the session was opened again meanwhile. ``close``
remembers the session as closed (the last 8192 closes, as SGLang's tombstones) so that a
second close does nothing. The tree's side (what is held, how eviction spares it) is
``prefix_cache.PrefixCache``'s; the scheduler's thread calls both.
"""

from __future__ import annotations

import collections

__all__ = ["RadixSessions"]

CLOSED_REMEMBERED = 8192  # SGLang's _CLOSED_SESSION_TOMBSTONE_LIMIT


class RadixSessions:
    def __init__(self) -> None:
        self._generations: dict[str, int] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._counter = 0

    def __len__(self) -> int:
        return len(self._generations)

    def open(self, session: str) -> int:
        """A new generation of ``session`` (``/open_session``, or its first request)."""
        self._closed.pop(session, None)
        self._counter += 1
        self._generations[session] = self._counter
        return self._counter

    def ensure(self, session: str) -> int:
        """``session``'s generation, opened if it has none."""
        generation = self._generations.get(session)
        return self.open(session) if generation is None else generation

    def current(self, session: str) -> int | None:
        """``session``'s generation now (None: closed, or never opened)."""
        return self._generations.get(session)

    def close(self, session: str) -> bool:
        """Close ``session``; False where it was closed already (nothing to release)."""
        if session in self._closed:
            return False
        self._closed[session] = None
        self._closed.move_to_end(session)
        while len(self._closed) > CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        self._generations.pop(session, None)
        return True
