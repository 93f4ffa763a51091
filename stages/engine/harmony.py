"""OpenAI's Harmony format (gpt-oss): an answer as messages on channels, read as SGLang 0.5.23
reads it for ``--reasoning-parser gpt-oss`` and ``--tool-call-parser gpt-oss``.

A gpt-oss answer (the prompt ends ``<|start|>assistant``)::

    <|channel|>analysis<|message|>Let me look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

or, answering, ``<|channel|>final<|message|>It is sunny.<|return|>``. ``HarmonyReader`` is
SGLang's ``parser/harmony_parser.py`` ``HarmonyParser``: text in (whole, or delta by delta),
events out: ``reasoning`` (an ``analysis`` message, streamed as it comes), ``normal`` (a
``final`` message, streamed as it comes; a ``commentary`` message once it ends; text outside
the messages), ``call`` (a message that ends ``<|call|>``, with its whole text). Text written
without the special tokens (``analysis...assistantfinal...``, what a tokenizer that skips them
leaves) is read by the same words, as SGLang's text fallback reads it. Its edges are SGLang's:
a message on a channel it does not know, or one cut short before its end token, is held back
and never sent; stray structural tokens are dropped, and so is the word ``commentary`` after a
call (the filler between two calls).

``HarmonyReasoning`` is the reasoning parser (``GptOssDetector`` of ``reasoning_parser.py``):
the reasoning is the ``analysis`` messages, the content the rest, calls kept whole in it for the
tool-call parser. ``GptOssCalls`` is the tool-call parser (``gpt_oss_detector.py``): only an
answer holding ``<|start|>assistant<|channel|>commentary`` has calls; each call message's
recipient ``to=functions.NAME`` (or ``to=NAME``) and its JSON after ``<|constrain|>json
<|message|>`` make a call (a tool not offered, or arguments that are not JSON: dropped, logged);
the content is the other messages' text joined by spaces. Streamed, a call goes out whole (name
and arguments in one piece) once its message ends, as SGLang streams it.

One difference from SGLang, on purpose: text with no Harmony structure at all (no special token
and none of its words) is content here; SGLang's reader waits for a structure that never comes
and loses the whole answer.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls, partial_tail

__all__ = [
    "CALL",
    "FRAMES",
    "SECTION",
    "GptOssCalls",
    "HarmonyReader",
    "HarmonyReasoning",
    "kept_stop_ids",
]

log = structlog.get_logger("stages.engine.tool_calls")

CALL = "<|call|>"
# what an answer with calls holds (GptOssDetector.bot_token)
SECTION = "<|start|>assistant<|channel|>commentary"
_KINDS = {
    "<|start|>": "start",
    "<|channel|>": "channel",
    "<|message|>": "message",
    "<|constrain|>": "constrain",
    "<|end|>": "end",
    CALL: "call",
    "<|return|>": "return",
}
_TOKENS = tuple(_KINDS)
# a forced call's frame (tool_calls._FRAMES: before the name, the name as it is, after it, the
# end, the trigger): a new assistant message on the commentary channel to the function, as the
# Harmony guide writes one and as the reader below needs it (SECTION before it). SGLang asks
# xgrammar for its own Harmony tag instead, whose first call, after a reasoning parser's
# analysis, opens without <|start|>assistant, which SGLang's reader then does not read. A strict
# tool under tool_choice auto is not constrained here (that tag holds every message of the
# answer, which a trigger cannot: <|start|> opens plain answers too).
FRAMES = {"gpt-oss": (SECTION + " to=functions.", False, " <|constrain|>json<|message|>", CALL,
                      SECTION)}  # fmt: skip
# what a text fallback's words look like (HarmonyParser's choice of strategy)
_WORDS = re.compile(r"(?:^|\s)(?:assistant)?\s*(analysis|commentary|assistantfinal)", re.I)
_BOTH = re.compile(
    r"^\s*(?:assistant)?\s*(analysis|commentary)(.*?)\s*assistantfinal\s*(.*)\s*$", re.I | re.S
)
_OPENED = re.compile(r"(?:^|\s)(?:assistant)?\s*(analysis|commentary)", re.I)
_FINAL = re.compile(r"^\s*assistantfinal\s*(.*)\s*$", re.I | re.S)
_CHANNEL = re.compile(r"^\s*(?:assistant)?\s*(analysis|commentary)(.*)\s*$", re.I | re.S)
_CALL = re.compile(
    r"to=([a-zA-Z_][a-zA-Z0-9_.-]*)\s*<\|constrain\|>json<\|message\|>(.*?)(?:<\|call\|>|$)",
    re.S,
)


def kept_stop_ids(tokenizer: Any, tool_parser: str | None) -> frozenset[int]:
    """The stop tokens whose text an answer keeps under ``tool_parser``: gpt-oss stops at the
    ``<|call|>`` that ends a call, which SGLang's detokenizer keeps with ``--tool-call-parser
    gpt-oss`` (as token 200012, gpt-oss's ``<|call|>``) so that the reader sees the call end."""
    if tool_parser != "gpt-oss" or tokenizer is None:
        return frozenset()
    call = tokenizer.get_vocab().get(CALL)
    return frozenset() if call is None else frozenset({call})


@dataclass
class Event:
    kind: str  # "normal", "reasoning" or "call"
    content: str
    raw: str = ""  # a call's whole text, its tokens included


def _held(text: str, tokens: tuple[str, ...]) -> tuple[str, str]:
    """``(to send, to hold)``: the longest tail of ``text`` that may begin one of ``tokens``
    is held."""
    keep = max(partial_tail(text, token) for token in tokens) if text else 0
    return text[: len(text) - keep], text[len(text) - keep :]


def _pieces(text: str) -> list[tuple[str, int, int]]:
    """``text`` as ``(kind, start, end)`` pieces: a structural token's kind, or ``text``. A
    tail that may begin a token is one text piece; an unknown ``<|...|>`` is text, its ``<|``
    a piece of its own (``iter_tokens``)."""
    out: list[tuple[str, int, int]] = []
    pos, n, odd = 0, len(text), False
    while pos < n:
        at = text.find("<|", pos)
        if at == -1:
            break
        if at > pos:
            out.append(("text", pos, at))
        token = next((t for t in _TOKENS if text.startswith(t, at)), None)
        if token is not None:
            out.append((_KINDS[token], at, at + len(token)))
            pos = at + len(token)
            continue
        if any(t.startswith(text[at:]) for t in _TOKENS):  # the start of a token: wait
            out.append(("text", at, n))
            pos = n
            break
        odd = True
        out.append(("text", at, at + 2))
        close = text.find("|>", at + 2)
        if close == -1:
            pos = at + 2
            continue
        after = text.find("<|", close + 2)
        if after == -1:
            out.append(("text", at + 2, n))
            pos = n
            break
        out.append(("text", at + 2, after))
        pos = after
    if pos < n:
        out.append(("text", pos, n))
    elif odd and text.endswith(_TOKENS):  # an empty last piece: the one before is not last
        out.append(("text", n, n))
    return out


def _channel(header: str) -> str | None:
    header = header.strip().lower()
    return next((c for c in ("analysis", "commentary", "final") if header.startswith(c)), None)


def _header(pieces: list[tuple[str, int, int]], i: int) -> tuple[int | None, int | None]:
    """Where the message that piece ``i`` opens has its (first) channel token and its
    message token (None: not there yet)."""
    channel = None
    for k in range(i + 1 if pieces[i][0] == "start" else i, len(pieces)):
        if pieces[k][0] == "channel" and channel is None:
            channel = k
        elif pieces[k][0] == "message":
            return channel, k
    return channel, None


def _message(text: str, pieces: list[tuple[str, int, int]], i: int) -> tuple[Event, int] | None:
    """The message piece ``i`` opens and the piece after it (None: not whole yet, or on a
    channel not known)."""
    channel, message = _header(pieces, i)
    if message is None:
        return None
    body = pieces[message][2]
    if channel is None:  # a tool's answer: straight to its message
        for k in range(message + 1, len(pieces)):
            if pieces[k][0] in ("end", "call", "return"):
                return Event("normal", text[body : pieces[k][1]]), k + 1
        return None
    kind = _channel(text[pieces[channel + 1][1] : pieces[message][1]])
    if kind is None:
        return None
    ends = ("return",) if kind == "final" else ("end", "call")
    k = next((k for k in range(message + 1, len(pieces)) if pieces[k][0] in ends), len(pieces))
    if k == len(pieces):
        return (Event("normal", text[body:]), k) if kind == "final" else None
    stop, content = pieces[k], text[body : pieces[k][1]]
    if kind == "final":
        if k + 1 < len(pieces) and pieces[k + 1][0] == "text":  # text after <|return|>
            nxt = pieces[k + 1]
            return Event("normal", content + text[nxt[1] : nxt[2]]), k + 2
        return Event("normal", content), k + 1
    if stop[0] == "call":
        return Event("call", content.strip(), text[pieces[i][1] : stop[2]]), k + 1
    return Event("reasoning" if kind == "analysis" else "normal", content), k + 1


def _analysis_so_far(
    text: str, pieces: list[tuple[str, int, int]], i: int
) -> tuple[Event, str] | None:
    """An ``analysis`` message piece ``i`` opens, not ended yet: its text so far, and the
    header to hold for the rest."""
    channel, message = _header(pieces, i)
    if channel is None or message is None:
        return None
    if _channel(text[pieces[channel + 1][1] : pieces[message][1]]) != "analysis":
        return None
    body = pieces[message][2]
    return Event("reasoning", text[body:]), text[pieces[i][1] : body]


def _filler(text: str, pieces: list[tuple[str, int, int]], i: int) -> bool:
    """The noise a call leaves before the next message: a message token, or the word
    ``commentary``, right after ``<|call|>``."""
    if i == 0 or pieces[i - 1][0] != "call":
        return False
    kind, start, end = pieces[i]
    return kind == "message" or (kind == "text" and text[start:end].strip().lower() == "commentary")


def _tokens(text: str) -> tuple[list[Event], str]:
    """The events of ``text`` written with Harmony's tokens, and what to hold for more."""
    pieces = _pieces(text)
    events: list[Event] = []
    i = 0
    while i < len(pieces):
        kind, start, end = pieces[i]
        if kind == "text" and i == len(pieces) - 1:
            send, hold = _held(text[start:end], _TOKENS)
            if send:
                events.append(Event("normal", send))
            return events, hold
        if kind in ("start", "channel"):
            found = _message(text, pieces, i)
            if found is None:
                so_far = _analysis_so_far(text, pieces, i)
                if so_far is not None:
                    events.append(so_far[0])
                    return events, so_far[1]
                return events, text[start:]
            events.append(found[0])
            i = found[1]
            continue
        piece = text[start:end]
        if not _filler(text, pieces, i) and piece.strip() not in _TOKENS:
            events.append(Event("normal", piece))
        i += 1
    return events, ""


def _words(text: str) -> tuple[list[Event], str]:
    """The events of ``text`` written without the tokens (``analysis...assistantfinal...``),
    and what to hold for more (``TextStrategy``)."""
    both = _BOTH.match(text)
    if both:
        channel, first, final = both.groups()
        events = []
        if first.strip():
            kind = "reasoning" if channel.lower() == "analysis" else "normal"
            events.append(Event(kind, first.strip()))
        if final.strip():
            events.append(Event("normal", final.strip()))
        return events, ""
    low = text.lower()
    if _OPENED.search(text) and "assistantfin" in low and "assistantfinal" not in low:
        return [], text
    final_only = _FINAL.match(text)
    if final_only:
        final = final_only.group(1).strip()
        return ([Event("normal", final)] if final else []), ""
    opened = _CHANNEL.match(text)
    if opened:
        channel, rest = opened.groups()
        send, hold = _held(rest, ("assistantfinal",))
        head = text[: opened.start(2)] + hold
        if not send:
            return [], head
        if channel.lower() == "analysis":
            return [Event("reasoning", send)], head if hold else channel
        return [Event("normal", send if hold else send.strip())], head if hold else ""
    send, hold = _held(text, ("analysis", "commentary", "assistantfinal"))
    return ([Event("normal", send)] if send else []), hold


class HarmonyReader:
    """One answer's events, fed whole (``whole``) or delta by delta (``feed``)."""

    def __init__(self) -> None:
        self.buffer = ""  # text held for more
        self.read: Any = None  # _tokens or _words, once the text says which
        self._after_call = False  # the filler word may follow
        self._word = ""  # the start of the filler word so far

    def whole(self, text: str) -> list[Event]:
        return self.feed(text) + self.feed("")

    def feed(self, delta: str) -> list[Event]:
        self.buffer += delta
        if self.read is None:
            if "<|channel|>" in self.buffer or "<|start|>" in self.buffer:
                self.read = _tokens
            elif _WORDS.search(self.buffer):
                self.read = _words
            else:
                return []
        events, rest = self.read(self.buffer)
        called = self.buffer.rstrip().endswith(CALL)
        self.buffer = rest
        out = []
        for event in events:
            if event.kind == "normal" and self._dropped(event.content):
                continue
            if event.kind == "call":
                self._after_call, self._word = True, ""
            elif called:
                self._after_call = True
            out.append(event)
        return out

    def _dropped(self, content: str) -> bool:
        """The word ``commentary`` (or its start, or only space) after a call."""
        if not (self._after_call or self._word):
            return False
        word = self._word + content.strip().lower()
        if word == "commentary":
            self._word, self._after_call = "", False
            return True
        if "commentary".startswith(word):
            self._word = word
            return True
        self._word, self._after_call = "", False
        return False


def _joined(events: list[Event]) -> tuple[str, str]:
    """``(reasoning, content)``: a call's whole text goes to the content."""
    reasoning, content = [], []
    for event in events:
        if event.kind == "reasoning":
            reasoning.append(event.content)
        else:
            content.append(event.raw or event.content if event.kind == "call" else event.content)
    return "".join(reasoning), "".join(content)


class HarmonyReasoning:
    """``--reasoning-parser gpt-oss`` for one answer, as ``reasoning.ThinkParser`` is for the
    others: ``parse`` a whole answer, or ``feed`` its deltas and ``finish``. ``nonempty``
    (``force_nonempty_content``): a whole answer without content gets its reasoning as
    content (SGLang's stream does not)."""

    def __init__(self, *, nonempty: bool = False) -> None:
        self.reader = HarmonyReader()
        self.nonempty = nonempty

    def parse(self, text: str) -> tuple[str, str]:
        reasoning, content = _joined(self.reader.whole(text))
        if self.reader.read is None:  # no structure at all: the answer is content
            self.reader.buffer = ""
            return "", text
        if self.nonempty and not content:
            return content, reasoning
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        return _joined(self.reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        """Text that never showed a structure goes out as content; a message cut short is
        dropped, as SGLang drops it (logged)."""
        left, self.reader.buffer = self.reader.buffer, ""
        if self.reader.read is None:
            return "", left
        if left:
            log.info("harmony_text_unsent", text=left[:200])
        return "", ""


class GptOssCalls(ListedCalls):
    """``--tool-call-parser gpt-oss``: the calls of an answer to the tools named ``names``."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return SECTION in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(tool_index, call)])``: a call's index is its place among the calls
        read."""
        if SECTION not in text:
            return text, []
        calls: list[tuple[int, dict[str, str]]] = []
        normal = []
        for event in HarmonyReader().whole(text):
            if event.kind == "call":
                call = self.call(event.raw or event.content)
                if call is not None:
                    calls.append((len(calls), call))
            elif event.kind == "normal":
                normal.append(event.content)
        return " ".join(normal).strip(), calls

    def call(self, text: str) -> dict[str, str] | None:
        """A call message's call (None, logged: not a call to a tool offered with JSON
        arguments)."""
        found = _CALL.search(text)
        if found is None:
            log.warning("tool_call_unparsed", text=text[:200])
            return None
        name = found.group(1).split(".")[-1]
        if name not in self.names:
            log.warning("tool_call_unknown_tool", name=name)
            return None
        raw = found.group(2)
        try:
            arguments = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            log.warning("tool_call_unparsed", name=name, error=str(exc))
            return None
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}

    def stream(self) -> _HarmonyStream:
        return _HarmonyStream(self)


# what shows an answer's text may be Harmony's (GptOssDetector.parse_streaming_increment)
_HINTS = (*_TOKENS, "assistantfinal")


class _HarmonyStream:
    """A stream of ``GptOssCalls``' answer: content as the reader gives it, each call whole
    once its message ends; text that shows nothing of Harmony goes out at once."""

    def __init__(self, owner: GptOssCalls) -> None:
        self.owner = owner
        self.reader = HarmonyReader()
        self.text = ""  # the text since the last events
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        events = self.reader.feed(delta)
        if not events and not any(hint in self.text for hint in _HINTS):
            out, self.text = self.text, ""
            return out, []
        if "<|channel|>commentary to=" not in self.text:
            if events:
                self.text = ""
            return "".join(e.content for e in events if e.kind == "normal"), []
        if not events:
            return "", []
        content, pieces = "", []
        for event in events:
            if event.kind == "normal":
                content += event.content
            elif event.kind == "call":
                call = self.owner.call(event.raw or event.content)
                if call is not None:
                    pieces.append({"index": self.calls, **call})
                    self.calls += 1
        self.text = ""
        return content, pieces

    def flush(self) -> str:
        if self.reader.buffer:  # a message cut short, never sent (as SGLang's stream)
            log.info("harmony_text_unsent", text=self.reader.buffer[:200])
        return ""

    def unsent(self) -> list[dict[str, Any]]:
        return []
