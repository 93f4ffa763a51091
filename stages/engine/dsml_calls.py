"""Tool calls in DeepSeek V3.2's DSML format (SGLang's ``--tool-call-parser deepseekv32``)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

(an invoke's body may instead be a JSON object; ``<｜DSML｜invoke name="now"/>`` has none).
As SGLang 0.5.23 reads them (``function_call/deepseekv32_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): with the block marker, the content is the text before it less one blank
  line, and the calls are the invokes inside each closed block (a block never closed: none);
  without it, invokes from the first one on, the content the text before the first DSML tag.
  An invoke never closed is dropped; so is one whose parameters do not read (a ``string="true"``
  value is its text, stripped; any other is JSON, else its text; a body that is JSON must be an
  object, without ``NaN``; text that is not a parameter tag, or a DSML tag that is not one, in
  the body), and a call to a tool not offered. Each call's ``tool_index`` is its tool's place.
- streamed (``stream``): content as it comes until the first DSML tag (a tail that may begin
  one, and a last blank line, wait), then each call whole (name and arguments in one piece) once
  its invoke closes.

Differences from SGLang: its stream holds back the content after the first line that might be
DSML and releases what its rules allow, here content is what the whole answer has, sent as it
comes. Streamed, an invoke that closes is read whether or not its block closes later (as
SGLang's stream reads it; SGLang's whole answer reads no call of a block never closed), and
invokes before a first block marker are read as calls though a block comes after them (the
whole answer then reads only the blocks). A forced ``tool_choice`` is held to the detector's
``structure_info`` frame (an invoke whose body is JSON), where SGLang asks xgrammar for V3.2's
own tag (parameter tags in a block).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, partial_tail

__all__ = ["BLOCK", "FRAMES", "DeepSeekV32Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

DSML = "｜DSML｜"
BLOCK, BLOCK_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
_BLOCKS = re.compile(re.escape(BLOCK) + "(.*?)" + re.escape(BLOCK_END), re.DOTALL)
_INVOKES = re.compile(
    re.escape(INVOKE) + r'\s+name="(?P<name>[^"]+)"\s*'
    r"(?:(?P<self_close>/>)|>(?P<body>.*?)(?P<end>(?:" + re.escape(INVOKE_END) + "|$)))",
    re.DOTALL,
)
_PARAMETER = re.compile(
    f"<{DSML}parameter" + r'\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)'
    + re.escape(f"</{DSML}parameter>"),
    re.DOTALL,
)  # fmt: skip
# structure_info (tool_calls._FRAMES): before the name, the name as it is, after it, the end,
# the trigger
FRAMES = {"deepseekv32": (INVOKE + ' name="', False, '">', INVOKE_END, INVOKE)}

Pieces = list[dict[str, Any]]


class _Malformed(ValueError):
    """An invoke whose arguments do not read: the invoke is dropped."""


def _no_constant(value: str) -> Any:
    raise _Malformed(f"Invalid JSON constant: {value}")


def _before_dsml(text: str) -> str:
    """The text before its first DSML tag, less one blank line."""
    at = text.find(DSML)
    if at == -1:
        return text
    if text[at - 2 : at] == "</" and at >= 2:
        at -= 2
    elif at >= 1 and text[at - 1] == "<":
        at -= 1
    return text[:at].removesuffix("\n\n")


def _arguments(body: str) -> dict[str, Any]:
    """An invoke body's arguments: a JSON object, or its parameter tags (_Malformed: neither,
    or text beside the tags that holds DSML)."""
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped, parse_constant=_no_constant)
        except ValueError as exc:
            raise _Malformed(str(exc)) from exc
        if not isinstance(value, dict):
            raise _Malformed("DeepSeek tool arguments must be a JSON object")
        return value
    values: dict[str, Any] = {}
    matches = list(_PARAMETER.finditer(body))
    leftover, last = [], 0
    for match in matches:
        leftover.append(body[last : match.start()])
        last = match.end()
        name, string, value = match.groups()
        if string == "true":
            values[name] = value.strip()
            continue
        try:
            values[name] = json.loads(value.strip(), parse_constant=_no_constant)
        except ValueError:
            values[name] = value.strip()
    leftover.append(body[last:])
    rest = "".join(leftover)
    if DSML in rest or (not matches and rest.strip()):
        raise _Malformed("Malformed DeepSeek tool parameter")
    return values


class DeepSeekV32Calls:
    """The calls of answers to one request (``names``: its tools')."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return BLOCK in text or INVOKE in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BLOCK)
        if at != -1:
            content, sections = text[:at].removesuffix("\n\n"), _BLOCKS.findall(text)
        else:
            start = text.find(INVOKE)
            if start == -1:
                return text, []
            content, sections = _before_dsml(text), [text[start:]]
        calls = []
        try:
            for section in sections:
                for match in _INVOKES.finditer(section):
                    call = self.call(match)
                    if call is not None:
                        calls.append(call)
        except RecursionError as exc:  # the detector's catch-all: the calls read so far
            log.warning("tool_call_unreadable", format="deepseekv32", error=str(exc))
        return content, calls

    def call(self, match: re.Match[str]) -> dict[str, str] | None:
        """An invoke's call (None, logged: not closed, arguments that do not read, a tool not
        offered)."""
        name = match.group("name").strip()
        if not match.group("self_close") and not match.group("end"):
            log.warning("tool_call_incomplete", format="deepseekv32", name=name)
            return None
        try:
            arguments = {} if match.group("self_close") else _arguments(match.group("body"))
        except _Malformed as exc:
            log.warning("tool_call_unparsed", format="deepseekv32", name=name, error=str(exc))
            return None
        if name not in self.names:
            log.warning("tool_call_unknown_tool", format="deepseekv32", name=name)
            return None
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}

    def stream(self) -> _DsmlStream:
        return _DsmlStream(self)


