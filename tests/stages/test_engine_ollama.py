"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``) on the built-in
engine, through the ``ollama`` client, against the engine's own ``/v1/chat/completions`` and
``/v1/completions`` (SGLang 0.5.23's Ollama routes: ``srt/entrypoints/ollama/serving.py``,
``protocol.py``). The engine of ``test_engine_responses.py``: a byte-level model with a tool
template, the ``llama3`` tool-call format and the ``qwen3`` reasoning parser."""

from __future__ import annotations

import json

import ollama
import pytest
import requests

from stages.engine.ollama_api import ChatLines, _answer_message
from tests.stages.test_engine_grammar import TOOLS
from tests.stages.test_engine_responses import client, engine, model  # noqa: F401

OFF = {"reasoning_effort": "none"}  # the chat route's thinking off: the answer is the content


@pytest.fixture(scope="module")
def llama(engine) -> ollama.Client:  # noqa: F811
    return ollama.Client(host=engine.url, timeout=60)


def _refused(engine) -> int:  # noqa: F811
    counts = requests.get(engine.url + "/server_info", timeout=10).json()["refused_requests"]
    return sum(counts.values())


@pytest.mark.timeout(60)
def test_chat_is_the_chat_routes_answer_in_ollamas_shape(llama, client, model) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "ab"}]
    got = llama.chat(
        model="any", messages=messages, think=False, options={"num_predict": 8, "temperature": 0}
    )
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=OFF
    )
    assert got.model == model  # the served model answers, under its name (SGLang's)
    assert got.message.role == "assistant"
    assert got.message.content == chat.choices[0].message.content
    assert got.done and got.done_reason == "length"  # at num_predict (SGLang says "stop")
    assert (got.prompt_eval_count, got.eval_count) == (chat.usage.prompt_tokens, 8)
    assert got.total_duration > 0 and got.created_at.endswith("Z")
    # streamed: a line per delta, the same text, then the last line, done, with the counts
    lines = list(
        llama.chat(
            model="any",
            messages=messages,
            think=False,
            stream=True,
            options={"num_predict": 8, "temperature": 0},
        )
    )
    assert all(not line.done for line in lines[:-1]) and lines[-1].done
    assert "".join(line.message.content for line in lines) == got.message.content
    assert lines[-1].message.content == "" and lines[-1].done_reason == "length"
    assert (lines[-1].prompt_eval_count, lines[-1].eval_count) == (chat.usage.prompt_tokens, 8)


@pytest.mark.timeout(60)
def test_think_is_the_templates_switch_and_its_reasoning_comes_as_thinking(
    llama,
    client,  # noqa: F811
    model,  # noqa: F811
) -> None:
    ask = {"model": "any", "messages": [{"role": "user", "content": "ab"}]}
    options = {"num_predict": 24, "temperature": 0}
    thought = llama.chat(**ask, think=True, options=options)
    chat = client.chat.completions.create(
        model=model, messages=ask["messages"], max_tokens=24, temperature=0,
        extra_body={"reasoning_effort": "medium"},
    ).choices[0].message  # fmt: skip
    assert thought.message.thinking and thought.message.thinking == chat.reasoning_content
    assert thought.message.content == chat.content
    plain = llama.chat(**ask, think=False, options=options)
    assert plain.message.thinking is None
    streamed = list(llama.chat(**ask, think=True, options=options, stream=True))
    assert "".join(line.message.thinking or "" for line in streamed) == (
        thought.message.thinking or ""
    )
    assert "".join(line.message.content for line in streamed) == thought.message.content


@pytest.mark.timeout(60)
def test_generate_is_the_completion_of_the_prompt_as_written(
    llama,
    client,  # noqa: F811
    model,  # noqa: F811
    engine,  # noqa: F811
) -> None:
    options = {"num_predict": 6, "temperature": 0}
    got = llama.generate(model="any", prompt="ab", system="cd", options=options)
    completion = client.completions.create(
        model=model, prompt="cd\n\nab", max_tokens=6, temperature=0
    )
    assert got.response == completion.choices[0].text  # system, a blank line, the prompt
    assert got.done and got.done_reason == "length" and got.eval_count == 6
    assert got.prompt_eval_count == completion.usage.prompt_tokens
    lines = list(
        llama.generate(model="any", prompt="ab", system="cd", options=options, stream=True)
    )
    assert "".join(line.response for line in lines) == got.response and lines[-1].done
    # the Ollama CLI's first call: an empty prompt, answered at once
    empty = llama.generate(model="any", prompt="")
    assert empty.done and empty.response == "" and empty.eval_count is None
    # SGLang's OllamaGenerateResponse as written: its fields in its order, nulls too
    fields = ["model", "created_at", "response", "done", "done_reason", "context",
              "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
              "eval_count", "eval_duration"]  # fmt: skip
    for prompt in ("ab", ""):
        body = {"model": "any", "prompt": prompt, "stream": False, "options": options}
        raw = requests.post(engine.url + "/api/generate", json=body, timeout=30).json()
        assert list(raw) == fields and raw["context"] is None, raw
    # a num_predict past the context: what the context leaves (SGLang's scheduler cuts it)
    long = llama.generate(
        model="any", prompt="ab", options={"num_predict": 10**6, "temperature": 0}
    )
    context = client.models.list().data[0].max_model_len
    assert long.done and long.prompt_eval_count + long.eval_count <= context


@pytest.mark.timeout(60)
def test_options_seed_format_and_logprobs_are_honoured(llama, client, model) -> None:  # noqa: F811
    ask = {"model": "any", "messages": [{"role": "user", "content": "ab"}], "think": False}
    sampled = {"num_predict": 12, "temperature": 1.0, "seed": 7}
    first = llama.chat(**ask, options=sampled).message.content
    assert llama.chat(**ask, options=sampled).message.content == first  # the seed holds
    others = {llama.chat(**ask, options={**sampled, "seed": s}).message.content for s in (8, 9)}
    assert others != {first}
    # format: json constrains the answer to a JSON object, a schema to that schema
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    greedy = {"num_predict": 64, "temperature": 0}
    shaped = llama.chat(**ask, format=schema, options=greedy)
    assert shaped.done_reason == "stop" and json.loads(shaped.message.content) in (
        {"a": True},
        {"a": False},
    )
    anything = llama.chat(**ask, format="json", options=greedy)  # may run to its length
    assert anything.message.content.lstrip().startswith("{")
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    # logprobs: the chat route's, per token, with the top alternatives
    scored = llama.chat(
        **ask, options={"num_predict": 4, "temperature": 0}, logprobs=True, top_logprobs=2
    )
    chat = client.chat.completions.create(
        model=model, messages=ask["messages"], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body=OFF,
    )  # fmt: skip
    expected = chat.choices[0].logprobs.content
    assert [e.token for e in scored.logprobs] == [e.token for e in expected]
    assert [e.logprob for e in scored.logprobs] == pytest.approx([e.logprob for e in expected])
    assert all(len(e.top_logprobs) == 2 for e in scored.logprobs)
    # and /api/generate's, the completion route's
    generated = llama.generate(
        model="any", prompt="ab", options={"num_predict": 3, "temperature": 0}, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    completion = (
        client.completions.create(model=model, prompt="ab", max_tokens=3, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    assert [e.token for e in generated.logprobs] == completion.tokens
    assert [e.logprob for e in generated.logprobs] == pytest.approx(completion.token_logprobs)
    assert all(len(e.top_logprobs) == 2 for e in generated.logprobs)


@pytest.mark.timeout(60)
def test_tool_history_renders_as_the_chat_routes_and_calls_come_back_as_objects(
    llama,
    client,  # noqa: F811
    model,  # noqa: F811
) -> None:
    name = TOOLS[0]["function"]["name"]
    history = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": name, "arguments": {"city": "x"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": name},
    ]  # fmt: skip
    got = llama.chat(
        model="any", messages=history, tools=TOOLS, think=False,
        options={"num_predict": 6, "temperature": 0},
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, tools=TOOLS, extra_body=OFF,
        messages=[
            history[0],
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
             "function": {"name": name, "arguments": json.dumps({"city": "x"})}}]},
            {"role": "tool", "content": "sunny", "name": name},
        ],
    )  # fmt: skip
    assert got.prompt_eval_count == chat.usage.prompt_tokens
    assert got.message.content == chat.choices[0].message.content
    # a call the chat route read, as Ollama writes it: its arguments an object
    message = _answer_message(
        {"content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": name, "arguments": '{"city": "y"}'}}]}
    )  # fmt: skip
    assert message == {
        "role": "assistant", "content": "", "images": None, "thinking": "hm",
        "tool_calls": [{"function": {"name": name, "arguments": {"city": "y"}}}],
    }  # fmt: skip
    # streamed, the chat route sends a call in pieces (its name, then parts of its arguments):
    # Ollama's line holds each call whole, once the choice finishes
    lines = ChatLines({"ollama": {"model": model, "started": 0}, "model": model, "n": 1,
                       "include_usage": False, "continuous_usage_stats": False})  # fmt: skip
    lines.inner = lambda chunks: chunks  # the chat route's chunks, as they come
    pieces = [
        {"index": 0, "function": {"name": name, "arguments": ""}},
        {"index": 0, "function": {"name": None, "arguments": '{"city": "Pa'}},
        {"index": 0, "function": {"name": None, "arguments": 'ris"}'}},
        {"index": 1, "function": {"name": "other", "arguments": "{}"}},
    ]
    chunks = [{"choices": [{"delta": {"tool_calls": [p]}, "finish_reason": None}]} for p in pieces]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    (line,) = lines(chunks)
    assert line["done"] is False and line["message"]["tool_calls"] == [
        {"function": {"name": name, "arguments": {"city": "Paris"}}},
        {"function": {"name": "other", "arguments": {}}},
    ]


def test_tags_show_root_and_invocations(llama, engine, model) -> None:  # noqa: F811
    (listed,) = llama.list().models
    assert listed.model == model and listed.size == 0 and listed.details.format == "sglang"
    shown = llama.show("org/Some-Model-Instruct")
    assert shown.details.family == "Some-Model" and shown.capabilities == ["completion"]
    assert shown.parameters.startswith("num_ctx ")
    root = requests.get(engine.url + "/", timeout=10)
    assert root.status_code == 200 and root.json() == "SGLang is running"
    body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 3, "temperature": 0}
    sage = requests.post(engine.url + "/invocations", json=body, timeout=30).json()
    chat = requests.post(engine.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert sage["object"] == "chat.completion"
    assert sage["choices"][0]["message"] == chat["choices"][0]["message"]


def test_bad_requests_get_ollamas_error_and_are_counted(llama, engine) -> None:  # noqa: F811
    before = _refused(engine)
    with pytest.raises(ollama.ResponseError) as caught:
        llama.chat(model="any", messages=[{"role": "user", "content": "ab", "images": ["aGk="]}])
    assert caught.value.status_code == 400 and "images" in caught.value.error
    # what SGLang's request models refuse: FastAPI's answer, SGLang's ErrorResponse shape
    for path, body, words in (
        ("/api/chat", {"model": "m"}, "messages: Field required"),
        ("/api/chat", {"model": "m", "messages": [{"content": "x"}]}, "messages.0.role: Field"),
        (
            "/api/chat",
            {"model": "m", "messages": [{"role": "user", "content": 1}]},
            "messages.0.content: Input should be a valid string",
        ),
        ("/api/chat", {"model": "m", "messages": [], "options": []}, "options: Input should"),
        ("/api/chat", {"model": "m", "messages": [], "think": "very"}, "think.literal"),
        ("/api/chat", {"model": "m", "messages": [], "stream": None}, "stream: Input should"),
        ("/api/generate", {"model": "m", "prompt": 5}, "prompt: Input should be a valid str"),
        ("/api/generate", {"prompt": "x"}, "model: Field required"),
        ("/api/show", {}, "model: Field required"),
    ):
        answer = requests.post(engine.url + path, json=body, timeout=30)
        assert answer.status_code == 400, (path, body)
        assert words in answer.json()["message"], answer.text
        assert answer.json()["type"] == "Bad Request" and answer.json()["param"] is None
    # no validate_json_request on these routes: FastAPI reads JSON sent as JSON, else bytes
    for content_type, code in (("text/plain", 400), ("application/vnd.ollama+json", 200)):
        answer = requests.post(
            engine.url + "/api/show",
            data=b'{"model": "m"}',
            headers={"Content-Type": content_type},
            timeout=30,
        )
        assert answer.status_code == code, answer.text
    assert answer.json()["model_info"], answer.text
    # the route's own refusals: Ollama's {error}
    too_long = {"model": "m", "messages": [{"role": "user", "content": "a " * 9000}]}
    answer = requests.post(engine.url + "/api/chat", json=too_long, timeout=30)
    assert answer.status_code == 400 and "leaves no room" in answer.json()["error"]
    assert _refused(engine) - before == 12
    lax = {"model": "m", "messages": [{"role": "user", "content": "ab"}], "stream": "false",
           "think": 0, "options": {"num_predict": 1}}  # fmt: skip
    answer = requests.post(engine.url + "/api/chat", json=lax, timeout=30)
    assert answer.status_code == 200 and answer.json()["done"] is True  # one answer, no stream
    assert llama.chat(model="any", messages=[{"role": "user", "content": "ab"}], think=False,
                      options={"num_predict": 2}).done  # fmt: skip
