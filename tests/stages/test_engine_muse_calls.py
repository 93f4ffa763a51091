"""Muse Glimmer's tool calls and reasoning (``stages.engine.muse_calls``,
``stages.engine.muse_reasoning``; ``--tool-call-parser muse``, ``--reasoning-parser muse``) read
whole and streamed, as SGLang 0.5.23's ``MuseGlimmerDetector``s read them (held to them on random
answers in ``test_engine_sglang_muse.py``); these cases need no SGLang."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from stages.engine.muse_reasoning import MuseReasoning
from stages.engine.parse_routes import _read_calls, _separated
from stages.engine.reasoning import PARSERS
from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
)
from tests.stages.test_engine_tool_formats import STEPS, _feed


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [_tool("get_weather"), _tool("search"), _tool("fs.read"), _tool("web.search")]


def _invoke(name: str, **values: str) -> str:
    params = ""
    for key, value in values.items():
        params += f'<atem:parameter name="{key}">{value}</atem:parameter>\n'
    return f'<atem:invoke name="{name}">\n{params}</atem:invoke>\n'


def _tool_channel(recipient: str, *invokes: str, end: str = "<|eom|>") -> str:
    body = "<atem:function_calls>\n" + "".join(invokes) + "</atem:function_calls>"
    return f"<|start|>assistant to={recipient}<|message|>{body}{end}"


THINK = " to=self<|message|>Check the weather.<|eom|>"
ANSWER = "<|start|>assistant to=user<|message|>Looking it up.<|eom|>"
CALLS = _tool_channel(
    "functions.get_weather",
    _invoke("get_weather", city='"Zürich"', days="3", raw="not json"),
    _invoke("ghost", a="1"),
    _invoke("web.search", q='"x"', q2='[1, {"k": null}]'),
)
WEATHER = {"city": "Zürich", "days": 3, "raw": "not json"}


def _calls_of(pieces: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each streamed call comes whole in one piece, named (SGLang's ToolCallItem)."""
    assert [p["index"] for p in pieces] == list(range(len(pieces)))
    assert all(p["name"] for p in pieces)
    return [{"name": p["name"], "arguments": p["arguments"]} for p in pieces]


@pytest.mark.parametrize("step", STEPS)
def test_muse_reads_the_invokes_of_tool_channels(step: int) -> None:
    """muse_glimmer_detector.py:213 (``_consume_body``): a tool channel's invokes are calls, each
    parameter JSON or else text, the rest of its body dropped; prose channels are content, their
    framing gone (without the reasoning parser, ``to=self`` is content too); a call to a tool
    not offered dropped; streamed, each call whole in one piece at its ``</atem:invoke>``."""
    text = THINK + ANSWER + CALLS
    reader = ToolCallParser(TOOLS, "muse")
    assert reader.has_tool_call(text)
    content, calls = reader.parse(text)
    assert content == "Check the weather.Looking it up."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", WEATHER),
        ("web.search", {"q": "x", "q2": [1, {"k": None}]}),
    ]
    assert '"Zürich"' in calls[0]["arguments"]  # not ASCII-escaped
    assert [i for i, _ in reader.indexed(text, {})[1]] == [0, 1]  # numbered in order
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "muse"))
    streamed, pieces = _feed(stream, text, step)
    assert (streamed, _calls_of(pieces), stream.calls) == (content, calls, 2)


def test_muse_names_a_call_by_the_tool_it_means() -> None:
    """muse_glimmer_detector.py:56 (``_normalize_name``): ``NAME.NAME`` is ``NAME``, a dotted
    name whose last part is one tool's last part is that tool; a last part two tools share, or
    none, names no tool offered: dropped; without tools nothing is read (``/parse_function_call``
    answers the text as it is)."""
    text = _tool_channel(
        "functions.x",
        _invoke("get_weather.get_weather"),
        _invoke("ns.read", path='"/a"'),
        _invoke("a.search"),
        _invoke("functions.get_weather"),
        _invoke("fs.read.read"),
    )
    content, calls = ToolCallParser(TOOLS, "muse").parse(text)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", "{}"), ("fs.read", '{"path": "/a"}'), ("get_weather", "{}"),
        ("fs.read", "{}"),
    ]  # fmt: skip
    names = [t["function"]["name"] for t in TOOLS]
    assert _read_calls(text, names, "muse", TOOLS)[1][2] == {
        "tool_index": 2, "name": "get_weather", "parameters": "{}"
    }  # fmt: skip
    assert _read_calls(text, [], "muse", []) == (text, [])


