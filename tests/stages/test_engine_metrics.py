"""``--enable-metrics`` on the built-in engine as a real server, as SGLang 0.5.23 serves it
(``observability/metrics_collector.py``: ``SchedulerMetricsCollector`` and
``TokenizerMetricsCollector``, ``TokenizerManager.collect_metrics``;
``observability/req_time_stats.py``: the time stats of ``meta_info``): ``GET /metrics`` read
with Prometheus' own parser, and what each answer's ``meta_info`` says of its timing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from stages.engine.engine_metrics import E2E_BUCKETS, ITL_BUCKETS, EngineMetrics
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_byte_model

PROMPT = [5, 17, 33, 8, 50, 41, 7]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TIME_STATS = (
    "forward_entry_time",
    "prefill_finished_time",
    "queue_time",
    "request_received_ts",
    "first_token_latency",
    "api_server_dispatch_finish_ts",
    "request_finished_ts",
    "decode_throughput",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a byte-level tokenizer, so that a grammar can constrain it
    return make_byte_model(tmp_path_factory.mktemp("models") / "m", seed=5)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with builtin_engine(model, "--enable-metrics", "--max-running", "4") as engine:
        yield engine


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, by name and labels, as Prometheus parses them."""
    resp = requests.get(url + "/metrics", timeout=30)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    """A sample's value by its name and the labels besides model_name and engine_type."""
    for (found, pairs), value in samples.items():
        given = {k: v for k, v in pairs if k not in ("model_name", "engine_type")}
        if found == name and given == labels:
            return value
    return 0.0


