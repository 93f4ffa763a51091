"""LoRA weight updates against full ones at a size users train: bytes and seconds per update.

Run: ``python bench/lora_update.py [--rank 8] [--runs 5]`` (a few minutes on 2 cores; makes the
random Qwen2.5-0.5B-shaped model of ``bench/stale_at_size.py`` once, 494M parameters). Prints
one JSON line on stdout.

One built-in engine server (``python -m stages.engine.server --dtype bfloat16``) serves the
model; this process joins it in a weight group as a ``WeightPublisher`` (gloo, flattened
buckets of ``--bucket-mb``) and, alternating, publishes (a) every parameter in bfloat16, what a
full-parameter learner sends, and (b) the adapters of a ``peft`` LoRA of rank ``--rank`` on
every linear layer but the head (``stages.learner.lora.published_adapters``: A, and B scaled by
alpha/r; B drawn random so that the merge is not a no-op), what a LoRA learner sends; the engine
merges them (``W = W0 + B @ A``, ``stages.engine.model_weights``). Seconds are from the first
announcement to the engine's last answer, the engine's load or merge included (the first
LoRA update also copies each adapted weight as the engine's ``W0``: in the range, not the
median). The built-in engine merges adapters; it does not run them unmerged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from bench._engines import engine_server  # noqa: E402
from bench.stale_at_size import make_model  # noqa: E402


async def _publish_runs(url: str, full, adapters, runs: int, bucket_mb: float) -> dict:
    from stages.weights.publisher import WeightPublisher

    publisher = WeightPublisher([url], bucket_mb=bucket_mb)
    await publisher.connect()
    out: dict[str, list] = {"full_s": [], "lora_s": [], "full_bytes": [], "lora_bytes": []}
    try:
        version = 0
        for _ in range(runs):
            for kind, weights in (("full", full), ("lora", adapters)):
                version += 1
                stats = await publisher.publish(weights, version)
                out[f"{kind}_s"].append(stats.seconds)
                out[f"{kind}_bytes"].append(stats.bytes)
    finally:
        await publisher.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "qwen05-shape")
    args = parser.parse_args()
    torch.set_num_threads(1)
    make_model(args.model_dir)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages.learner.lora import published_adapters

    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in base.parameters())
    full = [(n, p.detach()) for n, p in base.named_parameters()]
    lora = get_peft_model(
        base,
        LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules="all-linear"),
    ).eval()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    adapters = [(n, (p.detach() * s).to(torch.bfloat16)) for n, p, s in published_adapters(lora)]
    with engine_server(args.model_dir, "--dtype", "bfloat16") as (url, _proc):
        runs = asyncio.run(_publish_runs(url, full, adapters, args.runs, args.bucket_mb))
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "bench": "lora_update",
        "params": params,
        "rank": args.rank,
        "adapter_params": sum(t.numel() for _, t in adapters),
        "full_bytes": int(med["full_bytes"]),
        "lora_bytes": int(med["lora_bytes"]),
        "bytes_ratio": round(med["lora_bytes"] / med["full_bytes"], 5),
        "full_s": round(med["full_s"], 3),
        "lora_s": round(med["lora_s"], 3),
        "full_s_range": [round(min(runs["full_s"]), 3), round(max(runs["full_s"]), 3)],
        "lora_s_range": [round(min(runs["lora_s"]), 3), round(max(runs["lora_s"]), 3)],
        "seconds_ratio": round(med["lora_s"] / med["full_s"], 4),
        "runs": args.runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
