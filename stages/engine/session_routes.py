"""``/open_session`` and ``/close_session`` (SGLang 0.5.23's ``http_server.py``: GET or POST,
``OpenSessionReqInput`` and ``CloseSessionReqInput``): the session's id as a JSON string, or
SGLang's ``{"error": {"message"}}`` 400; a closed session's empty 200. The sessions themselves
are ``stages.engine.sessions``'.

With the server's ``--enable-session-radix-cache`` (SGLang's ``Scheduler.open_session`` and
``close_session``): opening a session also starts a new generation of its KV holding, and
closing any session id (one ``/open_session`` made or one only requests named, by
``session_id``) lets go of the KV it held (``radix_sessions``); only a session ``/open_session``
made is then closed as such, so an id that only requests named is not logged as unknown.

``POST /close_sessions`` (Inflight's; SGLang has no such route: 404 there) closes many at once,
``{"session_ids": [...]}``, each as ``/close_session`` closes it, the KV of all let go at one
step boundary: a generator closing each finished episode's session sends one request for many
episodes (``stages.generator.session_closer``), where one request each cost more than the
holding saved. Answers ``{"closed": N}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from stages.engine import control_fields
from stages.engine.request_body import bad_request, json_response
from stages.engine.sessions import SessionError, Sessions

__all__ = ["SessionRoutes"]


class SessionRoutes:
    def __init__(self, sessions: Sessions, scheduler: Any = None) -> None:
        self.sessions = sessions
        # the scheduler whose prefix cache holds sessions' KV (None: the flag is off)
        self.holding = (
            scheduler if getattr(scheduler, "session_radix_cache", False) is True else None
        )

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/open_session", self.open_session)
            app.router.add_route(method, "/close_session", self.close_session)
        app.router.add_post("/close_sessions", self.close_sessions)

    async def open_session(self, request: web.Request) -> web.Response:
        body = await control_fields.typed_body(request, control_fields.OPEN_SESSION)
        if isinstance(body, web.Response):
            return body
        try:
            session_id = self.sessions.open(body)
        except SessionError as exc:
            return bad_request(str(exc))
        if self.holding is not None:
            await asyncio.wrap_future(self.holding.open_radix_session(session_id))
        return json_response(session_id)

    async def close_session(self, request: web.Request) -> web.Response:
        body = await control_fields.typed_body(request, control_fields.CLOSE_SESSION)
        if isinstance(body, web.Response):
            return body
        await self._close([body["session_id"]])
        return web.Response(status=200)

    async def close_sessions(self, request: web.Request) -> web.Response:
        body = await control_fields.typed_body(request, control_fields.CLOSE_SESSIONS)
        if isinstance(body, web.Response):
            return body
        await self._close(body["session_ids"])
        return json_response({"closed": len(body["session_ids"])})

    async def _close(self, ids: list[str]) -> None:
        if self.holding is not None:
            await asyncio.wrap_future(self.holding.release_radix_sessions(ids))
        for session_id in ids:
            if self.holding is None or session_id in self.sessions:
                self.sessions.close(session_id)
