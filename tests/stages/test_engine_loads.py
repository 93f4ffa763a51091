"""``GET /v1/loads`` on the built-in engine as a real server, as SGLang 0.5.23 answers it
(``entrypoints/v1_loads.py``, ``managers/load_snapshot.py``,
``scheduler_components/load_inquirer.py``), and the counters behind it
(``stages.engine.load_meter``).

One engine for the module, on a tiny model; ``/slow_down`` holds requests in flight where a
test needs them running.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from stages.engine.load_meter import DECODE_LOG_INTERVAL, STALE_SECONDS, LoadMeter
from tests.stages import engine_setup
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

# LoadSnapshot's fields in their order, less its sections (load_snapshot.py: _CORE_KEYS)
CORE = [
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
]
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=2)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with builtin_engine(model, "--max-running", "4", "--enable-lora") as engine:
        yield engine


def _loads(url: str, **query: str) -> requests.Response:
    return requests.get(url + "/v1/loads", params=query, timeout=30)


def _load(url: str, **query: str) -> dict[str, Any]:
    resp = _loads(url, **query)
    assert resp.status_code == 200, resp.text
    (load,) = resp.json()["loads"]
    return load


def _num_requests(load: Any) -> int:
    """How slime reads a load (``server_control.num_requests_from_load``): running plus
    waiting requests."""
    if isinstance(load, list):
        return sum(_num_requests(item) for item in load)
    if "loads" in load:
        return _num_requests(load["loads"])
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def _generate(url: str, rid: str, new: int, out: dict[str, Any], **more: Any) -> None:
    body = {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0},
        **more,
    }
    out[rid] = requests.post(url + "/generate", json=body, timeout=120).json()


@contextlib.contextmanager
def _in_flight(
    url: str, count: int, *, slow: float, new: int = 300, **more: Any
) -> Iterator[dict[str, Any]]:
    """``count`` requests of ``new`` tokens (``more``: other fields of their bodies) running,
    each step slowed by ``slow`` seconds, until the block ends; then every request is aborted
    (generation continued first) and ended. Yields their answers by rid, once ended."""
    out: dict[str, Any] = {}
    _slow(url, slow)
    threads = [
        threading.Thread(target=_generate, args=(url, f"flight-{i}", new, out), kwargs=more)
        for i in range(count)
    ]
    try:
        for t in threads:
            t.start()
        yield out
    finally:
        requests.post(url + "/continue_generation", json={}, timeout=30)
        resp = requests.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
        _slow(url, None)
        for t in threads:
            t.join(60)
    assert resp.status_code == 200


def _slow(url: str, seconds: float | None) -> None:
    resp = requests.post(url + "/slow_down", json={"forward_sleep_time": seconds}, timeout=30)
    assert resp.status_code == 200, resp.text


def _wait(url: str, until: Any, within: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        load = _load(url)
        if until(load):
            return load
        assert time.monotonic() < deadline, f"never reached: {load}"
        time.sleep(0.05)


def _weight_gb(model: Path) -> float:
    """The parameters' GB as SGLang rounds them (3 places: 0.0 for a tiny model)."""
    from transformers import AutoModelForCausalLM

    params = AutoModelForCausalLM.from_pretrained(model).parameters()
    return round(sum(p.numel() * p.element_size() for p in params) / 1024**3, 3)


def _refused(url: str) -> dict[str, int]:
    return requests.get(url + "/server_info", timeout=10).json()["refused_requests"]


# ---- the answer's shape ---------------------------------------------------------------------


