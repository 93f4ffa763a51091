"""A chat request's messages and tools as SGLang 0.5.23 hands them to a chat template.

SGLang validates a chat request with pydantic (``entrypoints/openai/protocol.py``) and renders
the template from the models' dumps (``serving_chat._process_messages``), so a template sees
what those dumps hold, not what the client wrote; a template that writes a tool or a message
whole (Qwen's ``{{ tool | tojson }}``) writes it so.

Tools (``template_tool``: ``[tool.model_dump() for tool in request.tools]``):

- the tool: ``type`` (``"function"`` when left out), ``function``, then ``defer_loading``, null
  when the client left it out (``Tool`` has no serializer of its own);
- its ``function`` (``Function._serialize``): the fields the client wrote, in its order, then
  the others in the model's order (``description``, ``name``, ``parameters``), a missing one
  null; ``strict`` and ``defer_loading`` only where they are not null (a tool's
  ``defer_loading`` moved into its function's where that one has none,
  ``Tool._propagate_defer_loading``); keys that are no field of ``Function`` dropped;
- ``strict`` and ``defer_loading`` read as pydantic reads an optional bool (``"yes"``, ``1``,
  ``"off"`` ...; anything else refused).

Messages (``template_message``: ``msg.model_dump()``, then ``normalize_assistant_tool_call_
arguments``, a null ``content`` made ``""``, ``process_content_for_template_format`` and
``normalize_tool_content``):

- a ``user`` message is its ``role`` and ``content`` (``ChatCompletionMessageUserParam``: a
  ``name`` or any other key is dropped; its content is required); any other role
  (``ChatCompletionMessageGenericParam``, the role's case ignored) has ``role``, ``content``,
  ``tool_call_id``, ``name``, ``phase``, ``reasoning_content``, ``tool_calls``, ``tools``,
  ``prefix``, in that order, those that are null left out (``content``: ``""``), other keys
  dropped;
- ``tool_calls``: each ``{id, index, type: "function", function: {name, arguments}}`` (nulls
  inside kept); an assistant's ``arguments`` given as text are parsed as JSON, which must be an
  object (SGLang's 400s otherwise); ``tools``: as above;
- content parts (``process_content_for_template_format``): for a template that iterates over
  a message's content (``content_format``: ``"openai"``, as
  ``detect_jinja_template_content_format`` decides) the list stays, its text parts as ``{type:
  "text", text}``, ``tool_reference`` blocks as they are; else (``"string"``) the text parts
  joined with a space; a ``tool`` message's list of text parts is joined in both
  (``normalize_tool_content``); ``thinking`` parts (an assistant's only) are dropped, as
  SGLang drops them there. Media parts are refused: this engine serves text models.

This module knows nothing of HTTP: ``DumpError`` says what and where, the route answers 400.
``tests/stages/test_engine_sglang_template_dump.py`` holds both dumps to SGLang's own models
where they import.
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
import orjson
from pydantic import TypeAdapter, ValidationError

__all__ = [
    "BOOL_FIELDS",
    "DumpError",
    "content_format",
    "lax_bool",
    "template_message",
    "template_tool",
]

# the fields of SGLang's Function, in its order; the bool ones are left out of its dump when null
_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
BOOL_FIELDS = ("strict", "defer_loading")
_BOOL = TypeAdapter(bool | None)
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
# ChatCompletionMessageGenericParam's fields after role and content, each with its type
_GENERIC = {
    "tool_call_id": TypeAdapter(str | None),
    "name": TypeAdapter(str | None),
    "phase": TypeAdapter(Literal["commentary", "final_answer"] | None),
    "reasoning_content": TypeAdapter(str | None),
}
_PREFIX = TypeAdapter(bool | None)
_CALL_ID, _CALL_INDEX = TypeAdapter(str | None), TypeAdapter(int | None)
_CALL_ARGUMENTS = TypeAdapter(str | dict[str, Any] | None)
_MEDIA = ("image_url", "video_url", "audio_url", "input_audio")
_THINKING_ROLE = "thinking content parts are only valid in assistant messages"  # SGLang's words
_THINKING_PAYLOAD = "thinking parts require exactly one of 'thinking' or 'text'"


class DumpError(ValueError):
    """What SGLang refuses in a message or tool, and the request field it is in."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


def lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic reads an ``Optional[bool]`` field; ValueError where it does not."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise ValueError("Input should be a valid boolean") from None


def template_tool(raw: dict[str, Any]) -> dict[str, Any]:
    """``protocol.Tool(**raw).model_dump()`` of a tool the chat route checked (``raw``: as the
    client sent it)."""
    fn = raw["function"]
    tool_defer = lax_bool(raw.get("defer_loading"))
    values = {key: fn.get(key) for key in _FIELDS}
    for key in BOOL_FIELDS:
        values[key] = lax_bool(values[key])
    if values["defer_loading"] is None:
        values["defer_loading"] = tool_defer
    dumped = {k: v for k, v in values.items() if v is not None or k not in BOOL_FIELDS}
    order = [key for key in fn if key in dumped]
    function = {key: dumped[key] for key in order}
    function.update((key, value) for key, value in dumped.items() if key not in function)
    return {"type": raw.get("type", "function"), "function": function, "defer_loading": tool_defer}


def content_format(template: str | None) -> str:
    """``"openai"`` for a template that iterates over a message's content (a content list
    stays a list), else ``"string"`` (``jinja_template_utils.detect_jinja_template_content_
    format``: any of ``image``, ``audio``, ``video``, ``vision`` in its text decides too; no
    template: ``"string"``)."""
    if not template:
        return "string"
    if any(word in template for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return "string"
    names = ("message", "msg", "m")
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, "content") for name in names):
            return "openai"
    return "string"


def _reads(node: Any, name: str, key: str) -> bool:
    """``node`` is ``name[key]`` or ``name.key``, through filters, tests and slices
    (``_is_var_or_elems_access``)."""
    nodes = jinja2.nodes
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        return _loads(node.node, name) and isinstance(arg, nodes.Const) and arg.value == key
    if isinstance(node, nodes.Getattr):
        return _loads(node.node, name) and node.attr == key
    return False


