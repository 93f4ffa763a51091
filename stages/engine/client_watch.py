"""Requests not streamed whose client went away: aborted, as SGLang aborts them.

SGLang's ``TokenizerManager._wait_one_response`` aborts a request that is not streamed once its
client has disconnected (unless the request says ``background: true``), looking every 4 s of
waiting and at each of its outputs. aiohttp does not cancel a handler whose client went away,
so without a look of its own such a request would run to its end for nobody, holding its slot.

``ClientWatch`` is one per server: a route hands it the HTTP request and what to do once the
client is gone (``watch``), and takes it back when the answer is ready (``unwatch``). One timer
for all of them looks at their connections every ``period`` seconds while any is watched, so a
request costs a dictionary entry, not a timer of its own (which would cost the event loop several
microseconds a request). A streamed request needs none of this: its first write to a closed
connection ends it (``streaming.write_events``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["DISCONNECT_POLL_S", "ClientWatch"]

DISCONNECT_POLL_S = 1.0  # how often the connections of watched requests are looked at


class ClientWatch:
    def __init__(self, period: float = DISCONNECT_POLL_S) -> None:
        self.period = period
        self._watched: dict[int, tuple[Any, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.gone = 0  # requests whose client went away before their answer

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, request: Any, on_gone: Callable[[], None]) -> int:
        """Call ``on_gone()`` once ``request``'s connection is closed (within ``period``
        seconds), unless ``unwatch`` comes first; returns the key ``unwatch`` takes."""
        key = next(self._keys)
        self._watched[key] = (request, on_gone)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.period, self._look)
        return key

    def unwatch(self, key: int) -> None:
        self._watched.pop(key, None)

    def _look(self) -> None:
        self._timer = None
        for key, (request, on_gone) in list(self._watched.items()):
            transport = request.transport
            if transport is None or transport.is_closing():
                del self._watched[key]
                self.gone += 1
                on_gone()
        if self._watched:
            self._timer = asyncio.get_running_loop().call_later(self.period, self._look)
