"""The placement plan: which CPU cores and GPUs every replica, and every engine it launches, gets.

Every stage entry may declare ``resources: {cpus, gpus}`` per replica, and so may an engine
launch among a stage's options (the generator's ``launch:``, per engine). ``requests`` lists the
processes a pipeline will start, each with what it asks for: this is launcher-neutral. ``plan``
places them on one host's ``Inventory`` (the cores this process may run on, the GPUs it sees):
explicit ids are taken as given, counts are filled from what is left in ascending order, and
processes that ask for no cores float on the cores nobody reserved (on every core when all are
reserved). Everything wrong is reported at once as ConfigIssues with their key paths: ids that do
not exist, explicit lists that overlap, more cores or GPUs asked for than the host has, GPUs on
a host without any.

``process_env``, ``affinity`` and ``engine_placement`` turn one process's assignment into what a
local launcher applies: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (unless the stage's own ``env``
sets one of them), ``CUDA_VISIBLE_DEVICES`` and the cores to pin to. The engines a replica
launches get theirs through one environment variable (``ENGINE_PLACEMENT_ENV``, JSON), read back
with ``read_engine_placement``: stage code sees its environment, not the plan.

Pure: nothing here starts, pins or probes anything, except ``host_inventory`` (the
supervisor's affinity, ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L``; torch is not imported).
``python -m pipeline.placement`` prints this host's inventory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pipeline.config.errors import ConfigIssue
from pipeline.config.schema import Resources, StageSection
from pipeline.config.yaml_source import join_path

__all__ = [
    "ENGINE_PLACEMENT_ENV",
    "THREAD_VARS",
    "Assignment",
    "Inventory",
    "Launch",
    "Plan",
    "ProcessPlacement",
    "Request",
    "affinity",
    "engine_placement",
    "host_inventory",
    "plan",
    "process_env",
    "read_engine_placement",
    "requests",
    "span",
]

ENGINE_PLACEMENT_ENV = "INFLIGHT_ENGINE_PLACEMENT"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_GPU_VAR = "CUDA_VISIBLE_DEVICES"

Locate = Callable[[str], str]


@runtime_checkable
class Launch(Protocol):
    """A stage option that makes each replica start ``count`` processes of its own (engines).

    The generator's ``LaunchConfig`` is one. A stage's options hold at most one launch (the
    first such field counts); its processes are named ``STAGE.REPLICA.engineI``.
    """

    count: int
    resources: Resources | None


@dataclass(frozen=True)
class Inventory:
    """What one host offers: core ids this process may run on, and GPU ids it can see.

    ``gpu_devices`` is what ``CUDA_VISIBLE_DEVICES`` must say for each GPU id (same order); it
    differs from the ids only when the parent's ``CUDA_VISIBLE_DEVICES`` lists UUIDs.
    ``gpu_source`` says where the GPUs were found, for messages.
    """

    cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()
    gpu_devices: tuple[str, ...] = ()
    gpu_source: str = "no GPUs given"
    memory_gb: float | None = None  # physical memory (None: unknown, not checked)

    def device(self, gpu: int) -> str:
        if self.gpu_devices:
            return self.gpu_devices[self.gpus.index(gpu)]
        return str(gpu)

    def describe(self) -> str:
        gpus = f"GPUs [{span(self.gpus)}]" if self.gpus else "no GPUs"
        return f"cores [{span(self.cores)}], {gpus} ({self.gpu_source})"


def host_inventory(environ: Mapping[str, str] | None = None) -> Inventory:
    """This host as this process sees it: its CPU affinity and its GPUs.

    GPUs: ``CUDA_VISIBLE_DEVICES`` when set (integers are the ids; UUIDs or MIG names are
    numbered 0..n-1 in order), else one per ``nvidia-smi -L`` line, else none.
    """
    environ = os.environ if environ is None else environ
    inventory = _cores_and_gpus(environ)
    return dataclasses.replace(inventory, memory_gb=_memory_gb())


def _memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def _cores_and_gpus(environ: Mapping[str, str]) -> Inventory:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    visible = environ.get(_GPU_VAR)
    if visible is not None:
        tokens = [t.strip() for t in visible.split(",") if t.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual way to hide every GPU
        valid = []
        for token in tokens:
            if token.lstrip("-").isdigit() and int(token) < 0:
                break
            valid.append(token)
        source = f"{_GPU_VAR}={visible!r}"
        if all(t.isdigit() for t in valid):
            return Inventory(cores, tuple(int(t) for t in valid), (), source)
        return Inventory(cores, tuple(range(len(valid))), tuple(valid), source)
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except FileNotFoundError:
        return Inventory(cores, gpu_source=f"no {_GPU_VAR}, no nvidia-smi")
    except (OSError, subprocess.SubprocessError) as exc:
        return Inventory(cores, gpu_source=f"nvidia-smi -L failed: {exc}")
    ids = tuple(int(m.group(1)) for m in re.finditer(r"^GPU (\d+):", listed, flags=re.MULTILINE))
    return Inventory(cores, ids, (), "nvidia-smi -L" if ids else "nvidia-smi -L lists none")


@dataclass(frozen=True)
class Request:
    """One process to start and what it asks for (its share of its ``resources`` entry).

    ``cpus``/``gpus``: a count, explicit ids (this process's share of an explicit list), or
    None/0 for nothing. ``resources`` is the entry itself, at key path ``path``; ``owner`` names
    it in messages (``learner``, ``generator.launch``).
    """

    name: str
    stage: str
    replica: int
    engine: int | None
    resources: Resources | None
    path: str
    owner: str
    cpus: int | tuple[int, ...] | None
    gpus: int | tuple[int, ...]


@dataclass(frozen=True)
class Assignment:
    """Where one process runs. ``pinned``: the cores are its own; else it floats on them."""

    request: Request
    cores: tuple[int, ...]
    gpus: tuple[int, ...]
    pinned: bool

    @property
    def name(self) -> str:
        return self.request.name


@dataclass(frozen=True)
class Plan:
    """Every process's assignment on one host, in start order (config order)."""

    inventory: Inventory
    assignments: tuple[Assignment, ...]
    floating: tuple[int, ...]  # cores of the processes that reserve none
    every_core_reserved: bool

    @property
    def reserves_anything(self) -> bool:
        return any(a.pinned or a.gpus for a in self.assignments)

    @property
    def pins_cores(self) -> bool:
        return any(a.pinned for a in self.assignments)

    def replica(self, stage: str, replica: int) -> Assignment:
        for a in self.assignments:
            if a.request.stage == stage and a.request.replica == replica:
                if a.request.engine is None:
                    return a
        raise KeyError(f"no replica {stage}.{replica} in the plan")

    def engines(self, stage: str, replica: int) -> list[Assignment]:
        return [
            a
            for a in self.assignments
            if a.request.stage == stage
            and a.request.replica == replica
            and a.request.engine is not None
        ]

    def lines(self) -> list[str]:
        """One line per process: ``name -> cores [..], GPUs [..]`` or ``floating on cores``."""
        width = max((len(a.name) for a in self.assignments), default=0)
        out = []
        for a in self.assignments:
            if a.pinned:
                where = f"cores [{span(a.cores)}]"
            else:
                where = f"floating on cores [{span(a.cores)}]"
                if self.every_core_reserved:
                    where += " (every core is reserved)"
            if a.gpus:
                where += f", GPUs [{span(a.gpus)}]"
            out.append(f"{a.name.ljust(width)} -> {where}")
        return out


def span(ids: Iterable[int]) -> str:
    """``0-3,8`` for [0, 1, 2, 3, 8]: how ``Cpus_allowed_list`` writes a set of ids."""
    ordered = sorted(set(ids))
    runs: list[list[int]] = []
    for i in ordered:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _nowhere(path: str) -> str:
    return ""


# ---------------------------------------------------------------------------------- requests
def _launch_of(options: object) -> tuple[str, Launch] | None:
    if options is None or not dataclasses.is_dataclass(options):
        return None
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if (
            isinstance(value, Launch)
            and isinstance(value.count, int)
            and isinstance(value.resources, (Resources, type(None)))
        ):
            return f.name, value
    return None


def _shares(
    value: int | list[int] | None,
    n: int,
    path: str,
    what: str,
    per: str,
    fail: Callable[[str, str], None],
) -> list[int | tuple[int, ...] | None] | None:
    """Each of ``n`` processes' share of a count or explicit list (None: nothing is shared)."""
    if not isinstance(value, list):
        return [value] * n
    ok = True
    if what == "core" and not value:
        fail(path, "an empty list of core ids: give core ids, a count, or leave cpus out")
        return None
    for i, ident in enumerate(value):
        if ident < 0:
            fail(f"{path}[{i}]", f"{what} ids are 0 or more, got {ident}")
            ok = False
        elif ident in value[:i]:
            fail(f"{path}[{i}]", f"{what} {ident} is listed twice")
            ok = False
    if len(value) % n:
        fail(
            path,
            f"{len(value)} {what} ids cannot be shared out evenly among {n} {per}: give a "
            f"multiple of {n} ids (each gets the next {len(value) // n or 1} in order) or a count",
        )
        ok = False
    if not ok:
        return None
    k = len(value) // n
    return [tuple(value[i * k : (i + 1) * k]) for i in range(n)]


def requests(
    stages: Mapping[str, StageSection],
    issues: list[ConfigIssue] | None = None,
    locate: Locate = _nowhere,
) -> list[Request]:
    """Every process the stages start (each replica, then the engines it launches), in order.

    Problems that need no host (empty or repeated ids, a list that does not split evenly, an
    ``env`` that sets ``CUDA_VISIBLE_DEVICES`` beside ``gpus``) go to ``issues``.
    """
    issues = [] if issues is None else issues

    def fail(path: str, message: str) -> None:
        issues.append(ConfigIssue(path, message, locate(path)))

    out: list[Request] = []
    for stage, section in stages.items():
        path = join_path(join_path("stages", stage), "resources")
        res = section.resources
        launch = _launch_of(section.options)
        n = section.replicas
        cpus = _shares(
            res.cpus if res else None, n, join_path(path, "cpus"), "core", "replicas", fail
        )
        gpus = _shares(res.gpus if res else 0, n, join_path(path, "gpus"), "GPU", "replicas", fail)
        if res is not None and res.gpus and _GPU_VAR in section.env:
            fail(
                join_path(join_path(join_path("stages", stage), "env"), _GPU_VAR),
                f"{_GPU_VAR} set in env and gpus requested in resources: the placement sets "
                f"{_GPU_VAR}; remove one of them",
            )
        engine_cpus = engine_gpus = None
        if launch is not None:
            field, cfg = launch
            lres = cfg.resources
            lpath = join_path(join_path(join_path("stages", stage), field), "resources")
            total = n * cfg.count
            per = "engines" + (f" ({n} replicas x {cfg.count})" if n > 1 else "")
            engine_cpus = _shares(
                lres.cpus if lres else None, total, join_path(lpath, "cpus"), "core", per, fail
            )
            engine_gpus = _shares(
                lres.gpus if lres else 0, total, join_path(lpath, "gpus"), "GPU", per, fail
            )
        for r in range(n):
            out.append(
                Request(
                    f"{stage}.{r}",
                    stage,
                    r,
                    None,
                    res,
                    path,
                    stage,
                    cpus[r] if cpus else None,
                    gpus[r] if gpus else 0,
                )
            )
            if launch is None:
                continue
            field, cfg = launch
            for i in range(cfg.count):
                k = r * cfg.count + i
                out.append(
                    Request(
                        f"{stage}.{r}.engine{i}",
                        stage,
                        r,
                        i,
                        cfg.resources,
                        lpath,
                        f"{stage}.{field}",
                        engine_cpus[k] if engine_cpus else None,
                        engine_gpus[k] if engine_gpus else 0,
                    )
                )
    _check_overlaps(out, fail, locate)
    return out


def _check_overlaps(reqs: list[Request], fail: Callable[[str, str], None], locate: Locate) -> None:
    """Explicit ids claimed by two entries (within one entry, repeats were reported already)."""
    for kind in ("cpus", "gpus"):
        what = "core" if kind == "cpus" else "GPU"
        owner: dict[int, Request] = {}
        for req in reqs:
            ids = getattr(req, kind)
            if not isinstance(ids, tuple):
                continue
            for ident in ids:
                first = owner.setdefault(ident, req)
                if first.path != req.path:
                    other = join_path(first.path, kind)
                    where = ", ".join(p for p in (other, locate(other)) if p)
                    fail(
                        join_path(req.path, kind),
                        f"{what} {ident} is also requested by {first.owner} ({where}): "
                        f"explicit {what} lists must not overlap",
                    )


# ---------------------------------------------------------------------------------- the plan
def plan(
    stages: Mapping[str, StageSection],
    inventory: Inventory | None,
    locate: Locate = _nowhere,
) -> tuple[Plan | None, list[ConfigIssue]]:
    """The placement of every process on ``inventory``, and every problem found.

    With ``inventory`` None only the host-independent checks run and no plan is made. The plan
    is None whenever there are issues. ``locate`` maps a key path to ``file:line``.
    """
    issues: list[ConfigIssue] = []

    def fail(path: str, message: str) -> None:
        issues.append(ConfigIssue(path, message, locate(path)))

    reqs = requests(stages, issues, locate)
    if inventory is None:
        return None, issues
    _check_memory_and_custom(reqs, inventory, fail)
    cores = _place(reqs, "cpus", inventory.cores, inventory, fail, locate)
    gpus = _place(reqs, "gpus", inventory.gpus, inventory, fail, locate)
    if issues:
        return None, issues
    reserved = {c for ids in cores.values() for c in ids}
    floating = tuple(c for c in inventory.cores if c not in reserved)
    every = not floating
    floating = floating or inventory.cores
    assignments = tuple(
        Assignment(
            req,
            cores.get(req.name, floating),
            gpus.get(req.name, ()),
            req.name in cores,
        )
        for req in reqs
    )
    return Plan(inventory, assignments, floating, every), issues


def _check_memory_and_custom(
    reqs: list[Request], inventory: Inventory, fail: Callable[[str, str], None]
) -> None:
    """One host has no custom resources, and its processes' ``memory_gb`` must fit in it."""
    reported: set[str] = set()
    total = 0.0
    for req in reqs:
        res = req.resources
        if res is None:
            continue
        if res.custom and req.path not in reported:
            reported.add(req.path)
            names = ", ".join(sorted(res.custom))
            fail(
                join_path(req.path, "custom"),
                f"custom resources ({names}) place replicas on nodes of a Ray cluster; one host "
                "has none: set run.launcher: ray, or remove them",
            )
        total += res.memory_gb or 0.0
    if inventory.memory_gb is not None and total > inventory.memory_gb:
        asking = [r for r in reqs if r.resources is not None and r.resources.memory_gb]
        first = asking[0].path
        who = ", ".join(f"{r.name} {r.resources.memory_gb:g}" for r in asking)  # type: ignore[union-attr]
        fail(
            join_path(first, "memory_gb"),
            f"{total:g} GiB of memory asked in all ({who}), but this host has "
            f"{inventory.memory_gb:.1f} GiB: ask for less",
        )


def _place(
    reqs: list[Request],
    kind: str,
    available: tuple[int, ...],
    inventory: Inventory,
    fail: Callable[[str, str], None],
    locate: Locate,
) -> dict[str, tuple[int, ...]]:
    """Process name -> its ids of ``kind``: explicit ids first, then counts from what is left."""
    what = "core" if kind == "cpus" else "GPU"
    placed: dict[str, tuple[int, ...]] = {}
    asking = [r for r in reqs if getattr(r, kind)]
    if not asking:
        return placed
    if kind == "gpus" and not available:
        reported = set()
        for req in asking:
            if req.path not in reported:
                reported.add(req.path)
                fail(
                    join_path(req.path, "gpus"),
                    f"gpus requested, but this host has no GPUs ({inventory.gpu_source}): "
                    "remove gpus, or run where GPUs are visible",
                )
        return placed
    taken: set[int] = set()
    reported_missing: set[tuple[str, int]] = set()
    for req in asking:
        ids = getattr(req, kind)
        if not isinstance(ids, tuple):
            continue
        missing = [i for i in ids if i not in available]
        for ident in missing:
            if (req.path, ident) in reported_missing:
                continue
            reported_missing.add((req.path, ident))
            if kind == "cpus":
                has = f"inflight may run on cores [{span(available)}] (its CPU affinity)"
            else:
                has = f"the GPUs here are [{span(available)}] ({inventory.gpu_source})"
            fail(join_path(req.path, kind), f"{what} {ident} does not exist here: {has}")
        placed[req.name] = ids
        taken.update(i for i in ids if i in available)
    free = [i for i in available if i not in taken]
    counts = [r for r in asking if isinstance(getattr(r, kind), int)]
    explicit = sum(len(getattr(r, kind)) for r in asking if isinstance(getattr(r, kind), tuple))
    wanted = sum(getattr(r, kind) for r in counts)
    if wanted > len(free):
        used = 0
        for first in counts:  # the first count that no longer fits carries the message
            used += getattr(first, kind)
            if used > len(free):
                break
        fail(
            join_path(first.path, kind),
            f"{wanted + explicit} {what}s requested in all ({_who(asking, kind)}), but this "
            f"host has {len(available)} ({what}s [{span(available)}]): ask for fewer",
        )
        return {}
    for req in counts:
        n = getattr(req, kind)
        placed[req.name], free = tuple(free[:n]), free[n:]
    return placed


def _who(asking: list[Request], kind: str) -> str:
    """``learner: 2 replicas x 2 = 4, generator.launch: [1]`` — each entry's share of the ask."""
    entries: dict[str, list[Request]] = {}
    for r in asking:
        entries.setdefault(r.path, []).append(r)
    parts = []
    for group in entries.values():
        first = getattr(group[0], kind)
        unit = "engines" if group[0].engine is not None else "replicas"
        if isinstance(first, int):
            n = len(group)
            total = first * n
            parts.append(
                f"{group[0].owner}: {n} {unit[:-1] if n == 1 else unit} x {first} = {total}"
            )
        else:
            ids = [i for r in group for i in getattr(r, kind)]
            parts.append(f"{group[0].owner}: [{span(ids)}] = {len(ids)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------- applying the plan
@dataclass(frozen=True)
class ProcessPlacement:
    """What a local launcher applies to one process: cores to pin to (None: leave as is) and
    environment changes (a value of None removes the variable)."""

    cores: tuple[int, ...] | None
    env: dict[str, str | None]


def affinity(assignment: Assignment, plan: Plan) -> tuple[int, ...] | None:
    """The cores to pin a process to: its own, the floating ones when some core is reserved
    by another, or None (leave it alone) when nobody reserved any."""
    if assignment.pinned or plan.pins_cores:
        return assignment.cores
    return None


def process_env(
    assignment: Assignment,
    plan: Plan,
    base: Mapping[str, str],
    user_env: Mapping[str, str],
) -> dict[str, str | None]:
    """Values for the thread and GPU variables of one process, over ``base`` (the environment
    the process would otherwise get).

    Thread counts are the number of its cores when it has cores of its own, unless ``user_env``
    (the stage's ``env``) sets either of them. Every managed variable is in the result, so
    applying it over any environment derived from ``base`` (a replica's, for its engines) gives
    the same answer.
    """
    out: dict[str, str | None] = {}
    # torch takes MKL_NUM_THREADS over OMP_NUM_THREADS when both are set: a stage that sets
    # either one in its env decides its threads, and the plan sets neither
    ours = assignment.pinned and not any(var in user_env for var in THREAD_VARS)
    for var in THREAD_VARS:
        out[var] = str(len(assignment.cores)) if ours else base.get(var)
    if assignment.gpus:
        out[_GPU_VAR] = ",".join(plan.inventory.device(g) for g in assignment.gpus)
    else:
        out[_GPU_VAR] = base.get(_GPU_VAR)
    return out


def engine_placement(
    plan: Plan,
    stage: str,
    replica: int,
    base: Mapping[str, str],
    user_env: Mapping[str, str],
) -> str | None:
    """The ``ENGINE_PLACEMENT_ENV`` value for a replica that launches engines (JSON: one
    ``{name, cores, env}`` per engine), or None when it launches none or nothing is reserved."""
    engines = plan.engines(stage, replica)
    if not engines or not plan.reserves_anything:
        return None
    return json.dumps(
        [
            {
                "name": a.name,
                "cores": None if affinity(a, plan) is None else list(a.cores),
                "env": process_env(a, plan, base, user_env),
            }
            for a in engines
        ]
    )


def read_engine_placement(environ: Mapping[str, str], count: int) -> list[ProcessPlacement] | None:
    """The engine placements the supervisor handed this replica (None when it handed none).

    Raises ValueError when the variable is malformed or holds another number of engines.
    """
    text = environ.get(ENGINE_PLACEMENT_ENV)
    if not text:
        return None
    try:
        items = json.loads(text)
        placements = [
            ProcessPlacement(
                None if item["cores"] is None else tuple(int(c) for c in item["cores"]),
                {str(k): None if v is None else str(v) for k, v in item["env"].items()},
            )
            for item in items
        ]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{ENGINE_PLACEMENT_ENV} is malformed ({exc}): {text[:200]!r}") from exc
    if len(placements) != count:
        raise ValueError(
            f"{ENGINE_PLACEMENT_ENV} places {len(placements)} engines, but this replica "
            f"launches {count}"
        )
    return placements


if __name__ == "__main__":
    print(host_inventory().describe())
