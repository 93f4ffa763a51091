"""A checkpoint's tensors under the names of a live model's parameters, converted as transformers
converts them when it loads that checkpoint.

Transformers 5 keeps some parameters otherwise than the checkpoints it loads them from, and
converts them on the way in (its conversion mapping, ``conversion_mapping.py``): a mixture of
experts is one tensor an expert in Qwen's, Mixtral's and OLMoE's checkpoints
(``mlp.experts.3.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.3.w1.weight``) and one
fused parameter for all of a layer's experts in the model (``mlp.experts.gate_up_proj``); it
saves them back the checkpoints' way. SGLang's models load those checkpoint names, on every
weight-update route. ``CheckpointNames(model)`` says which names it takes (``in``: the model's
own, or one transformers converts into one of them) and ``convert``s tensors so named into the
model's, with transformers' own renamings and operations (stacking the experts, joining gate
and up), so that a checkpoint of such a model updates it whole. A conversion that needs tensors
the call does not hold (some of a layer's experts) gives a tensor of another shape, which the
loader refuses with its name.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CheckpointNames", "checkpoint_names"]

_KNOWN: weakref.WeakKeyDictionary[torch.nn.Module, CheckpointNames] = weakref.WeakKeyDictionary()


class CheckpointNames:
    """The names ``model`` takes tensors by, and their conversion (see the module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.own = set(model.state_dict())
        self._renamings: list[Any] = []
        self._converters: list[Any] = []
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            mapping = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        except (ImportError, AttributeError, TypeError):  # not a transformers model
            mapping = []
        else:
            self._renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
            self._converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._renamed: dict[str, tuple[str, str | None] | None] = {}

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.own or self._target(name) is not None)

    def convert(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """``tensors`` under the model's names: its own names as they are, others converted as
        transformers converts them (those it does not map are passed on as they are, for the
        loader to refuse by name)."""
        out: list[tuple[str, torch.Tensor]] = []
        pending: dict[str, Any] = {}  # target name -> transformers' transform collecting
        for name, tensor in tensors:
            found = None if name in self.own else self._target(name)
            if found is None:
                out.append((name, tensor))
                continue
            target, pattern = found
            if pattern is None:  # a renaming only
                out.append((target, tensor))
                continue
            transform = pending.setdefault(target, copy.deepcopy(self._by_pattern[pattern]))
            transform.add_tensor(target, name, pattern, _ready(tensor))
        for target, transform in pending.items():
            made = transform.convert(target, model=self.model, config=self.model.config)
            for made_name, value in made.items():
                out.append((made_name, value[0] if isinstance(value, list) else value))
        return out

    def _target(self, name: str) -> tuple[str, str | None] | None:
        """The model's name for checkpoint name ``name`` and the converter's source pattern that
        matched it (None: renamed only); None: transformers maps it to none of the model's."""
        if name not in self._renamed:
            found = None
            if self._renamings or self._converters:
                from transformers.core_model_loading import rename_source_key

                target, pattern = rename_source_key(
                    name,
                    self._renamings,
                    self._converters,
                    getattr(self.model, "base_model_prefix", None),
                    dict.fromkeys(self.own),
                )
                if target in self.own and target != name:
                    found = (target, pattern)
            self._renamed[name] = found
        return self._renamed[name]


def checkpoint_names(model: torch.nn.Module) -> CheckpointNames:
    """``model``'s ``CheckpointNames``, made once (its parameters' names do not change)."""
    found = _KNOWN.get(model)
    if found is None:
        found = _KNOWN[model] = CheckpointNames(model)
    return found


def _ready(tensor: torch.Tensor) -> Any:
    """``tensor`` as transformers' transforms take what they collect (a callable that gives
    it, the way its loader defers reading)."""
    return lambda: tensor
