"""The weight process group: the publisher (rank 0) and every engine rank, apart from the default.

Made exactly the way SGLang's ``init_custom_process_group`` (``sglang/srt/utils/common.py``) makes
it, so one publisher can rendezvous with a real SGLang server and with Inflight's built-in engine:
``rendezvous("tcp://master_address:master_port", rank, world_size)`` gives a TCP store that rank 0
hosts (it waits until all ``world_size`` ranks have connected), the store is wrapped in
``PrefixStore(group_name, store)`` and torch's ``_new_process_group_helper`` builds the group on it.
Engine ranks are ``rank_offset + tp_rank``.

The default process group is never touched (the learner's DeepSpeed owns it in the same process).
This module does not pick ports, talk HTTP or know about buckets.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["WeightGroup", "init_weight_group"]


class WeightGroup:
    """One rank's handle on the weight process group."""

    def __init__(self, pg: dist.ProcessGroup, *, rank: int, world_size: int, name: str) -> None:
        self._pg: dist.ProcessGroup | None = pg
        self.rank = rank
        self.world_size = world_size
        self.name = name

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src`` to all ranks, in place (blocking)."""
        if self._pg is None:
            raise RuntimeError(f"weight group {self.name!r} was destroyed")
        # As SGLang does: ``src`` maps through pg_group_ranks (identity), never the default group.
        dist.broadcast(tensor, src=src, group=self._pg)

    def barrier(self, device: torch.device | None = None) -> None:
        """Wait until every rank has reached it (SGLang's ``dist.barrier`` after a group is
        made); ``device``: the CUDA device an NCCL group's barrier runs on."""
        if self._pg is None:
            raise RuntimeError(f"weight group {self.name!r} was destroyed")
        if device is not None and device.type == "cuda":
            dist.barrier(group=self._pg, device_ids=[device.index or 0])
        else:
            dist.barrier(group=self._pg)

    def destroy(self) -> None:
        """Release the group (idempotent). A collective still running on it must have ended."""
        pg, self._pg = self._pg, None
        if pg is not None:
            dist.destroy_process_group(pg)


def _tcp_url(host: str, port: int) -> str:
    # An IPv6 literal needs brackets in a URL.
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def init_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300,
) -> WeightGroup:
    """Join (rank 0: host) the weight group; blocks until all ``world_size`` ranks have joined.

    ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors on the current device).
    Raises after ``timeout_s`` if the group does not come together.
    """
    if not group_name:
        raise ValueError("group_name must not be empty (it prefixes the rendezvous store keys)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    url = _tcp_url(master_address, int(master_port))
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    # torch 2.6 renamed pg_options to backend_options; SGLang passes None under either name.
    options_kw = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options_kw: None},
    )
    # Collectives translate ranks through this map; in this group, group rank == rank.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(pg, rank=rank, world_size=world_size, name=group_name)
