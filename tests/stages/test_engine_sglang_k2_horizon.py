"""K2 Horizon's tool calls and reasoning read by the engine (``stages.engine.k2_horizon_calls``,
``stages.engine.reasoning``'s ``k2_horizon``) and by SGLang 0.5.23's own detectors
(``function_call/k2_v3_detector.py`` and ``parser/reasoning_parser.py``, both ``K2V3Detector``)
on random answers: calls in a group or not, in the tagged, typed and JSON dialects, values typed
by their tools' schemas (``$ref``s, unions, type lists) or their type tags, and every way of
getting them wrong (text between calls or arguments, tags cut or never closed, names missing,
JSON that is not a call, values nested too deep or numbers too long for Python's JSON reader),
behind leading reasoning blocks or not. Whole (``detect_and_parse``): the same content and the
same calls with the same ``tool_index``, and where the detector raises, what the chat route
answers (the text as it is, no calls); fed in random splits, the engine's stream adds up to
what the detector reads whole. The reasoning, for each ``reasoning_effort`` (the request's
field, ``chat_template_kwargs``' or both): whole, and fed in random splits step by step.

Skipped unless SGLang's detectors import (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how; it also needs ``partial_json_parser``).
"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
k2: Any = pytest.importorskip("sglang.srt.function_call.k2_v3_detector")

from stages.engine.reasoning import PARSERS, ReasoningSettings, ThinkParser  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _reasoned_alike, _splits  # noqa: E402

PROPERTIES = {
    "a": {"type": "integer"}, "b": {"type": "number"}, "flag": {"type": "boolean"},
    "s": {"type": "string"}, "ns": {"type": ["string", "null"]},
    "ni": {"type": ["integer", "null"]}, "two": {"type": ["integer", "boolean"]},
    "onlynull": {"type": ["null"]},
    "items": {"type": "array"}, "cfg": {"type": "object", "properties": {"k": {}}},
    "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "e": {"enum": [1, 2]},
    "any": {}, "anyt": {"type": "any"}, "r": {"$ref": "#/$defs/code"},
    "rd": {"$ref": "#/definitions/n"}, "loop": {"$ref": "#/$defs/loop"}, "root": {"$ref": "#"},
    "missing": {"$ref": "#/$defs/none"}, "over": {"$ref": "#/$defs/code", "type": "integer"},
}  # fmt: skip
DEFS = {"code": {"type": "string"}, "loop": {"$ref": "#/$defs/loop"},
        "chain": {"$ref": "#/$defs/code"}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": PROPERTIES, "$defs": DEFS,
        "definitions": {"n": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "bare", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "none"}},
    {"type": "function", "function": {"name": "union", "parameters": {"oneOf": [
        {"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "string"}}}]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "properties": {"a": {"type": "string"}}}}},  # a second of the name: the first counts
]  # fmt: skip
NAMES = ["add", "bare", "none", "union", "ghost", "", " add ", "add x", "[add", "{add"]
KEYS = [*PROPERTIES, "x", "y", "k", "zz", "", " a "]
VALUES = ["1", " 2.5 ", "1e3", "-3", "true", "False", "null", "abc", "", " ", "[1, 2]",
          '{"k": 1}', '"q"', "NaN", "Infinity", "1e400", "0x1F", "007", "é", "a<b", "x\ny",
          "[1,", "{", "\u00a0", "1" * 5000, "[" * 3000 + "]" * 3000]  # fmt: skip
TYPES = ["string", "integer", "number", "any", "object", "", " string ", "bogus", "array"]
JSON_VALUES = ['1', '"1"', '"abc"', '2.5', 'true', 'null', '[1, "2"]', '{"k": "v"}', '"007"',
               'NaN', '"[1]"', '"{\\"k\\": 1}"', '1' * 5000, '[' * 3000 + ']' * 3000]  # fmt: skip
SPACES = ["", "", "\n", " ", " \n ", "\u00a0"]


def _tagged(r: random.Random, sound: bool) -> str:
    """A call in the tagged (or typed) dialect: its name and key, type and value tags."""
    names, keys, values = (NAMES[:4], KEYS[:-2], VALUES[:-2]) if sound else (NAMES, KEYS, VALUES)
    out = r.choice(SPACES) + r.choice(names) + r.choice(SPACES)
    for _ in range(r.randint(0, 3)):
        out += f"<ifm|arg_key>{r.choice(keys)}</ifm|arg_key>" + r.choice(SPACES)
        if r.random() < 0.4:
            out += f"<ifm|arg_type>{r.choice(TYPES)}</ifm|arg_type>" + r.choice(SPACES)
        value = r.choice(values)
        if sound or r.random() < 0.7:
            out += f"<ifm|arg_value>{value}</ifm|arg_value>"
        else:
            out += r.choice([f"<ifm|arg_value>{value}", value, f"<ifm|arg_value>{value}</ifm|",
                             f"junk<ifm|arg_value>{value}</ifm|arg_value>"])  # fmt: skip
        out += r.choice(SPACES)
        if not sound and r.random() < 0.1:
            out += r.choice(["stray", "<ifm|arg_key>k</ifm|arg_key>", "</ifm|arg_value>"])
    return out


def _json(r: random.Random) -> str:
    """A call in the JSON dialect (or something in its place)."""

    def one() -> str:
        name = r.choice(['"add"', '"bare"', '"ghost"', '""', "5", "null", '"union"'])
        args = (
            "{"
            + ", ".join(
                f'"{r.choice(KEYS)}": {r.choice(JSON_VALUES)}' for _ in range(r.randint(0, 3))
            )
            + "}"
        )
        args = r.choice([args, args, args, f'"{args.replace(chr(34), chr(92) + chr(34))}"',
                         '""', "null", "[1]", '"[1]"', '"{bad"', "5"])  # fmt: skip
        key = r.choice(["arguments", "arguments", "parameters", "args"])
        body = f'{{"name": {name}, "{key}": {args}}}'
        return r.choice([body, body, f'{{"function": {body}}}', '{"function": 5}', "7", "{}"])

    calls = [one() for _ in range(r.randint(1, 3))]
    return r.choice([calls[0], "[" + ", ".join(calls) + "]", "[]", "{bad json", "[" + calls[0]])


def _call(r: random.Random, sound: bool) -> str:
    body = _json(r) if r.random() < 0.3 else _tagged(r, sound)
    end = "</ifm|tool_call>" if sound or r.random() < 0.85 else r.choice(["", "</ifm|tool_"])
    return "<ifm|tool_call>" + body + end


def _reasoning(r: random.Random) -> str:
    """Leading reasoning blocks as a model (or a template) may write them, or their pieces."""
    out = ""
    for _ in range(r.choice([0, 0, 1, 1, 2])):
        start, end = r.choice([("<ifm|think>", "</ifm|think>"),
                               ("<ifm|think_fast>", "</ifm|think_fast>"),
                               ("<ifm|think_faster>", "</ifm|think_faster>")])  # fmt: skip
        inner = r.choice(
            ["plan", "", "maybe <ifm|tool_call>x</ifm|tool_call>", "a</ifm|tool_calls>"]
        )
        out += r.choice(SPACES) + start + inner + r.choice([end, end, end, "", "</ifm|think>"])
    return out + r.choice(["", "", "\n", "<ifm|th", " <", "<ifm|think_"])


def _answer(r: random.Random) -> str:
    sound = r.random() < 0.6
    out = _reasoning(r) + r.choice(
        ["", "Sure ", " text\n", "\n", "<", "</ifm|tool_calls", "a</ifm|tool_calls>b"]
    )
    for _ in range(r.choice([0, 1, 1, 1, 2])):
        grouped = r.random() < 0.7
        if grouped:
            out += r.choice(["<ifm|tool_calls>", "<ifm|tool_calls>\n"])
        for _ in range(r.randint(0, 3)):
            out += _call(r, sound) + r.choice(
                SPACES if sound else [*SPACES, "junk", "</ifm|tool_calls"]
            )
        if grouped:
            out += r.choice(["</ifm|tool_calls>", "</ifm|tool_calls>", "\n</ifm|tool_calls>", ""])
        out += r.choice(["", " after", "\n", "<ifm|tool_calls>", "</ifm|tool_calls>", ">"])
    return out


def _theirs(text: str, tools: list[Any]) -> tuple[str, list[tuple[int, str, str]]] | None:
    """The detector's whole reading as ``FunctionCallParser.parse_non_stream`` gives it (None:
    it raises)."""
    detector = k2.K2V3Detector()
    try:
        if not detector.has_tool_call(text):
            return text, []
        got = detector.detect_and_parse(text, tools)
    except Exception:
        return None
    return got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]


@pytest.mark.timeout(300)
def test_k2_horizon_reads_as_sglangs_detector(caplog: pytest.LogCaptureFixture) -> None:
    """``k2_v3_detector.py:81`` (``detect_and_parse``: the leading reasoning, ``:323``, a
    closed group all or nothing, ``:228``, else each call alone, the group tags out of the
    content), ``:357`` (``_parse_block``), ``:372`` (JSON), ``:406`` (tagged), ``:507``
    (``_argument_type``, ``$ref``s by ``:461``), ``:535`` (``_coerce_value``), ``:439``
    (unknown tools dropped)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(21)
    raised = called = 0
    for _ in range(20000):
        text = _answer(r)
        reader = ToolCallParser(TOOLS, "k2_horizon")
        assert reader.has_tool_call(text) == k2.K2V3Detector().has_tool_call(text), text
        content, calls = reader.indexed(text, {})
        got = (content, [(i, c["name"], c["arguments"]) for i, c in calls])
        want = _theirs(text, tools)
        if want is None:  # the detector raises: serving_chat answers the text, no calls
            assert got == (text, []), text
            raised += 1
            continue
        assert got == want, text
        called += bool(calls)
    assert raised > 100 and called > 4000, (raised, called)


