"""SGLang 0.5.23's routes for features the built-in engine lacks (n-gram speculation's corpora,
HiCache storage, prefill/decode role switch, transfer-engine info, audio transcription, elastic
expert parallelism, the dumper) on a real engine process, generating and pooling: each
answers as SGLang started with default flags answers (``stages.engine.feature_off_routes``
names the lines), a malformed request as SGLang's checks refuse it, a wrong method 405 with
``Allow``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from stages.engine.feature_off_routes import ADMIN_KEY_MISSING, ELASTIC_EP_OFF, NGRAM_OFF
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model

AUDIO_OFF = (
    "this engine serves a text-only model, which cannot transcribe audio: "
    "/v1/audio/transcriptions needs a speech-recognition model (SGLang serves it with an "
    "audio model such as Whisper or Qwen3-ASR)"
)
WAV = {"file": ("a.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")}


def _invalid(message: str, kind: str = "Bad Request") -> dict:
    """SGLang's ``ErrorResponse`` with a 400."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": 400}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_model(tmp_path_factory.mktemp("off") / "model", seed=1)
    with builtin_engine(model) as found:
        yield found


def _call(url: str, method: str, route: str, **kwargs) -> tuple[int, object]:
    resp = requests.request(method, url + route, timeout=30, **kwargs)
    body = resp.json() if "json" in resp.headers.get("Content-Type", "") else resp.text
    return resp.status_code, body


@pytest.mark.timeout(120)
def test_ngram_corpus_routes_say_ngram_speculation_is_off(url: str) -> None:
    off = {"success": False, "corpus_id": "", "message": NGRAM_OFF, "loaded_token_count": 0}
    assert _call(url, "POST", "/add_external_corpus", json={"documents": ["a b"]}) == (400, off)
    assert _call(url, "POST", "/add_external_corpus", json={"file_path": "/x"}) == (400, off)
    # AddExternalCorpusReqInput(**body): its TypeError, before the feature is looked at
    assert _call(url, "POST", "/add_external_corpus", json={"documents": [], "docs": 1}) == (
        400, {"success": False, "message": "Unexpected keyword argument 'docs'"},
    )  # fmt: skip
    assert _call(url, "POST", "/add_external_corpus", json=["a"]) == (
        400, {"success": False, "message": "sglang.srt.managers.io_struct."
              "AddExternalCorpusReqInput() argument after ** must be a mapping, not list"},
    )  # fmt: skip
    status, body = _call(url, "POST", "/add_external_corpus", data=b"{")  # SGLang: a 500
    assert status == 400 and body["message"].startswith("the body is no JSON")

    off = {"success": False, "message": NGRAM_OFF}
    assert _call(url, "POST", "/remove_external_corpus", json={"corpus_id": "c1"}) == (400, off)
    required = {"success": False, "message": "corpus_id is required."}
    assert _call(url, "POST", "/remove_external_corpus", json={"corpus_id": ""}) == (400, required)
    assert _call(url, "POST", "/remove_external_corpus", json={}) == (400, required)
    status, body = _call(url, "POST", "/remove_external_corpus", json=[1])  # SGLang: a 500
    assert status == 400 and body["success"] is False

    listed = {"success": False, "corpus_token_counts": {}, "message": NGRAM_OFF}
    assert _call(url, "GET", "/list_external_corpora") == (400, listed)
    for method, route, allow in (
        ("POST", "/list_external_corpora", "GET"),
        ("GET", "/add_external_corpus", "POST"),
        ("PUT", "/remove_external_corpus", "POST"),
    ):
        resp = requests.request(method, url + route, timeout=30)
        assert (resp.status_code, resp.json()) == (405, {"detail": "Method Not Allowed"})
        assert resp.headers["Allow"] == allow


