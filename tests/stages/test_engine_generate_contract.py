"""``/generate``'s two checks before its route (``stages.engine.generate_contract``), in the
words SGLang 0.5.23 answers with (each expected text below is its decoder's, from
``sglang/api/v1/api_types.py``; ``test_engine_sglang_generate_contract.py`` compares 20,000
random bodies with that decoder where it imports)."""

from __future__ import annotations

from typing import Any

import pytest

from stages.engine.generate_contract import GenerateFields, checked_generate, contract_error

SAMPLING_KEYS = (
    "`max_new_tokens`, `stop`, `stop_token_ids`, `stop_regex`, `temperature`, `top_p`, "
    "`top_k`, `min_p`, `frequency_penalty`, `presence_penalty`, `repetition_penalty`, "
    "`min_new_tokens`, `n`, `json_schema`, `regex`, `ebnf`, `structural_tag`, `ignore_eos`, "
    "`skip_special_tokens`, `spaces_between_special_tokens`, `no_stop_trim`, "
    "`stream_interval`, `logit_bias`, `sampling_seed`, `custom_params`, `beam_width`, "
    "`watermark`, `choice`"
)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text": "hi", "stream": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"text": 5}, "invalid type: integer `5`, expected a value or an array of values for "
                      "StringOrList"),
        ({"input_ids": [1, "x"]}, 'invalid type: string "x", expected i64'),
        ({"input_ids": [[1], 2]}, "invalid type: integer `2`, expected a sequence"),
        ({"input_ids": [1, True]}, "invalid type: boolean `true`, expected i64"),
        ({"input_ids": "12"}, 'invalid type: string "12", expected a value or an array of '
                              "values for TokenIdsOrList"),
        ({"text": "hi", "return_logprob": [True, 1]}, "invalid type: integer `1`, expected a "
                                                      "boolean"),
        ({"text": "hi", "top_logprobs_num": 2.0}, "invalid type: floating point `2.0`, "
         "expected a value or an array of values for Int64OrList"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": "2"}},
         'invalid type: string "2", expected i64'),
        ({"text": "hi", "sampling_params": {"temperature": True}},
         "invalid type: boolean `true`, expected f64"),
        ({"text": "hi", "sampling_params": {"bogus": 1}},
         f"unknown field `bogus`, expected one of {SAMPLING_KEYS}"),
        ({"text": "hi", "sampling_params": [{"n": 1}, 3]},
         "invalid type: integer `3`, expected struct SamplingParams"),
        ({"text": "hi", "sampling_params": "fast"}, 'invalid type: string "fast", expected a '
         "value or an array of values for SamplingParamsOrList"),
        ({"text": "hi", "sampling_params": {"watermark": {"on": True}}},
         "unknown field `on`, expected one of `enabled`, `key`, `context_window`"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"5": "x"}}},
         'invalid type: string "x", expected f64'),
        ({"text": "hi", "max_thinking_tokens": -1}, "invalid value: integer `-1`, expected u64"),
        ({"text": "hi", "return_prompt_token_ids": None}, "invalid type: null, expected a "
                                                          "boolean"),
        ({"text": "hi", "bootstrap_port": [1, None, "x"]}, 'invalid type: string "x", '
                                                           "expected i64"),
        ({"text": "hi", "custom_labels": {"team": 1}}, "invalid type: integer `1`, expected a "
                                                       "string"),
        ({"text": "hi", "images_config": {"prefix": None}}, "invalid type: null, expected a "
                                                            "string"),
        ({"text": "hi", "return_hidden_states": "last"}, 'invalid type: string "last", '
         "expected a value or an array of values for BoolOrList"),
    ],
)  # fmt: skip
def test_the_contract_gate_answers_in_sglangs_words(body: dict, words: str) -> None:
    assert contract_error(body) == words


