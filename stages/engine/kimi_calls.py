"""Tool calls in Kimi K2's format (SGLang's ``--tool-call-parser kimi_k2``):

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{"city": "Paris"}
    <|tool_call_end|><|tool_calls_section_end|>      (no newline before the end token)

As SGLang 0.5.23 reads them (``function_call/kimik2_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``, ``listed``): only an answer with the section marker has calls; the content
  is the text before it, as it is. A call is ``<|tool_call_begin|>``, its id, ``<|tool_call_
  argument_begin|>``, a JSON object's text up to the first ``}`` that the end token follows
  (whitespace allowed around each part), found anywhere in the text. The id names the function
  (``functions.NAME:N`` or ``NAME:N``; the model's ``N`` is a count over the conversation, not
  used); a bare counter (``N``), or no id, leaves the name to the arguments: the only tool
  offered, else the tool whose parameters' properties best match the arguments' keys (matched
  less unmatched; the first of equals); a call whose name is not known so is dropped (logged).
  The name is not checked against the tools (SGLang's detector keeps a call to any), the
  arguments are passed on as the model wrote them, and each call's ``tool_index`` is its place
  among the calls.
- streamed (``stream``): content as it comes (a tail that may begin a marker waits); after the
  section marker a call is named once its id is whole (a bare counter: once its arguments are
  whole, where more than one tool is offered), its arguments go out as they come, the text
  outside the calls is dropped.

In the chat route a call's id is ``functions.NAME:K``, ``K`` counting the calls of the
conversation's assistant messages before it (``serving_chat._process_tool_call_id``), so that
the model sees the ids it was trained on when the calls come back.

Differences from SGLang's stream, which are where its text depends on the deltas or leaks the
format: it reads a call that begins without the section marker (here, as in the whole answer,
there is none), strips the format's tokens out of content, and reads a call that never got a
whole header as content; here the stream gives what the whole answer gives. A call whose text
is not an id and a JSON object is skipped here at its end token, where the whole answer's
pattern may read on into the next call's text.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import MarkedStream
from stages.engine.partial_json import ListedCalls, partial_tail
from stages.engine.qwen3_coder_calls import _properties

__all__ = ["FRAMES", "KimiK2Calls", "history_calls", "kimi_id"]

log = structlog.get_logger("stages.engine.tool_calls")

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BEGIN, ARGUMENTS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_b, _a, _e = re.escape(BEGIN), re.escape(ARGUMENTS), re.escape(END)
_CALL = re.compile(_b + r"\s*(?P<id>[^\s<|]+)\s*" + _a + r"\s*(?P<args>\{.*?\})\s*" + _e, re.DOTALL)
_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_COUNTER = re.compile(r"^\d+$")
# structure_info (tool_calls._FRAMES): before the name, the name as it is, after it, the end, the
# trigger; SGLang's xgrammar has a structural tag of Kimi's own, which llguidance has not
FRAMES = {
    "kimi_k2": (SECTION + BEGIN + "functions.", False, ":0" + ARGUMENTS, END + SECTION_END, SECTION)
}

Pieces = list[dict[str, Any]]


def kimi_id(name: str, index: int) -> str:
    """A Kimi K2 call's id in the chat route (``index``: counted over the conversation)."""
    return f"functions.{name}:{index}"


def history_calls(messages: Any) -> int:
    """How many tool calls the assistant messages of ``messages`` hold
    (``serving_chat._get_history_tool_calls_cnt``)."""
    count = 0
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "assistant":
            calls = message.get("tool_calls")
            count += len(calls) if isinstance(calls, list) else 0
    return count


class KimiK2Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, whose parameters name a call
    that the model left unnamed)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.properties: list[tuple[str, set[str]]] = []
        for tool in tools:
            fn = tool.get("function") or {}
            if "name" in fn:
                self.properties.append((fn["name"], set(_properties(fn.get("parameters") or {}))))

    def has_tool_call(self, text: str) -> bool:
        return SECTION in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(place, call)])``: each call with its place among the calls."""
        at = text.find(SECTION)
        if at == -1:
            return text, []
        calls: list[dict[str, str]] = []
        for match in _CALL.finditer(text):
            name = self.name(match["id"], match["args"])
            if name is not None:
                calls.append({"name": name, "arguments": match["args"]})
        return text[:at], list(enumerate(calls))

    def name(self, call_id: str, arguments: str | None) -> str | None:
        """The function a call's id names (``_resolve_function_name``), or that its arguments
        point to; None (logged) where neither does."""
        named = _ID.match(call_id)
        if named:
            return named["name"]
        if call_id and not _COUNTER.match(call_id):
            log.warning("tool_call_unknown_function", name=call_id[:100])
            return None
        return self.inferred(arguments)

    def inferred(self, arguments: str | None) -> str | None:
        """The tool a call without a name is to (``_infer_tool_name``): the only one, or the one
        whose parameters' properties best match the arguments' keys."""
        if not self.properties:
            return None
        if len(self.properties) == 1:
            return self.properties[0][0]
        try:
            keys = set(json.loads(arguments or ""))
        except (ValueError, TypeError, RecursionError):
            return None
        best, score = None, -1
        for name, properties in self.properties:
            if properties and len(keys & properties) - len(keys - properties) > score:
                best, score = name, len(keys & properties) - len(keys - properties)
        return best

    def stream(self) -> _KimiStream:
        return _KimiStream(self)


class _KimiStream(MarkedStream):
    begin, end = BEGIN, END

    def __init__(self, reader: KimiK2Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent so far
        self.skipped: set[int] = set()  # where calls that name no function begin
        self.names: dict[int, str] = {}  # the calls named so far, by where they begin

    def content(self, text: str) -> tuple[str, int | None]:
        at = text.find(SECTION)
        upto = max(at if at != -1 else len(text) - partial_tail(text, SECTION), self.sent)
        content, self.sent = text[self.sent : upto], upto
        return content, None if at == -1 else at + len(SECTION)

    def rest(self, text: str) -> str:
        out, self.sent = text[self.sent :], len(text)
        return out

    def partial(self, key: int, body: str) -> Pieces:
        """Pieces of the call at ``key`` (``body``: its text after the begin token so far)."""
        split = body.find(ARGUMENTS)
        if split == -1 or key in self.skipped:
            return []
        call_id, raw = body[:split].strip(), body[split + len(ARGUMENTS) :].lstrip()
        name = self._named(key, call_id)
        if name is None:
            return []
        raw = raw[: len(raw) - partial_tail(raw, END)].rstrip()
        return self.pieces.partial(key, name, raw if raw.startswith("{") else None)

    def _named(self, key: int, call_id: str) -> str | None:
        """The name of the call at ``key`` while its arguments come: from its id, or the only
        tool's; None until then (a name its arguments will tell), or for an id of no call."""
        if key in self.names:
            return self.names[key]
        name = None
        if _ID.match(call_id) or (call_id and not _COUNTER.match(call_id)):
            name = self.reader.name(call_id, None)
            if name is None:
                self.skipped.add(key)
        elif len(self.reader.properties) == 1:
            name = self.reader.properties[0][0]
        if name is not None:
            self.names[key] = name
        return name

    def whole(self, key: int, text: str) -> Pieces:
        if key in self.skipped:
            return []
        match = _CALL.fullmatch(text)
        if match is None:
            log.warning("tool_call_unparsed", text=text[:200])
            return []
        name = self.reader.name(match["id"], match["args"])
        if name is None:
            return []
        return self.pieces.whole(key, name, match["args"])
