"""The scorer takes ``rollout_batch`` messages (several groups as columns, what the generator
sends it): each group is scored and sent on (a batch in order is scored from its columns and
goes on as columns, a ``scored_batch``, where the learner takes them), the message is
acknowledged only once the learner is done with every one of its groups, and what cannot be
read is dropped, counted and in the ledger, as for ``rollout_group`` messages."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from pipeline.ledger import LedgerReporter
from stages import rollout_batch
from stages.scorer.runner import RewardRunner
from stages.scorer.stage import RewardSpec, Scorer, ScorerConfig, _Group
from tests.stages.test_rollout_batch import _group
from tests.stages.test_scorer_shutdown import EM, _Tokenizer
from transport.message import Message


class _Inbox:
    def __init__(self, messages: list[Message]) -> None:
        self.messages, self.acked = list(messages), []

    def __aiter__(self):
        return self

    async def __anext__(self) -> Message:
        if not self.messages:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.messages.pop(0)

    def ack(self, msg: Message) -> None:
        self.acked.append(msg)


class _Learner:
    """The scorer's output: records what it sends; the test acknowledges it."""

    def __init__(self, columns: bool = False, room: int = 64) -> None:
        self.sent: list[tuple[int, dict]] = []
        self.acked = None
        self.columns = columns  # takes scored_batch
        self.kinds: list[str] = []
        self.space = room  # groups the learner with the most credit has room for

    def room(self) -> int:
        return self.space

    def sends(self, kind: str) -> bool:
        return self.columns or kind != "scored_batch"

    def on_ack(self, callback) -> None:
        self.acked = callback

    async def send(self, kind: str, data: dict) -> int:
        self.kinds.append(kind)
        self.sent.append((len(self.sent) + 1, data))
        return len(self.sent)


class _FullLearner(_Learner):
    """A learner whose inbox is full: no room until the test gives some (``wait_for_room``, as
    ``transport.Sender`` has it)."""

    def __init__(self) -> None:
        super().__init__(columns=True, room=0)
        self.asked, self.freed = asyncio.Event(), asyncio.Event()

    async def wait_for_room(self) -> int:
        self.asked.set()
        await self.freed.wait()
        return self.space


async def _scorer(
    messages: list[Message],
    columns: bool = False,
    room: int = 64,
    learner: _Learner | None = None,
) -> tuple[Scorer, _Inbox, _Learner, list[dict]]:
    config = ScorerConfig(rewards=[RewardSpec(EM)], tokenizer="unused", workers=0)
    inbox, ledger = _Inbox(messages), []
    learner = learner or _Learner(columns, room)
    log = structlog.get_logger("scorer")
    ctx = SimpleNamespace(
        log=log,
        inputs={"rollouts": inbox},
        outputs={"groups": learner},
        ledger=LedgerReporter(ledger.append),
        metrics=lambda **values: None,
    )
    scorer = Scorer(config, ctx)
    learner.on_ack(scorer._acked)
    scorer._chained = True
    scorer.tokenizer = _Tokenizer()  # every completion reads "7"
    scorer.failed = asyncio.get_running_loop().create_future()
    scorer.runner = RewardRunner(config.rewards, workers=0, log=log)
    await scorer.runner.start()
    await scorer._read()
    await asyncio.sleep(0)  # the scoring call starts at the end of the loop's turn
    while scorer._tasks:
        await asyncio.gather(*list(scorer._tasks))
    return scorer, inbox, learner, ledger


def _asked(group: dict, answer: str = "7") -> dict:
    group["meta"] = {"answer": answer, "text": "a question"}
    return group


def _batch(*groups: dict) -> Message:
    data = rollout_batch.pack(list(groups), "run", groups[0]["group_size"], "generator.0:s")
    msg = Message("rollout_batch", data)
    msg.sender = "generator.0"
    return msg


@pytest.mark.timeout(30)
async def test_a_batch_s_groups_are_scored_alone_and_it_is_acked_with_the_last():
    a, b = _asked(_group("a", [0, 1], size=2)), _asked(_group("b", [1, 0], size=2), "8")
    short = _asked(_group("c", [1], size=2))  # one of 2: below min_group, dropped
    msg = _batch(a, b, short)
    scorer, inbox, learner, ledger = await _scorer([msg])
    assert [d["group_id"] for _, d in learner.sent] == ["a/1", "b/1"]
    first, second = (d for _, d in learner.sent)
    assert [s["sample_index"] for s in second["samples"]] == [0, 1]  # sent in index order
    assert [s["reward"] for s in first["samples"]] == [1.0, 1.0]  # "7" is a's answer
    assert [s["reward"] for s in second["samples"]] == [0.0, 0.0]
    assert second["samples"][0]["completion_ids"].tolist() == [0]  # b's sample 0: 1 token
    assert first["prompt_ids"].tolist() == [10, 11, 12] and first["uid"] == "feeder.0:a"
    assert scorer.counts["groups_in"] == 3 and scorer.counts["groups_dropped"] == 1
    assert {"fates": [["feeder.0:c", 2, 1]], "reason": "incomplete_group", "step": None} in ledger
    assert inbox.acked == []  # the learner is done with neither group yet
    learner.acked(1)
    assert inbox.acked == []
    learner.acked(2)
    assert inbox.acked == [msg]  # once, with its last group


