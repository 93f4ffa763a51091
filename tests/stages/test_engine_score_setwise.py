"""``/v1/score``'s setwise readout (``score_extraction_token``) on an engine without the prefix
cache, as SGLang 0.5.23 reads it with a causal LM (``tokenizer_manager_score_mixin``:
``_validate_score_extraction``, ``_resolve_score_extraction_indices``,
``_process_single_item_scoring_results`` with ``per_item_matrix``; ``logits_processor``'s
``compute_logprobs_at_positions``: the labels' log-probs of the token after each anchor), against
transformers' distribution at each anchor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import load_reference
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

LABELS = [3, 41, 90]
ANCHOR = 12  # the tiny tokenizer's "w12"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("setwise") / "model", vocab=128, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("setwise-log") / "engine.log"
    with serving(model_dir, log, "--disable-radix-cache") as eng:
        yield eng


def _score(engine: Engine, **body: object) -> tuple[int, dict]:
    return engine.request("POST", "/v1/score", body)


def _at(model: torch.nn.Module, ids: list[int], embeds: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' log-probs of the token after each position of ``ids`` ``[len, vocab]``."""
    with torch.no_grad():
        if embeds is None:
            logits = model(torch.tensor([ids])).logits[0]
        else:
            logits = model(inputs_embeds=embeds[None]).logits[0]
        return torch.log_softmax(logits.float(), -1)


@pytest.mark.timeout(60)
def test_each_anchor_gives_a_row_of_the_labels_after_it(
    engine: Engine, reference: torch.nn.Module
) -> None:
    query = [5, 17, 33]
    items = [[2, ANCHOR, 90, 8, ANCHOR, 77], [41, 8, ANCHOR]]  # the last ends on its anchor
    status, out = _score(
        engine, query=query, items=items, label_token_ids=LABELS,
        score_extraction_token="w12", return_token_logprobs=True,
    )  # fmt: skip
    assert status == 200, out
    assert [len(m) for m in out["scores"]] == [2, 1]
    assert out["token_logprobs"] == []  # SGLang's setwise branch adds none
    for matrix, item in zip(out["scores"], items, strict=True):
        prompt = query + item
        after = _at(reference, prompt)
        anchors = [p for p, t in enumerate(prompt) if t == ANCHOR]
        terms = forward_terms(reference.config, len(prompt))
        for row, p in zip(matrix, anchors, strict=True):
            assert_close(row, after[p, LABELS].exp().tolist(), terms=terms)
    assert out["usage"]["prompt_tokens"] == 9 + 6
    # text: each whole query + item tokenized once; a softmax over the labels per row
    status, soft = _score(
        engine, query="w5 w17", items=[" w12 w33 w12"], label_token_ids=LABELS,
        score_extraction_token="w12", apply_softmax=True, temperature=2.0,
    )  # fmt: skip
    assert status == 200, soft
    (matrix,) = soft["scores"]
    after = _at(reference, [5, 17, 12, 33, 12])
    for row, p in zip(matrix, [2, 4], strict=True):
        want = torch.softmax(after[p, LABELS].double() / 2.0, 0).tolist()
        assert_close(row, want, terms=forward_terms(reference.config, 5))
        assert sum(row) == pytest.approx(1)


@pytest.mark.timeout(60)
def test_setwise_with_embedding_overrides(engine: Engine, reference: torch.nn.Module) -> None:
    """Both at once: the text query tokenized, its placeholder overridden, rows read at the
    item's anchors."""
    hole = 7
    row = torch.randn(32, generator=torch.Generator().manual_seed(5))
    status, out = _score(
        engine, query="w5 w7", items=[[ANCHOR, 40, ANCHOR]], label_token_ids=LABELS,
        score_extraction_token="w12", embed_override_token_id=hole,
        query_embed_overrides=[row.tolist()],
    )  # fmt: skip
    assert status == 200, out
    prompt = [5, 7, ANCHOR, 40, ANCHOR]
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(torch.tensor(prompt)).clone()
    embeds[1] = row
    after = _at(reference, prompt, embeds)
    (matrix,) = out["scores"]
    for got, p in zip(matrix, [2, 4], strict=True):
        assert_close(got, after[p, LABELS].exp().tolist(), terms=forward_terms(reference.config, 5))


@pytest.mark.timeout(60)
def test_setwise_refusals_in_sglang_words(engine: Engine) -> None:
    base = {"query": [5, 17], "items": [[ANCHOR, 8]], "label_token_ids": LABELS,
            "score_extraction_token": "w12"}  # fmt: skip
    refused = {
        "in query": ({"query": [ANCHOR, 5]}, "score-extraction token found in the shared query"),
        "text in query": ({"query": "w12 w5", "items": [" w12"]},
                          "score-extraction token found in the shared query"),
        "none": ({"items": [[ANCHOR], [8, 9]]}, "No score-extraction token (id=12) found"),
        "item first": ({"item_first": True}, "item_first is not supported with score_extraction"),
        "mixed": ({"query": "w5", "items": [[ANCHOR]]},
                  "query and items must both be text or both be token IDs"),
        "unknown": ({"score_extraction_token": "nothing"}, "did not resolve to a dedicated"),
    }  # fmt: skip
    for case, (change, words) in refused.items():
        status, out = _score(engine, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
    status, out = _score(engine, **base)
    assert status == 200 and len(out["scores"][0]) == 1  # the engine serves on
    # an engine with --allow-auto-truncate refuses the readout (tokenizer_manager_score_mixin)
    from transformers import AutoTokenizer

    from stages.engine.openai_api import OpenAIError
    from stages.engine.openai_score import ScoreEngine, score_request

    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    truncating = ScoreEngine(tokenizer, prefix_cache=False, embed_width=None, auto_truncate=True)
    with pytest.raises(OpenAIError, match="not supported with --allow-auto-truncate"):
        score_request(base, truncating)
    score_request(base, ScoreEngine(tokenizer, prefix_cache=False, embed_width=None))
