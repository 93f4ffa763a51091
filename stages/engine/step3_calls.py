"""Tool calls in Step-3's format (SGLang's ``--tool-call-parser step3``)::

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="f">
    <steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke><｜tool_call_end｜>
    <｜tool_calls_end｜>

As SGLang 0.5.23 reads them (``function_call/step3_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): only an answer whose ``<｜tool_calls_begin｜>`` is followed by
  ``<｜tool_calls_end｜>`` has calls: each ``<｜tool_call_begin｜>`` ... ``<｜tool_call_end｜>``
  between them whose type (before ``<｜tool_sep｜>``) is ``function`` and which holds a
  ``<steptml:invoke name="NAME">`` with a body; its parameters (values without ``<``, stripped)
  read as JSON, else a Python literal, else the text where the tool declares a type other than
  string, else kept as text. Calls to tools not offered are dropped (logged). The content is the
  text before and after the section. An answer whose values cannot be written as JSON (a Python
  set), or whose schema cannot be read, has no calls, its text the content.
- streamed (``stream``): content before the section as it comes (a tail that may begin it
  waits), each call whole at its ``<｜tool_call_end｜>``, the text after the section as it
  comes. A section never closed: its calls went out as they came (SGLang's stream sends them
  too); the whole answer has none.
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (no structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.glm_calls import literal
from stages.engine.partial_json import PieceStream, partial_tail
from stages.engine.qwen3_coder_calls import _properties
from stages.engine.tool_formats import _Unreadable, offered_call

__all__ = ["Step3Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
CALL, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
_CALLS = re.compile(re.escape(CALL) + "(.*?)" + re.escape(CALL_END), re.DOTALL)
_INVOKE = re.compile(r'<steptml:invoke name="([^"]+)">(.+?)</steptml:invoke>', re.DOTALL)
_PARAMETER = re.compile(r'<steptml:parameter name="([^"]+)">([^<]*)</steptml:parameter>', re.DOTALL)
_FAILS = (_Unreadable, AttributeError, TypeError, ValueError, RecursionError)

Pieces = list[dict[str, Any]]


class Step3Calls:
    """The calls of answers to one request (``tools``: its tools, their parameters)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.schemas: dict[str, Any] = {}
        for tool in tools:  # name2tool: the last of a name
            fn = tool.get("function") or {}
            self.schemas[fn.get("name")] = fn.get("parameters") or {}

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        if BEGIN not in text:
            return text, []
        before, rest = text.split(BEGIN, 1)
        if END not in rest:
            return text, []
        section, after = rest.split(END, 1)
        try:
            calls = [c for c in map(self.call, _CALLS.findall(section)) if c is not None]
        except _FAILS as exc:  # the detector's except Exception
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return text, []
        return before + after, calls

    def call(self, body: str) -> dict[str, str] | None:
        """``{name, arguments}`` of one call's text (between its begin and end tokens); None
        for one that is no function call, or (logged) to a tool not offered."""
        if SEP not in body:
            return None
        kind, invoke = body.split(SEP, 1)
        match = _INVOKE.search(invoke) if kind.strip() == "function" else None
        if match is None:
            return None
        name, arguments = match.group(1), {}
        for key, raw in _PARAMETER.findall(match.group(2)):
            arguments[key] = self.value(name, key, raw.strip())
        return offered_call(name, arguments, self.schemas)

    def value(self, name: str, key: str, raw: str) -> Any:
        """``raw`` read as JSON, else a Python literal, else as it is, where ``name``'s ``key``
        declares a type other than string; else as it is (``get_argument_type``)."""
        properties = _properties(self.schemas.get(name)) if name in self.schemas else {}
        kind = properties[key].get("type") if key in properties else None
        if not kind or kind == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            pass
        try:
            return literal(raw)
        except _Unreadable:  # the detector's bare except: the text
            return raw

    def stream(self) -> _Step3Stream:
        return _Step3Stream(self)


class _Step3Stream(PieceStream):
    def __init__(self, reader: Step3Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent, of the text before the section or after it
        self.at: int | None = None  # where the calls not yet read begin (None: no section)
        self.after: int | None = None  # where the text after the section begins

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text = self.text
        if self.after is not None:
            return self._content(len(text)), []
        if self.at is None:
            start = text.find(BEGIN)
            if start == -1:
                return self._content(len(text) - partial_tail(text, BEGIN)), []
            self.at = start + len(BEGIN)
            content = self._content(start)
        else:
            content = ""
        end = text.find(END, self.at)
        section = text[self.at : end if end != -1 else len(text)]
        pieces: Pieces = []
        for match in _CALLS.finditer(section):
            try:
                call = self.reader.call(match.group(1))
            except _FAILS as exc:
                log.warning("tool_call_unparsed", error=str(exc)[:200])
                call = None
            if call is not None:
                key = self.at + match.start()
                pieces += self.pieces.whole(key, call["name"], call["arguments"])
        if _CALLS.search(section):
            self.at += max(m.end() for m in _CALLS.finditer(section))
        if end != -1:
            self.after = self.sent = end + len(END)
            content += self._content(len(text))
        return content, pieces

    def _content(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out

    def flush(self) -> str:
        if self.at is None:
            return self._content(len(self.text))
        if self.after is None:
            log.warning("tool_call_incomplete", text=self.text[self.at :][:200])
        return ""
