"""``/weights_checker`` on the built-in engine as a real server, as SGLang 0.5.23 answers it
(``http_server.check_weights``, ``tokenizer_control_mixin.check_weights``,
``scheduler_components/weight_updater.check_weights``, ``utils/weight_checker.py``), and the
digests of ``stages.engine.weight_checker`` that a trainer computes to compare with it.

One engine for the module, on a tiny model; the test that garbles its weights loads them back.
The publisher's path (snapshot, reset, publish, compare) is in ``test_inflight_update``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.weight_checker import (
    _tile_hash,
    checksums,
    overall_checksum,
    tensor_checksum,
)
from tests.stages import engine_setup
from tests.stages.engine_setup import builtin_engine, hf_greedy, load_reference
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 90]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=1)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with builtin_engine(model) as engine:
        yield engine


def _check(url: str, body: Any = None, method: str = "POST") -> requests.Response:
    if body is None:
        return requests.request(method, url + "/weights_checker", timeout=60)
    return requests.request(method, url + "/weights_checker", json=body, timeout=60)


def _greedy(url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    resp = requests.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _refused(url: str) -> dict[str, int]:
    return requests.get(url + "/server_info", timeout=10).json()["refused_requests"]


# ---- the digests --------------------------------------------------------------------------


def test_a_cpu_tensor_digest_is_the_sha256_of_its_bytes_as_sglang_hashes_it() -> None:
    """``mm_utils.tensor_hash`` on the CPU: the first 8 bytes of the sha256 of the tensor's
    bytes, read as a big-endian integer, written as 16 hex digits (``_hash_tensor``)."""
    g = torch.Generator().manual_seed(0)
    for tensor in (
        torch.randn(7, 5, generator=g),
        torch.randn(4, 3, generator=g).to(torch.bfloat16),
        torch.randn(6, 4, generator=g).t(),  # not contiguous: hashed as its contiguous copy
        torch.arange(10, dtype=torch.int64),
    ):
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        digest = int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")
        assert tensor_checksum(tensor) == f"{digest:016x}"
    assert tensor_checksum(torch.zeros(3)) != tensor_checksum(torch.zeros(4))


def _words_reference(data: bytes) -> int:
    """``gpu_tensor_hash`` written out word by word in Python (``kernels/ops/memory/
    gpu_tensor_hash.py``: the tile kernel, the sum of the tiles, splitmix64)."""
    m32, m64 = 0xFFFFFFFF, (1 << 64) - 1

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m32
        return x ^ (x >> 16)

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m32

    data += bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    seed = 0x243F6A88
    s1, s2 = seed & m32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & m32
    nbytes = (len(words) * 4) & m32
    total = 0
    for base in range(0, len(words), 8192):
        h1 = h2 = 0
        for i in range(base, min(base + 8192, len(words))):
            p1 = ((i * 0x27D4EB2D + s1) & m32) ^ rotl(i, 15)
            p2 = ((i * 0x165667B1 + s2) & m32) ^ rotl(i, 13)
            h1 = (h1 + fmix(words[i] ^ p1)) & m32
            h2 = (h2 + fmix(words[i] ^ p2)) & m32
        total += (fmix(h1 ^ nbytes) << 32) | fmix(h2 ^ nbytes)
    x = total & m64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m64
    return x ^ (x >> 31)


def test_the_gpu_digest_in_torch_ops_is_the_tile_hash_word_for_word() -> None:
    """The torch version of ``gpu_tensor_hash`` (what the engine answers for a tensor on a GPU)
    against the algorithm written out in Python: two whole tiles and a part, a byte count that
    is not a multiple of 4 (zero-padded), and words with the high bit set."""
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (8192 * 4 * 2 + 4 * 37 + 3,), dtype=torch.uint8, generator=g)
    assert _tile_hash(data) == _words_reference(data.numpy().tobytes())
    small = torch.tensor([-1.5, 2.0, float("inf")], dtype=torch.bfloat16)
    assert _tile_hash(small) == _words_reference(small.view(torch.uint8).numpy().tobytes())
    assert _tile_hash(torch.empty(0)) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_tensor_digest_is_the_tile_hash() -> None:
    tensor = torch.randn(1000, 33, generator=torch.Generator().manual_seed(1))
    assert tensor_checksum(tensor.cuda()) == f"{_tile_hash(tensor):016x}"
    assert tensor_checksum(tensor) != tensor_checksum(tensor.cuda())  # as SGLang's, per device


# ---- the route ----------------------------------------------------------------------------


def test_checksum_answers_each_weights_digest_as_the_trainer_computes_them(
    url: str, model: Path
) -> None:
    # the digests as a trainer computes them on the engine's kind of device (SGLang's: of the
    # bytes on a CPU, of the 32-bit words on a GPU)
    reference = load_reference(model).to(engine_setup.ENGINE_DEVICE)
    expected = checksums(reference)
    assert "model.embed_tokens.weight" in expected and not any("inv_freq" in n for n in expected)
    for resp in (_check(url, method="GET"), _check(url, {}), _check(url, {"action": "checksum"})):
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert list(answer) == ["success", "message", "ranks", "per_engine_checksum"]
        assert answer["success"] is True and answer["message"] == "Success."
        (rank,) = answer["ranks"]
        assert rank["checksums"] == expected
        assert rank["per_gpu_checksum"] == overall_checksum(expected)
        assert rank["parallelism_info"] == [
            {
                "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1,
            }
        ]  # fmt: skip
        assert (
            answer["per_engine_checksum"]
            == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        )
    # skip_tensor_list leaves out every name holding one of its strings
    answer = _check(url, {"skip_tensor_list": ["layers.0.", "norm"]}).json()
    left = answer["ranks"][0]["checksums"]
    assert left == {n: d for n, d in expected.items() if "layers.0." not in n and "norm" not in n}
    assert 0 < len(left) < len(expected)
    # a draft model is all that "draft" selects: this engine has none
    answer = _check(url, {"selector": "draft"}).json()
    assert answer == {"success": True, "message": "Success."}


@pytest.mark.timeout(120)
def test_snapshot_reset_and_compare_find_weights_not_brought_back(url: str, model: Path) -> None:
    """slime's check of an update path: snapshot the weights, overwrite them all with random
    values, load them back, compare. Garbled, the compare lists each tensor that differs (and
    keeps the snapshot); loaded back from disk, it succeeds and drops the snapshot."""
    expected = hf_greedy(load_reference(model), PROMPT, 12)
    assert _greedy(url) == expected
    before = _check(url).json()["per_engine_checksum"]
    assert _check(url, {"action": "snapshot"}).json() == {"success": True, "message": "Success."}
    resp = _check(url, {"action": "reset_tensors", "skip_tensor_list": ["lm_head"]})
    assert resp.status_code == 200 and resp.json()["success"] is True
    assert _greedy(url) != expected
    assert _check(url).json()["per_engine_checksum"] != before

    resp = _check(url, {"action": "compare"})
    assert resp.status_code == 400
    answer = resp.json()
    assert answer["success"] is False
    message = answer["message"]
    assert message.startswith("check tensor equality failed:\n")
    lines = message.splitlines()[1:]
    names = {line.split()[0].removeprefix("name=") for line in lines}
    reference = load_reference(model)
    params = {n for n, _ in reference.named_parameters()}
    assert "lm_head.weight" in params  # not tied in this model: left as it was, by the skip
    assert names == params - {"lm_head.weight"}  # every other weight was reset
    line = next(line for line in lines if line.startswith("name=model.norm.weight "))
    assert "num_exceed=32 " in line and "expect=raw(shape=(32,) dtype=torch.float32)" in line
    assert float(line.split("max_abs_err=")[1].split()[0]) > 0

    resp = requests.post(
        url + "/update_weights_from_disk", json={"model_path": str(model)}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert _check(url, {"action": "compare"}).json() == {"success": True, "message": "Success."}
    assert _greedy(url) == expected
    assert _check(url).json()["per_engine_checksum"] == before
    again = _check(url, {"action": "compare"})  # the snapshot went with the compare
    assert again.status_code == 400 and "no snapshot" in again.json()["message"]


def test_a_bad_body_is_refused_in_sglangs_layouts_and_the_engine_serves_on(url: str) -> None:
    refused = _refused(url)
    resp = _check(url, {"action": "wipe"})  # the scheduler's: Unsupported action
    assert resp.status_code == 400
    assert resp.json() == {"success": False, "message": "Unsupported action='wipe'"}
    for body, where in (  # the request struct's: pydantic's validation, SGLang's 400 layout
        ({"selector": "both"}, "selector"),
        ({"skip_tensor_list": [1, 2]}, "skip_tensor_list"),
        ({"action": 3}, "action"),
        ({"allow_quant_error": "maybe"}, "allow_quant_error"),
        ({"rid": 5}, "rid"),
    ):
        resp = _check(url, body)
        assert resp.status_code == 400, body
        answer = resp.json()
        assert answer["object"] == "error" and answer["type"] == "Bad Request"
        assert answer["code"] == 400 and answer["message"].startswith(where)
    resp = requests.post(url + "/weights_checker", data=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["type"] == "Bad Request"
    # unknown fields and a lax bool are read as SGLang's request struct reads them
    ok = _check(url, {"action": "checksum", "allow_quant_error": "yes", "extra": 1})
    assert ok.status_code == 200 and ok.json()["success"] is True
    counts = _refused(url)
    assert sum(counts.values()) - sum(refused.values()) == 7
    assert _greedy(url)  # serving on


def test_while_the_weights_are_released_the_checker_is_refused(url: str) -> None:
    resp = requests.post(url + "/release_memory_occupation", json={"tags": ["weights"]}, timeout=30)
    assert resp.status_code == 200, resp.text
    try:
        resp = _check(url)
        assert resp.status_code == 400
        answer = resp.json()
        assert answer["success"] is False and "weights_checker" in answer["message"]
    finally:
        resp = requests.post(
            url + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30
        )
        assert resp.status_code == 200, resp.text
    assert _check(url).json()["success"] is True
