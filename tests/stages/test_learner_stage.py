"""The learner stage's start-up order, with the DeepSpeed trainer, the weight publisher and the
evaluator replaced by recorders (their own tests run the real ones; here only the order counts).

The first evaluation must measure the initial weights, so it has to end before the first publish
changes them; it must not hold up training, so the first optimizer step may run meanwhile. The
weight group is formed before the first publish needs it. When the engines never show up the
run fails instead of waiting for samples that cannot come; when an engine lacks the current
weights while the learner waits for samples, it gets them again without a new step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from pipeline.ledger import LedgerReporter
from stages.feeder.sources import SourceConfig
from stages.learner import evaluate as evaluate_module
from stages.learner import publishing as publishing_module
from stages.learner.config import CheckpointConfig, EvalConfig, LearnerConfig
from stages.learner.stage import Learner
from stages.scorer.stage import RewardSpec
from transport.message import Message

pytestmark = pytest.mark.timeout(30)


class _Inbox:
    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        then_block: bool = False,
        gate: tuple[int, asyncio.Event] | None = None,
    ) -> None:
        self.groups = list(groups)
        self.then_block = then_block
        self.gate = gate  # (n, event): after n groups, the rest wait for the event
        self.given = 0
        self.acked: list[str] = []  # group ids, as the learner acknowledged them

    def __aiter__(self) -> _Inbox:
        return self

    async def __anext__(self) -> Message:
        if not self.groups:
            if self.then_block:
                await asyncio.Event().wait()
            raise StopAsyncIteration
        if self.gate is not None and self.given >= self.gate[0]:
            await self.gate[1].wait()
        self.given += 1
        return _message(self.groups.pop(0))

    def waiting(self) -> int:
        """How many ``take`` returns without waiting (as a Receiver's)."""
        if self.gate is not None and not self.gate[1].is_set():
            return max(0, min(len(self.groups), self.gate[0] - self.given))
        return len(self.groups)

    def stats(self) -> dict[str, int]:
        return {"depth": self.waiting()}  # as a Receiver's: what waits to be read

    def take(self) -> Message:
        assert self.waiting() > 0
        self.given += 1
        return _message(self.groups.pop(0))

    def ack(self, msg: Message) -> None:
        self.acked.append(msg.data["group_id"])


def _message(item: dict[str, Any] | Message) -> Message:
    return item if isinstance(item, Message) else Message("scored_group", item)


class _Ctx:
    def __init__(self, run_dir: Path, inbox: _Inbox) -> None:
        self.log = structlog.get_logger()
        self.inputs = {"groups": inbox}
        self.replicas, self.replica, self.run_dir, self.stages = 1, 0, run_dir, {}
        self.summaries: dict[str, Any] = {}
        self.stopped: str | None = None
        self.ledger_reports: list[dict[str, Any]] = []
        self.ledger = LedgerReporter(self.ledger_reports.append)
        self.mode = "async"
        self.published: list[tuple[str, dict[str, Any]]] = []

    async def publish(self, topic: str, payload: dict[str, Any]) -> None:
        self.published.append((topic, dict(payload)))

    async def summary(self, **values: Any) -> None:
        self.summaries.update(values)

    def request_stop(self, reason: str, *, failed: bool = False) -> None:
        self.stopped = reason


def _groups(n: int, *, uids: bool = False) -> list[dict[str, Any]]:
    """``n`` groups of 4 samples with signal; ``uids``: each its prompt's ledger uid."""
    return [
        {
            "group_id": f"g{i}",
            **({"uid": f"feeder.0:{i}", "group_size": 4} if uids else {}),
            "prompt_ids": [3, 4, 5],
            "samples": [
                {
                    "completion_ids": [6, 7],
                    "sampler_logprobs": [-0.5, -0.25],
                    "versions": [0, 0],
                    "reward": float(j % 2),
                }
                for j in range(4)
            ],
        }
        for i in range(n)
    ]


def _learner(
    tmp_path: Path,
    inbox: _Inbox,
    events: list,
    monkeypatch: pytest.MonkeyPatch,
    *,
    engines: bool = True,
    behind: Callable[[], str | None] = lambda: None,
    fails: BaseException | None = None,
) -> Learner:
    def note(*what: Any) -> None:
        events.append((time.monotonic(), *what))

    class Trainer:
        rank, world, device = 0, 1, torch.device("cpu")

        def setup(self) -> None:
            note("trainer_ready")

        def agree(self, have_data: bool) -> bool:
            return have_data

        def step(self, samples: list, policy_version: int) -> dict[str, Any]:
            time.sleep(0.02)
            note("step", policy_version)
            return {
                "samples": len(samples),
                "skipped": 0,
                "reward": 0.5,
                "solved": 0.5,
                "lag_mean": 0.0,
            }

        def snapshot(self, bucket_bytes: int) -> dict[str, torch.Tensor]:
            return {"w": torch.zeros(2)}

        def last_snapshot(self) -> dict[str, torch.Tensor]:
            return {"w": torch.zeros(2)}  # what the last publish sent

        def close(self) -> None:
            pass

    class Publishing:
        files = False  # the weight group, not adapter files
        log = structlog.get_logger()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.counts = {"catch_ups": 0}

        async def wait_for_engines(self, timeout_s: float) -> list[str]:
            await asyncio.sleep(0.05)
            if not engines:
                raise TimeoutError(f"no engines announced within {timeout_s} s")
            return ["http://engine"]

        async def connect(self) -> bool:
            note("group_formed")
            return True

        async def publish(self, weights: Any, version: int) -> bool:
            note("publish", version)
            if fails is not None:
                raise fails  # what no retry can mend: out of publish(), not a False
            return True

        async def behind(self) -> str | None:
            return behind()  # by default the engines always have the current weights

        def urls(self) -> list[str]:
            return ["http://engine"]

        async def close(self) -> None:
            pass

    class Evaluator:
        history: list = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def start(self) -> None:
            pass

        async def evaluate(self, urls: list[str], *, step: int, version: int) -> dict:
            note("eval_start", step, version)
            await asyncio.sleep(0.5 if step == 0 else 0.0)  # longer than a step
            note("eval_end", step, version)
            return {"accuracy": 0.5}

        async def close(self) -> None:
            pass

    monkeypatch.setattr(publishing_module, "Publishing", Publishing)
    monkeypatch.setattr(evaluate_module, "Evaluator", Evaluator)
    config = LearnerConfig(
        model="unused",
        steps=3,
        batch_size=8,
        eval=EvalConfig(source=SourceConfig(), rewards=[RewardSpec(fn="exact_match")]),
        checkpoint=CheckpointConfig(at_end=False),
    )
    learner = Learner(config, _Ctx(tmp_path, inbox))
    learner.trainer = Trainer()
    learner._setup_blocking = lambda evaluate: (learner.trainer.setup(), ([], None))[1]
    return learner


def _run(learner: Learner) -> None:
    """Set up, run and close ``learner``, as its replica does."""

    async def go() -> None:
        await learner.setup()
        await learner.run()
        await learner.close()

    asyncio.run(go())


def test_first_evaluation_ends_before_the_first_publish_but_does_not_hold_up_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list = []
    inbox = _Inbox(_groups(6))
    learner = _learner(tmp_path, inbox, events, monkeypatch)

    _run(learner)
    order = [e[1:] for e in sorted(events, key=lambda e: e[0])]
    names = [o[0] for o in order]
    assert ("eval_start", 0, 0) in order
    first_eval_end = order.index(("eval_end", 0, 0))
    assert names.index("step") < first_eval_end  # training went on meanwhile
    assert names.index("publish") > first_eval_end  # ...but the weights stayed put
    assert names.index("group_formed") < names.index("publish")
    assert [o for o in order if o[0] == "publish"] == [
        ("publish", 1),
        ("publish", 2),
        ("publish", 3),
    ]
    assert learner.ctx.summaries["eval_before"] == 0.5
    assert learner.ctx.stopped == "trained 3 steps"
    # every group was in a finished step, and acknowledged once, when its step was done
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]


