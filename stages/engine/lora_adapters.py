"""LoRA adapters kept beside the base weights and applied per request, unmerged (SGLang's
``/load_lora_adapter``, ``/unload_lora_adapter`` and a request's ``lora_path``).

An adapter is a folder in ``peft``'s format (``adapter_config.json`` and
``adapter_model.safetensors`` or ``adapter_model.bin``: what ``PeftModel.save_pretrained`` and a
LoRA learner's checkpoints write). ``load_adapter`` reads it against the model: every adapted
module must be one of a Llama-family layer's seven projections (q, k, v, o, gate, up, down; or a
model's own fused q/k/v and gate/up, Phi-3's ``qkv_proj`` and ``gate_up_proj``; no gate in an
MLP without one), each ``lora_A``
``[r, in]`` and ``lora_B`` ``[out, r]`` of that module's shape. ``B`` is scaled by ``lora_alpha
/ r`` (``/ sqrt(r)`` with ``use_rslora``) once, at load. Per layer, the adapter's q/k/v pieces
are fused as the engine fuses the projections themselves (``llama_forward``): one ``A`` of the
targeted pieces stacked, one block-diagonal ``B`` whose rows land on each piece's slice of the
fused output; gate/up the same.

``RowAdapters`` says which rows of one forward pass take which adapter; ``add`` puts each
adapted projection's low-rank term ``(x A^T) B^T`` onto its rows' output: on every row at once
when all rows share one adapter (an RL batch on the current policy), else by row index. The
base weights are never touched, so rows of the base model and of several adapters share a batch.
Merging an adapter into the weights instead (what an in-flight LoRA update over the weight
group does: ``model_weights``) costs nothing per token but serves one adapter at a time.

Not here: which rows take which adapter (the scheduler), the HTTP routes (``lora_routes``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages.engine.latent_attention import is_latent
from stages.engine.llama_forward import decoder_layers, dense_mlp

__all__ = ["Adapter", "AdapterError", "RowAdapters", "load_adapter"]

_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[^.]+)?\.weight$"
)
# the engine's fused slots: which projections feed each, in the fused order
_SLOTS = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}
# a slot the model's layer has as one projection of its own (Phi-3's): its adapter is whole
_OWN = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
_SLOT_OF = {(part, proj): slot for slot, (part, projs) in _SLOTS.items() for proj in projs} | {
    (_SLOTS[slot][0], proj): slot for slot, proj in _OWN.items()
}


class AdapterError(ValueError):
    """An adapter folder that cannot be applied to this model (says what and where)."""


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per layer, per fused slot, ``(A, B)`` with ``B`` scaled."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    modules: int = 0  # adapted projections

    def describe(self) -> dict[str, Any]:
        return {"lora_name": self.name, "lora_path": self.path, "rank": self.rank}


def load_adapter(path: str | Path, model: torch.nn.Module, name: str) -> Adapter:
    """Read the ``peft`` adapter folder ``path`` for ``model`` (a Llama-family model); raises
    ``AdapterError`` saying what does not fit."""
    folder = Path(path)
    config = _read_config(folder)
    return build_adapter(
        config, lambda: _read_tensors(folder), model, name, str(path),
        config_at=str(folder / "adapter_config.json"), at=str(folder),
    )  # fmt: skip


def build_adapter(
    config: dict[str, Any],
    tensors: Callable[[], dict[str, torch.Tensor]],
    model: torch.nn.Module,
    name: str,
    path: str,
    *,
    config_at: str,
    at: str,
) -> Adapter:
    """The adapter of a ``peft`` ``config`` (``adapter_config.json``'s) and its weights
    (``tensors``, read once the config is checked) for ``model``; ``path`` is what
    ``loaded_adapters`` shows; ``config_at`` and ``at`` say where a problem is."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_at}: peft_type {config.get('peft_type')!r}, not LORA")
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{config_at}: r={rank!r} is not a rank >= 1")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{config_at}: lora_alpha={alpha!r}")
    if config.get("use_dora"):
        raise AdapterError(f"{at}: DoRA adapters are not supported (use_dora: true)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{at}: per-module ranks (rank_pattern, alpha_pattern)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    folder = at  # where the weights are, in what follows
    tensors = tensors()
    layers = decoder_layers(model)  # (a vision model's: its text's)
    pieces: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _NAME.match(key)
        if m is None or (m.group(2), m.group(3)) not in _SLOT_OF:
            raise AdapterError(
                f"{folder}: {key}: not a LoRA weight of a layer's q/k/v/o/gate/up/down "
                "projection (the engine applies no other unmerged)"
            )
        index = int(m.group(1))
        if index >= len(layers):
            raise AdapterError(f"{folder}: {key}: layer {index}, the model has {len(layers)}")
        pieces.setdefault((index, m.group(2), m.group(3)), {})[m.group(4)] = tensor
    if not pieces:
        raise AdapterError(f"{folder}: no LoRA weights in the adapter file")
    adapted = len(pieces)
    weight = next(model.parameters())
    built: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in layers]
    for index in range(len(layers)):
        for slot, (part, projs) in _SLOTS.items():
            module = getattr(layers[index], part)
            own = _OWN.get(slot)
            if own is not None and isinstance(getattr(module, own, None), torch.nn.Linear):
                projs = (own,)
            elif slot == "gate_up" and dense_mlp(module):  # (an MLP without a gate: up alone)
                projs = tuple(p for p in projs if hasattr(module, p))
            found = [pieces.get((index, part, p)) for p in projs]
            if not any(found):
                continue
            if slot == "qkv" and is_latent(module):
                raise AdapterError(
                    f"{folder}: layer {index}'s attention is multi-head latent attention, whose "
                    f"o_proj alone the engine applies adapters to (the adapter has its "
                    f"{'/'.join(p for p, f in zip(projs, found, strict=True) if f)})"
                )
            if part == "mlp" and not dense_mlp(layers[index].mlp):
                raise AdapterError(
                    f"{folder}: layer {index}'s MLP is a mixture of experts, which the engine "
                    f"applies no adapter to (the adapter has its {'/'.join(projs)})"
                )
            modules = [getattr(getattr(layers[index], part), p) for p in projs]
            built[index][slot] = _fuse(
                folder, index, part, projs, modules, found, rank, scale, weight
            )
            for p in projs:
                pieces.pop((index, part, p), None)
    for index, part, proj in sorted(pieces):  # q/k/v where the layer has qkv_proj, or the reverse
        raise AdapterError(
            f"{folder}: layers.{index}.{part}.{proj}: the model's layer has no such projection"
        )
    return Adapter(name, path, rank, built, modules=adapted)


