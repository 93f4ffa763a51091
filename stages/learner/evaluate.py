"""Held-out evaluation: greedy answers from the engines, scored by the reward functions.

The learner's rank 0 evaluates the policy the engines serve: the held-out prompts are sent with
``temperature: 0`` to the engines in batched ``/generate`` requests (a list of ``input_ids``, as
SGLang takes them; round robin, one request per engine in flight, ``concurrency`` prompts in
flight in all), the answers are decoded and scored by the same reward runner the scorer uses,
and accuracy is the fraction of prompts whose reward reaches ``correct_at``. An engine that
refuses a batched request (an error other than a retryable one) gets one prompt per request from
then on (``concurrency`` requests in flight), said once in the log and counted. It runs on the
event loop while training goes on in its worker thread. An answer whose tokens span two policy
versions (an update landed during the evaluation) is reported under ``versions`` so a reader can
tell.

Not here: choosing when to evaluate (the stage does: at the start, every ``every`` steps, at the
end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from stages.generator.client import Completion, EngineAuthError, EngineClient, EngineError
from stages.learner.config import EvalConfig
from stages.scorer.runner import RewardRunner

__all__ = ["Evaluator"]


class Evaluator:
    def __init__(
        self,
        config: EvalConfig,
        prompts: list[dict[str, Any]],
        tokenizer: Any,
        log: Any,
        *,
        api_key: str | None = None,
    ) -> None:
        self.config = config
        self.api_key = api_key  # the run's engine API key (stages.engine.auth)
        self.prompts = prompts[: config.max_prompts]
        self.tokenizer = tokenizer
        self.log = log
        self.runner = RewardRunner(
            [(r.fn, r.weight) for r in config.rewards], workers=1, timeout_s=30.0, log=log
        )
        self.history: list[dict[str, Any]] = []
        self.batched = True  # False once an engine refused a batched request
        self.batch_refusals = 0

    async def start(self) -> None:
        await self.runner.start()

    async def close(self) -> None:
        await self.runner.aclose()

    async def evaluate(self, urls: list[str], *, step: int, version: int) -> dict[str, Any]:
        started = time.perf_counter()
        params = {"temperature": 0.0, "max_new_tokens": self.config.max_new_tokens}
        n = len(self.prompts)
        outputs: list[list[int] | None] = [None] * n
        reasons: list[str] = [""] * n
        seen_versions: set[int] = set()

        def record(i: int, done: Completion) -> None:
            seen_versions.update(int(v) for v in set(done.versions.tolist()))
            outputs[i] = done.output_ids.tolist()
            reasons[i] = done.finish_reason

        async with aiohttp.ClientSession() as session:
            clients = [
                EngineClient(u, session, timeout_s=600.0, api_key=self.api_key) for u in urls
            ]
            single = asyncio.Semaphore(self.config.concurrency)
            batches = asyncio.Semaphore(len(clients))

            async def one(i: int) -> None:
                async with single:
                    for attempt in range(len(clients)):
                        client = clients[(i + attempt) % len(clients)]
                        try:
                            done = await client.generate(
                                self.prompts[i]["input_ids"], params, rid=f"eval/{step}/{i}"
                            )
                        except EngineAuthError:
                            raise  # every other prompt would be refused the same way
                        except EngineError:
                            continue
                        record(i, done)
                        return

            async def batch(k: int, idx: list[int]) -> None:
                async with batches:
                    if self.batched and await batched(k, idx):
                        return
                await asyncio.gather(*(one(i) for i in idx))

            async def batched(k: int, idx: list[int]) -> bool:
                """One request for ``idx``; False when the engine refused it (go one by one)."""
                for attempt in range(len(clients)):
                    client = clients[(k + attempt) % len(clients)]
                    try:
                        done = await _generate_batch(
                            client,
                            [self.prompts[i]["input_ids"] for i in idx],
                            params,
                            [f"eval/{step}/{i}" for i in idx],
                        )
                    except EngineError as exc:
                        if exc.retryable:
                            continue
                        if isinstance(exc, EngineAuthError):
                            raise
                        self._refused(exc)
                        return False
                    for i, completion in zip(idx, done, strict=True):
                        record(i, completion)
                    return True
                return True  # no engine answered: these prompts failed

            size = max(1, -(-self.config.concurrency // max(len(clients), 1)))
            chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
            await asyncio.gather(*(batch(k, idx) for k, idx in enumerate(chunks)))
        failed = sum(o is None for o in outputs)
        kept = [(p, o) for p, o in zip(self.prompts, outputs, strict=True) if o is not None]
        texts = self.tokenizer.batch_decode([o for _, o in kept], skip_special_tokens=True)
        kwargs: dict[str, Any] = {  # the names the scorer gives reward functions
            "completions": texts,
            "prompts": [(p.get("meta") or {}).get("text", "") for p, _ in kept],
            "completion_ids": [o for _, o in kept],
            "finish_reason": [r for r, o in zip(reasons, outputs, strict=True) if o is not None],
        }
        for key in {k for p, _ in kept for k in (p.get("meta") or {})} - kwargs.keys():
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
            "batched": self.batched,
            "versions": sorted(seen_versions),
            "seconds": round(time.perf_counter() - started, 3),
        }
        self.history.append(result)
        self.log.info("eval", **result)
        return result

    def _refused(self, exc: EngineError) -> None:
        self.batch_refusals += 1
        if self.batched:
            self.batched = False
            self.log.warning(
                "eval_batches_refused",
                error=str(exc),
                fallback="one prompt per request from now on",
            )


async def _generate_batch(
    client: EngineClient,
    prompts: Sequence[Sequence[int]],
    params: dict[str, Any],
    rids: list[str],
) -> list[Completion]:
    """One ``/generate`` request for several prompts (SGLang's batched form), in their order."""
    return await client.generate_batch(prompts, params, rids=rids)
