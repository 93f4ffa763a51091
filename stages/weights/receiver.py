"""The engine side of weight publishing: join the weight group, receive announced tensors.

An engine server calls these from its ``/init_weights_update_group`` and
``/update_weights_from_distributed`` handlers (in a worker thread: every call blocks until the
publisher's side of the collective has run). ``receive`` follows SGLang's model runner: with
``load_format=None`` one broadcast per tensor in ``names`` order, with ``"flattened_bucket"`` one
broadcast of a flat ``uint8`` tensor cut apart by ``unpack_bucket``.

It does not load weights into a model, hold a version number or speak HTTP: the engine does.
"""

from __future__ import annotations

import torch

from stages.weights.buckets import (
    StagingBuffer,
    bucket_nbytes,
    dtype_from_name,
    unpack_bucket,
)
from stages.weights.group import WeightGroup, init_weight_group

__all__ = ["LOAD_FORMATS", "WeightReceiver"]

# None: one broadcast per tensor; "flattened_bucket": one flat uint8 broadcast per request.
LOAD_FORMATS = (None, "flattened_bucket")


class WeightReceiver:
    """One engine rank's membership of the weight group (rank 0 is the publisher)."""

    def __init__(self, device: str | torch.device = "cpu", *, timeout_s: float = 300) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.backend = "gloo"
        self._group: WeightGroup | None = None
        # One reused receive buffer: a fresh one per bucket above glibc's mmap threshold (32 MB)
        # is a new mapping each time, faulted in and zeroed: 4x the receive CPU at 64 MB buckets.
        self._staging = StagingBuffer(slots=1)

    @property
    def group_name(self) -> str | None:
        return None if self._group is None else self._group.name

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the publisher's group as ``rank``; blocks until every rank has joined."""
        if self._group is not None:
            raise RuntimeError(
                f"already in weight group {self._group.name!r}: call destroy() before joining "
                f"{group_name!r}"
            )
        if rank == 0:
            raise ValueError("rank 0 of the weight group is the publisher; engines use rank >= 1")
        self.backend = backend
        self._group = init_weight_group(
            backend=backend,
            master_address=master_address,
            master_port=int(master_port),
            rank=rank,
            world_size=world_size,
            group_name=group_name,
            timeout_s=self.timeout_s,
        )

    def receive(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive the announced tensors from rank 0; blocks until all have arrived.

        Everything is validated before the first broadcast, so a bad request fails without
        joining any collective (the publisher then sees the error in the HTTP answer).
        With ``"flattened_bucket"`` the returned tensors are views of one reused buffer: copy
        them (load them into the model) before the next ``receive``.
        """
        if self._group is None:
            raise RuntimeError(
                "no weight group: POST /init_weights_update_group before "
                "/update_weights_from_distributed"
            )
        if load_format not in LOAD_FORMATS:
            raise ValueError(
                f"unknown load_format {load_format!r}: expected one of {list(LOAD_FORMATS)}"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}"
            )
        torch_dtypes = [dtype_from_name(d) for d in dtypes]
        # gloo moves CPU memory: a GPU engine in a gloo group (learner and engine sharing one
        # GPU, where NCCL cannot join both) receives into CPU staging and copies to the device
        device = torch.device("cpu") if self.backend == "gloo" else self.device
        if load_format == "flattened_bucket":
            flat = self._staging.take(bucket_nbytes(dtypes, shapes), device)
            self._group.broadcast(flat, src=0)
            return unpack_bucket(flat, names, dtypes, shapes)
        out = []
        for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
            tensor = torch.empty(list(shape), dtype=dtype, device=device)
            self._group.broadcast(tensor, src=0)
            out.append((name, tensor))
        return out

    def destroy(self) -> None:
        """Leave the weight group (idempotent)."""
        group, self._group = self._group, None
        self._staging = StagingBuffer(slots=1)
        if group is not None:
            group.destroy()