def test_an_evaluation_is_due_at_the_step_its_weights_were_taken_however_long_they_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's publish runs on while the next steps train: the evaluation it makes due is
    the one of the step it was taken at (every 2 steps: after steps 2 and 4, the last one's
    at the end), even when the step counter has moved on by the time the engines have it."""
    events: list = []
    inbox = _Inbox(_groups(10))
    learner = _learner(tmp_path, inbox, events, monkeypatch)
    learner.config.steps = 5
    learner.config.eval.every = 2
    fake = publishing_module.Publishing
    sent = fake.publish

    async def slow(self: Any, weights: Any, version: int) -> bool:
        await asyncio.sleep(0.15)  # longer than a step: the next one trains meanwhile
        return await sent(self, weights, version)

    monkeypatch.setattr(fake, "publish", slow)
    _run(learner)
    order = [e[1:] for e in sorted(events, key=lambda e: e[0])]
    assert [o[1] for o in order if o[0] == "eval_start"] == [0, 2, 4, 5]


def test_no_engines_fails_the_run_instead_of_waiting_for_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inbox = _Inbox([], then_block=True)  # no engines, so no samples ever
    learner = _learner(tmp_path, inbox, [], monkeypatch, engines=False)

    async def go() -> None:
        await learner.setup()
        try:
            with pytest.raises(TimeoutError, match="no engines"):
                await asyncio.wait_for(learner.run(), 10)
        finally:
            await learner.close()

    asyncio.run(go())


def test_a_snapshots_publish_that_fails_for_good_fails_the_learner_waiting_for_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's publish runs in the background while the learner waits for the next
    step's samples. One that raises (an engine without --enable-lora, a refused key) fails
    the learner, which would otherwise wait for ever: in sync mode no samples of the new
    version can come."""
    from stages.weights.adapter_files import LoraNotServed

    inbox = _Inbox(_groups(2), then_block=True)  # one step's groups, then none
    fails = LoraNotServed("http://engine", "LoRA is not enabled.")
    learner = _learner(tmp_path, inbox, [], monkeypatch, fails=fails)
    learner.config.publish.snapshot = True

    async def go() -> None:
        await learner.setup()
        try:
            with pytest.raises(LoraNotServed, match="serves no LoRA adapters"):
                await asyncio.wait_for(learner.run(), 10)
        finally:
            await learner.close()

    asyncio.run(go())


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_learner_restarted_before_its_first_publish_sends_its_weights_as_version_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restarts: int
) -> None:
    """A learner that died after acknowledging its first step's samples and before any
    version went out comes back with no checkpoint and no live version (0). In sync mode the
    generators made version 0's batch already and wait for version 1 before the next: the
    restarted learner's weights go out as version 1 first, or the run waits for ever
    (tests/stages/test_rl_crashes.py kills one there). A first start publishes nothing first."""
    events: list = []
    learner = _learner(tmp_path, _Inbox(_groups(6)), events, monkeypatch)
    learner.ctx.restarts = restarts

    _run(learner)
    published = [what[1] for _, *what in events if what[0] == "publish"]
    trained = [what[1] for _, *what in events if what[0] == "step"]
    if restarts:
        assert published == [1, 2, 3, 4] and trained == [1, 2, 3]
    else:
        assert published == [1, 2, 3] and trained == [0, 1, 2]


