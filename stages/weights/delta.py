"""Delta weight updates: send only the values that changed since the version every engine holds.

``DeltaEncoder`` lives with the publisher. It keeps a copy of what the engines hold (every
tensor in the published dtype, on CPU) and turns each new weight set into, per tensor, the
smallest of these (nothing for a tensor that did not change):

- the whole tensor, ``NAME`` (``itemsize`` bytes a value);
- ``NAME.delta_idx`` (int32 positions in the flattened tensor, 4 bytes a changed value) and
  ``NAME.delta_val`` (their new values);
- ``NAME.delta_mask`` (a bit per value, uint8, least significant bit first) and
  ``NAME.delta_val``;
- for 2-byte dtypes (bfloat16, float16), ``NAME.delta_zmask`` (that bit mask, zlib-compressed),
  ``NAME.delta_zdiff`` (zlib-compressed int8: each changed value's bit pattern minus the old
  one's, read as int16, which is a few units for a value that moved by a few steps of its dtype;
  -128 where it does not fit) and ``NAME.delta_esc`` (the new values of those, in order). After
  an RL step most changed bfloat16 values moved by one step, and few values changed at all, so
  both parts compress well.

Values are compared bit for bit in the published dtype (a bfloat16 engine holds bfloat16: a
float32 master weight that moved less than half a bfloat16 step sends nothing). An engine applies
a delta only on top of the version it was computed against (``base_version``; ``decode`` here,
``stages.engine.model_weights`` there); the publisher sends a full update instead whenever it is
in doubt (``full=True``: the first, every ``full_every`` versions, after a failure or a change of
engines). A failure part-way leaves the copy part-updated: ``reset()`` then, and the next update
is full.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

__all__ = ["DeltaEncoder", "complete", "decode", "delta_base"]

_PARTS = ("idx", "mask", "val", "zmask", "zdiff", "esc")
# the part sets that make a whole delta, each with what it carries
_KINDS = ({"idx", "val"}, {"mask", "val"}, {"zmask", "zdiff", "esc"})
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ESCAPE = -128
_ZLIB_LEVEL = 1  # level 6 compressed a mask 6% better in 6x the time


def delta_base(name: str) -> tuple[str, str] | None:
    """``(tensor name, part)`` for a delta part's name (``NAME.delta_PART``), else None."""
    stem, dot, last = name.rpartition(".")
    if dot and last.startswith("delta_") and last[6:] in _PARTS:
        return stem, last[6:]
    return None


