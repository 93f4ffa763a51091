"""``/v1/messages`` (Anthropic's Messages API) on the built-in engine, through the
``anthropic`` client, against its own ``/v1/chat/completions`` (which SGLang 0.5.23's
Anthropic route builds on: ``srt/entrypoints/anthropic/serving.py``, ``protocol.py``). The
engine of ``test_engine_responses.py``: a byte-level model with a tool template, the
``llama3`` tool-call format and the ``qwen3`` reasoning parser."""

from __future__ import annotations

import json
import re

import anthropic
import pytest
import requests

from stages.engine.anthropic_messages import _messages, _tools
from stages.engine.reasoning import PARSERS
from tests.stages.test_engine_grammar import TOOLS
from tests.stages.test_engine_responses import client, engine, model  # noqa: F401

# this client has no ``temperature`` parameter any more; the route takes it (SGLang's too)
GREEDY = {"temperature": 0}
OFF = {"thinking": {"type": "disabled"}}  # the template's thinking off: the answer is text
CHAT_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
CUSTOM = [  # Anthropic's tools: name, description, input_schema
    {"name": t["function"]["name"], "description": "a tool",
     "input_schema": t["function"]["parameters"], "strict": True}
    for t in TOOLS
]  # fmt: skip


@pytest.fixture(scope="module")
def claude(engine) -> anthropic.Anthropic:  # noqa: F811
    return anthropic.Anthropic(base_url=engine.url, api_key="unused", max_retries=0)


def _raw(engine, path: str, body: dict) -> tuple[int, dict]:  # noqa: F811
    answer = requests.post(engine.url + path, json=body, timeout=30)
    return answer.status_code, answer.json()


@pytest.mark.timeout(60)
def test_a_greedy_message_is_the_chat_answer_in_anthropic_shape(
    claude,
    client,  # noqa: F811
    model,  # noqa: F811
    engine,  # noqa: F811
) -> None:
    ask = {"model": model, "max_tokens": 8, "extra_body": GREEDY, **OFF}
    got = claude.messages.create(messages=[{"role": "user", "content": "ab"}], **ask)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ab"}], max_tokens=8, temperature=0,
        extra_body=CHAT_OFF,
    )  # fmt: skip
    assert re.fullmatch("msg_[0-9a-f]{32}", got.id) and got.type == "message"
    assert got.role == "assistant" and got.model == model
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == chat.choices[0].message.content
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None  # cut at its length
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    # as SGLang writes it: its keys in order, nulls left out
    plain = {"model": model, "max_tokens": 8, **GREEDY, **OFF}
    status, raw = _raw(
        engine, "/v1/messages", {**plain, "messages": [{"role": "user", "content": "ab"}]}
    )
    assert status == 200 and list(raw) == [
        "id",
        "type",
        "role",
        "content",
        "model",
        "stop_reason",
        "usage",
    ]
    assert list(raw["usage"]) == ["input_tokens", "output_tokens"]
    # the system prompt: one system message first
    briefed = claude.messages.create(
        system="be brief", messages=[{"role": "user", "content": "ab"}], **ask
    )
    system = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, extra_body=CHAT_OFF,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}],
    )  # fmt: skip
    assert briefed.usage.input_tokens == system.usage.prompt_tokens > got.usage.input_tokens
    assert briefed.content[0].text == system.choices[0].message.content