def test_a_resume_merges_every_ranks_groups(tmp_path):
    """Part-trained groups and taken uids of every rank come back to each rank on resume (a
    group, or a copy of one, may reach another rank, and the rank count may change)."""
    import json

    from stages.learner.stage import _load_groups

    (tmp_path / "groups").mkdir()
    ranks = [
        {"partial": {"f.0:1": [0, 1]}, "seen": ["f.0:1", "f.0:2"]},
        {"partial": {"f.0:7": [3]}, "seen": ["f.0:7"]},
    ]
    for rank, groups in enumerate(ranks):
        (tmp_path / "groups" / f"rank-{rank}.json").write_text(json.dumps(groups))
    partial, seen = _load_groups(tmp_path)
    assert partial == {"f.0:1": {0, 1}, "f.0:7": {3}}
    assert list(seen) == ["f.0:1", "f.0:2", "f.0:7"]
    assert _load_groups(tmp_path / "nothing") == ({}, {})
    # a checkpoint from before ranks saved their own: rank 0's, from its client state
    earlier = {"step": 4, "partial": {"f.0:3": [2]}, "seen": ["f.0:3"]}
    assert _load_groups(tmp_path / "nothing", earlier) == ({"f.0:3": {2}}, {"f.0:3": None})


def test_the_learner_reports_its_pace_at_the_start_and_after_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generators keep what the learner is not done with within what it trains in ``max_lag``
    versions: they learn its batch, version and how many of them share it from these."""
    from pipeline import topics

    groups = _groups(6)
    for i, group in enumerate(groups):  # two generator sessions feed it
        group["origin"] = f"generator.{i % 2}:s"
    inbox = _Inbox(groups)
    learner = _learner(tmp_path, inbox, [], monkeypatch)  # 8 samples (2 groups) a step, 3 steps

    _run(learner)
    reports = [p for t, p in learner.ctx.published if t == topics.PACE]
    assert [r["version"] for r in reports] == [0, 1, 2, 3]
    assert [r["origins"] for r in reports] == [1, 2, 2, 2]  # none seen before the first step
    cfg = learner.config
    assert all(
        (r["batch"], r["every"], r["max_lag"], r["rank"]) == (8, 1, cfg.max_lag, 0) for r in reports
    )


def test_a_restarted_generator_counts_once_in_the_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generator's groups name its session; a restarted one's new session takes the old
    one's place. Counted as two, the dead session would halve the live one's share for
    ``_LIVE_STEPS`` steps."""
    from pipeline import topics

    groups = _groups(6)
    origins = ["generator.0:a", "generator.1:a"] * 2 + ["generator.0:b"] * 2
    for group, origin in zip(groups, origins, strict=True):
        group["origin"] = origin
    learner = _learner(tmp_path, _Inbox(groups), [], monkeypatch)

    _run(learner)
    reports = [p for t, p in learner.ctx.published if t == topics.PACE]
    assert [r["origins"] for r in reports] == [1, 2, 2, 2]