def test_an_idle_engine_answers_sglangs_fields_in_sglangs_order(url: str, model: Path) -> None:
    """``get_loads``'s answer: timestamp, version, accelerator (none on the CPU), one
    accelerator a rank, and the rank's load: the core keys, then memory, disaggregation and
    queues (no speculative: the engine does not speculate; no lora: no adapter loaded)."""
    resp = _loads(url)
    assert resp.status_code == 200
    body = resp.json()
    assert list(body) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    assert body["timestamp"].endswith("+00:00")  # datetime.now(timezone.utc).isoformat()
    assert body["version"] == requests.get(url + "/server_info", timeout=10).json()["version"]
    # the CUDA device's name on a GPU (torch.cuda.get_device_name, as SGLang's)
    on_cpu = engine_setup.ENGINE_DEVICE == "cpu"
    assert (body["accelerator"] is None) is on_cpu and body["num_accelerators"] == 1
    (load,) = body["loads"]
    assert list(load) == [*CORE, "memory", "disaggregation", "queues"]
    assert abs(load["timestamp"] - time.time()) < 60
    assert load["dp_rank"] == 0 and load["max_running_requests"] == 4
    info = requests.get(url + "/server_info", timeout=10).json()
    assert load["max_total_num_tokens"] == info["max_total_num_tokens"]
    assert load["memory"]["token_capacity"] == info["max_total_num_tokens"]
    assert load["memory"]["weight_gb"] == _weight_gb(model) and load["memory"]["graph_gb"] == 0
    assert load["disaggregation"]["mode"] == "null"
    assert list(load["queues"]) == ["waiting", "grammar", "paused", "retracted", "prealloc_ready"]
    assert _num_requests(body) == 0 and load["num_used_tokens"] == 0
    # SGLang serves /metrics with --enable-metrics only, and adds time stats with it only
    assert requests.get(url + "/metrics", timeout=10).status_code == 404
    assert requests.get(url + "/server_info", timeout=10).json()["enable_metrics"] is False
    out: dict[str, Any] = {}
    before = time.time()
    _generate(url, "idle-1", 3, out)
    meta = out["idle-1"]["meta_info"]
    assert meta["num_retractions"] == 0
    assert before <= meta["response_sent_to_client_ts"] <= time.time()  # in every answer
    assert not {"queue_time", "forward_entry_time", "decode_throughput"} & set(meta)


def test_include_picks_sections_and_core_is_always_there(url: str) -> None:
    """``LoadSnapshot.to_dict``: ``core`` alone is the flat keys; a section named adds
    itself; ``all`` (or nothing) is every section present."""
    assert list(_load(url, include="core")) == CORE
    assert list(_load(url, include="core, queues")) == [*CORE, "queues"]
    assert list(_load(url, include="memory")) == [*CORE, "memory"]
    assert list(_load(url, include="spec,lora")) == CORE  # neither is present
    assert list(_load(url, include="all")) == [*CORE, "memory", "disaggregation", "queues"]
    assert list(_load(url, include="")) == [*CORE, "memory", "disaggregation", "queues"]


def test_a_section_sglang_does_not_know_is_refused_with_the_valid_ones(url: str) -> None:
    before = _refused(url).get("GET /v1/loads 400", 0)
    resp = _loads(url, include="core,cpu")
    assert resp.status_code == 400
    body = resp.json()
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "400"
    assert "{'cpu'}" in body["message"] and "'queues'" in body["message"]
    resp = _loads(url, dp_rank="first")
    assert resp.status_code == 400 and "dp_rank" in resp.json()["message"]
    assert _refused(url)["GET /v1/loads 400"] == before + 2
    assert _load(url)["dp_rank"] == 0  # the engine serves on


def test_another_ranks_load_is_an_empty_list(url: str) -> None:
    """``get_loads``: a ``dp_rank`` out of range answers no load, not an error."""
    assert _loads(url, dp_rank="1").json()["loads"] == []
    assert _loads(url, dp_rank="-1").json()["loads"] == []
    assert len(_loads(url, dp_rank="0").json()["loads"]) == 1


def test_prometheus_gives_a_gauge_per_number_by_rank(url: str) -> None:
    """``_format_loads_prometheus``: ``sglang_<key>`` per core number and
    ``sglang_<prefix>_<key>`` per section number (strings and lists left out)."""
    resp = _loads(url, format="prometheus")
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    lines = resp.text.splitlines()
    assert resp.text.endswith("\n")
    samples = {}
    for i in range(0, len(lines), 2):  # one rank: each gauge's TYPE line and its sample
        name = lines[i].removeprefix("# TYPE ").removesuffix(" gauge")
        sample, value = lines[i + 1].split(" ")
        assert sample == f'{name}{{dp_rank="0"}}'
        samples[name] = float(value)
    assert samples["sglang_num_running_reqs"] == 0
    assert samples["sglang_max_running_requests"] == 4
    assert samples["sglang_memory_token_capacity"] == samples["sglang_max_total_num_tokens"] > 0
    assert samples["sglang_queues_waiting"] == 0
    assert samples["sglang_disagg_kv_transfer_speed_gb_s"] == 0
    assert "sglang_disagg_mode" not in samples and "sglang_decode_moments" not in samples
    assert "sglang_dp_rank" not in samples and "sglang_timestamp" in samples
    only = _loads(url, format="prometheus", include="core").text
    assert "sglang_queues_waiting" not in only and "sglang_num_waiting_reqs" in only


