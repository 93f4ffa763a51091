"""Held-out evaluation: greedy answers from the engines, scored by the reward functions.

The learner's rank 0 evaluates the policy the engines serve: every held-out prompt is sent with
``temperature: 0`` to the engines (round robin, ``concurrency`` in flight), the answers are
decoded and scored by the same reward runner the scorer uses, and accuracy is the fraction of
prompts whose reward reaches ``correct_at``. It runs on the event loop while training goes on in
its worker thread. An answer whose tokens span two policy versions (an update landed during the
evaluation) is reported under ``versions`` so a reader can tell.

Not here: choosing when to evaluate (the stage does: at the start, every ``every`` steps, at the
end).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from stages.generator.client import EngineClient, EngineError
from stages.learner.config import EvalConfig
from stages.scorer.runner import RewardRunner

__all__ = ["Evaluator"]


class Evaluator:
    def __init__(
        self, config: EvalConfig, prompts: list[dict[str, Any]], tokenizer: Any, log: Any
    ) -> None:
        self.config = config
        self.prompts = prompts[: config.max_prompts]
        self.tokenizer = tokenizer
        self.log = log
        self.runner = RewardRunner(
            [(r.fn, r.weight) for r in config.rewards], workers=1, timeout_s=30.0, log=log
        )
        self.history: list[dict[str, Any]] = []

    async def start(self) -> None:
        await self.runner.start()

    async def close(self) -> None:
        await self.runner.aclose()

    async def evaluate(self, urls: list[str], *, step: int, version: int) -> dict[str, Any]:
        started = time.perf_counter()
        params = {"temperature": 0.0, "max_new_tokens": self.config.max_new_tokens}
        limit = asyncio.Semaphore(self.config.concurrency)
        failed = 0
        seen_versions: set[int] = set()

        async with aiohttp.ClientSession() as session:
            clients = [EngineClient(u, session, timeout_s=600.0) for u in urls]

            async def one(i: int, prompt: dict[str, Any]) -> list[int] | None:
                nonlocal failed
                async with limit:
                    for attempt in range(len(clients)):
                        client = clients[(i + attempt) % len(clients)]
                        try:
                            done = await client.generate(
                                prompt["input_ids"], params, rid=f"eval/{step}/{i}"
                            )
                        except EngineError:
                            continue
                        seen_versions.update(int(v) for v in set(done.versions.tolist()))
                        return done.output_ids.tolist()
                    failed += 1
                    return None

            outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(self.prompts)))
        kept = [(p, o) for p, o in zip(self.prompts, outputs, strict=True) if o is not None]
        texts = self.tokenizer.batch_decode([o for _, o in kept], skip_special_tokens=True)
        kwargs: dict[str, Any] = {
            "completions": texts,
            "prompts": [(p.get("meta") or {}).get("text", "") for p, _ in kept],
            "completion_ids": [o for _, o in kept],
        }
        for key in {k for p, _ in kept for k in (p.get("meta") or {})}:
            kwargs[key] = [(p.get("meta") or {}).get(key) for p, _ in kept]
        scored = await self.runner.score(kwargs, eval_step=step) if kept else []
        rewards = [r for r, _ in scored]
        correct = sum(r >= self.config.correct_at for r in rewards)
        result = {
            "step": step,
            "policy_version": version,
            "accuracy": correct / max(len(self.prompts), 1),
            "reward": sum(rewards) / max(len(rewards), 1),
            "prompts": len(self.prompts),
            "failed": failed,
            "versions": sorted(seen_versions),
            "seconds": round(time.perf_counter() - started, 3),
        }
        self.history.append(result)
        self.log.info("eval", **result)
        return result