def test_muse_keeps_what_it_cannot_read() -> None:
    """A value nested past the recursion limit: SGLang's reading raises, its chat route answers
    the text without calls (streamed, that call alone is dropped); an invoke never closed is
    dropped, a header never finished is content, a text without an ATEM marker is left as it
    is (its framing too: SGLang's chat route does not read it)."""
    deep = "[" * 20000 + "]" * 20000
    text = ANSWER + _tool_channel("f", _invoke("search", q="1"), _invoke("search", q=deep))
    assert ToolCallParser(TOOLS, "muse").parse(text) == (text, [])
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(TOOLS, "muse")), text, 7)
    want = ("Looking it up.", [{"name": "search", "arguments": '{"q": 1}'}])
    assert (streamed, _calls_of(pieces)) == want
    cut = ANSWER + '<|start|>assistant to=f<|message|><atem:invoke name="search">'
    assert ToolCallParser(TOOLS, "muse").parse(cut) == ("Looking it up.", [])
    header = "<|start|>assistant to=f <atem:invoke"
    assert ToolCallParser(TOOLS, "muse").parse(ANSWER + header) == ("Looking it up." + header, [])
    plain = ANSWER + "<|start|>assistant to=f<|message|>no calls<|eom|>"
    assert ToolCallParser(TOOLS, "muse").has_tool_call(plain) is False
    for step in STEPS:
        stream = StreamingToolCalls(ToolCallParser(TOOLS, "muse"))
        assert _feed(stream, ANSWER + header, step) == ("Looking it up." + header, [])


def test_muse_calls_are_not_constrained_and_named_by_its_template() -> None:
    """Its detector ``parses_required_natively`` and has no structural tag
    (muse_glimmer_detector.py:251): a forced choice constrains nothing and the answer is read in
    this format; a strict tool constrains nothing either; a template that writes its invokes
    does not name it."""
    assert forced_calls(TOOLS, "muse", named=False, parallel=True) == {}
    assert answer_format("muse", {}) == "muse"
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    assert strict_calls(strict, "muse") is None
    # SGLang names it by the model's architecture (_architecture_parser_defaults), not its template
    found = template_parsers("{{ '<atem:invoke name=\"' + name + '\">' }}")
    assert found["tool_call_parser"] is None


def _streamed(reader: MuseReasoning, text: str, step: int) -> tuple[str, str]:
    thought = content = ""
    for i in range(0, len(text), step):
        more, said = reader.feed(text[i : i + step])
        thought, content = thought + more, content + said
    more, said = reader.finish()
    return thought + more, content + said


@pytest.mark.parametrize("step", STEPS)
def test_muse_reasoning_is_its_self_channels(step: int) -> None:
    """reasoning_parser.py:2047 (``MuseGlimmerDetector``): ``to=self`` channels are the
    reasoning, joined by a newline; ``to=user`` and ``to=commentary`` content, unwrapped; a tool
    channel content whole, framed; with a tool-call parser reading the content (``tools``) and an
    ATEM marker in it, every content channel framed, which the tool-call reader unwraps (whole;
    streamed, always framed); the same streamed."""
    more = "<|start|>assistant to=self<|message|>And more.<|eom|>"
    text = THINK + ANSWER + more + CALLS
    reasoning = "Check the weather.\nAnd more."
    assert MuseReasoning().parse(text) == (reasoning, "Looking it up." + CALLS)
    framed = ANSWER + CALLS
    assert MuseReasoning(tools=True).parse(text) == (reasoning, framed)
    assert ToolCallParser(TOOLS, "muse").parse(framed)[0] == "Looking it up."
    plain = THINK + ANSWER
    assert MuseReasoning(tools=True).parse(plain) == ("Check the weather.", "Looking it up.")
    assert _streamed(MuseReasoning(), text, step) == (reasoning, "Looking it up." + CALLS)
    assert _streamed(MuseReasoning(tools=True), text, step) == (reasoning, framed)
    assert _streamed(MuseReasoning(tools=True), plain, step) == ("Check the weather.", ANSWER)
    held = MuseReasoning(stream_reasoning=False)
    assert held.feed(" to=self<|message|>a") == ("", "")
    assert held.feed("b<|eom|>") == ("ab", "")
    # force_nonempty_content: an answer without content has its reasoning as content
    assert MuseReasoning(nonempty=True).parse(THINK) == ("", "Check the weather.")
    assert _streamed(MuseReasoning(nonempty=True), THINK, step)[1] == "Check the weather."