def complete(parts: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``parts`` (by part name) make a whole delta."""
    return any(kind <= set(parts) for kind in _KINDS)


def decode(
    parts: Mapping[str, torch.Tensor], target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(where, values)`` of a whole delta of ``target`` (its current values are the base):
    ``where`` int64 positions or a bool mask over the flattened tensor, ``values`` as published
    (on CPU). Raises ``ValueError`` naming the part that does not fit."""
    n = target.numel()
    if "zmask" in parts:
        # the published dtype is the escapes': an engine holding float32 holds exactly what it
        # was sent in it, so casting back gives the bit patterns the differences are against
        published = parts["esc"].dtype
        if published not in (torch.bfloat16, torch.float16):
            raise ValueError(f"delta_esc: {published}, want bfloat16 or float16")
        try:
            packed = np.frombuffer(zlib.decompress(_bytes(parts["zmask"])), np.uint8)
            diffs = np.frombuffer(zlib.decompress(_bytes(parts["zdiff"])), np.int8)
        except zlib.error as exc:
            raise ValueError(f"delta_zmask/delta_zdiff: not zlib data ({exc})") from exc
        if packed.size != -(-n // 8):
            raise ValueError(f"delta_zmask: {packed.size} bytes, want {-(-n // 8)} (a bit a value)")
        flags = np.unpackbits(packed, count=n, bitorder="little").astype(bool)
        if diffs.size != int(np.count_nonzero(flags)):
            raise ValueError(f"delta_zdiff: {diffs.size} values, the mask marks {flags.sum()}")
        held = target.detach().reshape(-1).to("cpu", published)
        old = held.view(torch.int16).numpy()[flags]
        bits = (old.astype(np.int32) + diffs).astype(np.int16)
        escaped = diffs == _ESCAPE
        esc = parts["esc"].detach().cpu().reshape(-1)
        if esc.numel() != int(np.count_nonzero(escaped)):
            raise ValueError(
                f"delta_esc: {esc.numel()} values, delta_zdiff escapes {escaped.sum()}"
            )
        bits[escaped] = esc.view(torch.int16).numpy()
        values = torch.from_numpy(bits).view(published)
        return torch.from_numpy(flags), values
    values = parts["val"].detach().cpu()
    if not values.is_floating_point() or values.dim() != 1:
        raise ValueError(f"delta_val: want 1-D floating-point values, got {values.dtype}")
    if "mask" in parts:
        mask = parts["mask"]
        if mask.dtype != torch.uint8 or mask.shape != (-(-n // 8),):
            raise ValueError(
                f"delta_mask: {list(mask.shape)} {mask.dtype}, want [{-(-n // 8)}] uint8"
            )
        flags = np.unpackbits(mask.cpu().numpy(), count=n, bitorder="little").astype(bool)
        if values.numel() != int(np.count_nonzero(flags)):
            raise ValueError(f"delta_val: {values.numel()} values, the mask marks {flags.sum()}")
        return torch.from_numpy(flags), values.to(target.dtype)
    positions = parts["idx"].detach().cpu()
    if positions.is_floating_point() or positions.dim() != 1:
        raise ValueError("delta_idx: want a 1-D integer tensor")
    if values.shape != positions.shape:
        raise ValueError(f"delta_val: {values.numel()} values for {positions.numel()} positions")
    if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < n):
        raise ValueError(f"delta_idx: positions outside 0..{n - 1}")
    return positions.long(), values.to(target.dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().to(torch.uint8).numpy().tobytes()


def _blob(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class DeltaEncoder:
    """What the engines hold, and the smallest update that brings them to a new weight set."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        """``dtype``: the published dtype (None: each tensor's own)."""
        self.dtype = dtype
        self.held: dict[str, torch.Tensor] = {}
        self.stats = {"values": 0, "changed": 0, "full_tensors": 0, "delta_tensors": 0}

    def reset(self) -> None:
        """Forget what the engines hold: the next update must be full."""
        self.held.clear()

    @property
    def ready(self) -> bool:
        """Whether a delta can be computed (a full update went out since the last reset)."""
        return bool(self.held)

    def encode(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors to send for ``named_tensors`` (lazily, in order; the copy is updated as
        each goes out). ``full``: every tensor whole."""
        for name, tensor in named_tensors:
            new = tensor.detach().to("cpu", self.dtype or tensor.dtype)
            old = self.held.get(name)
            self.stats["values"] += new.numel()
            if full or old is None or old.shape != new.shape or old.dtype != new.dtype:
                self.held[name] = new.clone()
                self.stats["full_tensors"] += 1
                self.stats["changed"] += new.numel()
                yield name, new
                continue
            parts = self._delta(new, old)
            old.copy_(new)
            if parts is None:
                self.stats["full_tensors"] += 1
                yield name, new
                continue
            for part, value in parts:
                yield f"{name}.delta_{part}", value

    def _delta(self, new: torch.Tensor, old: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The smallest delta from ``old`` to ``new`` ([] when equal), or None when the whole
        tensor is smaller."""
        as_int = _INT_OF_SIZE[new.element_size()]
        bits = new.reshape(-1).view(as_int).numpy()
        before = old.view(-1).view(as_int).numpy()
        moved = bits != before  # numpy: counting and selecting took 5x as long in torch
        count, size, n = int(np.count_nonzero(moved)), new.element_size(), new.numel()
        self.stats["changed"] += count
        if count == 0:
            return []
        options: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []
        if count * (4 + size) < n * size:
            changed = np.flatnonzero(moved)
            values = torch.from_numpy(bits[changed]).view(new.dtype)
            options.append(
                (
                    count * (4 + size),
                    [("idx", torch.from_numpy(changed.astype(np.int32))), ("val", values)],
                )
            )
        if size == 2 and count * 200 > n:  # rarer changes: positions are as small, and quick
            packed = np.packbits(moved, bitorder="little")
            diff = bits[moved].astype(np.int32) - before[moved].astype(np.int32)
            escaped = (diff < -127) | (diff > 127)
            diff[escaped] = _ESCAPE
            zmask = zlib.compress(packed.tobytes(), _ZLIB_LEVEL)
            zdiff = zlib.compress(diff.astype(np.int8).tobytes(), _ZLIB_LEVEL)
            esc = torch.from_numpy(bits[moved][escaped]).view(new.dtype)
            nbytes = len(zmask) + len(zdiff) + esc.numel() * size
            options.append(
                (nbytes, [("zmask", _blob(zmask)), ("zdiff", _blob(zdiff)), ("esc", esc)])
            )
        if size != 2 and count * 32 > n:  # a bit per value beats positions past 1 in 32
            packed = np.packbits(moved, bitorder="little")
            values = torch.from_numpy(bits[moved]).view(new.dtype)
            options.append(
                (packed.size + count * size, [("mask", torch.from_numpy(packed)), ("val", values)])
            )
        nbytes, parts = min(options, key=lambda o: o[0], default=(n * size, []))
        if nbytes >= n * size:
            return None
        self.stats["delta_tensors"] += 1
        return parts
