"""Tool calls in Qwen3-Coder's XML-like format (SGLang's ``--tool-call-parser qwen3_coder``):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

As SGLang 0.5.23 reads them (``function_call/qwen3_coder_detector.py``; a local check holds this
module to it on random texts and splits):

- whole (``parse``): the blocks between ``<tool_call>`` and the next ``</tool_call>`` (none
  closed, but ``<function=`` in the text: the whole text is the one block); in each block every
  ``<function=NAME>`` up to the next ``</function>`` (or the block's end) is a call, and in its
  body every ``<parameter=KEY>`` up to ``</parameter>``, the next ``<parameter=``, or the end
  (Python's ``$``: before a last newline too) is an argument, one newline trimmed from each end
  of its value. The content is the text before the first ``<tool_call>``, as it is. Calls to
  functions the request did not offer are kept (SGLang's detector does not drop them, the JSON
  formats' do).
- a value is converted by its parameter's JSON-schema type (``infer_type_from_json_schema``):
  ``null`` is null; strings stay text; integers and numbers are read as Python reads them
  (failing that, the text), a number without ``.`` or ``e`` that is whole as an integer;
  booleans are ``true`` (any case) or else false; objects and arrays as JSON, failing that (and
  for any other type) as a Python literal, failing that the text. A parameter the tool does
  not declare stays text. An answer whose values then cannot be written as JSON (a Python set)
  has no calls, its text the content.
- streamed (``stream``): a call is named once its ``<function=NAME>`` is whole, its arguments
  go out a parameter at a time once the parameter has ended (``{`` before the first, ``, ``
  between, ``}`` at ``</function>``), text outside the blocks is content as it comes, and a
  tail that may begin a tag waits; at the end what waits is dropped, and no arguments are
  completed (SGLang's detector keeps none to complete). One difference: a value JSON cannot
  write (a Python set) goes out as its text, where SGLang's stream raises and fails.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls
from stages.engine.tool_formats import quiet_ast

__all__ = ["Qwen3CoderCalls", "typed_value"]

log = structlog.get_logger("stages.engine.tool_calls")

BLOCK, BLOCK_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_TAGS = (BLOCK, BLOCK_END, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END)
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_INTEGERS = ("int", "uint", "long", "short", "unsigned")


class Qwen3CoderCalls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.params: dict[str, Any] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            if tool.get("type", "function") == "function" and "name" in fn:
                self.params.setdefault(fn["name"], _arguments_config(fn.get("parameters")))

    def has_tool_call(self, text: str) -> bool:
        return BLOCK in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(place, call)])``: each call with its place among the calls (SGLang's
        ``tool_index`` here)."""
        if BLOCK not in text:
            return text, []
        blocks = _blocks(text)
        if not blocks and FUNCTION in text:
            blocks = [text]
        calls: list[tuple[int, dict[str, str]]] = []
        try:
            for block in blocks:
                for body in _functions(block):
                    if ">" not in body:
                        continue
                    name, params = body.split(">", 1)
                    values: dict[str, Any] = {}
                    for raw in _parameters(params):
                        if ">" not in raw:
                            continue
                        key, value = raw.split(">", 1)
                        values[key] = self.convert(name, key, _trim(value))
                    arguments = json.dumps(values, ensure_ascii=False)
                    calls.append((len(calls), {"name": name, "arguments": arguments}))
        except Exception as exc:  # a value JSON cannot write...: SGLang's catch-all
            log.warning("tool_call_unreadable", format="qwen3_coder", error=str(exc))
            return text, []
        start = text.find(BLOCK)
        return (text[:start] if start > 0 else ""), calls

    def convert(self, function: str, key: str, value: str) -> Any:
        """``value`` as the type ``function``'s parameter ``key`` declares
        (``_convert_param_value``)."""
        if value.lower() == "null":
            return None
        config = self.params.get(function)
        if config is None:
            log.warning("tool_call_unknown_function", format="qwen3_coder", name=function)
            config = {}
        if key not in config:
            return value
        kind = str(_schema_type(config[key]) or "string").strip().lower()
        return typed_value(value, kind, _number)

    def stream(self) -> _Qwen3CoderStream:
        return _Qwen3CoderStream(self)


