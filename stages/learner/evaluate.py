"""Held-out evaluation: greedy answers from the engines, scored by the reward functions.

The learner's rank 0 evaluates the policy the engines serve: ``max_prompts`` held-out prompts,
spread evenly over the eval split (``spread``), are sent with
``temperature: 0`` to the engines in batched ``/generate`` requests (a list of ``input_ids``, as
SGLang takes them; round robin, one request per engine in flight, ``concurrency`` prompts in
flight in all), the answers are decoded and scored by the same reward runner the scorer uses,
and accuracy is the fraction of prompts whose reward reaches ``correct_at``. An engine that
refuses a batched request (an error other than a retryable one) gets one prompt per request from
then on (``concurrency`` requests in flight), said once in the log and counted. It runs on the
event loop while training goes on in its worker thread. An answer whose tokens span two policy
versions (an update landed during the evaluation) is reported under ``versions`` so a reader can
tell.

With ``eval.rollout`` (tool calls, an environment: share the generator's ``rollout`` with a YAML
anchor) every held-out prompt is played as one greedy episode of that rollout instead
(``concurrency`` episodes at once, each turn to the next engine that answers), and scored on its
final answer and the environment's reward like the scorer scores trajectories; the result adds
``turns_mean``, ``tool_use`` (the share of episodes that called a tool), ``solved`` (the share an
environment marked solved, when it says), ``truncated`` and ``finish_reasons``.

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
from stages.rollouts.api import EngineUnavailable, EnvError, RequestRefused
from stages.rollouts.trajectory import Generation, Trajectory
from stages.scorer.arguments import reward_arguments
from stages.scorer.runner import RewardRunner
from stages.weights.adapter_names import adapter_name

__all__ = ["Evaluator", "spread"]


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` of ``items`` (all when there are no more), evenly spaced from the first: an eval
    split in a meaningful order (enumerated problems, sorted by source or difficulty) is
    sampled across its length, not at its head."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


class Evaluator:
    def __init__(
        self,
        config: EvalConfig,
        prompts: list[dict[str, Any]],
        tokenizer: Any,
        log: Any,
        *,
        api_key: str | None = None,
        model: str = "",
    ) -> None:
        self.config = config
        self.model = model  # the rollout's tokenizer when it names none
        self.api_key = api_key  # the run's engine API key (stages.engine.auth)
        self.prompts = spread(prompts, config.max_prompts)
        self.tokenizer = tokenizer
        self.log = log
        self.runner = RewardRunner(config.rewards, workers=config.workers, timeout_s=30.0, log=log)
        self.history: list[dict[str, Any]] = []
        self.batched = True  # False once an engine refused a batched request
        self.batch_refusals = 0
        self.rollouts: Any = None  # stages.rollouts.runtime.RolloutRuntime, with eval.rollout
        self._episode_errors = 0
        # publish.lora_transport files: the prefix of the adapters' names (requests name the
        # version evaluated's); None: the engines hold the weights themselves
        self.adapter_prefix: str | None = None

    async def start(self) -> None:
        await self.runner.start()
        rollout = self.config.rollout
        if rollout is not None and not rollout.single_turn:
            from stages.rollouts.runtime import RolloutRuntime

            self.rollouts = await RolloutRuntime.start(
                rollout, log=self.log, default_tokenizer=self.model
            )

    async def close(self) -> None:
        await self.runner.aclose()
        if self.rollouts is not None:
            await self.rollouts.aclose()

    def _clients(
        self, urls: list[str], session: aiohttp.ClientSession, version: int
    ) -> list[EngineClient]:
        clients = [EngineClient(u, session, timeout_s=600.0, api_key=self.api_key) for u in urls]
        if self.adapter_prefix is not None:  # the adapter of the version evaluated
            named = (adapter_name(self.adapter_prefix, version) if version > 0 else None, version)
            for client in clients:
                client.adapter = lambda named=named: named
        return clients

    async def evaluate(self, urls: list[str], *, step: int, version: int) -> dict[str, Any]:
        if self.rollouts is not None:
            return await self._evaluate_episodes(urls, step=step, version=version)
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
            clients = self._clients(urls, session, version)
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
        answered = [
            (p, {"completion_ids": o, "finish_reason": r, "meta": p.get("meta")})
            for p, o, r in zip(self.prompts, outputs, reasons, strict=True)
            if o is not None
        ]
        rewards = await self._score(answered, step)
        return self._result(
            rewards,
            step=step,
            version=version,
            failed=failed,
            started=started,
            batched=self.batched,
            versions=sorted(seen_versions),
        )

    async def _score(self, answered: list[tuple[dict[str, Any], dict[str, Any]]], step: int):
        """Rewards of the answered prompts' samples, as the scorer gives them."""
        if not answered:
            return []
        prompts = [(p.get("meta") or {}).get("text", "") for p, _ in answered]
        kwargs = reward_arguments(self.tokenizer, prompts, [s for _, s in answered])
        return [r for r, _ in await self.runner.score(kwargs, eval_step=step)]

    def _result(
        self,
        rewards: list[float],
        *,
        step: int,
        version: int,
        failed: int,
        started: float,
        **extra: Any,
    ) -> dict[str, Any]:
        correct = sum(r >= self.config.correct_at for r in rewards)
        result = {
            "step": step,
            "policy_version": version,
            "accuracy": correct / max(len(self.prompts), 1),
            "reward": sum(rewards) / max(len(rewards), 1),
            "prompts": len(self.prompts),
            "failed": failed,
            **extra,
            "seconds": round(time.perf_counter() - started, 3),
        }
        self.history.append(result)
        self.log.info("eval", **result)
        return result

    # ------------------------------------------------------------------ episodes
    async def _evaluate_episodes(
        self, urls: list[str], *, step: int, version: int
    ) -> dict[str, Any]:
        """Every held-out prompt played as one greedy episode of ``eval.rollout``."""
        started = time.perf_counter()
        params = {"temperature": 0.0, "max_new_tokens": self.config.max_new_tokens}
        runtime = self.rollouts
        seen_versions: set[int] = set()
        async with aiohttp.ClientSession() as session:
            clients = self._clients(urls, session, version)
            limit = asyncio.Semaphore(self.config.concurrency)

            async def play(i: int) -> Trajectory | None:
                rid = f"eval/{step}/{i}"
                engine = _EvalEngine(clients, i, rid, params)
                ctx = runtime.context(sampling=params, group_id=rid)
                async with limit:
                    try:
                        return await runtime.rollout(self.prompts[i], engine, ctx)
                    except EngineAuthError:
                        raise  # every other episode would be refused the same way
                    except (EngineUnavailable, EnvError):
                        return None  # counted as failed
                    except Exception as exc:  # a rollout's bug: this episode only
                        self._episode_failed(rid, exc)
                        return None

            played = await asyncio.gather(*(play(i) for i in range(len(self.prompts))))
        answered = []
        for prompt, trajectory in zip(self.prompts, played, strict=True):
            if not isinstance(trajectory, Trajectory):
                continue
            mask = trajectory.loss_mask
            seen_versions.update(int(v) for v in set(trajectory.versions[mask == 1].tolist()))
            sample = {
                "completion_ids": trajectory.completion_ids,
                "loss_mask": mask,
                "finish_reason": trajectory.finish_reason,
                "meta": prompt.get("meta"),
                "rollout": {**trajectory.info, "env_reward": trajectory.reward},
            }
            answered.append((prompt, sample, trajectory))
        rewards = await self._score([(p, s) for p, s, _ in answered], step)
        episodes = [t for _, _, t in answered]
        n = max(len(episodes), 1)
        reasons: dict[str, int] = {}
        for t in episodes:
            reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
        solved = [t.info["solved"] for t in episodes if "solved" in t.info]
        return self._result(
            rewards,
            step=step,
            version=version,
            failed=len(self.prompts) - len(episodes),
            started=started,
            turns_mean=sum(t.turns for t in episodes) / n,
            tool_use=sum(int(t.info.get("tool_calls", 0) or 0) > 0 for t in episodes) / n,
            solved=sum(map(bool, solved)) / len(solved) if solved else None,
            truncated=sum(bool(t.info.get("truncated")) for t in episodes) / n,
            finish_reasons=reasons,
            versions=sorted(seen_versions),
        )

    def _episode_failed(self, rid: str, exc: BaseException) -> None:
        self._episode_errors += 1
        if self._episode_errors & (self._episode_errors - 1) == 0:  # 1st, 2nd, 4th...
            self.log.warning(
                "eval_rollout_failed",
                rid=rid,
                error=f"{type(exc).__name__}: {exc}",
                failures=self._episode_errors,
            )

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


