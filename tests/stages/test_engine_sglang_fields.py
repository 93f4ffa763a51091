"""The request fields of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/tokenize``,
``/v1/detokenize``, ``/v1/responses``, ``/v1/score``, ``/v1/rerank``, ``/v1/embeddings``,
``/v1/classify``, ``/v1/messages`` (and ``count_tokens``) and Ollama's ``/api/chat``,
``/api/generate`` and ``/api/show`` (``stages.engine.request_fields``) against SGLang
0.5.23's own pydantic models: the same fields in the same order, and for every field and a
spread of JSON values, the same answer: refused by both, or taken by both with the same
converted value.

Skipped unless SGLang's protocol module imports (``test_engine_sglang_shapes.py``'s docstring
says how).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
anthropic: Any = pytest.importorskip("sglang.srt.entrypoints.anthropic.protocol")
ollama: Any = pytest.importorskip("sglang.srt.entrypoints.ollama.protocol")

from stages.engine import request_fields  # noqa: E402

VALUES = [
    None, True, False, 0, 1, -1, 2, 2.0, 2.5, 0.5, "x", "1", "0", "yes", "off", "2.0", "last",
    "auto", "none", "high", "selected", [], ["x"], [1], [None], [[1]], [1, "x"], {}, {"a": 1},
    {"a": "1"}, {"include_usage": "1"}, {"include_usage": None, "continuous_usage_stats": 0},
    {"function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}},
    [{"type": "function", "function": {"name": "f", "parameters": {}}}], [{"function": {}}],
    " 1", "1.0", "1e3", "inf", "nan", "TRUE", "", 3.0, -0.0, 1e20, 2**70, float("inf"), [""],
    [[]], [1.0], [True], [None, "x"], {"a": None}, {"a": [1]}, {"include_usage": "yes", "b": 1},
    {"function": {"name": None}, "type": "function"}, {"function": {"name": "f"}, "type": "x"},
    [{"type": 1, "function": {"name": "f"}}], [{"function": {"name": "f", "strict": "no"}}],
    "flex", "disabled", ["message.output_text.logprobs"], ["bogus"], {"effort": "none"},
    {"effort": "low", "summary": "auto", "x": 1}, {"effort": 1}, {"summary": "long"},
    [[1.0, 2]], [[[1.0]], None], [[["x"]]], ["a", ["b"]], [["a"]], ["a", [{"type": "text"}]],
    "json", "5m", 300, "low", "", [{"role": "user", "content": "x"}], [{"role": "user"}],
    [{"role": 1, "content": "x"}], [{"role": "user", "content": "x", "images": "a"}],
    # what a body parsed as Starlette parses it may hold (NaN, Infinity, 64 bits and more)
    float("nan"), -float("inf"), -(2**70), 2**63, -(2**63) - 1, [float("nan")], [2**70],
    {"a": float("nan")},
]  # fmt: skip
# a field checked by the route itself (its SGLang message): typed loosely here
ROUTES_OWN = {
    "ChatCompletionRequest": {"messages", "tools", "tool_choice", "response_format",
                              "reasoning_effort", "chat_template_kwargs"},
    "CompletionRequest": {"response_format"},
    "TokenizeRequest": {"messages"},
    "DetokenizeRequest": set(),
    "ResponsesRequest": {"input", "tools", "text"},
    "ScoringRequest": set(),
    "V1RerankReqInput": {"query", "documents"},
    "EmbeddingRequest": {"input"},
    "ClassifyRequest": set(),
    "AnthropicMessagesRequest": {"messages", "system", "thinking", "tool_choice", "tools",
                                 "output_config"},
    "AnthropicCountTokensRequest": {"messages", "system", "thinking", "tool_choice", "tools",
                                    "output_config"},
    "OllamaChatRequest": {"messages"},  # typed, with content optional (request_fields says why)
    "OllamaGenerateRequest": set(),
    "OllamaShowRequest": set(),
}  # fmt: skip
CASES = [
    (protocol.CompletionRequest, request_fields.checked_completion, {"prompt": "hi"}),
    (protocol.ChatCompletionRequest, request_fields.checked_chat, {"messages": []}),
    (protocol.TokenizeRequest, request_fields.checked_tokenize, {"prompt": "hi"}),
    (protocol.DetokenizeRequest, request_fields.checked_detokenize, {"tokens": [1]}),
    (protocol.ResponsesRequest, request_fields.checked_responses, {"input": "hi"}),
    (protocol.ScoringRequest, request_fields.checked_score, {}),
    (protocol.V1RerankReqInput, request_fields.checked_rerank, {"query": "q", "documents": []}),
    (protocol.EmbeddingRequest, request_fields.checked_embedding, {"input": "hi"}),
    (protocol.ClassifyRequest, request_fields.checked_classify, {"input": "hi"}),
    (
        anthropic.AnthropicMessagesRequest,
        request_fields.checked_messages,
        {"model": "m", "messages": [], "max_tokens": 4},
    ),
    (
        anthropic.AnthropicCountTokensRequest,
        request_fields.checked_count_tokens,
        {"model": "m", "messages": []},
    ),
    (ollama.OllamaChatRequest, request_fields.checked_ollama_chat, {"model": "m", "messages": []}),
    (
        ollama.OllamaGenerateRequest,
        request_fields.checked_ollama_generate,
        {"model": "m", "prompt": "hi"},
    ),
    (ollama.OllamaShowRequest, request_fields.checked_ollama_show, {"model": "m"}),
]
ADAPTERS = {
    "CompletionRequest": request_fields.CompletionFields,
    "ChatCompletionRequest": request_fields.ChatFields,
    "TokenizeRequest": request_fields.TokenizeFields,
    "DetokenizeRequest": request_fields.DetokenizeFields,
    "ResponsesRequest": request_fields.ResponsesFields,
    "ScoringRequest": request_fields.ScoreFields,
    "V1RerankReqInput": request_fields.RerankFields,
    "EmbeddingRequest": request_fields.EmbeddingFields,
    "ClassifyRequest": request_fields.ClassifyFields,
    "AnthropicMessagesRequest": request_fields.MessagesFields,
    "AnthropicCountTokensRequest": request_fields.CountTokensFields,
    "OllamaChatRequest": request_fields.OllamaChatFields,
    "OllamaGenerateRequest": request_fields.OllamaGenerateFields,
    "OllamaShowRequest": request_fields.OllamaShowFields,
}


def _sglang(model: Any, body: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, model.model_validate(copy.deepcopy(body))
    except ValueError:  # pydantic's ValidationError
        return False, None


def _ours(check: Any, body: dict[str, Any]) -> tuple[bool, Any]:
    try:
        return True, check(copy.deepcopy(body))
    except ValueError:
        return False, None


def _plain(value: Any) -> Any:
    """A model's value as JSON-like data (a nested model: the fields it was given)."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_unset=True))
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _same(theirs: Any, ours: Any) -> bool:
    """Equal as JSON-like data, NaN included, with the same types (1 is not 1.0 or True)."""
    return repr(_plain(theirs)) == repr(_plain(ours))


