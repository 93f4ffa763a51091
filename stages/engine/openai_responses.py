"""SGLang's ``/v1/responses`` (OpenAI's Responses API, what the OpenAI Agents SDK speaks by
default) on the built-in engine, built on its ``/v1/chat/completions`` as SGLang 0.5.23 builds
it (``srt/entrypoints/openai/serving_responses.py``, non-Harmony models; ``protocol.py``
``ResponsesRequest``, ``ResponsesResponse``; ``responses_adapters.py``):

- ``input`` (a string: one user message; or a list of items) becomes chat messages:
  ``instructions`` first as a system message; messages of any role (``developer`` as
  ``system``, its text after ``Developer instructions:\\n``), their ``input_text`` and
  ``output_text`` parts as text; a ``function_call`` item as an assistant message with that
  tool call (``arguments`` kept when they are a JSON object, else ``{}``); a
  ``function_call_output`` as a ``tool`` message; a ``reasoning`` item as an assistant
  message's ``reasoning_content`` (none without text); adjacent assistant messages merged when
  their ``phase`` agrees or the first is reasoning alone (``_merge_consecutive_assistant_
  messages``); any other item type: 400 ``Unsupported Responses API input item type``;
- ``tools`` of ``type: function`` (``name``, ``description``, ``parameters``, ``strict``) are
  the chat tools; other tool types are accepted and not used (``shell``: 400); ``tool_choice``
  ``auto``, ``none``, ``required`` or ``{type: function, name}``;
- sampling: ``max_output_tokens`` less 2 (SGLang's headroom), ``temperature`` (else the model's
  ``generation_config.json``, else 0.7), ``top_p``, ``top_k``, ``min_p``, ``stop``, the
  penalties; ``text.format`` ``json_schema`` or ``json_object`` constrains the answer;
  ``reasoning.effort`` switches the template's thinking (``none``: off; any other, ``{}``
  included: on); ``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) adds
  the log-probs of every generated token to the message's text (not when streamed: 400);
- the answer: ``{id (request_id, "resp_<hex>"), object: "response", created_at, model,
  output, status, usage, ...}`` with its items in SGLang's order (a ``reasoning`` item, a
  ``message`` with one ``output_text`` part, then the ``function_call`` items), ``status``
  ``incomplete`` (``incomplete_details.reason: max_output_tokens``) for a sample cut at its
  length, ``failed`` for an aborted one; ``usage`` ``{input_tokens, input_tokens_details:
  {cached_tokens, cache_write_tokens}, output_tokens, output_tokens_details:
  {reasoning_tokens}, total_tokens}``; the request's fields echoed as SGLang echoes them;
- ``stream``: ``event: <type>`` / ``data: {json}`` server-sent events, ``sequence_number``
  from 0, no ``[DONE]``: ``response.created``, ``response.in_progress``, each item's
  ``output_item.added``, ``content_part.added``, its deltas (``reasoning_text``,
  ``output_text``, ``function_call_arguments``), their ``done`` events and
  ``output_item.done``, then ``response.completed`` (or ``incomplete``, ``failed``) with the
  whole response. With tools, a message's events are held back until a call follows it (its
  ``phase`` then ``commentary``) or the answer ends (``final_answer``), as SGLang holds them.

SGLang's response store is off unless it is started with ``--enable-response-store``, and so is
this engine's (``ResponseStore``): without it ``previous_response_id``, ``background``, ``GET
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` are refused with SGLang's words;
with it a finished response (``store`` not false) is kept with its input and output items, a
later request's ``previous_response_id`` puts them before its own input (not its
``instructions``), and ``GET`` answers it. ``background`` (with ``store``; not streamed) is
answered at once with the response ``queued`` and run in a task (``run_in_background``):
``GET`` then shows it ``in_progress``, then whole (or ``failed``); ``cancel`` marks one still
running ``cancelled`` and aborts it, and answers one that has ended as it is. Streamed, a
background request streams on its connection, as SGLang's does.
Not here: system messages gathered in front for a template that refuses them later in the
conversation (SGLang probes the template for that; here the template's error is the 400), and
encrypted reasoning (``include: ["reasoning.encrypted_content"]`` is accepted, not filled).
This module knows nothing of HTTP; ``openai_api.OpenAIRoutes`` serves it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from stages.engine.chunk_stream import mapped
from stages.engine.openai_api import OpenAIError
from stages.engine.openai_api import new_id as _new_id
from stages.engine.openai_chat import ChatChunks, ChatSettings, chat_request, chat_response
from stages.engine.streaming import Progress

__all__ = [
    "STORE_DISABLED",
    "ResponseEvents",
    "ResponseStore",
    "response_events",
    "responses_request",
    "responses_response",
    "sse_named",
]

STORE_DISABLED = (
    "Response store is disabled. Stateful Responses require --enable-response-store on a "
    "standalone server; response storage is unavailable in PD mode."
)
LOGPROBS = "message.output_text.logprobs"
_ECHO_EFFORTS = ("minimal", "low", "medium", "high")  # ECHOABLE_REASONING_EFFORTS
_TEMPERATURE = 0.7  # ResponsesRequest._DEFAULT_SAMPLING_PARAMS
_PASSED = ("top_p", "top_k", "min_p", "stop", "repetition_penalty")
_PASSED += ("frequency_penalty", "presence_penalty", "chat_template_kwargs")


class ResponseStore:
    """SGLang's response and message stores (``--enable-response-store``): each finished
    response by its id, with the input items that led to it and its output items, for a later
    request's ``previous_response_id`` and ``GET /v1/responses/{id}``. The oldest are
    forgotten past ``capacity`` (SGLang keeps every one)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self.responses: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.items: dict[str, list[dict[str, Any]]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}  # background requests still running

    def get(self, response_id: str) -> dict[str, Any]:
        """The stored response; OpenAIError in SGLang's words for an id that is not one."""
        if not response_id.startswith("resp_"):
            raise OpenAIError(
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                "response_id",
            )
        found = self.responses.get(response_id)
        if found is None:
            raise OpenAIError(
                f"Response with id '{response_id}' not found.", "response_id", status=404
            )
        return found

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The input and output items of the stored response ``response_id``."""
        self.get(response_id)
        return list(self.items[response_id])

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel`` (``cancel_responses``): a background response
        still queued or running is marked ``cancelled`` and its request aborted (its task
        cancelled, which aborts what it queued); one that has ended is answered as it is."""
        response = self.get(response_id)
        if response["status"] not in ("queued", "in_progress"):
            return response
        response["status"] = "cancelled"
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        return response

    def keep(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        rid = response["id"]
        self.responses[rid] = response
        self.responses.move_to_end(rid)
        self.items[rid] = items + [_without_none(item) for item in response["output"]]
        while len(self.responses) > self.capacity:
            old, _ = self.responses.popitem(last=False)
            self.items.pop(old, None)


def responses_request(
    body: Any,
    settings: ChatSettings,
    context_length: int,
    known_model: Callable[[str], bool] | None = None,
    store: ResponseStore | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, what the answer needs)`` for a ``/v1/responses`` body, through
    ``chat_request``; OpenAIError (its ``status`` 404 for an unknown model or response) when
    SGLang refuses it. ``known_model(name)``: whether the engine serves ``model`` (None: any);
    ``store``: the response store (None: off, as SGLang's is by default). Its fields' types
    are ``request_fields.checked_responses``' (the route checks them first)."""
    model = body.get("model")
    if model is None:  # declared optional, required by its chat request
        raise OpenAIError("model: Input should be a valid string", "model")
    tools = _tools(body.get("tools"))
    if any(t.get("type") == "shell" for t in tools):
        raise OpenAIError("Shell tools are not supported by this model", "tools")
    previous = body.get("previous_response_id")
    if previous is not None and store is None:  # (a string: checked above)
        raise OpenAIError(STORE_DISABLED, "previous_response_id")
    if body.get("background"):
        if store is None:
            raise OpenAIError(STORE_DISABLED, "background")
        if body.get("store") is False:
            raise OpenAIError("background=true requires store=true.", "store")
    if known_model is not None and not known_model(model):
        raise OpenAIError(f"The model '{model}' does not exist", "model", status=404)
    functions = [t for t in tools if t["type"] == "function"]
    choice = _tool_choice(body.get("tool_choice", "auto"), functions)
    logprobs = LOGPROBS in (body.get("include") or [])
    if body.get("stream") and logprobs:
        raise OpenAIError("logprobs are not supported in streaming mode", "logprobs")
    items = (store.history(previous) if store is not None and previous else []) + _items(
        body.get("input")
    )
    chat_body: dict[str, Any] = {
        "model": model,
        "messages": _messages(items, body.get("instructions")),
        "rid": body.get("request_id") or _new_id("resp"),
        "temperature": body.get("temperature"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }
    if chat_body["temperature"] is None:
        chat_body["temperature"] = settings.defaults.get("temperature", _TEMPERATURE)
    for name in _PASSED:
        if body.get(name) is not None:
            chat_body[name] = body[name]
    if functions:
        chat_body["tools"] = [_chat_tool(t) for t in functions]
        chat_body["tool_choice"] = choice
    limit = body.get("max_output_tokens")
    if limit is not None:
        if limit - 2 < 0:  # SGLang keeps 2 tokens of headroom (to_sampling_params)
            raise OpenAIError(
                f"max_new_tokens must be at least 0, got {limit - 2}.", "max_output_tokens"
            )
        chat_body["max_tokens"] = limit - 2
    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        effort = reasoning.get("effort", "medium")  # ResponseReasoningParam's default
        if effort is not None:
            chat_body["reasoning_effort"] = effort
    text = body.get("text")
    fmt = _text_format(text)
    if fmt is not None:
        chat_body["response_format"] = fmt
    if logprobs:
        chat_body["logprobs"] = True
        chat_body["top_logprobs"] = body.get("top_logprobs") or 0
    if body.get("stream"):
        chat_body["stream"] = True
        chat_body["stream_options"] = {"include_usage": True}
    try:
        native, options = chat_request(chat_body, settings, context_length)
    except OpenAIError as exc:  # named as the client wrote it
        raise _as_responses(exc) from None
    options["response"] = {
        "id": chat_body["rid"],
        "model": model,
        "tools": body.get("tools") or [],
        "tool_choice": _echo_choice(body.get("tool_choice", "auto")),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "instructions": body.get("instructions"),
        "max_output_tokens": limit,
        "reasoning": {"effort": effort if effort in _ECHO_EFFORTS else None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": text,
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
        "previous_response_id": previous,
        "phased": bool(functions) and choice != "none",  # messages wait for a call or the end
    }
    if store is not None and body.get("store") is not False:  # kept once it is whole
        options["response"]["keep"] = lambda response: store.keep(response, items)
    # streamed, a background request streams on its connection (SGLang: not detached)
    options["background"] = bool(body.get("background")) and not body.get("stream")
    return native, options


def run_in_background(
    native: dict[str, Any],
    options: dict[str, Any],
    generate: Callable[[dict[str, Any]], Awaitable[Any]],
    store: ResponseStore,
) -> dict[str, Any]:
    """SGLang's background mode (``serving_responses``: ``background`` without ``stream``):
    the response kept at once as ``queued`` and answered; the request runs in a task, which
    marks it ``in_progress``, then keeps the whole response as it ends, or marks it
    ``failed``. ``GET /v1/responses/{id}`` follows it; ``ResponseStore.cancel`` ends it."""
    queued = _response(options, [], None, None, status="queued")
    _kept(options, queued)  # its input is kept too: previous_response_id may name it

    async def run() -> None:
        queued["status"] = "in_progress"
        try:
            rendered = await generate(native)
            responses_response(rendered if isinstance(rendered, list) else [rendered], options)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a request the engine failed: as SGLang, the status says so
            if queued["status"] not in ("completed", "cancelled"):
                queued["status"] = "failed"
                queued["error"] = {"code": "server_error", "message": str(exc)}

    rid = queued["id"]
    task = store.tasks[rid] = asyncio.get_running_loop().create_task(run(), name=f"create_{rid}")
    task.add_done_callback(lambda _: store.tasks.pop(rid, None))
    return queued


def responses_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict:
    """The ``response`` object of a finished request (its one sample, ``results[0]``)."""
    chat = chat_response(results, options)
    choice, meta = chat["choices"][0], results[0]["meta_info"]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content"):
        logprobs = _text_logprobs(choice["logprobs"]) if options["logprobs"] else None
        phase = "commentary" if calls else "final_answer"
        output.append(_message_item(_new_id("msg"), message["content"], phase, logprobs))
    for call in calls:
        fn = call["function"]
        output.append(_call_item(_new_id("fc", 8), call["id"], fn["name"], fn["arguments"]))
    return _kept(options, _response(options, output, meta.get("finish_reason"), _usage_of(meta)))


def _kept(options: Mapping[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    keep = options["response"].get("keep")
    if keep is not None:
        keep(response)
    return response


def response_events(
    batches: AsyncIterator[list[Mapping[str, Any]]], options: Mapping[str, Any]
) -> AsyncIterator[list[dict[str, Any]]]:
    """The events of a streamed request (``ResponseEvents`` of each native batch)."""
    return mapped(batches, ResponseEvents(options))


class ResponseEvents:
    """``_responses_stream_generator_non_harmony``'s events, batch by batch (a
    ``chunk_stream.Transform`` over the request's one sample: its ``Progress`` or its native
    chunks; ``ChatChunks`` reads the reasoning and the tool calls out of them, this lays them
    out as items). Each event's fields come in the order SGLang's pydantic models write them
    (sorted by name, ``response.*`` events aside)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = options
        self.chat = ChatChunks({**options, "include_usage": False})
        self.sequence = 0
        self.started = False
        self.items: list[dict[str, Any]] = []  # output items closed, in order
        self.open: dict[str, Any] | None = None  # the item whose deltas are going out
        self.calls: dict[int, dict[str, Any]] = {}  # open function calls by their index
        self.held: list[dict[str, Any]] | None = None  # a message's events, phase to come
        self.cached = 0
        self.finish: Any = None

    def __call__(self, batch: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            pending = _response(self.options, [], None, None, status="in_progress")
            out.append(self._event("response.created", pending))
            out.append(self._event("response.in_progress", pending))
        for sample in batch:
            if type(sample) is Progress:
                self.cached, finish = sample.cached, sample.finish
            else:
                meta = sample["meta_info"]
                self.cached, finish = meta.get("cached_tokens", 0), meta.get("finish_reason")
            self.finish = finish or self.finish
        for chunk in self.chat(batch):
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    self._text(out, "reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    if self.calls and not delta["content"].strip():
                        continue  # whitespace between calls
                    self._text(out, "message", delta["content"])
                for call in delta.get("tool_calls") or ():
                    self._call(out, call)
        return out

    def end(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._close(out)
        self._close_calls(out)
        self._release(out, "final_answer")
        chat = self.chat
        usage = _usage(
            chat.prompt_tokens.get(0, 0),
            chat.completion_tokens.get(0, 0),
            self.cached,
            chat.reasoning_tokens.get(0, 0),
        )
        response = _response(self.options, self.items, self.finish, usage)
        _kept(self.options, response)
        out.append(self._event(f"response.{response['status']}", response))
        return out

    # -- items ---------------------------------------------------------------------------------
    def _text(self, out: list[dict[str, Any]], kind: str, text: str) -> None:
        item = self.open
        if item is None or item["type"] != kind:
            self._close(out)
            if kind == "message":  # text after calls closes them
                self._close_calls(out)
            item = self.open = self._open(out, kind)
        item["_text"] += text
        if kind == "reasoning":
            out.append({"content_index": 0, "delta": text, "item_id": item["id"],
                        "output_index": item["_index"], "sequence_number": self._number(),
                        "type": "response.reasoning_text.delta"})  # fmt: skip
            return
        self._put(out, {"content_index": 0, "delta": text, "item_id": item["id"], "logprobs": [],
                        "output_index": item["_index"], "sequence_number": self._number(),
                        "type": "response.output_text.delta"}, message=True)  # fmt: skip

    def _open(self, out: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        index = len(self.items) + len(self.calls)
        message = kind == "message"
        item = {"id": _new_id("msg" if message else "rs"), "_text": "", "_index": index}
        item["type"] = kind
        if message:
            if self.options["response"]["phased"] and self.held is None:
                self.held = []
            added = _message_item(item["id"], None, "final_answer", None, status="in_progress")
            part: dict[str, Any] = {"annotations": [], "text": "", "type": "output_text",
                                    "logprobs": None}  # ResponseOutputText's order  # fmt: skip
        else:
            added = _reasoning_item(item["id"], None, status="in_progress")
            part = {"text": "", "type": "reasoning_text"}
        self._put(out, {"item": added, "output_index": index, "sequence_number": self._number(),
                        "type": "response.output_item.added"}, message)  # fmt: skip
        self._put(out, {"content_index": 0, "item_id": item["id"], "output_index": index,
                        "part": part, "sequence_number": self._number(),
                        "type": "response.content_part.added"}, message)  # fmt: skip
        return item

    def _close(self, out: list[dict[str, Any]]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        rid, text, index, message = (
            item["id"],
            item["_text"],
            item["_index"],
            item["type"] == "message",
        )
        if message:
            done = _message_item(rid, text, "final_answer", None)
            self._put(out, {"content_index": 0, "item_id": rid, "logprobs": [],
                            "output_index": index, "sequence_number": self._number(),
                            "text": text, "type": "response.output_text.done"},
                      message)  # fmt: skip
            part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text",
                                    "logprobs": None}  # fmt: skip
        else:
            done = _reasoning_item(rid, text)
            out.append({"content_index": 0, "item_id": rid, "output_index": index,
                        "sequence_number": self._number(), "text": text,
                        "type": "response.reasoning_text.done"})  # fmt: skip
            part = {"text": text, "type": "reasoning_text"}
        self._put(out, {"content_index": 0, "item_id": rid, "output_index": index, "part": part,
                        "sequence_number": self._number(), "type": "response.content_part.done"},
                  message)  # fmt: skip
        self._put(out, {"item": done, "output_index": index, "sequence_number": self._number(),
                        "type": "response.output_item.done"}, message)  # fmt: skip
        self.items.append(done)

    def _call(self, out: list[dict[str, Any]], piece: Mapping[str, Any]) -> None:
        index, fn = piece["index"], piece["function"]
        call = self.calls.get(index)
        if call is None:  # a new call: what is open before it closes
            self._close(out)
            self._close_calls(out)
            self._release(out, "commentary")
            position = len(self.items)
            call = self.calls[index] = {
                "id": _new_id("fc", 8),
                "call_id": piece["id"] or _new_id("call", 24),
                "name": fn["name"],
                "arguments": "",
                "_index": position,
            }
            added = _call_item(call["id"], call["call_id"], call["name"], "", "in_progress")
            out.append({"item": added, "output_index": position,
                        "sequence_number": self._number(),
                        "type": "response.output_item.added"})  # fmt: skip
        if fn.get("arguments"):
            call["arguments"] += fn["arguments"]
            out.append({"delta": fn["arguments"], "item_id": call["id"],
                        "output_index": call["_index"], "sequence_number": self._number(),
                        "type": "response.function_call_arguments.delta"})  # fmt: skip

    def _close_calls(self, out: list[dict[str, Any]]) -> None:
        for call in self.calls.values():
            rid, index = call["id"], call["_index"]
            out.append({"arguments": call["arguments"], "item_id": rid, "name": call["name"],
                        "output_index": index, "sequence_number": self._number(),
                        "type": "response.function_call_arguments.done"})  # fmt: skip
            done = _call_item(rid, call["call_id"], call["name"], call["arguments"])
            out.append({"item": done, "output_index": index, "sequence_number": self._number(),
                        "type": "response.output_item.done"})  # fmt: skip
            self.items.append(done)
        self.calls = {}

    def _release(self, out: list[dict[str, Any]], phase: str) -> None:
        """Send a held message's events, its ``phase`` now known."""
        held, self.held = self.held, None
        if held is None:
            return
        for event in held:
            item = event.get("item")
            if item is not None and item.get("type") == "message":
                item["phase"] = phase  # the done event's item is the one in ``items`` too
            out.append(event)

    # -- events --------------------------------------------------------------------------------
    def _number(self) -> int:
        """The next event's ``sequence_number``."""
        number = self.sequence
        self.sequence = number + 1
        return number

    def _event(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "response": response, "sequence_number": self._number()}

    def _put(self, out: list[dict[str, Any]], event: dict[str, Any], message: bool) -> None:
        """A message's event is held while the message waits for its phase."""
        (self.held if message and self.held is not None else out).append(event)


def sse_named(batch: list[Any], encode: Callable[[Any], bytes]) -> bytes:
    """Events as ``event: <type>`` and ``data: <json>`` lines (SGLang's Responses stream)."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (e["type"].encode(), encode(e)) for e in batch if e
    )


def _response(
    options: Mapping[str, Any],
    output: list[dict[str, Any]],
    finish: Any,
    usage: dict[str, Any] | None,
    *,
    status: str | None = None,
) -> dict[str, Any]:
    echo = options["response"]
    error = incomplete = None
    if status is None:
        kind = finish.get("type") if isinstance(finish, Mapping) else None
        status = "completed"
        if kind == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif kind in ("abort", "error"):
            message = finish.get("message") or "Generation aborted"
            status, error = "failed", {"code": "server_error", "message": message}
    text = echo["text"]
    if text is None and output and all(item["type"] == "message" for item in output):
        text = {"format": {"type": "text"}}
    return {
        "id": echo["id"],
        "object": "response",
        "created_at": int(time.time()),
        "model": echo["model"],
        "output": output,
        "status": status,
        "usage": usage,
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "tool_choice": echo["tool_choice"],
        "tools": echo["tools"],
        "error": error,
        "incomplete_details": incomplete,
        "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"],
        "previous_response_id": echo["previous_response_id"],
        "reasoning": echo["reasoning"],
        "store": echo["store"],
        "temperature": echo["temperature"],
        "text": text,
        "top_p": echo["top_p"],
        "truncation": echo["truncation"],
        "user": echo["user"],
        "metadata": echo["metadata"],
    }


def _usage_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    return _usage(
        meta.get("prompt_tokens", 0),
        meta.get("completion_tokens", 0),
        meta.get("cached_tokens", 0),
        meta.get("reasoning_tokens", 0),
    )


def _usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _reasoning_item(rid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": rid, "summary": [], "type": "reasoning", "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def _message_item(
    rid: str, text: str | None, phase: str, logprobs: Any, status: str = "completed"
) -> dict[str, Any]:
    content = (
        []
        if text is None
        else [{"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}]
    )
    return {"id": rid, "content": content, "role": "assistant", "status": status,
            "type": "message", "phase": phase}  # fmt: skip


def _call_item(
    rid: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call",
            "id": rid, "status": status}  # fmt: skip


def _text_logprobs(chat_logprobs: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The chat answer's ``logprobs.content`` as the Responses API's (``_build_output_text_
    logprobs``: each token's text, its text's bytes (SGLang reads this route's log-probs
    without the tokenizer: a part of a character is U+FFFD's bytes here) and log-prob, its
    alternatives by distinct text, a text that comes twice with the later one's log-prob)."""
    out = []
    for entry in (chat_logprobs or {}).get("content") or ():
        tops: dict[str, float] = {}
        for top in entry.get("top_logprobs") or ():
            tops[top["token"]] = top["logprob"]
        out.append(
            {
                "token": entry["token"],
                "bytes": list(entry["token"].encode()),
                "logprob": entry["logprob"],
                "top_logprobs": [
                    {"token": text, "bytes": list(text.encode()), "logprob": logprob}
                    for text, logprob in tops.items()
                ],
            }
        )
    return out


# ---- the request ----------------------------------------------------------------------------


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise OpenAIError("tools: Input should be a valid list", "tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise OpenAIError(f"tools[{i}].type: Field required", "tools")
        if tool["type"] == "function" and not tool.get("name"):
            raise OpenAIError("Function tools must include a name.", "tools")
    return raw


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = {"name": tool["name"], "description": tool.get("description")}
    fn["parameters"] = tool.get("parameters")
    fn["strict"] = bool(tool.get("strict", False))
    return {"type": "function", "function": fn}


def _forced_name(raw: dict[str, Any]) -> str | None:
    """The function a ``tool_choice`` object forces (its ``name`` or ``function.name``, for
    ``type`` ``function`` or ``custom``), else None: ``effective_tool_choice`` makes that
    ``auto`` (a built-in tool type cannot be forced)."""
    fn = raw.get("function")
    name = raw.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
    if raw.get("type") in ("function", "custom") and isinstance(name, str) and name:
        return name
    return None


def _tool_choice(raw: Any, functions: list[dict[str, Any]]) -> Any:
    """The chat ``tool_choice`` of the request's (``effective_tool_choice``)."""
    if isinstance(raw, dict):
        name = _forced_name(raw)
        if name is None:
            return "auto"
        if not any(t["name"] == name for t in functions):
            raise OpenAIError(f"Tool '{name}' is not declared in tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    if raw == "required" and not functions:
        raise OpenAIError(
            'tool_choice="required" requires at least one tool with type="function" or '
            'type="custom"; other built-in tool types cannot be forced.'
        )
    if raw not in ("auto", "required", "none"):
        raise OpenAIError("tool_choice: 'auto', 'required', 'none' or a named tool", "tool_choice")
    return raw if functions else "none"


def _echo_choice(raw: Any) -> Any:
    if isinstance(raw, dict):
        name = _forced_name(raw)
        return "auto" if name is None else {"type": raw["type"], "name": name}
    return raw


# the chat request's fields that come from the Responses request's, by their names there
_FIELDS = {
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "max_tokens": "max_output_tokens",
}


def _as_responses(exc: OpenAIError) -> OpenAIError:
    """A refusal of the chat request made of a Responses one, in the Responses request's
    terms (``messages[2].content``: the third chat message made of ``instructions`` and
    ``input``)."""
    message = str(exc)
    for chat, ours in _FIELDS.items():
        if message.startswith(chat):
            message = f"{ours}: {message}" if chat == "messages" else ours + message[len(chat) :]
            param = ours.split(".")[0]
            return OpenAIError(message, param, status=exc.status)
    return exc


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as the chat ``response_format`` (``json_schema``, ``json_object``)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    raise OpenAIError("text.format.type: 'text', 'json_schema' or 'json_object'", "text")


def _items(raw: Any) -> list[Any]:
    """``input`` as a list of items (a string: one user message)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if isinstance(raw, list):
        return list(raw)
    raise OpenAIError("input: Input should be a valid string or list", "input")


def _without_none(value: Any) -> Any:
    """``value`` with the null fields of its objects left out (pydantic's ``exclude_none``)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _messages(raw: Any, instructions: Any) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (``_construct_input_messages``)."""
    items = _items(raw)
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise OpenAIError(f"input[{i}]: Input should be a valid dictionary", "input")
        message = _message(item)
        if message is not None:
            messages.append(message)
    return _merged(messages)


def _message(item: dict[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type")
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}
        call_id = item.get("call_id") or item.get("id")
        return {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        parts = item.get("summary") or item.get("content") or []
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return {"role": "assistant", "reasoning_content": "\n".join(texts)} if texts else None
    if kind not in (None, "message"):
        raise OpenAIError(f"Unsupported Responses API input item type: {kind!r} None", "input")
    message = {k: v for k, v in item.items() if k not in ("id", "status", "type") and v is not None}
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [
            {"type": "text", "text": p.get("text")}
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
            else p
            for p in content
        ]
    if message.get("role") == "developer":
        message["role"] = "system"
        message["content"] = _developer(message.get("content"))
    return message


def _developer(content: Any) -> Any:
    prefix = "Developer instructions:\n"
    if isinstance(content, str):
        return prefix + content
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                content = list(content)
                content[i] = {**part, "text": prefix + part["text"]}
                break
    return content


def _arguments(raw: Any) -> str:
    """A replayed call's arguments as the template takes them: a JSON object's text, else
    ``{}``."""
    if isinstance(raw, dict):
        return json.dumps(raw, separators=(",", ":"))
    if isinstance(raw, str):
        try:
            if isinstance(json.loads(raw), dict):
                return raw
        except ValueError:
            pass
    return "{}"


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent assistant messages as one, where their ``phase`` agrees or the first is its
    reasoning alone (``_merge_consecutive_assistant_messages``)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        last = out[-1] if out else None
        if (
            last is None
            or last.get("role") != "assistant"
            or message.get("role") != "assistant"
            or not (
                last.get("phase") == message.get("phase")
                or set(last) == {"role", "reasoning_content"}
            )
        ):
            out.append(dict(message))
            continue
        for key, value in message.items():
            if key == "role":
                continue
            if key not in last:
                last[key] = value
            elif key == "content":
                a, b = last["content"], value
                if isinstance(a, str) and isinstance(b, str):
                    last["content"] = f"{a}\n\n{b}"
                else:
                    last["content"] = _parts(a) + _parts(b)
            elif key == "tool_calls":
                last["tool_calls"] = list(last["tool_calls"]) + list(value)
            elif key == "reasoning_content":
                last["reasoning_content"] = f"{last['reasoning_content']}\n{value}"
            else:
                last[key] = value
    return out


def _parts(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or [])
