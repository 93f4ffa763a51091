"""``rollout.hold_kv``'s session closes, many to a request (``stages.generator.session_closer``):
against a real built-in engine (``/close_sessions``, the sessions' KV let go), and against a
server that has only SGLang 0.5.23's one-id ``/close_session`` (``http_server.close_session``,
``CloseSessionReqInput``), where the client falls back to one close each and remembers it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from stages.generator.client import EngineClient
from stages.generator.session_closer import SessionCloser
from tests.stages.engine_setup import builtin_engine, free_port, recorded_calls
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_model(tmp_path_factory.mktemp("closer") / "model", vocab=128, seed=1)
    with builtin_engine(model, "--enable-session-radix-cache", "--max-running", "8") as url:
        yield url


async def _held(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/server_info") as resp:
        return (await resp.json())["prefix_cache"]["sessions"]


async def test_closes_go_many_to_a_request_and_let_the_kv_go(engine_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        client = EngineClient(engine_url, http)
        ids = [f"ep{i}" for i in range(7)]
        params = {"max_new_tokens": 2, "temperature": 0}
        for i, session in enumerate(ids):
            await client.generate([3, 4, 5, 6 + i], params, rid=f"{session}/0", session=session)
        assert await _held(http, engine_url) == 7
        sent = recorded_calls(client)
        closer = SessionCloser({engine_url: client}.get, batch=3, delay_s=0.2)
        for session in ids:
            closer.close(engine_url, session)
        await asyncio.sleep(0.05)  # two full batches went at once; the 7th waits
        assert sent == [
            ("/close_sessions", {"session_ids": ids[:3]}),
            ("/close_sessions", {"session_ids": ids[3:6]}),
        ]
        await asyncio.sleep(0.3)  # its delay passed
        assert sent[2:] == [("/close_sessions", {"session_ids": ids[6:]})]
        await closer.flush()
        assert closer.requests == 3 and closer.failures == 0
        assert await _held(http, engine_url) == 0
        # a body that is not a list of ids: the native routes' validation answer
        async with http.post(engine_url + "/close_sessions", json={"session_ids": "ep0"}) as r:
            assert r.status == 400
            assert (await r.json())["message"].startswith("session_ids: Input should be")


async def test_an_engine_without_the_route_gets_one_close_each() -> None:
    """SGLang's contract: ``/close_session`` with one id; no ``/close_sessions`` (404)."""
    closed: list[str] = []

    async def close_session(request: web.Request) -> web.Response:
        closed.append((await request.json())["session_id"])
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/close_session", close_session)
    async with _serving(app) as url, aiohttp.ClientSession() as http:
        client = EngineClient(url, http)
        sent = recorded_calls(client)
        counts: dict[str, int] = {}
        closer = SessionCloser({url: client}.get, batch=2, counts=counts)
        for session in ("a", "b", "c", "d"):
            closer.close(url, session)
        await closer.flush()
        assert sorted(closed) == ["a", "b", "c", "d"]
        assert counts == {"session_close_requests": 2}
        # the batch route asked (by each batch already on its way), its 404 then remembered
        assert [path for path, _ in sent].count("/close_session") == 4
        del sent[:]
        closer.close(url, "e")
        await closer.flush()
        assert closed[-1] == "e" and sent == [("/close_session", {"session_id": "e"})]
    # an engine gone: every close of its batch counted as failed
    gone = EngineClient(f"http://127.0.0.1:{free_port()}", aiohttp.ClientSession())
    try:
        closer = SessionCloser({"x": gone}.get, counts=counts)
        closer.close("x", "e")
        closer.close("x", "f")
        closer.close("left", "g")  # an engine no longer in the run: nothing to send
        await closer.flush()
        assert closer.failures == 2 and closer.requests == 1
        assert counts == {"session_close_requests": 4, "session_close_failures": 2}
    finally:
        await gone.session.close()


class _serving:
    """``app`` on a free local port, as an async context manager yielding its URL."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: Any) -> None:
        await self.runner.cleanup()
