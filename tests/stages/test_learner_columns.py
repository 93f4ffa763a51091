"""The learner reads a ``scored_batch``'s groups from its columns (``_Part.read``) as it reads
the ``scored_group`` maps they stand for (``_Part.data``, ``_sample_arrays``), and leaves a group
it cannot read so to the maps, which say what is wrong."""

from __future__ import annotations

import numpy as np

from stages import rollout_batch
from stages.learner.stage import _Columns, _Part, _sample_arrays
from tests.stages.test_rollout_batch import _group


def _scored(name: str, indexes: list[int], prompt: int = 3) -> dict:
    group = _group(name, indexes, prompt=prompt)
    for sample in group["samples"]:
        i = sample["sample_index"]
        sample["reward"], sample["reward_info"] = 0.1 * i, {"em": 0.1 * i}
        sample["timings"]["score_s"] = 0.01
    return group


def _parts(*groups: dict) -> list[_Part]:
    batch = rollout_batch.pack(list(groups), "run", 4, "generator.0:s", scored=True)
    columns, entry = _Columns(batch), [None, len(groups)]
    return [_Part(columns, g, entry) for g in range(len(groups))]


def test_a_group_read_from_columns_is_the_group_read_from_its_map():
    parts = _parts(_scored("a", [0, 1, 2, 3]), _scored("b", [1, 3], prompt=5), _scored("c", [2]))
    for part in parts:
        rows, rewards, reasons, indexes = part.read()
        group = part.data
        prompt = np.asarray(group["prompt_ids"], dtype=np.int64)
        want = [_sample_arrays(s, prompt) for s in group["samples"]]
        assert len(rows) == len(want)
        for got, expected in zip(rows, want, strict=True):
            for a, b in zip(got[:4], expected[:4], strict=True):
                assert a.dtype == b.dtype and a.tolist() == b.tolist()
            assert got[4] is None and expected[4] is None
        scored = [float(s["reward"]) for s in group["samples"]]
        assert rewards == np.asarray(scored, dtype=np.float32).tolist()
        assert reasons == [s["finish_reason"] for s in group["samples"]]
        assert indexes == [s["sample_index"] for s in group["samples"]]
        assert part.head == {
            "group_id": group["group_id"],
            "group_size": 4,
            "uid": group["uid"],
            "origin": "generator.0:s",
        }


def test_a_group_with_an_empty_completion_is_left_to_its_map():
    empty = _scored("a", [0, 1])
    empty["samples"][1]["completion_ids"] = np.zeros(0, dtype=np.int32)
    empty["samples"][1]["sampler_logprobs"] = np.zeros(0, dtype=np.float32)
    empty["samples"][1]["versions"] = np.zeros(0, dtype=np.int32)
    part, fine = _parts(empty, _scored("b", [0]))
    assert part.read() is None and fine.read() is not None
    assert len(part.data["samples"][1]["completion_ids"]) == 0  # _sample_arrays refuses it