@pytest.mark.parametrize("model", [case[0] for case in CASES], ids=lambda m: m.__name__)
def test_the_fields_are_sglangs_in_its_order(model: Any) -> None:
    assert list(ADAPTERS[model.__name__].__annotations__) == list(model.model_fields)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "check", "base"), CASES, ids=[c[0].__name__ for c in CASES])
def test_every_field_is_refused_or_converted_as_sglang_does(
    model: Any, check: Any, base: dict[str, Any]
) -> None:
    own = ROUTES_OWN[model.__name__]
    differences = []
    for field in model.model_fields:
        if field in own:
            continue
        for value in VALUES:
            body = {**base, field: value}
            (took, theirs), (ours_took, ours) = _sglang(model, body), _ours(check, body)
            if took != ours_took:
                differences.append((field, value, "sglang takes it" if took else "sglang refuses"))
            elif took and field in ours and not _same(getattr(theirs, field), ours[field]):
                differences.append((field, value, getattr(theirs, field), ours[field]))
    assert not differences, differences


def test_ollama_messages_are_sglangs_but_a_missing_content_is_empty() -> None:
    base = {"model": "m"}
    for value in VALUES:
        body = {**base, "messages": value}
        (took, _), (ours_took, _) = (
            _sglang(ollama.OllamaChatRequest, body),
            _ours(request_fields.checked_ollama_chat, body),
        )
        lacking = isinstance(value, list) and any(
            isinstance(m, dict) and "content" not in m for m in value
        )
        assert took == ours_took or (lacking and ours_took), value
    assert not _sglang(ollama.OllamaChatRequest, {**base, "messages": [{"role": "user"}]})[0]
