"""``/v1/responses`` on the built-in engine, through the ``openai`` client, against its own
``/v1/chat/completions`` (which SGLang 0.5.23's Responses route builds on:
``serving_responses.py``, ``protocol.py`` ``ResponsesRequest``/``ResponsesResponse``) and the
shapes SGLang answers with. One engine: a byte-level model with a tool template, the ``llama3``
tool-call format and the ``qwen3`` reasoning parser (a request thinks unless its
``reasoning.effort`` is ``none``; a random model never closes its thinking, so a thinking
answer is all reasoning)."""

from __future__ import annotations

import json
import re
import string
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from stages.engine.openai_api import OpenAIError, OpenAIRoutes
from stages.engine.openai_chat import ChatSettings
from stages.engine.openai_responses import (
    STORE_DISABLED,
    ResponseEvents,
    _messages,
    responses_request,
)
from tests.stages.test_engine_grammar import TOOL_TEMPLATE, TOOLS
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import BYTE_CHARS, make_byte_model
from tests.stages.tool_tokenizers import QWEN_LIKE, TAGS, char_tokenizer

CHARS = BYTE_CHARS + " <>_/\n|()=';"
PLAIN = {"reasoning": {"effort": "none"}}  # thinking off: the answer is the message
FUNCTIONS = [  # the Responses API's tools: flat function objects
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
     "strict": True}
    for t in TOOLS
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("responses")
    model_dir = make_byte_model(root / "model", seed=4, chars=CHARS, words=("<|python_tag|>",))
    (root / "template.jinja").write_text(TOOL_TEMPLATE)
    with serving(
        model_dir, root / "engine.log", "--chat-template", str(root / "template.jinja"),
        "--tool-call-parser", "llama3", "--reasoning-parser", "qwen3", "--enable-response-store",
    ) as eng:  # fmt: skip
        yield eng


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id  # SGLang checks the name (_validate_model)


@pytest.mark.timeout(60)
def test_a_greedy_response_is_the_chat_answer_in_responses_shape(client, model) -> None:
    ask = {"model": model, "temperature": 0, **PLAIN}
    got = client.responses.create(input="ab", max_output_tokens=8, **ask)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "ab"}],
        max_tokens=6,  # max_output_tokens less SGLang's 2 tokens of headroom
        model=model, temperature=0, reasoning_effort="none",
    )  # fmt: skip
    assert got.object == "response" and got.id.startswith("resp_") and got.model == model
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.phase == "final_answer" and item.content[0].type == "output_text"
    assert got.output_text == chat.choices[0].message.content
    # cut at its length: incomplete, as SGLang's _status_from_finish_reason says
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    usage = got.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert usage.total_tokens == usage.input_tokens + 6
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert got.text.format.type == "text" and got.instructions is None
    assert got.max_output_tokens == 8 and got.temperature == 0 and got.reasoning.effort is None
    # instructions: a system message first
    briefed = client.responses.create(
        input="ab", max_output_tokens=8, instructions="be brief", **ask
    )
    system = client.chat.completions.create(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}],
        max_tokens=6, model=model, temperature=0, reasoning_effort="none",
    )  # fmt: skip
    assert briefed.usage.input_tokens == system.usage.prompt_tokens > usage.input_tokens
    assert briefed.instructions == "be brief"


@pytest.mark.timeout(60)
def test_a_thinking_answer_is_a_reasoning_item(client, model) -> None:
    got = client.responses.create(model=model, input="ab", max_output_tokens=10, temperature=0)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ab"}], max_tokens=8, temperature=0
    )
    (item,) = got.output  # no text after the reasoning: no message
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert got.text is None  # SGLang's rule: "text" only for an answer of messages alone
    assert got.usage.output_tokens_details.reasoning_tokens == chat.usage.reasoning_tokens


