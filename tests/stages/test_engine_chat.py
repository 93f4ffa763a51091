"""``/v1/chat/completions`` on the built-in engine, through the ``openai`` client, checked against
the native ``/generate`` of the same engine and SGLang 0.5's ``serving_chat.py`` /
``protocol.py`` / ``sse_utils.py`` (the shapes each test names); tool-call reading against
``function_call/qwen25_detector.py``."""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from openai.types.chat import ChatCompletionChunk
from transformers import PreTrainedTokenizerFast

from stages.engine.dsv32_encoding import ASSISTANT, BOS, EOS, USER
from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings, chat_request, chat_response, chat_stream
from stages.engine.openai_decisions import template_kwargs
from stages.engine.template_dump import DumpError, content_format, template_message
from stages.engine.tool_calls import StreamingToolCalls, ToolCallParser
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.tiny_model import make_tiny_model
from tests.stages.tool_tokenizers import QWEN_LIKE, char_tokenizer

# Word-level, as the tiny tokenizer is (w<N> words); the comment names the tool-call format, so
# the engine reads <tool_call> blocks in answers to requests with tools.
TEMPLATE = (
    "{# tool calls: <tool_call> {json} </tool_call> #}"
    "{%- if tools %}w5 {% for t in tools %}w{{ 20 + loop.index }} {% endfor %}w6 {% endif %}"
    "{%- for m in messages %}"
    "{% if m.role == 'user' %}w7 {% elif m.role == 'assistant' %}w8 {% else %}w9 {% endif %}"
    "{{ m.content }} w10 {% endfor %}"
    "{%- if add_generation_prompt %}w8 {% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]
HELLO = [{"role": "user", "content": "w11 w12 w13"}]


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("chat-engine")
    model_dir = make_tiny_model(root / "model", vocab=128, seed=2)
    (root / "template.jinja").write_text(TEMPLATE)
    template = ("--chat-template", str(root / "template.jinja"))
    with serving(model_dir, root / "engine.log", *template, "--tool-call-parser", "qwen25") as eng:
        yield eng


@pytest.fixture(scope="module")
def client(chat_engine: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_engine.url + "/v1", api_key="unused", max_retries=0)


def _ids(engine: Engine, messages: list[dict], tools: list | None = None) -> list[int]:
    ids = _tokenizer(engine).apply_chat_template(
        messages, tools=tools, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.timeout(60)
def test_greedy_chat_equals_generate_on_the_templated_prompt(chat_engine: Engine, client) -> None:
    ids = _ids(chat_engine, HELLO)
    native = chat_engine.generate(
        {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
         "return_text_in_logprobs": True,
         "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    )  # fmt: skip
    out = client.chat.completions.create(
        model="anything", messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.object == "chat.completion" and out.model == "anything"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == native["text"]
    assert choice.message.model_extra["reasoning_content"] is None
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 6)
    assert out.metadata["weight_version"] == native["meta_info"]["weight_version"]
    entries = native["meta_info"]["output_token_logprobs"]
    tops = native["meta_info"]["output_top_logprobs"]
    for got, entry, top in zip(choice.logprobs.content, entries, tops, strict=True):
        assert got.token == entry[2] and got.bytes == list(entry[2].encode())
        assert abs(got.logprob - entry[0]) < 1e-5
        assert [t.token for t in got.top_logprobs] == [t[2] for t in top]
    # SGLang 0.5.23 bounds top_logprobs by nothing but the vocabulary (not OpenAI's 20), and
    # without logprobs: true it answers none
    many = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=25
    )
    assert all(len(e.top_logprobs) == 25 for e in many.choices[0].logprobs.content)
    unasked = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2,
                                             top_logprobs=3)  # fmt: skip
    assert unasked.choices[0].logprobs is None


@pytest.mark.timeout(60)
def test_chat_stream_sends_role_then_deltas_then_the_finish(chat_engine: Engine, client) -> None:
    options = {"model": "m", "messages": HELLO, "max_tokens": 7, "temperature": 0, "n": 2,
               "logprobs": True, "top_logprobs": 2,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.chat.completions.create(**options)
    chunks = list(
        client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 14
    texts: dict[int, str] = {}
    first: dict[int, Any] = {}
    finish: dict[int, str] = {}
    entries: dict[int, list[Any]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        first.setdefault(choice.index, choice.delta)
        assert choice.index not in finish, "a chunk after the choice's finish"
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        entries[choice.index] += choice.logprobs.content if choice.logprobs else []
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert all(d.role == "assistant" and d.content == "" for d in first.values())
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    for c in whole.choices:  # each token's log-prob entry once, as in the whole answer
        streamed, expected = entries[c.index], c.logprobs.content
        assert [e.token for e in streamed] == [e.token for e in expected] and len(expected) == 7
        pairs = zip(streamed, expected, strict=True)
        assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in pairs)
        assert [[t.token for t in e.top_logprobs] for e in streamed] == [
            [t.token for t in e.top_logprobs] for e in expected
        ]


@pytest.mark.timeout(60)
def test_chat_stream_sends_the_finishes_after_all_content(chat_engine: Engine) -> None:
    """serving_chat._generate_chat_stream (SGLang 0.5.23): the choices' finish chunks go out
    after the generation loop, before the usage chunk; with
    ``continuous_usage_stats`` every chunk but the role's and the finish's (``build_sse_content``
    without usage) has the choice's usage, ``prompt_tokens_details`` null without the cache
    report, and the last usage chunk keeps its null fields (``model_dump_json``)."""
    body = {"model": "m", "messages": HELLO, "n": 3, "max_tokens": 6, "stream": True,
            "stop_token_ids": [20, 21, 22, 23, 24, 25], "temperature": 1.0, "seed": 5,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    answer = requests.post(chat_engine.url + "/v1/chat/completions", json=body, timeout=30)
    events = answer.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    *choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens_details"] is None
    finishes = [c for c in choices if c["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 3 and choices[-3:] == finishes  # nothing after the first finish
    assert sorted(c["choices"][0]["index"] for c in finishes) == [0, 1, 2]
    roles = [c for c in choices if c["choices"][0]["delta"].get("role") == "assistant"]
    assert len(roles) == 3 and all("usage" not in c for c in roles + finishes)
    deltas = [c for c in choices if c not in roles and c not in finishes]
    assert deltas and all(c["usage"]["prompt_tokens_details"] is None for c in deltas)


@pytest.mark.timeout(60)
def test_a_stream_read_for_tool_calls_sends_its_log_probs_apart(chat_engine: Engine) -> None:
    """serving_chat._process_tool_call_stream (SGLang 0.5.23): with tools, the text read out of
    the calls goes in pydantic's chunks (the delta's nulls and a null ``usage`` written out, no
    log-probs), and each step's log-probs follow alone (``build_sse_content``, the delta
    ``{reasoning_content: null}``); every token's entry once, as the whole answer's."""
    body = {"model": "m", "messages": HELLO, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "tools": TOOLS, "logprobs": True}  # fmt: skip
    whole = requests.post(chat_engine.url + "/v1/chat/completions", json=body, timeout=30)
    expected = [e["token"] for e in whole.json()["choices"][0]["logprobs"]["content"]]
    answer = requests.post(
        chat_engine.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
    )
    chunks = [json.loads(e[len("data: ") :]) for e in answer.text.split("\n\n")[:-2]]
    role, *steps, finish = chunks
    texts = [c for c in steps if c["choices"][0]["delta"].get("content")]
    assert texts and all(
        c["choices"][0]["delta"] == {"role": None, "content": c["choices"][0]["delta"]["content"],
                                     "reasoning_content": None}
        and c["choices"][0]["logprobs"] is None and c["usage"] is None
        for c in texts
    )  # fmt: skip
    alone = [c for c in steps if c["choices"][0]["logprobs"] is not None]
    assert all(c["choices"][0]["delta"] == {"reasoning_content": None} for c in alone)
    assert all("usage" not in c for c in [*alone, role, finish])
    streamed = [e["token"] for c in alone for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == expected and len(expected) == 6


@pytest.mark.timeout(60)
def test_tools_reach_the_template_and_what_cannot_be_honoured_is_a_400(
    chat_engine: Engine, client
) -> None:
    # the template renders the tools (w5 w21 w6): the prompt is longer by 3 tokens
    plain = client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
    tooled = client.chat.completions.create(model="m", messages=HELLO, max_tokens=1, tools=TOOLS)
    assert tooled.usage.prompt_tokens == plain.usage.prompt_tokens + 3
    none = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    cases = [
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools[0].function.parameters"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "schema_ is required"),
        # a word-level tokenizer writes spaces between tokens: no grammar can constrain it
        ({"response_format": {"type": "json_object"}}, "cannot constrain"),
        ({"top_logprobs": "three"}, "top_logprobs"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"tools": TOOLS + TOOLS}, "unique"),
        # routed experts past the prompt, as /generate refuses them (with the server's flag
        # or without); a custom logit processor without the flag: SGLang's refusal
        ({"extra_body": {"return_routed_experts": True, "routed_experts_start_len": 999}},
         "is higher than the number of input tokens"),
        ({"extra_body": {"custom_logit_processor": "x"}}, "--enable-custom-logit-processor"),
    ]  # fmt: skip
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=HELLO, **extra)
        assert words in info.value.body["message"], (extra, info.value.body)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="Messages cannot be empty"):
        client.chat.completions.create(model="m", messages=[])
    assert client.chat.completions.create(model="m", messages=HELLO, max_tokens=1).choices


@pytest.mark.timeout(60)
def test_a_model_without_a_chat_template_is_told_so(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", vocab=64)
    settings = ChatSettings.of(PreTrainedTokenizerFast.from_pretrained(model_dir), model_dir)
    assert settings is not None and settings.tool_parser is None
    with pytest.raises(OpenAIError, match="no chat template"):
        chat_request({"messages": HELLO}, settings, 512)


# ---- reading tool calls (no engine) -----------------------------------------------------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n</tool_call>'


def test_tool_calls_are_read_from_the_text_and_unknown_ones_dropped() -> None:
    parser = ToolCallParser(TOOLS)
    content, calls = parser.parse("Let me add.\n" + CALL + "\n" + CALL.replace("add", "sub"))
    assert content == "Let me add."
    assert calls == [{"name": "add", "arguments": '{"a": 1, "b": "é"}'}]
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("<tool_call>\n{not json}\n</tool_call>") == ("", [])
    assert parser.parse("<tool_call>\n" + '{"name": "add"') == ("", [])  # never closed


def _calls_of(pieces: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The calls streamed pieces add up to, as a client adds them up."""
    calls: list[dict[str, str]] = []
    for piece in pieces:
        if piece["name"] is not None:
            assert piece["index"] == len(calls) and piece["arguments"] == ""
            calls.append({"name": piece["name"], "arguments": ""})
        else:
            calls[piece["index"]]["arguments"] += piece["arguments"]
    return calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_tool_calls_add_up_to_the_whole_ones_whatever_the_pieces(step: int) -> None:
    """SGLang's base_format_detector.parse_streaming_increment: the name first, then the
    arguments' JSON in pieces; the pieces add up to the non-streamed call."""
    nested = (
        '<tool_call>\n{"name": "add", "arguments": {"a": -12.5, "b": "x\\"y\\u00e9\\n", '
        '"c": [1, {"d": null}, true], "e": {}}}\n</tool_call>'
    )
    text = "Sure: " + CALL + "\n" + nested + "\n" + CALL.replace("add", "nope") + "\n" + CALL
    stream = StreamingToolCalls(ToolCallParser(TOOLS))
    content, pieces = "", []
    for i in range(0, len(text), step):
        c, new = stream.feed(text[i : i + step])
        content += c
        pieces += new
    content += stream.flush()
    # whitespace before a call may have gone out before the call began (non-streamed: stripped)
    assert content.rstrip() == "Sure:"
    assert _calls_of(pieces) == ToolCallParser(TOOLS).parse(text)[1]  # the unknown one dropped
    assert len(_calls_of(pieces)) == 3
    if step <= 3:  # generated piece by piece: the arguments went out in several pieces too
        assert sum(p["name"] is None and p["index"] == 1 for p in pieces) > 3
    # text that only looks like the start of a call is passed on at the end
    stream = StreamingToolCalls(ToolCallParser(TOOLS))
    assert stream.feed("a <tool_") == ("a ", [])
    assert stream.flush() == "<tool_"


def _native(text: str, reason: dict, index: int | None = None) -> dict[str, Any]:
    out = {
        "text": text,
        "output_ids": [3] * 4,
        "meta_info": {"id": "r1", "finish_reason": reason, "prompt_tokens": 5,
                      "completion_tokens": 4, "weight_version": "7"},
    }  # fmt: skip
    if index is not None:
        out["index"] = index
    return out


OPTIONS = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True, "tools": TOOLS,
           "stream": True, "include_usage": False, "continuous_usage_stats": False}  # fmt: skip


def test_an_answer_with_a_tool_call_has_tool_calls_and_finish_reason_tool_calls() -> None:
    """serving_chat._process_tool_calls: ``stop`` becomes ``tool_calls``, matched None."""
    out = chat_response([_native("ok " + CALL, {"type": "stop", "matched": 1})], OPTIONS)
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    message = choice["message"]
    assert message["content"] == "ok" and message["reasoning_content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["index"] == 0 and call["id"].startswith("call_")
    assert len(call["id"]) == len("call_") + 24 and json.loads(call["function"]["arguments"])
    assert out["object"] == "chat.completion" and out["metadata"] == {"weight_version": "7"}
    plain = chat_response([_native("", {"type": "length", "length": 4})], OPTIONS)
    assert plain["choices"][0]["message"] == {
        "role": "assistant", "content": "", "reasoning_content": None,
    }  # fmt: skip


def test_an_incomplete_call_is_dropped_and_the_text_around_it_is_the_content() -> None:
    """serving_chat._process_tool_calls: a marker with no complete call ("dropping the
    incomplete call"): no tool_calls, the detector's normal text as content (Qwen25Detector
    .detect_and_parse: the text before <tool_call>, stripped), finish_reason as it was."""
    text = 'I will add. <tool_call>\n{"name": "add", "arguments": {"a"'
    out = chat_response([_native(text, {"type": "length", "length": 4})], OPTIONS)
    (choice,) = out["choices"]
    assert choice["message"] == {
        "role": "assistant", "content": "I will add.", "reasoning_content": None,
    }  # fmt: skip
    assert choice["finish_reason"] == "length"


def test_a_request_with_tools_keeps_special_tokens_in_the_text(chat_engine: Engine) -> None:
    """serving_chat (before applying the template): tools and tool_choice other than none set
    skip_special_tokens false, so that a format's markers that are special tokens
    (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS]) stay in the text to be read."""
    settings = ChatSettings.of(_tokenizer(chat_engine), chat_engine.model_dir)
    assert settings is not None
    settings.template = TEMPLATE
    body = {"messages": HELLO, "max_tokens": 3}
    native, _ = chat_request({**body, "tools": TOOLS}, settings, 64)
    assert native["sampling_params"]["skip_special_tokens"] is False
    for other in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        native, _ = chat_request({**body, **other}, settings, 64)
        assert "skip_special_tokens" not in native["sampling_params"]


def test_the_template_sees_the_tools_as_sglangs_pydantic_dump_of_them() -> None:
    """serving_chat._process_messages passes the template ``[tool.model_dump() ...]``
    (protocol.Tool, Function._serialize): the function's fields in the client's order, a
    missing description or parameters null, strict and defer_loading only where set (read as
    pydantic reads a bool), keys that are no field dropped, and the tool's defer_loading null
    when not given; a named tool_choice shows the template that tool alone. A strict that is no
    bool: 400."""
    tokenizer = char_tokenizer(string.printable, template=QWEN_LIKE)
    settings = ChatSettings(tokenizer, None)
    tools = [
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "add",
                                          "strict": "yes", "examples": [1]}},
        {"function": {"name": "neg", "description": "minus"}, "defer_loading": "off"},
    ]  # fmt: skip
    native, _ = chat_request({"messages": HELLO, "tools": tools}, settings, 4096)
    text = tokenizer.decode(native["input_ids"])
    assert (
        '{"type": "function", "function": {"parameters": {"type": "object"}, "name": "add", '
        '"strict": true, "description": null}, "defer_loading": null}\n'
        '{"type": "function", "function": {"name": "neg", "description": "minus", '
        '"parameters": null, "defer_loading": false}, "defer_loading": false}\n'
    ) in text
    named = {"type": "function", "function": {"name": "neg"}}
    native, _ = chat_request(
        {"messages": HELLO, "tools": tools, "tool_choice": named}, settings, 4096
    )
    assert '"add"' not in tokenizer.decode(native["input_ids"])
    bad = [{"type": "function", "function": {"name": "add", "strict": 2}}]
    with pytest.raises(OpenAIError, match=r"tools\[0\]\.function\.strict: Input should be"):
        chat_request({"messages": HELLO, "tools": bad}, settings, 4096)


def test_tool_parameters_are_rewritten_and_checked_as_sglang_does() -> None:
    """serving_chat._validate_request: each tool's parameters (the request's, then a system
    message's) get JSON Schema's type names for database ones (normalize_json_schema_types:
    what the template shows), then must be a valid JSON Schema, else SGLang's 400 naming the
    tool by its place."""
    tokenizer = char_tokenizer(string.printable, template=QWEN_LIKE)
    settings = ChatSettings(tokenizer, None)
    typed = {
        "type": "object",
        "properties": {"id": {"type": "VARCHAR(36)"}, "n": {"type": ["int32", "integer", "null"]}},
    }
    tools = [{"type": "function", "function": {"name": "get", "parameters": typed}}]
    native, _ = chat_request({"messages": HELLO, "tools": tools}, settings, 4096)
    text = tokenizer.decode(native["input_ids"])
    assert '"id": {"type": "string"}, "n": {"type": ["integer", "null"]}' in text
    bad = {"type": "object", "properties": 5}
    for body in (
        {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f",
                                                                          "parameters": bad}}]},
        {"messages": [{"role": "system", "content": "s", "tools": [
            {"type": "function", "function": {"name": "g", "parameters": bad}}]}, *HELLO],
         "tools": tools},
    ):  # fmt: skip
        index = len(body["tools"]) - 1 if body["messages"][0]["role"] == "user" else 1
        with pytest.raises(OpenAIError, match=f"Tool {index} function has invalid 'parameters'"):
            chat_request(body, settings, 4096)


def test_a_valid_tool_schema_is_checked_once_and_still_rewritten_each_time(monkeypatch) -> None:
    """An agent offers the same tools with every call: a schema found valid is not checked
    against the metaschema again (``tool_schemas``), its type names are still rewritten in
    the request's own copy, and an invalid one is refused every time."""
    from jsonschema import Draft202012Validator

    from stages.engine import tool_schemas

    monkeypatch.setattr(tool_schemas, "_KNOWN_VALID", set())
    checked = []
    real = Draft202012Validator.check_schema
    monkeypatch.setattr(
        Draft202012Validator, "check_schema", lambda schema: checked.append(1) or real(schema)
    )
    settings = ChatSettings(char_tokenizer(string.printable, template=QWEN_LIKE), None)
    typed = {"type": "object", "properties": {"when": {"type": "DATE"}, "k": {"type": "int32"}}}

    def request(parameters: Any) -> dict[str, Any]:
        tool = {"type": "function", "function": {"name": "get", "parameters": parameters}}
        return {"messages": HELLO, "tools": [tool]}

    for _ in range(3):
        body = request(json.loads(json.dumps(typed)))
        chat_request(body, settings, 4096)
        assert body["tools"][0]["function"]["parameters"]["properties"]["when"] == {
            "type": "string"
        }
    assert len(checked) == 1
    bad = {"type": "object", "properties": {"k": {"type": "int32"}, "n": {"minimum": "0"}}}
    for _ in range(2):
        with pytest.raises(OpenAIError, match="Tool 0 function has invalid 'parameters'"):
            chat_request(request(json.loads(json.dumps(bad))), settings, 4096)
    assert len(checked) == 3


def test_settings_shared_as_a_subclass_keep_every_field_and_what_was_worked_out() -> None:
    """``ChatSettings.shared_as`` (the agent proxy's per-episode settings, ``/tokenize``'s with
    special tokens): every field kept (the encoding and default kwargs included), the
    renderer, token bytes, reasoning toggle and content format the same objects, not
    parsed from the template again."""

    class Recording(ChatSettings):
        pass

    settings = ChatSettings(
        char_tokenizer(string.printable, template=QWEN_LIKE),
        None,
        {"temperature": 0.5},
        "hermes",
        default_kwargs={"enable_thinking": False},
        encoding="dsv32",
    )
    copy = settings.shared_as(Recording)
    assert type(copy) is Recording and copy is not settings
    for name in ("tokenizer", "defaults", "tool_parser", "default_kwargs", "encoding"):
        assert getattr(copy, name) == getattr(settings, name), name
    assert copy.renderer is settings.renderer and copy.token_bytes is settings.token_bytes
    assert "toggle" in vars(copy) and "content_format" in vars(copy)
    assert copy.content_format == settings.content_format


def test_a_request_template_and_too_many_completion_tokens_are_refused_as_sglang_does() -> None:
    """serving_chat._validate_request: a chat_template in chat_template_kwargs only with
    --trust-request-chat-template, which then renders the request with it; max_tokens (or
    max_completion_tokens) past the context length: SGLang's 400, in its words, unless it runs
    with --allow-auto-truncate."""
    tokenizer = char_tokenizer(string.printable, template=QWEN_LIKE)
    settings = ChatSettings(tokenizer, None)
    own = {"chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"}
    body = {"messages": HELLO, "chat_template_kwargs": own}
    with pytest.raises(OpenAIError, match="Request-supplied chat_template is not allowed"):
        chat_request(body, settings, 4096)
    settings.trust_request_template = True
    native, _ = chat_request(body, settings, 4096)
    assert tokenizer.decode(native["input_ids"]) == "[w11 w12 w13]"
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(OpenAIError, match=r"too large: 4097\.This model supports at most 4096"):
            chat_request({"messages": HELLO, field: 4097}, settings, 4096)
    assert chat_request({"messages": HELLO, "max_tokens": 4096}, settings, 4096)
    settings.auto_truncate = True  # --allow-auto-truncate: cut by the context fit, not refused
    native, _ = chat_request({"messages": HELLO, "max_completion_tokens": 4097}, settings, 4096)
    assert native["sampling_params"]["max_new_tokens"] == 4097


def test_the_template_sees_the_messages_as_sglangs_pydantic_dump_of_them() -> None:
    """serving_chat._process_messages on ChatCompletionMessageParam dumps: a user message's
    name dropped, another role's fields in the model's order with nulls out (content ""), its
    history calls as ToolCalls (index null) with parsed arguments; a template that iterates
    over a message's content gets the parts, a tool message's text parts joined."""
    messages = [
        {"name": "bob", "role": "user", "content": "hi", "extra": 1},
        {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
         "role": "Assistant", "content": None},
        {"role": "tool", "content": [{"type": "text", "text": "2"}, {"type": "text", "text": "3"}],
         "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]  # fmt: skip
    assert [template_message(m, i, "openai") for i, m in enumerate(messages)] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "index": None, "type": "function",
            "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2 3"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]  # fmt: skip
    assert template_message(messages[3], 3, "string")["content"] == "a b"
    assert content_format(QWEN_LIKE) == "string"
    loops = "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
    assert content_format(loops) == "openai"
    for arguments, words in (("[1]", "a JSON object"), ("{", "valid JSON")):
        bad = {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
        }
        with pytest.raises(DumpError, match=words):
            template_message(bad, 0, "string")


def test_default_chat_template_kwargs_fill_what_a_request_leaves_unset() -> None:
    """serving_chat.py:1805 (--default-chat-template-kwargs): each default set where the
    request's chat_template_kwargs leave it unset, a default reasoning_effort the request's
    where it has none; the template and the thinking decision see the merged kwargs."""
    template = (
        "{% if enable_thinking is false %}NOTHINK {% endif %}effort={{ reasoning_effort }} "
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tokenizer = char_tokenizer(string.printable, template=template)
    defaults = {"enable_thinking": False, "reasoning_effort": "low"}
    settings = ChatSettings(tokenizer, None, default_kwargs=defaults)

    def rendered(body: dict) -> str:
        native, _ = chat_request({"messages": [{"role": "user", "content": "hi"}], **body},
                                 settings, 4096)  # fmt: skip
        return tokenizer.decode(native["input_ids"])

    assert rendered({}) == "NOTHINK effort=low hi"
    # the field sets enable_thinking; the template gets the kwargs after the field, the
    # default's effort among them (_apply_jinja_template's extra_template_kwargs)
    assert rendered({"reasoning_effort": "high"}) == "effort=low hi"
    assert rendered({"chat_template_kwargs": {"enable_thinking": True}}) == "effort=low hi"
    # the request's kwarg moved into its field first (serving_chat.py:1291): the default's again
    assert rendered({"chat_template_kwargs": {"reasoning_effort": "medium"}}) == (
        "NOTHINK effort=low hi"
    )
    # /v1/decisions' (serving_decisions._chat_template_kwargs): reasoning off, defaults, request
    kwargs = template_kwargs(settings, "enable_thinking", {"x": 1})
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "low", "x": 1}
    settings.default_kwargs = {}
    assert rendered({}) == "effort= hi"


def test_deepseek_v32_prompts_are_rendered_by_its_encoder() -> None:
    """serving_chat.py:2076 (chat_encoding_spec dsv32, --tool-call-parser deepseekv32): no
    template; an empty system turn first with every request tool on it, each message as
    encoding_dsv32 renders it, thinking where the request's thinking kwarg says, encoded with
    the tokenizer's own special tokens; what the encoder refuses, SGLang's 400."""
    tokenizer = char_tokenizer(string.printable, special=[BOS, EOS, USER, ASSISTANT])
    settings = ChatSettings(tokenizer, None, tool_parser="deepseekv32", encoding="dsv32")

    def rendered(body: dict) -> str:
        native, _ = chat_request(body, settings, 8192)
        return tokenizer.decode(native["input_ids"])

    hi = [{"role": "user", "content": "hi"}]
    assert rendered({"messages": hi}) == f"{BOS}{USER}hi{ASSISTANT}</think>"
    thinking = rendered({"messages": hi, "chat_template_kwargs": {"thinking": True}})
    assert thinking.endswith(f"{ASSISTANT}<think>")
    named = {"type": "function", "function": {"name": "f"}}
    tools = [named, {"type": "function", "function": {"name": "g"}}]
    text = rendered({"messages": hi, "tools": tools, "tool_choice": named})
    assert '{"name": "f", "description": null, "parameters": null}' in text
    assert '{"name": "g", "description": null, "parameters": null}' in text  # every tool
    turn = [*hi, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert f"ok{EOS}{USER}more" in rendered({"messages": turn})
    orphan = [{"role": "user", "content": "x"}, {"role": "tool", "content": "5"}]
    with pytest.raises(OpenAIError, match="Invalid messages at 2"):
        rendered({"messages": orphan})
    with pytest.raises(OpenAIError, match="Unknown role: function") as unknown:  # its 500
        rendered({"messages": [*hi, {"role": "function", "content": "x"}]})
    assert unknown.value.status == 500
    # /v1/tokenize (serving_tokenize._tokenize_chat_request): the same ids; no template to
    # tell add_generation_prompt
    from types import SimpleNamespace

    from stages.engine.tokenize_routes import TokenizeRoutes

    loaded = SimpleNamespace(tokenizer=tokenizer, context_length=8192, vocab_size=len(tokenizer))
    routes = TokenizeRoutes(loaded, settings)  # type: ignore[arg-type]
    assert tokenizer.decode(routes.tokenized({"messages": hi})["tokens"]) == rendered(
        {"messages": hi}
    )
    with pytest.raises(OpenAIError, match="supported only with a Jinja chat template"):
        routes.tokenized({"messages": hi, "add_generation_prompt": True})


def test_a_streamed_call_cut_short_gets_the_rest_of_its_arguments_at_the_end() -> None:
    """serving_chat._check_for_unstreamed_tool_args: when the answer ends inside a call, the
    rest of its partial arguments' JSON goes out (open strings and objects closed), before the
    finish; the non-streamed answer drops the incomplete call (_process_tool_calls)."""
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "xy'

    async def run() -> list[dict]:
        async def batches():
            yield [_native(cut[:-1], None)]
            yield [_native(cut, {"type": "length", "length": 9})]

        return [c async for batch in chat_stream(batches(), OPTIONS) for c in batch]

    chunks = asyncio.run(run())
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    assert calls[0]["function"] == {"name": "add", "arguments": ""}
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"a": 1, "b": "xy"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = chat_response([_native(cut, {"type": "length", "length": 9})], OPTIONS)
    assert "tool_calls" not in whole["choices"][0]["message"]


def test_a_streamed_tool_call_is_named_then_its_arguments_then_the_finish() -> None:
    async def run() -> list[dict]:
        async def batches():
            yield [_native("ok <tool", None)]
            yield [_native("ok " + CALL, {"type": "stop", "matched": 1})]

        return [c async for batch in chat_stream(batches(), OPTIONS) for c in batch]

    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas).rstrip() == "ok"
    first, rest = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert first["function"] == {"name": "add", "arguments": ""} and first["index"] == 0
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert rest == {"id": None, "index": 0, "type": "function",
                    "function": {"name": None, "arguments": '{"a": 1, "b": "é"}'}}  # fmt: skip
    for c in chunks:  # what the openai client reads them as
        ChatCompletionChunk.model_validate(c)
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {"reasoning_content": None} and last["finish_reason"] == "tool_calls"


def test_a_choice_aborted_with_an_error_status_ends_the_stream_with_an_error_event() -> None:
    """serving_chat._generate_chat_stream (SGLang 0.5.23): a choice whose finish reason is an
    abort with an ``HTTPStatus`` (the sampling-mask's 500, a grammar's 400) is answered with
    ``create_streaming_error_response`` and the loop breaks: nothing of the choices after it,
    then the finish chunks of those that finished before, the usage chunk, no sglext ids; the
    stream's source is closed there (what it still generates is aborted)."""
    outside = {"type": "abort", "status_code": 500, "err_type": "InternalServerError",
               "message": "The sampling backend selected a token outside its captured "
               "sampling support."}  # fmt: skip
    closed: list[bool] = []

    async def run() -> list[list[dict]]:
        async def batches():
            try:
                yield [_native("1", None, 0), _native("2", None, 1)]
                yield [_native("12", {"type": "length", "length": 2}, 0)]
                yield [_native("2", outside, 1), _native("x", None, 2)]
                yield [_native("xy", None, 2)]  # never read
            finally:
                closed.append(True)

        options = {**OPTIONS, "n": 3, "parse_tools": False, "include_usage": True,
                   "sglext_output_ids": True}  # fmt: skip
        return [batch async for batch in chat_stream(batches(), options)]

    *_, last = asyncio.run(run())
    assert closed == [True]
    error, finish, usage = last
    assert error["error"] == {
        "object": "error", "message": outside["message"], "type": "INTERNAL_SERVER_ERROR",
        "param": None, "code": 500,
    }  # fmt: skip
    assert finish["choices"][0]["index"] == 0 and finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8  # 2 choices of 4
    for chunk in (finish, usage):
        assert "sglext" not in chunk
        ChatCompletionChunk.model_validate(chunk)
