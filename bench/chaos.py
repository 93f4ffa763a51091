"""Chaos: SIGKILL random parts of a running pipeline, seeded, and check that the run completes.

Runs ``inflight run CONFIG`` (the default task, shortened) as a user would and, while it trains,
kills a random victim every few seconds: a feeder, generator or scorer replica, the generator's
engine server, or a learner rank (the learner restarts as a gang from its last checkpoint).
Victims, times and the run's configuration all follow ``--seed``. Where feeder, generator and
scorer share one process (``run.share_process``, the default), each of them as a victim is that
process: the three die together, and come back each under its own restart policy. Every stage
may restart often enough to outlive the kills. At the end it reads the run's summary and logs
and prints one JSON line: status, steps done of those asked, wall time, kills per victim,
restarts per replica, messages sent again to restarted consumers, and the run's ledger
(``pipeline.ledger``): prompts fed, samples trained and dropped by reason, copies recognized,
and ``unaccounted`` (must be 0).

    python bench/chaos.py [--kills 10] [--steps 150] [--seed 0] [--victims feeder,generator,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.processes import kill_with_parent

ROOT = Path(__file__).resolve().parents[1]
VICTIMS = ("feeder", "generator", "engine", "scorer", "learner")


def _events(run_dir: Path, name: str) -> list[dict]:
    found = []
    for path in sorted((run_dir / "logs").glob(f"{name}.jsonl")):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return found


def _steps(run_dir: Path) -> int:
    steps = [e.get("step", 0) for e in _events(run_dir, "learner.0") if e["event"] == "train_step"]
    return max(steps, default=0)


def _pid(run_dir: Path, victim: str) -> int | None:
    if victim == "engine":
        launched = [e for e in _events(run_dir, "generator.0") if e["event"] == "engine_launched"]
        # an engine inside the generator's process (launch.in_process) has no pid of its own:
        # it dies with the generator, which is a victim of its own
        return launched[-1].get("pid") if launched else None
    spawned = [
        e
        for e in _events(run_dir, "supervisor")
        if e["event"] == "replica_spawned" and e["replica_name"] == f"{victim}.0"
    ]
    return spawned[-1]["pid"] if spawned else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"))
    parser.add_argument("--victims", default=",".join(VICTIMS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument(
        "--by-step",
        action="store_true",
        help="kill at seeded learner steps (spread over the first 80%%) instead of every few s",
    )
    args = parser.parse_args()
    victims = [v for v in args.victims.split(",") if v]
    unknown = set(victims) - set(VICTIMS)
    if unknown:
        parser.error(f"unknown victims {sorted(unknown)}; choose from {list(VICTIMS)}")
    rng = random.Random(args.seed)
    run_dir = Path(args.run_dir or f"runs/chaos-{int(time.time())}")
    restart = "{policy: on-failure, max_restarts: 100, backoff_s: 0.2}"
    overrides = [
        f"stages.learner.steps={args.steps}",
        "stages.learner.eval.every=0",
        f"stages.learner.checkpoint.every={args.checkpoint_every}",
        "stages.generator.launch.max_restarts=100",
        f"run.seed={args.seed}",
        *[f"stages.{s}.restart={restart}" for s in ("feeder", "generator", "scorer", "learner")],
    ]
    cmd = [sys.executable, "-m", "pipeline.cli", "run", args.config, *overrides]
    proc = subprocess.Popen(
        [*cmd, "--run-dir", str(run_dir), "-q"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=kill_with_parent(),  # this bench killed (a test's timeout): the run too
    )
    started = time.monotonic()
    kills: list[dict] = []
    try:
        while proc.poll() is None and _steps(run_dir) < 1:  # training has begun
            if time.monotonic() - started > args.timeout:
                break
            time.sleep(0.5)
        last = max(3, int(0.8 * args.steps))
        at_steps = sorted(rng.choices(range(2, last), k=args.kills)) if args.by_step else []
        while proc.poll() is None and len(kills) < args.kills:
            if args.by_step:
                while proc.poll() is None and _steps(run_dir) < at_steps[len(kills)]:
                    time.sleep(0.1)
            else:
                time.sleep(rng.uniform(*args.every))
            victim = rng.choice(victims)
            pid = _pid(run_dir, victim)
            if pid is None or proc.poll() is not None:
                time.sleep(0.2)  # restarting: another victim, or this one again, in a moment
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it was restarting already: no kill
            kills.append({"victim": victim, "at_step": _steps(run_dir)})
        proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a run that does not stop: its stages die with it
            proc.kill()
            proc.wait()
    wall = time.monotonic() - started
    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary.get("ledger") or {}
    finished = [e for e in _events(run_dir, "supervisor") if e["event"] == "run_finished"]
    # every producer that sent messages again to a restarted consumer said how many
    redelivered = sum(
        e.get("count", 0) for e in _events(run_dir, "*") if e["event"] == "redelivering"
    )
    by_victim: dict[str, int] = {}
    for k in kills:
        by_victim[k["victim"]] = by_victim.get(k["victim"], 0) + 1
    print(
        json.dumps(
            {
                "bench": "chaos",
                "seed": args.seed,
                "status": finished[-1]["status"] if finished else "no end recorded",
                "exit_code": proc.returncode,
                "steps": summary.get("steps"),
                "steps_asked": args.steps,
                "wall_s": round(wall, 1),
                "kills": len(kills),
                "kills_by_victim": by_victim,
                "restarts": finished[-1].get("restarts") if finished else None,
                "redelivered": redelivered,
                "unaccounted": ledger.get("unaccounted"),
                "ledger_incomplete": ledger.get("incomplete"),
                "prompts_fed": ledger.get("prompts_fed"),
                "prompts_refed": ledger.get("prompts_refed"),
                "samples": ledger.get("samples"),
                "copies_dropped": ledger.get("copies_dropped"),
                "duplicate_fates": ledger.get("duplicate_fates"),
                "catch_ups": (summary.get("publishes") or {}).get("catch_ups"),
                "eval_after": summary.get("eval_after"),
                "run_dir": str(run_dir),
            }
        )
    )
    ok = finished and finished[-1]["status"] == "succeeded" and ledger.get("unaccounted") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
