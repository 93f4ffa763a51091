"""Ollama's API on the built-in engine, for agents and tools written for the ``ollama`` client
(its ``host`` the engine's): ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``,
``POST /api/show``, as SGLang 0.5.23 serves them (``srt/entrypoints/ollama/serving.py``,
``protocol.py``), built on the OpenAI routes here.

- ``/api/chat``: ``messages`` (``role``, ``content``) through the chat template, as
  ``/v1/chat/completions`` renders them; ``stream`` (true by default, as Ollama's) answers
  newline-delimited JSON, a line per content delta, then one with ``done: true``, its
  ``done_reason`` and the counts; not streamed, one ``{model, created_at, message, done,
  done_reason, total_duration, prompt_eval_count, eval_count}``.
- ``/api/generate``: ``prompt`` (after ``system`` and a blank line), the text as it is (no
  template: SGLang's, whatever ``raw`` says; ``suffix``, ``template`` and ``context`` are
  left, as there); an empty prompt answers at once, done, in one JSON object even when
  streamed (the Ollama CLI's warm-up call); answers ``response`` in place of ``message``.
  ``keep_alive`` means nothing here (the model stays loaded). A prompt that leaves no room in
  the context for an answer is refused.
- ``options``: ``temperature``, ``top_p``, ``top_k``, ``num_predict`` (``max_new_tokens``:
  2048 when absent, SGLang's default for this API), ``stop``, ``presence_penalty``,
  ``frequency_penalty``, ``seed``; the model's own settings (``num_ctx``, ``num_gpu``...) and
  Ollama's other samplers are not SGLang's and are left, as there. ``model`` names nothing:
  the served model answers, under its own name (SGLang's ``served_model_name``).
- ``/api/tags`` lists the served model, ``/api/show`` describes it, in SGLang's words (a
  pooling engine serves these two as well).

Where SGLang's version loses something, this one does what the Ollama API means, and says so:
the text of a stream's last chunk is sent (SGLang drops it), ``done_reason`` is ``length`` at
the token limit (SGLang says ``stop`` always), a ``num_predict`` past the context is cut to what
it leaves (SGLang's scheduler does that; this engine's native route refuses it), ``seed``
seeds the sample (SGLang passes it on as an unknown sampling parameter); ``format`` (``json``
or a JSON schema), ``tools`` (calls in ``message.tool_calls``, arguments as objects, read as
``--tool-call-parser`` reads them), ``logprobs``/``top_logprobs``, ``min_p`` and
``repeat_penalty`` are honoured, and ``think`` is the template's thinking switch, its
reasoning in ``message.thinking`` (SGLang ignores them all); ``images`` are refused (this is a
text model; SGLang drops them). Errors are Ollama's ``{"error": message}``, which its client
reads (SGLang's validation answers its own 400 layout, its generation errors a 500).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from typing import Any

from stages.engine.chunk_stream import mapped
from stages.engine.openai_api import (
    OpenAIError,
    checked_body,
    completion_request,
    completion_response,
)
from stages.engine.openai_chat import ChatChunks, ChatSettings, chat_request, chat_response
from stages.engine.request_fields import (
    checked_ollama_chat,
    checked_ollama_generate,
    checked_ollama_show,
)

__all__ = [
    "chat_events",
    "error_body",
    "generate_events",
    "ollama_chat_request",
    "ollama_chat_response",
    "ollama_generate_request",
    "ollama_generate_response",
    "show",
    "tags",
]

MAX_NEW_TOKENS = 2048  # SGLang's default for this API ("Ollama users expect longer responses")
# options read as SGLang reads them, and those it ignores that mean the same here
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
}
_DIGEST = "sha256:sglang" + "0" * 58  # SGLang's stand-in digest


def error_body(message: str) -> dict[str, str]:
    """Ollama's error answer, which its client raises as ``ResponseError``."""
    return {"error": message}


