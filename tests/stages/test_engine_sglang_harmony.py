"""gpt-oss's Harmony format read by ``stages.engine.harmony`` and by SGLang 0.5.23's own code
on random texts (well-formed messages, some cut short, and fragments of tokens, channel words
and text): the reader's events (``parser/harmony_parser.py`` ``HarmonyParser``), the reasoning
parser's split (``reasoning_parser.py`` ``GptOssDetector``) and the tool-call parser's content
and calls (``function_call/gpt_oss_detector.py``), whole and fed in random splits.

Skipped unless SGLang's code imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

harmony_parser: Any = pytest.importorskip("sglang.srt.parser.harmony_parser")
reasoning_parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")
gpt_oss_detector: Any = pytest.importorskip("sglang.srt.function_call.gpt_oss_detector")
protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")

from stages.engine.harmony import HarmonyReader, HarmonyReasoning  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("add", "get_weather")
]
FRAGMENTS = [
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
    "<|return|>", "assistant", "analysis", "commentary", "final", "Analysis", "json", " ", "\n",
    " to=functions.add ", "to=get_weather", '{"a": 1}', "hi ", "x", "<|", "<|sta", "<|chan",
    "<|weird|>", "|>", "assistantfinal", "assistantfin", "commentary ", "FINAL",
]  # fmt: skip
RECIPIENTS = ["functions.add", "functions.get_weather", "add", "functions.ghost", "x.y.add"]
ARGUMENTS = ['{"a": 1}', '{"city": "Paris", "n": [1, 2.5]}', '{"b": "é"}', "{", "", " 7 ", "NaN"]


def _message(r: random.Random) -> str:
    start = r.choice(["", "<|start|>assistant", "<|start|>assistant"])
    kind = r.random()
    if kind < 0.3:
        body = r.choice(["Let me think.", "a\nb", "", " x "])
        return start + "<|channel|>analysis<|message|>" + body + r.choice(["<|end|>"] * 4 + [""])
    if kind < 0.65:
        header = f"<|channel|>commentary to={r.choice(RECIPIENTS)}" + r.choice([" ", ""])
        if r.random() < 0.2:  # the recipient before the channel, as the model may write it
            header = f" to={r.choice(RECIPIENTS)}<|channel|>commentary "
        end = r.choice(["<|call|>"] * 5 + ["<|end|>", ""])
        after = r.choice(["", "", "commentary", "\n"])
        return start + header + "<|constrain|>json<|message|>" + r.choice(ARGUMENTS) + end + after
    if kind < 0.9:
        body = r.choice(["It is sunny.", "", "x y", "<|end|>z"])
        return start + "<|channel|>final<|message|>" + body + r.choice(["<|return|>", "", " t"])
    return r.choice(["analysis", "assistantfinal", "commentary", "plain"]) + r.choice([" hi", ""])


def _text(r: random.Random) -> str:
    if r.random() < 0.6:
        return "".join(_message(r) for _ in range(r.randint(1, 4)))
    return "".join(r.choice(FRAGMENTS) for _ in range(r.randint(0, 14)))


def _splits(r: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _theirs(events: list[Any]) -> list[tuple[str, str, str]]:
    kinds = {"tool_call": "call"}
    return [(kinds.get(e.event_type, e.event_type), e.content, e.raw_text or "") for e in events]


def _ours(events: list[Any]) -> list[tuple[str, str, str]]:
    return [(e.kind, e.content, e.raw) for e in events]


@pytest.mark.timeout(120)
def test_reader_gives_sglangs_events_whole_and_in_random_splits() -> None:
    r = random.Random(0)
    structured = 0
    for _ in range(4000):
        text = _text(r)
        parser = harmony_parser.HarmonyParser()
        want = _theirs(parser.parse(text) + parser.parse(""))
        reader = HarmonyReader()
        assert _ours(reader.whole(text)) == want, text
        structured += reader.read is not None
        parts = _splits(r, text)
        parser, reader = harmony_parser.HarmonyParser(), HarmonyReader()
        theirs: list[Any] = []
        ours: list[Any] = []
        for part in parts:
            theirs += _theirs(parser.parse(part))
            ours += _ours(reader.feed(part))
        assert ours == theirs, parts
    assert structured > 3000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nonempty", [False, True])
def test_reasoning_splits_as_sglangs_gpt_oss_detector(nonempty: bool) -> None:
    """The same reasoning and content, whole and streamed; where SGLang's reader never finds a
    structure (and drops the answer), the answer is content here."""
    r = random.Random(1)
    dropped = 0
    for _ in range(3000):
        text = _text(r)
        detector = reasoning_parser.GptOssDetector(force_nonempty_content=nonempty)
        want = detector.detect_and_parse(text)
        ours = HarmonyReasoning(nonempty=nonempty)
        got = ours.parse(text)
        if ours.reader.read is None:  # SGLang's answer is empty: here, the text
            assert (want.reasoning_text, want.normal_text) == ("", "")
            assert got == ("", text)
            dropped += 1
            continue
        assert got == (want.reasoning_text, want.normal_text), text
        parts = _splits(r, text)
        detector, ours = reasoning_parser.GptOssDetector(), HarmonyReasoning()
        for part in parts:
            step = detector.parse_streaming_increment(part)
            assert ours.feed(part) == (step.reasoning_text, step.normal_text), parts
        end = detector.finish()
        assert ours.finish() == (end.reasoning_text, end.normal_text)
    assert 0 < dropped < 1000


@pytest.mark.timeout(120)
def test_tool_calls_read_as_sglangs_gpt_oss_detector(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(2)
    with_calls = 0
    for _ in range(3000):
        text = _text(r)
        if r.random() < 0.5:  # as the reasoning parser hands it on
            text = HarmonyReasoning().parse(text)[1]
        detector = gpt_oss_detector.GptOssDetector()
        want = detector.detect_and_parse(text, tools)
        reader = ToolCallParser(TOOLS, "gpt-oss")
        content, calls = reader.indexed(text, {})
        got = [(i, c["name"], c["arguments"]) for i, c in calls]
        assert got == [(c.tool_index, c.name, c.parameters) for c in want.calls], text
        assert content == want.normal_text, text
        assert reader.has_tool_call(text) == detector.has_tool_call(text)
        with_calls += bool(calls)
        detector, stream = gpt_oss_detector.GptOssDetector(), reader.stream()
        for part in _splits(r, text):
            step = detector.parse_streaming_increment(part, tools)
            more, pieces = stream.feed(part)
            assert more == step.normal_text, text
            assert [(p["index"], p["name"], p["arguments"]) for p in pieces] == [
                (c.tool_index, c.name, c.parameters) for c in step.calls
            ], text
        assert stream.flush() == ""
    assert with_calls > 300
