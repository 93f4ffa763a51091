"""SGLang's OpenAI-compatible routes on the built-in engine: ``/v1/models`` and ``/v1/completions``.

What agent frameworks, evaluation harnesses and the ``openai`` client speak. Field names,
defaults and answers follow SGLang 0.5 (``srt/entrypoints/openai/protocol.py``:
``CompletionRequest``, ``CompletionResponse``, ``ModelCard``, ``ErrorResponse``;
``serving_completions.py``; ``utils.py`` ``to_openai_style_logprobs``; ``usage_processor.py``):

- a completion request becomes a native ``/generate`` request (``max_tokens`` -> ``max_new_tokens``
  (default 16), ``min_tokens`` -> ``min_new_tokens``, ``seed`` -> ``sampling_seed``, the other
  sampling fields by their own names; ``prompt`` a string, strings, token ids or lists of them),
  so the native route's checks apply and a value it cannot honour is refused, never ignored;
- ``logprobs: k`` asks for log-probs with ``k`` alternatives each (``top_logprobs_num``);
  ``echo`` puts the prompt's text in front of each choice's;
- the answer: ``{id, object: "text_completion", created, model, choices: [{index, text, logprobs:
  {text_offset (-1 each, as SGLang), token_logprobs, tokens, top_logprobs}, finish_reason,
  matched_stop}], usage: {prompt_tokens, total_tokens, completion_tokens, ...}, metadata:
  {weight_version, weight_versions}}``, choices prompt-major as ``/generate`` orders samples;
- fields SGLang accepts and does not use (``user``, ``suffix``, ``best_of``, ``stream_options``
  without ``stream``, and any it does not know) are ignored, as there.

Streamed (``stream: true``): server-sent ``CompletionStreamResponse`` chunks, each with one choice
and the text added since that choice's last chunk (the prompt's text in front of its first with
``echo``), the log-probs of the new tokens and, on its last, ``finish_reason`` and
``matched_stop``; ``usage`` null on each unless ``stream_options.continuous_usage_stats``; with
``stream_options.include_usage`` a last chunk without choices carrying the whole ``usage``; then
``data: [DONE]`` (``serving_completions._generate_completion_stream``).

``echo`` with ``logprobs`` > 0 asks for the prompt's log-probs too (``logprob_start_len`` 0, as
SGLang does): its tokens come first in ``logprobs``, the first with a null log-prob. The chat
route is ``openai_chat``'s, the Responses route ``openai_responses``'s (errors in its own
``{"error": {...}}`` envelope), Anthropic's ``/v1/messages`` ``anthropic_messages``'s (errors in
Anthropic's ``{"type": "error", "error": {...}}``), ``/v1/score`` ``openai_score``'s; the others'
errors are SGLang's ``{object:
"error", message, type, param, code}``.

This module knows nothing of the scheduler: the server hands it ``/generate`` as a coroutine.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from stages.engine.aborts import error_status, streaming_error
from stages.engine.chunk_stream import mapped
from stages.engine.preferred_params import with_preferred
from stages.engine.protocol import GRAMMAR_FIELDS, RequestError, cached_tokens_details, is_int
from stages.engine.request_body import dumps, loads, read_body
from stages.engine.request_error import AbortedWithError
from stages.engine.request_fields import (
    checked_chat,
    checked_completion,
    checked_rerank,
    checked_responses,
    checked_score,
)
from stages.engine.streaming import Progress, write_events
from stages.engine.token_bytes import TokenBytes

__all__ = [
    "ROUTE_KEYS",
    "OpenAIRoutes",
    "checked_body",
    "completion_request",
    "completion_response",
    "completion_stream",
    "read_json",
    "refusal",
    "response_format",
    "route_refusal",
]

# OpenAI field -> the native sampling parameter it sets (SGLang's _build_sampling_params)
_SAMPLING = {
    "temperature": "temperature",
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "n": "n",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "custom_params": "custom_params",
    "seed": "sampling_seed",
}
_NATIVE_NAMES = {native: name for name, native in _SAMPLING.items()}
# --preferred-sampling-params (preferred_params): the sampling keys each route's native body
# sets whatever the request says, as SGLang's builders set them, which the flag's values do not
# replace; a route not here takes none of them (the scoring routes sample nothing)
_COMPLETION_KEYS = frozenset(_SAMPLING.values()) | {"watermark"}  # _build_sampling_params
_CHAT_KEYS = (_COMPLETION_KEYS - {"json_schema"}) | {"spaces_between_special_tokens"}
ROUTE_KEYS: dict[str, frozenset[str]] = {
    "completions": _COMPLETION_KEYS,
    # ChatCompletionRequest.to_sampling_params: json_schema only with a response_format
    "chat": _CHAT_KEYS,
    "messages": _CHAT_KEYS,
    # ResponsesRequest.to_sampling_params: top_k, min_p and repetition_penalty only when set
    "responses": frozenset(
        ("max_new_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty", "stop")
    ),
    # OpenAIServingOllama._convert_options_to_sampling_params: max_new_tokens 2048 when unset
    "ollama_chat": frozenset(("max_new_tokens",)),
    "ollama_generate": frozenset(("max_new_tokens",)),
}
_MAX_TOKENS_DEFAULT = 16  # CompletionRequest.max_tokens


_IDS = random.Random()  # ids need to differ, not to be secret: no system call for each


def new_id(prefix: str, length: int = 32) -> str:
    """``prefix_`` and ``length`` hex digits (SGLang: of a ``uuid4``)."""
    return f"{prefix}_{_IDS.getrandbits(128):032x}"[: len(prefix) + 1 + length]


class OpenAIError(ValueError):
    """A request SGLang answers with 400 (``param``: the offending field, when known);
    ``kind``: the answer's ``type``, ``BAD_REQUEST`` for one its request model or FastAPI
    refuses before the route runs."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        kind: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status  # 404: a model or response the engine does not have
        self.kind = kind


# the ``type`` of SGLang's answer to its ``RequestValidationError`` (http_server.py)
BAD_REQUEST = "Bad Request"


def error_response(message: str, *, status: int = 400, param: str | None = None) -> web.Response:
    """SGLang's ``ErrorResponse`` (``OpenAIServingBase.create_error_response``)."""
    return web.json_response(_error(message, status=status, param=param), status=status)


