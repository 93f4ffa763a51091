"""What one message costs to hand on: encode and decode over ZeroMQ's wire, or in-process.

A rollout group as the generator sends it (4 samples of 5 tokens after a 12-token prompt, each
with its token ids, sampler log-probs and versions) goes through ``transport.codec.encode`` and
``decode`` (with the schema check), and through ``transport.local.delivered`` (what a consumer in
the same process gets instead: ``run.share_process``). Prints one JSON line of microseconds per
message, the median of ``--rounds`` rounds of ``--n`` messages each, with the spread.

    python bench/codec.py [--rounds 5] [--n 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # run as a script: bench/transport.py would shadow the package

import numpy as np  # noqa: E402

from stages.schemas import ROLLOUT_GROUP  # noqa: E402
from transport.codec import decode, encode  # noqa: E402
from transport.message import Message  # noqa: E402

try:
    from transport.local import delivered
except ImportError:  # a checkout from before in-process links (to compare the codec alone)
    delivered = None


def rollout_group(samples: int = 4, prompt: int = 12, tokens: int = 5) -> Message:
    def sample(i: int) -> dict:
        return {
            "sample_index": i,
            "completion_ids": np.arange(tokens, dtype=np.int32),
            "sampler_logprobs": np.zeros(tokens, np.float32),
            "versions": np.full(tokens, 3, np.int32),
            "finish_reason": "length",
            "engine": "http://127.0.0.1:30000",
            "timings": {"queued_s": 0.01, "generate_s": 0.2},
        }

    data = {
        "run_id": "run",
        "prompt_id": "train-123",
        "group_id": "g-123-abc",
        "group_size": samples,
        "prompt_ids": np.arange(prompt, dtype=np.int32),
        "samples": [sample(i) for i in range(samples)],
        "meta": {"answer": "42"},
        "uid": "feeder.0:123",
        "origin": "generator.0:abc",
    }
    return Message(kind="rollout_group", data=data, version=ROLLOUT_GROUP.version)


def per_message_us(fn: Callable[[], object], n: int, rounds: int) -> dict[str, float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e6)
    return {
        "median": round(statistics.median(times), 2),
        "min": round(min(times), 2),
        "max": round(max(times), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    msg = rollout_group()
    frames = [bytes(f) for f in encode(msg)]
    schemas = {"rollout_group": ROLLOUT_GROUP}
    result = {
        "message": "rollout_group, 4 samples x 5 tokens",
        "frames": len(frames),
        "bytes": sum(len(f) for f in frames),
        "encode_us": per_message_us(lambda: encode(msg), args.n, args.rounds),
        "decode_us": per_message_us(lambda: decode(frames, schemas), args.n, args.rounds),
    }
    if delivered is not None:
        result["in_process_us"] = per_message_us(lambda: delivered(msg), args.n, args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
