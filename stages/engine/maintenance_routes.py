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
- ``POST|PUT /set_internal_state``: ``{server_args: {name: number}}`` (SGLang's
  ``SetInternalStateReq``), answered as SGLang's scheduler answers it
  (``SchedulerInternalStateController.set_internal_state``): ``[true]`` when every name is one
  it takes here, and then they show in ``/server_info``'s ``internal_states``; else
  ``[false]``, nothing changed. It takes ``pp_max_micro_batch_size`` in 1..max running
  requests and ``speculative_accept_threshold_single`` / ``_acc`` (a scheduler without
  pipeline stages or speculative decoding, as this one, accepts them and runs as before); the
  DSpark knobs need a draft worker, which this engine lacks, and other names are not
  updatable.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import Future

from aiohttp import web

from pipeline import heap
from stages.engine.control_fields import SET_INTERNAL_STATE, SLOW_DOWN, typed_body
from stages.engine.protocol import RequestError
from stages.engine.request_body import bad_request
from stages.engine.scheduler import Scheduler

__all__ = ["MaintenanceRoutes"]


# the names SGLang's scheduler updates without a pipeline-parallel, speculative or DSpark setup
_ANY_VALUE = frozenset(("speculative_accept_threshold_single", "speculative_accept_threshold_acc"))


class MaintenanceRoutes:
    """The routes of an engine that runs at most ``max_running`` requests at once;
    ``slow_down``: its scheduler's (``Scheduler.slow_down``; None: no ``/slow_down``, a
    pooling engine's); ``overrides``: what ``/set_internal_state`` set (shared with
    ``/server_info``)."""

    def __init__(
        self,
        max_running: int,
        slow_down: Callable[[float | None], Future[None]] | None = None,
        overrides: dict[str, float] | None = None,
    ) -> None:
        self.max_running = max_running
        self._slow_down = slow_down
        self.overrides = {} if overrides is None else overrides

    @classmethod
    def of(cls, scheduler: Scheduler, overrides: dict[str, float]) -> MaintenanceRoutes:
        """A generating engine's."""
        return cls(scheduler.max_running, scheduler.slow_down, overrides)

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/freeze_gc", self.freeze_gc)
            if self._slow_down is not None:
                app.router.add_route(method, "/slow_down", self.slow_down)
        for method in ("POST", "PUT"):
            app.router.add_route(method, "/set_internal_state", self.set_internal_state)

    async def set_internal_state(self, request: web.Request) -> web.Response:
        body = await typed_body(request, SET_INTERNAL_STATE)
        if isinstance(body, web.Response):
            return body
        wanted = body["server_args"]
        updated = all(self._takes(key, value) for key, value in wanted.items())
        if updated:
            self.overrides.update(wanted)
        return web.json_response([updated])  # one per data-parallel rank, as SGLang's

    def _takes(self, key: str, value: float) -> bool:
        if key == "pp_max_micro_batch_size":  # pipeline stages: 1 here
            return 1 <= value <= self.max_running
        return key in _ANY_VALUE

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
        assert self._slow_down is not None
        await asyncio.wrap_future(self._slow_down(seconds))
        return web.json_response(None)
