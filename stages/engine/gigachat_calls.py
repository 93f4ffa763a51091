"""Tool calls in GigaChat 3.5's GCML format (SGLang's ``--tool-call-parser gigachat35``)::

    <｜GCML｜tool_calls><｜GCML｜invoke name="get_weather"><｜GCML｜parameter name="city"
    string="true">Paris</｜GCML｜parameter></｜GCML｜invoke></｜GCML｜tool_calls>

As SGLang 0.5.23 reads them (``function_call/gigachat35_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): in the text after the first ``<｜GCML｜tool_calls>`` (up to its close, or
  the end) each closed invoke is a call, its parameters' values the text where ``string`` is
  ``true``, else JSON (NaN too), else the text; calls to tools not offered dropped (logged).
  The content is the text before the block, less trailing ``<|message_sep|>`` / ``</s>`` markers
  (and the space after them) and newlines; an answer whose block holds no invoke is all
  content, less those markers at its end.
- streamed (``stream``): content as it comes but for a tail that the whole answer may take
  off (markers, space, a start of the block's tag); each call whole once its invoke closes;
  at the end, what the whole answer has. (SGLang's stream sends the content before the block
  as it is.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (no structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, partial_tail
from stages.engine.tool_formats import MarkedCalls

__all__ = ["GigaChat3Calls", "GigaChat35Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<｜GCML｜tool_calls>", "</｜GCML｜tool_calls>"
_INVOKE = re.compile(
    r"<｜GCML｜invoke\s+name=\"(?P<name>[^\"]*)\"\s*>(?P<body>.*?)</｜GCML｜invoke>", re.DOTALL
)
_PARAMETER = re.compile(
    r"<｜GCML｜parameter\s+name=\"(?P<name>[^\"]*)\"\s+string=\"(?P<string>true|false)\"\s*>"
    r"(?P<value>.*?)</｜GCML｜parameter>",
    re.DOTALL,
)
_MARKERS = re.compile(r"(?:<\|message_sep\|>|</s>)+\s*$")  # taken off the content's end
_HELD = re.compile(r"(?:<\|message_sep\|>|</s>|\s)*$")  # a tail the content may lose
_TAGS = ("<|message_sep|>", "</s>", BEGIN)

Pieces = list[dict[str, Any]]


def _unmarked(text: str) -> str:
    return _MARKERS.sub("", text)


def _arguments(body: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for match in _PARAMETER.finditer(body):
        raw = match.group("value")
        try:
            out[match.group("name")] = raw if match.group("string") == "true" else json.loads(raw)
        except ValueError:
            out[match.group("name")] = raw
    return out


class GigaChat35Calls(MarkedCalls):
    """The calls of answers to one request (``names``: the tools offered)."""

    marker = BEGIN

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        if BEGIN not in text:
            return text, []
        leading, _, after = text.partition(BEGIN)
        invokes = list(_INVOKE.finditer(after.partition(END)[0]))
        if not invokes:
            return _unmarked(text), []
        calls = [c for c in map(self.call, invokes) if c is not None]
        return _unmarked(leading).rstrip("\n"), calls

    def call(self, invoke: re.Match[str]) -> dict[str, str] | None:
        name = invoke.group("name")
        if name not in self.names:
            log.warning("tool_call_unknown_function", name=name[:100])
            return None
        arguments = json.dumps(_arguments(invoke.group("body")), ensure_ascii=False)
        return {"name": name, "arguments": arguments}

    def stream(self) -> _GigaChatStream:
        return _GigaChatStream(self)


class _GigaChatStream(PieceStream):
    def __init__(self, reader: GigaChat35Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent
        self.read = 0  # invokes read

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        at = self.text.find(BEGIN)
        if at == -1:  # held: a start of a tag, and the markers and space before it
            cut = len(self.text) - max(partial_tail(self.text, tag) for tag in _TAGS)
            cut -= len(_HELD.search(self.text, 0, cut).group())
            return self._content(self.text[:cut]), []
        after = self.text[at + len(BEGIN) :].partition(END)[0]
        invokes = list(_INVOKE.finditer(after))
        if not invokes:
            return "", []
        content = self._content(_unmarked(self.text[:at]).rstrip("\n"))
        pieces: Pieces = []
        for invoke in invokes[self.read :]:
            call = self.reader.call(invoke)
            if call is not None:
                pieces += self.pieces.whole(invoke.start(), call["name"], call["arguments"])
        self.read = len(invokes)
        return content, pieces

    def _content(self, upto: str) -> str:
        out = upto[self.sent :]
        self.sent = max(self.sent, len(upto))
        return out

    def flush(self) -> str:
        if self.read:
            return ""
        return self._content(self.reader.parse(self.text)[0])


# ---- GigaChat 3 (--tool-call-parser gigachat3) ---------------------------------------------------

G3_MARKERS = ("function call<|role_sep|>\n", "<|function_call|>")
_G3_CALL = re.compile(r"(?:function call<\|role_sep\|>\n|<\|function_call\|>)(.*)", re.DOTALL)
_G3_CONTENT = re.compile(r"^(.*?)(?:<\|message_sep\|>|<\|function_call\|>)", re.DOTALL)
_G3_ENDS = ("<|message_sep|>", "<|function_call|>")


class GigaChat3Calls:
    """GigaChat 3's one call (``gigachat3_detector.py``): the JSON object
    ``{"name", "arguments": {...}}`` after ``function call<|role_sep|>`` and a newline (or
    ``<|function_call|>``) to the end of the answer (a trailing ``</s>`` off), a tool not
    offered dropped; the content the text before the first ``<|message_sep|>`` or
    ``<|function_call|>``. A call that is not JSON leaves the whole answer (less ``</s>``)
    content; JSON that is no such object, the content alone. Streamed: the content as it
    comes, the call at the end (it runs to the end of the answer)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return any(marker in text for marker in G3_MARKERS)

    def parse(self, answer: str) -> tuple[str, list[dict[str, str]]]:
        text = answer[: answer.rfind("</s>")] if answer.rstrip().endswith("</s>") else answer
        call, found = None, _G3_CALL.search(text)
        if found:
            try:
                call = json.loads(found.group(1), strict=False)
            except ValueError:  # JSONDecodeError: the whole answer is content
                return text, []
            if not (isinstance(call, dict) and "name" in call and isinstance(
                    call.get("arguments"), dict)):  # fmt: skip
                call = None
        content = _G3_CONTENT.search(text)
        content_text = content.group(1) if content else text
        if call is None:
            return content_text, []
        name = call["name"]
        try:
            offered = bool(name) and name in self.names
        except TypeError:  # a name that is a list or an object: raised out of the detector
            return answer, []
        if not offered:
            log.warning("tool_call_unknown_function", name=str(name)[:100])
            return content_text, []
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        return content_text, [{"name": name, "arguments": arguments}]

    def stream(self) -> _GigaChat3Stream:
        return _GigaChat3Stream(self)


class _GigaChat3Stream(PieceStream):
    def __init__(self, reader: GigaChat3Calls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0
        self.ended = False  # the content ended (a marker came)
        self.last: Pieces = []

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        if self.ended:
            return "", []
        cut = min((i for i in (self.text.find(m) for m in _G3_ENDS) if i != -1), default=-1)
        if cut != -1:
            self.ended = True
        else:
            cut = len(self.text) - max(partial_tail(self.text, m) for m in (*_G3_ENDS, "</s>"))
        out, self.sent = self.text[self.sent : cut], max(self.sent, cut)
        return out, []

    def flush(self) -> str:
        whole = self.reader.has_tool_call(self.text)
        content, calls = self.reader.parse(self.text) if whole else (self.text, [])
        for call in calls:
            self.last += self.pieces.whole(0, call["name"], call["arguments"])
        if not content.startswith(self.text[: self.sent]):  # cannot be
            return ""
        out, self.sent = content[self.sent :], len(content)
        return out

    def unsent(self) -> Pieces:
        out, self.last = self.last, []
        return out
