"""Inkling's tool calls and reasoning read by the engine (``stages.engine.inkling_calls``,
``stages.engine.inkling_reasoning``) and by SGLang 0.5.23's own detectors
(``function_call/inkling_detector.py`` and ``parser/reasoning_parser.py``, both
``InklingDetector``) on random answers: typed messages as the model writes them (thinking, text,
JSON and raw-text calls with their headers, end-of-sampling) and every way of getting them wrong
(framing tokens cut, doubled, missing or quoted inside a message, headers without a message,
bodies that are not JSON, not an object, ``NaN``, nested past the recursion limit, calls never
closed, names that are not strings or not offered).

Tool calls whole (``detect_and_parse`` as ``FunctionCallParser.parse_non_stream`` calls it): the
same content, calls and ``tool_index``, and where the detector raises, the text without calls
(what SGLang's chat route answers); fed in random splits, each step the same content and calls
as its ``parse_streaming_increment`` (a raw-text call unnamed, as the chat route sends it), and
nothing at the end (it has no ``finish``). Reasoning (streamed or held): whole as
``detect_and_parse``, streamed step by step as ``parse_streaming_increment`` and ``finish``; and
the two chained as SGLang's chat route chains them, whole and streamed. The forced-call tag is
``FunctionCallParser.get_structure_constraint``'s.

Skipped unless SGLang's detectors import (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
inkling: Any = pytest.importorskip("sglang.srt.function_call.inkling_detector")
parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")
calls_parser: Any = pytest.importorskip("sglang.srt.function_call.function_call_parser")

from stages.engine.inkling_calls import CONTROL  # noqa: E402
from stages.engine.inkling_reasoning import InklingReasoning  # noqa: E402
from stages.engine.tool_calls import ToolCallParser, forced_calls, strict_calls  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _reasoned_alike, _splits  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "strict": True,
                                      "parameters": {"type": "object"}}},
]  # fmt: skip
MM, J, T, E = ("<|message_model|>", "<|content_invoke_tool_json|>",
               "<|content_invoke_tool_text|>", "<|end_message|>")  # fmt: skip
THINK, TEXT, STOP = "<|content_thinking|>", "<|content_text|>", "<|content_model_end_sampling|>"
OTHER = ["<|message_user|>", "<|endoftext|>", "<|content_xml|>", "<|content_invoke_tool|>",
         "<|model_trigger_generation|>", "<|audio_end|>"]  # fmt: skip
NAMES = ['"get_weather"', '"search"', '"ghost"', '""', "1", "null", '["x"]', '"é"']
ARGS = ['{"city": "Zürich"}', "{}", '{"n": NaN}', '{"x": [1, {"y": null}]}', "[1]", '"s"',
        "null", '{"q": "<|end_message|>"}']  # fmt: skip
DEEP = '{"d": ' + "[" * 1200 + "]" * 1200 + "}"  # past the recursion limit
PROSE = ["Let me think. ", "The answer is 42.", " ", "\n", "a < b", "<|mes", "<|end_mess", "<",
         "<|content_invoke_tool_js", "é", "quote <|message_model|>", "{", "}"]  # fmt: skip
HEADERS = ["get_weather", "search", "", " tool ", "x\n"]


def _payload(r: random.Random) -> str:
    if r.random() < 0.1:
        return r.choice(["{bad", "", "[]", "NaN", '{"name": "search"', "1e999", " \n"])
    name, args = r.choice(NAMES), r.choice(ARGS) if r.random() < 0.98 else DEEP
    fields = [f'"name": {name}', f'"args": {args}']
    if r.random() < 0.1:
        fields.pop(r.randrange(2))
    if r.random() < 0.1:
        fields.append('"extra": 1')
    r.shuffle(fields)
    return r.choice(["", " ", "\n"]) + "{" + ", ".join(fields) + "}" + r.choice(["", " \n"])


def _message(r: random.Random) -> str:
    """One typed message, sometimes mangled."""
    kind = r.random()
    head = MM if r.random() < 0.9 else r.choice(["", "<|message_mo", MM + MM])
    if kind < 0.3:
        body = THINK + "".join(r.choice(PROSE) for _ in range(r.randint(0, 3)))
    elif kind < 0.55:
        body = TEXT + "".join(r.choice(PROSE) for _ in range(r.randint(0, 3)))
    elif kind < 0.9:
        body = r.choice(HEADERS) + (J if r.random() < 0.95 else r.choice(OTHER)) + _payload(r)
    else:
        body = r.choice(["", "sh"]) + T + r.choice(["ls -la", "é\n", "", '"q"', THINK + "x"])
    if r.random() < 0.1:  # a framing token inside the message (mostly not inside another)
        at = r.randint(0, len(body))
        inside = body[:at] + r.choice([*OTHER, MM, J, TEXT, THINK]) + body[at:]
        body = inside if r.random() < 0.05 or not _ambiguous(inside) else body
    end = r.choice([E] * 12 + [STOP, "", "<|end_", E + STOP])
    return head + body + end + r.choice(["", "", " ", "\n"])


def _answer(r: random.Random) -> str:
    """A run of messages as the model writes them, some cut or mangled, or fragments."""
    if r.random() < 0.1:
        pieces = [*PROSE, *OTHER, MM, J, T, E, THINK, TEXT, STOP, _payload(r)]
        return "".join(r.choice(pieces) for _ in range(r.randint(1, 10)))
    out = r.choice(["", "", "Hi ", "\n"])
    for _ in range(r.randint(1, 4)):
        out += _message(r)
    if r.random() < 0.1:
        out += r.choice(PROSE)
    if r.random() < 0.1:
        out = out[: r.randint(0, len(out))]
    return out


def _ambiguous(text: str) -> bool:
    """Taking one framing token out of ``text`` makes another (``<|end<|content_text|>_message|>``):
    what the detector's ``_clean_normal_text`` leaves then depends on the order of its set of
    tokens, which Python's string hashing decides, in its process as in ours (a difference the
    engine's module documents)."""
    for gone in CONTROL:
        if gone in text:
            rest = text.replace(gone, "")
            if any(rest.count(token) > text.count(token) for token in CONTROL):
                return True
    return False


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]] | None:
    """``FunctionCallParser.parse_non_stream`` with the detector (None: it raises)."""
    detector = inkling.InklingDetector()
    marked = detector.has_tool_call(text)
    try:
        got = detector.detect_and_parse(text, tools)
    except RecursionError:
        return None
    if not got.calls and not marked:
        return text, []
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


