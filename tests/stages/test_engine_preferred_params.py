"""``--preferred-sampling-params`` (``stages.engine.preferred_params``): merged under a request's
own sampling parameters as SGLang 0.5.23's ``TokenizerManager._create_tokenized_object`` merges
them, so on each OpenAI-compatible route only the keys its SGLang builder leaves out take the
preferred values (``serving_completions._build_sampling_params``,
``ChatCompletionRequest.to_sampling_params``, ``ResponsesRequest.to_sampling_params``,
``OpenAIServingOllama._convert_options_to_sampling_params``). The engine-level behaviour is in
``test_engine_sglang_flags.py`` and ``test_engine_in_process.py``."""

from __future__ import annotations

import argparse

import pytest

from stages.engine.openai_api import ROUTE_KEYS
from stages.engine.preferred_params import parse, with_preferred

PREFERRED = {
    "temperature": 0.3, "max_new_tokens": 3, "top_k": 5, "json_schema": '{"type": "object"}',
    "spaces_between_special_tokens": False, "stop_regex": "x+",
}  # fmt: skip


def _taken(route: str, own: dict | None = None) -> set[str]:
    body = {"input_ids": [1, 2], "sampling_params": dict(own or {})}
    merged = with_preferred(body, PREFERRED, ROUTE_KEYS[route])
    assert body["sampling_params"] == dict(own or {})  # the caller's body is left alone
    return {k for k, v in merged["sampling_params"].items() if PREFERRED.get(k) == v}


def test_each_openai_route_takes_only_the_keys_its_sglang_builder_leaves_out() -> None:
    # completions sets json_schema (null when unset), not spaces_between_special_tokens
    assert _taken("completions") == {"spaces_between_special_tokens"}
    # chat: json_schema only with a response_format; it sets spaces_between_special_tokens
    assert _taken("chat") == _taken("messages") == {"json_schema"}
    # responses sets temperature, top_p, max_new_tokens, the penalties and stop; top_k,
    # min_p and repetition_penalty only when the request gives them
    assert _taken("responses") == {"top_k", "json_schema", "spaces_between_special_tokens",
                                   "stop_regex"}  # fmt: skip
    assert _taken("responses", {"top_k": 7}) == {"json_schema", "spaces_between_special_tokens",
                                                "stop_regex"}  # fmt: skip
    # Ollama's routes set max_new_tokens (2048) and what the request's options name
    assert _taken("ollama_chat") == set(PREFERRED) - {"max_new_tokens"}
    assert _taken("ollama_generate", {"temperature": 1.0}) == set(PREFERRED) - {
        "max_new_tokens", "temperature"
    }  # fmt: skip
    assert set(ROUTE_KEYS) == {"completions", "chat", "messages", "responses", "ollama_chat",
                               "ollama_generate"}  # the scoring routes take none  # fmt: skip


def test_a_native_body_takes_every_key_it_leaves_out_entry_by_entry() -> None:
    body = {"input_ids": [[1], [2]], "sampling_params": [{"temperature": 1.0}, {}, "bad"]}
    merged = with_preferred(body, {"temperature": 0.3, "top_k": 5})
    assert merged["sampling_params"] == [
        {"temperature": 1.0, "top_k": 5}, {"temperature": 0.3, "top_k": 5}, "bad",
    ]  # (the route's parser refuses the entry that is no object)  # fmt: skip
    assert with_preferred({"text": "a"}, {"top_k": 5})["sampling_params"] == {"top_k": 5}
    assert with_preferred({"text": "a", "sampling_params": 3}, {"top_k": 5})["sampling_params"] == 3
    assert with_preferred([1], {"top_k": 5}) == [1] and with_preferred({"a": 1}, None) == {"a": 1}


def test_the_flags_value_is_a_json_object_without_a_watermark_or_an_n() -> None:
    assert parse('{"temperature": 0.6, "n": 1}') == {"temperature": 0.6, "n": 1}
    for text, words in (
        ("{", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"watermark": {}}', "watermark is not supported in --preferred-sampling-params"),
        ('{"n": 2}', "the samples a request asks for are its own"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)
