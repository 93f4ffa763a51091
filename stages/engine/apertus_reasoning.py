"""Reasoning in Apertus's answers (SGLang's ``--reasoning-parser apertus2509``): blocks between
``<|inner_prefix|>`` and ``<|inner_suffix|>``, any number of them, the text around them content,
and a tool-call block inside a reasoning block (``<|tools_prefix|>[`` to ``<|tools_suffix|>``,
or to the end) content too, so that the tool-call reader finds it.

As SGLang 0.5.23 reads it (``parser/reasoning_parser.py``, ``Apertus2509Detector``;
``tests/stages/test_engine_sglang_reasoning_blocks.py`` holds this module to it on random texts
where SGLang imports):

- whole (``parse``): ``detect_and_parse_block_sequence``'s blocks, the reasoning ones joined and
  the text ones joined; a reasoning block never closed runs to the end; with ``nonempty``
  (``force_nonempty_content``) an answer without content has its reasoning as content.
  ``blocks`` gives the sequence itself (``/separate_reasoning`` with ``return_blocks``).
- streamed (``feed``, ``finish``): what the whole answer so far gives, less a tail that may be
  the start of a tag (held until the next delta); with ``stream_reasoning`` false, a reasoning
  block's text waits for its end. The reasoning and content streamed add up to the whole
  answer's. (SGLang's stream gives the same on these answers but at its end, where its
  ``finish`` gives a reasoning block cut inside a tool block as reasoning.)

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from stages.engine.partial_json import partial_tail

__all__ = ["ApertusReasoning"]

START, END = "<|inner_prefix|>", "<|inner_suffix|>"
TOOL_START, TOOL_END = "<|tools_prefix|>[", "<|tools_suffix|>"
_TAGS = (START, END, TOOL_START, TOOL_END)


def _inner(text: str, closed: bool) -> list[tuple[str, str, bool]]:
    """One reasoning block's text split into reasoning and the tool-call blocks in it
    (``_split_inner_reasoning``); each part ``(kind, text, whether its block is closed)``."""
    out, at = [], 0
    while (start := text.find(TOOL_START, at)) != -1:
        if start > at:
            out.append(("reasoning", text[at:start], closed))
        end = text.find(TOOL_END, start)
        if end == -1:
            out.append(("text", text[start:], closed))
            return out
        out.append(("text", text[start : end + len(TOOL_END)], closed))
        at = end + len(TOOL_END)
    if text[at:]:
        out.append(("reasoning", text[at:], closed))
    return out


def _blocks(text: str, in_reasoning: bool) -> list[tuple[str, str, bool]]:
    """``detect_and_parse_block_sequence`` (``in_reasoning``: the answer continues a message
    whose reasoning is open), each block with whether its reasoning block is closed."""
    out: list[tuple[str, str, bool]] = []
    at = 0
    if in_reasoning:
        end = text.find(END)
        if end == -1:
            return [*_inner(text, False), ("text", "", True)]
        out += _inner(text[:end], True)
        at = end + len(END)
    while True:
        start = text.find(START, at)
        if start == -1:
            out.append(("text", text[at:], True))
            break
        if start > at:
            out.append(("text", text[at:start], True))
        at = start + len(START)
        end = text.find(END, at)
        if end == -1:
            out += [*_inner(text[at:], False), ("text", "", True)]
            break
        out += _inner(text[at:end], True)
        at = end + len(END)
    last = len(out) - 1  # empty text blocks dropped, but the last
    return [b for i, b in enumerate(out) if not (b[0] == "text" and not b[1] and i != last)]


class ApertusReasoning:
    """One answer's reasoning and content (``previous``: the message a
    ``continue_final_message`` request continues)."""

    def __init__(
        self, *, stream_reasoning: bool = True, previous: str = "", nonempty: bool = False
    ) -> None:
        self.stream_reasoning = stream_reasoning
        self.nonempty = nonempty
        self.in_reasoning = START in previous and END not in previous[previous.rfind(START) :]
        self.text = ""
        self.sent = ("", "")  # the reasoning and the content streamed so far

    def blocks(self, text: str) -> list[tuple[str, str]]:
        return [(kind, part) for kind, part, _ in _blocks(text, self.in_reasoning)]

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer."""
        reasoning, content = self._split(text, closed_only=False)
        if self.nonempty and not content:
            return content, reasoning
        return reasoning, content

    def _split(self, text: str, closed_only: bool) -> tuple[str, str]:
        blocks = _blocks(text, self.in_reasoning)
        reasoning = "".join(p for k, p, closed in blocks if k == "reasoning" and
                            (closed or not closed_only))  # fmt: skip
        return reasoning, "".join(p for k, p, _ in blocks if k == "text")

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        held = max(partial_tail(self.text, tag) for tag in _TAGS)
        return self._more(self.text[: len(self.text) - held], not self.stream_reasoning)

    def finish(self) -> tuple[str, str]:
        reasoning, content = self._more(self.text, False)
        if self.nonempty and not self.sent[1]:  # no content: the reasoning is
            self.sent = ("", self.sent[0])
            return "", self.sent[1]
        return reasoning, content

    def _more(self, text: str, closed_only: bool) -> tuple[str, str]:
        reasoning, content = self._split(text, closed_only)
        (old_reasoning, old_content), self.sent = self.sent, (reasoning, content)
        if not (reasoning.startswith(old_reasoning) and content.startswith(old_content)):
            self.sent = (old_reasoning, old_content)  # cannot be: the answer so far is its start
            return "", ""
        return reasoning[len(old_reasoning) :], content[len(old_content) :]
