"""The learner stage: scored groups in, optimizer steps, new weights out to the engines.

Each replica is one rank of a DeepSpeed data-parallel group (the supervisor starts the ranks as a
gang, see ``pipeline.supervisor``). Every rank takes whole groups from its own inbox until it
holds its share of ``batch_size`` samples, computes group advantages, drops samples whose oldest
sampled token is more than ``max_lag`` versions old (counted), with ``dynamic_sampling`` leaves
out groups whose rewards are all equal (counted, filling the batch with others), and runs one
step in a worker thread (``trainer.py``) so that its event loop keeps the heartbeat and the
inbox going meanwhile.
A multi-turn sample's ``loss_mask`` (tokens sampled by the model vs inserted by a tool) and its
own ``prompt_ids`` (overriding the group's) are read when present (``_sample_arrays``). With
``distill.coef > 0`` each sample's ``teacher_logprobs`` make per-token advantages
(``distill.py``); a group with a sample that lacks them is dropped (``no_teacher``).

Rank 0 also runs the weight publisher (``publishing.py``) and the evaluation (``evaluate.py``).
After every ``publish.every`` steps it takes a CPU snapshot of the weights (a collective gather
under ZeRO-3) and publishes from it while the next steps train; at most one publish is in flight.
Held-out greedy accuracy is measured through the engines before the first step, every
``eval.every`` steps and after the last one. Checkpoints (a Hugging Face folder with DeepSpeed
state inside) go to ``RUN_DIR/checkpoints/step-N``; a learner that starts in a run directory
holding one (``inflight run --resume RUN_DIR``, or a restart after a crash) continues from the
newest. After ``steps`` steps rank 0 writes the run summary and ends the run.

Start-up order (launch to first step is part of every run's wall time): the DeepSpeed engine is
made in a worker thread, then rank 0 loads the held-out prompts; it starts the evaluation's
reward workers and waits for the engines in the background, and as soon as they are up forms the
weight group and runs the first evaluation, all while the first batch is generated and trained
on. The first publish waits for that
evaluation, so it measures the initial weights. This module imports torch, transformers and
DeepSpeed only when a learner is made, not when the supervisor loads it to validate a config.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from asyncio import FIRST_COMPLETED
from collections import OrderedDict, deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline import topics
from pipeline.ledger import NO_SIGNAL, TRAINED
from pipeline.stage import Port, StageContext
from stages import rollout_batch
from stages.engine.auth import engine_api_key
from stages.learner.config import LearnerConfig
from stages.schemas import SCORED_BATCH, SCORED_GROUP
from transport.credit import sparse

if TYPE_CHECKING:
    from stages.learner.trainer import TrainSample

__all__ = ["Learner"]

_ENGINE_WAIT_S = 600.0
_SEEN_UIDS = 200_000  # uids of groups remembered to recognize copies
_PACE_ORIGINS = 64  # generators remembered (the latest ones)
_LIVE_STEPS = 8  # a generator whose groups came within this many steps counts as feeding
# waiting this long for samples with none coming, the learner stops counting the generators
# that sent nothing meanwhile (gone for good, or held back by a budget that counts them)
_SILENT_S = 2.0
# how long a step's acknowledgements wait for its pace report to come back over the bus
_PACE_ECHO_S = 0.5
_CATCH_UP_S = 1.0  # while waiting for samples, rank 0 checks this often that engines are current


class Learner:
    Config = LearnerConfig
    keeps_ledger = True  # reports where its samples end (pipeline.ledger)
    reads_pace = True  # hears its own pace report back before it acknowledges a step
    # a group is processed once every sample of it is in a finished step (or dropped, counted)
    inputs = {
        "groups": Port(
            SCORED_GROUP,
            SCORED_BATCH,
            doc="scored groups from the scorer, one a message or several as columns",
            ack="manual",
        )
    }
    outputs: dict[str, Port] = {}
    distributed = True  # replicas are the ranks of one torch.distributed group

    def __init__(self, config: LearnerConfig, ctx: StageContext) -> None:
        from stages.learner.trainer import Trainer  # torch: only in the learner's own process

        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.trainer = Trainer(config, ctx.log)
        self.rank = ctx.replica  # the supervisor starts replica i as rank i
        self.publishing: Any = None
        self.evaluator: Any = None
        self.step = 0
        self.version = 0
        self.offset = 0  # policy version = ceil(step / publish.every) + offset (see setup)
        self.counts = {
            "samples": 0,
            "groups": 0,
            "stale": 0,
            "bad_groups": 0,
            "skipped_steps": 0,
            "no_signal": 0,  # samples in steps without passes (advantage 0)
            "copies": 0,  # groups of a prompt that came before, dropped
            "set_aside": 0,  # samples of groups without signal left out (dynamic_sampling)
            "overlong_filtered": 0,  # truncated samples that trained nothing (overlong.filter)
            "overlong_shaped": 0,  # samples whose reward the overlong punishment lowered
            "no_teacher": 0,  # samples of groups dropped without teacher log-probs (distill)
            "pace_unheard": 0,  # steps whose pace report did not come back in _PACE_ECHO_S
        }
        # sums over steps; "passes_n": steps that had passes (the loss statistics' steps)
        self.totals = {
            "lag": 0.0,
            "tis_clip_frac": 0.0,
            "ess": 0.0,
            "mismatch_kl": 0.0,
            "n": 0,
            "passes_n": 0,
        }
        self._carry: list[TrainSample] = []
        # distill: sums of sampler - teacher log-probs over sampled tokens, and their count,
        # since the last step was logged (teacher_kl: the reverse KL's one-sample estimate)
        self._teacher_kl = [0.0, 0]
        self._no_teacher_logged = False  # the first group dropped without them is logged
        # received groups not yet processed (see _samples_of)
        self._open: dict[int, list[Any]] = {}
        self._parts: deque[_Part] = deque()  # the groups of a scored_batch not yet taken
        # groups read while the last step trained (see _train), and their samples' count
        self._ready: deque[list[TrainSample]] = deque()
        self._ready_n = 0
        # set while the training thread runs a backward pass (Trainer.on_backward)
        self._backward_running: asyncio.Event | None = None
        # resumed: uid -> sample indexes of a group that are in the checkpoint already
        self._partial: dict[str, set[int]] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # uids of groups taken (copies)
        # generator ("stage.replica" of an origin) -> the step and the time its groups last came
        self._origins_seen: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._checked_at = 0.0  # rank 0: when it last checked that the engines are current
        self._origins = 0
        self._publish_task: asyncio.Task | None = None
        self._eval_task: asyncio.Task | None = None
        self._eval_due: tuple[int, int] | None = None  # (step, version) of a pending evaluation
        self._engines_task: asyncio.Task | None = None  # rank 0: find the engines
        self._first_eval: asyncio.Task | None = None  # rank 0: the evaluation before step 1
        self._input_done = False
        self._urls: list[str] = []

    # ------------------------------------------------------------------ setup
    async def setup(self) -> None:
        cfg = self.config
        if cfg.batch_size % self.ctx.replicas:
            raise ValueError(
                f"batch_size {cfg.batch_size} must be a multiple of the learner's replicas "
                f"({self.ctx.replicas}): each rank takes an equal share"
            )
        self.share = cfg.batch_size // self.ctx.replicas
        self._groups = aiter(self.ctx.inputs["groups"])
        resumed = self._latest_checkpoint()
        live = int(getattr(self.ctx, "version", 0) or 0)  # > 0: started into a run that published
        # a restart before the first version went out: the step it trained (and acknowledged)
        # is lost with it, and a sync generator waits for version 1 before its next batch
        again = int(getattr(self.ctx, "restarts", 0) or 0) > 0
        evaluate = self.rank == 0 and cfg.eval.source is not None
        # One worker thread does everything that imports transformers, in turn: its lazy
        # modules are not safe to import from two threads at once.
        prompts, tokenizer = await asyncio.to_thread(self._setup_blocking, evaluate)
        if self.trainer.rank != self.rank:
            raise RuntimeError(
                f"learner replica {self.rank} became torch.distributed rank {self.trainer.rank}: "
                "start the learner's replicas as one gang (RANK = replica)"
            )
        if hasattr(self.trainer, "on_backward"):  # the next groups are read meanwhile (_train)
            loop, running = asyncio.get_running_loop(), asyncio.Event()
            self._backward_running = running

            def on_backward(on: bool) -> None:  # in the training thread
                try:
                    loop.call_soon_threadsafe(running.set if on else running.clear)
                except RuntimeError:  # the loop closed under a step left behind: no one reads
                    pass

            self.trainer.on_backward = on_backward
        if self.rank == 0:
            from stages.learner.publishing import Publishing

            self.publishing = Publishing(
                cfg.publish,
                self.ctx,
                device=self.trainer.device,
                lora=cfg.lora.on,
                model=cfg.model,
            )
            if evaluate:
                from stages.learner.evaluate import Evaluator

                self.evaluator = Evaluator(
                    cfg.eval,
                    prompts,
                    tokenizer,
                    self.log,
                    api_key=engine_api_key(self.ctx),
                    model=cfg.model,
                )
                if self.publishing.files:
                    from stages.weights.adapter_names import ADAPTER_PREFIX

                    self.evaluator.adapter_prefix = ADAPTER_PREFIX
            self._engines_task = asyncio.create_task(
                self._engines_up(evaluate=evaluate and resumed is None and not live),
                name="engines",
            )
        if resumed is not None:
            state = await asyncio.to_thread(self.trainer.load, str(resumed))
            self.step = int(state.get("step", 0))
            self.version = int(state.get("version", 0))
            self.offset = int(state.get("version_offset", 0))
            for key in self.counts:
                self.counts[key] = int(state.get("counts", {}).get(key, 0))
            totals = state.get("totals", {})
            self.totals.update({"passes_n": totals.get("n", 0), **totals})  # older: every step
            self._partial, self._seen = _load_groups(resumed, earlier=state)
        if live >= self.version and (live > 0 or again):
            # restarted mid-run (from a checkpoint, or from scratch when there is none yet):
            # versions up to `live` were published after these weights and everyone holds them
            # as current. Versions only grow, so these weights go out as a new one, and later
            # ones count on from there. Restarted before anything was published (live 0),
            # they go out as version 1 all the same: in sync mode the generators made the batch
            # of version 0 already and start the next one only at version 1
            self.offset += live + 1 - self.version
            self.version = live + 1
        if resumed is not None or live > 0 or again:
            self.log.info(
                "learner_resumed",
                checkpoint=str(resumed) if resumed is not None else None,
                step=self.step,
                policy_version=self.version,
                version_offset=self.offset,
            )
        # the engines may hold other weights than these: bring them up to date first
        self.resumed = resumed is not None or live > 0 or again
        if self.rank == 0:  # samples trained after the step we start from are not in the model
            self.ctx.ledger.rollback(self.step)

    def _setup_blocking(self, evaluate: bool) -> tuple[list[dict[str, Any]], Any]:
        """The DeepSpeed engine, then (``evaluate``) the held-out prompts and their tokenizer."""
        self.trainer.setup()
        if not evaluate:
            return [], None
        from stages.feeder.sources import load_prompts
        from stages.hub import resolve_model
        from stages.light_tokenizer import load_tokenizer

        source = self.config.eval.source
        prompts = load_prompts(source, "eval", log=self.log).prompts
        spec = source.tokenizer or self.config.model
        what = "eval.source.tokenizer" if source.tokenizer else "model"
        folder = resolve_model(spec, what=what, needs="tokenizer")  # a folder, or a Hub id's
        return prompts, load_tokenizer(folder)  # as the scorer reads it

    async def _engines_up(self, *, evaluate: bool) -> None:
        """Rank 0, in the background: start the evaluation's reward workers and wait for the
        engines; then form the weight group and, on a fresh start, measure the initial weights
        (both go on while the first batch is generated)."""
        workers = asyncio.ensure_future(
            self.evaluator.start() if self.evaluator is not None else asyncio.sleep(0)
        )
        try:
            self._urls = await self.publishing.wait_for_engines(_ENGINE_WAIT_S)
        except BaseException:
            workers.cancel()
            await asyncio.gather(workers, return_exceptions=True)
            raise
        self.log.info("engines_found", urls=self._urls)
        await workers
        if evaluate:
            self._first_eval = asyncio.create_task(self._evaluate_initial(), name="first-eval")
        await self.publishing.connect()

    def _eval_urls(self) -> list[str]:
        """The engines to evaluate on now: a generator restarted since the start announced
        new ones (its old engine is gone)."""
        return self.publishing.urls() or self._urls

    async def _evaluate_initial(self) -> None:
        result = await self.evaluator.evaluate(self._urls, step=0, version=0)
        await self.ctx.summary(eval_before=result["accuracy"])

    # -------------------------------------------------------------------- run
    async def run(self) -> None:
        from stages.learner.trainer import without_passes

        cfg = self.config
        started = time.monotonic()
        if self.resumed:
            # the engines start from the original model: bring them up to date first (every
            # rank: under ZeRO-3 the snapshot is a collective gather)
            await self._publish(self.version)
        publish_s = 0.0
        await self._publish_pace()  # generators bound their lead from the first samples on
        while self.step < cfg.steps:
            waited = time.monotonic()
            samples = await self._collect()
            # several ranks agree in a collective (a thread); one rank has only its own say
            go_on = bool(samples)
            if self.trainer.world > 1:
                go_on = await asyncio.to_thread(self.trainer.agree, go_on)
            if not go_on:
                self.log.warning("input_ended", step=self.step, steps=cfg.steps)
                break
            policy_version = self.step // cfg.publish.every + self.offset
            # time this step waited for samples, and for the last publish (hand-off included)
            timing = {"wait_s": time.monotonic() - waited, "publish_s": publish_s}
            metrics = await self._train(samples, policy_version)
            self.step += 1
            fates: dict[str, list[TrainSample]] = {TRAINED: [], NO_SIGNAL: []}
            for s in samples:
                fates[NO_SIGNAL if without_passes(cfg, s) else TRAINED].append(s)
            for reason, ended in fates.items():
                self._fates(ended, reason, step=self.step)
            self._account({**metrics, **timing}, time.monotonic() - started)
            # The new pace goes first and the step's samples are acknowledged once it is heard
            # back over the control bus: the room their acknowledgements free in a generator's
            # queue gate must not be taken at the version before this step (it would start
            # samples that are stale by the time they are trained).
            await self._pace_heard(await self._publish_pace())
            for sample in samples:  # in a finished step: processed
                self._done_with(sample)
            last = self.step == cfg.steps
            publish_s = time.monotonic()
            if self.step % cfg.publish.every == 0 or last:
                # ceil: the last step too
                await self._publish(-(-self.step // cfg.publish.every) + self.offset)
            publish_s = time.monotonic() - publish_s
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and not last:
                await self._checkpoint()
        await self._finish(started)

    async def _collect(self) -> list[TrainSample]:
        """This rank's share of the next batch (fewer only when the input has ended). With
        ``dynamic_sampling``, groups without signal are set aside (``_set_aside``) until the
        step has taken ``max_oversample`` times its share. The samples dropped as stale and set
        aside that it finds together (among the groups read ahead during the last step, most
        of them) go to the ledger in one report each, before anything here waits."""
        stale: list[TrainSample] = []
        aside: list[TrainSample] = []
        samples, self._carry = self._fresh(self._carry, stale), []
        hungry = set_aside = False
        taken, limit = len(samples), self.config.max_oversample * self.share
        while len(samples) < self.share:
            if self._ready:  # read during the last step: stale by now perhaps
                if self._look_due():  # as _next_message would before taking it
                    self._drop(stale, aside)
                    await self._look_at_engines()
                group = self._ready.popleft()
                self._ready_n -= len(group)
                group = self._fresh(group, stale)
            else:
                self._drop(stale, aside)
                if self._input_done:
                    break
                if (
                    not hungry
                    and (self.ctx.replicas > 1 or set_aside)
                    and not self._parts
                    and _inbox_empty(self.ctx.inputs["groups"])
                ):
                    # the generators' queue gate then lets one batch more through. Several
                    # ranks: this one may wait for samples while another holds more than its
                    # share. Groups set aside: done with, but a generator's batch is
                    # acknowledged only with its last group, and the others may wait here for
                    # this step: the gate can stay shut on samples this step cannot use
                    hungry = True
                    await self._publish_pace(hungry=True)
                try:
                    msg = await self._next_group_or_recount()
                except StopAsyncIteration:
                    self._input_done = True
                    break
                group = self._samples_of(msg)
            taken += len(group)
            no_signal = not any(s.carries_signal for s in group)
            if self.config.dynamic_sampling and group and no_signal and taken <= limit:
                aside.extend(group)
                set_aside = True
                continue
            samples.extend(group)
        self._drop(stale, aside)
        self._carry = samples[self.share :]
        return samples[: self.share]

    def _drop(self, stale: list[TrainSample], aside: list[TrainSample]) -> None:
        """Report and let go of the samples ``_collect`` gathered as ``stale`` and set
        ``aside``, one ledger report each (emptied: gather again)."""
        self._drop_stale(stale)
        self._set_aside(aside)
        stale.clear()
        aside.clear()

    async def _train(self, samples: list[TrainSample], policy_version: int) -> dict[str, Any]:
        """One step in the training thread. Meanwhile the loop reads the groups that arrive
        (parses them, computes their advantages): up to a batch of them, which the next step
        then finds ready instead of reading them after this one, while the model waits. A
        trainer that says when its backward passes run (``on_backward``) gets them read then
        only: the rest of a step holds the GIL between small operators, and Python run beside
        it costs the step about twice its own time. Their freshness is looked at again when
        they are taken: the version moves with this step."""
        training = asyncio.ensure_future(
            asyncio.to_thread(self.trainer.step, samples, policy_version)
        )
        inbox = self.ctx.inputs["groups"]
        if getattr(inbox, "waiting", None) is None:  # a port that cannot say what is there
            return await training
        free = self._backward_running
        pending: Any = None  # received, not read yet
        receiving: asyncio.Future | None = None
        opening: asyncio.Future | None = None
        try:
            while not training.done():
                if free is None or free.is_set():
                    if pending is not None:
                        self._take_ahead(pending)
                        pending = None
                    if not self._read_ahead(inbox):
                        break  # a batch is read
                waits: set[asyncio.Future] = {training}
                if pending is None:
                    receiving = receiving or asyncio.ensure_future(anext(self._groups))
                    waits.add(receiving)
                if free is not None and not free.is_set():
                    opening = opening or asyncio.ensure_future(free.wait())
                    waits.add(opening)
                await asyncio.wait(waits, return_when=FIRST_COMPLETED)
                if opening is not None and opening.done():
                    opening = None
                if receiving is not None and receiving.done():
                    try:
                        pending = receiving.result()
                    except Exception:  # the input ended or failed: the next _collect finds out
                        break
                    finally:
                        receiving = None
        finally:
            for waiting in (receiving, opening):
                if waiting is not None:
                    waiting.cancel()
        metrics = await training
        if pending is not None:
            self._take_ahead(pending)
        return metrics

    def _read_ahead(self, inbox: Any) -> bool:
        """Read what waits (a batch's worth at most); whether there is room for more."""
        while self._ready_n + len(self._carry) < self.share:
            if self._parts:
                self._ready_group(self._parts.popleft())
            elif inbox.waiting() > 0:
                self._take_ahead(inbox.take())
            else:
                return True
        return False

    def _take_ahead(self, msg: Any) -> None:
        if msg.kind != SCORED_BATCH.kind:
            self._ready_group(msg)
        else:
            self._parts.extend(self._parts_of(msg))

    def _ready_group(self, msg: Any) -> None:
        group = self._samples_of(msg)
        if group:
            self._ready.append(group)
            self._ready_n += len(group)

    def _set_aside(self, samples: list[TrainSample]) -> None:
        """Dynamic sampling: groups whose rewards are all equal stay out of the step; they are
        processed (acknowledged), their samples' fate ``no_signal`` (one ledger report for all
        of ``samples``). Done with at once, they free the generators' queue gate for the groups
        that replace them: the pace needs no change (a pace of the batch over the share of
        groups with signal left 27k samples stale)."""
        if samples:
            self.counts["set_aside"] += len(samples)
            self._fates(samples, NO_SIGNAL)
            for sample in samples:
                self._done_with(sample)

    async def _next_group(self) -> Any:
        """The next scored group: a ``scored_group`` message, or one group of a
        ``scored_batch`` (a ``_Part``: acknowledged with the batch's last group)."""
        while not self._parts:
            msg = await self._next_message()
            if msg.kind != SCORED_BATCH.kind:
                return msg
            self._parts.extend(self._parts_of(msg))
        return self._parts.popleft()

    def _parts_of(self, msg: Any) -> list[_Part]:
        """A ``scored_batch``'s groups; none when its columns do not line up (all its samples
        dropped as ``bad_group``, counted, logged, the message acknowledged)."""
        batch = msg.data
        problems = rollout_batch.problems(batch)
        if problems:
            size, groups = batch["group_size"], len(batch["group_id"])
            self.counts["bad_groups"] += groups
            self.log.warning("scored_batch_dropped", reason="; ".join(problems), groups=groups)
            uids = [u for u in batch["uid"] if isinstance(u, str)]
            self.ctx.ledger.fates(
                [(uid, size, i) for uid in uids for i in range(max(0, size))], "bad_group"
            )
            self.ctx.inputs["groups"].ack(msg)
            return []
        columns = _Columns(batch)
        entry = [msg, len(batch["group_id"])]
        return [_Part(columns, g, entry) for g in range(len(batch["group_id"]))]

    def _ack(self, msg: Any) -> None:
        """A group is processed: its message is, or (a batch's) once all its groups are."""
        if isinstance(msg, _Part):
            msg.entry[1] -= 1
            if msg.entry[1] > 0:
                return
            msg = msg.entry[0]
        self.ctx.inputs["groups"].ack(msg)

    async def _next_message(self) -> Any:
        """The next message from the scorers. Rank 0 meanwhile fails if looking for the engines
        fails, and sends the current weights again to engines that lack them
        (``_catch_up``)."""
        if self.rank != 0:
            return await anext(self._groups)
        inbox = self.ctx.inputs["groups"]
        if getattr(inbox, "waiting", None) is not None and inbox.waiting() > 0:
            # one is there already: no task to wait for it, unless the engines need a look
            if not self._look_due():
                return inbox.take()
        receiving = asyncio.ensure_future(anext(self._groups))
        try:
            while True:
                engines = self._engines_task
                ready = engines is not None and engines.done()
                if not receiving.done():
                    waits: set[asyncio.Future] = {receiving}
                    if engines is not None and not ready:
                        waits.add(engines)
                    due = self._checked_at + _CATCH_UP_S - time.monotonic()
                    timeout = max(0.0, due) if ready else None
                    await asyncio.wait(waits, timeout=timeout, return_when=FIRST_COMPLETED)
                    ready = engines is not None and engines.done()
                if ready:
                    await self._look_at_engines()
                if receiving.done():
                    break
        except BaseException:
            receiving.cancel()
            raise
        return receiving.result()

    def _look_due(self) -> bool:
        """Rank 0: whether the engines need a look now (``_look_at_engines``)."""
        engines = self._engines_task
        if self.rank != 0 or engines is None or not engines.done():
            return False
        healthy = not engines.cancelled() and engines.exception() is None
        return not healthy or time.monotonic() - self._checked_at >= _CATCH_UP_S

    async def _look_at_engines(self) -> None:
        """Rank 0, once looking for the engines has ended: fail if it failed, and catch them
        up when due (at most every ``_CATCH_UP_S``), also while groups keep coming: they may
        all be stale, from an engine that lost the weights, and would keep coming for ever."""
        engines = self._engines_task
        assert engines is not None and engines.done()
        if not engines.cancelled() and engines.exception() is not None:
            engines.result()  # raises: no engines, no samples and no publishing
        if time.monotonic() - self._checked_at >= _CATCH_UP_S:
            publishing = self._publish_task
            if publishing is not None and not publishing.done():
                # its outcome decides: when groups were read during the last step, a publish
                # is always in flight here and the look would never be taken
                await asyncio.wait({publishing})
            self._checked_at = time.monotonic()
            await self._catch_up()

    async def _catch_up(self) -> None:
        """Rank 0, between steps: send the current weights to engines that lack them.

        A restarted engine serves its initial weights, and the generator holds samples back from
        an engine that lags more than ``max_lag``: without this the run would wait forever for
        samples when that engine is the only one. (Or, when the last publishes failed, the
        generator may still take that engine as current enough, and every sample it makes is
        too stale for the learner: dropped, counted, for ever.) Checked at most once a second,
        while waiting for groups. Between steps the weights do not change.
        """
        if self.version == 0 or self.publishing is None:
            return  # nothing published yet: every engine starts from these weights
        sending = self._publish_task
        if sending is not None and not sending.done():
            return  # its outcome decides
        if sending is not None and not sending.cancelled() and sending.exception() is not None:
            # what a snapshot's publish raised in the background: one no retry can mend (a
            # refused key, an engine without LoRA; retried failures are caught in publish())
            sending.result()
        reason = await self.publishing.behind()
        if reason is None:
            return
        self.publishing.log.info("weights_catch_up", policy_version=self.version, reason=reason)
        self.publishing.counts["catch_ups"] += 1
        cfg = self.config
        if cfg.publish.snapshot or cfg.deepspeed.zero_stage == 3:
            weights: Any = list(self.trainer.last_snapshot().items())  # what the last publish sent
        else:
            bucket = int(cfg.publish.bucket_mb * 2**20)
            weights = lambda: self.trainer.named_weights(bucket)  # noqa: E731
        await self.publishing.publish(weights, self.version)

    def _fresh(
        self, samples: list[TrainSample], stale: list[TrainSample] | None = None
    ) -> list[TrainSample]:
        """``samples`` less those whose oldest *sampled* token is more than ``max_lag``
        versions old: those go to ``stale`` (the caller drops them, ``_drop_stale``), or are
        dropped now. Inserted tokens have no version (-1) and are not looked at; a sample
        without any sampled token is never stale (it trains nothing)."""
        current = self.step // self.config.publish.every + self.offset
        kept, old = [], ([] if stale is None else stale)
        for s in samples:
            oldest = _oldest(s.sampled_versions)
            if oldest is None or current - oldest <= self.config.max_lag:
                kept.append(s)
            else:
                old.append(s)
        if stale is None:
            self._drop_stale(old)
        return kept

    def _drop_stale(self, samples: list[TrainSample]) -> None:
        """Count ``samples`` as stale, in one ledger report, and let them go (processed)."""
        if samples:
            self.counts["stale"] += len(samples)
            self._fates(samples, "stale", step=self.step + 1)  # undone if step rolls back
            for s in samples:
                self._done_with(s)

    def _note_origin(self, group: Mapping[str, Any]) -> None:
        """Remember which generator fed this step, to count them. A group's ``origin`` is its
        generator's session (``stage.replica:session``): a restarted generator's new session
        takes its predecessor's place, which sends nothing more."""
        origin = group.get("origin")
        if not isinstance(origin, str):
            return  # a producer that does not name itself
        generator = origin.rpartition(":")[0] or origin
        self._origins_seen[generator] = (self.step, time.monotonic())
        self._origins_seen.move_to_end(generator)
        while len(self._origins_seen) > _PACE_ORIGINS:  # generators long gone
            self._origins_seen.popitem(last=False)

    def _forget_silent(self, since: float) -> bool:
        """While no samples come: stop counting the generators that sent nothing since
        ``since`` (whether any were forgotten). One that died for good would otherwise count
        for ``_LIVE_STEPS`` more steps, which may never come: the live ones' share of the
        budget can be less than the batch they wait to fill. One that lives and was held back
        by its share sends again, and counts again, once the larger share lets it."""
        silent = [g for g, (_, heard) in self._origins_seen.items() if heard < since]
        for generator in silent:
            del self._origins_seen[generator]
        return bool(silent)

    async def _next_group_or_recount(self) -> Any:
        """``_next_group``; while none comes for ``_SILENT_S``, the generators that sent
        nothing meanwhile stop counting in the pace (``_forget_silent``), which then goes out
        again, hungry: the generators let one batch more through. A generator's batch is
        acknowledged only with its last group, so the queue gate can stay shut on groups
        this rank holds for the step it waits to fill (seen after a scorer restarted, the
        learner holding one group of each of 16 batches: the gate's whole budget)."""
        waiting = getattr(self.ctx.inputs["groups"], "waiting", None)
        if self._parts or (waiting is not None and waiting() > 0):
            return await self._next_group()  # one is there: no task to wait for it
        receiving = asyncio.ensure_future(self._next_group())
        try:
            while True:
                since = time.monotonic()
                await asyncio.wait({receiving}, timeout=_SILENT_S)
                if receiving.done():
                    return receiving.result()
                forgot = self._forget_silent(since)
                self.log.info(
                    "generators_silent", step=self.step, waited_s=_SILENT_S, forgot=forgot
                )
                await self._publish_pace(hungry=True)
        except BaseException:
            receiving.cancel()
            raise

    async def _publish_pace(self, *, hungry: bool = False) -> int | None:
        """After a step: tell the generators the pace they keep ahead of (``topics.PACE``):
        the batch, ``publish.every``, ``max_lag``, the version the staleness check compares
        with, how many generators share the batch, and whether it waits for samples now
        (``hungry``: then the generators let one batch more through). Returns that version
        (None: nothing published)."""
        cfg = self.config
        if self.ctx.mode != "async" or not hasattr(self.ctx, "publish"):
            return None
        live = sum(self.step - at <= _LIVE_STEPS for at, _ in self._origins_seen.values())
        version = self.step // cfg.publish.every + self.offset
        await self.ctx.publish(
            topics.PACE,
            {
                "rank": self.rank,
                "batch": cfg.batch_size,
                "every": cfg.publish.every,
                "max_lag": cfg.max_lag,
                # what _fresh compares with: ahead of the published version while publishing
                "version": version,
                "origins": max(1, live),
                "hungry": hungry,
            },
        )
        return version

    async def _pace_heard(self, version: int | None) -> None:
        """Wait (at most ``_PACE_ECHO_S``) until this rank's pace report at ``version`` has come
        back over the control bus: the broker has then passed it on to the generators too. One
        that does not come back (the bus dropped it) is counted and logged, and the step goes
        on."""
        wait = getattr(self.ctx, "wait_for_pace", None)
        if version is None or wait is None:
            return
        # (asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation)
        heard = asyncio.ensure_future(wait(self.rank, version))
        try:
            done, _ = await asyncio.wait({heard}, timeout=_PACE_ECHO_S)
        finally:
            heard.cancel()
        if not done:
            self.counts["pace_unheard"] += 1
            if sparse(self.counts["pace_unheard"]):
                self.log.warning(
                    "pace_unheard",
                    version=version,
                    waited_s=_PACE_ECHO_S,
                    count=self.counts["pace_unheard"],
                )

    def _fates(self, samples: list[TrainSample], reason: str, step: int | None = None) -> None:
        """Tell the ledger where ``samples`` ended (before their groups are acknowledged)."""
        slots = []
        for s in samples:
            _, _, uid, size, _ = self._open[s.origin]
            slots.append((uid, size, s.index))
        self.ctx.ledger.fates(slots, reason, step=step)

    def _done_with(self, sample: TrainSample) -> None:
        """One more sample of its group trained or dropped; the last acknowledges the group."""
        entry = self._open[sample.origin]
        entry[1] -= 1
        entry[4].add(sample.index)
        if entry[1] == 0:
            del self._open[sample.origin]
            self._ack(entry[0])

    def _samples_of(self, msg: Any) -> list[TrainSample]:
        from stages.learner.advantages import one_group_advantages
        from stages.learner.distill import token_advantages
        from stages.learner.overlong import overlong_penalty
        from stages.learner.trainer import TrainSample

        distill = self.config.distill
        # a group of a scored_batch is read from its columns (not for distillation: teacher
        # log-probs do not travel as columns)
        read = msg.read() if isinstance(msg, _Part) and not distill.on else None
        group = msg.head if read is not None else msg.data
        uid = group.get("uid")
        done = self._partial.pop(uid, None) if isinstance(uid, str) else None
        if isinstance(uid, str) and done is None:
            if uid in self._seen:  # this prompt's group came before (made again after a crash)
                group = msg.data
                items = group.get("samples") if isinstance(group.get("samples"), list) else []
                indexes = [s.get("sample_index") for s in items if isinstance(s, dict)]
                self.ctx.ledger.copies(uid, group.get("group_size"), indexes)
                self.counts["copies"] += 1
                self._ack(msg)
                return []
            self._seen[uid] = None
            if len(self._seen) > _SEEN_UIDS:
                self._seen.popitem(last=False)
        if read is not None:
            rows, rewards, reasons, indexes = read
            teachers: list[np.ndarray | None] = [None] * len(rows)
        else:
            try:
                prompt = np.asarray(group["prompt_ids"], dtype=np.int64)
                items = group["samples"]
                # float32, as the rewards were scored (and as the sum of a batch is reported)
                scored = [float(s["reward"]) for s in items]
                rewards = np.asarray(scored, dtype=np.float32).tolist()
                rows = [_sample_arrays(s, prompt) for s in items]
                teachers = (
                    [_teacher_logprobs(s, len(row[1])) for s, row in zip(items, rows, strict=True)]
                    if distill.on
                    else [None] * len(rows)
                )
                reasons = [item.get("finish_reason") for item in items]
                indexes = [int(item.get("sample_index", i)) for i, item in enumerate(items)]
            except (KeyError, TypeError, ValueError) as exc:
                self.counts["bad_groups"] += 1
                self.log.warning("group_dropped", group_id=group.get("group_id"), reason=str(exc))
                self.ctx.ledger.fates(_slots_of(group), "bad_group")
                self._ack(msg)
                return []
        if not rows:
            self._ack(msg)
            return []
        if distill.on and any(t is None for t in teachers):
            self._no_teacher(msg, sum(t is None for t in teachers))
            return []
        for (_, _, lp, _, mask), teacher in zip(rows, teachers, strict=True):
            if teacher is not None:
                gap = lp - teacher if mask is None else (lp - teacher)[mask]
                self._teacher_kl[0] += float(gap.sum())
                self._teacher_kl[1] += gap.size
        self._origins += 1
        origin = self._origins
        self.counts["groups"] += 1
        self._note_origin(group)
        cfg = self.config
        shaped = rewards
        if cfg.overlong.shaping:  # sampled tokens: a trajectory's inserted ones do not count
            lengths = [len(r[1]) if r[4] is None else int(r[4].sum()) for r in rows]
            shaped = [
                r + overlong_penalty(n, cfg.overlong) for r, n in zip(rewards, lengths, strict=True)
            ]
            self.counts["overlong_shaped"] += sum(
                a != b for a, b in zip(rewards, shaped, strict=True)
            )
        advantages = one_group_advantages(
            shaped, baseline=cfg.advantage.baseline, std_normalize=cfg.advantage.std_normalize
        )
        truncated = set()
        if cfg.overlong.filter:  # after the group's advantages: the others' baseline keeps it
            for i, reason in enumerate(reasons):
                if reason == "length":
                    advantages[i] = 0.0
                    truncated.add(indexes[i])
        samples = [
            TrainSample(
                own_prompt,
                ids,
                lp,
                versions,
                a,
                r,
                origin,
                index,
                loss_mask=mask,
                token_advantages=None
                if teacher is None
                else token_advantages(a, teacher, lp, mask, distill),
            )
            for (own_prompt, ids, lp, versions, mask), a, r, index, teacher in zip(
                rows, advantages, rewards, indexes, teachers, strict=True
            )
        ]
        if done:  # part of it is in the checkpoint we resumed from: not again
            samples = [s for s in samples if s.index not in done]
            if not samples:
                self._ack(msg)
                return []
        # origin -> [message, samples not yet trained or dropped, uid, group_size, those done]
        self._open[origin] = [msg, len(samples), uid, group.get("group_size"), set(done or ())]
        kept = self._fresh(samples)  # a truncated sample may be stale: dropped as such
        for s in kept:
            if s.index in truncated:  # trains no token (leaves normalize: token's count)
                s.loss_mask = np.zeros(len(s.completion_ids), dtype=bool)
                self.counts["overlong_filtered"] += 1
        return kept

    def _no_teacher(self, msg: Any, missing: int) -> None:
        """Distillation: a group with samples that lack teacher log-probs (the teacher failed
        for them) is dropped and counted; the first one is logged."""
        group = msg.data
        slots = _slots_of(group)
        if not self._no_teacher_logged:
            self._no_teacher_logged = True
            self.log.warning(
                "group_dropped",
                group_id=group.get("group_id"),
                reason=f"distill: {missing} of its {len(group['samples'])} samples have no "
                "teacher_logprobs (the teacher failed for them: see the scorer's teacher_failed "
                "events, or no scorer upstream has a teacher)",
                later="counted in no_teacher, not logged again",
            )
        self.counts["no_teacher"] += len(slots) or len(group["samples"])
        self.ctx.ledger.fates(slots, "no_teacher")
        self._ack(msg)

    def _account(self, metrics: dict[str, Any], elapsed: float) -> None:
        self.counts["samples"] += metrics["samples"]
        self.counts["skipped_steps"] += metrics["skipped"]
        self.counts["no_signal"] += metrics.get("no_signal", 0)
        t = self.totals
        t["n"] += 1
        t["passes_n"] += int("ess" in metrics)  # a step without passes has no loss statistics
        for key, name in (
            ("lag", "lag_mean"),
            ("tis_clip_frac", "tis_clip_frac"),
            ("ess", "ess"),
            ("mismatch_kl", "mismatch_kl"),
        ):
            value = metrics.get(name)
            if isinstance(value, (int, float)):
                t[key] += float(value)
        if self.rank == 0:
            self.log.info(
                "train_step",
                step=self.step,
                reward=round(metrics["reward"], 4),
                solved=round(metrics["solved"], 4),
                lag=round(metrics["lag_mean"], 3),
                samples_per_s=round(self.counts["samples"] / max(elapsed, 1e-9), 2),
                **{
                    k: (round(v, 5) if isinstance(v, float) else v)
                    for k, v in metrics.items()
                    if k not in ("reward", "solved", "lag_mean")
                },
                stale=self.counts["stale"],
                **(self._distill_metrics() if self.config.distill.on else {}),
            )

    def _distill_metrics(self) -> dict[str, Any]:
        """``no_teacher`` and ``teacher_kl`` (since the last step: None without tokens)."""
        total, n = self._teacher_kl
        self._teacher_kl = [0.0, 0]
        return {
            "no_teacher": self.counts["no_teacher"],
            "teacher_kl": round(total / n, 5) if n else None,
        }

    # ---------------------------------------------------------------- publish
    async def _publish(self, version: int) -> None:
        if self.rank == 0:
            await self._engines_task  # engines known (and the weight group formed)
            if self._first_eval is not None:  # it measures the initial weights: let it end
                await self._first_eval
                self._first_eval = None
        if self._publish_task is not None:
            await self._publish_task  # one publish in flight at a time
            self._publish_task = None
        cfg = self.config.publish
        bucket = int(cfg.bucket_mb * 2**20)
        if cfg.snapshot or self.config.deepspeed.zero_stage == 3:
            weights = await asyncio.to_thread(self.trainer.snapshot, bucket)
            if self.rank == 0:
                named = list(weights.items())
                self._publish_task = asyncio.create_task(self._send(named, version, self.step))
        elif self.rank == 0:
            await self._send(lambda: self.trainer.named_weights(bucket), version, self.step)
        self.version = version

    async def _send(self, weights: Any, version: int, step: int) -> None:
        """Publish the weights of ``step`` as ``version``, then start its evaluation when one
        is due. ``step`` is the one the weights were taken at: a snapshot's publish runs on
        while the next steps train, and must not read ``self.step`` when it ends."""
        ok = await self.publishing.publish(weights, version)
        if ok and self.evaluator is not None and self.config.eval.every:
            if step % self.config.eval.every == 0 and step < self.config.steps:
                self._eval_due = (step, version)
                if self._eval_task is None or self._eval_task.done():
                    self._eval_task = asyncio.create_task(self._evaluations())
                else:  # run when the previous one ends (only the newest waits)
                    self.log.info("eval_deferred", step=step, policy_version=version)

    async def _evaluations(self) -> None:
        """Run due evaluations one after another; training goes on meanwhile."""
        while self._eval_due is not None:
            (step, version), self._eval_due = self._eval_due, None
            await self.evaluator.evaluate(self._eval_urls(), step=step, version=version)

    # ------------------------------------------------------------ checkpoints
    def _checkpoint_root(self) -> Path:
        return self.ctx.run_dir / "checkpoints"

    def _latest_checkpoint(self) -> Path | None:
        root = self._checkpoint_root()
        done = sorted(p.parent for p in root.glob("step-*/COMPLETE")) if root.exists() else []
        return done[-1] if done else None

    async def _checkpoint(self) -> None:
        path = self._checkpoint_root() / f"step-{self.step:06d}"
        if self.rank == 0:  # written again (a rerun of this step): not complete until it is
            (path / "COMPLETE").unlink(missing_ok=True)
        state = {
            "step": self.step,
            "version": self.version,
            "version_offset": self.offset,
            "counts": self.counts,
            "totals": self.totals,
        }
        # each rank's own groups (DeepSpeed keeps rank 0's client state only): those
        # part-trained in the steps saved here, so that on resume only the rest trains (every
        # group open: one with nothing trained yet must not pass for a copy later), and the
        # uids taken, to recognize copies after a resume
        groups = {
            "partial": {e[2]: sorted(e[4]) for e in self._open.values() if e[2]},
            "seen": list(self._seen),
        }
        started = time.perf_counter()
        await asyncio.to_thread(self._save_groups, path, groups)
        await asyncio.to_thread(self.trainer.save, str(path), state, self.config.model)
        if self.rank == 0:  # every rank has written (trainer.save ends at a barrier)
            (path / "COMPLETE").write_text(json.dumps(state))
            self.ctx.ledger.checkpoint(self.step)
            self._remove_old_checkpoints(keep=self.config.checkpoint.keep)
            self.log.info(
                "checkpoint_saved",
                path=str(path),
                step=self.step,
                seconds=round(time.perf_counter() - started, 3),
            )

    def _save_groups(self, path: Path, groups: dict[str, Any]) -> None:
        folder = path / "groups"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"rank-{self.rank}.json.tmp"
        tmp.write_text(json.dumps(groups))
        tmp.replace(folder / f"rank-{self.rank}.json")

    def _remove_old_checkpoints(self, *, keep: int) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older ones and any older folder
        left without its marker (a write or a removal cut short by a crash)."""
        folders = sorted(self._checkpoint_root().glob("step-*"))
        kept = [f for f in folders if (f / "COMPLETE").exists()][-keep:]
        for old in folders:
            if old in kept or old.name >= kept[0].name:
                continue
            (old / "COMPLETE").unlink(missing_ok=True)  # first: a removal cut short never loads
            shutil.rmtree(old, ignore_errors=True)

    # ----------------------------------------------------------------- ending
    async def _finish(self, started: float) -> None:
        if self._publish_task is not None:
            await self._publish_task
        if self.config.checkpoint.at_end and self.step > 0:
            await self._checkpoint()
        if self.rank != 0:
            return
        await self._engines_task
        for task in (self._first_eval, self._eval_task):
            if task is not None:
                await task
        summary: dict[str, Any] = {}
        if self.evaluator is not None:
            final = await self.evaluator.evaluate(
                self._eval_urls(), step=self.step, version=self.version
            )
            summary["eval_after"] = final["accuracy"]
            summary["evals"] = self.evaluator.history
        n = max(self.totals["n"], 1)
        passes = self.totals["passes_n"]

        def per_step(key: str) -> float | None:  # over the steps that had passes
            return self.totals[key] / passes if passes else None

        summary.update(
            steps=self.step,
            samples=self.counts["samples"],
            train_s=round(time.monotonic() - started, 3),
            mean_lag=self.totals["lag"] / n,
            tis_clip_frac=per_step("tis_clip_frac"),
            ess=per_step("ess"),
            mismatch_kl=per_step("mismatch_kl"),
            stale_dropped=self.counts["stale"],
            bad_groups=self.counts["bad_groups"],
            skipped_steps=self.counts["skipped_steps"],
            no_signal=self.counts["no_signal"],
            set_aside=self.counts["set_aside"],
            overlong_filtered=self.counts["overlong_filtered"],
            overlong_shaped=self.counts["overlong_shaped"],
            no_teacher=self.counts["no_teacher"],
            policy_version=self.version,
            publishes=self.publishing.counts,
        )
        await self.ctx.summary(**summary)
        self.log.info("learner_done", **{k: v for k, v in summary.items() if k != "evals"})
        self.ctx.request_stop(f"trained {self.step} steps")

    async def close(self) -> None:
        for task in (self._engines_task, self._first_eval, self._publish_task, self._eval_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.publishing is not None:
            await self.publishing.close()
        if self.evaluator is not None:
            await self.evaluator.close()
        await asyncio.to_thread(self.trainer.close)


class _Columns:
    """A ``scored_batch`` as its groups are read (``_Part.read``): its token columns as the
    trainer takes them, converted once for every group, and where each group lies."""

    __slots__ = ("batch", "cuts", "ids", "logprobs", "prompt_cuts", "prompts", "spans", "versions")

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch
        self.spans = rollout_batch.spans(batch)
        self.cuts = np.asarray(batch["completion_offsets"]).tolist()
        self.prompt_cuts = np.asarray(batch["prompt_offsets"]).tolist()
        self.prompts = np.asarray(batch["prompt_ids"], dtype=np.int64)
        self.ids = np.asarray(batch["completion_ids"], dtype=np.int64)
        self.logprobs = np.asarray(batch["sampler_logprobs"], dtype=np.float32)
        self.versions = np.asarray(batch["versions"], dtype=np.int64)


class _Part:
    """One group of a ``scored_batch``, taken as the ``scored_group`` it stands for (``data``,
    its map, made only where it is needed); ``entry``: [the message, its groups not yet
    processed]."""

    __slots__ = ("_data", "columns", "entry", "g")
    kind = SCORED_GROUP.kind

    def __init__(self, columns: _Columns, g: int, entry: list[Any]) -> None:
        self.columns, self.g, self.entry = columns, g, entry
        self._data: dict[str, Any] | None = None

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            spans, g = self.columns.spans, self.g
            self._data = rollout_batch.group_map(self.columns.batch, g, spans[g], spans[g + 1])
        return self._data

    @property
    def head(self) -> dict[str, Any]:
        """The group's own fields (``data`` without its samples)."""
        batch, g = self.columns.batch, self.g
        return {
            "group_id": batch["group_id"][g],
            "group_size": batch["group_size"],
            "uid": batch["uid"][g],
            "origin": batch["origin"],
        }

    def read(
        self,
    ) -> tuple[list[tuple[Any, ...]], list[float], list[str], list[int]] | None:
        """Its samples as ``_samples_of`` takes them, from the columns: each sample's
        ``_sample_arrays``, reward (float32), finish reason and index; None when the group
        cannot be read so (an empty prompt or completion: its map says what is wrong)."""
        c, g = self.columns, self.g
        lo, hi = c.spans[g], c.spans[g + 1]
        prompt = c.prompts[c.prompt_cuts[g] : c.prompt_cuts[g + 1]]
        cuts = c.cuts
        if not len(prompt) or any(cuts[k] == cuts[k + 1] for k in range(lo, hi)):
            return None
        rows = [
            (
                prompt,
                c.ids[cuts[k] : cuts[k + 1]],
                c.logprobs[cuts[k] : cuts[k + 1]],
                c.versions[cuts[k] : cuts[k + 1]],
                None,
            )
            for k in range(lo, hi)
        ]
        batch = c.batch
        rewards = np.asarray(batch["reward"][lo:hi], dtype=np.float32).tolist()
        indexes = np.asarray(batch["sample_index"][lo:hi]).tolist()
        return rows, rewards, batch["finish_reason"][lo:hi], indexes


def _inbox_empty(inbox: Any) -> bool:
    """Whether nothing waits in the learner's inbox (a port without statistics: not known)."""
    stats = getattr(inbox, "stats", None)
    return stats is not None and stats().get("depth", 1) == 0


def _oldest(versions: np.ndarray) -> int | None:
    """The smallest of ``versions`` (None if empty); short ones as Python ints, where numpy's
    reduction costs more than the list."""
    if versions.size > 64:
        return int(versions.min())
    return min(versions.tolist(), default=None)


def _sample_arrays(
    sample: dict[str, Any], group_prompt: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """One scored sample's ``(prompt, completion, sampler log-probs, versions, loss mask)``.

    ``prompt_ids`` of the sample (a rollout that rendered its own context) replaces the group's.
    ``loss_mask`` (1 = sampled by the model, 0 = inserted by a tool or an environment) is
    optional: absent, None, or all ones means every token was sampled (then None here). Raises
    ``ValueError`` (or ``KeyError``, ``TypeError``) naming what is malformed.
    """
    own = sample.get("prompt_ids")
    prompt = group_prompt if own is None else np.asarray(own, dtype=np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError("prompt_ids is empty (or not a flat list): a sample needs a context")
    ids = np.asarray(sample["completion_ids"], dtype=np.int64)
    lp = np.asarray(sample["sampler_logprobs"], dtype=np.float32)
    versions = np.asarray(sample["versions"], dtype=np.int64)
    if not (len(ids) == len(lp) == len(versions)) or len(ids) == 0:
        raise ValueError(
            "completion_ids, sampler_logprobs and versions differ in length (or are empty)"
        )
    raw = sample.get("loss_mask")
    if raw is None:
        return prompt, ids, lp, versions, None
    flags = np.asarray(raw)
    if flags.shape != ids.shape:
        raise ValueError(
            f"loss_mask has {flags.size} entries, completion_ids {len(ids)}: one per token"
        )
    if not np.isin(flags, (0, 1)).all():
        raise ValueError("loss_mask holds values other than 0 (inserted) and 1 (sampled)")
    mask = flags.astype(bool)
    return prompt, ids, lp, versions, None if mask.all() else mask


def _teacher_logprobs(sample: dict[str, Any], length: int) -> np.ndarray | None:
    """A scored sample's ``teacher_logprobs`` (float32, one per completion token), or None when
    it has none; ``ValueError`` when they are malformed."""
    raw = sample.get("teacher_logprobs")
    if raw is None:
        return None
    values = np.asarray(raw, dtype=np.float32)
    if values.shape != (length,):
        raise ValueError(
            f"teacher_logprobs has shape {values.shape}, completion_ids {length} tokens: one per "
            "token"
        )
    if not np.isfinite(values).all():
        raise ValueError("teacher_logprobs holds values that are not finite")
    return values


def _slots_of(group: Any) -> list[tuple[Any, Any, int]]:
    """The ledger slots of a group's samples, as far as a malformed group names them."""
    uid, size, items = group.get("uid"), group.get("group_size"), group.get("samples")
    if not isinstance(size, int) or not isinstance(items, list):
        return []
    indexes = [s.get("sample_index") for s in items if isinstance(s, dict)]
    return [(uid, size, i) for i in indexes if isinstance(i, int) and 0 <= i < size]


def _load_groups(
    checkpoint: Path, earlier: dict[str, Any] | None = None
) -> tuple[dict[str, set[int]], OrderedDict[str, None]]:
    """Every rank's open groups and taken uids, merged: a group (or a copy of one) may come to
    any rank after a resume, with as many ranks as before or not. ``earlier``: the client state
    of a checkpoint written before ranks saved their own (rank 0's groups only)."""
    partial: dict[str, set[int]] = {}
    seen: OrderedDict[str, None] = OrderedDict()
    files = sorted((checkpoint / "groups").glob("rank-*.json"))
    every = [json.loads(path.read_text()) for path in files] or [earlier or {}]
    for groups in every:
        groups = {"partial": {}, "seen": [], **groups}
        for uid, indexes in groups["partial"].items():
            partial.setdefault(uid, set()).update(indexes)
        seen.update(OrderedDict.fromkeys(groups["seen"]))
    while len(seen) > _SEEN_UIDS:
        seen.popitem(last=False)
    return partial, seen
