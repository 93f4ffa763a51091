"""Tracker overhead: the default run's learner samples/s with TensorBoard, W&B (offline) and
MLflow (file store) all on, against none, runs interleaved (off, on, off, on ...).

samples/s is ``samples / train_s`` from each run's ``summary.json``. Prints one JSON line: per
arm the median and min-max over the runs, every run's figure, and ``ratio`` (median on /
median off; the goal is >= 0.97). Needs the three trackers installed; run it alone on the
machine; it takes about 10 minutes.

    python bench/trackers.py [--runs 3] [--steps 150] [--config configs/default.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL = "run.trackers=[tensorboard, wandb, mlflow]"


def _run(config: str, steps: int, run_dir: Path, trackers: bool) -> float:
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        config,
        f"stages.learner.steps={steps}",
        "stages.learner.eval.every=0",
        *([ALL] if trackers else []),
        "--run-dir",
        str(run_dir),
        "-q",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "MLFLOW_TRACKING_URI")}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    if done.returncode != 0 or summary.get("trackers"):
        raise SystemExit(f"run {run_dir} did not go cleanly:\n{done.stdout[-2000:]}{summary}")
    return summary["samples"] / summary["train_s"]


def _arm(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
        "runs": [round(v, 1) for v in values],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=f"runs/trackers-{int(time.time())}")
    args = parser.parse_args()
    out = Path(args.out)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.runs):
        for arm in ("off", "on"):
            rate = _run(args.config, args.steps, out / f"{arm}-{i}", trackers=arm == "on")
            rates[arm].append(rate)
            print(f"# {arm} {i}: {rate:.1f} samples/s", file=sys.stderr, flush=True)
    off, on = _arm(rates["off"]), _arm(rates["on"])
    line = {
        "bench": "trackers",
        "config": args.config,
        "steps": args.steps,
        "samples_per_s_off": off,
        "samples_per_s_on": on,
        "ratio": round(on["median"] / off["median"], 3),
        "goal": 0.97,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
