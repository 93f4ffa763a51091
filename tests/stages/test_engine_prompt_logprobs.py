"""Input log-probs (``logprob_start_len``) and prefill-only scoring (``max_new_tokens: 0``) on the
built-in engine as a real server, against transformers' forward. Layout as SGLang 0.5 gives it
(``SchedulerLogprobResultProcessor._process_input_token_logprobs``: ``[None] + values[:-1]``
over ``origin_input_ids[logprob_start_len:]``; ``Scheduler.handle_generate_request``: a start
beyond the prompt is refused; ``logprob_processor``: ``log_softmax`` of the raw logits)."""

from __future__ import annotations

import json
import math

import openai
import pytest
import requests
import torch

from stages.engine.prompt_logprobs import POSITIONS_PER_CHUNK, prompt_logprobs, scoring_passes
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import (  # noqa: F401
    GREEDY,
    Engine,
    _tokenizer,
    engine,
    ref_model,
)

pytestmark = pytest.mark.numerics

PROMPT = [5, 17, 33, 2, 90, 41, 8, 77, 12]


def _reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position ``[L, vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.timeout(60)
def test_prefill_only_scoring_gives_each_prompt_tokens_logprob(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    out = engine.generate(
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        }
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT
    assert entries[0][0] is None  # nothing before the first token (SGLang: None, always)
    expected = _reference(ref_model, PROMPT)
    want = [expected[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))]
    assert_close([e[0] for e in entries[1:]], want, terms=forward_terms(ref_model.config, 9))
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0


@pytest.mark.timeout(60)
def test_a_start_inside_the_prompt_with_generation_and_top_logprobs(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    start, k = 4, 3
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": k,
        "return_text_in_logprobs": True,
        "sampling_params": {**GREEDY, "max_new_tokens": 5},
    }
    out = engine.generate(body)
    meta = out["meta_info"]
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [e[1] for e in entries] == PROMPT[start:] and entries[0][0] is None
    assert len(tops) == len(PROMPT) - start and tops[0] is None
    tokenizer = _tokenizer(engine)
    assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in PROMPT[start:]]
    expected = _reference(ref_model, PROMPT)
    terms = forward_terms(ref_model.config, len(PROMPT))
    for k_, (entry, top) in enumerate(zip(entries[1:], tops[1:], strict=True), start=start + 1):
        row = expected[k_ - 1]
        assert_close([entry[0]], [row[PROMPT[k_]].item()], terms=terms)
        assert_close([t[0] for t in top], row.topk(k).values, terms=terms)
        assert len(top) == k and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
    # the generation is what it is without input log-probs
    plain = engine.generate({**body, "logprob_start_len": -1})
    assert (
        plain["output_ids"] == out["output_ids"]
        and plain["meta_info"]["input_token_logprobs"] == []
    )
    for a, b in zip(
        plain["meta_info"]["output_token_logprobs"], meta["output_token_logprobs"], strict=True
    ):
        assert a[1] == b[1] and math.isclose(a[0], b[0], abs_tol=1e-5)


@pytest.mark.timeout(60)
def test_scoring_is_the_same_in_a_batch_and_after_the_prompt_was_cached(
    engine: Engine,  # noqa: F811
) -> None:
    def score(ids: list[int]) -> list:
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 1,
                "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
        return engine.generate(body)["meta_info"]["input_token_logprobs"]

    alone = score(PROMPT)
    # the prompt's KV goes into the prefix cache with this request; scoring must not reuse it
    engine.generate({"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 3}})
    again = score(PROMPT)
    batch = engine.generate(
        {
            "input_ids": [PROMPT[:3], PROMPT, PROMPT[2:]],
            "return_logprob": True,
            "logprob_start_len": [0, 1, 0],
            "sampling_params": {"max_new_tokens": 0},
        }
    )
    assert [e[1] for e in batch[1]["meta_info"]["input_token_logprobs"]] == PROMPT[1:]
    for a, b, c in zip(alone, again, batch[1]["meta_info"]["input_token_logprobs"], strict=True):
        assert a[1] == b[1] == c[1]
        if a[0] is not None:
            assert math.isclose(a[0], b[0], abs_tol=1e-5) and math.isclose(a[0], c[0], abs_tol=1e-5)
    # the start at the prompt's end gives none; beyond it is refused, as SGLang refuses it
    at_end = engine.generate(
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": len(PROMPT),
            "sampling_params": {"max_new_tokens": 0},
        }
    )
    assert at_end["meta_info"]["input_token_logprobs"] == []
    status, error = engine.request(
        "POST", "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT) + 1},
    )  # fmt: skip
    assert status == 400 and "logprob_start_len" in error["error"]["message"]


@pytest.mark.timeout(60)
def test_echo_with_logprobs_on_v1_completions_scores_the_prompt(engine: Engine) -> None:  # noqa: F811
    """SGLang's /v1/completions with echo and logprobs asks for input log-probs from 0: the
    prompt's tokens come first in ``logprobs``, the first with a null log-prob."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    logprobs = out.choices[0].logprobs
    native = engine.generate(
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        }
    )["meta_info"]["input_token_logprobs"]
    assert logprobs.token_logprobs[0] is None
    assert len(logprobs.token_logprobs) == len(PROMPT)
    for got, want in zip(logprobs.token_logprobs[1:], native[1:], strict=True):
        assert math.isclose(got, want[0], abs_tol=1e-6)
    assert logprobs.top_logprobs[0] is None and all(len(t) == 1 for t in logprobs.top_logprobs[1:])


def test_prompt_logprobs_in_chunks_equal_one_pass() -> None:
    """The arithmetic alone: a prompt longer than a chunk of positions, against log_softmax
    of all logits at once (float64)."""
    gen = torch.Generator().manual_seed(0)
    length, width, vocab = POSITIONS_PER_CHUNK + 37, 8, 50
    hidden = torch.randn(length, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()

    def head(h: torch.Tensor) -> torch.Tensor:
        return h @ weight.T

    full = torch.log_softmax(head(hidden), -1)
    for start in (0, 5, length - 1, length):
        lps, tops = prompt_logprobs(hidden, ids, start, 2, head)
        assert len(lps) == length - start and len(tops) == length - start
        if start < length:
            assert lps[0] is None and tops[0] is None
        want = [full[p - 1, ids[p]].item() for p in range(start + 1, length)]
        assert lps[1:] == pytest.approx(want, abs=1e-12)
        for p, top in zip(range(start + 1, length), tops[1:], strict=True):
            assert [t[1] for t in top] == full[p - 1].topk(2).indices.tolist()
    assert scoring_passes([3, 9000, 4, 4]) == [[0, 2, 3], [1]]


@pytest.mark.timeout(60)
def test_streamed_chunks_carry_the_prompts_logprobs_from_the_first(engine: Engine) -> None:  # noqa: F811
    """SGLang's cumulative chunks hold the input log-probs in every chunk once computed."""
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 2,
            "top_logprobs_num": 2, "sampling_params": {**GREEDY, "max_new_tokens": 4}}  # fmt: skip
    response = requests.post(engine.url + "/generate", json={**body, "stream": True}, timeout=30)
    chunks = [
        json.loads(line[len(b"data: ") :])
        for line in response.iter_lines()
        if line.startswith(b"data: {")
    ]
    final = chunks[-1]["meta_info"]
    assert [e[1] for e in final["input_token_logprobs"]] == PROMPT[2:]
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["input_token_logprobs"] == final["input_token_logprobs"]
        assert meta["input_top_logprobs"] == final["input_top_logprobs"]
