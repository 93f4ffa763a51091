"""A new engine's weights from a running one (``--load-format remote_instance``), through real
engine server processes, as SGLang 0.5.23 exchanges them: ``model_loader/loader.py``
(``load_model_from_remote_instance_by_nccl``: the group joined as rank 1, the send asked for,
every ``named_parameters`` tensor broadcast from rank 0), ``remote_instance_weight_loader_utils
.py`` (the two requests' bodies), ``connector/remote_instance.py`` (the group's name,
``send_weights_<address>_<port>_<tp_rank>``, and its barrier), ``model_runner_components/
weight_exporter.py`` (the seed's side and its messages) and ``entrypoints/http_server.py``
(``{success, message}``, 400 on failure).

The seed is started on model A and then loads B's weights from disk under version 7, so a new
engine started on A's folder serves B's weights only if they came from the seed.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from stages.engine.memory_offload import KV_CACHE, WEIGHTS, MemoryState, MemoryStateError
from stages.engine.server import _parser, remote_seed
from tests.stages import engine_setup
from tests.stages.engine_setup import (
    EngineProcess,
    builtin_engine,
    free_port,
    hf_greedy,
    load_reference,
    two_tiny_models,
)

PROMPT = [5, 17, 33, 8, 90]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return two_tiny_models(tmp_path_factory)


@pytest.fixture(scope="module")
def seed(models: tuple[Path, Path]) -> Iterator[str]:
    a, b = models
    with builtin_engine(a, "--max-running", "4") as url:
        answer = requests.post(
            url + "/update_weights_from_disk",
            json={"model_path": str(b), "weight_version": "7"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        yield url


def _flags(seed_url: str, group_port: int) -> list[str]:
    port = seed_url.rsplit(":", 1)[1]
    # on one GPU (tests.cuda_engines) NCCL cannot join both engines: gloo, through the host
    one_gpu = ["--remote-instance-weight-loader-backend", "gloo"]
    return [
        *(one_gpu if engine_setup.ENGINE_DEVICE == "cuda" else []),
        "--load-format",
        "remote_instance",
        "--remote-instance-weight-loader-seed-instance-ip",
        "127.0.0.1",
        "--remote-instance-weight-loader-seed-instance-service-port",
        port,
        "--remote-instance-weight-loader-send-weights-group-ports",
        f"[{group_port}]",
    ]


def _greedy(url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    answer = requests.post(url + "/generate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def _checksums(url: str) -> dict[str, str]:
    answer = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["ranks"][0]["checksums"]


def _post(url: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    answer = requests.post(url + route, json=body, timeout=30)
    return answer.status_code, answer.json()


@pytest.mark.timeout(120)
def test_a_new_engine_serves_the_seeds_live_weights_and_version(
    seed: str, models: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = models
    want_b = hf_greedy(load_reference(b), PROMPT, 10)
    assert want_b != hf_greedy(load_reference(a), PROMPT, 10)  # the test tells them apart
    group_port = free_port()
    log = tmp_path / "new.log"
    with builtin_engine(a, *_flags(seed, group_port), output=log) as new:
        assert _greedy(new) == want_b  # B's weights: the seed's, not A's folder's
        assert _checksums(new) == _checksums(seed)  # every tensor, bit for bit
        assert requests.get(new + "/get_weight_version", timeout=10).json() == {
            "weight_version": "7"
        }
        assert "weights_from_remote_instance" in log.read_text()
        # /model_info's load_format: SGLang's config value (http_server.py 827)
        info = requests.get(new + "/model_info", timeout=10).json()
        assert info["load_format"] == "remote_instance"
    assert requests.get(seed + "/model_info", timeout=10).json()["load_format"] == "auto"
    assert _greedy(seed) == want_b  # the seed serves on
    # the seed destroyed the group once it sent (weight_exporter.py): a second send finds none
    status, answer = _post(
        seed,
        "/send_weights_to_remote_instance",
        {"master_address": "127.0.0.1", "ports": str(group_port), "group_name": "send_weights_x"},
    )
    assert status == 400 and answer == {
        "success": False,
        "message": f"Group send_weights_x_{group_port}_0 not in _weights_send_group list. "
        "Please call `init_weights_send_group_for_remote_instance` first.",
    }


@pytest.mark.timeout(120)
def test_the_seed_sends_between_two_updates_never_in_the_middle_of_one(
    seed: str, models: tuple[Path, Path], tmp_path: Path
) -> None:
    """A send asked for while a weight-update session is open (``/begin_weight_update``, the
    publisher's buckets arriving one request each) waits for its end: between two buckets the
    seed holds a mix of two versions under the older one's name."""
    status, _ = _post(seed, "/begin_weight_update", {})
    assert status == 200
    log = tmp_path / "new.log"
    engine = EngineProcess(models[0], *_flags(seed, free_port()), output=log)
    try:
        deadline = time.monotonic() + 40
        while "remote_instance_group_joined" not in (log.read_text() if log.exists() else ""):
            assert engine.proc.poll() is None and time.monotonic() < deadline, engine.tail()
            time.sleep(0.2)
        time.sleep(1.5)  # it has asked for the weights: the seed waits for the session's end
        assert engine.proc.poll() is None, engine.tail()
        assert "weights_from_remote_instance" not in log.read_text()
        status, _ = _post(seed, "/end_weight_update", {})
        assert status == 200
        new = engine.wait_up(60)
        assert _checksums(new) == _checksums(seed)
        assert "weights_from_remote_instance" in log.read_text()
    finally:
        engine.stop(10)


@pytest.mark.timeout(60)
def test_the_seed_refuses_what_it_cannot_do_in_sglangs_words(seed: str) -> None:
    route = "/init_weights_send_group_for_remote_instance"
    body = {"master_address": "127.0.0.1", "ports": "29999", "group_rank": 0, "world_size": 2}

    def refused(**change: Any) -> str:
        status, answer = _post(seed, route, {**body, **change})
        assert status == 400 and answer["success"] is False, answer
        return answer["message"]

    assert refused(ports="29999,30001") == "Expected 1 ports, but got 2 ports."
    assert refused(group_name="") == "Group name cannot be empty"
    assert "rank 0" in refused(group_rank=1)  # the sender broadcasts from rank 0
    # SGLang's loader asks for nccl; a CPU engine cannot run it and says what to ask for
    if engine_setup.ENGINE_DEVICE == "cpu":
        assert "ask for gloo" in refused(backend="nccl")
    assert "ports" in refused(ports="a-port")
    # a body its struct cannot read: SGLang's validation answer (FastAPI's 400 here)
    status, answer = _post(seed, route, {"master_address": "127.0.0.1"})
    assert status == 400 and "ports" in str(answer)
    status, answer = _post(seed, "/send_weights_to_remote_instance", {"ports": "1"})
    assert status == 400 and "master_address" in str(answer)
    assert requests.get(seed + "/health", timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_a_new_engine_whose_seed_cannot_be_reached_fails_at_once_saying_why(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    log = tmp_path / "new.log"
    nobody = f"http://127.0.0.1:{free_port()}"
    engine = EngineProcess(models[0], *_flags(nobody, free_port()), output=log)
    started = time.monotonic()
    try:
        code = engine.proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        engine.stop(5)
        pytest.fail(f"the engine kept waiting for a seed that is not there:\n{engine.tail()}")
    assert code == 2, engine.tail()
    said = log.read_text()
    assert "engine_model_load_failed" in said and "could not be called" in said, said
    assert time.monotonic() - started < 40


@pytest.mark.timeout(120)
def test_a_seed_whose_weights_are_released_refuses_and_the_new_engine_fails(
    seed: str, models: tuple[Path, Path], tmp_path: Path
) -> None:
    status, _ = _post(seed, "/release_memory_occupation", {"tags": ["weights"]})
    assert status == 200
    log = tmp_path / "new.log"
    try:
        engine = EngineProcess(models[0], *_flags(seed, free_port()), output=log)
        try:
            code = engine.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.stop(5)
            pytest.fail(f"the engine did not fail:\n{engine.tail()}")
    finally:
        status, _ = _post(seed, "/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 200
    assert code == 2, engine.tail()
    said = log.read_text()
    assert "the weights are released" in said, said
    assert len(_greedy(seed)) == 10  # resumed, it serves on


def test_incomplete_seed_flags_load_the_checkpoint_as_sglang_falls_back() -> None:
    """``arg_groups/model_path_hook.py``: without the seed's address, or without the group's
    ports, SGLang warns and loads as ``auto``."""
    parse = _parser().parse_args
    base = ["--model", "m", "--load-format", "remote_instance"]
    assert remote_seed(parse(base)) is None
    ip = ["--remote-instance-weight-loader-seed-instance-ip", "10.0.0.1"]
    port = ["--remote-instance-weight-loader-seed-instance-service-port", "30000"]
    assert remote_seed(parse([*base, *ip, *port])) is None  # no group ports
    ports = ["--remote-instance-weight-loader-send-weights-group-ports", "[30100]"]
    found = remote_seed(parse([*base, *ip, *port, *ports]))
    assert found is not None and (found.url, found.group_ports) == (
        "http://10.0.0.1:30000",
        (30100,),
    )
    with pytest.raises(ValueError, match=r"torch\.distributed group only"):
        more = ["--remote-instance-weight-loader-backend", "transfer_engine"]
        remote_seed(parse([*base, *ip, *port, *ports, *more]))
    with pytest.raises(SystemExit):  # not a JSON list of ports: argparse's error
        parse([*base, "--remote-instance-weight-loader-send-weights-group-ports", "30100"])


def test_weights_lent_to_a_send_may_not_be_released_but_the_kv_cache_may() -> None:
    state = MemoryState()
    state.lent = 1
    with pytest.raises(MemoryStateError, match="being sent to a remote instance"):
        state.to_release([WEIGHTS], idle=True)
    assert state.released == []
    assert state.to_release([KV_CACHE], idle=True) == [KV_CACHE]
    state.lent = 0
    assert state.to_release(None, idle=True) == [WEIGHTS, "cuda_graph"]


@pytest.mark.timeout(120)
def test_a_new_pooling_engine_takes_a_running_reward_models_weights(tmp_path: Path) -> None:
    """The same exchange between two pooling engines (a reward model scaled out in a run that
    trains it): the seed serves A and loaded B's weights as version 3; the new engine, started
    on A's folder, scores as B. ``--load-format dummy`` is not ignored there either."""
    from tests.stages.engine_setup import classifier_reference
    from tests.stages.tiny_model import make_tiny_classifier

    a = make_tiny_classifier(tmp_path / "a", seed=3)
    b = make_tiny_classifier(tmp_path / "b", seed=4)
    want_b, scale = classifier_reference(b, PROMPT)
    want_a, _ = classifier_reference(a, PROMPT)
    assert abs(want_a[0] - want_b[0]) > 1e-3  # the test tells them apart

    def reward(url: str) -> float:
        status, out = _post(url, "/classify", {"input_ids": PROMPT})
        assert status == 200, out
        return out["embedding"][0]

    with builtin_engine(a) as seed:
        status, out = _post(
            seed, "/update_weights_from_disk", {"model_path": str(b), "weight_version": "3"}
        )
        assert status == 200, out
        with builtin_engine(a, *_flags(seed, free_port()), output=tmp_path / "new.log") as new:
            assert reward(new) == pytest.approx(want_b[0], abs=1e-5 * max(scale, 1.0))
            assert _checksums(new) == _checksums(seed)
            assert requests.get(new + "/get_weight_version", timeout=10).json() == {
                "weight_version": "3"
            }
        assert reward(seed) == pytest.approx(want_b[0], abs=1e-5 * max(scale, 1.0))
    with builtin_engine(a, "--load-format", "dummy") as drawn:
        assert abs(reward(drawn) - want_a[0]) > 1e-3  # drawn weights, not the checkpoint's
