"""SGLang's ``GET /v1/loads`` on the built-in engine, as SGLang 0.5.23 answers it
(``entrypoints/v1_loads.py``, ``managers/load_snapshot.py``,
``scheduler_components/load_inquirer.py``), and with ``--enable-metrics`` its ``GET /metrics``
(``engine_metrics``). The load of each data-parallel rank (one here), for a router's balancing
and for RL drivers that wait for an engine to drain (slime's ``abort_servers_until_idle``
polls ``/v1/loads?include=core`` after ``/abort_request``). A pooling engine (a reward or
embedding model) answers it too, from its ``Pooler``: each pass a prefill.

Query: ``include`` (comma-separated sections: ``core``, ``memory``, ``spec``, ``lora``,
``disagg``, ``queues``, ``all``; default all), ``dp_rank`` (another rank's: an empty list),
``format=prometheus`` (each number a gauge ``sglang_<key>{dp_rank="0"}``, a section's keys
prefixed with its name).

The answer: ``timestamp`` (ISO, UTC), ``version``, ``accelerator`` (the GPU's name, null on
CPU), ``num_accelerators`` and ``loads``, each with SGLang's core keys in its order, then the
sections present: ``memory``, ``lora`` (once an adapter is loaded), ``disaggregation`` (mode
``null``) and ``queues`` (no ``speculative``: the engine does not speculate).

What the figures are here (the scheduler's live state, read without waiting for a step; the
counters are ``load_meter``'s):

- ``num_used_tokens``: the tokens the running requests hold in the KV cache;
  ``num_total_tokens`` (and ``num_active_tokens``) add the waiting requests' prompts;
  ``num_waiting_uncached_tokens`` estimates how many of those the prefix cache will not supply
  (SGLang's estimate: the last admission's miss rate); ``token_usage`` is the used share of
  ``max_total_num_tokens`` (every running row at the context length, as ``/server_info``).
- ``utilization`` is 0, as SGLang's (it sets it only under
  ``max_running_requests_under_SLO``, which has no setter there).
- ``memory``: ``weight_gb`` (parameters), ``kv_cache_gb`` (the batch's KV storage now: it
  grows with the rows, not preallocated), ``graph_gb`` 0 (no CUDA graphs), ``token_capacity``.
- ``lora``: adapters used by running rows, adapters loaded (the engine has no fixed slots).
- ``queues``: ``waiting``, ``grammar`` (waiting for their grammar to compile), ``paused``
  (running requests held by an in-place ``/pause_generation``), ``retracted`` (sent back by a
  retracting pause, waiting to resume), ``prealloc_ready`` 0. SGLang's ``paused`` is never set
  (0), and its ``retracted`` counts what its memory pressure retracted in its last log
  interval: this engine's pauses are what holds or retracts requests, so it says those.

A section named in ``include`` that SGLang does not know is refused with 400 and the valid
ones (SGLang means to answer so, but its check runs outside the handler that turns it into
400, and answers 500); a ``dp_rank`` that is not an integer, with its 400.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Protocol

import torch
from aiohttp import web

from stages.engine.engine_metrics import PROMETHEUS_TEXT, EngineMetrics
from stages.engine.load_meter import LoadMeter
from stages.engine.request_body import invalid

__all__ = ["SECTIONS", "LoadRoutes", "LoadSource"]

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
# a section's key in a load, the name ``include`` gives it, its prefix in Prometheus
_SECTIONS = (
    ("memory", "memory", "memory"),
    ("speculative", "spec", "spec"),
    ("lora", "lora", "lora"),
    ("disaggregation", "disagg", "disagg"),
    ("queues", "queues", "queues"),
)
_GB = 1024**3


class LoadSource(Protocol):
    """What runs the model: the generating engine's ``Scheduler``, or a pooling engine's
    ``Pooler`` (``stages.engine.pooling``)."""

    load: LoadMeter
    max_running: int
    device: torch.device

    def occupancy(self) -> dict[str, int]: ...


class LoadRoutes:
    """``/v1/loads``, and with ``metrics`` (``--enable-metrics``) ``/metrics``."""

    def __init__(
        self,
        scheduler: LoadSource,
        model: torch.nn.Module,
        capacity: int,
        version: str,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.capacity = capacity  # max_total_num_tokens
        self.version = version
        self.weight_gb = round(
            sum(p.numel() * p.element_size() for p in model.parameters()) / _GB, 3
        )
        device = scheduler.device
        self.accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/loads", self.loads)
        if self.metrics is not None:  # SGLang serves it with --enable-metrics only
            app.router.add_get("/metrics", self.prometheus)
            app.router.add_get("/metrics/", self.prometheus)

    async def prometheus(self, request: web.Request) -> web.Response:
        """Every metric in Prometheus' text format (``engine_metrics``)."""
        assert self.metrics is not None
        body = self.metrics.render(self.load(None))
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})

    async def loads(self, request: web.Request) -> web.Response:
        query = request.query
        include = _include(query.get("include"))
        if isinstance(include, web.Response):
            return include
        rank = query.get("dp_rank")
        if rank is not None:
            try:
                rank_number = int(rank)
            except ValueError:
                return invalid(f"dp_rank: expected an integer, got {rank!r}")
        loads = [self.load(include)] if rank is None or rank_number == 0 else []
        if query.get("format") == "prometheus":
            return web.Response(body=_prometheus(loads), headers={"Content-Type": PROMETHEUS_TEXT})
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": self.version,
                "accelerator": self.accelerator,
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    def load(self, include: frozenset[str] | None) -> dict[str, Any]:
        """Rank 0's load: SGLang's core keys, then the sections ``include`` names (all:
        None)."""
        scheduler, meter = self.scheduler, self.scheduler.load
        now = time.perf_counter()
        held = scheduler.occupancy()
        used = held["used_tokens"]
        total = used + held["waiting_tokens"]
        load: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": held["running"],
            "num_waiting_reqs": held["waiting"],
            "num_waiting_uncached_tokens": int(
                held["waiting_tokens"] * (1.0 - meter.cache_hit_rate)
            ),
            "num_used_tokens": used,
            "num_total_tokens": total,
            "num_active_tokens": total,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.capacity,
            "max_running_requests": scheduler.max_running,
            "token_usage": round(used / self.capacity, 4) if self.capacity else 0.0,
            "gen_throughput": round(meter.gen_throughput(now), 2),
            "cache_hit_rate": round(meter.cache_hit_rate, 4),
            "utilization": 0.0,
            "total_prefill_uncached_tokens": meter.prefill_uncached_tokens,
            "total_prefill_busy_us": meter.prefill_busy_us,
            "decode_moments": meter.moments(),
        }
        if include == frozenset({"core"}):
            return load
        sections: dict[str, dict[str, Any] | None] = {
            "memory": {
                "weight_gb": self.weight_gb,
                "kv_cache_gb": round(held["kv_bytes"] / _GB, 3),
                "graph_gb": 0.0,
                "token_capacity": self.capacity,
            },
            "speculative": None,
            "lora": None
            if not held["adapters"]
            else {
                "slots_used": held["adapters_in_use"],
                "slots_total": held["adapters"],
                "utilization": held["adapters_in_use"] / held["adapters"],
            },
            "disaggregation": {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": held["waiting"],
                "grammar": held["grammar"],
                "paused": held["paused"],
                "retracted": held["retracted"],
                "prealloc_ready": 0,
            },
        }
        every = include is None or "all" in include
        for key, name, _ in _SECTIONS:
            section = sections[key]
            if section is not None and (every or name in include):  # type: ignore[operator]
                load[key] = section
        return load


def _include(text: str | None) -> frozenset[str] | web.Response | None:
    """The sections ``include`` names (None: all), or SGLang's 400 for one it does not know."""
    if not text:
        return None
    named = frozenset(part.strip() for part in text.split(","))
    unknown = named - SECTIONS
    if unknown:
        return invalid(
            f"Invalid include sections: {set(sorted(unknown))}. Valid options: {sorted(SECTIONS)}",
            kind="400",
        )
    return named


def _prometheus(loads: list[dict[str, Any]]) -> bytes:
    """SGLang's Prometheus text of ``loads``: a gauge per number, by rank."""
    prefixes = {key: prefix for key, _, prefix in _SECTIONS}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                for sub, number in value.items():
                    if isinstance(number, int | float):
                        samples.setdefault(f"sglang_{prefixes[key]}_{sub}", []).append(
                            (rank, number)
                        )
            elif isinstance(value, int | float):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return ("\n".join(lines) + "\n").encode()
