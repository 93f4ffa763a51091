"""``inflight engine``: serve a Hugging Face causal LM over SGLang's HTTP API subset (aiohttp).

Run: ``inflight engine --model DIR --port 30000 [--host 127.0.0.1] [--device cpu|cuda]
[--dtype auto|float32|bfloat16|float16] [--max-running 64] [--stream-interval 1] [--seed 0]
[--event-loop-turns]
[--weight-version 0] [--reasoning-parser auto|qwen3|deepseek-r1|...]
[--prefix-cache-tokens 32768] [--prefix-cache-max-age 2] [--chat-template FILE]
[--tool-call-parser auto|qwen25|hermes|deepseekv31|kimi_k2|...] [--enable-response-store]
[--enable-cache-report] [--is-embedding] [--log-file PATH] [--api-key KEY] [--insecure]``

A reward model (a ``*ForSequenceClassification`` checkpoint), or any model with
``--is-embedding``, is served as SGLang serves a pooling model instead: ``/encode``,
``/classify``, ``/v1/embeddings`` (``stages.engine.pooling_server``).

With an API key (``INFLIGHT_ENGINE_API_KEY`` in its environment, which is how the generator's
launcher hands it over; or ``--api-key``, which ``ps`` shows) it answers as SGLang does with
``--api-key``: ``Authorization: Bearer KEY`` required, else 401 ``{"error": "Unauthorized"}``;
``/health`` always answers (``stages.engine.auth``). Bound to a host other machines can reach, it
refuses to start without a key unless ``--insecure`` is given.

Routes (SGLang names and layouts): ``POST /generate``, ``POST /abort_request``, ``POST
/pause_generation``, ``POST /continue_generation``, ``GET|POST /flush_cache``, ``GET /health``,
``GET /model_info`` (also ``/get_model_info``), ``GET /get_server_info``, ``GET
/get_weight_version``, ``POST /update_weight_version``; the weight routes
(``stages.engine.weight_routes``: ``/init_weights_update_group``,
``/update_weights_from_distributed`` inside ``/begin_weight_update`` ... ``/end_weight_update`` as
SGLang 0.5.23 wants it, ``/destroy_weights_update_group``, ``/update_weights_from_tensor`` in such
a session too, ``/update_weights_from_disk``, ``/get_weights_by_name``, ``GET|POST
/weights_checker``, ``/update_weights_from_ipc`` refused as SGLang without checkpoint-engine, and
``/init_weights_send_group_for_remote_instance`` and ``/send_weights_to_remote_instance``: a new
engine's weights from this one, ``stages.engine.remote_instance``);
``GET|POST /release_memory_occupation`` and ``/resume_memory_occupation``
(``stages.engine.memory_routes``: the weights and KV cache given back to a colocated trainer);
``POST /v1/tokenize`` and ``/v1/detokenize`` (``stages.engine.tokenize_routes``); ``POST
/parse_function_call`` and ``/separate_reasoning`` (``stages.engine.parse_routes``); ``GET|POST
/start_profile`` and ``/stop_profile`` (``stages.engine.profile_routes``); ``GET|POST /freeze_gc``
and ``/slow_down`` (``stages.engine.maintenance_routes``); ``GET /v1/loads``
(``stages.engine.load_routes``: the load a router balances on); ``stream: true`` answers server-sent
events (``stages.engine.streaming``); the OpenAI-compatible ``/v1`` routes (and SageMaker's
``/invocations``) are ``stages.engine.openai_api``'s, Ollama's ``/api/*`` routes
``stages.engine.ollama_api``'s; ``GET /`` says "SGLang is running", as SGLang's. A malformed
request gets HTTP 400 with ``{"error": {"message": "<field>: <problem>"}}``; weight routes answer
``{"success": false, "message": ...}`` instead, as SGLang does. A client that leaves mid-stream is
counted as refused with status 499 (``refused_requests``). The model runs on the scheduler thread;
this event loop only parses, waits and answers, so requests are accepted while a decode step runs.

Prefix cache (``stages.engine.prefix_cache``; ``--prefix-cache-tokens 0`` turns it off): each
response's ``meta_info.cached_tokens`` counts the prompt tokens served from it (SGLang's field)
and ``cached_weight_version`` names the version that computed them; ``/get_server_info`` has its
counters under ``prefix_cache``. ``/flush_cache`` empties it (running requests keep their own
KV, so unlike SGLang it never refuses), as does ``update_weights_from_distributed`` with
``flush_cache`` true (SGLang's default; the publisher sends false: in-flight updates keep it).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
import torch
from aiohttp import web

from pipeline import heap
from stages.detokenize import decoder
from stages.engine import (
    control_fields,
    generate_contract,
    ignored_fields,
    preferred_params,
    sglang_flags,
)
from stages.engine.aborts import raise_aborted_with_error, tokenizer_answer
from stages.engine.auth import API_KEY_ENV, UNAUTHORIZED, authorized, bind_error
from stages.engine.client_watch import ClientWatch
from stages.engine.context_fit import max_input
from stages.engine.encode_routes import EncodeRoutes
from stages.engine.engine_metrics import EngineMetrics
from stages.engine.expert_distribution import (
    ExpertDistributionRecorder,
    ExpertDistributionRoutes,
    recorder_buffer_flag,
    recorder_mode_flag,
)
from stages.engine.feature_off_routes import FeatureOffRoutes
from stages.engine.grammar import GrammarSet
from stages.engine.harmony import kept_stop_ids
from stages.engine.identity import ENGINE_ID_ENV, ENGINE_ID_HEADER
from stages.engine.images import remote_images
from stages.engine.load_routes import LoadRoutes
from stages.engine.loader import DTYPE_ALIASES, DTYPES, LOAD_FORMATS, LoadedModel, load_model
from stages.engine.logging_routes import LoggingRoutes
from stages.engine.loop_turns import Turns, turn_taking_loop
from stages.engine.lora_adapters import AdapterError
from stages.engine.lora_routes import LoraRoutes, lora_refs
from stages.engine.maintenance_routes import MaintenanceRoutes
from stages.engine.memory_routes import MemoryRoutes
from stages.engine.openai_api import OpenAIRoutes
from stages.engine.openai_chat import ChatSettings
from stages.engine.openai_responses import ResponseStore
from stages.engine.openai_score import mis_refusal
from stages.engine.parse_routes import ParseRoutes
from stages.engine.pooling import model_kind
from stages.engine.priority import Priorities
from stages.engine.priority import from_flags as priority_flags
from stages.engine.profile_routes import ProfileRoutes
from stages.engine.protocol import (
    SAMPLING_MASK_MAX_TOKENS,
    GenerateInput,
    RequestError,
    SamplingParams,
    SequenceResult,
    parse_sampling_params,
    render_sample,
    token_texts,
)
from stages.engine.reasoning import PARSERS as REASONING_PARSERS
from stages.engine.reasoning import end_tag_ids
from stages.engine.remote_instance import RemoteLoadError, RemoteSeed
from stages.engine.request_body import (
    bad_request,
    dumps,
    invalid,
    json_response,
)
from stages.engine.request_error import AbortedWithError
from stages.engine.request_log import LEVELS, RequestLog, entry
from stages.engine.scheduler import (
    MAMBA_FULL_MEMORY_RATIO,
    PREFIX_CACHE_MAX_AGE,
    PREFIX_CACHE_TOKENS,
    Scheduler,
)
from stages.engine.session_routes import SessionRoutes
from stages.engine.sessions import Recording, Sessions
from stages.engine.streaming import parse_body, stream_generate, write_events
from stages.engine.strict_thinking import StrictThinking
from stages.engine.template_detection import resolve_auto
from stages.engine.tokenize_routes import TokenizeRoutes
from stages.engine.tool_calls import PARSERS as TOOL_CALL_PARSERS
from stages.engine.torch_threads import in_passing_thread
from stages.engine.weight_routes import WeightRoutes
from transport.credit import sparse

__all__ = [
    "ENGINE_VERSION",
    "SERVED_VERSION",
    "app_options",
    "base_app",
    "build_app",
    "build_scheduler",
    "engine_id_header",
    "generate",
    "generate_results",
    "ignored_counts",
    "main",
    "mis_allowed",
    "model_info",
    "parse_args",
    "plain_answers",
    "refused_counts",
    "remote_seed",
    "request_log_of",
    "resolve_parsers",
    "run_loop",
    "serve",
    "sessions_of",
]

log = structlog.get_logger("stages.engine.server")

_SCHEDULER = web.AppKey("scheduler", Scheduler)
_LOADED = web.AppKey("loaded", LoadedModel)
_WEIGHTS = web.AppKey("weights", "WeightRoutes")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_DECODE = web.AppKey("decode", object)
_INCREMENTAL = web.AppKey("incremental_stream", bool)  # --incremental-streaming-output
_SESSIONS = web.AppKey("sessions", Sessions)
_CLIENT_WATCH = web.AppKey("client_watch", ClientWatch)
_REFUSED = web.AppKey("refused", Counter)
_IGNORED = web.AppKey("ignored", Counter)
_API_KEY = web.AppKey("api_key", str)
_OVERRIDES = web.AppKey("overrides", dict)  # what /set_internal_state set
_ENGINE_ID = web.AppKey("engine_id", dict)  # the /health header naming this engine, or none
SERVED_NAME = web.AppKey("served_model_name", str)  # the model's name on the OpenAI routes
_PARSERS = web.AppKey("parsers", dict)  # /model_info's reasoning_parser and tool_call_parser
_MAX_BODY = 256 * 1024 * 1024  # token-id batches and weight metadata can be large
# how long /health_generate waits for a step: SGLang's variable, and its default
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("inflight-rl")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


ENGINE_VERSION = _package_version()
SERVED_VERSION = f"inflight-rl {ENGINE_VERSION}"  # what /server_info and /v1/loads name


def sessions_of(app: web.Application) -> Sessions:
    """The ``/open_session`` sessions of an app ``build_app`` made."""
    return app[_SESSIONS]


def build_app(
    loaded: LoadedModel,
    scheduler: Scheduler,
    *,
    max_body: int = _MAX_BODY,
    api_key: str | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    trust_request_chat_template: bool = False,
    sampling_defaults: str = "model",
    engine_id: str | None = None,
    response_store: bool = False,
    cache_report: bool = False,
    enable_metrics: bool = False,
    served_model_name: str | None = None,
    streaming_sessions: bool = False,
    request_log: RequestLog | None = None,
    mis: bool = False,
    default_usage: bool = False,
    incremental_stream: bool = False,
    sglext_ids: tuple[bool, bool] = (False, False),
) -> web.Application:
    """The aiohttp application; the caller starts and stops ``scheduler``. A request body over
    ``max_body`` bytes is refused (413) without being read whole; with ``api_key``, a request
    without it is refused (401, counted like every refusal); with ``engine_id``, ``/health``
    names it (``stages.engine.identity``); ``response_store``: ``/v1/responses`` keeps its
    answers (SGLang's ``--enable-response-store``); ``cache_report``: the ``/v1`` routes'
    ``usage`` has ``prompt_tokens_details.cached_tokens`` (SGLang's ``--enable-cache-report``);
    ``enable_metrics``: ``GET /metrics`` and each answer's time stats (SGLang's
    ``--enable-metrics``, ``stages.engine.engine_metrics``); ``served_model_name``: the
    model's name on the OpenAI routes (SGLang's ``--served-model-name``; None: its path);
    ``request_log``: SGLang's request logging and dumps (``stages.engine.request_log``; None:
    off until ``/configure_logging`` turns it on); ``mis``: ``/v1/score``'s multi-item scoring
    (SGLang's ``--enable-mis``, ``stages.engine.openai_score``); ``default_usage``: every
    streamed ``/v1`` completion and chat answer ends with its usage chunk, asked or not
    (SGLang's ``--stream-response-default-include-usage``); ``incremental_stream``: a
    ``/generate`` stream's chunks hold what is new (SGLang's ``--incremental-streaming-output``,
    ``stages.engine.incremental_stream``); ``sglext_ids``: every chat answer's ``sglext``
    input and output ids (SGLang's ``--return-input-ids``, ``--return-output-ids``).
    """
    app = base_app(max_body=max_body, api_key=api_key, engine_id=engine_id)
    name = served_model_name or str(loaded.path)
    app[SERVED_NAME] = name
    app[_LOADED] = loaded
    app[_SCHEDULER] = scheduler
    app[_INCREMENTAL] = incremental_stream
    app[_DECODE] = decoder(loaded.tokenizer)
    weights = WeightRoutes(scheduler, str(loaded.path))
    app[_WEIGHTS] = weights
    decode = app[_DECODE]
    requests = request_log if request_log is not None else RequestLog()
    requests.decode = decode
    requests.config_updates = app[_OVERRIDES] = {}  # /set_internal_state's
    scheduler.request_log = requests
    # a failing model step writes the crash dump (--crash-dump-folder) before what was in
    # flight is failed, on the scheduler thread
    scheduler.on_step_failed = lambda exc: (
        requests.crash_dump(f"a model step failed: {exc!r}", scheduler.outputs_so_far())
        if requests.crash_folder
        else None
    )
    chat = ChatSettings.of(
        loaded.tokenizer,
        Path(loaded.path),
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        default_kwargs=default_chat_template_kwargs,
        sampling_defaults=sampling_defaults,
    )
    if chat is not None:
        chat.trust_request_template = trust_request_chat_template
        chat.auto_truncate = scheduler.auto_truncate
        chat.mis = mis  # /v1/decisions and /v1/systemone refuse to run under it
        chat.vision = loaded.vision is not None  # image parts read (images.Vision)
    app[_PARSERS] = {"reasoning_parser": reasoning_parser, "tool_call_parser": tool_call_parser}
    loaded.kept_stop_ids = kept_stop_ids(loaded.tokenizer, tool_call_parser)
    app[_CLIENT_WATCH] = ClientWatch()  # requests not streamed: aborted once their client goes
    sessions = app[_SESSIONS] = Sessions(
        lambda rids: scheduler.abort_many(rids, "replaced in its session"),
        streaming=streaming_sessions,  # SGLang's --enable-streaming-session
    )

    async def in_session(body: Any, client: web.Request | None = None) -> Any:
        """A /v1 request, in its session if it names one (``client``: its HTTP request,
        watched while it runs)."""
        body, serving = _session_request(sessions, body, scheduler, loaded)
        try:
            return await generate(loaded, serving, decode, body, client=client)
        finally:
            _settle(serving)

    def stream_in_session(body: Any, progress: bool = False) -> Any:
        body, serving = _session_request(sessions, body, scheduler, loaded)
        try:  # checked and queued at once (stream_generate)
            return stream_generate(loaded, serving, decode, body, progress=progress)
        finally:
            _settle(serving)

    OpenAIRoutes(
        in_session,
        stream_in_session,
        decode,
        served_model_name=name,
        context_length=loaded.context_length,
        on_disconnect=lambda request: _refused(request, 499, "the client went away mid-stream"),
        chat=chat,
        progress_stream=lambda body: stream_in_session(body, progress=True),
        adapters=scheduler.adapters,
        response_store=ResponseStore() if response_store else None,
        preferred=scheduler.preferred_sampling_params,
        auto_truncate=scheduler.auto_truncate,
        cache_report=cache_report,
        request_log=requests,
        watched=in_session,
        prefix_cache=scheduler.prefix_cache_on,
        embed_width=loaded.embed_width,
        mis=mis,
        images=lambda body: remote_images(loaded.vision, body),
        default_usage=default_usage,
        sglext_ids=sglext_ids,
    ).add_to(app)
    TokenizeRoutes(loaded, chat).add_to(app)
    EncodeRoutes(None, name).add_to(app)  # SGLang's refusal: not an embedding model
    ParseRoutes(loaded.tokenizer).add_to(app)
    MemoryRoutes(scheduler).add_to(app)
    ProfileRoutes(scheduler).add_to(app)
    ExpertDistributionRoutes(scheduler).add_to(app)
    MaintenanceRoutes.of(scheduler, app[_OVERRIDES]).add_to(app)
    LoggingRoutes(requests).add_to(app)
    FeatureOffRoutes().add_to(app)  # what SGLang answers without those features
    if enable_metrics:  # each finished request recorded, with its time stats in its meta_info
        scheduler.metrics = EngineMetrics(name, loaded.context_length)
    capacity = _max_total_tokens(scheduler, loaded)
    LoadRoutes(scheduler, loaded.model, capacity, SERVED_VERSION, scheduler.metrics).add_to(app)
    SessionRoutes(sessions, scheduler).add_to(app)
    app.router.add_post("/generate", _generate)
    app.router.add_put("/generate", _generate)  # SGLang's route takes PUT too
    app.router.add_post("/abort_request", _abort_request)
    app.router.add_post("/pause_generation", _unturned(scheduler, _pause))
    app.router.add_post("/continue_generation", _unturned(scheduler, _continue))
    app.router.add_post("/update_weight_version", _unturned(scheduler, weights.update_version))
    app.router.add_route("GET", "/flush_cache", _flush_cache)
    app.router.add_post("/flush_cache", _flush_cache)
    app.router.add_post("/init_weights_update_group", _unturned(scheduler, weights.init_group))
    app.router.add_post("/update_weights_from_distributed", _unturned(scheduler, weights.update))
    app.router.add_post("/destroy_weights_update_group", weights.destroy_group)
    app.router.add_post("/begin_weight_update", weights.begin)
    app.router.add_post("/end_weight_update", weights.end)
    app.router.add_post("/update_weights_from_disk", _unturned(scheduler, weights.update_from_disk))
    app.router.add_post(
        "/update_weights_from_tensor", _unturned(scheduler, weights.update_from_tensor)
    )
    app.router.add_post("/update_weights_from_ipc", weights.update_from_ipc)
    app.router.add_post(  # a new engine's weights from this one (remote_instance)
        "/init_weights_send_group_for_remote_instance",
        _unturned(scheduler, weights.init_send_group),
    )
    app.router.add_post(
        "/send_weights_to_remote_instance", _unturned(scheduler, weights.send_weights)
    )
    app.router.add_route("GET", "/get_weights_by_name", weights.weights_by_name)
    app.router.add_post("/get_weights_by_name", weights.weights_by_name)
    app.router.add_route("GET", "/weights_checker", weights.check)
    app.router.add_post("/weights_checker", weights.check)
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health_generate)
    app.router.add_get("/ready", _health)
    app.router.add_get("/ping", _health)  # SageMaker's: 200 while paused too, as SGLang's
    # SGLang's current names, and the get_ ones it keeps (deprecated there)
    app.router.add_get("/model_info", _model_info)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/get_weight_version", _weight_version)
    LoraRoutes(scheduler).add_to(app)
    app.on_shutdown.append(weights.stop_joining)
    app.on_cleanup.append(weights.close)
    return app


@web.middleware
async def _tally(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Count every refused request (4xx) by route and status, and every request key the route
    ignored (``ignored_fields``) by route and key; log the 1st, 2nd, 4th ... of each kind:
    garbage is answered, counted, and cannot flood the log."""
    with ignored_fields.collect() as ignored:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # 404, 405, 413 (a body over client_max_size) ...
            if not 400 <= exc.status < 500:
                raise
            _refused(request, exc.status, exc.reason)
            # FastAPI's answer (SGLang's routing): {"detail": "Not Found"}, not aiohttp's text
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return web.json_response({"detail": exc.reason}, status=exc.status, headers=allow)
        finally:
            if ignored:
                _ignored(request, ignored)
    if 400 <= response.status < 500:
        _refused(request, response.status, getattr(response, "text", None) or "")
    return response


@web.middleware
async def _check_key(request: web.Request, handler: Callable) -> web.StreamResponse:
    """SGLang's API-key rule; the path is the matched route's, so that no spelling of a path
    reaches a route other than the one exempted."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else request.path
    key = request.app[_API_KEY]
    if not authorized(request.method, path, request.headers.get("Authorization"), key):
        return web.json_response(UNAUTHORIZED, status=401)
    return await handler(request)


def _refused(request: web.Request, status: int, message: str) -> None:
    counts = request.app[_REFUSED]
    key = f"{request.method} {_route(request)} {status}"
    counts[key] += 1
    if sparse(counts[key]):
        log.warning("request_refused", request=key, count=counts[key], message=message[:300])


def _route(request: web.Request) -> str:
    route = request.match_info.route.resource
    return route.canonical if route is not None else "(no route)"


_IGNORED_KINDS = 1024  # distinct route-and-key counts kept; past them: "(other keys)"


def _ignored(request: web.Request, keys: list[str]) -> None:
    counts = request.app[_IGNORED]
    for name in dict.fromkeys(keys):
        key = f"{request.method} {_route(request)} {name[:100]}"
        if key not in counts and len(counts) >= _IGNORED_KINDS:  # random keys: bounded
            key = f"{request.method} {_route(request)} (other keys)"
        counts[key] += 1
        if sparse(counts[key]):
            log.warning("request_field_ignored", request=key, count=counts[key])


# ---- generation ------------------------------------------------------------------------------


async def _generate(request: web.Request) -> web.StreamResponse:
    try:
        body, refused = generate_contract.read(
            await request.read(), request.headers.get("Content-Type")
        )
        if refused is not None:  # SGLang's checks before its route
            return refused
        loaded, scheduler = request.app[_LOADED], request.app[_SCHEDULER]
        body = preferred_params.with_preferred(body, scheduler.preferred_sampling_params)
        body, scheduler = _session_request(request.app[_SESSIONS], body, scheduler, loaded)
        try:
            if isinstance(body, dict) and body.get("stream") is True:
                async with remote_images(loaded.vision, body):  # (checked and queued at once)
                    chunks = stream_generate(
                        loaded,
                        scheduler,
                        request.app[_DECODE],
                        body,
                        tokenizer_aborts=True,
                        headers=request.headers,
                        incremental=request.app.get(_INCREMENTAL, False),
                    )
                return await write_events(
                    request,
                    chunks,
                    dumps,
                    on_disconnect=lambda: _refused(request, 499, "the client went away mid-stream"),
                )
            rendered = await generate(
                loaded,
                scheduler,
                request.app[_DECODE],
                body,
                request.headers,
                client=None if body.get("background") is True else request,
            )
        finally:
            _settle(scheduler)
        # a sample aborted while it waited: answered as SGLang's tokenizer answers it (the
        # /v1 routes, which build on ``generate``, read the fields it leaves out)
        if isinstance(rendered, list):
            rendered = [tokenizer_answer(answer) for answer in rendered]
        else:
            rendered = tokenizer_answer(rendered)
    except RequestError as exc:
        return bad_request(str(exc))
    except AbortedWithError as exc:  # SGLang: its ValueError's 400, or an HTTPException's
        if exc.status == 400:
            return bad_request(str(exc))
        return invalid(str(exc), str(exc.status), status=exc.status)
    except ValueError as exc:  # a rid already in flight: nothing was queued
        return bad_request(str(exc))
    return json_response(rendered)


def _session_request(
    sessions: Sessions, body: Any, scheduler: Scheduler, loaded: LoadedModel
) -> tuple[Any, Any]:
    """A generating request's body and the scheduler to serve it with: its session's prompt and
    a scheduler that records its output there, where it names a session (``Sessions.request``;
    SessionError, a 400, where that is refused)."""
    tokenizer = loaded.tokenizer
    return sessions.request(
        body,
        scheduler,
        None if tokenizer is None else tokenizer.encode,
        None if tokenizer is None else tokenizer.bos_token_id,
        None if loaded.vision is None else loaded.vision.spans,
    )


def _settle(scheduler: Any) -> None:
    """After a request was served or refused: a session's request refused before it ran leaves
    no trace in its session."""
    if isinstance(scheduler, Recording):
        scheduler.refused()


async def generate(
    loaded: LoadedModel,
    scheduler: Scheduler,
    decode: Callable[[list[int], bool], str] | None,
    body: Any,
    headers: Any = None,
    *,
    client: web.Request | None = None,
) -> Any:
    """What ``/generate`` answers to ``body`` (SGLang's layout: one result, or a list of them).

    Raises RequestError for a malformed body and ValueError for a rid already in flight (the
    route answers 400 for both); cancelled (the client went away), it aborts the requests it
    queued, as SGLang aborts on disconnect. With the server's request log active
    (``stages.engine.request_log``), the request is logged once checked and each sample at its
    end (``headers``: the HTTP request's, for the headers it logs). ``client``: the HTTP
    request whose connection is watched while the request runs (``watch_client``).
    """

    def render(inputs: list[GenerateInput], results: list[SequenceResult]) -> list[Any]:
        token_text = token_texts(decode, body)  # (the body checked by now)
        return [
            render_sample(inp, result, decode, token_text)
            for inp, result in zip(inputs, results, strict=True)
        ]

    _, results, listed, rendered = await _served(loaded, scheduler, body, render, headers, client)
    raise_aborted_with_error(result.finish_reason for result in results)
    return rendered if listed else rendered[0]


async def generate_results(
    loaded: LoadedModel, scheduler: Scheduler, body: Any
) -> tuple[list[GenerateInput], list[SequenceResult], bool]:
    """``generate`` before rendering: the requests, their results (in request order) and
    whether the body was a batch. ``stages.engine.in_process`` hands them on as they are
    (rendered only for the request log, where it is active)."""
    inputs, results, listed, _ = await _served(loaded, scheduler, body, None)
    return inputs, results, listed


async def _served(
    loaded: LoadedModel,
    scheduler: Scheduler,
    body: Any,
    render: Callable[[list[GenerateInput], list[SequenceResult]], list[Any]] | None,
    headers: Any = None,
    client: web.Request | None = None,
) -> tuple[list[GenerateInput], list[SequenceResult], bool, list[Any] | None]:
    """``body`` checked, queued and served: its inputs, results, whether it was a batch and
    the answers ``render`` made of them (None: none wanted; the request log's own, plain,
    where it is active). Logged where the request log is active, aborts too, as SGLang logs
    them (before it raises)."""
    async with remote_images(loaded.vision, body):
        inputs, listed = parse_body(loaded, scheduler, body)
    requests = scheduler.request_log
    logged = entry(requests, body, (inp.rid for inp in inputs), listed, headers)
    answers = None
    unwatch = None if client is None else _watch_client(client, scheduler, inputs)
    try:
        results = await _submit(scheduler, inputs)
        if render is not None:
            answers = render(inputs, results)
        if logged is not None:
            requests.finished_all(logged, answers or plain_answers(requests, inputs, results))
    finally:
        if unwatch is not None:
            unwatch()
        if logged is not None:
            requests.ended(logged)
    return inputs, results, listed, answers


def _watch_client(
    client: web.Request, scheduler: Scheduler, inputs: list[GenerateInput]
) -> Callable[[], None]:
    """Abort ``inputs`` once ``client``'s connection is gone, counted as a 499
    (``client_watch``); returns the function that stops the watch."""
    watch = client.app[_CLIENT_WATCH]

    def gone() -> None:
        scheduler.abort_many([inp.rid for inp in inputs], "the client went away")
        _refused(client, 499, "the client went away before its answer")

    key = watch.watch(client, gone)
    return lambda: watch.unwatch(key)


def plain_answers(
    requests: RequestLog, inputs: list[GenerateInput], results: list[SequenceResult]
) -> list[Any]:
    """What ``/generate`` answers for ``inputs``' ``results`` (no ``return_text_in_logprobs``
    texts): the request log's ``out`` where nothing else rendered them."""
    return [
        render_sample(inp, result, requests.decode, None)
        for inp, result in zip(inputs, results, strict=True)
    ]


async def _submit(scheduler: Scheduler, inputs: list[GenerateInput]) -> list[SequenceResult]:
    """Queue ``inputs`` (one command and one future, however many samples they hold) and wait
    for their results."""
    try:
        return await scheduler.submit_async(inputs)
    except asyncio.CancelledError:
        scheduler.abort_many([inp.rid for inp in inputs])
        raise


async def _abort_request(request: web.Request) -> web.Response:
    """SGLang's ``AbortReq``: ``rid`` (none: ``""``, which names no request: nothing is
    aborted) or ``abort_all``. Answered as SGLang 0.5.23's route answers
    (``http_server.abort_request``: ``Response(status_code=200)``): 200 with an empty body,
    whether or not anything was aborted; the log says how many samples were."""
    body = await control_fields.typed_body(request, control_fields.ABORT)
    if isinstance(body, web.Response):
        return body
    rid = body.get("rid") or ""
    abort_all = body.get("abort_all", False)
    if rid or abort_all:
        aborted = await asyncio.wrap_future(
            request.app[_SCHEDULER].abort(rid or None, abort_all=abort_all)
        )
        log.info("abort_request", rid=rid or None, abort_all=abort_all, aborted=aborted)
    return web.Response(status=200)


async def _pause(request: web.Request) -> web.Response:
    body = await control_fields.typed_body(request, control_fields.PAUSE)
    if isinstance(body, web.Response):
        return body
    mode = body.get("mode", "abort")  # SGLang's default
    await asyncio.wrap_future(request.app[_SCHEDULER].pause(mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _continue(request: web.Request) -> web.Response:
    """SGLang's ``ContinueGenerationReqInput``: ``torch_empty_cache`` (default true: CUDA's
    cached blocks go back to the driver before decoding resumes; nothing to do on CPU); other
    fields are ignored, as there."""
    body = await control_fields.typed_body(request, control_fields.CONTINUE)
    if isinstance(body, web.Response):
        return body
    empty_cache = body.get("torch_empty_cache", True)
    if empty_cache and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    await asyncio.wrap_future(request.app[_SCHEDULER].resume())
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def _flush_cache(request: web.Request) -> web.Response:
    dropped = await asyncio.wrap_future(request.app[_SCHEDULER].flush_prefix_cache())
    return web.Response(text=f"Cache flushed.\n{dropped} cached prefix tokens dropped.\n")


# ---- info ------------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    """``/health`` and ``/ready``: 200 while the scheduler runs (SGLang's ``/health`` runs no
    generation unless told to by its environment)."""
    named = request.app[_ENGINE_ID]
    if request.app[_SCHEDULER].alive:
        return web.Response(status=200, headers=named)
    return web.Response(status=503, text="scheduler is not running", headers=named)


async def _health_generate(request: web.Request) -> web.Response:
    """SGLang's ``/health_generate``: one greedy token of the prompt ``[0]``; 200 once the
    scheduler has made a step since the call (its own token, or anyone's), else 503 after
    ``HEALTH_CHECK_TIMEOUT_S`` (paused, or stuck)."""
    scheduler = request.app[_SCHEDULER]
    if not scheduler.alive:
        return web.Response(status=503)
    steps = scheduler.steps
    rid = f"HEALTH_CHECK_{os.urandom(8).hex()}"
    probe = GenerateInput(rid, [0], SamplingParams(max_new_tokens=1, temperature=0.0), False)
    answer = asyncio.ensure_future(scheduler.submit_async([probe]))
    deadline = asyncio.get_running_loop().time() + HEALTH_CHECK_TIMEOUT_S
    try:
        while not answer.done() and scheduler.steps == steps:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("health_check_failed", timeout_s=HEALTH_CHECK_TIMEOUT_S)
                return web.Response(status=503)
            await asyncio.sleep(0.01)
        return web.Response(status=200)
    finally:
        if not answer.done():
            scheduler.abort_many([rid])
            answer.cancel()


async def _model_info(request: web.Request) -> web.Response:
    """SGLang's ``/model_info`` (the fields it has; no modalities or disaggregation here)."""
    loaded = request.app[_LOADED]
    return web.json_response(
        model_info(
            loaded,
            model_path=request.app[_WEIGHTS].model_path,
            served_model_name=request.app[SERVED_NAME],
            is_generation=True,
            weight_version=request.app[_SCHEDULER].weight_version,
            parsers=request.app[_PARSERS],
            preferred=request.app[_SCHEDULER].preferred_sampling_params,
        )
    )


def model_info(
    loaded: LoadedModel,
    *,
    model_path: str,
    served_model_name: str,
    is_generation: bool,
    weight_version: str,
    parsers: dict[str, str | None],
    preferred: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """SGLang's ``/model_info`` answer (the fields it has; no modalities or disaggregation);
    ``preferred``: ``--preferred-sampling-params``."""
    return {
        "model_path": model_path,
        "served_model_name": served_model_name,
        "tokenizer_path": str(loaded.path) if loaded.tokenizer is not None else None,
        "is_generation": is_generation,
        "preferred_sampling_params": preferred,
        "weight_version": weight_version,
        "load_format": loaded.load_format,  # as loaded (SGLang's config value, resolved)
        **parsers,
        "disaggregation_mode": "null",
        "has_image_understanding": loaded.vision is not None,
        "has_audio_understanding": False,
        "model_type": loaded.model.config.model_type,
        "architectures": loaded.model.config.architectures,
    }


def _priority_info(priorities: Priorities) -> dict[str, Any]:
    """SGLang's priority settings, under its names."""
    return {
        "enable_priority_scheduling": priorities.enabled,
        "disable_priority_preemption": not priorities.preempt,
        "default_priority_value": priorities.default,
        "abort_on_priority_when_disabled": priorities.abort_when_disabled,
        "schedule_low_priority_values_first": priorities.low_first,
        "priority_scheduling_preemption_threshold": priorities.threshold,
    }


async def _server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info``: its settings (``max_running_requests``, ``context_length``,
    ``stream_interval``), the scheduler's limits (``max_total_num_tokens``,
    ``max_req_input_len``), live state per data-parallel rank (``internal_states``, one here)
    and ``version``; then the built-in engine's own counters."""
    loaded, scheduler = request.app[_LOADED], request.app[_SCHEDULER]
    state = {
        **scheduler.counts(),
        "num_held_reqs": scheduler.held(),  # Inflight's: what a pause holds (SGLang's tokenizer)
        "num_queue_full_refused": scheduler.queue_full,  # Inflight's: --max-queued-requests
        # Inflight's: rows preempted, and requests refused or dropped, for their priority
        "num_priority_preempted": scheduler.preempted,
        "num_priority_aborted": scheduler.priority_aborted,
        "decode_steps": scheduler.steps,
        "tokens_generated": scheduler.tokens_generated,
        "prefix_cache": scheduler.prefix_cache_stats(),
        "released_memory": scheduler.released_memory,  # /release_memory_occupation's tags
    }
    requests = scheduler.request_log
    recorder = scheduler.expert_distribution
    return web.json_response(
        {
            "model_path": str(loaded.path),
            "tokenizer_path": (
                str(loaded.tokenizer_path or loaded.path) if loaded.tokenizer is not None else None
            ),
            "served_model_name": request.app[SERVED_NAME],
            "max_running_requests": scheduler.max_running,
            "max_queued_requests": scheduler.max_queued,
            **_priority_info(scheduler.priorities),
            "context_length": loaded.context_length,
            "max_total_num_tokens": _max_total_tokens(scheduler, loaded),
            "max_req_input_len": max_input(loaded.context_length),
            "allow_auto_truncate": scheduler.auto_truncate,
            "preferred_sampling_params": scheduler.preferred_sampling_params,
            "stream_interval": scheduler.stream_interval,
            "incremental_streaming_output": request.app.get(_INCREMENTAL, False),
            "enable_metrics": scheduler.metrics is not None,
            "sampling_mask_max_tokens": scheduler.sampling_mask_max_tokens,
            "enable_strict_thinking": scheduler.strict_thinking is not None,
            "enable_custom_logit_processor": scheduler.logit_processors is not None,
            # as SGLang resolves them (serving_hook.handle_return_hidden_states_mode)
            "enable_return_hidden_states": scheduler.hidden_states_mode is not None,
            "return_hidden_states_mode": scheduler.hidden_states_mode,
            "enable_return_routed_experts": scheduler.routed_experts,
            "enable_session_radix_cache": scheduler.session_radix_cache,
            # as given, and the ratio resolved to SGLang's fallback
            "max_mamba_cache_size": scheduler.mamba_cache_size,
            "mamba_full_memory_ratio": scheduler.mamba_memory_ratio,
            "mamba_ssm_dtype": scheduler.mamba_ssm_dtype,
            "enable_fp32_lm_head": scheduler.fp32_lm_head,
            "enable_deterministic_inference": scheduler.deterministic,
            # resolved as SGLang resolves them (parallel_hook.py: the buffer 1000 with a mode)
            "expert_distribution_recorder_mode": None if recorder is None else recorder.mode,
            "expert_distribution_recorder_buffer_size": (
                None if recorder is None else recorder.buffer_size
            ),
            "load_format": loaded.load_format,
            "weight_version": scheduler.weight_version,
            # as SGLang reports its server args: auto resolved to the parser it found
            **request.app[_PARSERS],
            # as launched (SGLang's server args; /configure_logging changes the live ones)
            "log_requests": requests.launched["log_requests"],
            "log_requests_level": requests.launched["log_requests_level"],
            "log_requests_format": requests.launched["log_requests_format"],
            "log_requests_target": requests.launched["log_requests_target"],
            "crash_dump_folder": requests.launched["crash_dump_folder"],
            # with /set_internal_state's values, as SGLang's resolved config has them
            "internal_states": [{**state, **request.app[_OVERRIDES]}],
            "version": SERVED_VERSION,
            "frontend": "python",
            "engine": "inflight-builtin",
            "forward_path": scheduler.forward_path,
            "refused_requests": dict(request.app[_REFUSED]),
            "ignored_fields": dict(request.app[_IGNORED]),
            # samples aborted because their custom logit processor failed (None: no flag)
            "custom_logit_processor_failures": (
                None if scheduler.logit_processors is None else scheduler.logit_processors.failures
            ),
            **state,
        }
    )


def _max_total_tokens(scheduler: Scheduler, loaded: LoadedModel) -> int:
    """SGLang's ``max_total_num_tokens``: every running request may grow to the context
    length."""
    return scheduler.max_running * loaded.context_length


async def _weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[_SCHEDULER].weight_version})


# ---- process ---------------------------------------------------------------------------------


def _device(value: str) -> str:
    if value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: use cpu, cuda or cuda:N (N a GPU index)")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected an integer >= 1")
    return number


def _port_list(value: str) -> list[int]:
    """SGLang's ``json_list_type`` for ports: a JSON list of port numbers."""
    try:
        found = json.loads(value)
    except ValueError:
        found = None
    if not isinstance(found, list) or not all(type(p) is int and 0 < p < 65536 for p in found):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a JSON list of ports, e.g. [30100]")
    return found


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number in (0, 1]")
    return number


@functools.cache  # (built once: it holds SGLang's 500 flags too)
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight engine",
        description="Serve a Hugging Face causal LM, or a reward or embedding model, over "
        "SGLang's HTTP API.",
    )
    parser.add_argument(
        "--model-path",
        "--model",
        dest="model",
        required=True,
        type=Path,
        help="model folder or Hub id (org/name[@revision]); SGLang's name, --model its alias",
    )
    parser.add_argument(
        "--revision",
        help="the Hub revision (branch, tag or commit) of a --model-path that names a Hub repo, "
        "as org/name@REVISION does (SGLang's flag; a local folder is read as it is)",
    )
    parser.add_argument(
        "--tokenizer-path",
        help="the tokenizer's folder or Hub id, if not the model's (SGLang's flag)",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: requests give input_ids and answers have no text (SGLang's flag)",
    )
    parser.add_argument(
        "--context-length",
        type=_positive_int,
        help="the longest prompt and output a request may ask for, at most the model's own "
        "(max_position_embeddings) unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (SGLang's "
        "flag; default: the model's)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on; off loopback it needs a key"
    )
    parser.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' (as SGLang's --api-key; /health is open); "
        f"prefer {API_KEY_ENV} in the environment: a command line is visible to every user",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen off loopback without an API key (anyone who reaches the port may "
        "generate and replace the weights)",
    )
    parser.add_argument(
        "--port", type=int, default=30000, help="0 picks a free port (SGLang's default: 30000)"
    )
    parser.add_argument(
        "--device", default="cpu", type=_device, help="cpu, cuda or cuda:N (the N-th visible GPU)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES, *DTYPE_ALIASES])
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=list(LOAD_FORMATS),
        help="the weights from safetensors or pt (.bin) files (auto: safetensors where there "
        "are some), dummy: random ones, as SGLang draws them, until an update brings the "
        "real ones, or remote_instance: those a running engine serves, sent by it (the "
        "--remote-instance-weight-loader-* flags; SGLang's flag)",
    )
    parser.add_argument(
        "--remote-instance-weight-loader-seed-instance-ip",
        help="with --load-format remote_instance: the address of the running engine (the "
        "seed) to take the weights from (SGLang's flag)",
    )
    parser.add_argument(
        "--remote-instance-weight-loader-seed-instance-service-port",
        type=int,
        help="the seed's HTTP port (SGLang's flag)",
    )
    parser.add_argument(
        "--remote-instance-weight-loader-send-weights-group-ports",
        type=_port_list,
        help="the port, on the seed's address, of the group the weights come through, as a "
        "JSON list with one port per tensor-parallel rank: [PORT] (SGLang's flag)",
    )
    parser.add_argument(
        "--remote-instance-weight-loader-backend",
        default="nccl",
        choices=["nccl", "gloo", "transfer_engine", "modelexpress"],
        help="how the weights come: nccl, a torch.distributed group (gloo on CPU); gloo, that "
        "group over gloo on a GPU too (Inflight's: two engines on one GPU, where NCCL cannot "
        "join both); SGLang's transfer_engine and modelexpress are not served here (SGLang's "
        "flag)",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=_fraction,
        help="SGLang's share of GPU memory for weights and its KV pool; taken and logged: the "
        "built-in engine has no static pool (its KV grows with the requests, up to "
        "--max-running rows)",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="SGLang's switch for /release_memory_occupation to free memory; taken: the "
        "built-in engine's release always does",
    )
    parser.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="SGLang's; taken: the built-in engine runs no warm-up request",
    )
    parser.add_argument(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="a JSON schema's output has no whitespace between its tokens (SGLang's flag, as "
        "its llguidance backend takes it)",
    )
    parser.add_argument(
        "--constrained-json-whitespace-pattern",
        metavar="REGEX",
        help="the whitespace a JSON schema's output may have between its tokens (SGLang's "
        "flag, as its llguidance backend takes it)",
    )
    parser.add_argument(
        "--grammar-backend",
        choices=["llguidance"],
        help="constrained decoding's backend (SGLang's flag): the built-in engine's grammars "
        "are llguidance's, so that alone",
    )
    parser.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="tensor parallelism (SGLang's flag): the built-in engine runs a model on one "
        "device, so 1 only",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the code the model folder ships for its model, config or tokenizer (its "
        "auto_map), as SGLang's flag; only for a folder you trust (without it such a folder "
        "is refused)",
    )
    parser.add_argument(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=int,
        default=64,
        help="rows per decode batch (SGLang's --max-running-requests)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="a new request while this many wait is refused with a 503 (SGLang's flag; "
        "default: no limit)",
    )
    parser.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="serve waiting requests by their priority, preempting running ones of a priority "
        "lower by more than --priority-scheduling-preemption-threshold (SGLang's)",
    )
    parser.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with --enable-priority-scheduling: low priority values first (SGLang's)",
    )
    parser.add_argument("--disable-priority-preemption", action="store_true",
                        help="priority scheduling without preemption (SGLang's)")  # fmt: skip
    parser.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10,
                        help="the least priority difference that preempts (SGLang's)")  # fmt: skip
    parser.add_argument("--default-priority-value", type=int, default=None,
                        help="the priority of a request that names none (SGLang's)")  # fmt: skip
    parser.add_argument(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="without --enable-priority-scheduling: refuse requests that name a priority with "
        "a 503 (SGLang's)",
    )
    parser.add_argument(
        "--admit-fraction",
        type=float,
        default=0.25,
        help="free share of --max-running before waiting requests join a running batch "
        "(batched prefills; 0 admits at once)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="a streamed request gets a chunk after its first token and every this many "
        "after (SGLang's; a request's sampling_params.stream_interval overrides it)",
    )
    parser.add_argument(
        "--event-loop-turns",
        action="store_true",
        help="the HTTP event loop and the scheduler's steps take turns at the interpreter "
        "instead of interleaving their Python (stages/engine/loop_turns.py): less CPU a sample "
        "where a step is mostly Python (a small model on CPU), slower streams where it is mostly "
        "the model's own compute",
    )
    parser.add_argument(
        "--sampling-mask-max-tokens",
        type=_positive_int,
        default=SAMPLING_MASK_MAX_TOKENS,
        help="the largest sampling support a request's return_sampling_mask returns: its "
        "top_k must be 1 (greedy) or at most this (SGLang's)",
    )
    parser.add_argument(
        "--return-hidden-states-mode",
        choices=["last", "full"],
        help="the most a request's return_hidden_states may ask for (SGLang's): last, the "
        "newest final hidden state; full, also every one (none: no hidden states)",
    )
    parser.add_argument(
        "--enable-return-hidden-states",
        action="store_true",
        help="--return-hidden-states-mode full, unless that names another (SGLang's older flag)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="a request's return_routed_experts answers the experts each of its tokens was "
        "routed to, in every layer (SGLang's; mixture-of-experts models, either forward path)",
    )
    parser.add_argument(
        "--expert-distribution-recorder-mode",
        type=recorder_mode_flag,
        metavar="{stat,per_pass,per_token}",
        help="what /start_expert_distribution_record ... /dump_expert_distribution_record "
        "record (SGLang's): stat, each pass's tokens per layer and expert in a circular buffer; "
        "per_pass, a record per pass; per_token, also every token's experts (stat_approx, "
        "DeepEP's, is refused); without it those routes answer 400. Mixture-of-experts models, "
        "either forward path",
    )
    parser.add_argument(
        "--expert-distribution-recorder-buffer-size",
        type=recorder_buffer_flag,
        help="the passes stat mode keeps, the last ones (SGLang's; default 1000; -1: all)",
    )
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "sglang", "transformers", "mindspore"],
        help="SGLang's flag: auto and sglang take the engine's own passes where the model has "
        "them, else transformers' (as SGLang falls back); transformers is --forward "
        "transformers; mindspore is not served",
    )
    parser.add_argument(
        "--forward",
        default="fast",
        choices=["fast", "transformers"],
        help="prefill and decode passes: fast (Llama-family models, straight on the weights) "
        "or transformers (model(...), any model); fast falls back to transformers by itself",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=_MAX_BODY / 2**20,
        help="largest request body taken, in MiB (larger ones get 413)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=PREFIX_CACHE_TOKENS,
        help="tokens of finished requests whose KV is kept for reuse by requests that start "
        "with them (least recently used out first; a token costs 2 x layers x kv_heads x "
        "head_dim x dtype bytes); 0 turns the prefix cache off",
    )
    parser.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: --prefix-cache-tokens 0 (SGLang's flag)",
    )
    parser.add_argument(
        "--max-mamba-cache-size",
        type=int,
        help="a model with linear-attention (Mamba, gated delta net) layers: the most states, "
        "a running row's and the prefix cache's together; it caps --max-running (SGLang's "
        "flag; default: the cache's bounded by --mamba-full-memory-ratio)",
    )
    parser.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        help="a model with linear-attention layers: the prefix cache's states take at most this "
        "times the bytes of --prefix-cache-tokens tokens of its KV (SGLang's flag, default "
        f"{MAMBA_FULL_MEMORY_RATIO})",
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant passes (SGLang's flag): a request's tokens and log-probs are the "
        "same whatever runs beside it; the prefix cache off, seed 42 for rows without "
        "sampling_seed; Llama-family dense models on the engine's own passes",
    )
    parser.add_argument(
        "--enable-fp32-lm-head",
        action="store_true",
        help="the LM head's logits in float32 (SGLang's flag): a bfloat16 model's log-probs "
        "without bfloat16 rounding, closer to a learner's",
    )
    parser.add_argument(
        "--mamba-ssm-dtype",
        choices=sorted(DTYPES),
        help="a model with linear-attention layers: the dtype their recurrent states are kept "
        "in between passes (SGLang's flag; default: the SGLANG_MAMBA_SSM_DTYPE environment "
        "variable, else the model config's mamba_ssm_dtype, else float32)",
    )
    parser.add_argument(
        "--enable-mis",
        action="store_true",
        help="/v1/score's multi-item scoring (SGLang's flag): a request's items scored as one "
        "fused sequence's, query <delim> item <delim> ..., the delimiter token 9999; turns the "
        "prefix cache off, as in SGLang",
    )
    parser.add_argument(
        "--prefix-cache-max-age",
        type=int,
        default=PREFIX_CACHE_MAX_AGE,
        help="cached KV more than this many weight versions old is dropped; older KV is reused "
        "only by a request that continues a whole sequence served before (a next turn)",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name on the OpenAI routes: what /v1/models lists, what "
        "/v1/responses and BASE:ADAPTER take, served_model_name in /model_info (SGLang's "
        "flag; default: --model's path)",
    )
    parser.add_argument(
        "--chat-template",
        help="Jinja chat template (or a file holding one) for /v1/chat/completions, in place of "
        "the tokenizer's (SGLang's flag)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="a chat request may carry its own template in chat_template_kwargs.chat_template "
        "(SGLang's flag; without it such a request is refused)",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        help="chat template kwargs every chat request gets where its own chat_template_kwargs "
        "leave them unset, as JSON (SGLang's flag: '{\"enable_thinking\": false}')",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", *TOOL_CALL_PARSERS],
        help="read tool calls in answers to /v1/chat/completions with tools in this format "
        "(SGLang's flag and names: qwen25/qwen/hermes <tool_call>, llama3 JSON after "
        "<|python_tag|>, mistral [TOOL_CALLS], pythonic [f(a=1)], qwen3_coder (step3p5, "
        "nanbeige) <function=NAME><parameter=KEY>, glm45/glm and glm47 <arg_key>, deepseekv3/"
        "deepseekv31 and kimi_k2 between their special tokens; auto: the one SGLang detects "
        "from the chat template; default: none, tool calls stay in content)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=["auto", *REASONING_PARSERS],
        help="split the reasoning (<think> ... </think>, or the parser's own tags) out of "
        "answers to /v1/chat/completions as reasoning_content (SGLang's flag; auto: the one "
        "SGLang detects from the chat template)",
    )
    parser.add_argument(
        "--enable-strict-thinking",
        action="store_true",
        help="while a request thinks (require_reasoning; a thinking chat request), its "
        "reasoning parser's excluded tags (Qwen3's <tool_call>, <|im_end|>...) cannot be drawn, "
        "and once it has thought max_thinking_tokens (else SGLANG_MAX_THINK_TOKENS) its "
        "reasoning's end is forced (SGLang's flag; needs --reasoning-parser)",
    )
    parser.add_argument(
        "--enable-custom-logit-processor",
        action="store_true",
        help="requests may carry custom_logit_processor, a dill-pickled CustomLogitProcessor "
        "class (stages.engine.custom_logits; SGLang's own load too) run on their logits each "
        "step. Unpickling runs the client's code: only for clients you trust (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-session-radix-cache",
        action="store_true",
        help="a request's session_id (or its session_params session) holds its finished "
        "sequence's KV in the prefix cache for that session: evicted only once nothing else is "
        "left, until /close_session names it (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-streaming-session",
        action="store_true",
        help="/open_session takes streaming: true, a session whose turns each append to the "
        "last that ended well, one at a time (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-response-store",
        action="store_true",
        help="/v1/responses keeps its answers for previous_response_id and GET "
        "/v1/responses/{id} (SGLang's flag; the 4,096 newest are kept)",
    )
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve GET /metrics (Prometheus' text format, SGLang's metric names) and give each "
        "answer's meta_info its time stats: queue_time, first_token_latency, "
        "decode_throughput... (SGLang's flag)",
    )
    parser.add_argument(
        "--return-input-ids",
        action="store_true",
        help="every /v1/chat/completions answer has sglext.input_ids, as if "
        "return_input_ids_in_sglext were asked (SGLang's flag)",
    )
    parser.add_argument(
        "--return-output-ids",
        action="store_true",
        help="every /v1/chat/completions answer has sglext.output_ids, as if "
        "return_output_ids_in_sglext were asked (SGLang's flag)",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="each chunk of a /generate stream holds the text, ids and per-token log-probs "
        "new since the sample's last, not its whole output so far (SGLang's flag)",
    )
    parser.add_argument(
        "--stream-response-default-include-usage",
        action="store_true",
        help="every streamed /v1/completions and /v1/chat/completions answer ends with its "
        "usage chunk, as with stream_options.include_usage (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="the /v1 completions and chat answers' usage has prompt_tokens_details."
        "cached_tokens, the prompt tokens the prefix cache served (SGLang's flag)",
    )
    parser.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve the model as an embedding model (/encode, /v1/embeddings), as SGLang's "
        "flag; a *ForSequenceClassification model (a reward model) is served so without it",
    )
    parser.add_argument(
        "--seed",
        "--random-seed",
        dest="seed",
        type=int,
        default=0,
        help="seed of unseeded sampling (SGLang's --random-seed)",
    )
    parser.add_argument(
        "--weight-version", default="0", help="initial weight_version (SGLang: 'default')"
    )
    parser.add_argument("--log-file", type=Path, help="JSON-lines log file (default: console)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="lowest level written to --log-file (debug: every weight update too)",
    )
    parser.add_argument(
        "--log-requests",
        action="store_true",
        help="log every generating request and each sample's answer (SGLang's request log; "
        "POST /configure_logging changes it while serving)",
    )
    parser.add_argument(
        "--log-requests-level",
        type=int,
        default=2,
        choices=LEVELS,
        help="0: metadata; 1: and sampling parameters; 2: and inputs/outputs cut to 2048; "
        "3: everything",
    )
    parser.add_argument("--log-requests-format", default="text", choices=["text", "json"])
    parser.add_argument(
        "--log-requests-target",
        nargs="+",
        metavar="TARGET",
        help="stdout and/or folders (each written to HOSTNAME_0.log, rotated hourly)",
    )
    parser.add_argument(
        "--crash-dump-folder",
        help="pickle the last 5 minutes' requests and those in flight here when a step fails",
    )
    parser.add_argument(
        "--log-as",
        default="engine.0",
        metavar="STAGE.REPLICA",
        help="stage and replica named on every log event (how `inflight logs` filters it)",
    )
    parser.add_argument(
        "--json-model-override-args",
        type=_json_object,
        help="a JSON object of the model config's keys to change before it is built (SGLang's "
        "flag), e.g. '{\"max_position_embeddings\": 65536}'",
    )
    parser.add_argument(
        "--sampling-defaults",
        choices=["openai", "model"],
        default="model",
        help="where a chat request's unset temperature, top_p, top_k, min_p and "
        "repetition_penalty come from: the model's generation_config.json (model) or "
        "OpenAI's defaults (openai) (SGLang's flag)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: /load_lora_adapter and a request's lora_path (SGLang's flag; "
        "--lora-paths turns it on)",
    )
    parser.add_argument(
        "--lora-paths",
        nargs="*",
        help="LoRA adapters (peft folders) loaded before the engine serves, each PATH, NAME=PATH "
        "or a JSON object with lora_name and lora_path (SGLang's flag); more come with "
        "/load_lora_adapter",
    )
    parser.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="cut a prompt the context cannot take to its first context-6 tokens, and a "
        "max_new_tokens to what the context leaves, instead of refusing them (SGLang's flag)",
    )
    parser.add_argument(
        "--preferred-sampling-params",
        type=preferred_params.parse,
        help="a JSON object of sampling parameters a request gets where it names none, e.g. "
        "'{\"temperature\": 0.6}' (SGLang's flag: /generate takes every one, the /v1 routes "
        "only those they leave out; reported in /model_info)",
    )
    sglang_flags.add_to(parser)  # SGLang's other flags: taken or refused (sglang_flags)
    return parser


