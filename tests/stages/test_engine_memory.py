"""``/release_memory_occupation`` and ``/resume_memory_occupation`` as SGLang 0.5.23 serves them
(``http_server.py``: 200 ``null``, or 400 ``{"error": {"message"}}`` from
``_create_error_response``; ``scheduler_components/weight_updater.py``: the server must be idle
unless paused, tags default to ``kv_cache``, ``weights`` and ``cuda_graph``, resuming a tag not
released fails) on a real engine server, and what each tag gives back on the scheduler itself.
The weights' round trip through host memory runs where CUDA is (``test_weights_leave_the_gpu_
and_come_back_unchanged``; the device machine runs it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.loader import load_model
from stages.engine.memory_offload import IDLE_ONLY, MemoryStateError, WeightOffload
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 90]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("memory") / "m", seed=1)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with builtin_engine(model, "--max-running", "4") as found:
        yield found


def _post(url: str, route: str, body: Any = None, **kw: Any) -> requests.Response:
    return requests.post(url + route, json=body, timeout=30, **kw)


def _generate(url: str, n: int = 8) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    resp = _post(url, "/generate", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _info(url: str) -> dict[str, Any]:
    return requests.get(url + "/server_info", timeout=10).json()


def _in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}

    def run() -> None:
        got["resp"] = _post(url, "/generate", body)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, got


def _wait(cond: Any, what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_a_release_holds_generation_until_the_resume_and_changes_nothing(url: str) -> None:
    before = _generate(url)
    resp = _post(url, "/release_memory_occupation", {})  # no tags: all of them
    assert (resp.status_code, resp.json()) == (200, None)
    assert _info(url)["released_memory"] == ["kv_cache", "weights", "cuda_graph"]
    worker, got = _in_background(
        url, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    )
    _wait(lambda: _info(url)["num_waiting_reqs"] == 1, "the request never queued")
    time.sleep(0.2)
    assert worker.is_alive() and _info(url)["num_waiting_reqs"] == 1  # held, not run
    # weights first (a colocated trainer loads the new ones), then the KV cache
    assert _post(url, "/resume_memory_occupation", {"tags": ["weights"]}).json() is None
    time.sleep(0.1)
    assert worker.is_alive()  # the KV cache is still out
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).ok
    worker.join(20)
    assert got["resp"].status_code == 200 and got["resp"].json()["output_ids"] == before
    assert _info(url)["released_memory"] == []
    assert _generate(url) == before


@pytest.mark.timeout(60)
def test_a_release_while_a_request_runs_is_refused_as_sglang_refuses_it(url: str) -> None:
    worker, got = _in_background(
        url, {"input_ids": [60, 61], "sampling_params": {**GREEDY, "max_new_tokens": 400}}
    )
    _wait(lambda: _info(url)["num_running_reqs"] == 1, "the request never started")
    resp = _post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert (resp.status_code, resp.json()) == (400, {"error": {"message": IDLE_ONLY}})
    worker.join(30)
    assert len(got["resp"].json()["output_ids"]) == 400  # it ran on, whole
    assert _info(url)["released_memory"] == []
    refused = _info(url)["refused_requests"]
    assert refused.get("POST /release_memory_occupation 400", 0) >= 1


@pytest.mark.timeout(60)
def test_a_paused_engine_releases_with_requests_waiting(url: str) -> None:
    """Retracted requests wait (SGLang's ``ignore_waiting`` when paused) and run after."""
    before = _generate(url, 6)
    worker, got = _in_background(
        url, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    )
    assert _post(url, "/pause_generation", {"mode": "retract"}).ok
    # retracted, or held by the pause (sent after it), or already answered
    _wait(
        lambda: (
            (info := _info(url))["num_waiting_reqs"]
            + info["num_held_reqs"]
            + (not worker.is_alive())
            >= 1
        ),
        "no request",
    )
    assert _post(url, "/release_memory_occupation", {"tags": ["kv_cache"]}).ok
    assert _post(url, "/continue_generation", {}).ok
    time.sleep(0.1)
    assert worker.is_alive() or got["resp"].json()["output_ids"] == before
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).ok
    worker.join(20)
    assert got["resp"].json()["output_ids"] == before


