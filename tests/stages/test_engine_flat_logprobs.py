"""Top log-probs as flat arrays on the built-in engine, as SGLang 0.5.23 answers
``return_flat_raw_top_logprobs``, ``return_flat_raw_output_top_logprobs`` and
``return_flat_raw_top_logprobs_b64`` (``io_struct.GenerateReqInput._validate_inputs``,
``flat_top_logprobs_layout``, ``build_flat_top_logprobs_arrays``,
``tokenizer_manager._build_flat_top_logprobs_fields`` and the meta_info it fills,
``serving_chat._validate_request`` and ``_convert_to_internal_request``).

Each flat answer is checked against the nested one of the same greedy request: the same
numbers, laid out as the fields say.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from stages.engine.flat_logprobs import flat_fields
from tests.stages.engine_setup import builtin_engine, pass_through_template
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 90, 41]
K = 3
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
SCORED = {"return_logprob": True, "top_logprobs_num": K, "sampling_params": GREEDY}
FLAT_KEYS = ("val_flat", "idx_flat", "shape", "null_prefix")
B64_KEYS = ("val_flat_b64", "idx_flat_b64", "val_flat_b64_dtype", "idx_flat_b64_dtype")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=4)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    template = pass_through_template(model.parent)  # the chat test reads no format
    with builtin_engine(model, "--chat-template", str(template)) as engine:
        yield engine


def _generate(url: str, **body: Any) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": PROMPT, **body}, timeout=60)


def _meta(url: str, **body: Any) -> dict[str, Any]:
    resp = _generate(url, **{**SCORED, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def _nested_rows(steps: list[Any]) -> tuple[int, list[list[float]], list[list[int]]]:
    """A nested side's leading positions without top log-probs, and its rows."""
    null = 0
    while null < len(steps) and not steps[null]:
        null += 1
    rows = steps[null:]
    return null, [[e[0] for e in r] for r in rows], [[e[1] for e in r] for r in rows]


def _flat_rows(meta: dict[str, Any], side: str) -> tuple[int, list[list[float]], list[list[int]]]:
    """A flat side's null prefix and its rows (plain lists or base64), by its shape."""
    prefix = f"{side}_top_logprobs"
    rows, k = meta[f"{prefix}_shape"]
    if f"{prefix}_val_flat_b64" in meta:
        assert meta[f"{prefix}_val_flat_b64_dtype"] == "float32"
        assert meta[f"{prefix}_idx_flat_b64_dtype"] == "int32"
        values = np.frombuffer(base64.b64decode(meta[f"{prefix}_val_flat_b64"]), "<f4").tolist()
        ids = np.frombuffer(base64.b64decode(meta[f"{prefix}_idx_flat_b64"]), "<i4").tolist()
    else:
        values, ids = meta[f"{prefix}_val_flat"], meta[f"{prefix}_idx_flat"]
    assert len(values) == len(ids) == rows * k
    return (
        meta[f"{prefix}_null_prefix"],
        [values[r * k : (r + 1) * k] for r in range(rows)],
        [ids[r * k : (r + 1) * k] for r in range(rows)],
    )


def _same(got: tuple[int, list, list], want: tuple[int, list, list]) -> None:
    """Two answers' rows of one side: the same positions and tokens, the same log-probs up to
    float32 rounding and the run-to-run noise of batched CPU kernels (two requests of the same
    prompt may be computed in different batches, or from the prefix cache)."""
    assert (got[0], got[2]) == (want[0], want[2])
    assert [len(row) for row in got[1]] == [len(row) for row in want[1]]
    assert np.allclose(got[1], want[1], rtol=0, atol=1e-5)


