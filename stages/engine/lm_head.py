"""The LM head's logits in float32: SGLang's ``--enable-fp32-lm-head`` (or a config's
``enable_lm_head_fp32``), as its ``LogitsProcessor`` computes them
(``layers/logits_processor.py``: ``hidden_states.to(float32) @ lm_head.weight.to(float32).T``).

A bfloat16 model's logits then carry no bfloat16 rounding: its sampled tokens' log-probs come
closer to a learner's, which computes its log-softmax in float32. ``use_fp32(head)`` makes the
head module compute so, wherever the engine calls it (transformers' passes call the module;
``logits(head, hidden)`` is what the engine's own passes call); a float32 model's logits are
the same either way.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["fp32_wanted", "is_fp32", "logits", "use_fp32"]

_MARK = "_inflight_fp32_head"


def fp32_wanted(flag: bool, config: Any) -> bool:
    """Whether the head computes in float32: the flag, or the (text) config's
    ``enable_lm_head_fp32``, as SGLang reads them."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return bool(flag or getattr(text, "enable_lm_head_fp32", False))


def use_fp32(head: torch.nn.Module) -> None:
    """From now on ``head`` (a ``Linear``) computes its logits in float32."""
    setattr(head, _MARK, True)
    head.forward = types.MethodType(_fp32_forward, head)  # type: ignore[method-assign]


def is_fp32(head: torch.nn.Module) -> bool:
    """Whether ``use_fp32`` made ``head`` compute in float32."""
    return bool(getattr(head, _MARK, False))


def logits(
    head: torch.nn.Module, hidden: torch.Tensor, linear: Callable[..., torch.Tensor] | None = None
) -> torch.Tensor:
    """``head``'s logits of ``hidden``: in float32 after ``use_fp32``, else in its dtype; the
    product by ``linear`` (None: ``F.linear``; ``batch_invariant.linear`` in that mode)."""
    if is_fp32(head):
        return _fp32_forward(head, hidden, linear)
    return (linear or F.linear)(hidden, head.weight, head.bias)


def _fp32_forward(
    head: Any, hidden: torch.Tensor, linear: Callable[..., torch.Tensor] | None = None
) -> torch.Tensor:
    bias = None if head.bias is None else head.bias.float()
    return (linear or F.linear)(hidden.float(), head.weight.float(), bias)
