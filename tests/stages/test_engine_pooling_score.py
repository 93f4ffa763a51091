"""``/v1/score`` on a pooling engine, as SGLang 0.5.23 scores with a model that does not
generate (``tokenizer_manager_score_mixin.score_request``'s non-generation path,
``_process_single_item_scoring_results``, ``_multi_position_score_rows``): a classifier's head
outputs after each ``query + item``, its embedding overrides and setwise readout, against
transformers' forward of each prompt alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("score-classifier")
    model = make_tiny_classifier(root / "model", seed=4, labels=("neg", "neu", "pos"))
    with serving(model, root / "engine.log", "--disable-radix-cache") as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(classifier: Engine) -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_pretrained(classifier.model_dir).eval()


def _score(engine: Engine, **body: object) -> tuple[int, dict]:
    return engine.request("POST", "/v1/score", body)


def _hidden(model: torch.nn.Module, ids: list[int], rows: dict[int, list[float]] | None = None):
    """transformers' final hidden states of ``ids`` alone ``[len, hidden]`` (``rows``: their
    embeddings at those positions replaced)."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids])).clone()
        for at, row in (rows or {}).items():
            embeds[0, at] = torch.tensor(row)
        return model.base_model(inputs_embeds=embeds).last_hidden_state[0]


def _close(got: list[float], want: torch.Tensor, model: torch.nn.Module, length: int) -> None:
    assert_close(got, want.tolist(), terms=forward_terms(model.config, length))


@pytest.mark.timeout(60)
def test_a_classifier_scores_each_query_and_item_with_its_head(
    classifier: Engine, reference: torch.nn.Module
) -> None:
    query, items = "w11 w12", [" w13", " w14 w15"]
    status, out = _score(classifier, query=query, items=items, return_pooled_hidden_states=True)
    assert status == 200, out
    assert list(out) == ["scores", "pooled_hidden_states", "token_logprobs", "model", "usage",
                         "object"]  # fmt: skip
    assert out["token_logprobs"] is None and out["object"] == "scoring"
    prompts = [[11, 12, 13], [11, 12, 14, 15]]
    assert out["usage"]["prompt_tokens"] == 7
    for scores, state, prompt in zip(
        out["scores"], out["pooled_hidden_states"], prompts, strict=True
    ):
        hidden = _hidden(reference, prompt)[-1]
        _close(scores, reference.score(hidden), reference, len(prompt))
        _close(state, hidden, reference, len(prompt))
    # token ids, labels ignored (a classifier's outputs are its scores), a softmax at 0.5
    status, soft = _score(
        classifier, query=[11, 12], items=[[13]], label_token_ids=[3], apply_softmax=True,
        temperature=0.5,
    )  # fmt: skip
    assert status == 200 and soft["pooled_hidden_states"] is None, soft
    logits = torch.tensor(out["scores"][0], dtype=torch.float64)
    assert soft["scores"][0] == pytest.approx(torch.softmax(logits / 0.5, 0).tolist(), rel=1e-5)


@pytest.mark.timeout(60)
def test_overrides_and_the_setwise_readout_on_a_classifier(
    classifier: Engine, reference: torch.nn.Module
) -> None:
    hole, anchor = 7, 12
    row = torch.randn(32, generator=torch.Generator().manual_seed(6)).tolist()
    status, out = _score(
        classifier, query=[5, hole, 9], items=[[anchor, 40, anchor, 41], [42, anchor]],
        embed_override_token_id=hole, query_embed_overrides=[row],
        score_extraction_token="w12", return_pooled_hidden_states=True,
    )  # fmt: skip
    assert status == 200, out
    assert [len(m) for m in out["scores"]] == [2, 1]
    for i, item in enumerate([[anchor, 40, anchor, 41], [42, anchor]]):
        prompt = [5, hole, 9, *item]
        hidden = _hidden(reference, prompt, {1: row})
        anchors = [p for p, t in enumerate(prompt) if t == anchor]
        for got, state, p in zip(
            out["scores"][i], out["pooled_hidden_states"][i], anchors, strict=True
        ):
            _close(got, reference.score(hidden[p]), reference, len(prompt))
            _close(state, hidden[p], reference, len(prompt))
    status, soft = _score(
        classifier, query=[5, 9], items=[[anchor, 40]], score_extraction_token="w12",
        apply_softmax=True,
    )  # fmt: skip
    assert status == 200, soft
    ((probs,),) = soft["scores"]
    assert sum(probs) == pytest.approx(1, rel=1e-6) and len(probs) == 3