def _fuse(
    folder: str,
    index: int,
    part: str,
    projs: tuple[str, ...],
    modules: list[torch.nn.Linear],
    found: list[dict[str, torch.Tensor] | None],
    rank: int,
    scale: float,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's ``A`` (targeted pieces stacked) and block-diagonal ``B`` (scaled)."""
    targeted = [i for i, f in enumerate(found) if f]
    a_all = like.new_zeros((len(targeted) * rank, modules[0].in_features))
    outs = [m.out_features for m in modules]
    b_all = like.new_zeros((sum(outs), len(targeted) * rank))
    for k, i in enumerate(targeted):
        where = f"{folder}: layers.{index}.{part}.{projs[i]}"
        a, b = found[i].get("A"), found[i].get("B")  # type: ignore[union-attr]
        if a is None or b is None:
            raise AdapterError(f"{where}: lora_{'A' if a is None else 'B'} is missing")
        if tuple(a.shape) != (rank, modules[i].in_features):
            raise AdapterError(
                f"{where}.lora_A: shape {list(a.shape)}, want [{rank}, {modules[i].in_features}]"
            )
        if tuple(b.shape) != (modules[i].out_features, rank):
            raise AdapterError(
                f"{where}.lora_B: shape {list(b.shape)}, want [{modules[i].out_features}, {rank}]"
            )
        row = sum(outs[:i])
        a_all[k * rank : (k + 1) * rank] = a.to(like.dtype)
        b_all[row : row + outs[i], k * rank : (k + 1) * rank] = b.to(torch.float32).mul(scale)
    return a_all, b_all


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no adapter_config.json (a peft adapter folder)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{file}: peft_type {kind!r}, not LORA")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safe, plain = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safe.exists():
            from safetensors.torch import load_file

            return load_file(str(safe))
        if plain.exists():
            return torch.load(plain, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise AdapterError(f"{safe if safe.exists() else plain}: {exc}") from None
    raise AdapterError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


class RowAdapters:
    """Which rows of one forward pass take which adapter: ``groups`` of ``(adapter, rows)``,
    ``rows`` None for every row of the pass."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[Adapter, torch.Tensor | None]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, adapters: list[Adapter | None], device: torch.device) -> RowAdapters | None:
        """From each row's adapter (None: the base model); None when no row has one."""
        first = adapters[0] if adapters else None
        if all(a is first for a in adapters):
            return None if first is None else cls([(first, None)])
        rows: dict[Adapter, list[int]] = {}
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(adapter, []).append(i)
        if not rows:
            return None
        return cls([(a, torch.tensor(r, device=device)) for a, r in rows.items()])

    def add(
        self, layer: int, slot: str, x: torch.Tensor, y: torch.Tensor, linear: Any = F.linear
    ) -> None:
        """``y += (x A^T) B^T`` on each group's rows for ``slot`` of ``layer`` (in place), the
        products by ``linear`` (``batch_invariant.linear`` in that mode)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(slot)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.add_(linear(linear(x, a), b))
            else:
                y.index_add_(0, rows, linear(linear(x.index_select(0, rows), a), b))
