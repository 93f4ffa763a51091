"""Tool calls in Xiaomi MiMo's format (SGLang's ``--tool-call-parser mimo``)::

    <tool_call>
    <function=execute_bash>
    <parameter=command>pwd && ls</parameter>
    </function>
    </tool_call>

As SGLang 0.5.23 reads them (``function_call/mimo_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): the content is the text before the first ``<tool_call>``; each block up to
  the next ``</tool_call>`` holds at most one call, its first ``<function=NAME>`` up to
  ``</function>``, and in it every ``<parameter=KEY>VALUE</parameter>``. A call to a tool not
  offered is not a call: its block goes to the content, with the text since the block before
  (text between known calls, and after the last block, is dropped). Each call's
  ``tool_index`` is its tool's place.
- a value (HTML entities unescaped) is typed by its parameter's declared ``type``: ``null``
  (any case) is null; strings stay text; integers and numbers as Python reads them, else the
  text (a whole number an integer); booleans are ``true`` (any case) or else false; objects and
  arrays as JSON, and anything else as a Python literal, else the text. A value JSON cannot
  write (a Python set), or a ``type`` that is not a string, leaves the answer unread (no calls,
  the text as content: SGLang's detector raises).
- streamed (``stream``): content as it comes until the first ``<tool_call>`` (a tail that may
  begin it waits), then each block once closed: its call whole (name and arguments in one
  piece), or for an unknown tool its text, with what came between it and the block before, as
  content. Text left at the end (an unclosed block, or after the last) is dropped, as the whole
  answer drops it.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, partial_tail
from stages.engine.qwen3_coder_calls import _properties, typed_value
from stages.engine.tool_formats import _Unreadable

__all__ = ["MiMoCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

BLOCK, BLOCK_END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>]+)>(.*?)</function>", re.DOTALL)
_PARAMETERS = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)

Pieces = list[dict[str, Any]]


def _number(value: str) -> Any:
    """A number's value, whole ones as integers (not a number: its text; an infinite one:
    _Unreadable, where SGLang's detector raises)."""
    try:
        number = float(value)
        return number if number - int(number) != 0 else int(number)
    except ValueError:
        return value
    except OverflowError as exc:
        raise _Unreadable(str(exc)) from exc


class MiMoCalls:
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.tools = [t.get("function") or {} for t in tools]
        self.names = {fn["name"] for fn in self.tools if "name" in fn}

    def has_tool_call(self, text: str) -> bool:
        return BLOCK in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BLOCK)
        if at == -1:
            return text, []
        content, calls, last = [text[:at]], [], at
        try:
            for match in _BLOCKS.finditer(text):
                call = self.call(match.group(1))
                if call is False:  # a tool not offered: its block is content
                    content.append(text[last : match.end()])
                elif call is not None:
                    calls.append(call)
                last = match.end()
        except _Unreadable as exc:
            log.warning("tool_call_unreadable", format="mimo", error=str(exc))
            return text, []
        return "".join(content), calls

    def call(self, body: str) -> dict[str, str] | bool | None:
        """A block's call: None where it holds none, False where it calls a tool not offered
        (logged)."""
        function = _FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1).strip()
        values = {
            match.group(1).strip(): self.convert(name, match.group(1).strip(), match.group(2))
            for match in _PARAMETERS.finditer(function.group(2))
        }
        if name not in self.names:
            log.warning("tool_call_unknown_tool", format="mimo", name=name)
            return False
        try:
            arguments = json.dumps(values, ensure_ascii=False)
        except (TypeError, ValueError) as exc:  # a Python set...
            raise _Unreadable(str(exc)) from exc
        return {"name": name, "arguments": arguments}

    def _type(self, function: str, key: str) -> Any:
        for fn in self.tools:
            if fn.get("name") == function:
                schema = _properties(fn.get("parameters"))
                if key in schema:
                    if not isinstance(schema[key], dict):
                        raise _Unreadable(f"parameter {key!r}: its schema is not an object")
                    return schema[key].get("type", "string")
        return "string"

    def convert(self, function: str, key: str, value: str) -> Any:
        """``value`` as the type ``function``'s parameter ``key`` declares."""
        value = html.unescape(value)
        if value.lower() == "null":
            return None
        kind = self._type(function, key)
        if not isinstance(kind, str):
            raise _Unreadable(f"parameter {key!r}: type {kind!r} is not a string")
        return typed_value(value, kind, _number, _Unreadable)

    def stream(self) -> _MiMoStream:
        return _MiMoStream(self)


class _MiMoStream(PieceStream):
    """A sample's text deltas in, content to send now and whole calls out."""

    def __init__(self, reader: MiMoCalls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # before the first block: the content sent
        self.last: int | None = None  # where the text after the last block begins (None: none)

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text = self.text
        if self.last is None:
            at = text.find(BLOCK)
            if at == -1:
                safe = len(text) - partial_tail(text, BLOCK)
                out, self.sent = text[self.sent : safe], max(self.sent, safe)
                return out, []
            content, self.last = text[self.sent : at], at
        else:
            content = ""
        pieces: Pieces = []
        while True:
            start = text.find(BLOCK, self.last)
            end = -1 if start == -1 else text.find(BLOCK_END, start)
            if end == -1:
                return content, pieces
            end += len(BLOCK_END)
            try:
                call = self.reader.call(text[start + len(BLOCK) : end - len(BLOCK_END)])
            except _Unreadable as exc:  # the whole answer reads no calls then
                log.warning("tool_call_unreadable", format="mimo", error=str(exc))
                call = None
            if call is False:
                content += text[self.last : end]
            elif call is not None:
                pieces += self.pieces.whole(start, call["name"], call["arguments"])
            self.last = end

    def flush(self) -> str:
        if self.last is None:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        return ""
