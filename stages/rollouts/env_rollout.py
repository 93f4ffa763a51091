"""The ``environment`` rollout: a multi-turn episode against an environment plugin.

Gymnasium's loop, on tokens: the environment's ``reset(prompt)`` observation (text; nothing when
empty) is inserted after the prompt; then, turn after turn, the model samples an action (one
engine call, ending at its end-of-turn token or ``max_new_tokens``), the action's text goes to
``step(action)``, and the observation it returns is inserted (not trained) before the next turn.
The episode ends when the environment says ``done`` (``finish_reason`` ``done``), after
``max_turns`` turns (``max_turns``), when the episode's ``max_tokens`` is spent (``max_tokens``,
an observation cut to what was left), or when the environment fails: a reset or step that
raises, times out or loses its worker ends the episode (``env_error``, counted by kind in
``env_errors_KIND``) and the trajectory keeps what it had. The trajectory's ``reward`` is the sum
of the step rewards (score it with the ``env_reward`` reward function, alone or next to others);
``info`` has ``turns``, ``env_steps``, the environment's last ``info`` values and
``env_error`` when one happened.

Environments run in worker processes (``environments.py``), so one that hangs or crashes the
interpreter costs its episodes, never the generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.rollouts.api import EnvError, RolloutContext, RolloutEngine
from stages.rollouts.trajectory import Trajectory

__all__ = ["environment_rollout"]


async def environment_rollout(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:
    if ctx.env is None:
        raise RuntimeError("the environment rollout needs rollout.environment")
    config = ctx.config
    trajectory = Trajectory(prompt["input_ids"])
    budget = config.max_tokens or None
    total, steps = 0.0, 0
    async with ctx.env.episode(prompt) as env:
        try:
            observation = await env.reset()
            if not _insert(trajectory, ctx, observation, budget):
                return trajectory
            for _ in range(config.max_turns):
                sampling: dict[str, Any] = {}
                if budget is not None:
                    left = budget - trajectory.length
                    if left <= 0:
                        return _truncated(trajectory, ctx)
                    sampling["max_new_tokens"] = min(left, _max_new(ctx))
                generation = await engine.generate(trajectory.context, **sampling)
                trajectory.sampled(generation)
                observation, reward, done, info = await env.step(ctx.decode(generation.token_ids))
                steps += 1
                total += reward
                trajectory.info.update(info)
                if done:
                    trajectory.finish_reason = "done"
                    return trajectory
                if not _insert(trajectory, ctx, observation, budget):
                    return trajectory
            trajectory.finish_reason = "max_turns"
            ctx.count("episodes_max_turns")
            return trajectory
        except EnvError as exc:
            trajectory.finish_reason = "env_error"
            trajectory.info["env_error"] = exc.kind
            if trajectory.turns == 0:  # nothing sampled: nothing to train on (dropped, counted)
                raise
            return trajectory
        finally:
            trajectory.reward = total
            trajectory.info["env_steps"] = steps


def _insert(trajectory: Trajectory, ctx: RolloutContext, text: str, budget: int | None) -> bool:
    """Insert an observation; False (and the episode marked truncated) when it does not fit."""
    if not text:
        return True
    ids = ctx.encode(text)
    if budget is not None and trajectory.length + len(ids) > budget:
        trajectory.inserted(ids[: max(budget - trajectory.length, 0)])
        _truncated(trajectory, ctx)
        return False
    trajectory.inserted(ids)
    return True


def _truncated(trajectory: Trajectory, ctx: RolloutContext) -> Trajectory:
    trajectory.finish_reason = "max_tokens"
    trajectory.info["truncated"] = True
    ctx.count("episodes_truncated")
    return trajectory


def _max_new(ctx: RolloutContext) -> int:
    return int(ctx.sampling.get("max_new_tokens") or 128)