def base_app(
    *, max_body: int = _MAX_BODY, api_key: str | None = None, engine_id: str | None = None
) -> web.Application:
    """An application with the engine's middlewares (every refusal counted; the API key
    checked when there is one) and one route: ``GET|HEAD /``, SGLang's "SGLang is running"
    (the Ollama client and load balancers knock there)."""
    middlewares = [_tally] + ([_check_key] if api_key else [])
    app = web.Application(client_max_size=max_body, middlewares=middlewares)
    app[_REFUSED] = Counter()
    app[_IGNORED] = Counter()
    if api_key:
        app[_API_KEY] = api_key
    app[_ENGINE_ID] = {ENGINE_ID_HEADER: engine_id} if engine_id else {}
    app.router.add_get("/", _root)
    return app


async def _root(request: web.Request) -> web.Response:
    return web.json_response("SGLang is running")


def refused_counts(app: web.Application) -> dict[str, int]:
    """The refusals counted so far, by ``METHOD route status``."""
    return dict(app[_REFUSED])


def ignored_counts(app: web.Application) -> dict[str, int]:
    """The request keys ignored so far, by ``METHOD route key`` (``ignored_fields``)."""
    return dict(app[_IGNORED])


def engine_id_header(app: web.Application) -> dict[str, str]:
    """The header ``/health`` names this engine with (none when it has no id)."""
    return app[_ENGINE_ID]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The engine's options from its command line (``SystemExit`` with a message if bad)."""
    args = _parser().parse_args(argv)
    args.sglang_taken, refused = sglang_flags.read(args)
    if refused:
        _parser().error("\n  ".join(refused))
    try:
        args.lora_paths = lora_refs(args.lora_paths)
    except ValueError as exc:
        _parser().error(f"--lora-paths: {exc}")
    # SGLang's check_lora_server_args: adapters given at start turn LoRA on
    args.lora_by_paths = bool(args.lora_paths) and not args.enable_lora
    args.enable_lora = args.enable_lora or bool(args.lora_paths)
    if args.tp_size != 1:
        _parser().error(
            f"--tp-size {args.tp_size}: the built-in engine runs a model on one device (tensor "
            "parallelism is SGLang's); give 1, or run more engines"
        )
    # SGLang's --model-impl (get_model_architecture): its own implementation where there is
    # one, else transformers'; transformers: transformers' alone
    if args.model_impl == "mindspore":
        _parser().error("--model-impl mindspore: the built-in engine runs PyTorch models")
    if args.model_impl == "transformers":
        args.forward = "transformers"
    if args.disable_radix_cache or args.enable_mis:  # (SGLang: MIS turns its radix cache off)
        args.prefix_cache_tokens = 0
    if args.revision is not None and not args.model.expanduser().is_dir():
        if "@" in str(args.model):
            _parser().error(f"--revision {args.revision}: --model-path {args.model} names one")
        args.model = Path(f"{args.model}@{args.revision}")
    if args.max_running < 1:
        _parser().error("--max-running must be >= 1")
    if args.prefix_cache_tokens < 0 or args.prefix_cache_max_age < 0:
        _parser().error("--prefix-cache-tokens and --prefix-cache-max-age must be >= 0")
    if args.served_model_name is not None and ":" in args.served_model_name:
        _parser().error(  # SGLang's words (server_args validation)
            "served_model_name cannot contain a colon (':') character. The colon is reserved "
            "for the 'model:adapter' syntax used in LoRA adapter specification. Invalid value: "
            f"'{args.served_model_name}'"
        )
    return args