def _streamed(parts: list[str]) -> tuple[str, dict[int, list[str]]]:
    """``parts`` fed to the engine's stream, flushed, its calls' pieces (``unsent`` too)
    added up by index."""
    ours = ToolCallParser(TOOLS, "k2_horizon").stream()
    text, pieces = "", []
    for part in parts:
        more, new = ours.feed(part)
        text, pieces = text + more, pieces + new
    text += ours.flush()
    calls: dict[int, list[str]] = {}
    for piece in pieces + ours.unsent():
        item = calls.setdefault(piece["index"], ["", ""])
        item[0] += piece["name"] or ""
        item[1] += piece["arguments"]
    return text, calls


@pytest.mark.timeout(300)
def test_k2_horizon_streams_what_sglangs_detector_reads_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Random splits of each answer fed to the engine's stream: its content and its calls'
    pieces added up are the detector's whole reading (``k2_v3_detector.py:81``), where it does
    not raise, and the text as it came where it does."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(22)
    grouped = 0
    for _ in range(20000):
        text = _answer(r)
        want = _theirs(text, tools) or (text, [])
        parts = _splits(r, text) if len(text) > 1 else [text]
        if r.random() < 0.25:  # a character at a time
            parts = list(text)
        content, calls = _streamed(parts)
        assert (content, [calls[i] for i in sorted(calls)]) == (
            want[0],
            [[name, arguments] for _, name, arguments in want[1]],
        ), parts
        grouped += "</ifm|tool_calls>" in text and bool(want[1])
    assert grouped > 2000