def response_format(fmt: Any) -> dict[str, str]:
    """The native grammar a ``response_format`` asks for (SGLang's ``to_sampling_params``):
    ``json_schema`` its ``json_schema.schema`` as JSON text (or a top-level ``schema``, as
    SGLang's chat takes it), ``json_object`` any JSON object, ``structural_tag`` the format
    itself as the tag (``stages.engine.grammar``), ``text`` (or none) nothing."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise OpenAIError(
            "response_format.type: Input should be 'text', 'json_object', 'json_schema' or "
            "'structural_tag'",
            "response_format",
        )
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "structural_tag":  # the whole format is the tag (SGLang: model_dump)
        return {"structural_tag": json.dumps(fmt)}
    if kind == "text":
        return {}
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
    if schema is None:
        raise OpenAIError(
            "schema_ is required for json_schema response format request.", "response_format"
        )
    if isinstance(schema, str):
        return {"json_schema": schema}
    if not isinstance(schema, dict):
        raise OpenAIError(
            "response_format.json_schema.schema: Input should be a valid dictionary",
            "response_format",
        )
    return {"json_schema": json.dumps(schema)}


def completion_request(body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, what the answer needs: model, n, echo, logprobs)`` for a
    ``/v1/completions`` body; OpenAIError when SGLang would refuse it (or the engine cannot do
    what it asks)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    if "prompt" not in body:
        raise OpenAIError("prompt: Field required", "prompt")
    prompt = body["prompt"]
    text = _prompt_kind(prompt)
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise OpenAIError("Prompt cannot be empty", "prompt")  # _validate_request
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise OpenAIError("model: Input should be a valid string", "model")
    for flag in ("stream", "echo", "return_token_ids", *SGLEXT_FLAGS):
        if not isinstance(body.get(flag, False), bool):
            raise OpenAIError(f"{flag}: Input should be a valid boolean", flag)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise OpenAIError("stream_options: Input should be a valid dictionary", "stream_options")
    for flag in ("include_usage", "continuous_usage_stats"):
        if not isinstance(stream_options.get(flag, False), bool | None):
            raise OpenAIError(f"stream_options.{flag}: Input should be a valid boolean", flag)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise OpenAIError("logprobs: Input should be a non-negative integer", "logprobs")
    echo = body.get("echo", False)
    sampling: dict[str, Any] = {"max_new_tokens": _MAX_TOKENS_DEFAULT}
    for name, native in _SAMPLING.items():
        if body.get(name) is not None:
            sampling[native] = body[name]
    # SGLang's completions read a format only when there is one (``if request.response_format``)
    grammar = response_format(body.get("response_format") or None)
    sampling.update(grammar)
    native_body: dict[str, Any] = {
        "text" if text else "input_ids": prompt,
        "sampling_params": sampling,
        "return_logprob": logprobs is not None,
        "top_logprobs_num": logprobs or 0,
        "return_text_in_logprobs": True,
    }
    for name in PASSED_ON:  # checked by the native route, as SGLang passes them on
        if body.get(name) is not None:
            native_body[name] = body[name]
    adapter_in_model = name_adapter(native_body, model, body.get("lora_path"))
    if body.get("stream"):
        native_body["stream"] = True
    if echo and logprobs:  # SGLang: the prompt's log-probs too, in front of the output's
        native_body["logprob_start_len"] = 0
    if body.get("return_token_ids"):  # each choice's prompt ids too (SGLang 0.5.23)
        native_body["return_prompt_token_ids"] = True
    n = body.get("n", 1)
    options = {
        "model": model,
        "n": n if is_int(n) and n > 0 else 1,
        "echo": echo,
        "logprobs": logprobs,
        "return_token_ids": body.get("return_token_ids", False),
        "adapter_in_model": adapter_in_model,
        "grammar_from": "response_format" if grammar else None,
        "prompt": prompt,
        "stream": body.get("stream", False),
        # SGLang: only asked for, with stream (or --stream-response-default-include-usage)
        "include_usage": bool(stream_options.get("include_usage")),
        "continuous_usage_stats": bool(stream_options.get("continuous_usage_stats")),
        "hidden_states": hidden_mode(body),
        "return_cached_tokens_details": bool(body.get("return_cached_tokens_details")),
        "routed_experts": body.get("return_routed_experts") is True,
    }
    return native_body, options


def hidden_mode(body: Mapping[str, Any]) -> Any:
    """A ``/v1`` request's ``return_hidden_states``: false, true or ``"last"`` (SGLang's
    ``Union[bool, Literal["last"]]``; a list, as ``/generate`` takes per prompt, is refused);
    whether the server returns them, ``/generate`` checks."""
    mode = body.get("return_hidden_states")
    if mode is not None and not isinstance(mode, bool) and mode != "last":
        raise OpenAIError(
            "return_hidden_states: Input should be a valid boolean or 'last'",
            "return_hidden_states",
        )
    return mode or False


def choice_hidden_states(hidden: Any, mode: Any) -> Any:
    """A choice's ``hidden_states`` of its native ones (SGLang 0.5.23's
    ``process_hidden_states_for_response``): the newest (``return_hidden_states: true``: the
    last of them, [] with only the prompt's), or "last"'s as it is; None: none or not asked."""
    if not mode or hidden is None:
        return None
    if mode == "last":
        return hidden
    return hidden[-1] if len(hidden) > 1 else []


def name_adapter(native_body: dict[str, Any], model: str, lora_path: Any) -> bool:
    """Put the request's LoRA adapter in ``native_body`` as SGLang chooses it
    (``OpenAIServingBase._resolve_lora_path``): the name after the first colon of ``model``
    (``base-model:adapter``, stripped; nothing after the colon: none), else the request's own
    ``lora_path`` (a name, or one per prompt), else the base model. Returns whether ``model``
    named it (a refusal then names ``model``)."""
    _, colon, adapter = model.partition(":")
    adapter = adapter.strip()
    if colon and adapter:
        native_body["lora_path"] = adapter
        return True
    if lora_path is not None and lora_path != "":
        native_body["lora_path"] = lora_path
    return False


def completion_response(
    results: list[Mapping[str, Any]],
    options: Mapping[str, Any],
    decode: Callable[[list[int], bool], str],
    tokens: TokenBytes,
) -> dict[str, Any]:
    """SGLang's ``CompletionResponse`` for the native results of ``completion_request``
    (``tokens``: the tokenizer's, for the log-probs' texts)."""
    n = options["n"]
    echoes = _echo_prompts(options["prompt"], decode) if options["echo"] else []
    choices = []
    for index, item in enumerate(results):
        meta = item["meta_info"]
        text = item.get("text", "")
        if echoes:
            text = echoes[index // n] + text
        logprobs = None
        if options["logprobs"] is not None:
            logprobs = _openai_logprobs(
                meta.get("output_token_logprobs") or [],
                meta.get("output_top_logprobs") or [],
                tokens,
                _echoed_logprobs(meta, options),
            )
        reason = meta.get("finish_reason")
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason["type"] if reason else None,
            "matched_stop": reason.get("matched") if reason else None,
        }
        hidden = choice_hidden_states(meta.get("hidden_states"), options.get("hidden_states"))
        if hidden is not None:
            choice["hidden_states"] = hidden
        if options["return_token_ids"]:
            choice["token_ids"] = item["output_ids"]
            if item.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = item["prompt_token_ids"]
        choices.append(choice)
    first = results[0]["meta_info"]
    metadata = {"weight_version": first["weight_version"]}
    if "weight_versions" in first:
        metadata["weight_versions"] = first["weight_versions"]
    answer = {
        "id": first["id"],
        "object": "text_completion",
        "created": int(time.time()),
        "model": options["model"],
        "choices": choices,
        "usage": results_usage(results, n, options.get("cache_report", False)),
        "metadata": metadata,
    }
    sglext = response_sglext(first, options)
    if sglext:
        answer["sglext"] = sglext
    return answer


def response_sglext(first: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """A whole answer's ``sglext`` fields other than the ids, of its first sample, in
    ``SglExt``'s order: ``routed_experts`` (``process_routed_experts_from_ret``: asked for,
    and returned by a server with ``--enable-return-routed-experts``), then
    ``cached_tokens_details`` (``process_cached_tokens_details_from_ret``), when asked for and
    some of the prompt was cached. ``return_spec_tokens_details`` finds nothing: no
    speculative decoding here (SGLang's answer without it)."""
    out: dict[str, Any] = {}
    if options.get("routed_experts") and first.get("routed_experts"):
        out["routed_experts"] = first["routed_experts"]
    if options.get("return_cached_tokens_details"):
        details = first.get("cached_tokens_details")
        if details is not None:
            out["cached_tokens_details"] = details
    return out


def completion_stream(
    batches: AsyncIterator[list[Any]],
    options: Mapping[str, Any],
    decode: Callable[[list[int], bool], str],
    tokens: TokenBytes,
) -> AsyncIterator[list[dict[str, Any]]]:
    """SGLang's ``CompletionStreamResponse`` chunks for the native chunks (or samples'
    ``Progress``) of a streamed ``completion_request``: ``CompletionChunks`` of each batch."""
    return mapped(batches, CompletionChunks(options, decode, tokens, error_events=True))


class StreamLayout:
    """What an OpenAI stream's chunks keep per choice between batches (text and log-probs sent,
    tokens counted, the newest id, the hidden states), and the chunks its ``end`` is made of:
    each choice's hidden states (in the layout's own chunk) and the usage chunk of ``OBJECT``."""

    OBJECT = ""
    USAGE_EXCLUDE_NONE = False

    def __init__(self, options: Mapping[str, Any], *, error_events: bool = False) -> None:
        self.options = options
        # SGLang's /v1/completions and chat streams end at a sample aborted with an error
        # status, with its error event (``aborts.streaming_error``); then ``ended`` is set,
        # which ends the stream (``chunk_stream``). Its /api and /v1/responses streams read the
        # native chunks and do not.
        self.error_events = error_events
        self.ended = False
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}
        self.logprobs_sent: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.reasoning_tokens: dict[int, int] = {}  # a require_reasoning request's (chat)
        self.cached_tokens: dict[int, int] = {}  # the prompt's, from the prefix cache
        self.last_id = ""
        # with return_hidden_states: each choice's native hidden states, from its newest chunk
        self.hidden: dict[int, Any] | None = {} if options.get("hidden_states") else None
        # with return_routed_experts: each choice's, from its newest chunk (only its last has
        # them), in the order the choices first came (SGLang's dictionary of them)
        self.routed: dict[int, Any] | None = {} if options.get("routed_experts") else None

    def error_ends(self, reason: dict[str, Any] | None, out: list[dict[str, Any]]) -> bool:
        """Whether a sample's finish ``reason`` ends the stream (an abort with an error status,
        with ``error_events``): then its error event is added to ``out`` and ``ended`` set."""
        if reason is None or not self.error_events or error_status(reason) is None:
            return False
        out.append(streaming_error(reason))
        self.ended = True
        return True

    def hidden_chunks(self, chunk: Callable[[int, Any], dict[str, Any]]) -> list[dict[str, Any]]:
        """After the choices' last chunks, one of each choice's hidden states when asked for
        (SGLang's streams: ``choice_hidden_states`` of its newest, none where it has none),
        each made by ``chunk(index, hidden_states)``."""
        if not self.hidden:
            return []
        mode = self.options["hidden_states"]
        return [
            chunk(index, choice_hidden_states(hidden, mode))
            for index, hidden in self.hidden.items()
            if hidden
        ]

    def usage_chunks(self) -> list[dict[str, Any]]:
        """The usage chunk, when asked for (``stream_options.include_usage``)."""
        if not self.options["include_usage"]:
            return []
        return [
            usage_chunk(
                self.OBJECT, self.last_id, self.created, self.options["model"],
                self.prompt_tokens, self.completion_tokens, self.options["n"],
                self.reasoning_tokens,
                self.cached_tokens if self.options.get("cache_report") else None,
                exclude_none=self.USAGE_EXCLUDE_NONE,
            )
        ]  # fmt: skip

    def sglext_fields(self) -> dict[str, Any]:
        """The ``sglext`` chunk's fields other than the ids, in ``SglExt``'s order: the first
        choice's ``routed_experts`` that has some, its ``cached_tokens_details``."""
        out: dict[str, Any] = {}
        if self.routed:
            routed = next((r for r in self.routed.values() if r is not None), None)
            if routed is not None:
                out["routed_experts"] = routed
        details = self.cached_details()
        if details is not None:
            out["cached_tokens_details"] = details
        return out

    def cached_details(self) -> dict[str, int] | None:
        """``sglext.cached_tokens_details`` when the request asked for it
        (``return_cached_tokens_details``): the first choice's, in the order they came, that
        has cached tokens (SGLang 0.5.23's streams take it so)."""
        if not self.options.get("return_cached_tokens_details"):
            return None
        cached = next((t for t in self.cached_tokens.values() if t > 0), 0)
        return cached_tokens_details(cached)


