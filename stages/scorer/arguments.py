"""The keyword arguments every reward function gets, from samples (the scorer's and the
evaluation's: both score the same way).

``completions`` is the decoded text of each sample's final answer: the whole completion, or for a
trajectory (a sample with a ``loss_mask``) what the model sampled after the last inserted token.
Aligned with it: ``prompts`` (text), ``completion_ids`` (every token after the prompt),
``finish_reason``, every key of the prompt's ``meta`` (``answer``...) and, when any sample is a
trajectory, ``trajectories`` (the whole text), ``env_reward`` (the environment's, or None) and
``rollout`` (what the rollout reported). TRL's convention: a function takes what it needs and
the rest through ``**kwargs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stages.detokenize import batch_decoder, token_lists
from stages.rollouts.trajectory import final_turn

__all__ = ["reward_arguments"]


def reward_arguments(
    tokenizer: Any, prompts: Sequence[str], samples: Sequence[Mapping[str, Any]]
) -> dict[str, list]:
    """``samples`` carry ``completion_ids``, ``finish_reason``, ``meta`` and optionally
    ``loss_mask`` and ``rollout``; ``prompts`` is each one's prompt text."""
    ids = token_lists([s["completion_ids"] for s in samples])
    finals = [final_turn(i, s.get("loss_mask")) for i, s in zip(ids, samples, strict=True)]
    decode = batch_decoder(tokenizer)
    kwargs: dict[str, list] = {
        "prompts": list(prompts),
        "completions": decode(finals, True),
        "completion_ids": ids,
        "finish_reason": [s["finish_reason"] for s in samples],
    }
    if any(s.get("loss_mask") is not None for s in samples):  # trajectories
        rollout = [dict(s.get("rollout") or {}) for s in samples]
        kwargs["trajectories"] = decode(ids, True)
        kwargs["env_reward"] = [r.get("env_reward") for r in rollout]
        kwargs["rollout"] = rollout
    for key in dict.fromkeys(k for s in samples for k in (s.get("meta") or {})):
        if key not in kwargs:  # the scorer's own names come first
            kwargs[key] = [(s.get("meta") or {}).get(key) for s in samples]
    return kwargs
