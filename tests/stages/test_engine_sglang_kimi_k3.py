"""Kimi K3's tool calls and reasoning read by the engine (``stages.engine.kimi_k3_calls``,
``stages.engine.kimi_k3_reasoning``) and by SGLang 0.5.23's own detectors
(``function_call/kimik3_detector.py`` and ``parser/reasoning_parser.py``, both
``KimiK3Detector``) on random answers: response, message, think and tools markers whole, cut
short or out of place, calls whole or broken (no tool attribute, escaped names, text between
arguments, bodies never closed, calls after the tools channel closed), values of every type tag
(strings, JSON, text that is not JSON, values nested too deep or integers too long for Python's
JSON reader).

- the calls whole (``detect_and_parse`` as ``parse_non_stream`` answers it): the same content,
  calls and ``tool_index``;
- the calls streamed, in random splits: each step the content and calls SGLang's
  ``parse_streaming_increment`` gives and at the end its ``finish``, but for the calls after
  ``<|close|>tools<|sep|>``, which the engine does not read (its whole reading does not), and
  where SGLang's stream raises (a value it cannot read: it starts over), skipped; and on answers
  in the model's shape (nothing outside the response channel), the stream adds up to the whole
  reading;
- the reasoning, forced or not, streamed or held, ``force_nonempty_content`` or not, a continued
  message or not: whole, and step by step;
- the two chained as the chat route chains them, whole and streamed.

Skipped unless SGLang's detectors import (its environment, or its wheel's source with
xgrammar, which the K3 detector imports: ``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
k3: Any = pytest.importorskip("sglang.srt.function_call.kimik3_detector")
parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")

from stages.engine.kimi_k3_calls import (  # noqa: E402
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
)
from stages.engine.kimi_k3_reasoning import KimiK3Reasoning  # noqa: E402
from stages.engine.reasoning import PARSERS, ReasoningSettings  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _reasoned_alike, _splits  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
NAMES = ["get_weather", "ghost", "a&quot;b", "x&amp;quot;y", "", "two words", "é"]
KEYS = ["city", "days", "", "a&amp;b", "k k"]
TYPES = ["string", "integer", "number", "object", "array", "boolean", "", "bogus", None]
VALUES = ["Paris", "3", " 2.5 ", "true", "null", '{"k": [1, 2]}', "[1, 2]", "abc", "", "NaN",
          "1e400", '"q"', "x\ny", "a<|sep|>b", "<|open|>"]  # fmt: skip
# what SGLang's reading raises on (JSON's recursion, Python's integer digits)
BAD = ["[" * 3000 + "]" * 3000, "1" * 5000]
REPLY = ["Hi ", "the answer", "\n", " ", "a<b", "<|", "&quot;", "é"]
TEXT = [*REPLY, "<|open|>", "<|close|>"]  # (a bare control token: a marker cut short)
PARTIAL = ["<|open|>", "<|close|>", "<|open|>resp", "<|open|>response", "<|close|>response",
           "<|close|>message", "<|open|>tools", "<|close|>tools", "<|close|>think", "<|open|>to",
           "<|close|>mess", "<|open|>think"]  # fmt: skip


def _argument(r: random.Random, bad: bool) -> str:
    kind = r.choice(TYPES)
    typed = "" if kind is None else f' type="{kind}"'
    value = r.choice(BAD) if bad and r.random() < 0.3 else r.choice(VALUES)
    head = r.choice(["<|open|>argument ", "<|open|>argument\n", "<|open|>argument"])
    out = f'{head}key="{r.choice(KEYS)}"{typed}<|sep|>{value}'
    return out + r.choice(["<|close|>argument<|sep|>"] * 6 + ["", "<|close|>argument"])


def _call(r: random.Random, bad: bool = False) -> str:
    name = r.choice(NAMES)
    attrs = r.choice([f'tool="{name}" index="1"', f'tool="{name}"', 'index="2"',
                      f'index="1" tool="{name}" tool="get_weather"'])  # fmt: skip
    out = r.choice(["<|open|>call ", "<|open|>call  ", "<|open|>call"]) + attrs + "<|sep|>"
    for _ in range(r.randint(0, 3)):
        out += r.choice(["", "", "\n", " junk "]) + _argument(r, bad)
    return out + r.choice([CALL_END] * 8 + ["", "<|close|>ca"])


CALL_END = "<|close|>call<|sep|>"


def _answer(r: random.Random, bad: bool = False) -> str:
    """Anything the markers make, in any order."""
    out = ""
    for _ in range(r.randint(0, 8)):
        pick = r.random()
        if pick < 0.3:
            out += r.choice(TEXT)
        elif pick < 0.5:
            out += r.choice([RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE, TOOLS_OPEN, TOOLS_CLOSE])
        elif pick < 0.6:
            out += r.choice(PARTIAL)
        else:
            out += (TOOLS_OPEN if r.random() < 0.25 else "") + _call(r, bad)
    return out


def _shaped(r: random.Random, bad: bool = False) -> str:
    """An answer as the model writes it after its reasoning (or skipping it): its reply in the
    response channel (or closed only), then maybe a tools channel; cut short between two
    tokens."""
    reply = "".join(r.choice(REPLY) for _ in range(r.randint(0, 4)))
    opened = r.random() < 0.7
    out = (RESPONSE_OPEN if opened else "") + reply
    out += r.choice([RESPONSE_CLOSE + MESSAGE_CLOSE, RESPONSE_CLOSE, "", MESSAGE_CLOSE])
    if r.random() < 0.7:
        out += TOOLS_OPEN
        for _ in range(r.randint(0, 3)):
            out += r.choice(["", "\n", "  "]) + _call(r, bad)
        out += r.choice([TOOLS_CLOSE, TOOLS_CLOSE, "", "\n" + TOOLS_CLOSE])
    if r.random() < 0.3:  # cut short (by max_tokens: between two tokens)
        tokens = _TOKEN.findall(out)
        out = "".join(tokens[: r.randint(0, len(tokens))])
    return out


# K3's tokens, as far as a cut goes: its control tokens and the channel names after them are
# each one
_TOKEN = re.compile(
    r"<\|(?:open|close|sep)\|>|(?:(?<=<\|open\|>)|(?<=<\|close\|>))"
    r"(?:think|response|tools|message|call|argument)|.",
    re.DOTALL,
)


def _raises(text: str) -> bool:
    return any(bad in text for bad in BAD)


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]]:
    """The detector's whole reading as ``FunctionCallParser.parse_non_stream`` gives it."""
    detector = k3.KimiK3Detector()
    if not detector.has_tool_call(text):
        return text, []
    got = detector.detect_and_parse(text, tools)
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