class CompletionChunks(StreamLayout):
    """``serving_completions._generate_completion_stream``'s chunks, batch by batch (a
    ``chunk_stream.Transform``): per chunk one choice with the text added since that choice's
    last chunk (the prompt in front of its first with ``echo``), the log-probs of the new
    tokens, ``finish_reason`` on its last; with ``stream_options.include_usage`` a last chunk
    with no choices and the whole ``usage``."""

    OBJECT = "text_completion"
    USAGE_EXCLUDE_NONE = True  # serving_completions: ``model_dump_json(exclude_none=True)``

    def __init__(
        self,
        options: Mapping[str, Any],
        decode: Callable[[list[int], bool], str],
        tokens: TokenBytes,
        *,
        error_events: bool = False,
    ) -> None:
        super().__init__(options, error_events=error_events)
        self.tokens = tokens  # the tokenizer's: a part of a character's text (latin-1)
        self.echoes = _echo_prompts(options["prompt"], decode) if options["echo"] else []
        self.ids_sent: dict[int, int] = {}
        # each choice's chunk before its last, built once and brought up to date (a chunk is
        # encoded before the next is built); None: chunks with token ids or usage, built anew
        self.chunks: dict[int, tuple[dict[str, Any], dict[str, Any]]] | None = None
        if not options["return_token_ids"] and not options["continuous_usage_stats"]:
            self.chunks = {}

    def _progress_chunk(self, p: Progress, want_logprobs: bool) -> dict[str, Any]:
        """The chunk of a sample that moved on and goes on (``__call__``'s usual case)."""
        assert self.chunks is not None
        index, ids, text = p.index, p.ids, p.text
        self.prompt_tokens[index] = p.prompt_tokens
        self.cached_tokens[index] = p.cached
        self.completion_tokens[index] = total = len(ids)
        offsets = self.offsets
        start = offsets.get(index, 0)
        offsets[index] = len(text)
        logprobs = None
        if want_logprobs:
            sent = self.logprobs_sent.get(index, 0)
            if sent < total:
                logprobs = _progress_logprobs(p, sent, total, self.tokens)
            self.logprobs_sent[index] = total
        self.last_id = p.rid
        made = self.chunks.get(index)
        if made is None:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
            choice["matched_stop"] = None
            chunk = {"id": p.rid, "object": "text_completion", "created": self.created}
            chunk.update(model=self.options["model"], choices=[choice], usage=None)
            made = self.chunks[index] = (chunk, choice)
        chunk, choice = made
        choice["text"] = text[start:]
        choice["logprobs"] = logprobs
        if self.hidden is not None:
            self.hidden[index] = p.hidden_states()
        if self.routed is not None:
            self.routed.setdefault(index, None)
        return chunk

    def end(self) -> list[dict[str, Any]]:
        """After the choices' last chunks: a chunk of each one's hidden states when asked for,
        the ``sglext`` chunk when it has something (``return_cached_tokens_details``), then the
        usage chunk when asked for (``stream_options.include_usage``)."""
        out = self.hidden_chunks(self.hidden_chunk)
        sglext = self.sglext_fields()
        if sglext:
            out.append(
                {"id": self.last_id, "object": self.OBJECT, "created": self.created,
                 "model": self.options["model"], "choices": [], "usage": None,
                 "sglext": sglext}
            )  # fmt: skip
        return out + self.usage_chunks()

    def hidden_chunk(self, index: int, hidden: Any) -> dict[str, Any]:
        """A ``text_completion`` chunk of a choice's hidden states alone."""
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        choice.update(matched_stop=None, hidden_states=hidden)
        return {"id": self.last_id, "object": self.OBJECT, "created": self.created,
                "model": self.options["model"], "choices": [choice], "usage": None}  # fmt: skip

    def __call__(self, batch: list[Any]) -> list[dict[str, Any]]:
        options, offsets, logprobs_sent = self.options, self.offsets, self.logprobs_sent
        prompt_tokens, completion_tokens = self.prompt_tokens, self.completion_tokens
        want_logprobs = options["logprobs"] is not None
        out = []
        for content in batch:
            if type(content) is Progress:  # a sample that moved on (not echoed)
                if content.finish is None and self.chunks is not None:  # and goes on
                    out.append(self._progress_chunk(content, want_logprobs))
                    continue
                index, rid, ids, text = content.index, content.rid, content.ids, content.text
                prompt_tokens[index] = content.prompt_tokens
                self.cached_tokens[index] = content.cached
                completion_tokens[index] = total = len(ids)
                delta = text[offsets.get(index, 0) :]
                offsets[index] = len(text)
                logprobs = None
                if want_logprobs:
                    sent = logprobs_sent.get(index, 0)
                    if sent < total:
                        logprobs = _progress_logprobs(content, sent, total, self.tokens)
                    logprobs_sent[index] = total
                reason = content.finish
                prompt_ids = content.prompt_ids
                hidden = content.hidden_states()
                routed = content.routed
            else:
                index = content.get("index", 0)
                meta = content["meta_info"]
                rid = meta["id"]
                prompt_tokens[index] = meta.get("prompt_tokens", 0)
                self.cached_tokens[index] = meta.get("cached_tokens", 0)
                completion_tokens[index] = meta.get("completion_tokens", 0)
                text = content.get("text", "")
                if index not in offsets and self.echoes:  # its first chunk
                    text = self.echoes[index // options["n"]] + text
                delta = text[offsets.get(index, 0) :]
                offsets[index] = len(content.get("text", ""))
                logprobs = None
                if want_logprobs:
                    echoed = _echoed_logprobs(meta, options) if index not in logprobs_sent else None
                    sent, total = logprobs_sent.get(index, 0), meta["output_token_logprobs_length"]
                    if sent < total or echoed is not None:
                        logprobs = _openai_logprobs(
                            meta["output_token_logprobs"][sent:total],
                            (meta.get("output_top_logprobs") or [])[sent:total],
                            self.tokens,
                            echoed,
                        )
                    logprobs_sent[index] = total
                reason = meta.get("finish_reason")
                ids = content["output_ids"]
                prompt_ids = content.get("prompt_token_ids")
                hidden = meta.get("hidden_states")
                routed = meta.get("routed_experts")
            if self.hidden is not None:
                self.hidden[index] = hidden
            if self.routed is not None:
                self.routed[index] = routed
            self.last_id = rid
            if self.error_ends(reason, out):
                break
            choice: dict[str, Any] = {
                "index": index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": reason["type"] if reason else None,
                "matched_stop": reason.get("matched") if reason else None,
            }
            if options["return_token_ids"]:
                first = index not in self.ids_sent
                choice["token_ids"] = ids[self.ids_sent.get(index, 0) :]
                self.ids_sent[index] = len(ids)
                if first and prompt_ids is not None:  # the prompt's ids with the first chunk
                    choice["prompt_token_ids"] = prompt_ids
            chunk = {
                "id": rid,
                "object": "text_completion",
                "created": self.created,
                "model": options["model"],
                "choices": [choice],
                "usage": None,
            }
            if options["continuous_usage_stats"]:
                chunk["usage"] = _usage(prompt_tokens[index], completion_tokens[index])
            out.append(chunk)
        return out


def _progress_logprobs(p: Progress, start: int, end: int, tokens: TokenBytes) -> dict[str, Any]:
    """``_openai_logprobs`` of a streamed sample's tokens ``start:end``, read from its
    progress (what the native chunk's entries would hold, without building them)."""
    text = p.token_text
    if end - start == 1 and p.tops is None:  # a token at a time, without top log-probs
        token = p.ids[start]
        return {
            "text_offset": [-1],
            "token_logprobs": [p.logprobs[start]],
            "tokens": [None if text is None else tokens.text_of(token, text(token))],
            "top_logprobs": [],
        }
    if text is None:
        text = _no_text
    lossless = tokens.text_of
    tops = p.tops[start:end] if p.tops is not None else []
    return {
        "text_offset": [-1] * (end - start),
        "token_logprobs": p.logprobs[start:end],
        "tokens": [lossless(token, text(token)) for token in p.ids[start:end]],
        "top_logprobs": [{lossless(tok, text(tok)): lp for lp, tok in step} for step in tops],
    }


# a /v1 request's fields that go on to /generate as they are: its rid, its prefix-cache
# namespace, its priority, its hidden states (with the server's flag: each choice's newest),
# its custom logit processor (with the server's flag), its session (session_params: the
# server serves it in its session; session_id: its KV held for it, with the server's
# --enable-session-radix-cache), its routed experts (with the server's flag), and SGLang
# 0.5.23's fields for what this engine has not (multimodal settings, data-parallel ranks),
# which /generate takes at their neutral values only and refuses otherwise, naming the field
PASSED_ON = (
    "rid", "extra_key", "cache_salt", "priority",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "session_id",
    "session_params", "custom_logit_processor", "watermark", "images_config",
    "mm_processor_kwargs", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video",
    "video_config", "data_parallel_rank",
)  # fmt: skip
# a chat request's too (its ``meta_info`` carries them, with return_meta_info): each token's
# sampling support; SGLang's completion requests have no such field and ignore it
CHAT_PASSED_ON = (*PASSED_ON, "return_sampling_mask", "sampling_logprobs_mode")
# SGLang 0.5.23's requests for more ``sglext`` (booleans, on /v1/completions and the chat route):
# the prompt's cached tokens by cache tier; speculative decoding's figures (none here)
SGLEXT_FLAGS = ("return_cached_tokens_details", "return_spec_tokens_details")
# a chat request's headers that ask for the sglext ids as its fields do (serving_chat)
_SGLEXT_HEADERS = (
    ("x-sglext-return-input-ids", "return_input_ids_in_sglext"),
    ("x-sglext-return-output-ids", "return_output_ids_in_sglext"),
)


def _json_lines(batch: list[Any], encode: Callable[[Any], bytes]) -> bytes:
    """A batch of Ollama's stream: one JSON object a line."""
    return b"".join(encode(item) + b"\n" for item in batch)


def _ids_framed(batch: list[Any], encode: Callable[[Any], bytes]) -> bytes:
    """A chat stream's events with SGLang's ``x-sglext-ids-framed: 1``: the sglext ids in a
    chunk of their own as ``event: sglext_ids`` (a hop on the way picks the ids out without
    parsing JSON), after a ``data:`` chunk of the other sglext fields if there are some; the
    rest as ``data:`` lines."""
    out = []
    for chunk in batch:
        sglext = chunk.get("sglext")
        ids = {k: v for k, v in (sglext or {}).items() if k in _SGLEXT_IDS}
        if not ids:
            out.append(b"data: " + encode(chunk) + b"\n\n")
            continue
        if len(ids) < len(sglext):
            rest = {k: v for k, v in sglext.items() if k not in _SGLEXT_IDS}
            out.append(b"data: " + encode({**chunk, "sglext": rest}) + b"\n\n")
        out.append(b"event: sglext_ids\ndata: " + encode({**chunk, "sglext": ids}) + b"\n\n")
    return b"".join(out)


_SGLEXT_IDS = ("input_ids", "output_ids")  # SglExt.split_ids


def _no_text(token: int) -> None:
    return None


def _openai_logprobs(
    entries: list[list[Any]],
    tops: list[list[list[Any]]],
    tokens: TokenBytes,
    echoed: tuple[list[list[Any]], list[Any]] | None = None,
) -> dict[str, Any]:
    """SGLang's ``to_openai_style_logprobs`` of ``[logprob, id, text]`` entries, each text
    lossless (``TokenBytes.text_of``: a part of a character as latin-1); ``echoed``: the
    prompt's entries and top entries, which go first (``echo`` with ``logprobs``)."""
    if echoed is not None:
        entries = echoed[0] + entries
        tops = echoed[1] + tops
    lossless = tokens.text_of
    return {
        "text_offset": [-1] * len(entries),  # SGLang: "not supported yet"
        "token_logprobs": [e[0] for e in entries],
        "tokens": [lossless(e[1], e[2]) for e in entries],
        "top_logprobs": [
            None if step is None else {lossless(e[1], e[2]): e[0] for e in step} for step in tops
        ],
    }


def _echoed_logprobs(
    meta: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[list[list[Any]], list[Any]] | None:
    """The prompt's log-prob entries when ``echo`` and ``logprobs`` (> 0) asked for them."""
    if not (options["echo"] and options["logprobs"]):
        return None
    return meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []


def _details(cached_tokens: int) -> dict[str, Any]:
    """SGLang 0.5.23's ``PromptTokensDetails`` of a text prompt (its serializer leaves the
    multimodal counts out when they are null)."""
    return {"cached_tokens": cached_tokens}


def results_usage(
    results: list[Mapping[str, Any]], n: int, cache_report: bool = False
) -> dict[str, Any]:
    """``usage`` of whole answers, prompt-major with ``n`` samples a prompt
    (``UsageProcessor.calculate_response_usage``: each prompt counted once, its cached tokens
    too with ``cache_report``; the reasoning tokens of ``meta_info``, a ``require_reasoning``
    request's)."""
    firsts = range(0, len(results), n)
    prompts = sum(results[i]["meta_info"]["prompt_tokens"] for i in firsts)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    reasoning = sum(r["meta_info"].get("reasoning_tokens", 0) for r in results)
    cached = sum(results[i]["meta_info"]["cached_tokens"] for i in firsts) if cache_report else None
    return _usage(prompts, completion, reasoning, cached)


def usage_chunk(
    kind: str,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: Mapping[int, int],
    completion_tokens: Mapping[int, int],
    n: int,
    reasoning_tokens: Mapping[int, int] | None = None,
    cached_tokens: Mapping[int, int] | None = None,
    *,
    exclude_none: bool = False,
) -> dict[str, Any]:
    """A stream's last chunk with ``stream_options.include_usage``: no choices, the usage of
    every choice (by index; each prompt counted once, its cached tokens too when given:
    ``calculate_streaming_usage``). ``exclude_none``: its null fields left out (SGLang 0.5.23
    dumps a completion stream's usage chunk so, a chat stream's with them)."""
    prompts = sum(t for i, t in prompt_tokens.items() if i % n == 0)
    reasoning = sum(reasoning_tokens.values()) if reasoning_tokens else 0
    cached = None
    if cached_tokens is not None:
        cached = sum(t for i, t in cached_tokens.items() if i % n == 0)
    usage = _usage(prompts, sum(completion_tokens.values()), reasoning, cached)
    if exclude_none:
        usage = {k: v for k, v in usage.items() if v is not None}
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def _usage(
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int = 0,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """SGLang's ``UsageInfo`` (``UsageProcessor.calculate_token_usage``: the reasoning tokens
    also in ``completion_tokens_details`` when there are some; ``cached_tokens``, with
    ``--enable-cache-report``, in ``prompt_tokens_details``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else _details(cached_tokens),
        "reasoning_tokens": reasoning_tokens,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}
        if reasoning_tokens
        else None,
    }


class OpenAIRoutes:
    """The ``/v1`` handlers of one engine. ``generate(body)`` answers a native ``/generate``
    body (raising RequestError or ValueError as that route does), ``stream(body)`` the chunks
    of a streamed one (``stages.engine.streaming.stream_generate``); ``decode`` is the
    tokenizer's (None: the model has none, and these routes refuse every request);
    ``on_disconnect(request)``: a client went away mid-stream; ``watched(body, request)``: what
    ``generate`` does for a request served over HTTP, watching its client (the engine's:
    aborted once the client is gone, as SGLang aborts it; None: ``generate``)."""

    def __init__(
        self,
        generate: Callable[[Any], Awaitable[Any]],
        stream: Callable[[Any], AsyncIterator[Any]],
        decode: Callable[[list[int], bool], str] | None,
        *,
        served_model_name: str,
        context_length: int,
        on_disconnect: Callable[[web.Request], None] = lambda request: None,
        chat: Any = None,
        progress_stream: Callable[[Any], AsyncIterator[Any]] | None = None,
        adapters: Callable[[], list[dict[str, Any]]] = list,
        any_model: bool = False,
        response_store: Any = None,
        cache_report: bool = False,
        request_log: Any = None,
        watched: Callable[[Any, web.Request], Awaitable[Any]] | None = None,
        prefix_cache: bool = True,
        embed_width: int | None = None,
        mis: bool = False,
        images: Callable[[Any], AbstractAsyncContextManager[Any]] = lambda body: nullcontext(),
        preferred: Mapping[str, Any] | None = None,
        auto_truncate: bool = False,
        default_usage: bool = False,
        sglext_ids: tuple[bool, bool] = (False, False),
    ) -> None:
        self.generate, self.stream, self.decode = generate, stream, decode
        # --stream-response-default-include-usage: a stream's usage chunk, asked or not
        self.default_usage = default_usage
        # --return-input-ids, --return-output-ids: every chat answer's sglext ids
        self.sglext_ids = sglext_ids
        # --preferred-sampling-params, under the keys each route leaves out (preferred_params)
        self.preferred = preferred
        self.auto_truncate = auto_truncate  # --allow-auto-truncate (/v1/score's readout)
        # a native body's http(s) images fetched off the loop for a stream to read as it is
        # checked (``images.remote_images``; ``generate`` fetches its own)
        self.images = images
        # /v1/score's: whether the prefix cache is on (its setwise readout wants it off), and
        # the model's embedding width (what its embedding overrides' rows hold)
        self.prefix_cache, self.embed_width = prefix_cache, embed_width
        self.mis = mis  # --enable-mis: its multi-item scoring
        self.watched = watched
        # stages.engine.request_log.RequestLog: each /v1 body logged as it came (level >= 2)
        self.request_log = request_log
        self.any_model = any_model  # /v1/responses takes any model name (the agent proxy)
        # openai_responses.ResponseStore (--enable-response-store); None: off, SGLang's default
        self.response_store = response_store
        self.cache_report = cache_report  # --enable-cache-report: usage's cached tokens
        self.adapters = adapters  # the loaded LoRA adapters ({lora_name, lora_path, ...})
        # ``stream`` giving each sample's Progress rather than native chunks before its last
        # (``stream_generate(..., progress=True)``): every /v1 stream renders its own from them
        # (an echoed completion aside)
        self.progress_stream = progress_stream
        self.on_disconnect = on_disconnect
        self.chat = chat  # openai_chat.ChatSettings (None: the model has no tokenizer)
        self.served_model_name, self.context_length = served_model_name, context_length

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/score", self.score)
        app.router.add_post("/v1/decisions", self.decisions)
        app.router.add_post("/v1/systemone", self.systemone)
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_put("/v1/rerank", self.rerank)
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)
        app.router.add_post("/invocations", self.chat_completions)  # SageMaker's, as SGLang's
        app.router.add_post("/api/chat", self.ollama_chat)  # Ollama's (stages.engine.ollama_api)
        app.router.add_post("/api/generate", self.ollama_generate)
        app.router.add_get("/api/tags", self.ollama_tags)
        app.router.add_post("/api/show", self.ollama_show)

    def _card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.context_length,
        }

    async def models(self, request: web.Request) -> web.Response:
        """The served model, then each loaded LoRA adapter (SGLang's ``available_models``: its
        name, its folder as ``root``, the model as ``parent``); a request names one as
        ``model: "MODEL:ADAPTER"`` or with ``lora_path``."""
        cards = [self._card(self.served_model_name)]
        for adapter in self.adapters():
            card = self._card(adapter["lora_name"])
            card.update(root=adapter["lora_path"], parent=self.served_model_name)
            card["max_model_len"] = None
            cards.append(card)
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return web.json_response({"error": error}, status=404)
        return web.json_response(self._card(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "responses")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "messages")

    async def score(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "score")

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "rerank")

    async def decisions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "decisions")

    async def systemone(self, request: web.Request) -> web.Response:
        from stages.engine import systemone  # it builds on the decisions route

        return await systemone.serve(request, self)

    async def ollama_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "ollama_chat")

    async def ollama_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "ollama_generate")

    async def ollama_tags(self, request: web.Request) -> web.Response:
        from stages.engine import ollama_api

        return web.json_response(ollama_api.tags(self.served_model_name))

    async def ollama_show(self, request: web.Request) -> web.Response:
        from stages.engine import ollama_api

        body, refused = read_body(await request.read(), request.headers.get("Content-Type"))
        if refused is not None:  # as on the other Ollama routes (_serve)
            return refused
        try:
            return web.json_response(ollama_api.show(body, self.context_length))
        except OpenAIError as exc:
            return web.json_response(route_refusal("ollama_show", exc), status=400)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``/v1/messages/count_tokens``: the tokens of the prompt a request would render."""
        from stages.engine.anthropic_messages import count_tokens

        try:
            if self.decode is None:
                raise OpenAIError("this model has no tokenizer: use the native /generate route")
            counted = count_tokens(await read_json(request), self.chat, self.context_length)
        except OpenAIError as exc:
            return web.json_response(route_refusal("messages", exc), status=exc.status)
        return web.json_response(counted)

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: a stored response (a background one as it stands);
        without a store, SGLang's refusal."""
        return await self._stored(request, cancel=False)

    async def cancel_response(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: a background response still running is
        cancelled; one that has ended is answered as it is, as SGLang answers it."""
        return await self._stored(request, cancel=True)

    async def _stored(self, request: web.Request, *, cancel: bool) -> web.Response:
        from stages.engine.openai_responses import STORE_DISABLED

        store = self.response_store
        if store is None:
            return web.json_response(_nested(STORE_DISABLED, 400, "response_id"), status=400)
        response_id = request.match_info["response_id"]
        try:
            found = await store.cancel(response_id) if cancel else store.get(response_id)
        except OpenAIError as exc:
            return web.json_response(route_refusal("responses", exc), status=exc.status)
        return web.Response(body=dumps(found), content_type="application/json")

    def _known_model(self, name: str) -> bool:
        """Whether ``model`` names the served model, a loaded adapter or ``SERVED:ANYTHING``
        (``OpenAIServingResponses._validate_model``)."""
        adapters = {a["lora_name"] for a in self.adapters()}
        return name in adapters or name.split(":", 1)[0] == self.served_model_name

    async def reply(self, route: str, body: Any, client: web.Request | None = None) -> Reply:
        """The answer to ``body`` on ``route`` (``completions`` or ``chat``), whatever carries
        it: HTTP here (``_serve``: ``client``, the HTTP request), or a caller in this process
        (the agent proxy's client)."""
        if self.decode is None:
            refused = OpenAIError("this model has no tokenizer: use the native /generate route")
            return Reply(400, route_refusal(route, refused))
        build, respond, stream = self._handlers(route)
        options: dict[str, Any] = {}
        try:
            native, options = build(body)
            if self.preferred and route in ROUTE_KEYS:
                native = with_preferred(native, self.preferred, ROUTE_KEYS[route])
            if route in ("completions", "chat"):
                options["cache_report"] = self.cache_report
            if options.get("background"):  # /v1/responses: answered at once, run in a task
                from stages.engine.openai_responses import run_in_background

                queued = run_in_background(native, options, self.generate, self.response_store)
                return Reply(200, queued)
            if native is None:  # nothing to run (a /v1/score of no items)
                return Reply(200, respond([], options))
            if options["stream"]:
                source = self.stream
                progress = route != "completions" or not options["echo"]
                if progress and self.progress_stream:  # an echo's first chunk needs the native
                    source = self.progress_stream
                async with self.images(native):  # (checked and queued at once)
                    return Reply(200, chunks=stream(source(native), options))
            if client is not None and self.watched is not None:
                rendered = await self.watched(native, client)
            else:
                rendered = await self.generate(native)
        except ValueError as exc:  # OpenAIError, RequestError, a rid already in flight
            status = getattr(exc, "status", 400)
            return Reply(status, route_refusal(route, _as_written(exc, options)))
        results = rendered if isinstance(rendered, list) else [rendered]
        return Reply(200, respond(results, options))

    def _handlers(self, route: str) -> tuple[Callable[..., Any], ...]:
        """``(build, respond, stream)`` of ``route``: the native body of a request's, the
        answer of native results, the events of native chunks."""
        if route == "responses":
            from stages.engine import openai_responses  # it builds on the chat route

            chat, length = self.chat, self.context_length
            known = None if self.any_model else self._known_model
            store = self.response_store

            def build_response(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                body = checked_body(checked_responses, raw)
                return openai_responses.responses_request(body, chat, length, known, store)

            return (
                build_response,
                openai_responses.responses_response,
                openai_responses.response_events,
            )
        if route == "score":
            from stages.engine import openai_score  # it builds on this module

            tokenizer = self.chat.tokenizer if self.chat is not None else None
            engine = openai_score.ScoreEngine(
                tokenizer, self.prefix_cache, self.embed_width, mis=self.mis,
                auto_truncate=self.auto_truncate,
            )  # fmt: skip

            def build_score(raw: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
                return openai_score.score_request(checked_body(checked_score, raw), engine)

            return build_score, openai_score.score_response, None
        if route == "decisions":
            from stages.engine import openai_decisions  # it builds on the score route

            settings, length, served = self.chat, self.context_length, self.served_model_name

            def build_decisions(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                return openai_decisions.decisions_request(raw, settings, length, served)

            return build_decisions, openai_decisions.decisions_response, None
        if route == "rerank":
            from stages.engine import openai_rerank  # it builds on this module

            settings = self.chat

            def build_rerank(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                raw = checked_body(checked_rerank, raw)
                if settings is None:  # no tokenizer: no template either
                    raise OpenAIError(openai_rerank.NOT_A_RERANKER)
                template = settings.template or getattr(settings.tokenizer, "chat_template", None)
                return openai_rerank.rerank_request(raw, template, settings.tokenizer, self.mis)

            return build_rerank, openai_rerank.rerank_response, None
        if route == "messages":
            from stages.engine import anthropic_messages  # it builds on the chat route

            chat, length = self.chat, self.context_length

            def build_message(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                return anthropic_messages.messages_request(raw, chat, length)

            return (
                build_message,
                anthropic_messages.messages_response,
                anthropic_messages.message_events,
            )
        if route.startswith("ollama_"):
            return self._ollama_handlers(route)
        if route == "chat":
            from stages.engine import openai_chat  # it builds on this module

            chat, length = self.chat, self.context_length

            def build(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                built = openai_chat.chat_request(checked_body(checked_chat, raw), chat, length)
                return self._usage(built)

            return build, openai_chat.chat_response, openai_chat.chat_stream
        decode = self.decode
        tokens = self.chat.token_bytes if self.chat is not None else TokenBytes(None)

        def respond(results: list[Any], options: dict[str, Any]) -> dict[str, Any]:
            return completion_response(results, options, decode, tokens)

        def stream(chunks: AsyncIterator[Any], options: dict[str, Any]) -> AsyncIterator[Any]:
            return completion_stream(chunks, options, decode, tokens)

        def build_completion(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            return self._usage(completion_request(checked_body(checked_completion, raw)))

        return build_completion, respond, stream

    def _usage(self, built: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict, dict]:
        """A completion or chat request's (native body, options), its stream ending with the
        usage chunk under ``--stream-response-default-include-usage`` (SGLang's
        ``should_include_usage``: ``stream_options.include_usage`` or the flag)."""
        if self.default_usage:
            built[1]["include_usage"] = True
        return built

    def _ollama_handlers(self, route: str) -> tuple[Callable[..., Any], ...]:
        """``_handlers`` of Ollama's ``/api/chat`` and ``/api/generate``."""
        from stages.engine import ollama_api  # it builds on the chat and completion routes

        chat, length, served = self.chat, self.context_length, self.served_model_name
        if route == "ollama_chat":

            def build_chat(raw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
                return ollama_api.ollama_chat_request(raw, chat, length, served)

            return build_chat, ollama_api.ollama_chat_response, ollama_api.chat_events
        decode = self.decode
        tokens = chat.token_bytes if chat is not None else TokenBytes(None)

        def build(raw: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
            return ollama_api.ollama_generate_request(raw, chat, length, served)

        def respond(results: list[Any], options: dict[str, Any]) -> dict[str, Any]:
            return ollama_api.ollama_generate_response(results, options, decode, tokens)

        def stream(chunks: AsyncIterator[Any], options: dict[str, Any]) -> AsyncIterator[Any]:
            completions = CompletionChunks(options, decode, tokens)
            return ollama_api.generate_events(chunks, options, completions)

        return build, respond, stream

    async def _serve(self, request: web.Request, route: str) -> web.StreamResponse:
        """One HTTP request of a ``/v1`` route: its ``reply``, as JSON or as events."""
        if route.startswith("ollama"):  # no validate_json_request there: FastAPI's reading
            body, refused = read_body(await request.read(), request.headers.get("Content-Type"))
            if refused is not None:
                return refused
        else:
            try:
                body = await read_json(request)
            except OpenAIError as exc:
                return web.json_response(route_refusal(route, exc), status=400)
        if route == "chat" and isinstance(body, dict):  # SGLang 0.5.23's sglext headers
            for (header, flag), default in zip(_SGLEXT_HEADERS, self.sglext_ids, strict=True):
                # (or the server's flag: serving_chat's _should_return_input_ids)
                if (default or request.headers.get(header) == "1") and not body.get(flag):
                    body[flag] = True
        if self.request_log is not None and not route.startswith("ollama"):
            self.request_log.received_openai(body, request.headers)
        reply = await self.reply(route, body, request)
        if reply.chunks is None:
            return web.Response(
                body=dumps(reply.body), status=reply.status, content_type="application/json"
            )
        framing: dict[str, Any] = {}
        if route in ("responses", "messages"):  # ``event:`` lines, no [DONE] (SGLang's)
            from stages.engine.openai_responses import sse_named

            framing = {"events": sse_named, "done": b""}
        elif route.startswith("ollama_"):  # newline-delimited JSON, Ollama's
            framing = {"events": _json_lines, "done": b"", "content_type": "application/x-ndjson"}
        elif route == "chat" and request.headers.get("x-sglext-ids-framed") == "1":
            framing = {"events": _ids_framed}  # the sglext ids as a named event
        try:
            return await write_events(
                request,
                reply.chunks,
                dumps,
                on_disconnect=lambda: self.on_disconnect(request),
                **framing,
            )
        except ValueError as exc:  # raised before the first event: still an error status
            return web.json_response(route_refusal(route, exc), status=400)


async def read_json(request: web.Request) -> Any:
    """The JSON body of a request to an OpenAI route; OpenAIError (a 400) when it is not
    ``application/json`` (SGLang's ``validate_json_request``) or not JSON."""
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise OpenAIError(  # as SGLang words its validation error: the field, then the msg
            "header.content-type: Unsupported Media Type: Only 'application/json' is allowed",
            kind=BAD_REQUEST,
        )
    try:
        return loads(await request.read())
    except (UnicodeDecodeError, ValueError) as exc:  # FastAPI's json_invalid
        raise OpenAIError(f"the request body is not JSON: {exc}", kind=BAD_REQUEST) from None


def checked_body(check: Callable[[Any], dict[str, Any]], body: Any) -> dict[str, Any]:
    """``body`` as ``check`` (``stages.engine.request_fields``) converts its fields; an
    OpenAIError in the shape of SGLang's validation error when it refuses one."""
    try:
        return check(body)
    except ValueError as exc:
        raise OpenAIError(str(exc), kind=BAD_REQUEST) from None


@dataclass
class Reply:
    """A ``/v1`` answer: ``status`` and ``body`` (JSON), or ``chunks`` to send as events."""

    status: int
    body: Any = None
    chunks: AsyncIterator[list[Any]] | None = None


def refusal(exc: ValueError) -> dict[str, Any]:
    """The 400 body for a request refused by the routes' checks: an OpenAIError (its param),
    a native RequestError (its field under the OpenAI name) or a rid already in flight."""
    if isinstance(exc, OpenAIError):
        return _error(str(exc), param=exc.param, kind=exc.kind)
    if isinstance(exc, RequestError):
        field = _openai_field(exc.field)
        message = f"{field}{str(exc)[len(exc.field) :]}"
        return _error(message, param=field.split("[")[0].split(".")[0])
    if isinstance(exc, AbortedWithError):  # SGLang's ValueError, or an HTTPException's answer
        kind = "BadRequestError" if exc.status == 400 else str(exc.status)
        return _error(str(exc), status=exc.status, kind=kind)
    return _error(str(exc))  # a rid in flight (SGLang's create_error_response: no param)


def _as_written(exc: ValueError, options: Mapping[str, Any]) -> ValueError:
    """``exc``, naming the field the client wrote: an adapter ``model`` named is refused as
    ``model``, not as the native ``lora_path`` it became; a grammar made of ``response_format``
    or ``tool_choice`` (``options["grammar_from"]``) as that field."""
    if not isinstance(exc, RequestError):
        return exc
    if exc.field == "lora_path" and options.get("adapter_in_model"):
        return RequestError("model", str(exc)[len(exc.field) + 2 :])
    grammar_from = options.get("grammar_from")
    if grammar_from and exc.field.rsplit(".", 1)[-1] in GRAMMAR_FIELDS:
        return RequestError(grammar_from, str(exc)[len(exc.field) + 2 :])
    return exc


def route_refusal(route: str, exc: ValueError) -> dict[str, Any]:
    """``refusal(exc)``, in the Responses route's envelope on ``responses``, Anthropic's on
    ``messages``, Ollama's on its routes."""
    refused = refusal(exc)
    if route.startswith("ollama_"):  # a body its model refuses: FastAPI's answer, SGLang's shape
        return refused if refused["type"] == BAD_REQUEST else {"error": refused["message"]}
    if route == "messages":
        from stages.engine.anthropic_messages import error_body

        message = refused["message"]
        if refused["type"] == BAD_REQUEST and len(message) > 500:  # SGLang's digest, cut
            message = message[:500] + "…"
        return error_body(message, getattr(exc, "status", 400))
    if route != "responses":
        return refused
    kind = refused["type"] if refused["type"] == BAD_REQUEST else "invalid_request_error"
    return _nested(refused["message"], getattr(exc, "status", 400), refused["param"], kind)


def _nested(
    message: str, status: int, param: str | None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    """The Responses route's error (``serving_responses.create_error_response``; ``kind``
    ``BAD_REQUEST``: its validation handler's, for ``/v1/responses``)."""
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": status,
        }
    }


def _error(
    message: str, *, status: int = 400, param: str | None = None, kind: str = "BadRequestError"
) -> dict[str, Any]:
    """SGLang's ``ErrorResponse`` body (``OpenAIServingBase.create_error_response``)."""
    return {
        "object": "error",
        "message": message,
        "type": kind,
        "param": param,
        "code": status,
    }


def _prompt_kind(prompt: Any) -> bool:
    """Whether ``prompt`` is text (a string or strings); OpenAIError unless it is one of
    ``str | list[str] | list[int] | list[list[int]]``."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return True
        if all(is_int(p) for p in prompt) or all(
            isinstance(p, list) and all(is_int(t) for t in p) for p in prompt
        ):
            return False
    raise OpenAIError(
        "prompt: Input should be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids",
        "prompt",
    )


def _echo_prompts(prompt: Any, decode: Callable[[list[int], bool], str]) -> list[str]:
    """Each prompt's text, as SGLang's ``_prepare_echo_prompts`` gives it."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(is_int(t) for t in prompt):
        return [decode(list(prompt), True)]
    return [decode(list(p), True) for p in prompt]


def _openai_field(native: str) -> str:
    """The OpenAI name of a native field path (``sampling_params.max_new_tokens`` ->
    ``max_tokens``, ``input_ids[1]`` -> ``prompt[1]``)."""
    for prefix in ("sampling_params.", "sampling_params[0]."):
        if native.startswith(prefix):
            name = native[len(prefix) :]
            return _NATIVE_NAMES.get(name, name)
    for prefix in ("input_ids", "text"):
        if native.startswith(prefix):
            return "prompt" + native[len(prefix) :]
    return "logprobs" if native == "top_logprobs_num" else native
