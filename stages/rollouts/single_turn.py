"""The default rollout: one completion of the prompt, every token sampled.

The generator serves it with one group request per prompt (``group_requests``) rather than
calling this function per sample; it is here so that the evaluation, a rollout of your own and
the tests can run the same behaviour through the plugin interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stages.rollouts.api import RolloutContext, RolloutEngine
from stages.rollouts.trajectory import Trajectory

__all__ = ["single_turn"]


async def single_turn(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:
    trajectory = Trajectory(prompt["input_ids"])
    generation = await engine.generate(trajectory.context)
    trajectory.sampled(generation)
    trajectory.finish_reason = generation.finish_reason
    return trajectory
