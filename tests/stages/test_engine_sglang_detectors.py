"""Qwen3-Coder's tool calls read by ``stages.engine.qwen3_coder_calls`` and by SGLang 0.5.23's own
``Qwen3CoderDetector`` (``function_call/qwen3_coder_detector.py``) on random texts (well-formed
calls with typed values, and fragments of tags, values and text), whole (``detect_and_parse``)
and fed in random splits (``parse_streaming_increment``): the same content and the same calls.

Skipped unless SGLang's detector imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how; it also needs ``partial_json_parser``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
detectors: Any = pytest.importorskip("sglang.srt.function_call.qwen3_coder_detector")

from stages.engine.qwen3_coder_calls import Qwen3CoderCalls  # noqa: E402

PROPERTIES = {
    "a": {"type": "integer"}, "b": {"type": "number"}, "flag": {"type": "boolean"},
    "items": {"type": "array"}, "cfg": {"type": "object"}, "s": {"type": "string"},
    "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "e": {"enum": [1, 2]}, "any": {},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add",
     "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "bare", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "union", "parameters": {"oneOf": [
        {"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "boolean"}}}]}}},
]  # fmt: skip
NAMES = ["add", "bare", "union", "ghost", ""]
KEYS = [*PROPERTIES, "x", "y", "type", "zz"]
VALUES = ["1", "2.5", "1e3", "-3", "true", "False", "null", "[1, 2]", '{"k": 1}', "{'k': 1}",
          "(1, 2)", "abc", "", "\n", " 7 ", "1_000", "inf", "nan", "[", "é"]  # fmt: skip


def _fragment(r: random.Random) -> str:
    return r.choice([
        "<tool_call>", "</tool_call>", "</function>", "</parameter>", "\n", " ", "<", "<x",
        "a < b", "<tool", "<param", "hello ", "ok\n",
        "<function=" + r.choice(NAMES) + r.choice([">", ">\n", ""]),
        "<parameter=" + r.choice(KEYS) + ">" + r.choice(["", "\n"]) + r.choice(VALUES)
        + r.choice(["", "\n", "\n\n"]),
    ])  # fmt: skip


def _text(r: random.Random) -> str:
    if r.random() < 0.5:  # calls as a model writes them, some cut short
        out = r.choice(["", "Let me call.\n", "pre "])
        for _ in range(r.randint(1, 2)):
            out += "<tool_call>\n<function=" + r.choice(NAMES) + ">\n"
            for _ in range(r.randint(0, 3)):
                value = r.choice(VALUES)
                out += f"<parameter={r.choice(KEYS)}>\n{value}\n</parameter>\n"
            out += r.choice(["</function>\n</tool_call>", "</function>", "", "</tool_call>"])
            out += r.choice(["", "\n", " after"])
        return out
    return "".join(_fragment(r) for _ in range(r.randint(1, 12)))


def _splits(r: random.Random, text: str) -> list[str]:
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.timeout(120)
def test_qwen3_coder_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)  # the detector warns of every unknown tool
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(0)
    compared = 0
    for _ in range(2000):
        text = _text(r)
        theirs = detectors.Qwen3CoderDetector().detect_and_parse(text, tools)
        content, calls = Qwen3CoderCalls(TOOLS).listed(text)
        assert (content, [(i, c["name"], c["arguments"]) for i, c in calls]) == (
            theirs.normal_text,
            [(c.tool_index, c.name, c.parameters) for c in theirs.calls],
        ), text
        parts = _splits(r, text) if len(text) > 1 else [text]
        detector, ours = detectors.Qwen3CoderDetector(), Qwen3CoderCalls(TOOLS).stream()
        their_text, their_items, our_text, our_items = "", [], "", []
        try:
            for part in parts:
                got = detector.parse_streaming_increment(part, tools)
                their_text += got.normal_text
                their_items += [(c.tool_index, c.name or None, c.parameters) for c in got.calls]
        except TypeError:  # a value JSON cannot write: SGLang's stream raises (ours: its text)
            continue
        for part in parts:
            more, pieces = ours.feed(part)
            our_text += more
            our_items += [(p["index"], p["name"], p["arguments"]) for p in pieces]
        assert (our_text + ours.flush(), our_items) == (their_text, their_items), parts
        compared += 1
    assert compared > 1500