def load_served(args: argparse.Namespace) -> LoadedModel:
    """The model the options name, loaded as they say (its own code, tokenizer, context length,
    weights' format): as a server process and an engine in a generator's process load it."""
    load_format, remote = args.load_format, remote_seed(args)
    if load_format == "remote_instance" and remote is None:  # SGLang's _handle_load_format
        load_format = "auto"
    return load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        tokenizer_path=args.tokenizer_path,
        skip_tokenizer=args.skip_tokenizer_init,
        context_length=args.context_length,
        load_format=load_format,
        remote=remote,
        overrides=args.json_model_override_args,
    )


def mis_allowed(args: argparse.Namespace, vocab_size: int) -> bool:
    """Whether ``--enable-mis`` (if given) can run on a model of ``vocab_size`` tokens; logs
    why not, or that it turns the prefix cache off (SGLang's warning)."""
    if not args.enable_mis:
        return True
    refusal = mis_refusal(vocab_size)
    if refusal is not None:
        log.error("engine_settings_refused", model=str(args.model), error=refusal)
        return False
    log.warning("prefix_cache_off", message="Radix cache is disabled because --enable-mis is set.")
    return True


def remote_seed(args: argparse.Namespace) -> RemoteSeed | None:
    """The engine ``--load-format remote_instance`` takes its weights from; None (logged in
    SGLang's words, which then loads the checkpoint) where its flags are incomplete."""
    if getattr(args, "load_format", None) != "remote_instance":
        return None
    backend = args.remote_instance_weight_loader_backend
    if backend not in ("nccl", "gloo"):
        raise ValueError(
            f"--remote-instance-weight-loader-backend "
            f"{args.remote_instance_weight_loader_backend}: the built-in engine takes a remote "
            "instance's weights through a torch.distributed group only (nccl or gloo)"
        )
    ip = args.remote_instance_weight_loader_seed_instance_ip
    port = args.remote_instance_weight_loader_seed_instance_service_port
    ports = args.remote_instance_weight_loader_send_weights_group_ports
    if ip is None or port is None:
        log.warning(
            "load_format_fallback",
            message="Fallback load_format to 'auto' due to incomplete remote instance weight "
            "loader settings.",
        )
        return None
    if ports is None:
        log.warning(
            "load_format_fallback",
            message="Fallback load_format to 'auto' due to incomplete remote instance weight "
            "loader NCCL group ports settings.",
        )
        return None
    key = args.api_key or os.environ.get(API_KEY_ENV) or None  # the seed's, as this one's
    return RemoteSeed(ip, port, tuple(ports), api_key=key, backend=backend)


