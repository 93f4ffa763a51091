"""Hunyuan's tool calls and reasoning (``stages.engine.hunyuan_calls``,
``stages.engine.hunyuan_reasoning``; ``--tool-call-parser`` / ``--reasoning-parser hunyuan``)
read whole and streamed, as SGLang 0.5.23's ``function_call/hunyuan_detector.py`` and
``parser/hunyuan_reasoning.py`` read them (held to them on random answers in
``test_engine_sglang_hunyuan.py``); these cases need no SGLang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stages.engine.hunyuan_calls import tokens
from stages.engine.hunyuan_reasoning import EFFORT_ERROR, normalized_effort, thinks
from stages.engine.openai_api import OpenAIError
from stages.engine.reasoning import (
    PARSERS,
    ReasoningSettings,
    ThinkParser,
    Toggle,
    served_format,
    template_toggle,
    thinking_on,
)
from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    NATIVE_FORCED,
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
)
from tests.stages.test_engine_chat import _calls_of
from tests.stages.test_engine_tool_formats import STEPS, _feed

PROPERTIES = {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "fresh": {"type": "boolean"}, "tags": {"type": "array"}, "opts": {"type": "object"},
    "n": {"type": "int"}, "size": {"type": "uint32"}, "ratio": {"type": "double"},
    "either": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "any": {},
    "nothing": {"type": "null"},
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
     "parameters": {"type": "object", "properties": PROPERTIES}}},
    {"type": "function", "function": {"name": "note"}},
]  # fmt: skip


def _call(name: str, *pairs: tuple[str, str], sep: str = "<tool_sep>") -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}{sep}\n{body}</tool_call>\n"


WEATHER = _call("get_weather", ("city", "Zürich"), ("days", " 3 "), ("temp", "2"),
                ("fresh", "TRUE"), ("tags", '["a", 1]'), ("opts", "{bad"), ("n", "7"),
                ("size", "1_000"), ("ratio", "1e2"), ("either", "5"), ("any", "[1]"),
                ("nothing", "[2]"), ("undeclared", "3"), (" city ", "Bern"))  # fmt: skip
WEATHER_ARGS = {"city": "Bern", "days": 3, "temp": 2, "fresh": True, "tags": ["a", 1],
                "opts": "{bad", "n": 7, "size": 1000, "ratio": 100.0, "either": 5,
                "any": "[1]", "nothing": [2], "undeclared": "3"}  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_hunyuan_reads_typed_values_and_drops_unknown_tools(step: int) -> None:
    """hunyuan_detector.py ``detect_and_parse``: the content before ``<tool_calls>``, stripped;
    each value by its parameter's types (``_parse_value``: aliases and ``uint``/``double``
    names, an integer's spaces and underscores as Python reads them, a number without ``.``
    or ``e`` an integer, JSON for other types, a string as written, a schema without a type (or
    a parameter not declared) a string's, one that allows null alone JSON, else text; a key met
    again keeps its place and takes the last value); a call to a tool not
    offered dropped; a name without ``<tool_sep>`` ends at its first ``<arg_key>``; streamed,
    the same."""
    text = (
        "Let me check.\n <tool_calls>\n" + WEATHER + _call("ghost", ("a", "1"))
        + _call("note", ("x", "null"), ("y", "text"), sep="\n") + "</tool_calls>"
    )  # fmt: skip
    reader = ToolCallParser(TOOLS, "hunyuan")
    assert reader.has_tool_call(text) and not reader.has_tool_call(WEATHER)
    content, calls = reader.parse(text)
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", WEATHER_ARGS),
        ("note", {"x": "null", "y": "text"}),
    ]
    assert '"city": "Bern"' in calls[0]["arguments"]  # its first place, its last value
    assert reader.indexed(text, {"note": 4, "get_weather": 2})[1][1][0] == 4  # the tool's place
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "hunyuan"))
    streamed, pieces = _feed(stream, text, step)
    assert (streamed, _calls_of(pieces)) == (content, calls)


def test_hunyuan_calls_need_their_block_and_an_end_tag() -> None:
    """Without ``<tool_calls>`` the answer is content as it came (calls in it too); with it,
    every ``<tool_call>`` ... ``</tool_call>`` of the answer is a call, one before the block
    too; a call never ended is dropped, streamed as whole."""
    reader = ToolCallParser(TOOLS, "hunyuan")
    bare = "  " + _call("note", ("a", "1"))
    assert reader.parse(bare) == (bare, [])
    early = _call("note", ("a", "1")) + " mid <tool_calls>" + _call("note") + "<tool_call>note"
    content, calls = reader.parse(early)
    assert content == _call("note", ("a", "1")) + " mid"
    assert calls == [
        {"name": "note", "arguments": '{"a": "1"}'},
        {"name": "note", "arguments": "{}"},
    ]
    for step in STEPS:
        streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(TOOLS, "hunyuan")), early, step)
        assert (streamed, _calls_of(pieces)) == (content, calls)
        assert _feed(StreamingToolCalls(ToolCallParser(TOOLS, "hunyuan")), bare, step) == (bare, [])


def test_hunyuan_answer_whose_value_cannot_be_read_is_content() -> None:
    """``detect_and_parse``'s ``except Exception``: a parameter whose schema's ``type`` is a list
    (``_normalize_type`` hashes it) or whose schema is not an object leaves the whole answer as
    it came, without calls; the stream sends the rest of the answer as content from there."""
    listed = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "a": {"type": ["string", "null"]}, "b": True, "c": {"type": "string"}}}}}]  # fmt: skip
    for key in ("a", "b"):
        text = "ok <tool_calls>" + _call("f", ("c", "x")) + _call("f", (key, "1")) + "</tool_calls>"
        assert ToolCallParser(listed, "hunyuan").parse(text) == (text, [])
        stream = StreamingToolCalls(ToolCallParser(listed, "hunyuan"))
        streamed, pieces = _feed(stream, text, 3)
        assert streamed == text and _calls_of(pieces) == [{"name": "f", "arguments": '{"c": "x"}'}]
    # a call that sets no such parameter reads as ever
    fine = "<tool_calls>" + _call("f", ("c", "1"))
    assert ToolCallParser(listed, "hunyuan").parse(fine)[1] == [
        {"name": "f", "arguments": '{"c": "1"}'}
    ]


def test_hunyuan_tokens_are_the_served_tokenizers() -> None:
    """``resolve_hunyuan_tokens``: Hy3's shipping tokenizer spells each token with a suffix;
    the reader and the reasoning parser take them from its vocabulary (bare tags where it has
    none)."""

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            names = ("tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value", "think")
            return {**{f"<{n}:os>": i for i, n in enumerate(names)}, "<tool_call>": 9}

    vocab = Vocab()
    spelled = tokens(vocab)
    assert spelled["tool_calls"] == "<tool_calls:os>" and spelled["think"] == "<think:os>"
    assert spelled["tool_call"] == "<tool_call>"  # the last of a name in the vocabulary
    assert tokens()["tool_sep"] == "<tool_sep>"
    text = (
        "hi<tool_calls:os><tool_call>note<tool_sep:os><arg_key:os>a</arg_key:os>"
        "<arg_value:os>2</arg_value:os></tool_call></tool_calls:os>"
    )
    assert ToolCallParser(TOOLS, "hunyuan", vocab).parse(text) == (
        "hi",
        [{"name": "note", "arguments": '{"a": "2"}'}],
    )
    assert ToolCallParser(TOOLS, "hunyuan").parse(text) == (text, [])
    fmt = served_format(PARSERS["hunyuan"], vocab)
    assert (fmt.start, fmt.end, fmt.tool_start) == ("<think:os>", "</think:os>", "<tool_calls:os>")
    assert ThinkParser(fmt, force=False).parse("<think:os>plan</think:os>ok") == ("plan", "ok")
    assert served_format(PARSERS["qwen3"], vocab) is PARSERS["qwen3"]


def test_hunyuan_is_not_constrained_when_forced_and_is_named_by_its_template() -> None:
    """``parses_required_natively`` and no structural tag (``supports_structural_tag``
    false): a forced choice constrains nothing and is read in this format, a strict tool under
    ``auto`` neither; a template with ``<tool_calls>`` and ``<tool_sep>`` (bare or suffixed)
    names it, GLM's ``<arg_key>`` alone not."""
    assert "hunyuan" in NATIVE_FORCED
    forced = forced_calls(TOOLS, "hunyuan", named=False, parallel=True)
    assert forced == {} and answer_format("hunyuan", forced) == "hunyuan"
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    assert strict_calls(strict, "hunyuan") is None
    hy3 = "{{ '<tool_calls>\\n<tool_call>' + name + '<tool_sep>\\n<arg_key>' }}"
    assert template_parsers(hy3)["tool_call_parser"] == "hunyuan"  # SGLang's _is_hunyuan
    glm = "{{ '<tool_call>' + name }}\n<arg_key>x</arg_key><arg_value>"
    assert template_parsers(glm)["tool_call_parser"] != "hunyuan"


