"""``/update_weights_from_tensor`` on the built-in engine as a real server, as SGLang 0.5.23
answers it (``http_server.py``, ``tokenizer_control_mixin.update_weights_from_tensor``,
``scheduler_components/weight_updater.py``, ``model_runner_components/weight_updater.py``,
``utils/common.py``'s ``MultiprocessingSerializer`` and ``SafeUnpickler``,
``weight_sync/tensor_bucket.py``).

This test process is the sender, as a trainer would be: its tensors go in shared memory (torch's
``file_system`` strategy) and only their handles travel, in the three layouts RL frameworks
send: a list of pairs, verl's ``LocalSerializedTensor`` per tensor, and slime's flattened
bucket. SGLang's classes are pickled under SGLang's own module names, from stand-ins
registered here (SGLang is not installed).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.stages.engine_setup import builtin_engine, hf_greedy, load_reference, two_tiny_models

PROMPT = [5, 17, 33, 8, 90]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
RUNNER = "sglang.srt.model_executor.model_runner_components.weight_updater"
BUCKET = "sglang.srt.weight_sync.tensor_bucket"


@dataclass
class LocalSerializedTensor:  # SGLang's, as verl builds it
    values: list[bytes]


@dataclass
class FlattenedTensorMetadata:  # SGLang's, as slime builds it
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@pytest.fixture
def sglang_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's payload classes importable under its module names, in this process only."""
    for module, cls in ((RUNNER, LocalSerializedTensor), (BUCKET, FlattenedTensorMetadata)):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setattr(cls, "__module__", module)
        monkeypatch.setattr(sys.modules[module], cls.__name__, cls, raising=False)


@pytest.fixture
def shared_files() -> Iterator[None]:
    """Tensors shared by file name (what a CPU sender outside the engine's tree must use)."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def raw(obj: Any) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize(obj)``."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


_SENT: list[Any] = []  # what was sent stays alive here, as a trainer keeps it until answered


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: for JSON. Only
    handles travel: ``obj`` is kept, so that its shared memory outlives the request."""
    _SENT.append(obj)
    return base64.b64encode(raw(obj)).decode()


def flattened(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's ``FlattenedTensorBucket`` of ``named``, as slime sends it."""
    pieces, metadata, at = [], [], 0
    for name, tensor in named:
        raw = tensor.flatten().view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(
                name, tensor.shape, tensor.dtype, at, at + raw.numel(), raw.numel()
            )
        )
        pieces.append(raw)
        at += raw.numel()
    return {"flattened_tensor": torch.cat(pieces), "metadata": metadata}


