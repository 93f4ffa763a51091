"""Tool calls in MiniMax-M3's format (SGLang's ``--tool-call-parser minimax-m3``), each tag led
by the namespace marker ``]<]minimax[>[`` (``NS``)::

    NS<tool_call>
    NS<invoke name="search">
    NS<query>weather in Shanghai NS</query>
    NS<filters>NS<item>news NS</item>NS<item>web NS</item>NS</filters>
    NS</invoke>
    NS</tool_call>

A parameter is an element named by its key; its value is the element's text, or, nested, an
object of elements (an array where its schema says so or its children are ``<item>``).

As SGLang 0.5.23 reads them (``function_call/minimax_m3.py``, ``MinimaxM3Detector``;
``tests/stages/test_engine_sglang_minimax_m3.py`` holds this module to it on random texts where
SGLang imports):

- the whole text first loses the whitespace between a marker and the ``<`` after it;
- whole (``parse``): the content is the text outside the blocks ``NS<tool_call>`` ...
  ``NS</tool_call>``, joined as it is (not stripped), a block never closed and what follows it
  content too. In a block, each ``NS<invoke name="NAME">`` ... ``NS</invoke>`` is a call (one
  without ``">`` after its name is passed over); its body, split at the markers, is a tree of
  elements: an opening tag with text is a leaf (or one whose schema is a scalar type), read by
  its schema (``value``), else an object or array; a closing tag hands the element to its
  parent (a key met twice becomes a list); text outside the tags is passed over, elements never
  closed are lost. The schemas come from the tool's ``parameters`` through ``properties`` (and
  ``anyOf``/``oneOf``/``allOf``'s), ``additionalProperties``, an array's ``prefixItems``,
  ``additionalItems`` and ``items``. Calls to tools not offered are dropped (logged), unless
  the request has no tools at all: this format reads calls without them
  (``parses_without_tools``: ``PARSES_WITHOUT_TOOLS``). A body that cannot be read (a closing
  tag that does not close the open element, an opening tag without ``>``, an element inside a
  leaf, a number too large for an integer) leaves the whole answer as it came, without calls.
  ``/parse_function_call`` numbers each call by its place in its block.
- streamed (``stream``): the text outside the blocks as it comes (a tail that may begin a block
  waits), each block's calls whole at its end tag, a block never closed content at the end: the
  whole answer's. (SGLang streams a call's arguments as they come; an answer whose whole
  reading fails has, in the stream, the calls of the blocks before the failing one, whose text
  goes out as content.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import BlockStream
from stages.engine.partial_json import ListedCalls, partial_tail
from stages.engine.qwen3_coder_calls import _properties

__all__ = ["BEGIN", "NS", "PARSES_WITHOUT_TOOLS", "MiniMaxM3Calls", "normalized"]

log = structlog.get_logger("stages.engine.tool_calls")

NS = "]<]minimax[>["
BEGIN, END = NS + "<tool_call>", NS + "</tool_call>"
INVOKE, INVOKE_END = NS + '<invoke name="', NS + "</invoke>"
# the --tool-call-parser names whose calls are read in a request without tools
PARSES_WITHOUT_TOOLS = frozenset({"minimax-m3"})
_SPACING = re.compile(re.escape(NS) + r"[ \t\r\n]+(?=<)")
_STRINGS, _INTEGERS = {"string", "str"}, {"integer", "int"}
_NUMBERS, _BOOLEANS = {"number", "float"}, {"boolean", "bool"}
_SCALARS = _STRINGS | _INTEGERS | _NUMBERS | _BOOLEANS | {"null"}
_CONTAINERS = {"object", "array"}
_NULLS = ("null", "Null", "NULL")  # exactly these: "none" may be a string's value
_LITERALS = {"true": True, "false": False, "null": None}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

Pieces = list[dict[str, Any]]


class _Unreadable(ValueError):
    """A body the detector's reading raises on: the whole answer is then content."""


def normalized(text: str) -> str:
    """``text`` without the whitespace between a marker and the tag after it."""
    return _SPACING.sub(NS, text)


