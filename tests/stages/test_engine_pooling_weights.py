"""Weight updates of a reward model served by the built-in pooling engine, as SGLang 0.5.23 serves
its weight routes on any model (``http_server.py``: ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/update_weight_version``, ``/get_weights_by_name``; one
``ModelRunner`` loads a reward model's weights as a policy's): the scores after each update are
transformers' scores of the new weights, and a checkpoint that does not fit changes nothing."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import classifier_reference
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.test_engine_tensor_weights import serialize, shared_files  # noqa: F401
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

TEXT = "w5 w6 w7 w8 w9"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm-weights")
    return {
        "a": make_tiny_classifier(root / "a", seed=3),
        "b": make_tiny_classifier(root / "b", seed=8),
        "lm": make_tiny_model(root / "lm", seed=2, vocab=64),  # another architecture and size
    }


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("rm-weights-log") / "engine.log"
    with serving(folders["a"], log) as eng:
        yield eng


def _score(engine: Engine, ids: list[int]) -> tuple[list[float], str]:
    status, out = engine.request("POST", "/classify", {"input_ids": ids})
    assert status == 200, out
    return out["embedding"], out["meta_info"]["weight_version"]


def _scores_of(engine: Engine, folder: Path, ids: list[int]) -> None:
    got, _ = _score(engine, ids)
    want, scale = classifier_reference(folder, ids)
    terms = forward_terms(AutoConfig.from_pretrained(folder), len(ids))
    assert_close(got, want, terms=terms, scale=scale)


def _post(engine: Engine, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    return engine.request("POST", route, body)


@pytest.mark.timeout(120)
def test_a_reward_model_takes_new_weights_from_disk_and_from_tensors(
    engine: Engine,
    folders: dict[str, Path],
    shared_files: None,  # noqa: F811
) -> None:
    ids = _tokenizer(engine).encode(TEXT)
    _scores_of(engine, folders["a"], ids)
    a_score, _ = _score(engine, ids)

    status, answer = _post(
        engine,
        "/update_weights_from_disk",
        {"model_path": str(folders["b"]), "weight_version": "b1"},
    )
    assert (status, answer) == (200, {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to b1.",
        "num_paused_requests": 0,
    })  # fmt: skip
    _scores_of(engine, folders["b"], ids)
    assert _score(engine, ids)[1] == "b1"
    assert engine.request("GET", "/get_weight_version")[1] == {"weight_version": "b1"}
    status, rows = _post(
        engine, "/get_weights_by_name", {"name": "score.weight", "truncate_size": 1}
    )
    b_head = load_file(folders["b"] / "model.safetensors")["score.weight"]
    assert status == 200 and rows == b_head[:1].float().tolist()

    # a checkpoint of another model: refused, the weights as they were
    status, answer = _post(engine, "/update_weights_from_disk", {"model_path": str(folders["lm"])})
    assert status == 400 and answer["success"] is False, answer
    _scores_of(engine, folders["b"], ids)

    # a trainer's tensors, shared in memory (SGLang's update_weights_from_tensor), in a session
    a = list(load_file(folders["a"] / "model.safetensors").items())
    assert _post(engine, "/begin_weight_update", {})[0] == 200
    status, answer = _post(
        engine,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize(a)], "weight_version": "a2"},
    )
    assert _post(engine, "/end_weight_update", {})[0] == 200
    assert status == 200 and answer["success"] is True, answer
    score, version = _score(engine, ids)
    assert score == a_score and version == "a2"

    status, answer = _post(
        engine, "/update_weight_version", {"new_version": "a3", "abort_all_requests": False}
    )
    assert (status, answer["new_version"]) == (200, "a3")
    assert _score(engine, ids) == (a_score, "a3")


@pytest.mark.timeout(60)
def test_a_checker_digest_follows_the_update(engine: Engine, folders: dict[str, Path]) -> None:
    """``/weights_checker`` reads the weights the pooling thread holds after an update."""
    status, answer = _post(engine, "/weights_checker", {"action": "snapshot"})
    assert status == 200, answer
    status, answer = _post(engine, "/weights_checker", {"action": "compare"})
    assert status == 200 and answer["success"] is True, answer
    status, _ = _post(engine, "/update_weights_from_disk", {"model_path": str(folders["b"])})
    assert status == 200
    status, answer = _post(engine, "/weights_checker", {"action": "compare"})
    assert status == 400 and answer["success"] is False, answer


@pytest.mark.timeout(90)
def test_a_reward_model_takes_a_trainers_broadcast(
    engine: Engine, folders: dict[str, Path]
) -> None:
    """``/update_weights_from_distributed``: the engine joins this test's gloo group as rank 1
    and receives a trainer's tensors, one broadcast each, as a publisher sends a policy's."""
    from stages.weights.buckets import dtype_name
    from stages.weights.group import init_weight_group
    from transport.address import rendezvous_port

    ids = _tokenizer(engine).encode(TEXT)
    port = rendezvous_port("127.0.0.1")
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "group_name": "rm"}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        rank0 = pool.submit(
            init_weight_group, backend="gloo", master_address="127.0.0.1", master_port=port,
            rank=0, world_size=2, group_name="rm", timeout_s=30,
        )  # fmt: skip
        joined = _post(engine, "/init_weights_update_group", join)
        group = rank0.result(timeout=30)
        try:
            assert joined[0] == 200, joined
            tensors = list(load_file(folders["b"] / "model.safetensors").items())
            update = {
                "names": [n for n, _ in tensors],
                "dtypes": [dtype_name(t.dtype) for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
                "group_name": "rm",
                "weight_version": "b-dist",
            }
            assert _post(engine, "/begin_weight_update", {})[0] == 200
            sent = pool.submit(_post, engine, "/update_weights_from_distributed", update)
            for _, tensor in tensors:
                group.broadcast(tensor.contiguous(), src=0)
            status, answer = sent.result(timeout=60)
            assert _post(engine, "/end_weight_update", {})[0] == 200
            assert status == 200 and answer["success"] is True, answer
            _scores_of(engine, folders["b"], ids)
            assert _score(engine, ids)[1] == "b-dist"
            left = _post(engine, "/destroy_weights_update_group", {"group_name": "rm"})
            assert left[0] == 200, left
        finally:
            group.destroy()


@pytest.mark.timeout(90)
def test_a_colocated_trainers_turn_holds_prompts_until_the_weights_are_back(
    engine: Engine, folders: dict[str, Path]
) -> None:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang's
    ``ReleaseMemoryOccupationReqInput``): while released, a prompt waits and weight reads and
    updates are refused; after the resume it is scored by the weights as they were."""
    ids = _tokenizer(engine).encode(TEXT)
    before = _score(engine, ids)
    assert _post(engine, "/release_memory_occupation", {"tags": None}) == (200, None)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_score, engine, ids)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=0.5)  # held while released
        status, answer = _post(engine, "/get_weights_by_name", {"name": "score.weight"})
        assert status == 400 and "the weights are released" in answer["error"]["message"]
        status, answer = _post(
            engine, "/update_weights_from_disk", {"model_path": str(folders["a"])}
        )
        assert status == 400 and "the weights are released" in answer["message"], answer
        # a second release while a prompt waits: SGLang's words (idle only)
        status, answer = _post(engine, "/release_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "only when server is idle" in answer["error"]["message"]
        assert _post(engine, "/resume_memory_occupation", {"tags": None}) == (200, None)
        assert waiting.result(timeout=30) == before
    status, answer = _post(engine, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "is not released" in answer["error"]["message"]