# ---- the live figures -----------------------------------------------------------------------


def test_requests_in_flight_are_counted_and_an_abort_drains_them(url: str) -> None:
    """slime's ``abort_servers_until_idle``: ``/abort_request`` with ``abort_all``, then
    ``/v1/loads?include=core`` until no request runs or waits."""
    with _in_flight(url, 6, slow=0.05) as out:
        load = _wait(url, lambda x: x["num_running_reqs"] == 4 and x["num_waiting_reqs"] == 2)
        # each running row holds at least its prompt; the waiting ones bring theirs
        assert load["num_used_tokens"] >= 4 * len(PROMPT)
        assert load["num_total_tokens"] == load["num_used_tokens"] + 2 * len(PROMPT)
        assert load["num_active_tokens"] == load["num_total_tokens"]
        assert 0 < load["token_usage"] <= 1
        assert load["queues"]["waiting"] == 2 and load["queues"]["paused"] == 0
        assert 0 <= load["num_waiting_uncached_tokens"] <= 2 * len(PROMPT)
        assert _num_requests(_loads(url, include="core").json()) == 6
    assert _num_requests(_wait(url, lambda x: _num_requests(x) == 0)) == 0
    assert {r["meta_info"]["finish_reason"]["type"] for r in out.values()} == {"abort"}


def test_the_counters_follow_prefills_and_decode_steps(url: str) -> None:
    before = _load(url, include="core")
    out: dict[str, Any] = {}
    _generate(url, "count-1", DECODE_LOG_INTERVAL + 10, out)
    # 1 token comes from the prefill, the rest from decode steps of one row; the last step is
    # recorded once it returns, which may be just after its answer went out
    steps = DECODE_LOG_INTERVAL + 9
    old = before["decode_moments"] or [0.0] * 6
    after = _wait(url, lambda x: x["decode_moments"][0] - old[0] >= steps)
    moments = after["decode_moments"]
    assert moments[0] - old[0] == steps  # steps
    assert moments[1] - old[1] == steps  # rows, one a step
    assert moments[3] - old[3] == steps  # rows squared
    assert moments[5] - old[5] == steps  # tokens generated
    assert moments[2] > old[2] and moments[4] > old[4]  # microseconds
    assert after["total_prefill_busy_us"] > before["total_prefill_busy_us"]
    grew = after["total_prefill_uncached_tokens"] - before["total_prefill_uncached_tokens"]
    assert 1 <= grew <= len(PROMPT)  # the prefix cache may hold the prompt's head
    assert after["gen_throughput"] > 0  # an interval of 40 steps closed just now
    # the same prompt again: the prefix cache supplies all of it but its last token
    _generate(url, "count-2", 1, out)
    hit = _load(url, include="core")
    assert hit["cache_hit_rate"] == round((len(PROMPT) - 1) / len(PROMPT), 4)


def test_a_pause_shows_in_the_queues_and_stops_the_throughput(url: str) -> None:
    """``in_place`` holds the running requests (``queues.paused``), ``retract`` sends them
    back to wait (``queues.retracted``); a pause of either mode zeroes ``gen_throughput``
    until an interval closes after it, as SGLang's ``pause_generation`` does."""
    with _in_flight(url, 2, slow=0.02) as out:
        _wait(url, lambda x: x["num_running_reqs"] == 2 and x["gen_throughput"] > 0, 60)
        resp = requests.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
        assert resp.status_code == 200
        load = _load(url)
        assert load["queues"]["paused"] == 2 and load["gen_throughput"] == 0
        requests.post(url + "/continue_generation", json={}, timeout=30)
        _wait(url, lambda x: x["gen_throughput"] > 0, 60)
        resp = requests.post(url + "/pause_generation", json={"mode": "retract"}, timeout=30)
        assert resp.status_code == 200
        load = _load(url)
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 2
        assert load["queues"]["retracted"] == 2 and load["queues"]["paused"] == 0
        assert load["gen_throughput"] == 0
        assert load["num_used_tokens"] == 0
        # the waiting requests bring their prompts and what they generated
        assert load["num_total_tokens"] > 2 * len(PROMPT)
        requests.post(url + "/continue_generation", json={}, timeout=30)
    # each answer counts the retraction (SGLang's meta_info.num_retractions)
    assert [a["meta_info"]["num_retractions"] for a in out.values()] == [1, 1]
    _wait(url, lambda x: _num_requests(x) == 0)


