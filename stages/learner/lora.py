"""LoRA: train low-rank adapters (through ``peft``) and publish only them to the engines.

``LoraSection`` is ``stages.<learner>.lora``; ``rank: 0`` (the default) trains every parameter.
With ``rank > 0`` the learner wraps its model with ``peft``'s ``LoraConfig(r=rank,
lora_alpha=alpha, lora_dropout=dropout, target_modules=...)``: only the adapters train, the
optimizer holds only them, and a weight update carries only them (``adapter_tensors``), named
as the base model's module with ``.lora_A.weight`` / ``.lora_B.weight`` (peft's saved names
without ``base_model.model.``) and ``B`` already multiplied by peft's scaling (``alpha / rank``):
an engine sets ``W = W0 + B @ A`` from the base weights it keeps (``stages.engine.model_weights``).

``check_targets`` fails before training when a target matches no module or the rank is larger
than a targeted matrix allows. Not here: the optimizer, DeepSpeed, checkpoints (the trainer).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LoraSection",
    "adapter_name",
    "check_targets",
    "merged_state_dict",
    "published_adapters",
    "wrap",
]

_ADAPTER = re.compile(r"^(?:base_model\.model\.)?(.*)\.(lora_[AB])\.[^.]+\.weight$")


@dataclass
class LoraSection:
    rank: int = field(
        default=0, metadata={"min": 0, "doc": "LoRA rank r (0: train every parameter)"}
    )
    alpha: float = field(default=16.0, metadata={"min": 0.0, "doc": "LoRA alpha: scaling alpha/r"})
    dropout: float = field(
        default=0.0, metadata={"min": 0.0, "max": 1.0, "doc": "dropout on the adapters' input"}
    )
    target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={
            "doc": "module names (or suffixes) that get adapters; ['all-linear']: every linear "
            "layer but the output head (peft's)"
        },
    )
    merged_checkpoints: bool = field(
        default=False,
        metadata={"doc": "checkpoints also hold the merged model (CHECKPOINT/merged)"},
    )

    def __post_init__(self) -> None:
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules to adapt")

    @property
    def on(self) -> bool:
        return self.rank > 0


def _matrices(folder: Path) -> dict[str, tuple[int, int]] | None:
    """``MODULE -> (out, in)`` of every 2-D ``MODULE.weight`` in a model folder's safetensors
    files, read from their headers (no torch, nothing loaded); None when the folder has none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    out = {}
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if name.endswith(".weight") and isinstance(shape, list) and len(shape) == 2:
                out[name[: -len(".weight")]] = (int(shape[0]), int(shape[1]))
    return out


def _chosen(
    linear: dict[str, tuple[int, int]], head: str | None, section: LoraSection, where: str
) -> list[str]:
    """The modules of ``linear`` (``name -> (out, in)``) that ``section`` adapts; raises
    ``ValueError`` for a target matching none or a rank above a chosen matrix's smaller side."""
    if section.target_modules == ["all-linear"]:
        chosen = [n for n in linear if n != head]
    else:
        chosen = []
        for target in section.target_modules:
            hits = [n for n in linear if n == target or n.endswith("." + target)]
            if not hits:
                leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
                raise ValueError(
                    f"lora.target_modules: {target!r} matches no linear module of {where} "
                    f"(its linear modules end in: {', '.join(leaves)})"
                )
            chosen += hits
    if not chosen:
        raise ValueError(f"lora.target_modules: no linear module of {where} to adapt")
    for name in chosen:
        out_f, in_f = linear[name]
        if section.rank > min(out_f, in_f):
            raise ValueError(
                f"lora.rank {section.rank} is larger than {name}'s matrix allows "
                f"({out_f} x {in_f}: at most {min(out_f, in_f)})"
            )
    return sorted(set(chosen))


def config_issue(model: str, section: LoraSection) -> str | None:
    """What is wrong with ``section``'s targets for the model folder ``model``, found from its
    weight files' headers before anything starts (``check_targets`` checks the loaded model
    again); None when nothing is, or when ``model`` is not a folder with safetensors files."""
    if not section.on or not Path(model).is_dir():
        return None
    matrices = _matrices(Path(model))
    if not matrices:
        return None
    # embeddings are 2-D too, and not linear layers
    linear = {n: s for n, s in matrices.items() if "embed" not in n.rsplit(".", 1)[-1]}
    head = next((n for n in linear if n.rsplit(".", 1)[-1] == "lm_head"), None)
    try:
        _chosen(linear, head, section, model)
    except ValueError as exc:
        return str(exc)
    return None


def check_targets(model: Any, section: LoraSection) -> list[str]:
    """The linear modules ``section`` adapts in a loaded ``model`` (their names); raises
    ``ValueError`` naming a target that matches none (with the model's linear module names) or
    a module whose matrix is smaller than the rank."""
    import torch

    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linear = {n: (m.out_features, m.in_features) for n, m in modules.items()}
    output = getattr(model, "get_output_embeddings", lambda: None)()
    head = next((n for n, m in modules.items() if m is output), None)
    return _chosen(linear, head, section, "the model")


def _targets(section: LoraSection) -> str | list[str]:
    if section.target_modules == ["all-linear"]:
        return "all-linear"
    return list(section.target_modules)


def wrap(model: Any, section: LoraSection) -> Any:
    """``model`` as a ``peft`` model with ``section``'s adapters (only they require grad)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - the extra is in dev
        raise ImportError("lora needs peft: pip install 'inflight-rl[lora]'") from exc

    check_targets(model, section)
    config = LoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=_targets(section),
        bias="none",
    )
    return get_peft_model(model, config)


def adapter_name(param_name: str) -> tuple[str, str] | None:
    """``(module, "lora_A" | "lora_B")`` of a peft adapter parameter's name (the module named as
    in the base model), or None for any other parameter."""
    m = _ADAPTER.match(param_name)
    return None if m is None else (m.group(1), m.group(2))


def scaling_of(model: Any, module: str) -> float:
    """peft's scaling (``alpha / r``) of the adapter on base module ``module``."""
    peft_module = model.get_submodule("base_model.model." + module)
    scaling = peft_module.scaling
    return float(next(iter(scaling.values())) if isinstance(scaling, dict) else scaling)


def merged_state_dict(model: Any, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base model's state dict (its Hugging Face names) with every adapter merged in:
    ``W = W0 + scaling * B @ A``. ``state_dict``: the peft model's (default: its own)."""
    import torch

    state = model.state_dict() if state_dict is None else state_dict
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        found = adapter_name(name)
        if found is not None:
            adapters.setdefault(found[0], {})[found[1]] = tensor
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[plain] = tensor
    for module, pair in adapters.items():
        weight = out[f"{module}.weight"]
        delta = scaling_of(model, module) * (pair["lora_B"].float() @ pair["lora_A"].float())
        out[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return out


def published_adapters(model: Any) -> list[tuple[str, Any, float]]:
    """``(name an engine knows, parameter, factor)`` of every adapter parameter of a peft
    ``model``: ``MODULE.lora_A.weight`` (factor 1) and ``MODULE.lora_B.weight`` (factor
    ``alpha / r``), each module's A right before its B."""
    out = []
    for name, p in model.named_parameters():
        found = adapter_name(name)
        if found is not None:
            module, which = found
            scale = scaling_of(model, module) if which == "lora_B" else 1.0
            out.append((f"{module}.{which}.weight", p, scale))
    return out
