"""``stages.engine.client_watch``: one timer for every watched request, running only while
some request is watched; a request whose connection closed is handed to its ``on_gone`` once,
one taken back first never is. The server's use (a real disconnect) is
``test_engine_server.py::test_a_request_whose_client_went_away_is_aborted_unless_background``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from stages.engine.client_watch import ClientWatch


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


@pytest.mark.timeout(10)
def test_a_closed_connection_is_handed_over_once_and_the_timer_stops() -> None:
    async def run() -> None:
        watch = ClientWatch(period=0.01)
        open_, closing, gone_ = _Transport(), _Transport(), SimpleNamespace(transport=None)
        seen: list[str] = []
        a = watch.watch(SimpleNamespace(transport=open_), lambda: seen.append("open"))
        watch.watch(SimpleNamespace(transport=closing), lambda: seen.append("closing"))
        watch.watch(gone_, lambda: seen.append("gone"))
        taken = watch.watch(SimpleNamespace(transport=None), lambda: seen.append("taken back"))
        watch.unwatch(taken)
        await asyncio.sleep(0.05)
        assert seen == ["gone"] and len(watch) == 2
        closing.closing = True
        await asyncio.sleep(0.05)
        assert seen == ["gone", "closing"] and watch.gone == 2
        watch.unwatch(a)
        await asyncio.sleep(0.03)
        assert watch._timer is None and len(watch) == 0  # nothing watched: no timer
        open_.closing = True
        await asyncio.sleep(0.03)
        assert seen == ["gone", "closing"]  # taken back before it closed: never handed over

    asyncio.run(run())
