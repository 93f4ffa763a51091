"""MiniMax-M3's tool calls read by the engine (``stages.engine.minimax_m3_calls``) and by SGLang
0.5.23's own detector (``function_call/minimax_m3.py``, ``MinimaxM3Detector``) on random answers:
well-formed calls with typed, nested and listed values, and every way of getting them wrong
(markers spaced, tags cut, mismatched or without ``>``, blocks never closed, unknown tools).
Whole (``detect_and_parse``), with tools and without: the same content and the same calls, each
numbered by its place in its block; fed in random splits, the engine's stream adds up to what
the detector reads whole, where that reading does not fail (the module says why a stream
cannot know it will).

Skipped unless SGLang's detector imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how; it also needs ``partial_json_parser``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
m3: Any = pytest.importorskip("sglang.srt.function_call.minimax_m3")

from stages.engine.minimax_m3_calls import NS  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _our_stream, _splits  # noqa: E402

PROPERTIES = {
    "a": {"type": "integer"}, "b": {"type": "number"}, "flag": {"type": "boolean"},
    "s": {"type": "string"}, "ns": {"type": ["string", "null"]},
    "ni": {"type": ["integer", "null"]},
    "items": {"type": "array", "items": {"type": "integer"}},
    "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
    "cfg": {"type": "object", "properties": {"k": {"type": "integer"}, "deep": {"type": "object"}},
            "additionalProperties": {"type": "boolean"}},
    "any": {}, "loose": {"type": "object"},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add",
     "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "bare", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "union", "parameters": {"anyOf": [
        {"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "boolean"}}}]}}},
    {"type": "function", "function": {"name": "list", "parameters": {"type": "array",
     "items": {"type": "object", "properties": {"v": {"type": "number"}}}}}},
]  # fmt: skip
NAMES = ["add", "bare", "union", "list", "ghost", ""]
KEYS = [*PROPERTIES, "x", "y", "k", "v", "item", "zz"]
VALUES = ["1", "2.5", "1e3", "-3", " 7 ", "1_000", "true", "False", "yes", "off", "0", "null",
          "NULL", "None", "", "abc", "[1, 2]", '{"k": 1}', "nan", "inf", "1e400", "é", "a<b",
          "x\ny", '"q"']  # fmt: skip
SPACES = ["", "", "", " ", "\n", " \t\n"]


def _tag(r: random.Random, inner: str) -> str:
    """A tag led by the marker, spaced as a model may space it."""
    return NS + r.choice(SPACES) + inner


def _element(r: random.Random, depth: int, sound: bool) -> str:
    """A parameter element (``sound``: its tags whole and matched), some nested."""
    key = r.choice(KEYS)
    opening = [f"<{key}>", f"< {key} >"] if sound or not depth else [f"<{key}>", f"<{key}"]
    out = _tag(r, r.choice(opening))
    if depth < 2 and r.random() < 0.3:
        for _ in range(r.randint(0, 3)):
            out += _element(r, depth + 1, sound)
    else:
        out += r.choice(VALUES) + r.choice(SPACES)
    if sound:
        return out + _tag(r, r.choice([f"</{key}>", f"</ {key} >"]))
    closing = r.choice([key, key, key, "zz", f" {key} "])
    return out + r.choice([_tag(r, f"</{closing}>"), _tag(r, f"</{closing}>"), _tag(r, "</"), ""])


def _answer(r: random.Random) -> str:
    """Content and blocks of calls: sound ones (tags whole, names known or not) or any."""
    sound = r.random() < 0.6
    out = r.choice(["", "Sure ", " text\n", "\n", NS, "a " + NS + " <b>"])
    for _ in range(r.randint(0, 3)):
        out += _tag(r, "<tool_call>") + r.choice(["\n", ""])
        for _ in range(r.randint(0, 2)):
            name = r.choice(NAMES)
            forms = (
                [f'<invoke name="{name}">']
                if sound
                else [f'<invoke name="{name}">', f'<invoke name="{name}"', f"<invoke name={name}>"]
            )
            out += _tag(r, r.choice(forms)) + r.choice(["\n", ""])
            for _ in range(r.randint(0, 3)):
                out += _element(r, 0, sound) + r.choice(["\n", ""])
            ends = [_tag(r, "</invoke>")] if sound else [_tag(r, "</invoke>"), ""]
            out += r.choice(ends) + r.choice(["\n", ""])
        ends = [_tag(r, "</tool_call>")] if sound else [_tag(r, "</tool_call>"), ""]
        out += r.choice(ends) + r.choice(["", " mid ", "\n", NS])
    return out


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]]:
    got = m3.MinimaxM3Detector().detect_and_parse(text, tools)
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


def _fails(text: str, tools: list[Any]) -> bool:
    """The detector's whole reading raises (it then gives the text back, without calls)."""
    detector = m3.MinimaxM3Detector()
    try:
        detector._extract(detector._normalize_tag_spacing(text), tools)
    except Exception:
        return True
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_tools", [True, False])
def test_minimax_m3_reads_as_sglangs_detector(
    with_tools: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``minimax_m3.py:71`` (``detect_and_parse``), ``:96`` (``_extract``), ``:119``
    (``_parse_block``: each call numbered in its block; without tools, kept as named),
    ``:551`` (``_parse_parameter``), ``:477`` (``_convert_leaf_value``)."""
    caplog.set_level(logging.CRITICAL)
    raw = TOOLS if with_tools else []
    tools = [protocol.Tool.model_validate(t) for t in raw]
    r = random.Random(7 if with_tools else 8)
    failed = called = 0
    for _ in range(20000):
        text = _answer(r)
        reader = ToolCallParser(raw, "minimax-m3")
        assert reader.has_tool_call(text) == m3.MinimaxM3Detector().has_tool_call(text), text
        content, calls = reader.indexed(text, {})
        want = _theirs(text, tools)
        assert (content, [(i, c["name"], c["arguments"]) for i, c in calls]) == want, text
        failed += _fails(text, tools)
        called += bool(calls)
    assert failed > 500 and called > 5000, (failed, called)


@pytest.mark.timeout(120)
def test_minimax_m3_streams_what_sglangs_detector_reads_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Random splits of each answer fed to the engine's stream: its content and its calls'
    pieces added up are the detector's whole reading (``minimax_m3.py:71``)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(9)
    compared = 0
    for _ in range(20000):
        text = _answer(r)
        if _fails(text, tools):
            continue
        parts = _splits(r, text) if len(text) > 1 else [text]
        content, calls = _our_stream("minimax-m3", parts, TOOLS)
        want_content, want_calls = _theirs(text, tools)
        assert (content, [calls[i] for i in sorted(calls)]) == (
            want_content,
            [[name, arguments] for _, name, arguments in want_calls],
        ), parts
        compared += 1
    assert compared > 10000


THINK = ["<mm:think>", "</mm:think>", "plan ", "ok", " ", "\n", "</mm:", "<mm:th", "x</mm:think>y"]


def _thought(r: random.Random) -> str:
    """Reasoning as M3 writes it (opened or not, a stray closer first, cut short), or pieces."""
    if r.random() < 0.5:
        out = r.choice(["", " ", "\n", "</mm:think>", " </mm:think>", "</mm:think></mm:think>"])
        out += r.choice(["", "<mm:think>"]) + r.choice(["plan ", "", "a\nb"])
        return out + r.choice(["</mm:think>", ""]) + r.choice(["", "answer", " answer"])
    return "".join(r.choice(THINK) for _ in range(r.randint(1, 8)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("force", [False, True])
def test_minimax_m3_reasoning_reads_as_sglangs_detector(force: bool) -> None:
    """``reasoning_parser.py:1197`` (``MiniMaxM3Detector``): whole answers (forced or not,
    ``force_nonempty_content`` or not, reasoning streamed or held) give the detector's
    reasoning and content (``detect_and_parse``); fed in random splits, what its
    ``parse_streaming_increment`` gives each step and its ``finish`` at the end (but for spaces
    out of the reasoning and nothing after them, which its stream drops and the engine's
    sends as content, as its whole answer has them)."""
    parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")
    from stages.engine.reasoning import PARSERS, ThinkParser

    fmt = PARSERS["minimax-m3"]
    r = random.Random(30 + force)
    for _ in range(5000):
        text = _thought(r)
        options = {"force_nonempty_content": r.random() < 0.3, "stream_reasoning": r.random() < 0.7}
        mine = {"nonempty": options["force_nonempty_content"],
                "stream_reasoning": options["stream_reasoning"]}  # fmt: skip
        theirs = parser.MiniMaxM3Detector(force_reasoning=force, **options)
        want = theirs.detect_and_parse(text)
        got = ThinkParser(fmt, force=force, **mine).parse(text)
        assert got == (want.reasoning_text, want.normal_text), text
        theirs = parser.MiniMaxM3Detector(force_reasoning=force, **options)
        ours = ThinkParser(fmt, force=force, **mine)
        parts = _splits(r, text) if len(text) > 1 else [text]
        for part in parts:
            step = theirs.parse_streaming_increment(part)
            assert ours.feed(part) == (step.reasoning_text, step.normal_text), parts
        end, (thought, content) = theirs.finish(), ours.finish()
        assert thought == end.reasoning_text, parts
        spaces = not end.normal_text and not content.strip()  # held spaces: sent, not dropped
        assert content == end.normal_text or spaces, parts