def _number(value: str) -> Any:
    """A number's value: an integer where it is written without ``.`` or ``e`` and is whole;
    not a number: its text."""
    try:
        number = float(value)
    except ValueError:
        return value
    whole = "." not in value and "e" not in value.lower()
    return int(number) if whole and number.is_integer() else number


def typed_value(
    value: str, kind: str, number: Callable[[str], Any], errors: type[Exception] | None = None
) -> Any:
    """``value`` read as the type name ``kind`` says (the typing Qwen3-Coder's and MiMo's
    detectors share, after vLLM's): strings as they are; integers as Python reads them, else
    the text; numbers by ``number``; booleans ``true`` (any case) or else false; objects and
    arrays as JSON, and anything else as a Python literal, else the text. A failure other than
    the readings' own (``ValueError``, ``SyntaxError``, ``TypeError``) raises ``errors`` where
    given (the detector raises there), else gives the text too."""
    if kind in _STRINGS:
        return value
    if kind.startswith(_INTEGERS):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        return number(value)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            try:
                return json.loads(value)
            except ValueError:  # the next reading, as SGLang's
                pass
        try:
            return quiet_ast(ast.literal_eval, value)
        except (ValueError, SyntaxError, TypeError):
            return value
    except Exception as exc:  # deep nesting, memory...
        if errors is None:
            return value
        raise errors(str(exc)) from exc


def _arguments_config(parameters: Any) -> Any:
    """What a tool's parameters give its arguments' types by (``_get_arguments_config``): the
    schema's properties (those of its ``anyOf``/``oneOf``/``allOf`` branches when it has
    none), or the schema itself when it declares no properties at all."""
    if not isinstance(parameters, dict):
        return {}
    properties = _properties(parameters)
    if properties or "properties" in parameters:
        return properties
    return parameters


def _properties(schema: Any) -> dict[str, Any]:
    """``get_schema_properties``."""
    if not isinstance(schema, dict):
        return {}
    found = schema.get("properties")
    if isinstance(found, dict):
        return found
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in _properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def _schema_type(schema: Any) -> Any:
    """A parameter's type as ``infer_type_from_json_schema`` reads its schema (None: none)."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            return kind
        if isinstance(kind, list) and kind:
            rest = [t for t in kind if t != "null"]
            return rest[0] if rest else "string"
    if "anyOf" in schema or "oneOf" in schema:
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list):
            kinds = [k for k in (_schema_type(b) for b in branches) if k]
            if kinds:
                distinct = set(kinds)
                if len(distinct) == 1:
                    return kinds[0]
                if len(distinct) == 2 and "null" in kinds:
                    return next(k for k in kinds if k != "null")
                return "string" if "string" in kinds else kinds[0]
    if "enum" in schema and isinstance(schema["enum"], list):
        if not schema["enum"]:
            return "string"
        kinds = {_enum_type(v) for v in schema["enum"]} - {None}
        return kinds.pop() if len(kinds) == 1 else "string"
    if "allOf" in schema and isinstance(schema["allOf"], list):
        for branch in schema["allOf"]:
            kind = _schema_type(branch)
            if kind and kind != "string":
                return kind
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _enum_type(value: Any) -> str | None:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array"), (dict, "object")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return None


def _blocks(text: str) -> list[str]:
    """The texts between each ``<tool_call>`` and the next ``</tool_call>``, left to right."""
    out, pos = [], 0
    while (start := text.find(BLOCK, pos)) != -1:
        end = text.find(BLOCK_END, start + len(BLOCK))
        if end == -1:
            break
        out.append(text[start + len(BLOCK) : end])
        pos = end + len(BLOCK_END)
    return out


def _functions(block: str) -> list[str]:
    """Each ``<function=`` body: up to the next ``</function>``, else to the block's end."""
    out, pos = [], 0
    while (start := block.find(FUNCTION, pos)) != -1:
        begin = start + len(FUNCTION)
        end = block.find(FUNCTION_END, begin)
        if end == -1:
            out.append(block[begin:])
            break
        out.append(block[begin:end])
        pos = end + len(FUNCTION_END)
    return out


