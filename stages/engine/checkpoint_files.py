"""The named tensors of a checkpoint folder, found as SGLang 0.5.23's ``DefaultModelLoader`` finds
them for ``/update_weights_from_disk``.

``weight_files(path, load_format)`` picks the files (SGLang's ``_prepare_weights``): the top-level
files of the first pattern that matches any, for ``load_format`` ``auto`` (or none)
``*.safetensors``, else ``*.bin``, else ``*.pt``; ``safetensors`` only ``*.safetensors``; ``pt``
only ``*.pt`` (so, as there, PyTorch's ``pytorch_model*.bin`` files are read with ``auto``).
With a ``model.safetensors.index.json``, safetensors files it does not list are left out and a
shard it lists that is missing is an error; ``training_args.bin``, ``optimizer.bin|pt``,
``scheduler.pt`` and ``scaler.pt`` are never weights. ``path`` is a folder, or a Hub repo id
(``stages.hub``: downloaded unless ``HF_HUB_OFFLINE`` is set).

``read_weights(files, names)`` reads the tensors whose names are among ``names`` (the model's
``state_dict`` names, which are a Hugging Face checkpoint's) and lists the others, which SGLang's
model loaders skip too; ``.bin`` and ``.pt`` files go through ``torch.load(weights_only=True)``,
so no code runs from a pickle. The whole checkpoint is then in host memory at once.

Errors are ``CheckpointError``, naming the folder or file. Not here: checking shapes against
the model and writing the tensors (``model_weights``), when (the scheduler), the HTTP route
(``server``). SGLang's other load formats (``gguf``, ``npcache``, ``dummy``, ...) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Container, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from stages.hub import HubError, resolve_model

__all__ = ["LOAD_FORMATS", "CheckpointError", "read_weights", "weight_files"]

# load_format -> the patterns tried in turn (SGLang adds *.pt as the fallback of auto)
_PATTERNS = {
    "auto": ("*.safetensors", "*.bin", "*.pt"),
    "safetensors": ("*.safetensors",),
    "pt": ("*.pt",),
}
LOAD_FORMATS = tuple(_PATTERNS)
_INDEX = "model.safetensors.index.json"
# weight_utils.filter_files_not_needed_for_inference
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: no such folder, no weight files, a broken file."""


def weight_files(path: str, load_format: str | None = None) -> list[Path]:
    """The weight files of checkpoint ``path`` for ``load_format`` (case-insensitive, as
    SGLang's ``LoadConfig``), sorted."""
    fmt = "auto" if load_format is None else load_format.lower()
    patterns = _PATTERNS.get(fmt)
    if patterns is None:
        raise CheckpointError(
            f"load_format {load_format!r} is not supported by the built-in engine "
            f"(use one of {', '.join(LOAD_FORMATS)})"
        )
    folder = _folder(path)
    files: list[Path] = []
    for pattern in patterns:
        files = sorted(p for p in folder.glob(pattern) if p.is_file())
        if files:
            break
    if files and files[0].suffix == ".safetensors":
        files = _indexed(folder, files)
    else:
        files = [f for f in files if not f.name.endswith(_NOT_WEIGHTS)]
    if not files:  # SGLang's words, then where it looked
        raise CheckpointError(
            f"Cannot find any model weights with `{path}` (load_format {fmt} reads "
            f"{' else '.join(patterns)} in {folder})"
        )
    return files


def read_weights(
    files: Sequence[Path], names: Container[str]
) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """The tensors of ``files`` named in ``names`` (on the CPU, in the file's dtype), and the
    names of those left out; raises ``CheckpointError`` when none is taken."""
    taken: list[tuple[str, torch.Tensor]] = []
    skipped: list[str] = []
    for file in files:
        try:
            found = _read(file, names)
        except CheckpointError:
            raise
        except Exception as exc:  # truncated or corrupt, or a pickle weights_only refuses
            raise CheckpointError(f"{file} cannot be read: {exc}") from exc
        for name, tensor in found:
            if tensor is None:
                skipped.append(name)
            else:
                taken.append((name, tensor))
    if not taken:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        raise CheckpointError(
            f"none of the {len(skipped)} tensors in {files[0].parent} names a parameter of "
            f"this model ({shown}): is it a checkpoint of this architecture?"
        )
    return taken, skipped


def _read(file: Path, names: Container[str]) -> list[tuple[str, torch.Tensor | None]]:
    """Each tensor of ``file`` by name; None for those not in ``names``."""
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt") as opened:  # those left out are never read
            return [(n, opened.get_tensor(n) if n in names else None) for n in opened.keys()]
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a dict of named tensors")
    return [(n, t if n in names else None) for n, t in state.items()]


def _folder(path: str) -> Path:
    local = Path(path).expanduser()
    if local.is_dir():  # a folder of weights alone will do: no config.json asked for
        return local
    try:
        return resolve_model(path, what="model_path")
    except HubError as exc:  # no such folder, and not a repo id; or the Hub said no
        raise CheckpointError(str(exc)) from None


def _indexed(folder: Path, files: list[Path]) -> list[Path]:
    """``files`` less those the safetensors index does not list (SGLang's
    ``filter_duplicate_safetensors_files``)."""
    index = folder / _INDEX
    if not index.is_file():
        return files
    try:
        listed = {folder / name for name in json.loads(index.read_text())["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index: {exc!r}") from None
    missing = sorted(p.name for p in listed if not p.is_file())
    if missing:
        raise CheckpointError(
            f"{_INDEX} references {len(missing)} shard file(s) missing from {folder} "
            f"(incomplete download?): {missing}"
        )
    return [f for f in files if f in listed]
