"""What ``/release_memory_occupation`` gives back and what the round trip costs.

The engine's scheduler on a random Qwen2-shaped model (``--hidden``, ``--layers``: 1024 and 16
are about 0.3B parameters) generates a batch of greedy samples (which fills its KV cache), then
releases its weights and KV cache as a colocated trainer's engine would between rollouts
(``stages.engine.memory_offload``), resumes them, and generates the same batch again:

- ``freed_gib``: the accelerator memory the release gave back (``torch.cuda.mem_get_info``'s
  free memory after over before; on the CPU, the KV cache's bytes: weights stay there);
- ``release_s``, ``resume_s``: how long each took (the weights to pinned host memory and back);
- ``same_outputs``: the greedy samples after every round trip equal those before.

Each figure is the median of ``--repeats`` round trips, with their range.

    python bench/release_memory.py [--hidden 1024] [--layers 16] [--repeats 5] [--device cuda|cpu]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench._engines  # noqa: E402,F401  (DeepSpeed's accelerator notice off stdout)
from stages.engine.loader import load_model  # noqa: E402
from stages.engine.protocol import GenerateInput, SamplingParams  # noqa: E402
from stages.engine.scheduler import Scheduler  # noqa: E402


def _free(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    return 0


def _batch(scheduler: Scheduler, rows: int, new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    inputs = [
        GenerateInput(f"r{i}", [(7 * i + j) % 1000 + 2 for j in range(32)], params, False)
        for i in range(rows)
    ]
    future = scheduler.submit_many(inputs)
    scheduler.run_until_idle()
    return [r.output_ids for r in future.result(timeout=0)]


def _timed(scheduler: Scheduler, command: Callable[[], Future[Any]]) -> float:
    """Seconds from ``command``'s call to its end (it runs at the next step boundary)."""
    start = time.perf_counter()
    future = command()
    scheduler.step()
    future.result(timeout=0)
    return time.perf_counter() - start


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="release/resume round trips")
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # stdout: JSON
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=1024,
        eos_token_id=1,
        pad_token_id=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        with torch.device(args.device):
            made = AutoModelForCausalLM.from_config(config, dtype=dtype)
        params = sum(p.numel() for p in made.parameters())
        made.save_pretrained(tmp)
        del made
        loaded = load_model(Path(tmp), device=args.device, dtype=str(dtype).split(".")[-1])
    scheduler = Scheduler(loaded.model, max_running=args.rows, eos_token_ids=())
    before = _batch(scheduler, args.rows, args.new_tokens)
    kv_bytes = sum(s.numel() * s.element_size() for s in scheduler._kv._stores)
    freed, release_s, resume_s, same = [], [], [], True
    for _ in range(args.repeats):
        free_before = _free(args.device)
        release_s.append(
            _timed(scheduler, lambda: scheduler.release_memory(["weights", "kv_cache"]))
        )
        freed.append(_free(args.device) - free_before if args.device != "cpu" else kv_bytes)
        resume_s.append(_timed(scheduler, lambda: scheduler.resume_memory(["weights", "kv_cache"])))
        same = same and _batch(scheduler, args.rows, args.new_tokens) == before
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(
        json.dumps(
            {
                "bench": "release_memory",
                "device": args.device,
                "dtype": str(dtype).split(".")[-1],
                "params": params,
                "weights_gib": round(weight_bytes / 2**30, 3),
                "kv_cache_gib": round(kv_bytes / 2**30, 3),
                "repeats": args.repeats,
                "freed_gib": _spread([f / 2**30 for f in freed]),
                "release_s": _spread(release_s),
                "resume_s": _spread(resume_s),
                "same_outputs": same,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