def test_generators_silent_while_the_learner_waits_stop_counting_in_the_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two generators fed the first step; one then dies for good. The live one's share of the
    budget (its half) is less than the batch the learner waits to fill, so it sends nothing
    more until the learner stops counting the silent ones: as a generator held by its budget,
    the inbox here gives more only once a pace report counts one generator. Without the
    recount the run waits for ever (the test's timeout)."""
    from pipeline import topics
    from stages.learner import stage as stage_module

    monkeypatch.setattr(stage_module, "_SILENT_S", 0.2)
    released = asyncio.Event()
    groups = _groups(6)
    for i, group in enumerate(groups):
        group["origin"] = f"generator.{i % 2 if i < 2 else 0}:s"
    learner = _learner(tmp_path, _Inbox(groups, gate=(2, released)), [], monkeypatch)
    publish = learner.ctx.publish

    async def recorded(topic: str, payload: dict[str, Any]) -> None:
        await publish(topic, payload)
        if topic == topics.PACE and learner.step >= 1 and payload["origins"] == 1:
            released.set()  # the live generator's share is now the whole budget

    learner.ctx.publish = recorded
    waited = time.monotonic()
    _run(learner)
    assert learner.step == 3
    reports = [p["origins"] for t, p in learner.ctx.published if t == topics.PACE]
    assert reports[:2] == [1, 2] and 1 in reports[2:]
    assert time.monotonic() - waited < 10


def test_a_learner_waiting_for_samples_sends_the_current_weights_to_engines_that_lack_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine restarted after the first publish serves its initial weights, and the generator
    holds back its samples until it has current ones. The learner, waiting for samples, must
    send the current weights again (a catch-up, not a new version): here no more samples come
    until it has, so without the catch-up the run would wait for ever (the test's timeout)."""
    events: list = []
    released = asyncio.Event()
    inbox = _Inbox(_groups(6), gate=(2, released))  # one step's groups, then none until caught up

    def published() -> list[int]:
        return [e[2] for e in sorted(events, key=lambda e: e[0]) if e[1] == "publish"]

    def behind() -> str | None:
        if published() == [1, 1]:
            released.set()  # the restarted engine is current: its samples come
        return "engines_changed" if published() == [1] else None

    learner = _learner(tmp_path, inbox, events, monkeypatch, behind=behind)

    _run(learner)
    assert published() == [1, 1, 2, 3]  # version 1 again between steps 1 and 2
    assert learner.publishing.counts["catch_ups"] == 1
    assert learner.ctx.stopped == "trained 3 steps"
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]


def test_engines_are_caught_up_even_while_groups_keep_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups already in the inbox are taken without a task each, but not past a due check of
    the engines: groups that keep coming may all be stale, from an engine that lost the
    weights. (Every look at the engines is due here; no group ever has to be waited for.)"""
    import stages.learner.stage as stage_module

    monkeypatch.setattr(stage_module, "_CATCH_UP_S", 0.0)
    events: list = []
    inbox = _Inbox(_groups(6))  # all there from the start

    def published() -> list[int]:
        return [e[2] for e in sorted(events, key=lambda e: e[0]) if e[1] == "publish"]

    learner = _learner(
        tmp_path,
        inbox,
        events,
        monkeypatch,
        behind=lambda: "engines_changed" if published() == [1] else None,
    )

    _run(learner)
    assert published() == [1, 1, 2, 3]  # version 1 again, though groups were waiting
    assert learner.publishing.counts["catch_ups"] == 1
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]


def test_the_groups_of_a_scored_batch_train_and_it_is_acknowledged_once_with_its_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages import rollout_batch
    from tests.stages.test_rollout_batch import _group

    def scored(name: str) -> dict[str, Any]:
        group = _group(name, [0, 1, 2, 3])
        for j, sample in enumerate(group["samples"]):
            sample["reward"], sample["reward_info"] = float(j % 2), {"em": float(j % 2)}
            sample["timings"]["score_s"] = 0.01
        return group

    batches = [
        rollout_batch.pack([scored(n) for n in names], "run", 4, "generator.0:s", scored=True)
        for names in (("a", "b", "c"), ("d", "e", "f"))
    ]
    events: list = []
    inbox = _Inbox([Message("scored_batch", b) for b in batches])
    learner = _learner(tmp_path, inbox, events, monkeypatch)

    _run(learner)
    assert learner.ctx.stopped == "trained 3 steps"  # 6 groups of 4, 8 samples a step
    # each batch once, when the step that trained its last group was done
    assert inbox.acked == [["a/1", "b/1", "c/1"], ["d/1", "e/1", "f/1"]]
    trained = [r for r in learner.ctx.ledger_reports if r.get("reason") == "trained"]
    assert sorted((u, i) for r in trained for u, _, i in r["fates"]) == sorted(
        (f"feeder.0:{n}", i) for n in "abcdef" for i in range(4)
    )


def _reads(learner: Learner, events: list) -> None:
    """Note each group the learner reads (parses, computes advantages for)."""
    read = learner._samples_of

    def noted(msg: Any) -> Any:
        note = msg.data["group_id"] if isinstance(msg, Message) else msg
        events.append((time.monotonic(), "read", note))
        return read(msg)

    learner._samples_of = noted


def test_the_next_steps_groups_are_read_while_a_step_trains_and_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups waiting when a step starts are read in the event loop while the training thread
    runs it (the next step need not read them while the model waits): a batch's worth (2
    groups of 4 here), not everything the inbox holds."""
    events: list = []
    inbox = _Inbox(_groups(8))
    learner = _learner(tmp_path, inbox, events, monkeypatch)
    _reads(learner, events)

    _run(learner)
    order = [e[1:] for e in sorted(events, key=lambda e: e[0])]
    first_end = order.index(("step", 0))
    before = [o[1] for o in order[:first_end] if o[0] == "read"]
    assert before == ["g0", "g1", "g2", "g3"]  # the second step's groups: during the first
    assert [o[1] for o in order if o[0] == "read"] == [f"g{i}" for i in range(8)]
    assert learner.ctx.stopped == "trained 3 steps"
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]  # g6, g7: never trained


