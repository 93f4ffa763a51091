"""``/v1/score`` on the built-in engine as a real server, as SGLang 0.5.23 scores with a causal
LM (``entrypoints/openai/serving_score.py``, ``protocol.ScoringRequest``/``ScoringResponse``,
``managers/tokenizer_manager_score_mixin.py``: ``score_request``,
``_process_single_item_scoring_results``, ``_convert_logprobs_to_scores``), against
transformers' distribution after each ``query + item``."""

from __future__ import annotations

import math
import urllib.request

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
        "rows, no id": ({"query_embed_overrides": [[0.0] * 32]}, "embed_override_token_id is"),
        "unknown anchor": ({"score_extraction_token": "x"}, "did not resolve to a dedicated"),
        "setwise, cached": ({"score_extraction_token": "w12"}, "requires --disable-radix-cache"),
        "flag": ({"apply_softmax": "maybe"}, "apply_softmax: Input should be a valid boolean"),
    }
    for case, (change, words) in refused.items():
        status, out = _score(engine, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
        assert out["object"] == "error", case
    status, out = _score(engine, **base)
    assert status == 200 and len(out["scores"]) == 1  # the engine serves on
    # the placeholder id alone, with no rows: nothing to override (SGLang's has_embeds)
    status, same = _score(engine, **base, embed_override_token_id=7)
    assert status == 200 and same["scores"] == out["scores"]


def _after_overridden(
    model: torch.nn.Module, ids: list[int], rows: dict[int, list[float]]
) -> torch.Tensor:
    """transformers' log-probs of the token after ``ids``, the embeddings at ``rows``' positions
    replaced by its rows ``[vocab]``."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids])).clone()
        for at, row in rows.items():
            embeds[0, at] = torch.tensor(row)
        return torch.log_softmax(model(inputs_embeds=embeds).logits[0, -1].float(), -1)


@pytest.mark.timeout(60)
def test_embedding_overrides_take_the_placeholders_places_and_skip_the_prefix_cache(
    engine: Engine,  # noqa: F811
    ref_model: torch.nn.Module,  # noqa: F811
) -> None:
    """``_build_token_id_inputs``: the query's placeholders take ``query_embed_overrides`` in
    order, each item's its own; a prompt with them neither takes the cached KV of the same ids
    nor leaves its own for them (``Req.skip_radix_cache_insert``)."""
    hole = 7
    query = [5, 17, 33, 8, hole, 90, 11, 23, 44, 61, 70, 81]  # long enough to be cached
    items = [[2, hole, 90], [41, 8, 77], [hole, hole]]
    gen = torch.Generator().manual_seed(3)
    q_rows = torch.randn(1, 32, generator=gen).tolist()
    i_rows = [torch.randn(n, 32, generator=gen).tolist() for n in (1, 0, 2)]
    i_rows[1] = None  # that item has none
    plain = {"query": query, "items": items, "label_token_ids": LABELS}
    status, before = _score(engine, **plain)  # the plain prompts' KV now in the cache
    assert status == 200, before
    status, out = _score(
        engine, **plain, embed_override_token_id=hole, query_embed_overrides=q_rows,
        item_embed_overrides=i_rows, return_token_logprobs=True,
    )  # fmt: skip
    assert status == 200, out
    for i, item in enumerate(items):
        prompt = query + item
        rows = {4: q_rows[0]}
        holes = [len(query) + j for j, t in enumerate(item) if t == hole]
        rows.update(zip(holes, i_rows[i] or [], strict=True))
        want = _after_overridden(ref_model, prompt, rows)[LABELS]
        terms = forward_terms(ref_model.config, len(prompt))
        assert_close(out["token_logprobs"][i], want.tolist(), terms=terms)
        assert_close(out["scores"][i], want.exp().tolist(), terms=terms)
        assert out["scores"][i] != before["scores"][i]
    status, after = _score(engine, **plain)  # nothing of the overridden KV was cached
    assert status == 200
    for again, first in zip(after["scores"], before["scores"], strict=True):
        assert again == pytest.approx(first, rel=1e-4)  # (on the cached prefix: not bitwise)
    # text: the query tokenized with special tokens, the items without; a row per placeholder
    status, text = _score(
        engine, query="w5 w7 w17", items=[" w7 w33"], label_token_ids=LABELS,
        embed_override_token_id=hole, item_embed_overrides=[q_rows],
    )  # fmt: skip
    assert status == 200, text
    want = _after_overridden(ref_model, [5, 7, 17, 7, 33], {3: q_rows[0]})[LABELS]
    assert_close(text["scores"][0], want.exp().tolist(), terms=forward_terms(ref_model.config, 5))


@pytest.mark.timeout(60)
def test_embedding_overrides_refused_as_sglang_refuses_them(engine: Engine) -> None:  # noqa: F811
    base = {"query": [5, 7], "items": [[7, 8]], "label_token_ids": LABELS,
            "embed_override_token_id": 7}  # fmt: skip
    row = [0.5] * 32
    refused = {
        "query count": ({"query_embed_overrides": [row, row]},
                        "query contains 1 occurrences of embed_override_token_id=7, but 2"),
        "item count": ({"item_embed_overrides": [[]]},
                       "items[0] contains 1 occurrences of embed_override_token_id=7, but 0"),
        "items length": ({"item_embed_overrides": [None, None]},
                         "item_embed_overrides length (2) must match items length (1)."),
        "item first": ({"query_embed_overrides": [row], "item_first": True},
                       "item_first is not supported when embeddings are supplied"),
        "width": ({"query_embed_overrides": [[0.5] * 31]},
                  "query_embed_overrides[0]: expected a row of 32 numbers"),
    }  # fmt: skip
    for case, (change, words) in refused.items():
        status, out = _score(engine, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
    status, out = _score(engine, **base, query_embed_overrides=[row])
    assert status == 200 and len(out["scores"]) == 1


@pytest.mark.timeout(120)
def test_overridden_and_plain_prompts_of_the_same_ids_at_once_keep_their_own_answers(
    engine: Engine,  # noqa: F811
) -> None:
    """Requests that come together share passes: plain ones of a long common prefix (which the
    prefix cache and the in-batch waves share among them), overridden ones of the same ids
    (which share nothing), and generating ones after the same prefix. Each answers what it
    answers alone."""
    import concurrent.futures

    hole = 7
    prefix = [hole, 5, 17, 33, 8, 90, 11, 23, 44, 61, 70, 81, 3, 9, 14, 15, 16, 18, 19, 20] * 2
    items = [[21 + i, hole] for i in range(6)]
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(2, 32, generator=gen).tolist() for _ in range(6)]
    plain = [{"query": prefix, "items": [item], "label_token_ids": LABELS} for item in items]
    over = [
        {**body, "embed_override_token_id": hole, "query_embed_overrides": [r[0]] * 2,
         "item_embed_overrides": [[r[1]]]}
        for body, r in zip(plain, rows, strict=True)
    ]  # fmt: skip
    calls = [("score", body) for pair in zip(plain, over, strict=True) for body in pair]
    calls += [("generate", {"input_ids": prefix + item, "sampling_params": GREEDY_4})
              for item in items]  # fmt: skip

    def call(what: str, body: dict) -> tuple[int, dict]:
        if what == "score":
            return _score(engine, **body)
        return engine.request("POST", "/generate", body)

    def flush() -> None:
        with urllib.request.urlopen(
            urllib.request.Request(engine.url + "/flush_cache", method="POST"), timeout=10
        ) as answer:
            assert answer.status == 200

    flush()
    alone = [call(*c) for c in calls]
    flush()
    for _ in range(2):  # the second time, the plain prefixes are cached
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            together = list(pool.map(lambda c: call(*c), calls))
        for (what, _), (s1, first), (s2, again) in zip(calls, alone, together, strict=True):
            assert s1 == s2 == 200, (first, again)
            if what == "generate":
                assert again["output_ids"] == first["output_ids"]
                continue
            for a, b in zip(again["scores"][0], first["scores"][0], strict=True):
                assert a == pytest.approx(b, rel=1e-4)


GREEDY_4 = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
