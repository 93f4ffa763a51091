"""Tool calls in Kimi K3's format (SGLang's ``--tool-call-parser kimi_k3``): XTML channels, each
marker a run of special tokens, the reply in a ``response`` channel and the calls in a ``tools``
channel after it::

    <|open|>response<|sep|>Let me look.<|close|>response<|sep|>
    <|open|>tools<|sep|>
      <|open|>call tool="get_weather" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
        <|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>
      <|close|>call<|sep|>
    <|close|>tools<|sep|>

As SGLang 0.5.23 reads it (``function_call/kimik3_detector.py``, ``KimiK3Detector``, and
``kimik3_format.py``; ``tests/stages/test_engine_sglang_kimi_k3.py`` holds this module to it on
random answers where SGLang imports):

- an answer has calls where it opens the tools channel (``<|open|>tools<|sep|>``); without it
  the answer is left as it is (``FunctionCallParser.parse_non_stream``);
- the content is the text before the tools channel, unwrapped (``strip_wrappers``: the inside
  of the first response channel, or without one the text less its response closes; message
  closes out; a marker cut short at its end out);
- the calls are the complete ``<|open|>call ATTRS<|sep|>BODY<|close|>call<|sep|>`` in the
  channel (up to ``<|close|>tools<|sep|>``, or the end), each named by its ``tool="..."``
  attribute (``&quot;`` and ``&amp;`` unescaped; a call without one dropped), each
  ``<|open|>argument key=".." type=".."<|sep|>VALUE<|close|>argument<|sep|>`` of its body an
  argument (a later key over an earlier one): a ``string`` value (or one without a type) its
  text, another JSON where it reads, else its text;
- calls to tools not offered are kept, as the detector keeps them; ``tool_index`` is a call's
  place among the calls;
- where the reading raises (a value nested deeper than Python's recursion limit, an integer
  longer than Python reads), the content is still the text before the channel, with no calls
  (the detector's own ``except``).

Streamed (``stream``), as SGLang's ``parse_streaming_increment`` and ``finish``: the content is
the text before the tools channel with the response and message markers taken out as it comes
(a tail that may begin one, or the tools channel, held back; at the end, a marker cut short
dropped), and each call whole, name and arguments in one piece, at its
``<|close|>call<|sep|>``. That stream adds up to the whole reading where nothing stands outside
the response channel (the shape the model writes: the reasoning parser of the same name,
``stages.engine.kimi_k3_reasoning``, hands the tool-call reader the response channel's inside
and the tools channel); where text stands before ``<|open|>response<|sep|>`` or after
``<|close|>response<|sep|>`` the stream sends it and the whole reading does not (this engine
sends content as SGLang's stream does rather than hold every answer to its end; the same holds
for a marker cut short that the whole answer's end drops and the stream sent). Two differences
from SGLang's stream, for the stream to add up to the whole answer: a call after
``<|close|>tools<|sep|>`` is not read (SGLang's stream reads one; its whole answer does not, and
its chat route stops a request with tools at that marker anyway); a call whose value cannot be
read is dropped, logged, and the stream reads on (SGLang's stream starts over on the text after
it, sending the rest of the tools channel as content).

Not constrained: SGLang 0.5.23 constrains every K3 request with tools (``auto`` too) with
xgrammar structural tags of K3's own (``kimik3_structural_tag.py``) built of token formats and
free text before a tag, which this engine's structural-tag compiler
(``stages.engine.structural_format``) does not read. Here no K3 answer is constrained, a forced
``tool_choice`` nor a ``strict`` tool; the answer is read in this format (``tool_calls``'
``UNCONSTRAINED``, a warning logged once). SGLang's chat route also ends a request with tools at
``<|close|>tools<|sep|>`` (a stop string, ``TOOLS_CLOSE``), and names each call ``NAME:K``, ``K``
counting the conversation's calls; the chat route here does both.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls, partial_tail

__all__ = [
    "MESSAGE_CLOSE",
    "RESPONSE_CLOSE",
    "RESPONSE_OPEN",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TOOLS_CLOSE",
    "TOOLS_OPEN",
    "KimiK3Calls",
    "cut_partial",
    "held_tail",
    "k3_id",
    "strip_wrappers",
]

log = structlog.get_logger("stages.engine.tool_calls")

_SEP = "<|sep|>"
THINK_OPEN, THINK_CLOSE = f"<|open|>think{_SEP}", f"<|close|>think{_SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"<|open|>response{_SEP}", f"<|close|>response{_SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"<|open|>tools{_SEP}", f"<|close|>tools{_SEP}"
MESSAGE_CLOSE = f"<|close|>message{_SEP}"
CALL_CLOSE = f"<|close|>call{_SEP}"
# what an answer cut short by max_tokens may end with: a bare control token, or a channel's
# marker without its <|sep|> (_PARTIAL_MARKER_SUFFIXES, in its order)
_CUT = (
    "<|open|>",
    "<|close|>",
    *(m.removesuffix(_SEP) for m in (THINK_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN)),
    *(m.removesuffix(_SEP) for m in (TOOLS_CLOSE, MESSAGE_CLOSE)),
)
_WRAPPERS = (RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE)
# a header's attributes: anything up to the first <|sep|>
_HEAD = r"\s+(?P<attrs>(?:(?!<\|sep\|>).)*?)<\|sep\|>"
_CALL = re.compile(r"<\|open\|>call" + _HEAD + r"(?P<body>.*?)<\|close\|>call<\|sep\|>", re.DOTALL)
_ARGUMENT = re.compile(
    r"<\|open\|>argument" + _HEAD + r"(?P<value>.*?)<\|close\|>argument<\|sep\|>", re.DOTALL
)
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


def k3_id(name: str, index: int) -> str:
    """A call's id in the chat route (``index``: counted over the conversation's calls;
    ``serving_chat._process_tool_call_id``)."""
    return f"{name}:{index}"


def held_tail(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may begin one of ``markers``
    (``partial_suffix_len``)."""
    return max((partial_tail(text, marker) for marker in markers), default=0)


