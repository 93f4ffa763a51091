"""The ``tools`` rollout: the model calls tools, turn after turn, until it answers without one.

Each turn is one engine call from the context so far (``ctx.tools.format`` says where the
episode starts, which stop tokens end a turn and how calls and answers are written). A turn with
calls gets their answers (``ctx.tools``: run in worker processes; a bad call is answered with an
error text and counted, never raised) inserted after it, never trained, and the model goes on.

The episode ends when:

- a turn has no call: ``stop`` (the model's answer);
- a turn hits ``max_new_tokens`` without finishing: ``length``;
- a turn with calls is the ``max_turns``-th: ``max_turns`` (its calls are not run);
- the episode's ``max_tokens`` (sampled and inserted after the prompt) is spent: ``max_tokens``.
  The last turn's ``max_new_tokens`` is capped to what is left; answers that do not fit are cut
  to it. The trajectory is marked ``truncated`` in its info.

``info``: ``turns``, ``tool_calls``, ``tool_errors``, ``truncated``. Counters (``ctx.count``):
``tool_calls``, ``tool_errors_KIND`` (kinds: ``stages.rollouts.tools.ERROR_KINDS``),
``tool_outputs_cut``, ``episodes_truncated``, ``episodes_max_turns``.

Not here: what a tool is and how it runs (``tools.py``), call syntax (``tool_format.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.rollouts.api import RolloutContext, RolloutEngine
from stages.rollouts.tool_format import ToolEpisode, Turn
from stages.rollouts.trajectory import Trajectory

__all__ = ["tool_rollout"]


async def tool_rollout(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:
    if ctx.tools is None:
        raise RuntimeError("the tools rollout needs rollout.tools (at least one tool function)")
    episode = ctx.tools.format.episode(prompt)
    trajectory = Trajectory(episode.prompt_ids)
    trajectory.info.update(turns=0, tool_calls=0, tool_errors=0, truncated=False)
    try:
        trajectory.finish_reason = await _play(trajectory, episode, engine, ctx)
    finally:
        trajectory.info["turns"] = trajectory.turns
    return trajectory


async def _play(
    trajectory: Trajectory, episode: ToolEpisode, engine: RolloutEngine, ctx: RolloutContext
) -> str:
    """Run turns until the episode ends; its finish reason."""
    budget = ctx.config.max_tokens or None
    overrides = episode.sampling(ctx.sampling)
    while True:
        sampling = dict(overrides)
        if budget is not None:
            left = budget - trajectory.length
            if left <= 0:
                return _truncated(trajectory, ctx)
            sampling["max_new_tokens"] = min(left, int(ctx.sampling.get("max_new_tokens") or left))
        turn = episode.read(await engine.generate(trajectory.context, **sampling))
        trajectory.sampled(turn.generation)
        reason = turn.generation.finish_reason
        if reason != "stop":  # the turn hit its token limit (or the engine aborted it)
            if reason == "length" and budget is not None and trajectory.length >= budget:
                return _truncated(trajectory, ctx)
            return reason
        if not turn.calls:
            return "stop"
        if trajectory.turns >= ctx.config.max_turns:
            ctx.count("episodes_max_turns")
            return "max_turns"
        answer = await _answer(turn, episode, trajectory, ctx)
        if budget is not None and trajectory.length + len(answer) > budget:
            trajectory.inserted(answer[: budget - trajectory.length])
            return _truncated(trajectory, ctx)
        trajectory.inserted(answer)


async def _answer(
    turn: Turn, episode: ToolEpisode, trajectory: Trajectory, ctx: RolloutContext
) -> list[int]:
    """Run the turn's calls, count them, and return the answer's tokens."""
    results = await ctx.tools.call_all(turn.calls)
    trajectory.info["tool_calls"] += len(results)
    ctx.count("tool_calls", len(results))
    for result in results:
        if result.error is not None:
            trajectory.info["tool_errors"] += 1
            ctx.count(f"tool_errors_{result.error}")
        if result.cut:
            ctx.count("tool_outputs_cut")
    return episode.answer_ids(turn.calls, [r.text for r in results])


def _truncated(trajectory: Trajectory, ctx: RolloutContext) -> str:
    trajectory.info["truncated"] = True
    ctx.count("episodes_truncated")
    return "max_tokens"
