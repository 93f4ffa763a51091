"""Codec: round trips for every dtype and shape, zero-copy both ways, and every way a message
can be malformed."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
import zmq

from transport.codec import decode, encode
from transport.errors import DecodeError
from transport.message import Message, Schema

TORCH_DTYPES = [
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
]
NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]
SHAPES = [(), (0,), (3, 0), (5,), (2, 3, 4)]


def roundtrip(data: dict, kind: str = "k", version: int = 1) -> Message:
    return decode(encode(Message(kind=kind, data=data, version=version)))


def torch_sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    values = torch.arange(int(np.prod(shape)), dtype=torch.float64) * 1.5 - 3
    return values.reshape(shape).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch_sample(dtype, shape)
    out = roundtrip({"t": t}).data["t"]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_roundtrip(dtype: str, shape: tuple[int, ...]) -> None:
    a = (np.arange(int(np.prod(shape))) * 1.5 - 3).reshape(shape).astype(dtype)
    out = roundtrip({"a": a}).data["a"]
    assert isinstance(out, np.ndarray)
    assert out.dtype == a.dtype and out.shape == a.shape
    np.testing.assert_array_equal(out, a)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_roundtrip(dtype: torch.dtype) -> None:
    t = torch.linspace(-2, 2, 12).reshape(3, 4).to(dtype)
    out = roundtrip({"t": t}).data["t"]
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_nested_structures_and_plain_values() -> None:
    data = {
        "run": "r1",
        "n": 3,
        "x": 0.5,
        "ok": True,
        "none": None,
        "raw": b"\x00\x01",
        "np_scalar": np.int64(7),
        "groups": [
            {"ids": torch.tensor([1, 2, 3]), "logp": np.array([-0.5, -1.0], dtype=np.float32)},
            [torch.zeros(2, 2, dtype=torch.bfloat16), {"deep": [np.arange(3)]}],
        ],
    }
    msg = Message(kind="rollout", data=data, version=4)
    frames = encode(msg)
    assert len(frames) == 1 + 2 + 1  # header, one frame per tensor, the small arrays' pack
    out = decode(frames)
    assert (out.kind, out.version) == ("rollout", 4)
    d = out.data
    assert d["run"] == "r1" and d["n"] == 3 and d["ok"] is True and d["none"] is None
    assert d["raw"] == b"\x00\x01" and d["np_scalar"] == 7
    assert torch.equal(d["groups"][0]["ids"], torch.tensor([1, 2, 3]))
    np.testing.assert_array_equal(d["groups"][0]["logp"], [-0.5, -1.0])
    assert d["groups"][1][0].dtype == torch.bfloat16
    np.testing.assert_array_equal(d["groups"][1][1]["deep"][0], np.arange(3))


def test_header_layout() -> None:
    header = msgpack.unpackb(encode(Message("k", {"a": 1}, 2))[0])
    assert header == {"kind": "k", "version": 2, "data": {"a": 1}}


def test_noncontiguous_inputs_are_sent_correctly() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    a = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]
    big_endian = np.arange(4, dtype=">f4")
    out = roundtrip({"t": t, "a": a, "b": big_endian}).data
    assert torch.equal(out["t"], t)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], big_endian)


def test_tensor_requiring_grad_is_detached() -> None:
    t = torch.ones(3, requires_grad=True)
    assert torch.equal(roundtrip({"t": t}).data["t"], torch.ones(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_arrives_on_cpu() -> None:
    t = torch.arange(10, device="cuda", dtype=torch.bfloat16)
    out = roundtrip({"t": t}).data["t"]
    assert out.device.type == "cpu" and torch.equal(out, t.cpu())


def test_unsupported_values_fail_loudly() -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        encode(Message("k", {"x": object()}))
    with pytest.raises(TypeError, match="dtype"):
        encode(Message("k", {"x": np.array(["a"], dtype=object)}))
    with pytest.raises(TypeError, match="dense"):
        encode(Message("k", {"x": torch.eye(2).to_sparse()}))


def test_large_tensor_is_zero_copy_both_ways() -> None:
    t = torch.zeros(32 * 1024 * 1024, dtype=torch.bfloat16)  # 64 MB
    frames = encode(Message("weights", {"w": t}))
    frame = frames[1]
    assert isinstance(frame, memoryview) and frame.nbytes == 64 * 1024 * 1024
    # The frame is the tensor's own memory: same address, and a write shows through.
    assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == t.data_ptr()
    t[0] = 1.0
    assert bytes(frame[:2]) == t[:1].view(torch.uint8).numpy().tobytes() != b"\x00\x00"

    # Through a real socket pair: decode builds the tensor over the received frame.
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.linger = 0
        a.bind("inproc://zero-copy")
        b.connect("inproc://zero-copy")
        a.send_multipart(frames, copy=False)
        received = b.recv_multipart(copy=False)
        out = decode(received).data["w"]
        assert out.data_ptr() == np.frombuffer(received[1], dtype=np.uint8).ctypes.data
        assert out.dtype == torch.bfloat16 and out.shape == t.shape and out[0] == 1.0
        del out, received
    finally:
        a.close()
        b.close()
        ctx.term()


def test_numpy_encode_is_zero_copy() -> None:
    a = np.zeros(1 << 20, dtype=np.float32)
    frame = encode(Message("k", {"a": a}))[1]
    assert np.frombuffer(frame, dtype=np.uint8).ctypes.data == a.ctypes.data


def test_small_arrays_share_one_frame_the_last() -> None:
    big = np.arange(1 << 17, dtype=np.float32)  # 512 KiB: a frame of its own, zero-copy
    samples = [
        {
            "ids": np.arange(i + 1, dtype=np.int64),
            "logp": np.full(i + 1, -0.5, dtype=np.float32),
            "flag": np.array(i % 2 == 0),
            "none": np.zeros((0, 3), dtype=np.int16),
        }
        for i in range(4)
    ]
    frames = encode(Message("group", {"samples": samples, "big": big, "after": np.arange(3)}))
    assert len(frames) == 3  # header, the big array, then the pack of the 17 small ones
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == big.ctypes.data
    # each small array at the next multiple of 8 bytes, nothing after the last: the last
    # sample's flag ends at byte 153, and "after" (24 bytes) starts at 160
    assert len(frames[2]) == 184
    # a pack received unaligned (inside ZeroMQ's buffer) is copied once, arrays come aligned
    shifted = memoryview(bytearray(len(frames[2]) + 1))[1:]
    shifted[:] = frames[2]
    out = decode([bytes(frames[0]), bytes(frames[1]), shifted]).data
    for got, sent in zip(out["samples"], samples, strict=True):
        for key, array in sent.items():
            assert got[key].dtype == array.dtype and got[key].shape == array.shape
            assert got[key].flags.aligned
            np.testing.assert_array_equal(got[key], array)
    np.testing.assert_array_equal(out["big"], big)
    np.testing.assert_array_equal(out["after"], np.arange(3))


def test_a_shape_seen_before_is_encoded_right_in_every_layout_and_byte_order() -> None:
    # small arrays of a (dtype, shape) packed once take a shortcut after: one that is not
    # native or not contiguous must still go the long way, and a reference decoded once is
    # read at its own place in each later pack
    base = np.arange(10, dtype=np.int32)
    forms = {
        "native": base[:5].copy(),
        "big_endian": base[:5].astype(">i4"),
        "strided": base[::2],
        "fortran": np.asfortranarray(base[:6].reshape(2, 3)),
        "c_order": base[:6].reshape(2, 3).copy(),
    }
    for _ in range(2):  # the second time, every reference is one seen before
        out = roundtrip({"a": base[:5].copy(), **forms, "last": base[5:].copy()}).data
        for key, sent in forms.items():
            assert out[key].dtype.isnative and out[key].shape == sent.shape, key
            np.testing.assert_array_equal(out[key], sent, err_msg=key)
        np.testing.assert_array_equal(out["a"], base[:5])
        np.testing.assert_array_equal(out["last"], base[5:])


def test_import_transport_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, transport\n"
        "from transport import Message, decode, encode\n"
        "decode(encode(Message('k', {'a': np.arange(3)})))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# malformed input


def ref(
    index: int, dtype: str = "float32", shape: list[int] | None = None, code: int = 1
) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([index, dtype, [2] if shape is None else shape]))


def header(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def packed(dtype: str = "float32", shape: list[int] | None = None) -> msgpack.ExtType:
    return msgpack.ExtType(3, msgpack.packb([dtype, [2] if shape is None else shape]))


EIGHT = b"\x00" * 8
GOOD = {"kind": "k", "version": 1}

MALFORMED = {
    "no_frames": ([], "frame_count"),
    "not_msgpack": ([b"\xc1"], "not_msgpack"),
    "trailing_bytes": ([msgpack.packb({"kind": "k"}) + b"\x00"], "not_msgpack"),
    "not_a_map": ([msgpack.packb([1, 2])], "bad_header"),
    "missing_kind": ([header(version=1, data={})], "missing_kind"),
    "kind_not_str": ([header(kind=3, version=1, data={})], "missing_kind"),
    "version_not_int": ([header(kind="k", version="1", data={})], "bad_header"),
    "data_not_map": ([header(**GOOD, data=[1])], "bad_header"),
    "ref_out_of_range": ([header(**GOOD, data={"a": ref(2)}), EIGHT], "frame_count"),
    "ref_to_header": ([header(**GOOD, data={"a": ref(0)}), EIGHT], "frame_count"),
    "ref_twice": ([header(**GOOD, data={"a": ref(1), "b": ref(1)}), EIGHT], "frame_count"),
    "unreferenced_frame": ([header(**GOOD, data={}), EIGHT], "frame_count"),
    "frame_too_small": ([header(**GOOD, data={"a": ref(1, shape=[3])}), EIGHT], "frame_size"),
    "frame_too_big": ([header(**GOOD, data={"a": ref(1, shape=[1])}), EIGHT], "frame_size"),
    "huge_shape": ([header(**GOOD, data={"a": ref(1, shape=[2**40, 2**40])}), EIGHT], "frame_size"),
    "negative_dim": ([header(**GOOD, data={"a": ref(1, shape=[-2])}), EIGHT], "bad_header"),
    "unknown_dtype": ([header(**GOOD, data={"a": ref(1, dtype="float128")}), EIGHT], "bad_dtype"),
    "numpy_bfloat16": (
        [header(**GOOD, data={"a": ref(1, dtype="bfloat16", shape=[4])}), EIGHT],
        "bad_dtype",
    ),
    "torch_unknown_dtype": (
        [header(**GOOD, data={"a": ref(1, dtype="str", code=2)}), EIGHT],
        "bad_dtype",
    ),
    "unknown_ext_code": ([header(**GOOD, data={"a": ref(1, code=9)}), EIGHT], "bad_header"),
    "bad_ref_payload": (
        [header(**GOOD, data={"a": msgpack.ExtType(1, b"\xc1")}), EIGHT],
        "bad_header",
    ),
    "packed_without_a_pack": ([header(**GOOD, data={"a": packed()})], "frame_count"),
    "pack_too_short": ([header(**GOOD, data={"a": packed(shape=[3])}), EIGHT], "frame_size"),
    "pack_too_long": ([header(**GOOD, data={"a": packed(shape=[1])}), EIGHT], "frame_size"),
    "pack_padding_missing": (
        [header(**GOOD, data={"a": packed("int8", [1]), "b": packed("int64", [1])}), b"\0" * 9],
        "frame_size",
    ),
    "pack_also_referenced": (
        [header(**GOOD, data={"a": ref(1), "b": packed("int8", [0])}), EIGHT],
        "frame_count",
    ),
    "referenced_after_packing": (
        [header(**GOOD, data={"b": packed("int8", [0]), "a": ref(1)}), EIGHT],
        "frame_count",
    ),
    "packed_ref_with_index": (
        [header(**GOOD, data={"a": msgpack.ExtType(3, msgpack.packb([1, "int8", [8]]))}), EIGHT],
        "bad_header",
    ),
    "packed_unknown_dtype": (
        [header(**GOOD, data={"a": packed("float128", [1])}), EIGHT],
        "bad_dtype",
    ),
    "pack_not_last": (
        [header(**GOOD, data={"a": packed(shape=[2])}), EIGHT, EIGHT],
        "frame_count",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_frames_are_rejected_with_a_reason(case: str) -> None:
    frames, reason = MALFORMED[case]
    with pytest.raises(DecodeError) as info:
        decode(frames)
    assert info.value.reason == reason, info.value.detail


def test_schema_checks() -> None:
    schemas = {"item": Schema("item", 2, {"id": "int", "values": "array"})}
    good = encode(Message("item", {"id": 1, "values": np.zeros(2)}, version=2))
    assert decode(good, schemas).data["id"] == 1
    cases = {
        "unknown_kind": Message("other", {}, 2),
        "bad_version": Message("item", {"id": 1, "values": np.zeros(2)}, version=1),
        "invalid_fields": Message("item", {"id": "one"}, version=2),
    }
    for reason, msg in cases.items():
        with pytest.raises(DecodeError) as info:
            decode(encode(msg), schemas)
        assert info.value.reason == reason
    with pytest.raises(DecodeError, match="missing field 'values'"):
        decode(encode(Message("item", {"id": 1}, 2)), schemas)
