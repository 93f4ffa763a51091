"""Message <-> ZeroMQ frames, with arrays and tensors as zero-copy frames.

Frame 0 is a msgpack map ``{"kind": str, "version": int, "data": {...}}``. Every numpy array
and torch tensor found anywhere in ``data`` (inside lists and maps too) is replaced in that map
by a msgpack ``ExtType`` reference ``[frame_index, dtype_name, shape]`` (ext code 1 for numpy,
2 for torch) and its bytes travel as frame ``frame_index``.

Small numpy arrays (under ``PACK_BELOW`` bytes each) share one frame instead, the last one: the
*pack*. Their references are ``[dtype_name, shape]`` (ext code 3) and they lie in the pack in
reference order, each at the next multiple of 8 bytes, with nothing after the last; so the
layout follows from the header alone, and a pack with a byte too many or too few is refused.
ZeroMQ copies frames that small anyway (pyzmq's copy threshold is 64 KiB) and every frame costs
a send and a receive call each way: a rollout group's dozen token arrays travel as two frames
instead of fourteen, at a quarter of the per-message cost.

Zero-copy, both ways:

- ``encode`` hands out memoryviews over the arrays' own memory. The one copy it makes is for
  inputs that are not already C-contiguous CPU memory in native byte order (non-contiguous
  views, CUDA tensors, big-endian arrays): those are copied once into contiguous CPU memory.
  The caller must not modify an array in place after sending it until it is sent (ZeroMQ reads
  the memory later, from its I/O thread).
- ``decode`` builds arrays over the received frame buffers (``np.frombuffer`` /
  ``torch.frombuffer``); a frame whose address is not aligned to the element size (small frames
  packed inside ZeroMQ's receive buffer) is copied. Decoded arrays share the frame's memory:
  treat them as read-only. numpy marks them so when the buffer is immutable; torch cannot, so do
  not write a decoded tensor in place (``t.add_(1)``); make a copy (``t.clone()``) first.

A *batch* carries several messages of one kind in one set of frames (``encode_batch``: the
header's ``data`` is replaced by ``batch``, a list of data maps; their arrays share the frames and
the pack): what a producer sends one consumer at once costs one header, one pack and one send
instead of one each. ``decode_batch`` gives the messages back one by one, each checked against
its schema on its own (a bad one does not take the others with it).

``decode`` trusts nothing in the header: sizes are checked against the frames actually received
(never used to allocate), every frame must be referenced exactly once, and with ``schemas`` the
kind, version and fields are checked too. Every problem is a :class:`DecodeError` with a reason.

torch is optional: it is imported only when a tensor is encoded or a torch frame is decoded.
This module does no I/O.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from transport.errors import DecodeError
from transport.message import Message, Schema

__all__ = ["decode", "decode_batch", "encode", "encode_batch"]

# What encode returns: the header as bytes, array payloads as memoryviews over their memory.
Frame = bytes | memoryview

_EXT_NUMPY = 1
_EXT_TORCH = 2
_EXT_PACKED = 3  # a numpy array in the pack (the last frame)
PACK_BELOW = 1 << 16  # numpy arrays smaller than this (bytes) go into the pack
_PACK_MAX = 1 << 20  # ... while it stays this small; later ones get frames of their own
_PACK_ALIGN = 8
_MAX_NDIM = 32

# dtype name -> item size in bytes. Names are what numpy's ``dtype.name`` and torch's
# ``str(dtype)`` (without "torch.") give, so both sides agree without importing torch.
_NUMPY_ITEMSIZE = {
    name: np.dtype(name).itemsize
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
# dtype -> its name for the native-order dtypes above (``dtype.name`` costs microseconds in
# numpy 2, and a message carries a dozen arrays); other dtypes fall back to ``dtype.name``
_NUMPY_NAMES = {np.dtype(name): name for name in _NUMPY_ITEMSIZE}
_TORCH_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
}


def _loaded_torch() -> Any:
    return sys.modules.get("torch")  # a tensor can only exist if torch is already imported


# ---------------------------------------------------------------------------------------------
# encode


def encode(msg: Message) -> list[Frame]:
    """Frames for ``msg``: the msgpack header, then one frame per large array, in reference
    order, then the pack of the small ones (when there are any).

    Raises TypeError for values that cannot travel (objects, unsupported dtypes, sparse
    tensors) and names the offending type.
    """
    return _encode(msg.kind, {"kind": msg.kind, "version": msg.version, "data": msg.data})


def encode_batch(kind: str, version: int, batch: Sequence[Mapping[str, Any]]) -> list[Frame]:
    """Frames for several messages of one ``kind`` (their ``data`` maps, in order): one header,
    their arrays' frames and one pack. ``decode_batch`` reads it."""
    return _encode(kind, {"kind": kind, "version": version, "batch": list(batch)})


