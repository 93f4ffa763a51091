"""Kimi K3's tool calls and reasoning (``stages.engine.kimi_k3_calls``,
``stages.engine.kimi_k3_reasoning``; ``--tool-call-parser kimi_k3``, ``--reasoning-parser
kimi_k3``) read whole and streamed, as SGLang 0.5.23's ``KimiK3Detector``s read them (held to
them on random answers in ``test_engine_sglang_kimi_k3.py``), on the chat route and the parse
routes, and through an engine serving a tiny model with both parsers; these cases need no
SGLang."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog

from stages.engine.kimi_k3_calls import (
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
)
from stages.engine.kimi_k3_reasoning import KimiK3Reasoning
from stages.engine.openai_chat import ChatSettings, chat_request, chat_response, chat_stream
from stages.engine.parse_routes import _read_calls, _separated
from stages.engine.reasoning import PARSERS
from stages.engine.template_detection import resolve_auto
from stages.engine.tool_calls import (
    UNCONSTRAINED,
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
)
from tests.stages.test_engine_chat import _native
from tests.stages.test_engine_server import Engine, serving
from tests.stages.test_engine_tool_formats import STEPS, _feed
from tests.stages.tiny_model import BYTE_CHARS, make_byte_model

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]  # fmt: skip


def _arg(key: str, value: str, kind: str | None = "string") -> str:
    typed = "" if kind is None else f' type="{kind}"'
    return f'<|open|>argument key="{key}"{typed}<|sep|>{value}<|close|>argument<|sep|>'


def _call(name: str, *arguments: str, attrs: str = ' index="1"') -> str:
    return f'<|open|>call tool="{name}"{attrs}<|sep|>' + "".join(arguments) + "<|close|>call<|sep|>"


WEATHER = _call(
    "get_weather",
    _arg("city", "Zürich"),
    _arg("days", " 3 ", "integer"),
    _arg("opts", '{"units": ["c"]}', "object"),
    _arg("note", "x y", None),
    _arg("raw", "not json", "number"),
)
WEATHER_ARGS = {"city": "Zürich", "days": 3, "opts": {"units": ["c"]}, "note": "x y",
                "raw": "not json"}  # fmt: skip
GHOST = _call("gh&quot;ost&amp;", _arg("a", "1", "integer"))
REPLY = f"{RESPONSE_OPEN}Let me look.{RESPONSE_CLOSE}"
ANSWER = f"{REPLY}{TOOLS_OPEN}\n{WEATHER}\n{GHOST}\n{TOOLS_CLOSE}"


def _read(text: str) -> tuple[str, list[tuple[int, str, Any]]]:
    content, calls = ToolCallParser(TOOLS, "kimi_k3").indexed(text, {})
    return content, [(i, c["name"], json.loads(c["arguments"])) for i, c in calls]


def _stream(text: str, step: int) -> tuple[str, list[tuple[int, str, Any]]]:
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "kimi_k3"))
    content, pieces = _feed(stream, text, step)
    assert stream.unsent() == [] and stream.calls == len(pieces)
    return content, [(p["index"], p["name"], json.loads(p["arguments"])) for p in pieces]


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k3_reads_the_calls_of_its_tools_channel(step: int) -> None:
    """``detect_and_parse``: the reply unwrapped, each call's arguments by their type tags (a
    string's text, JSON else the text), its name unescaped, calls to tools not offered kept,
    each call whole in one piece when streamed."""
    want = ("Let me look.", [(0, "get_weather", WEATHER_ARGS), (1, 'gh"ost&', {"a": 1})])
    assert _read(ANSWER) == want
    assert _stream(ANSWER, step) == want
    assert ToolCallParser(TOOLS, "kimi_k3").has_tool_call(ANSWER)
    assert not ToolCallParser(TOOLS, "kimi_k3").has_tool_call(REPLY + "<|open|>tool")


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k3_drops_what_is_not_a_whole_call(step: int) -> None:
    """A call without a ``tool`` attribute, one never closed and one after the tools channel
    closed are no calls; a later key wins; what follows the channel is not content."""
    nameless = '<|open|>call index="1"<|sep|>' + _arg("a", "1") + "<|close|>call<|sep|>"
    twice = _call("add", _arg("a", "1", "integer"), _arg("a", "2", "integer"))
    text = (f"Hi{MESSAGE_CLOSE}{TOOLS_OPEN}{nameless}{twice}{TOOLS_CLOSE}"
            f"{_call('add')} after")  # fmt: skip
    assert _read(text) == _stream(text, step) == ("Hi", [(0, "add", {"a": 2})])
    cut = f"{REPLY}{TOOLS_OPEN}{WEATHER}" + '<|open|>call tool="add"<|sep|>' + _arg("a", "1")
    assert _read(cut) == _stream(cut, step) == ("Let me look.", [(0, "get_weather", WEATHER_ARGS)])


def test_kimi_k3_answer_whose_value_cannot_be_read_keeps_its_reply_alone() -> None:
    """A value nested past Python's recursion limit (or an integer longer than it reads)
    makes the detector's reading raise: its ``except`` answers the reply, no calls; streamed,
    that call is dropped (logged) and the others go out."""
    for bad in ("[" * 20000 + "]" * 20000, "1" * 5000):
        text = f"{REPLY}{TOOLS_OPEN}{WEATHER}{_call('add', _arg('a', bad, 'array'))}{TOOLS_CLOSE}"
        with structlog.testing.capture_logs() as logs:
            assert _read(text) == ("Let me look.", [])
            assert _stream(text, 7) == ("Let me look.", [(0, "get_weather", WEATHER_ARGS)])
        assert [e["event"] for e in logs] == ["tool_call_unparsed"] * 2


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k3_content_is_the_response_channels_inside(step: int) -> None:
    """``strip_response_wrappers``: the first response channel's inside (to the end when it is
    not closed), a response close alone taken out, message closes out, a marker cut short at
    the end dropped; streamed as it comes, a tail that may begin a marker held back. Text
    outside the response channel: the whole reading drops it, the stream sends it (as
    SGLang's)."""
    for text, want in (
        (f"{RESPONSE_OPEN}Hello{RESPONSE_CLOSE}{MESSAGE_CLOSE}{TOOLS_OPEN}", "Hello"),
        (f"{RESPONSE_OPEN}Hello <|close|>resp{TOOLS_OPEN}", "Hello <|close|>resp"),
        (f"Hello{RESPONSE_CLOSE}{MESSAGE_CLOSE}{TOOLS_OPEN}", "Hello"),
    ):
        assert _read(text) == _stream(text, step) == (want, []), text
    outside = f"pre{RESPONSE_OPEN}Hello{RESPONSE_CLOSE}post{TOOLS_OPEN}"
    assert _read(outside)[0] == "Hello" and _stream(outside, step)[0] == "preHellopost"
    cut = f"{RESPONSE_OPEN}a<b<|close|>{TOOLS_OPEN}"  # (the marker cut short: whole only)
    assert _read(cut)[0] == "a<b" and _stream(cut, step)[0] == "a<b<|close|>"
    # without the tools channel the stream unwraps (and a cut marker goes at its end)
    assert _stream(f"{RESPONSE_OPEN}Hi{RESPONSE_CLOSE}<|close|>message", step)[0] == "Hi"


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k3_reasoning_is_its_think_channel(step: int) -> None:
    """``KimiK3Detector``: forced, reasoning up to the think close (or the response or tools
    channel opening), the content unwrapped with the tools channel passed on; not forced, only
    an answer that opens the think channel reasons; a response closed before any think close
    skipped the reasoning (all content, the reasoning streamed so far sent again as content);
    ``force_nonempty_content`` only changes a skipped answer without think markers."""
    calls = f"{TOOLS_OPEN}{WEATHER}"
    cases = [
        (True, f"plan{THINK_CLOSE}{RESPONSE_OPEN}Hi{RESPONSE_CLOSE}", ("plan", "Hi")),
        (True, f"{THINK_OPEN}plan{THINK_CLOSE}{REPLY}{calls}", ("plan", "Let me look." + calls)),
        (True, f"plan{calls}", ("plan", calls)),
        (True, f"plan{RESPONSE_OPEN}Hi", ("plan", "Hi")),
        (False, f"{REPLY}{MESSAGE_CLOSE}", ("", "Let me look.")),
        (False, f"{THINK_OPEN}plan{THINK_CLOSE}Hi", ("plan", "Hi")),
    ]
    for force, text, want in cases:
        assert KimiK3Reasoning(force=force).parse(text) == want, text
        ours = KimiK3Reasoning(force=force)
        parts = [ours.feed(text[i : i + step]) for i in range(0, len(text), step)]
        parts.append(ours.finish())
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, (text, step)
    # a think close cut short: the whole answer drops it, SGLang's stream sends it
    assert KimiK3Reasoning().parse("plan<|close|>think") == ("plan", "")
    ours = KimiK3Reasoning()
    assert [ours.feed("plan<|close|>think"), ours.finish()] == [
        ("plan", ""),
        ("<|close|>think", ""),
    ]
    assert KimiK3Reasoning(previous=f"{THINK_OPEN}a{THINK_CLOSE}").parse("Hi") == ("", "Hi")
    # a skipped think: streamed, what went out as reasoning goes again as content
    skipped = f"Hi{RESPONSE_CLOSE}{MESSAGE_CLOSE}"
    assert KimiK3Reasoning().parse(skipped) == ("", "Hi")
    ours = KimiK3Reasoning()
    assert [ours.feed("Hi"), ours.feed(skipped[2:]), ours.finish()] == [
        ("Hi", ""), ("", "Hi"), ("", "")]  # fmt: skip
    assert KimiK3Reasoning(nonempty=True).parse(f"Hi{RESPONSE_CLOSE}") == ("", "Hi")


def test_kimi_k3_parse_routes_read_as_sglangs() -> None:
    """``/parse_function_call``: no tools, the text as it is; a text without the tools channel
    as it is; else the reply and the calls with their place. ``/separate_reasoning``: no chat
    request, so forced (the detector's default)."""
    names = [t["function"]["name"] for t in TOOLS]
    assert _read_calls(ANSWER, [], "kimi_k3", []) == (ANSWER, [])
    assert _read_calls(REPLY, names, "kimi_k3", TOOLS) == (REPLY, [])
    content, calls = _read_calls(ANSWER, names, "kimi_k3", TOOLS)
    assert content == "Let me look." and [(c["tool_index"], c["name"]) for c in calls] == [
        (0, "get_weather"), (1, 'gh"ost&')]  # fmt: skip
    fmt = PARSERS["kimi_k3"]
    assert fmt.kimi_k3 and fmt.end == THINK_CLOSE and "response" in fmt.excluded
    assert _separated(f"plan{THINK_CLOSE}{REPLY}", fmt, True) == {
        "reasoning_text": "plan", "text": "Let me look.", "reasoning_blocks": ["plan"],
        "text_blocks": ["Let me look."], "blocks": [{"type": "reasoning", "text": "plan"},
                                                     {"type": "text", "text": "Let me look."}],
    }  # fmt: skip


def test_kimi_k3_answers_are_not_constrained_and_it_says_so(tmp_path: Path) -> None:
    """SGLang constrains every K3 request with tools by xgrammar tags of token formats, which
    the engine cannot compile: nothing is constrained here (a forced ``tool_choice`` neither:
    its JSON array would not be read in this format), the answer read in the format, and the
    server says so once, at its start; a ``KimiK3`` architecture picks both parsers (``auto``),
    now served."""
    assert "kimi_k3" in UNCONSTRAINED
    assert forced_calls(TOOLS, "kimi_k3", named=False, parallel=True) == {}
    assert strict_calls([{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}],
                        "kimi_k3") is None  # fmt: skip
    assert answer_format("kimi_k3", {}) == "kimi_k3"
    model = _model(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "architectures": ["KimiK3ForCausalLM"]})
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    with structlog.testing.capture_logs() as logs:
        found = resolve_auto(["reasoning_parser", "tool_call_parser"], chat_template=None,
                             tokenizer=None, model_dir=model)  # fmt: skip
        settings = ChatSettings.of(
            tokenizer, model, chat_template=TEMPLATE, tool_call_parser="kimi_k3",
            reasoning_parser="kimi_k3",
        )  # fmt: skip
    assert [found[k].parser for k in ("reasoning_parser", "tool_call_parser")] == ["kimi_k3"] * 2
    (warning,) = [e for e in logs if e["event"] == "native_tool_tag_not_served"]
    assert warning["parser"] == "kimi_k3" and "not constrained" in warning["reason"]
    assert settings is not None and settings.kimi_k3
    native, _ = chat_request({**ASK, "tools": TOOLS, "tool_choice": "required"}, settings, 512)
    sampling = native["sampling_params"]
    assert not {"structural_tag", "json_schema"} & set(sampling)


