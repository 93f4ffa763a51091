"""Decode throughput of the built-in engine against transformers ``generate``, same model.

Run: ``python bench/engine.py [--workload both --batch 64 --new-tokens 64 --requests 256]``

Makes a random Qwen2-style model (~22M parameters: vocab 32000, hidden 384, 6 layers, 6 heads,
2 KV heads, tied embeddings) in a temporary directory, starts ``inflight engine`` on it as a
real server process (``--max-running`` = batch), and sends ``--batch`` concurrent
``/generate`` requests over HTTP (greedy, ``ignore_eos``, ``--new-tokens`` each, random prompts
of ``--prompt-len`` tokens). The baseline is one ``model.generate`` call on the same prompts as a
single batch (``do_sample=False``, no EOS), in this process while the server is idle. Both run on
CPU in float32 with the same number of torch threads. Tokens/s counts generated tokens over wall
time, prefill included. Prints exactly one JSON line on stdout.

Two workloads (``--workload equal|rl|both``):

- ``equal``: every request wants exactly ``--new-tokens`` tokens, one batch of ``--batch``: the
  best case for static batching, where both sides run the same forward passes.
- ``rl``: ``--requests`` requests whose lengths vary as RL completions do (uniform between
  ``--new-tokens``/8 and ``--new-tokens``), at most ``--batch`` in flight. The engine refills a
  finished row at once (continuous batching); ``generate`` takes them ``--batch`` at a time and
  runs each batch until its longest sequence is done, exactly as it does when sequences reach
  EOS at different steps. Tokens/s counts the tokens the requests asked for, on both sides.

It does not measure latency percentiles or sampling cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path; the repository root is what we need.
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench._engines import engine_server, make_model  # noqa: E402


async def _engine_run(url: str, prompts: list[list[int]], lengths: list[int]) -> tuple[float, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(prompt: list[int], n: int) -> int:
            params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
            async with session.post(
                url + "/generate", json={"input_ids": prompt, "sampling_params": params}
            ) as r:
                body: dict[str, Any] = await r.json()
                assert r.status == 200, body
                return len(body["output_ids"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))
        return time.perf_counter() - start, sum(counts)


@torch.inference_mode()
def _hf_run(
    model: torch.nn.Module, prompts: list[list[int]], lengths: list[int], batch: int
) -> tuple[float, int]:
    """Static batches of ``batch``; each runs until its longest request is done."""
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch])
        want = lengths[i : i + batch]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max(want),
            min_new_tokens=max(want),
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] - ids.shape[1] == max(want)
        useful += sum(want)
    return time.perf_counter() - start, useful


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--workload", choices=["equal", "rl", "both"], default="both")
    parser.add_argument("--requests", type=int, default=256, help="rl workload: requests")
    parser.add_argument("--rl-new-tokens", type=int, default=128, help="rl workload: max length")
    parser.add_argument(
        "--model",
        choices=["qwen2", "qwen3_5", "qwen3_moe", "deepseek_v3"],
        default="qwen2",
        help="the random model's layout: Qwen2's, Qwen3.5's (3 linear-attention layers a "
        "full-attention one; the engine serves it on transformers' passes), Qwen3-MoE's (8 "
        "experts, 2 a token), or DeepSeek-V3's (latent attention over 8 experts and a shared one)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help="more flags for the engine, as one string (--enable-deterministic-inference...)",
    )
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(1)
    workloads: dict[str, tuple[list[list[int]], list[int]]] = {}
    if args.workload in ("equal", "both"):
        prompts = torch.randint(2, 32000, (args.batch, args.prompt_len), generator=gen).tolist()
        workloads["equal"] = (prompts, [args.new_tokens] * args.batch)
    if args.workload in ("rl", "both"):
        prompts = torch.randint(2, 32000, (args.requests, args.prompt_len), generator=gen).tolist()
        lo = max(1, args.rl_new_tokens // 8)
        lengths = torch.randint(lo, args.rl_new_tokens + 1, (args.requests,), generator=gen)
        workloads["rl"] = (prompts, lengths.tolist())

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        n_params = make_model(model_dir, family=args.model)
        engine: dict[str, tuple[float, int]] = {}
        flags = ["--max-running", str(args.batch), "--log-file", str(Path(tmp) / "engine.log")]
        flags += shlex.split(args.engine_args)
        with engine_server(model_dir, *flags) as (url, _proc):
            for _ in range(args.warmup):
                warm = next(iter(workloads.values()))[0][:8]
                asyncio.run(_engine_run(url, warm, [4] * len(warm)))
            for name, (prompts, lengths) in workloads.items():
                engine[name] = asyncio.run(_engine_run(url, prompts, lengths))

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        for _ in range(args.warmup):
            warm = next(iter(workloads.values()))[0][:8]
            _hf_run(model, warm, [4] * len(warm), args.batch)
        hf = {
            name: _hf_run(model, prompts, lengths, args.batch)
            for name, (prompts, lengths) in workloads.items()
        }

    result: dict[str, Any] = {
        "bench": "engine_vs_hf_generate",
        "model": args.model,
        "params_m": round(n_params / 1e6, 1),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "engine_args": args.engine_args,
        "threads": torch.get_num_threads(),
    }
    for name in workloads:
        (e_s, e_tok), (h_s, h_tok) = engine[name], hf[name]
        assert e_tok == h_tok, (name, e_tok, h_tok)  # the same useful tokens on both sides
        result[name] = {
            "requests": len(workloads[name][1]),
            "tokens": e_tok,
            "engine_tokens_per_s": round(e_tok / e_s, 1),
            "hf_generate_tokens_per_s": round(h_tok / h_s, 1),
            "speedup": round((e_tok / e_s) / (h_tok / h_s), 2),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
