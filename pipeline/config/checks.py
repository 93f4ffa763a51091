"""Checks across stages' options that no single stage can make: batch splits, groups, devices.

``pipeline_issues`` runs once every stage's options are built. It recognizes stages by what
their options hold, not by name, so a plugin with the same options is checked the same way:

- A *trainer* is a stage whose class is ``distributed`` (its replicas are the ranks of one
  group) and whose options have an integer ``batch_size``: the ranks take equal shares, so
  ``batch_size`` must be a multiple of ``replicas``. Micro-batches (``train_micro_batch``,
  ``forward_micro_batch``) need not divide anything: the learner's last micro-batch may be
  smaller and ranks with fewer micro-batches pad with empty ones (``stages/learner``).
- A *sampler* is a stage whose options have integer ``group_size`` and ``sync_batch``. Feeding
  a trainer that uses group advantages (options with ``advantage``), ``group_size`` must be at
  least 2: a reward minus the mean of a group of one is 0, and nothing would be learned. In
  ``run.mode: sync`` a trainer's policy version lasts ``publish.every`` steps of ``batch_size``
  samples, and its samplers start exactly their ``sync_batch`` per version: the sum over the
  samplers upstream of it (times their replicas) must equal ``batch_size * publish.every``
  (fewer: the trainer waits for ever for its batch while the samplers wait for a new version;
  more: samples are trained after the next version is out, which is not sync).
- A trainer that distills (options with ``distill.coef > 0``) needs a stage upstream of it whose
  options have a ``teacher`` (the scorer's): without one no sample carries teacher log-probs,
  and every group would be dropped.
- A field with ``device`` metadata names a torch device: ``cpu``, ``cuda`` or ``cuda:N``
  (``device: "auto"`` metadata: ``auto`` too, left to the stage), and ``N`` must be below the
  number of GPUs the process will see (its own ``resources.gpus`` share, else its stage's, its
  stage's ``CUDA_VISIBLE_DEVICES``, or the host's when an inventory is given).

Every problem is a ConfigIssue at the key to change, with its ``file:line`` and what would be
valid. Only reports; imports no stage code.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config.errors import ConfigIssue
from pipeline.config.schema import Resources, RunSection, StageSection
from pipeline.config.typed import did_you_mean
from pipeline.config.yaml_source import Locations, join_path, parent_path

if TYPE_CHECKING:
    from pipeline.placement import Inventory

__all__ = ["pipeline_issues"]

_DEVICE = re.compile(r"(cpu|cuda)(:(0|[1-9][0-9]*))?")
_GPU_VAR = "CUDA_VISIBLE_DEVICES"


def _int(options: Any, name: str) -> int | None:
    value = getattr(options, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pipeline_issues(
    run: RunSection,
    stages: Mapping[str, StageSection],
    classes: Mapping[str, type],
    locations: Locations,
    inventory: Inventory | None = None,
) -> list[ConfigIssue]:
    """Every cross-stage problem in the built ``stages`` (those whose options were built)."""
    found: list[ConfigIssue] = []

    def fail(path: str, message: str) -> None:
        found.append(ConfigIssue(path, message, locations.at(path)))

    built = {name: s for name, s in stages.items() if s.options is not None}
    trainers = {
        name: s
        for name, s in built.items()
        if getattr(classes.get(name), "distributed", False) is True
        and _int(s.options, "batch_size") is not None
    }
    samplers = {
        name: s
        for name, s in built.items()
        if _int(s.options, "group_size") is not None and _int(s.options, "sync_batch") is not None
    }
    for name, section in trainers.items():
        _check_ranks(name, section, locations, fail)
    upstream = _upstream(stages)
    for name, section in trainers.items():
        feeding = {s: samplers[s] for s in upstream.get(name, ()) if s in samplers}
        if getattr(section.options, "advantage", None) is not None:
            for sampler, sampler_section in feeding.items():
                _check_group_size(sampler, sampler_section, name, fail)
        if run.mode == "sync" and feeding:
            _check_sync_batch(name, section, feeding, locations, fail)
        producers = {s: built[s] for s in upstream.get(name, ()) if s in built}
        _check_teacher(name, section, producers, fail)
        _check_builtin_engines_only(name, section, producers, fail)
        if run.mode == "sync" and getattr(section.options, "dynamic_sampling", False) is True:
            fail(
                join_path(join_path("stages", name), "dynamic_sampling"),
                "run.mode is sync: each policy version gets one batch of samples, and a step "
                "that leaves groups out would wait for more that never come; use run.mode: "
                "async, or dynamic_sampling: false",
            )
    for name, section in built.items():
        _check_devices(name, section, inventory, fail)
        if not run.trust_remote_code:
            _check_own_code(name, section, fail)
    return found


_FOLDER_CHECKS = ("model_check", "tokenizer_check")  # stages.hub's checks of a model folder


def _check_own_code(name: str, section: StageSection, fail: Any) -> None:
    """A model or tokenizer folder that ships its own code (``auto_map`` in its
    ``config.json`` or ``tokenizer_config.json``) needs ``run.trust_remote_code``: without it
    the stage and the engines would refuse it once started (a Hub id not downloaded yet is
    left to them)."""
    for owner, field_name, path, value in _fields_with(section.options, "check", "stages." + name):
        spec = {f.name: f for f in dataclasses.fields(owner)}[field_name].metadata["check"]
        if getattr(spec, "__name__", "") not in _FOLDER_CHECKS or not isinstance(value, str):
            continue
        folder = Path(value).expanduser()
        own = [f for f in ("config.json", "tokenizer_config.json") if _has_auto_map(folder / f)]
        if own:
            fail(
                path,
                f"{value} ships its own code ({', '.join(own)}: auto_map), which runs only "
                "where the run trusts it: set run.trust_remote_code: true for a folder you "
                "trust, or use one without it",
            )


def _has_auto_map(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("auto_map"))


def _check_ranks(name: str, section: StageSection, locations: Locations, fail: Any) -> None:
    batch, ranks = section.options.batch_size, section.replicas
    if batch % ranks == 0:
        return
    stage = join_path("stages", name)
    lower, higher = batch - batch % ranks, batch - batch % ranks + ranks
    use = f"{lower} or {higher}" if lower else f"{higher}"
    fail(
        join_path(stage, "batch_size"),
        f"batch_size {batch} over {ranks} ranks ({stage}.replicas, "
        f"{locations.at(join_path(stage, 'replicas'))}) is {batch / ranks:.2f} samples per rank: "
        f"each rank trains an equal share, so batch_size must be a multiple of {ranks}: use {use}",
    )


def _upstream(stages: Mapping[str, StageSection]) -> dict[str, set[str]]:
    """Every stage's transitive producers, from the ``inputs`` edges (``STAGE.PORT``)."""
    direct: dict[str, set[str]] = {}
    for consumer, section in stages.items():
        for sources in section.inputs.values():
            for source in [sources] if isinstance(sources, str) else sources:
                direct.setdefault(consumer, set()).add(source.partition(".")[0])
    closed: dict[str, set[str]] = {}
    for start in stages:
        seen: set[str] = set()
        todo = list(direct.get(start, ()))
        while todo:
            producer = todo.pop()
            if producer not in seen:
                seen.add(producer)
                todo.extend(direct.get(producer, ()))
        closed[start] = seen
    return closed