def test_muse_separate_reasoning_reads_without_a_tool_call_parser() -> None:
    """``/separate_reasoning``: no chat request, no tool-call parser: content channels
    unwrapped."""
    assert PARSERS["muse"].muse and PARSERS["muse"].end == "<|eom|>"
    assert _separated(THINK + ANSWER, PARSERS["muse"], False) == {
        "reasoning_text": "Check the weather.",
        "text": "Looking it up.",
    }


def test_a_muse_chat_answer_has_its_reasoning_and_calls(tmp_path: Path) -> None:
    """serving_chat: ``muse`` keeps the special tokens of every answer
    (``_patch_reasoning_skip_special_tokens``) and always reasons (its ``reasoning_default``);
    the reasoning parser keeps the channels' framing for the tool-call parser exactly where that
    reads the answer (``_tool_call_parsing_active``: tools, a ``tool_choice`` other than
    ``none``, no JSON ``response_format``); a forced ``tool_choice`` constrains nothing. Whole
    and streamed, the reasoning, the content unwrapped and the calls (each in one delta)."""
    from transformers import AutoTokenizer

    from stages.engine.openai_chat import ChatSettings, chat_request, chat_response, chat_stream
    from tests.stages.test_engine_chat import _native
    from tests.stages.tiny_model import make_tagged_byte_model

    tags = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")
    model = make_tagged_byte_model(tmp_path / "model", tags)
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = "{%- for m in messages %}{{ m.content }}.{% endfor %}{{ '<|start|>assistant' }}"
    settings = ChatSettings.of(
        tokenizer, model, chat_template=template, tool_call_parser="muse", reasoning_parser="muse"
    )
    assert settings is not None
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    with_tools = {**ask, "tools": TOOLS}
    text = THINK + ANSWER + CALLS
    stop = {"type": "stop", "matched": 1}

    for body, reads in ((ask, False), (with_tools, True),
                        ({**with_tools, "tool_choice": "none"}, False),
                        ({**with_tools, "response_format": {"type": "json_object"}}, False),
                        ({**with_tools, "tool_choice": "required"}, True)):  # fmt: skip
        native, options = chat_request(body, settings, context_length=512)
        assert native["sampling_params"]["skip_special_tokens"] is False, body
        assert native["require_reasoning"] is True
        assert options["reasoning"].tools is reads, body
        assert "structural_tag" not in native["sampling_params"]
        message = chat_response([_native(text, stop)], options)["choices"][0]["message"]
        assert message["reasoning_content"] == "Check the weather."
        if reads:
            assert message["content"] == "Looking it up."
            assert [c["function"]["name"] for c in message["tool_calls"]] == [
                "get_weather", "web.search"
            ]  # fmt: skip
        else:
            assert message["content"] == "Looking it up." + CALLS and "tool_calls" not in message

    _, options = chat_request({**with_tools, "stream": True}, settings, context_length=512)

    async def run() -> list[dict]:
        async def batches():
            for n in range(7, len(text), 7):
                yield [_native(text[:n], None)]
            yield [_native(text, stop)]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(run()) if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Check the weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Looking it up."
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", WEATHER),
                                (1, "web.search", {"q": "x", "q2": [1, {"k": None}]})]  # fmt: skip
    finish = [c for c in asyncio.run(run()) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish[-1]["choices"][0]["finish_reason"] == "tool_calls"