# -- reasoning ------------------------------------------------------------------------------------

# a chat template whose reasoning is set by effort (SGLang's hunyuan_reasoning_effort rule)
EFFORT_TEMPLATE = (
    "{%- set reasoning_mode_token = 'no_think' if reasoning_effort == 'no_think' else "
    "reasoning_effort -%}{%- for m in messages %}{{ m.content }}{% endfor %}"
    "[{{ reasoning_mode_token }},{{ other | default('') }}]"
)
PLAIN_TEMPLATE = "{%- for m in messages %}{{ m.content }}{% endfor %}[{{ reasoning_effort }}]"


def test_hunyuan_effort_is_normalized_and_decides_its_reasoning() -> None:
    """hunyuan_reasoning.py ``normalize_hunyuan_reasoning_effort``: the request's effort, else
    the kwarg's; none: high; none/no_think: no_think; minimal/low: low; medium to max: high;
    else SGLang's ValueError; the kwarg taken out. serving_chat.py:3538-3545: an effort
    template reasons unless no_think; another reasons only with an effort other than
    none/no_think, the kwarg's first (moved into the request's field for every template but
    Hunyuan's effort ones, serving_chat.py:1291-1307)."""
    assert template_toggle(EFFORT_TEMPLATE) == (False, Toggle(special="hunyuan_effort"))
    assert normalized_effort(None, None) == ("high", None)
    assert normalized_effort(None, {"reasoning_effort": "none", "x": 1}) == ("no_think", {"x": 1})
    assert normalized_effort("low", {"reasoning_effort": "none"}) == ("low", {})
    for given, want in (("minimal", "low"), ("medium", "high"), ("xhigh", "high"), ("max", "high"),
                        ("no_think", "no_think"), ("high", "high")):  # fmt: skip
        assert normalized_effort(given, None)[0] == want
    for bad in ("ultra", 0.5, "HIGH", ""):
        with pytest.raises(ValueError, match=EFFORT_ERROR):
            normalized_effort(bad, None)
    fmt = PARSERS["hunyuan"]
    effort = Toggle(special="hunyuan_effort")
    assert thinking_on(fmt, effort, None, "high") and thinking_on(fmt, effort, {}, "low")
    assert not thinking_on(fmt, effort, None, "no_think")
    # any other template: off unless an effort other than none / no_think is set
    assert not thinking_on(fmt, None, None, None)
    assert not thinking_on(fmt, Toggle("enable_thinking", True), {"enable_thinking": True}, None)
    assert thinking_on(fmt, None, None, "low") and thinking_on(fmt, None, None, 0.5)
    assert thinking_on(fmt, None, {"reasoning_effort": "medium"}, "none")  # the kwarg's first
    assert not thinking_on(fmt, None, {"reasoning_effort": "no_think"}, "high")
    assert thinks(False, {"reasoning_effort": False}, None)  # set, and not none: on
    # its tags, <tool_calls> ending the reasoning too (HunyuanDetector's tool_start_token)
    assert ThinkParser(fmt, force=True).parse("plan<tool_calls>x") == ("plan", "<tool_calls>x")
    assert ThinkParser(fmt, force=False).parse("plan<tool_calls>x") == ("", "plan<tool_calls>x")


