"""``--enable-cache-report`` on the built-in engine as a real server: the ``/v1`` answers'
``usage.prompt_tokens_details.cached_tokens``, as SGLang 0.5.23 reports them
(``usage_processor.calculate_response_usage`` and ``calculate_streaming_usage``: each prompt's
cached tokens once, whatever ``n``; ``PromptTokensDetails``; a completion stream's usage chunk
without its null fields, a chat stream's with them), through the ``openai`` client; and the
cached tokens' details every engine gives: ``meta_info.cached_tokens_details``
(``OutputStreamer.get_cached_tokens_details``) and the ``/v1`` routes' ``sglext`` with
``return_cached_tokens_details`` (``serving_completions``/``serving_chat``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_byte_model

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
TEXT = "the same long prompt, again and again, so that its prefix is cached"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("cache_report")
    model = make_byte_model(folder / "model")
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATE)
    with builtin_engine(
        model, "--enable-cache-report", "--chat-template", str(template)
    ) as found:  # fmt: skip
        yield found


@pytest.mark.timeout(60)
def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first = client.completions.create(model="m", prompt=TEXT, max_tokens=2, n=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    again = client.completions.create(model="m", prompt=TEXT, max_tokens=2, n=2)
    native = requests.post(
        url + "/generate", json={"text": TEXT, "sampling_params": {"max_new_tokens": 1}}, timeout=30
    ).json()
    cached = native["meta_info"]["cached_tokens"]
    assert 0 < cached < again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == cached  # once for n = 2
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2}
    raw = requests.post(url + "/v1/completions", json=body, timeout=30).json()
    # PromptTokensDetails' serializer leaves the null multimodal counts out
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    stream = client.completions.create(
        model="m", prompt=TEXT, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == cached
    assert last.usage.prompt_tokens_details.model_extra == {}
    messages = [{"role": "user", "content": TEXT}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    streamed = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert list(streamed)[-1].usage.prompt_tokens_details.cached_tokens > 0


def _events(answer: requests.Response) -> list[dict[str, Any]]:
    """A stream's ``data:`` chunks, each with its ``event:`` name (``__event``) if it has one."""
    out = []
    for event in answer.text.split("\n\n"):
        name = None
        if event.startswith("event: "):
            head, event = event.split("\n", 1)
            name = head[len("event: ") :]
        if event.startswith("data: {"):
            out.append({**json.loads(event[len("data: ") :]), "__event": name})
    return out