def _now() -> str:
    """Ollama's ``created_at``: UTC to the millisecond."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# ---- /api/chat --------------------------------------------------------------------------------


def ollama_chat_request(
    body: Any, settings: ChatSettings, context_length: int, served: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, what the answer needs)`` of an ``/api/chat`` body, through
    ``chat_request``; OpenAIError (a 400) where it is refused."""
    body = checked_body(checked_ollama_chat, body)  # refused: SGLang's shape, not {error}
    messages = body["messages"]
    chat_body: dict[str, Any] = {
        "model": body["model"],
        "messages": [_message(m, i) for i, m in enumerate(messages)],
        "stream": _stream(body),
    }
    _sampling(body.get("options"), chat_body)
    _format(body.get("format"), chat_body)
    _think(body.get("think"), chat_body)
    if body.get("tools"):
        chat_body["tools"] = body["tools"]
    if body.get("logprobs"):
        chat_body["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat_body["top_logprobs"] = body["top_logprobs"]
    native, options = chat_request(chat_body, settings, context_length)
    _limit(native, chat_body)
    options["ollama"] = {"model": served, "started": time.monotonic_ns()}
    return native, options


def ollama_chat_response(
    results: list[Mapping[str, Any]], options: Mapping[str, Any]
) -> dict[str, Any]:
    """The non-streamed answer (SGLang's ``OllamaChatResponse``) of the request's sample."""
    chat = chat_response(results, options)
    choice = chat["choices"][0]
    out = _head(options)
    out["message"] = _answer_message(choice["message"])
    out.update(_done(options, choice["finish_reason"], chat["usage"]))
    if choice.get("logprobs"):
        out["logprobs"] = _logprobs(choice["logprobs"]["content"])
    return out


def chat_events(
    batches: AsyncIterator[list[Any]], options: Mapping[str, Any]
) -> AsyncIterator[list[dict[str, Any]]]:
    """The lines of a streamed ``/api/chat`` (``ChatLines`` of each batch)."""
    return mapped(batches, ChatLines(options))


class _Lines(ABC):
    """Ollama's stream over the OpenAI route's chunk transform ``inner`` (a
    ``chunk_stream.Transform``, which counts the tokens too): a line per choice delta that says
    something (``_line``), then the last, ``done: true``, with the counts."""

    def __init__(self, options: Mapping[str, Any], inner: Any) -> None:
        self.options, self.inner = options, inner
        self.finish: str | None = None

    def __call__(self, batch: list[Any]) -> list[dict[str, Any]]:
        out = []
        for chunk in self.inner(batch):
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    self.finish = choice["finish_reason"]
                line = self._line(choice)
                if line is not None:
                    out.append({**_head(self.options), **line, "done": False, "done_reason": None})
        return out

    def end(self) -> list[dict[str, Any]]:
        last = {**_head(self.options), **self._last()}
        last.update(_done(self.options, self.finish, _counts(self.inner)))
        return [last]

    @abstractmethod
    def _line(self, choice: Mapping[str, Any]) -> dict[str, Any] | None:
        """A choice's line (its fields after ``created_at``), None when it says nothing."""

    @abstractmethod
    def _last(self) -> dict[str, Any]:
        """The last line's content fields."""


class ChatLines(_Lines):
    """``_stream_chat_response``'s lines: a line per delta of content or thinking; tool calls,
    which the chat stream sends in pieces (a call's name, then parts of its arguments), go
    whole in one line when the choice finishes, as Ollama sends them."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options, ChatChunks(options))
        self.calls: dict[int, dict[str, Any]] = {}  # by the call's index: name, arguments

    def _line(self, choice: Mapping[str, Any]) -> dict[str, Any] | None:
        delta = dict(choice["delta"])
        for piece in delta.pop("tool_calls", None) or ():
            fn = piece["function"]
            call = self.calls.setdefault(piece["index"], {"name": None, "arguments": ""})
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments") or ""
        if choice["finish_reason"] is not None and self.calls:
            delta["tool_calls"] = [{"function": self.calls[i]} for i in sorted(self.calls)]
            self.calls = {}
        message = _answer_message({"content": delta.get("content") or "", **delta})
        if len(message) == 3 and not message["content"] and not choice.get("logprobs"):
            return None  # the role's chunk, a finish: nothing to say yet
        line: dict[str, Any] = {"message": message}
        if choice.get("logprobs"):
            line["logprobs"] = _logprobs(choice["logprobs"]["content"])
        return line

    def _last(self) -> dict[str, Any]:
        return {"message": _answer_message({"content": ""})}


def _message(raw: Any, index: int) -> dict[str, Any]:
    """An Ollama message as the chat route's: ``role`` and ``content`` (text); an assistant's
    ``tool_calls`` with their arguments as JSON; a tool's answer with its ``tool_name``
    (``role`` and ``content`` typed by ``request_fields.OllamaMessage``)."""
    where = f"messages.{index}"
    content = raw.get("content", "")  # left out by the ollama client when empty
    if raw.get("images"):
        raise OpenAIError(
            f"{where}.images: this model reads text only; images are not supported", "messages"
        )
    message: dict[str, Any] = {"role": raw["role"], "content": content}
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise OpenAIError(f"{where}.tool_calls: Input should be a valid list", "messages")
        message["tool_calls"] = [_tool_call_in(c, f"{where}.tool_calls.{i}", i)
                                 for i, c in enumerate(calls)]  # fmt: skip
    if raw.get("tool_name") is not None:
        message["name"] = raw["tool_name"]
    return message


def _tool_call_in(raw: Any, where: str, index: int) -> dict[str, Any]:
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(f"{where}.function.name: Field required", "messages")
    arguments = fn.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise OpenAIError(f"{where}.function.arguments: Input should be an object", "messages")
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.dumps(arguments)},
    }


def _answer_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The chat route's message (or delta) as Ollama's: ``thinking``, ``tool_calls`` with
    their arguments as objects, when there are any."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    out["images"] = None
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {"function": {"name": c["function"]["name"], "arguments": _arguments(c["function"])}}
            for c in calls
        ]
    return out


def _arguments(fn: Mapping[str, Any]) -> Any:
    try:
        return json.loads(fn.get("arguments") or "{}")
    except ValueError:  # the model's text: what it wrote, under a key that says so
        return {"_unparsed": fn.get("arguments")}


def _completion_logprobs(logprobs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The completion route's ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``
    as ``{token: logprob}``) as Ollama's list."""
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [
        {
            "token": token,
            "logprob": lp,
            "top_logprobs": [{"token": t, "logprob": v} for t, v in (top or {}).items()],
        }
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True)
    ]


