"""Episodes: the generator's side of rollout plugins (``stages.rollouts``).

With a rollout other than ``single_turn`` the generator runs one episode per sample: the
rollout function gets the prompt, an :class:`EpisodeEngine` and its context, and returns a
``Trajectory``. The episode holds one sample of its engine's in-flight count from its first turn
to its end (tool calls and environment steps included), so the controller's gates (downstream
credit, the staleness bound, engine targets) decide when episodes *start*, exactly as they do
for completions; later turns of a running episode are never held back by them (an episode that
spans several weight updates is allowed, and measured per token by the learner).

Every turn of an episode goes to the engine its last turn used, which holds that turn's prefix in
its cache. An engine that fails a turn (connection lost, 5xx, timeout) is taken out of use as for
any request, and the turn goes to another live engine (waiting for a slot there), up to
``max_retries`` times; then, or on a 4xx, the episode is dropped as ``engine_failure``. A rollout
that raises (a bug in a rollout of your own) drops its sample as ``rollout_error``: counted,
logged, and the generator goes on. ``sample_fields`` turns a trajectory into the sample map of a
``rollout_group`` (``stages.schemas``, version 2).

With ``rollout.hold_kv`` each episode is a session of the engines it uses (its rid as SGLang's
``session_id``): an engine with ``--enable-session-radix-cache`` keeps the episode's KV in its
prefix cache from one turn to the next, whatever else it serves meanwhile, and the generator
closes the session on each of those engines when the episode ends (``SessionCloser``: many
episodes' closes to a request).

Not here: what a turn is (the rollouts), tools and environments (``stages.rollouts``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.generator.client import EngineError
from stages.rollouts.api import EngineUnavailable, RequestRefused
from stages.rollouts.trajectory import Generation, Trajectory

if TYPE_CHECKING:
    from stages.generator.stage import Generator

__all__ = ["EpisodeEngine", "sample_fields"]


class EpisodeEngine:
    """The ``RolloutEngine`` an episode gets: routes its turns and holds its in-flight slot.

    ``engine`` is the engine whose in-flight count the episode holds now (it moves when a turn
    is re-routed); the generator releases it when the episode ends.
    """

    def __init__(
        self, generator: Generator, engine: str, rid: str, *, hold_kv: bool = False
    ) -> None:
        self.gen, self.engine, self.rid = generator, engine, rid
        # the engines that hold its KV as a session's (rollout.hold_kv; None: not asked)
        self.holding: set[str] | None = set() if hold_kv else None
        self.calls = 0
        self.cached_tokens = 0  # prompt tokens the engines served from their prefix caches
        self.prompt_tokens = 0

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        gen = self.gen
        params = {**gen.params, **sampling} if sampling else gen.params
        attempt = 0
        while True:
            engine, rid = self.engine, f"{self.rid}/{self.calls}"
            self.calls += 1
            gen.counts["requests"] += 1
            session = None
            if self.holding is not None:
                session = self.rid
                self.holding.add(engine)
            try:
                completion = await gen.clients[engine].generate(
                    input_ids, params, rid=rid, session=session
                )
            except EngineError as exc:
                if exc.status == 400:  # the request, not the engine: no retry helps
                    raise RequestRefused(str(exc)) from exc
                if exc.retryable:
                    gen._mark_down(engine, str(exc))
                if not exc.retryable or attempt >= gen.config.max_retries:
                    raise EngineUnavailable(str(exc)) from exc
                attempt += 1
                gen._retrying([rid], engine, attempt, exc)
                gen._release(engine, 1)
                self.engine = await gen._slot(1)  # a live engine with room, or wait for one
                gen.in_flight[self.engine] += 1
                continue
            gen._served(engine, [completion])
            cached = _int(completion.meta.get("cached_tokens"))
            self.cached_tokens += cached
            self.prompt_tokens += len(input_ids)
            return Generation(
                completion.output_ids,
                completion.logprobs,
                completion.versions,
                completion.finish_reason,
                cached_tokens=cached,
            )


def sample_fields(
    index: int,
    trajectory: Trajectory,
    *,
    group_prompt: Sequence[int] | np.ndarray,
    engine: EpisodeEngine,
    queued: float,
    started: float,
) -> dict[str, Any]:
    """A trajectory as a ``rollout_group`` sample (``prompt_ids`` only when its own)."""
    done = time.monotonic()
    sample: dict[str, Any] = {
        "sample_index": index,
        "completion_ids": trajectory.completion_ids,
        "sampler_logprobs": trajectory.logprobs,
        "versions": trajectory.versions,
        "loss_mask": trajectory.loss_mask,
        "finish_reason": trajectory.finish_reason,
        "engine": engine.engine,
        "timings": {
            "queued_s": round(started - queued, 6),
            "generate_s": round(done - started, 6),
        },
        "rollout": {
            **{k: _plain(v) for k, v in trajectory.info.items()},
            "turns": trajectory.turns,
            "sampled_tokens": trajectory.sampled_tokens,
            "inserted_tokens": trajectory.inserted_tokens,
            "cached_tokens": engine.cached_tokens,
            "env_reward": trajectory.reward,
        },
    }
    if not np.array_equal(trajectory.prompt_ids, np.asarray(group_prompt)):
        sample["prompt_ids"] = trajectory.prompt_ids
    return sample


def check_trajectory(value: Any) -> Trajectory:
    """``value`` if it is a usable trajectory, else TypeError/ValueError saying why."""
    if not isinstance(value, Trajectory):
        raise TypeError(f"the rollout returned {type(value).__name__}, not a Trajectory")
    if value.turns == 0:
        raise ValueError("the rollout returned a trajectory without a sampled turn")
    if value.reward is not None and not math.isfinite(float(value.reward)):
        raise ValueError(f"the trajectory's reward is {value.reward}")
    return value


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _plain(value: Any) -> Any:
    """A value msgpack carries as is (numbers, strings, booleans, None), else its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
