"""The generator stage: prompts in, one rollout per sampled completion out.

For every prompt it starts ``group_size`` samples, each a ``/generate`` request to the engine with
the fewest requests in flight among those below their target, and emits each finished sample as
a ``rollout`` (token ids, sampler log-prob and policy version per token). How many requests are
in flight is the controller's call (``controller.py``): downstream credit and the staleness bound
gate new starts, measured throughput sets each engine's target; each decision is logged.

Engines are either attached (``engines: [URL, ...]``) or started by the stage (``launch:``), and
the same client serves SGLang and the built-in engine. An engine that fails a request (connection
lost, 5xx, timeout), or does not answer ``/health`` at start, is taken out of use and probed on
``/health`` every ``retry_backoff_s * 2**(k-1)`` s (capped; ``k`` counts its failures since it
last served a request) until it answers again (a launched engine is restarted by the launcher
meanwhile). The failed request is re-routed at once to another live engine, or waits for one to
come back, up to ``max_retries`` times; after that, or on a 4xx (a bad request), the sample is
dropped, counted and logged, and the stage goes on. If every launched engine is given up, the
stage fails (the supervisor's restart policy takes over). Not here: weight updates (the publisher
talks to the engines).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from pipeline import topics
from pipeline.stage import Port, StageContext
from stages.generator.client import Completion, EngineClient, EngineError
from stages.generator.controller import ControllerConfig, Decision, InFlightController
from stages.generator.launcher import EngineLauncher, LaunchConfig
from stages.schemas import PROMPT, ROLLOUT

__all__ = ["Generator", "SamplingConfig"]

_BACKOFF_CAP_S = 10.0


@dataclass
class SamplingConfig:
    """SGLang's sampling parameters (same names and defaults), as sent with every request."""

    temperature: float = field(default=1.0, metadata={"min": 0.0})
    top_p: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
    top_k: int = -1
    max_new_tokens: int = field(default=128, metadata={"min": 1})
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def as_params(self) -> dict[str, Any]:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass
class GeneratorConfig:
    engines: list[str] = field(
        default_factory=list, metadata={"doc": "URLs of running engines to attach to"}
    )
    launch: LaunchConfig | None = field(
        default=None, metadata={"doc": "start engines instead of attaching to URLs"}
    )
    group_size: int = field(default=4, metadata={"min": 1, "doc": "samples per prompt (G)"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_lag: int = field(
        default=4, metadata={"min": 0, "doc": "start samples only within this many versions"}
    )
    outbox: int = field(
        default=8, metadata={"min": 1, "doc": "finished rollouts held while waiting for credit"}
    )
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    request_timeout_s: float = field(default=600.0, metadata={"min": 1.0})
    max_retries: int = field(
        default=3, metadata={"min": 0, "doc": "re-routings of a sample after engine failures"}
    )
    retry_backoff_s: float = field(
        default=0.5,
        metadata={"min": 0.0, "doc": "first /health probe period of a failed engine (doubles)"},
    )
    sync_batch: int = field(
        default=0,
        metadata={
            "min": 0,
            "doc": "run.mode sync: samples per policy version (the learner's batch_size); "
            "the next batch starts once they are all out and a new version is live",
        },
    )

    def __post_init__(self) -> None:
        if bool(self.engines) == (self.launch is not None):
            raise ValueError("give exactly one of `engines` (URLs to attach to) or `launch`")


class Generator:
    Config = GeneratorConfig
    inputs = {"prompts": Port(PROMPT)}
    outputs = {"rollouts": Port(ROLLOUT)}

    def __init__(self, config: GeneratorConfig, ctx: StageContext) -> None:
        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.run_id = ctx.run_dir.name
        self.launcher: EngineLauncher | None = None
        self.session: aiohttp.ClientSession | None = None
        self.in_flight: dict[str, int] = {}
        self.engine_version = 0
        self.counts = {"started": 0, "emitted": 0, "dropped": 0, "retried": 0, "tokens": 0}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def setup(self) -> None:
        self.session = aiohttp.ClientSession()
        urls = list(self.config.engines)
        if self.config.launch is not None:
            self.launcher = EngineLauncher(
                self.config.launch,
                name=f"{self.ctx.stage}.{self.ctx.replica}",
                log_dir=self.ctx.run_dir / "logs",
                log=self.log,
            )
            urls = await self.launcher.start()
        self.clients = {
            url: EngineClient(url, self.session, timeout_s=self.config.request_timeout_s)
            for url in urls
        }
        self.in_flight = dict.fromkeys(urls, 0)
        self.down: dict[str, asyncio.Task] = {}  # engines out of use -> their health probe
        self.failures = dict.fromkeys(urls, 0)  # failures since the engine last served a request
        self.controller = InFlightController(urls, self.config.controller)
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self.config.outbox)
        # an attached engine may be down already: requests go only to those that answer
        health = await asyncio.gather(*(c.healthy() for c in self.clients.values()))
        for url, ok in zip(urls, health, strict=True):
            if not ok:
                self._mark_down(url, "no answer to /health at start")
        self._epoch = -1
        await self._announce_engines()

    async def _announce_engines(self) -> None:
        """Tell the weight publisher which engines to update (again when one was restarted)."""
        epoch = self.launcher.restarts if self.launcher is not None else 0
        if epoch != self._epoch:
            self._epoch = epoch
            await self.ctx.publish(topics.ENGINES, {"urls": list(self.clients), "epoch": epoch})

    # ---------------------------------------------------------------- engines
    def _mark_down(self, engine: str, error: str) -> None:
        """Take ``engine`` out of use until its health probe finds it answering again."""
        if engine in self.down:
            return  # already out: requests that were in flight there fail one by one
        self.failures[engine] += 1
        period = self.config.retry_backoff_s * 2 ** (self.failures[engine] - 1)
        period = min(max(period, 0.05), _BACKOFF_CAP_S)
        self.log.warning(
            "engine_down",
            url=engine,
            failures=self.failures[engine],
            probe_every_s=period,
            error=error,
        )
        self.down[engine] = asyncio.create_task(self._probe(engine, period))

    async def _probe(self, engine: str, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            if await self.clients[engine].healthy(timeout_s=max(period, 1.0)):
                break
        del self.down[engine]
        self.log.info("engine_up", url=engine)
        self._changed.set()

    # ---------------------------------------------------------------- decisions
    def _log_decisions(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.log.info(
                "inflight_decision", scope=d.scope, value=d.value, reason=d.reason, **d.detail
            )

    def _pick_engine(self) -> str | None:
        """The live engine with the fewest requests in flight among those below target."""
        open_engines = []
        for url, n in self.in_flight.items():
            if url in self.down:
                continue
            if n >= self.controller.target(url):
                self.controller.record_blocked(url)
                continue
            open_engines.append(url)
        return min(open_engines, key=lambda u: self.in_flight[u]) if open_engines else None

    async def _slot(self) -> str:
        """Wait until the gates are open and some engine has room; returns that engine."""
        rollouts = self.ctx.outputs["rollouts"]
        while True:
            if self.launcher is not None and self.launcher.all_given_up:
                raise RuntimeError("every engine this generator launched died for good")
            room = rollouts.credit() + (self.outbox.maxsize - self.outbox.qsize())
            version = max(self.engine_version, 0)
            may_start, changes = self.controller.gates(
                in_flight=sum(self.in_flight.values()),
                room=room,
                version=version,
                newest=max(self.ctx.version, version),
                max_lag=self.config.max_lag,
            )
            self._log_decisions(changes)
            if may_start:
                engine = self._pick_engine()
                if engine is not None:
                    return engine
            self._changed.clear()
            # credit arrives without an event of ours: look again at least every 50 ms.
            # (asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation
            # that races its timeout, and this loop would then outlive a shutdown.)
            waiter = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait([waiter], timeout=0.05)
            finally:
                waiter.cancel()

    # ------------------------------------------------------------------- work
    async def run(self) -> None:
        workers = [
            asyncio.create_task(self._emit(), name="emit"),
            asyncio.create_task(self._decide(), name="decide"),
        ]
        try:
            if self.ctx.mode == "sync" and self.config.sync_batch < 1:
                raise ValueError(
                    "run.mode is sync: set the generator's sync_batch to the learner's batch_size"
                )
            batch_started, batch_version = 0, self.ctx.version
            async for msg in self.ctx.inputs["prompts"]:
                if self.ctx.mode == "sync" and batch_started >= self.config.sync_batch:
                    batch_version = await self._next_sync_batch(batch_version)
                    batch_started = 0
                batch_started += self.config.group_size
                group_id = f"{msg.data['prompt_id']}/{secrets.token_hex(3)}"
                for index in range(self.config.group_size):
                    engine = await self._slot()
                    self._start(msg.data, group_id, index, engine)
            if self._tasks:
                await asyncio.gather(*list(self._tasks))
            await self.outbox.join()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        self.log.info("generator_done", in_flight=sum(self.in_flight.values()), **self.counts)

    async def _next_sync_batch(self, version: int) -> int:
        """Sync mode: wait until the last batch is out and trained on (a newer version)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks))
        await self.outbox.join()
        self.log.info("sync_batch_done", version=version)
        return await self.ctx.wait_for_version(version + 1)

    def _start(self, prompt: dict[str, Any], group_id: str, index: int, engine: str) -> None:
        self.in_flight[engine] += 1
        self.counts["started"] += 1
        task = asyncio.create_task(self._sample(prompt, group_id, index, engine, time.monotonic()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sample(
        self, prompt: dict[str, Any], group_id: str, index: int, engine: str, queued: float
    ) -> None:
        rid = f"{self.run_id}/{group_id}/{index}"
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                completion = await self.clients[engine].generate(
                    prompt["input_ids"], self.config.sampling.as_params(), rid=rid
                )
                break
            except EngineError as exc:
                self._release(engine)
                if exc.retryable:
                    self._mark_down(engine, str(exc))
                if not exc.retryable or attempt >= self.config.max_retries:
                    self.counts["dropped"] += 1
                    self.log.warning(
                        "sample_dropped",
                        rid=rid,
                        engine=engine,
                        error=str(exc),
                        attempts=attempt + 1,
                    )
                    return
                attempt += 1
                self.counts["retried"] += 1
                self.log.warning(
                    "sample_retry", rid=rid, engine=engine, attempt=attempt, error=str(exc)
                )
                # the failed engine is out of use now: this goes to a live one, or waits
                # for one to come back (the probes' capped backoff)
                engine = await self._slot()
                self.in_flight[engine] += 1
        self._release(engine)
        self.failures[engine] = 0
        self.controller.record_tokens(engine, len(completion.output_ids))
        self.engine_version = max(self.engine_version, completion.weight_version)
        await self.outbox.put(
            self._rollout(
                prompt,
                group_id,
                index,
                engine,
                completion,
                queued_s=started - queued,
                generate_s=time.monotonic() - started,
            )
        )

    def _release(self, engine: str) -> None:
        self.in_flight[engine] -= 1
        self._changed.set()

    def _rollout(
        self,
        prompt: dict[str, Any],
        group_id: str,
        index: int,
        engine: str,
        completion: Completion,
        **timings: float,
    ) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "prompt_id": prompt["prompt_id"],
            "group_id": group_id,
            "sample_index": index,
            "group_size": self.config.group_size,
            "prompt_ids": np.asarray(prompt["input_ids"], dtype=np.int32),
            "completion_ids": completion.output_ids,
            "sampler_logprobs": completion.logprobs,
            "versions": completion.versions,
            "finish_reason": completion.finish_reason,
            "engine": engine,
            "timings": {k: round(v, 6) for k, v in timings.items()},
            "meta": prompt.get("meta"),
        }

    async def _emit(self) -> None:
        rollouts = self.ctx.outputs["rollouts"]
        while True:
            item = await self.outbox.get()
            try:
                await rollouts.send("rollout", item)
                self.counts["emitted"] += 1
                self.counts["tokens"] += len(item["completion_ids"])
            finally:
                self.outbox.task_done()
                self._changed.set()

    async def _decide(self) -> None:
        interval = self.config.controller.interval_s
        while True:
            await asyncio.sleep(interval)
            await self._announce_engines()
            self._log_decisions(self.controller.decide(time.monotonic()))
            self.ctx.metrics(
                in_flight=sum(self.in_flight.values()),
                targets={u: self.controller.target(u) for u in self.in_flight},
                engines_down=len(self.down),
                engine_version=self.engine_version,
                **self.counts,
            )

    async def close(self) -> None:
        tasks = [*self._tasks, *getattr(self, "down", {}).values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.launcher is not None:
            await self.launcher.close()
        if self.session is not None:
            await self.session.close()