TEMPLATE = "{%- for m in messages %}{{ m.content }}.{% endfor %}"
ASK: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "ab"}]}


CHARS = BYTE_CHARS + " <>_/\n|()=';L"


def _model(path: Path) -> Path:
    """A byte-level model whose ``<|open|>``, ``<|close|>`` and ``<|sep|>`` are special
    tokens, as K3's are."""
    from transformers import AutoTokenizer

    tags = ("<|open|>", "<|close|>", "<|sep|>")
    model = make_byte_model(path, seed=4, chars=CHARS, words=tags)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tags)})
    tokenizer.save_pretrained(model)
    return model


def test_a_kimi_k3_chat_request_keeps_its_markers_stops_at_its_tools_close_and_counts_ids(
    tmp_path: Path,
) -> None:
    """serving_chat with ``kimi_k3``: every answer decoded with its special tokens
    (``_patch_reasoning_skip_special_tokens``), a request with tools stopped at
    ``<|close|>tools<|sep|>`` (its ``tool_call_stop``, with the request's own stops), reasoning
    on unless ``thinking`` is false; its answer's reasoning, reply and calls, each call's id
    ``NAME:K``, ``K`` counting the conversation's calls (``_process_tool_call_id``); whole and
    streamed."""
    from transformers import AutoTokenizer

    model = _model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = ChatSettings.of(tokenizer, model, chat_template=TEMPLATE,
                               tool_call_parser="kimi_k3", reasoning_parser="kimi_k3")  # fmt: skip
    assert settings is not None
    earlier = {"id": "add:0", "type": "function",
               "function": {"name": "add", "arguments": '{"a": 1}'}}  # fmt: skip
    messages = [*ASK["messages"], {"role": "assistant", "content": "", "tool_calls": [earlier]},
                {"role": "tool", "content": "3", "tool_call_id": "add:0"}]  # fmt: skip
    with_tools = {**ASK, "messages": messages, "tools": TOOLS, "stop": "zz"}
    # tools on a system message count too (_effective_tools)
    system = {"role": "system", "content": "s", "tools": TOOLS}
    told = {**ASK, "messages": [system, *ASK["messages"]]}
    for body, stop in ((ASK, None), (with_tools, ["zz", TOOLS_CLOSE]),
                       ({**with_tools, "tool_choice": "none"}, "zz"),
                       (told, [TOOLS_CLOSE])):  # fmt: skip
        native, options = chat_request(body, settings, 512)
        assert native["sampling_params"]["skip_special_tokens"] is False
        assert native["sampling_params"].get("stop") == stop
        assert native["require_reasoning"] is True and options["reasoning"].force
    off = {**ASK, "chat_template_kwargs": {"thinking": False}}
    assert not chat_request(off, settings, 512)[1]["reasoning"].force

    text = f"plan{THINK_CLOSE}{ANSWER}"
    stop = {"type": "stop", "matched": TOOLS_CLOSE}
    _, options = chat_request(with_tools, settings, 512)
    (choice,) = chat_response([_native(text, stop)], options)["choices"]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "Let me look.")
    assert [(c["id"], c["function"]["name"]) for c in message["tool_calls"]] == [
        ("get_weather:1", "get_weather"), ('gh"ost&:2', 'gh"ost&')]  # fmt: skip
    assert choice["finish_reason"] == "tool_calls"

    _, options = chat_request({**with_tools, "stream": True}, settings, 512)

    async def run() -> list[dict]:
        async def batches():
            for n in range(5, len(text), 5):
                yield [_native(text[:n], None)]
            yield [_native(text, stop)]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    chunks = [c for c in asyncio.run(run()) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "plan"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("get_weather:1", "get_weather", WEATHER_ARGS),
                                ('gh"ost&:2', 'gh"ost&', {"a": 1})]  # fmt: skip
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- through the engine ------------------------------------------------------------------------


