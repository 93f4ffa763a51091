"""SGLang's Anthropic-compatible ``/v1/messages`` (and ``/v1/messages/count_tokens``) on the
built-in engine, built on its ``/v1/chat/completions`` as SGLang 0.5.23 builds it
(``srt/entrypoints/anthropic/serving.py``, ``protocol.py``): agents written for the
``anthropic`` client (``base_url`` the engine's, or the agent proxy's) sample from it.

- the request: ``model``, ``messages`` and ``max_tokens`` required (``max_tokens`` positive);
  ``system`` (a string, or text blocks) first as one system message, and ``system`` messages
  among ``messages`` merged into it; a message's blocks: ``text`` parts, ``tool_use`` as the
  assistant's tool calls (``input`` as JSON arguments), a user's ``tool_result`` as a ``tool``
  message between the text before and after it (its text, or its text blocks as parts;
  ``is_error`` unused, as there), ``thinking`` in an assistant message wrapped
  in ``--reasoning-parser``'s own tags (``start``, its label, the reasoning, a newline, ``end``)
  as the message's first text, as SGLang 0.5.23 puts history its template has no channel for
  (``wrap_reasoning_history``), the blocks joined by newlines; without the flag dropped (logged);
  with a chat encoding of SGLang's (``dsv32``...) the message's ``reasoning_content``;
  ``redacted_thinking``: 400), ``image``,
  ``search_result``, ``tool_reference`` and other blocks a text model cannot take: dropped or
  refused as SGLang does for a text-only model; ``tools`` (custom: ``name``, ``description``,
  ``input_schema``, ``strict``; server tools such as ``web_search_20250305`` accepted and not
  used), ``tool_choice`` (``auto``, ``any`` as ``required``, ``tool`` a named function,
  ``none``; ``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``, ``top_p``,
  ``top_k``, ``thinking`` (``enabled``/``adaptive`` and ``disabled`` switch the template's
  thinking; without ``--reasoning-parser`` enabling it is refused in SGLang's words),
  ``output_config`` (``effort`` as ``reasoning_effort``, ``format`` a JSON schema);
  ``metadata``, ``betas`` and keys it does not know are ignored;
- the answer: ``{id: "msg_<hex>", type: "message", role: "assistant", content, model,
  stop_reason, usage}``, its blocks ``thinking``, ``text``, then a ``tool_use`` per call;
  ``stop_reason`` ``end_turn`` (a stop string too: SGLang never says ``stop_sequence``),
  ``max_tokens`` or ``tool_use``; fields that are null left out, as SGLang's
  ``exclude_none`` leaves them;
- ``stream``: ``event: <type>`` / ``data: {json}`` events, ``message_start`` (with the first
  content), a ``content_block_start``, ``content_block_delta``\\s (``text_delta``,
  ``thinking_delta``, ``input_json_delta``) and ``content_block_stop`` per block, indexes
  from 0, ``message_delta`` (``stop_reason``, ``usage.output_tokens``), ``message_stop``; no
  ``ping``, no ``[DONE]``;
- errors: ``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``
  (the type by status), a field's error as ``field: what`` (SGLang's digest of pydantic's).

This module knows nothing of HTTP; ``openai_api.OpenAIRoutes`` serves it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import structlog

from stages.engine.chunk_stream import mapped
from stages.engine.openai_api import OpenAIError, checked_body, new_id
from stages.engine.openai_chat import ChatChunks, ChatSettings, chat_request, chat_response
from stages.engine.reasoning import ThinkFormat
from stages.engine.request_fields import checked_count_tokens, checked_messages

log = structlog.get_logger("inflight.engine.messages")

__all__ = [
    "MessageEvents",
    "count_tokens",
    "message_events",
    "messages_request",
    "messages_response",
]

ERROR_TYPES = {  # serving.ERROR_TYPE_MAP
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "request_timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_BLOCKS = {"text", "image", "tool_use", "tool_result", "tool_reference", "search_result"}
_BLOCKS |= {"thinking", "redacted_thinking"}
_REQUIRED = {"text": ("text",), "tool_use": ("id", "name"), "thinking": ("thinking",)}  # str fields
_SERVER_TOOLS = ("web_search_", "computer_", "bash_", "text_editor_")


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """Anthropic's error envelope (``_error_response``)."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def messages_request(
    body: Any, settings: ChatSettings, context_length: int, *, counting: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, what the answer needs)`` of a ``/v1/messages`` body, through
    ``chat_request``; OpenAIError (a 400) where SGLang refuses it. ``counting``: a
    ``count_tokens`` body (no ``max_tokens``)."""
    body = checked_body(checked_count_tokens if counting else checked_messages, body)
    _check(body)
    chat_body: dict[str, Any] = {
        "model": body["model"],
        "messages": _messages(
            body,
            settings.reasoning.fmt if settings.reasoning else None,
            # a chat encoding of SGLang's renders reasoning history itself
            # (chat_encoding.spec_owns_reasoning_history)
            native=settings.encoding is not None,
            vision=settings.vision,
        ),
        "max_tokens": 1 if counting else body["max_tokens"],
        "stream": bool(body.get("stream")) and not counting,
    }
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat_body[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat_body["stop"] = body["stop_sequences"]
    _thinking(body.get("thinking"), settings, chat_body)
    _output_config(body.get("output_config"), chat_body)
    _tools(body, chat_body)
    native, options = chat_request(chat_body, settings, context_length)
    options["message"] = {"model": body["model"]}
    return native, options


def count_tokens(body: Any, settings: ChatSettings, context_length: int) -> dict[str, int]:
    """``/v1/messages/count_tokens``: the rendered prompt's tokens (template, tools and the
    generation prompt; nothing taken off for the prefix cache)."""
    native, _ = messages_request(body, settings, context_length, counting=True)
    return {"input_tokens": len(native["input_ids"])}


def messages_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict:
    """The ``message`` of a finished request (``_convert_response``; its first sample)."""
    chat = chat_response(results, options)
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"]})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn)}
        )
    usage = chat["usage"]
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": options["message"]["model"],
        "stop_reason": _STOP_REASONS.get(choice["finish_reason"] or "stop", "end_turn"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
        },
    }


def message_events(
    batches: AsyncIterator[list[Any]], options: Mapping[str, Any]
) -> AsyncIterator[list[dict[str, Any]]]:
    """The events of a streamed request (``MessageEvents`` of each batch)."""
    return mapped(batches, MessageEvents(options))


class MessageEvents:
    """``_generate_stream``'s events, batch by batch (a ``chunk_stream.Transform`` over the
    request's sample: ``ChatChunks`` reads its reasoning and tool calls, this lays them out
    as content blocks)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = options
        self.chat = ChatChunks({**options, "include_usage": False}, error_events=True)
        self.id = new_id("msg")
        self.started = False
        self.index = 0  # the open (or next) block's index
        self.open: str | None = None  # the open block's type
        self.finish: str | None = None
        self.ended = False  # the chat stream's error event met: the stream ends there

    def __call__(self, batch: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for chunk in self.chat(batch):
            if "error" in chunk:  # a sample aborted with an error status
                self._fail(out, chunk["error"])
                break
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if choice["finish_reason"] is not None:
                self.finish = choice["finish_reason"]
            payload = (
                delta.get("reasoning_content") or delta.get("tool_calls") or delta.get("content")
            )
            if (payload or self.finish is not None) and not self.started:
                self._start(out)
            if delta.get("reasoning_content"):
                self._block(out, "thinking", {"type": "thinking", "thinking": ""})
                out.append(
                    self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                )
            for call in delta.get("tool_calls") or ():
                fn = call["function"]
                if fn.get("name"):
                    self._close(out)
                    block = {"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                             "name": fn["name"], "input": {}}  # fmt: skip
                    self._block(out, "tool_use", block)
                if fn.get("arguments") and self.open == "tool_use":
                    out.append(
                        self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                    )
            if delta.get("content"):
                self._block(out, "text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        return out

    def end(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.ended:  # its events closed the message
            return out
        if not self.started:
            self._start(out)
        self._close(out)
        reason = _STOP_REASONS.get(self.finish or "stop", "end_turn")
        completion = self.chat.completion_tokens.get(0, 0)
        out.append({"type": "message_delta", "delta": {"stop_reason": reason},
                    "usage": {"output_tokens": completion}})  # fmt: skip
        out.append({"type": "message_stop"})
        return out

    def _fail(self, out: list[dict[str, Any]], error: Mapping[str, Any]) -> None:
        """The chat stream's error event as SGLang's ``_flush_on_error`` of its
        ``_parse_upstream_error`` ends the message: ``message_start`` if not sent (its usage
        zero), the open block closed, an ``error`` event (its type by the status), then
        ``message_stop``."""
        if not self.started:
            self._start(out, input_tokens=0)
        self._close(out)
        code = error.get("code")
        out.append(error_body(error.get("message") or "Upstream error", code))
        out.append({"type": "message_stop"})
        self.ended = True

    def _start(self, out: list[dict[str, Any]], input_tokens: int | None = None) -> None:
        self.started = True
        if input_tokens is None:
            input_tokens = self.chat.prompt_tokens.get(0, 0)
        usage = {"input_tokens": input_tokens, "output_tokens": 0}
        message = {"id": self.id, "type": "message", "role": "assistant", "content": [],
                   "model": self.options["message"]["model"], "usage": usage}  # fmt: skip
        out.append({"type": "message_start", "message": message})

    def _block(self, out: list[dict[str, Any]], kind: str, block: dict[str, Any]) -> None:
        """Open a block of ``kind`` unless one is open (a tool call's always opens anew)."""
        if self.open == kind and kind != "tool_use":
            return
        self._close(out)
        self.open = kind
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self, out: list[dict[str, Any]]) -> None:
        if self.open is None:
            return
        out.append({"type": "content_block_stop", "index": self.index})
        self.open = None
        self.index += 1

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


# ---- the request ----------------------------------------------------------------------------


def _check(body: dict[str, Any]) -> None:
    """What ``AnthropicMessagesRequest``'s validation refuses in the messages and ``system``
    (``request_fields`` checks the other fields' types first), as SGLang's digest of it."""
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict):
            raise OpenAIError(f"messages.{i}: Input should be a valid dictionary", "messages")
        if message.get("role") not in ("user", "assistant", "system"):
            raise OpenAIError(
                f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'", "messages"
            )
        _check_content(message.get("content"), f"messages.{i}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_content(system, "system")


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise OpenAIError(f"{where}: Input should be a valid string or a list of blocks", where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCKS:
            raise OpenAIError(
                f"{where}.{j}: Input tag '{kind}' found using 'type' does not match any of the "
                f"expected tags: {', '.join(repr(b) for b in sorted(_BLOCKS))}",
                where,
            )
        for field in _REQUIRED.get(kind, ()):
            if not isinstance(block.get(field), str):
                raise OpenAIError(f"{where}.{j}.{kind}.{field}: Field required", where)
        if kind == "tool_use" and not isinstance(block.get("input", {}), dict):
            raise OpenAIError(
                f"{where}.{j}.tool_use.input: Input should be a valid dictionary", where
            )


def _messages(
    body: dict[str, Any],
    history: ThinkFormat | None = None,
    *,
    native: bool = False,
    vision: bool = False,
) -> list[dict[str, Any]]:
    """The chat messages (``_convert_to_chat_completion_request``): one system message first
    (``system`` and the ``system`` messages, merged), then each message's (``history``: the
    reasoning parser's format, whose tags wrap an assistant's thinking; None: none; ``native``:
    the thinking goes as the message's ``reasoning_content`` instead; ``vision``: a vision
    model's engine, whose image blocks go as ``image_url`` parts, else refused)."""
    system: list[str] = []
    raw = body.get("system")
    if isinstance(raw, str):
        if raw.strip():
            system.append(raw)
    elif isinstance(raw, list):
        system += [b["text"] for b in raw if b.get("type") == "text" and b.get("text")]
    out: list[dict[str, Any]] = []
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":  # merged into the leading one (_extract_system_text)
            text = _system_text(content)
            if text:
                system.append(text)
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        out += _blocks(role, content, history, native, vision)
    return ([{"role": "system", "content": "\n".join(system)}] if system else []) + out


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content.strip() or None
    texts = [b["text"].strip() for b in content if b.get("type") == "text" and b["text"].strip()]
    return "\n".join(texts) or None


def _blocks(
    role: str,
    content: list[dict[str, Any]],
    history: ThinkFormat | None,
    native: bool,
    vision: bool = False,
) -> list[dict[str, Any]]:
    """One message's blocks as chat messages: a user's tool results as ``tool`` messages
    between the text before and after them, an assistant's thinking first, in ``history``'s
    tags."""
    out: list[dict[str, Any]] = []
    message: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    if role == "assistant":
        if any(b["type"] == "redacted_thinking" for b in content):
            raise OpenAIError("Anthropic redacted_thinking history is not supported", "messages")
        thought = "\n".join(
            b["thinking"] for b in content if b["type"] == "thinking" and b["thinking"]
        )
        if thought and native:
            message["reasoning_content"] = thought
        elif thought and history is None:  # no detector to wrap it (SGLang logs and drops it)
            log.warning("anthropic_thinking_history_dropped", why="no --reasoning-parser")
        elif thought:  # serving_chat.wrap_reasoning_history
            wrapped = f"{history.opening}{thought}\n{history.end}"
            parts.append({"type": "text", "text": wrapped})
    for block in content:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            if not vision:
                raise OpenAIError(
                    "Model only supports text input; received unsupported content type "
                    "'image_url'.",
                    "messages",
                )
            part = _image_part(block["source"])
            if part is not None:
                parts.append(part)
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append({
                "id": block["id"] or new_id("call"),
                "type": "function",
                "function": {"name": block["name"], "arguments": arguments},
            })  # fmt: skip
        elif kind == "tool_result":
            call_id = block.get("tool_use_id") or block.get("id") or ""
            result = _tool_result(block.get("content"))
            if role == "user":
                if parts:  # the text before it goes first
                    out.append({"role": "user", "content": _joined(parts)})
                    parts = []
                out.append({"role": "tool", "tool_call_id": call_id, "content": result})
            else:
                text = result if isinstance(result, str) else "\n".join(p["text"] for p in result)
                parts.append({"type": "text", "text": "Tool result: " + text})
        # search_result, tool_reference, thinking (read above) and the rest: not for the chat
    if calls:
        message["tool_calls"] = calls
    if parts:
        message["content"] = _joined(parts)
        out.append(message)
    elif calls:
        out.append(message)
    elif role != "user":
        message["content"] = ""
        out.append(message)
    return out


def _image_part(source: Any) -> dict[str, Any] | None:
    """An image block's ``source`` as a chat ``image_url`` part (``_convert_anthropic_image_
    source_to_openai_part``: base64 data as a ``data:`` URI of its media type, PNG by default,
    or its ``url``); None for one without data or URL."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        data = source.get("data", "")
        media = source.get("media_type", "image/png")
        return (
            {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
            if data
            else None
        )
    url = source.get("url")
    return {"type": "image_url", "image_url": {"url": url}} if url else None


def _tool_result(content: Any) -> Any:
    """A tool result's content: its text, or its text blocks as parts (``_convert_tool_result_
    content``, for text)."""
    if not isinstance(content, list):
        return str(content) if content else ""
    parts = [{"type": "text", "text": b["text"]} for b in content
             if isinstance(b, dict) and b.get("type") == "text" and b.get("text")]  # fmt: skip
    if not parts:
        return ""
    return _joined(parts)


def _joined(parts: list[dict[str, Any]]) -> Any:
    """One text part as a string, else the list (``_emit_user_message``)."""
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _thinking(raw: Any, settings: ChatSettings, chat_body: dict[str, Any]) -> None:
    """``thinking`` as the template's switch (``apply_reasoning_enabled``)."""
    if raw is None:
        return
    if not isinstance(raw, dict) or raw.get("type") not in ("enabled", "disabled", "adaptive"):
        raise OpenAIError(
            "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'", "thinking"
        )
    kind, budget = raw["type"], raw.get("budget_tokens")
    if kind == "enabled" and budget is None:
        raise OpenAIError(
            "thinking: Value error, thinking.budget_tokens is required when thinking.type is "
            "'enabled'",
            "thinking",
        )
    if kind == "enabled" and (not isinstance(budget, int) or budget < 1024):
        raise OpenAIError(
            f"thinking: Value error, thinking.budget_tokens must be >= 1024 (got {budget})",
            "thinking",
        )
    if kind != "enabled" and budget is not None:
        raise OpenAIError(
            f"thinking: Value error, thinking.budget_tokens is not allowed when thinking.type "
            f"is '{kind}'",
            "thinking",
        )
    if budget is not None:  # SGLang 0.5.23 takes it and says so, enforcing nothing
        log.warning(
            "thinking_budget_not_enforced",
            budget_tokens=budget,
            why="Anthropic's thinking.budget_tokens is accepted as SGLang accepts it; no chat "
            "route enforces a budget (a /generate request's max_thinking_tokens does, with "
            "--enable-strict-thinking)",
        )
    enabled = kind != "disabled"
    reasoning = settings.reasoning
    if reasoning is None:
        if enabled:
            raise OpenAIError(
                "Anthropic thinking is not supported for models without a reasoning parser",
                "thinking",
            )
        return
    toggle = reasoning.toggle
    if reasoning.fmt.inkling and (not enabled or toggle is None):
        if not enabled:  # effort-conditioned: "none" its off switch
            chat_body["reasoning_effort"] = "none"
        return  # on, without the template's switch: its detector's "always"
    if reasoning.always or (toggle is not None and toggle.special == "always"):
        if not enabled:
            raise OpenAIError(
                f"Reasoning parser '{reasoning.name}' is always-on and cannot be disabled via "
                "Anthropic thinking",
                "thinking",
            )
        return
    param = toggle.param if toggle is not None else None
    if param is None:
        default = reasoning.fmt.default or ""
        param = default.removeprefix("explicit_") if "thinking" in default else None
    if param is None:
        if enabled:
            raise OpenAIError(
                f"Anthropic thinking is not supported for reasoning parser '{reasoning.name}'",
                "thinking",
            )
        return
    chat_body["chat_template_kwargs"] = {param: enabled}


def _output_config(raw: Any, chat_body: dict[str, Any]) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise OpenAIError("output_config: Input should be a valid dictionary", "output_config")
    fmt = raw.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise OpenAIError(
                "output_config.format.type: Input should be 'json_schema'", "output_config"
            )
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError("output_config.format.schema: Field required", "output_config")
        chat_body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": fmt["schema"], "strict": True},
        }
    effort = raw.get("effort")
    if effort is not None:
        chat_body["reasoning_effort"] = "max" if effort == "xhigh" else effort


def _tools(body: dict[str, Any], chat_body: dict[str, Any]) -> None:
    """Custom tools as the chat's functions (server tools accepted, not used) and
    ``tool_choice`` as the chat's."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise OpenAIError("tools: Input should be a valid list", "tools")
    functions = []
    for i, tool in enumerate(raw or ()):
        if not isinstance(tool, dict):
            raise OpenAIError(f"tools.{i}: Input should be a valid dictionary", "tools")
        kind = tool.get("type")
        if isinstance(kind, str) and kind.startswith(_SERVER_TOOLS):
            continue  # SGLang: "Skipping built-in Anthropic server tool"
        if kind not in (None, "custom"):
            raise OpenAIError(f"tools.{i}.custom.type: Input should be 'custom'", "tools")
        if not isinstance(tool.get("name"), str):
            raise OpenAIError(f"tools.{i}.custom.name: Field required", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise OpenAIError(f"tools.{i}.custom.input_schema: Field required", "tools")
        # its validator adds the type last (AnthropicCustomTool._ensure_object_schema)
        schema = schema if "type" in schema else {**schema, "type": "object"}
        function = {
            "type": "function",
            "function": {"name": tool["name"], "description": tool.get("description") or "",
                         "parameters": schema, "strict": bool(tool.get("strict", False))},
        }  # fmt: skip
        if tool.get("defer_loading") is not None:  # the chat tool's (serving.py:676)
            function["defer_loading"] = tool["defer_loading"]
        functions.append(function)
    if functions:
        chat_body["tools"] = functions
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise OpenAIError(
            "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice"
        )
    kind = choice["type"]
    chat_body["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    if kind == "none":
        chat_body["tool_choice"] = "none"
    elif functions:
        if kind == "tool":
            name = choice.get("name")
            if name not in {f["function"]["name"] for f in functions}:
                raise OpenAIError(
                    f"tool_choice references tool {name!r} but it is not in the forwarded tools "
                    "list (server-side Anthropic tools cannot be selected)",
                    "tool_choice",
                )
            chat_body["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            chat_body["tool_choice"] = "required" if kind == "any" else "auto"
    elif kind in ("any", "tool"):
        raise OpenAIError(
            f"tool_choice={kind!r} requires at least one custom tool; all supplied tools were "
            "server-side Anthropic built-ins which the OpenAI-compatible backend cannot invoke",
            "tool_choice",
        )


# ---- the answer -----------------------------------------------------------------------------


def _input(fn: Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments as its ``input`` (``{}`` when they are not a JSON object)."""
    try:
        value = json.loads(fn.get("arguments") or "")
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