def test_groups_read_during_a_step_are_looked_at_again_for_staleness_when_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_lag: 0`` the groups of version 0 read during the first step were fresh then
    and are stale after it: dropped as stale when the second step takes them, and counted."""
    events: list = []
    inbox = _Inbox(_groups(4), then_block=False)
    learner = _learner(tmp_path, inbox, events, monkeypatch)
    learner.config.max_lag = 0
    _reads(learner, events)

    _run(learner)
    order = [e[1:] for e in sorted(events, key=lambda e: e[0])]
    before = order[: order.index(("step", 0))]
    assert [o[1] for o in before if o[0] == "read"] == ["g0", "g1", "g2", "g3"]
    assert learner.counts["stale"] == 8  # both groups' samples
    assert [o for o in order if o[0] == "step"] == [("step", 0)]  # nothing fresh came after
    assert sorted(inbox.acked) == [f"g{i}" for i in range(4)]  # the stale ones too: processed


def test_a_trainer_that_says_when_it_runs_backward_gets_the_next_groups_read_then_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the rest of a step, Python in the event loop would take the GIL from the training
    thread between its small operators; a backward pass runs without it."""
    events: list = []
    inbox = _Inbox(_groups(6))
    learner = _learner(tmp_path, inbox, events, monkeypatch)
    _reads(learner, events)
    trainer = learner.trainer
    trainer.on_backward = None  # the learner sets it up (Trainer's attribute)
    plain = trainer.step

    def step(samples: list, policy_version: int) -> dict[str, Any]:
        time.sleep(0.03)  # the forward pass: groups waiting are not read yet
        events.append((time.monotonic(), "backward", policy_version))
        trainer.on_backward(True)
        time.sleep(0.03)
        trainer.on_backward(False)
        events.append((time.monotonic(), "backward_end", policy_version))
        return plain(samples, policy_version)

    trainer.step = step

    _run(learner)
    order = [e[1:] for e in sorted(events, key=lambda e: e[0])]
    window = order[order.index(("backward", 0)) : order.index(("backward_end", 0))]
    assert [o[1] for o in window if o[0] == "read"] == ["g2", "g3"]
    before = order[: order.index(("backward", 0))]
    assert [o[1] for o in before if o[0] == "read"] == ["g0", "g1"]
    assert learner.ctx.stopped == "trained 3 steps"
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]