@pytest.mark.timeout(120)
def test_function_calls_come_as_items_and_go_back_in_as_input(client, model) -> None:
    got = client.responses.create(
        model=model, input="ab", max_output_tokens=400, tools=FUNCTIONS, tool_choice="required",
        **PLAIN,
    )  # fmt: skip
    calls = [o for o in got.output if o.type == "function_call"]
    assert calls and all(o.type == "function_call" for o in got.output)
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.name in {"add", "mul"} and set(json.loads(call.arguments)) == {"a", "b"}
    assert got.tool_choice == "required" and got.text is None
    # the next turn: the calls and their outputs as input items, as an agent sends them
    turn = [{"role": "user", "content": "ab"}, *[c.model_dump() for c in calls[:1]]]
    turn.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "9"})
    after = client.responses.create(
        model=model, input=turn, max_output_tokens=6, tools=FUNCTIONS, temperature=0, **PLAIN
    )
    call = calls[0]
    chat = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, reasoning_effort="none",
        tools=TOOLS, messages=[
            {"role": "user", "content": "ab"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "9"},
        ],
    )  # fmt: skip
    assert after.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt


@pytest.mark.timeout(120)
def test_a_stream_sends_sglangs_events_and_ends_with_the_whole_response(client, model) -> None:
    ask = {"model": model, "input": "ab", "max_output_tokens": 9, "temperature": 0, **PLAIN}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == 7
    # thinking: a reasoning item's events
    thought = list(client.responses.create(**{**ask, "reasoning": None}, stream=True))
    assert "response.reasoning_text.delta" in {e.type for e in thought}
    (item,) = thought[-1].response.output
    assert item.type == "reasoning"
    text = "".join(e.delta for e in thought if e.type == "response.reasoning_text.delta")
    assert item.content[0].text == text


@pytest.mark.timeout(120)
def test_streamed_calls_add_up_to_their_items(client, model) -> None:
    ask = {"model": model, "input": "ab", "max_output_tokens": 300, "temperature": 0,
           "tools": FUNCTIONS, "tool_choice": "required", **PLAIN}  # fmt: skip
    events = list(client.responses.create(**ask, stream=True))
    final = events[-1].response
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls
    for call in calls:
        pieces = [
            e.delta for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == call.id
        ]  # fmt: skip
        assert "".join(pieces) == call.arguments
        (done,) = [
            e for e in events
            if e.type == "response.function_call_arguments.done" and e.item_id == call.id
        ]  # fmt: skip
        assert done.arguments == call.arguments and done.name == call.name
    whole = client.responses.create(**ask)
    assert [(c.name, c.arguments) for c in calls] == [
        (o.name, o.arguments) for o in whole.output if o.type == "function_call"
    ]


@pytest.mark.timeout(60)
def test_output_logprobs_are_the_chat_routes(client, model) -> None:
    ask = {"model": model, "temperature": 0, **PLAIN}
    got = client.responses.create(
        input="ab", max_output_tokens=7, include=["message.output_text.logprobs"],
        top_logprobs=2, **ask,
    )  # fmt: skip
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "ab"}], max_tokens=5, logprobs=True,
        top_logprobs=2, model=model, temperature=0, reasoning_effort="none",
    )  # fmt: skip
    entries = got.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert len(entries) == len(expected) == 5
    for entry, want in zip(entries, expected, strict=True):
        assert entry.token == want.token and abs(entry.logprob - want.logprob) < 1e-5
        assert [t.token for t in entry.top_logprobs] == [t.token for t in want.top_logprobs]


