"""Apertus's reasoning (``stages.engine.apertus_reasoning``) against SGLang 0.5.23's own
``Apertus2509Detector`` (``parser/reasoning_parser.py``) on random answers: blocks of reasoning,
text around them, tool-call blocks inside them, tags cut short.

Skipped unless SGLang's parser imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")

from stages.engine.apertus_reasoning import ApertusReasoning  # noqa: E402

PIECES = ["<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>[", "<|tools_suffix|>",
          "think ", "text ", "\n", "<|inner", "<|tools_pre", '{"add": {"a": 1}}]', " "]  # fmt: skip


def _answer(r: random.Random) -> str:
    if r.random() < 0.5:  # as a model writes it: reasoning, a call inside it or after, text
        out = r.choice(["", "<|inner_prefix|>"]) + "let me think "
        if r.random() < 0.4:
            out += '<|tools_prefix|>[{"add": {"a": 1}}]' + r.choice(["<|tools_suffix|>", ""])
        out += r.choice(["more", ""]) + r.choice(["<|inner_suffix|>", ""]) + r.choice(["", "ok"])
        return out * r.randint(1, 2)
    return "".join(r.choice(PIECES) for _ in range(r.randint(1, 10)))


def _splits(r: random.Random, text: str) -> list[str]:
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nonempty", [False, True])
def test_apertus_reads_as_sglangs_detector(nonempty: bool) -> None:
    """Whole answers: the same reasoning and content as ``detect_and_parse`` and the same
    blocks as ``detect_and_parse_block_sequence``; streamed in random splits (reasoning
    streamed or not): what the whole answer gives, and on answers whose blocks all close, what
    SGLang's ``parse_streaming_increment`` and ``finish`` give."""
    r = random.Random(20 + nonempty)
    compared = 0
    for _ in range(3000):
        text = _answer(r)
        theirs = parser.Apertus2509Detector(force_nonempty_content=nonempty)
        want = theirs.detect_and_parse(text)
        ours = ApertusReasoning(nonempty=nonempty)
        assert ours.parse(text) == (want.reasoning_text, want.normal_text), text
        sequence = parser.Apertus2509Detector().detect_and_parse_block_sequence(text)
        assert ApertusReasoning().blocks(text) == sequence, text
        stream = r.random() < 0.7
        parts = _splits(r, text) if len(text) > 1 else [text]
        reader = ApertusReasoning(nonempty=nonempty, stream_reasoning=stream)
        got = ["", ""]
        for part in parts:
            for i, more in enumerate(reader.feed(part)):
                got[i] += more
        for i, more in enumerate(reader.finish()):
            got[i] += more
        if ApertusReasoning().parse(text)[1]:  # else (nonempty) the reasoning, twice
            assert tuple(got) == ours.parse(text), (text, parts)
        elif not nonempty:
            assert tuple(got) == ours.parse(text), (text, parts)
        # SGLang's stream reads a tool-call block in the reasoning to its end, past the
        # reasoning's (its whole answer stops at the reasoning's end, as the engine does)
        bare = text
        for tag in (
            "<|inner_prefix|>",
            "<|inner_suffix|>",
            "<|tools_prefix|>[",
            "<|tools_suffix|>",
        ):
            bare = bare.replace(tag, "")
        closed = "<|inner" not in bare and "<|tools" not in bare  # no tag cut short
        closed = (
            closed
            and text.count("<|inner_prefix|>") == text.count("<|inner_suffix|>")
            and all(
                part.endswith("<|tools_suffix|>")
                for kind, part in ApertusReasoning().blocks(text)
                if kind == "text" and part.startswith("<|tools_prefix|>[")
            )
        )
        if closed and not nonempty:
            detector = parser.Apertus2509Detector(stream_reasoning=stream)
            theirs_streamed = ["", ""]
            for part in parts:
                result = detector.parse_streaming_increment(part)
                theirs_streamed[0] += result.reasoning_text or ""
                theirs_streamed[1] += result.normal_text or ""
            result = detector.finish()
            theirs_streamed[0] += result.reasoning_text or ""
            theirs_streamed[1] += result.normal_text or ""
            assert tuple(got) == tuple(theirs_streamed), (text, parts)
            compared += 1
    assert nonempty or compared > 300


COHERE_PIECES = ["<|START_THINKING|>", "<|END_THINKING|>", "<|START_TEXT|>", "<|END_TEXT|>",
                 "<|START_ACTION|>", "<|END_ACTION|>", "think ", "answer ", "\n", "<|START",
                 "<|END_T", '[{"tool_name": "f"}]']  # fmt: skip


def _cohere_answer(r: random.Random) -> str:
    if r.random() < 0.6:  # as a model writes it: reasoning, then a text or an action block
        out = r.choice(["", "<|START_THINKING|>"]) + r.choice(["let me think ", ""])
        out += r.choice(["<|END_THINKING|>", "", "<|END_THINKING|>\n"])
        if r.random() < 0.5:
            out += "<|START_TEXT|>the answer" + r.choice(["<|END_TEXT|>", "", "<|END_TEXT|> x"])
        else:
            out += '<|START_ACTION|>[{"tool_name": "f"}]' + r.choice(["<|END_ACTION|>", ""])
        return out
    return "".join(r.choice(COHERE_PIECES) for _ in range(r.randint(1, 8)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nonempty", [False, True])
def test_cohere_command4_reads_as_sglangs_detector(nonempty: bool) -> None:
    """Whole answers: the same reasoning and content as ``CohereCommand4Detector``'s
    ``detect_and_parse``; streamed in random splits (answers that do not echo the start tag,
    which SGLang's stream sends as reasoning): what its ``parse_streaming_increment`` and
    ``finish`` give."""
    from stages.engine.cohere_reasoning import CohereReasoning

    r = random.Random(30 + nonempty)
    compared = 0
    for _ in range(3000):
        text = _cohere_answer(r)
        want = parser.CohereCommand4Detector(force_nonempty_content=nonempty).detect_and_parse(text)
        assert CohereReasoning(nonempty=nonempty).parse(text) == (
            want.reasoning_text, want.normal_text,
        ), text  # fmt: skip
        if nonempty or text.startswith("<|START_THINKING|>") or "<|START\n" in text:
            continue
        stream = r.random() < 0.7
        parts = _splits(r, text) if len(text) > 1 else [text]
        ours, theirs = CohereReasoning(stream_reasoning=stream), parser.CohereCommand4Detector(
            stream_reasoning=stream
        )  # fmt: skip
        got, their = ["", ""], ["", ""]
        for part in parts:
            for i, more in enumerate(ours.feed(part)):
                got[i] += more
            result = theirs.parse_streaming_increment(part)
            their[0] += result.reasoning_text or ""
            their[1] += result.normal_text or ""
        for i, more in enumerate(ours.finish()):
            got[i] += more
        # an empty delta first: its stream returns at the tag that ends the reasoning and reads
        # what follows on the next delta, which an answer that ends there does not have
        for result in (theirs.parse_streaming_increment(""), theirs.finish()):
            their[0] += result.reasoning_text or ""
            their[1] += result.normal_text or ""
        assert got == their, (text, parts)
        compared += 1
    assert nonempty or compared > 1000