@pytest.mark.timeout(30)
async def test_a_batch_with_a_sample_twice_is_filed_sample_by_sample():
    a = _asked(_group("a", [0, 1], size=2))
    a["samples"].append(dict(a["samples"][0]))  # index 0 again
    scorer, inbox, learner, ledger = await _scorer([_batch(a)])
    ((_, sent),) = learner.sent
    assert [s["sample_index"] for s in sent["samples"]] == [0, 1]
    assert scorer.counts["dropped"] == 1
    assert {"copies": [0], "uid": "feeder.0:a", "size": 2} in ledger
    learner.acked(1)
    assert len(inbox.acked) == 1


@pytest.mark.timeout(30)
async def test_columns_that_do_not_line_up_drop_the_batch_counted_and_in_the_ledger():
    msg = _batch(_group("a", [0, 1], size=2), _group("b", [0, 1], size=2))
    msg.data["completion_offsets"] = np.asarray([0, 1, 3, 4, 99])
    with capture_logs() as logs:
        scorer, inbox, learner, ledger = await _scorer([msg])
    assert learner.sent == [] and inbox.acked == [msg]
    assert scorer.counts["dropped"] == 4
    (fates,) = [e for e in ledger if e.get("reason") == "malformed"]
    assert sorted(map(tuple, fates["fates"])) == [
        ("feeder.0:a", 2, 0),
        ("feeder.0:a", 2, 1),
        ("feeder.0:b", 2, 0),
        ("feeder.0:b", 2, 1),
    ]
    (warning,) = [e for e in logs if e["event"] == "rollout_batch_dropped"]
    assert "completion_offsets must rise from 0 to 6" in warning["reason"]
    assert warning["groups"] == 2


@pytest.mark.timeout(30)
async def test_a_scoring_call_goes_to_a_learner_that_takes_columns_as_one_scored_batch():
    a, b = _asked(_group("a", [0, 1], size=2)), _asked(_group("b", [0, 1], size=2), "8")
    msg = _batch(a, b)
    scorer, inbox, learner, _ = await _scorer([msg], columns=True)
    assert learner.kinds == ["scored_batch"]
    ((seq, batch),) = learner.sent
    assert batch["group_id"] == ["a/1", "b/1"] and batch["reward"].tolist() == [1, 1, 0, 0]
    assert batch["completion_ids"].tolist() == [0, 0, 1, 0, 0, 1]
    got = rollout_batch.groups(batch)
    assert [s["reward_info"][EM] for g in got for s in g["samples"]] == [1.0, 1.0, 0.0, 0.0]
    assert scorer.counts["groups_out"] == 2 and scorer.counts["samples"] == 4
    learner.acked(seq)
    assert inbox.acked == [msg]  # both groups released by the one acknowledgement


@pytest.mark.timeout(30)
async def test_a_scored_batch_holds_no_more_groups_than_the_learner_has_room_for():
    groups = [_asked(_group(name, [0, 1], size=2)) for name in "abc"]
    msg = _batch(*groups)
    _, inbox, learner, _ = await _scorer([msg], columns=True, room=2)
    assert learner.kinds == ["scored_batch", "scored_batch"]
    assert [b["group_id"] for _, b in learner.sent] == [["a/1", "b/1"], ["c/1"]]
    learner.acked(2)
    learner.acked(1)
    assert inbox.acked == [msg]


@pytest.mark.timeout(30)
async def test_a_scorer_without_room_at_the_learner_waits_and_sends_its_groups_together():
    """No credit at the learner: the scorer waits for room before it cuts a scored batch, then
    sends as much as the room allows in one, not one group ahead of the rest."""
    groups = [_asked(_group(name, [0, 1], size=2)) for name in "abc"]
    learner, msg = _FullLearner(), _batch(*groups)
    scoring = asyncio.ensure_future(_scorer([msg], columns=True, learner=learner))
    await asyncio.wait_for(learner.asked.wait(), 10)  # scored: it waits for room
    assert learner.sent == []
    learner.space = 3
    learner.freed.set()
    _, inbox, _, _ = await asyncio.wait_for(scoring, 5)
    assert [b["group_id"] for _, b in learner.sent] == [["a/1", "b/1", "c/1"]]
    learner.acked(1)
    assert inbox.acked == [msg]


