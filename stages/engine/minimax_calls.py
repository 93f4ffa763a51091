"""Tool calls in MiniMax-M2's format (SGLang's ``--tool-call-parser minimax-m2``)::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">2</parameter>
    </invoke>
    </minimax:tool_call>

As SGLang 0.5.23 reads them (``function_call/minimax_m2.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): each block from ``<minimax:tool_call>`` to the next
  ``</minimax:tool_call>`` holds calls; a block never closed, and all text outside the blocks,
  is the content, as it is. In a block every ``<invoke name="NAME">`` up to ``</invoke>`` (or
  the block's end) is a call, and in its body every ``<parameter name="KEY">`` up to
  ``</parameter>`` (or the end) an argument, its newlines trimmed at both ends. A call to a tool
  the request did not offer is dropped (logged); each call's ``tool_index`` is its tool's place.
- a value is typed by its parameter's schema (``type``, a list of types, ``enum`` values'
  types, ``anyOf``/``oneOf``/``allOf``; a parameter not declared: a string), trying integer,
  number (whole numbers as integers), boolean (``true``/``1``/``yes``/``on`` and their
  opposites), object and array (JSON), then string, in that order, else JSON, else the text;
  ``null`` (any case), ``none`` and ``nil`` are null.
- streamed (``stream``): content as it comes (a tail that may begin the block's tag waits), a
  call named once its ``<invoke name="NAME">`` is whole, its arguments in pieces as each
  parameter closes, the rest at ``</invoke>``: the pieces add up to the whole answer's call.

Differences from SGLang, on purpose: a parameter whose type allows null is null only when its
value says so (SGLang's makes every such value null, so an ``Optional[int]`` argument is always
lost); SGLang's stream writes arguments in its own order and spacing, sends ``""`` for a call
without parameters, and a call to an unknown tool as content, where here the stream gives what
the whole answer gives. A block cut short (no ``</minimax:tool_call>``): its calls have
streamed, where the whole answer reads that block as content (SGLang's stream and whole answer
differ the same way). A key given twice: the whole answer keeps the last value, the stream may
have sent the first.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, partial_tail
from stages.engine.qwen3_coder_calls import _properties
from stages.engine.tool_formats import _Unreadable

__all__ = ["MiniMaxM2Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BLOCK, BLOCK_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = '<invoke name="', "</invoke>"
PARAMETER_END = "</parameter>"
_INVOKES = re.compile(r"<invoke name=\"(.*?)</invoke>|<invoke name=\"(.*)$", re.DOTALL)
_PARAMETERS = re.compile(r"<parameter name=\"(.*?)</parameter>|<parameter name=\"(.*?)$", re.DOTALL)
_NULLS = ("null", "none", "nil")
# the types tried, in this order (the first that reads the value wins)
_ORDER = ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string",
          "str", "text")  # fmt: skip
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))  # fmt: skip

Pieces = list[dict[str, Any]]


def _types(schema: Any) -> set[str]:
    """The types a parameter's schema allows (none found: a string)."""
    if not isinstance(schema, dict):
        return {"string"}
    found: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(k for k in kind if isinstance(k, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            if value is None:
                found.add("null")
            else:
                found.update(name for cls, name in _ENUM_TYPES if type(value) is cls)
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) if isinstance(schema.get(keyword), list) else ():
            found |= _types(branch)
    return found or {"string"}


def _typed(value: str, types: set[str]) -> Any:
    """``value`` read as the first of ``_ORDER`` among ``types`` that reads it; else JSON, else
    the text. _Unreadable where SGLang's conversion raises (an infinite number)."""
    if value.lower() in _NULLS:
        return None
    kinds = {t.lower() for t in types}
    for kind in _ORDER:
        if kind not in kinds:
            continue
        if kind in ("string", "str", "text"):
            return value
        try:
            if kind in ("integer", "int"):
                return int(value)
            if kind in ("number", "float"):
                number = float(value)
                return number if number != int(number) else int(number)
        except (ValueError, TypeError):
            continue
        except OverflowError as exc:  # int(inf): SGLang's detector raises
            raise _Unreadable(str(exc)) from exc
        if kind in ("boolean", "bool"):
            word = value.lower().strip()
            if word in ("true", "1", "yes", "on"):
                return True
            if word in ("false", "0", "no", "off"):
                return False
            continue
        try:  # object, array
            return json.loads(value)
        except json.JSONDecodeError:
            continue
        except (ValueError, RecursionError) as exc:
            raise _Unreadable(str(exc)) from exc
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
    except (ValueError, RecursionError) as exc:
        raise _Unreadable(str(exc)) from exc


def _pairs(body: str) -> list[tuple[str, str]]:
    """The ``(key, raw value)`` arguments of an invoke's ``body``."""
    out = []
    for closed, rest in _PARAMETERS.findall(body):
        raw = closed or rest
        if '">' in raw:
            key, value = raw.split('">', 1)
            out.append((key.strip(), value.strip("\n")))
    return out


class MiniMaxM2Calls:
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.names: set[str] = set()
        self.params: dict[str, dict[str, Any]] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            if "name" not in fn:
                continue
            self.names.add(fn["name"])
            if isinstance(fn.get("parameters"), dict) and fn["name"] not in self.params:
                self.params[fn["name"]] = _properties(fn["parameters"])

    def has_tool_call(self, text: str) -> bool:
        return BLOCK in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        content, calls, cursor = [], [], 0
        try:
            while True:
                start = text.find(BLOCK, cursor)
                if start == -1:
                    content.append(text[cursor:])
                    break
                content.append(text[cursor:start])
                end = text.find(BLOCK_END, start)
                if end == -1:  # never closed: content
                    content.append(text[start:])
                    break
                cursor = end + len(BLOCK_END)
                for closed, rest in _INVOKES.findall(text[start:cursor]):
                    call = self.call(closed or rest)
                    if call is not None:
                        calls.append(call)
        except _Unreadable as exc:
            log.warning("tool_call_unreadable", format="minimax-m2", error=str(exc))
            return text, []
        return "".join(content), calls

    def call(self, invoke: str) -> dict[str, str] | None:
        """The call an invoke's text (after ``<invoke name="``) makes; None: not a call to a
        tool offered (logged)."""
        if '">' not in invoke:
            return None
        name, body = invoke.split('">', 1)
        name = name.strip()
        if name not in self.names:
            log.warning("tool_call_unknown_tool", format="minimax-m2", name=name)
            return None
        return {
            "name": name,
            "arguments": json.dumps(self.arguments(name, body), ensure_ascii=False),
        }

    def arguments(self, name: str, body: str) -> dict[str, Any]:
        config = self.params.get(name, {})
        return {key: _typed(value, _types(config[key]) if key in config else {"string"})
                for key, value in _pairs(body)}  # fmt: skip

    def stream(self) -> _MiniMaxStream:
        return _MiniMaxStream(self)


class _MiniMaxStream(PieceStream):
    """A sample's text deltas in, content to send now and pieces of its calls out."""

    def __init__(self, reader: MiniMaxM2Calls) -> None:
        super().__init__()
        self.reader = reader
        self.pos = 0  # what is read so far
        self.inside = False  # within a block
        self.invoke: tuple[int, str, int] | None = None  # the call begun: (key, name, body at)

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content, pieces = self.text, [], []
        while True:
            if not self.inside:
                at = text.find(BLOCK, self.pos)
                if at == -1:
                    keep = partial_tail(text[self.pos :], BLOCK)
                    content.append(text[self.pos : len(text) - keep])
                    self.pos = len(text) - keep
                    break
                content.append(text[self.pos : at])
                self.pos, self.inside = at + len(BLOCK), True
            elif self.invoke is None:
                if not self._begin(text, pieces):
                    break
            elif not self._end(text, pieces):
                break
        return "".join(content), pieces

    def _begin(self, text: str, pieces: Pieces) -> bool:
        """The next invoke's name, or the block's end; False: not in the text yet."""
        at, end = text.find(INVOKE, self.pos), text.find(BLOCK_END, self.pos)
        if end != -1 and (at == -1 or end < at):
            self.pos, self.inside = end + len(BLOCK_END), False
            return True
        if at == -1:
            return False
        limit = len(text) if end == -1 else end  # the block's text
        close, stop = text.find('">', at, limit), text.find(INVOKE_END, at, limit)
        if stop != -1 and (close == -1 or stop < close):  # no name: not a call
            self.pos = stop + len(INVOKE_END)
            return True
        if close == -1:
            if end != -1:  # no name before the block ends: not a call
                self.pos = end
                return True
            return False
        name = text[at + len(INVOKE) : close].strip()
        self.invoke = (at, name, close + 2)
        if name in self.reader.names:
            pieces += self.pieces.partial(at, name, None)
        return True

    def _end(self, text: str, pieces: Pieces) -> bool:
        """The arguments of the invoke begun, so far or whole; False: not whole yet."""
        key, name, body_at = self.invoke  # type: ignore[misc]
        stop, end = text.find(INVOKE_END, body_at), text.find(BLOCK_END, body_at)
        known = name in self.reader.names
        if stop == -1 and end == -1:  # still being written: its closed parameters
            last = text.rfind(PARAMETER_END, body_at)
            if known and last != -1:
                closed = text[body_at : last + len(PARAMETER_END)]
                arguments = json.dumps(self._arguments(name, closed), ensure_ascii=False)
                pieces += self.pieces.partial(key, name, arguments)
            return False
        if end != -1 and (stop == -1 or end < stop):  # it ends with its block
            body, self.pos, self.inside = text[body_at : end + len(BLOCK_END)], end, True
        else:
            body, self.pos = text[body_at:stop], stop + len(INVOKE_END)
        if known:
            arguments = json.dumps(self._arguments(name, body), ensure_ascii=False)
            pieces += self.pieces.whole(key, name, arguments)
        self.invoke = None
        return True

    def _arguments(self, name: str, body: str) -> dict[str, Any]:
        try:
            return self.reader.arguments(name, body)
        except _Unreadable:  # a value SGLang cannot read: its text
            return {key: value for key, value in _pairs(body)}

    def flush(self) -> str:
        if self.inside:
            log.warning(
                "tool_call_incomplete", format="minimax-m2", text=self.text[self.pos :][:200]
            )
            return ""
        left, self.pos = self.text[self.pos :], len(self.text)
        return left
