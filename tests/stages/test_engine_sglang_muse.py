"""Muse Glimmer's tool calls and reasoning read by the engine (``stages.engine.muse_calls``,
``stages.engine.muse_reasoning``) and by SGLang 0.5.23's own detectors
(``function_call/muse_glimmer_detector.py`` and ``parser/reasoning_parser.py``, both
``MuseGlimmerDetector``) on random answers: channels as the model writes them (its first header
without ``<|start|>``, reasoning, answers, commentary, tool channels of ATEM invokes) and every
way of getting them wrong (headers and markers cut, spaced or missing, recipients with spaces,
prose without a header, markup quoted in an answer, invokes and parameters never closed, names
doubled, dotted or not offered, values that are not JSON or nest past the recursion limit).

Tool calls whole (``detect_and_parse`` as ``FunctionCallParser.parse_non_stream`` calls it): the
same content, calls and ``tool_index``, and where the detector raises, the text without calls
(what SGLang's chat route answers); fed in random splits, each step the same content and calls
as its ``parse_streaming_increment``, and at the end its ``finish``. Reasoning (a tool-call
parser reading the content or not, ``force_nonempty_content`` or not, reasoning streamed or
held): whole as ``detect_and_parse``, streamed step by step as ``parse_streaming_increment`` and
``finish``; and the two together as SGLang's chat route chains them, whole and streamed.

Skipped unless SGLang's detectors import (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
muse: Any = pytest.importorskip("sglang.srt.function_call.muse_glimmer_detector")
parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")

from stages.engine.muse_reasoning import MuseReasoning  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _reasoned_alike, _splits  # noqa: E402


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [_tool("get_weather"), _tool("search"), _tool("fs.read"), _tool("web.search")]
NAMES = ["get_weather", "search", "fs.read", "web.search", "functions.get_weather",
         "get_weather.get_weather", "ns.read", "a.search", "ghost", "fs.read.read", "", "x y",
         "search.search"]  # fmt: skip
KEYS = ["city", "q", "n", "city", "", "a b"]
VALUES = ['"Paris"', "Paris", "3", " 4 ", "-1.5e3", "true", "null", "NaN", "[1, 2]",
          '{"k": [1, {"z": null}]}', "{bad", '"é\\u00e9"', "é", "a\nb", "<b>x</b>", "",
          "1" * 5000, '"unterminated', "[" * 1200 + "]" * 1200, "Infinity",
          "</atem:parameter", "<|eom"]  # fmt: skip
RECIPIENTS = [" to=self", " to=self", " to=user", " to=user", " to=commentary",
              " to=functions.get_weather", " to=functions.search", " to=get_weather",
              " to=functions.get_weather", " to=functions.search",
              " to=functions.ghost", "", " channel=final", " to=", " to=a b", " to=self ",
              "to=user", "  to=self", " to=functions.x<y", " to =user"]  # fmt: skip
STARTS = ["<|start|>assistant", "<|start|>assistant", "<|start|>", " <|start|>assistant",
          "\n<|start|>assistant", "<|start", "<|sta", "", "assistant"]  # fmt: skip
ENDS = ["<|eom|>", "<|eom|>", "<|eot|>", "", "<|eo", "<|eot", " <|eom|>"]
PROSE = ["Let me think. ", "The answer is 42.", " ", "\n", "a < b", "to=self", "<|mes",
         "<|message|>", "<|start|>assistant to=functions.search<|message|>", "quote <atem:",
         '<atem:invoke name="search"><atem:parameter name="q">x</atem:parameter></atem:invoke>',
         "<|eo", "é"]  # fmt: skip


def _parameter(r: random.Random) -> str:
    key = r.choice(KEYS)
    opening = r.choice([f'<atem:parameter name="{key}">', f'<atem:parameter name="{key}" t="s">',
                        f"<atem:parameter name='{key}'>", f'<atem:parameter  name="{key}">',
                        f'<atem:parametername="{key}">'])  # fmt: skip
    value = r.choice(VALUES) if r.random() < 0.97 else r.choice(VALUES[:-4])
    closing = r.choice(["</atem:parameter>"] * 5 + ["", "</atem:param>"])
    return opening + value + closing + r.choice(["", "\n"])


def _invoke(r: random.Random) -> str:
    name = r.choice(NAMES)
    opening = r.choice([f'<atem:invoke name="{name}">'] * 4 + [
        f'<atem:invoke id="1" name="{name}">', f'<atem:invoke name="{name}"',
        f"<atem:invoke {name}>", f'<atem:invokename="{name}">', "<atem:invoke>",
        f'<atem:invoke name="{name}" x=">">'])  # fmt: skip
    body = "".join(_parameter(r) for _ in range(r.randint(0, 3)))
    closing = r.choice(["</atem:invoke>"] * 5 + ["", "</atem:invoke", "</atem:inv"])
    return r.choice(["", "\n"]) + opening + r.choice(["", "\n"]) + body + closing


def _body(r: random.Random, recipient: str) -> str:
    if "functions" in recipient or "get_weather" in recipient or r.random() < 0.1:
        out = r.choice(["<atem:function_calls>", "<atem:function_calls>\n", "", "junk "])
        out += "".join(_invoke(r) for _ in range(r.randint(0, 3)))
        return out + r.choice(["</atem:function_calls>", "\n</atem:function_calls>", "", " x"])
    return "".join(r.choice(PROSE) for _ in range(r.randint(0, 4)))


def _answer(r: random.Random) -> str:
    """A run of channels as the model writes them, some cut or mangled, or fragments."""
    if r.random() < 0.1:
        pieces = [*PROSE, *ENDS, *STARTS, *RECIPIENTS, "<|message|>", _invoke(r)]
        return "".join(r.choice(pieces) for _ in range(r.randint(1, 10)))
    out = r.choice(["", "", " ", "\n"])
    for i in range(r.randint(1, 4)):
        recipient = r.choice(RECIPIENTS)
        if i or r.random() < 0.2:
            out += r.choice(STARTS) if r.random() < 0.9 else r.choice(["x", " ", "\n\n"])
        out += recipient + r.choice(["<|message|>"] * 12 + ["", "<|mess", " <|message|>"])
        out += _body(r, recipient) + r.choice(ENDS) + r.choice(["", "", " ", "\n"])
    if r.random() < 0.1:
        out += r.choice(PROSE)
    return out


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]] | None:
    """``FunctionCallParser.parse_non_stream`` with the detector (None: it raises)."""
    detector = muse.MuseGlimmerDetector()
    marked = detector.has_tool_call(text)
    try:
        got = detector.detect_and_parse(text, tools)
    except Exception:
        return None
    if not got.calls and not marked:
        return text, []
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


@pytest.mark.timeout(300)
def test_muse_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """``muse_glimmer_detector.py:107`` (``detect_and_parse``: the stream's one step and its
    ``finish``), ``:140`` (``parse_streaming_increment``), ``:213`` (``_consume_body``), ``:56``
    (``_normalize_name``), ``:90`` (``_emit_call``: a call to a tool not offered dropped);
    ``serving_chat._process_tool_calls``: where it raises, the text and no calls."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(41)
    raised = called = 0
    for _ in range(20000):
        text = _answer(r)
        reader = ToolCallParser(TOOLS, "muse")
        assert reader.has_tool_call(text) == muse.MuseGlimmerDetector().has_tool_call(text), text
        content, calls = reader.indexed(text, {})
        got = (content, [(i, c["name"], c["arguments"]) for i, c in calls])
        want = _theirs(text, tools)
        if want is None:  # the chat route's except: the text, no calls
            assert got == (text, []), text
            raised += 1
            continue
        assert got == want, text
        called += bool(calls)
    assert raised > 50 and called > 3000, (raised, called)


