"""``GET|POST /release_memory_occupation`` and ``/resume_memory_occupation``, as SGLang 0.5.23
serves them (``http_server.py``): a body ``{"tags": [...] | null}`` (``io_struct
.ReleaseMemoryOccupationReqInput``), answered 200 with ``null`` once done, or 400 with
``{"error": {"message": ...}}`` (its ``_create_error_response``): a release while requests run
or wait unpaused, a resume of a tag not released. What each tag gives back and what waits
meanwhile: ``stages.engine.memory_offload``."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from stages.engine.control_fields import MEMORY, typed_body
from stages.engine.memory_offload import MemoryStateError
from stages.engine.request_body import bad_request, json_response

__all__ = ["MemoryRoutes"]


class MemoryRoutes:
    """The two routes, on ``scheduler``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/release_memory_occupation", self.release)
            app.router.add_route(method, "/resume_memory_occupation", self.resume)

    async def release(self, request: web.Request) -> web.Response:
        return await self._change(request, self.scheduler.release_memory)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._change(request, self.scheduler.resume_memory)

    async def _change(self, request: web.Request, change: Any) -> web.Response:
        body = await typed_body(request, MEMORY)
        if isinstance(body, web.Response):
            return body
        try:
            await asyncio.wrap_future(change(body.get("tags")))
        except MemoryStateError as exc:
            return bad_request(str(exc))
        return json_response(None)
