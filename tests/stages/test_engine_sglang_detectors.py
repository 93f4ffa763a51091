"""Tool calls read by the engine's readers and by SGLang 0.5.23's own detectors on random texts:
Qwen3-Coder's (``stages.engine.qwen3_coder_calls`` and ``qwen3_coder_detector.py``; well-formed
calls with typed values, and fragments of tags, values and text) whole (``detect_and_parse``)
and fed in random splits (``parse_streaming_increment``); the JSON formats and ``pythonic``
(``stages.engine.tool_formats``, ``pythonic_calls``; ``qwen25_detector.py``,
``hermes_detector.py``, ``llama32_detector.py``, ``mistral_detector.py``,
``pythonic_detector.py``) whole, where SGLang's detector does not raise (the engine then reads
no calls: the formats' modules say so): the same content and the same calls.

Skipped unless SGLang's detector imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how; it also needs ``partial_json_parser``).
"""

from __future__ import annotations

import importlib
import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
detectors: Any = pytest.importorskip("sglang.srt.function_call.qwen3_coder_detector")

from stages.engine.qwen3_coder_calls import Qwen3CoderCalls  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402

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


JSON_CALLS = [
    '{"name": "add", "arguments": {"a": 1}}',
    '{"name": "bare", "parameters": {"b": "é"}}',
    '{"name": "ghost", "arguments": {}}',
    '{"name": "add"}',
    '{"name": "add", "arguments": null}',
    '[{"name": "add", "arguments": {"a": 2}}]',
    '{"name": "add", "arguments": {"a": 1}',
    "not json",
    '"str"',
    '{"name": ["add"]}',
]
PYTHONIC_CALLS = ["[add(a=1)]", "[add(a=1), bare(b='é')]", "[ghost()]", "[add(a=1", "[1, 2]",
                  "[add(a=x)]", "[add(**k)]", "<|python_start|>[add()]<|python_end|>"]  # fmt: skip
DETECTORS = {
    "qwen25": ("qwen25_detector", "Qwen25Detector"),
    "hermes": ("hermes_detector", "HermesDetector"),
    "llama3": ("llama32_detector", "Llama32Detector"),
    "mistral": ("mistral_detector", "MistralDetector"),
    "pythonic": ("pythonic_detector", "PythonicDetector"),
}


def _answer(r: random.Random, parser: str) -> str:
    out = r.choice(["", "Sure ", "text\n", " "])
    for _ in range(r.randint(0, 3)):
        call = r.choice(JSON_CALLS)
        if parser in ("qwen25", "hermes"):
            gap = r.choice(["\n", "", " "])
            out += (
                "<tool_call>" + gap + call + gap + r.choice(["</tool_call>", "", "</tool_call>\n"])
            )
        elif parser == "llama3":
            out += r.choice(["<|python_tag|>", "", ";", "; "]) + call
        elif parser == "mistral":
            out += r.choice([f"[TOOL_CALLS] [{call}]", '[TOOL_CALLS]add[ARGS]{"a": 1}',
                             f"[TOOL_CALLS] [{call}, {call}]"])  # fmt: skip
        else:
            out += r.choice(PYTHONIC_CALLS)
        out += r.choice(["", " after", "\n"])
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parser", list(DETECTORS))
def test_each_format_reads_a_whole_answer_as_sglangs_detector(
    parser: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL)
    module, name = DETECTORS[parser]
    detector_class = getattr(importlib.import_module(f"{detectors.__package__}.{module}"), name)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    places = {t["function"]["name"]: i for i, t in enumerate(TOOLS)}
    r = random.Random(1)
    compared = 0
    for _ in range(1500):
        text = _answer(r, parser)
        detector = detector_class()
        try:
            theirs = (
                detector.detect_and_parse(text, tools) if detector.has_tool_call(text) else None
            )
        except Exception:  # SGLang's detector raises: the engine reads the answer as unreadable
            continue
        want = (text, []) if theirs is None else (
            theirs.normal_text, [(c.tool_index, c.name, c.parameters) for c in theirs.calls]
        )  # fmt: skip
        reader = ToolCallParser(TOOLS, parser)
        got: tuple[str, list[Any]] = (text, [])
        if reader.has_tool_call(text):
            content, calls = reader.indexed(text, places)
            got = (content, [(i, c["name"], c["arguments"]) for i, c in calls])
        assert got == want, text
        compared += 1
    assert compared > 800