class Models:
    def __init__(self, paths: tuple[Path, Path]) -> None:
        self.a, self.b = paths
        named = dict(zip("ab", paths, strict=True))
        self.tensors = {k: load_file(path / "model.safetensors") for k, path in named.items()}
        self.greedy = {k: hf_greedy(load_reference(path), PROMPT, 12) for k, path in named.items()}
        assert self.greedy["a"] != self.greedy["b"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(two_tiny_models(tmp_path_factory))


@pytest.fixture(scope="module")
def url(models: Models) -> Iterator[str]:
    with builtin_engine(models.a, "--max-running", "4", "--enable-lora") as found:
        yield found


def _post(url: str, route: str, **body: Any) -> tuple[int, dict[str, Any]]:
    resp = requests.post(url + route, json=body, timeout=30)
    return resp.status_code, resp.json()


def _update(url: str, payload: str, *, session: bool = True, **body: Any) -> tuple[int, dict]:
    """One update inside its own session (``begin_weight_update`` ... ``end``), as SGLang wants."""
    if session:
        assert _post(url, "/begin_weight_update")[0] == 200
    try:
        return _post(url, "/update_weights_from_tensor", serialized_named_tensors=[payload], **body)
    finally:
        if session:
            assert _post(url, "/end_weight_update")[0] == 200


def _greedy(url: str) -> dict[str, Any]:
    status, out = _post(url, "/generate", input_ids=PROMPT, sampling_params=GREEDY)
    assert status == 200, out
    return out


@pytest.mark.timeout(90)
def test_shared_tensors_in_each_layout_become_the_models_weights(
    url: str, models: Models, sglang_classes: None, shared_files: None
) -> None:
    assert _greedy(url)["output_ids"] == models.greedy["a"]
    b = list(models.tensors["b"].items())
    # a list of (name, tensor) pairs (load_format null), with a weight version
    status, answer = _update(url, serialize(b), weight_version="b1")
    assert (status, answer) == (
        200, {"success": True, "message": "Success Weight version updated to b1."}
    )  # fmt: skip
    out = _greedy(url)
    assert out["output_ids"] == models.greedy["b"] and out["meta_info"]["weight_version"] == "b1"
    # verl's: a LocalSerializedTensor per tensor, a payload per rank (this engine reads the
    # first: the second is garbage it must not touch); load_format direct
    a = [(n, LocalSerializedTensor([raw(t), b"x"])) for n, t in models.tensors["a"].items()]
    status, answer = _update(url, serialize(a), load_format="direct")
    assert (status, answer["message"]) == (200, "Success")
    out = _greedy(url)
    assert out["output_ids"] == models.greedy["a"] and out["meta_info"]["weight_version"] == "b1"
    # slime's: one flattened bucket of every tensor (float32 here)
    status, answer = _update(url, serialize(flattened(b)), load_format="flattened_bucket")
    assert status == 200, answer
    assert _greedy(url)["output_ids"] == models.greedy["b"]
    # the prefix cache was flushed (flush_cache's default): the same prompt is computed afresh
    assert _greedy(url)["meta_info"]["cached_tokens"] > 0
    a_bucket = serialize(flattened(list(models.tensors["a"].items())))
    assert _update(url, a_bucket, load_format="flattened_bucket")[0] == 200
    out = _greedy(url)
    assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == models.greedy["a"]


@pytest.mark.timeout(90)
def test_payloads_that_cannot_be_loaded_are_refused_and_the_model_stays(
    url: str, models: Models, sglang_classes: None, shared_files: None
) -> None:
    assert _update(url, serialize(list(models.tensors["a"].items())))[0] == 200
    b = list(models.tensors["b"].items())
    # outside a session: refused as SGLang 0.5.23 refuses it, nothing loaded
    status, answer = _update(url, serialize(b), session=False)
    assert (status, answer) == (
        400,
        {
            "success": False,
            "message": "update_weights_from_tensor must run between begin_weight_update() "
            "and end_weight_update()",
        },
    )
    bad = {
        "load_format": (
            {"load_format": "my.module:loader"},
            "Unknown load_format=my.module:loader",
        ),
        # a global outside the allowlist is never looked up (os.system would run here)
        "global": (
            {"payload": base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()},
            "serialized_named_tensors[0]: a payload may not name os.system",
        ),
        "shape": (
            {"payload": serialize([(b[0][0], torch.zeros(3, 3))])},
            f"{b[0][0]}: shape [3, 3] does not match",
        ),
        "name": ({"payload": serialize([("lm_head.nope", torch.zeros(2))])}, "lm_head.nope"),
        "layout": ({"payload": serialize({"x": 1})}, "expected a list of (name, tensor)"),
        "bucket": (
            {
                "payload": serialize(
                    {
                        "flattened_tensor": torch.zeros(8, dtype=torch.uint8),
                        "metadata": [
                            FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 0, 12, 12)
                        ],
                    }
                ),
                "load_format": "flattened_bucket",
            },
            "bytes 0..12 do not hold a [4] torch.float32 tensor",
        ),
        "type": ({"flush_cache": "perhaps"}, "flush_cache"),
        "base64": ({"payload": "not base64!"}, "Expected base64-encoded bytes"),
    }
    for case, (body, words) in bad.items():
        body = dict(body)
        payload = body.pop("payload", serialize(b))
        status, answer = _update(url, payload, **body)
        if case in ("type", "base64"):  # the struct's types first: SGLang's validation answer
            assert status == 400 and answer["type"] == "Bad Request", case
        else:  # then the route's own checks
            assert status == 400 and answer["success"] is False, case
        assert words in answer["message"], (case, answer)
    assert _greedy(url)["output_ids"] == models.greedy["a"]  # nothing of B got in


@pytest.mark.timeout(90)
def test_a_tensor_shared_by_file_descriptor_says_how_to_share_it(url: str, models: Models) -> None:
    """torch's default CPU sharing passes a file descriptor that only the sender's own
    ``multiprocessing`` tree may fetch: the answer says what to set instead."""
    assert mp.get_sharing_strategy() == "file_descriptor"  # torch's default on Linux
    status, answer = _update(url, serialize(list(models.tensors["b"].items())[:1]))
    assert status == 400, answer
    assert "set_sharing_strategy('file_system')" in answer["message"]
    assert _greedy(url)["output_ids"] == models.greedy["a"]  # the last test left A