class MiniMaxM3Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, their parameters' schemas;
    none: every call is kept as the model named it)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.schemas: dict[Any, Any] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            self.schemas.setdefault(fn.get("name"), fn.get("parameters"))  # the first of a name

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in normalized(text)

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        flat = normalized(text)
        content, calls, at = [], [], 0
        try:
            while (start := flat.find(BEGIN, at)) != -1:
                content.append(flat[at:start])
                stop = flat.find(END, start)
                if stop == -1:
                    break
                calls += self.block(flat[start + len(BEGIN) : stop])
                at = stop + len(END)
            else:
                start = at
        except _Unreadable as exc:  # out of the detector: detect_and_parse's except
            log.warning("tool_call_unparsed", format="minimax-m3", error=str(exc)[:200])
            return text, []
        content.append(flat[start:])
        return "".join(content), calls

    def block(self, body: str) -> list[tuple[int, dict[str, str]]]:
        """The calls of one block (``body``: its text between the tags), each with its place
        in it; _Unreadable where a call's body cannot be read."""
        calls: list[tuple[int, dict[str, str]]] = []
        at = 0
        while (start := body.find(INVOKE, at)) != -1 and (
            stop := body.find(INVOKE_END, start)
        ) != -1:
            at = stop + len(INVOKE_END)
            name_end = body.find('">', start + len(INVOKE), stop)
            if name_end == -1:
                continue
            name = body[start + len(INVOKE) : name_end]
            schema = self.schemas.get(name)
            arguments = _tree(
                body[name_end + 2 : stop], schema if isinstance(schema, dict) else None
            )
            if self.schemas and (not name or name not in self.schemas):
                log.warning("tool_call_unknown_function", name=name[:100])
                continue
            text = json.dumps(arguments, ensure_ascii=False)
            calls.append((len(calls), {"name": name, "arguments": text}))
        return calls

    def stream(self) -> _MiniMaxM3Stream:
        return _MiniMaxM3Stream(self)


# ---- a call's body as a tree of elements (MinimaxM3Detector._parse_parameter) -----------------


def _types(schema: Any) -> set[str]:
    """A schema's ``type``, lowercased, as a set (none: empty)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind.lower()}
    if isinstance(kind, list):
        return {k.lower() for k in kind if isinstance(k, str)}
    return set()


def _untyped(schema: Any) -> bool:
    """Nothing to read children by: no schema, or one with no type, properties or items."""
    if not isinstance(schema, dict):
        return True
    return not _types(schema) and not any(
        k in schema for k in ("properties", "items", "prefixItems")
    )


def _child_schema(parent: Any, tag: str, value: Any) -> dict[str, Any] | None:
    """The schema of ``parent``'s child ``tag`` (``value``: the parent's value so far, whose
    length places an array's next item)."""
    if not isinstance(parent, dict):
        return None
    if "array" in _types(parent) and tag == "item":
        place = len(value) if isinstance(value, list) else 0
        prefix = parent.get("prefixItems")
        if isinstance(prefix, list) and place < len(prefix):
            return prefix[place] if isinstance(prefix[place], dict) else None
        for key in ("additionalItems", "items"):
            if isinstance(parent.get(key), dict):
                return parent[key]
        if isinstance(prefix, list) and prefix:
            return prefix[-1] if isinstance(prefix[-1], dict) else None
        return None
    properties = _properties(parent)
    if tag in properties:
        return properties[tag] if isinstance(properties[tag], dict) else None
    extra = parent.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def value(text: str, schema: Any) -> Any:
    """A leaf's text read by its schema (``_convert_leaf_value``): untyped, only JSON's
    literals; a string kept; where null is allowed, ``null`` (any of three cases) or nothing
    None; then an integer, a number (whole: an integer), a boolean's spellings, as the types
    allow; else the text."""
    if _untyped(schema):
        return _LITERALS.get(text.strip(), text)
    types = _types(schema)
    nullable = "null" in types
    if types & _STRINGS and not nullable:
        return text
    if nullable and (text in _NULLS or text == ""):
        return None
    if types & _INTEGERS:
        try:
            return int(text)
        except ValueError:
            pass
    if types & _NUMBERS:
        try:
            number = float(text)
            return number if number != int(number) else int(number)
        except ValueError:
            pass
        except OverflowError as exc:  # infinity: the detector's int() raises out of it
            raise _Unreadable(f"number out of range: {text[:50]!r}") from exc
    if types & _BOOLEANS:
        lowered = text.lower().strip()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    return text


