"""Tool-call overhead: what one call costs outside the tool's own work.

A no-op tool is called ``--calls`` times through the path a ``tools`` rollout takes: the model's
turn read (decode, find the call's end, parse), the call answered (arguments checked, sent to a
worker process and back, its value made text), and the answer's tokens made by the format. Per
format (``tags`` with a one-token ``</tool_call>``; ``chat_template`` with a small Qwen-like
template, whose insertion renders the conversation twice); one tool worker. Prints one JSON
line: per format the median and p90 milliseconds per call (the goal: median <= 5 ms).

    python bench/tools.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, bench/ would come first on sys.path; the repository root is what we need.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

NOOP = "bench.tools:noop"
WARMUP = 50


def noop() -> str:
    """Do nothing: the call's cost is all overhead."""
    return "ok"


async def _measure(tool_format: str, calls: int) -> dict[str, float]:
    from stages.rollouts.api import RolloutConfig
    from stages.rollouts.tools import ToolBox
    from stages.rollouts.trajectory import Generation
    from tests.stages.tool_tokenizers import chat_tokenizer  # characters, the tags one token

    tok = chat_tokenizer()
    config = RolloutConfig(use="tools", tools=[NOOP], tool_format=tool_format)
    box = await ToolBox.start(config, tok)
    turn_text = {
        "tags": "<tool_call>noop()</tool_call>",
        "chat_template": '<tool_call>{"name": "noop", "arguments": {}}</tool_call><|im_end|>',
    }[tool_format]
    ids = tok.encode(turn_text, add_special_tokens=False)
    generation = Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop")
    prompt: dict[str, Any] = {"prompt_id": "p", "input_ids": [2, 3], "meta": {"text": "hi"}}
    times = []
    try:
        for i in range(WARMUP + calls):
            episode = box.format.episode(prompt)  # a fresh conversation each call
            started = time.perf_counter()
            turn = episode.read(generation)
            results = await box.call_all(turn.calls)
            answer = episode.answer_ids(turn.calls, [r.text for r in results])
            elapsed = time.perf_counter() - started
            if results[0].error is not None or not answer:
                raise RuntimeError(f"the no-op call failed: {results[0].text}")
            if i >= WARMUP:
                times.append(elapsed * 1000)
    finally:
        await box.aclose()
    times.sort()
    return {
        "median_ms": round(statistics.median(times), 3),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3),
    }


async def _main(calls: int) -> dict[str, Any]:
    line: dict[str, Any] = {"bench": "tool_call_overhead", "calls": calls, "goal_median_ms": 5}
    for tool_format in ("tags", "chat_template"):
        line[tool_format] = await _measure(tool_format, calls)
    return line


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_main(args.calls))))
