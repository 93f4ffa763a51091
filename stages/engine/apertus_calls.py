"""Tool calls in Apertus's format (SGLang's ``--tool-call-parser apertus2509``)::

    <|tools_prefix|>[{"get_weather": {"city": "Paris"}}, {"get_time": {}}]<|tools_suffix|>

As SGLang 0.5.23 reads them (``function_call/apertus2509_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``listed``): each ``<|tools_prefix|>[`` begins a JSON value (Python's JSON: NaN too;
  one that is not a list is a list of it) whose items are calls, each an object whose first key
  names the tool and whose value is its arguments (none: ``{}``); the block ends at the next
  ``<|tools_suffix|>`` after the value (text between is dropped). A value that is not JSON, or
  without that suffix, makes the rest of the answer content. Items that are not objects are
  skipped, calls to tools not offered dropped (logged); calls are numbered in order. The content
  is the text outside the blocks, joined and stripped.
- streamed (``stream``): content as it comes (stripped as the whole answer's; a tail that may
  begin the prefix waits), each block's calls once its suffix comes; a block that is not JSON
  holds the rest back to the end, when it is content, as the whole answer has it.
- ``tool_choice`` ``required`` or named: the structural tag of the detector's
  ``structure_info`` (``<|tools_prefix|>[{"NAME": `` ... ``}]<|tools_suffix|>``).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from stages.engine.marked_stream import OutsideText
from stages.engine.partial_json import ListedCalls, PieceStream, partial_tail
from stages.engine.tool_formats import MarkedCalls

__all__ = ["FRAMES", "ApertusCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<|tools_prefix|>[", "<|tools_suffix|>"
# structure_info (tool_calls._FRAMES): before the name, the name as JSON, after it, the end,
# the trigger
FRAMES = {"apertus2509": ('<|tools_prefix|>[{"', False, '": ', "}]<|tools_suffix|>",
                          "<|tools_prefix|>")}  # fmt: skip
_DECODER = json.JSONDecoder()

Pieces = list[dict[str, Any]]


class ApertusCalls(MarkedCalls, ListedCalls):
    """The calls of answers to one request (``names``: the tools offered)."""

    marker = BEGIN

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        if BEGIN not in text:
            return text, []
        content, calls, at = [], [], 0
        while (block := self.block(text, at)) is not None:
            start, items, end = block
            content.append(text[at:start])
            calls += [(len(calls) + i, call) for i, call in enumerate(self.calls(items))]
            at = end
        content.append(text[at:])  # after the last block; from a block that is not, all of it
        return "".join(content).strip(), calls

    def block(self, text: str, at: int) -> tuple[int, list[Any], int] | None:
        """``(where it begins, its items, where its suffix ends)`` of the first block from
        ``at``; None where there is none, or it is not JSON, or it has no suffix."""
        start = text.find(BEGIN, at)
        if start == -1:
            return None
        try:
            value, end = _DECODER.raw_decode(text, start + len(BEGIN) - 1)
        except ValueError:
            return None
        suffix = text.find(END, end)
        if suffix == -1:
            return None
        return start, value if isinstance(value, list) else [value], suffix + len(END)

    def calls(self, items: list[Any]) -> list[dict[str, str]]:
        out = []
        for item in items:
            if not isinstance(item, dict) or not item:
                continue
            name = next(iter(item))
            if name not in self.names:
                log.warning("tool_call_unknown_function", name=name[:100])
                continue
            arguments = item[name] if item[name] is not None else {}
            out.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
        return out

    def stream(self) -> _ApertusStream:
        return _ApertusStream(self)


class _ApertusStream(PieceStream):
    def __init__(self, reader: ApertusCalls) -> None:
        super().__init__()
        self.reader = reader
        self.content = OutsideText()
        self.shown = ""  # the content sent
        self.pos = 0  # where the text not yet read begins

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content, pieces = self.text, "", []
        while True:
            start = text.find(BEGIN, self.pos)
            if start == -1:
                upto = len(text) - partial_tail(text[self.pos :], BEGIN)
                content += self.content.more(text[self.pos : upto])
                self.pos = upto
                break
            content += self.content.more(text[self.pos : start])
            self.content.called = True
            self.pos = start
            block = self.reader.block(text, start)
            if block is None:  # not whole yet, or never: it waits (the end says which)
                break
            _, items, self.pos = block
            for call in self.reader.calls(items):
                pieces += self.pieces.whole(self.pieces.count, call["name"], call["arguments"])
        self.shown += content
        return content, pieces

    def flush(self) -> str:
        """The rest of the whole answer's content (space it stripped may have gone out first,
        as SGLang's stream sends it)."""
        final = self.reader.parse(self.text)[0]
        shown = self.shown.lstrip() if BEGIN in self.text else self.shown
        if not final.startswith(shown):  # cannot be: the content so far is its start
            log.warning("tool_call_content_diverged", sent=shown[:200], whole=final[:200])
            return ""
        self.shown += final[len(shown) :]
        return final[len(shown) :]
