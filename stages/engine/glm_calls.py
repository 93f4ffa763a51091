"""Tool calls in GLM-4.5's format (SGLang's ``--tool-call-parser glm45``, also ``glm``):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

As SGLang 0.5.23 reads them (``function_call/glm4_moe_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): the content is the text before the first ``<tool_call>``, stripped; each
  ``<tool_call>`` up to the next ``</tool_call>`` is a call, its name the text before its first
  newline (or a literal backslash-n), its arguments each ``<arg_key>KEY</arg_key>`` followed by
  ``<arg_value>VALUE</arg_value>`` after it. A value is read by its parameter's JSON-schema type
  (``parse_arguments``): as JSON (a number type turning a JSON string that is a number into
  it), else as a JSON string's contents, else (a string type) as it is less matching quotes,
  else as a Python literal, else as text; a string type keeps text, writing a list or object
  back as JSON; an undeclared parameter keeps what was read, or the text. A call to a tool not
  offered is dropped (logged). An answer whose values cannot then be written as JSON (a Python
  set), or whose Python literal cannot be read at all, has no calls, its text the content (the
  detector's ``except Exception``).
- streamed (``stream``): content as it comes (a tail that may begin ``<tool_call>``, and
  whitespace, wait for what follows); a call is named once its name line is whole, its
  arguments go out as its pairs close, the rest at ``</tool_call>``; at the end, a call cut
  short gets the rest of what its closed pairs make (``unsent``).

SGLang's stream writes each value as it comes, typed by the schema or, for an undeclared
parameter, guessed from the value's first characters (where its whole-answer reading keeps what
JSON or Python reads); this gives what the whole answer gives. A key given twice is written
once, with the last value, as the whole answer's dictionary keeps it; the stream may have sent
the first by then.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import ContentFirst, whole_calls
from stages.engine.qwen3_coder_calls import _properties, _schema_type
from stages.engine.tool_formats import _Unreadable, offered_call, quiet_ast

__all__ = ["GlmCalls", "Ling3Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)  # func_call_regex
_CALL = re.compile(r"<tool_call>(.*?)(?:\\n|\n)(.*)</tool_call>", re.DOTALL)  # func_detail_regex
_NAME = re.compile(r"(.*?)(?:\\n|\n)", re.DOTALL)  # a call's name line, being written
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)

Pieces = list[dict[str, Any]]


class GlmCalls:
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    detail = _CALL  # a whole call: its name, its pairs
    name_line = _NAME  # the name of a call being written, once it is whole

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.params: dict[str, dict[str, Any]] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            if "name" in fn:  # name2tool: the last of a name
                self.params[fn["name"]] = _properties(fn.get("parameters"))

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        return whole_calls(text, text.find(BEGIN), _CALLS, self.call)

    def call(self, text: str) -> dict[str, str] | None:
        """``{name, arguments}`` of one call's text (``<tool_call>`` to ``</tool_call>``); None
        for one without a name line, or (logged) to a tool not offered; ``_Unreadable`` where
        its values cannot be read or written as JSON."""
        match = self.detail.search(text)
        if match is None:
            return None
        name = match.group(1) or ""
        arguments = self.arguments(name, _PAIR.findall(match.group(2) or ""))
        return offered_call(name, arguments, self.params)

    def arguments(self, name: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """The arguments of ``name``'s call of these ``(key, value)`` pairs
        (``_parse_argument_pairs``)."""
        out: dict[str, Any] = {}
        properties = self.params.get(name, {})
        for key, raw in pairs:
            key = key.strip()
            kind = _schema_type(properties[key]) if key in properties else None
            value = _value(raw, kind)
            if kind == "string":
                if isinstance(value, str):
                    out[key] = value
                elif isinstance(value, dict | list):
                    out[key] = json.dumps(value, ensure_ascii=False)
                else:
                    out[key] = str(value)
            else:
                out[key] = value
        return out

    def stream(self) -> _GlmStream:
        return _GlmStream(self)


class Ling3Calls(GlmCalls):
    """Ling 3's calls (SGLang's ``--tool-call-parser ling3``, ``Ling3Detector``): GLM-4.5's,
    the name's leading space taken out and its end a newline, or the first ``<arg_key>``, or
    ``</tool_call>`` (a call without arguments)."""

    detail = re.compile(
        r"<tool_call>\s*(.*?)(?:(?:\\n|\n)\s*|(?=<arg_key>)|(?=</tool_call>))"
        r"(<arg_key>.*?)?</tool_call>",
        re.DOTALL,
    )
    name_line = re.compile(r"\s*(.*?)(?:(?:\\n|\n)\s*|(?=<arg_key>))", re.DOTALL)


def _number(text: str) -> Any:
    """``_convert_to_number``."""
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return text


def _value(raw: str, kind: str | None) -> Any:
    """A value's text read for a parameter of type ``kind`` (``parse_arguments``; its last
    resort, the text, never fails: what it reads is always used)."""
    for read in (json.loads, lambda t: json.loads(json.loads('{"tmp": "' + t + '"}')["tmp"])):
        try:
            value = read(raw)
        except (ValueError, KeyError):
            continue
        except RecursionError as exc:  # not the detector's to catch: the whole answer unread
            raise _Unreadable(f"a value cannot be read: {exc!r}") from exc
        return _number(value) if kind == "number" and isinstance(value, str) else value
    return unquoted(raw) if kind == "string" else literal(raw)


def unquoted(raw: str) -> str:
    """A string parameter's text that is not JSON: less the quotes around it, if any."""
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'"
    return raw[1:-1] if quoted else raw


def literal(raw: str) -> Any:
    """``raw`` as a Python literal, else as it is; ``_Unreadable`` where reading it raises
    anything else (the detector's ``except Exception``: the whole answer unread)."""
    try:
        return quiet_ast(ast.literal_eval, raw)
    except (ValueError, SyntaxError):
        return raw
    except Exception as exc:
        raise _Unreadable(f"a value cannot be read: {exc!r}") from exc


class _GlmStream(ContentFirst):
    begin, end = BEGIN, END

    def __init__(self, reader: GlmCalls) -> None:
        super().__init__()
        self.reader = reader
        self.dropped: set[int] = set()  # where calls to tools not offered begin

    def partial(self, key: int, body: str) -> Pieces:
        line = self.reader.name_line.match(body)
        if line is None or key in self.dropped:
            return []
        name = line.group(1)
        if not self.pieces.named(key) and (not name or name not in self.reader.params):
            log.warning("tool_call_unknown_function", name=name[:100])
            self.dropped.add(key)
            return []
        try:
            so_far = json.dumps(
                self.reader.arguments(name, _PAIR.findall(body, line.end())), ensure_ascii=False
            )
        except (TypeError, ValueError, _Unreadable):
            return self.pieces.partial(key, name, None)
        return self.pieces.partial(key, name, so_far)

    def whole(self, key: int, text: str) -> Pieces:
        if key in self.dropped:
            return []
        try:
            call = self.reader.call(text)
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return []
        if call is None:
            return []
        return self.pieces.whole(key, call["name"], call["arguments"])
