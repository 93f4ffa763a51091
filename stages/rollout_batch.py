"""Single-turn groups as columns: the ``rollout_batch`` and ``scored_batch`` messages
(``stages.schemas``).

The generator packs the groups it has ready for a scorer into one message (``pack``); the
scorer checks that its columns line up (``problems``) and reads its groups back (``groups``).
The scorer packs the scored groups of one scoring call for the learner the same way
(``pack(..., scored=True)``: their rewards too), and the learner reads them back alike.
One message of 16 groups costs one hand-over, one encode and one decode instead of 16, and no
map per sample travels: a sample's tokens, log-probs and versions are slices of three arrays.
Trajectories (a sample with ``loss_mask``, its own ``prompt_ids`` or ``rollout``) do not fit
the columns and travel as ``rollout_group`` (``fits``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["fits", "groups", "pack", "problems", "well_formed"]

# a sample's fields the columns lack
_TRAJECTORY = ("loss_mask", "prompt_ids", "rollout", "teacher_logprobs")


def fits(group: Mapping[str, Any]) -> bool:
    """Whether a ``rollout_group`` (or ``scored_group``) map can travel in a batch."""
    return not any(key in sample for sample in group["samples"] for key in _TRAJECTORY)


def pack(
    heads: Sequence[Mapping[str, Any]],
    run_id: str,
    group_size: int,
    origin: str | None,
    scored: bool = False,
) -> dict[str, Any]:
    """``heads``: ``rollout_group`` maps that ``fit``, of ``run_id`` and ``group_size``; their
    ``rollout_batch`` (``scored``: ``scored_group`` maps, their ``scored_batch``)."""
    prompts = [np.asarray(h["prompt_ids"], dtype=np.int32) for h in heads]
    samples = [s for h in heads for s in h["samples"]]
    lengths = [len(s["completion_ids"]) for s in samples]
    batch = {
        "run_id": run_id,
        "group_size": group_size,
        "origin": origin,
        "prompt_id": [h["prompt_id"] for h in heads],
        "group_id": [h["group_id"] for h in heads],
        "uid": [h.get("uid") for h in heads],
        "meta": [h.get("meta") for h in heads],
        "prompt_ids": _joined(prompts, np.int32),
        "prompt_offsets": _offsets([len(p) for p in prompts]),
        "group": np.repeat(
            np.arange(len(heads), dtype=np.int32), [len(h["samples"]) for h in heads]
        ),
        "sample_index": np.asarray([s["sample_index"] for s in samples], dtype=np.int32),
        "completion_offsets": _offsets(lengths),
        "completion_ids": _joined([s["completion_ids"] for s in samples], np.int32),
        "sampler_logprobs": _joined([s["sampler_logprobs"] for s in samples], np.float32),
        "versions": _joined([s["versions"] for s in samples], np.int32),
        "finish_reason": [s["finish_reason"] for s in samples],
        "engine": [s["engine"] for s in samples],
        "queued_s": np.asarray([s["timings"]["queued_s"] for s in samples], dtype=np.float64),
        "generate_s": np.asarray([s["timings"]["generate_s"] for s in samples], dtype=np.float64),
    }
    if scored:
        batch["reward"] = np.asarray([s["reward"] for s in samples], dtype=np.float32)
        batch["reward_info"] = [s["reward_info"] for s in samples]
        batch["score_s"] = np.asarray([s["timings"]["score_s"] for s in samples], dtype=np.float64)
    return batch


def _joined(arrays: Sequence[Any], dtype: Any) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays])


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def problems(batch: Mapping[str, Any]) -> list[str]:
    """What keeps ``batch`` (a ``rollout_batch`` that passed its schema's check) from being
    read: columns that do not line up, or a value no sample can have. Empty when it reads."""
    out: list[str] = []
    n = len(batch["group_id"])
    for key in ("prompt_id", "uid", "meta"):
        if len(batch[key]) != n:
            out.append(f"{key} has {len(batch[key])} entries for {n} groups")
    for key, ok, what in _ENTRIES + (_SCORED_ENTRIES if "reward" in batch else ()):
        if not all(ok(v) for v in batch[key]):
            out.append(f"{key} holds an entry that is not {what}")
    for key, kind in _DTYPES.items():
        if key in batch and np.asarray(batch[key]).dtype.kind not in kind:
            out.append(
                f"{key} is an array of {np.asarray(batch[key]).dtype}, not of {_KINDS[kind]}"
            )
    if out:
        return out
    out += _cuts("prompt_offsets", batch["prompt_offsets"], n, len(batch["prompt_ids"]))
    s = len(batch["sample_index"])
    tokens = len(batch["completion_ids"])
    out += _cuts("completion_offsets", batch["completion_offsets"], s, tokens)
    for key in ("sampler_logprobs", "versions"):
        if len(batch[key]) != tokens:
            out.append(f"{key} has {len(batch[key])} entries for {tokens} tokens")
    per_sample = ("group", "finish_reason", "engine", "queued_s", "generate_s")
    if "reward" in batch:  # a scored_batch
        per_sample += ("reward", "reward_info", "score_s")
    for key in per_sample:
        if len(batch[key]) != s:
            out.append(f"{key} has {len(batch[key])} entries for {s} samples")
    if not out and s:
        group = np.asarray(batch["group"])
        if group.min() < 0 or group.max() >= n or np.any(np.diff(group) < 0):
            out.append(f"group must run from 0 to {n - 1} in order, a group's samples together")
    if batch["group_size"] < 1:
        out.append(f"group_size {batch['group_size']} < 1")
    return out


_ENTRIES = (
    ("prompt_id", lambda v: isinstance(v, str), "a str"),
    ("group_id", lambda v: isinstance(v, str), "a str"),
    ("uid", lambda v: v is None or isinstance(v, str), "a str or None"),
    ("meta", lambda v: v is None or isinstance(v, Mapping), "a map or None"),
    ("finish_reason", lambda v: isinstance(v, str), "a str"),
    ("engine", lambda v: isinstance(v, str), "a str"),
)
_SCORED_ENTRIES = (("reward_info", lambda v: isinstance(v, Mapping), "a map"),)
_INT, _FLOAT = "iu", "f"
_KINDS = {_INT: "integers", _FLOAT: "floats", _INT + _FLOAT: "numbers"}
_DTYPES = {
    "prompt_ids": _INT,
    "prompt_offsets": _INT,
    "group": _INT,
    "sample_index": _INT,
    "completion_offsets": _INT,
    "completion_ids": _INT,
    "sampler_logprobs": _FLOAT,
    "versions": _INT,
    "queued_s": _INT + _FLOAT,
    "generate_s": _INT + _FLOAT,
    "reward": _INT + _FLOAT,
    "score_s": _INT + _FLOAT,
}


def _cuts(name: str, offsets: Any, pieces: int, total: int) -> list[str]:
    cuts = np.asarray(offsets)
    if cuts.ndim != 1 or len(cuts) != pieces + 1:
        return [f"{name} has {len(cuts)} entries, expected {pieces + 1}"]
    if cuts[0] != 0 or cuts[-1] != total or np.any(np.diff(cuts) < 0):
        return [f"{name} must rise from 0 to {total}"]
    return []


def well_formed(batch: Mapping[str, Any]) -> bool:
    """Whether ``batch`` (one without ``problems``) names each of its groups once and each
    sample's index once within its group, inside ``0..group_size-1``: what a generator sends.
    The scorer files such a batch's samples without checking them one by one."""
    if len(set(batch["group_id"])) != len(batch["group_id"]):
        return False
    index = np.asarray(batch["sample_index"])
    if not len(index):
        return True
    size = batch["group_size"]
    if index.min() < 0 or index.max() >= size:
        return False
    key = np.asarray(batch["group"], dtype=np.int64) * size + index
    return len(np.unique(key)) == len(key)


def groups(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``batch`` (one without ``problems``) as ``rollout_group`` maps (a ``scored_batch``: as
    ``scored_group`` maps), its samples' arrays slices of the batch's (read-only where the
    batch's are)."""
    cuts = np.asarray(batch["completion_offsets"]).tolist()
    spans = np.asarray(batch["prompt_offsets"]).tolist()
    group = np.asarray(batch["group"]).tolist()
    index = np.asarray(batch["sample_index"]).tolist()
    queued = np.asarray(batch["queued_s"]).tolist()
    generate = np.asarray(batch["generate_s"]).tolist()
    ids, logprobs, versions = (
        batch["completion_ids"],
        batch["sampler_logprobs"],
        batch["versions"],
    )
    reasons, engines = batch["finish_reason"], batch["engine"]
    scored = "reward" in batch
    if scored:
        rewards = np.asarray(batch["reward"]).tolist()
        infos = batch["reward_info"]
        score_s = np.asarray(batch["score_s"]).tolist()
    out = [
        {
            "run_id": batch["run_id"],
            "prompt_id": batch["prompt_id"][g],
            "group_id": batch["group_id"][g],
            "group_size": batch["group_size"],
            "prompt_ids": batch["prompt_ids"][spans[g] : spans[g + 1]],
            "samples": [],
            "meta": batch["meta"][g],
            "uid": batch["uid"][g],
            "origin": batch["origin"],
        }
        for g in range(len(batch["group_id"]))
    ]
    for k, g in enumerate(group):
        a, b = cuts[k], cuts[k + 1]
        sample = {
            "sample_index": index[k],
            "completion_ids": ids[a:b],
            "sampler_logprobs": logprobs[a:b],
            "versions": versions[a:b],
            "finish_reason": reasons[k],
            "engine": engines[k],
            "timings": {"queued_s": queued[k], "generate_s": generate[k]},
        }
        if scored:
            sample["timings"]["score_s"] = score_s[k]
            sample["reward"], sample["reward_info"] = rewards[k], infos[k]
        out[g]["samples"].append(sample)
    return out
