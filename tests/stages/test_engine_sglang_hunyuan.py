"""Hunyuan's tool calls and reasoning read by the engine (``stages.engine.hunyuan_calls``,
``stages.engine.reasoning``'s ``hunyuan``) and by SGLang 0.5.23's own detectors
(``function_call/hunyuan_detector.py``, ``HunyuanDetector``; ``parser/reasoning_parser.py``,
its ``HunyuanDetector``) on random answers: well-formed calls with values of every declared
type, and every way of getting them wrong (the block or a call cut short, names not offered or
empty, separators missing, tags stray or unclosed, values that are not JSON, schemas the detector
cannot read), with the bare tags and with a tokenizer that spells them with a suffix (Hy3's).
Whole (``detect_and_parse``, as ``FunctionCallParser.parse_non_stream`` answers it): the same
content and the same calls with the same ``tool_index``, and where the detector's reading
raises (it catches it and answers the text), the text without calls; fed in random splits, the
engine's stream adds up to what the detector reads whole (its content's leading whitespace
aside, which the stream sends before it knows a call follows), or where that reading fails, its
content is the whole text. The reasoning: whole, and streamed step by step against the
detector's ``parse_streaming_increment`` and ``finish``. The effort normalization against
``parser/hunyuan_reasoning.py``.

Skipped unless SGLang's detectors import (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import importlib.util
import logging
import random
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
hunyuan: Any = pytest.importorskip("sglang.srt.function_call.hunyuan_detector")

from stages.engine.hunyuan_reasoning import normalized_effort, thinks  # noqa: E402
from stages.engine.reasoning import PARSERS, ThinkParser, Toggle, served_format  # noqa: E402
from stages.engine.tool_calls import ToolCallParser  # noqa: E402
from tests.stages.test_engine_sglang_detectors import _our_stream, _reasoned_alike, _splits  # noqa: E402

PROPERTIES = {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "b": {"type": "boolean"}, "a": {"type": "array"}, "o": {"type": "object"},
    "ai": {"type": "int"}, "u": {"type": "uint64"}, "d": {"type": "double"},
    "f": {"type": "Float32"}, "e": {"type": "enum"}, "any": {}, "nul": {"type": "null"},
    "union": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "one": {"oneOf": [{"type": "object"}, {"type": "string"}]},
    "opt": {"anyOf": [{"type": "array"}, {"type": "null"}]}, "str": "string",
    "St": {"type": "Str"}, "B2": {"type": "BOOL"}, "t": {"type": "text"}, "l": {"type": "list"},
    "m": {"type": "map"}, "bin": {"type": "binary"}, "sh": {"type": "short"},
    "num": {"type": "numeric"},
    # what the detector cannot read: the whole answer is then content
    "types": {"type": ["integer", "null"]}, "weird": True, "untyped": {"type": None},
    "loose": {"anyOf": "xy"},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get",
     "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "plain"}},
    {"type": "function", "function": {"name": "dup", "parameters": {
        "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "branch", "parameters": {"anyOf": [
        {"properties": {"p": {"type": "integer"}}}, {"properties": {"q": {"type": "boolean"}}}]}}},
    # a second tool of a name: its place is the name's tool_index, the first one's schema types
    {"type": "function", "function": {"name": "dup", "parameters": {
        "properties": {"x": {"type": "string"}}}}},
]  # fmt: skip
NAMES = ["get", "get", "plain", "dup", "branch", "ghost", "", " get ", "get\n", "pl ain"]
SOUND_KEYS = ["s", "i", "n", "b", "a", "o", "ai", "u", "d", "f", "e", "any", "nul", "union",
              "one", "opt", "str", "St", "B2", "t", "l", "m", "bin", "sh", "num", "x", "p", "q",
              "zz", " i "]  # fmt: skip
BAD_KEYS = ["types", "weird", "untyped", "loose"]
VALUES = ["1", " 7 ", "1_000", "-3", "+4", "2.5", "1e3", "1E3", ".5", "nan", "inf", "1e400",
          "True", "false", "TRUE", "null", "None", "", " ", "abc", "[1, 2]", '{"k": 1}', "{bad",
          '"q"', "é", "a<b", "x\ny", "[1, {\"a\": [true]}]", "٣", "1" * 5000,
          "[" * 3000]  # fmt: skip
SPACES = ["", "", "\n", " ", "\n\n"]
STRAY = [
    "<tool_calls>",
    "</tool_calls>",
    "<tool_call>",
    "</tool_call>",
    "<tool_sep>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_",
    "</arg",
    "<",
    " ",
]


class _Vocab:
    """A tokenizer whose vocabulary spells the tokens with a suffix, as Hy3's shipping one."""

    def __init__(self, suffix: str) -> None:
        names = ("tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value", "think")
        self.vocab = {f"<{n}{suffix}>": i for i, n in enumerate(names)}
        self.vocab.update({"<tool": 50, "hello": 51})

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