def _logprobs(entries: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat route's ``logprobs.content`` as Ollama's: ``token``, ``logprob``,
    ``top_logprobs``."""
    out = []
    for entry in entries:
        tops = [
            {"token": t["token"], "logprob": t["logprob"]} for t in entry.get("top_logprobs") or ()
        ]
        out.append({"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": tops})
    return out


# ---- /api/generate ----------------------------------------------------------------------------


def ollama_generate_request(
    body: Any, settings: ChatSettings, context_length: int, served: str
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(native /generate body or None for an empty prompt, what the answer needs)`` of an
    ``/api/generate`` body, through ``completion_request``."""
    body = checked_body(checked_ollama_generate, body)
    prompt = body["prompt"]
    system = body.get("system")
    if body.get("images"):
        raise OpenAIError("images: this model reads text only; images are not supported")
    if system:
        prompt = f"{system}\n\n{prompt}"
    stream = _stream(body)
    options: dict[str, Any] = {"ollama": {"model": served, "started": time.monotonic_ns()}}
    if not prompt.strip():  # the Ollama CLI's first call: answered at once, done
        options["stream"] = False
        return None, options
    ids = settings.tokenizer.encode(prompt)  # as /generate encodes a text prompt
    completion: dict[str, Any] = {"model": body["model"], "prompt": ids, "stream": stream}
    _sampling(body.get("options"), completion)
    _format(body.get("format"), completion)
    if body.get("logprobs"):
        completion["logprobs"] = body.get("top_logprobs") or 0
    native, more = completion_request(completion)
    _limit(native, completion, context_length - len(ids))
    more["ollama"] = options["ollama"]
    return native, more


def ollama_generate_response(
    results: list[Mapping[str, Any]], options: Mapping[str, Any], decode: Any, tokens: Any
) -> dict[str, Any]:
    """The non-streamed answer (SGLang's ``OllamaGenerateResponse``, its fields in its order:
    ``context`` before the counts; an empty prompt's with every count null, as there)."""
    out = _head(options)
    if not results:  # an empty prompt
        out.update(response="", done=True, done_reason="stop", context=None)
        out.update(dict.fromkeys(_COUNTS))
        return out
    completion = completion_response(results, options, decode, tokens)
    choice = completion["choices"][0]
    out["response"] = choice["text"]
    done = _done(options, choice["finish_reason"], completion["usage"])
    out.update(done=done.pop("done"), done_reason=done.pop("done_reason"), context=None, **done)
    if choice.get("logprobs"):
        out["logprobs"] = _completion_logprobs(choice["logprobs"])
    return out


def generate_events(
    batches: AsyncIterator[list[Any]], options: Mapping[str, Any], completions: Any
) -> AsyncIterator[list[dict[str, Any]]]:
    """The lines of a streamed ``/api/generate``: ``completions`` (the completion route's
    chunk transform of this request) through ``GenerateLines``."""
    return mapped(batches, GenerateLines(options, completions))


class GenerateLines(_Lines):
    """``_stream_generate_response``'s lines: a line per text delta."""

    def _line(self, choice: Mapping[str, Any]) -> dict[str, Any] | None:
        if not choice["text"] and not choice.get("logprobs"):
            return None
        line: dict[str, Any] = {"response": choice["text"]}
        if choice.get("logprobs"):
            line["logprobs"] = _completion_logprobs(choice["logprobs"])
        return line

    def _last(self) -> dict[str, Any]:
        return {"response": ""}


# ---- /api/tags, /api/show ---------------------------------------------------------------------


def tags(served: str) -> dict[str, Any]:
    """SGLang's ``get_tags``: the served model, its family the name's last part."""
    family = served.split("/")[-1]
    model = {
        "name": served, "model": served, "modified_at": _now(), "size": 0, "digest": _DIGEST,
        "details": {"format": "sglang", "family": family, "parameter_size": "unknown"},
    }  # fmt: skip
    return {"models": [model]}


def show(body: Any, context_length: int) -> dict[str, Any]:
    """SGLang's ``get_show`` of the model ``body`` names (any name: this engine serves one)."""
    model = checked_body(checked_ollama_show, body)["model"]
    family = model.split("/")[-1]
    for suffix in ("-Instruct", "-Chat", "-Base"):
        if family.endswith(suffix):
            family = family[: -len(suffix)]
            break
    return {
        "license": "",
        "modelfile": f"FROM {model}\nPARAMETER num_ctx {context_length}\n",
        "parameters": f"num_ctx {context_length}",
        "template": "",
        "modified_at": _now(),
        "details": {
            "parent_model": "", "format": "sglang", "family": family, "families": [family],
            "parameter_size": "unknown", "quantization_level": "",
        },
        "model_info": {
            "general.architecture": family, "general.name": model,
            "general.parameter_count": 0, f"{family}.context_length": context_length,
            f"{family}.block_count": 0, f"{family}.embedding_length": 0,
            f"{family}.attention.head_count": 0,
        },
        "capabilities": ["completion"],
    }  # fmt: skip


# ---- shared -----------------------------------------------------------------------------------


def _stream(body: dict[str, Any]) -> bool:
    return body.get("stream", True)  # Ollama streams unless told not to


def _sampling(raw: Any, out: dict[str, Any]) -> None:
    """``options`` as the OpenAI route's fields (``num_predict`` kept for ``_limit``)."""
    raw = raw or {}
    for name, field in _OPTIONS.items():
        if raw.get(name) is not None:
            out[field] = raw[name]
    predict = raw.get("num_predict")
    if predict is not None and (isinstance(predict, bool) or not isinstance(predict, int)):
        raise OpenAIError("options.num_predict: Input should be a valid integer", "options")
    # -1 (no limit) and -2 (fill the context), Ollama's: what the context leaves
    out["num_predict"] = None if predict is None else (predict if predict >= 0 else -1)


def _format(raw: Any, out: dict[str, Any]) -> None:
    """``format``: ``json`` (any JSON object) or a JSON schema, as ``response_format``."""
    if raw is None:
        return
    if raw == "json":
        out["response_format"] = {"type": "json_object"}
    else:  # a JSON schema (request_fields: "json", a dictionary or null)
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": raw},
        }


