"""Tool calls in poolside's format (SGLang's ``--tool-call-parser poolside_v1``, Laguna)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

As SGLang 0.5.23 reads them (``function_call/poolside_v1_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): the content is the text before the first ``<tool_call>``, as it is; each
  ``<tool_call>`` up to the next ``</tool_call>`` is a call, its name the text before its first
  newline or ``<arg_key>``, stripped, its arguments each ``<arg_key>KEY</arg_key>`` (a key
  without ``<``) and the ``<arg_value>VALUE</arg_value>`` after it, one newline taken off each
  end of the value. A value is read by its parameter's declared ``type``: a string (``str``,
  ``text``, ``enum``) keeps the text; an undeclared one is JSON or the text; another type JSON,
  else a Python literal, else the text (a reading JSON cannot write is passed over). Calls to
  tools not offered are dropped.
- streamed (``stream``): the content before the first call as it comes (a tail that may begin
  the tag waits), each call whole at its ``</tool_call>``, nothing after the calls: the whole
  answer's. (SGLang's stream writes each value as its tags close.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from stages.engine.glm_calls import literal
from stages.engine.marked_stream import MarkedStream
from stages.engine.partial_json import partial_tail
from stages.engine.qwen3_coder_calls import _properties
from stages.engine.tool_formats import _Unreadable

__all__ = ["PoolsideCalls"]

BEGIN, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PAIR = re.compile(r"<arg_key>([^<]*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_STRINGS = ("string", "str", "text", "enum")

Pieces = list[dict[str, Any]]


class PoolsideCalls:
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.properties: dict[str, dict[str, Any]] = {}
        for tool in tools:  # the first of a name
            fn = tool.get("function") or {}
            parameters = fn.get("parameters")
            properties = _properties(parameters) if isinstance(parameters, dict) else {}
            self.properties.setdefault(fn.get("name"), properties)

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        try:
            return text[:at], [c for c in map(self.call, _CALLS.findall(text)) if c is not None]
        except RecursionError:  # out of the detector: serving_chat's except Exception
            return text, []

    def call(self, body: str) -> dict[str, str] | None:
        """``{name, arguments}`` of one call's text between its tags; None for a tool not
        offered."""
        ends = [i for i in (body.find("\n"), body.find("<arg_key>")) if i != -1]
        name = (body[: min(ends)] if ends else body).strip()
        if name not in self.properties:
            return None
        properties = self.properties[name]
        arguments = {}
        for key, raw in _PAIR.findall(body):
            value = raw.removeprefix("\n").removesuffix("\n")
            arguments[key.strip()] = _value(value, properties.get(key.strip()))
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}

    def stream(self) -> _PoolsideStream:
        return _PoolsideStream(self)


def _value(raw: str, schema: Any) -> Any:
    """``_convert_param_value``."""
    kind = str(schema.get("type", "")).lower() if isinstance(schema, dict) else ""
    if kind in _STRINGS:
        return raw
    for read in (json.loads,) if not kind else (json.loads, literal):
        try:
            value = read(raw)
            json.dumps(value)
        except (ValueError, TypeError, _Unreadable):
            continue
        return value
    return raw


class _PoolsideStream(MarkedStream):
    begin, end = BEGIN, END

    def __init__(self, reader: PoolsideCalls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0

    def content(self, text: str) -> tuple[str, int | None]:
        at = text.find(BEGIN)
        upto = len(text) - partial_tail(text, BEGIN) if at == -1 else at
        out, self.sent = text[self.sent : upto], max(self.sent, upto)
        return out, None if at == -1 else at

    def rest(self, text: str) -> str:
        out, self.sent = text[self.sent :], len(text)
        return out

    def whole(self, key: int, text: str) -> Pieces:
        call = self.reader.call(text[len(BEGIN) : -len(END)])
        return [] if call is None else self.pieces.whole(key, call["name"], call["arguments"])
