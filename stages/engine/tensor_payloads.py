"""SGLang's serialized tensors (``/update_weights_from_tensor``), read without running what a
payload names beyond torch's constructors.

A payload is what SGLang's ``MultiprocessingSerializer.serialize`` makes (SGLang 0.5.23,
``srt/utils/common.py``): torch's ``ForkingPickler`` over the tensors, so that only a handle to
each tensor's memory travels, base64 in JSON. On a GPU the handle is CUDA IPC's (the device
named by its UUID when SGLang's ``monkey_patch_torch_reductions`` made it); on CPU it is a
shared-memory segment. A CPU sender sets ``torch.multiprocessing.set_sharing_strategy(
"file_system")``: torch's default passes a file descriptor, which only a process of the
sender's own ``multiprocessing`` tree may fetch.

Layouts (``load_format``, ``weight_updater.update_weights_from_tensor``): null or ``direct``,
a list of ``(name, tensor)`` pairs, a tensor possibly a ``LocalSerializedTensor`` (a payload
per tensor-parallel rank: verl's); ``flattened_bucket``, ``{"flattened_tensor", "metadata"}``:
one byte tensor and each tensor's place in it (``FlattenedTensorBucket``: slime's). The list
``serialized_named_tensors`` has one payload per tensor-parallel rank; this engine is one
rank and reads the first, as SGLang's rank 0 does.

Unpickling allows only the globals SGLang's ``SafeUnpickler`` allows that rebuild data:
containers, torch's dtypes, sizes, storages and tensor rebuilders, and SGLang's three payload
classes (read here as look-alikes: SGLang need not be installed). Anything else is refused
with the global it named.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

__all__ = ["PayloadError", "named_tensors", "payload_bytes", "tensor_dict"]

LOAD_FORMATS = (None, "direct", "flattened_bucket")


class PayloadError(ValueError):
    """A payload that cannot be read: what is wrong, in words for the HTTP answer."""


@dataclass
class LocalSerializedTensor:
    """SGLang's ``LocalSerializedTensor``: one payload of a tensor per tensor-parallel rank."""

    values: list[bytes]


@dataclass
class FlattenedTensorMetadata:
    """SGLang's ``FlattenedTensorMetadata``: a tensor's bytes ``start_idx..end_idx`` of a
    bucket."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """SGLang's ``FlattenedTensorBucket`` as a payload may hold one (its attributes only)."""

    flattened_tensor: torch.Tensor
    metadata: list[FlattenedTensorMetadata]


def _rebuild_cuda_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's ``_rebuild_cuda_tensor_modified``: torch's CUDA rebuild, with the device
    given by its UUID (argument 6) found among this machine's."""
    device = args[6]
    if isinstance(device, str):
        found = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not found:
            raise PayloadError(f"a tensor on CUDA device {device}, which this machine lacks")
        args = (*args[:6], found[0], *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


_SGLANG = {  # SGLang's classes and functions a payload may name, and what stands for each here
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"): (
        LocalSerializedTensor
    ),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): FlattenedTensorBucket,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_by_uuid,
}
_REDUCTIONS = (  # torch.multiprocessing.reductions' rebuilders
    "rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
    "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
    "rebuild_typed_storage_child",
)  # fmt: skip
_TORCH_UTILS = (
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage",
)  # fmt: skip
_BUILTINS = (
    "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "set",
    "slice", "str", "tuple",
)  # fmt: skip
_ALLOWED = {
    **{("builtins", n): None for n in _BUILTINS},
    ("collections", "OrderedDict"): OrderedDict,
    ("copyreg", "__newobj__"): None,
    ("multiprocessing.resource_sharer", "DupFd"): None,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    **{("torch.multiprocessing.reductions", n): None for n in _REDUCTIONS},
    **{("torch._utils", n): None for n in _TORCH_UTILS},
    ("torch._tensor", "_rebuild_from_type_v2"): None,
}


class _Unpickler(pickle.Unpickler):
    """Only the globals above (and torch's dtypes and ``*Storage`` classes); SGLang's classes
    as their look-alikes here."""

    def find_class(self, module: str, name: str) -> Any:
        stand_in = _SGLANG.get((module, name))
        if stand_in is not None:
            return stand_in
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)] or super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        if module in ("torch", "torch.cuda") and name.endswith(("Tensor", "Storage")):
            found = super().find_class(module, name)  # torch.Tensor, torch.FloatStorage...
            if isinstance(found, type):
                return found
        raise PayloadError(f"a payload may not name {module}.{name}")