@pytest.mark.timeout(60)
def test_a_stream_adds_up_to_the_whole_message(claude, model, engine) -> None:  # noqa: F811
    """``_generate_stream``: ``message_start``, a text block (start, deltas, stop, index 0),
    ``message_delta`` with the stop reason and output tokens, ``message_stop``; thinking
    comes as a ``thinking`` block of its own."""
    ask = {"model": model, "max_tokens": 8, "extra_body": GREEDY,
           "messages": [{"role": "user", "content": "ab"}]}  # fmt: skip
    whole = claude.messages.create(**ask, **OFF)
    events = list(claude.messages.create(**ask, **OFF, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.usage.input_tokens == whole.usage.input_tokens and start.usage.output_tokens == 0
    assert all(e.index == 0 for e in events if e.type.startswith("content_block"))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # thinking on (a random model never closes it: the answer is all reasoning)
    thought = claude.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in thought.content] == ["thinking"]
    streamed = list(claude.messages.create(**ask, thinking={"type": "adaptive"}, stream=True))
    deltas = [e.delta for e in streamed if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta"}
    assert "".join(d.thinking for d in deltas) == thought.content[0].thinking
    # the budget is taken, not enforced, and the log says so (SGLang's warning)
    assert "thinking_budget_not_enforced" in engine.log_file.read_text()


@pytest.mark.timeout(120)
def test_tool_use_comes_as_blocks_and_goes_back_as_tool_results(claude, client, model) -> None:  # noqa: F811
    """A forced call (``tool_choice: tool``) is a ``tool_use`` block, ``stop_reason:
    tool_use``; the next turn (the assistant's ``tool_use``, the user's ``tool_result``)
    renders the prompt the chat route renders for the same conversation."""
    got = claude.messages.create(
        model=model, max_tokens=400, tools=CUSTOM, tool_choice={"type": "tool", "name": "add"},
        messages=[{"role": "user", "content": "ab"}], **OFF,
    )  # fmt: skip
    uses = [b for b in got.content if b.type == "tool_use"]
    assert uses and all(b.name == "add" and set(b.input) == {"a", "b"} for b in uses)
    assert got.stop_reason == "tool_use"
    streamed = list(claude.messages.create(
        model=model, max_tokens=400, tools=CUSTOM, tool_choice={"type": "tool", "name": "add"},
        messages=[{"role": "user", "content": "ab"}], stream=True, **OFF,
    ))  # fmt: skip
    starts = [e.content_block for e in streamed if e.type == "content_block_start"]
    assert starts and {b.type for b in starts} == {"tool_use"} and starts[0].name == "add"
    first = [e.delta for e in streamed if e.type == "content_block_delta" and e.index == 0]
    partial = "".join(d.partial_json for d in first)
    assert set(json.loads(partial)) == {"a", "b"}
    use = uses[0]
    turn = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                           "input": use.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "9"},
            {"type": "text", "text": "and now?"},
        ]},
    ]  # fmt: skip
    after = claude.messages.create(model=model, max_tokens=4, tools=CUSTOM, messages=turn, **OFF)
    chat = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, tools=TOOLS, extra_body=CHAT_OFF,
        messages=[
            {"role": "user", "content": "ab"},
            {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function",
             "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "9"},
            {"role": "user", "content": "and now?"},
        ],
    )  # fmt: skip
    assert after.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt
    counted = claude.messages.count_tokens(model=model, tools=CUSTOM, messages=turn, **OFF)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_messages_become_chat_messages_as_sglang_makes_them() -> None:
    body = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "system", "content": "  and kind  "},  # merged into the first
            {"role": "user", "content": [
                {"type": "text", "text": "A"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "r", "is_error": True},
                {"type": "text", "text": "B"},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2",
                                          "content": [{"type": "text", "text": "x"},
                                                      {"type": "text", "text": "y"}]}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t3", "name": "f",
                                               "input": {"a": 1}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
        ],
    }  # fmt: skip
    assert _messages(body) == [
        {"role": "system", "content": "be brief\nand kind"},
        {"role": "user", "content": "A"},
        {"role": "tool", "tool_call_id": "t1", "content": "r"},
        {"role": "user", "content": "B"},
        {"role": "tool", "tool_call_id": "t2", "content": [
            {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "assistant", "tool_calls": [{"id": "t3", "type": "function",
                                              "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "assistant", "content": ""},  # no reasoning parser: dropped, as SGLang's
    ]  # fmt: skip
    # serving_chat.wrap_reasoning_history: the parser's tags around it, the message's first text
    assistant = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm"}, {"type": "thinking", "thinking": "so"},
        {"type": "text", "text": "ok"}]}  # fmt: skip
    assert _messages({"messages": [assistant]}, PARSERS["qwen3"]) == [
        {"role": "assistant", "content": [{"type": "text", "text": "<think>hm\nso\n</think>"},
                                          {"type": "text", "text": "ok"}]},
    ]  # fmt: skip
    native = _messages({"messages": [assistant]}, PARSERS["qwen3"], native=True)  # dsv32's
    assert native == [{"role": "assistant", "reasoning_content": "hm\nso", "content": "ok"}]
    assert _messages({"messages": [assistant]}, PARSERS["gemma4"])[0]["content"][0]["text"] == (
        "<|channel>thought\nhm\nso\n<channel|>"
    )


def test_custom_tools_become_chat_tools_as_sglang_makes_them() -> None:
    """anthropic/serving.py:676: a custom tool's function (its description "" when missing,
    strict false), its ``defer_loading`` on the chat tool; protocol.py:146: a schema without a
    type gets ``object`` after its own keys."""
    chat_body: dict = {}
    body = {"tools": [{"name": "f", "input_schema": {"properties": {}}, "defer_loading": True}]}
    _tools(body, chat_body)
    assert chat_body["tools"] == [{
        "type": "function",
        "function": {"name": "f", "description": "",
                     "parameters": {"properties": {}, "type": "object"}, "strict": False},
        "defer_loading": True,
    }]  # fmt: skip
    assert list(chat_body["tools"][0]["function"]["parameters"]) == ["properties", "type"]


@pytest.mark.timeout(60)
def test_what_sglang_refuses_is_refused_in_its_words(engine, claude, model) -> None:  # noqa: F811
    hello = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "ab"}]}
    cases = [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"max_tokens": 0}, "max_tokens: Value error, max_tokens must be positive"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}},
         "thinking: Value error, thinking.budget_tokens must be >= 1024 (got 10)"),
        ({"messages": [{"role": "bot", "content": "x"}]},
         "messages.0.role: Input should be 'user', 'assistant' or 'system'"),
        ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking"}]}]},
         "Anthropic redacted_thinking history is not supported"),
        ({"tools": CUSTOM, "tool_choice": {"type": "tool", "name": "nope"}},
         "tool_choice references tool 'nope' but it is not in the forwarded tools list"),
        ({"tool_choice": {"type": "any"}}, "tool_choice='any' requires at least one custom tool"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages.0.content.0: Input tag 'document' found using 'type'"),
        # its scalar fields' types, as pydantic reads them (request_fields.MessagesFields)
        ({"stream": "maybe"}, "stream: Input should be a valid boolean"),
        ({"top_k": 2.5}, "top_k: Input should be a valid integer, got a number"),
        ({"stop_sequences": "END"}, "stop_sequences: Input should be a valid list"),
        ({"model": ""}, "model: Value error, Model is required"),
        ({"stop_sequences": ["END", 1]}, "stop_sequences.1: Input should be a valid str"),
    ]  # fmt: skip
    for more, words in cases:
        body = {k: v for k, v in {**hello, **more}.items() if v is not None}
        status, answer = _raw(engine, "/v1/messages", body)
        assert status == 400 and answer["type"] == "error", (more, answer)
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"].startswith(words), (more, answer)
    answer = requests.post(engine.url + "/v1/messages", data="{}", timeout=10,
                           headers={"Content-Type": "text/plain"})  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["message"] == (
        "header.content-type: Unsupported Media Type: Only 'application/json' is allowed"
    )
    status, answer = _raw(engine, "/v1/messages", {**hello, "stop_sequences": [1] * 30})
    assert status == 400 and len(answer["error"]["message"]) == 501  # SGLang's digest: cut
    assert answer["error"]["message"].endswith("…")
    lax = {**hello, "max_tokens": "2", "temperature": "0", "stream": "false"}
    status, answer = _raw(engine, "/v1/messages", lax)  # pydantic's conversions, as SGLang's
    assert status == 200 and answer["usage"]["output_tokens"] <= 2, answer
    with pytest.raises(anthropic.BadRequestError):  # the client reads the envelope
        claude.messages.create(**{**hello, "max_tokens": 0})
    # server tools are accepted and not used; unknown keys ignored
    ok = claude.messages.create(
        **hello, **OFF, tools=[{"type": "web_search_20250305", "name": "web_search"}],
        extra_body={"metadata": {"user_id": "u"}, "whatever": 1},
    )  # fmt: skip
    assert ok.content[0].type == "text"