def test_the_memory_section_rounds_as_sglang(tmp_path: Path) -> None:
    """``weight_gb`` is the parameters' bytes in GiB to 3 places (``MemoryMetrics``): a
    quarter of a GiB of float32 parameters is 0.25."""
    import types

    import torch

    from stages.engine.load_routes import LoadRoutes

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.empty(1 << 26), requires_grad=False)  # 256 MiB
    model.b = torch.nn.Parameter(torch.empty(1 << 18), requires_grad=False)  # 1 MiB
    scheduler = types.SimpleNamespace(device=torch.device("cpu"))
    routes = LoadRoutes(scheduler, model, 1024, "v")  # type: ignore[arg-type]
    assert routes.weight_gb == round(257 / 1024, 3) == 0.251


# ---- the meter ------------------------------------------------------------------------------


def test_the_throughput_is_the_last_intervals_and_goes_stale() -> None:
    meter = LoadMeter()
    start = 1000.0
    meter.idle(start)
    assert meter.gen_throughput(start) == 0  # no interval closed yet
    assert meter.moments() is None
    for i in range(DECODE_LOG_INTERVAL):  # 4 rows a step, a step every 10 ms
        meter.decoded(4, 0.008, 4, start + 0.01 * (i + 1))
    end = start + 0.01 * DECODE_LOG_INTERVAL
    assert meter.gen_throughput(end) == pytest.approx(400.0)
    assert meter.gen_throughput(end + STALE_SECONDS + 1) == 0
    moments = meter.moments()
    assert moments == [DECODE_LOG_INTERVAL, 160, 320_000, 640, 1_280_000, 160]
    meter.paused(end)  # zero until the next interval closes
    assert meter.gen_throughput(end) == 0
    for i in range(DECODE_LOG_INTERVAL - 1):
        meter.decoded(2, 0.008, 2, end + 0.01 * (i + 1))
    assert meter.gen_throughput(end + 1) == 0
    meter.decoded(2, 0.008, 2, end + 0.01 * DECODE_LOG_INTERVAL)
    assert meter.gen_throughput(end + 1) == pytest.approx(200.0)
    meter.prefilled(0.25, uncached=30, hit=10)
    assert (meter.prefill_busy_us, meter.prefill_uncached_tokens) == (250_000, 30)
    assert meter.cache_hit_rate == 0.25
    meter.prefilled(0.0, uncached=0, hit=0)
    assert meter.cache_hit_rate == 0.0


def test_a_loaded_adapter_adds_the_lora_section(url: str, model: Path, tmp_path: Path) -> None:
    """SGLang adds ``lora`` with LoRA on: adapters used by running rows over the slots. The
    engine's adapters have no fixed slots: those loaded are the total."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path)
    resp = requests.post(
        url + "/load_lora_adapter",
        json={"lora_name": "load-a", "lora_path": str(tmp_path)},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    try:
        load = _load(url)
        assert list(load) == [*CORE, "memory", "lora", "disaggregation", "queues"]
        assert load["lora"] == {"slots_used": 0, "slots_total": 1, "utilization": 0.0}
        with _in_flight(url, 1, slow=0.05, lora_path="load-a"):
            load = _wait(url, lambda x: x["num_running_reqs"] == 1)
            assert load["lora"] == {"slots_used": 1, "slots_total": 1, "utilization": 1.0}
            assert _load(url, include="core,lora")["lora"]["slots_used"] == 1
    finally:
        resp = requests.post(url + "/unload_lora_adapter", json={"lora_name": "load-a"}, timeout=30)
        assert resp.status_code == 200, resp.text
    assert "lora" not in _load(url)
