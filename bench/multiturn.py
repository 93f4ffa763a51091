"""Multi-turn episodes against the built-in engine, with its prefix cache on and off.

Run: ``python bench/multiturn.py [--episodes 16 --turns 5 --prompt-len 256 --new-tokens 32]``

Makes a random Qwen2-style model (~22M parameters, as ``bench/engine.py``) in a temporary
directory and, for each setting (``--prefix-cache-tokens`` default, then 0), starts ``inflight
engine`` on it as a real server process and runs ``--episodes`` episodes concurrently over
HTTP. An episode is ``--turns`` turns: turn 1 sends a random prompt of ``--prompt-len`` tokens;
every turn generates ``--new-tokens`` tokens (temperature 1, ``ignore_eos``, seeded per episode
and turn); the next turn's input is the last input, its output and 5 to 10 random "inserted"
tokens (what a tool or an environment would add).

Reported per setting: the prefill tokens each later turn computed (``prompt_tokens -
cached_tokens`` from its ``meta_info``) divided by that turn's inserted tokens (median, 10th and
90th percentiles, extremes; with the cache about (inserted + 1) / inserted: the last sampled
token of the previous turn has no KV yet), the engine's hit rates (``/get_server_info``), the
prefill tokens of all later turns, and the wall time of all episodes. Prints exactly one JSON
line on stdout. It does not measure latency per turn or weight updates during episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
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

from bench._engines import engine_server, make_model  # noqa: E402

VOCAB = 32000


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


async def _episode(
    session: aiohttp.ClientSession, url: str, index: int, args: argparse.Namespace
) -> list[tuple[int, int]]:
    """Run one episode; returns (prefill tokens computed, inserted tokens) of turns 2..T."""
    rng = random.Random(index)
    ids = [rng.randrange(2, VOCAB) for _ in range(args.prompt_len)]
    turns: list[tuple[int, int]] = []
    inserted = 0
    for turn in range(args.turns):
        params = {
            "temperature": 1.0,
            "max_new_tokens": args.new_tokens,
            "ignore_eos": True,
            "sampling_seed": 1000 * index + turn,
        }
        body = {"input_ids": ids, "sampling_params": params}
        async with session.post(url + "/generate", json=body) as r:
            out: dict[str, Any] = await r.json()
            assert r.status == 200, out
        meta = out["meta_info"]
        if turn:
            turns.append((meta["prompt_tokens"] - meta["cached_tokens"], inserted))
        inserted = rng.randint(5, 10)
        ids = ids + out["output_ids"] + [rng.randrange(2, VOCAB) for _ in range(inserted)]
    return turns


async def _episodes(url: str, args: argparse.Namespace) -> tuple[float, list[tuple[int, int]]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(_episode(session, url, i, args) for i in range(args.episodes))
        )
        return time.perf_counter() - start, [t for run in runs for t in run]


async def _warm(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()


def _run_engine(model_dir: Path, tmp: Path, cache_tokens: int | None, args: argparse.Namespace):
    flags = ["--max-running", str(args.episodes), "--device", args.device]
    flags += ["--log-file", str(tmp / f"engine-{cache_tokens}.log")]
    if cache_tokens is not None:
        flags += ["--prefix-cache-tokens", str(cache_tokens)]
    with engine_server(model_dir, *flags) as (url, _proc):
        asyncio.run(_warm(url))
        before = _get(url + "/get_server_info")["prefix_cache"]
        wall, turns = asyncio.run(_episodes(url, args))
        after = _get(url + "/get_server_info")["prefix_cache"]
    return wall, turns, before, after


def _summary(wall: float, turns: list[tuple[int, int]], before: dict, after: dict) -> dict:
    ratios = sorted(computed / inserted for computed, inserted in turns)
    deciles = statistics.quantiles(ratios, n=10)
    out: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "prefill_per_new_token": {
            "median": round(statistics.median(ratios), 3),
            "p10": round(deciles[0], 3),
            "p90": round(deciles[-1], 3),
            "min": round(ratios[0], 3),
            "max": round(ratios[-1], 3),
        },
        "later_turns": len(turns),
        "later_turn_prefill_tokens": sum(c for c, _ in turns),
        "later_turn_inserted_tokens": sum(i for _, i in turns),
    }
    if after["enabled"]:
        lookups = after["lookups"] - before["lookups"]
        hits = after["hits"] - before["hits"]
        hit_tokens = after["hit_tokens"] - before["hit_tokens"]
        prefill = after["prefill_tokens"] - before["prefill_tokens"]
        out["hit_rate"] = round(hits / lookups, 4)
        out["token_hit_rate"] = round(hit_tokens / (hit_tokens + prefill), 4)
        out["cache_tokens_held"] = after["tokens"]
        out["cache_evictions"] = after["evictions"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.turns < 2 or args.episodes * (args.turns - 1) < 2:
        parser.error("need at least 2 turns and 2 later turns in all")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        n_params = make_model(model_dir, vocab=VOCAB, max_positions=4096)
        on = _summary(*_run_engine(model_dir, tmp, None, args))
        off = _summary(*_run_engine(model_dir, tmp, 0, args))

    result = {
        "bench": "multiturn_prefix_cache",
        "params_m": round(n_params / 1e6, 1),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "episodes": args.episodes,
        "turns": args.turns,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "inserted_per_turn": [5, 10],
        "cache_on": on,
        "cache_off": off,
        "speedup": round(off["wall_s"] / on["wall_s"], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