class _Element:
    """An element being read: its tag, schema and value, and whether its value is a list only
    because its first child was an ``<item>`` (no schema said so)."""

    __slots__ = ("inferred", "schema", "tag", "value")

    def __init__(self, tag: str, schema: Any, value: Any) -> None:
        self.tag, self.schema, self.value, self.inferred = tag, schema, value, False

    def infer(self, child: str) -> None:
        """An untyped element's shape from its child ``child``: a first ``<item>`` makes it a
        list; a named child after that folds the items back under ``item``."""
        if child == "item":
            if isinstance(self.value, dict) and not self.value:
                self.value, self.inferred = [], True
        elif self.inferred:
            self.value = {"item": self.value[0] if len(self.value) == 1 else self.value}
            self.inferred = False

    def add(self, tag: str, child: Any) -> None:
        """``child`` under this element as ``tag`` (a key met again: a list of them)."""
        if isinstance(self.value, list):
            self.value.append(child)
        elif not isinstance(self.value, dict):
            raise _Unreadable(f"element <{tag}> inside a value")
        elif tag in self.value:
            held = self.value[tag]
            if isinstance(held, list):
                held.append(child)
            else:
                self.value[tag] = [held, child]
        else:
            self.value[tag] = child


def _tree(body: str, schema: dict[str, Any] | None) -> Any:
    """A call's arguments from its body (its text after the name's ``">``)."""
    pieces = [p.strip() for p in body.split(NS)]
    pieces = [p for p in pieces if p]
    listed = "array" in _types(schema) and bool(pieces) and pieces[0].startswith("<item>")
    stack = [_Element("", schema, [] if listed else {})]
    for piece in pieces:
        if piece.startswith("</"):
            gt = piece.find(">", 2)
            tag = (piece[2:gt] if gt != -1 else piece[2:]).strip()
            if len(stack) == 1:
                raise _Unreadable(f"unexpected closing tag: {tag[:50]}")
            if stack[-1].tag != tag:
                raise _Unreadable(f"mismatched closing tag: {tag[:50]}")
            done = stack.pop()
            stack[-1].add(done.tag, done.value)
        elif piece.startswith("<"):
            gt = piece.find(">")
            if gt == -1:
                raise _Unreadable(f"tag without '>': {piece[:50]!r}")
            tag, text = piece[1:gt].strip(), piece[gt + 1 :]
            parent = stack[-1]
            if _untyped(parent.schema):
                parent.infer(tag)
            child = _child_schema(parent.schema, tag, parent.value)
            kinds = _types(child)
            if text or (kinds & _SCALARS and not kinds & _CONTAINERS):
                stack.append(_Element(tag, child, value(text, child)))
            else:
                stack.append(_Element(tag, child, [] if "array" in kinds else {}))
    return stack[0].value


# ---- streams -----------------------------------------------------------------------------------


class _MiniMaxM3Stream(BlockStream):
    begin, end = BEGIN, END

    def __init__(self, reader: MiniMaxM3Calls) -> None:
        super().__init__()
        self.reader = reader
        self.raw = ""  # text not yet normalized: a marker whose tag may follow, or part of one

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.raw += delta
        last = self.raw.rfind(NS)
        if last != -1 and not self.raw[last + len(NS) :].strip(" \t\r\n"):
            keep = len(self.raw) - last
        else:
            keep = partial_tail(self.raw, NS)
        ready, self.raw = self.raw[: len(self.raw) - keep], self.raw[len(self.raw) - keep :]
        return super().feed(normalized(ready))

    def outside(self, text: str, block_next: bool) -> str:
        return text

    def closed(self, key: int, block: str) -> tuple[str, Pieces]:
        try:
            calls = self.reader.block(block[len(BEGIN) : -len(END)])
        except _Unreadable as exc:  # (the whole answer is then all content, without calls)
            log.warning("tool_call_unparsed", format="minimax-m3", error=str(exc)[:200])
            return block, []
        pieces: Pieces = []
        for i, call in calls:
            pieces += self.pieces.whole((key, i), call["name"], call["arguments"])
        return "", pieces

    def flush(self) -> str:
        # what waited on a marker (no block ends in it: the tag after the marker is missing)
        content, _ = super().feed(normalized(self.raw))
        self.raw = ""
        rest, self.pos = self.text[self.pos :], len(self.text)
        return content + rest
