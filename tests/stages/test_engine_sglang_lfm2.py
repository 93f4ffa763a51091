"""LFM2's tool calls read by the engine (``stages.engine.lfm2_calls``) and by SGLang 0.5.23's own
detector (``function_call/lfm2_detector.py``, ``Lfm2Detector``) on random answers: Python calls
as a model writes them and as it gets them wrong (nested unescaped quotes, zero-padded numbers,
raw newlines, keywords as parameter names, positional arguments, names that are not tools,
values that are not literals, calls cut short), JSON calls, blocks never closed. Whole
(``detect_and_parse``): the same content and the same calls with the same ``tool_index``, and
where the detector raises, the engine reads no calls; fed in random splits, the engine's stream
adds up to what the detector reads whole.

Skipped unless SGLang's detector imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how; it also needs ``partial_json_parser``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
lfm2: Any = pytest.importorskip("sglang.srt.function_call.lfm2_detector")

from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _our_stream, _splits  # noqa: E402


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [_tool("run"), _tool("get_weather"), _tool("fs.read"), _tool("run")]
NAMES = ["run", "get_weather", "fs.read", "ghost", "fs", "a.b.c"]
KEYS = ["command", "city", "days", "from", "in", "class", "x", "from_pyreservedkw_", "lambda"]
VALUES = ["'ls -la'", '"Paris"', "3", "07", "0", "00", "1.07", "-2", "+2.5", "-True", "True",
          "false", "null", "None", "[1, 2]", "(1, 'a')", "{1, 2}", "{'k': [1]}", "{(1, 2): 3}",
          "f'hi'", "f'{x}'", "b'x'", "1j", "1e999", "...", "x", "'a\nb'", "'tab\there'",
          "'sed -n '360,450p' f.py'", "\"say \"hi\" now\"", "'it's'", "'\\d+'", "'é'",
          "{'a': 1, **{'b': 2}}", "[[[1]]]", "0x1F", "1_000", "0_7", "'unterminated",
          "'x\x00y'"]  # fmt: skip
JSON_BLOCKS = ['[{"name": "run", "arguments": {"command": "ls"}}]',
               '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
               '[{"name": "ghost", "arguments": {}}]', '[{"name": "run"}, 5]', '{"name": ["x"]}',
               '[{"name": "run", "arguments": {"n": NaN}}]', "[{bad json", "{}", "[]",
               '[{"name": "fs.read", "arguments": null, "parameters": {"p": 1}}]']  # fmt: skip


def _call(r: random.Random) -> str:
    args = []
    for _ in range(r.randint(0, 3)):
        if r.random() < 0.08:
            args.append(r.choice(VALUES))  # positional
        elif r.random() < 0.05:
            args.append("**" + r.choice(["{'a': 1}", "x", "[1]"]))
        else:
            args.append(f"{r.choice(KEYS)}{r.choice(['=', ' = ', '=='])}{r.choice(VALUES)}")
    return f"{r.choice(NAMES)}({r.choice([', ', ',']).join(args)})"


def _block(r: random.Random) -> str:
    if r.random() < 0.2:
        return r.choice(JSON_BLOCKS)
    calls = [_call(r) for _ in range(r.randint(1, 3))]
    body = r.choice([", ", ",", ",\n"]).join(calls)
    return r.choice([f"[{body}]", f"[{body}]", body, f" [{body}] ", f"[{body}", "x = " + calls[0]])


def _answer(r: random.Random) -> str:
    out = r.choice(["", "Sure ", " let me check\n", "\n"])
    for _ in range(r.randint(0, 3)):
        out += "<|tool_call_start|>" + _block(r)
        out += r.choice(["<|tool_call_end|>", "<|tool_call_end|>", "", "<|tool_call_end|> after"])
        out += r.choice(["", " mid ", "\n"])
    return out


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]] | None:
    """The detector's whole reading (None: it raises)."""
    try:
        got = lfm2.Lfm2Detector().detect_and_parse(text, tools)
    except Exception:
        return None
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


@pytest.mark.timeout(120)
def test_lfm2_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """``lfm2_detector.py:816`` (``detect_and_parse``), ``:790`` (JSON first, then Python),
    ``:640`` (``_parse_pythonic_content``: the rewrites, then each call alone), ``:529``
    (``_parse_pythonic_call``), ``:467`` (``_get_parameter_value``)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(11)
    raised = called = 0
    for _ in range(10000):
        text = _answer(r)
        content, calls = ToolCallParser(TOOLS, "lfm2").indexed(text, {})
        got = (content, [(i, c["name"], c["arguments"]) for i, c in calls])
        want = _theirs(text, tools)
        if want is None:  # the detector raises: serving_chat answers the text, no calls
            assert got == (text, []), text
            raised += 1
            continue
        assert got == want, text
        called += bool(calls)
    assert raised > 100 and called > 2000, (raised, called)


@pytest.mark.timeout(120)
def test_lfm2_streams_what_sglangs_detector_reads_whole(caplog: pytest.LogCaptureFixture) -> None:
    """Random splits of each answer fed to the engine's stream: its content and its calls'
    pieces added up are the detector's whole reading (``lfm2_detector.py:816``), where that
    does not raise (the content's leading spaces aside: the stream sends them before it knows a
    block follows)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(12)
    compared = 0
    for _ in range(5000):
        text = _answer(r)
        want = _theirs(text, tools)
        if want is None:
            continue
        parts = _splits(r, text) if len(text) > 1 else [text]
        content, calls = _our_stream("lfm2", parts, TOOLS)
        if "<|tool_call_start|>" in text:  # (the whole answer's is stripped; the stream sent its
            content = content.lstrip()  # leading spaces before it could know)
        assert (content, [calls[i] for i in sorted(calls)]) == (
            want[0],
            [[name, arguments] for _, name, arguments in want[1]],
        ), text
        compared += 1
    assert compared > 4000
