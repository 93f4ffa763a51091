"""The Ray launcher against the local one: the same shortened default run, same resources.

(a) ``run.launcher: local``; (b) ``run.launcher: ray`` on a 3-node ``ray.cluster_utils.Cluster``
on this machine (2 CPUs per node; generator and its engine on node A, feeder and scorer on B,
the learner on C, steered by custom resources). Runs interleave (local, ray, local, ray ...).
The cluster is started once, before the first run, and not counted: users start theirs once.

Per run: samples/s (``samples / train_s`` of ``summary.json``) and start-up, from launching
``inflight run`` to the learner's first ``train_step`` event. Prints one JSON line: per arm the
median and min-max of both, ``samples_ratio`` (ray / local, goal >= 0.9) and
``startup_extra_s`` (ray - local medians, goal <= 15). Run it alone on the machine;
about 5 minutes with the defaults.

    python bench/scale.py [--runs 3] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEMENT = (
    "stages.generator.resources.custom.node_a=1",
    "stages.feeder.resources.custom.node_b=1",
    "stages.scorer.resources.custom.node_b=1",
    "stages.learner.resources.custom.node_c=1",
)


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def _run(steps: int, run_dir: Path, ray_address: str | None) -> tuple[float, float]:
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        "configs/default.yaml",
        f"stages.learner.steps={steps}",
        "stages.learner.eval.every=0",
        "stages.learner.checkpoint.every=0",
        "--run-dir",
        str(run_dir),
        "-q",
    ]
    if ray_address is not None:
        cmd += ["run.launcher=ray", f"run.ray.address={ray_address}", *PLACEMENT]
    launched = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {run_dir} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = None
    for line in (run_dir / "logs" / "learner.0.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "train_step":
            first = _ts(event)
            break
    assert first is not None, f"{run_dir}: no train_step"
    return summary["samples"] / summary["train_s"], first - launched


def _arm(values: list[float], digits: int = 1) -> dict:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    for resources in ({"node_b": 2}, {"node_c": 1}):
        cluster.add_node(num_cpus=2, resources=resources)
    cluster.wait_for_nodes()
    results: dict[str, dict[str, list[float]]] = {
        arm: {"samples_s": [], "startup_s": []} for arm in ("local", "ray")
    }
    try:
        with tempfile.TemporaryDirectory(prefix="inflight-scale-") as tmp:
            for i in range(args.runs):
                for arm, address in (("local", None), ("ray", cluster.address)):
                    rate, startup = _run(args.steps, Path(tmp) / f"{arm}-{i}", address)
                    results[arm]["samples_s"].append(rate)
                    results[arm]["startup_s"].append(startup)
                    print(f"{arm} {i}: {rate:.0f} samples/s, start-up {startup:.1f} s", flush=True)
    finally:
        cluster.shutdown()
    local, ray = results["local"], results["ray"]
    print(
        json.dumps(
            {
                "bench": "scale",
                "steps": args.steps,
                "runs": args.runs,
                "local": {
                    "samples_s": _arm(local["samples_s"]),
                    "startup_s": _arm(local["startup_s"]),
                },
                "ray": {"samples_s": _arm(ray["samples_s"]), "startup_s": _arm(ray["startup_s"])},
                "samples_ratio": round(
                    statistics.median(ray["samples_s"]) / statistics.median(local["samples_s"]), 3
                ),
                "startup_extra_s": round(
                    statistics.median(ray["startup_s"]) - statistics.median(local["startup_s"]), 1
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
