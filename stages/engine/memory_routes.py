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

from stages.engine.memory_offload import MemoryStateError
from stages.engine.protocol import RequestError
from stages.engine.request_body import bad_request, base_request, json_body, json_response

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
        try:
            tags = _tags(base_request(await json_body(request, allow_empty=True)))
            await asyncio.wrap_future(change(tags))
        except (RequestError, MemoryStateError) as exc:
            return bad_request(str(exc))
        return json_response(None)


def _tags(body: dict[str, Any]) -> list[str] | None:
    tags = body.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RequestError("tags", f"expected a list of strings or null, got {tags!r}")
    return tags