@pytest.mark.timeout(120)
def test_hicache_routes_answer_as_sglang_without_hierarchical_cache(url: str) -> None:
    missing = (400, {"error": ADMIN_KEY_MISSING})
    assert _call(url, "GET", "/hicache/storage-backend") == missing
    assert _call(url, "DELETE", "/hicache/storage-backend") == missing
    attach = {"hicache_storage_backend": "file", "hicache_write_policy": "write_through"}
    assert _call(url, "PUT", "/hicache/storage-backend", json=attach) == missing
    # AttachHiCacheStorageReqInput is checked before the admin key
    assert _call(url, "PUT", "/hicache/storage-backend", json={}) == (
        400, _invalid("hicache_storage_backend: Field required"),
    )  # fmt: skip
    assert _call(url, "PUT", "/hicache/storage-backend", json={"hicache_storage_backend": 1}) == (
        400, _invalid("hicache_storage_backend: Input should be a valid string"),
    )  # fmt: skip
    assert _call(url, "PUT", "/hicache/storage-backend")[1] == _invalid("body: Field required")
    resp = requests.post(url + "/hicache/storage-backend", timeout=30)
    assert resp.status_code == 405
    assert set(resp.headers["Allow"].split(",")) == {"GET", "PUT", "DELETE"}

    # the scheduler's success=False, with SGLang's one text for the route
    cleared = requests.post(url + "/hicache/storage-backend/clear", timeout=30)
    assert (cleared.status_code, cleared.text) == (
        400, "Hierarchical cache storage backend cleared.\n",
    )  # fmt: skip
    assert requests.get(url + "/hicache/storage-backend/clear", timeout=30).status_code == 405

    layout = {
        "enabled": False,
        "backend": None,
        "page_size": 1,
        "hicache_object_layout": {"pools": []},
        "reason": "Hierarchical cache is disabled",
    }
    assert _call(url, "GET", "/get_hicache_l3_cache_layout") == (200, layout)
    resp = requests.post(url + "/get_hicache_l3_cache_layout", timeout=30)
    assert (resp.status_code, resp.headers["Allow"]) == (405, "GET")


@pytest.mark.timeout(120)
def test_pd_role_switch_says_the_flag_is_not_set(url: str) -> None:
    def off(new_role: str) -> dict:
        return {"rid": None, "http_worker_ipc": None, "success": False,
                "message": "--enable-pd-role-switch is not set on this server",
                "old_role": "null", "new_role": new_role, "safe_to_restore": True}  # fmt: skip

    assert _call(url, "POST", "/pd_role_switch", json={"new_role": "decode"}) == (
        400, off("decode"),
    )  # fmt: skip
    assert _call(url, "POST", "/pd_role_switch", json={}) == (400, off(""))
    assert _call(url, "POST", "/pd_role_switch", json={"new_role": "both"}) == (
        400, _invalid("new_role: Input should be 'prefill', 'decode' or ''"),
    )  # fmt: skip
    status, body = _call(url, "POST", "/pd_role_switch", json={"prepare_only": "maybe"})
    assert status == 400 and body["message"].startswith("prepare_only: Input should be a valid")
    assert _call(url, "POST", "/pd_role_switch")[1] == _invalid("body: Field required")
    resp = requests.get(url + "/pd_role_switch", timeout=30)
    assert (resp.status_code, resp.headers["Allow"]) == (405, "POST")


@pytest.mark.timeout(120)
def test_transfer_engine_info_fails_for_every_rank(url: str) -> None:
    for route in ("/remote_instance_transfer_engine_info",
                  "/get_remote_instance_transfer_engine_info"):  # fmt: skip
        failed = {"error": {"message": "Failed to get transfer engine info for rank 3"}}
        assert _call(url, "GET", route + "?rank=3") == (400, failed)
        invalid = (400, {"error": {"message": "Missing or invalid rank parameter"}})
        assert _call(url, "GET", route) == invalid
        assert _call(url, "GET", route + "?rank=-1") == invalid
        assert _call(url, "GET", route + "?rank=x") == (
            400,
            _invalid("query.rank: Input should be a valid integer, unable to parse string as "
                     "an integer"),
        )  # fmt: skip
        resp = requests.post(url + route + "?rank=0", timeout=30)
        assert (resp.status_code, resp.headers["Allow"]) == (405, "GET")