def _ours(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    reader = ToolCallParser(TOOLS, "kimi_k3")
    if not reader.has_tool_call(text):
        return text, []
    content, calls = reader.indexed(text, {})
    return content, [(i, c["name"], c["arguments"]) for i, c in calls]


@pytest.mark.timeout(300)
def test_kimi_k3_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """``kimik3_detector.py:146`` (``detect_and_parse``: the content before the tools channel
    unwrapped, ``kimik3_format.py:42``; its calls, ``:140``, each ``_decode_call``, ``:118``;
    where reading raises, the content alone, ``:171``)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(31)
    raised = called = 0
    for n in range(20000):
        text = _answer(r, bad=n % 10 == 0) if n % 3 else _shaped(r, bad=n % 10 == 0)
        assert ToolCallParser(TOOLS, "kimi_k3").has_tool_call(text) == (TOOLS_OPEN in text)
        want = _theirs(text, tools)
        assert _ours(text) == want, text
        called += bool(want[1])
        raised += TOOLS_OPEN in text and _raises(text) and not want[1]
    assert called > 3000 and raised > 100, (called, raised)


def _after_close(text: str, tools: list[Any]) -> int:
    """How many calls the whole reading has (SGLang's stream reads more where calls follow the
    tools channel's close)."""
    return len(k3.KimiK3Detector().detect_and_parse(text, tools).calls)


@pytest.mark.timeout(300)
def test_kimi_k3_streams_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """Random splits of each answer: each step the content and calls (index, name and
    arguments in one piece) of ``parse_streaming_increment`` (``kimik3_detector.py:178``), and
    at the end its ``finish`` (``:222``); less the calls after ``<|close|>tools<|sep|>``, which
    the engine does not read; answers SGLang's stream raises on skipped."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(32)
    compared = called = beyond = 0
    for n in range(20000):
        text = _answer(r) if n % 2 else _shaped(r)
        if _raises(text):
            continue
        parts = _splits(r, text) if len(text) > 1 else [text]
        if r.random() < 0.2:
            parts = list(text)
        read = _after_close(text, tools)
        theirs, ours = k3.KimiK3Detector(), ToolCallParser(TOOLS, "kimi_k3").stream()
        for part in parts:
            step = theirs.parse_streaming_increment(part, tools)
            content, pieces = ours.feed(part)
            want = [(c.tool_index, c.name, c.parameters) for c in step.calls]
            beyond += len([c for c in want if c[0] >= read])
            want = [c for c in want if c[0] < read]
            assert (content, [(p["index"], p["name"], p["arguments"]) for p in pieces]) == (
                step.normal_text,
                want,
            ), parts
            called += bool(pieces)
        end = theirs.finish(tools)
        assert (ours.flush(), ours.unsent()) == (end.normal_text, []), parts
        assert ours.calls == min(theirs.current_tool_id + 1, read), parts
        compared += 1
    assert compared > 19000 and called > 4000 and beyond > 50, (compared, called, beyond)


def _streamed(parts: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    ours = ToolCallParser(TOOLS, "kimi_k3").stream()
    text, pieces = "", []
    for part in parts:
        more, new = ours.feed(part)
        text, pieces = text + more, pieces + new
    text += ours.flush()
    pieces += ours.unsent()
    return text, [(p["index"], p["name"], p["arguments"]) for p in pieces]


@pytest.mark.timeout(300)
def test_kimi_k3_stream_adds_up_to_the_whole_answer_in_the_models_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On answers in the model's shape (nothing outside the response channel; a reasoning
    parser's content), in random splits or a character at a time: the stream's content joined
    is the whole reading's content, its calls the whole reading's calls (where the reading does
    not raise: the calls before the value that cannot be read went out)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(33)
    called = 0
    for _ in range(20000):
        text = _shaped(r)
        # (without the tools channel the chat route leaves the answer as it is, whole, and its
        # stream unwraps it: as SGLang's, the same where the reasoning parser unwrapped it)
        got = k3.KimiK3Detector().detect_and_parse(text, tools)
        want = (got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls])
        parts = list(text) if r.random() < 0.25 else _splits(r, text) if len(text) > 1 else [text]
        assert _streamed(parts) == want, parts
        called += bool(want[1])
    assert called > 4000, called


@pytest.mark.timeout(120)
def test_kimi_k3_stream_differs_from_the_whole_answer_outside_the_response() -> None:
    """Where text stands outside the response channel the stream sends it, as SGLang's stream
    does, and the whole reading drops it (the module docstring)."""
    text = f"pre{RESPONSE_OPEN}Hi{RESPONSE_CLOSE}post{TOOLS_OPEN}"
    assert _ours(text)[0] == "Hi"
    assert _streamed(list(text))[0] == "preHipost"
    theirs = k3.KimiK3Detector()
    sent = "".join(theirs.parse_streaming_increment(c, []).normal_text for c in text)
    assert sent == "preHipost"


def _thought(r: random.Random) -> str:
    """Reasoning and what follows it, as K3 writes it (its template opens the think channel)
    or not: every marker, pieces of them, text."""
    tags = [THINK_OPEN, THINK_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE, TOOLS_OPEN,
            TOOLS_CLOSE, "<|open|>think", "<|close|>think", "<|open|>", "<|close|>", "<|op",
            "<|open|>resp", "<|close|>respo", "<|open|>tools", "plan ", "ok", " ", "\n", "<|",
            '<|open|>call tool="f"<|sep|><|close|>call<|sep|>', "|>", "think"]  # fmt: skip
    return "".join(r.choice(tags) for _ in range(r.randint(0, 10)))


PREVIOUS = ["", "", "", "so " + THINK_OPEN, "a" + THINK_CLOSE, THINK_OPEN + "x" + THINK_CLOSE]


def _detector(force: bool, stream: bool, nonempty: bool, previous: str) -> Any:
    """SGLang's detector for a chat request (``ReasoningParser`` passes these on; the continued
    message only for a pydantic request, so here directly)."""
    return parser.KimiK3Detector(
        stream_reasoning=stream,
        force_reasoning=force,
        continue_final_message=bool(previous),
        previous_content=previous,
        force_nonempty_content=nonempty,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("thinking", [True, False])
def test_kimi_k3_reasoning_reads_as_sglangs_detector(thinking: bool) -> None:
    """``reasoning_parser.py:617`` (``KimiK3Detector``; ``reasoning_default="thinking"``: a
    request reasons, and its reasoning is forced, unless ``chat_template_kwargs.thinking`` is
    false): whole answers (``force_nonempty_content`` or not, reasoning streamed or held, a
    continued message or not) give ``detect_and_parse``'s reasoning and content (``:698``);
    fed in random splits, each step what ``parse_streaming_increment`` gives (``:746``) and at
    the end ``finish`` (``:845``, the base's ``:336`` without ``force_nonempty_content``)."""
    settings = ReasoningSettings("kimi_k3", PARSERS["kimi_k3"], False, None, (1,))
    r = random.Random(34 + thinking)
    compared = 0
    for _ in range(20000):
        text = _thought(r)
        nonempty, stream = r.random() < 0.3, r.random() < 0.7
        kwargs: dict[str, Any] = {} if thinking else {"thinking": False}
        if nonempty:
            kwargs["force_nonempty_content"] = True
        previous = r.choice(PREVIOUS)
        mine = settings.request(kwargs, None, stream=stream, previous=previous)
        assert mine.force is thinking and mine.keep_special
        options = (thinking, stream, nonempty, previous)
        want = _detector(*options).detect_and_parse(text)
        assert mine.parser().parse(text) == (want.reasoning_text, want.normal_text), text
        theirs, ours = _detector(*options), mine.parser()
        assert isinstance(ours, KimiK3Reasoning)
        parts = _splits(r, text) if len(text) > 1 else [text]
        _reasoned_alike(theirs, ours, parts, (parts, options))
        compared += 1
    assert compared == 20000


@pytest.mark.timeout(60)
def test_kimi_k3_reasoning_on_the_parse_route_is_forced() -> None:
    """``/separate_reasoning``: no chat request, so the detector's own ``force_reasoning``
    (True) holds."""
    from stages.engine.parse_routes import _separated

    for text in ["plan", f"plan{THINK_CLOSE}{RESPONSE_OPEN}Hi{RESPONSE_CLOSE}", "x<|close|>t"]:
        want = parser.ReasoningParser("kimi_k3", request=object()).parse_non_stream(text)
        got = _separated(text, PARSERS["kimi_k3"], False)
        assert (got["reasoning_text"], got["text"]) == (want[0] or "", want[1] or ""), text


@pytest.mark.timeout(300)
def test_kimi_k3_reasoning_and_calls_chain_as_sglangs_chat_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reasoning parser's content read by the tool-call parser, as ``serving_chat`` chains
    them: whole (``parse_non_stream``, then ``_process_tool_calls`` where the content opens the
    tools channel) and streamed (``_process_reasoning_stream``, then
    ``_process_tool_call_stream``, each step's content fed on, both flushed at the end); the
    streamed content joined is the whole content, where the answer is in the model's shape."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(36)
    called = shaped = 0
    for n in range(10000):
        model_shape = n % 2 == 0
        head = r.choice(["plan", "", "think it over\n"]) + r.choice([THINK_CLOSE] * 4 + [""])
        text = head + _shaped(r) if model_shape else _thought(r) + _answer(r)
        if _raises(text):
            continue
        stream_reasoning = r.random() < 0.7
        reasoning = parser.ReasoningParser("kimi_k3", stream_reasoning=False, force_reasoning=True)
        thought, content = reasoning.parse_non_stream(text)
        want = _theirs(content, tools)
        mine, rest = KimiK3Reasoning(stream_reasoning=False).parse(text)
        got = _ours(rest)
        assert (mine, got) == (thought, want), text
        called += bool(got[1])

        parts = _splits(r, text) if len(text) > 1 else [text]
        their_reasoning = parser.ReasoningParser(
            "kimi_k3", stream_reasoning=stream_reasoning, force_reasoning=True
        )
        our_reasoning = KimiK3Reasoning(stream_reasoning=stream_reasoning)
        their_calls, our_calls = k3.KimiK3Detector(), ToolCallParser(TOOLS, "kimi_k3").stream()
        fed, steps = "", []
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
            fed += content
            step = their_calls.parse_streaming_increment(content, tools)
            said, pieces = our_calls.feed(rest)
            items = step.calls
            if last:
                end = their_calls.finish(tools)
                step.normal_text += end.normal_text
                items = [*items, *end.calls]
                said += our_calls.flush()
            calls = [(p["index"], p["name"], p["arguments"]) for p in pieces]
            theirs = [(c.tool_index, c.name, c.parameters) for c in items]
            steps.append(((said, calls), (step.normal_text, theirs)))
        read = _after_close(fed, tools)  # (the calls after the tools channel's close: not read)
        for ours, (said, theirs) in steps:
            assert ours == (said, [c for c in theirs if c[0] < read]), parts
        if model_shape and TOOLS_OPEN in text:
            said_all = "".join(said for (said, _), _ in steps)
            calls_all = [c for (_, calls), _ in steps for c in calls]
            assert (said_all, calls_all) == got, parts
            shaped += 1
    assert called > 1500 and shaped > 1500, (called, shaped)
