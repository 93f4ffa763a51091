"""``/v1/score`` under ``--enable-mis``, SGLang 0.5.23's multi-item scoring
(``tokenizer_manager_score_mixin``: ``_build_multi_item_token_sequence``,
``_process_multi_item_scoring_results``, ``_anchor_counts_per_item``,
``_process_multi_item_extraction_results``; ``flashinfer_backend._process_multi_item_scoring``:
the items' mask and position ids; ``logits_processor.compute_logprobs_for_multi_item_scoring``:
the readout before each delimiter), held to transformers' forward of the whole fused sequence
under that mask, which the engine never builds: it scores each item alone at those positions."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.engine.openai_score import MIS_DELIMITER
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

LABELS = [3, 41, 90]
VOCAB = 10240  # token 9999, the delimiter, is a token of it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mis") / "model", vocab=VOCAB, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", params=["fast", "transformers"])
def engine(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("mis-log") / "engine.log"
    with serving(model_dir, log, "--enable-mis", "--forward", request.param) as eng:
        yield eng


def _score(engine: Engine, **body: object) -> tuple[int, dict]:
    return engine.request("POST", "/v1/score", body)


def _fused(
    query: list[int], items: list[list[int]]
) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """SGLang's fused sequence, its delimiters' indices, its position ids and its mask (0 where
    a token sees another: the query causally, each item's block (its delimiter and tokens) the
    query and itself causally; -inf elsewhere)."""
    fused, delims, blocks = list(query), [], [-1] * len(query)
    for b, item in enumerate(items):
        delims.append(len(fused))
        fused += [MIS_DELIMITER, *item]
        blocks += [b] * (len(item) + 1)
    delims.append(len(fused))
    fused.append(MIS_DELIMITER)
    blocks.append(len(items))
    size = len(query)
    positions = list(range(size))
    for t in range(size, len(fused)):
        start = max(d for d in delims if d <= t)
        positions.append(size + (t - start) - 1)  # prefix_len + pos_within_item - 1
    mask = torch.full((len(fused), len(fused)), float("-inf"))
    for t in range(len(fused)):
        for s in range(t + 1):
            if s < size or blocks[s] == blocks[t]:
                mask[t, s] = 0.0
    return fused, delims, positions, mask


def _fused_logprobs(
    model: torch.nn.Module, query: list[int], items: list[list[int]]
) -> tuple[torch.Tensor, list[int]]:
    """transformers' log-probs at every position of the fused sequence, and its delimiters."""
    fused, delims, positions, mask = _fused(query, items)
    with torch.no_grad():
        logits = model(
            torch.tensor([fused]), attention_mask=mask[None, None],
            position_ids=torch.tensor([positions]),
        ).logits[0]  # fmt: skip
    return torch.log_softmax(logits.float(), -1), delims


@pytest.mark.timeout(60)
def test_each_item_is_read_before_the_delimiter_that_ends_it(
    engine: Engine, reference: torch.nn.Module
) -> None:
    query, items = [5, 17, 33], [[2, 90], [41, 8, 77], [6]]
    status, out = _score(
        engine, query=query, items=items, label_token_ids=LABELS, return_token_logprobs=True,
        item_first=True,  # (ignored under MIS)
    )  # fmt: skip
    assert status == 200, out
    logprobs, delims = _fused_logprobs(reference, query, items)
    terms = forward_terms(reference.config, len(delims) + 9)
    for i, d in enumerate(delims[1:]):  # the first delimiter ends the query: no decision
        want = logprobs[d - 1, LABELS]
        assert_close(out["token_logprobs"][i], want.tolist(), terms=terms)
        assert_close(out["scores"][i], want.exp().tolist(), terms=terms)
    assert out["usage"]["prompt_tokens"] == 3 + 3 + 4 + 2 + 1  # the fused sequence's
    # a text query with token-id items is fine under MIS (tokenized apart, then fused)
    status, mixed = _score(engine, query="w5 w17 w33", items=items, label_token_ids=LABELS)
    assert status == 200, mixed
    for got, want in zip(mixed["scores"], out["scores"], strict=True):
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.timeout(60)
def test_the_setwise_readout_and_overrides_under_mis(
    engine: Engine, reference: torch.nn.Module
) -> None:
    anchor, hole = 12, 7
    query, items = [5, hole, 33], [[12, 90, 12], [41, 12]]
    row = torch.randn(32, generator=torch.Generator().manual_seed(2))
    status, out = _score(
        engine, query=query, items=items, label_token_ids=LABELS, score_extraction_token="w12",
        embed_override_token_id=hole, query_embed_overrides=[row.tolist()],
        return_token_logprobs=True,
    )  # fmt: skip
    assert status == 200, out
    assert out["token_logprobs"] is None  # (SGLang's MIS setwise answer has none)
    fused, _, positions, mask = _fused(query, items)
    with torch.no_grad():
        embeds = reference.get_input_embeddings()(torch.tensor([fused])).clone()
        embeds[0, 1] = row
        logits = reference(
            inputs_embeds=embeds, attention_mask=mask[None, None],
            position_ids=torch.tensor([positions]),
        ).logits[0]  # fmt: skip
    logprobs = torch.log_softmax(logits.float(), -1)
    anchors = [t for t, token in enumerate(fused) if token == anchor]
    rows = [r for matrix in out["scores"] for r in matrix]
    assert [len(m) for m in out["scores"]] == [2, 1]
    for got, t in zip(rows, anchors, strict=True):
        want = logprobs[t, LABELS].exp().tolist()
        assert_close(got, want, terms=forward_terms(reference.config, len(fused)))


