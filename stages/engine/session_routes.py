"""``/open_session`` and ``/close_session`` (SGLang 0.5.23's ``http_server.py``: GET or POST,
``OpenSessionReqInput`` and ``CloseSessionReqInput``): the session's id as a JSON string, or
SGLang's ``{"error": {"message"}}`` 400; a closed session's empty 200. The sessions themselves
are ``stages.engine.sessions``'."""

from __future__ import annotations

from aiohttp import web

from stages.engine import control_fields
from stages.engine.request_body import bad_request, json_response
from stages.engine.sessions import SessionError, Sessions

__all__ = ["SessionRoutes"]


class SessionRoutes:
    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/open_session", self.open_session)
            app.router.add_route(method, "/close_session", self.close_session)

    async def open_session(self, request: web.Request) -> web.Response:
        body = await control_fields.typed_body(request, control_fields.OPEN_SESSION)
        if isinstance(body, web.Response):
            return body
        try:
            return json_response(self.sessions.open(body))
        except SessionError as exc:
            return bad_request(str(exc))

    async def close_session(self, request: web.Request) -> web.Response:
        body = await control_fields.typed_body(request, control_fields.CLOSE_SESSION)
        if isinstance(body, web.Response):
            return body
        self.sessions.close(body["session_id"])
        return web.Response(status=200)
