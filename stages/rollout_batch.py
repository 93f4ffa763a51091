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
from itertools import chain
from typing import Any

import numpy as np

__all__ = [
    "Finished",
    "fits",
    "group_map",
    "groups",
    "in_order",
    "pack",
    "problems",
    "spans",
    "take",
    "version_array",
    "version_of",
    "well_formed",
]

# a sample's fields the columns lack
_TRAJECTORY = ("loss_mask", "prompt_ids", "rollout", "teacher_logprobs")


class Finished:
    """A group's samples as its engine finished them, kept as columns until they are packed:
    each sample's token ids, log-probs and policy versions (lists, as the engine gives them;
    versions as integers or their text), its finish reason, and the group's engine and
    timings. What the generator puts in a ``rollout_group`` map's ``samples`` instead of a map
    per sample; ``maps`` makes those maps where a consumer needs them."""

    __slots__ = ("engine", "finish_reason", "generate_s", "ids", "logprobs", "queued_s", "versions")

    def __init__(
        self,
        ids: list[Sequence[int]],
        logprobs: list[Sequence[float]],
        versions: list[Sequence[Any]],
        finish_reason: list[str],
        engine: str,
        queued_s: float,
        generate_s: float,
    ) -> None:
        self.ids, self.logprobs, self.versions = ids, logprobs, versions
        self.finish_reason, self.engine = finish_reason, engine
        self.queued_s, self.generate_s = queued_s, generate_s

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.ids))

    def maps(self) -> list[dict[str, Any]]:
        """Each sample as a ``rollout_group`` sample map (its index its position)."""
        timings = {"queued_s": self.queued_s, "generate_s": self.generate_s}
        return [
            {
                "sample_index": i,
                "completion_ids": np.asarray(ids, dtype=np.int32),
                "sampler_logprobs": np.asarray(lps, dtype=np.float32),
                "versions": version_array(versions),
                "finish_reason": reason,
                "engine": self.engine,
                "timings": dict(timings),
            }
            for i, (ids, lps, versions, reason) in enumerate(
                zip(self.ids, self.logprobs, self.versions, self.finish_reason, strict=True)
            )
        ]


def version_of(value: Any) -> int:
    """A policy version: SGLang carries weight versions as text, Inflight's are integers; one
    that is not a number reads as 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def version_array(versions: Sequence[Any]) -> np.ndarray:
    """Per-token policy versions (numbers or their text) as int32, each read as
    ``version_of`` reads it when one is not a number."""
    try:
        return np.asarray(versions, dtype=np.int32)  # numbers or numeric text, in C
    except ValueError:
        return np.asarray([version_of(v) for v in versions], dtype=np.int32)


def fits(group: Mapping[str, Any]) -> bool:
    """Whether a ``rollout_group`` (or ``scored_group``) map can travel in a batch."""
    samples = group["samples"]
    if isinstance(samples, Finished):
        return True
    return not any(key in sample for sample in samples for key in _TRAJECTORY)


def pack(
    heads: Sequence[Mapping[str, Any]],
    run_id: str,
    group_size: int,
    origin: str | None,
    scored: bool = False,
) -> dict[str, Any]:
    """``heads``: ``rollout_group`` maps that ``fit``, of ``run_id`` and ``group_size``; their
    ``rollout_batch`` (``scored``: ``scored_group`` maps, their ``scored_batch``). Groups whose
    ``samples`` are ``Finished`` are read as columns, with no map made per sample."""
    if not scored and heads and all(isinstance(h["samples"], Finished) for h in heads):
        return _pack_finished(heads, run_id, group_size, origin)
    heads = [
        {**h, "samples": h["samples"].maps()} if isinstance(h["samples"], Finished) else h
        for h in heads
    ]
    samples = [s for h in heads for s in h["samples"]]
    lengths = [len(s["completion_ids"]) for s in samples]
    batch = {
        **_group_columns(heads, run_id, group_size, origin),
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


def _pack_finished(
    heads: Sequence[Mapping[str, Any]], run_id: str, group_size: int, origin: str | None
) -> dict[str, Any]:
    """``pack`` of groups whose samples are all ``Finished``: each column made at once."""
    done: list[Finished] = [h["samples"] for h in heads]
    sizes = [len(d.ids) for d in done]
    every = chain.from_iterable
    return {
        **_group_columns(heads, run_id, group_size, origin),
        "group": np.repeat(np.arange(len(heads), dtype=np.int32), sizes),
        "sample_index": np.fromiter(every(map(range, sizes)), np.int32, sum(sizes)),
        "completion_offsets": _offsets([len(ids) for d in done for ids in d.ids]),
        "completion_ids": np.array(list(every(every(d.ids for d in done))), dtype=np.int32),
        "sampler_logprobs": np.array(
            list(every(every(d.logprobs for d in done))), dtype=np.float32
        ),
        "versions": version_array(list(every(every(d.versions for d in done)))),
        "finish_reason": list(every(d.finish_reason for d in done)),
        "engine": [d.engine for d, n in zip(done, sizes, strict=True) for _ in range(n)],
        "queued_s": np.repeat(np.asarray([d.queued_s for d in done], dtype=np.float64), sizes),
        "generate_s": np.repeat(np.asarray([d.generate_s for d in done], dtype=np.float64), sizes),
    }


def _group_columns(
    heads: Sequence[Mapping[str, Any]], run_id: str, group_size: int, origin: str | None
) -> dict[str, Any]:
    """A batch's own fields and its per-group columns (the prompts end to end)."""
    prompts = [np.asarray(h["prompt_ids"], dtype=np.int32) for h in heads]
    return {
        "run_id": run_id,
        "group_size": group_size,
        "origin": origin,
        "prompt_id": [h["prompt_id"] for h in heads],
        "group_id": [h["group_id"] for h in heads],
        "uid": [h.get("uid") for h in heads],
        "meta": [h.get("meta") for h in heads],
        "prompt_ids": _joined(prompts, np.int32),
        "prompt_offsets": _offsets([len(p) for p in prompts]),
    }


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
    for key, types, ok, what in _ENTRIES + (_SCORED_ENTRIES if "reward" in batch else ()):
        values = batch[key]
        # the types of its entries, in one pass in C; each entry checked only when one is
        # of another type (a subclass of str, a Mapping that is no dict)
        if not set(map(type, values)) <= types and not all(ok(v) for v in values):
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