@pytest.mark.timeout(60)
def test_what_sglang_refuses_is_refused_in_its_words(client, model, engine: Engine) -> None:
    with pytest.raises(openai.NotFoundError) as found:
        client.responses.create(model="another", input="ab")
    assert found.value.body == {
        "message": "The model 'another' does not exist", "type": "invalid_request_error",
        "param": "model", "code": 404,
    }  # fmt: skip
    refused = [
        ({"previous_response_id": "x"}, "Invalid 'response_id': 'x'. Expected an ID that"),
        ({"background": True, "store": False}, "background=true requires store=true."),
        ({"max_output_tokens": 1}, "max_new_tokens must be at least 0, got -1."),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "Unsupported Responses API input"),
        ({"stream": True, "include": ["message.output_text.logprobs"]}, "logprobs are not"),
        ({"tools": [{"type": "shell"}]}, "Shell tools are not supported by this model"),
        ({"tool_choice": "required"}, 'tool_choice="required" requires at least one tool'),
        # the chat request's checks, in the Responses request's terms
        ({"input": [{"role": "wizard"}]}, "input: messages[0].role: one of system, user"),
    ]
    # what ResponsesRequest's own types refuse: its validation handler's type and null param
    invalid = [
        ({"reasoning": {"effort": "bogus"}}, "reasoning.effort: Input should be 'none', "),
        ({"text": "plain"}, "text: Input should be a valid dictionary"),
        ({"store": "maybe"}, "store: Input should be a valid boolean"),
        ({"max_output_tokens": 2.5}, "max_output_tokens: Input should be a valid integer"),
        ({"service_tier": "fast"}, "service_tier: Input should be 'auto', "),
        ({"include": ["everything"]}, "include.0: Input should be "),
        ({"extra_body": {"priority": None}}, "priority: Input should be a valid integer"),
    ]
    for kind, cases in (("invalid_request_error", refused), ("Bad Request", invalid)):
        for more, message in cases:
            with pytest.raises(openai.BadRequestError) as bad:
                client.responses.create(**{"model": model, "input": "ab", **more})
            assert bad.value.body["message"].startswith(message), bad.value.body
            assert bad.value.body["type"] == kind, bad.value.body
            assert kind != "Bad Request" or bad.value.body["param"] is None
    lax = client.responses.create(  # pydantic's lax conversions, as SGLang's model reads
        model=model, input="ab", max_output_tokens="4", temperature="0", store="no"
    )
    assert lax.max_output_tokens == 4 and lax.temperature == 0.0 and lax.store is False
    not_json = requests.post(
        engine.url + "/v1/responses", data="{", headers={"Content-Type": "application/json"}
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] is None
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, input="ab", previous_response_id="resp_gone")
    assert missing.value.body["message"] == "Response with id 'resp_gone' not found."


@pytest.mark.timeout(60)
def test_the_store_keeps_responses_for_previous_response_id_and_get(client, model) -> None:
    """``--enable-response-store``: SGLang's ``response_store`` and ``msg_store``."""
    ask = {"model": model, "max_output_tokens": 6, "temperature": 0, **PLAIN}
    first = client.responses.create(input="ab", **ask)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.cancel(first.id).status == first.status  # it has ended
    second = client.responses.create(input="cd", previous_response_id=first.id, **ask)
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, reasoning_effort="none", messages=[
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "cd"},
        ],
    )  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # the chain as one chat
    assert second.output_text == chat.choices[0].message.content
    streamed = list(client.responses.create(input="ab", stream=True, **ask))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    unkept = client.responses.create(input="ab", store=False, **ask)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.retrieve("msg_1")
    assert bad.value.body["param"] == "response_id"


