"""Tool calls in InternLM2's and Intern-S1's format (SGLang's ``--tool-call-parser interns1``)::

    What's the weather?<|action_start|> <|plugin|>
    {"name": "get_weather", "parameters": {"city": "Tokyo"}}<|action_end|>

As SGLang 0.5.23 reads them (``function_call/internlm_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): each block from ``<|action_start|> <|plugin|>`` to the next
  ``<|action_end|>`` holds one JSON object, ``name`` and ``parameters`` (or ``arguments``; none
  or empty: ``{}``); with a block, the content is the text before the first marker, stripped,
  and each call to a tool offered is read (a block that is not JSON is skipped, a call to
  another tool dropped); a block that is JSON but not an object (or whose name is not a
  string...) leaves the whole answer unread, its text the content (the detector's catch-all),
  as does a marker never closed. Each call's ``tool_index`` is its tool's place.
- streamed (``stream``): content as it comes (an answer that opens with space waits, as the
  whole answer strips it only where calls follow; so do a last run of space and a tail that may
  begin the marker), then each call whole once its block closes.

Differences from SGLang's stream, which are where its text depends on the deltas: it drops
``<|action_end|>`` from content and reads calls one block a delta; here the stream gives what
the whole answer gives (but where a later block makes the whole answer unread, the calls before
it have gone out).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, partial_tail
from stages.engine.tool_formats import MarkedCalls, _Unreadable

__all__ = ["FRAMES", "InternlmCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<|action_start|> <|plugin|>", "<|action_end|>"
_BLOCKS = re.compile(re.escape(BEGIN) + r"\s*(.*?)" + re.escape(END), re.DOTALL)
# structure_info (tool_calls._FRAMES): before the name, the name as JSON, after it, the end,
# the trigger
FRAMES = {"interns1": (BEGIN + '\n{"name": ', True, ', "parameters": ', "}" + END, BEGIN)}

Pieces = list[dict[str, Any]]


class InternlmCalls(MarkedCalls):
    """The calls of answers to one request (``names``: its tools')."""

    marker = BEGIN

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        bodies = _BLOCKS.findall(text)
        if not bodies:
            return text, []
        try:
            calls = [call for call in map(self.call, bodies) if call is not None]
        except _Unreadable as exc:
            log.warning("tool_call_unreadable", format="interns1", error=str(exc))
            return text, []
        return text[:at].strip(), calls

    def call(self, body: str) -> dict[str, str] | None:
        """A block's call (None, logged: not JSON, or a call to a tool not offered;
        _Unreadable: JSON that is not a call's object)."""
        try:
            action = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            log.warning("tool_call_unparsed", format="interns1", error=str(exc))
            return None
        except (ValueError, RecursionError) as exc:
            raise _Unreadable(str(exc)) from exc
        if not isinstance(action, dict):
            raise _Unreadable(f"a call is a JSON object, not {type(action).__name__}")
        name = action.get("name")
        if "parameters" in action:
            arguments = action["parameters"]
        else:
            arguments = action.get("arguments")
        if name and isinstance(name, list | dict):  # not a key: the detector raises
            raise _Unreadable(f"a call's name is not a string: {name!r}")
        if not (name and name in self.names):
            log.warning("tool_call_unknown_tool", format="interns1", name=name)
            return None
        return {"name": str(name), "arguments": json.dumps(arguments or {}, ensure_ascii=False)}

    def stream(self) -> _InternlmStream:
        return _InternlmStream(self)


class _InternlmStream(PieceStream):
    """A sample's text deltas in, content to send now and whole calls out."""

    def __init__(self, reader: InternlmCalls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent: the text's first characters
        self.pos: int | None = None  # the calls are read from here (None: no block closed yet)

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text = self.text
        if self.pos is None:
            at = text.find(BEGIN)
            if at == -1 or _BLOCKS.search(text, at) is None:
                return self._content(text, at), []
            self.pos = at  # a block closed: the content is the text before it, stripped
            content = text[:at].strip()[self.sent :]
        else:
            content = ""
        pieces: Pieces = []
        for match in _BLOCKS.finditer(text, self.pos):
            try:
                call = self.reader.call(match.group(1))
            except _Unreadable as exc:  # the whole answer reads no calls then
                log.warning("tool_call_unreadable", format="interns1", error=str(exc))
                call = None
            if call is not None:
                pieces += self.pieces.whole(match.start(), call["name"], call["arguments"])
            self.pos = match.end()
        return content, pieces

    def _content(self, text: str, at: int) -> str:
        """Content while no block has closed: the text but from the marker (or a tail that may
        begin it) and a last run of space; none while the answer opens with space."""
        if not text[:1].strip():
            return ""  # the whole answer strips it only if calls come: wait
        safe = at if at != -1 else len(text) - partial_tail(text, BEGIN)
        safe = len(text[:safe].rstrip())
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def flush(self) -> str:
        """At the end, no block having closed: the text as it is (what waited)."""
        if self.pos is not None:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
