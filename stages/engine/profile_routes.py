"""SGLang's profiling routes on the built-in engine: ``GET|POST /start_profile`` (an optional
``ProfileReq`` body: ``output_dir``, ``num_steps``, ``start_step``, ``activities``,
``with_stack``, ``record_shapes``, ``profile_id``, ``profile_prefix``) and ``GET|POST
/stop_profile``, answered with SGLang's texts (``Start profiling.``, ``Stop profiling. This
will take some time.``). The profile itself is ``stages.engine.step_profiler``'s.

Where SGLang lets the scheduler's refusal out as a 500 (a second start, a stop with none
running: its ``RuntimeError``), this engine answers 400 with the same message; a field it
cannot honour (``profile_by_stage``, ``profile_stages``, ``detailed_annotations``, ``RPD``,
``MEM`` or ``CUDA_PROFILER`` off CUDA) is a 400 naming it.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from stages.engine.control_fields import PROFILE, typed_body
from stages.engine.protocol import RequestError
from stages.engine.request_body import bad_request
from stages.engine.scheduler import Scheduler
from stages.engine.step_profiler import ProfileError, profile_request

__all__ = ["ProfileRoutes"]


class ProfileRoutes:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/start_profile", self.start)
            app.router.add_route(method, "/stop_profile", self.stop)

    async def start(self, request: web.Request) -> web.Response:
        body = await typed_body(request, PROFILE, optional=True)
        if isinstance(body, web.Response):
            return body
        try:
            wanted = profile_request(body)
            await asyncio.wrap_future(self.scheduler.start_profile(wanted))
        except (RequestError, ProfileError) as exc:
            return bad_request(str(exc))
        return web.Response(text="Start profiling.\n")

    async def stop(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wrap_future(self.scheduler.stop_profile())
        except ProfileError as exc:
            return bad_request(str(exc))
        return web.Response(text="Stop profiling. This will take some time.\n")