def test_groups_set_aside_together_go_to_the_ledger_in_one_report_before_their_acks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamic sampling: the groups without signal that a step finds among those read ahead
    are reported together (one ``no_signal`` message, not one a group: the supervisor reads
    every report), and each before its group is acknowledged (the ledger's order)."""
    groups = _groups(8, uids=True)
    for i in (2, 3):  # all rewards equal: no signal
        for sample in groups[i]["samples"]:
            sample["reward"] = 1.0
    events: list = []
    inbox = _Inbox(groups)
    learner = _learner(tmp_path, inbox, events, monkeypatch)
    learner.config.dynamic_sampling = True
    reports = learner.ctx.ledger_reports
    acked_after: dict[str, int] = {}  # group id -> reports made when it was acknowledged
    plain_ack = inbox.ack

    def ack(msg: Message) -> None:
        acked_after[msg.data["group_id"]] = len(reports)
        plain_ack(msg)

    inbox.ack = ack

    _run(learner)
    aside = [r for r in reports if r.get("reason") == "no_signal"]
    assert len(aside) == 1  # g2 and g3: read during the first step, set aside together
    assert sorted({u for u, _, _ in aside[0]["fates"]}) == ["feeder.0:2", "feeder.0:3"]
    assert len(aside[0]["fates"]) == 8
    assert learner.counts["set_aside"] == 8
    made = reports.index(aside[0]) + 1
    assert acked_after["g2"] >= made and acked_after["g3"] >= made
    assert learner.ctx.stopped == "trained 3 steps"


def test_samples_gone_stale_together_go_to_the_ledger_in_one_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stale samples a step finds together are one ``stale`` report, before their acks."""
    inbox = _Inbox(_groups(4, uids=True), then_block=False)
    learner = _learner(tmp_path, inbox, [], monkeypatch)
    learner.config.max_lag = 0

    _run(learner)
    stale = [r for r in learner.ctx.ledger_reports if r.get("reason") == "stale"]
    assert len(stale) == 1 and len(stale[0]["fates"]) == 8
    assert learner.counts["stale"] == 8


def test_a_learner_that_set_groups_aside_and_waits_lets_the_generators_send_one_batch_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamic sampling: groups set aside are done with, but a generator's batch is
    acknowledged only with its last group, so the queue gate can stay shut on samples the
    step cannot use (seen in CI: a 3-step run waited for ever after its first step). A learner
    that set groups aside and finds nothing more to read says it is hungry: as a generator
    held by its budget, the inbox here gives more only then. Without it the run waits for
    ever (the test's timeout)."""
    from pipeline import topics

    released = asyncio.Event()
    groups = _groups(8, uids=True)
    for i in (2, 3):  # the second step's first groups carry no signal
        for sample in groups[i]["samples"]:
            sample["reward"] = 1.0
    learner = _learner(tmp_path, _Inbox(groups, gate=(4, released)), [], monkeypatch)
    learner.config.dynamic_sampling = True
    publish = learner.ctx.publish

    async def recorded(topic: str, payload: dict[str, Any]) -> None:
        await publish(topic, payload)
        if topic == topics.PACE and payload["hungry"]:
            released.set()  # one batch more through the generators' gate

    learner.ctx.publish = recorded
    _run(learner)
    assert learner.step == 3 and learner.counts["set_aside"] == 8
    hungry = [p for t, p in learner.ctx.published if t == topics.PACE and p["hungry"]]
    assert [p["version"] for p in hungry] == [1]  # once, in the step that set groups aside


def test_a_learner_that_waits_long_for_samples_lets_the_generators_send_one_batch_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generator's batch is acknowledged only with its last group, so the queue gate can
    stay shut on groups the learner holds for the step it waits to fill (a CI run of the Ray
    node-loss test waited for ever so after its scorer restarted). When nothing comes for
    ``_SILENT_S`` the learner reports itself hungry: as a generator held by its budget, the
    inbox here gives more only then. Without it the run waits for ever (the test's timeout)."""
    from pipeline import topics
    from stages.learner import stage as stage_module

    monkeypatch.setattr(stage_module, "_SILENT_S", 0.2)
    released = asyncio.Event()
    learner = _learner(tmp_path, _Inbox(_groups(6), gate=(3, released)), [], monkeypatch)
    publish = learner.ctx.publish

    async def recorded(topic: str, payload: dict[str, Any]) -> None:
        await publish(topic, payload)
        if topic == topics.PACE and payload["hungry"]:
            released.set()

    learner.ctx.publish = recorded
    _run(learner)
    assert learner.step == 3
    hungry = [p for t, p in learner.ctx.published if t == topics.PACE and p["hungry"]]
    assert [p["version"] for p in hungry] == [1]  # once: in the step that waited


def test_a_step_is_acknowledged_once_its_pace_report_has_come_back_over_the_bus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room a step's acknowledgements free in a generator's queue gate must not be taken
    at the version before the step (those samples would be stale when trained): the learner
    publishes the step's pace, waits until it hears it back over the bus
    (``ctx.wait_for_pace``: the broker has then passed it on to the generators too), and
    only then acknowledges the step's groups."""
    from pipeline import topics

    inbox = _Inbox(_groups(6))
    learner = _learner(tmp_path, inbox, [], monkeypatch)  # 2 groups a step, 3 steps
    order: list[tuple[str, Any]] = []
    publish = learner.ctx.publish

    async def recorded(topic: str, payload: dict[str, Any]) -> None:
        if topic == topics.PACE:
            order.append(("pace", payload["version"]))
        await publish(topic, payload)

    async def wait_for_pace(rank: int, version: int) -> None:
        await asyncio.sleep(0.05)  # the round trip through the broker
        order.append(("heard", version))

    plain_ack = inbox.ack

    def ack(msg: Message) -> None:
        order.append(("ack", msg.data["group_id"]))
        plain_ack(msg)

    learner.ctx.publish, learner.ctx.wait_for_pace, inbox.ack = recorded, wait_for_pace, ack
    _run(learner)
    assert order == [("pace", 0)] + [
        event
        for step in (1, 2, 3)
        for event in (
            ("pace", step),
            ("heard", step),
            ("ack", f"g{2 * step - 2}"),
            ("ack", f"g{2 * step - 1}"),
        )
    ]
    assert learner.counts["pace_unheard"] == 0


def test_a_pace_report_that_does_not_come_back_holds_a_step_up_briefly_and_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control bus may drop a message: a step whose pace is not heard back within
    ``_PACE_ECHO_S`` is acknowledged anyway, counted (``pace_unheard``) and logged."""
    import stages.learner.stage as learner_stage

    monkeypatch.setattr(learner_stage, "_PACE_ECHO_S", 0.05)
    inbox = _Inbox(_groups(6))
    learner = _learner(tmp_path, inbox, [], monkeypatch)

    async def never(rank: int, version: int) -> None:
        await asyncio.Event().wait()

    learner.ctx.wait_for_pace = never
    _run(learner)
    assert sorted(inbox.acked) == [f"g{i}" for i in range(6)]
    assert learner.counts["pace_unheard"] == 3
    assert learner.ctx.stopped == "trained 3 steps"