def _post(url: str, path: str, body: dict, **headers: str) -> requests.Response:
    answer = requests.post(url + path, json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.timeout(60)
def test_generate_gives_the_cached_tokens_details_in_every_answer_and_chunk(url: str) -> None:
    """``meta_info.cached_tokens_details`` (SGLang 0.5.23: ``{device, host}`` when some of the
    prompt was cached, every token from the device's cache here; null when none), after
    ``cached_tokens``, in answers and in each streamed chunk, whatever the cache report."""
    text = "a prompt of its own for the details, long enough to leave a cached prefix"
    body = {"text": text, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    cold = _post(url, "/generate", body).json()["meta_info"]
    assert cold["cached_tokens"] == 0 and cold["cached_tokens_details"] is None
    # in SGLang's order (TokenizerManager._handle_batch_output), Inflight's per-token versions
    # and cached prefix's version after SGLang's versions and cache details
    assert list(cold) == [
        "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions",
        "output_token_weight_versions", "cached_tokens_details", "cached_weight_version",
        "e2e_latency", "response_sent_to_client_ts",
    ]  # fmt: skip
    scored = _post(url, "/generate", {**body, "return_logprob": True, "top_logprobs_num": 2})
    keys = list(scored.json()["meta_info"])
    assert keys[5:10] == [
        "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
        "input_top_logprobs", "output_top_logprobs",
    ] and keys[10] == "reasoning_tokens"  # fmt: skip
    warm = _post(url, "/generate", body).json()["meta_info"]
    assert warm["cached_tokens"] > 0
    assert warm["cached_tokens_details"] == {"device": warm["cached_tokens"], "host": 0}
    chunks = _events(_post(url, "/generate", {**body, "stream": True}))
    # a chunk before the last (one a slow reader got merged into the last has the last's)
    first = chunks[0]["meta_info"]
    assert first["finish_reason"] is not None or list(first) == [
        "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "cached_tokens_details",
        "response_sent_to_client_ts",
    ]  # fmt: skip
    assert chunks and all(
        c["meta_info"]["cached_tokens_details"] == {"device": warm["cached_tokens"], "host": 0}
        for c in chunks
    )


@pytest.mark.timeout(60)
def test_the_v1_routes_give_the_cached_tokens_details_in_sglext_when_asked(url: str) -> None:
    """``return_cached_tokens_details``: the answer's ``sglext.cached_tokens_details`` (its first
    choice's) when some of the prompt was cached, nothing otherwise; streamed, a chunk of its
    own after the choices' last, before the usage chunk (the chat route's with the ids it was
    asked for, split from them with ``x-sglext-ids-framed: 1``)."""
    text = "yet another prompt, cached for the sglext of the v1 routes"
    native = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    completion = {"model": "m", "prompt": text, "max_tokens": 2, "n": 2,
                  "return_cached_tokens_details": True}  # fmt: skip
    cold = _post(url, "/v1/completions", completion).json()
    assert "sglext" not in cold  # nothing was cached: no details
    cached = _post(url, "/generate", native).json()["meta_info"]["cached_tokens"]
    details = {"device": cached, "host": 0}
    warm = _post(url, "/v1/completions", completion).json()
    assert list(warm)[-1] == "sglext" and warm["sglext"] == {"cached_tokens_details": details}
    unasked = {**completion, "return_cached_tokens_details": False}
    assert "sglext" not in _post(url, "/v1/completions", unasked).json()
    streamed = _events(
        _post(url, "/v1/completions",
              {**completion, "stream": True, "stream_options": {"include_usage": True}})
    )  # fmt: skip
    *_, ext, usage = streamed
    assert ext["choices"] == [] and ext["usage"] is None and ext["object"] == "text_completion"
    assert ext["sglext"] == {"cached_tokens_details": details} and "sglext" not in usage
    # the chat route: with the prompt's ids, in SglExt's order; framed, in two events
    template_ids = requests.post(
        url + "/v1/tokenize", json={"model": "m", "messages": [{"role": "user", "content": text}]},
        timeout=30,
    ).json()["tokens"]  # fmt: skip
    chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "return_cached_tokens_details": True, "return_input_ids_in_sglext": True}  # fmt: skip
    _post(url, "/v1/chat/completions", chat)  # its prompt cached
    whole = _post(url, "/v1/chat/completions", chat).json()
    assert list(whole["sglext"]) == ["cached_tokens_details", "input_ids"]
    assert whole["sglext"]["input_ids"] == template_ids
    chat_cached = whole["sglext"]["cached_tokens_details"]["device"]
    assert whole["sglext"]["cached_tokens_details"] == {"device": chat_cached, "host": 0}
    assert chat_cached == whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    plain = _events(_post(url, "/v1/chat/completions", {**chat, "stream": True}))
    assert plain[-1]["sglext"] == whole["sglext"] and plain[-1]["__event"] is None
    framed = _events(
        _post(url, "/v1/chat/completions", {**chat, "stream": True}, **{"x-sglext-ids-framed": "1"})
    )
    *_, rest, ids = framed
    assert rest["sglext"] == {"cached_tokens_details": whole["sglext"]["cached_tokens_details"]}
    assert rest["__event"] is None and rest["choices"] == []
    assert ids["sglext"] == {"input_ids": template_ids} and ids["__event"] == "sglext_ids"
    wrong = requests.post(
        url + "/v1/completions", json={**completion, "return_cached_tokens_details": "maybe"},
        timeout=30,
    )  # fmt: skip
    assert wrong.status_code == 400 and wrong.json()["type"] == "Bad Request"
    assert wrong.json()["message"].startswith("return_cached_tokens_details: Input should be")


@pytest.mark.timeout(60)
def test_chat_streams_count_cached_tokens_in_each_usage(url: str) -> None:
    """``stream_options.continuous_usage_stats`` with the cache report: each chat chunk's
    ``usage`` has the choice's ``prompt_tokens_details`` (``_continuous_usage_cached_details``);
    the role's and the finish's chunks have none (``build_sse_content`` without usage); the
    last usage chunk keeps its null fields (``model_dump_json``), a completion stream's does
    not (``exclude_none=True``)."""
    messages = [{"role": "user", "content": TEXT}]
    body = {"model": "m", "messages": messages, "max_tokens": 3, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    _post(url, "/v1/chat/completions", body)  # its prompt cached
    chunks = _events(_post(url, "/v1/chat/completions", body))
    *choices, last = chunks
    role, *deltas, finish = choices
    assert role["choices"][0]["delta"]["role"] == "assistant" and "usage" not in role
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    counts = [d["usage"]["completion_tokens"] for d in deltas]  # a token a delta, or more
    assert counts == sorted(set(counts)) and counts[-1] == 3  # (part of a character waits)
    cached = {d["usage"]["prompt_tokens_details"]["cached_tokens"] for d in deltas}
    assert len(cached) == 1 and cached.pop() > 0
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert last["usage"]["completion_tokens_details"] is None  # written out
    completion = {"model": "m", "prompt": TEXT, "max_tokens": 2, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
    usage = _events(_post(url, "/v1/completions", completion))[-1]["usage"]
    assert "completion_tokens_details" not in usage


@pytest.mark.timeout(90)
def test_default_include_usage_ends_every_stream_with_its_usage(url: str, tmp_path: Path) -> None:
    """``--stream-response-default-include-usage`` (SGLang 0.5.23's ``should_include_usage``:
    ``stream_options.include_usage or`` the flag, and the flag alone without
    ``stream_options``): a completion or chat stream the ``openai`` client sends without
    ``stream_options`` ends with the usage chunk, which a stream without the flag lacks; an
    answer not streamed is the same."""
    model = make_byte_model(tmp_path / "model")
    template = tmp_path / "chat_template.jinja"
    template.write_text(TEMPLATE)
    common = {"model": "m", "max_tokens": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": TEXT}]
    with builtin_engine(
        model, "--stream-response-default-include-usage", "--chat-template", str(template)
    ) as flagged:  # fmt: skip
        for base, usage_chunk in ((flagged, True), (url, False)):
            client = openai.OpenAI(base_url=base + "/v1", api_key="none")
            streams = (
                client.completions.create(prompt=TEXT, stream=True, **common),
                client.chat.completions.create(messages=messages, stream=True, **common),
            )
            for stream in streams:
                *_, last = list(stream)
                if usage_chunk:
                    assert last.choices == [] and last.usage.completion_tokens == 3
                    assert last.usage.prompt_tokens > 0
                else:
                    assert last.choices and last.usage is None
        client = openai.OpenAI(base_url=flagged + "/v1", api_key="none")
        asked_not = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": False}, **common
        )
        assert list(asked_not)[-1].usage.total_tokens > 3  # (False or the flag)
        whole = client.chat.completions.create(messages=messages, **common)
        assert whole.usage.completion_tokens == 3