def _encode(kind: str, header: dict[str, Any]) -> list[Frame]:
    frames: list[Frame] = [b""]
    pack = _Pack()
    torch = _loaded_torch()

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _encode_numpy(obj, frames, pack)
        if torch is not None and isinstance(obj, torch.Tensor):
            return _encode_torch(obj, frames)
        if isinstance(obj, np.generic):
            return obj.item()  # numpy scalars travel as plain msgpack numbers / bools
        raise TypeError(
            f"message {kind!r}: cannot encode a {type(obj).__module__}.{type(obj).__name__}; "
            "use None, bool, int, float, str, bytes, lists, str-keyed maps, numpy arrays or "
            "torch tensors"
        )

    frames[0] = msgpack.packb(header, default=default, use_bin_type=True)
    if pack.parts:
        frames.append(b"".join(pack.parts))
    return frames


_PADS = [b"\0" * n for n in range(_PACK_ALIGN)]


class _Pack:
    """The small arrays of a message being encoded: their bytes, padded to ``_PACK_ALIGN``."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def fits(self, nbytes: int) -> bool:
        return nbytes < PACK_BELOW and self.size + nbytes <= _PACK_MAX

    def add(self, data: bytes) -> None:
        nbytes = len(data)
        pad = -self.size % _PACK_ALIGN if nbytes else 0
        if pad:
            self.parts.append(_PADS[pad])
        self.parts.append(data)
        self.size += pad + nbytes


_PACKED_REFS: dict[tuple[str, tuple[int, ...]], msgpack.ExtType] = {}


def _packed_ref(name: str, shape: tuple[int, ...]) -> msgpack.ExtType:
    """The reference of a packed array (the same few shapes recur: made once each)."""
    ref = _PACKED_REFS.get((name, shape))
    if ref is None:
        ref = msgpack.ExtType(_EXT_PACKED, msgpack.packb([name, list(shape)]))
        if len(_PACKED_REFS) < 65536:
            _PACKED_REFS[(name, shape)] = ref
    return ref


def _ext(code: int, index: int, dtype: str, shape: Sequence[int]) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([index, dtype, list(shape)]))


# (dtype, shape) of a small array packed before -> its reference and size: the same recur
_SMALL: dict[tuple[np.dtype, tuple[int, ...]], tuple[msgpack.ExtType, int]] = {}


def _encode_numpy(a: np.ndarray, frames: list[Frame], pack: _Pack) -> msgpack.ExtType:
    small = _SMALL.get((a.dtype, a.shape))
    if small is not None and a.flags.c_contiguous and pack.size + small[1] <= _PACK_MAX:
        pack.add(a.tobytes())
        return small[0]
    name = _NUMPY_NAMES.get(a.dtype) or a.dtype.name
    if name not in _NUMPY_ITEMSIZE:
        raise TypeError(
            f"cannot encode a numpy array of dtype {a.dtype}; supported: {sorted(_NUMPY_ITEMSIZE)}"
        )
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # the one copy: wire order is native
    elif not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)  # the one copy: frames are contiguous memory
    shape = a.shape  # before reshaping: 0-d arrays keep shape ()
    if pack.fits(a.nbytes):  # small: its bytes are copied into the pack anyway
        pack.add(a.tobytes())
        ref = _packed_ref(name, shape)
        if len(_SMALL) < 65536:  # a native dtype here: as the next such array's is
            _SMALL[(a.dtype, shape)] = (ref, a.nbytes)
        return ref
    data = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
    frames.append(data if a.size else b"")
    return _ext(_EXT_NUMPY, len(frames) - 1, name, shape)


def _encode_torch(t: Any, frames: list[Frame]) -> msgpack.ExtType:
    torch = _loaded_torch()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_ITEMSIZE:
        raise TypeError(
            f"cannot encode a torch tensor of dtype {t.dtype}; supported: {sorted(_TORCH_ITEMSIZE)}"
        )
    if t.layout != torch.strided:
        raise TypeError(f"cannot encode a {t.layout} tensor; convert it with .to_dense()")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # the one copy: frames are host memory
    elif not t.is_contiguous():
        t = t.contiguous()  # the one copy: frames are contiguous memory
    t = t.resolve_conj().resolve_neg()  # no-ops unless a lazy conj/neg view slipped through
    shape = tuple(t.shape)
    if t.numel():
        # A flat uint8 view of the tensor's own memory works for every dtype, including those
        # numpy has no type for (bfloat16, float8).
        frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    else:
        frames.append(b"")
    return _ext(_EXT_TORCH, len(frames) - 1, name, shape)


# ---------------------------------------------------------------------------------------------
# decode


def decode(frames: Sequence[Any], schemas: Mapping[str, Schema] | None = None) -> Message:
    """The message carried by ``frames`` (bytes, memoryviews or ``zmq.Frame`` objects).

    With ``schemas`` (kind -> Schema), also checks that the kind is known, the version is the
    schema's and the data has the schema's fields. Raises DecodeError with a reason tag.
    """
    kind, version, header = _decode(frames, schemas, "data")
    data = header.get("data")
    if not isinstance(data, dict):
        raise DecodeError(
            "bad_header", f"kind {kind!r}: 'data' is a {type(data).__name__}, not a map"
        )
    if schemas is not None:
        _check_fields(schemas[kind], data)
    return Message(kind=kind, data=data, version=version)


def decode_batch(
    frames: Sequence[Any], schemas: Mapping[str, Schema] | None = None
) -> list[Message | DecodeError]:
    """The messages of a batch (``encode_batch``), in order. What is wrong with the frames or
    the header raises DecodeError (the whole batch is unreadable); a message whose data does not
    fit its schema is a DecodeError in its place (the others are fine)."""
    kind, version, header = _decode(frames, schemas, "batch")
    batch = header.get("batch")
    if not isinstance(batch, list) or not batch:
        raise DecodeError("bad_header", f"kind {kind!r}: 'batch' is not a non-empty list")
    out: list[Message | DecodeError] = []
    for i, data in enumerate(batch):
        if not isinstance(data, dict):
            out.append(DecodeError("bad_header", f"kind {kind!r}: batch item {i} is not a map"))
            continue
        try:
            if schemas is not None:
                _check_fields(schemas[kind], data)
        except DecodeError as e:
            out.append(e)
            continue
        out.append(Message(kind=kind, data=data, version=version))
    return out


def _check_fields(schema: Schema, data: Mapping[str, Any]) -> None:
    problems = schema.check(data)
    if problems:
        raise DecodeError("invalid_fields", f"kind {schema.kind!r}: " + "; ".join(problems))


def _decode(
    frames: Sequence[Any], schemas: Mapping[str, Schema] | None, body: str
) -> tuple[str, int, dict]:
    """The header of ``frames`` with its arrays in place: kind, version and the map. ``body``
    ("data" or "batch") is the form expected: the other one is refused."""
    if not frames:
        raise DecodeError("frame_count", "no frames")
    buffers = [memoryview(f) for f in frames]
    used = [False] * len(buffers)
    pack = _Unpack(buffers, used)

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == _EXT_PACKED:
            return pack.take(*_packed_of(payload))
        if code not in (_EXT_NUMPY, _EXT_TORCH):
            raise DecodeError("bad_header", f"unknown ext type code {code}")
        index, dtype, shape = _parse_ref(payload)
        if not 1 <= index < len(buffers):
            raise DecodeError(
                "frame_count",
                f"array reference to frame {index}, but frames are 1..{len(buffers) - 1}",
            )
        if used[index] or pack.index == index:
            raise DecodeError("frame_count", f"frame {index} is referenced twice")
        used[index] = True
        if code == _EXT_NUMPY:
            return _decode_numpy(buffers[index], dtype, shape)
        return _decode_torch(buffers[index], dtype, shape)

    try:
        header = msgpack.unpackb(buffers[0], raw=False, ext_hook=ext_hook)
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, UnpackValueError, ...)
        raise DecodeError("not_msgpack", f"frame 0: {type(e).__name__}: {e}") from None

    if not isinstance(header, dict):
        raise DecodeError("bad_header", f"frame 0 is a {type(header).__name__}, not a map")
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind:
        raise DecodeError("missing_kind", f"'kind' is {kind!r}, expected a non-empty string")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DecodeError("bad_header", f"kind {kind!r}: 'version' is {version!r}, not an int")
    other = "batch" if body == "data" else "data"
    if other in header:
        raise DecodeError("bad_header", f"kind {kind!r}: a {other!r} where a {body!r} belongs")
    pack.finish(kind)
    unused = [i for i in range(1, len(buffers)) if not used[i]]
    if unused:
        raise DecodeError("frame_count", f"kind {kind!r}: frames {unused} are not referenced")
    if schemas is not None:
        schema = schemas.get(kind)
        if schema is None:
            raise DecodeError("unknown_kind", f"kind {kind!r} is not one of {sorted(schemas)}")
        if version != schema.version:
            raise DecodeError(
                "bad_version", f"kind {kind!r}: version {version}, expected {schema.version}"
            )
    return kind, version, header


class _Unpack:
    """The pack of a message being decoded (its last frame): hands out its arrays in order,
    each at the next multiple of ``_PACK_ALIGN``, and checks that they cover it exactly."""

    def __init__(self, buffers: list[memoryview], used: list[bool]) -> None:
        self.buffers, self.used = buffers, used
        self.index = 0  # the pack's frame, once an array was taken from it
        self.data: np.ndarray | None = None
        self.cursor = 0

    def take(self, dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> np.ndarray:
        """The next array of the pack (``_packed_of`` gives its dtype, shape and size)."""
        data = self.data
        if data is None:
            self.index = len(self.buffers) - 1
            if self.index < 1 or self.used[self.index]:
                raise DecodeError("frame_count", "a packed array, but no frame is the pack")
            self.used[self.index] = True
            data = np.frombuffer(self.buffers[self.index], dtype=np.uint8)
            if data.ctypes.data % _PACK_ALIGN:
                data = data.copy()  # landed unaligned in ZeroMQ's buffer: one copy for all
            self.data = data
        start = self.cursor + (-self.cursor % _PACK_ALIGN if nbytes else 0)
        end = start + nbytes
        if end > data.nbytes:
            raise DecodeError(
                "frame_size",
                f"packed {dtype.name}{list(shape)} needs bytes {start}..{end}, "
                f"the pack has {data.nbytes}",
            )
        self.cursor = end
        if not nbytes:
            return np.empty(shape, dtype=dtype)
        array = data[start:end].view(dtype)
        return array if len(shape) == 1 else array.reshape(shape)

    def finish(self, kind: str) -> None:
        if self.data is not None and self.cursor != self.data.nbytes:
            raise DecodeError(
                "frame_size",
                f"kind {kind!r}: the packed arrays end at byte {self.cursor}, "
                f"the pack has {self.data.nbytes}",
            )


# a packed array's reference (its bytes) -> (dtype, shape, bytes): the same few recur
_PACKED_OF: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}


def _packed_of(payload: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """A packed array's dtype, shape and size in bytes, from its reference (checked once per
    distinct reference, as ``_packed_ref`` makes each once)."""
    known = _PACKED_OF.get(payload)
    if known is not None:
        return known
    dtype, shape = _parse_ref(payload, packed=True)
    shape = tuple(shape)
    known = (np.dtype(dtype), shape, _itemsize(dtype) * math.prod(shape))  # Python ints
    if len(_PACKED_OF) < 65536:
        _PACKED_OF[bytes(payload)] = known
    return known


def _parse_ref(payload: bytes, *, packed: bool = False) -> Any:
    """``(index, dtype, shape)`` from an array reference; ``(dtype, shape)`` when ``packed``."""
    try:
        ref = msgpack.unpackb(payload, raw=False)
    except Exception as e:
        raise DecodeError("bad_header", f"array reference is not msgpack: {e}") from None
    if packed:
        if not (isinstance(ref, list) and len(ref) == 2):
            raise DecodeError("bad_header", f"packed array reference {ref!r} is not [dtype, shape]")
        index, (dtype, shape) = 0, ref
    elif not (isinstance(ref, list) and len(ref) == 3):
        raise DecodeError("bad_header", f"array reference {ref!r} is not [index, dtype, shape]")
    else:
        index, dtype, shape = ref
    if not isinstance(index, int) or isinstance(index, bool):
        raise DecodeError("bad_header", f"array reference index {index!r} is not an int")
    if not isinstance(dtype, str):
        raise DecodeError("bad_dtype", f"array dtype {dtype!r} is not a string")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise DecodeError(
            "bad_header", f"array shape {shape!r} is not a list of <= {_MAX_NDIM} non-negative ints"
        )
    return (dtype, tuple(shape)) if packed else (index, dtype, tuple(shape))


def _check_size(buf: memoryview, dtype: str, itemsize: int, shape: tuple[int, ...]) -> None:
    expected = itemsize * math.prod(shape)  # Python ints: no overflow, nothing allocated
    if buf.nbytes != expected:
        raise DecodeError(
            "frame_size",
            f"{dtype}{list(shape)} needs {expected} bytes, the frame has {buf.nbytes}",
        )


def _aligned(buf: memoryview, itemsize: int) -> bool:
    address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    return address % itemsize == 0


def _itemsize(dtype: str) -> int:
    """The size of one item of a numpy ``dtype`` the codec carries (DecodeError otherwise)."""
    itemsize = _NUMPY_ITEMSIZE.get(dtype)
    if itemsize is None:
        raise DecodeError(
            "bad_dtype", f"numpy dtype {dtype!r} is not one of {sorted(_NUMPY_ITEMSIZE)}"
        )
    return itemsize


def _decode_numpy(buf: memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    itemsize = _itemsize(dtype)
    _check_size(buf, dtype, itemsize, shape)
    try:
        if buf.nbytes == 0:
            return np.empty(shape, dtype=dtype)
        array = np.frombuffer(buf, dtype=dtype)
        if not array.flags.aligned:
            array = array.copy()  # only small frames land unaligned; a copy is cheap there
        return array.reshape(shape)
    except ValueError as e:
        raise DecodeError("bad_header", f"cannot build {dtype}{list(shape)}: {e}") from None


def _torch_dtypes(torch: Any) -> dict[str, Any]:
    return {
        "bool": torch.bool,
        "int8": torch.int8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "uint8": torch.uint8,
        "float16": torch.float16,
        "float32": torch.float32,
        "float64": torch.float64,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "complex64": torch.complex64,
        "complex128": torch.complex128,
    }


def _decode_torch(buf: memoryview, dtype: str, shape: tuple[int, ...]) -> Any:
    itemsize = _TORCH_ITEMSIZE.get(dtype)
    if itemsize is None:
        raise DecodeError(
            "bad_dtype", f"torch dtype {dtype!r} is not one of {sorted(_TORCH_ITEMSIZE)}"
        )
    _check_size(buf, dtype, itemsize, shape)
    import torch  # lazily: a pipeline without tensors never pays for importing torch

    torch_dtype = _torch_dtypes(torch)[dtype]
    try:
        if buf.nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        if _aligned(buf, itemsize):
            with warnings.catch_warnings():
                # Frames are often immutable; the module docstring says decoded tensors are
                # read-only by contract, so torch's generic warning about it is noise here.
                warnings.filterwarnings(
                    "ignore", message="The given buffer is not writable", category=UserWarning
                )
                raw = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            # only small frames land unaligned; numpy's copy is aligned and cheap there
            raw = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8).copy())
        # bytes -> dtype via a uint8 view works for dtypes numpy lacks (bfloat16, float8)
        return raw.view(torch_dtype).reshape(shape)
    except (RuntimeError, ValueError) as e:
        raise DecodeError("bad_header", f"cannot build {dtype}{list(shape)}: {e}") from None