def cut_partial(text: str) -> str:
    """``text`` less a marker cut short at its end (``strip_partial_marker_suffix``: the first
    of those it ends with)."""
    for suffix in _CUT:
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def strip_wrappers(text: str) -> str:
    """The reply in ``text`` (``strip_response_wrappers``): the inside of its first response
    channel (to its end where it never closes), else the text less its response closes; message
    closes taken out, then a marker cut short at the end."""
    opened = text.find(RESPONSE_OPEN)
    if opened != -1:
        start = opened + len(RESPONSE_OPEN)
        closed = text.find(RESPONSE_CLOSE, start)
        text = text[start:] if closed == -1 else text[start:closed]
    else:
        text = text.replace(RESPONSE_CLOSE, "")
    return cut_partial(text.replace(MESSAGE_CLOSE, ""))


def _attributes(raw: str) -> dict[str, str]:
    """A header's ``key="value"`` attributes, unescaped as the template escapes them."""
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTRIBUTE.findall(raw)}


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # (not RecursionError, nor an integer too long: they raise)
        return raw


def _call(attrs: str, body: str) -> dict[str, str] | None:
    """One call (``_decode_call``): None where it names no tool. RecursionError or ValueError
    where a value cannot be read."""
    name = _attributes(attrs).get("tool", "")
    if not name:
        return None
    arguments: dict[str, Any] = {}
    for argument in _ARGUMENT.finditer(body):
        header = _attributes(argument["attrs"])
        kind, raw = header.get("type", "string"), argument["value"]
        arguments[header.get("key", "")] = raw if kind == "string" else _value(raw)
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _unwrapped(text: str) -> str:
    for marker in _WRAPPERS:
        text = text.replace(marker, "")
    return text


class KimiK3Calls(ListedCalls):
    """The calls of answers to one request (calls to any tool kept, so the tools are not
    needed)."""

    def __init__(self, tools: Iterable[dict[str, Any]] = ()) -> None:
        del tools

    def has_tool_call(self, text: str) -> bool:
        return TOOLS_OPEN in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(place, call)])`` (``detect_and_parse``)."""
        at = text.find(TOOLS_OPEN)
        if at == -1:
            return strip_wrappers(text), []
        before = strip_wrappers(text[:at])
        start = at + len(TOOLS_OPEN)
        end = text.find(TOOLS_CLOSE, start)
        section = text[start:] if end == -1 else text[start:end]
        try:
            calls = [c for m in _CALL.finditer(section) if (c := _call(m["attrs"], m["body"]))]
        except (RecursionError, ValueError) as exc:
            log.warning("tool_call_unparsed", format="kimi_k3", error=str(exc)[:200])
            return before, []
        return before, list(enumerate(calls))

    def stream(self) -> _K3Stream:
        return _K3Stream()


class _K3Stream:
    """One answer as it comes: content to send now, each call at its end."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # the content went out up to here (_sent_normal_idx)
        self.opened = -1  # where the tools channel opens (-1: not yet)
        self.closed = False  # the tools channel closed: no call after it
        self.scanned = 0  # in the channel: calls are read up to here
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        was = len(self.text)
        self.text += delta
        if self.opened == -1:
            self.opened = self.text.find(TOOLS_OPEN, max(0, was - len(TOOLS_OPEN) + 1))
            if self.opened == -1:
                return self._content(), []
        return self._content(self.opened), self._calls()

    def _content(self, limit: int | None = None) -> str:
        """``_emit_normal_text``: the text not sent yet up to ``limit`` (none: less a tail that
        may begin a marker), its response and message markers taken out."""
        if limit is None:
            limit = len(self.text) - held_tail(self.text, (TOOLS_OPEN, *_WRAPPERS))
        if limit <= self.sent:
            return ""
        pending, self.sent = self.text[self.sent : limit], limit
        return _unwrapped(pending)

    def _calls(self) -> list[dict[str, Any]]:
        """The calls that closed in the channel since the last step (``_parse_calls`` of the
        channel so far, the new ones)."""
        if self.closed:
            return []
        text = self.text
        self.scanned = max(self.scanned, self.opened + len(TOOLS_OPEN))
        limit = text.find(TOOLS_CLOSE, self.scanned)
        if limit == -1:
            limit = len(text)
        else:
            self.closed = True
        pieces: list[dict[str, Any]] = []
        while text.find(CALL_CLOSE, self.scanned, limit) != -1:
            found = _CALL.search(text, self.scanned, limit)
            if found is None:
                break
            self.scanned = found.end()
            try:
                call = _call(found["attrs"], found["body"])
            except (RecursionError, ValueError) as exc:
                log.warning("tool_call_unparsed", format="kimi_k3", error=str(exc)[:200])
                continue
            if call is not None:
                pieces.append({"index": self.calls, **call})
                self.calls += 1
        return pieces

    def flush(self) -> str:
        """At the end (``finish``): with the tools channel open nothing more; else the text
        held back, less a marker cut short."""
        if self.opened != -1:
            return ""
        return cut_partial(self._content(len(self.text)))

    def unsent(self) -> list[dict[str, Any]]:
        return []  # (each call went out whole)