@pytest.mark.timeout(60)
def test_a_background_response_runs_in_a_task_and_a_cancel_ends_it(client, model, engine) -> None:
    """``background`` without ``stream`` (``serving_responses``: ``_run_background_request``):
    answered at once ``queued``, then ``GET`` follows it to the whole response, the same as
    the request's without it; a cancel while it waits (the engine paused) marks it
    ``cancelled`` and aborts it (still cancelled after the engine goes on), a second cancel
    answers it as it is; ``stream`` with ``background`` streams on its connection."""
    ask = {"model": model, "temperature": 0, "max_output_tokens": 6, "input": "ab", **PLAIN}
    whole = client.responses.create(**ask)
    queued = client.responses.create(background=True, **ask)
    assert queued.status == "queued" and queued.output == [] and queued.usage is None
    got = client.responses.retrieve(queued.id)
    deadline = time.monotonic() + 30
    while got.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        got = client.responses.retrieve(queued.id)
    assert got.status == whole.status and got.output_text == whole.output_text
    assert got.usage.output_tokens == whole.usage.output_tokens
    made = engine.request("GET", "/server_info")[1]["tokens_generated"]
    assert engine.request("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        waiting = client.responses.create(background=True, **ask)
        assert client.responses.retrieve(waiting.id).status == "in_progress"
        assert client.responses.cancel(waiting.id).status == "cancelled"
    finally:
        assert engine.request("POST", "/continue_generation", {})[0] == 200
    time.sleep(0.5)  # had it not been aborted, it would end now
    assert client.responses.retrieve(waiting.id).status == "cancelled"
    assert engine.request("GET", "/server_info")[1]["tokens_generated"] == made  # aborted
    assert client.responses.cancel(waiting.id).status == "cancelled"  # as it is
    streamed = list(client.responses.create(background=True, stream=True, **ask))
    assert streamed[-1].response.output_text == whole.output_text


async def test_without_a_store_sglangs_refusals() -> None:
    """SGLang's default (no ``--enable-response-store``): every stateful request refused."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    settings = ChatSettings(char_tokenizer("ab", template=QWEN_LIKE), None)
    for more in ({"previous_response_id": "resp_x"}, {"background": True}):
        with pytest.raises(OpenAIError, match="Response store is disabled") as refused:
            responses_request({"model": "m", "input": "ab", **more}, settings, 64)
        assert refused.value.param == next(iter(more))
    app = web.Application()
    OpenAIRoutes(None, None, None, served_model_name="m", context_length=64).add_to(app)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as http:
        for method, path in (
            ("GET", "/v1/responses/resp_1"),
            ("POST", "/v1/responses/resp_1/cancel"),
        ):
            answer = await http.request(method, path)
            body = await answer.json()
            assert answer.status == 400 and body["error"]["message"] == STORE_DISABLED


def test_input_items_become_chat_messages_as_sglang_makes_them() -> None:
    """``_construct_input_messages`` and ``_normalize_response_message_for_chat``."""
    items: list[Any] = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "id": "msg_1", "status": "completed",
         "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
         "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
         "text": "let me add"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "[1]"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text",
         "text": "4"}]},
        {"type": "reasoning", "summary": [], "content": []},  # no text: dropped
    ]  # fmt: skip
    assert _messages(items, "be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "Developer instructions:\nrules"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {  # reasoning alone merges with what follows; the same (no) phase merges too
            "role": "assistant",
            "reasoning_content": "think",
            "content": [{"type": "text", "text": "let me add"}],
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": "{}"},
                },  # not an object: {}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    assert _messages("hello", None) == [{"role": "user", "content": "hello"}]


def test_with_tools_a_message_waits_for_its_phase() -> None:
    """SGLang holds a message's events while tools may follow (``responses_stream_generator_
    non_harmony``): a call after it sends them with ``phase: commentary``, the call's next."""
    tokenizer = char_tokenizer(string.printable, special=TAGS, template=QWEN_LIKE)
    settings = ChatSettings(tokenizer, None, {}, "qwen25", None)
    body = {"model": "m", "input": "ab", "tools": FUNCTIONS, "stream": True, **PLAIN}
    _, options = responses_request(body, settings, 4096)
    events = ResponseEvents(options)

    def native(text: str, finish: dict | None = None) -> dict[str, Any]:
        meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "cached_tokens": 1,
                "completion_tokens": len(text)}  # fmt: skip
        return {"text": text, "output_ids": [], "meta_info": meta}

    first = events([native("Let me ")])
    assert [e["type"] for e in first] == ["response.created", "response.in_progress"]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    second = events([native("Let me add.\n" + call, {"type": "stop", "matched": None})])
    kinds = [e["type"] for e in second]
    assert kinds[:3] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    assert second[0]["item"]["phase"] == "commentary"
    added = kinds.index("response.output_item.added", 1)
    assert kinds.index("response.output_item.done") < added  # the message closed first
    assert second[added]["item"]["type"] == "function_call"
    last = events.end()
    final = last[-1]
    assert final["type"] == "response.completed"
    message, function = final["response"]["output"]
    assert message["phase"] == "commentary" and message["content"][0]["text"].startswith("Let me")
    assert function["name"] == "add" and json.loads(function["arguments"]) == {"a": 1, "b": 2}
    numbers = [e["sequence_number"] for e in first + second + last]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 1