def _pattern(text: str) -> str:
    """A regex that holds the answer to ``text`` exactly."""
    return "".join("[ ]" if c == " " else re.escape(c) if c in r"\.^$*+?{}[]|()" else c
                   for c in text)  # fmt: skip


@pytest.fixture(scope="module")
def k3_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("kimi-k3")
    # (the markers spelled a character at a time: a regex holds the answer to them)
    model = make_byte_model(root / "model", seed=4, chars=CHARS)
    (root / "template.jinja").write_text(TEMPLATE)
    with serving(
        model, root / "engine.log", "--chat-template", str(root / "template.jinja"),
        "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3",
    ) as eng:  # fmt: skip
        yield eng


@pytest.mark.timeout(180)
def test_a_kimi_k3_answer_through_the_engine(k3_engine: Engine) -> None:
    """A tiny model held by a regex to a K3 answer, served with both parsers: through the
    ``openai`` client its reasoning, reply and calls, the answer stopped at the tools channel's
    close, whole and streamed alike; the parse routes read K3's text; the start said the
    answers are not constrained."""
    client = openai.OpenAI(base_url=k3_engine.url + "/v1", api_key="unused", max_retries=0)
    call = _call("add", _arg("a", "1", "integer"), _arg("b", "x y"))
    answer = f"{THINK_OPEN}plan{THINK_CLOSE}{REPLY}{TOOLS_OPEN}{call}{TOOLS_CLOSE}"
    # (not thinking: a thinking request's grammar would wait for the end of its reasoning)
    extra = {"regex": _pattern(answer), "chat_template_kwargs": {"thinking": False}}
    ask = {**ASK, "tools": TOOLS, "max_tokens": 400, "temperature": 0, "extra_body": extra}
    out = client.chat.completions.create(**ask)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice
    message = choice.message
    assert (message.reasoning_content, message.content) == ("plan", "Let me look.")  # type: ignore[attr-defined]
    (read,) = message.tool_calls or []
    assert (read.id, read.function.name, json.loads(read.function.arguments)) == (
        "add:0", "add", {"a": 1, "b": "x y"})  # fmt: skip

    reasoning = content = ""
    pieces: list[Any] = []
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            pieces += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == ("plan", "Let me look.", "tool_calls")
    assert [(p.id, p.function.name, p.function.arguments) for p in pieces] == [
        (read.id, read.function.name, read.function.arguments)]  # fmt: skip

    reply = answer.split(THINK_CLOSE)[1]
    status, parsed = k3_engine.request("POST", "/parse_function_call", {
        "text": reply, "tools": TOOLS, "tool_call_parser": "kimi_k3"})  # fmt: skip
    assert status == 200 and parsed["normal_text"] == "Let me look."
    assert [(c["tool_index"], c["name"]) for c in parsed["calls"]] == [(0, "add")]
    status, split = k3_engine.request("POST", "/separate_reasoning", {
        "text": answer, "reasoning_parser": "kimi_k3"})  # fmt: skip
    assert status == 200 and split["reasoning_text"] == "plan"
    assert split["text"].startswith("Let me look." + TOOLS_OPEN)
    assert "native_tool_tag_not_served" in k3_engine.log_file.read_text()