@pytest.mark.timeout(120)
def test_audio_transcription_needs_an_audio_model(url: str) -> None:
    route = "/v1/audio/transcriptions"
    assert _call(url, "POST", route, files=WAV) == (400, _invalid(AUDIO_OFF, "BadRequestError"))
    form = {"response_format": "text", "temperature": "0.2", "stream": "true", "language": "en"}
    assert _call(url, "POST", route, files=WAV, data=form)[1] == _invalid(
        AUDIO_OFF, "BadRequestError"
    )
    # the form's parameters, as FastAPI checks them first, then response_format
    assert _call(url, "POST", route, files=WAV, data={"response_format": "srt"}) == (
        400, {"error": {"message": "Only 'json', 'text', and 'verbose_json' formats supported"}},
    )  # fmt: skip
    assert _call(url, "POST", route, data={"model": "m"}) == (400, _invalid("file: Field required"))
    assert _call(url, "POST", route, json={"file": "a.wav"}) == (
        400, _invalid("file: Field required"),
    )  # fmt: skip
    bad = {"file": "not-an-upload", "temperature": "hot"}
    assert _call(url, "POST", route, files={k: (None, v) for k, v in bad.items()})[1] == _invalid(
        "file: Value error, Expected UploadFile, received: <class 'str'>; "
        "temperature: Input should be a valid number, unable to parse string as a number"
    )
    garbage = {"Content-Type": "multipart/form-data; boundary=x"}
    assert _call(url, "POST", route, data=b"--x\r\nbad", headers=garbage) == (
        400, _invalid("There was an error parsing the body", "400"),
    )  # fmt: skip
    resp = requests.get(url + route, timeout=30)
    assert (resp.status_code, resp.headers["Allow"]) == (405, "POST")


@pytest.mark.timeout(120)
def test_elastic_ep_routes_say_it_is_not_enabled(url: str) -> None:
    """``entrypoints/elastic_ep.py``: the body's checks (400), then 404 without
    ``--elastic-ep-backend``; a wrong method 405."""
    off = (404, {"error": ELASTIC_EP_OFF})
    assert _call(url, "POST", "/scale_elastic_ep", json={"new_ep_size": 4}) == off
    assert _call(url, "GET", "/is_scaling_elastic_ep") == off
    for body, words in (
        ([4], "request body must be a JSON object"),
        ({"new_ep_size": 0}, "new_ep_size must be a positive integer"),
        ({"new_ep_size": True}, "new_ep_size must be a positive integer"),
        ({"new_ep_size": "4"}, "new_ep_size must be a positive integer"),
        ({}, "new_ep_size must be a positive integer"),
    ):
        assert _call(url, "POST", "/scale_elastic_ep", json=body) == (400, {"error": words})
    status, body = _call(url, "POST", "/scale_elastic_ep", data=b"{")
    assert status == 400
    assert body == {"error": "Invalid JSON: Expecting property name enclosed in double quotes: "
                    "line 1 column 2 (char 1)"}  # fmt: skip
    assert _call(url, "GET", "/scale_elastic_ep")[0] == 405
    assert _call(url, "POST", "/is_scaling_elastic_ep")[0] == 405


@pytest.mark.timeout(120)
def test_the_dumper_is_not_served_as_in_sglang_without_dumper_server_port(url: str) -> None:
    # SGLang registers POST /dumper/{method} only with DUMPER_SERVER_PORT=reuse
    for method in ("POST", "GET"):
        assert _call(url, method, "/dumper/start", json={}) == (404, {"detail": "Not Found"})
    assert requests.get(url + "/health", timeout=30).status_code == 200  # still serving


@pytest.mark.timeout(180)
def test_a_pooling_engine_answers_the_same(tmp_path: Path) -> None:
    model = make_tiny_classifier(tmp_path / "rm", seed=3)
    with builtin_engine(model) as pooled:
        listed = {"success": False, "corpus_token_counts": {}, "message": NGRAM_OFF}
        assert _call(pooled, "GET", "/list_external_corpora") == (400, listed)
        assert _call(pooled, "GET", "/hicache/storage-backend") == (
            400, {"error": ADMIN_KEY_MISSING},
        )  # fmt: skip
        assert _call(pooled, "GET", "/get_hicache_l3_cache_layout")[0] == 200
        assert _call(pooled, "POST", "/pd_role_switch", json={})[1]["old_role"] == "null"
        assert _call(pooled, "GET", "/remote_instance_transfer_engine_info?rank=0")[0] == 400
        assert _call(pooled, "POST", "/v1/audio/transcriptions", files=WAV) == (
            400, _invalid(AUDIO_OFF, "BadRequestError"),
        )  # fmt: skip
        assert _call(pooled, "GET", "/is_scaling_elastic_ep") == (404, {"error": ELASTIC_EP_OFF})