@pytest.mark.timeout(300)
def test_inkling_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """``inkling_detector.py:53`` (``detect_and_parse``), ``:70`` (``_parse_canonical``), ``:123``
    (``_recover_last_json_call``), ``:274`` (``_tool_call_item``: calls to tools not offered
    kept); ``serving_chat._process_tool_calls``: where it raises, the text and no calls."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(71)
    raised = called = recovered = ambiguous = 0
    for _ in range(20000):
        text = _answer(r)
        if _ambiguous(text):
            ambiguous += 1
            continue
        reader = ToolCallParser(TOOLS, "inkling")
        assert reader.has_tool_call(text) == inkling.InklingDetector().has_tool_call(text), text
        content, calls = reader.indexed(text, {})
        got = (content, [(i, c["name"], c["arguments"]) for i, c in calls])
        want = _theirs(text, tools)
        if want is None:  # the chat route's except: the text, no calls
            assert got == (text, []), text
            raised += 1
            continue
        assert got == want, text
        called += bool(calls)
        recovered += bool(calls) and content == "" and len(calls) == 1
    assert ambiguous < 200 and raised > 50, (ambiguous, raised)
    assert called > 3000 and recovered > 500, (called, recovered)


@pytest.mark.timeout(300)
def test_inkling_streams_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """Random splits of each answer: each step the content and calls (index, name and
    arguments in one piece) of the detector's ``parse_streaming_increment`` (``:148``; a call
    that fails to frame: ``_stream_recover_or_fallback``, ``:188``), the name of a raw-text
    call None (``serving_chat``: ``if call_item.name``), and nothing at the end (the base
    ``finish``), where it does not raise."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(72)
    compared = called = 0
    for _ in range(20000):
        text = _answer(r)
        if _ambiguous(text):
            continue
        parts = _splits(r, text) if len(text) > 1 else [text]
        theirs, ours = inkling.InklingDetector(), ToolCallParser(TOOLS, "inkling").stream()
        try:
            steps = [theirs.parse_streaming_increment(part, tools) for part in parts]
            end = theirs.finish(tools)
        except RecursionError:
            continue
        for part, step in zip(parts, steps, strict=True):
            content, pieces = ours.feed(part)
            want = [(c.tool_index, c.name or None, c.parameters) for c in step.calls]
            got = [(p["index"], p["name"], p["arguments"]) for p in pieces]
            assert (content, got) == (step.normal_text, want), parts
            called += bool(pieces)
        assert (ours.flush(), ours.unsent()) == (end.normal_text, end.calls) == ("", []), parts
        assert ours.calls == theirs._stream_call_index
        compared += 1
    assert compared > 19000 and called > 3000, (compared, called)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("force", [False, True])
def test_inkling_reasoning_reads_as_sglangs_detector(force: bool) -> None:
    """``reasoning_parser.py:1358`` (``InklingDetector``): whole answers give
    ``detect_and_parse``'s reasoning and content (``:1399``); fed in random splits, each step
    what ``parse_streaming_increment`` gives (``:1412``) and at the end ``finish`` (``:1422``);
    ``force_reasoning`` and ``force_nonempty_content`` change nothing."""
    r = random.Random(80 + force)
    thought = 0
    for _ in range(6000):
        text = _answer(r)
        stream = r.random() < 0.6
        options = {"force_reasoning": force, "stream_reasoning": stream,
                   "force_nonempty_content": r.random() < 0.3}  # fmt: skip
        want = parser.InklingDetector(**options).detect_and_parse(text)
        got = InklingReasoning(stream_reasoning=stream).parse(text)
        assert got == (want.reasoning_text, want.normal_text), (text, options)
        thought += bool(got[0])
        theirs = parser.InklingDetector(**options)
        ours = InklingReasoning(stream_reasoning=stream)
        parts = _splits(r, text) if len(text) > 1 else [text]
        _reasoned_alike(theirs, ours, parts, (parts, options))
    assert thought > 1200, thought


