"""Tool calls in Gemma 4's format (SGLang's ``--tool-call-parser gemma4``)::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,units:[<|"|>C<|"|>]}<tool_call|>

As SGLang 0.5.23 reads them (``function_call/gemma4_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): each ``<|tool_call>`` up to the next ``<tool_call|>`` whose text opens
  ``call:NAME{`` is a call, its arguments up to the brace that closes that one (strings between
  ``<|"|>`` marks do not count; none: all of it). With a call, the content is the text before the
  first ``<|tool_call>``; without one, the whole answer. Calls to tools not offered are kept
  (``tool_index`` -1, as that detector keeps them).
- arguments are Gemma's own notation: ``key:value`` pairs split by commas, a value a string
  between ``<|"|>`` marks, an object in braces, a list in brackets, ``true``/``false``, a number
  (with a ``.``: a float, else an integer), else its text. Its edges are the detector's: a list
  in a list does not mind string marks, a brace or bracket never closed ends the value a
  character early. One difference, on purpose: a ``]`` in a list that closes nothing (left
  there by a bracket never closed) is skipped, where SGLang's reader loops forever.
- streamed (``stream``): content as it comes until the first ``<|tool_call>`` (a tail that may
  begin it waits; the rest waits until a call is whole, so that an answer without one is its
  text as it is), a call named once its ``call:NAME{`` is whole, its arguments once its
  ``<tool_call|>`` comes.

Differences from SGLang's stream: it sends the text between and after the calls as content and
the arguments at their closing brace; here the stream gives what the whole answer gives (a call
cut short before its ``<tool_call|>``: named, no arguments; the whole answer has none).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls, PieceStream, partial_tail

__all__ = ["Gemma4Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_SPACE = (" ", "\n", "\t")
_GAP = (" ", ",", "\n", "\t")

Pieces = list[dict[str, Any]]


def _scalar(text: str) -> Any:
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    try:
        return (float if "." in text else int)(text) if text else text
    except ValueError:
        return text


def _past_quote(text: str, i: int, strict: bool = False) -> int | None:
    """Past the string that opens at ``i`` (a mark there): where its closing mark ends (none:
    the text's end, or None where ``strict``)."""
    close = text.find(QUOTE, i + len(QUOTE))
    if close == -1:
        return None if strict else len(text)
    return close + len(QUOTE)


def _closing(text: str, i: int, opens: str, closes: str, quotes: bool = True) -> int:
    """Past the bracket that closes the one opened at ``i`` (strings skipped where
    ``quotes``); never closed: the text's end."""
    depth, i, n = 1, i + 1, len(text)
    while i < n and depth > 0:
        if quotes and text.startswith(QUOTE, i):
            i = _past_quote(text, i)  # type: ignore[assignment]
            continue
        if text[i] == opens:
            depth += 1
        elif text[i] == closes:
            depth -= 1
        i += 1
    return i


def _string(text: str, i: int) -> tuple[str, int | None]:
    """The string whose mark opens at ``i``, and where it ends (None: never closed, the rest
    of the text is the string)."""
    close = text.find(QUOTE, i + len(QUOTE))
    if close == -1:
        return text[i + len(QUOTE) :], None
    return text[i + len(QUOTE) : close], close + len(QUOTE)


def _list(text: str) -> list[Any]:
    items: list[Any] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in _GAP:
            i += 1
        if i >= n:
            break
        if text.startswith(QUOTE, i):
            value, after = _string(text, i)
            items.append(value)
            if after is None:
                break
            i = after
        elif text[i] == "{":
            end = _closing(text, i, "{", "}")
            items.append(_arguments(text[i + 1 : end - 1]))
            i = end
        elif text[i] == "[":
            end = _closing(text, i, "[", "]", quotes=False)
            items.append(_list(text[i + 1 : end - 1]))
            i = end
        elif text[i] == "]":  # a bracket that closes nothing: SGLang's reader loops forever
            log.warning("gemma4_stray_bracket", text=text[:200])
            i += 1
        else:
            start = i
            while i < n and text[i] not in (",", "]"):
                i += 1
            items.append(_scalar(text[start:i]))
    return items


def _arguments(text: str) -> dict[str, Any]:
    """Gemma's ``key:value,...`` notation as a dict."""
    if not text.strip():
        return {}
    out: dict[str, Any] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in _GAP:
            i += 1
        if i >= n:
            break
        colon = text.find(":", i)
        if colon == -1:
            break
        key, i = text[i:colon].strip(), colon + 1
        while i < n and text[i] in _SPACE:
            i += 1
        if i >= n:
            out[key] = ""
            break
        if text.startswith(QUOTE, i):
            out[key], after = _string(text, i)
            if after is None:
                break
            i = after
        elif text[i] == "{":
            end = _closing(text, i, "{", "}")
            out[key] = _arguments(text[i + 1 : end - 1])
            i = end
        elif text[i] == "[":
            end = _closing(text, i, "[", "]")
            out[key] = _list(text[i + 1 : end - 1])
            i = end
        else:
            start = i
            while i < n and text[i] not in (",", "}", "]"):
                i += 1
            out[key] = _scalar(text[start:i])
    return out


def _call_text(inner: str) -> tuple[str, str] | None:
    """``(name, arguments' text)`` of a block's text (None: not ``call:NAME{``)."""
    brace = inner.find("{") if inner.startswith("call:") else -1
    if brace == -1:
        return None
    depth, i, rest = 1, 0, inner[brace + 1 :]
    while i < len(rest) and depth > 0:
        if rest.startswith(QUOTE, i):
            past = _past_quote(rest, i, strict=True)
            if past is None:  # a string never closed: all of it
                return inner[5:brace], rest
            i = past
            continue
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        i += 1
    return inner[5:brace], rest[: i - 1] if depth == 0 else rest


class Gemma4Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, whose places are the calls'
    ``tool_index``)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.places = {
            (t.get("function") or {}).get("name"): i for i, t in enumerate(tools)
        }  # the last of a name wins, as the detector's

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        if BEGIN not in text:
            return text, []
        try:
            calls = [self.call(name, body) for name, body in _blocks(text)]
        except RecursionError as exc:  # the detector raises
            log.warning("tool_call_unreadable", format="gemma4", error=str(exc))
            return text, []
        if not calls:
            return text, []
        return text[: text.find(BEGIN)], calls

    def call(self, name: str, body: str) -> tuple[int, dict[str, str]]:
        arguments = json.dumps(_arguments(body), ensure_ascii=False)
        return self.places.get(name, -1), {"name": name, "arguments": arguments}

    def stream(self) -> _Gemma4Stream:
        return _Gemma4Stream(self)


