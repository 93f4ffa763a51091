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

``--pressure``: sessions that hold their KV (``--enable-session-radix-cache``) against plain
LRU, on a cache smaller than what runs through it. Each episode waits ``--tool-s`` seconds
between turns (a tool call) while ``--background`` loops send single-turn requests of
``--prompt-len`` random tokens (``--new-tokens`` / 2 each) until the episodes end, both settings
on ``--prefix-cache-tokens`` (default: the episodes' own final contexts, no more). With
sessions every turn names its episode (``session_id``) and the episode closes its session at its
end (``/close_session``). Reported per setting as above, plus the background requests served
and their wall time, ``--rounds`` times alternating the settings; medians and ranges.
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
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    args: argparse.Namespace,
    *,
    held: bool = False,
    pause_s: float = 0.0,
) -> list[tuple[int, int]]:
    """Run one episode; returns (prefill tokens computed, inserted tokens) of turns 2..T.
    ``held``: its turns name it as their session, closed at its end; ``pause_s``: the wait
    between turns (a tool call)."""
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
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": params}
        if held:
            body["session_id"] = f"episode-{index}"
        async with session.post(url + "/generate", json=body) as r:
            out: dict[str, Any] = await r.json()
            assert r.status == 200, out
        meta = out["meta_info"]
        if turn:
            turns.append((meta["prompt_tokens"] - meta["cached_tokens"], inserted))
        inserted = rng.randint(5, 10)
        ids = ids + out["output_ids"] + [rng.randrange(2, VOCAB) for _ in range(inserted)]
        if pause_s and turn < args.turns - 1:
            await asyncio.sleep(pause_s)
    if held:
        async with session.post(url + "/close_session", json=body) as r:
            assert r.status == 200, await r.text()
    return turns


async def _background(
    session: aiohttp.ClientSession, url: str, seed: int, args: argparse.Namespace, done: Any
) -> int:
    """Single-turn requests of random prompts, one at a time, until ``done`` is set."""
    rng = random.Random(10_000 + seed)
    served = 0
    while not done.is_set():
        ids = [rng.randrange(2, VOCAB) for _ in range(args.prompt_len)]
        new = max(1, args.new_tokens // 2)
        params = {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True}
        body = {"input_ids": ids, "sampling_params": params}
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
        served += 1
    return served


async def _pressured(url: str, args: argparse.Namespace, held: bool) -> tuple[float, list, int]:
    """The episodes with their tool pauses, and the background traffic meanwhile."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        done = asyncio.Event()
        others = [
            asyncio.ensure_future(_background(session, url, k, args, done))
            for k in range(args.background)
        ]
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                _episode(session, url, i, args, held=held, pause_s=args.tool_s)
                for i in range(args.episodes)
            )
        )
        wall = time.perf_counter() - start
        done.set()
        served = sum(await asyncio.gather(*others))
        return wall, [t for run in runs for t in run], served


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
        if "states" in after:  # a linear-attention model's states (Qwen3.5's)
            out["cache_states"] = after["states"]
            out["cache_state_evictions"] = after["state_evictions"]
    return out


def _run_pressured(model_dir: Path, tmp: Path, held: bool, args: argparse.Namespace) -> dict:
    flags = ["--max-running", str(args.episodes + args.background), "--device", args.device]
    flags += ["--prefix-cache-tokens", str(args.prefix_cache_tokens)]
    flags += ["--log-file", str(tmp / f"engine-{held}.log")]
    if held:
        flags.append("--enable-session-radix-cache")
    with engine_server(model_dir, *flags) as (url, _proc):
        asyncio.run(_warm(url))
        before = _get(url + "/get_server_info")["prefix_cache"]
        wall, turns, served = asyncio.run(_pressured(url, args, held))
        after = _get(url + "/get_server_info")["prefix_cache"]
    out = _summary(wall, turns, before, after)
    out["background_requests"] = served
    out["held_at_end"] = after.get("session_held_tokens", 0)
    return out


def _pressure(args: argparse.Namespace, model_dir: Path, tmp: Path, n_params: int) -> dict:
    if not args.prefix_cache_tokens:  # the episodes' final contexts (10 inserted a turn at most)
        final = args.prompt_len + args.turns * args.new_tokens + (args.turns - 1) * 10
        args.prefix_cache_tokens = args.episodes * final
    runs: dict[str, list[dict]] = {"lru": [], "sessions": []}
    for _ in range(args.rounds):  # alternated, so that drift touches both alike
        runs["lru"].append(_run_pressured(model_dir, tmp, False, args))
        runs["sessions"].append(_run_pressured(model_dir, tmp, True, args))

    def spread(key: str, setting: str) -> dict[str, float]:
        values = [r[key] for r in runs[setting]]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    keys = ("wall_s", "later_turn_prefill_tokens", "background_requests", "token_hit_rate")
    return {
        "bench": "multiturn_sessions",
        "params_m": round(n_params / 1e6, 1),
        "episodes": args.episodes,
        "turns": args.turns,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "tool_s": args.tool_s,
        "background": args.background,
        "prefix_cache_tokens": args.prefix_cache_tokens,
        "rounds": args.rounds,
        **{s: {k: spread(k, s) for k in keys} for s in runs},
        "later_turn_inserted_tokens": runs["lru"][0]["later_turn_inserted_tokens"],
        "held_at_end": [r["held_at_end"] for r in runs["sessions"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model",
        choices=["qwen2", "qwen3_5"],
        default="qwen2",
        help="the random model's layout (bench/engine.py's): Qwen3.5's keeps linear-attention "
        "states, which its prefix cache holds at each sequence's end",
    )
    parser.add_argument("--pressure", action="store_true", help="sessions against LRU")
    parser.add_argument("--tool-s", type=float, default=0.5, help="--pressure: between turns")
    parser.add_argument("--background", type=int, default=4, help="--pressure: loops")
    parser.add_argument("--prefix-cache-tokens", type=int, default=0, help="--pressure's")
    parser.add_argument("--rounds", type=int, default=3, help="--pressure: of each setting")
    args = parser.parse_args()
    if args.turns < 2 or args.episodes * (args.turns - 1) < 2:
        parser.error("need at least 2 turns and 2 later turns in all")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        n_params = make_model(model_dir, vocab=VOCAB, max_positions=4096, family=args.model)
        if args.pressure:
            print(json.dumps(_pressure(args, model_dir, tmp, n_params)))
            return 0
        on = _summary(*_run_engine(model_dir, tmp, None, args))
        off = _summary(*_run_engine(model_dir, tmp, 0, args))

    result = {
        "bench": "multiturn_prefix_cache",
        "params_m": round(n_params / 1e6, 1),
        "device": args.device,
        "model": args.model,
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
