"""Load named tensors into a live model, in place, by their Hugging Face checkpoint names.

Names are those of ``model.state_dict()`` (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``); with tied embeddings both ``lm_head.weight`` and
``model.embed_tokens.weight`` name the same parameter, and either updates it. A vision model's
tensors also go by the names its original checkpoints (and SGLang's models) give them
(``visual.X``, ``model.layers...``: ``images.model_name``), and any model's by the names of
the checkpoints transformers converts into its parameters (a mixture's experts one tensor an
expert: ``checkpoint_names``). Every name,
shape and dtype is checked before anything is written, so a bad bucket leaves the model as it
was. This module does not receive tensors (see ``stages.weights.receiver``) nor decide when to
load them (the scheduler does, between two decode steps).

LoRA adapters (``MODULE.lora_A.weight`` ``[r, in]`` and ``MODULE.lora_B.weight`` ``[out, r]``,
``B`` already scaled by ``alpha / r``: what a LoRA learner publishes) are merged:
``MODULE.weight = W0 + B @ A`` (one ``addmm`` in the weight's dtype, written in place), where
``W0`` is the module's weight before its first adapter (a copy kept per adapted module, on the
weight's device). An adapter's A and B may come in different calls: the last of each is used. A full
tensor for an adapted module replaces its ``W0`` (the adapter stays merged on top).

Delta updates (``stages.weights.delta``): the parts ``NAME.delta_*`` of a delta (positions or
a bit mask, and values or compressed differences) write the changed values of ``NAME``; parts
wait for the others if those come in a later call. Whether the model holds the
version a delta was computed against is the caller's check (the server's ``base_version``).
"""

from __future__ import annotations

from collections.abc import Container

import torch

from stages.engine.checkpoint_names import checkpoint_names
from stages.engine.images import is_vision_model, model_name
from stages.weights.delta import complete, decode, delta_base

__all__ = ["WeightLoadError", "load_named_tensors", "parameter_rows"]

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class WeightLoadError(ValueError):
    """A tensor that does not fit the model: unknown name, wrong shape or non-float dtype."""


class _State:
    """What loading keeps between calls for one model: each adapted module's base weight and
    last A and B, and the parts of deltas whose other parts are still to come."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # "MODULE.weight" -> W0
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # "MODULE.weight" -> {A, B}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # a delta's parts, others to come


def _state(model: torch.nn.Module) -> _State:
    found = getattr(model, "_inflight_load_state", None)
    if found is None:
        found = _State()
        model._inflight_load_state = found  # type: ignore[assignment]
    return found


def _split(name: str) -> tuple[str, str] | None:
    """``("MODULE.weight", "A" | "B")`` for an adapter tensor's name, else None."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", suffix[6]
    return None