def _check_builtin_engines_only(
    name: str, section: StageSection, producers: Mapping[str, StageSection], fail: Any
) -> None:
    """A LoRA trainer publishes adapters (``MODULE.lora_A.weight``...) over the weight group,
    which the built-in engine merges, unless ``publish.lora_transport: files`` (SGLang's way:
    adapter folders loaded by name); ``publish.delta`` sends changed values only, which the
    built-in engine writes; SGLang has no delta updates."""
    lora = getattr(section.options, "lora", None)
    lora_rank = getattr(lora, "rank", 0)
    publish = getattr(section.options, "publish", None)
    delta = getattr(publish, "delta", False) is True
    files = getattr(publish, "lora_transport", "group") == "files"
    stage = join_path("stages", name)
    for producer, producer_section in producers.items():
        launch = getattr(producer_section.options, "launch", None)
        if getattr(launch, "kind", None) != "sglang":
            continue
        if isinstance(lora_rank, int) and lora_rank > 0 and not files:
            fail(
                join_path(join_path(stage, "publish"), "lora_transport"),
                f"lora.rank {lora_rank}: over the weight group a LoRA learner's adapters are "
                f"merged by the built-in engine; {producer}'s engines are SGLang, which loads "
                f"adapters by name from files: set publish.lora_transport: files (and start "
                f"SGLang with --enable-lora --max-lora-rank {lora_rank} --lora-target-modules "
                f"...), or use launch.kind: builtin for {producer}",
            )
        if delta:
            fail(
                join_path(join_path(stage, "publish"), "delta"),
                f"publish.delta: {producer}'s engines are SGLang, which takes whole tensors "
                f"only; use launch.kind: builtin for {producer}, or publish.delta: false",
            )