@pytest.mark.timeout(120)
def test_a_lora_adapter_sent_as_tensors_computes_what_its_folder_does(
    url: str, models: Models, shared_files: None, sglang_classes: None, tmp_path: Path
) -> None:
    """SGLang 0.5.23's ``/load_lora_adapter_from_tensors`` (``tp_worker``): the adapter's
    ``peft`` config and its state dict (or a flattened bucket of it) from this process's
    memory; requests naming it get what the same adapter loaded from its folder gives;
    ``expected_checksums`` (sha256 of each tensor's bytes) checked first."""
    from tests.stages.test_engine_lora import _adapter

    folder = tmp_path / "adapter"
    _adapter(models.a, folder, seed=4, targets="all-linear")
    config = json.loads((folder / "adapter_config.json").read_text())
    state = load_file(folder / "adapter_model.safetensors")
    assert _post(url, "/load_lora_adapter", lora_name="disk", lora_path=str(folder))[0] == 200
    body = {
        "lora_name": "mem",
        "config_dict": config,
        "serialized_named_tensors": [serialize(state)],
    }
    status, answer = _post(url, "/load_lora_adapter_from_tensors", **body)
    assert status == 200, answer
    assert answer == {"success": True, "error_message": None,
                      "loaded_adapters": {"disk": str(folder), "mem": "__tensor__"}}  # fmt: skip
    sums = {
        n: hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in state.items()
    }
    bucket = {**body, "lora_name": "bucket", "load_format": "flattened_bucket",
              "serialized_named_tensors": [serialize(flattened(list(state.items())))],
              "expected_checksums": sums}  # fmt: skip
    assert _post(url, "/load_lora_adapter_from_tensors", **bucket)[0] == 200
    try:
        outs = {}
        for name in ("disk", "mem", "bucket", None):
            status, out = _post(url, "/generate", input_ids=PROMPT, sampling_params=GREEDY,
                                lora_path=name)  # fmt: skip
            assert status == 200, out
            outs[name] = out["output_ids"]
        assert outs["mem"] == outs["bucket"] == outs["disk"] != outs[None]
        wrong = {**bucket, "lora_name": "wrong",
                 "expected_checksums": {**sums, next(iter(sums)): "0" * 64}}  # fmt: skip
        status, answer = _post(url, "/load_lora_adapter_from_tensors", **wrong)
        assert (
            status == 400 and "[LORA-CHECK] rank0 adapter sync MISMATCH" in answer["error_message"]
        )
        status, answer = _post(url, "/load_lora_adapter_from_tensors", **{**body, "config_dict": 3})
        assert status == 400 and answer["message"].startswith("config_dict: Input should be")
        assert set(_post(url, "/unload_lora_adapter", lora_name="none")[1]["loaded_adapters"]) == {
            "disk",
            "mem",
            "bucket",
        }
    finally:
        for name in ("disk", "mem", "bucket"):
            _post(url, "/unload_lora_adapter", lora_name=name)


@pytest.mark.timeout(120)
def test_a_tensor_update_lands_between_two_steps_of_running_requests(
    url: str, models: Models, shared_files: None
) -> None:
    """In flight, as the distributed route's buckets: a request decoding while the update
    arrives goes on, its tokens after it under the new version (``/slow_down`` keeps it
    running long enough)."""
    assert _update(url, serialize(list(models.tensors["a"].items())), weight_version="a1")[0] == 200
    assert _post(url, "/slow_down", forward_sleep_time=0.01)[0] == 200
    result: dict[str, Any] = {}
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 150}}
    worker = threading.Thread(target=lambda: result.update(_post(url, "/generate", **body)[1]))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while requests.get(url + "/server_info", timeout=10).json()["num_running_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        b = serialize(list(models.tensors["b"].items()))
        assert _update(url, b, weight_version="b2", flush_cache=False)[0] == 200
    finally:
        worker.join(60)
        _post(url, "/slow_down", forward_sleep_time=None)
    versions = result["meta_info"]["output_token_weight_versions"]
    assert len(versions) == 150 and versions[0] == "a1" and versions[-1] == "b2"
    assert versions == sorted(versions)  # one switch, never back
    assert _update(url, serialize(list(models.tensors["a"].items())))[0] == 200


@pytest.mark.timeout(60)
def test_checkpoint_engines_ipc_update_is_refused_as_sglang_refuses_it_without_the_package(
    url: str, models: Models
) -> None:
    """``/update_weights_from_ipc`` (SGLang 0.5.23 ``http_server.py``'s route; its worker maps
    CUDA IPC buffers, ``checkpoint_engine/checkpoint_engine_worker.py``, and without the
    package ``model_runner_components/weight_updater.py`` answers ``IPC weight update failed:
    ...``): the body's types checked first, then 400 ``{success: false}``, counted, and the
    model and its weight version as they were."""
    before = _greedy(url)
    version = requests.get(url + "/get_weight_version", timeout=10).json()
    refused = requests.get(url + "/server_info", timeout=10).json()["refused_requests"]
    status, answer = _post(
        url,
        "/update_weights_from_ipc",
        zmq_handles={"GPU-0d1e": "ipc:///tmp/ckpt-engine.sock"},
        weight_version="ipc-1",
        flush_cache=False,
    )
    assert status == 400 and answer["success"] is False, answer
    assert answer["message"].startswith("IPC weight update failed: ")
    assert "/update_weights_from_tensor" in answer["message"]  # what to use instead
    for body, field in (({}, "zmq_handles"), ({"zmq_handles": ["x"]}, "zmq_handles")):
        status, answer = _post(url, "/update_weights_from_ipc", **body)
        assert status == 400 and answer["type"] == "Bad Request", answer
        assert field in answer["message"]
    after = requests.get(url + "/server_info", timeout=10).json()["refused_requests"]
    key = "POST /update_weights_from_ipc 400"
    assert after.get(key, 0) - refused.get(key, 0) == 3
    assert requests.get(url + "/get_weight_version", timeout=10).json() == version
    after_out = _greedy(url)
    assert after_out["output_ids"] == before["output_ids"]
    assert after_out["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