class _DsmlStream(PieceStream):
    """A sample's text deltas in, content to send now and whole calls out."""

    def __init__(self, reader: DeepSeekV32Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent: the text's first characters
        self.found = False  # the calls began (a block marker or an invoke came)
        self.blocks = False  # they are in blocks (else bare invokes)
        self.inside = False  # within a block
        self.pos = 0  # the calls are read up to here

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content = self.text, ""
        if not self.found:
            block, invoke = text.find(BLOCK), text.find(INVOKE)
            if block == -1 and invoke == -1:
                return self._content(text), []
            self.found = True
            self.blocks = block != -1 and (invoke == -1 or block < invoke)
            head = text[:block].removesuffix("\n\n") if self.blocks else _before_dsml(text)
            content, self.sent = head[self.sent :], len(head)
            self.pos = block if self.blocks else invoke
        return content, self._calls(text)

    def _content(self, text: str) -> str:
        """What is content whether or not calls come: the text but from its first DSML tag
        (what follows it is content only if no call comes), a tail that may begin one, and a
        last blank line (cut when calls follow it)."""
        at = text.find(DSML)
        if at != -1:
            safe = at - (2 if text[max(at - 2, 0) : at] == "</" else text[at - 1 : at] == "<")
        else:
            safe = len(text) - max(partial_tail(text, "<" + DSML), partial_tail(text, "</" + DSML))
        head = text[:safe]
        safe -= 2 if head.endswith("\n\n") else 1 if head.endswith("\n") else 0
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def _calls(self, text: str) -> Pieces:
        """Each invoke that closed since the last delta, as its call."""
        pieces: Pieces = []
        while True:
            if self.blocks and not self.inside:
                start = text.find(BLOCK, self.pos)
                if start == -1:
                    return pieces
                self.pos, self.inside = start + len(BLOCK), True
            close = text.find(BLOCK_END, self.pos) if self.blocks else -1
            match = _INVOKES.search(text, self.pos, len(text) if close == -1 else close)
            if match is not None and (match.group("self_close") or match.group("end")):
                call = self.reader.call(match)
                if call is not None:
                    pieces += self.pieces.whole(match.start(), call["name"], call["arguments"])
                self.pos = match.end()
            elif close != -1:  # the block ended: none more in it
                self.pos, self.inside = close + len(BLOCK_END), False
            else:
                return pieces

    def flush(self) -> str:
        """At the end: without calls, what waited is content (the answer as it is)."""
        if self.found:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