def _check_teacher(
    trainer: str, section: StageSection, upstream: Mapping[str, StageSection], fail: Any
) -> None:
    coef = getattr(getattr(section.options, "distill", None), "coef", 0)
    if not isinstance(coef, (int, float)) or coef <= 0:
        return
    if any(getattr(s.options, "teacher", None) is not None for s in upstream.values()):
        return
    fail(
        join_path(join_path("stages", trainer), "distill.coef"),
        f"distill.coef is {coef} but no stage upstream of {trainer!r} asks a teacher for "
        "log-probs (set the scorer's teacher: {url: ...} or {launch: {model: ...}}): every "
        "group would arrive without teacher_logprobs and be dropped",
    )


def _check_group_size(sampler: str, section: StageSection, trainer: str, fail: Any) -> None:
    if section.options.group_size >= 2:
        return
    fail(
        join_path(join_path("stages", sampler), "group_size"),
        f"group_size 1 feeds {trainer!r}, whose advantage is a reward minus its group's mean: "
        "in a group of one that is always 0 and nothing is learned; use 2 or more (4 is usual)",
    )


def _check_sync_batch(
    trainer: str,
    section: StageSection,
    samplers: Mapping[str, StageSection],
    locations: Locations,
    fail: Any,
) -> None:
    batch = section.options.batch_size
    publish = getattr(section.options, "publish", None)
    every = _int(publish, "every") or 1
    per_version = batch * every
    how = f"{trainer}.batch_size {batch}" + (f" x publish.every {every}" if every > 1 else "")
    for sampler, s in samplers.items():
        path = join_path(join_path("stages", sampler), "sync_batch")
        size = s.options.group_size
        if s.options.sync_batch >= 1:
            continue
        share = per_version // s.replicas if len(samplers) == 1 else None
        hint = (
            f": set it to {share}"
            if share is not None and share * s.replicas == per_version and share % size == 0
            else f" (a multiple of group_size {size})"
        )
        fail(
            path,
            f"run.mode is sync: each policy version needs {per_version} samples ({how}), "
            f"started by the generators' sync_batch, which is not set{hint}",
        )
    if any(s.options.sync_batch < 1 for s in samplers.values()):
        return
    total = sum(s.options.sync_batch * s.replicas for s in samplers.values())
    if total == per_version:
        return
    sampler, s = next(iter(samplers.items()))
    path = join_path(join_path("stages", sampler), "sync_batch")
    parts = " + ".join(
        f"{n}.sync_batch {samplers[n].options.sync_batch}"
        + (f" x {samplers[n].replicas} replicas" if samplers[n].replicas > 1 else "")
        for n in samplers
    )
    effect = (
        "the learner would wait for ever for its batch while generation waits for a new version"
        if total < per_version
        else "the rest would be trained after the next version is out, which is not sync"
    )
    fix = ""
    if len(samplers) == 1 and per_version % s.replicas == 0:
        share = per_version // s.replicas
        if share % s.options.group_size == 0:
            fix = f": set {sampler}.sync_batch to {share}"
        else:
            fix = (
                f"; {share} per replica is not a multiple of group_size "
                f"{s.options.group_size}: change {trainer}.batch_size too"
            )
    fail(
        path,
        f"run.mode is sync: the generators start {total} samples per policy version ({parts}), "
        f"but {trainer} trains {per_version} per version ({how}, at "
        f"{locations.at(join_path(join_path('stages', trainer), 'batch_size'))}): "
        f"{effect}{fix}",
    )


