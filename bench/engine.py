"""Decode throughput of the built-in engine against transformers ``generate``, same model.

Run: ``python bench/engine.py [--batch 64 --prompt-len 32 --new-tokens 64 --warmup 1]``

Makes a random Qwen2-style model (~22M parameters: vocab 32000, hidden 384, 6 layers, 6 heads,
2 KV heads, tied embeddings) in a temporary directory, starts ``inflight engine`` on it as a
real server process (``--max-running`` = batch), and sends ``--batch`` concurrent
``/generate`` requests over HTTP (greedy, ``ignore_eos``, ``--new-tokens`` each, random prompts
of ``--prompt-len`` tokens). The baseline is one ``model.generate`` call on the same prompts as a
single batch (``do_sample=False``, no EOS), in this process while the server is idle. Both run on
CPU in float32 with the same number of torch threads. Tokens/s counts generated tokens over wall
time, prefill included. Prints exactly one JSON line on stdout. It does not measure latency
percentiles, sampling, or staggered arrivals (where continuous batching helps most).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path; the repository root is what we need.
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402


def _make_model(path: Path) -> int:
    config = Qwen2Config(
        vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("engine exited before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("engine did not become healthy")


async def _engine_run(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(prompt: list[int]) -> int:
            async with session.post(url + "/generate",
                                    json={"input_ids": prompt, "sampling_params": params}) as r:
                body: dict[str, Any] = await r.json()
                assert r.status == 200, body
                return len(body["output_ids"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, sum(counts)


@torch.inference_mode()
def _hf_run(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - ids.shape[1]) * ids.shape[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        n_params = _make_model(model_dir)
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, 32000, (args.batch, args.prompt_len), generator=gen).tolist()

        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.engine.server", "--model", str(model_dir),
             "--port", str(port), "--max-running", str(args.batch),
             "--log-file", str(Path(tmp) / "engine.log")],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            _wait_health(url, proc)
            for _ in range(args.warmup):
                asyncio.run(_engine_run(url, prompts[:8], 4))
            engine_s, engine_tokens = asyncio.run(_engine_run(url, prompts, args.new_tokens))
        finally:
            proc.terminate()
            proc.wait(30)

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        for _ in range(args.warmup):
            _hf_run(model, prompts[:8], 4)
        hf_s, hf_tokens = _hf_run(model, prompts, args.new_tokens)

    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    print(json.dumps({
        "bench": "engine_vs_hf_generate",
        "params_m": round(n_params / 1e6, 1),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "speedup": round(engine_tps / hf_tps, 2),
        "engine_s": round(engine_s, 3),
        "hf_generate_s": round(hf_s, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
