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