def _fields_with(options: Any, key: str, path: str) -> Iterator[tuple[Any, str, str, Any]]:
    """(owner dataclass, field name, key path, value) of every field with ``key`` metadata."""
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        return
    for f in dataclasses.fields(options):
        value = getattr(options, f.name, None)
        sub = join_path(path, f.name)
        if f.metadata.get(key):
            yield options, f.name, sub, value
        if dataclasses.is_dataclass(value):
            yield from _fields_with(value, key, sub)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from _fields_with(item, key, f"{sub}[{i}]")


def _visible_gpus(
    owner: Any, owner_path: str, stage: str, section: StageSection, inventory: Inventory | None
) -> tuple[int, str] | None:
    """How many GPUs the process that uses ``owner``'s device sees, and why; None: unknown."""
    # a launch's own GPUs; else (a launched process inherits its replica's) the stage's
    tiers = [(section.resources, section.replicas, join_path(stage, "resources.gpus"))]
    own = getattr(owner, "resources", None)
    if isinstance(own, Resources):
        processes = section.replicas * (_int(owner, "count") or 1)
        tiers.insert(0, (own, processes, join_path(owner_path, "resources.gpus")))
    for resources, processes, key in tiers:
        if isinstance(resources.gpus, int) and resources.gpus:
            return resources.gpus, f"{key}: {resources.gpus} per process"
        if isinstance(resources.gpus, list) and resources.gpus:
            share = len(resources.gpus) // processes
            return share, f"{key} lists {len(resources.gpus)} for {processes} processes"
    if _GPU_VAR in section.env:
        visible = [t for t in section.env[_GPU_VAR].split(",") if t.strip()]
        return len(visible), f"env {_GPU_VAR}={section.env[_GPU_VAR]!r}"
    if inventory is not None:
        return len(inventory.gpus), f"this host: {inventory.gpu_source}"
    return None


def _check_devices(
    name: str, section: StageSection, inventory: Inventory | None, fail: Any
) -> None:
    found = _fields_with(section.options, "device", join_path("stages", name))
    for owner, field_name, path, value in found:
        if not isinstance(value, str):
            continue
        meta = {f.name: f.metadata for f in dataclasses.fields(owner)}[field_name]
        if value == "auto" and meta.get("device") == "auto":
            continue
        match = _DEVICE.fullmatch(value)
        if match is None:
            guess = value.strip().lower().replace("gpu", "cuda").replace(" ", "")
            guess = re.sub(r"^cuda(\d+)$", r"cuda:\1", guess)
            hint = (
                f"; did you mean {guess!r}?"
                if _DEVICE.fullmatch(guess)
                else did_you_mean(value, ["cpu", "cuda", "cuda:0"])
            )
            fail(
                path,
                f"expected a device: cpu, cuda or cuda:N (N the index of a GPU the process "
                f"sees, from 0), got {value!r}{hint}",
            )
            continue
        if match.group(1) != "cuda":
            continue
        stage = join_path("stages", name)
        seen = _visible_gpus(owner, parent_path(path), stage, section, inventory)
        if seen is None:
            continue
        count, why = seen
        index = int(match.group(3) or 0)
        if count == 0:
            fail(path, f"{value!r} needs a GPU, but the process sees none ({why}): use cpu")
        elif index >= count:
            valid = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            fail(
                path,
                f"{value!r} is out of range: the process sees {count} GPU"
                f"{'' if count == 1 else 's'} ({why}; CUDA numbers the visible ones from 0): "
                f"use {valid}",
            )
