"""Packing named tensors into SGLang ``flattened_bucket`` buckets and back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.weights.buckets import (
    bucket_nbytes,
    dtype_from_name,
    dtype_name,
    group_by_size,
    pack_buckets,
    unpack_bucket,
)

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(20)]


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 3, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 3, generator=g).half()),
        ("model.step", torch.randint(-(2**40), 2**40, (3,), generator=g)),
        ("model.scalar", torch.tensor(1.5)),
        ("model.empty", torch.empty(0, 4)),
        ("model.mask", torch.tensor([True, False, True])),
        ("model.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_dtype_names_round_trip_as_sglang_spells_them() -> None:
    for name in ("float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool"):
        assert dtype_name(dtype_from_name(name)) == name
        assert dtype_from_name(name) == getattr(torch, name)  # SGLang: getattr(torch, name)
    with pytest.raises(ValueError, match=r"unknown weight dtype 'torch\.float32'"):
        dtype_from_name("torch.float32")
    with pytest.raises(ValueError, match="cannot be published"):
        dtype_name(torch.complex64)


def test_round_trip_is_bit_exact_with_mixed_dtypes() -> None:
    tensors = _mixed()
    (bucket,) = pack_buckets(tensors, bucket_bytes=1 << 20)
    assert bucket.flat.dtype == torch.uint8
    assert bucket.nbytes == sum(t.numel() * t.element_size() for _, t in tensors)
    assert bucket.dtypes == [
        *("bfloat16", "float32", "float16", "int64", "float32", "float32", "bool", "bfloat16")
    ]
    assert bucket_nbytes(bucket.dtypes, bucket.shapes) == bucket.nbytes
    out = unpack_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, out, strict=True):
        assert _same_bits(want, got)


def test_layout_is_sglangs_bytes_back_to_back_without_padding() -> None:
    # 3 bf16 values (6 bytes) then an int64: SGLang concatenates the raw bytes, no alignment.
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([7], dtype=torch.int64)
    (bucket,) = pack_buckets([("a", a), ("b", b)], bucket_bytes=64)
    expected = torch.cat([a.view(torch.uint8), b.view(torch.uint8)])
    assert torch.equal(bucket.flat, expected)
    (_, a2), (_, b2) = unpack_bucket(bucket.flat, ["a", "b"], ["bfloat16", "int64"], [[3], [1]])
    assert _same_bits(a, a2) and _same_bits(b, b2)


def test_unpacked_tensors_are_views_when_aligned() -> None:
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(2, dtype=torch.float32)
    (bucket,) = pack_buckets([("a", a), ("b", b)], bucket_bytes=64)
    (_, a2), _ = unpack_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
    assert a2.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()


def test_bucket_boundaries_keep_order_and_never_split_a_tensor() -> None:
    tensors = [(f"w{i}", torch.full((10,), float(i))) for i in range(7)]  # 40 bytes each
    buckets = list(pack_buckets(tensors, bucket_bytes=100))
    assert [b.names for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"], ["w6"]]
    assert all(b.nbytes <= 100 for b in buckets)
    exact = list(pack_buckets(tensors[:4], bucket_bytes=80))  # exactly full buckets
    assert [b.names for b in exact] == [["w0", "w1"], ["w2", "w3"]]
    flat = [x for b in buckets for x in unpack_bucket(b.flat, b.names, b.dtypes, b.shapes)]
    assert all(_same_bits(t, u) for (_, t), (_, u) in zip(tensors, flat, strict=True))


def test_oversized_tensor_gets_a_bucket_of_its_own() -> None:
    small, big = torch.zeros(4), torch.randn(100)  # 16 and 400 bytes
    tensors = [("s0", small), ("big", big), ("s1", small), ("s2", small)]
    buckets = list(pack_buckets(tensors, bucket_bytes=64))
    assert [b.names for b in buckets] == [["s0"], ["big"], ["s1", "s2"]]
    assert buckets[1].nbytes == 400


def test_non_contiguous_tensors_pack_by_value() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    (bucket,) = pack_buckets([("t", t)], bucket_bytes=1024)
    ((_, out),) = unpack_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
    assert torch.equal(out, t) and out.shape == (4, 3)


def test_empty_tensors_of_any_strides_pack_as_no_bytes() -> None:
    empty = torch.from_numpy(np.zeros(4, np.int16)[np.zeros(4, bool)]).view(torch.bfloat16)
    assert empty.stride() == (0,)  # what numpy's empty selections give
    named = [("a", torch.ones(2)), ("e", empty), ("b", torch.ones(3, dtype=torch.bfloat16))]
    (bucket,) = pack_buckets(named, bucket_bytes=1024)
    out = unpack_bucket(bucket.flat, bucket.names, bucket.dtypes, bucket.shapes)
    assert [(n, t.shape, t.dtype) for n, t in out] == [(n, t.shape, t.dtype) for n, t in named]


def test_group_by_size_is_lazy() -> None:
    pulled = []

    def source():
        for i in range(4):
            pulled.append(i)
            yield f"w{i}", torch.zeros(10)

    groups = group_by_size(source(), 40)
    assert [name for name, _ in next(groups)] == ["w0"]
    assert pulled == [0, 1]  # one tensor of look-ahead, never the whole model


def test_unpack_rejects_bad_metadata() -> None:
    flat = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="holds 8 bytes but its 1 tensors need 16"):
        unpack_bucket(flat, ["a"], ["float32"], [[4]])
    with pytest.raises(ValueError, match="lengths differ"):
        unpack_bucket(flat, ["a", "b"], ["float32"], [[2]])
    with pytest.raises(ValueError, match="unknown weight dtype 'fp8'"):
        unpack_bucket(flat, ["a"], ["fp8"], [[8]])
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(pack_buckets([("a", torch.zeros(1))], 0))
