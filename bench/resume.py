"""Resume, exactly: the default run uninterrupted against the same run whose supervisor is
SIGKILLed at a seeded step and then resumed (``inflight run ... --resume RUN_DIR``), per seed.

Prints one JSON line: per seed, the step of the kill, the status and steps of the resumed run,
its ``unaccounted``, and the held-out accuracy at the end (``eval_after``) of both runs.

    python bench/resume.py [--seeds 1 2 3] [--config configs/default.yaml]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.processes import kill_with_parent

ROOT = Path(__file__).resolve().parents[1]


def _steps(run_dir: Path) -> int:
    path = run_dir / "logs" / "learner.0.jsonl"
    done = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            if event.get("event") == "train_step":
                done = max(done, event["step"])
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kill-between", type=int, nargs=2, default=(60, 300))
    parser.add_argument("--out", default=f"runs/resume-{int(time.time())}")
    args = parser.parse_args()
    out = Path(args.out)
    results = []
    for seed in args.seeds:
        cmd = [sys.executable, "-m", "pipeline.cli", "run", args.config, f"run.seed={seed}"]
        plain = out / f"plain-{seed}"
        subprocess.run([*cmd, "--run-dir", str(plain), "-q"], cwd=ROOT, capture_output=True)
        killed = out / f"killed-{seed}"
        at = random.Random(seed).randint(*args.kill_between)
        proc = subprocess.Popen(
            [*cmd, "--run-dir", str(killed), "-q"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=kill_with_parent(),
        )
        while proc.poll() is None and _steps(killed) < at:
            time.sleep(0.2)
        killed_at = _steps(killed)
        proc.send_signal(signal.SIGKILL)  # the supervisor; its replicas follow it
        proc.wait()
        time.sleep(3)
        resumed = subprocess.run(
            [*cmd, "--resume", str(killed), "-q"], cwd=ROOT, capture_output=True
        )
        a = json.loads((plain / "summary.json").read_text())
        b = json.loads((killed / "summary.json").read_text())
        results.append(
            {
                "seed": seed,
                "killed_at_step": killed_at,
                "resumed_exit_code": resumed.returncode,
                "resumed_status": b.get("status"),
                "steps": [a.get("steps"), b.get("steps")],
                "eval_after": [a.get("eval_after"), b.get("eval_after")],
                "unaccounted": (b.get("ledger") or {}).get("unaccounted"),
            }
        )
    print(json.dumps({"bench": "resume", "config": args.config, "runs": results}))
    ok = all(r["resumed_status"] == "succeeded" and r["unaccounted"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
