"""``/start_profile`` and ``/stop_profile`` on the built-in engine as a real server, as SGLang
0.5.23 profiles (``http_server.py``, ``tokenizer_control_mixin.start_profile``,
``scheduler_components/profiler_manager.py``): a torch profiler around the scheduler's steps,
stopped by ``num_steps`` or by the route, its Chrome trace at
``OUTPUT_DIR/[PREFIX-]PROFILE_ID-TP-0.trace.json.gz``."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.stages import engine_setup
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="module")
def url(folder: Path) -> Iterator[str]:
    model = make_tiny_model(folder / "model", seed=1)
    env = {"SGLANG_TORCH_PROFILER_DIR": str(folder / "default")}  # SGLang's variable
    with builtin_engine(model, env=env) as found:
        yield found


def _post(url: str, route: str, body: dict | None = None) -> requests.Response:
    return requests.post(url + route, json=body, timeout=60)


def _ops(trace: Path) -> set[str]:
    with gzip.open(trace, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


@pytest.mark.timeout(120)
def test_a_profile_of_num_steps_writes_its_trace_by_itself(url: str, tmp_path: Path) -> None:
    body = {"output_dir": str(tmp_path), "profile_id": "p1", "num_steps": 3}
    started = _post(url, "/start_profile", body)
    assert (started.status_code, started.text) == (200, "Start profiling.\n")
    again = _post(url, "/start_profile", body)  # SGLang: a RuntimeError (500); here a 400
    assert again.status_code == 400 and "already in progress" in again.text
    assert _post(url, "/generate", GENERATE).status_code == 200
    trace = tmp_path / "p1-TP-0.trace.json.gz"
    assert trace.exists()  # after 3 decode steps, before the 8th token
    assert any(name.startswith("aten::") for name in _ops(trace))
    stopped = _post(url, "/stop_profile")
    assert stopped.status_code == 400 and "not in progress" in stopped.text


@pytest.mark.timeout(120)
def test_a_profile_runs_until_stop_profile_and_may_wait_for_its_step(
    url: str, folder: Path, tmp_path: Path
) -> None:
    started = requests.get(url + "/start_profile", timeout=60)  # no body: SGLang's defaults
    assert started.status_code == 200
    status = _post(url, "/stop_profile")
    assert (status.status_code, status.text) == (200, "Stop profiling. This will take some time.\n")
    # the defaults: SGLANG_TORCH_PROFILER_DIR (else /tmp), named by the start's time
    assert len(list((folder / "default").glob("*-TP-0.trace.json.gz"))) == 1
    body = {"output_dir": str(tmp_path), "profile_prefix": "run"}
    assert _post(url, "/start_profile", body).status_code == 200
    assert _post(url, "/generate", GENERATE).status_code == 200
    assert _post(url, "/stop_profile").status_code == 200
    (trace,) = tmp_path.glob("run-*-TP-0.trace.json.gz")
    assert any(name.startswith("aten::") for name in _ops(trace))
    steps = requests.get(url + "/server_info", timeout=10).json()["decode_steps"]
    later = {"output_dir": str(tmp_path), "profile_id": "later", "start_step": steps + 3,
             "num_steps": 2}  # fmt: skip
    assert _post(url, "/start_profile", later).status_code == 200
    assert _post(url, "/generate", {**GENERATE, "sampling_params": {"max_new_tokens": 2}})
    assert not (tmp_path / "later-TP-0.trace.json.gz").exists()  # its step not reached yet
    early = _post(url, "/stop_profile")  # not running yet, as SGLang sees it: refused, armed
    assert early.status_code == 400 and "not in progress" in early.text
    assert _post(url, "/generate", GENERATE).status_code == 200
    assert (tmp_path / "later-TP-0.trace.json.gz").exists()


@pytest.mark.timeout(60)
def test_what_cannot_be_profiled_here_is_refused_naming_the_field(url: str) -> None:
    on_cpu = engine_setup.ENGINE_DEVICE == "cpu"
    cases = [
        ({"activities": ["RPD"]}, "activities"),
        # (on a GPU the memory profile runs: tests.cuda_engines)
        *([({"activities": ["MEM"]}, "needs the engine on a CUDA device")] * on_cpu),
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": "three"}, "num_steps: Input should be a valid integer"),  # ProfileReq's
        ({"profile_by_stage": True}, "profile_by_stage"),
        ({"with_stack": "perhaps"}, "with_stack: Input should be a valid boolean"),
        ({"req_type": 3}, "req_type: Input should be 1 or 2"),
    ]
    for body, words in cases:
        answer = _post(url, "/start_profile", body)
        assert answer.status_code == 400 and words in answer.text, (body, answer.text)
    assert _post(url, "/stop_profile").status_code == 400  # nothing was started
    assert _post(url, "/generate", GENERATE).status_code == 200
