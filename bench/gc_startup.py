"""The garbage collector's share of a learner's start-up, with Python's settings and with
``pipeline.heap``'s hold (no full collections until the replica has set up).

Each run is a fresh process that does what the learner's setup does first: import torch,
DeepSpeed (as the trainer imports it) and transformers, load ``configs/models/arith-tiny`` with
``AutoModelForCausalLM`` and import aiohttp; then the replica settles (``heap.settle``, which the
actor calls after every setup). A ``gc.callbacks`` hook times each collection by generation.
Runs alternate between the two settings; it reports per setting the median (min-max) CPU
seconds of the whole start-up, the seconds spent in collections, their count by generation, and
the objects a full collection afterwards still finds garbage (what the hold leaves frozen).

    python bench/gc_startup.py [--runs 5]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
held = sys.argv[2] == "hold"
from pipeline import heap
counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]
def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        counts[info["generation"]] += 1
        seconds[info["generation"]] += time.perf_counter() - started[0]
gc.callbacks.append(timed)
cpu = time.process_time()
if held:
    heap.hold()
import torch
from stages.learner.trainer import import_deepspeed
import_deepspeed()
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(os.path.join(sys.argv[1], "configs/models/arith-tiny"))
import aiohttp
if held:
    heap.settle()
else:
    gc.collect(1)
cpu = time.process_time() - cpu
gc.callbacks.remove(timed)
gc.unfreeze()
print(json.dumps({"cpu_s": cpu, "gc_s": sum(seconds), "collections": counts,
                  "garbage_left": gc.collect()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"python": [], "hold": []}
    for _ in range(args.runs):
        for mode in results:
            out = subprocess.run(
                [sys.executable, "-c", _PROBE, str(ROOT), mode],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def spread(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    report = {
        mode: {
            "cpu_s": spread([r["cpu_s"] for r in runs]),
            "gc_s": spread([r["gc_s"] for r in runs]),
            "collections_by_generation": runs[-1]["collections"],
            "garbage_left": runs[-1]["garbage_left"],
        }
        for mode, runs in results.items()
    }
    print(json.dumps({"runs": args.runs, **report}))


if __name__ == "__main__":
    main()