BARE, SUFFIXED = None, _Vocab(":opensource")


def _spelled(text: str, tokenizer: Any) -> str:
    """``text`` (written with the bare tags) as ``tokenizer`` spells the tags."""
    if tokenizer is None:
        return text
    for name in ("tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value", "think"):
        text = text.replace(f"<{name}>", f"<{name}:opensource>")
        text = text.replace(f"</{name}>", f"</{name}:opensource>")
    return text


def _call(r: random.Random, sound: bool) -> str:
    name = r.choice(NAMES)
    seps = ["<tool_sep>"] if sound else ["<tool_sep>", "<tool_sep>", "", "\n", "<tool_sep"]
    out = "<tool_call>" + name + r.choice(seps) + r.choice(SPACES)
    for _ in range(r.randint(0, 4)):
        key = r.choice(BAD_KEYS) if r.random() < 0.03 else r.choice(SOUND_KEYS)
        value = r.choice(VALUES)
        if sound:
            out += f"<arg_key>{key}</arg_key>{r.choice(SPACES)}<arg_value>{value}</arg_value>"
        else:
            out += r.choice(["<arg_key>", "<arg_key>", ""]) + key
            out += r.choice(["</arg_key>", "</arg_key>", "", "</arg_key>x"]) + r.choice(SPACES)
            out += r.choice(["<arg_value>", "<arg_value>", ""]) + value
            out += r.choice(["</arg_value>", "</arg_value>", "", r.choice(STRAY)])
        out += r.choice(SPACES)
    ends = ["</tool_call>"] if sound else ["</tool_call>", "</tool_call>", "", "</tool_calls>"]
    return out + r.choice(ends) + r.choice(SPACES)


def _answer(r: random.Random) -> str:
    """Content and a block of calls: sound ones (tags whole, names known or not) or any."""
    if r.random() < 0.1:
        return "".join(r.choice([*STRAY, "text ", "\n", "get"]) for _ in range(r.randint(1, 12)))
    sound = r.random() < 0.6
    out = r.choice(["", "Sure ", " text\n", "\n", "a <tool_call>b", "x</tool_calls>"])
    if not sound and r.random() < 0.2:
        out += _call(r, sound)  # a call before the block
    out += r.choice(["<tool_calls>", "<tool_calls>", "<tool_calls>", "", "<tool_"])
    out += r.choice(SPACES)
    for _ in range(r.randint(0, 3)):
        out += _call(r, sound)
    out += r.choice(["</tool_calls>", "</tool_calls>", "", "</tool_calls> after", " <tool_calls>"])
    return out + r.choice(["", "\n", " done"])


class _Errors(logging.Handler):
    """Counts the detector's logged errors (its reading raised and was caught)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _theirs(
    text: str, tools: list[Any], tokenizer: Any, errors: _Errors
) -> tuple[tuple[str, list[tuple[int, str, str]]], bool]:
    """``FunctionCallParser.parse_non_stream``'s answer, and whether the detector's reading
    raised (it answers the text then)."""
    before = errors.count
    detector = hunyuan.HunyuanDetector(tokenizer=tokenizer)
    if not detector.has_tool_call(text):
        return (text, []), False
    got = detector.detect_and_parse(text, tools)
    return (got.normal_text, [(c.tool_index, c.name, c.parameters) for c in got.calls]), (
        errors.count > before
    )


@pytest.fixture
def errors() -> Any:
    handler = _Errors()
    logger = logging.getLogger(hunyuan.__name__)
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.ERROR
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tokenizer", [BARE, SUFFIXED], ids=["bare", "suffixed"])
def test_hunyuan_reads_as_sglangs_detector(
    tokenizer: Any, errors: _Errors, caplog: pytest.LogCaptureFixture
) -> None:
    """``hunyuan_detector.py:292`` (``detect_and_parse``: the content before the block,
    stripped; ``tool_call_regex`` anywhere in the answer; tools not offered dropped; the
    ``except Exception`` answering the text), ``:248`` (``_parse_value``), ``:190``
    (``_get_types``), ``:172`` (``_normalize_type``), ``:180`` (``_get_arg_schema``: the first
    tool of the name); ``tool_index`` the last tool of the name (``_get_tool_indices``)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    places = {t["function"]["name"]: i for i, t in enumerate(TOOLS)}
    r = random.Random(21 if tokenizer is None else 22)
    raised = called = 0
    for _ in range(20000):
        text = _spelled(_answer(r), tokenizer)
        reader = ToolCallParser(TOOLS, "hunyuan", tokenizer)
        want, failed = _theirs(text, tools, tokenizer, errors)
        content, calls = reader.indexed(text, places) if reader.has_tool_call(text) else (text, [])
        assert (content, [(i, c["name"], c["arguments"]) for i, c in calls]) == want, text
        if failed:  # what the chat route answers: the text, no calls
            assert want == (text, []), text
        raised += failed
        called += bool(calls)
    assert raised > 300 and called > 5000, (raised, called)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tokenizer", [BARE, SUFFIXED], ids=["bare", "suffixed"])