def test_what_the_contract_takes() -> None:
    for body in (
        {"text": ["a", "b"], "rid": ["1", "2"], "return_logprob": [True, False]},
        {"input_ids": [], "sampling_params": [{"stop": ["x"], "temperature": 0}, {}]},
        {"input_ids": [[1, 2], []], "token_ids_logprob": [[3], [4]], "lora_path": [None, "a"]},
        {"text": "hi", "bogus": 1, "stream": None, "sampling_params": {"custom_params": [1]}},
        {"text": "hi", "image_data": 5, "kv_hints": "anything"},  # the route refuses them
    ):
        assert contract_error(body) is None, body


def test_generate_req_inputs_types_come_first_and_convert_as_pydantic_does() -> None:
    body = {"text": "hi", "stream": "yes", "logprob_start_len": "3", "priority": 2.0}
    assert checked_generate(body) is body
    assert body["stream"] is True and body["logprob_start_len"] == 3 and body["priority"] == 2
    for bad, words in (
        ({"text": 5}, "text.list[str]: Input should be a valid list; text.str: Input should be"),
        ({"input_ids": [1, 2.5]}, "input_ids: Value error, contains non-int64 element"),
        ({"input_ids": [[1], 2]}, "input_ids: Value error, row 1: must be list; got int"),
        ({"input_ids": [2**63]}, "input_ids: Value error, contains non-int64 element"),
        ({"sampling_params": "fast"}, "sampling_params.list[dict[str,any]]: Input should be"),
        ({"return_hidden_states": "full"}, "return_hidden_states.list[union[bool,literal["),
    ):
        with pytest.raises(ValueError) as info:
            checked_generate(bad)
        assert str(info.value).startswith(words), str(info.value)


def test_bytes_that_are_no_object_are_refused_as_fastapi_refuses_them() -> None:
    import json

    from stages.engine.generate_contract import read

    json_type, dataclass = "application/json", "Input should be a dictionary or an instance of "
    for raw, content_type, words in (
        (b"", json_type, "body: Field required"),
        (b"", None, "body: Field required"),
        (b'{"text": ', json_type, "body.9: JSON decode error"),
        (b'"hi"', json_type, dataclass + "GenerateReqInput"),
        # FastAPI (0.132 on) reads a body as JSON only when it is sent as JSON: else bytes
        (b'{"text": "hi"}', None, dataclass + "GenerateReqInput"),
        (b'{"text": "hi"}', "text/plain", dataclass + "GenerateReqInput"),
        (b'{"text": "hi"}', "application/x-www-form-urlencoded", dataclass + "GenerateReqInput"),
    ):
        body, refused = read(raw, content_type)
        assert body is None or not isinstance(body, dict)
        assert refused is not None and refused.status == 400
        answer = json.loads(refused.body)
        assert answer == {"object": "error", "message": words, "type": "Bad Request",
                          "param": None, "code": 400}  # fmt: skip
    for content_type in (
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/x+json",
    ):
        assert read(b'{"text": "hi"}', content_type) == ({"text": "hi"}, None)


def test_each_sglang_field_is_read_left_or_refused_unless_neutral() -> None:
    """Every field of ``GenerateReqInput`` and ``EmbeddingReqInput`` has its place in the
    routes' own checks (read, left as SGLang leaves it by default, or refused unless at its
    default); what is none of them is a key SGLang does not know (``ignored_fields``)."""
    from stages.engine import control_fields, encode_routes, protocol

    def keys(fields: Any) -> set[str]:
        return set(fields.__required_keys__ | fields.__optional_keys__)

    placed = [protocol._KNOWN_TOP, protocol._IGNORED_TOP, set(protocol._NEUTRAL_TOP)]
    assert set().union(*placed) == keys(GenerateFields)
    assert sum(map(len, placed)) == len(keys(GenerateFields))  # each in one place
    assert set(encode_routes._TAKEN) | set(encode_routes._NEUTRAL) == keys(
        control_fields.EncodeFields
    )
    assert not set(encode_routes._TAKEN) & set(encode_routes._NEUTRAL)