def _settings(tmp_path: Path, template: str, reasoning: str = "hunyuan") -> Any:
    from transformers import AutoTokenizer

    from stages.engine.openai_chat import ChatSettings
    from tests.stages.tiny_model import BYTE_CHARS, make_tagged_byte_model

    tags = ("<think>", "</think>", "<tool_calls>", "</tool_calls>", "<tool_call>",
            "</tool_call>", "<tool_sep>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>")  # fmt: skip
    model = make_tagged_byte_model(tmp_path / "model", tags, chars=BYTE_CHARS + "\n_")
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = ChatSettings.of(
        tokenizer, model, chat_template=template, tool_call_parser="hunyuan",
        reasoning_parser=reasoning,
    )  # fmt: skip
    assert settings is not None
    return settings


def test_a_hunyuan_chat_request_gives_its_template_the_effort_and_reads_its_answer(
    tmp_path: Path,
) -> None:
    """serving_chat._process_messages with an effort template: the template gets the
    normalized effort and not the kwarg, the request reasons by it (``require_reasoning``), an
    effort it does not take is SGLang's 400; the answer's reasoning, then its calls."""
    from stages.engine.openai_chat import chat_request, chat_response

    settings = _settings(tmp_path, EFFORT_TEMPLATE)
    assert settings.reasoning.effort_levels
    decode = settings.tokenizer.decode

    def ask(**body: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
        native, options = chat_request(body, settings, context_length=512)
        return decode(native["input_ids"]), native, options

    prompt, native, options = ask()
    assert prompt == "hi[high,]" and native.get("require_reasoning") is True
    prompt, native, _ = ask(chat_template_kwargs={"reasoning_effort": "none", "other": "o"})
    assert prompt == "hi[no_think,o]" and "require_reasoning" not in native
    prompt, native, _ = ask(
        reasoning_effort="minimal", chat_template_kwargs={"reasoning_effort": "none"}
    )
    assert prompt == "hi[low,]" and native["require_reasoning"] is True
    for bad in ({"reasoning_effort": "ultra"}, {"chat_template_kwargs": {"reasoning_effort": 1}}):
        with pytest.raises(OpenAIError, match=EFFORT_ERROR) as info:
            ask(**bad)
        assert info.value.kind == "BadRequest"  # serving_base.handle_request's ValueError
    tools = [{"type": "function", "function": {"name": "note"}}]
    _, _, options = ask(tools=tools)
    text = "plan</think>ok\n<tool_calls><tool_call>note<tool_sep><arg_key>a</arg_key>"
    text += "<arg_value>1</arg_value></tool_call></tool_calls>"
    result = {"text": text, "output_ids": [3], "meta_info": {
        "id": "r", "finish_reason": {"type": "stop", "matched": 1}, "prompt_tokens": 2,
        "completion_tokens": 1, "weight_version": "0"}}  # fmt: skip
    choice = chat_response([result], options)["choices"][0]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "ok")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("note", '{"a": "1"}')
    ]
    assert choice["finish_reason"] == "tool_calls"


def test_other_templates_and_parsers_keep_their_effort(tmp_path: Path) -> None:
    """Only ``hunyuan`` with an effort template normalizes (``uses_hunyuan_reasoning_effort``):
    with another template its effort reaches the template as given and it does not reason by
    default; another parser on an effort template leaves the effort as it is."""
    from stages.engine.openai_chat import chat_request

    settings = _settings(tmp_path, PLAIN_TEMPLATE)
    assert not settings.reasoning.effort_levels
    body = {"messages": [{"role": "user", "content": "hi"}]}
    native, _ = chat_request(body, settings, context_length=512)
    assert settings.tokenizer.decode(native["input_ids"]) == "hi[]"
    assert "require_reasoning" not in native
    native, _ = chat_request(
        {**body, "chat_template_kwargs": {"reasoning_effort": "ultra"}},
        settings,
        context_length=512,
    )
    assert settings.tokenizer.decode(native["input_ids"]) == "hi[ultra]"
    assert native["require_reasoning"] is True
    qwen = ReasoningSettings("qwen3", PARSERS["qwen3"], False, Toggle(special="hunyuan_effort"), ())
    assert not qwen.effort_levels