def _thought(r: random.Random) -> str:
    """Reasoning as K2 writes it (forced: its template opens it), cut short or not, a call's
    tag ending it, or pieces of every effort's tags."""
    tags = ["<ifm|think>", "</ifm|think>", "<ifm|think_fast>", "</ifm|think_fast>",
            "<ifm|think_faster>", "</ifm|think_faster>", "</ifm|think", "<ifm|think_f",
            "<ifm|tool_calls>", "<ifm|tool_call>", "<ifm|tool_c", "</ifm|tool_calls>", "plan ",
            "ok", " ", "\n", "x</ifm|think_fast>y", "<ifm"]  # fmt: skip
    return "".join(r.choice(tags) for _ in range(r.randint(0, 9)))


EFFORTS = [None, "high", "medium", "low", "none", "max", "minimal", 0.5, "HIGH", 5, [1], True]


@pytest.mark.timeout(300)
def test_k2_horizon_reasoning_reads_as_sglangs_detector() -> None:
    """``reasoning_parser.py:560`` (``K2V3Detector``: always forced, the tags of the effort,
    ``medium``'s for any other value, ``high``'s for none), ``:2371`` (the effort:
    ``chat_template_kwargs``' before the request's): whole answers (``force_nonempty_content``
    or not, reasoning streamed or held, a continued message or not) give the detector's
    reasoning and content; fed in random splits, what its ``parse_streaming_increment`` gives
    each step and its ``finish`` at the end."""
    parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")
    settings = ReasoningSettings("k2_horizon", PARSERS["k2_horizon"], True, None, (1,), ((1,),) * 3)
    r = random.Random(23)
    compared = 0
    for _ in range(20000):
        text = _thought(r)
        field, kwarg = r.choice(EFFORTS), r.choice([*EFFORTS, "absent"])
        kwargs: dict[str, Any] = {} if kwarg == "absent" else {"reasoning_effort": kwarg}
        nonempty, stream = r.random() < 0.3, r.random() < 0.7
        if nonempty:
            kwargs["force_nonempty_content"] = True
        previous = r.choice(["", "", "so <ifm|think>", "<ifm|think_fast>a</ifm|think_fast>"])
        request = SimpleNamespace(
            chat_template_kwargs=dict(kwargs), reasoning_effort=field, continue_final_message=False
        )

        mine = settings.request(kwargs, field, stream=stream, previous=previous)
        options = (request, stream, nonempty, previous)
        want = _detector(parser, *options).detect_and_parse(text)
        assert mine.parser().parse(text) == (want.reasoning_text, want.normal_text), text
        detector, ours = _detector(parser, *options), mine.parser()
        assert isinstance(ours, ThinkParser) and ours.fmt.end == detector.think_end_token
        parts = _splits(r, text) if len(text) > 1 else [text]
        _reasoned_alike(detector, ours, parts, parts)
        compared += 1
    assert compared == 20000


def _detector(parser: Any, request: Any, stream: bool, nonempty: bool, previous: str) -> Any:
    """SGLang's detector for a chat request (``ReasoningParser``'s; ``previous``: the message
    it continues, which ``ReasoningParser`` passes on for a pydantic request only)."""
    detector = parser.ReasoningParser(
        "k2_horizon", stream_reasoning=stream, force_reasoning=True, request=request
    ).detector
    if not previous:
        return detector
    efforts = {"<ifm|think>": "high", "<ifm|think_fast>": "medium", "<ifm|think_faster>": "low"}
    return type(detector)(
        stream_reasoning=stream,
        force_nonempty_content=nonempty,
        continue_final_message=True,
        previous_content=previous,
        reasoning_effort=efforts[detector.think_start_token],
    )