def test_the_prompts_top_log_probs_come_flat_in_place_of_the_nested_ones(url: str) -> None:
    """``logprob_start_len`` 0: the prompt's first token has none (the null prefix), each
    later one its ``K``; the fields stand where ``input_top_logprobs`` stood, the output's
    stay nested."""
    nested = _meta(url, logprob_start_len=0)
    flat = _meta(url, logprob_start_len=0, return_flat_raw_top_logprobs=True)
    assert "input_top_logprobs" not in flat
    _same(_nested_rows(flat["output_top_logprobs"]), _nested_rows(nested["output_top_logprobs"]))
    keys = list(flat)
    at = keys.index("output_token_logprobs_length")
    assert keys[at + 1 : at + 6] == [*(f"input_top_logprobs_{k}" for k in FLAT_KEYS),
                                     "output_top_logprobs"]  # fmt: skip
    assert flat["input_top_logprobs_shape"] == [len(PROMPT) - 1, K]
    assert flat["input_top_logprobs_null_prefix"] == 1
    _same(_flat_rows(flat, "input"), _nested_rows(nested["input_top_logprobs"]))


def test_the_outputs_come_flat_in_base64_as_float32_and_int32(url: str) -> None:
    nested = _meta(url, logprob_start_len=2)
    flat = _meta(
        url,
        logprob_start_len=2,
        return_flat_raw_top_logprobs=True,
        return_flat_raw_output_top_logprobs=True,
        return_flat_raw_top_logprobs_b64=True,
    )
    assert "input_top_logprobs" not in flat and "output_top_logprobs" not in flat
    for side in ("input", "output"):
        assert all(f"{side}_top_logprobs_{k}" in flat for k in B64_KEYS)
        assert f"{side}_top_logprobs_val_flat" not in flat
        _same(_flat_rows(flat, side), _nested_rows(nested[f"{side}_top_logprobs"]))
    assert flat["output_top_logprobs_shape"] == [GREEDY["max_new_tokens"], K]
    # SGLang's first prompt position has none, from whatever start (logprob_result_processor)
    assert flat["input_top_logprobs_shape"] == [len(PROMPT) - 3, K]
    assert flat["input_top_logprobs_null_prefix"] == 1


def test_no_prompt_log_probs_make_an_empty_side_and_no_top_log_probs_no_fields(url: str) -> None:
    """``logprob_start_len`` -1 (SGLang's default): an input side of no rows, ``[0, K]``;
    ``top_logprobs_num`` 0: no top log-probs, flat or nested."""
    meta = _meta(url, return_flat_raw_top_logprobs=True)
    assert meta["input_top_logprobs_val_flat"] == meta["input_top_logprobs_idx_flat"] == []
    assert meta["input_top_logprobs_shape"] == [0, K]
    assert meta["input_top_logprobs_null_prefix"] == 0
    meta = _meta(url, top_logprobs_num=0, return_flat_raw_output_top_logprobs=True)
    assert not [key for key in meta if "top_logprobs" in key]


def test_each_sample_of_a_batch_has_its_own(url: str) -> None:
    prompts = [PROMPT, PROMPT[:3]]
    body = {
        **SCORED,
        "input_ids": prompts,
        "logprob_start_len": 0,
        "sampling_params": {**GREEDY, "n": 2},
    }
    nested = requests.post(url + "/generate", json=body, timeout=60).json()
    resp = requests.post(
        url + "/generate",
        json={
            **body,
            "return_flat_raw_top_logprobs": True,
            "return_flat_raw_output_top_logprobs": True,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    flat = resp.json()
    assert len(flat) == len(nested) == 4
    for got, want in zip(flat, nested, strict=True):
        for side in ("input", "output"):
            _same(
                _flat_rows(got["meta_info"], side),
                _nested_rows(want["meta_info"][f"{side}_top_logprobs"]),
            )
    assert [f["meta_info"]["input_top_logprobs_shape"][0] for f in flat] == [5, 5, 2, 2]


def test_a_stream_carries_the_prompts_in_every_chunk(url: str) -> None:
    """The input side, built once, in each chunk (SGLang's ``meta_info.update`` of its cached
    fields); the output's nested, growing."""
    body = {
        "input_ids": PROMPT,
        **SCORED,
        "logprob_start_len": 0,
        "stream": True,
        "return_flat_raw_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True,
    }
    # each step slowed, so that the chunks do not pile up into one on a loaded machine
    slow = requests.post(url + "/slow_down", json={"forward_sleep_time": 0.02}, timeout=30)
    assert slow.status_code == 200
    try:
        resp = requests.post(url + "/generate", json=body, timeout=60, stream=True)
        assert resp.status_code == 200, resp.text
        chunks = [
            json.loads(line[6:])
            for line in resp.iter_lines(decode_unicode=True)
            if line.startswith("data: {")
        ]
    finally:
        requests.post(url + "/slow_down", json={"forward_sleep_time": None}, timeout=30)
    assert len(chunks) >= 2
    first = _flat_rows(chunks[0]["meta_info"], "input")
    assert first[0] == 1 and len(first[1]) == len(PROMPT) - 1
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert _flat_rows(meta, "input") == first and "input_top_logprobs" not in meta
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (
            {"stream": True, "return_flat_raw_output_top_logprobs": True},
            "return_flat_raw_output_top_logprobs",
            "is only set on the finished response and does not support stream=True.",
        ),
        (
            {"return_flat_raw_top_logprobs_b64": True},
            "return_flat_raw_top_logprobs_b64",
            "requires return_flat_raw_top_logprobs or return_flat_raw_output_top_logprobs.",
        ),
        # GenerateReqInput's bool, as pydantic reads it ("yes" is true; its handler's 400)
        (
            {"return_flat_raw_top_logprobs": "maybe"},
            "return_flat_raw_top_logprobs",
            "Input should be a valid boolean, unable to interpret input",
        ),
    ],
)
def test_what_sglang_refuses_is_refused_in_its_words(url, body, field, words) -> None:
    resp = _generate(url, **SCORED, **body)
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    message = answer["message"] if "message" in answer else answer["error"]["message"]
    assert message.startswith(field + ": ") and message.endswith(words), message


