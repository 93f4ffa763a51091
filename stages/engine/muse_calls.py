"""Tool calls in Muse Glimmer's format (SGLang's ``--tool-call-parser muse``): an answer is a
run of recipient channels, the model writing the first header itself (its chat template ends
the prompt at ``<|start|>assistant``)::

     to=self<|message|>I should look it up.<|eom|>
    <|start|>assistant to=functions.get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">"Paris"</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>

A channel is a header (up to ``<|message|>``; its recipient the first ``to=NAME``, none:
``user``) and a body up to ``<|eom|>`` or ``<|eot|>``. ``self``, ``user`` and ``commentary``
are prose; any other recipient is a tool, whose body holds ATEM ``<atem:invoke name="NAME">``
calls, each ``<atem:parameter name="KEY">VALUE</atem:parameter>`` an argument.

As SGLang 0.5.23 reads them (``function_call/muse_glimmer_detector.py``, ``MuseGlimmerDetector``,
and ``muse_glimmer_format.py``; ``tests/stages/test_engine_sglang_muse.py`` holds this module to
it on random answers where SGLang imports). Its detector reads a whole answer as one step of its
stream and the stream's end, so here the stream is the reader (``_MuseStream``) and the whole
answer is read through it:

- before a body: at the very start, text that may still grow into a header (spaces, ``to=``
  and a recipient without spaces, a ``<|message|>`` begun) waits for its ``<|message|>``;
  elsewhere a header must open with ``<|start|>`` (spaces before it go out as content, a
  ``<|start|>`` begun waits); anything else is unframed prose, a body without a header;
- a body ends at its first ``<|eom|>`` or ``<|eot|>``, both dropped; a prose body is content
  as it comes (a tail that may begin a marker waits); in a tool's body each invoke, once its
  ``</atem:invoke>`` comes, is a call, its parameters' values read as JSON, else kept as text
  (a later key over an earlier one), the rest of the body (the ``<atem:function_calls>``
  wrapper, text between invokes) dropped, an invoke never closed dropped;
- a call's name is the invoke's, unless it is not a tool offered: ``NAME.NAME`` is ``NAME``
  where ``NAME`` is, and a dotted name whose last part is the last part of exactly one tool's
  name is that tool's; a call to a tool not offered is dropped (logged; SGLang's
  ``SGLANG_FORWARD_UNKNOWN_TOOLS`` is off by default). Calls are numbered in order, which is
  also their ``tool_index`` on ``/parse_function_call``;
- at the end, a header never finished is content, a body still open read to its end;
- an answer without an ATEM marker (``<atem:invoke``, ``<atem:function_calls>``) is left as it
  is, framing and all (``FunctionCallParser.parse_non_stream``; SGLang's chat route does not
  read it either);
- a value whose JSON nests deeper than Python's recursion limit makes SGLang's reading raise:
  the whole answer is then its text, without calls (what its chat route answers); streamed,
  that call is dropped (logged), where SGLang's stream raises.

Streamed (``stream``), the content as it comes and each call whole, name and arguments in one
piece, at its ``</atem:invoke>``, as SGLang's stream sends them. ``tool_choice`` ``required`` or
named: not constrained (its detector ``parses_required_natively`` and has no structural tag),
the answer read in this format; a ``strict`` tool constrains nothing either.

The reasoning parser of the same name (``stages.engine.muse_reasoning``) reads the same channels
with ``Channels``.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls

__all__ = [
    "EOM",
    "EOT",
    "INVOKE",
    "MESSAGE",
    "START",
    "Channels",
    "MuseCalls",
    "has_calls",
    "held",
    "terminator",
]

log = structlog.get_logger("stages.engine.tool_calls")

MESSAGE, EOM, EOT, START = "<|message|>", "<|eom|>", "<|eot|>", "<|start|>"
BLOCK, INVOKE, INVOKE_END = "<atem:function_calls>", "<atem:invoke", "</atem:invoke>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_INVOKE = re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)"[^>]*?>')
_PARAMETER = re.compile(
    r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*?>(.*?)</atem:parameter>', re.DOTALL
)
PROSE = ("commentary", "self", "user")  # the recipients whose bodies are text
# what may be begun at the end of a tool stream's body (the longest held: 20 characters)
_MARKERS = (MESSAGE, EOM, EOT, START, BLOCK, INVOKE)
_LONGEST = len(BLOCK)

Pieces = list[dict[str, Any]]


def has_calls(text: str) -> bool:
    """The text has an ATEM marker (the detectors' ``has_atem_markers``)."""
    return INVOKE in text or BLOCK in text


def held(text: str, markers: Sequence[str], longest: int) -> int:
    """How many characters at the end of ``text`` (fewer than ``longest``) begin one of
    ``markers``, or are one whole (``partial_marker_len``)."""
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(marker.startswith(tail) for marker in markers):
            return n
    return 0


def terminator(text: str) -> tuple[int, str]:
    """Where the first ``<|eom|>`` or ``<|eot|>`` is, and which (-1, "": none)."""
    found = [(at, tag) for tag in (EOM, EOT) if (at := text.find(tag)) != -1]
    return min(found) if found else (-1, "")


def _may_open(text: str) -> bool:
    """At the start of an answer: the text may still grow into a header (``could_start_
    header``)."""
    shown = text.lstrip()
    if not shown:
        return True
    if not (shown.startswith("to=") or "to=".startswith(shown[:3])):
        return False
    if MESSAGE in shown:
        return True
    name, angle, rest = shown[3:].partition("<")
    if any(c.isspace() for c in name):
        return False
    return not angle or MESSAGE.startswith("<" + rest)


class Channels:
    """Where a text of channels stands as it comes: what is not read yet (``buffer``), whether
    a body is open and to whom (``recipient``: None for unframed prose), and whether nothing
    has been read yet (``at_start``)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.recipient: str | None = None
        self.in_body = False
        self.at_start = True

    def open(self) -> tuple[str, str, str]:
        """Reads what comes before a body: ``(spaces to send as content first, what it is,
        the header)``: ``"prose"``, an unframed body begun; ``"header"``, a header read (its
        text up to ``<|message|>``), its body begun; ``"start"``, a ``<|start|>`` begun, or
        ``"message"``, a header whose ``<|message|>`` has not come: more text is needed."""
        text, spaces = self.buffer, ""
        if not (self.at_start and _may_open(text)):
            stripped = text.lstrip()
            head = stripped[: len(START)]
            if not START.startswith(head):
                self.in_body, self.recipient, self.at_start = True, None, False
                return "", "prose", ""
            spaces, text = text[: len(text) - len(stripped)], stripped
            self.buffer = text
            if len(head) < len(START):
                return spaces, "start", ""
        at = text.find(MESSAGE)
        if at == -1:
            return spaces, "message", ""
        header = text[:at]
        self.buffer = text[at + len(MESSAGE) :]
        found = _RECIPIENT.search(header)
        self.recipient = found.group(1) if found else "user"
        self.in_body, self.at_start = True, False
        return spaces, "header", header


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # (not RecursionError: SGLang's reading raises on it)
        return raw


class MuseCalls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools; a call to another is
    dropped)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.names = {n for t in tools if (n := (t.get("function") or {}).get("name"))}

    def has_tool_call(self, text: str) -> bool:
        return has_calls(text)

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        reader = _MuseStream(self, whole=True)
        try:
            content, pieces = reader.feed(text)
            content += reader.flush()
            pieces += reader.unsent()
        except RecursionError as exc:  # out of the detector: the chat route's except
            log.warning("tool_call_unparsed", format="muse", error=str(exc)[:200])
            return text, []
        calls = [(p["index"], {"name": p["name"], "arguments": p["arguments"]}) for p in pieces]
        if not calls and not has_calls(text):  # parse_non_stream: nothing read, the text
            return text, []
        return content, calls

    def named(self, name: str) -> str | None:
        """The tool a call names (``_normalize_name``), None for one not offered."""
        if name in self.names:
            return name
        if "." in name:
            head, _, tail = name.partition(".")
            if head == tail and head in self.names:
                return head
            leaf = name.rsplit(".", 1)[-1]
            matches = [n for n in self.names if n.rsplit(".", 1)[-1] == leaf]
            if len(matches) == 1:
                return matches[0]
        log.warning("tool_call_unknown_function", name=name[:100])
        return None

    def stream(self) -> _MuseStream:
        return _MuseStream(self)


class _MuseStream(Channels):
    """One answer's channels as they come: content to send now, each call at its end."""

    def __init__(self, reader: MuseCalls, *, whole: bool = False) -> None:
        super().__init__()
        self.reader = reader
        self.whole = whole  # a whole answer: a value that cannot be read raises
        self.invoke: str | None = None  # the call whose </atem:invoke> has not come
        self.calls = 0  # calls sent (the next one's index)
        self.left: Pieces = []  # the calls read at the end, for unsent

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.buffer += delta
        content: list[str] = []
        pieces: Pieces = []
        while self.buffer:
            if not self.in_body:
                spaces, kind, _ = self.open()
                content.append(spaces)
                if kind in ("start", "message"):
                    break
                continue
            at, tag = terminator(self.buffer)
            if at != -1:
                self.body(self.buffer[:at], True, content, pieces)
                self.buffer = self.buffer[at + len(tag) :]
                self.in_body, self.recipient, self.invoke = False, None, None
                continue
            ready = len(self.buffer) - held(self.buffer, _MARKERS, _LONGEST)
            if not ready:
                break
            used = self.body(self.buffer[:ready], False, content, pieces)
            if not used:
                break
            self.buffer = self.buffer[used:]
        return "".join(content), pieces

    def body(self, text: str, final: bool, content: list[str], pieces: Pieces) -> int:
        """Reads ``text`` of the open body (``final``: all of it there is): how much of it
        was used; prose to ``content``, calls to ``pieces``."""
        if self.recipient is None or self.recipient in PROSE:
            content.append(text)
            return len(text)
        at = 0
        while at < len(text):
            if self.invoke is None:
                found = _INVOKE.search(text, at)
                if found is None:
                    return len(text) if final else at
                self.invoke, at = found.group(1), found.end()
                continue
            end = text.find(INVOKE_END, at)
            if end == -1:
                return len(text) if final else at
            self.call(self.invoke, text[at:end], pieces)
            self.invoke, at = None, end + len(INVOKE_END)
        return len(text)

    def call(self, name: str, body: str, pieces: Pieces) -> None:
        try:
            arguments: dict[str, Any] = {}
            for key, raw in _PARAMETER.findall(body):
                arguments[key] = _value(raw)
            tool = self.reader.named(name)
            if tool is None:
                return
            text = json.dumps(arguments, ensure_ascii=False)
        except RecursionError as exc:
            if self.whole:
                raise
            log.warning("tool_call_unparsed", format="muse", error=str(exc)[:200])
            return
        pieces.append({"index": self.calls, "name": tool, "arguments": text})
        self.calls += 1

    def flush(self) -> str:
        """At the end: a header never finished as content, a body still open read to its
        end (its calls then go with ``unsent``)."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return ""
        if not self.in_body:
            return rest
        content: list[str] = []
        self.body(rest, True, content, self.left)
        return "".join(content)

    def unsent(self) -> Pieces:
        left, self.left = self.left, []
        return left
