"""What the agent proxy adds per call: an ``openai`` agent's call against the same call made
directly.

Run: ``python bench/agent_proxy.py [--episodes 400] [--rounds 5] [--concurrency 1]``

Both sides play episodes of one completion of a 5-token prompt on the same engine handle: a
stand-in that answers at once with 5 fixed tokens, so what is measured is everything but the
model. ``direct`` is the ``single_turn`` rollout (the generator's own path for a rollout:
``engine.generate`` on the prompt's tokens); ``proxy`` is the ``openai_agent`` rollout with the
``one_completion`` agent: an ``openai.AsyncOpenAI`` client's ``completions.create`` through the
process's agent proxy (HTTP on 127.0.0.1, the engine's /v1 request checks and answer layout,
the call recorded into the trajectory). Rounds alternate the two; each reports CPU and wall
milliseconds per episode, and the JSON line has their medians and spreads and the difference
(the issue's goal: at most 2 ms per call). The tokenizer is a character one with a chat
template, built here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import numpy as np  # noqa: E402

from stages.rollouts.api import RolloutConfig, RolloutContext  # noqa: E402
from stages.rollouts.openai_agent import openai_agent  # noqa: E402
from stages.rollouts.single_turn import single_turn  # noqa: E402
from stages.rollouts.trajectory import Generation  # noqa: E402
from tests.stages.tool_tokenizers import QWEN_LIKE, char_tokenizer  # noqa: E402


class _Engine:
    """Answers every call at once with the same 5 tokens."""

    def __init__(self) -> None:
        self.ids = np.array([5, 6, 7, 8, 1], dtype=np.int32)

    async def generate(self, input_ids: Any, **sampling: Any) -> Generation:
        return Generation(self.ids, np.full(5, -0.5), np.full(5, 3), "stop")


async def _round(rollout: Any, config: RolloutConfig, tok: Any, n: int, conc: int) -> tuple:
    ids = tok.encode("12+34", add_special_tokens=False)
    message = {"prompt_id": "p:1", "input_ids": ids, "meta": {"text": "12+34", "answer": "46"}}
    engine = _Engine()
    limit = asyncio.Semaphore(conc)

    async def one() -> None:
        async with limit:
            ctx = RolloutContext(config, tokenizer=tok, sampling={"temperature": 1.0})
            await rollout(message, engine, ctx)

    await asyncio.gather(*(one() for _ in range(8)))  # warm: connections, caches
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    return (time.process_time() - cpu) / n * 1e3, (time.perf_counter() - wall) / n * 1e3


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    tok = char_tokenizer(
        string.printable, special=["<|im_start|>", "<|im_end|>"], template=QWEN_LIKE
    )
    direct_config = RolloutConfig()
    proxy_config = RolloutConfig(use="openai_agent", agent="one_completion")
    out: dict[str, list] = {"direct": [], "proxy": []}
    for _ in range(args.rounds):
        out["direct"].append(
            await _round(single_turn, direct_config, tok, args.episodes, args.concurrency)
        )
        out["proxy"].append(
            await _round(openai_agent, proxy_config, tok, args.episodes, args.concurrency)
        )

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}  # fmt: skip

    result: dict[str, Any] = {"bench": "agent_proxy", "episodes": args.episodes,
                              "rounds": args.rounds, "concurrency": args.concurrency}  # fmt: skip
    for side in out:
        result[f"{side}_cpu_ms"] = spread([c for c, _ in out[side]])
        result[f"{side}_wall_ms"] = spread([w for _, w in out[side]])
    result["added_cpu_ms"] = round(
        result["proxy_cpu_ms"]["median"] - result["direct_cpu_ms"]["median"], 3
    )
    result["added_wall_ms"] = round(
        result["proxy_wall_ms"]["median"] - result["direct_wall_ms"]["median"], 3
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=1)
    print(json.dumps(asyncio.run(_main(parser.parse_args()))))


if __name__ == "__main__":
    main()
