"""The ``verifiers`` agent: a verifiers environment's own rollout, as an ``openai_agent``.

``rollout: {use: openai_agent, agent: verifiers}`` with prompts of a ``kind: verifiers`` source
(their ``meta.verifiers`` names the environment): each episode runs the environment's
``run_rollout`` (its multi-turn protocol: ``env_response``, tools, stop conditions, then its
rubric) with the model behind verifiers' ``OpenAIChatCompletionsClient`` around the episode's
``openai.AsyncOpenAI``, so every model turn goes through the agent proxy and is trained as the
exact tokens the engine sampled. The model is named ``policy``; the environment's
``sampling_args`` are sent as it sends them (its ``max_tokens``, stop strings...), and the proxy
holds them to the run's sampling (temperature, top-p... and ``max_new_tokens``). The rubric's
reward is the agent's return value: ``env_reward`` passes it on.

What ends an episode without a reward (the sample is dropped and counted, as any agent that
raises: ``rollout_agent_raised``, the error logged): the environment raises; a rubric reward
function raises or returns something that is not a number (verifiers would score it 0); the
environment stops on an error that is not the model's doing (a model call that failed, e.g. past
the episode's ``max_turns`` / ``max_tokens`` budget, where ``openai_agent`` keeps what was
sampled with no reward of its own; an infrastructure or the environment's own ``vf.Error``); a
rubric with group reward functions (Inflight plays each episode on its own: use the
``single_turn`` rollout and the ``verifiers`` reward, which scores whole groups). An episode
that the environment stops because of the model's output (an empty or invalid answer, a tool
call it cannot parse or run) is trained with the rubric's reward, as verifiers scores it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from stages.verifiers_env import (
    VerifiersError,
    environment_of,
    package,
    rollout_input,
    rubric_failures,
)

__all__ = ["POLICY", "solve"]

POLICY = "policy"  # the model name the proxy serves (it accepts any)


async def solve(client: Any, task: Mapping[str, Any]) -> float | None:
    """Play ``task`` (a prompt of a verifiers source) in its environment; the rubric's reward."""
    env = environment_of(task)
    if env.rubric.has_group_rewards:
        raise VerifiersError(
            f"environment {task['verifiers']['env']!r}: its rubric has group reward functions "
            "(they compare a group's rollouts), and the verifiers agent plays each episode on "
            "its own; use rollout single_turn with rewards [{fn: verifiers}]"
        )
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    sampling = copy.deepcopy(env.sampling_args)
    with rubric_failures() as failed:
        output = await env.run_rollout(
            rollout_input(task), OpenAIChatCompletionsClient(client), POLICY, sampling
        )
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise VerifiersError(f"the environment's rubric failed: {failed[0]}{more}")
    error = output.get("error")
    if error is not None and _error_class(error) not in _models_doing():
        raise VerifiersError(f"the environment stopped on an error: {_shown(error)}")
    reward = output.get("reward")
    return None if reward is None else float(reward)


def _error_class(error: Any) -> str:
    """The class name of a rollout's error (verifiers' output holds it as ``ErrorData``)."""
    if isinstance(error, BaseException):
        return type(error).__name__
    return str(error.get("error", "")) if isinstance(error, Mapping) else type(error).__name__


def _shown(error: Any) -> str:
    """The error with its causes (``ModelError() -> BadRequestError(...)``)."""
    if isinstance(error, Mapping):
        return str(error.get("error_chain_repr") or f"{error.get('error')}: {error.get('message')}")
    return f"{type(error).__name__}: {error}"


def _models_doing() -> set[str]:
    """The errors that the model's own output causes (verifiers stops the rollout and scores
    it): an empty or invalid answer, a tool call it cannot parse or run; their subclasses too."""
    vf = package()
    found: set[str] = set()
    todo = [vf.InvalidModelResponseError, vf.ToolError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found