_STR, _MAP = frozenset({str}), frozenset({dict})
_ENTRIES = (
    ("prompt_id", _STR, lambda v: isinstance(v, str), "a str"),
    ("group_id", _STR, lambda v: isinstance(v, str), "a str"),
    ("uid", _STR | {type(None)}, lambda v: v is None or isinstance(v, str), "a str or None"),
    ("meta", _MAP | {type(None)}, lambda v: v is None or isinstance(v, Mapping), "a map or None"),
    ("finish_reason", _STR, lambda v: isinstance(v, str), "a str"),
    ("engine", _STR, lambda v: isinstance(v, str), "a str"),
)
_SCORED_ENTRIES = (("reward_info", _MAP, lambda v: isinstance(v, Mapping), "a map"),)
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
    key = _slot_keys(batch)
    if key is None:
        return False
    if not len(key) or bool(np.all(key[1:] > key[:-1])):
        return True  # in order (what a generator sends): each slot once
    return len(np.unique(key)) == len(key)


def group_map(batch: Mapping[str, Any], g: int, lo: int, hi: int) -> dict[str, Any]:
    """Group ``g`` of ``batch`` (its samples ``lo:hi``, ``spans``) as the ``rollout_group`` (a
    scored batch's: ``scored_group``) map it stands for."""
    one = take([(batch, g, lo, hi)], batch["run_id"], batch["group_size"], batch["origin"])
    return groups(one)[0]


def in_order(batch: Mapping[str, Any]) -> bool:
    """Whether ``batch`` is ``well_formed`` with each group's samples in ``sample_index``
    order: its columns are then those of the groups it stands for, as they are scored and
    trained, with no sample to reorder or drop."""
    if len(set(batch["group_id"])) != len(batch["group_id"]):
        return False
    key = _slot_keys(batch)
    return key is not None and (not len(key) or bool(np.all(key[1:] > key[:-1])))


def _slot_keys(batch: Mapping[str, Any]) -> np.ndarray | None:
    """Each sample's slot (group x group_size + index); None if an index is out of range."""
    index = np.asarray(batch["sample_index"])
    size = batch["group_size"]
    if len(index) and (index.min() < 0 or index.max() >= size):
        return None
    return np.asarray(batch["group"], dtype=np.int64) * size + index


