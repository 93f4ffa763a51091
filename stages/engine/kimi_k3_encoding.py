"""Kimi K3's chat encoding: what its template gets, as SGLang 0.5.23 hands it over.

SGLang serves a model whose chat encoding spec is ``kimi_k3`` (``openai_chat._encoding``) by a
path of its own (``serving_chat._encode_messages``), not the generic template path:

- messages (``k3_messages``): ``msg.model_dump()`` whole, its nulls kept (the generic path drops
  them; transformers' ``apply_chat_template`` then drops a message's top-level nulls on both);
  an assistant's text arguments that are no JSON object kept as text
  (``normalize_assistant_tool_call_arguments(strict=False)``); then
  ``_prepare_kimi_k3_messages``: a null content ``""``, a content list its text parts alone,
  ``<|kimi_image_placeholder|>`` spaced out (``neutralize_kimi_k3_image_placeholder``) in
  texts and in an assistant's reasoning and call arguments, a system or developer message's
  tools dumped as set (``k3_tool``), ``developer`` made ``system``;
- tools (``k3_tools``): every request tool, whatever ``tool_choice`` says, as
  ``tool.model_dump(exclude_unset=True, by_alias=True)``;
- kwargs (``k3_kwargs``): ``chat_template_kwargs`` less ``tokenize``, ``return_dict``,
  ``image_prompts``; ``thinking_effort`` from a ``low``/``high``/``max`` effort (another
  logged and left out); ``tool_choice`` ``required``/``none`` where there are tools;
  ``response_format`` as set; no ``reasoning_effort`` and no thinking toggles;
- the generation prompt always, a continued final assistant message's text after it;
- usage's ``prompt_tokens`` less the three tokens of the assistant stub
  (``_reported_prompt_tokens``).

Image parts stay refused (``template_dump``'s 400): this engine serves text models. The chat
route (``openai_chat.chat_request``) renders what these give through the template as SGLang's
``apply_chat_template(tokenize=True)``, and holds a ``strict: false`` JSON schema to no grammar
(``unconstrained_format``).
``tests/stages/test_engine_kimi_k3_encoding.py`` holds these to SGLang's own functions.
"""

from __future__ import annotations

from typing import Any

import structlog

from stages.engine.template_dump import DumpError, lax_bool, template_message

__all__ = [
    "STUB_TOKENS",
    "k3_kwargs",
    "k3_messages",
    "k3_response_format",
    "k3_tool",
    "k3_tools",
    "neutralize",
    "reported_prompt_tokens",
    "unconstrained_format",
]

log = structlog.get_logger("stages.engine.kimi_k3_encoding")

PLACEHOLDER, SPACED = "<|kimi_image_placeholder|>", "<| kimi_image_placeholder |>"
# the assistant generation stub's tokens, not counted in usage (_KIMI_K3_GENERATION_STUB_TOKENS)
STUB_TOKENS = 3
_EFFORTS = ("low", "high", "max")
_FUNCTION = ("description", "name", "parameters", "strict", "defer_loading")
_GENERIC = ("tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix")
_DROPPED_KWARGS = ("tokenize", "return_dict", "image_prompts")


def neutralize(value: Any) -> Any:
    """``value`` with the image placeholder spaced out in every string inside it
    (``neutralize_kimi_k3_image_placeholder_value``)."""
    if isinstance(value, str):
        return value.replace(PLACEHOLDER, SPACED)
    if isinstance(value, list):
        return [neutralize(item) for item in value]
    if isinstance(value, dict):
        return {key: neutralize(item) for key, item in value.items()}
    return value


def k3_tool(raw: dict[str, Any]) -> dict[str, Any]:
    """``protocol.Tool(**raw).model_dump(exclude_unset=True, by_alias=True)``: the fields the
    client wrote (a null too), the function's in its order; a null ``strict`` or
    ``defer_loading`` left out of it; a tool's ``defer_loading`` copied into a function that
    has none (``_propagate_defer_loading``)."""
    fn = raw["function"]
    function = {key: fn[key] for key in fn if key in _FUNCTION}
    for key in ("strict", "defer_loading"):
        if key in function:
            function[key] = lax_bool(function[key])
    tool_defer = lax_bool(raw.get("defer_loading"))
    if tool_defer is not None and function.get("defer_loading") is None:
        function["defer_loading"] = tool_defer
    function = {k: v for k, v in function.items() if v is not None or k not in _FUNCTION[3:]}
    out: dict[str, Any] = {}
    if "type" in raw:
        out["type"] = raw["type"]
    out["function"] = function
    if "defer_loading" in raw:
        out["defer_loading"] = tool_defer
    return out


