"""The reward scorer stage: rollouts in, one scored group per prompt out.

A ``rollout_batch`` (what the generator sends) brings several prompts' groups as columns, and the
message is acknowledged with its last group. When it is as a generator makes it (each group's
samples once and in index order) its whole groups are scored from the columns: the reward arguments
are read from them and the scored groups go on as columns too (a ``scored_batch``: the batch's
columns and their rewards, no map made per sample). Otherwise each group is filed as the
``rollout_group`` it stands for. A ``rollout_group`` brings a prompt's samples at once; ``rollout``
messages (one sample each, from a producer of your own) are collected by ``group_id`` until
``group_size`` have arrived. Either way the whole group is then decoded (``skip_special_tokens``)
and scored, and sent as one ``scored_group`` (samples in ``sample_index`` order, each with
``reward`` and ``reward_info``). A trajectory (a sample with a ``loss_mask``: turns with tokens a
tool or an environment inserted) is scored on its final answer: ``completions`` is what the model
sampled after the last inserted token, ``trajectories`` the whole text, ``env_reward`` the
environment's reward (the ``env_reward`` reward function passes it on) and ``rollout`` what the
rollout reported (turns, tool calls...). Complete groups waiting while every worker is busy are
scored together in one call (up to ``batch_groups``; a function sees each group's samples next to
each other, like a TRL batch), so the cost of a call is shared; so are groups that complete in the
same turn of the event loop (a burst the generator sent together). Once a full batch waits and
every worker is busy the stage stops reading, and backpressure reaches the generators.

Reward functions run in worker processes under ``timeout_s`` (``runner.py``): one that raises,
hangs or returns garbage gives its completions reward 0 with an ``error`` in ``reward_info``,
and the stage goes on. With ``workers: 0`` they run in this stage's event loop instead (cheap,
trusted functions: no hand-over to a process, no time limit; raising or garbage still gives 0).
Rewards behind HTTP (``url``: a reward server; ``reward_model``: a reward model on an engine's
``/classify``; ``judge``: a generative judge on an engine; ``remote.py``) run on this event
loop whatever ``workers`` is, with their own time limits, retries and bound on calls in flight;
a call that fails gives its samples 0 the same way.
A group still incomplete ``group_timeout_s`` after its first sample (a
sample lost upstream), or at the end of input, is sent with what it has if that is at least
``min_group`` samples, else dropped; so is a ``rollout_group`` that comes with fewer than
``group_size`` samples (the generator dropped some, and counted them). Malformed rollouts
(per-token arrays of different lengths, ``sample_index`` outside the group, a duplicate, a
``group_size`` that disagrees with the group's, a sample for a group already sent or dropped,
a group's sample that is not a full rollout) are dropped. Every drop is counted and logged.
A message counts as processed (acknowledged, so the generator stops keeping it) once the learner
has acknowledged its scored group, or the group was dropped: a scorer killed while scoring gets
those groups again, and so does one killed after sending them (were the learner to lose them).
With a ``teacher`` (on-policy distillation, ``teacher.py``) every scored sample also goes to a
teacher engine, alongside its rewards, for the teacher's log-prob of each completion token: the
sample then carries ``teacher_logprobs``; where the teacher failed it does not (counted and
logged there), and the group is sent all the same.
Not here: advantages or any normalization across a group (the learner does that).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.stage import Port, StageContext
from stages import rollout_batch
from stages.hub import resolve_model, tokenizer_check
from stages.light_tokenizer import load_tokenizer
from stages.schemas import (
    OPTIONAL_SAMPLE_FIELDS,
    ROLLOUT,
    ROLLOUT_BATCH,
    ROLLOUT_GROUP,
    SAMPLE_FIELDS,
    SCORED_BATCH,
    SCORED_GROUP,
)
from stages.scorer.arguments import completion_arguments, reward_arguments
from stages.scorer.runner import EngineSite, RewardRunner
from stages.scorer.spec import RewardSpec
from stages.scorer.teacher import TeacherSpec
from transport.message import Message, Schema

__all__ = ["RewardSpec", "Scorer", "ScorerConfig"]

# A rollout_group's own fields are checked as its message is; a sample that repeats none of
# them need only be checked for the rollout fields it brings (the same check, cheaper).
_HEAD_FIELDS = frozenset(ROLLOUT_GROUP.fields)
_SAMPLE = Schema(
    ROLLOUT.kind,
    ROLLOUT.version,
    {name: spec for name, spec in ROLLOUT.fields.items() if ROLLOUT_GROUP.fields.get(name) != spec},
)
_CLOSED_REMEMBERED = 10_000  # ids of sent or dropped groups kept to recognize late samples


@dataclass
class ScorerConfig:
    rewards: list[RewardSpec] = field(
        metadata={
            "doc": "reward functions (fn), reward servers (url), reward models (reward_model) "
            "and judges (judge); a sample's reward is their weighted sum"
        }
    )
    tokenizer: str = field(
        metadata={
            "doc": "model folder or Hub id (org/name[@revision]) whose tokenizer decodes "
            "completions",
            "path": "model",
            "check": tokenizer_check,
        }
    )
    workers: int = field(
        default=2,
        metadata={
            "min": 0,
            "doc": "reward worker processes (scoring calls run at once); 0: the functions run in "
            "this process's event loop, one call at a time, without timeout_s (cheap functions "
            "you trust, such as the built-in ones: no hand-over to a process). url and judge "
            "rewards run on the event loop whatever it is (no process starts for them alone); "
            "it bounds the scoring calls at once, their own concurrency the HTTP calls",
        },
    )
    batch_groups: int = field(
        default=64, metadata={"min": 1, "doc": "most complete groups scored in one call"}
    )
    timeout_s: float = field(
        default=10.0,
        metadata={
            "min": 0.01,
            "doc": "limit for one reward function on one call (url and judge rewards: their "
            "own timeout_s per HTTP call)",
        },
    )
    group_timeout_s: float = field(
        default=120.0, metadata={"min": 0.01, "doc": "an incomplete group is closed after this"}
    )
    min_group: int = field(
        default=2, metadata={"min": 1, "doc": "fewest samples an incomplete group is sent with"}
    )
    metrics_every_s: float = field(
        default=5.0, metadata={"min": 0.01, "doc": "period of metrics (reward over the period)"}
    )
    teacher: TeacherSpec | None = field(
        default=None,
        metadata={
            "doc": "on-policy distillation: an engine serving the teacher model, which gives each "
            "scored sample its log-prob of every completion token (teacher_logprobs, for the "
            "learner's distill); it must share the student's tokenizer"
        },
    )

    def __post_init__(self) -> None:
        names = [r.name for r in self.rewards]
        if not names:
            raise ValueError("`rewards` needs at least one reward function")
        if len(set(names)) != len(names):
            raise ValueError(f"`rewards` lists a reward more than once: {names} (give each a name)")


@dataclass
class _Group:
    head: Mapping[str, Any]  # the first rollout: the group-level fields come from it
    started: float  # monotonic time its first sample arrived
    samples: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    # a whole group of a rollout_batch in order, left as columns: (batch, g, lo, hi), group g
    # of the batch, its samples lo:hi (``rollout_batch.take``); ``samples`` is then empty
    cols: tuple[Mapping[str, Any], int, int, int] | None = None

    @property
    def size(self) -> int:
        return self.head["group_size"]

    def sample_maps(self) -> list[Mapping[str, Any]]:
        """Its samples in index order, as rollouts (those of a group left as columns made)."""
        if self.cols is None:
            return [self.samples[i] for i in sorted(self.samples)]
        group = rollout_batch.group_map(*self.cols)
        for sample in group["samples"]:
            sample["meta"] = group["meta"]  # as a rollout carries it (reward_arguments)
        return group["samples"]


async def _nothing(samples: list[Any]) -> list[None]:
    """No teacher: no teacher log-probs for any sample."""
    return [None] * len(samples)


def _load_tokenizer(spec: str) -> Any:
    path = resolve_model(spec, what="tokenizer", needs="tokenizer")  # a folder or a Hub id
    try:  # transformers (and torch) only for a folder whose tokenizer needs them
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {path}: cannot load it ({exc})") from exc


class Scorer:
    Config = ScorerConfig
    shares_process = True  # its work is on its event loop or threads: it may share a process
    keeps_ledger = True  # reports where its samples end (pipeline.ledger)
    inputs = {
        # a message is processed once the learner has processed its scored group, or once the
        # group was dropped (counted)
        "rollouts": Port(
            ROLLOUT_GROUP,
            ROLLOUT,
            ROLLOUT_BATCH,
            doc="sampled completions: whole groups (one, or several as columns), or samples in "
            "any order",
            ack="manual",
        )
    }
    outputs = {
        "groups": Port(
            SCORED_GROUP,
            doc="one message per prompt, scored (or a scoring call's groups as one scored_batch, "
            "where the learner takes it)",
            if_accepted=(SCORED_BATCH,),
        )
    }

    def __init__(self, config: ScorerConfig, ctx: StageContext) -> None:
        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.runner: RewardRunner | None = None
        self.teacher: Any = None  # a Teacher (teacher.py) when config.teacher is set
        self._calls_at_once = max(1, config.workers)  # workers: 0 scores in the loop, one call
        self.pending: dict[str, _Group] = {}
        self._sources: dict[str, list[Message]] = {}  # group id -> its messages, not yet acked
        # a rollout_batch's groups not yet released: id(message) -> [message, groups left]
        self._batch_left: dict[int, list[Any]] = {}
        self._launched: set[str] = set()  # group ids queued for scoring or being scored
        # scored groups sent, not yet acknowledged by the learner: send seq -> their group ids
        # (their messages stay unacknowledged upstream until then)
        self._awaiting_ack: dict[int, list[str]] = {}
        self._acked_early: set[int] = set()  # acknowledged before send_many returned
        self._chained = False
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.counts = {
            "rollouts_in": 0,
            "groups_in": 0,
            "groups_out": 0,
            "groups_partial": 0,
            "groups_dropped": 0,
            "samples": 0,
            "dropped": 0,
        }
        self.window: list[float] = []  # rewards scored since the last metrics event
        self._tasks: set[asyncio.Task] = set()
        self.ready: list[_Group] = []  # complete groups waiting for a worker
        self.busy = 0  # scoring calls in flight
        self._kick_pending = False  # a _kick is scheduled for the end of this loop turn
        self._room = asyncio.Event()

    async def setup(self) -> None:
        groups = self.ctx.outputs["groups"]
        if hasattr(groups, "on_ack"):
            groups.on_ack(self._acked)
            self._chained = True
        self.runner = RewardRunner(
            self.config.rewards,
            workers=self.config.workers,
            timeout_s=self.config.timeout_s,
            log=self.log,
            site=self._engine_site(),
        )
        # both take seconds (importing transformers, starting workers): overlap them
        tokenizer, started = await asyncio.gather(
            asyncio.to_thread(_load_tokenizer, self.config.tokenizer),
            self.runner.start(),
            return_exceptions=True,
        )
        for outcome in (tokenizer, started):
            if isinstance(outcome, BaseException):
                raise outcome
        self.tokenizer = tokenizer
        if self.config.teacher is not None:
            from stages.scorer.teacher import Teacher

            site = self._engine_site()
            self.teacher = Teacher(
                self.config.teacher,
                self.log,
                api_key=site.api_key,
                name=site.name,
                log_dir=site.log_dir,
                log_level=site.log_level,
            )
            await self.teacher.start(tokenizer, _load_tokenizer)
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()

    def _engine_site(self) -> EngineSite:
        """Where the engines this stage starts (a teacher's, a reward model's) log, and the
        run's engine key they take."""
        from stages.engine.auth import engine_api_key

        return EngineSite(
            name=f"{self.ctx.stage}.{self.ctx.replica}",
            log_dir=getattr(self.ctx, "log_dir", self.ctx.run_dir / "logs"),
            api_key=engine_api_key(self.ctx),
            log_level=getattr(self.ctx, "log_level", "info"),
        )

    # ------------------------------------------------------------------- run
    async def run(self) -> None:
        background = [
            asyncio.create_task(self._expire(), name="expire"),
            asyncio.create_task(self._report(), name="metrics"),
        ]
        for task in background:
            task.add_done_callback(self._fail_on_error)
        reader = asyncio.create_task(self._read(), name="read")
        try:
            # a task that fails (a scoring task's send, a broken worker pool) fails the stage
            await asyncio.wait([reader, self.failed], return_when=asyncio.FIRST_COMPLETED)
            if self.failed.done():
                self.failed.result()
            reader.result()
            while self._tasks:
                await asyncio.wait([*self._tasks, self.failed], return_when=asyncio.FIRST_COMPLETED)
                if self.failed.done():
                    self.failed.result()
        finally:
            for task in [reader, *background]:
                task.cancel()
            await asyncio.gather(reader, *background, return_exceptions=True)
        self._metrics()
        self.log.info("scorer_done", **self._totals())

    async def _read(self) -> None:
        async for msg in self.ctx.inputs["rollouts"]:
            if msg.kind == ROLLOUT_BATCH.kind:
                await self._add_batch(msg)
                continue
            group_id = msg.data["group_id"]
            self._sources.setdefault(group_id, []).append(msg)
            if msg.kind == ROLLOUT_GROUP.kind:
                await self._add_group(msg.data, msg.sender)
            else:
                self.counts["rollouts_in"] += 1
                group = self._add(msg.data, msg.sender)
                if group is not None:
                    await self._launch(group)
            if group_id not in self.pending and group_id not in self._launched:
                self._release(group_id)  # dropped, or late for a group already sent
        for group_id in list(self.pending):
            await self._close_incomplete(group_id, "end_of_input")

    def _add(self, rollout: Mapping[str, Any], sender: str) -> _Group | None:
        """File ``rollout`` under its group; returns the group when that completes it."""
        group_id = rollout["group_id"]
        group = self.pending.get(group_id)
        problem = self._problem(rollout, group)
        if problem is not None:
            self._dropped(rollout, problem, problem, sender)
            return None
        if group is None:
            group = self.pending[group_id] = _Group(rollout, time.monotonic())
        group.samples[rollout["sample_index"]] = rollout
        if len(group.samples) < group.size:
            return None
        self._forget(group_id)
        return group

    async def _add_batch(self, msg: Message) -> None:
        """A ``rollout_batch``: each of its groups as a ``rollout_group`` of its own; the message
        is acknowledged once every one of them is released."""
        batch = msg.data
        problems = rollout_batch.problems(batch)
        if problems:  # its columns do not line up: none of its samples can be read
            size = batch["group_size"]
            uids = [u for u in batch["uid"] if isinstance(u, str)]
            self.counts["dropped"] += size * len(batch["group_id"])
            self.ctx.ledger.fates(
                ((uid, size, i) for uid in uids for i in range(max(0, size))), "malformed"
            )
            self.ctx.inputs["rollouts"].ack(msg)
            self.log.warning(
                "rollout_batch_dropped",
                reason="; ".join(problems),
                groups=len(batch["group_id"]),
                sender=msg.sender,
            )
            return
        ids = batch["group_id"]
        if not ids:  # nothing in it to wait for
            self.ctx.inputs["rollouts"].ack(msg)
            return
        self._batch_left[id(msg)] = [msg, len(ids)]
        known = any(g in self.pending or g in self.closed for g in ids)
        if not known and rollout_batch.in_order(batch):
            # what a generator sends: each group complete (left as columns), or all it gets
            await self._add_columns(msg)
            return
        heads = rollout_batch.groups(batch)
        if known or not rollout_batch.well_formed(batch):
            # a sample to drop, or a group already open or closed: one sample at a time
            for head in heads:
                group_id = head["group_id"]
                self._sources.setdefault(group_id, []).append(msg)
                await self._add_group(head, msg.sender, checked=True)
                if group_id not in self.pending and group_id not in self._launched:
                    self._release(group_id)
            return
        now = time.monotonic()  # each group's samples known to be well formed, out of order
        for head in heads:
            await self._add_samples(msg, head, head.pop("samples"), now)

    async def _add_columns(self, msg: Message) -> None:
        """A batch in order: each whole group is scored from the batch's columns; one the
        generator dropped samples of is filed as a ``rollout_group`` would be."""
        batch = msg.data
        size, ids = batch["group_size"], batch["group_id"]
        cuts = rollout_batch.spans(batch)
        prompt_cuts = np.asarray(batch["prompt_offsets"]).tolist()
        now = time.monotonic()
        partial = None
        for g, group_id in enumerate(ids):
            lo, hi = cuts[g], cuts[g + 1]
            if hi - lo != size:  # samples dropped upstream: the group's maps, as they come
                if partial is None:
                    partial = rollout_batch.groups(batch)
                await self._add_samples(msg, partial[g], partial[g].pop("samples"), now)
                continue
            self._sources.setdefault(group_id, []).append(msg)
            self.counts["groups_in"] += 1
            self.counts["rollouts_in"] += size
            head = {
                "run_id": batch["run_id"],
                "prompt_id": batch["prompt_id"][g],
                "group_id": group_id,
                "group_size": size,
                "meta": batch["meta"][g],
                "uid": batch["uid"][g],
                "origin": batch["origin"],
                "prompt_ids": batch["prompt_ids"][prompt_cuts[g] : prompt_cuts[g + 1]],
            }
            self._remember_closed(group_id)
            await self._launch(_Group(head, now, cols=(batch, g, lo, hi)))

    async def _add_samples(
        self, msg: Message, head: Mapping[str, Any], samples: list[Any], now: float
    ) -> None:
        """A group of a batch whose samples are known to be well formed: scored whole, or with
        all it will get (the generator dropped some)."""
        group_id = head["group_id"]
        self._sources.setdefault(group_id, []).append(msg)
        self.counts["groups_in"] += 1
        self.counts["rollouts_in"] += len(samples)
        meta = head["meta"]
        for sample in samples:
            sample["meta"] = meta  # as a rollout carries it (reward_arguments)
        group = _Group(head, now, {s["sample_index"]: s for s in samples})
        if len(samples) == group.size:
            self._remember_closed(group_id)
            await self._launch(group)
        else:
            self.pending[group_id] = group
            await self._close_incomplete(group_id, "samples_dropped_upstream")
        if group_id not in self._launched:
            self._release(group_id)  # dropped, and counted

    async def _add_group(self, data: Mapping[str, Any], sender: str, checked: bool = False) -> None:
        """A ``rollout_group``: file its samples, then score it as it is (all it will get).
        ``checked``: its samples are known to be well formed (a ``rollout_batch``'s)."""
        self.counts["groups_in"] += 1
        group_id = data["group_id"]
        head = {k: v for k, v in data.items() if k != "samples"}
        complete: _Group | None = None
        for sample in data["samples"]:
            self.counts["rollouts_in"] += 1
            # the sample maps are not checked on receipt: check each as a rollout (the group's
            # own fields were, as its message's: only a sample's own, unless it repeats one)
            rollout = {**head, **sample} if isinstance(sample, Mapping) else {}
            if checked:
                shape = []
            elif not rollout:
                shape = ["a sample is not a map"]
            elif _HEAD_FIELDS.isdisjoint(sample):
                shape = _SAMPLE.check(sample)
            else:
                shape = ROLLOUT.check(rollout)
            if shape:
                self._dropped(rollout, "; ".join(shape), "malformed", sender)
                continue
            if complete is not None:  # the group is whole: a sample more is a copy of one
                index = rollout["sample_index"]
                reason = (
                    f"duplicate sample_index {index}"
                    if index in complete.samples
                    else f"sample_index {index} is outside 0..{complete.size - 1}"
                )
                self._dropped(rollout, reason, reason, sender)
                continue
            complete = self._add(rollout, sender)
        if complete is not None:
            await self._launch(complete)
        else:
            await self._close_incomplete(group_id, "samples_dropped_upstream")

    def _dropped(self, rollout: Mapping[str, Any], reason: str, fate: str, sender: str) -> None:
        """A sample dropped for ``reason``: counted, logged, in the ledger as ``fate``
        (``_ledger_drop``)."""
        self._ledger_drop(rollout, fate)
        self.counts["dropped"] += 1
        self.log.warning(
            "rollout_dropped",
            reason=reason,
            group_id=rollout.get("group_id"),
            sample_index=rollout.get("sample_index"),
            sender=sender,
        )

    def _problem(self, rollout: Mapping[str, Any], group: _Group | None) -> str | None:
        if rollout["group_id"] in self.closed:
            return "late: its group was already sent or dropped"
        size, index = rollout["group_size"], rollout["sample_index"]
        if size < 1:
            return f"group_size {size} < 1"
        if not 0 <= index < size:
            return f"sample_index {index} is outside 0..{size - 1}"
        per_token = ("completion_ids", "sampler_logprobs", "versions")
        lengths = {k: len(rollout[k]) for k in per_token}
        if rollout.get("loss_mask") is not None:
            lengths["loss_mask"] = len(rollout["loss_mask"])
        if len(set(lengths.values())) > 1:
            return f"per-token arrays differ in length: {lengths}"
        if group is not None and size != group.size:
            return f"group_size {size} differs from the group's {group.size}"
        if group is not None and index in group.samples:
            return f"duplicate sample_index {index}"
        return None

    def _ledger_drop(self, rollout: Mapping[str, Any], problem: str) -> None:
        """A sample dropped: a second copy of one we have is not a fate of its own."""
        uid, size = rollout.get("uid"), rollout.get("group_size")
        index = rollout.get("sample_index")
        if not (isinstance(size, int) and isinstance(index, int) and 0 <= index < size):
            return  # no slot to name: a sample of no group (its slot shows as unaccounted)
        if problem.startswith("duplicate"):
            self.ctx.ledger.copies(uid, size, [index])
        else:
            reason = "late" if problem.startswith("late") else "malformed"
            self.ctx.ledger.fates([(uid, size, index)], reason)

    def _release(self, group_id: str) -> None:
        """The group was processed downstream or dropped: acknowledge the messages it came in."""
        port = self.ctx.inputs["rollouts"]
        for msg in self._sources.pop(group_id, ()):
            left = self._batch_left.get(id(msg))
            if left is not None:  # a rollout_batch: acknowledged with its last group
                left[1] -= 1
                if left[1] > 0:
                    continue
                del self._batch_left[id(msg)]
            port.ack(msg)

    def _forget(self, group_id: str) -> None:
        del self.pending[group_id]
        self._remember_closed(group_id)

    def _remember_closed(self, group_id: str) -> None:
        self.closed[group_id] = None
        if len(self.closed) > _CLOSED_REMEMBERED:
            self.closed.popitem(last=False)

    async def _close_incomplete(self, group_id: str, reason: str) -> None:
        group = self.pending.get(group_id)
        if group is None:  # completed or closed while we waited for a scoring slot
            return
        self._forget(group_id)
        have = len(group.samples)
        if have >= self.config.min_group:
            self.counts["groups_partial"] += 1
            self.log.info(
                "group_incomplete", group_id=group_id, reason=reason, samples=have, of=group.size
            )
            await self._launch(group)
        else:
            self.counts["groups_dropped"] += 1
            self.counts["dropped"] += have
            head = group.head
            self.ctx.ledger.fates(
                ((head.get("uid"), group.size, i) for i in group.samples), "incomplete_group"
            )
            self._release(group_id)
            self.log.warning(
                "group_dropped",
                group_id=group_id,
                reason=reason,
                samples=have,
                of=group.size,
                min_group=self.config.min_group,
            )

    async def _expire(self) -> None:
        limit = self.config.group_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for group_id in [g for g, grp in self.pending.items() if now - grp.started >= limit]:
                await self._close_incomplete(group_id, "timeout")

    # ------------------------------------------------------------------- scoring
    async def _launch(self, group: _Group) -> None:
        """Queue ``group`` for scoring; waits (stops reading) while a full batch is queued."""
        self._launched.add(group.head["group_id"])
        self.ready.append(group)
        if len(self.ready) >= self.config.batch_groups:
            self._kick()
        elif not self._kick_pending:  # groups completed in this loop turn: one call for all
            self._kick_pending = True
            asyncio.get_running_loop().call_soon(self._kick)
        while len(self.ready) >= self.config.batch_groups and self.busy >= self._calls_at_once:
            self._room.clear()
            await self._room.wait()

    def _kick(self) -> None:
        """Start scoring calls for the queued groups while workers are free."""
        self._kick_pending = False
        while self.ready and self.busy < self._calls_at_once:
            batch = self.ready[: self.config.batch_groups]
            self.ready = self.ready[self.config.batch_groups :]
            self.busy += 1
            task = asyncio.create_task(self._score(batch))
            self._tasks.add(task)
            task.add_done_callback(self._scored)

    def _scored(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.busy -= 1
        self._fail_on_error(task)
        self._kick()
        self._room.set()

    def _fail_on_error(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.failed.done():
            self.failed.set_exception(task.exception())

    async def _score(self, batch: list[_Group]) -> None:
        assert self.runner is not None
        if self.teacher is None and all(g.cols is not None for g in batch):
            await self._score_columns(batch)
            return
        started = time.monotonic()
        per_group = [g.sample_maps() for g in batch]
        flat = [sample for samples in per_group for sample in samples]
        kwargs = self._reward_kwargs([g.head for g in batch], per_group)
        ids = [g.head["group_id"] for g in batch]
        context = {"group_id": ids[0] if len(ids) == 1 else f"{ids[0]} (+{len(ids) - 1} groups)"}
        scored, taught = await asyncio.gather(
            self.runner.score(kwargs, **context),
            self.teacher.logprobs(flat, context) if self.teacher is not None else _nothing(flat),
        )
        score_s = round(time.monotonic() - started, 6)
        offset = 0
        payloads = []
        for group, samples in zip(batch, per_group, strict=True):
            out = []
            span = slice(offset, offset + len(samples))
            for sample, (reward, info), teacher in zip(
                samples, scored[span], taught[span], strict=True
            ):
                item = {k: sample[k] for k in SAMPLE_FIELDS}
                item.update((k, sample[k]) for k in OPTIONAL_SAMPLE_FIELDS if k in sample)
                item["timings"] = {**sample["timings"], "score_s": score_s}
                item["reward"], item["reward_info"] = reward, info
                if teacher is not None:
                    item["teacher_logprobs"] = teacher
                out.append(item)
                self.window.append(reward)
            offset += len(samples)
            head = group.head
            payloads.append(
                {
                    "run_id": head["run_id"],
                    "prompt_id": head["prompt_id"],
                    "group_id": head["group_id"],
                    "group_size": head["group_size"],
                    "prompt_ids": head["prompt_ids"],
                    "samples": out,
                    "meta": head.get("meta"),
                    "uid": head.get("uid"),
                    "origin": head.get("origin"),  # the learner counts its generators
                }
            )
        sent = await self._send(payloads)
        for payload in payloads:
            self.counts["groups_out"] += 1
            self.counts["samples"] += len(payload["samples"])
            self._launched.discard(payload["group_id"])
        self._sent(sent)

    async def _score_columns(self, groups: list[_Group]) -> None:
        """``_score`` for groups left as columns (``_Group.cols``): the reward arguments are
        read from the columns, and the scored groups go on as columns, their rewards added,
        with no map made per sample."""
        assert self.runner is not None
        started = time.monotonic()
        ids = [g.head["group_id"] for g in groups]
        context = {"group_id": ids[0] if len(ids) == 1 else f"{ids[0]} (+{len(ids) - 1} groups)"}
        scored = await self.runner.score(self._column_kwargs(groups), **context)
        score_s = round(time.monotonic() - started, 6)
        self.window.extend(reward for reward, _ in scored)
        # one scored_batch per (run, generator session, group size), as _send makes them
        by_source: dict[tuple, list[tuple[_Group, list[tuple[float, dict]]]]] = {}
        row = 0
        for group in groups:
            n = group.cols[3] - group.cols[2]  # type: ignore[index]
            key = (group.head["run_id"], group.head["origin"], group.size)
            by_source.setdefault(key, []).append((group, scored[row : row + n]))
            row += n
        sent = []
        for (run_id, origin, group_size), members in by_source.items():
            sent += await self._send_columns(members, run_id, group_size, origin, score_s)
        for g in groups:
            self.counts["groups_out"] += 1
            self.counts["samples"] += g.size
            self._launched.discard(g.head["group_id"])
        self._sent(sent)

    def _sent(self, sent: list[tuple[Any, list[str]]]) -> None:
        """Scored groups sent (each send's seq and its group ids): released once the learner
        has acknowledged them."""
        for seq, group_ids in sent:
            if isinstance(seq, int) and self._chained and seq not in self._acked_early:
                self._awaiting_ack[seq] = group_ids  # released once the learner is done
            else:
                self._acked_early.discard(seq)
                for group_id in group_ids:
                    self._release(group_id)

    async def _send(self, payloads: list[dict[str, Any]]) -> list[tuple[Any, list[str]]]:
        """Send a scoring call's groups: as ``scored_batch`` messages where the learner takes
        them (single-turn groups; one per generator session, cut to what the learner with the
        most credit has room for), else a ``scored_group`` each (in one ``send_many`` to a
        learner in another process). Each send's seq and its group ids."""
        port = self.ctx.outputs["groups"]
        sends = getattr(port, "sends", None)
        if (
            sends is not None
            and sends(SCORED_BATCH.kind)
            and all(map(rollout_batch.fits, payloads))
        ):
            by_source: dict[tuple, list[dict[str, Any]]] = {}
            for payload in payloads:
                key = (payload["run_id"], payload["origin"], payload["group_size"])
                by_source.setdefault(key, []).append(payload)
            out = []
            for (run_id, origin, size), heads in by_source.items():
                while heads:  # no more groups at once than a learner has room for (as send_many)
                    room = port.room() if hasattr(port, "room") else len(heads)
                    take, heads = heads[: max(1, room)], heads[max(1, room) :]
                    batch = rollout_batch.pack(take, run_id, size, origin, scored=True)
                    seq = await port.send(SCORED_BATCH.kind, batch)
                    out.append((seq, [h["group_id"] for h in take]))
            return out
        if hasattr(port, "send_many"):  # to a learner in another process: one send for all
            seqs = await port.send_many("scored_group", payloads)
        else:
            seqs = [await port.send("scored_group", payload) for payload in payloads]
        return [(seq, [p["group_id"]]) for seq, p in zip(seqs, payloads, strict=True)]

    async def _send_columns(
        self,
        members: list[tuple[_Group, list[tuple[float, dict]]]],
        run_id: str,
        group_size: int,
        origin: str | None,
        score_s: float,
    ) -> list[tuple[Any, list[str]]]:
        """Send one generator session's groups left as columns, with their rewards, as
        ``scored_batch`` messages where the learner takes them (no more groups in one than the
        learner with the most credit has room for), else as a ``scored_group`` each
        (``_send``). Each send's seq and its group ids."""
        port = self.ctx.outputs["groups"]
        sends = getattr(port, "sends", None)
        columns = sends is not None and sends(SCORED_BATCH.kind)
        out = []
        while members:  # no more groups at once than a learner has room for (as send_many)
            room = len(members)
            if columns and hasattr(port, "room"):
                # none: wait for some, then send as much as it allows (not one group now and
                # the rest behind it)
                room = await port.wait_for_room() if hasattr(port, "wait_for_room") else port.room()
            take, members = members[: max(1, room)], members[max(1, room) :]
            parts = [g.cols for g, _ in take]
            batch = rollout_batch.take(parts, run_id, group_size, origin)  # type: ignore[arg-type]
            results = [result for _, part in take for result in part]
            batch["reward"] = np.asarray([reward for reward, _ in results], dtype=np.float32)
            batch["reward_info"] = [info for _, info in results]
            batch["score_s"] = np.full(len(results), score_s)
            if not columns:
                out += await self._send(rollout_batch.groups(batch))
                continue
            seq = await port.send(SCORED_BATCH.kind, batch)
            out.append((seq, [g.head["group_id"] for g, _ in take]))
        return out

    def _column_kwargs(self, groups: list[_Group]) -> dict[str, list]:
        """``_reward_kwargs`` for groups left as columns, read from their batches' columns."""
        prompts: list[str] = []
        ids: list[list[int]] = []
        finish: list[str] = []
        metas: list[Any] = []
        tokens: dict[int, tuple[list[int], list[int]]] = {}  # id(batch) -> its ids, offsets
        for group in groups:
            batch, g, lo, hi = group.cols  # type: ignore[misc]
            read = tokens.get(id(batch))
            if read is None:
                read = tokens[id(batch)] = (
                    np.asarray(batch["completion_ids"]).tolist(),
                    np.asarray(batch["completion_offsets"]).tolist(),
                )
            flat, cuts = read
            prompts += [self._prompt_text(group.head)] * (hi - lo)
            ids += [flat[cuts[k] : cuts[k + 1]] for k in range(lo, hi)]
            finish += batch["finish_reason"][lo:hi]
            metas += [batch["meta"][g]] * (hi - lo)
        return completion_arguments(self.tokenizer, prompts, ids, finish, metas)

    def _acked(self, seq: int) -> None:
        """The learner is done with scored groups: release the messages they came in. (One of a
        ``send_many`` may be acknowledged while later ones still wait for credit.)"""
        group_ids = self._awaiting_ack.pop(seq, None)
        if group_ids is None:
            self._acked_early.add(seq)
        else:
            for group_id in group_ids:
                self._release(group_id)

    def _reward_kwargs(
        self, heads: list[Mapping[str, Any]], per_group: list[list[Mapping[str, Any]]]
    ) -> dict[str, list]:
        """The keyword lists every reward function gets, aligned with the samples of every
        group (``heads``: each group's own fields) in order, in one call: a key only some
        samples have (their meta) is None for the others'."""
        prompts = [
            text
            for head, samples in zip(heads, per_group, strict=True)
            for text in [self._prompt_text(head)] * len(samples)
        ]
        flat = [sample for samples in per_group for sample in samples]
        return reward_arguments(self.tokenizer, prompts, flat)

    def _prompt_text(self, head: Mapping[str, Any]) -> str:
        """The group's prompt as reward functions get it: its text, else its ids decoded."""
        prompt = (head.get("meta") or {}).get("text")
        if not isinstance(prompt, str):
            prompt = self.tokenizer.decode([int(t) for t in head["prompt_ids"]])
        return prompt

    # ------------------------------------------------------------------- metrics
    def _totals(self) -> dict[str, Any]:
        runner = self.runner.stats() if self.runner is not None else {}
        return {
            **self.counts,
            "errors": runner.get("errors", 0),
            "timeouts": runner.get("timeouts", 0),
            "worker_restarts": runner.get("restarts", 0),
            # HTTP rewards: their retries, split calls, and failed samples by kind
            **{
                k: v
                for k, v in runner.items()
                if k in ("http_retries", "http_split_calls") or k.startswith("failed_")
            },
            **(self.teacher.stats() if self.teacher is not None else {}),
            "groups_pending": len(self.pending),
            "groups_scoring": len(self._tasks),
            "groups_ready": len(self.ready),
        }

    def _metrics(self) -> None:
        window, self.window = self.window, []
        self.ctx.metrics(
            reward_mean=sum(window) / len(window) if window else None,
            accuracy=sum(r > 0 for r in window) / len(window) if window else None,
            window_samples=len(window),
            **self._totals(),
        )

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_every_s)
            self._metrics()

    async def close(self) -> None:
        # Nothing more starts: a cancelled scoring task's callback would start the next batch,
        # on workers about to be killed (a false `reward_failed` at every normal end). Queued
        # groups stay unacknowledged upstream, so they are sent again to a restarted scorer.
        self.ready.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        failed = getattr(self, "failed", None)  # made in setup()
        if failed is not None and failed.done() and not failed.cancelled():
            failed.exception()  # retrieved: a send cut short by the shutdown is not news
        if self.runner is not None:
            await self.runner.aclose()
        if self.teacher is not None:
            await self.teacher.aclose()
