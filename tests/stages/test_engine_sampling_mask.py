"""``return_sampling_mask`` on the built-in engine, as SGLang 0.5.23 serves it
(``io_struct.GenerateReqInput``, ``layers/sampler.py`` ``_build_sampling_mask_output``,
``tokenizer_manager.py`` ``_validate_one_request`` and the meta_info it fills,
``Scheduler.handle_generate_request``'s top_k check, ``serving_chat._validate_request``).

Each output token's sampling support (the tokens top-k, top-p and min-p left the draw, most
likely first) and the behaviour log-prob of the drawn token under that truncated distribution,
or with ``sampling_logprobs_mode: support`` the log-prob of every token of the support: what an
RL learner needs to correct for the truncation the sampler applied. The sampler's own numbers
are checked against a reference truncation written here and against its draws' frequencies;
the server's against transformers' logits of the same tokens.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.protocol import SamplingParams
from stages.engine.sampling import SlotSampler
from tests.stages.engine_setup import builtin_engine, load_reference, pass_through_template
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 90]
FIELDS = (
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
    "output_token_sampling_mask_length",
)


def _reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> tuple[list[int], list[float]]:
    """The support of one row's draw and its renormalized log-probs, most likely first, in
    float64: softmax of ``logits / temperature``; the ``top_k`` most likely; of those, the
    shortest prefix whose mass reaches ``top_p``; those at least ``min_p`` of the first."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, ids = probs.sort(descending=True)
    keep = torch.arange(len(ordered)) < top_k
    keep &= (ordered.cumsum(0) - ordered) < top_p
    keep &= ordered >= ordered[0] * min_p
    keep[0] = True
    kept = ordered[keep]
    return ids[keep].tolist(), (kept / kept.sum()).log().tolist()


# ---- the sampler --------------------------------------------------------------------------


