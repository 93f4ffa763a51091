"""Weight buckets in SGLang's ``flattened_bucket`` layout, and dtype names as SGLang spells them.

A bucket is one flat ``uint8`` tensor holding the raw bytes of several named tensors back to back,
in order, with no padding or alignment (SGLang's ``FlattenedTensorBucket`` concatenates
``tensor.flatten().view(torch.uint8)``), plus the names, dtype names and shapes needed to cut it
apart again. ``pack_buckets`` groups tensors up to a byte budget and copies each tensor once into
its bucket; ``unpack_bucket`` is its exact inverse and returns views into the flat tensor (a copy
only for a tensor whose byte offset does not fit its dtype's alignment).

This module does no communication and does not cast: a tensor travels in its own dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Bucket",
    "StagingBuffer",
    "bucket_nbytes",
    "dtype_from_name",
    "dtype_name",
    "group_by_size",
    "pack_buckets",
    "unpack_bucket",
]

# SGLang resolves a dtype name with ``getattr(torch, name)`` and trainers produce it with
# ``str(dtype).replace("torch.", "")``: the name is the torch attribute name.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype SGLang means by ``name`` (``"bfloat16"`` -> ``torch.bfloat16``)."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown weight dtype {name!r}: expected one of {sorted(_DTYPES)} "
            "(torch attribute names, as SGLang spells them)"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's name for ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be published: supported are {sorted(_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class Bucket:
    """Named tensors packed back to back into one flat ``uint8`` tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flat: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def group_by_size(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a bigger tensor is a group of its own).

    Order is kept and no tensor is split. Groups are yielded lazily, so only one group's tensors
    are referenced at a time.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


class StagingBuffer:
    """Flat buffers reused bucket after bucket (``slots`` of them, in turn), grown when needed.

    Reuse spares a fresh allocation per bucket (and, on CPU, the page faults of touching it),
    which costs as much as the copy itself. With two slots a sender can pack the next bucket
    while the previous one is still on the wire.
    """

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"a staging buffer needs at least one slot, got {slots}")
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._next = 0

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of the next slot (what ``take`` gave ``slots`` calls ago is overwritten)."""
        i, self._next = self._next, (self._next + 1) % len(self._bufs)
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._bufs[i] = buf = None  # release the old one before allocating its successor
            self._bufs[i] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _pack(group: Sequence[tuple[str, torch.Tensor]], staging: StagingBuffer | None) -> Bucket:
    total = sum(t.numel() * t.element_size() for _, t in group)
    device = group[0][1].device
    if staging is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        flat = staging.take(total, device)
    offset = 0
    for _, tensor in group:
        if tensor.numel() == 0:  # no bytes (and any strides: view(uint8) would refuse some)
            continue
        # reshape(-1) and view(uint8) are views for a contiguous tensor: copy_ is the one copy.
        src = tensor.detach().reshape(-1).view(torch.uint8)
        flat[offset : offset + src.numel()].copy_(src)
        offset += src.numel()
    return Bucket(
        names=[name for name, _ in group],
        dtypes=[dtype_name(t.dtype) for _, t in group],
        shapes=[list(t.shape) for _, t in group],
        flat=flat,
    )


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    staging: StagingBuffer | None = None,
) -> Iterator[Bucket]:
    """Pack tensors, in order, into flat buckets of at most ``bucket_bytes`` each.

    A tensor bigger than ``bucket_bytes`` gets a bucket of its own; no tensor is split. The flat
    tensor lives on the device of the bucket's first tensor. Each bucket is fully copied before it
    is yielded, so the caller may free the source tensors as soon as it receives the bucket.
    With ``staging``, every bucket's flat tensor is a view of that one buffer: a bucket is only
    valid until the next one is drawn.
    """
    for group in group_by_size(named_tensors, bucket_bytes):
        yield _pack(group, staging)


def unpack_bucket(
    flat: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> list[tuple[str, torch.Tensor]]:
    """Cut a flat ``uint8`` bucket back into named tensors (exact inverse of ``pack_buckets``)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"bucket metadata lengths differ: {len(names)} names, {len(dtypes)} dtypes, "
            f"{len(shapes)} shapes"
        )
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a bucket is a 1-d uint8 tensor, got {flat.dtype} of shape {flat.shape}")
    torch_dtypes = [dtype_from_name(d) for d in dtypes]
    sizes = [_nbytes(dtype, shape) for dtype, shape in zip(torch_dtypes, shapes, strict=True)]
    if sum(sizes) != flat.numel():
        raise ValueError(
            f"bucket holds {flat.numel()} bytes but its {len(names)} tensors need {sum(sizes)}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, dtype, shape, size in zip(names, torch_dtypes, shapes, sizes, strict=True):
        chunk = flat[offset : offset + size]
        if (flat.storage_offset() + offset) % dtype.itemsize:
            # No padding on the wire (SGLang's layout), so e.g. an int64 after an odd number of
            # bf16 values is misaligned: copy those bytes to a fresh, aligned buffer.
            chunk = chunk.clone()
        out.append((name, chunk.view(dtype).reshape(list(shape))))
        offset += size
    return out


def bucket_nbytes(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> int:
    """Bytes of the flat bucket holding tensors of these dtype names and shapes."""
    return sum(_nbytes(dtype_from_name(d), s) for d, s in zip(dtypes, shapes, strict=True))


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for dim in shape:
        n *= int(dim)
    return n