def resolve_parsers(args: argparse.Namespace, loaded: LoadedModel) -> None:
    """``--tool-call-parser auto`` and ``--reasoning-parser auto`` made the parsers SGLang
    detects (``template_detection.resolve_auto``; None where it finds none), in ``args``, once
    at the start, as SGLang resolves them before it serves (``ParserRefused``, a ValueError,
    for one the engine does not read)."""
    needs = [a for a in ("reasoning_parser", "tool_call_parser") if getattr(args, a) == "auto"]
    if not needs:
        return
    found = resolve_auto(
        needs,
        chat_template=args.chat_template,
        tokenizer=loaded.tokenizer,
        model_dir=loaded.path,
    )
    for attr, detected in found.items():
        setattr(args, attr, detected.parser)


def build_scheduler(
    args: argparse.Namespace, loaded: LoadedModel, turns: Turns | None = None
) -> Scheduler:
    """The scheduler the options ask for, on ``loaded``'s model (not started); ``turns``: the
    turns its steps take with the server's event loop (``loop_turns``)."""
    decode = decoder(loaded.tokenizer)
    grammars = None
    strict = _strict_thinking(args, loaded)
    if args.preferred_sampling_params:  # read as a request's, with the model's tokenizer
        encode = loaded.tokenizer.encode if loaded.tokenizer is not None else None
        try:
            parse_sampling_params(dict(args.preferred_sampling_params), encode)
        except ValueError as exc:
            raise ValueError(f"--preferred-sampling-params: {exc}") from None
    if loaded.tokenizer is not None:
        grammars = GrammarSet(
            loaded.tokenizer,
            loaded.vocab_size,
            sorted(loaded.eos_token_ids),
            json_whitespace=json_whitespace(args),
        )
        if args.reasoning_parser:  # require_reasoning: the grammar after the reasoning's end
            fmt = REASONING_PARSERS[args.reasoning_parser]
            encode = loaded.tokenizer.encode
            grammars.think_end = end_tag_ids(fmt, loaded.tokenizer)
            if fmt.self_opens and grammars.think_end:
                grammars.think_start = tuple(encode(fmt.start, add_special_tokens=False))
            ends = (tuple(encode(end, add_special_tokens=False)) for _, _, end in fmt.efforts)
            grammars.think_ends = tuple(end for end in ends if end)
        threading.Thread(target=grammars.warm, name="grammar-warmup", daemon=True).start()
    return Scheduler(
        loaded.model,
        max_running=args.max_running,
        seed=args.seed,
        # the seed's, for weights taken from a running engine (remote_instance)
        weight_version=args.weight_version
        if loaded.weight_version is None
        else loaded.weight_version,
        eos_token_ids=loaded.eos_token_ids,
        admit_fraction=args.admit_fraction,
        stream_interval=args.stream_interval,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        # a mode named wins over the older flag, as SGLang's
        hidden_states_mode=args.return_hidden_states_mode
        or ("full" if args.enable_return_hidden_states else None),
        fast_forward=args.forward == "fast",
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefix_cache_max_age=args.prefix_cache_max_age,
        # stop strings are looked for in the text as SGLang decodes it (special tokens kept)
        decode_tail=None if decode is None else (lambda ids: decode(ids, False)),
        grammars=grammars,
        strict_thinking=strict,
        custom_logit_processors=args.enable_custom_logit_processor,
        routed_experts=args.enable_return_routed_experts,
        session_radix_cache=args.enable_session_radix_cache,
        mamba_cache_size=args.max_mamba_cache_size,
        mamba_memory_ratio=args.mamba_full_memory_ratio,
        mamba_ssm_dtype=args.mamba_ssm_dtype,
        fp32_lm_head=args.enable_fp32_lm_head,
        deterministic=args.enable_deterministic_inference,
        max_queued=args.max_queued_requests,
        priorities=priority_flags(args),
        auto_truncate=args.allow_auto_truncate,
        preferred_sampling_params=args.preferred_sampling_params,
        lora=args.enable_lora,
        expert_distribution=ExpertDistributionRecorder.of(
            loaded.model,
            args.expert_distribution_recorder_mode,
            args.expert_distribution_recorder_buffer_size,
        ),
        turns=turns,
    )


