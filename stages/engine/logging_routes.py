"""SGLang's logging routes on the built-in engine: ``GET|POST /configure_logging`` and
``GET|POST /set_trace_level``, as SGLang 0.5.23 answers them (``http_server.py``).

- ``/configure_logging``: a ``ConfigureLoggingReq`` body (every field optional, the body not:
  ``{}`` changes nothing) applied to the engine's request log (``stages.engine.request_log``:
  request logging, its level and format, request and crash dumps) and, with ``log_level``, to
  the level of the process's log; answers 200 with no body. A ``log_requests_level`` other
  than 0-3 or an unknown ``log_level`` is SGLang's 500 (``Internal Server Error``), with
  nothing changed.
- ``/set_trace_level?level=N``: SGLang's OpenTelemetry trace level (``N`` >= 0, a query
  parameter). The built-in engine has no tracing (as SGLang without ``--enable-trace``, where
  the level changes nothing either): the level is checked and kept, and ``success`` answered.
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import Field, TypeAdapter, ValidationError

from stages.engine.control_fields import CONFIGURE_LOGGING, typed_body
from stages.engine.request_body import invalid
from stages.engine.request_log import RequestLog

__all__ = ["LoggingRoutes"]

_TRACE_LEVEL: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(ge=0)])


class LoggingRoutes:
    def __init__(self, requests: RequestLog) -> None:
        self.requests = requests
        self.trace_level = 0

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/configure_logging", self.configure_logging)
            app.router.add_route(method, "/set_trace_level", self.set_trace_level)

    async def configure_logging(self, request: web.Request) -> web.Response:
        body = await typed_body(request, CONFIGURE_LOGGING)
        if isinstance(body, web.Response):
            return body
        try:
            self.requests.configure(body)
        except ValueError:  # SGLang lets it propagate: FastAPI's plain 500
            return web.Response(status=500, text="Internal Server Error")
        return web.Response(status=200)

    async def set_trace_level(self, request: web.Request) -> web.Response:
        raw = request.query.get("level")
        if raw is None:
            return invalid("query.level: Field required")
        try:
            self.trace_level = _TRACE_LEVEL.validate_python(raw)
        except ValidationError as exc:
            return invalid("; ".join(f"query.level: {e['msg']}" for e in exc.errors()))
        return web.Response(text="success")