def k3_tools(raw_tools: Any) -> list[dict[str, Any]] | None:
    """The template's ``tools``: every request tool (``_encode_messages``' ``request_tools``)."""
    return [k3_tool(raw) for raw in raw_tools] if raw_tools else None


def k3_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as ``_encode_messages`` hands them to the template (before a
    continued final message is taken out); ``template_dump.DumpError`` for what SGLang
    refuses."""
    return [_message(raw, i) for i, raw in enumerate(messages)]


def _message(raw: Any, i: int) -> dict[str, Any]:
    checked = template_message(raw, i, "openai", strict=False)  # the model's checks, its dump
    role = checked["role"]
    content = _content(raw.get("content"))
    if role == "user":
        return {"role": role, "content": content}
    out = {"role": role, "content": content, **{key: checked.get(key) for key in _GENERIC}}
    if role == "assistant":
        out["reasoning_content"] = neutralize(out["reasoning_content"])
        for call in out["tool_calls"] or ():
            call["function"]["arguments"] = neutralize(call["function"]["arguments"])
    if role in ("system", "developer") and raw.get("tools"):
        out["tools"] = [k3_tool(tool) for tool in raw["tools"]]
    if role == "developer":
        out["role"] = "system"
    return out


def _content(content: Any) -> Any:
    """A message's content (``_prepare_kimi_k3_messages``): null ``""``, text spaced out, of a
    list its text parts alone (thinking and tool references dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return neutralize(content)
    return [
        {"type": "text", "text": neutralize(part["text"])}
        for part in content
        if part.get("type") == "text"
    ]


def effective_tools(body: dict[str, Any]) -> bool:
    """Whether the request has tools, its own or a root, system or developer message's
    (``_effective_tools``)."""
    if body.get("tools"):
        return True
    for message in body["messages"]:
        role = message.get("role")
        if isinstance(role, str) and role.lower() in ("root", "system", "developer"):
            if message.get("tools"):
                return True
    return False


def k3_kwargs(body: dict[str, Any], kwargs: dict[str, Any] | None, effort: Any) -> dict[str, Any]:
    """The template's kwargs (``_encode_messages``): ``kwargs`` (the request's
    ``chat_template_kwargs`` over the server's defaults, its ``reasoning_effort`` moved to
    ``effort``) less what the encoder sets itself, then the effort, tool choice and response
    format, each under the request's own kwarg; DumpError for a ``tools`` kwarg."""
    out = {k: v for k, v in (kwargs or {}).items() if k not in _DROPPED_KWARGS}
    if "tools" in out:  # apply_chat_template's TypeError
        raise DumpError(
            "the chat template refused the messages: apply_chat_template() got multiple "
            "values for keyword argument 'tools'",
            "chat_template_kwargs",
        )
    if effort in _EFFORTS and "thinking_effort" not in out:
        out["thinking_effort"] = effort
    elif effort not in (None, "none", *_EFFORTS):
        log.warning("kimi_k3_effort_unsupported", reasoning_effort=effort)
    choice = body.get("tool_choice")
    if choice in ("required", "none") and effective_tools(body):
        out.setdefault("tool_choice", choice)
    fmt = body.get("response_format")
    if fmt is not None:
        out.setdefault("response_format", k3_response_format(fmt))
    return out


def k3_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``request.response_format.model_dump(exclude_unset=True, by_alias=True)``: the fields
    the client wrote, in the model's order (``ResponseFormat``: ``type``, ``json_schema`` of
    ``name``, ``description``, ``schema``, ``strict``); a structural tag as it came."""
    if fmt.get("type") == "structural_tag":
        return fmt
    out = {"type": fmt["type"]}
    if "json_schema" in fmt:
        spec = fmt["json_schema"]
        fields = ("name", "description", "schema", "strict")
        out["json_schema"] = spec if spec is None else {k: spec[k] for k in fields if k in spec}
    return out


def unconstrained_format(fmt: Any) -> bool:
    """A ``json_schema`` response format with ``strict: false``: the encoding hands it to the
    model and SGLang holds the answer to no grammar (``to_sampling_params``'
    ``renderer_handles_response_format``)."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return False
    spec = fmt.get("json_schema")
    return isinstance(spec, dict) and spec.get("strict") is False


def reported_prompt_tokens(tokens: int) -> int:
    """Usage's ``prompt_tokens`` of a prompt of ``tokens`` (``_reported_prompt_tokens``)."""
    return max(0, tokens - STUB_TOKENS)
