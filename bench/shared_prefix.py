"""Prompts that share a system prompt, sent together to an engine whose cache has none of it.

Run: ``python bench/shared_prefix.py [--against DIR] [--system 256] [--question 32]
[--prompts 16] [--group 4] [--new-tokens 16] [--rounds 5] [--per-round 3]``. Prints one JSON
line on stdout.

What an RL generator sends the built-in engine after every weight update: a batch of prompts,
each a group of ``--group`` samples (``n``), that begin alike (a chat template's system prompt,
tool schemas, few-shot examples: ``--system`` tokens) and differ after (``--question``
tokens). An update starts a new version of the prefix cache, which holds nothing of the new
weights yet: each batch begins with ``/flush_cache`` to stand for it, then sends the
``--prompts`` requests at once and is timed to the last answer. Each round starts the server,
sends it one batch unmeasured and ``--per-round`` measured, and stops it; reported: the median
(min-max) over rounds of the wall seconds a batch, the engine's CPU seconds a batch (its
process's user + system time), and the prompt tokens it computed a batch
(``/get_server_info``'s ``prefix_cache.prefill_tokens``).

``--against DIR``: each round also on a server started from another checkout of this
repository (``git worktree add DIR COMMIT``), in turn with this one (the order reversed every
other round), and each round's ratio of its wall time over this one's.
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

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402


def _info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
        return json.loads(resp.read())


async def _round(url: str, bodies: list[dict[str, Any]]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await session.post(url + "/flush_cache")

        async def one(body: dict[str, Any]) -> None:
            async with session.post(url + "/generate", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {await resp.text()}")
                await resp.read()

        await asyncio.gather(*(one(b) for b in bodies))


def _bodies(rng: random.Random, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    system = [rng.randrange(2, vocab) for _ in range(args.system)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    return [
        {
            "input_ids": system + [rng.randrange(2, vocab) for _ in range(args.question)],
            "sampling_params": {**params, "n": args.group},
        }
        for _ in range(args.prompts)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout to compare with")
    parser.add_argument("--system", type=int, default=256, help="tokens all prompts share")
    parser.add_argument("--question", type=int, default=32, help="tokens of each prompt's own")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="samples of a prompt (n)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=3, help="batches a server a round")
    args = parser.parse_args()

    from bench._engines import engine_server, make_model, process_cpu_s, spread

    vocab = 32000
    rng = random.Random(0)
    roots = {"this": ROOT}
    if args.against:
        roots["against"] = args.against.resolve()
    flags = ("--max-running", str(args.prompts * args.group))
    wall: dict[str, list[float]] = {name: [] for name in roots}
    cpu: dict[str, list[float]] = {name: [] for name in roots}
    computed: dict[str, list[int]] = {name: [] for name in roots}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, vocab=vocab)
        for r in range(args.rounds):
            bodies = [_bodies(rng, args, vocab) for _ in range(args.per_round)]
            for name in list(roots) if r % 2 == 0 else list(roots)[::-1]:
                # one server alive at a time: one series with two alive had one of them a
                # third slower than alone, though the other was idle (not seen again later)
                with engine_server(model, *flags, root=roots[name]) as (url, proc):
                    asyncio.run(_round(url, _bodies(rng, args, vocab)))  # its first, unmeasured
                    before = _info(url)["prefix_cache"]["prefill_tokens"]
                    cpu0 = process_cpu_s(proc.pid)
                    start = time.perf_counter()
                    for body in bodies:
                        asyncio.run(_round(url, body))
                    wall[name].append((time.perf_counter() - start) / args.per_round)
                    cpu[name].append((process_cpu_s(proc.pid) - cpu0) / args.per_round)
                    after = _info(url)["prefix_cache"]["prefill_tokens"]
                    computed[name].append((after - before) // args.per_round)
            print(
                f"round {r}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in wall.items()),
                file=sys.stderr,
            )

    result: dict[str, Any] = {
        "bench": "shared_prefix",
        "system_tokens": args.system,
        "question_tokens": args.question,
        "prompts": args.prompts,
        "group": args.group,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "wall_s_per_batch": {n: spread(v) for n, v in wall.items()},
        "engine_cpu_s_per_batch": {n: spread(v) for n, v in cpu.items()},
        "prompt_tokens_computed_per_batch": {n: statistics.median(v) for n, v in computed.items()},
    }
    if args.against:
        result["against_over_this"] = spread(
            [a / t for a, t in zip(wall["against"], wall["this"], strict=True)]
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
