"""The type of each ``/v1/completions`` and ``/v1/chat/completions`` field, as SGLang 0.5.23's
pydantic request models read it (``protocol.py``; ``stages.engine.request_fields``): pydantic's
lax conversions taken and used, other types refused in the shape of SGLang's
``RequestValidationError`` handler (``http_server.py``: 400, ``type: "Bad Request"``, ``param:
null``), counted, and the engine serving on. ``test_engine_sglang_fields.py`` compares every
field with SGLang's own models where they import."""

from __future__ import annotations

import json

import pytest
import requests

from stages.engine import request_fields
from tests.stages.test_engine_chat import (
    HELLO,
    chat_engine,  # noqa: F401
)
from tests.stages.test_engine_server import Engine

PROMPT = "w11 w12 w13"


def _post(served: Engine, route: str, body: object) -> tuple[int, dict]:
    answer = requests.post(served.url + route, json=body, timeout=30)
    return answer.status_code, answer.json()


def _without_ids(answer: object, floats: list[float]) -> object:
    """An answer less what differs from one request to the next: its id and time; its
    log-probs go to ``floats`` (a cached prompt is computed in other shapes: the last digits
    differ)."""
    if isinstance(answer, dict):
        return {k: _without_ids(v, floats) for k, v in answer.items() if k not in ("id", "created")}
    if isinstance(answer, list):
        return [_without_ids(v, floats) for v in answer]
    if isinstance(answer, float):
        floats.append(answer)
        return "float"
    return answer


@pytest.mark.timeout(60)
def test_what_pydantic_converts_is_taken_and_used(chat_engine: Engine) -> None:  # noqa: F811
    engine = chat_engine
    typed = {"n": 2, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
             "ignore_eos": True}  # fmt: skip
    lax = {"n": "2", "max_tokens": 3.0, "temperature": "0", "logprobs": "yes",
           "top_logprobs": " 2", "ignore_eos": 1}  # fmt: skip
    status, want = _post(engine, "/v1/chat/completions", {"messages": HELLO, **typed})
    assert status == 200 and len(want["choices"]) == 2
    assert [len(c["logprobs"]["content"]) for c in want["choices"]] == [3, 3]
    assert len(want["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    status, got = _post(engine, "/v1/chat/completions", {"messages": HELLO, **lax})
    got_floats: list[float] = []
    want_floats: list[float] = []
    assert status == 200
    assert _without_ids(got, got_floats) == _without_ids(want, want_floats)
    assert got_floats == pytest.approx(want_floats, abs=1e-5)
    # a stream asked for with 1, its usage with "true" (StreamOptions' Optional[bool])
    body = {"messages": HELLO, "max_tokens": 2, "stream": 1,
            "stream_options": {"include_usage": "true"}}  # fmt: skip
    events = requests.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    lines = [line for line in events.text.splitlines() if line.startswith("data: ")]
    assert events.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 2
    # completions: max_tokens 2.0 is 2, echo "on" true, logprobs "1" one alternative each
    status, got = _post(
        engine, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2.0, "echo": "on",
                                    "logprobs": "1", "temperature": 0}
    )  # fmt: skip
    choice = got["choices"][0]
    assert status == 200 and choice["text"].startswith(PROMPT), got
    assert got["usage"]["completion_tokens"] == 2
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][-2:])


@pytest.mark.timeout(60)
def test_other_types_are_refused_as_sglangs_validation_refuses_them(
    chat_engine: Engine,  # noqa: F811
) -> None:
    engine = chat_engine
    before = requests.get(engine.url + "/server_info", timeout=10).json()["refused_requests"]
    chat_cases = [
        ({"n": None}, "n: Input should be a valid integer"),
        ({"stream": None}, "stream: Input should be a valid boolean"),
        ({"logprobs": "maybe"}, "logprobs: Input should be a valid boolean"),
        ({"user": 1}, "user: Input should be a valid string"),
        ({"max_completion_tokens": []}, "max_completion_tokens: Input should be a valid integer"),
        ({"stream_options": False}, "stream_options: Input should be a valid dictionary"),
        ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage: "),
        ({"parallel_tool_calls": "x"}, "parallel_tool_calls: Input should be a valid boolean"),
        ({"task": "sing"}, "task: Input should be 'action'"),
        ({"bootstrap_port": "x"}, "bootstrap_port.list[nullable[int]]: Input should be"),
        ({"session_id": []}, "session_id: Input should be a valid string"),
        ({"video_config": 1}, "video_config: Input should be a valid dictionary"),
        ({"stop": 5}, "stop.list[str]: Input should be a valid list; stop.str: "),
        ({"max_tokens": 2.5}, "max_tokens: Input should be a valid integer, got a number"),
        ({"messages": "hi"}, "messages: Input should be a valid list"),
    ]
    completion_cases = [
        ({"max_tokens": 0}, "max_tokens: Value error, max_tokens must be positive"),
        ({"temperature": None}, "temperature: Input should be a valid number"),
        ({"suffix": 1}, "suffix: Input should be a valid string"),
        ({"logit_bias": {"5": "strong"}}, "logit_bias.5: Input should be a valid number"),
        ({"custom_labels": {"a": 1}}, "custom_labels.a: Input should be a valid string"),
        ({"prompt": None}, "prompt.list[int]: Input should be a valid list"),
    ]
    for route, base, cases in (
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1}, chat_cases),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, completion_cases),
    ):
        for extra, words in cases:
            status, answer = _post(engine, route, {**base, **extra})
            assert status == 400 and words in answer["message"], (extra, answer)
            assert answer == {"object": "error", "message": answer["message"],
                              "type": "Bad Request", "param": None, "code": 400}  # fmt: skip
    status, answer = _post(engine, "/v1/completions", [PROMPT])
    assert (status, answer["message"]) == (400, "Input should be a valid dictionary")
    after = requests.get(engine.url + "/server_info", timeout=10).json()["refused_requests"]
    for route, more in (("chat/completions", len(chat_cases)), ("completions", 7)):
        key = f"POST /v1/{route} 400"
        assert after.get(key, 0) - before.get(key, 0) == more, (key, after)
    status, answer = _post(engine, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


def test_the_message_names_each_field_pydantic_refused() -> None:
    with pytest.raises(ValueError) as info:
        request_fields.checked_completion({"prompt": "x", "n": "two", "echo": [], "best_of": 1})
    assert str(info.value) == (
        "echo: Input should be a valid boolean; "
        "n: Input should be a valid integer, unable to parse string as an integer"
    )
    body = {"prompt": "x", "n": "2", "bogus": object()}  # other keys kept as they are
    assert request_fields.checked_completion(body) is body and body["n"] == 2


def test_the_messages_are_a_list_and_their_contents_the_chat_routes_to_check() -> None:
    # openai_chat answers an empty list (SGLang's "Messages cannot be empty.") and each message
    with pytest.raises(ValueError, match="messages: Input should be a valid list"):
        request_fields.checked_chat({"messages": None})
    assert request_fields.checked_chat({"messages": []}) == {"messages": []}
