"""Rank 0 broadcasting to two ``WeightReceiver`` processes over gloo, on 127.0.0.1.

The publisher side is driven by hand here (no HTTP): each receiver is told what to receive through
a queue, the way an engine learns it from ``/update_weights_from_distributed``.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Any

import pytest
import torch

from stages.weights.buckets import dtype_name, pack_buckets
from stages.weights.group import init_weight_group
from stages.weights.receiver import WeightReceiver
from transport.address import rendezvous_port

pytestmark = pytest.mark.timeout(60)

GROUP = "test_weights_group"


def _digest(t: torch.Tensor) -> tuple[str, list[int], str]:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return dtype_name(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()


def _receiver_main(port: int, rank: int, jobs: Any, results: Any) -> None:
    """One engine rank: join the group, then receive each announced request."""
    receiver = WeightReceiver()
    try:
        receiver.init_group("127.0.0.1", port, rank, 3, GROUP, "gloo")
        while (job := jobs.get(timeout=30)) is not None:
            names, dtypes, shapes, load_format = job
            got = receiver.receive(names, dtypes, shapes, load_format)
            results.put((rank, {name: _digest(t) for name, t in got}))
    except BaseException as exc:  # report, so the test fails with the cause instead of a hang
        results.put((rank, repr(exc)))
    finally:
        receiver.destroy()


def _free_port() -> int:
    return rendezvous_port()  # below the ephemeral range: not taken before it is bound


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(16, 8, generator=g).half()),
        ("model.counter", torch.randint(0, 2**50, (5,), generator=g)),
        ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
    ]


def test_two_receivers_get_bit_exact_tensors_per_tensor_and_flattened() -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    jobs = [ctx.Queue(), ctx.Queue()]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_receiver_main, args=(port, rank, jobs[rank - 1], results), daemon=True)
        for rank in (1, 2)
    ]
    for p in procs:
        p.start()
    group = None
    try:
        group = init_weight_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=3,
            group_name=GROUP,
            timeout_s=30,
        )
        # The learner's DeepSpeed owns the default group: making ours must not create or touch it.
        assert not torch.distributed.is_initialized()
        weights = _weights()
        want = {name: _digest(t) for name, t in weights}

        # load_format None: one broadcast per tensor, in names order.
        job = (
            [n for n, _ in weights],
            [dtype_name(t.dtype) for _, t in weights],
            [list(t.shape) for _, t in weights],
            None,
        )
        for q in jobs:
            q.put(job)
        for _, t in weights:
            group.broadcast(t.contiguous(), src=0)
        got = dict(results.get(timeout=30) for _ in procs)
        assert got == {1: want, 2: want}

        # flattened_bucket: one flat uint8 broadcast per bucket (three buckets here).
        buckets = list(pack_buckets(weights, bucket_bytes=1024))
        assert len(buckets) == 3
        for bucket in buckets:
            for q in jobs:
                q.put((bucket.names, bucket.dtypes, bucket.shapes, "flattened_bucket"))
            group.broadcast(bucket.flat, src=0)
        merged: dict[int, dict[str, Any]] = {1: {}, 2: {}}
        for _ in range(len(buckets) * len(procs)):
            rank, digests = results.get(timeout=30)
            assert isinstance(digests, dict), digests
            merged[rank].update(digests)
        assert merged == {1: want, 2: want}
    finally:
        for q in jobs:
            q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if group is not None:
            group.destroy()
    assert all(p.exitcode == 0 for p in procs)


def test_receiver_errors_are_clear() -> None:
    receiver = WeightReceiver()
    with pytest.raises(RuntimeError, match="init_weights_update_group"):
        receiver.receive(["a"], ["float32"], [[1]], None)
    receiver._group = object()  # type: ignore[assignment]  # past the group check only
    with pytest.raises(ValueError, match="unknown load_format 'safetensors'"):
        receiver.receive(["a"], ["float32"], [[1]], "safetensors")
    with pytest.raises(ValueError, match="unknown weight dtype 'float33'"):
        receiver.receive(["a"], ["float33"], [[1]], "flattened_bucket")
    with pytest.raises(ValueError, match="differ in length"):
        receiver.receive(["a", "b"], ["float32"], [[1]], None)
    with pytest.raises(ValueError, match="rank 0 of the weight group is the publisher"):
        WeightReceiver().init_group("127.0.0.1", 1, 0, 2, "g", "gloo")