def spans(batch: Mapping[str, Any]) -> list[int]:
    """Where each group's samples start in ``batch`` (one without ``problems``), and where the
    last ends: group ``g`` holds samples ``spans[g]:spans[g + 1]``."""
    n = len(batch["group_id"])
    return np.searchsorted(np.asarray(batch["group"]), np.arange(n + 1)).tolist()


# the columns of a batch's groups, of its samples and of its tokens (a scored batch's too)
_PER_SAMPLE_ARRAYS = ("sample_index", "queued_s", "generate_s")
_PER_SAMPLE_LISTS = ("finish_reason", "engine")
_PER_TOKEN = ("completion_ids", "sampler_logprobs", "versions")
_SCORED_ARRAYS = ("reward", "score_s")


def take(
    parts: Sequence[tuple[Mapping[str, Any], int, int, int]],
    run_id: str,
    group_size: int,
    origin: str | None,
) -> dict[str, Any]:
    """A batch of the groups ``parts`` name, in that order: ``(batch, g, lo, hi)`` is group
    ``g`` of ``batch`` (one without ``problems``), whose samples are ``lo:hi`` (``spans``).
    The batches are all ``rollout_batch`` or all ``scored_batch`` columns; every group of one
    batch, in order, gives that batch's own columns back (no copy)."""
    first = parts[0][0]
    scored = "reward" in first
    if len(parts) == len(first["group_id"]) and all(
        b is first and g == i for i, (b, g, _, _) in enumerate(parts)
    ):
        out = {key: first[key] for key in _KEYS + (_SCORED_KEYS if scored else ())}
        out.update(run_id=run_id, group_size=group_size, origin=origin)
        return out
    out: dict[str, Any] = {"run_id": run_id, "group_size": group_size, "origin": origin}
    for key in ("prompt_id", "group_id", "uid", "meta"):
        out[key] = [b[key][g] for b, g, _, _ in parts]
    out["group"] = np.repeat(
        np.arange(len(parts), dtype=np.int32), [hi - lo for *_, lo, hi in parts]
    )
    # runs of consecutive groups of one batch: each column cut once a run, not once a group
    runs: list[list[Any]] = []  # [batch, first group, last group + 1, lo, hi]
    for b, g, lo, hi in parts:
        last = runs[-1] if runs else None
        if last is not None and last[0] is b and last[2] == g and last[4] == lo:
            last[2], last[4] = g + 1, hi
        else:
            runs.append([b, g, g + 1, lo, hi])
    prompts, tokens, lengths = [], [], []
    for b, g0, g1, lo, hi in runs:
        offsets, cuts = b["prompt_offsets"], b["completion_offsets"]
        prompts.append(b["prompt_ids"][int(offsets[g0]) : int(offsets[g1])])
        lengths.append(np.diff(np.asarray(offsets[g0 : g1 + 1])))
        tokens.append((b, int(cuts[lo]), int(cuts[hi])))
    out["prompt_ids"] = _cat(prompts)
    out["prompt_offsets"] = _offsets(np.concatenate(lengths))
    for key in _PER_TOKEN:
        out[key] = _cat([b[key][a:z] for b, a, z in tokens])
    sizes = [np.diff(np.asarray(b["completion_offsets"][lo : hi + 1])) for b, _, _, lo, hi in runs]
    out["completion_offsets"] = _offsets(np.concatenate(sizes))
    for key in _PER_SAMPLE_ARRAYS + (_SCORED_ARRAYS if scored else ()):
        out[key] = _cat([b[key][lo:hi] for b, _, _, lo, hi in runs])
    for key in _PER_SAMPLE_LISTS + (("reward_info",) if scored else ()):
        out[key] = [v for b, _, _, lo, hi in runs for v in b[key][lo:hi]]
    return out


_KEYS = (
    "prompt_id",
    "group_id",
    "uid",
    "meta",
    "prompt_ids",
    "prompt_offsets",
    "group",
    "completion_offsets",
    *_PER_TOKEN,
    *_PER_SAMPLE_ARRAYS,
    *_PER_SAMPLE_LISTS,
)
_SCORED_KEYS = (*_SCORED_ARRAYS, "reward_info")


def _cat(arrays: list[Any]) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) != 1 else np.asarray(arrays[0])


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