def _unturned(scheduler: Scheduler, handler: _Handler) -> _Handler:
    """``handler`` with the loop's turns with the steps lifted while it runs (``loop_turns``):
    the weight routes and the controls a publisher calls around them. A weight update's
    exchanges (the buckets received on a thread of their own, then loaded at a step's end)
    would each wait for a step to end, which slowed a publish under load 3x."""
    turns = scheduler.turns
    if turns is None:
        return handler

    async def run(request: web.Request) -> web.StreamResponse:
        with turns.suspended():
            return await handler(request)

    return run


def event_loop_turns(args: argparse.Namespace) -> Turns | None:
    """The turns ``--event-loop-turns`` asks for (None: the loop and the steps interleave)."""
    return Turns() if args.event_loop_turns else None


def _strict_thinking(args: argparse.Namespace, loaded: LoadedModel) -> StrictThinking | None:
    """``--enable-strict-thinking``'s filter (None without the flag). Without a reasoning
    parser it filters nothing, as SGLang's (its grammar backend is not wrapped then), which
    the log says; ValueError where the parser's tags cannot be encoded."""
    if not args.enable_strict_thinking:
        return None
    if not args.reasoning_parser or loaded.tokenizer is None:
        log.warning(
            "strict_thinking_inactive",
            why="--enable-strict-thinking filters the reasoning that --reasoning-parser "
            "delimits (and needs the model's tokenizer): nothing is filtered",
        )
        return StrictThinking(end=(), excluded=())
    return StrictThinking.of(args.reasoning_parser, loaded.tokenizer, vocab_size=loaded.vocab_size)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``inflight engine``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]  # `inflight engine -- --model DIR`: the CLI passes the separator on
    args = parse_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    refusal = bind_error(args.host, api_key, insecure=args.insecure)
    if refusal is not None:
        print(f"error: {refusal}")
        return 2
    holder: dict[str, Scheduler] = {}
    if args.log_file is not None:
        from pipeline.structured_log import configure_process_logging

        def version() -> int:
            current = holder["s"].weight_version if "s" in holder else "0"
            return int(current) if current.isdigit() else 0

        stage, _, replica = args.log_as.rpartition(".")
        if not stage or not replica.isdigit():
            print(f"error: --log-as wants STAGE.REPLICA (like engine.0), got {args.log_as!r}")
            return 2
        configure_process_logging(
            args.log_file,
            stage=stage,
            replica=int(replica),
            level=args.log_level,
            version=version,
            console=True,
        )
    torch.manual_seed(args.seed)
    try:
        kind = model_kind(args.model, args.is_embedding, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        log.error("engine_model_load_failed", model=str(args.model), error=str(exc))
        return 2
    if kind is not None:  # a reward or embedding model: /encode, /classify, /v1/embeddings
        from stages.engine.pooling_server import serve_pooling

        return serve_pooling(args, kind, api_key)
    heap.hold()  # no full collections while transformers and the model load (settled below)
    try:
        loaded = in_passing_thread(load_served, args)
    except (OSError, ValueError, RemoteLoadError) as exc:
        log.error("engine_model_load_failed", model=str(args.model), error=str(exc))
        return 2
    if not mis_allowed(args, loaded.vocab_size):
        return 2
    try:
        resolve_parsers(args, loaded)
        turns = event_loop_turns(args)
        scheduler = in_passing_thread(build_scheduler, args, loaded, turns)
    except ValueError as exc:  # settings the model cannot take (a reasoning tag it lacks...)
        log.error("engine_settings_refused", model=str(args.model), error=str(exc))
        return 2
    holder["s"] = scheduler
    scheduler.start()
    try:
        if args.lora_by_paths:  # SGLang's words
            log.warning(
                "lora_enabled", why="--enable-lora is set to True because --lora-paths is provided."
            )
        try:
            preload_adapters(scheduler, args.lora_paths)
        except AdapterError as exc:
            log.error("engine_lora_paths_failed", error=str(exc))
            return 2
        app = build_app(loaded, scheduler, **app_options(args, api_key))
        heap.settle()  # torch, transformers and the model stay: later collections skip them
        started = {
            "forward": scheduler.forward_path,
            "forward_fallback_reason": scheduler.forward_path_why,
            "max_running": args.max_running,
            "prefix_cache_tokens": args.prefix_cache_tokens,
            "prefix_cache_max_age": args.prefix_cache_max_age,
        }
        taken = {  # SGLang's flags that change nothing here, said once
            flag: value
            for flag, value in (
                ("mem_fraction_static", args.mem_fraction_static),
                ("enable_memory_saver", args.enable_memory_saver or None),
                ("skip_server_warmup", args.skip_server_warmup or None),
            )
            if value is not None
        }
        taken.update(args.sglang_taken)
        if taken:
            log.info("engine_flags_not_applicable", flags=taken, why=_NOT_APPLICABLE)
        started["event_loop_turns"] = turns is not None
        return run_loop(serve(app, args, loaded, started), turns)
    finally:
        scheduler.stop()


def preload_adapters(scheduler: Scheduler, refs: list[tuple[str, str]]) -> None:
    """Load ``--lora-paths``' adapters on a started scheduler, in order (AdapterError: one that
    does not fit the model, or a model whose passes take none)."""
    for name, path in refs:
        scheduler.load_adapter(name, path).result(timeout=600)


def _json_object(text: str) -> dict[str, Any]:
    """``--default-chat-template-kwargs``' and ``--json-model-override-args``' value: a JSON
    object (SGLang's check and words)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must decode to a JSON object")
    return value


def app_options(args: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    """``build_app``'s options from the server's flags: an engine process and one in the
    generator's process (``stages.engine.in_process``) serve alike."""
    return {
        "max_body": int(args.max_request_mb * 2**20),
        "api_key": api_key,
        "chat_template": args.chat_template,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "default_chat_template_kwargs": args.default_chat_template_kwargs,
        "trust_request_chat_template": args.trust_request_chat_template,
        "sampling_defaults": args.sampling_defaults,
        "engine_id": os.environ.get(ENGINE_ID_ENV) or None,
        "response_store": args.enable_response_store,
        "cache_report": args.enable_cache_report,
        "enable_metrics": args.enable_metrics,
        "served_model_name": args.served_model_name,
        "streaming_sessions": args.enable_streaming_session,
        "request_log": request_log_of(args),
        "mis": args.enable_mis,
        "default_usage": args.stream_response_default_include_usage,
        "incremental_stream": args.incremental_streaming_output,
        "sglext_ids": (args.return_input_ids, args.return_output_ids),
    }


def json_whitespace(args: argparse.Namespace) -> dict[str, Any]:
    """The whitespace a JSON schema's grammar allows, as SGLang's llguidance backend takes
    ``--constrained-json-disable-any-whitespace`` and ``--constrained-json-whitespace-pattern``
    (``GuidanceBackend.dispatch_json``'s defaults); a pattern llguidance does not compile
    is refused here, not by each request."""
    out: dict[str, Any] = {"whitespace_flexible": not args.constrained_json_disable_any_whitespace}
    pattern = args.constrained_json_whitespace_pattern
    if pattern is not None:
        import llguidance

        out["whitespace_pattern"] = pattern
        matcher = llguidance.LLMatcher
        try:
            error = matcher.validate_grammar(matcher.grammar_from_json_schema("{}", defaults=out))
        except Exception as exc:  # (llguidance's words)
            error = str(exc)
        if error:
            said = " ".join(line for line in error.splitlines() if line and "~~~" not in line)
            raise ValueError(f"--constrained-json-whitespace-pattern {pattern!r}: {said}")
    return out


def request_log_of(args: argparse.Namespace) -> RequestLog:
    """The request log the server's flags ask for (``--log-requests``...)."""
    return RequestLog(
        log_requests=args.log_requests,
        level=args.log_requests_level,
        fmt=args.log_requests_format,
        targets=args.log_requests_target,
        crash_dump_folder=args.crash_dump_folder,
        server_args={k: _plain(v) for k, v in vars(args).items()},
    )


def _plain(value: Any) -> Any:
    """A server argument as a dump pickles it (paths as text)."""
    return str(value) if isinstance(value, Path) else value


_NOT_APPLICABLE = (
    "they tune SGLang's GPU runtime (its static memory pool, its memory saver, its warm-up); "
    "the built-in engine grows its KV with its requests, releases memory on request always "
    "and serves without warming up"
)


def run_loop(coro: Awaitable[int], turns: Turns | None = None) -> int:
    """Run the server's coroutine to its end: on a loop that takes ``turns`` with the
    scheduler's steps (``loop_turns``), else on uvloop when installed."""
    if turns is not None:
        loop = turn_taking_loop(turns)
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


async def serve(
    app: web.Application, args: argparse.Namespace, loaded: LoadedModel, started: dict[str, Any]
) -> int:
    """Serve ``app`` until SIGTERM or SIGINT; ``started``: what ``engine_started`` logs beside
    the address, the model and the device."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received: list[str] = []

    def on_signal(name: str) -> Callable[[], None]:
        def handler() -> None:
            received.append(name)
            stop.set()

        return handler

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal(sig.name))
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            log.error("engine_bind_failed", host=args.host, port=args.port, error=str(exc))
            return 1
        port = runner.addresses[0][1]
        log.info(
            "engine_started",
            host=args.host,
            port=port,
            model=str(loaded.path),
            device=args.device,
            dtype=str(next(loaded.model.parameters()).dtype),
            **started,
            tokenizer=loaded.tokenizer is not None,
            threads=torch.get_num_threads(),
            api_key=_API_KEY in app,  # whether one is required, never the key
        )
        await stop.wait()
        log.info("engine_stopping", signal=received[0] if received else None)
    finally:
        await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
