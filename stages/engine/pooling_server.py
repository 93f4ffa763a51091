"""``inflight engine`` on a pooling model: a reward model (``*ForSequenceClassification``) or an
embedding model (``--is-embedding``), served as SGLang serves one.

Routes: ``stages.engine.encode_routes``' (``/encode``, ``/classify``, ``/v1/embeddings``,
``/v1/classify``); ``/v1/tokenize`` and ``/v1/detokenize`` (a client renders a conversation
with the model's own chat template there, ``add_generation_prompt: false``, and sends the ids to
``/classify``); ``/health``, ``/ready``, ``/health_generate`` (one pass over the prompt
``[0]``, as SGLang's sends an embedding request to a pooling model); ``/model_info`` with
``is_generation: false``; ``/server_info``; ``/v1/models``; ``/weights_checker``
(``stages.engine.weight_checker``: digests, a snapshot to compare with); ``/v1/loads``
(``stages.engine.load_routes``: each pass a prefill, its rows running, the rest waiting).
``/generate`` and the ``/v1`` generation routes answer 400: this model does not generate. The
same options as a generating engine apply where they mean something (``--device``, ``--dtype``,
``--max-running``: rows a pass, ``--chat-template``, ``--api-key``, ``--log-file``...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import structlog
import torch
from aiohttp import web

from pipeline import heap
from stages.detokenize import decoder
from stages.engine.encode_routes import EncodeRoutes
from stages.engine.feature_off_routes import FeatureOffRoutes
from stages.engine.identity import ENGINE_ID_ENV
from stages.engine.load_routes import LoadRoutes
from stages.engine.logging_routes import LoggingRoutes
from stages.engine.maintenance_routes import MaintenanceRoutes
from stages.engine.openai_api import OpenAIRoutes, error_response
from stages.engine.openai_chat import ChatSettings
from stages.engine.parse_routes import ParseRoutes
from stages.engine.pooling import Kind, Pooler, PoolingModel, load_pooling_model
from stages.engine.pooling_weights import add_weight_routes
from stages.engine.remote_instance import RemoteLoadError
from stages.engine.request_body import bad_request
from stages.engine.request_log import RequestLog
from stages.engine.server import (
    HEALTH_CHECK_TIMEOUT_S,
    SERVED_NAME,
    SERVED_VERSION,
    base_app,
    engine_id_header,
    ignored_counts,
    mis_allowed,
    model_info,
    refused_counts,
    remote_seed,
    request_log_of,
    run_loop,
    serve,
)
from stages.engine.tokenize_routes import TokenizeRoutes
from stages.engine.torch_threads import in_passing_thread

__all__ = ["build_pooling_app", "serve_pooling"]

log = structlog.get_logger("stages.engine.pooling_server")

_POOLER = web.AppKey("pooler", Pooler)
_OVERRIDES = web.AppKey("overrides", dict)  # what /set_internal_state set
# --allow-auto-truncate and --preferred-sampling-params, as /server_info reports them
_READING = web.AppKey("reading", dict)
_GENERATION_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
    "/api/chat",
    "/api/generate",
)


def serve_pooling(args: argparse.Namespace, kind: Kind, api_key: str | None) -> int:
    """Load ``args.model`` as a ``kind`` model and serve it until a signal; the exit code."""
    if args.enable_metrics:
        log.error(
            "engine_option_unsupported",
            option="--enable-metrics",
            message="--enable-metrics records generation (tokens, latencies, time stats): a "
            f"{kind} model generates nothing; /v1/loads gives its load",
        )
        return 2
    if args.return_hidden_states_mode or args.enable_return_hidden_states:
        log.error(
            "engine_option_unsupported",
            option="--return-hidden-states-mode",
            message="hidden states come with generated tokens: a "
            f"{kind} model generates nothing; /v1/embeddings gives its pooled states",
        )
        return 2
    if args.enable_return_routed_experts:
        log.error(
            "engine_option_unsupported",
            option="--enable-return-routed-experts",
            message=f"routed experts come with generated tokens: a {kind} model generates nothing",
        )
        return 2
    if args.expert_distribution_recorder_mode is not None:
        log.error(
            "engine_option_unsupported",
            option="--expert-distribution-recorder-mode",
            message=f"the recorder counts the experts of the generating passes: a {kind} model "
            "is served by the pooling engine, which records none",
        )
        return 2
    if args.enable_lora:  # (--lora-paths turns it on)
        log.error(
            "engine_option_unsupported",
            option="--lora-paths" if args.lora_paths else "--enable-lora",
            message=f"a {kind} model is served by the pooling engine, which applies no LoRA "
            "adapters: serve the adapter merged into the model's weights",
        )
        return 2
    queueing = (
        ("--max-queued-requests", args.max_queued_requests is not None),
        ("--enable-priority-scheduling", args.enable_priority_scheduling),
        ("--abort-on-priority-when-disabled", args.abort_on_priority_when_disabled),
    )
    for option, given in queueing:
        if given:
            log.error(
                "engine_option_unsupported",
                option=option,
                message=f"{option} limits and orders the generating scheduler's queue: a {kind} "
                "model is served by the pooling engine, which takes requests as they come",
            )
            return 2
    heap.hold()  # no full collections while transformers and the model load (settled below)
    try:
        load_format, remote = args.load_format, remote_seed(args)
        if load_format == "remote_instance" and remote is None:  # SGLang's _handle_load_format
            load_format = "auto"
        model = in_passing_thread(  # (torch_threads: the pooler's thread keeps the team)
            lambda: load_pooling_model(
                args.model,
                kind,
                device=args.device,
                dtype=args.dtype,
                trust_remote_code=args.trust_remote_code,
                load_format=load_format,
                remote=remote,
                overrides=args.json_model_override_args,
            )
        )
    except (OSError, ValueError, RemoteLoadError) as exc:
        log.error("engine_model_load_failed", model=str(args.model), error=str(exc))
        return 2
    if args.enable_mis and model.encoder:  # (its fused items read through a causal mask)
        log.error(
            "engine_settings_refused",
            model=str(args.model),
            error="--enable-mis scores items fused behind a causal mask: decoder models only, "
            "not an encoder (BERT, XLM-R), which attends both ways",
        )
        return 2
    if not mis_allowed(args, model.loaded.vocab_size):
        return 2
    pooler = Pooler(model, max_rows=args.max_running)
    # the seed's version, for weights taken from a running engine (remote_instance)
    pooler.weight_version = model.loaded.weight_version or args.weight_version
    pooler.start()
    try:
        app = build_pooling_app(
            pooler,
            max_body=int(args.max_request_mb * 2**20),
            api_key=api_key,
            chat_template=args.chat_template,
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            trust_request_chat_template=args.trust_request_chat_template,
            engine_id=os.environ.get(ENGINE_ID_ENV) or None,
            served_model_name=args.served_model_name,
            request_log=request_log_of(args),
            radix_cache_off=args.prefix_cache_tokens == 0,  # --disable-radix-cache
            mis=args.enable_mis,
            auto_truncate=args.allow_auto_truncate,
            preferred=args.preferred_sampling_params,
        )
        heap.settle()
        started = {"kind": kind, "outputs": model.width, "max_running": args.max_running}
        return run_loop(serve(app, args, model.loaded, started))
    finally:
        pooler.stop()


def build_pooling_app(
    pooler: Pooler,
    *,
    max_body: int = 256 * 2**20,
    api_key: str | None = None,
    chat_template: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    trust_request_chat_template: bool = False,
    engine_id: str | None = None,
    served_model_name: str | None = None,
    request_log: RequestLog | None = None,
    radix_cache_off: bool = False,
    mis: bool = False,
    auto_truncate: bool = False,
    preferred: dict[str, Any] | None = None,
) -> web.Application:
    """The application of a pooling engine; the caller starts and stops ``pooler``
    (``served_model_name``: the model's name on the OpenAI routes; None: its path;
    ``request_log``: SGLang's request logging of ``/encode``, ``/classify`` and their ``/v1``
    routes, with ``/configure_logging`` and ``/set_trace_level``; None: off until
    ``/configure_logging`` turns it on; ``radix_cache_off``: launched with
    ``--disable-radix-cache``, which ``/v1/score``'s setwise readout asks, as SGLang's does;
    ``mis``: ``--enable-mis``, its multi-item scoring; ``auto_truncate``:
    ``--allow-auto-truncate``; ``preferred``: ``--preferred-sampling-params``, reported only,
    as a pooling model samples nothing)."""
    app = base_app(max_body=max_body, api_key=api_key, engine_id=engine_id)
    app[_POOLER] = pooler
    loaded = pooler.model.loaded
    name = served_model_name or str(loaded.path)
    app[SERVED_NAME] = name
    requests = request_log if request_log is not None else RequestLog()
    requests.decode = decoder(loaded.tokenizer)
    app[_READING] = {"allow_auto_truncate": auto_truncate, "preferred_sampling_params": preferred}
    EncodeRoutes(
        pooler, name, requests, radix_cache_off=radix_cache_off, mis=mis,
        auto_truncate=auto_truncate,
    ).add_to(app)  # fmt: skip
    LoggingRoutes(requests).add_to(app)
    # SGLang serves these on any model: GC, runtime knobs, its stateless parsers
    app[_OVERRIDES] = requests.config_updates
    MaintenanceRoutes(pooler.max_rows, None, app[_OVERRIDES]).add_to(app)
    FeatureOffRoutes().add_to(app)  # SGLang's one app: the same answers on any model
    ParseRoutes(loaded.tokenizer).add_to(app)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", _flush_cache)
    chat = ChatSettings.of(
        loaded.tokenizer,
        loaded.path,
        chat_template=chat_template,
        default_kwargs=default_chat_template_kwargs,
    )
    if chat is not None:
        chat.trust_request_template = trust_request_chat_template
    TokenizeRoutes(loaded, chat).add_to(app)
    cards = OpenAIRoutes(
        _no_generation, _no_generation, None, served_model_name=name,
        context_length=loaded.context_length,
    )  # fmt: skip
    app.router.add_get("/v1/models", cards.models)
    app.router.add_get("/v1/models/{model:.+}", cards.model)
    app.router.add_get("/api/tags", cards.ollama_tags)  # Ollama's model list, as SGLang's
    app.router.add_post("/api/show", cards.ollama_show)
    app.router.add_post("/generate", _refuse_generate)
    for path in _GENERATION_ROUTES:
        app.router.add_post(path, _refuse_v1)
    app.router.add_post("/v1/decisions", _refuse_decisions)
    app.router.add_post("/v1/systemone", _refuse_systemone)
    for path in ("/health", "/ready", "/ping"):
        app.router.add_get(path, _health)
    app.router.add_get("/health_generate", _health_generate)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, _model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, _server_info)
    app.router.add_get("/get_weight_version", _weight_version)
    # SGLang's weight routes, on any model: a trainer updates a reward model as a policy
    add_weight_routes(app, pooler, str(loaded.path))
    LoadRoutes(pooler, loaded.model, pooler.max_batch_tokens, SERVED_VERSION).add_to(app)
    return app


def _no_generation(body: Any) -> Any:
    raise AssertionError("a pooling engine registers no generation route")


def _what(pooler: Pooler) -> str:
    if pooler.model.kind == "classify":
        return "a classification (reward) model: /classify and /encode answer its scores"
    return "an embedding model: /encode and /v1/embeddings answer its embeddings"


async def _flush_cache(request: web.Request) -> web.Response:
    """A pooling engine keeps no prefix cache: nothing to drop (the generating engine's words)."""
    return web.Response(text="Cache flushed.\n0 cached prefix tokens dropped.\n")


async def _refuse_generate(request: web.Request) -> web.Response:
    return bad_request(f"this engine serves {_what(request.app[_POOLER])}; it does not generate")


async def _refuse_v1(request: web.Request) -> web.Response:
    return error_response(
        f"this engine serves {_what(request.app[_POOLER])}; {request.path} needs a generating model"
    )


async def _refuse_decisions(request: web.Request) -> web.Response:
    """SGLang 0.5.23's refusal on a pooling model (``OpenAIServingDecisions._validate_server``)."""
    return error_response("/v1/decisions requires a generation model")


async def _refuse_systemone(request: web.Request) -> web.Response:
    """SGLang 0.5.23's answer on a pooling model without a Clef or Kev head: its body read and
    validated (422s, ``systemone.read_request``), then ``_validate_server``'s refusal."""
    from stages.engine import systemone

    parsed = await systemone.read_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    return error_response(f"{systemone.ROUTE} requires a generation model")


async def _health(request: web.Request) -> web.Response:
    named = engine_id_header(request.app)
    if request.app[_POOLER].alive:
        return web.Response(status=200, headers=named)
    return web.Response(status=503, text="the pooling thread is not running", headers=named)


async def _health_generate(request: web.Request) -> web.Response:
    """One pass over the prompt ``[0]``: 200 when it answers within
    ``HEALTH_CHECK_TIMEOUT_S``, else 503."""
    pooler = request.app[_POOLER]
    if not pooler.alive:
        return web.Response(status=503)
    try:
        await asyncio.wait_for(pooler.encode([[0]]), HEALTH_CHECK_TIMEOUT_S)
    except Exception as exc:  # a pass that fails or hangs is what this route reports
        log.warning("health_check_failed", error=str(exc) or type(exc).__name__)
        return web.Response(status=503)
    return web.Response(status=200)


async def _model_info(request: web.Request) -> web.Response:
    model: PoolingModel = request.app[_POOLER].model
    loaded = model.loaded
    return web.json_response(
        model_info(
            loaded,
            model_path=str(loaded.path),
            served_model_name=request.app[SERVED_NAME],
            is_generation=False,
            weight_version=request.app[_POOLER].weight_version,
            parsers={"reasoning_parser": None, "tool_call_parser": None},
            preferred=request.app[_READING]["preferred_sampling_params"],
        )
    )


async def _server_info(request: web.Request) -> web.Response:
    pooler: Pooler = request.app[_POOLER]
    loaded = pooler.model.loaded
    state = pooler.counts()
    return web.json_response(
        {
            "model_path": str(loaded.path),
            "tokenizer_path": str(loaded.path) if loaded.tokenizer is not None else None,
            "served_model_name": request.app[SERVED_NAME],
            "is_embedding": True,
            "max_running_requests": pooler.max_rows,
            "context_length": loaded.context_length,
            "max_total_num_tokens": pooler.max_batch_tokens,
            "max_req_input_len": loaded.context_length - 1,
            **request.app[_READING],
            "weight_version": pooler.weight_version,
            "internal_states": [{**state, **request.app[_OVERRIDES]}],
            "version": SERVED_VERSION,
            "engine": "inflight-builtin",
            "pooling": pooler.model.kind,
            "device": str(next(loaded.model.parameters()).device),
            "threads": torch.get_num_threads(),
            "refused_requests": refused_counts(request.app),
            "ignored_fields": ignored_counts(request.app),
            **state,
        }
    )


async def _weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[_POOLER].weight_version})