def _parameters(params: str) -> list[str]:
    """Each ``<parameter=`` body: up to the first ``</parameter>`` (consumed), ``<parameter=``
    or ``</function>`` (not), or the end (a regex's ``$``: also before a last newline)."""
    out, pos, size = [], 0, len(params)
    while (start := params.find(PARAMETER, pos)) != -1:
        begin = start + len(PARAMETER)
        last = size - 1 if params.endswith("\n") and size - 1 >= begin else size  # "$"
        stops = [(params.find(PARAMETER_END, begin), len(PARAMETER_END)),
                 (params.find(PARAMETER, begin), 0), (params.find(FUNCTION_END, begin), 0),
                 (last, 0)]  # fmt: skip
        end, length = min((at, n) for at, n in stops if at != -1)
        out.append(params[begin:end])
        pos = end + length
    return out


def _trim(value: str) -> str:
    """One newline off each end of a value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class _Qwen3CoderStream:
    """``parse_streaming_increment``: the text read tag by tag as it comes."""

    def __init__(self, reader: Qwen3CoderCalls) -> None:
        self.reader = reader
        self.text = ""  # what is not read yet
        self.inside = False  # within a <tool_call> block: text there is not content
        self.index = -1  # the current call's
        self.count = 0  # its arguments so far
        self.opened = False  # its "{" sent
        self.function: str | None = None
        self.calls = 0  # call pieces sent (a call's name or arguments: SGLang's has_tool_calls)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        text = self.text + delta
        pos, content, pieces = 0, [], []
        while pos < len(text):
            rest = text[pos:] if pos else text
            if rest.startswith(BLOCK):
                pos += len(BLOCK)
                self.inside = True
            elif rest.startswith(FUNCTION):
                close = rest.find(">")
                if close == -1:
                    break
                self.index += 1
                self.count, self.opened = 0, False
                self.function = rest[len(FUNCTION) : close]
                # an empty name names nothing: SGLang's route sends it as arguments ("")
                pieces.append({"index": self.index, "name": self.function or None,
                               "arguments": ""})  # fmt: skip
                pos += close + 1
            elif rest.startswith(PARAMETER):
                used = self._parameter(rest, pieces)
                if used == 0:
                    break
                pos += used
            elif rest.startswith(FUNCTION_END):
                if not self.opened:
                    pieces.append(self._piece("{"))
                    self.opened = True
                pieces.append(self._piece("}"))
                pos += len(FUNCTION_END)
                self.function = None
            elif rest.startswith(BLOCK_END):
                pos += len(BLOCK_END)
                self.inside = False
            else:
                angle = rest.find("<")
                if angle == 0:
                    if any(tag.startswith(rest) for tag in _TAGS):
                        break  # a tag may be beginning: wait
                    angle = 1  # a plain "<"
                elif angle == -1:
                    angle = len(rest)
                if not self.inside:
                    content.append(rest[:angle])
                pos += angle
        self.text = text[pos:]
        self.calls += len(pieces)
        return "".join(content), pieces

    def _parameter(self, rest: str, pieces: list[dict[str, Any]]) -> int:
        """A whole parameter at the start of ``rest`` sent as its arguments' piece; how much of
        ``rest`` it took (0: not whole yet)."""
        close = rest.find(">")
        if close == -1:
            return 0
        value = rest[close + 1 :]
        stops = [(value.find(PARAMETER_END), len(PARAMETER_END)),
                 (value.find(PARAMETER), 0), (value.find(FUNCTION_END), 0)]  # fmt: skip
        found = [stop for stop in stops if stop[0] != -1]
        if not found:
            return 0
        end, length = min(found, key=lambda stop: stop[0])
        key = rest[len(PARAMETER) : close]
        if not self.opened:
            pieces.append(self._piece("{"))
            self.opened = True
        raw = _trim(value[:end])
        converted = self.reader.convert(self.function or "", key, raw)
        try:
            written = json.dumps(converted, ensure_ascii=False)
        except (TypeError, ValueError):  # a Python set...: its text (SGLang's stream raises)
            written = json.dumps(raw, ensure_ascii=False)
        pair = f"{json.dumps(key)}: {written}"
        pieces.append(self._piece(f", {pair}" if self.count else pair))
        self.count += 1
        return close + 1 + end + length

    def _piece(self, arguments: str) -> dict[str, Any]:
        return {"index": self.index, "name": None, "arguments": arguments}

    def flush(self) -> str:
        """At the end: what waited (a tag's beginning) is dropped, as SGLang drops it."""
        self.text = ""
        return ""

    def unsent(self) -> list[dict[str, Any]]:
        return []  # SGLang's detector keeps no call to complete