def test_the_sampler_reports_the_support_it_draws_from() -> None:
    """Rows with top-k, top-p and min-p each report the support a reference truncation gives,
    the drawn token in it at its renormalized log-prob; a greedy row its argmax at 0; a row
    that did not ask, nothing."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=30, min_p=0.2),
        SamplingParams(temperature=0.0),
    ]
    sampler = SlotSampler(8, frozenset(), torch.Generator().manual_seed(2))
    sampler.add(params, [100] * 4, [None] * 4, (), [True, True, True, True])
    extra = SamplingParams(temperature=1.0)  # a row beside them that asks for nothing
    sampler.add([extra], [100], [None], (), [False])
    rows = torch.cat([logits, torch.randn(1, 64, generator=g)])
    for _ in range(50):
        tokens, _ = sampler.sample(rows.clone(), 0, 5)
        assert sorted(sampler.captured) == [0, 1, 2, 3]
        for slot, p in enumerate(params[:3]):
            ids, lps, selected = sampler.captured[slot]
            want_ids, want_lps = _reference(logits[slot], p.temperature, p.top_k, p.top_p, p.min_p)
            assert ids == want_ids
            assert lps == pytest.approx(want_lps, abs=1e-5)
            token = int(tokens[slot])
            assert token in ids and selected == lps[ids.index(token)]
        assert sampler.captured[3] == ([int(logits[3].argmax())], [0.0], 0.0)
    assert len(set(sampler.captured[1][0])) < 20  # top-p cut the 20 of top-k


def test_the_reported_log_probs_are_those_of_the_draws() -> None:
    """4,000 rows of the same logits, each drawn once: every token drawn is in the reported
    support, and how often each is drawn matches the reported probability (within four
    standard errors)."""
    n, p = 4000, SamplingParams(temperature=0.9, top_k=8, top_p=0.9)
    logits = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 2
    sampler = SlotSampler(n, frozenset(), torch.Generator().manual_seed(6))
    sampler.add([p] * n, [100] * n, [None] * n, (), [True] * n)
    tokens, _ = sampler.sample(logits.expand(n, -1).clone(), 0, n)
    ids, lps, _ = sampler.captured[0]
    assert all(sampler.captured[slot][0] == ids for slot in range(n))
    drawn = Counter(tokens.tolist())
    assert set(drawn) <= set(ids)
    for token, lp in zip(ids, lps, strict=True):
        prob = math.exp(lp)
        assert abs(drawn[token] / n - prob) < 4 * math.sqrt(prob * (1 - prob) / n) + 1e-3
    assert sum(math.exp(lp) for lp in lps) == pytest.approx(1.0, abs=1e-5)


# ---- the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=1)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    template = pass_through_template(model.parent)  # the chat test reads no format
    flags = ("--sampling-mask-max-tokens", "64", "--chat-template", str(template))
    with builtin_engine(model, *flags) as engine:
        yield engine


def _generate(url: str, **body: Any) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": PROMPT, **body}, timeout=60)


SAMPLED = {"temperature": 0.8, "top_k": 6, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.timeout(90)
def test_each_tokens_support_is_transformers_truncated_distribution(url: str, model: Path) -> None:
    resp = _generate(
        url, return_sampling_mask=True, sampling_params={**SAMPLED, "sampling_seed": 4}
    )
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    ids, meta = answer["output_ids"], answer["meta_info"]
    masks, lps = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(lps) == len(ids) == 12
    reference = load_reference(model)
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    for step, (token, mask, lp) in enumerate(zip(ids, masks, lps, strict=True)):
        want_ids, want_lps = _reference(logits[step], 0.8, 6, 1.0)
        assert mask == want_ids, step
        assert token in mask
        assert lp == pytest.approx(want_lps[mask.index(token)], abs=1e-4)
    # the support's log-probs: the same tokens (the same seed), each token's, selected among them
    resp = _generate(
        url,
        return_sampling_mask=True,
        sampling_logprobs_mode="support",
        sampling_params={**SAMPLED, "sampling_seed": 4},
    )
    support = resp.json()
    assert support["output_ids"] == ids
    meta = support["meta_info"]
    assert meta["output_token_sampling_mask"] == masks
    for token, mask, values, lp in zip(
        ids, masks, meta["output_token_sampling_logprobs"], lps, strict=True
    ):
        assert len(values) == len(mask) and values == sorted(values, reverse=True)
        assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-5)
        assert values[mask.index(token)] == pytest.approx(lp, abs=1e-5)


def test_greedy_tokens_are_their_own_support_and_a_batch_asks_per_prompt(url: str) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    answer = _generate(url, return_sampling_mask=True, sampling_params=greedy).json()
    meta = answer["meta_info"]
    assert meta["output_token_sampling_mask"] == [[t] for t in answer["output_ids"]]
    assert meta["output_token_sampling_logprobs"] == [0.0] * 6
    body = {
        "input_ids": [PROMPT, PROMPT[:3]],
        "return_sampling_mask": [True, False],
        "sampling_params": greedy,
    }
    first, second = requests.post(url + "/generate", json=body, timeout=60).json()
    assert first["meta_info"]["output_token_sampling_mask_length"] == 6
    assert not any(field in second["meta_info"] for field in FIELDS)
    plain = _generate(url, sampling_params=greedy).json()  # not asked: not there
    assert not any(field in plain["meta_info"] for field in FIELDS)


@pytest.mark.timeout(60)
def test_a_stream_carries_the_supports_so_far_and_ends_with_the_whole_answer(url: str) -> None:
    params = {**SAMPLED, "sampling_seed": 9}
    whole = _generate(url, return_sampling_mask=True, sampling_params=params).json()
    resp = requests.post(
        url + "/generate",
        json={
            "input_ids": PROMPT,
            "return_sampling_mask": True,
            "sampling_params": params,
            "stream": True,
        },
        stream=True,
        timeout=60,
    )
    chunks = [
        json.loads(line[6:])
        for line in resp.iter_lines()
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]
    # a chunk per token, but those that pile up while the client reads are merged
    lengths = [len(chunk["output_ids"]) for chunk in chunks]
    assert len(chunks) >= 2 and lengths == sorted(set(lengths)) and lengths[-1] == 12
    for chunk in chunks:
        meta = chunk["meta_info"]
        n = len(chunk["output_ids"])
        assert meta["output_token_sampling_mask_length"] == n
        assert meta["output_token_sampling_mask"] == whole["meta_info"][FIELDS[0]][:n]
        assert meta["output_token_sampling_logprobs"] == whole["meta_info"][FIELDS[1]][:n]


def test_what_sglang_refuses_is_refused_in_its_words(url: str) -> None:
    cases = [
        (  # the whole vocabulary (top_k -1): SGLang's TOP_K_ALL in the message
            {"return_sampling_mask": True, "sampling_params": {"temperature": 1.0}},
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
            "64; got top_k=1073741824. Lower top_k or increase --sampling-mask-max-tokens.",
        ),
        (  # beyond the server's --sampling-mask-max-tokens
            {"return_sampling_mask": True, "sampling_params": {"top_k": 65}},
            "got top_k=65",
        ),
        (
            {"sampling_logprobs_mode": "support"},
            "sampling_logprobs_mode can only be set when return_sampling_mask=true.",
        ),
        (
            {"return_sampling_mask": True, "sampling_logprobs_mode": "all"},
            "Input should be 'selected' or 'support'",
        ),
        # the JSON contract: BoolOrList ("yes" gets past GenerateReqInput's lax bool)
        (
            {"return_sampling_mask": "yes"},
            'invalid type: string "yes", expected a value or an array of values for BoolOrList',
        ),
    ]
    for body, words in cases:
        resp = _generate(url, **body)
        assert resp.status_code == 400, body
        answer = resp.json()  # the route's {error: {message}}, the contract's {error: text}
        error = answer.get("error")
        text = answer.get("message") or (error if isinstance(error, str) else error["message"])
        assert words in text, resp.text
    ok = _generate(url, return_sampling_mask=True, sampling_params={"top_k": 64})
    assert ok.status_code == 200  # at the limit


def test_the_chat_route_returns_supports_in_its_meta_info_only(url: str) -> None:
    chat = {
        "messages": [{"role": "user", "content": "w5 w6"}],
        "max_tokens": 4,
        "top_k": 5,
        "return_sampling_mask": True,
    }
    resp = requests.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["message"] == "return_sampling_mask requires return_meta_info=true."
    resp = requests.post(
        url + "/v1/chat/completions", json={**chat, "return_meta_info": True}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    meta = resp.json()["choices"][0]["meta_info"]
    assert meta["output_token_sampling_mask_length"] == meta["completion_tokens"]
    assert all(1 <= len(mask) <= 5 for mask in meta["output_token_sampling_mask"])
    # a completion request has no such field in SGLang: it is ignored there
    body = {"prompt": [5, 6], "max_tokens": 2, "return_sampling_mask": True}
    assert requests.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
