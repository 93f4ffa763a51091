"""``/v1/score`` on the built-in engine as a real server, as SGLang 0.5.23 scores with a causal
LM (``entrypoints/openai/serving_score.py``, ``protocol.ScoringRequest``/``ScoringResponse``,
``managers/tokenizer_manager_score_mixin.py``: ``score_request``,
``_process_single_item_scoring_results``, ``_convert_logprobs_to_scores``), against
transformers' distribution after each ``query + item``."""

from __future__ import annotations

import math

import pytest
import torch

from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import (  # noqa: F401
    Engine,
    _tokenizer,
    engine,
    ref_model,
)

pytestmark = pytest.mark.numerics

LABELS = [3, 41, 90]


def _after(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' log-probs of the token after ``ids`` ``[vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def _score(engine: Engine, **body: object) -> tuple[int, dict]:  # noqa: F811
    return engine.request("POST", "/v1/score", body)


@pytest.mark.timeout(60)
def test_text_items_score_each_labels_probability_after_query_and_item(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    tok = _tokenizer(engine)
    query, items = "w11 w12", [" w13", " w14 w15", " w16"]
    status, out = _score(engine, query=query, items=items, label_token_ids=LABELS, model="m")
    assert status == 200, out
    assert list(out) == ["scores", "pooled_hidden_states", "token_logprobs", "model", "usage",
                         "object"]  # fmt: skip
    assert out["object"] == "scoring" and out["model"] == "m" and out["token_logprobs"] is None
    prompts = [tok.encode(query + item) for item in items]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == sum(map(len, prompts))
    assert out["usage"]["completion_tokens"] == 0
    for scores, prompt in zip(out["scores"], prompts, strict=True):
        want = _after(ref_model, prompt)[LABELS].exp().tolist()  # probabilities, not normalized
        assert_close(scores, want, terms=forward_terms(ref_model.config, len(prompt)))
    # as the native route gives them: max_new_tokens 0 with the labels as token_ids_logprob
    native = engine.generate(
        {"text": query + items[0], "return_logprob": True, "token_ids_logprob": LABELS,
         "sampling_params": {"max_new_tokens": 0}}
    )  # fmt: skip
    ((step,),) = [native["meta_info"]["output_token_ids_logprobs"]]  # one prompt, not a batch
    assert out["scores"][0] == pytest.approx([math.exp(lp) for lp, _, _ in step], rel=1e-5)
    # a softmax over the labels at a temperature, with the raw log-probs; item_first
    status, soft = _score(engine, query=query, items=items[0], label_token_ids=LABELS,
                          apply_softmax=True, temperature=0.5, return_token_logprobs=True,
                          item_first=True)  # fmt: skip
    assert status == 200, soft
    (raw,) = soft["token_logprobs"]
    first_item = tok.encode(items[0] + query)
    assert_close(raw, _after(ref_model, first_item)[LABELS].tolist(),
                 terms=forward_terms(ref_model.config, len(first_item)))  # fmt: skip
    want = torch.softmax(torch.tensor(raw, dtype=torch.float64) / 0.5, 0).tolist()
    assert soft["scores"][0] == pytest.approx(want, rel=1e-12) and sum(
        soft["scores"][0]
    ) == pytest.approx(1)


@pytest.mark.timeout(60)
def test_token_id_items_with_a_label_list_each(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    query, items = [5, 17, 33], [[2, 90], [41, 8, 77]]
    labels = [[3, 41], [90]]
    status, out = _score(engine, query=query, items=items, label_token_ids=labels)
    assert status == 200, out
    assert [len(s) for s in out["scores"]] == [2, 1]
    for scores, item, wanted in zip(out["scores"], items, labels, strict=True):
        prompt = query + item
        want = _after(ref_model, prompt)[wanted].exp().tolist()
        assert_close(scores, want, terms=forward_terms(ref_model.config, len(prompt)))
    assert out["usage"]["prompt_tokens"] == 5 + 6
    status, first = _score(
        engine, query=query, items=items, label_token_ids=labels, item_first=True
    )
    assert status == 200 and first["scores"] != out["scores"]  # [2, 90, 5, 17, 33], ...
    status, empty = _score(engine, items=[], label_token_ids=LABELS, return_token_logprobs=True)
    assert (status, empty["scores"], empty["token_logprobs"]) == (200, [], [])
    assert empty["usage"]["prompt_tokens"] == 0


@pytest.mark.timeout(60)
def test_what_sglang_refuses_and_what_this_engine_cannot_do(engine: Engine) -> None:  # noqa: F811
    base = {"query": "w11", "items": [" w12"], "label_token_ids": LABELS}
    refused = {
        "no items": ({"items": None}, "items must be provided"),
        "no labels": ({"label_token_ids": None}, "label_token_ids is required"),
        "duplicates": ({"label_token_ids": [3, 3]}, "must not contain duplicate tokens"),
        "negative": ({"label_token_ids": [-1]}, "nonnegative integers"),
        "vocabulary": ({"label_token_ids": [128]}, "Token ID 128 is out of vocabulary"),
        "per item": ({"label_token_ids": [[3], [4]]}, "one list per item"),
        "temperature": ({"temperature": 0.5}, "temperature requires apply_softmax=True"),
        "zero": (
            {"temperature": 0, "apply_softmax": True},
            "temperature: Input should be greater than 0",
        ),
        "mixed": ({"items": [[1, 2]]}, "Invalid combination of query/items types"),
        "pooled": ({"return_pooled_hidden_states": True}, "not supported for CausalLM"),
        "overrides": ({"embed_override_token_id": 7}, "embed_override_token_id"),
        "setwise": ({"score_extraction_token": "x"}, "score_extraction_token"),
        "flag": ({"apply_softmax": "maybe"}, "apply_softmax: Input should be a valid boolean"),
    }
    for case, (change, words) in refused.items():
        status, out = _score(engine, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
        assert out["object"] == "error", case
    status, out = _score(engine, **base)
    assert status == 200 and len(out["scores"]) == 1  # the engine serves on