@pytest.mark.timeout(60)
def test_what_sglang_refuses_on_a_model_that_does_not_generate(classifier: Engine) -> None:
    base = {"query": [5, 9], "items": [[12, 40]]}
    refused = {
        "token log-probs": ({"return_token_logprobs": True},
                            "return_token_logprobs is only supported for CausalLM models"),
        "no items": ({"items": None}, "items must be provided"),
        "temperature": ({"temperature": 0.5}, "temperature requires apply_softmax=True"),
        "item first": ({"score_extraction_token": "w12", "item_first": True},
                       "item_first is not supported with score_extraction_token_id."),
    }  # fmt: skip
    for case, (change, words) in refused.items():
        status, out = _score(classifier, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
    status, out = _score(classifier, items=[])
    assert (status, out["scores"]) == (200, [])


@pytest.mark.timeout(60)
def test_an_embedding_model_scores_with_its_embedding_and_refuses_the_readout(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(tmp_path / "model", seed=5)
    with serving(model, tmp_path / "engine.log", "--is-embedding") as engine:
        status, out = _score(engine, query="w5", items=[" w6 w7"])
        assert status == 200, out
        status, native = engine.request("POST", "/encode", {"text": "w5 w6 w7"})
        assert out["scores"] == [pytest.approx(native["embedding"], rel=1e-5)]
        status, out = _score(engine, query=[5], items=[[12]], score_extraction_token="w12")
        assert status == 400 and "['Qwen2ForCausalLM'] do not" in out["message"], out
        _embedding_overrides(engine, model)


def _embedding_overrides(engine: Engine, model: Path) -> None:
    """``/v1/embeddings``' ``embed_overrides`` (``serving_embedding``, ``TokenizerManager.
    _resolve_embed_overrides``): an input's placeholders take its rows; null: none."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model).eval()
    hole = 7
    row = torch.randn(32, generator=torch.Generator().manual_seed(8)).tolist()
    inputs = [[5, hole, 9], [hole, 6]]
    body = {"input": inputs, "embed_override_token_id": hole, "embed_overrides": [[row], None]}
    status, out = engine.request("POST", "/v1/embeddings", body)
    assert status == 200, out
    for got, ids, rows in zip(out["data"], inputs, [{1: row}, {}], strict=True):
        with torch.no_grad():
            embeds = reference.get_input_embeddings()(torch.tensor([ids])).clone()
            for at, vector in rows.items():
                embeds[0, at] = torch.tensor(vector)
            last = reference.base_model(inputs_embeds=embeds).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=-1)
        _close(got["embedding"], want, reference, len(ids))
    refused = {
        "no id": ({"embed_override_token_id": None}, "embed_override_token_id is required"),
        "no rows": ({"embed_overrides": None}, "requires embed_overrides to be provided"),
        "count": ({"embed_overrides": [[row, row], None]},
                  "1 occurrences of embed_override_token_id=7, but embed_overrides has 2"),
        "short": ({"embed_overrides": [[row]]}, "expected an entry (or null) for each of the 2"),
        "width": ({"embed_overrides": [[row[:5]], None]}, "embed_overrides[0][0]: expected a row"),
    }  # fmt: skip
    for case, (change, words) in refused.items():
        status, out = engine.request("POST", "/v1/embeddings", {**body, **change})
        assert status == 400 and words in out["message"], (case, out)
