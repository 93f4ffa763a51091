"""The built-in engine inside the process that uses it: no HTTP between generator and engine.

``InProcessEngine`` is ``inflight engine`` run by its caller instead of as a process of its own:
the same options (its command line, so ``launch.extra_args`` mean the same), the same model
loading, the same scheduler on a thread of its own, and the same HTTP application served on the
caller's event loop at ``host:port``, because the weight publisher and any outside client still
reach it over SGLang's API. What changes is the caller's own ``/generate``: ``results(body)``
hands the request body to the scheduler directly (``stages.engine.server.generate_results``: the
same validation as the route) and returns the scheduler's results as they are, with no JSON,
socket or HTTP parsing, and no rendering of SGLang's response layout, on either side;
``submit_groups(body, sizes)`` does the same for several groups in one body, with a future per
group. The generator's launcher starts one with ``launch.in_process: true``.

Trade-offs: the engine shares the caller's process (its interpreter lock, its cores, its fate: a
crashed generator takes its engine with it, and the supervisor restarts both); the model runs on
the scheduler thread, so the caller's event loop still answers while a decode step runs.

Not here: deciding when to run in process (``stages.generator.launcher``), the routes
(``stages.engine.server``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import torch
from aiohttp import web

from stages.engine import server
from stages.engine.loader import LoadedModel, load_model
from stages.engine.protocol import SequenceResult
from stages.engine.scheduler import Scheduler

__all__ = ["InProcessEngine"]


class InProcessEngine:
    """``inflight engine ARGV`` on this process's event loop (``start`` / ``close``)."""

    def __init__(
        self,
        argv: list[str],
        *,
        log: Any,
        api_key: str | None = None,
        loader: Executor | None = None,
    ) -> None:
        """``loader``: where ``start`` loads the model (default: asyncio's default executor)."""
        try:
            self.args = server.parse_args(argv)
        except SystemExit as exc:  # argparse printed why; say it where it happened
            raise ValueError(f"in-process engine options {argv!r} are not valid") from exc
        self.api_key = api_key or self.args.api_key or None
        self.log = log
        self._loader = loader
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self._runner: web.AppRunner | None = None
        self.port: int = self.args.port

    @property
    def alive(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive

    async def start(self) -> None:
        """Load the model (in a worker thread), start the scheduler and serve the routes."""
        args = self.args
        load = functools.partial(load_model, args.model, device=args.device, dtype=args.dtype)
        self.loaded = await asyncio.get_running_loop().run_in_executor(self._loader, load)
        self.scheduler = server.build_scheduler(args, self.loaded)
        self.scheduler.start()
        app = server.build_app(
            self.loaded,
            self.scheduler,
            max_body=int(args.max_request_mb * 2**20),
            api_key=self.api_key,
            chat_template=args.chat_template,
            tool_call_parser=args.tool_call_parser,
        )
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, args.host, args.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.log.info(
            "engine_started",
            in_process=True,
            host=args.host,
            port=self.port,
            model=str(self.loaded.path),
            device=args.device,
            dtype=str(next(self.loaded.model.parameters()).dtype),
            max_running=args.max_running,
            forward=self.scheduler.forward_path,
            forward_fallback_reason=self.scheduler.forward_path_why,
            threads=torch.get_num_threads(),
            api_key=self.api_key is not None,
        )

    async def results(self, body: Any) -> list[SequenceResult]:
        """The scheduler's results for a ``/generate`` body, in request order (RequestError /
        ValueError if the body is bad, exactly as the route would refuse it)."""
        if self.scheduler is None or self.loaded is None:
            raise RuntimeError("the in-process engine is not started")
        _, results, _ = await server.generate_results(self.loaded, self.scheduler, body)
        return results

    def submit_groups(self, body: Any, sizes: Sequence[int]) -> list[asyncio.Future]:
        """A ``/generate`` body of ``sum(sizes)`` samples checked as the route checks it (one
        RequestError / ValueError for the whole body) and handed to the scheduler as groups of
        ``sizes`` consecutive samples: one future each, resolving with its results in order as
        soon as its own samples are done."""
        if self.scheduler is None or self.loaded is None:
            raise RuntimeError("the in-process engine is not started")
        inputs, _ = server.parse_body(self.loaded, self.scheduler, body)
        if len(inputs) != sum(sizes):
            raise ValueError(f"{len(inputs)} samples for groups of {list(sizes)}")
        futures, start = [], 0
        for size in sizes:
            futures.append(self.scheduler.submit_async(inputs[start : start + size]))
            start += size
        return futures

    def abort(self, rids: Iterable[str]) -> None:
        """Abort these requests (their slots are freed at the next step)."""
        if self.scheduler is not None:
            self.scheduler.abort_many(rids)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # the weight group too (WeightRoutes.close)
            self._runner = None
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