@pytest.mark.timeout(300)
def test_muse_streams_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """Random splits of each answer: each step the content and calls (index, name and
    arguments in one piece) of the detector's ``parse_streaming_increment``, and at the end
    its ``finish`` (``:115``), where it does not raise."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(42)
    compared = called = 0
    for _ in range(20000):
        text = _answer(r)
        parts = _splits(r, text) if len(text) > 1 else [text]
        theirs, ours = muse.MuseGlimmerDetector(), ToolCallParser(TOOLS, "muse").stream()
        try:
            steps = [theirs.parse_streaming_increment(part, tools) for part in parts]
            steps.append(theirs.finish(tools))
        except RecursionError:
            continue
        for part, step in zip(parts, steps, strict=False):
            content, pieces = ours.feed(part)
            want = [(c.tool_index, c.name, c.parameters) for c in step.calls]
            assert (content, [(p["index"], p["name"], p["arguments"]) for p in pieces]) == (
                step.normal_text,
                want,
            ), parts
            called += bool(pieces)
        rest = ours.flush()
        left = [(p["index"], p["name"], p["arguments"]) for p in ours.unsent()]
        end = steps[-1]
        assert (rest, left) == (
            end.normal_text,
            [(c.tool_index, c.name, c.parameters) for c in end.calls],
        ), parts
        assert ours.calls == theirs.current_tool_id + 1
        compared += 1
    assert compared > 19500 and called > 3000, (compared, called)


def _options(r: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    """The detector's options and the engine's of the same request."""
    theirs = {"force_nonempty_content": r.random() < 0.3, "stream_reasoning": r.random() < 0.7,
              "tool_call_parser_active": r.random() < 0.5}  # fmt: skip
    ours = {"nonempty": theirs["force_nonempty_content"],
            "stream_reasoning": theirs["stream_reasoning"],
            "tools": theirs["tool_call_parser_active"]}  # fmt: skip
    return theirs, ours


@pytest.mark.timeout(300)
@pytest.mark.parametrize("force", [False, True])
def test_muse_reasoning_reads_as_sglangs_detector(force: bool) -> None:
    """``reasoning_parser.py:2047`` (``MuseGlimmerDetector``): whole answers give
    ``detect_and_parse``'s reasoning and content (``:2208``: framed again where a tool-call
    parser reads the content and it has an ATEM marker); fed in random splits, each step what
    ``parse_streaming_increment`` gives (``:2223``) and at the end ``finish`` (``:2242``);
    ``force_reasoning`` changes nothing."""
    r = random.Random(50 + force)
    framed = 0
    for _ in range(10000):
        text = _answer(r)
        options, mine = _options(r)
        want = parser.MuseGlimmerDetector(force_reasoning=force, **options).detect_and_parse(text)
        got = MuseReasoning(**mine).parse(text)
        assert got == (want.reasoning_text, want.normal_text), (text, options)
        framed += mine["tools"] and "<|message|>" in got[1]
        theirs = parser.MuseGlimmerDetector(force_reasoning=force, **options)
        ours = MuseReasoning(**mine)
        parts = _splits(r, text) if len(text) > 1 else [text]
        _reasoned_alike(theirs, ours, parts, (parts, options))
    assert framed > 1000, framed


@pytest.mark.timeout(300)
def test_muse_reasoning_and_calls_chain_as_sglangs_chat_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reasoning parser's content read by the tool-call parser, as ``serving_chat`` chains
    them for a request whose calls are read (``tool_call_parser_active``): whole
    (``_build_chat_response``: ``parse_non_stream``, then ``_process_tool_calls`` where the
    content has an ATEM marker) and streamed (``_process_reasoning_stream``, then
    ``_process_tool_call_stream``, each step's content fed on; both flushed at the end)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(60)
    called = 0
    for _ in range(10000):
        text = _answer(r)
        stream_reasoning = r.random() < 0.7
        reasoning = parser.ReasoningParser("muse", stream_reasoning=False, force_reasoning=True,
                                           tool_call_parser_active=True)  # fmt: skip
        thought, content = reasoning.parse_non_stream(text)
        marked = muse.MuseGlimmerDetector().has_tool_call(content)
        want = _theirs(content, tools) if marked else None
        want_calls = [(n, a) for _, n, a in want[1]] if want else []
        want_content = want[0] if want else content
        mine, rest = MuseReasoning(stream_reasoning=False, tools=True).parse(text)
        reader = ToolCallParser(TOOLS, "muse")
        calls: list[dict[str, str]] = []
        if reader.has_tool_call(rest):
            rest, calls = reader.parse(rest)
        assert (mine, rest, [(c["name"], c["arguments"]) for c in calls]) == (
            thought, want_content, want_calls
        ), text  # fmt: skip
        called += bool(calls)

        parts = _splits(r, text) if len(text) > 1 else [text]
        their_reasoning = parser.ReasoningParser(
            "muse", stream_reasoning=stream_reasoning, force_reasoning=True,
            tool_call_parser_active=True,
        )  # fmt: skip
        our_reasoning = MuseReasoning(stream_reasoning=stream_reasoning, tools=True)
        their_calls, our_calls = muse.MuseGlimmerDetector(), ToolCallParser(TOOLS, "muse").stream()
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                thought, content = their_reasoning.parse_stream_chunk(part)
                mine, rest = our_reasoning.feed(part)
                if last:
                    more, tail = their_reasoning.parse_stream_end()
                    thought = (thought or "") + (more or "")
                    content = (content or "") + (tail or "")
                    more, tail = our_reasoning.finish()
                    mine, rest = mine + more, rest + tail
                assert (mine, rest) == (thought, content), parts
                step = their_calls.parse_streaming_increment(content, tools)
                said, pieces = our_calls.feed(rest)
                items = step.calls
                if last:
                    end = their_calls.finish(tools)
                    step.normal_text += end.normal_text
                    items = [*items, *end.calls]
                    said += our_calls.flush()
                    pieces += our_calls.unsent()
                assert (said, [(p["index"], p["name"], p["arguments"]) for p in pieces]) == (
                    step.normal_text,
                    [(c.tool_index, c.name, c.parameters) for c in items],
                ), parts
        except RecursionError:
            continue
    assert called > 1500, called