def _generate(url: str, **body: Any) -> Any:
    resp = requests.post(url + "/generate", json={"input_ids": PROMPT, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_each_answer_says_when_it_was_queued_prefilled_and_finished(url: str) -> None:
    """``meta_info`` gets the scheduler's time stats (``forward_entry_time``,
    ``prefill_finished_time``, ``queue_time``) and the API server's (``request_received_ts``,
    ``first_token_latency``, ``request_finished_ts``, ``decode_throughput``): what slime reads
    into its ``perf/request/queue_time`` and ``perf/decode/throughput``."""
    before = time.time()
    meta = _generate(url, sampling_params=GREEDY)["meta_info"]
    after = time.time()
    assert all(key in meta for key in TIME_STATS), meta
    received, entered = meta["request_received_ts"], meta["forward_entry_time"]
    prefilled, finished = meta["prefill_finished_time"], meta["request_finished_ts"]
    assert before <= received <= entered <= prefilled <= finished <= after
    assert meta["queue_time"] == pytest.approx(entered - received, abs=1e-3)
    assert meta["first_token_latency"] == pytest.approx(prefilled - received, abs=1e-3)
    assert meta["e2e_latency"] == pytest.approx(finished - received, abs=1e-3)
    decode = finished - prefilled
    assert meta["decode_throughput"] == pytest.approx(
        (GREEDY["max_new_tokens"] - 1) / decode, rel=1e-2
    )
    # one token: no decode time, no throughput (get_time_per_output_token: None)
    one = _generate(url, sampling_params={**GREEDY, "max_new_tokens": 1})["meta_info"]
    assert "decode_throughput" not in one and "first_token_latency" in one


def test_each_streamed_chunk_says_when_its_sample_was_queued_and_prefilled(url: str) -> None:
    """SGLang puts the scheduler's time stats (``forward_entry_time``, ``prefill_finished_time``,
    ``queue_time``) in every chunk, after ``num_retractions`` (``_handle_batch_output``), and
    the API server's too in the last: what slime's streaming rollout keeps of a cut stream."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "n": 2},
        "return_logprob": True,
        "stream": True,
    }
    chunks = []
    slowed = requests.post(url + "/slow_down", json={"forward_sleep_time": 0.03}, timeout=30)
    assert slowed.status_code == 200  # a chunk a step: none merged while the client reads
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line and line != b"data: [DONE]":
                    chunks.append(json.loads(line.removeprefix(b"data: ")))
    finally:
        requests.post(url + "/slow_down", json={"forward_sleep_time": None}, timeout=30)
    scheduler = TIME_STATS[:3]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        *going, last = mine
        assert going, "the sample came in one chunk"
        for chunk in going:
            meta = chunk["meta_info"]
            keys = list(meta)
            at = keys.index("num_retractions")
            assert tuple(keys[at + 1 : at + 4]) == scheduler, keys
            assert not set(TIME_STATS[3:]) & set(meta)  # the API server's: the last only
            assert meta["forward_entry_time"] <= meta["prefill_finished_time"]
        assert all(key in last["meta_info"] for key in TIME_STATS)
        for key in scheduler:  # the same times throughout (no retraction)
            assert {c["meta_info"][key] for c in mine} == {last["meta_info"][key]}, key


def test_finished_requests_are_counted_by_whether_they_streamed(url: str) -> None:
    """``observe_one_finished_request``: tokens, requests and the latency histograms, each
    sample of ``n`` a request; the streamed ones under ``is_streaming="true"``."""
    before = _samples(url)
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 3}}
    assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200
    streamed = requests.post(
        url + "/generate", json={**body, "stream": True, "sampling_params": GREEDY}, timeout=60
    )
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    after = _samples(url)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    new = GREEDY["max_new_tokens"]
    assert grew("sglang:num_requests_total", is_streaming="false") == 3
    assert grew("sglang:num_requests_total", is_streaming="true") == 1
    assert grew("sglang:prompt_tokens_total", is_streaming="false") == 3 * len(PROMPT)
    assert grew("sglang:generation_tokens_total", is_streaming="false") == 3 * new
    assert grew("sglang:generation_tokens_total", is_streaming="true") == new
    for streaming, count in (("false", 3), ("true", 1)):
        for name in (
            "sglang:e2e_request_latency_seconds_count",
            "sglang:time_to_first_token_seconds_count",
            "sglang:request_time_per_output_token_seconds_count",
        ):
            assert grew(name, is_streaming=streaming) == count, name
        infinite = grew(
            "sglang:e2e_request_latency_seconds_bucket", is_streaming=streaming, le="+Inf"
        )
        assert infinite == count
    # the inter-token latency: one observation per token after the first
    assert grew("sglang:inter_token_latency_seconds_count") == 4 * (new - 1)
    assert grew("sglang:generation_tokens_histogram_count") == 4
    # the prompt came again: the prefix cache supplied all but its last token
    assert grew("sglang:cached_tokens_total", cache_source="device") >= len(PROMPT) - 1


RANKS = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}  # the scheduler's labels


def _until(check: Any, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@contextlib.contextmanager
def _one_running(url: str, new: int, slow: float = 0.02) -> Iterator[dict[str, Any]]:
    """One request of ``new`` tokens running, each step slowed by ``slow`` seconds, from when
    the block starts (it runs by then) until it ends (generation continued, the slowing ended,
    its answer in: the dict's ``r``)."""
    resp = requests.post(url + "/slow_down", json={"forward_sleep_time": slow}, timeout=30)
    assert resp.status_code == 200
    done: dict[str, Any] = {}
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": new}}
    thread = threading.Thread(
        target=lambda: done.update(r=requests.post(url + "/generate", json=body, timeout=60))
    )
    thread.start()
    try:
        _until(lambda: _value(_samples(url), "sglang:num_running_reqs", **RANKS) == 1)
        yield done
    finally:
        requests.post(url + "/continue_generation", json={}, timeout=30)
        requests.post(url + "/slow_down", json={"forward_sleep_time": None}, timeout=30)
        thread.join(60)


def test_the_gauges_read_the_scheduler_with_sglangs_labels(url: str) -> None:
    """``SchedulerMetricsCollector``'s gauges carry ``tp_rank``, ``pp_rank`` and
    ``moe_ep_rank``; running requests show while they run."""
    with _one_running(url, 200, slow=0.05) as done:  # 10 s: aborted long before
        samples = _samples(url)
        assert _value(samples, "sglang:num_used_tokens", **RANKS) >= len(PROMPT)
        info = requests.get(url + "/server_info", timeout=10).json()
        assert info["enable_metrics"] is True
        total = _value(samples, "sglang:max_total_num_tokens", **RANKS)
        assert total == info["max_total_num_tokens"]
        assert _value(samples, "sglang:context_len", **RANKS) == info["context_length"]
        labels = next(dict(k) for (n, k) in samples if n == "sglang:num_running_reqs")
        assert labels["engine_type"] == "unified" and labels["model_name"] == info["model_path"]
        requests.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
    assert done["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert _value(_samples(url), "sglang:num_aborted_requests_total") >= 1
    _until(lambda: _value(_samples(url), "sglang:num_running_reqs", **RANKS) == 0)


def test_a_grammar_request_is_a_structured_output_request(url: str) -> None:
    before = _value(_samples(url), "sglang:num_so_requests_total")
    _generate(url, sampling_params={**GREEDY, "regex": "[a-z]+"})
    assert _value(_samples(url), "sglang:num_so_requests_total") == before + 1


# ---- the collector ----------------------------------------------------------------------------


def test_the_histograms_are_cumulative_and_the_text_parses() -> None:
    metrics = EngineMetrics('m"odel\\x', 64)
    for latency in (0.05, 0.3, 0.3, 5000.0):
        metrics.finished(
            prompt_tokens=10,
            completion_tokens=5,
            cached_tokens=0,
            created=100.0,
            admitted=100.01,
            queue_time=0.01,
            first_token=100.02,
            now=100.0 + latency,
            streamed=False,
            grammar=False,
            finish="length",
        )
    load = {
        "num_running_reqs": 1, "num_waiting_reqs": 2, "num_used_tokens": 30, "token_usage": 0.1,
        "gen_throughput": 12.5, "cache_hit_rate": 0.0, "utilization": 0.0,
        "max_total_num_tokens": 256,
        "queues": {"grammar": 0, "paused": 0, "retracted": 0},
        "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0},
    }  # fmt: skip
    text = metrics.render(load).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    e2e = families["sglang:e2e_request_latency_seconds"]
    assert e2e.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in e2e.samples if s.name.endswith("_bucket")}
    assert list(buckets) == [*(str(float(b)) for b in E2E_BUCKETS), "+Inf"]
    assert buckets["0.1"] == 1 and buckets["0.4"] == 3 and buckets["2400.0"] == 3
    assert buckets["+Inf"] == 4
    (labels,) = {tuple(s.labels.items())[:2] for s in e2e.samples}
    assert labels == (("model_name", 'm"odel\\x'), ("engine_type", "unified"))  # escaped
    itl = families["sglang:inter_token_latency_seconds"]
    count = next(s.value for s in itl.samples if s.name.endswith("_count"))
    assert count == 4 * 4  # each request's 4 tokens after its first
    assert len([s for s in itl.samples if s.name.endswith("_bucket")]) == len(ITL_BUCKETS) + 1
    assert families["sglang:gen_throughput"].samples[0].value == 12.5
    assert families["sglang:prompt_tokens"].type == "counter"
    assert "sglang:lora_pool_slots_used" not in families
    queue = families["sglang:queue_time_seconds"]  # with the scheduler's labels
    (counted,) = [s for s in queue.samples if s.name.endswith("_count")]
    assert counted.value == 4 and counted.labels["tp_rank"] == "0"


def test_a_retracted_requests_waits_add_up(url: str) -> None:
    """``queue_time`` adds each wait for a prefill, the one after a retraction too
    (``ReqTimeStats.set_forward_entry_time``): what a weight sync's retracting pause costs."""
    with _one_running(url, 60) as done:
        paused = requests.post(url + "/pause_generation", json={"mode": "retract"}, timeout=30)
        assert paused.status_code == 200
        time.sleep(0.5)
    meta = done["r"].json()["meta_info"]
    assert meta["num_retractions"] == 1 and meta["completion_tokens"] == 60
    assert meta["queue_time"] >= 0.5
    # the first wait alone is what came before the first prefill
    assert meta["forward_entry_time"] - meta["request_received_ts"] < meta["queue_time"] - 0.4