def test_hunyuan_streams_what_sglangs_detector_reads_whole(
    tokenizer: Any, errors: _Errors, caplog: pytest.LogCaptureFixture
) -> None:
    """Random splits of each answer fed to the engine's stream: its content and its calls'
    pieces added up are the detector's whole reading (``hunyuan_detector.py:292``); where that
    reading raises, the stream's content is the whole text (the calls before the one it cannot
    read having gone out)."""
    caplog.set_level(logging.CRITICAL)
    tools = [protocol.Tool.model_validate(t) for t in TOOLS]
    r = random.Random(23 if tokenizer is None else 24)
    compared = failing = 0
    for _ in range(15000):
        text = _spelled(_answer(r), tokenizer)
        parts = _splits(r, text) if len(text) > 1 else [text]
        ours = ToolCallParser(TOOLS, "hunyuan", tokenizer).stream()
        content, calls = "", {}
        for part in parts:
            more, pieces = ours.feed(part)
            content += more
            for p in pieces:
                item = calls.setdefault(p["index"], ["", ""])
                item[0] += p["name"] or ""
                item[1] += p["arguments"]
        content += ours.flush()
        assert ours.unsent() == []
        (want_content, want_calls), failed = _theirs(text, tools, tokenizer, errors)
        if failed:
            assert content == text, parts
            failing += 1
            continue
        if want_calls or _spelled("<tool_calls>", tokenizer) in text:
            content = content.lstrip()  # (sent before the stream could know a call follows)
        assert (content, [calls[i] for i in sorted(calls)]) == (
            want_content,
            [[name, arguments] for _, name, arguments in want_calls],
        ), parts
        compared += 1
    assert compared > 13000 and failing > 150, (compared, failing)


def test_our_stream_helper_reads_hunyuan() -> None:
    """(``_our_stream`` with this format, as the other formats' tests use it.)"""
    text = "hi<tool_calls><tool_call>plain<tool_sep></tool_call></tool_calls>"
    assert _our_stream("hunyuan", [text[:9], text[9:]], TOOLS) == ("hi", {0: ["plain", "{}"]})


# -- the reasoning --------------------------------------------------------------------------------

THINK = ["<think>", "</think>", "<tool_calls>", "plan ", "ok", " ", "\n", "</th", "<thi",
         "<tool_", "x</think>y", "<tool_call>"]  # fmt: skip