@pytest.mark.timeout(30)
async def test_a_batch_in_order_is_scored_from_its_columns_and_a_short_group_from_its_samples(
    monkeypatch,
):
    def no_maps(self):
        raise AssertionError("a group left as columns was made into sample maps")

    monkeypatch.setattr(_Group, "sample_maps", no_maps)
    a, b = _asked(_group("a", [0, 1], size=2)), _asked(_group("b", [0, 1], size=2), "8")
    short = _asked(_group("c", [1], size=2))  # one of 2: below min_group, dropped
    msg = _batch(a, short, b)
    assert rollout_batch.in_order(msg.data)
    scorer, inbox, learner, ledger = await _scorer([msg], columns=True)
    ((seq, sent),) = learner.sent
    assert sent["group_id"] == ["a/1", "b/1"] and sent["reward"].tolist() == [1, 1, 0, 0]
    assert sent["prompt_ids"].tolist() == [10, 11, 12] * 2 and sent["uid"] == [
        "feeder.0:a",
        "feeder.0:b",
    ]
    assert sent["completion_offsets"].tolist() == [0, 1, 3, 4, 6]
    assert sent["score_s"].shape == (4,) and sent["origin"] == "generator.0:s"
    assert rollout_batch.problems(sent) == []
    assert scorer.counts["groups_in"] == 3 and scorer.counts["groups_dropped"] == 1
    assert scorer.counts["groups_out"] == 2 and scorer.counts["samples"] == 4
    assert {"fates": [["feeder.0:c", 2, 1]], "reason": "incomplete_group", "step": None} in ledger
    assert inbox.acked == []
    learner.acked(seq)
    assert inbox.acked == [msg]


@pytest.mark.timeout(30)
async def test_groups_left_as_columns_go_to_a_learner_of_scored_groups_as_maps():
    a, b = _asked(_group("a", [0, 1, 2], size=3)), _asked(_group("b", [0, 1, 2], size=3), "8")
    msg = _batch(a, b)
    _, inbox, learner, _ = await _scorer([msg], columns=False)
    assert learner.kinds == ["scored_group", "scored_group"]
    first, second = (d for _, d in learner.sent)
    assert [s["sample_index"] for s in second["samples"]] == [0, 1, 2]
    assert [s["reward"] for s in first["samples"]] == [1.0] * 3
    assert [s["reward"] for s in second["samples"]] == [0.0] * 3
    assert second["samples"][2]["completion_ids"].tolist() == [0, 1, 2]
    assert (
        first["samples"][0]["reward_info"][EM] == 1.0
        and "score_s" in (first["samples"][0]["timings"])
    )
    assert first["prompt_ids"].tolist() == [10, 11, 12] and first["meta"]["answer"] == "7"
    learner.acked(1)
    assert inbox.acked == []
    learner.acked(2)
    assert inbox.acked == [msg]


def _column_group(data: dict, g: int) -> _Group:
    cuts = rollout_batch.spans(data)
    head = {
        "run_id": data["run_id"],
        "prompt_id": data["prompt_id"][g],
        "group_id": data["group_id"][g],
        "group_size": data["group_size"],
        "meta": data["meta"][g],
        "uid": data["uid"][g],
        "origin": data["origin"],
        "prompt_ids": np.arange(3, dtype=np.int32) + 10,
    }
    return _Group(head, 0.0, cols=(data, g, cuts[g], cuts[g + 1]))


@pytest.mark.timeout(30)
async def test_one_scoring_call_sends_a_scored_batch_per_generator_session():
    one = _batch(_asked(_group("a", [0, 1], size=2)), _asked(_group("b", [0, 1], size=2), "8"))
    two = _batch(_asked(_group("c", [0, 1], size=2)))
    two.data["origin"] = "generator.1:s"
    scorer, _, learner, _ = await _scorer([], columns=True)
    groups = [_column_group(two.data, 0), _column_group(one.data, 1), _column_group(one.data, 0)]
    for group in groups:
        scorer._launched.add(group.head["group_id"])
    await scorer._score(groups)
    by_origin = {b["origin"]: b for _, b in learner.sent}
    assert by_origin["generator.1:s"]["group_id"] == ["c/1"]
    assert by_origin["generator.0:s"]["group_id"] == ["b/1", "a/1"]  # the call's order
    assert by_origin["generator.0:s"]["reward"].tolist() == [0, 0, 1, 1]
    assert by_origin["generator.1:s"]["reward"].tolist() == [1, 1]
    assert scorer._launched == set() and scorer.counts["groups_out"] == 3


@pytest.mark.timeout(30)
async def test_a_call_that_mixes_columns_and_samples_scores_them_all_as_samples():
    msg = _batch(_asked(_group("a", [0, 1], size=2)))
    loose = _asked(_group("b", [1, 0], size=2), "8")
    scorer, _, learner, _ = await _scorer([], columns=True)
    head = {k: v for k, v in loose.items() if k != "samples"}
    for sample in loose["samples"]:
        sample["meta"] = loose["meta"]
    mapped = _Group(head, 0.0, {s["sample_index"]: s for s in loose["samples"]})
    await scorer._score([_column_group(msg.data, 0), mapped])
    ((_, sent),) = learner.sent
    assert sent["group_id"] == ["a/1", "b/1"] and sent["reward"].tolist() == [1, 1, 0, 0]
    assert sent["sample_index"].tolist() == [0, 1, 0, 1]  # each group in index order