@pytest.mark.timeout(60)
def test_what_sglang_refuses_under_mis(engine: Engine) -> None:
    base = {"query": [5, 17], "items": [[12, 8], [9, 12]], "label_token_ids": LABELS,
            "score_extraction_token": "w12"}  # fmt: skip
    refused = {
        "in query": ({"query": [12, 5]}, "found outside the candidate items"),
        "an item without": ({"items": [[12], [8]]}, "Each item (candidate set) must contain"),
        "none": ({"items": [[8]]}, "No score-extraction token (id=12) found"),
        "no query": ({"query": []}, "--enable-mis needs a query"),
    }
    for case, (change, words) in refused.items():
        status, out = _score(engine, **{**base, **change})
        assert status == 400 and words in out["message"], (case, out)
    body = {"input": "w5", "questions": [{"id": "q", "type": "yes_no", "question": "w6"}]}
    status, out = engine.request("POST", "/v1/decisions", body)
    assert status == 400 and out["message"] == "/v1/decisions does not support --enable-mis"


@pytest.mark.timeout(60)
def test_a_classifier_under_mis_and_a_model_without_the_delimiter(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = make_tiny_classifier(tmp_path / "rm", seed=4, labels=("a", "b"), vocab=VOCAB)
    reference = AutoModelForSequenceClassification.from_pretrained(
        model, attn_implementation="eager"
    ).eval()
    query, items = [5, 17], [[2, 90], [41]]
    with serving(model, tmp_path / "rm.log", "--enable-mis") as engine:
        status, out = _score(engine, query=query, items=items, return_pooled_hidden_states=True)
        assert status == 200, out
    fused, delims, positions, mask = _fused(query, items)
    with torch.no_grad():
        hidden = reference.base_model(
            torch.tensor([fused]), attention_mask=mask[None, None],
            position_ids=torch.tensor([positions]),
        ).last_hidden_state[0]  # fmt: skip
    for i, d in enumerate(delims[1:]):
        terms = forward_terms(reference.config, len(fused))
        assert_close(out["scores"][i], reference.score(hidden[d - 1]).tolist(), terms=terms)
        assert_close(out["pooled_hidden_states"][i], hidden[d - 1].tolist(), terms=terms)
    small = make_tiny_model(tmp_path / "small", seed=1)  # 128 tokens: no 9999
    run = subprocess.run(
        [sys.executable, "-m", "stages.engine.server", "--model", str(small), "--enable-mis",
         "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "delimiter token 9999" in run.stdout + run.stderr


def _word_tokenizer(bos: bool) -> object:
    """A word-level tokenizer of ``VOCAB`` words in which ``yes`` and ``no`` are words 20 and 21
    (a reranker's answers), with a BOS (word 3) before every text or none."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "yes": 20, "no": 21}
    words.update({f"w{i}": i for i in range(3, VOCAB) if i not in (20, 21)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        core.post_processor = processors.TemplateProcessing(
            single="w3 $A", special_tokens=[("w3", 3)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>")


def test_rerank_under_mis_scores_the_prompts_as_an_empty_querys_items() -> None:
    """SGLang's ``/v1/rerank`` scores its rendered prompts with ``score_prompts``: a
    ``/v1/score`` of an empty query, which ``--enable-mis`` fuses: the query is the tokenizer's
    special tokens alone (a BOS), the prompts the items, tokenized without them; a tokenizer
    without a BOS leaves no query (a 400 here)."""
    from stages.engine.openai_api import OpenAIError
    from stages.engine.openai_rerank import rerank_request
    from stages.engine.protocol import POSITIONS

    template = "{{ messages[0]['content'] }} {{ messages[1]['content'] }} the answer can only be "
    template += '"yes" or "no" '  # (what makes it a reranker's template)
    body = {"query": "w5 w6", "documents": ["w7", "w8 w9"]}
    with pytest.raises(OpenAIError, match="needs a query"):
        rerank_request(body, template, _word_tokenizer(bos=False), True)
    tokenizer = _word_tokenizer(bos=True)
    native, options = rerank_request(body, template, tokenizer, True)
    tail = ' the answer can only be "yes" or "no" '
    docs = [tokenizer.encode(f"w5 w6 {d}{tail}", add_special_tokens=False)
            for d in body["documents"]]  # fmt: skip
    assert native["input_ids"] == [[3, MIS_DELIMITER, *d] for d in docs]
    assert [p.ids for p in native[POSITIONS]] == [(0, 0, *range(1, 1 + len(d))) for d in docs]
    assert native["token_ids_logprob"] == [[20, 21]] * 2 and options["labels"] == (20, 21)
    alone, _ = rerank_request(body, template, tokenizer, False)
    assert POSITIONS not in alone and len(alone["text"]) == 2