@torch.no_grad()
def load_named_tensors(
    model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]
) -> int:
    """Copy each tensor into the model's parameter of that name (merge each adapter into its
    module's weight); returns how many tensors were taken."""
    targets = model.state_dict(keep_vars=True)
    given = len(named_tensors)
    if is_vision_model(getattr(model, "config", None)):  # the original checkpoints' names too
        named_tensors = [(model_name(name), tensor) for name, tensor in named_tensors]
    named_tensors = checkpoint_names(model).convert(named_tensors)  # as transformers loads them
    state = _state(model)
    problems = []
    incoming: dict[str, dict[str, torch.Tensor]] = {}
    deltas, plain = _deltas(named_tensors, targets, state, problems)
    for name, tensor in plain:
        part = _split(name)
        key = name if part is None else part[0]
        target = targets.get(key)
        if target is None:
            problems.append(f"{name}: no such parameter in the model")
        elif not tensor.is_floating_point() and target.is_floating_point():
            problems.append(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        elif part is None:
            if tuple(target.shape) != tuple(tensor.shape):
                problems.append(
                    f"{name}: shape {list(tensor.shape)} does not match the model's "
                    f"{list(target.shape)}"
                )
        else:
            incoming.setdefault(key, {})[part[1]] = tensor
    for key, parts in incoming.items():
        both = {**state.parts.get(key, {}), **parts}
        out_f, in_f = targets[key].shape
        a, b = both.get("A"), both.get("B")
        if a is not None and (a.dim() != 2 or a.shape[1] != in_f):
            problems.append(f"{key[:-7]}.lora_A.weight: shape {list(a.shape)}, want [r, {in_f}]")
        if b is not None and (b.dim() != 2 or b.shape[0] != out_f):
            problems.append(f"{key[:-7]}.lora_B.weight: shape {list(b.shape)}, want [{out_f}, r]")
        if a is not None and b is not None and a.shape[0] != b.shape[1]:
            problems.append(f"{key[:-7]}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}")
    if problems:
        raise WeightLoadError("; ".join(problems))
    for name, tensor in plain:
        if _split(name) is None:
            base = state.base.get(name)
            (targets[name].data if base is None else base).copy_(tensor)
    for name, (where, val) in deltas.items():
        base = state.base.get(name)
        flat = (targets[name].data if base is None else base).view(-1)
        val = val.to(flat.device, flat.dtype)
        if where.dtype == torch.bool:  # a bit per value
            flat.masked_scatter_(where.to(flat.device), val)
        else:
            flat.index_copy_(0, where.to(flat.device), val)
    written = {n for n, _ in plain} | set(deltas)
    for key in {k for k in state.base if k in written} | set(incoming):
        target = targets[key]
        base = state.base.get(key)
        if base is None:
            base = state.base[key] = target.detach().clone()
        parts = state.parts.setdefault(key, {})
        for which, tensor in incoming.get(key, {}).items():
            parts[which] = tensor.detach().to(target.device, target.dtype, copy=True)
        if "A" in parts and "B" in parts:  # one pass over the weight, written in place
            torch.addmm(base, parts["B"], parts["A"], out=target.data)
        else:
            target.data.copy_(base)
    return given


def _deltas(
    named_tensors: list[tuple[str, torch.Tensor]],
    targets: dict[str, torch.Tensor],
    state: _State,
    problems: list[str],
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The whole deltas of this call (``name -> (where, values)``, decoded against the model's
    current values; parts whose others are still to come are kept for a later call) and the
    other tensors."""
    plain: list[tuple[str, torch.Tensor]] = []
    arrived: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        found = delta_base(name)
        if found is None:
            plain.append((name, tensor))
        else:
            arrived.setdefault(found[0], {})[found[1]] = tensor
    whole = {}
    for name, parts in arrived.items():
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: no such parameter in the model (a delta of it)")
            continue
        parts = {**state.pending.get(name, {}), **parts}
        if not complete(parts):  # the rest comes in a later call
            state.pending[name] = parts
            continue
        base = state.base.get(name, target)
        try:
            whole[name] = decode(parts, base)
        except ValueError as exc:
            problems.append(f"{name}.{exc}")
            continue
        state.pending.pop(name, None)
    return whole, plain


def update_names(model: torch.nn.Module) -> Container[str]:
    """The tensor names a weight update may give ``model``'s tensors: its own, a vision
    model's as its original checkpoints name them (``images.checkpoint_name``), and those of
    the checkpoints transformers converts into its parameters (``checkpoint_names``)."""
    return _UpdateNames(model)


class _UpdateNames:
    def __init__(self, model: torch.nn.Module) -> None:
        self.names = checkpoint_names(model)
        self.vision = is_vision_model(getattr(model, "config", None))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return (model_name(name) if self.vision else name) in self.names


def parameter_rows(model: torch.nn.Module, name: str, rows: int) -> torch.Tensor | None:
    """Parameter ``name``'s first ``rows`` rows (a Python slice), copied to the CPU in
    float32; None when ``model`` has no parameter of that name (or it is a scalar)."""
    if is_vision_model(getattr(model, "config", None)):
        name = model_name(name)
    # remove_duplicate=False: a tied lm_head.weight is found as embed_tokens.weight
    found = dict(model.named_parameters(remove_duplicate=False)).get(name)
    if found is None or found.dim() == 0:
        return None
    return found.detach()[:rows].to("cpu", torch.float32, copy=True)
