"""Delta weight updates against full ones at a size users train: bytes and seconds per update
after 1, 10 and 100 optimizer steps.

Run: ``python bench/delta_update.py [--steps 100] [--lr 1e-5]`` (about 10 minutes on 2 cores;
makes the random Qwen2.5-0.5B-shaped model of ``bench/stale_at_size.py`` once, 494M
parameters). Prints one JSON line on stdout.

A learner in this process (the model in float32, AdamW at ``--lr``, gradient clipping at 1)
takes ``--steps`` policy-gradient steps (``-A * log p`` of random sequences, ``--batch`` x
``--tokens``, random advantages); one built-in engine server (``--dtype bfloat16``) serves the
same model. For each step ``k`` in ``--report`` a ``WeightPublisher`` (gloo, flattened buckets)
sends the weights after step ``k - 1`` whole, then those after step ``k`` as a delta against them
(``stages.weights.delta.DeltaEncoder`` in bfloat16: per tensor the changed positions as indices
or as a bit per value, and their values, or the whole tensor, whichever is smallest), then the
same weights whole again, which is what a full update of step ``k`` costs. Seconds are from the
first announcement to the engine's last answer, its writes included; ``encode_s`` is the
encoder's (comparing every value with what the engine holds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from bench._engines import engine_server  # noqa: E402
from bench.stale_at_size import make_model  # noqa: E402


async def _run(url: str, model, args) -> list[dict]:
    from stages.weights.delta import DeltaEncoder
    from stages.weights.publisher import WeightPublisher

    encoder = DeltaEncoder(torch.bfloat16)
    publisher = WeightPublisher([url], bucket_mb=args.bucket_mb)
    await publisher.connect()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(0)

    def weights():
        return [(n, p.detach()) for n, p in model.named_parameters()]

    rows = []
    try:
        if 1 in args.report:
            await publisher.publish(list(encoder.encode(weights(), full=True)), 0)
        for step in range(1, args.steps + 1):
            ids = torch.randint(3, 1000, (args.batch, args.tokens), generator=g)
            adv = torch.randn(args.batch, generator=g)
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(adv[:, None] * logp).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step + 1 in args.report:  # the engine holds this version, whole
                await publisher.publish(list(encoder.encode(weights(), full=True)), step)
            if step not in args.report:
                continue
            before = dict(encoder.stats)
            started = time.perf_counter()
            update = list(encoder.encode(weights(), full=False))
            encode_s = time.perf_counter() - started
            delta = await publisher.publish(update, step, base_version=step - 1)
            changed = encoder.stats["changed"] - before["changed"]
            values = encoder.stats["values"] - before["values"]
            full = await publisher.publish(list(encoder.encode(weights(), full=True)), step)
            rows.append(
                {
                    "step": step,
                    "changed_fraction": round(changed / values, 5),
                    "delta_bytes": delta.bytes,
                    "full_bytes": full.bytes,
                    "bytes_ratio": round(delta.bytes / full.bytes, 5),
                    "delta_s": round(delta.seconds, 3),
                    "encode_s": round(encode_s, 3),
                    "full_s": round(full.seconds, 3),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        await publisher.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--report", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "qwen05-shape")
    args = parser.parse_args()
    torch.set_num_threads(2)
    make_model(args.model_dir)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    started = time.perf_counter()
    with engine_server(args.model_dir, "--dtype", "bfloat16") as (url, _proc):
        rows = asyncio.run(_run(url, model, args))
    print(
        json.dumps(
            {
                "bench": "delta_update",
                "params": sum(p.numel() for p in model.parameters()),
                "lr": args.lr,
                "steps": args.steps,
                "dtype": "bfloat16",
                "at": rows,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
