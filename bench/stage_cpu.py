"""CPU seconds by stage per 256 trained samples, over a real ``inflight run``.

Runs ``inflight run CONFIG [KEY=VALUE ...]`` as a user would and samples the CPU time (user +
system, every thread) of each of its processes twice a second: the supervisor (``inflight run``
itself), each stage replica (``pipeline.actor``, named by its spec file: ``generator.0``) with the
helper processes it starts (the scorer's reward workers), and each built-in engine (``pipeline.cli
engine``). With ``launch.in_process`` the engine is part of the generator's process: its threads
(the scheduler, named ``engine`` for the operating system, ``engine-http``, which serves its
HTTP routes as the engine's own process would, ``engine-weights``, which receives weight
updates, with the gloo thread of its weight group, and ``engine-load``, which imports the
engine's code and loads its model) still count as ``engine``, once they have ended too, the rest of
the process (its event loop, ZeroMQ's threads) as ``generator``. A process's last sample is its
total (a replica that exits between two samples loses at most half a second). Per stage (replicas
summed) it reports the CPU seconds, the CPU seconds per 256 trained samples, and the share of the
learner's; ``light`` is feeder + generator + scorer + supervisor (the stages that do no model
work), the figure issue 24 asks to bring to at most 0.25 x the learner's. Stages that share one
process (``run.share_process``, the default: feeder, generator and scorer) count together as
``shared``, its engine threads still as ``engine``. ``steady_*`` are the same from the learner's
first step to the end: what each stage costs per sample once started (loading libraries, models and
tokenizers left out). Several ``--runs`` give the median and spread.

    python bench/stage_cpu.py [--config configs/default.yaml] [--runs 3] [KEY=VALUE ...]

Inflight's modules are compiled to bytecode before the runs (``compile_bytecode``): a run
measures what an installed package costs, not the compiling of its sources. Prints one JSON
line; the run directories go under ``--out`` (default ``runs/stage_cpu-TIME``) and
are deleted unless ``--keep``.

Not here: where the time goes inside a process (py-spy it), time to accuracy (async_vs_sync.py).
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from pipeline.processes import kill_with_parent

ROOT = Path(__file__).resolve().parents[1]
LIGHT = ("feeder", "generator", "scorer", "shared", "supervisor")


def role(proc: psutil.Process, top: int) -> str | None:
    """What a process of the run is: a stage name, ``engine`` or ``supervisor``; a helper a
    stage started (reward workers, compile workers) counts as that stage."""
    while proc is not None:
        if proc.pid == top:
            return "supervisor"
        try:
            cmd = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        if "pipeline.actor" in cmd:
            return Path(cmd[-1]).stem.split(".")[0]  # specs/STAGE.REPLICA.json
        if "pipeline.host" in cmd:
            return "shared"  # the stages that share one process (run.share_process)
        if "engine" in cmd and "pipeline.cli" in cmd:
            return "engine"
        try:
            proc = proc.parent()
        except psutil.NoSuchProcess:
            return None
        if proc is not None and proc.pid == top:
            return None  # a direct child of the supervisor that is no replica
    return None


def engine_threads_cpu(proc: psutil.Process, seen: dict[int, float]) -> float:
    """CPU seconds of the threads of ``proc`` that an in-process engine runs (named engine*,
    and gloo's own threads where there is one: its weight group's, the only torch.distributed
    group of a process that hosts an engine), those that have ended included (``seen``:
    thread id -> its last CPU seconds)."""
    threads = []
    for thread in proc.threads():
        try:
            comm = Path(f"/proc/{proc.pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            continue
        threads.append((comm, thread))
    hosts_engine = bool(seen) or any(comm.startswith("engine") for comm, _ in threads)
    for comm, thread in threads:
        if comm.startswith("engine") or (hosts_engine and comm.startswith("gloo")):
            seen[thread.id] = thread.user_time + thread.system_time
    return sum(seen.values())


def samples_trained(run_dir: Path) -> int:
    """Samples the learner's steps took (trained or skipped without signal), from its log."""
    total = 0
    for line in (run_dir / "logs" / "learner.0.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "train_step":
            total += int(event.get("samples", 0))
    return total


def run_once(config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, *overrides]
    cmd += ["--run-dir", str(run_dir), "-q"]
    out = run_dir.with_suffix(".out").open("w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=kill_with_parent()
    )
    top = psutil.Process(proc.pid)
    totals: dict[int, tuple[str, float]] = {}
    engine_seen: dict[int, dict[int, float]] = {}  # pid -> engine thread id -> CPU seconds
    at_first_step: dict[int, tuple[str, float]] | None = None  # totals once training began
    started = time.monotonic()
    while proc.poll() is None:
        if time.monotonic() - started > timeout_s:
            proc.kill()
            raise SystemExit(f"{run_dir}: timed out after {timeout_s:.0f} s")
        try:
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            name = role(p, top.pid)
            if name is None:
                continue
            try:
                t = p.cpu_times()
                seen = engine_seen.setdefault(p.pid, {})
                engine = engine_threads_cpu(p, seen) if name != "engine" else 0.0
            except psutil.NoSuchProcess:
                continue
            totals[p.pid] = (name, t.user + t.system - engine)
            if engine:
                totals[-p.pid] = ("engine", engine)
        if at_first_step is None and trained_yet(run_dir):
            at_first_step = dict(totals)
        time.sleep(0.5)
    out.close()
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir}: inflight run exited {proc.returncode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = samples_trained(run_dir)
    by_stage = stage_totals(totals)
    per256 = {k: v * 256 / trained for k, v in by_stage.items()}
    light = sum(per256.get(k, 0.0) for k in LIGHT)
    # steady state: from the learner's first step to the end (start-up costs left out)
    before = stage_totals(at_first_step or {})
    steady = {k: (v - before.get(k, 0.0)) * 256 / (trained - 256) for k, v in by_stage.items()}
    steady_light = sum(steady.get(k, 0.0) for k in LIGHT)
    return {
        "wall_s": summary.get("wall_s"),
        "samples": trained,
        "cpu_s": {k: round(v, 1) for k, v in sorted(by_stage.items())},
        "cpu_s_per_256": {k: round(v, 3) for k, v in sorted(per256.items())},
        "light_per_256": round(light, 3),
        "light_over_learner": round(light / per256["learner"], 3),
        "steady_per_256": {k: round(v, 3) for k, v in sorted(steady.items())},
        "steady_light_over_learner": round(steady_light / steady["learner"], 3),
    }


def stage_totals(totals: dict[int, tuple[str, float]]) -> dict[str, float]:
    by_stage: dict[str, float] = {}
    for name, cpu in totals.values():
        by_stage[name] = by_stage.get(name, 0.0) + cpu
    return by_stage


def trained_yet(run_dir: Path) -> bool:
    """Whether the learner has logged its first step."""
    try:
        return '"train_step"' in (run_dir / "logs" / "learner.0.jsonl").read_text()
    except OSError:
        return False


def compile_bytecode() -> None:
    """Inflight's own modules compiled to bytecode first, as an installed wheel has them (and
    a checkout from its first run on): otherwise every process of every run compiles what it
    imports anew where bytecode is not written (``PYTHONDONTWRITEBYTECODE``, as in some
    sandboxes), about 0.5 s of the light stages' start-up, a twentieth of their CPU."""
    for package in ("pipeline", "stages", "transport"):
        compileall.compile_dir(ROOT / package, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / f"stage_cpu-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    compile_bytecode()
    runs = []
    for i in range(args.runs):
        run_dir = out / f"run{i}"
        runs.append(run_once(args.config, args.overrides, run_dir, args.timeout))
        print(json.dumps(runs[-1]), file=sys.stderr)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    stages = sorted({k for r in runs for k in r["cpu_s_per_256"]})

    def spread(values: list[float]) -> dict[str, float]:
        median = round(statistics.median(values), 3)
        return {"median": median, "min": min(values), "max": max(values)}

    result: dict[str, Any] = {
        "config": args.config,
        "overrides": args.overrides,
        "runs": len(runs),
        "cpu_s_per_256": {
            s: spread([r["cpu_s_per_256"].get(s, 0.0) for r in runs]) for s in stages
        },
        "light_per_256": spread([r["light_per_256"] for r in runs]),
        "light_over_learner": spread([r["light_over_learner"] for r in runs]),
        "steady_per_256": {
            s: spread([r["steady_per_256"].get(s, 0.0) for r in runs]) for s in stages
        },
        "steady_light_over_learner": spread([r["steady_light_over_learner"] for r in runs]),
        "wall_s": spread([r["wall_s"] for r in runs]),
    }
    (out / "stage_cpu.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
