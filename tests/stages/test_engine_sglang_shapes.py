"""The ``/v1`` answers and stream chunks of the built-in engine, held to SGLang's own response
models: each answer is read by the class SGLang 0.5.23 builds it with and written back as SGLang
writes it, and must come out the same, key for key and in order (fields, nesting, nulls
written out or left out).

- ``protocol.CompletionResponse``, ``ChatCompletionResponse``, ``ModelList``: ``model_dump``;
- a completion stream's chunks, ``CompletionStreamResponse`` (its usage chunk with
  ``exclude_none``, as ``serving_completions`` dumps it);
- a chat stream's role, content and finish chunks, ``sse_utils.StreamChunk`` (msgspec, nulls of
  the delta left out); its tool-call, hidden-state, sglext and usage chunks, and with tools its
  content too, ``ChatCompletionStreamResponse``;
- Anthropic's ``/v1/messages``, whole and as events, with ``exclude_none`` (``anthropic/
  serving.py``); Ollama's ``/api/chat`` and ``/api/generate`` not streamed, and ``/api/tags``
  (its streams' last line has the counts the Ollama API gives, which SGLang's leaves out);
- a pooling engine's cross-encoder ``/v1/rerank`` entries, ``protocol.RerankResponse``.

SGLang is not installed here (its wheels pin a CUDA torch), so this module is skipped unless its
``protocol`` module imports: in SGLang's own environment with Inflight installed, or from its
wheel's source (``pip download sglang==0.5.23 --no-deps``, unzip, then ``pip install --target
DEPS msgspec pybase64`` and what else its import asks for; ``PYTHONPATH=SRC:DEPS pytest
tests/stages/test_engine_sglang_shapes.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests

protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
sse_utils = pytest.importorskip("sglang.srt.entrypoints.openai.sse_utils")
anthropic = pytest.importorskip("sglang.srt.entrypoints.anthropic.protocol")
ollama = pytest.importorskip("sglang.srt.entrypoints.ollama.protocol")
msgspec = pytest.importorskip("msgspec")

from stages.engine.openai_chat import chat_response, chat_stream  # noqa: E402
from tests.stages.engine_setup import builtin_engine  # noqa: E402
from tests.stages.test_engine_cache_report import TEMPLATE, TEXT  # noqa: E402
from tests.stages.test_engine_chat import CALL, OPTIONS, _native  # noqa: E402
from tests.stages.tiny_model import make_byte_model  # noqa: E402

MESSAGES = [{"role": "user", "content": TEXT}]
_ENCODER = msgspec.json.Encoder() if msgspec else None


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("sglang_shapes")
    model = make_byte_model(folder / "model")
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATE)
    with builtin_engine(
        model, "--enable-cache-report", "--enable-return-hidden-states",
        "--chat-template", str(template),
    ) as found:  # fmt: skip
        yield found


def _as_sglang_writes(model: Any, answer: dict[str, Any], **dump: Any) -> dict[str, Any]:
    """``answer`` read by SGLang's class ``model`` and written back as SGLang writes it."""
    if model is sse_utils.StreamChunk:
        decoded = msgspec.json.decode(json.dumps(answer), type=model)
        return json.loads(_ENCODER.encode(decoded))
    return model.model_validate(answer).model_dump(mode="json", **dump)


def _differences(model: Any, answers: list[dict[str, Any]], **dump: Any) -> list[str]:
    out = []
    for answer in answers:
        again = _as_sglang_writes(model, answer, **dump)
        if json.dumps(again) != json.dumps(answer):  # order too
            out.append(f"{model.__name__}:\n  ours   {answer}\n  SGLang {again}")
    return out