def _think(raw: Any, chat_body: dict[str, Any]) -> None:
    """``think``: the template's thinking switch, as the chat route's ``reasoning_effort``
    (false: ``none``; true: ``medium``; or Ollama's ``low``, ``medium``, ``high``)."""
    if raw is None:
        return
    if raw is True or raw is False:
        chat_body["reasoning_effort"] = "medium" if raw else "none"
    else:  # low, medium or high (request_fields.OllamaChatFields)
        chat_body["reasoning_effort"] = raw


def _limit(native: dict[str, Any], body: dict[str, Any], left: int | None = None) -> None:
    """The sample's ``max_new_tokens``: ``num_predict`` (else 2048), cut to what the context
    leaves after the prompt, as SGLang's scheduler cuts it."""
    sampling = native["sampling_params"]
    if left is None:  # the chat route set what the context leaves
        left = sampling["max_new_tokens"]
    if left <= 0:  # nothing to generate (a max_new_tokens of 0 would score the prompt only)
        raise OpenAIError("the prompt leaves no room in the model's context for an answer")
    want = body.get("num_predict")
    want = MAX_NEW_TOKENS if want is None else (left if want < 0 else want)
    sampling["max_new_tokens"] = min(want, left)


def _counts(layout: Any) -> dict[str, Any]:
    """A stream's token counts, as its chunk transform (a ``StreamLayout``) counted them."""
    return {
        "prompt_tokens": layout.prompt_tokens.get(0),
        "completion_tokens": layout.completion_tokens.get(0),
    }


def _head(options: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": options["ollama"]["model"], "created_at": _now()}


_COUNTS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
           "eval_count", "eval_duration")  # fmt: skip


def _done(options: Mapping[str, Any], finish: str | None, usage: Mapping[str, Any]) -> dict:
    """A finished answer's fields: ``done_reason`` (``length`` at the token limit) and its
    counts."""
    return {
        "done": True,
        "done_reason": "length" if finish == "length" else "stop",
        "total_duration": time.monotonic_ns() - options["ollama"]["started"],
        "load_duration": None,
        "prompt_eval_count": usage.get("prompt_tokens"),
        "prompt_eval_duration": None,
        "eval_count": usage.get("completion_tokens"),
        "eval_duration": None,
    }
