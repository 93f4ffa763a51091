"""``rollout_batch``: single-turn groups packed as columns (``stages.rollout_batch``) read back
as the groups they were, through the codec; columns that do not line up are named; and a port
sends it only to a consumer that accepts it (``Port.if_accepted``)."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest

from pipeline.stage import Port
from stages import rollout_batch
from stages.schemas import ROLLOUT, ROLLOUT_BATCH, ROLLOUT_GROUP, SCORED_BATCH, SCORED_GROUP
from transport.codec import decode, encode
from transport.message import Message


def _group(name: str, indexes: list[int], size: int = 4, prompt: int = 3) -> dict:
    return {
        "run_id": "run",
        "prompt_id": f"p-{name}",
        "group_id": f"{name}/1",
        "group_size": size,
        "prompt_ids": np.arange(prompt, dtype=np.int32) + 10,
        "samples": [
            {
                "sample_index": i,
                "completion_ids": np.arange(i + 1, dtype=np.int32),
                "sampler_logprobs": -np.linspace(0.1, 1.0, i + 1, dtype=np.float32),
                "versions": np.full(i + 1, 7, dtype=np.int32),
                "finish_reason": "stop" if i % 2 else "length",
                "engine": "e0",
                "timings": {"queued_s": 0.25 * i, "generate_s": 0.5},
            }
            for i in indexes
        ],
        "meta": {"answer": name},
        "uid": f"feeder.0:{name}",
        "origin": "generator.0:s",
    }


def _same(got: dict, sent: dict) -> None:
    for key in ("run_id", "prompt_id", "group_id", "group_size", "meta", "uid", "origin"):
        assert got[key] == sent[key], key
    assert got["prompt_ids"].tolist() == sent["prompt_ids"].tolist()
    assert len(got["samples"]) == len(sent["samples"])
    for a, b in zip(got["samples"], sent["samples"], strict=True):
        assert a.keys() == b.keys()
        for key in ("sample_index", "finish_reason", "engine", "timings"):
            assert a[key] == b[key], key
        for key in ("completion_ids", "sampler_logprobs", "versions"):
            assert a[key].dtype == b[key].dtype and a[key].tolist() == b[key].tolist(), key


def test_groups_packed_as_columns_come_back_as_they_were_through_the_codec():
    sent = [_group("a", [0, 1, 2, 3]), _group("b", [0, 2], prompt=5), _group("c", [3])]
    batch = rollout_batch.pack(sent, "run", 4, "generator.0:s")
    assert not ROLLOUT_BATCH.check(batch) and ROLLOUT_BATCH.weigh(batch) == 3
    assert batch["completion_offsets"].tolist() == [0, 1, 3, 6, 10, 11, 14, 18]
    (msg,) = [decode(encode(Message("rollout_batch", batch)), {"rollout_batch": ROLLOUT_BATCH})]
    assert rollout_batch.problems(msg.data) == []
    got = rollout_batch.groups(msg.data)
    for a, b in zip(got, sent, strict=True):
        _same(a, b)
        assert not ROLLOUT_GROUP.check(a)
    assert not got[0]["samples"][0]["completion_ids"].flags.writeable  # views of the frames


def test_only_single_turn_groups_fit():
    assert rollout_batch.fits(_group("a", [0, 1]))
    for key, value in (("loss_mask", np.ones(1, np.uint8)), ("rollout", {}), ("prompt_ids", [])):
        group = _group("a", [0, 1])
        group["samples"][1][key] = value
        assert not rollout_batch.fits(group), key


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda b: b.update(uid=b["uid"][:1]), "uid has 1 entries for 2 groups"),
        (lambda b: b.update(prompt_offsets=b["prompt_offsets"][:-1]), "prompt_offsets has 2"),
        (lambda b: b["completion_offsets"].__setitem__(-1, 99), "completion_offsets must rise"),
        (lambda b: b.update(versions=b["versions"][1:]), "versions has 5 entries for 6 tokens"),
        (lambda b: b.update(engine=["e0"]), "engine has 1 entries for 3 samples"),
        (lambda b: b["group"].__setitem__(0, 1), "group must run from 0 to 1 in order"),
        (lambda b: b["group"].__setitem__(2, 5), "group must run from 0 to 1 in order"),
        (lambda b: b.update(finish_reason=["stop", 3, "stop"]), "finish_reason holds an entry"),
        (lambda b: b.update(meta=[{}, "x"]), "meta holds an entry that is not a map or None"),
        (lambda b: b.update(sample_index=np.zeros(3)), "sample_index is an array of float64"),
        (lambda b: b.update(group_size=0), "group_size 0 < 1"),
    ],
)
def test_columns_that_do_not_line_up_are_named(change, named):
    batch = rollout_batch.pack([_group("a", [0, 1]), _group("b", [2])], "run", 4, None)
    assert rollout_batch.problems(batch) == []
    change(batch)
    found = rollout_batch.problems(batch)
    assert any(named in p for p in found), found


def test_a_port_sends_a_kind_it_offers_only_to_a_consumer_that_accepts_it():
    out = Port(ROLLOUT_GROUP, if_accepted=(ROLLOUT_BATCH,))
    assert [s.kind for s in out.schemas] == ["rollout_group", "rollout_batch"]
    assert out.sent_to(Port(ROLLOUT_GROUP, ROLLOUT, ROLLOUT_BATCH)) == [
        "rollout_group",
        "rollout_batch",
    ]
    assert out.sent_to(Port(ROLLOUT_GROUP, ROLLOUT)) == ["rollout_group"]
    assert out.sent_to(Port(SCORED_GROUP)) == ["rollout_group"]  # the wiring check says no


def test_scored_groups_packed_as_columns_come_back_with_their_rewards():
    sent = [_group("a", [0, 1, 2, 3]), _group("b", [1, 3])]
    for k, sample in enumerate(s for g in sent for s in g["samples"]):
        sample["reward"], sample["reward_info"] = 0.5 * k, {"fn": 0.5 * k}
        sample["timings"]["score_s"] = 0.125
    batch = rollout_batch.pack(sent, "run", 4, "generator.0:s", scored=True)
    assert not SCORED_BATCH.check(batch) and SCORED_BATCH.weigh(batch) == 2
    (msg,) = [decode(encode(Message("scored_batch", batch)), {"scored_batch": SCORED_BATCH})]
    assert rollout_batch.problems(msg.data) == []
    got = rollout_batch.groups(msg.data)
    for a, b in zip(got, sent, strict=True):
        _same(a, b)
        assert not SCORED_GROUP.check(a)
        assert [s["reward"] for s in a["samples"]] == [s["reward"] for s in b["samples"]]
        assert [s["reward_info"] for s in a["samples"]] == [s["reward_info"] for s in b["samples"]]
    msg.data["reward_info"] = msg.data["reward_info"][:-1]
    assert rollout_batch.problems(msg.data) == ["reward_info has 5 entries for 6 samples"]


def _same_columns(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].tolist() == value.tolist(), key
        else:
            assert got[key] == value, key


def _scored(groups: list[dict]) -> list[dict]:
    for k, sample in enumerate(s for g in groups for s in g["samples"]):
        sample["reward"], sample["reward_info"] = 0.25 * k, {"fn": 0.25 * k}
        sample["timings"]["score_s"] = 0.5
    return groups


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize(
    "picked",
    [
        [("two", 1), ("one", 2), ("one", 0), ("two", 0)],  # no two in a row
        [("one", 1), ("one", 2), ("two", 0), ("two", 1), ("one", 0)],  # runs of one batch
    ],
)
def test_groups_taken_from_several_batches_are_those_groups_packed_anew(scored, picked):
    first = [_group("a", [0, 1, 2, 3]), _group("b", [0, 2], prompt=5), _group("c", [3])]
    second = [_group("d", [1, 2]), _group("e", [0, 1, 2, 3], prompt=2)]
    if scored:
        _scored(first + second)
    one = rollout_batch.pack(first, "run", 4, "g:s", scored=scored)
    two = rollout_batch.pack(second, "run", 4, "g:s", scored=scored)
    cuts1, cuts2 = rollout_batch.spans(one), rollout_batch.spans(two)
    assert cuts1 == [0, 4, 6, 7] and cuts2 == [0, 2, 6]
    batches, groups = {"one": one, "two": two}, {"one": first, "two": second}
    parts = [
        (batches[b], g, c[g], c[g + 1])
        for b, g in picked
        for c in [rollout_batch.spans(batches[b])]
    ]
    got = rollout_batch.take(parts, "run", 4, "g:s")
    _same_columns(
        got, rollout_batch.pack([groups[b][g] for b, g in picked], "run", 4, "g:s", scored=scored)
    )
    assert rollout_batch.problems(got) == []
    schema = SCORED_BATCH if scored else ROLLOUT_BATCH
    assert not schema.check(got)


def test_every_group_of_a_batch_in_order_is_the_batch_itself():
    batch = rollout_batch.pack([_group("a", [0, 1]), _group("b", [0, 1, 2])], "run", 4, "g:s")
    cuts = rollout_batch.spans(batch)
    got = rollout_batch.take([(batch, g, cuts[g], cuts[g + 1]) for g in (0, 1)], "run", 4, "g:s")
    assert got["completion_ids"] is batch["completion_ids"] and got["group"] is batch["group"]
    assert got is not batch  # a new map: what the caller adds to it stays its own


def test_a_batch_is_in_order_when_each_group_s_samples_are_in_index_order():
    def batch_of(*groups: dict) -> dict:
        return rollout_batch.pack(list(groups), "run", 4, None)

    assert rollout_batch.in_order(batch_of(_group("a", [0, 1, 2, 3]), _group("b", [1, 3])))
    assert rollout_batch.well_formed(batch_of(_group("a", [0, 1]), _group("b", [3, 1])))
    assert not rollout_batch.in_order(batch_of(_group("a", [0, 1]), _group("b", [3, 1])))
    twice = _group("a", [0, 1])
    twice["samples"].append(dict(twice["samples"][0]))
    assert not rollout_batch.in_order(batch_of(twice))
    assert not rollout_batch.well_formed(batch_of(twice))
    beyond = batch_of(_group("a", [0, 1]))
    beyond["sample_index"] = np.asarray([0, 4], dtype=np.int32)  # group_size is 4
    assert not rollout_batch.in_order(beyond) and not rollout_batch.well_formed(beyond)
    again = batch_of(_group("a", [0]), _group("a", [1]))  # one group id twice
    assert not rollout_batch.in_order(again) and not rollout_batch.well_formed(again)


def test_entries_of_subclasses_pass_and_wrong_types_are_named():
    class Name(str):
        pass

    batch = rollout_batch.pack([_group("a", [0, 1])], "run", 4, None)
    batch["prompt_id"] = [Name("p-a")]
    batch["meta"] = [MappingProxyType({"answer": "a"})]
    assert rollout_batch.problems(batch) == []
    batch["uid"] = [3]
    assert rollout_batch.problems(batch) == ["uid holds an entry that is not a str or None"]


def _finished(group: dict) -> dict:
    """``group`` with its samples as the ``Finished`` columns a generator keeps."""
    samples = group["samples"]
    assert [s["sample_index"] for s in samples] == list(range(len(samples)))
    timings = samples[0]["timings"]
    for s in samples:
        s["timings"] = dict(timings)  # a group's samples share their timings
    done = rollout_batch.Finished(
        [s["completion_ids"].tolist() for s in samples],
        [s["sampler_logprobs"].tolist() for s in samples],
        [[str(v) for v in s["versions"].tolist()] for s in samples],  # as SGLang names them
        [s["finish_reason"] for s in samples],
        "e0",
        timings["queued_s"],
        timings["generate_s"],
    )
    return {**group, "samples": done}


def test_groups_kept_as_columns_pack_as_their_sample_maps_do():
    maps = [_group("a", [0, 1, 2, 3]), _group("b", [0, 1], prompt=5), _group("c", [0])]
    columns = [_finished(g) for g in maps]
    want = rollout_batch.pack(maps, "run", 4, "g:s")
    _same_columns(rollout_batch.pack(columns, "run", 4, "g:s"), want)  # every group as columns
    _same_columns(rollout_batch.pack([columns[0], maps[1], columns[2]], "run", 4, "g:s"), want)
    assert rollout_batch.fits(columns[0]) and len(columns[0]["samples"]) == 4
    for a, b in zip(columns[1]["samples"].maps(), maps[1]["samples"], strict=True):
        assert a["versions"].tolist() == b["versions"].tolist() and a["timings"] == b["timings"]


def test_versions_that_are_not_numbers_read_as_zero():
    assert rollout_batch.version_array(["3", "x", 4]).tolist() == [3, 0, 4]
    assert rollout_batch.version_array([]).dtype == np.int32
