"""Reasoning in Cohere Command's answers (SGLang's ``--reasoning-parser cohere_command4``)::

    thinking<|END_THINKING|><|START_TEXT|>the answer<|END_TEXT|>

The chat template opens ``<|START_THINKING|>``, so an answer begins in its reasoning (an echoed
start tag is taken out); the reasoning ends at ``<|END_THINKING|>``, or where the text block or
an action block (tool calls) begins. The content is the text between ``<|START_TEXT|>`` and
``<|END_TEXT|>``; an answer that calls tools instead keeps its action block whole as content,
for the tool-call reader; one that ends still thinking has none.

As SGLang 0.5.23 reads it (``parser/reasoning_parser.py``, ``CohereCommand4Detector``;
``tests/stages/test_engine_sglang_reasoning_blocks.py`` holds this module to it on random texts
where SGLang imports):

- whole (``parse``): ``detect_and_parse``; with ``nonempty`` an answer without content has its
  reasoning as content.
- streamed (``feed``, ``finish``): ``parse_streaming_increment``'s order, which decides at the
  first tag: reasoning up to it (a tail that may start a tag held back), then the text block's
  inside or, from an action block on, everything; the reasoning's echoed start tag is taken
  out as the whole answer takes it out (SGLang's stream sends it). An action block's content
  starts at its tag (the whole answer keeps what came between the reasoning's end and it, a
  newline); an answer whose tags come in another order is read in that order. With
  ``nonempty`` a stream that sent no content sends its reasoning as content at the end, as the
  other formats' do.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from stages.engine.partial_json import partial_tail

__all__ = ["CohereReasoning"]

START, END = "<|START_THINKING|>", "<|END_THINKING|>"
TEXT, TEXT_END, ACTION = "<|START_TEXT|>", "<|END_TEXT|>", "<|START_ACTION|>"


def _first(text: str, tags: tuple[str, ...], at: int = 0) -> tuple[int, str | None]:
    """Where the first of ``tags`` is in ``text`` from ``at``, and which (-1, None: none)."""
    found = [(i, tag) for tag in tags if (i := text.find(tag, at)) != -1]
    return min(found) if found else (-1, None)


class CohereReasoning:
    """One answer's reasoning and content."""

    def __init__(self, *, stream_reasoning: bool = True, nonempty: bool = False) -> None:
        self.stream_reasoning = stream_reasoning
        self.nonempty = nonempty
        self.text = ""
        self.pos = 0  # where the text not yet sent begins
        self.phase = "reasoning"  # then "open" (no block yet), "text", "action", "done"
        self.reasoning = ""  # streamed so far
        self.said = False  # content went out

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer (``detect_and_parse``)."""
        cut, tag = _first(text, (END,))
        if cut == -1:
            cut, tag = _first(text, (TEXT,))
        if cut == -1:
            cut, tag = _first(text, (ACTION,))
        if cut == -1:
            reasoning, rest = text, ""
        else:
            reasoning = text[:cut]
            rest = text[cut + len(END) :] if tag == END else text[cut:]
        if reasoning.startswith(START):
            reasoning = reasoning[len(START) :]
        content = _inside(rest)
        if self.nonempty and not content:
            return content, reasoning
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning = content = ""
        while True:
            text = self.text
            if self.phase == "reasoning":
                cut, tag = _first(text, (END, TEXT, ACTION), self.pos)
                if cut == -1:
                    if self.stream_reasoning:
                        held = max(partial_tail(text, t) for t in (START, END, TEXT, ACTION))
                        reasoning += self._thought(len(text) - held, False)
                    break
                reasoning += self._thought(cut, True)
                self.pos, self.phase = (cut + len(END) if tag == END else cut), "open"
            elif self.phase == "open":
                cut, tag = _first(text, (TEXT, ACTION), self.pos)
                if cut == -1:
                    break
                self.pos, self.phase = (cut + len(TEXT), "text") if tag == TEXT else (cut, "action")
            elif self.phase == "text":
                cut = text.find(TEXT_END, self.pos)
                upto = cut if cut != -1 else len(text) - partial_tail(text, TEXT_END)
                content += text[self.pos : max(upto, self.pos)]
                self.pos = max(upto, self.pos)
                if cut != -1:
                    self.phase = "done"
                break
            elif self.phase == "action":
                content += text[self.pos :]
                self.pos = len(text)
                break
            else:
                break
        self.said = self.said or bool(content)
        self.reasoning += reasoning
        return reasoning, content

    def _thought(self, upto: int, final: bool) -> str:
        """The reasoning from where it was sent up to ``upto``, its echoed start tag out
        (``final``: the reasoning ends there; else a start of the tag waits)."""
        if self.pos == 0 and self.text.startswith(START):
            self.pos = len(START)
        elif self.pos == 0 and not final and START.startswith(self.text[: len(START)]):
            return ""  # may yet be the start tag
        out = self.text[self.pos : max(upto, self.pos)]
        self.pos = max(upto, self.pos)
        return out

    def finish(self) -> tuple[str, str]:
        reasoning = content = ""
        if self.phase == "reasoning":
            reasoning = self._thought(len(self.text), True)
        elif self.phase == "text":
            content, self.pos = self.text[self.pos :], len(self.text)
        self.reasoning += reasoning
        if self.nonempty and not (self.said or content):
            return "", self.reasoning
        return reasoning, content


def _inside(rest: str) -> str:
    """The content of what follows the reasoning (``_strip_text_markers``): the text block's
    inside, or with no text block but an action block, all of it."""
    start = rest.find(TEXT)
    if start == -1:
        return rest if ACTION in rest else ""
    tail = rest[start + len(TEXT) :]
    end = tail.find(TEXT_END)
    return tail if end == -1 else tail[:end]
