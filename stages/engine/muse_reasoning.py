"""Reasoning in Muse Glimmer's answers (SGLang's ``--reasoning-parser muse``): the answer is a run
of recipient channels (``stages.engine.muse_calls`` reads their headers and bodies)::

     to=self<|message|>thinking<|eom|><|start|>assistant to=user<|message|>the answer<|eot|>

The ``to=self`` channels are the reasoning (several joined by a newline); ``to=user`` and
``to=commentary`` are content, their body alone; a channel to any other recipient (a tool) is
content whole, header and end marker kept, for the tool-call reader; unframed prose is content,
its end marker kept. Whether a request reasons does not change the reading.

As SGLang 0.5.23 reads it (``parser/reasoning_parser.py``, ``MuseGlimmerDetector``;
``tests/stages/test_engine_sglang_muse.py`` holds this module to it on random answers where
SGLang imports):

- ``tools``: a tool-call parser reads the content (``tool_call_parser_active``, which the chat
  route sets for a request whose calls are read): streamed, the content channels keep their
  framing too, which the tool-call reader unwraps; whole, only where the answer, read without
  it, has an ATEM marker in its content (without one the chat route does not run the tool-call
  reader, so the content comes unwrapped);
- whole (``parse``): ``detect_and_parse``; a header never finished is content, a ``<|start|>``
  begun at the end of the answer dropped; with ``nonempty`` (``force_nonempty_content``) an
  answer without content has its reasoning as content.
- streamed (``feed``, ``finish``): ``parse_streaming_increment``'s steps, a tail that may begin
  a channel marker held back (at the end, as whole); with ``stream_reasoning`` false, a
  channel's reasoning once it ends; with ``nonempty``, the reasoning streamed since the last
  content is sent again, as content, at the end when the end brings no content of its own
  (``finish``, as the detector does).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from stages.engine.muse_calls import EOM, EOT, MESSAGE, START, Channels, has_calls, held, terminator

__all__ = ["MuseReasoning"]

_MARKERS = (EOM, EOT, START)
_LONGEST = len(MESSAGE)  # (the detector's MAX_CHANNEL_MARKER)
_SHOWN = ("user", "commentary")  # content channels whose framing goes, unless tools read it


class MuseReasoning:
    """One answer's reasoning and content."""

    def __init__(
        self, *, stream_reasoning: bool = True, nonempty: bool = False, tools: bool = False
    ) -> None:
        self.stream_reasoning = stream_reasoning
        self.nonempty = nonempty
        self.tools = tools
        self.channels = Channels()
        self.thought = False  # a reasoning channel was opened
        self.pending = ""  # stream_reasoning false: the reasoning of a channel not ended
        self.reasoning = ""  # nonempty: the reasoning since the last content

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer (``detect_and_parse``)."""
        reasoning, content = _Reading(text).read(True, False)
        if self.tools and has_calls(content):
            reasoning, content = _Reading(text).read(True, True)
        if self.nonempty and not content:
            return content, reasoning
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the text added to a stream."""
        self.channels.buffer += delta
        reasoning, content = self._read(False)
        if not self.stream_reasoning:
            self.pending += reasoning
            reasoning = ""
            if not self.channels.in_body and self.pending:
                reasoning, self.pending = self.pending, ""
        if self.nonempty:
            self.reasoning = "" if content else self.reasoning + reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What a stream still holds at its end."""
        reasoning, content = self._read(True)
        reasoning, self.pending = self.pending + reasoning, ""
        if self.nonempty:
            promoted, self.reasoning = self.reasoning + reasoning, ""
            if not content and promoted:
                return "", promoted
        return reasoning, content

    def _read(self, flush: bool) -> tuple[str, str]:
        return _read(self, flush, self.tools)


class _Reading:
    """A whole answer's own reading (its channels from the start)."""

    def __init__(self, text: str) -> None:
        self.channels = Channels()
        self.channels.buffer = text
        self.thought = False

    def read(self, flush: bool, framed: bool) -> tuple[str, str]:
        return _read(self, flush, framed)


def _read(state: MuseReasoning | _Reading, flush: bool, framed: bool) -> tuple[str, str]:
    """Reads what ``state``'s channels hold (``_consume``): ``(reasoning, content)``. ``flush``:
    the answer has ended (nothing held back); ``framed``: content channels keep their framing."""
    walk = state.channels
    reasoning: list[str] = []
    content: list[str] = []
    while walk.buffer:
        if not walk.in_body:
            spaces, kind, header = walk.open()
            content.append(spaces)
            if kind == "start":
                break
            if kind == "message":
                if flush:
                    content.append(walk.buffer)
                    walk.buffer = ""
                break
            if kind == "header":
                if walk.recipient == "self":
                    if state.thought:
                        reasoning.append("\n")
                    state.thought = True
                elif walk.recipient not in _SHOWN or framed:
                    content.append(header + MESSAGE)
            continue
        at, tag = terminator(walk.buffer)
        if at != -1:
            body = walk.buffer[:at]
            walk.buffer = walk.buffer[at + len(tag) :]
            walk.in_body = False
            if walk.recipient == "self":
                reasoning.append(body)
            else:
                content.append(body)
                if walk.recipient not in _SHOWN or framed:
                    content.append(tag)
            walk.recipient = None
            continue
        if flush:
            body, walk.buffer = walk.buffer, ""
        else:
            keep = held(walk.buffer, _MARKERS, _LONGEST)
            if keep == len(walk.buffer):
                break
            cut = len(walk.buffer) - keep
            body, walk.buffer = walk.buffer[:cut], walk.buffer[cut:]
        if not body:
            break
        (reasoning if walk.recipient == "self" else content).append(body)
    return "".join(reasoning), "".join(content)
