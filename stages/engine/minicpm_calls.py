"""Tool calls in MiniCPM's XML format (SGLang's ``--tool-call-parser minicpm5``)::

    <function name="get_weather"><param name="city">Paris</param></function>
    <function name="note"><param name="text"><![CDATA[two
    lines]]></param></function>

As SGLang 0.5.23 reads them (``function_call/minicpm5_detector.py``, with the standard
library's XML parser, which it uses where ``lxml`` is not installed: SGLang does not require
it; ``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts
where SGLang imports):

- whole (``parse``): each ``<function`` up to the next ``</function>`` is a block, read as XML
  (the function's ``name`` attribute, stripped, and its ``<param name=KEY>`` children, or those
  of its ``<arguments>`` child where it has none), else, where that fails or names nothing, by
  patterns over its text (``<function name="NAME"``, ``<param name="KEY">VALUE</param>``, a
  ``CDATA`` section unwrapped). A value (stripped) is kept as text where its parameter's
  declared type is ``string``, else read as JSON, else as a Python literal, else kept. A block
  is a call when it names a tool offered, its keys are named, are that tool's (where it
  declares properties) and are not repeated, and it has the tool's required keys; any other
  block stays in the content, which is the text outside the calls, as it is. An answer whose
  values cannot be written as JSON (a Python set) has no calls, its text the content.
- streamed (``stream``): the text outside the blocks as it comes (a tail that may begin a block
  waits), each block at its end tag, a call or content: the whole answer's, but where a block's
  values cannot be written as JSON after calls went out (the block is then content). (SGLang's
  stream sends no text after the first call, nor a block that is no call.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ast
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import ReadBlocks
from stages.engine.qwen3_coder_calls import _properties
from stages.engine.tool_formats import _Unreadable, quiet_ast

__all__ = ["MiniCPM5Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<function", "</function>"
_BLOCKS = re.compile(r"<function.*?</function>", re.DOTALL)
_NAME = re.compile(r"<function\s+name=['\"]([^'\"]+)['\"][^>]*>")
_PARAM = re.compile(r"<param\s+name=['\"]([^'\"]+)['\"]>([\s\S]*?)</param>")
_UNNAMED = re.compile(r"<param(?![^>]*\bname=)[^>]*>")
_CDATA = ("<![CDATA[", "]]>")


class MiniCPM5Calls:
    """The calls of answers to one request (``tools``: its tools, their parameters)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.schemas: dict[str, Any] = {}  # the last tool of a name
        for tool in tools:
            fn = tool.get("function") or {}
            if fn.get("name"):
                self.schemas[fn["name"]] = fn.get("parameters") or {}
        self.allowed = {name: set(_properties(s)) for name, s in self.schemas.items()}
        self.required: dict[str, set[Any]] = {}
        for name, schema in self.schemas.items():
            wanted = schema.get("required", []) if isinstance(schema, dict) else []
            try:
                self.required[name] = set(wanted)
            except TypeError:  # not a list of names
                self.required[name] = set()

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        if BEGIN not in text:
            return text, []
        content, calls, last = [], [], 0
        try:
            for match in _BLOCKS.finditer(text):
                content.append(text[last : match.start()])
                call = self.call(match.group())
                if call is None:
                    content.append(match.group())
                else:
                    calls.append(call)
                last = match.end()
        except (_Unreadable, RecursionError) as exc:  # the detector's except Exception
            log.warning("tool_call_unparsed", format="minicpm5", error=str(exc)[:200])
            return text, []
        content.append(text[last:])
        return "".join(content), calls

    def read(self, inner: str) -> dict[str, str] | bool:
        """``ReadBlocks``' reading of a block (``inner``: its text between the tags): its call,
        or False where it is none or its arguments are not JSON (the block is content, as the
        whole answer's text is then)."""
        try:
            return self.call(BEGIN + inner + END) or False
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", format="minicpm5", error=str(exc)[:200])
            return False

    def call(self, block: str) -> dict[str, str] | None:
        """``{name, arguments}`` of a block (from ``<function`` to ``</function>``); None where
        it is no call to a tool offered. ``_Unreadable`` where the arguments are not JSON."""
        state = _Block()
        read = False
        for reading in (self._xml, self._patterns):  # the patterns where the XML fails
            try:
                reading(block, state)
            except Exception:  # the detector's: the next reading, or no call
                continue
            read = bool(state.name)
            if read:
                break
        name, arguments = state.name, state.arguments
        if not read or name not in self.schemas or state.invalid:
            return None
        if not self.required[name].issubset(arguments):
            return None
        try:
            return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
        except (TypeError, ValueError) as exc:
            raise _Unreadable(f"a call's arguments are not JSON: {exc}") from exc

    def _xml(self, block: str, state: _Block) -> None:
        root = ET.fromstring(block)
        node = root if root.tag == "function" else root.find("function")
        if node is None:
            return
        state.name = (node.attrib.get("name") or "").strip()
        params = node.findall("param")
        inner = node.find("arguments")
        if inner is not None and not params:
            params = inner.findall("param")
        pairs = ((p.attrib.get("name"), (p.text or "").strip()) for p in params)
        self._fill(state, pairs, named=True, bad=False)

    def _patterns(self, block: str, state: _Block) -> None:
        found = _NAME.search(block)
        if found:
            state.name = found.group(1).strip()
        pairs = ((m.group(1).strip(), _unwrapped(m.group(2))) for m in _PARAM.finditer(block))
        self._fill(state, pairs, named=False, bad=_UNNAMED.search(block) is not None)

    def _fill(
        self, state: _Block, pairs: Iterable[tuple[Any, str]], named: bool, bad: bool
    ) -> None:
        """Read ``pairs`` (key, text) into the block's arguments up to a key that is not
        ``name``'s (where it declares properties) or repeated, or (``named``: the XML's) has no
        name; where one is, or ``bad`` (a ``<param>`` without a name), the call is invalid and
        its arguments cleared."""
        name, arguments = state.name, state.arguments
        allowed = self.allowed[name] if name in self.schemas else set()
        seen: set[str] = set()
        for key, text in pairs:
            if (named and not key) or (allowed and key not in allowed) or key in seen:
                bad = True
                break
            seen.add(key)
            arguments[key] = text if self._type(name or "", key) == "string" else _value(text)
        if bad:
            arguments.clear()
            state.invalid = True

    def _type(self, name: str, key: str) -> Any:
        """``get_argument_type``: AttributeError where the property is no object."""
        schema = self.schemas.get(name)
        if schema is None or not isinstance(schema, dict):
            return None
        return _properties(schema).get(key, {}).get("type")

    def stream(self) -> ReadBlocks:
        return ReadBlocks(self, BEGIN, END)


class _Block:
    """What the readings of one block found: its name, its arguments (read in place, so that
    what a failed reading read stays), and whether a reading found it invalid."""

    __slots__ = ("arguments", "invalid", "name")

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: dict[str, Any] = {}
        self.invalid = False


def _unwrapped(raw: str) -> str:
    if raw.startswith(_CDATA[0]) and raw.endswith(_CDATA[1]):
        raw = raw[len(_CDATA[0]) : -len(_CDATA[1])]
    return raw.strip()


def _value(text: str) -> Any:
    """``parse_arguments``: JSON, else a Python literal, else the text; what else reading
    raises goes out (the block then is no call)."""
    try:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return quiet_ast(ast.literal_eval, text)
    except (ValueError, SyntaxError, TypeError):
        return text
