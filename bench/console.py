"""The console's goals on the default run: how many lines it prints, and how good its ETA is.

    python bench/console.py [--runs 3] [--config configs/default.yaml] [KEY=VALUE ...]

Runs ``inflight run CONFIG`` ``--runs`` times with stdout on a pipe (not a terminal: the plain
status line every ``run.console_every_s`` plus the permanent lines) and counts the lines it
printed and the evaluations among them. From each run's logs it then replays what the live
block showed at every ``train_step`` (``pipeline.console.StepRate``, the same estimator) and
compares that ETA with the real time to the last step, between 10% and 90% of the run.

Prints one JSON line: per run the line count, evaluations shown / held, the ETA error at
10/25/50/75/90% of the steps, the worst error in 10-90% and the share of steps within 20%;
and the medians with their ranges. The terminal view (the live block redrawn in place) is not
measured here: its permanent lines are the same ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.console import StepRate  # noqa: E402
from pipeline.log_view import event_wall  # noqa: E402


def _events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eta_errors(run_dir: Path) -> dict:
    """The console's ETA at each step against the real remaining time to the last step."""
    steps = [
        (e["step"], event_wall(e), e.get("samples"))
        for e in _events(run_dir, "learner.0")
        if e["event"] == "train_step"
    ]
    n, last = steps[-1][0], steps[-1][1]
    rate, errors = StepRate(), {}
    for step, at, samples in steps:
        rate.add(step, at, samples)
        eta = rate.eta(n, at)
        if eta is None or step < 0.1 * n or step > 0.9 * n or last <= at:
            continue
        errors[step] = (eta - (last - at)) / (last - at)
    at_share = {
        f"{int(p * 100)}%": round(errors[min(errors, key=lambda k, p=p: abs(k - p * n))], 3)
        for p in (0.1, 0.25, 0.5, 0.75, 0.9)
    }
    return {
        "eta_error_at": at_share,
        "eta_worst_10_90": round(max(abs(x) for x in errors.values()), 3),
        "eta_within_20pct": round(sum(abs(x) <= 0.2 for x in errors.values()) / len(errors), 3),
    }


def one_run(config: str, overrides: list[str], scratch: Path, index: int) -> dict:
    run_dir = scratch / f"run{index}"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            config,
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    evals = [e for e in _events(run_dir, "learner.0") if e["event"] == "eval"]
    shown = sum(1 for line in lines if " eval " in line and "held-out accuracy" in line)
    warnings = [line for line in lines if "warning" in line.lower() or "error" in line.lower()]
    return {
        "exit": result.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "lines": len(lines),
        "evals_held": len(evals),
        "eval_lines": shown,
        "warning_lines": len(warnings),
        **eta_errors(run_dir),
    }


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inflight-console-") as scratch:
        runs = [one_run(args.config, args.overrides, Path(scratch), i) for i in range(args.runs)]
    print(
        json.dumps(
            {
                "bench": "console",
                "config": args.config,
                "overrides": args.overrides,
                "runs": runs,
                "lines": _spread([r["lines"] for r in runs]),
                "eta_worst_10_90": _spread([r["eta_worst_10_90"] for r in runs]),
                "eta_within_20pct": _spread([r["eta_within_20pct"] for r in runs]),
            }
        )
    )


if __name__ == "__main__":
    main()
