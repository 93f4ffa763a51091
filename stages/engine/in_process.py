"""The built-in engine inside the process that uses it: no HTTP between generator and engine.

``InProcessEngine`` is ``inflight engine`` run by its caller instead of as a process of its own:
the same options (its command line, so ``launch.extra_args`` mean the same), the same model
loading, the same scheduler on a thread of its own, and the same HTTP application served at
``host:port``, because the weight publisher and any outside client still reach it over SGLang's
API. What changes is the caller's own ``/generate``: ``results(body)`` hands the request body to
the scheduler directly (``stages.engine.server.generate_results``: the same validation as the
route) and returns the scheduler's results as they are, with no JSON, socket or HTTP parsing, and
no rendering of SGLang's response layout, on either side; ``submit_groups(prompts,
sampling_params, rids)`` does the same for several groups at once, each prompt checked once
(``protocol.parse_groups``), with a future per group. The generator's launcher starts one with
``launch.in_process: true``.

The routes are served by an event loop of their own, on a thread named ``engine-http``, as the
engine's own process would serve them: the caller's loop never stops for them (a held-out
evaluation's answer of 300 completions to encode, a weight update every step). On the caller's
loop they took 6% of the generator's main thread in a default run (py-spy ``--gil``).

Trade-offs: the engine shares the caller's process (its interpreter lock, its cores, its fate: a
crashed generator takes its engine with it, and the supervisor restarts both); the model runs on
the scheduler thread and the routes on theirs, so the caller's event loop still answers while a
decode step runs. (The scheduler hands results to each loop that asked through that loop's own
queue: ``Scheduler._outbox``.)

Not here: deciding when to run in process (``stages.generator.launcher``), the routes
(``stages.engine.server``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import torch
from aiohttp import web

from pipeline.processes import name_thread
from stages.engine import server
from stages.engine.loader import LoadedModel
from stages.engine.preferred_params import merged
from stages.engine.protocol import (
    REQUEST_LEVEL_FIELDS,
    SamplingParams,
    SequenceResult,
    parse_groups,
    parse_sampling_params,
    request_options,
)
from stages.engine.scheduler import Scheduler
from stages.engine.torch_threads import in_passing_thread

T = TypeVar("T")

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
        """``loader``: where ``start`` loads the model and builds the scheduler (default: a
        thread of their own that ends with each, ``torch_threads``)."""
        try:
            self.args = server.parse_args(argv)
        except SystemExit as exc:  # argparse printed why; say it where it happened
            raise ValueError(f"in-process engine options {argv!r} are not valid") from exc
        self.api_key = api_key or self.args.api_key or None
        self.log = log
        self._loader = loader
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self._http: _HttpThread | None = None
        self._sessions: Any = ()  # the app's /open_session sessions, once started
        self.port: int = self.args.port
        # the sampling parameters submit_groups was last given, and their parsed form
        # and the request-level fields among them (REQUEST_LEVEL_FIELDS) as GenerateInput's
        self._params: tuple[dict[str, Any], SamplingParams, dict[str, Any]] | None = None

    @property
    def alive(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loader, else on a thread that ends with it: no thread that lives on
        keeps the OpenMP team torch's work made (its idle team would throttle the
        scheduler's passes: ``torch_threads``)."""
        if self._loader is not None:
            return await asyncio.get_running_loop().run_in_executor(self._loader, fn)
        return await asyncio.to_thread(in_passing_thread, fn)

    async def start(self) -> None:
        """Load the model (in a worker thread), start the scheduler and serve the routes."""
        args = self.args
        load = functools.partial(server.load_served, args)  # as a server process loads it
        self.loaded = await self._off_loop(load)
        if not server.mis_allowed(args, self.loaded.vocab_size):
            raise ValueError("--enable-mis: this model has no token 9999, its delimiter")
        server.resolve_parsers(args, self.loaded)  # --tool-call-parser auto... as a server's
        # on the loader's thread too, which ends with the start (torch_threads)
        build = functools.partial(server.build_scheduler, args, self.loaded)
        self.scheduler = await self._off_loop(build)
        self.scheduler.start()
        if args.lora_paths:  # (AdapterError: the start fails, saying which)
            await asyncio.to_thread(server.preload_adapters, self.scheduler, args.lora_paths)
        # every server flag as the engine's own process takes it (--enable-metrics, request
        # logging...), but the engine id: the generator's process has none of its own
        options = server.app_options(args, self.api_key)
        options["engine_id"] = None
        app = server.build_app(self.loaded, self.scheduler, **options)
        self._sessions = server.sessions_of(app)
        self._http = _HttpThread(app, args.host, args.port)
        self.port = await asyncio.to_thread(self._http.start)
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

    def release_sessions(self, sessions: list[str]) -> tuple[Future[int] | None, list[str]]:
        """``/close_sessions`` of the sessions only requests named (``session_id``: episodes',
        with ``--enable-session-radix-cache``), done on the scheduler directly, at one step
        boundary: what they held may go (None: there were none). The rest (all where the flag
        is off; ``/open_session`` sessions, which the routes' thread keeps) are returned, for
        the route to close."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.session_radix_cache:
            return None, list(sessions)
        direct = [s for s in sessions if s not in self._sessions]
        rest = [s for s in sessions if s in self._sessions]
        return (scheduler.release_radix_sessions(direct) if direct else None), rest

    async def results(self, body: Any) -> list[SequenceResult]:
        """The scheduler's results for a ``/generate`` body, in request order (RequestError /
        ValueError if the body is bad, exactly as the route would refuse it)."""
        if self.scheduler is None or self.loaded is None:
            raise RuntimeError("the in-process engine is not started")
        _, results, _ = await server.generate_results(self.loaded, self.scheduler, body)
        return results

    def submit_groups(
        self,
        prompts: Sequence[list[int]],
        sampling_params: Mapping[str, Any],
        rids: Sequence[Sequence[str]],
        lora: str | None = None,
    ) -> list[asyncio.Future]:
        """Groups of samples (``len(rids[i])`` of ``prompts[i]``, with log-probs, the adapter
        ``lora``) checked as the route checks the ``/generate`` body that lists each prompt
        once per sample (one RequestError / ValueError for them all: ``parse_groups``) and
        handed to the scheduler at once: a future per group, resolving with its results in
        order as soon as its own samples are done (or failing with the RequestError of a
        grammar that does not compile: grammars are compiled off this loop). The sampling
        parameters are parsed once for as long as they stay the same; the request-level fields
        among them (``REQUEST_LEVEL_FIELDS``: a thinking budget, a custom logit processor) apply
        to every sample, as at the top of the body."""
        if self.scheduler is None or self.loaded is None:
            raise RuntimeError("the in-process engine is not started")
        loaded = self.loaded
        if self._params is None or self._params[0] != sampling_params:
            raw = dict(sampling_params)  # a copy: a later change to the caller's is seen
            # --preferred-sampling-params under the caller's, as under a /generate body's
            under = merged(raw, self.scheduler.preferred_sampling_params or {}, frozenset())
            encode = loaded.tokenizer.encode if loaded.tokenizer is not None else None
            own = {k: v for k, v in under.items() if k not in REQUEST_LEVEL_FIELDS}
            options = request_options(
                under,
                strict_thinking=self.scheduler.strict_thinking is not None,
                custom_logits=self.scheduler.logit_processors is not None,
                vocab_size=loaded.vocab_size,
                think_ends=self.scheduler.think_ends,
            )
            self._params = (raw, parse_sampling_params(own, encode), options)
        groups = parse_groups(
            prompts,
            self._params[1],
            rids,
            vocab_size=loaded.vocab_size,
            context_length=loaded.context_length,
            lora=lora,
            adapters=(self.scheduler.adapter_names() if self.scheduler.lora else None)
            if lora is not None
            else (),
            options=self._params[2],
            auto_truncate=self.scheduler.auto_truncate,
        )
        futures = self.scheduler.submit_groups_async(groups)
        requests = self.scheduler.request_log
        if requests is not None and requests.active:  # --log-requests, dumps: as the route's
            _log_groups(requests, self._params[0], lora, groups, futures)
        return futures

    def abort(self, rids: Iterable[str]) -> None:
        """Abort these requests (their slots are freed at the next step)."""
        if self.scheduler is not None:
            self.scheduler.abort_many(rids)

    async def close(self) -> None:
        if self._http is not None:
            await asyncio.to_thread(self._http.stop)  # the weight group too (WeightRoutes.close)
            self._http = None
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)


def _log_groups(
    requests: Any,
    sampling_params: dict[str, Any],
    lora: str | None,
    groups: list[list[Any]],
    futures: list[asyncio.Future],
) -> None:
    """Log ``submit_groups``' request in the server's request log as the ``/generate`` body it
    stands for (each prompt once per sample, with its rid) and each sample as its group ends,
    with the answer the route would have given."""
    inputs = [inp for group in groups for inp in group]
    body: dict[str, Any] = {
        "rid": [inp.rid for inp in inputs],
        "input_ids": [list(inp.input_ids) for inp in inputs],
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if lora is not None:
        body["lora_path"] = lora
    logged = requests.received(body, body["rid"], True)
    left = [len(futures)]

    def ended(first: int, group: list[Any], future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            answers = server.plain_answers(requests, group, future.result())
            requests.finished_all(logged, answers, first)
        left[0] -= 1
        if not left[0]:
            requests.ended(logged)

    first = 0
    for group, future in zip(groups, futures, strict=True):
        future.add_done_callback(functools.partial(ended, first, group))
        first += len(group)


class _HttpThread:
    """``app`` served at ``host:port`` by an event loop on a thread of its own (``engine-http``):
    ``start()`` returns the port once it listens (or raises what stopped it), ``stop()`` cleans
    the application up there (its on-cleanup hooks run on that loop) and ends the thread. Both
    block: call them off the caller's loop."""

    _STOP_S = 30.0  # a weight update in progress is given that long to end

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._app, self._host, self._port = app, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name="engine-http", daemon=True)

    def start(self) -> int:
        self._thread.start()
        return self._ready.result()

    def _run(self) -> None:
        name_thread("engine-http")
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            try:
                port = loop.run_until_complete(self._listen())
            except BaseException as exc:  # the caller's start() raises it
                self._ready.set_exception(exc)
                return
            self._ready.set_result(port)
            loop.run_forever()
        finally:
            loop.close()

    async def _listen(self) -> int:
        self._runner = web.AppRunner(self._app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        return self._runner.addresses[0][1]

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not self._thread.is_alive():
            return
        if self._runner is not None:
            done = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop)
            try:
                done.result(self._STOP_S)
            except concurrent.futures.TimeoutError:
                done.cancel()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(self._STOP_S)
