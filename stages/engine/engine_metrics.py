"""SGLang's ``--enable-metrics`` on the built-in engine (SGLang 0.5.23's
``observability/metrics_collector.py`` and ``req_time_stats.py``): ``GET /metrics`` in
Prometheus' text format, and each finished request's time stats in its ``meta_info``.

The time stats (what slime reads into its ``perf/request/queue_time``, ``perf/decode/throughput``
and ``perf/request/e2e_latency``): ``forward_entry_time`` and ``prefill_finished_time`` (when
its first prefill began and ended) and ``queue_time`` (the seconds it waited for a prefill, a
retracted request's waits added up), then ``request_received_ts``, ``first_token_latency``,
``api_server_dispatch_finish_ts``, ``request_finished_ts`` and, past one token,
``decode_throughput`` (tokens a second after the first). Timestamps are Unix seconds. They come
with a request's answer and a stream's last chunk; the first three (``scheduler_stats``) also
come with each of a stream's chunks before it, as SGLang's.

The metrics keep SGLang's names, labels (``model_name`` and ``engine_type``; the scheduler's
gauges also ``tp_rank``, ``pp_rank`` and ``moe_ep_rank``, all 0) and default buckets:

- per finished request (a sample: each of a batch's and of ``n``'s), by ``is_streaming``:
  ``sglang:prompt_tokens_total``, ``generation_tokens_total``, ``num_requests_total``,
  ``time_to_first_token_seconds`` (not for one aborted before its answer began: a stream's
  first chunk, or a whole answer), ``e2e_request_latency_seconds``,
  ``request_time_per_output_token_seconds`` (finished by ``stop`` or ``length`` only); and
  ``cached_tokens_total`` (``cache_source="device"``: the prefix cache), ``num_so_requests_total``
  (with a grammar), ``queue_time_seconds`` (its wait for its first prefill; with the
  scheduler's labels), ``inter_token_latency_seconds`` (its decode time spread over its
  tokens after the first, observed at its end: SGLang observes it at each output it hands
  over, a stream's chunks or every 50 tokens otherwise, so its buckets are finer there) and the
  token-count histograms ``prompt_tokens_histogram``, ``uncached_prompt_tokens_histogram``,
  ``generation_tokens_histogram``;
- ``num_aborted_requests_total``: the requests that ended aborted (SGLang's counts the aborts
  it sends: one a ``/abort_request``, ``abort_all`` too, or a client gone);
- the scheduler's state at the scrape, as ``/v1/loads`` reads it (``load_routes``):
  ``num_running_reqs``, ``num_queue_reqs``, ``num_grammar_queue_reqs``, ``num_paused_reqs``,
  ``num_retracted_reqs``, ``num_used_tokens``, ``token_usage``, ``gen_throughput``,
  ``cache_hit_rate``, ``utilization``, ``max_total_num_tokens``, ``context_len``,
  ``weight_memory_usage_gb``, ``kv_cache_memory_usage_gb``, ``graph_memory_usage_gb``,
  ``is_cuda_graph`` (0) and, once a LoRA adapter is loaded, ``lora_pool_slots_used``,
  ``_slots_total`` and ``_utilization``. ``num_paused_reqs`` and ``num_retracted_reqs`` are
  the requests a pause holds now, in place or retracted (SGLang's first is never set, and its
  second counts the requests its memory pressure retracted in its last log interval).

The scheduler thread records each finished request (``EngineMetrics.finished``: plain numbers,
no lock: the scrape reads each as of one request or the next); the event loop renders them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["PROMETHEUS_TEXT", "EngineMetrics", "scheduler_stats"]

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's default buckets (TokenizerMetricsCollector)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
TOKEN_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000,
    12500, 15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000,
    100000, 200000, 300000, 400000, 600000, 800000, 1000000, 1100000,
)  # fmt: skip

QUEUE_BUCKETS = (
    0.000, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40,
    50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600,
    1800, 2000, 2500, 3000,
)  # fmt: skip

_STREAMED = ("false", "true")  # the is_streaming label's values, by bool

# name, help; counters by is_streaming, then the others
_COUNTERS = (
    ("sglang:prompt_tokens", "Number of prefill tokens processed.", True),
    ("sglang:generation_tokens", "Number of generation tokens processed.", True),
    ("sglang:num_requests", "Number of requests processed.", True),
    ("sglang:cached_tokens", "Number of cached prompt tokens by source (device/host/storage).",
     False),
    ("sglang:num_so_requests", "Number of structured output requests processed.", False),
    ("sglang:num_aborted_requests", "Number of requests aborted.", False),
)  # fmt: skip
_HISTOGRAMS = (
    ("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     TTFT_BUCKETS, True),
    ("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     ITL_BUCKETS, False),
    ("sglang:request_time_per_output_token_seconds",
     "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
     ITL_BUCKETS, True),
    ("sglang:e2e_request_latency_seconds",
     "Histogram of End-to-end request latency in seconds", E2E_BUCKETS, True),
    ("sglang:prompt_tokens_histogram", "Histogram of prompt token length.", TOKEN_BUCKETS,
     False),
    ("sglang:uncached_prompt_tokens_histogram",
     "Histogram of prefill token length excluding cache hits.", TOKEN_BUCKETS, False),
    ("sglang:generation_tokens_histogram", "Histogram of generation token length.",
     TOKEN_BUCKETS, False),
    ("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS,
     False),
)  # fmt: skip
# the histograms with the scheduler's labels (tp_rank, pp_rank, moe_ep_rank)
_RANKED = frozenset({"sglang:queue_time_seconds"})
# the scheduler's gauges: name, help, and where the load has it (``load_routes``'s load;
# empty: always 0)
_GAUGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("num_running_reqs", "The number of running requests.", ("num_running_reqs",)),
    ("num_queue_reqs", "The number of requests in the waiting queue.", ("num_waiting_reqs",)),
    ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.",
     ("queues", "grammar")),
    ("num_paused_reqs", "The number of paused requests by async weight sync.",
     ("queues", "paused")),
    ("num_retracted_reqs", "The number of retracted requests.", ("queues", "retracted")),
    ("num_used_tokens", "The number of used tokens.", ("num_used_tokens",)),
    ("token_usage", "The token usage.", ("token_usage",)),
    ("gen_throughput", "The generation throughput (token/s).", ("gen_throughput",)),
    ("cache_hit_rate", "The prefix cache hit rate.", ("cache_hit_rate",)),
    ("utilization", "The utilization.", ("utilization",)),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
     ("max_total_num_tokens",)),
    ("weight_memory_usage_gb", "Memory used by model weights in GB.", ("memory", "weight_gb")),
    ("kv_cache_memory_usage_gb", "Memory used by KV cache in GB.", ("memory", "kv_cache_gb")),
    ("graph_memory_usage_gb", "Memory used by CUDA graphs in GB.", ("memory", "graph_gb")),
    ("is_cuda_graph", "Whether the batch is using CUDA graph.", ()),
)  # fmt: skip
_LORA_GAUGES = (
    ("lora_pool_slots_used", "Number of LoRA adapter slots currently occupied.", "slots_used"),
    ("lora_pool_slots_total", "Total number of LoRA adapter slots available.", "slots_total"),
    ("lora_pool_utilization", "LoRA adapter pool utilization ratio.", "utilization"),
)


class _Histogram:
    """One label set's buckets (not cumulative), count and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float, times: int = 1, total: float | None = None) -> None:
        """``times`` observations of ``value`` (their sum ``total``, else ``value * times``)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times if total is None else total


def scheduler_stats(
    admitted: float, first_token: float, queue_time: float, offset: float
) -> dict[str, Any]:
    """The scheduler's time stats of a request (``SchedulerReqTimeStats
    .convert_to_output_meta_info``), in every answer and in each of a stream's chunks:
    ``forward_entry_time`` and ``prefill_finished_time`` once they happened (``perf_counter``
    times, ``offset`` to Unix time), ``queue_time`` always."""
    stats: dict[str, Any] = {}
    if admitted > 0:
        stats["forward_entry_time"] = admitted + offset
    if first_token > 0:
        stats["prefill_finished_time"] = first_token + offset
    stats["queue_time"] = queue_time
    return stats


class EngineMetrics:
    """The finished requests' metrics, and the time stats each one's ``meta_info`` gets."""

    def __init__(self, model_name: str, context_length: int) -> None:
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        self.context_length = context_length
        # perf_counter to Unix time, once (SGLang's convert_time_to_realtime): a time stat is
        # the same in every chunk and answer that carries it
        self.offset = time.time() - time.perf_counter()
        # by name, then by label value ("" for none): counts, or histograms
        self._counts: dict[str, dict[str, float]] = {name: {} for name, _, _ in _COUNTERS}
        self._histograms: dict[str, dict[str, _Histogram]] = {
            name: {} for name, _, _, _ in _HISTOGRAMS
        }
        self._bounds = {name: bounds for name, _, bounds, _ in _HISTOGRAMS}

    # -- the scheduler's side -------------------------------------------------------------------
    def finished(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        created: float,
        admitted: float,
        queue_time: float,
        first_token: float,
        now: float,
        streamed: bool,
        grammar: bool,
        finish: str,
    ) -> dict[str, Any]:
        """Record one finished request (``perf_counter`` times: ``created`` when it came,
        ``admitted`` when its first prefill began, ``first_token`` when it ended, 0 for
        never; ``queue_time``: the seconds it waited for prefills); returns the time stats for
        its ``meta_info``."""
        stream = _STREAMED[streamed]
        self._add("sglang:prompt_tokens", stream, prompt_tokens)
        self._add("sglang:generation_tokens", stream, completion_tokens)
        self._add("sglang:num_requests", stream, 1)
        if cached_tokens > 0:
            self._add("sglang:cached_tokens", "device", cached_tokens)
        if grammar:
            self._add("sglang:num_so_requests", "", 1)
        if finish == "abort":
            self._add("sglang:num_aborted_requests", "", 1)
        self._observe("sglang:e2e_request_latency_seconds", stream, now - created)
        self._observe("sglang:prompt_tokens_histogram", "", prompt_tokens)
        self._observe("sglang:uncached_prompt_tokens_histogram", "", prompt_tokens - cached_tokens)
        self._observe("sglang:generation_tokens_histogram", "", completion_tokens)
        offset = self.offset
        stats = scheduler_stats(admitted, first_token, queue_time, offset)
        if admitted > 0:
            self._observe("sglang:queue_time_seconds", "", max(admitted - created, 0.0))
        stats["request_received_ts"] = created + offset
        if first_token > created and (streamed or finish != "abort"):
            self._observe("sglang:time_to_first_token_seconds", stream, first_token - created)
        if first_token > created:
            stats["first_token_latency"] = first_token - created
        stats["api_server_dispatch_finish_ts"] = created + offset
        stats["request_finished_ts"] = now + offset
        decode = now - first_token
        if first_token > 0 and completion_tokens > 1 and decode > 0:
            per_token = decode / (completion_tokens - 1)
            self._observe(
                "sglang:inter_token_latency_seconds", "", per_token, completion_tokens - 1, decode
            )
            if finish in ("stop", "length"):
                self._observe("sglang:request_time_per_output_token_seconds", stream, per_token)
            stats["decode_throughput"] = 1.0 / per_token
        return stats

    def _add(self, name: str, label: str, amount: float) -> None:
        counts = self._counts[name]
        counts[label] = counts.get(label, 0) + amount

    def _observe(
        self, name: str, label: str, value: float, times: int = 1, total: float | None = None
    ) -> None:
        histograms = self._histograms[name]
        histogram = histograms.get(label)
        if histogram is None:
            histogram = histograms[label] = _Histogram(self._bounds[name])
        histogram.observe(value, times, total)

    # -- the scrape -----------------------------------------------------------------------------
    def render(self, load: Mapping[str, Any]) -> bytes:
        """Prometheus' text format of every metric, the gauges read off ``load`` (a
        ``/v1/loads`` load of every section)."""
        lines: list[str] = []
        base = _labels(self.labels)
        ranks = _labels({**self.labels, "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0})
        gauges = [(f"sglang:{name}", text, _dig(load, path)) for name, text, path in _GAUGES]
        gauges.append(("sglang:context_len", "The context length.", self.context_length))
        lora = load.get("lora")
        if lora is not None:
            gauges += [(f"sglang:{name}", text, lora[key]) for name, text, key in _LORA_GAUGES]
        for name, text, value in gauges:
            lines += [
                f"# HELP {name} {text}",
                f"# TYPE {name} gauge",
                f"{name}{ranks} {_num(value)}",
            ]
        for name, text, streamed in _COUNTERS:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
            key = "is_streaming" if streamed else "cache_source"
            for label, value in list(self._counts[name].items()):
                where = base if not label else _labels({**self.labels, key: label})
                lines.append(f"{name}_total{where} {_num(value)}")
        for name, text, _, streamed in _HISTOGRAMS:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
            for label, histogram in list(self._histograms[name].items()):
                named = {**self.labels, "is_streaming": label} if streamed else dict(self.labels)
                if name in _RANKED:
                    named.update(tp_rank=0, pp_rank=0, moe_ep_rank=0)
                cumulative = 0
                counts = list(histogram.counts)
                for bound, count in zip((*histogram.bounds, float("inf")), counts, strict=True):
                    cumulative += count
                    where = _labels({**named, "le": _num(bound)})
                    lines.append(f"{name}_bucket{where} {_num(cumulative)}")
                lines.append(f"{name}_count{_labels(named)} {_num(cumulative)}")
                lines.append(f"{name}_sum{_labels(named)} {_num(histogram.sum)}")
        return ("\n".join(lines) + "\n").encode()


def _dig(load: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = load
    for key in path:
        value = value[key]
    return value if path else 0


def _labels(labels: Mapping[str, Any]) -> str:
    """``{k="v",...}``, values escaped as Prometheus' text format wants them."""
    parts = []
    for key, value in labels.items():
        text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{key}="{text}"')
    return "{" + ",".join(parts) + "}"


def _num(value: float) -> str:
    """A sample's value as prometheus_client writes it (``floatToGoString``)."""
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    return repr(value)
