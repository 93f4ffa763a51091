"""Reasoning in Kimi K3's answers (SGLang's ``--reasoning-parser kimi_k3``): XTML channels, each
marker a run of special tokens::

    <|open|>think<|sep|>plan<|close|>think<|sep|><|open|>response<|sep|>Hi.<|close|>response<|sep|>

The chat template opens the think channel in the prompt of a thinking request, so such an
answer begins in its reasoning. The reasoning ends at ``<|close|>think<|sep|>``, or where the
``response`` channel or the ``tools`` channel opens; the content is the text after it with the
``response`` and ``message`` markers taken out (``kimi_k3_calls.strip_wrappers``: the inside of
the response channel), the ``tools`` channel passed on as it is, for the tool-call reader. An
answer that closes a response channel before any think close or channel opens skipped its
reasoning (the model does that on very long prompts): it is all content.

As SGLang 0.5.23 reads it (``parser/reasoning_parser.py``, ``KimiK3Detector``, and
``BaseReasoningFormatDetector.finish``; ``tests/stages/test_engine_sglang_kimi_k3.py`` holds
this module to it on random answers where SGLang imports, whole and step by step):

- ``force``: the answer starts in its reasoning (``force_reasoning``: on the chat route the
  template's or the request's thinking, SGLang's ``reasoning_default="thinking"``; with no chat
  request, the parse route, on); ``previous``: the assistant message a
  ``continue_final_message`` request continues (a think open in it starts the reasoning, a
  think close in it ends it);
- whole (``parse``): ``detect_and_parse``, which never hands the reasoning over as content;
  with ``nonempty`` (``force_nonempty_content``) only an answer without any think marker that
  closes its response or message is content whole;
- streamed (``feed``, ``finish``): ``parse_streaming_increment``'s steps, down to the tails
  held while they may begin a marker and the reasoning already sent that a skipped think
  channel sends again as content; with ``nonempty`` its ``finish`` (a skipped-think answer sent
  as reasoning goes again as content, the rest of a held reasoning as reasoning), without it
  the base detector's (what is held goes out as reasoning, or as content once out of it).

The stream is not whole-consistent where SGLang's is not (a stream that meets no marker it
can decide on sends its text before the whole answer would: e.g. the text before an echoed
think open, which the whole answer keeps as reasoning): held to SGLang's steps, not to its
whole reading.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from stages.engine.kimi_k3_calls import (
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_OPEN,
    cut_partial,
    held_tail,
    strip_wrappers,
)

__all__ = ["KimiK3Reasoning"]

_WRAPPERS = (RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE)


def _content(text: str) -> str:
    """The content of the text after the reasoning: the response channel's inside, the tools
    channel as it is (``_clean_content``)."""
    at = text.find(TOOLS_OPEN)
    if at == -1:
        return strip_wrappers(text)
    return strip_wrappers(text[:at]) + text[at:]


def _next_channel(text: str, start: int = 0) -> int:
    """Where the response or tools channel first opens (-1: neither)."""
    found = [at for tag in (RESPONSE_OPEN, TOOLS_OPEN) if (at := text.find(tag, start)) != -1]
    return min(found) if found else -1


def _skipped_think(text: str, start: int = 0, close: int = -1, channel: int = -1) -> bool:
    """A response close comes before any think close and channel open
    (``_skipped_think_channel``)."""
    at = text.find(RESPONSE_CLOSE, start)
    return at != -1 and all(bound == -1 or at < bound for bound in (close, channel))


def _skipped_answer(text: str) -> bool:
    """No think marker (nor one without its ``<|sep|>``), and a response or message close
    (``_is_skipped_think_answer``)."""
    marks = (THINK_OPEN, THINK_CLOSE, THINK_OPEN[: -len("<|sep|>")], THINK_CLOSE[: -len("<|sep|>")])
    return not any(mark in text for mark in marks) and (
        RESPONSE_CLOSE in text or MESSAGE_CLOSE in text
    )


def _unwrapped(text: str) -> str:
    for marker in _WRAPPERS:
        text = text.replace(marker, "")
    return text


class KimiK3Reasoning:
    """One answer's reasoning and content."""

    def __init__(
        self,
        *,
        force: bool = True,
        stream_reasoning: bool = True,
        previous: str = "",
        nonempty: bool = False,
    ) -> None:
        self.in_reasoning = force
        if THINK_OPEN in previous:
            self.in_reasoning = True
        if THINK_CLOSE in previous:
            self.in_reasoning = False
        self.stream_reasoning = stream_reasoning
        self.nonempty = nonempty
        self._buffer = ""  # text not sent yet
        self._opened = False  # the think open was taken out (stripped_think_start)
        self._done = False  # past the reasoning (_reasoning_done)
        self._passthrough = False  # in the tools channel: everything goes out as it is
        self._text = ""  # with nonempty: the whole stream so far
        self._sent: list[str] = []  # reasoning streamed, sent again if the think was skipped
        self._drop_close = False  # after a skipped think: a later think close is dropped

    # -- whole answers -------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer (``detect_and_parse``)."""
        if not (self.in_reasoning or THINK_OPEN in text) and THINK_CLOSE not in text:
            return "", _content(text)
        if self.nonempty and _skipped_answer(text):
            return "", _content(text)
        opened = text.find(THINK_OPEN)
        start = opened + len(THINK_OPEN) if opened != -1 else 0
        close = text.find(THINK_CLOSE, start)
        tools = text.find(TOOLS_OPEN, start)
        channel = _next_channel(text, start)
        if _skipped_think(text, start, close, channel):
            return "", _content(text[start:].replace(THINK_CLOSE, ""))
        if close != -1 and tools != -1 and tools < close:
            return cut_partial(text[start:tools]), _content(text[tools:])
        if close == -1:
            if channel != -1:
                return cut_partial(text[start:channel]), _content(text[channel:])
            return cut_partial(text[start:]), ""
        return text[start:close], _content(text[close + len(THINK_CLOSE) :])

    # -- streams -------------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the text added to a stream
        (``parse_streaming_increment``)."""
        self._buffer += delta
        if self.nonempty:
            self._text += delta
        if not self.in_reasoning and not self._done:
            at = self._buffer.find(THINK_OPEN)
            if at != -1:  # (what came before the open is dropped, as SGLang drops it)
                self._buffer = self._buffer[at + len(THINK_OPEN) :]
                self.in_reasoning = self._opened = True
            elif THINK_OPEN.startswith(self._buffer):
                return "", ""
            else:
                self._done = True
        if not self.in_reasoning:
            return "", self._drain()
        buf = self._buffer
        if not self._opened and (at := buf.find(THINK_OPEN)) != -1:
            buf = self._buffer = buf[at + len(THINK_OPEN) :]
            self._opened = True
        close = buf.find(THINK_CLOSE)
        tools = buf.find(TOOLS_OPEN)
        channel = _next_channel(buf)
        if _skipped_think(buf, close=close, channel=channel):
            replay = "".join(self._sent)
            self._sent.clear()
            self.in_reasoning, self._done, self._drop_close = False, True, True
            return "", replay + self._drain()
        if close != -1 and not (tools != -1 and tools < close):
            self._buffer = buf[close + len(THINK_CLOSE) :]
            self.in_reasoning, self._done = False, True
            self._sent.clear()
            return buf[:close], self._drain()
        if channel != -1:
            self._buffer = buf[channel:]
            self.in_reasoning, self._done = False, True
            self._sent.clear()
            self._passthrough = buf.startswith(TOOLS_OPEN, channel)
            return cut_partial(buf[:channel]), self._drain()
        if not self.stream_reasoning:
            return "", ""
        markers = [THINK_CLOSE, TOOLS_OPEN, *_WRAPPERS]
        if not self._opened:
            markers.append(THINK_OPEN)
        emit = cut_partial(buf[: len(buf) - held_tail(buf, markers)])
        self._buffer = buf[len(emit) :]
        self._sent.append(emit)
        return emit, ""

    def finish(self) -> tuple[str, str]:
        """What a stream still holds when its answer ends (``finish``)."""
        self._sent.clear()
        if not self.nonempty:  # BaseReasoningFormatDetector.finish
            left, self._buffer = self._buffer, ""
            if not self.in_reasoning:
                return "", left
            if left.startswith(THINK_OPEN):
                left = left[len(THINK_OPEN) :]
            return left, ""
        text, self._text = self._text, ""
        if self.in_reasoning and _skipped_answer(text):
            self._buffer = ""
            return "", _content(text)
        if self.in_reasoning and not self.stream_reasoning and self._buffer:
            left, self._buffer = self._buffer, ""
            return left, ""
        return "", ""

    def _drain(self) -> str:
        """The content that can go out now (``_drain_content``): in the tools channel all of
        it, before it the response channel's inside, a tail that may begin a marker held (and
        after a skipped think, a think close dropped)."""
        buf = self._buffer
        if not buf:
            return ""
        close = [THINK_CLOSE] if self._drop_close else []
        if self._passthrough or (tools := buf.find(TOOLS_OPEN)) != -1:
            emit = buf[: len(buf) - held_tail(buf, close)] if close else buf
            self._buffer = buf[len(emit) :]
            if not self._passthrough:  # the tools channel opens in it
                head, tail = _unwrapped(emit[:tools]), emit[tools:]
                self._passthrough = True
                if self._drop_close:
                    head, tail = head.replace(THINK_CLOSE, ""), tail.replace(THINK_CLOSE, "")
                return head + tail
            return emit.replace(THINK_CLOSE, "") if self._drop_close else emit
        emit = buf[: len(buf) - held_tail(buf, [*_WRAPPERS, TOOLS_OPEN, *close])]
        self._buffer = buf[len(emit) :]
        emit = _unwrapped(emit)
        return emit.replace(THINK_CLOSE, "") if self._drop_close else emit