def payload_bytes(entry: Any, where: str) -> bytes:
    """One entry of ``serialized_named_tensors`` as pickle bytes: base64 text (what JSON
    carries), as SGLang's ``normalize_serialized_named_tensor_payload`` reads it."""
    if not isinstance(entry, str):
        raise PayloadError(f"{where}: expected a base64 string, got {type(entry).__name__}")
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"{where}: not base64 ({exc})") from None


def _load(data: bytes, where: str) -> Any:
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except PayloadError as exc:
        raise PayloadError(f"{where}: {exc}") from None
    except Exception as exc:  # a torn pickle, a handle this process cannot open, ...
        raise PayloadError(f"{where}: cannot be read ({_why(exc)})") from None


def _why(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if "AuthenticationError" in text or "digest" in text or "resource_sharer" in text:
        return (
            f"{text}; a CPU tensor shared by file descriptor opens only in the sender's own "
            "process tree: serialize after torch.multiprocessing.set_sharing_strategy"
            "('file_system')"
        )
    return text


def _tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):  # a payload per rank: this engine's is the first
        if not isinstance(value.values, list) or not value.values:
            raise PayloadError(f"{where}: a LocalSerializedTensor without values")
        first = value.values[0]  # bytes, or base64 text (MultiprocessingSerializer reads both)
        if not isinstance(first, str | bytes | bytearray):
            raise PayloadError(f"{where}: a LocalSerializedTensor value of {type(first).__name__}")
        data = payload_bytes(first, where) if isinstance(first, str) else bytes(first)
        value = _load(data, where)
    if not isinstance(value, torch.Tensor):
        raise PayloadError(f"{where}: expected a tensor, got {type(value).__name__}")
    return value


def named_tensors(data: bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one rank's payload (tensors in the sender's memory, on
    its device: the caller copies them into the model while the sender waits for the answer)."""
    obj = _load(data, "serialized_named_tensors[0]")
    where = "serialized_named_tensors[0]"
    if load_format == "flattened_bucket":
        return _unflatten(obj, where)
    if not isinstance(obj, (list, tuple)):
        raise PayloadError(f"{where}: expected a list of (name, tensor), got {type(obj).__name__}")
    out = []
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise PayloadError(f"{where}[{i}]: expected a (name, tensor) pair")
        out.append((pair[0], _tensor(pair[1], f"{where}[{i}] ({pair[0]})")))
    return out


def tensor_dict(data: bytes, load_format: str | None) -> dict[str, torch.Tensor]:
    """One rank's payload of ``/load_lora_adapter_from_tensors`` (``tp_worker``): the
    adapter's state dict by name, or a flattened bucket of it."""
    where = "serialized_named_tensors[0]"
    obj = _load(data, where)
    if load_format == "flattened_bucket":
        return dict(_unflatten(obj, where))
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise PayloadError(f"{where}: expected a dict of name -> tensor, got {type(obj).__name__}")
    return {name: _tensor(value, f"{where}[{name!r}]") for name, value in obj.items()}


def _unflatten(obj: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """``FlattenedTensorBucket.reconstruct_tensors``: each tensor a view of the bucket's
    bytes, checked against them first."""
    if isinstance(obj, FlattenedTensorBucket):
        obj = vars(obj)
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
        raise PayloadError(f"{where}: expected {{flattened_tensor, metadata}} (flattened_bucket)")
    flat = _tensor(obj["flattened_tensor"], f"{where}.flattened_tensor")
    if flat.dim() != 1:
        raise PayloadError(f"{where}.flattened_tensor: expected one dimension, got {flat.dim()}")
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    out = []
    for i, meta in enumerate(obj["metadata"]):
        at = f"{where}.metadata[{i}]"
        if not isinstance(meta, FlattenedTensorMetadata):
            raise PayloadError(f"{at}: expected a FlattenedTensorMetadata")
        size = torch.Size(meta.shape).numel() * meta.dtype.itemsize
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or (
            meta.end_idx - meta.start_idx != size
        ):
            raise PayloadError(
                f"{at} ({meta.name}): bytes {meta.start_idx}..{meta.end_idx} do not hold a "
                f"{list(meta.shape)} {meta.dtype} tensor in a bucket of {flat.numel()} bytes"
            )
        try:
            piece = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        except RuntimeError as exc:  # bytes not aligned to the dtype's size
            raise PayloadError(f"{at} ({meta.name}): {exc}") from None
        out.append((meta.name, piece))
    return out
