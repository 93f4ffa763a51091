"""Wall time to held-out accuracy 0.85 on the default config: sync / async (goal >= 2).

Runs ``inflight run configs/default.yaml`` twice as a user would, once as configured (async:
generation never waits for training, weights land in flight) and once with ``run.mode=sync``
(generate a batch with the current weights, score, train, publish, repeat), each with evaluation
every few steps, and reads from the run logs when the held-out greedy accuracy reached the
target. One evaluation of 300 prompts is noisy (about +-0.02), so the target counts as reached at
the end of the first ``--window`` consecutive evaluations whose mean reaches it. Time counts from
the evaluation at step 0, when training starts (start-up, the same code in both modes, is left
out; ``*_from_launch_s`` has it in).

    python bench/async_vs_sync.py [--target 0.85] [--eval-every 10] [--window 3] [--steps N]
                                  [--keep DIR] [KEY=VALUE ...]

Extra ``KEY=VALUE`` arguments are passed to both runs as config overrides. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _events(run_dir: Path, name: str) -> list[dict]:
    out = []
    for line in (run_dir / "logs" / f"{name}.jsonl").read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def _ts(event: dict) -> float:
    return datetime.strptime(event["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def _run(config: str, run_dir: Path, overrides: list[str], target: float, window: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        config,
        *overrides,
        "--run-dir",
        str(run_dir),
        "-q",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False, env={**os.environ}
    )
    if proc.returncode:
        raise SystemExit(
            f"run failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    launched = next(_ts(e) for e in _events(run_dir, "supervisor") if e["event"] == "run_started")
    learner = _events(run_dir, "learner.0")
    evals = [e for e in learner if e["event"] == "eval"]
    start = _ts(evals[0])  # the evaluation at step 0: training starts after it
    reached = None
    for i in range(window - 1, len(evals)):
        if sum(e["accuracy"] for e in evals[i - window + 1 : i + 1]) / window >= target:
            reached = evals[i]
            break
    steps = [e for e in learner if e["event"] == "train_step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    train_s = _ts(steps[-1]) - start if steps else None
    return {
        "time_to_target_s": None if reached is None else round(_ts(reached) - start, 1),
        "from_launch_s": None if reached is None else round(_ts(reached) - launched, 1),
        "step_at_target": None if reached is None else reached["step"],
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "wall_s": summary.get("wall_s"),
        "steps": summary.get("steps"),
        "s_per_step": None if not steps else round(train_s / len(steps), 3),
        "mean_lag": summary.get("mean_lag"),
        "stale_dropped": summary.get("stale_dropped"),
        "curve": [(round(_ts(e) - start, 1), e["step"], round(e["accuracy"], 3)) for e in evals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--window", type=int, default=3, help="evaluations averaged")
    parser.add_argument("--keep", type=Path, help="keep both run directories under DIR")
    parser.add_argument("--steps", type=int, default=0, help="learner steps (default: config)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    common = [f"stages.learner.eval.every={args.eval_every}", *args.overrides]
    if args.steps:
        common.append(f"stages.learner.steps={args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        runs = {
            mode: _run(
                args.config,
                root / mode,
                [*common, f"run.mode={mode}"],
                args.target,
                args.window,
            )
            for mode in ("async", "sync")
        }
    a, s = runs["async"]["time_to_target_s"], runs["sync"]["time_to_target_s"]
    print(
        json.dumps(
            {
                "bench": "async_vs_sync",
                "target": args.target,
                "window": args.window,
                "async_s": a,
                "sync_s": s,
                "ratio_sync_over_async": None if not a or not s else round(s / a, 2),
                "goal": 2.0,
                **{f"{mode}_{k}": v for mode, r in runs.items() for k, v in r.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