def _chunks(url: str, path: str, body: dict, **headers: str) -> list[dict[str, Any]]:
    answer = requests.post(url + path, json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    events = [e.split("data: ", 1)[1] for e in answer.text.split("\n\n") if "data: {" in e]
    return [json.loads(e) for e in events]


def _chat_model(chunk: dict[str, Any]) -> Any:
    """The class SGLang builds a chat stream's chunk with (``serving_chat``)."""
    if not chunk["choices"]:  # the sglext and usage chunks
        return protocol.ChatCompletionStreamResponse
    delta = chunk["choices"][0]["delta"]
    if "tool_calls" in delta or "hidden_states" in delta:
        return protocol.ChatCompletionStreamResponse
    return sse_utils.StreamChunk  # build_sse_content's


@pytest.mark.timeout(120)
def test_completions_are_written_as_sglang_writes_them(url: str) -> None:
    diffs: list[str] = []
    for body in (
        {"prompt": TEXT, "max_tokens": 3},
        {"prompt": TEXT, "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": [TEXT, "x"], "max_tokens": 2, "n": 2, "return_cached_tokens_details": True},
        {"prompt": TEXT, "max_tokens": 2, "return_token_ids": True, "stop": ["a", "e"]},
        {"prompt": TEXT, "max_tokens": 2, "return_hidden_states": True},
    ):
        body = {"model": "m", **body}
        whole = requests.post(url + "/v1/completions", json=body, timeout=30).json()
        diffs += _differences(protocol.CompletionResponse, [whole])
        streamed = _chunks(url, "/v1/completions", {**body, "stream": True,
                           "stream_options": {"include_usage": True}})  # fmt: skip
        *chunks, usage = streamed
        diffs += _differences(protocol.CompletionStreamResponse, chunks)
        diffs += _differences(protocol.CompletionStreamResponse, [usage], exclude_none=True)
    models = requests.get(url + "/v1/models", timeout=30).json()
    diffs += _differences(protocol.ModelList, [models])
    assert not diffs, "\n".join(diffs)


@pytest.mark.timeout(120)
def test_chat_answers_and_chunks_are_written_as_sglang_writes_them(url: str) -> None:
    diffs: list[str] = []
    for body in (
        {"max_tokens": 3},
        {"max_tokens": 3, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 4, "n": 3, "temperature": 1.0},
        {"max_tokens": 3, "return_input_ids_in_sglext": True,
         "return_cached_tokens_details": True},
        {"max_tokens": 2, "n": 2, "return_hidden_states": True},
    ):  # fmt: skip
        body = {"model": "m", "messages": MESSAGES, **body}
        whole = requests.post(url + "/v1/chat/completions", json=body, timeout=30).json()
        diffs += _differences(protocol.ChatCompletionResponse, [whole])
        for stream_options in (
            {"include_usage": True},
            {"include_usage": True, "continuous_usage_stats": True},
        ):
            streamed = {**body, "stream": True, "stream_options": stream_options}
            chunks = _chunks(url, "/v1/chat/completions", streamed)
            for chunk in chunks:
                diffs += _differences(_chat_model(chunk), [chunk])
    assert not diffs, "\n".join(diffs)


def test_tool_calls_are_written_as_sglang_writes_them() -> None:
    async def run() -> list[dict]:
        async def batches():
            yield [_native("ok <tool", None)]
            yield [_native("ok " + CALL, {"type": "stop", "matched": 1})]

        return [c async for batch in chat_stream(batches(), OPTIONS) for c in batch]

    role, *parsed, finish = asyncio.run(run())
    assert any("tool_calls" in c["choices"][0]["delta"] for c in parsed)
    assert any(c["choices"][0]["delta"].get("content") for c in parsed)
    # the role and the finish by build_sse_content; the content and the calls read out of it
    # by _process_tool_call_stream, with pydantic's model
    diffs = _differences(sse_utils.StreamChunk, [role, finish])
    diffs += _differences(protocol.ChatCompletionStreamResponse, parsed)
    whole = chat_response([_native("ok " + CALL, {"type": "stop", "matched": 1})], OPTIONS)
    assert whole["choices"][0]["message"]["tool_calls"]
    diffs += _differences(protocol.ChatCompletionResponse, [whole])
    assert not diffs, "\n".join(diffs)


@pytest.mark.timeout(120)
def test_messages_and_ollama_answers_are_written_as_sglang_writes_them(url: str) -> None:
    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "messages": MESSAGES}
    whole = requests.post(url + "/v1/messages", json=body, timeout=30).json()
    diffs = _differences(anthropic.AnthropicMessagesResponse, [whole], exclude_none=True)
    events = {
        "message_start": anthropic.MessageStartEvent,
        "message_delta": anthropic.MessageDeltaEvent,
        "message_stop": anthropic.MessageStopEvent,
        "content_block_start": anthropic.ContentBlockStartEvent,
        "content_block_delta": anthropic.ContentBlockDeltaEvent,
        "content_block_stop": anthropic.ContentBlockStopEvent,
    }
    streamed = _chunks(url, "/v1/messages", {**body, "stream": True})
    assert [e["type"] for e in streamed][-1] == "message_stop"
    for event in streamed:
        diffs += _differences(events[event["type"]], [event], exclude_none=True)
    counted = {"model": model, "messages": MESSAGES}
    count = requests.post(url + "/v1/messages/count_tokens", json=counted, timeout=30).json()
    diffs += _differences(anthropic.AnthropicCountTokensResponse, [count])
    options = {"num_predict": 3}
    chat = {"model": model, "messages": MESSAGES, "stream": False, "options": options}
    answer = requests.post(url + "/api/chat", json=chat, timeout=30).json()
    diffs += _differences(ollama.OllamaChatResponse, [answer])
    for prompt in (TEXT, ""):
        generate = {"model": model, "prompt": prompt, "stream": False, "options": options}
        answer = requests.post(url + "/api/generate", json=generate, timeout=30).json()
        diffs += _differences(ollama.OllamaGenerateResponse, [answer])
    tags = requests.get(url + "/api/tags", timeout=30).json()
    diffs += _differences(ollama.OllamaTagsResponse, [tags])
    assert not diffs, "\n".join(diffs)


@pytest.mark.timeout(90)
def test_a_cross_encoders_rerank_answers_are_sglangs_rerank_responses(tmp_path) -> None:
    """``/v1/rerank`` on a pooling engine (``serving_rerank``'s cross-encoder path): each entry
    one ``RerankResponse`` as SGLang writes it (its serializer leaves a null ``document`` out)."""
    from tests.stages.tiny_encoders import make_bert

    model = make_bert(tmp_path / "ce", "BertForSequenceClassification", seed=1)
    with builtin_engine(model) as found:
        for shown in (True, False):
            body = {"query": "w5 w6", "documents": ["w7", "w8 w9"], "return_documents": shown}
            answer = requests.post(found + "/v1/rerank", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            entries = answer.json()
            assert len(entries) == 2 and all(isinstance(e["meta_info"], dict) for e in entries)
            assert _differences(protocol.RerankResponse, entries) == []