def test_events_are_laid_out_as_sglangs_and_progress_gives_the_same() -> None:
    """Each event's fields in the order SGLang's pydantic events dump them (sorted by name;
    ``response.*``: type, response, sequence_number; an ``output_text`` part as
    ``ResponseOutputText`` orders it), every event one of the ``openai`` client's stream
    events; and the engine's own stream (each sample's ``Progress``) gives the same events as
    its native chunks."""
    from openai.types.responses import ResponseOutputText, ResponseStreamEvent
    from pydantic import TypeAdapter

    from stages.engine.streaming import Progress

    tokenizer = char_tokenizer(string.printable, special=TAGS, template=QWEN_LIKE)
    settings = ChatSettings(tokenizer, None, {}, "qwen25", None)
    body = {"model": "m", "input": "ab", "tools": FUNCTIONS, "stream": True, **PLAIN}
    _, options = responses_request(body, settings, 4096)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    steps = ["Let me ", "Let me add.\n", "Let me add.\n" + call[:30], "Let me add.\n" + call]
    stop = {"type": "stop", "matched": None}

    def native(step: int) -> dict[str, Any]:
        meta = {"id": "r", "finish_reason": stop if step == len(steps) - 1 else None,
                "prompt_tokens": 3, "cached_tokens": 1, "completion_tokens": step + 1}  # fmt: skip
        return {"text": steps[step], "output_ids": list(range(step + 1)), "meta_info": meta}

    def progress(step: int) -> Progress:
        p = Progress("r", 3)
        p.ids, p.text, p.cached = list(range(step + 1)), steps[step], 1
        p.finish = stop if step == len(steps) - 1 else None
        return p

    def run(sample: Any) -> list[dict[str, Any]]:
        events = ResponseEvents(options)
        out = [e for step in range(len(steps)) for e in events([sample(step)])]
        return out + events.end()

    by_native, by_progress = run(native), run(progress)
    adapter = TypeAdapter(ResponseStreamEvent)
    text_part = list(ResponseOutputText.model_fields)
    for event in by_native:
        adapter.validate_python(event)
        keys = list(event)
        if event["type"].startswith("response.") and "response" in event:
            assert keys == ["type", "response", "sequence_number"]
        else:
            assert keys == sorted(keys), event["type"]
        part = event.get("part")
        if part is not None and part["type"] == "output_text":
            assert list(part) == text_part
    assert [e["sequence_number"] for e in by_native] == list(range(len(by_native)))

    def same(events: list[dict[str, Any]]) -> str:  # ids and times are drawn afresh
        text = json.dumps(events)
        for key in ("id", "item_id", "call_id", "created_at"):
            text = re.sub(rf'"{key}": ("[^"]*"|\d+)', f'"{key}": 0', text)
        return text

    assert same(by_progress) == same(by_native)
    usage = by_progress[-1]["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (3, len(steps))
    assert usage["input_tokens_details"]["cached_tokens"] == 1


@pytest.mark.timeout(60)
def test_metadata_past_64_bits_comes_back_as_it_went(engine: Engine, model) -> None:
    """A request read as FastAPI reads it keeps an integer past 64 bits, and the answer that
    echoes it (``metadata``) writes it as SGLang's pydantic writes it (orjson cannot: the
    answer was a 500); NaN is written as null, as orjson writes it."""
    raw = (
        b'{"model": "%s", "input": "ab", "max_output_tokens": 2, "temperature": 0,'
        b' "metadata": {"big": 1180591620717411303424, "small": -9223372036854775809}}'
        % model.encode()
    )
    status, answer = engine.request("POST", "/v1/responses", raw=raw)
    assert status == 200, answer
    assert answer["metadata"] == {"big": 2**70, "small": -(2**63) - 1}
    from stages.engine.request_body import dumps

    assert dumps({"a": 2**70, "b": float("nan"), "c": "é"}) == (
        b'{"a":1180591620717411303424,"b":null,"c":"\xc3\xa9"}'
    )