def _thought(r: random.Random) -> str:
    """Reasoning as Hunyuan writes it (opened or not, ended by its tag or a call, cut short),
    or pieces."""
    if r.random() < 0.5:
        out = (
            r.choice(["", " ", "\n"]) + r.choice(["", "<think>"]) + r.choice(["plan ", "", "a\nb"])
        )
        out += r.choice(["</think>", "", "<tool_calls>", "\n<tool_calls>"])
        return out + r.choice(["", "answer", " answer", "<tool_call>f</tool_call>"])
    return "".join(r.choice(THINK) for _ in range(r.randint(1, 8)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("tokenizer", [BARE, SUFFIXED], ids=["bare", "suffixed"])
def test_hunyuan_reasoning_reads_as_sglangs_detector(force: bool, tokenizer: Any) -> None:
    """``reasoning_parser.py:1287`` (``HunyuanDetector``: the base detector with its tokens as
    the tokenizer spells them and ``<tool_calls>`` ending the reasoning): whole answers (forced
    or not, ``force_nonempty_content`` or not, reasoning streamed or held, continuing a message
    or not) give the detector's reasoning and content; fed in random splits, what its
    ``parse_streaming_increment`` gives each step and its ``finish`` at the end."""
    parser: Any = pytest.importorskip("sglang.srt.parser.reasoning_parser")

    fmt = served_format(PARSERS["hunyuan"], tokenizer)
    r = random.Random(40 + 2 * force + (tokenizer is not None))
    for _ in range(5000):
        text = _spelled(_thought(r), tokenizer)
        previous = _spelled(r.choice(["", "", "<think>x", "<think>x</think>y"]), tokenizer)
        options = {"force_nonempty_content": r.random() < 0.3, "stream_reasoning": r.random() < 0.7}
        theirs_options = {**options, "force_reasoning": force, "tokenizer": tokenizer}
        if previous:
            theirs_options.update(continue_final_message=True, previous_content=previous)
        mine = {"force": force, "nonempty": options["force_nonempty_content"],
                "stream_reasoning": options["stream_reasoning"], "previous": previous}  # fmt: skip
        want = parser.HunyuanDetector(**theirs_options).detect_and_parse(text)
        assert ThinkParser(fmt, **mine).parse(text) == (want.reasoning_text, want.normal_text), text
        theirs = parser.HunyuanDetector(**theirs_options)
        ours = ThinkParser(fmt, **mine)
        parts = _splits(r, text) if len(text) > 1 else [text]
        _reasoned_alike(theirs, ours, parts, parts)


# -- the effort -----------------------------------------------------------------------------------


def _sglang_effort_module() -> tuple[Any, Any]:
    """``parser/hunyuan_reasoning.py`` and its ``ReasoningToggleConfig``: imported, or where its
    ``template_detection`` pulls in more than SGLang's source here provides, loaded with a
    stand-in for that class."""
    try:
        from sglang.srt.parser import hunyuan_reasoning, template_detection
    except ImportError:
        pass
    else:
        return hunyuan_reasoning, template_detection.ReasoningToggleConfig

    @dataclass(frozen=True)
    class ReasoningToggleConfig:
        special_case: str | None = None

    name = "sglang.srt.parser.template_detection"
    stand_in = types.ModuleType(name)
    stand_in.ReasoningToggleConfig = ReasoningToggleConfig  # type: ignore[attr-defined]
    path = Path(hunyuan.__file__).parents[1] / "parser" / "hunyuan_reasoning.py"
    spec = importlib.util.spec_from_file_location("_sglang_hunyuan_reasoning", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = stand_in
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module, ReasoningToggleConfig


EFFORTS = [None, "none", "no_think", "minimal", "low", "medium", "high", "xhigh", "max", "ultra",
           0.5, 0.0, "", "HIGH", False, True, 1]  # fmt: skip


def test_hunyuan_effort_is_normalized_as_sglang_does() -> None:
    """``hunyuan_reasoning.py:17`` (``normalize_hunyuan_reasoning_effort``) on every pair of a
    request's effort and its kwarg's (or no kwargs): the same effort, the same kwargs, the same
    refusals; and whether it reasons, as ``serving_chat._get_reasoning_from_request``'s
    ``hunyuan`` branch (``serving_chat.py:3538-3545``) reads the request after it and after
    ``_convert_to_internal_request`` (``:1291-1307``, which for templates other than the effort
    ones moves the kwarg into the request's field)."""
    module, toggle_config = _sglang_effort_module()
    config = toggle_config(special_case="hunyuan_effort")
    for effort in EFFORTS:
        for kwarg in [*EFFORTS, "absent", "no kwargs"]:
            kwargs = None if kwarg == "no kwargs" else {"other": 1}
            if kwargs is not None and kwarg != "absent":
                kwargs["reasoning_effort"] = kwarg
            request = types.SimpleNamespace(
                reasoning_effort=effort,
                chat_template_kwargs=None if kwargs is None else dict(kwargs),
            )
            try:
                module.normalize_hunyuan_reasoning_effort(request, "hunyuan", config)
            except ValueError as exc:
                with pytest.raises(ValueError, match=str(exc)):
                    normalized_effort(effort, kwargs)
            else:
                got = normalized_effort(effort, kwargs)
                assert got == (request.reasoning_effort, request.chat_template_kwargs)
                want = request.reasoning_effort not in ("none", "no_think")
                assert thinks(True, got[1], got[0]) == want
            # another template: the kwarg moved into the field (serving_chat.py:1291-1307)
            assert not module.uses_hunyuan_reasoning_effort("hunyuan", toggle_config())
            moved = (kwargs or {}).get("reasoning_effort")
            field = moved if moved is not None else effort
            assert thinks(False, kwargs, effort) == (field not in (None, "none", "no_think"))
    assert not module.uses_hunyuan_reasoning_effort("mistral", config)  # only hunyuan's
    assert Toggle(special="hunyuan_effort").special == config.special_case