def _loads(node: Any, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def template_message(
    raw: Any, i: int, fmt: str, *, strict: bool = True, images: list[Any] | None = None
) -> dict[str, Any]:
    """The message ``raw`` (the ``i``-th) as SGLang hands it to a template whose content
    format is ``fmt``; DumpError for what SGLang refuses. ``strict``: an assistant's text
    arguments that are no JSON object refused (else kept as text: ``normalize_assistant_tool_
    call_arguments(strict=False)``, Kimi K3's encoding). ``images``: where a vision model's
    image parts go (their ``{"url"}``, each part then ``{"type": "image"}`` for the
    template, as ``process_content_for_template_format`` has them); None: refused."""
    where = f"messages[{i}]"
    role = raw.get("role") if isinstance(raw, dict) else None
    if role != "user" and not (isinstance(role, str) and role.lower() in _GENERIC_ROLES):
        roles = ", ".join(("system", "user", *_GENERIC_ROLES[1:]))
        raise DumpError(f"{where}.role: one of {roles} is required")
    content = raw.get("content")
    if role == "user":
        if content is None:
            raise DumpError(f"{where}.content: Field required")
        return {"role": role, "content": _content(content, role, fmt, where, images)}
    role = role.lower()  # (_normalize_role)
    out: dict[str, Any] = {"role": role, "content": _content(content, role, fmt, where, images)}
    for key, check in _GENERIC.items():
        out[key] = _checked(check, raw.get(key), f"{where}.{key}")
    calls = raw.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise DumpError(f"{where}.tool_calls: Input should be a valid list")
        calls = [_call(c, role, f"{where}.tool_calls[{j}]", strict) for j, c in enumerate(calls)]
    out["tool_calls"] = calls
    tools = raw.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise DumpError(f"{where}.tools: a list of {{type: function, function: {{name}}}}")
        tools = [template_tool(tool) for tool in tools]
    out["tools"] = tools
    out["prefix"] = _checked(_PREFIX, raw.get("prefix"), f"{where}.prefix")
    out = {key: value for key, value in out.items() if value is not None}
    if isinstance(content, list) and fmt == "openai":  # (process_content_for_template_format)
        out["content"] = out.pop("content")
    return out


def _checked(check: TypeAdapter, value: Any, where: str) -> Any:
    try:
        return check.validate_python(value)
    except ValidationError as exc:
        raise DumpError(f"{where}: {exc.errors()[0]['msg']}") from None


def _content(content: Any, role: str, fmt: str, where: str, images: list[Any] | None = None) -> Any:
    """A message's content for the template (None: ``""``); ``images``: see
    ``template_message``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DumpError(f"{where}.content: expected a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            parts.append({"type": "text", "text": _checked(_TEXT, part.get("text"), f"{at}.text")})
        elif kind in ("thinking", "reasoning"):  # ChatCompletionMessageContentThinkingPart
            if role != "assistant":
                raise DumpError(f"{at}: {_THINKING_ROLE}")
            if (part.get("thinking") is None) == (part.get("text") is None):
                raise DumpError(f"{at}: {_THINKING_PAYLOAD}")
        elif kind == "tool_reference":
            _checked(_TEXT, part.get("name"), f"{at}.name")
            parts.append(part)
        elif kind in _IMAGE and images is not None:
            images.append({"url": _image_url(part, at)})
            parts.append({"type": "image"})
        elif kind in _MEDIA:
            raise DumpError(f"{at}: the built-in engine takes text parts only (a text model)")
        else:
            raise DumpError(f"{at}.type: {kind!r} is no content part's type")
    texts = [part["text"] for part in parts if part["type"] == "text"]
    if fmt == "string" or (role == "tool" and len(texts) == len(parts)):
        return " ".join(texts)
    return parts


_TEXT = TypeAdapter(str)
_IMAGE = ("image_url", "input_image")  # an image part's types (SGLang's)


def _image_url(part: dict[str, Any], at: str) -> str:
    """An image part's URL (``image_url``: ``{"url"}`` or the URL itself)."""
    given = part.get("image_url")
    url = (
        given
        if isinstance(given, str)
        else (given or {}).get("url")
        if isinstance(given, dict)
        else None
    )
    if not isinstance(url, str):
        raise DumpError(f"{at}.image_url.url: Field required")
    return url


def _call(call: Any, role: str, where: str, strict: bool) -> dict[str, Any]:
    """A history tool call as ``ToolCall`` dumps it, an assistant's text arguments parsed
    (``normalize_assistant_tool_call_arguments``)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise DumpError(f"{where}.function: Field required")
    if call.get("type", "function") != "function":
        raise DumpError(f"{where}.type: Input should be 'function'")
    arguments = _checked(_CALL_ARGUMENTS, fn.get("arguments"), f"{where}.function.arguments")
    if role == "assistant" and isinstance(arguments, str):
        try:  # parse_tool_call_arguments
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            if strict:
                raise DumpError(
                    "Assistant tool call function.arguments must be valid JSON."
                ) from None
            parsed = arguments
        if isinstance(parsed, dict):
            arguments = parsed
        elif strict:
            raise DumpError("Assistant tool call function.arguments must be a JSON object.")
    return {
        "id": _checked(_CALL_ID, call.get("id"), f"{where}.id"),
        "index": _checked(_CALL_INDEX, call.get("index"), f"{where}.index"),
        "type": "function",
        "function": {
            "name": _checked(_CALL_ID, fn.get("name"), f"{where}.function.name"),
            "arguments": arguments,
        },
    }


def _is_tool(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str)