@pytest.mark.timeout(60)
def test_weight_routes_wait_for_the_weights_and_bad_bodies_get_sglangs_400(
    url: str, model: Path
) -> None:
    resp = _post(url, "/resume_memory_occupation", {"tags": ["weights"]})  # never released
    assert resp.status_code == 400
    assert "'weights' is not released" in resp.json()["error"]["message"]
    for body, words in (
        ({"tags": "weights"}, "tags: Input should be a valid list"),
        ({"tags": [1]}, "tags.0: Input should be a valid string"),
    ):  # the struct's field types, in SGLang's validation answer (control_fields)
        resp = _post(url, "/release_memory_occupation", body)
        assert resp.status_code == 400
        assert resp.json()["type"] == "Bad Request" and resp.json()["message"] == words
    resp = requests.post(url + "/release_memory_occupation", timeout=10)  # no body: required
    assert (resp.status_code, resp.json()["message"]) == (400, "body: Field required")
    assert _post(url, "/release_memory_occupation", {"tags": ["weights"]}).ok
    resp = _post(url, "/update_weights_from_disk", {"model_path": str(model)})
    assert resp.status_code == 400 and not resp.json()["success"]
    assert "the weights are released" in resp.json()["message"]
    resp = _post(url, "/get_weights_by_name", {"name": "model.norm.weight"})
    assert resp.status_code == 400 and "the weights are released" in resp.json()["error"]["message"]
    resp = requests.get(url + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=10)
    assert (resp.status_code, resp.json()) == (200, None)  # GET too, as SGLang routes it
    assert _post(url, "/update_weights_from_disk", {"model_path": str(model)}).json()["success"]


def _scheduler(model: Path, device: str = "cpu") -> Scheduler:
    loaded = load_model(model, device=device)
    return Scheduler(loaded.model, max_running=4, eos_token_ids=loaded.eos_token_ids)


def _greedy(scheduler: Scheduler, rid: str, n: int = 8) -> list[int]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    future = scheduler.submit(GenerateInput(rid, PROMPT, params, False))
    scheduler.run_until_idle()
    return future.result(timeout=0).output_ids


@pytest.mark.timeout(60)
def test_the_kv_cache_is_freed_and_allocated_again(model: Path) -> None:
    scheduler = _scheduler(model)
    before = _greedy(scheduler, "a")
    assert scheduler._kv.columns > 0 and scheduler.prefix_cache_stats()["tokens"] > 0
    released = scheduler.release_memory(["kv_cache"])
    scheduler.step()  # the command runs at the step boundary
    assert released.result(timeout=0) == ["kv_cache"]
    assert scheduler._kv.columns == 0 and not scheduler._kv._stores
    assert scheduler.prefix_cache_stats()["tokens"] == 0
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    held = scheduler.submit(GenerateInput("b", PROMPT, params, False))
    assert not scheduler.step() and not held.done()  # nothing runs while it is out
    refused = scheduler.resume_memory(["weights", "kv_cache"])
    scheduler.step()
    with pytest.raises(MemoryStateError, match="'weights' is not released"):
        refused.result(timeout=0)
    assert scheduler.released_memory == ["kv_cache"]  # a refused resume changes nothing
    scheduler.resume_memory(["kv_cache"])
    scheduler.run_until_idle()
    assert held.result(timeout=0).output_ids == before
    assert scheduler._kv.columns > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_weights_leave_the_gpu_and_come_back_unchanged(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", seed=1, hidden=256, layers=4, intermediate=1024)
    scheduler = _scheduler(model, "cuda")
    before = _greedy(scheduler, "a")
    snapshot = {k: v.clone() for k, v in scheduler.model.state_dict().items()}
    used = torch.cuda.memory_allocated()
    offload = WeightOffload(scheduler.model)
    assert offload.nbytes >= sum(v.numel() * v.element_size() for v in snapshot.values()) // 2
    fut = scheduler.release_memory(["weights", "kv_cache"])
    scheduler.step()
    assert fut.result(timeout=0) == ["weights", "kv_cache"]
    freed = used - torch.cuda.memory_allocated()
    assert freed >= offload.nbytes, (freed, offload.nbytes)
    resumed = scheduler.resume_memory(["weights", "kv_cache"])  # None: cuda_graph's too
    scheduler.step()
    assert resumed.result(timeout=0) == ["weights", "kv_cache"]
    for name, value in scheduler.model.state_dict().items():
        assert torch.equal(value, snapshot[name]), name
    assert _greedy(scheduler, "b") == before