def _blocks(text: str, start: int = 0) -> list[tuple[str, str]]:
    """The ``(name, arguments' text)`` of each whole block from ``start`` on."""
    out = []
    while True:
        begin = text.find(BEGIN, start)
        end = -1 if begin == -1 else text.find(END, begin)
        if end == -1:
            return out
        found = _call_text(text[begin + len(BEGIN) : end])
        if found is not None:
            out.append(found)
        start = end + len(END)


class _Gemma4Stream(PieceStream):
    """A sample's text deltas in, content to send now and pieces of its calls out."""

    def __init__(self, reader: Gemma4Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent: the text's first characters
        self.first: int | None = None  # where the first block begins
        self.called = False  # a call is whole: the content is the text before the first block
        self.pos = 0  # the blocks are read from here

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content, pieces = self.text, "", []
        if self.first is None:
            at = text.find(BEGIN)
            safe = len(text) - partial_tail(text, BEGIN) if at == -1 else at
            content, self.sent = text[self.sent : safe], safe
            if at == -1:
                return content, []
            self.first = self.pos = at
        while True:
            begin = text.find(BEGIN, self.pos)
            if begin == -1:
                return content, pieces
            inner = text[begin + len(BEGIN) :]
            brace = inner.find("{") if inner.startswith("call:") else -1
            end = text.find(END, begin)
            if brace != -1 and (end == -1 or begin + len(BEGIN) + brace < end):
                pieces += self.pieces.partial(begin, inner[5:brace], None)  # named
            if end == -1:
                return content, pieces
            found = _call_text(text[begin + len(BEGIN) : end])
            if found is not None:
                try:
                    _, call = self.reader.call(*found)
                except RecursionError:  # the whole answer reads no calls then
                    call = None
                if call is not None:
                    pieces += self.pieces.whole(begin, call["name"], call["arguments"])
                    self.called = True
            self.pos = end + len(END)

    def flush(self) -> str:
        """At the end, no call having been whole: what waited is content."""
        if self.called:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
