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

__all__ = ["completion_arguments", "reward_arguments"]


def reward_arguments(
    tokenizer: Any, prompts: Sequence[str], samples: Sequence[Mapping[str, Any]]
) -> dict[str, list]:
    """``samples`` carry ``completion_ids``, ``finish_reason``, ``meta`` and optionally
    ``loss_mask`` and ``rollout``; ``prompts`` is each one's prompt text."""
    masks = [s.get("loss_mask") for s in samples]
    trajectories = any(m is not None for m in masks)
    return completion_arguments(
        tokenizer,
        prompts,
        token_lists([s["completion_ids"] for s in samples]),
        [s["finish_reason"] for s in samples],
        [s.get("meta") for s in samples],
        masks=masks if trajectories else None,
        rollouts=[s.get("rollout") for s in samples] if trajectories else None,
    )


def completion_arguments(
    tokenizer: Any,
    prompts: Sequence[str],
    ids: list[list[int]],
    finish_reasons: Sequence[str],
    metas: Sequence[Mapping[str, Any] | None],
    masks: Sequence[Any] | None = None,
    rollouts: Sequence[Mapping[str, Any] | None] | None = None,
) -> dict[str, list]:
    """The same from columns: each sample's completion token ids (lists of ints), finish
    reason and its prompt's ``meta``; ``masks`` and ``rollouts`` (each sample's ``loss_mask``
    and ``rollout``) when some sample is a trajectory, else None."""
    decode = batch_decoder(tokenizer)
    finals = ids if masks is None else [final_turn(i, m) for i, m in zip(ids, masks, strict=True)]
    kwargs: dict[str, list] = {
        "prompts": list(prompts),
        "completions": decode(finals, True),
        "completion_ids": ids,
        "finish_reason": list(finish_reasons),
    }
    if masks is not None:  # trajectories
        rollout = [dict(r or {}) for r in rollouts or [None] * len(ids)]
        kwargs["trajectories"] = decode(ids, True)
        kwargs["env_reward"] = [r.get("env_reward") for r in rollout]
        kwargs["rollout"] = rollout
    for key in dict.fromkeys(k for m in metas if m for k in m):
        if key not in kwargs:  # the scorer's own names come first
            kwargs[key] = [(m or {}).get(key) for m in metas]
    return kwargs
