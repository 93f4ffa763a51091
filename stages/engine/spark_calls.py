"""Tool calls in Spark 2.5's XML-KV format (SGLang's ``--tool-call-parser spark25``)::

    <tool_call>get_weather
    <arg_key>city</arg_key><arg_value>Paris</arg_value>
    </tool_call>

As SGLang 0.5.23 reads them (``function_call/spark25_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``listed``): each ``<tool_call>`` up to the next ``</tool_call>`` is a call if its name
  (the text before its first ``<arg_key>``, stripped) is not empty; its arguments each
  ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` with a key, the value read by its
  parameter's declared ``type`` (``null`` in any case: null; a string: the text; an integer or a
  number as Python reads it, a whole number an integer; a boolean ``true``/``1``/``false``/``0``;
  else JSON; failing that JSON, failing that the text), written as compact JSON. A block with
  no name stays in the content, one never closed too; a call is taken out of it, and dropped
  (logged) if its tool was not offered. Calls are numbered in order; the content is the rest,
  as it is.
- streamed (``stream``): content as it comes (a tail that may begin the tag waits), each call
  whole at its end tag, a block without a name content then; at the end a block never closed is
  content, as the whole answer has it (SGLang's stream drops it).
- ``tool_choice`` ``required`` or named: not constrained (the detector
  ``parses_required_natively``), the answer read in this format.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import ReadBlocks
from stages.engine.partial_json import ListedCalls
from stages.engine.qwen3_coder_calls import _properties

__all__ = ["Spark25Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END, KEY = "<tool_call>", "</tool_call>", "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", re.DOTALL)


def _value(raw: str, kind: str) -> Any:
    """``_convert_value``: ``raw`` read as a value of the declared type ``kind``."""
    if raw.lower() == "null":
        return None
    kind = kind.lower()
    try:
        if kind in ("string", "str", "text"):
            return raw
        if kind in ("integer", "int"):
            return int(raw)
        if kind in ("number", "float"):
            number = float(raw)
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool"):
            word = raw.strip().lower()
            if word not in ("true", "1", "false", "0"):
                raise ValueError(word)
            return word in ("true", "1")
        return json.loads(raw)
    except ValueError:
        try:
            return json.loads(raw)
        except ValueError:
            return raw


class Spark25Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.types: dict[str, dict[str, str]] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            parameters = fn.get("parameters")
            properties = _properties(parameters) if isinstance(parameters, dict) else {}
            self.types.setdefault(fn.get("name"), {
                key: value["type"] for key, value in properties.items()
                if isinstance(value, dict) and isinstance(value.get("type"), str)
            })  # fmt: skip

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        calls: list[tuple[int, dict[str, str]]] = []
        content, at = [], 0
        while (start := text.find(BEGIN, at)) != -1:
            end = text.find(END, start + len(BEGIN))
            if end == -1:
                break
            content.append(text[at:start])
            at = end + len(END)
            call = self.read(text[start + len(BEGIN) : end])
            if call is False:
                content.append(text[start:at])
            elif call is not None:
                calls.append((len(calls), call))
        return "".join(content) + text[at:], calls

    def read(self, body: str) -> dict[str, str] | bool | None:
        """One block's call: ``{name, arguments}``, None (logged) for a tool not offered,
        False for a block without a name."""
        cut = body.find(KEY)
        name = (body if cut == -1 else body[:cut]).strip()
        if not name:
            return False
        types = self.types.get(name, {})
        arguments = {
            key: _value(raw, types.get(key, "string")) for key, raw in _PAIR.findall(body) if key
        }
        if name not in self.types:
            log.warning("tool_call_unknown_function", name=name[:100])
            return None
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False,
                                                      separators=(",", ":"))}  # fmt: skip

    def stream(self) -> ReadBlocks:
        return ReadBlocks(self, BEGIN, END)
