"""SGLang's maintenance routes on the built-in engine: ``GET|POST /freeze_gc`` and
``GET|POST /slow_down``, as SGLang 0.5.23 answers them (``http_server.py``).

- ``/freeze_gc``: what the heap holds now is collected once and frozen (``pipeline.heap``:
  later collections skip it), as SGLang's ``freeze_gc`` freezes its tokenizer manager's and
  scheduler's heaps after start-up (an RL trainer calls it once its engines are warm); answers
  ``Garbage collection frozen.``. Unlike SGLang's, it first collects what became garbage
  among objects frozen before, so that calling it again frees it.
- ``/slow_down``: ``{forward_sleep_time: seconds or null}`` (required, as SGLang's
  ``SlowDownReqInput``): the scheduler sleeps that long before each step that has work, until a
  null or non-positive value ends it (SGLang's ``Scheduler.slow_down``: for tests that need
  requests to stay in flight); answers ``null``.
"""

from __future__ import annotations

import asyncio
import math

from aiohttp import web

from pipeline import heap
from stages.engine.control_fields import SLOW_DOWN, typed_body
from stages.engine.protocol import RequestError
from stages.engine.request_body import bad_request
from stages.engine.scheduler import Scheduler

__all__ = ["MaintenanceRoutes"]


class MaintenanceRoutes:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/freeze_gc", self.freeze_gc)
            app.router.add_route(method, "/slow_down", self.slow_down)

    async def freeze_gc(self, request: web.Request) -> web.Response:
        heap.resettle()
        return web.Response(text="Garbage collection frozen.\n")

    async def slow_down(self, request: web.Request) -> web.Response:
        body = await typed_body(request, SLOW_DOWN)
        if isinstance(body, web.Response):
            return body
        try:
            if "forward_sleep_time" not in body:
                raise RequestError("forward_sleep_time", "required (seconds, or null)")
            value = body["forward_sleep_time"]
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise RequestError("forward_sleep_time", f"expected seconds, got {value!r}")
        except RequestError as exc:
            return bad_request(str(exc))
        seconds = None if value is None or value <= 0 else float(value)
        await asyncio.wrap_future(self.scheduler.slow_down(seconds))
        return web.json_response(None)
