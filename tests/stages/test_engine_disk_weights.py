"""``/update_weights_from_disk`` and ``/get_weights_by_name`` on the built-in engine as a real
server, as SGLang 0.5.23 answers them (``http_server.py``, ``scheduler_components/
weight_updater.py``, ``model_runner_components/weight_updater.py``, ``models/llama.py``).

One engine for the module, started on model A; each test loads what it needs first. The
other checkpoints are models of the same shape with other seeds: B as ``save_pretrained`` saves
it (safetensors), B again in two shards with an index, C's weights alone as a PyTorch ``.bin``,
and B with one tensor of the wrong shape. The last test checks the choice of files alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from stages.engine.checkpoint_files import CheckpointError, read_weights, weight_files
from tests.stages.engine_setup import builtin_engine, hf_greedy, load_reference
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 90]
GREEDY = {"temperature": 0, "ignore_eos": True}
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # [32, 32]


class Models:
    def __init__(self, root: Path) -> None:
        self.a = make_tiny_model(root / "a", seed=1)
        self.b = make_tiny_model(root / "b", seed=2)
        made = make_tiny_model(root / "c", seed=3, with_tokenizer=False)
        # the same weights as a PyTorch checkpoint alone: what transformers 4's save_pretrained
        # (safe_serialization=False) wrote; transformers 5 writes safetensors only
        self.c_bin = root / "c_bin"
        self.c_bin.mkdir()
        torch.save(load_file(made / "model.safetensors"), self.c_bin / "pytorch_model.bin")
        self.b_tensors = load_file(self.b / "model.safetensors")
        self.b_sharded = _shard(self.b_tensors, root / "b_sharded")
        self.bad = root / "bad"  # B with one tensor of the wrong shape, after the good ones
        self.bad.mkdir()
        broken = dict(self.b_tensors)
        broken["model.norm.weight"] = torch.ones(7)
        save_file(broken, self.bad / "model.safetensors")
        self.empty = root / "empty"
        self.empty.mkdir()
        (self.empty / "notes.txt").write_text("no weights here")
        self.greedy = {
            name: hf_greedy(load_reference(path), PROMPT, 12)
            for name, path in (("a", self.a), ("b", self.b), ("c", made))
        }
        assert len({tuple(g) for g in self.greedy.values()}) == 3  # the seeds differ


def _shard(tensors: dict[str, torch.Tensor], folder: Path, *, index: bool = True) -> Path:
    """``tensors`` in two safetensors shards (with ``model.safetensors.index.json``), and a
    stray ``consolidated.safetensors`` of wrong shapes that only the index leaves out."""
    folder.mkdir()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / file)
    save_file({names[0]: torch.zeros(3)}, folder / "consolidated.safetensors")
    if index:
        weight_map = {n: file for file, part in shards.items() for n in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("disk_weights"))


@pytest.fixture(scope="module")
def url(models: Models) -> Iterator[str]:
    with builtin_engine(models.a, "--max-running", "4") as found:
        yield found


def _update(url: str, **body: Any) -> tuple[int, dict[str, Any]]:
    resp = requests.post(url + "/update_weights_from_disk", json=body, timeout=30)
    return resp.status_code, resp.json()


def _generate(url: str, n: int = 12) -> dict[str, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    resp = requests.post(url + "/generate", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _weights(url: str, name: str, method: str = "POST", **more: Any) -> tuple[int, Any]:
    resp = requests.request(
        method, url + "/get_weights_by_name", json={"name": name, **more}, timeout=30
    )
    return resp.status_code, resp.json()


def _info(url: str) -> dict[str, Any]:
    return requests.get(url + "/model_info", timeout=10).json()


def _wait_running(url: str) -> None:
    deadline = time.monotonic() + 10
    while requests.get(url + "/server_info", timeout=10).json()["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.002)


def _long_request(url: str, result: dict[str, Any]) -> threading.Thread:
    body = {"input_ids": [60, 61], "sampling_params": {**GREEDY, "max_new_tokens": 480}}

    def run() -> None:
        result["out"] = requests.post(url + "/generate", json=body, timeout=60).json()

    worker = threading.Thread(target=run)
    worker.start()
    _wait_running(url)
    return worker


@pytest.mark.timeout(60)
def test_greedy_output_becomes_the_loaded_checkpoints(url: str, models: Models) -> None:
    assert _generate(url)["output_ids"] == models.greedy["a"]
    status, answer = _update(url, model_path=str(models.b), weight_version="b1")
    assert (status, answer) == (
        200,
        {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to b1.",
            "num_paused_requests": 0,
        },
    )
    out = _generate(url)
    assert out["output_ids"] == models.greedy["b"]
    assert out["meta_info"]["weight_version"] == "b1"
    info = _info(url)
    assert info["weight_version"] == "b1" and info["model_path"] == str(models.b)
    # a PyTorch .bin folder (load_format null: SGLang's auto, *.bin when no *.safetensors);
    # no weight_version: the version stays
    status, answer = _update(url, model_path=str(models.c_bin), load_format=None)
    assert status == 200 and answer["message"] == "Succeeded to update model weights."
    out = _generate(url)
    assert out["output_ids"] == models.greedy["c"] and out["meta_info"]["weight_version"] == "b1"
    assert _info(url)["model_path"] == str(models.c_bin)
    status, answer = _update(url, model_path=str(models.a), load_format="SafeTensors")
    assert status == 200 and _generate(url)["output_ids"] == models.greedy["a"]
    status, answer = _update(url, model_path=str(models.b_sharded))  # two shards and an index
    assert status == 200 and _generate(url)["output_ids"] == models.greedy["b"]


@pytest.mark.timeout(60)
def test_get_weights_by_name_answers_the_loaded_values_truncated(url: str, models: Models) -> None:
    assert _update(url, model_path=str(models.b))[0] == 200
    saved = models.b_tensors
    # rows of a matrix (SGLang: .tolist()[:truncate_size]); all of them under the default 100
    assert _weights(url, Q_PROJ, truncate_size=3) == (200, saved[Q_PROJ][:3].tolist())
    assert _weights(url, Q_PROJ, method="GET") == (200, saved[Q_PROJ].tolist())
    embed = "model.embed_tokens.weight"  # [128, 32]
    status, rows = _weights(url, embed)
    assert status == 200 and rows == saved[embed][:100].tolist() and len(rows) == 100
    norm = "model.norm.weight"  # values of a vector
    assert _weights(url, norm, truncate_size=5) == (200, saved[norm][:5].tolist())
    assert _weights(url, norm, truncate_size=-30) == (200, saved[norm][:2].tolist())
    assert _weights(url, "lm_head.weight", truncate_size=1) == (
        200,
        saved["lm_head.weight"][:1].tolist(),
    )
    failed = {"error": {"message": "Get parameter by name failed"}}
    assert _weights(url, "model.layers.0.self_attn.qkv_proj.weight") == (400, failed)
    assert _weights(url, norm, truncate_size="5") == (200, saved[norm][:5].tolist())  # lax int
    for body, field in (({"name": norm, "truncate_size": "five"}, "truncate_size"), ({}, "name")):
        resp = requests.post(url + "/get_weights_by_name", json=body, timeout=10)
        assert resp.status_code == 400 and resp.json()["type"] == "Bad Request"
        assert resp.json()["message"].startswith(field)


@pytest.mark.timeout(60)
def test_a_checkpoint_that_cannot_be_loaded_is_refused_and_the_model_kept(
    url: str, models: Models, tmp_path: Path
) -> None:
    assert _update(url, model_path=str(models.a), weight_version="a1")[0] == 200
    before = _weights(url, Q_PROJ, truncate_size=2)

    def refused(body: dict[str, Any], *words: str) -> None:
        status, answer = _update(url, **body)
        assert status == 400 and answer["success"] is False, answer
        assert answer["num_paused_requests"] == 0
        for word in words:
            assert word in answer["message"], (word, answer)

    # a body its struct cannot read: SGLang's validation answer, naming the field
    for body, field in (
        ({}, "model_path: Field required"),
        ({"model_path": str(models.b), "flush_cache": "perhaps"}, "flush_cache"),
        ({"model_path": str(models.b), "weight_version": 3}, "weight_version"),
        ({"model_path": str(models.b), "token_step": 1.5}, "token_step"),
        ({"model_path": str(models.b), "manifest": []}, "manifest"),
    ):
        status, answer = _update(url, **body)
        assert status == 400 and answer["type"] == "Bad Request", answer
        assert answer["message"].startswith(field), answer
    # the checkpoint: SGLang's words, then what was wrong and where
    missing = tmp_path / "no_such_folder"
    refused({"model_path": str(missing)}, "Failed to get weights iterator", str(missing))
    refused(
        {"model_path": str(models.empty)},
        f"Failed to get weights iterator: Cannot find any model weights with `{models.empty}`",
    )
    refused({"model_path": str(models.c_bin), "load_format": "pt"}, "Cannot find any model")
    refused({"model_path": str(models.b), "load_format": "gguf"}, "gguf", "not supported")
    refused(
        {"model_path": str(models.bad), "weight_version": "bad"},
        "Failed to update weights: model.norm.weight: shape [7]",
    )
    # nothing was written (not even B's good tensors before the bad one), nothing moved
    assert _weights(url, Q_PROJ, truncate_size=2) == before
    out = _generate(url)
    assert out["output_ids"] == models.greedy["a"] and out["meta_info"]["weight_version"] == "a1"
    assert _info(url)["model_path"] == str(models.a)


@pytest.mark.timeout(60)
def test_abort_all_requests_ends_what_runs_and_without_it_requests_go_on(
    url: str, models: Models
) -> None:
    result: dict[str, Any] = {}
    worker = _long_request(url, result)
    status, answer = _update(url, model_path=str(models.b), abort_all_requests=True)
    assert status == 200 and answer["success"] is True
    worker.join(30)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 480
    # not aborting: a request held in place (as SGLang's pause in_place) takes the update
    # between two steps and goes on with the new weights
    worker = _long_request(url, result)
    paused = requests.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=10)
    assert paused.status_code == 200
    status, answer = _update(url, model_path=str(models.a), weight_version="a2")
    assert status == 200 and answer["success"] is True
    assert requests.post(url + "/continue_generation", json={}, timeout=10).status_code == 200
    worker.join(30)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    versions = meta["output_token_weight_versions"]
    assert versions[-1] == "a2" and versions[0] != "a2"


@pytest.mark.timeout(30)
def test_checkpoint_files_are_chosen_as_sglang_chooses_them(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.ones(2, 3), "b.weight": torch.zeros(4), "c.weight": torch.ones(1)}
    # shards and their index: the stray file the index does not list is left out
    sharded = _shard(tensors, tmp_path / "sharded")
    assert [f.name for f in weight_files(str(sharded))] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    taken, skipped = read_weights(
        weight_files(str(sharded), "safetensors"), {"a.weight", "c.weight"}
    )
    assert sorted(n for n, _ in taken) == ["a.weight", "c.weight"] and skipped == ["b.weight"]
    # without an index every *.safetensors file is read
    bare = _shard(tensors, tmp_path / "bare", index=False)
    assert len(weight_files(str(bare))) == 3
    # an index naming a shard that is not there
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing .*model-00002-of-00002\.safetensors"):
        weight_files(str(sharded))
    # PyTorch files: *.bin under auto (not under pt, which reads *.pt), training state left out
    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save(tensors, pt / "pytorch_model.bin")
    torch.save({"step": torch.tensor(3)}, pt / "training_args.bin")
    torch.save(tensors, pt / "optimizer.pt")
    assert [f.name for f in weight_files(str(pt), None)] == ["pytorch_model.bin"]
    with pytest.raises(CheckpointError, match="Cannot find any model weights"):
        weight_files(str(pt), "pt")
    taken, skipped = read_weights(weight_files(str(pt)), set(tensors))
    assert {n: t.tolist() for n, t in taken} == {n: t.tolist() for n, t in tensors.items()}
    with pytest.raises(CheckpointError, match="none of the 3 tensors"):
        read_weights(weight_files(str(pt)), {"x.weight"})
    # what a PyTorch file must hold: named tensors, and nothing weights_only refuses to unpickle
    odd = tmp_path / "odd"
    odd.mkdir()
    torch.save([torch.ones(1)], odd / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="holds a list"):
        read_weights(weight_files(str(odd)), {"a.weight"})
    torch.save({"a.weight": Path("x")}, odd / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin cannot be read"):
        read_weights(weight_files(str(odd)), {"a.weight"})