@pytest.mark.timeout(300)
def test_inkling_reasoning_and_calls_chain_as_sglangs_chat_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reasoning parser's content read by the tool-call parser, as ``serving_chat`` chains
    them: whole (``_build_chat_response``: ``parse_non_stream``, then ``_process_tool_calls``
    where the content has a marker) and streamed (``_process_reasoning_stream``, then
    ``_process_tool_call_stream``, each step's content fed on; both ended at the last)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(90)
    called = 0
    for _ in range(6000):
        text = _answer(r)
        if _ambiguous(text):
            continue
        reasoning = parser.ReasoningParser("inkling", stream_reasoning=False, force_reasoning=True)
        thought, content = reasoning.parse_non_stream(text)
        marked = inkling.InklingDetector().has_tool_call(content)
        want = _theirs(content, tools) if marked else (content, [])
        mine, rest = InklingReasoning(stream_reasoning=False).parse(text)
        reader = ToolCallParser(TOOLS, "inkling")
        calls: list[dict[str, str]] = []
        if reader.has_tool_call(rest):
            rest, calls = reader.parse(rest)
        if want is None:
            assert (mine, rest, calls) == (thought, content, []), text
            continue
        assert (mine, rest, [(c["name"], c["arguments"]) for c in calls]) == (
            thought, want[0], [(n, a) for _, n, a in want[1]]
        ), text  # fmt: skip
        called += bool(calls)

        stream_reasoning = r.random() < 0.7
        parts = _splits(r, text) if len(text) > 1 else [text]
        their_reasoning = parser.ReasoningParser(
            "inkling", stream_reasoning=stream_reasoning, force_reasoning=True
        )
        our_reasoning = InklingReasoning(stream_reasoning=stream_reasoning)
        their_calls, our_calls = (
            inkling.InklingDetector(),
            ToolCallParser(TOOLS, "inkling").stream(),
        )
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                thought, content = their_reasoning.parse_stream_chunk(part)
                mine, rest = our_reasoning.feed(part)
                if last:
                    more, tail = their_reasoning.parse_stream_end()
                    thought, content = (
                        (thought or "") + (more or ""),
                        (content or "") + (tail or ""),
                    )
                    more, tail = our_reasoning.finish()
                    mine, rest = mine + more, rest + tail
                assert (mine, rest) == (thought, content), parts
                step = their_calls.parse_streaming_increment(content, tools)
                said, pieces = our_calls.feed(rest)
                if last:
                    said += our_calls.flush()
                    pieces += our_calls.unsent()
                assert (said, [(p["index"], p["name"], p["arguments"]) for p in pieces]) == (
                    step.normal_text,
                    [(c.tool_index, c.name or None, c.parameters) for c in step.calls],
                ), parts
        except RecursionError:
            continue
    assert called > 900, called


def test_inkling_forced_tag_is_sglangs() -> None:
    """``get_structure_constraint``: ``required``, a named tool and ``auto`` with a strict tool
    get the legacy tag of the detector's ``structure_info``, field for field; plain ``auto``
    gets its token-triggered tag, which the engine does not serve (nothing constrained)."""
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    named = protocol.ToolChoice(function={"name": "search"})
    for choice, mine in (
        ("required", forced_calls(TOOLS, "inkling", named=False, parallel=True)),
        (named, forced_calls(TOOLS[1:], "inkling", named=True, parallel=True)),
        ("auto", strict_calls(TOOLS, "inkling")),
    ):
        given = tools[1:] if choice is named else tools
        kind, tag = calls_parser.FunctionCallParser(given, "inkling").get_structure_constraint(
            choice
        )
        assert kind == "structural_tag"
        mine, theirs = json.loads(mine["structural_tag"]), tag.model_dump(by_alias=True)
        mine["triggers"].sort()
        theirs["triggers"].sort()  # (SGLang's a set's)
        assert mine == theirs, choice
    loose = [t for t in TOOLS if not t["function"].get("strict")]
    plain = calls_parser.FunctionCallParser(
        [protocol.Tool.model_validate(t) for t in loose], "inkling"
    ).get_structure_constraint("auto")
    assert plain[1].format.type == "token_triggered_tags"
    assert strict_calls(loose, "inkling") is None
    assert all(token in CONTROL for token in (MM, J, T, E, THINK, TEXT, STOP, *OTHER))
