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
from tests.stages.test_engine_streaming import _events

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
def test_prefill_only_gives_the_distribution_after_the_prompt_without_a_token(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    """SGLang 0.5.23 (``tp_worker``: a prefill-only batch samples nothing;
    ``ModelRunner.compute_logprobs_only``; ``logprob_result_processor.add_logprob_return_values``):
    with ``top_logprobs_num`` or ``token_ids_logprob``, ``max_new_tokens: 0`` gives one entry
    of ``output_top_logprobs`` and ``output_token_ids_logprobs``, the distribution after the
    last prompt token, and no output token or ``output_token_logprobs``: how ``/v1/score``
    and LLM judges read a label's probability."""
    wanted = [3, 41, 90]
    expected = _reference(ref_model, PROMPT)[-1]
    terms = forward_terms(ref_model.config, len(PROMPT))
    for start in (-1, 4):  # alone, and with the prompt's own log-probs
        body = {"input_ids": [PROMPT, PROMPT], "return_logprob": True, "top_logprobs_num": 3,
                "token_ids_logprob": wanted, "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
        for out in engine.generate(body):  # a batch: the same prompt scored once, for both
            meta = out["meta_info"]
            assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
            ((picked,),) = [meta["output_token_ids_logprobs"]]
            assert [e[1] for e in picked] == wanted
            assert_close([e[0] for e in picked], expected[wanted].tolist(), terms=terms)
            ((top,),) = [meta["output_top_logprobs"]]
            assert [e[1] for e in top] == expected.topk(3).indices.tolist()
            assert len(meta["input_token_logprobs"]) == (0 if start < 0 else len(PROMPT) - start)
    # what a generated first token's entry holds: the same distribution (its prefill on top
    # of the prompt's KV the scoring left in the prefix cache: equal within rounding)
    drawn = engine.generate(
        {**body, "input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": 1}}
    )
    ((got,),) = [drawn["meta_info"]["output_token_ids_logprobs"]]
    assert [e[1] for e in got] == wanted
    assert_close([e[0] for e in got], [e[0] for e in picked], terms=terms)
    # without return_logprob, or asking for neither, nothing is computed after the prompt
    plain = engine.generate({"input_ids": PROMPT, "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 0}})["meta_info"]  # fmt: skip
    assert "output_token_ids_logprobs" not in plain and "output_top_logprobs" not in plain


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
def test_samples_of_one_prompt_scored_together_compute_the_prompt_once(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    """A teacher's or a reference's batch (``stages/scorer/teacher.py``): prompt + completion
    each, the log-probs from the completion on. As SGLang serves it, the prompt's KV is
    reused up to the start (``Req._compute_max_prefix_len``), and of the prompts that share
    32 tokens or more with none cached, one goes first and the rest after it
    (``schedule_policy.py``'s in-batch prefix caching): ``cached_tokens`` says so."""
    assert requests.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    prompt = [(7 * i + 3) % 120 + 3 for i in range(40)]
    completions = [[11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41]]
    body = {
        "input_ids": [prompt + c for c in completions],
        "return_logprob": True,
        "logprob_start_len": [len(prompt) - 1] * len(completions),
        "sampling_params": {"max_new_tokens": 0},
    }
    first = engine.generate(body)
    assert [o["meta_info"]["cached_tokens"] for o in first] == [0] + [len(prompt) - 1] * 3
    again = engine.generate(body)
    assert [o["meta_info"]["cached_tokens"] for o in again] == [len(prompt) - 1] * 4
    for c, a, b in zip(completions, first, again, strict=True):
        ids = prompt + c
        expected = _reference(ref_model, ids)
        want = [expected[p - 1, ids[p]].item() for p in range(len(prompt), len(ids))]
        for out in (a, b):
            entries = out["meta_info"]["input_token_logprobs"]
            assert [e[1] for e in entries] == ids[len(prompt) - 1 :] and entries[0][0] is None
            assert_close(
                [e[0] for e in entries[1:]], want, terms=forward_terms(ref_model.config, 46)
            )
    # a request that scores its prompt and generates: cached_tokens is what the scoring took
    # (up to the start), though its prefill then reuses the whole prompt the scoring left
    fresh = {"input_ids": prompt[::-1], "return_logprob": True, "logprob_start_len": 4,
             "sampling_params": {**GREEDY, "max_new_tokens": 2}}  # fmt: skip
    assert engine.generate(fresh)["meta_info"]["cached_tokens"] == 0
    assert engine.generate(fresh)["meta_info"]["cached_tokens"] == 4


@pytest.mark.timeout(60)
def test_echo_with_logprobs_on_v1_completions_scores_the_prompt(engine: Engine) -> None:  # noqa: F811
    """SGLang's /v1/completions with echo and logprobs asks for input log-probs from 0: the
    prompt's tokens come first in ``logprobs``, the first with a null log-prob, then the
    answer's (``max_tokens: 0`` is refused there: ``validate_max_tokens_positive``)."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be positive"):
        client.completions.create(model="default", prompt=PROMPT, max_tokens=0, echo=True)
    out = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0
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
    assert len(logprobs.token_logprobs) == len(PROMPT) + 1
    for got, want in zip(logprobs.token_logprobs[1:-1], native[1:], strict=True):
        assert math.isclose(got, want[0], abs_tol=1e-6)
    assert logprobs.top_logprobs[0] is None and all(len(t) == 1 for t in logprobs.top_logprobs[1:])
    assert logprobs.token_logprobs[-1] <= 0


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
        lps, tops, picked = prompt_logprobs(hidden, ids, start, 2, head, wanted=(7, 3))
        assert len(lps) == len(tops) == len(picked) == length - start
        if start < length:
            assert lps[0] is None and tops[0] is None and picked[0] is None
        want = [full[p - 1, ids[p]].item() for p in range(start + 1, length)]
        assert lps[1:] == pytest.approx(want, abs=1e-12)
        for p, top, pick in zip(range(start + 1, length), tops[1:], picked[1:], strict=True):
            assert [t[1] for t in top] == full[p - 1].topk(2).indices.tolist()
            assert [t[1] for t in pick] == [7, 3]
            assert [t[0] for t in pick] == pytest.approx(full[p - 1, [7, 3]].tolist(), abs=1e-12)
    assert prompt_logprobs(hidden, ids, 0, 0, head)[2] is None
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


@pytest.mark.timeout(60)
def test_token_ids_logprob_gives_those_tokens_logprobs_at_every_step(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    """SGLang's ``token_ids_logprob``: per output token (and per prompt token from
    ``logprob_start_len``, None first), ``[logprob, token_id, text or None]`` of each token
    asked for, in the order asked (``TokenizerManager.add_logprob_to_meta_info``), under the
    distribution the sampled token's log-prob comes from; what a judge reward asks an engine."""
    wanted, start, new = [40, 3, 77], 5, 4
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": start,
        "token_ids_logprob": wanted,
        "sampling_params": {**GREEDY, "max_new_tokens": new},
    }
    out = engine.generate(body)
    meta = out["meta_info"]
    context = PROMPT + out["output_ids"]
    expected = _reference(ref_model, context)
    terms = forward_terms(ref_model.config, len(context))
    outputs, inputs = meta["output_token_ids_logprobs"], meta["input_token_ids_logprobs"]
    assert len(outputs) == new and len(inputs) == len(PROMPT) - start and inputs[0] is None
    # an output step's logits follow the context before it, a prompt token's the one before it
    steps = [*outputs, *inputs[1:]]
    positions = [*range(len(PROMPT) - 1, len(context) - 1), *range(start, len(PROMPT) - 1)]
    for step, position in zip(steps, positions, strict=True):
        assert [e[1] for e in step] == wanted and all(e[2] is None for e in step)
        assert_close([e[0] for e in step], expected[position, wanted], terms=terms)
    # the sampled token's own log-prob, when it is asked for, is the one reported for it
    first = out["output_ids"][0]
    again = engine.generate({**body, "token_ids_logprob": [first]})["meta_info"]
    assert math.isclose(
        again["output_token_ids_logprobs"][0][0][0],
        again["output_token_logprobs"][0][0],
        abs_tol=1e-6,
    )
    # streamed: each chunk holds them so far, the last all of them
    chunks = _events(engine, {**body, "stream": True})[1][:-1]  # without [DONE]
    last = chunks[-1]["meta_info"]
    # (how many chunks depends on the machine: those that pile up while the client reads merge)
    assert chunks and len(last["output_token_ids_logprobs"]) == new
    for chunk in chunks:
        got = chunk["meta_info"]
        done = got["completion_tokens"]
        assert got["output_token_ids_logprobs"] == last["output_token_ids_logprobs"][:done]
        assert got["input_token_ids_logprobs"] == last["input_token_ids_logprobs"]
    # (the prompt's KV now comes from the prefix cache: the same values, summed otherwise)
    for mine, theirs in (
        (last["output_token_ids_logprobs"], outputs),
        (last["input_token_ids_logprobs"][1:], inputs[1:]),
    ):
        flat = [e[0] for step in mine for e in step]
        assert flat == pytest.approx([e[0] for step in theirs for e in step], abs=1e-5)
    # without return_logprob there are none, as in SGLang; text with return_text_in_logprobs
    assert (
        "output_token_ids_logprobs"
        not in engine.generate({**body, "return_logprob": False})["meta_info"]
    )
    texts = engine.generate({**body, "return_text_in_logprobs": True})["meta_info"]
    tokenizer = _tokenizer(engine)
    assert [e[2] for e in texts["output_token_ids_logprobs"][0]] == [
        tokenizer.decode([t]) for t in wanted
    ]


@pytest.mark.timeout(60)
def test_token_ids_logprob_in_a_batch_and_what_is_refused(engine: Engine) -> None:  # noqa: F811
    """SGLang's ``GenerateReqInput`` normalization: in a batch one id, one list for every
    prompt, or a list per prompt (not with n > 1); ids inside the vocabulary."""
    prompts = [PROMPT, [9, 8, 7]]
    params = {**GREEDY, "max_new_tokens": 2}

    def ask(value: object, **more: object) -> requests.Response:
        body = {"input_ids": prompts, "return_logprob": True, "token_ids_logprob": value,
                "sampling_params": params, **more}  # fmt: skip
        return requests.post(engine.url + "/generate", json=body, timeout=30)

    per_prompt = ask([[4], [5, 6]]).json()
    assert [[e[1] for e in o["meta_info"]["output_token_ids_logprobs"][0]] for o in per_prompt] == [
        [4],
        [5, 6],
    ]
    for o in ask([5, 6]).json():
        assert [e[1] for e in o["meta_info"]["output_token_ids_logprobs"][1]] == [5, 6]
    for value, more, words in (
        ([[4], [5]], {"sampling_params": {**params, "n": 2}}, "n > 1"),
        ([[4]], {}, "1 lists for a batch of 2"),
        ([[4], [10**6]], {}, "out-of-vocabulary"),
        # GenerateReqInput's type, Optional[Union[List[List[int]], List[int]]] (its validation
        # handler's 400): one id alone is no list over HTTP, whatever its normalization takes
        ([4, "x"], {}, "token_ids_logprob.list[list[int]].0: Input should be a valid list"),
        (4, {}, "token_ids_logprob.list[list[int]]: Input should be a valid list"),
    ):
        response = ask(value, **more)
        assert response.status_code == 400, (value, response.text)
        assert words in response.text and "token_ids_logprob" in response.text
    assert engine.generate({"input_ids": PROMPT, "sampling_params": params})["output_ids"]