def test_the_chat_route_puts_the_outputs_in_its_meta_info_in_base64(url: str) -> None:
    """``serving_chat``: ``return_flat_raw_output_top_logprobs`` needs ``return_meta_info``;
    the fields are base64 unless ``return_flat_raw_top_logprobs_b64`` is false, and each
    token's ``top_logprobs`` in ``logprobs`` is then empty."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none")
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "w5 w6"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            **chat, extra_body={"return_flat_raw_output_top_logprobs": True}
        )
    assert "requires return_meta_info=true" in str(refused.value)
    nested = client.chat.completions.create(**chat)
    answer = client.chat.completions.create(
        **chat,
        extra_body={"return_flat_raw_output_top_logprobs": True, "return_meta_info": True},
    )
    (choice,) = answer.model_dump()["choices"]
    meta = choice["meta_info"]
    assert all(f"output_top_logprobs_{k}" in meta for k in B64_KEYS)
    assert "output_top_logprobs" not in meta
    assert all(entry["top_logprobs"] == [] for entry in choice["logprobs"]["content"])
    tops = [entry.top_logprobs for entry in nested.choices[0].logprobs.content]
    want = (0, [[t.logprob for t in top] for top in tops], _flat_rows(meta, "output")[2])
    _same(_flat_rows(meta, "output"), want)  # (the chat's top lists carry no token ids)
    plain = client.chat.completions.create(
        **chat,
        extra_body={
            "return_flat_raw_output_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": False,
            "return_meta_info": True,
        },
    )
    meta = plain.model_dump()["choices"][0]["meta_info"]
    _same(_flat_rows(meta, "output"), want)
    assert "output_top_logprobs_val_flat_b64" not in meta
    # a completion request has no such fields in SGLang: they are ignored there
    body = {"prompt": [5, 6], "max_tokens": 2, "return_flat_raw_top_logprobs_b64": True}
    assert requests.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_ragged_rows_fall_back_to_nested() -> None:
    """``flat_top_logprobs_layout``: nulls only in the leading prefix, every row ``k`` wide;
    else no flat fields (the caller answers nested, as SGLang does)."""
    row = [(-0.1, 4), (-2.0, 9)]
    assert flat_fields("input", [None, [], row, row], 2, False) == {
        "input_top_logprobs_val_flat": [-0.1, -2.0, -0.1, -2.0],
        "input_top_logprobs_idx_flat": [4, 9, 4, 9],
        "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 2,
    }
    assert flat_fields("input", [None, row, None, row], 2, False) is None  # an interior null
    assert flat_fields("output", [row, row[:1]], 2, True) is None  # a short row
