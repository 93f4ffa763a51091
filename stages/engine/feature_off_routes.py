"""SGLang 0.5.23's routes for deployment features the built-in engine does not have, answered
as a SGLang server started with default flags answers them (``srt/entrypoints/http_server.py``
and the handlers it calls), so that a client or router probing for a feature gets SGLang's
"not enabled" instead of a 404:

- n-gram speculation's external corpora (``POST /add_external_corpus``, ``POST
  /remove_external_corpus``, ``GET /list_external_corpora``): 400, ``Ngram speculative
  decoding is not enabled.`` (no ``--speculative-algorithm NGRAM``);
- HiCache storage tiers (``PUT|DELETE|GET /hicache/storage-backend``: 400, the admin API key
  SGLang demands first and this engine never has; ``POST /hicache/storage-backend/clear``: 400;
  ``GET /get_hicache_l3_cache_layout``: 200, a disabled layout);
- prefill/decode disaggregation (``POST /pd_role_switch``): 400, ``--enable-pd-role-switch is
  not set on this server``;
- the transfer engine (``GET /remote_instance_transfer_engine_info`` and its deprecated
  ``/get_`` name, ``rank`` in the query): 400, no transfer engine info for that rank;
- audio models (``POST /v1/audio/transcriptions``, a multipart form): 400, the model is no
  speech-recognition model (SGLang fails inside the request, see ``transcribe``);
- elastic expert parallelism (``POST /scale_elastic_ep``, ``GET /is_scaling_elastic_ep``:
  ``entrypoints/elastic_ep.py``): 404, ``elastic EP is not enabled (set
  --elastic-ep-backend)``.

Each request is checked first as SGLang checks it (its ``io_struct`` struct, FastAPI's query
and form parameters), so a malformed one gets SGLang's answer to it. Not here: ``POST
/dumper/{method}``, which SGLang registers only when ``DUMPER_SERVER_PORT=reuse``
(``http_server.py`` 907): without the dumper it is FastAPI's 404, which the engine answers
already for any path it does not serve (a GET there is a 404 too, not a 405).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Literal

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import TypeAdapter, ValidationError
from typing_extensions import Required, TypedDict

from stages.engine.control_fields import typed_body
from stages.engine.request_body import invalid, loads
from stages.engine.request_fields import Checker, validation_message
from transport.credit import sparse

__all__ = [
    "ADMIN_KEY_MISSING",
    "ELASTIC_EP_OFF",
    "NGRAM_OFF",
    "AddCorpusFields",
    "AttachHiCacheFields",
    "FeatureOffRoutes",
    "PdRoleSwitchFields",
    "RemoveCorpusFields",
]

log = structlog.get_logger("stages.engine.feature_off_routes")

NGRAM_OFF = "Ngram speculative decoding is not enabled."  # tokenizer_control_mixin.py 224
ELASTIC_EP_OFF = "elastic EP is not enabled (set --elastic-ep-backend)"  # elastic_ep.py 47
# http_server.py 2260 _admin_api_key_missing_response: SGLang's HiCache storage routes
# answer it before anything else when started without --admin-api-key, which this engine
# has no counterpart of
ADMIN_KEY_MISSING = (
    "This endpoint requires admin API key, but this server was started "
    "without one (admin-api-key). Restart with --admin-api-key to enable."
)
# SGLang's default --page-size (arg_groups/overrides.py _page_size_default): one token a
# page, as this engine's KV cache holds it
PAGE_SIZE = 1
_ADD_CORPUS = "sglang.srt.managers.io_struct.AddExternalCorpusReqInput"
_TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")


class _Base(TypedDict, total=False):  # io_struct.BaseReq
    rid: str | None
    http_worker_ipc: str | None


class AddCorpusFields(_Base, total=False):  # AddExternalCorpusReqInput: names checked only
    corpus_id: str | None
    file_path: str | None
    documents: list[str] | None
    token_chunks: list[list[int]] | None


class RemoveCorpusFields(TypedDict, total=False):  # the one key /remove_external_corpus reads
    corpus_id: Any


class AttachHiCacheFields(_Base, total=False):  # AttachHiCacheStorageReqInput
    hicache_storage_backend: Required[str]
    hicache_storage_backend_extra_config_json: str | None
    hicache_storage_prefetch_policy: str | None
    hicache_write_policy: str | None


class PdRoleSwitchFields(_Base, total=False):  # PdRoleSwitchReqInput
    new_role: Literal["prefill", "decode", ""]
    decode_cuda_graph_bs: list[int] | None
    decode_cuda_graph_memory_gb: float | None
    prepare_only: bool


# /v1/audio/transcriptions' form parameters but the file, as FastAPI reads them
# (http_server.py 1943-1953); the list's name is its alias
_TranscriptionForm = TypedDict(
    "_TranscriptionForm",
    {
        "model": str,
        "language": str | None,
        "response_format": str,
        "temperature": float,
        "stream": bool,
        "timestamp_granularities[]": list[str] | None,
    },
    total=False,
)

_ADD_CORPUS_NAMES = frozenset(AddCorpusFields.__optional_keys__)
_ATTACH_HICACHE = Checker(AttachHiCacheFields)
_PD_ROLE_SWITCH = Checker(PdRoleSwitchFields)
_TRANSCRIPTION = Checker(_TranscriptionForm, extensions=("file",))
_RANK: TypeAdapter[int] = TypeAdapter(int)


class FeatureOffRoutes:
    """The routes; the same on a generating and on a pooling engine (SGLang serves one app
    for every model kind)."""

    def __init__(self) -> None:
        self._deprecated: Counter[str] = Counter()

    def add_to(self, app: web.Application) -> None:
        add = app.router.add_route  # GET without HEAD, as FastAPI's routes
        add("POST", "/add_external_corpus", self.add_external_corpus)
        add("POST", "/remove_external_corpus", self.remove_external_corpus)
        add("GET", "/list_external_corpora", self.list_external_corpora)
        add("POST", "/hicache/storage-backend/clear", self.clear_hicache_storage)
        add("PUT", "/hicache/storage-backend", self.attach_hicache_storage)
        add("DELETE", "/hicache/storage-backend", self.hicache_storage)
        add("GET", "/hicache/storage-backend", self.hicache_storage)
        add("GET", "/get_hicache_l3_cache_layout", self.hicache_l3_cache_layout)
        add("POST", "/pd_role_switch", self.pd_role_switch)
        add("GET", "/remote_instance_transfer_engine_info", self.transfer_engine_info)
        add("GET", "/get_remote_instance_transfer_engine_info", self.transfer_engine_info)
        add("POST", "/v1/audio/transcriptions", self.transcribe)
        add("POST", "/scale_elastic_ep", self.scale_elastic_ep)
        add("GET", "/is_scaling_elastic_ep", self.is_scaling_elastic_ep)

    async def scale_elastic_ep(self, request: web.Request) -> web.Response:
        """``entrypoints/elastic_ep.py`` 15-50: the body read with Starlette's
        ``request.json()`` (Python's ``json``: its error's words in ``Invalid JSON: ...``), a
        JSON object whose ``new_ep_size`` is a positive integer (not a bool), each a 400
        ``{"error": ...}``; then, without ``--elastic-ep-backend``, a 404."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"Invalid JSON: {exc}", 400)
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400)
        size = body.get("new_ep_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            return _error("new_ep_size must be a positive integer", 400)
        return _error(ELASTIC_EP_OFF, 404)

    async def is_scaling_elastic_ep(self, request: web.Request) -> web.Response:
        """``entrypoints/elastic_ep.py`` 76-87: without ``--elastic-ep-backend``, a 404."""
        return _error(ELASTIC_EP_OFF, 404)

    async def add_external_corpus(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1043-1065: the body read with ``request.json()`` and handed to
        ``AddExternalCorpusReqInput(**body)`` (a msgspec struct: names checked, types not),
        whose ``TypeError`` is a 400 ``{success: false, message}``; then
        ``tokenizer_control_mixin.py`` 217-226: without NGRAM speculation, ``success: false``
        and ``NGRAM_OFF``, a 400 with the answer's four fields. A body that is no JSON, which
        SGLang lets out as a 500, is a 400 here."""
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict):  # Python's words for ** on anything else
            kind = "NoneType" if body is None else type(body).__name__
            return _failure(f"{_ADD_CORPUS}() argument after ** must be a mapping, not {kind}")
        unknown = next((key for key in body if key not in _ADD_CORPUS_NAMES), None)
        if unknown is not None:  # msgspec's Struct_vectorcall: the first unknown name
            return _failure(f"Unexpected keyword argument '{unknown}'")
        answer = {"success": False, "corpus_id": "", "message": NGRAM_OFF, "loaded_token_count": 0}
        return web.json_response(answer, status=400)

    async def remove_external_corpus(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1068-1083: ``corpus_id`` read from the JSON body; none (or a
        falsy one) is ``corpus_id is required.``; then ``tokenizer_control_mixin.py`` 289-297:
        ``NGRAM_OFF``, 400 ``{success, message}``. A body that is no JSON object, which SGLang
        lets out as a 500 (its ``body.get``), is a 400 here."""
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict):
            return _failure(f"the body must be a JSON object, got {_json_kind(body)}")
        if not body.get("corpus_id"):
            return _failure("corpus_id is required.")
        return _failure(NGRAM_OFF)

    async def list_external_corpora(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1086-1097 and ``tokenizer_control_mixin.py`` 304-312:
        ``NGRAM_OFF``, 400 with ``corpus_token_counts: {}`` (its default)."""
        answer = {"success": False, "corpus_token_counts": {}, "message": NGRAM_OFF}
        return web.json_response(answer, status=400)

    async def clear_hicache_storage(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1103-1111: the scheduler's ``clear_hicache_storage_wrapped``
        (``scheduler.py`` 5230-5238) answers ``success=False`` without
        ``--enable-hierarchical-cache`` (or LMCache), and the route answers 400 with its one
        text, which says ``cleared`` whatever happened (SGLang's words, kept: the status is
        what tells)."""
        return web.Response(text="Hierarchical cache storage backend cleared.\n", status=400)

    async def attach_hicache_storage(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1123-1133: the body is ``AttachHiCacheStorageReqInput``
        (``hicache_storage_backend`` required), checked before the handler runs; then, with no
        admin API key, ``ADMIN_KEY_MISSING`` (400 ``{"error": ...}``)."""
        body = await typed_body(request, _ATTACH_HICACHE)
        if isinstance(body, web.Response):
            return body
        return _admin_key_missing()

    async def hicache_storage(self, request: web.Request) -> web.Response:
        """``GET`` (``http_server.py`` 1184-1190) and ``DELETE`` (1157-1163): with no admin
        API key, ``ADMIN_KEY_MISSING`` before anything else."""
        return _admin_key_missing()

    async def hicache_l3_cache_layout(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1204-1218: the one scheduler's reply (``scheduler.py``
        5552-5557 ``_hicache_l3_layout``: hierarchical cache off) through
        ``merge_l3_layouts`` unchanged: 200 with ``hicache_storage.disabled_l3_layout``
        (``mem_cache/hicache_storage.py`` 208-218) at SGLang's default page size."""
        return web.json_response(
            {
                "enabled": False,
                "backend": None,
                "page_size": PAGE_SIZE,
                "hicache_object_layout": {"pools": []},
                "reason": "Hierarchical cache is disabled",
            }
        )

    async def pd_role_switch(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1635-1648: the body is ``PdRoleSwitchReqInput`` (``new_role``
        one of ``prefill``, ``decode``, ``""``), checked first; then
        ``tokenizer_control_mixin.py`` 920-933: without ``--enable-pd-role-switch``, a 400
        with the whole ``PdRoleSwitchReqOutput`` (``msgspec_to_builtins``: ``BaseReq``'s
        fields first), ``old_role`` the disaggregation mode, ``"null"``."""
        body = await typed_body(request, _PD_ROLE_SWITCH)
        if isinstance(body, web.Response):
            return body
        answer = {
            "rid": None,
            "http_worker_ipc": None,
            "success": False,
            "message": "--enable-pd-role-switch is not set on this server",
            "old_role": "null",
            "new_role": body.get("new_role", ""),
            "safe_to_restore": True,
        }
        return web.json_response(answer, status=400)

    async def transfer_engine_info(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1366-1400: ``rank`` an integer query parameter (FastAPI's
        check first: ``query.rank: ...``); none or a negative one is ``Missing or invalid rank
        parameter``; else SGLang asks its engine-info bootstrap server, which it starts only
        with ``--remote-instance-weight-loader-start-seed-via-transfer-engine``
        (``entrypoints/engine.py`` 1187-1201), so the request fails and the answer is ``Failed
        to get transfer engine info for rank N``: 400 ``{"error": {"message"}}`` either way.
        The deprecated ``/get_`` name logs a warning, as SGLang's does."""
        path = request.match_info.route.resource.canonical  # type: ignore[union-attr]
        if path.startswith("/get_"):
            self._deprecated[path] += 1
            if sparse(self._deprecated[path]):
                log.warning("deprecated_route", route=path,
                            use="/remote_instance_transfer_engine_info",
                            count=self._deprecated[path])  # fmt: skip
        values = request.query.getall("rank", [])
        rank = None
        if values:  # the last one, as Starlette's QueryParams.get
            try:
                rank = _RANK.validate_python(values[-1])
            except ValidationError as exc:
                return invalid(f"query.rank: {validation_message(exc)}")
        if rank is None or rank < 0:
            message = "Missing or invalid rank parameter"
        else:
            message = f"Failed to get transfer engine info for rank {rank}"
        return web.json_response({"error": {"message": message}}, status=400)

    async def transcribe(self, request: web.Request) -> web.Response:
        """``http_server.py`` 1942-1978: the form's parameters checked by FastAPI first (a
        ``file`` upload required, ``temperature`` a number, ``stream`` a boolean: SGLang's
        validation shape), then ``response_format`` one of ``json``, ``text``,
        ``verbose_json`` (400 ``{"error": {"message"}}``).

        Then SGLang hands the audio to ``OpenAIServingTranscription.create_transcription``,
        whose adapter for a model that is no ASR model is Whisper's
        (``transcription_adapters/base.py`` 186-198). Its sampling parameters carry
        ``language`` or ``_detect_language``, which only the Whisper processor pops
        (``multimodal/processors/whisper.py`` 184); a text-only model has none, so
        ``tokenizer_manager.py`` 1565 ``SamplingParams(**...)`` raises ``TypeError`` and
        ``serving_base.py`` 136-142 answers 500 ``Internal server error: Unexpected keyword
        argument ...`` (or, on a context under 448 tokens, 1352-1379's too-many-tokens 400).
        Here: a 400 in that ``ErrorResponse`` shape saying that this engine has no audio
        model. A part sent with ``filename=""`` is read as text here (Starlette: as a file)."""
        try:
            form = await request.post() if _is_form(request.content_type) else {}
        except (ValueError, HttpProcessingError):  # FastAPI's HTTPException(400) for it
            return invalid("There was an error parsing the body", "400")
        fields: dict[str, Any] = {}
        problems = []
        file = _last(form, "file")
        if file is None:
            problems.append("file: Field required")
        elif not isinstance(file, web.FileField):
            problems.append("file: Value error, Expected UploadFile, received: <class 'str'>")
        for key in dict.fromkeys(key for key in form if key != "file"):
            values = [_text(value) for value in form.getall(key)]  # type: ignore[attr-defined]
            if key == "timestamp_granularities[]":
                fields[key] = [value for value in values if value != ""] or None
            elif values[-1] != "":  # an empty field is a missing one (FastAPI's forms)
                fields[key] = values[-1]
        try:
            fields = _TRANSCRIPTION(fields)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            return invalid("; ".join(problems))
        if fields.get("response_format", "json") not in _TRANSCRIPTION_FORMATS:
            message = "Only 'json', 'text', and 'verbose_json' formats supported"
            return web.json_response({"error": {"message": message}}, status=400)
        return invalid(
            "this engine serves a text-only model, which cannot transcribe audio: "
            "/v1/audio/transcriptions needs a speech-recognition model (SGLang serves it "
            "with an audio model such as Whisper or Qwen3-ASR)",
            "BadRequestError",
        )


async def _json(request: web.Request) -> Any:
    """The body as Starlette's ``request.json()`` reads it (whatever its content type), or a
    400 ``{success: false, message}`` when it is no JSON (SGLang: a 500)."""
    raw = await request.read()
    try:
        return loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return _failure(f"the body is no JSON: {exc}")


def _json_kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _failure(message: str) -> web.Response:
    """SGLang's 400 ``{success: false, message}``."""
    return web.json_response({"success": False, "message": message}, status=400)


def _admin_key_missing() -> web.Response:
    return _error(ADMIN_KEY_MISSING, 400)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _is_form(content_type: str) -> bool:
    """Whether Starlette's ``request.form()`` parses a body of this type (else: no fields)."""
    return content_type in ("multipart/form-data", "application/x-www-form-urlencoded")


def _last(form: Any, key: str) -> Any:
    """A form field's last value (Starlette's ``FormData.get``); None when it is missing or
    empty, as FastAPI reads an empty one."""
    values = form.getall(key, []) if form else []
    if not values:
        return None
    value = values[-1]
    if isinstance(value, web.FileField):
        return value
    return _text(value) or None


def _text(value: Any) -> Any:
    """A form field as Starlette hands it over: text (aiohttp keeps a part without a text
    content type as bytes)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return value
