"""Load named tensors into a live model, in place, by their Hugging Face checkpoint names.

Names are those of ``model.state_dict()`` (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``); with tied embeddings both ``lm_head.weight`` and
``model.embed_tokens.weight`` name the same parameter, and either updates it. Every name,
shape and dtype is checked before anything is written, so a bad bucket leaves the model as it
was. This module does not receive tensors (see ``stages.weights.receiver``) nor decide when to
load them (the scheduler does, between two decode steps).
"""

from __future__ import annotations

import torch

__all__ = ["WeightLoadError", "load_named_tensors"]


class WeightLoadError(ValueError):
    """A tensor that does not fit the model: unknown name, wrong shape or non-float dtype."""


@torch.no_grad()
def load_named_tensors(
    model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]
) -> int:
    """Copy each tensor into the model's parameter of that name; returns how many were copied."""
    targets = model.state_dict(keep_vars=True)
    problems = []
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: no such parameter in the model")
        elif tuple(target.shape) != tuple(tensor.shape):
            problems.append(
                f"{name}: shape {list(tensor.shape)} does not match the model's "
                f"{list(target.shape)}"
            )
        elif not tensor.is_floating_point() and target.is_floating_point():
            problems.append(f"{name}: dtype {tensor.dtype} is not a floating-point type")
    if problems:
        raise WeightLoadError("; ".join(problems))
    for name, tensor in named_tensors:
        targets[name].data.copy_(tensor)
    return len(named_tensors)
