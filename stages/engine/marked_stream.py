"""The stream of an answer whose tool calls each run from a begin token to an end token
(DeepSeek's, Kimi K2's and GLM-4.5's formats: ``deepseek_calls``, ``kimi_calls``,
``glm_calls``): content until the calls begin, then each call's pieces as it is written.

A format says where its content ends and its calls begin (``content``), what of a call being
written goes out (``partial``) and what a call's whole text gives (``whole``); this class keeps
the text, finds the calls and ends the stream. It knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import structlog

from stages.engine.partial_json import CallPieces, PieceStream, partial_tail
from stages.engine.tool_formats import _Content, _Unreadable

__all__ = [
    "BlockStream",
    "ContentFirst",
    "MarkedStream",
    "OutsideText",
    "ReadBlocks",
    "whole_calls",
]

log = structlog.get_logger("stages.engine.tool_calls")

Pieces = list[dict[str, Any]]


def whole_calls(
    text: str, at: int, calls: re.Pattern[str], call: Callable[[str], dict[str, str] | None]
) -> tuple[str, list[dict[str, str]]]:
    """``(content, calls)`` of a whole answer whose calls begin at ``at`` (-1: none): the text
    before them, stripped, and ``call(text)`` of each match of ``calls`` (its calls' pattern)
    that gives one; an answer with a call that is ``_Unreadable``: no calls, the text as it is
    (the detectors' ``except Exception``)."""
    if at == -1:
        return text, []
    out = []
    try:
        for match in calls.finditer(text):
            found = call(match.group())
            if found is not None:
                out.append(found)
    except _Unreadable as exc:
        log.warning("tool_call_unparsed", error=str(exc))
        return text, []
    return text[:at].strip(), out


class MarkedStream(PieceStream, ABC):
    """A sample's text deltas in, content to send now and pieces of its calls out (a
    ``tool_calls.CallStream``); each format's stream implements the four abstract methods."""

    begin: str  # a call's begin token
    end: str  # its end token

    def __init__(self, pieces: CallPieces | None = None) -> None:
        super().__init__(pieces)
        self.pos: int | None = None  # where the calls not read yet begin (None: in content)
        self.open = False  # a call begun and not ended

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content = self.text, ""
        if self.pos is None:
            content, self.pos = self.content(text)
            if self.pos is None:
                return content, []
        pieces: Pieces = []
        while True:
            start = text.find(self.begin, self.pos)
            if start == -1:
                self.open = False
                break
            stop = text.find(self.end, start)
            self.open = stop == -1
            if self.open:
                pieces += self.partial(start, text[start + len(self.begin) :])
                break
            self.pos = stop + len(self.end)
            pieces += self.whole(start, text[start : self.pos])
        return content, pieces

    @abstractmethod
    def content(self, text: str) -> tuple[str, int | None]:
        """``(content to send now, where the calls begin)`` of the text so far, before any
        call (None: not known yet)."""

    @abstractmethod
    def rest(self, text: str) -> str:
        """At the end of an answer without calls: the content that waited."""

    def partial(self, key: int, body: str) -> Pieces:
        """Pieces of the call that begins at ``key`` (``body``: its text after the begin token
        so far); none by default (the call goes out whole, at its end token)."""
        return []

    @abstractmethod
    def whole(self, key: int, text: str) -> Pieces:
        """Pieces of the call that begins at ``key``, now whole (``text``: from its begin token
        to its end token)."""

    def flush(self) -> str:
        if self.pos is None:
            return self.rest(self.text)
        if self.open:
            log.warning("tool_call_incomplete", text=self.text[self.pos :][:200])
        return ""


class ContentFirst(MarkedStream):
    """A ``MarkedStream`` whose content is the text before its first call, stripped, as it
    comes (GLM-4.5's, dots'): a tail that may begin a call, and whitespace, wait."""

    def __init__(self, pieces: CallPieces | None = None) -> None:
        super().__init__(pieces)
        self.before = _Content(self.begin, strip=True)

    def content(self, text: str) -> tuple[str, int | None]:
        at = text.find(self.begin)
        return self.before.more(text, None if at == -1 else at), None if at == -1 else at

    def rest(self, text: str) -> str:
        return self.before.rest(text)


class BlockStream(PieceStream, ABC):
    """The stream of an answer whose calls are blocks from a begin tag to an end tag with
    content before, between and after them (GLM-4.7's, IQuest Q1's): the text outside the
    blocks goes to ``outside`` as it comes (a tail that may begin a block waits), a block being
    written to ``opened``, a whole one to ``closed``."""

    begin: str
    end: str

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0  # where the text not yet read begins

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content, pieces = self.text, "", []
        while True:
            start = text.find(self.begin, self.pos)
            if start == -1:
                upto = len(text) - partial_tail(text[self.pos :], self.begin)
                content += self.outside(text[self.pos : upto], False)
                self.pos = upto
                return content, pieces
            content += self.outside(text[self.pos : start], True)
            self.pos = start
            stop = text.find(self.end, start + len(self.begin))
            if stop == -1:
                return content, pieces + self.opened(start, text[start + len(self.begin) :])
            self.pos = stop + len(self.end)
            more, new = self.closed(start, text[start : self.pos])
            content, pieces = content + more, pieces + new

    @abstractmethod
    def outside(self, text: str, block_next: bool) -> str:
        """The content to send of ``text``, outside the blocks (``block_next``: a block
        begins after it)."""

    def opened(self, key: int, body: str) -> Pieces:
        """Pieces of the block that begins at ``key``, still being written (``body``: its
        text after the begin tag so far); none by default."""
        return []

    @abstractmethod
    def closed(self, key: int, block: str) -> tuple[str, Pieces]:
        """Content and pieces of the block that begins at ``key``, now whole (``block``: from
        its begin tag to its end tag)."""


# what a block's reading raises where its detector's whole-answer reading fails
_FAILS = (_Unreadable, AttributeError, KeyError, TypeError, ValueError, RecursionError)


class ReadBlocks(BlockStream):
    """The stream of a format whose blocks are read whole (IQuest Q1's, Spark 2.5's): the text
    outside them as it comes, each block at its end tag through ``reader.read`` (its text between
    the tags: a call, None for one dropped, False for no call: the block is content), a block
    never closed content at the end, as the whole answer has it."""

    def __init__(self, reader: Any, begin: str, end: str) -> None:
        super().__init__()
        self.reader, self.begin, self.end = reader, begin, end

    def outside(self, text: str, block_next: bool) -> str:
        return text

    def closed(self, key: int, block: str) -> tuple[str, Pieces]:
        try:
            call = self.reader.read(block[len(self.begin) : -len(self.end)])
        except _FAILS as exc:
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            call = None
        if call is False:  # no call: the block is content
            return block, []
        return "", [] if call is None else self.pieces.whole(key, call["name"], call["arguments"])

    def flush(self) -> str:
        rest, self.pos = self.text[self.pos :], len(self.text)
        return rest


class OutsideText:
    """The content of a stream: the text outside its calls joined, sent as it comes but for
    whitespace at its ends, which the whole answer strips once it has a call."""

    def __init__(self) -> None:
        self.text, self.sent, self.called = "", 0, False

    def more(self, text: str) -> str:
        self.text += text
        if self.called and not self.text[: self.sent].strip():
            self.sent = len(self.text) - len(self.text.lstrip())  # nothing but space went out
        upto = len(self.text.rstrip())
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def rest(self) -> str:
        """At the end: what waited, which the whole answer keeps where it has no call."""
        return "" if self.called else self.text[self.sent :]