class _EvalEngine:
    """The evaluation's ``RolloutEngine``: a turn goes to the episode's engine, or to the next
    one that answers when it fails (retryable errors only); no engine answering ends the
    episode (``EngineUnavailable``, counted as failed)."""

    def __init__(
        self, clients: list[EngineClient], first: int, rid: str, params: dict[str, Any]
    ) -> None:
        self.clients, self.first, self.rid, self.params = clients, first, rid, params
        self.calls = 0

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        params = {**self.params, **sampling}
        error: EngineError | None = None
        for attempt in range(len(self.clients)):
            client = self.clients[(self.first + attempt) % len(self.clients)]
            rid = f"{self.rid}/{self.calls}"
            self.calls += 1
            try:
                done = await client.generate(input_ids, params, rid=rid)
            except EngineAuthError:
                raise
            except EngineError as exc:
                if exc.status == 400:  # the request, not the engine (an agent's call: its 400)
                    raise RequestRefused(str(exc)) from exc
                if not exc.retryable:
                    raise EngineUnavailable(str(exc)) from exc
                error = exc
                continue
            self.first = (self.first + attempt) % len(self.clients)  # stay there
            return Generation(done.output_ids, done.logprobs, done.versions, done.finish_reason)
        raise EngineUnavailable(f"no engine answered: {error}")
