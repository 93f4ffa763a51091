"""Encoder models on the built-in engine as real servers, as SGLang 0.5.23 serves them with
``--is-embedding``: BERT and XLM-R cross-encoders (bge-reranker's kind) ranking
query-document pairs on ``/v1/rerank`` and scoring them on ``/encode``, and a BERT embedder on
``/v1/embeddings``, each held to transformers' own forward of each prompt alone.

What SGLang does, and these tests follow: ``serving_rerank.py`` (``_convert_to_internal_request``:
``[query, document]`` pairs in an ``EmbeddingReqInput`` with ``is_cross_encoder_request``;
``_build_rerank_response``: the score is the embedding, or its first value; the best first);
``tokenizer_manager.py`` ``_tokenize_texts`` (the pairs through ``tokenizer(pairs,
return_token_type_ids=True)``); ``layers/pooler.py`` ``CrossEncodingPooler`` (the
classification head over the first token, then the activation
``get_cross_encoder_activation_function`` reads from the config, then ``squeeze(-1)``: one
label's score a number); ``models/bert.py`` ``BertModel`` with ``--is-embedding``
(``Pooler(CLS, normalize=True)``); ``models/roberta.py`` (positions from the padding index).

Against a real SGLang server when ``INFLIGHT_SGLANG_CROSS_ENCODER_URL`` names one and
``INFLIGHT_SGLANG_CROSS_ENCODER_MODEL`` the folder it serves (``make_bert(DIR,
"BertForSequenceClassification", seed=1)`` from ``tests/stages/tiny_encoders.py``, started with
``python -m sglang.launch_server --model-path DIR --is-embedding``): the cross-encoder tests
that hold answers to transformers, at bfloat16's tolerance (the 400s are the built-in
engine's)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
)

from stages.engine.openai_api import OpenAIError
from stages.engine.openai_rerank import cross_encoder_pairs
from stages.engine.pooling import load_pooling_model, pooling_kind
from stages.engine.pooling_server import serve_pooling
from stages.engine.server import parse_args
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_encoders import WORDS, make_bert, make_xlmr

SIGMOID = "torch.nn.modules.activation.Sigmoid"
QUERY = "w5 w6 w7"
DOCUMENTS = ["w8", "w9 w10 w11 w12 w13", "w14 w15", "w16 w17 w18 w19 w20 w21 w22 w23", "w24"]


# a real SGLang server (``--is-embedding``) on a cross-encoder made by ``make_bert`` (one
# label), with that folder: the cross-encoder tests that hold both to transformers run on it
CROSS_URL = os.environ.get("INFLIGHT_SGLANG_CROSS_ENCODER_URL", "")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("bert")
    if CROSS_URL:
        folder = os.environ.get("INFLIGHT_SGLANG_CROSS_ENCODER_MODEL", "")
        if not folder:
            pytest.skip("set INFLIGHT_SGLANG_CROSS_ENCODER_MODEL to the served model's folder")
        yield Engine(CROSS_URL.rstrip("/"), Path(folder), root / "none.log")
        return
    model = make_bert(root / "model", "BertForSequenceClassification", seed=1)
    with serving(model, root / "engine.log") as engine:
        yield engine


def _real(engine: Engine) -> bool:
    return bool(CROSS_URL) and engine.url == CROSS_URL.rstrip("/")


def _dtype(engine: Engine) -> torch.dtype | None:
    """The tolerance's dtype: a real server's bfloat16, float32 (None) for the built-in one."""
    return torch.bfloat16 if _real(engine) else None


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("xlmr")
    model = make_xlmr(root / "model", seed=2, sbert_ce_default_activation_function=SIGMOID)
    with serving(model, root / "engine.log") as engine:
        yield engine


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("bert-embedder")
    model = make_bert(root / "model", "BertModel", seed=3)
    with serving(model, root / "engine.log", "--is-embedding") as engine:
        yield engine


def _reference(
    engine: Engine, query: str, document: str | None = None, keep: int | None = None
) -> tuple[float, float]:
    """transformers' logit for the pair (or the text) alone, its first ``keep`` tokens where
    given, and its rounding's scale (the largest sum of ``|weight * input|`` of the head's
    last dot product)."""
    model = AutoModelForSequenceClassification.from_pretrained(engine.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    encoded = tokenizer(query, document, return_tensors="pt", return_token_type_ids=True)
    encoded = {name: ids[:, :keep] for name, ids in encoded.items()}
    with torch.no_grad():
        logit = model(**encoded).logits[0, 0]
        hidden = model.base_model(**encoded).last_hidden_state[0, 0]
        if hasattr(model, "bert"):  # BERT: its pooler, then the classifier
            pooled = model.bert.pooler.activation(model.bert.pooler.dense(hidden))
            head = model.classifier.weight
        else:  # XLM-R: dense, tanh, then out_proj
            pooled = torch.tanh(model.classifier.dense(hidden))
            head = model.classifier.out_proj.weight
        scale = float((head.abs() @ pooled.abs()).max())
    return float(logit), scale


def _terms(engine: Engine, length: int) -> int:
    config = AutoModelForSequenceClassification.from_pretrained(engine.model_dir).config
    return forward_terms(config, length)


def _context(engine: Engine) -> int:
    """The model's context (its position table: BERT's pads none)."""
    return AutoModelForSequenceClassification.from_pretrained(
        engine.model_dir
    ).config.max_position_embeddings


def _pair_length(engine: Engine, query: str, document: str) -> int:
    return len(AutoTokenizer.from_pretrained(engine.model_dir)(query, document)["input_ids"])


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_a_bert_cross_encoder_ranks_documents_by_its_score_of_each_pair(bert: Engine) -> None:
    # serving_rerank: [query, document] pairs, the score the head's logit (no activation:
    # bge-reranker's default), the best first; meta_info the native one
    status, out = bert.request("POST", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, out
    want = {i: _reference(bert, QUERY, doc) for i, doc in enumerate(DOCUMENTS)}
    assert [a["index"] for a in out] == sorted(want, key=lambda i: -want[i][0])
    for answer in out:
        i = answer["index"]
        assert answer["document"] == DOCUMENTS[i]
        length = _pair_length(bert, QUERY, DOCUMENTS[i])
        terms, scale = _terms(bert, length), want[i][1]
        assert_close([answer["score"]], [want[i][0]], terms=terms, scale=scale, dtype=_dtype(bert))
        assert answer["meta_info"]["prompt_tokens"] == length
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # top_n and return_documents: false (the document key left out, as RerankResponse does)
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    status, top = bert.request("POST", "/v1/rerank", body)
    assert status == 200 and [a["index"] for a in top] == [a["index"] for a in out[:2]]
    assert all("document" not in a for a in top)
    # content parts: their text parts joined with a space, the rest left out
    parts = [{"type": "text", "text": "w8 w9"}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"query": QUERY, "documents": [parts, "w8 w9"], "return_documents": False}
    status, mixed = bert.request("POST", "/v1/rerank", body)
    assert status == 200, mixed
    assert abs(mixed[0]["score"] - mixed[1]["score"]) < 1e-6


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_encode_scores_cross_encoder_pairs_and_texts_as_numbers(bert: Engine) -> None:
    # /encode with is_cross_encoder_request: text as pairs (SGLang's CROSS_ENCODER_PAIRS), each
    # scored with its token types; a one-label cross-encoder's embedding is one number
    pairs = [[QUERY, doc] for doc in DOCUMENTS[:3]]
    body = {"text": pairs, "is_cross_encoder_request": True}
    status, out = bert.request("POST", "/encode", body)
    assert status == 200 and len(out) == 3, out
    for (query, doc), answer in zip(pairs, out, strict=True):
        logit, scale = _reference(bert, query, doc)
        length = _pair_length(bert, query, doc)
        assert isinstance(answer["embedding"], float)
        terms = _terms(bert, length)
        assert_close([answer["embedding"]], [logit], terms=terms, scale=scale, dtype=_dtype(bert))
    # token types matter: the same ids as one text (all type 0) score otherwise
    tokenizer = AutoTokenizer.from_pretrained(bert.model_dir)
    ids = tokenizer(*pairs[1])["input_ids"]
    status, flat = bert.request("POST", "/encode", {"input_ids": ids})
    assert status == 200 and abs(flat["embedding"] - out[1]["embedding"]) > 1e-4
    status, text = bert.request("POST", "/encode", {"text": "w5 w6"})
    logit, scale = _reference(bert, "w5 w6")
    assert status == 200
    assert_close(
        [text["embedding"]], [logit], terms=_terms(bert, 4), scale=scale, dtype=_dtype(bert)
    )


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_an_xlmr_cross_encoder_applies_its_configs_activation(xlmr: Engine) -> None:
    # get_cross_encoder_activation_function: the torch.nn.modules class the config names;
    # XLM-R's positions count from its padding index, its padding its pad token
    status, out = xlmr.request("POST", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200, out
    assert [a["score"] for a in out] == sorted((a["score"] for a in out), reverse=True)
    for answer in out:
        doc = DOCUMENTS[answer["index"]]
        logit, scale = _reference(xlmr, QUERY, doc)
        length = _pair_length(xlmr, QUERY, doc)
        assert 0 < answer["score"] < 1
        # the sigmoid's slope is at most 1/4: the logit's bound holds for it
        want = torch.sigmoid(torch.tensor(logit)).item()
        assert_close([answer["score"]], [want], terms=_terms(xlmr, length), scale=scale)
    # 66 positions from index 2 on: 64 tokens fit, 65 would index past the table (a 400)
    for words, status_wanted in ((57, 200), (58, 400)):
        doc = " ".join((WORDS * 2)[:words])
        assert _pair_length(xlmr, QUERY, doc) == words + 7
        status, out = xlmr.request("POST", "/v1/rerank", {"query": QUERY, "documents": [doc]})
        assert status == status_wanted, out


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_a_bert_embedder_answers_its_first_tokens_normalized_state(embedder: Engine) -> None:
    # BertModel with --is-embedding: Pooler(CLS, normalize=True), a batch of lengths
    texts = ["w5", "w6 w7 w8 w9 w10 w11", "w12 w13"]
    status, out = embedder.request("POST", "/v1/embeddings", {"input": texts})
    assert status == 200, out
    model = AutoModel.from_pretrained(embedder.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedder.model_dir)
    for text, item in zip(texts, out["data"], strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            first = model(**encoded).last_hidden_state[0, 0]
        length = encoded["input_ids"].shape[1]
        want = F.normalize(first, dim=-1)
        assert_close(item["embedding"], want, terms=forward_terms(model.config, length), scale=1)
    # embedding overrides: SGLang's BERT has no input-embedding hook; refused, named
    body = {"input": ["w5 w6"], "embed_override_token_id": 5, "embed_overrides": [[[0.0] * 32]]}
    status, refused = embedder.request("POST", "/v1/embeddings", body)
    assert status == 400 and refused["param"] == "embed_overrides", refused


@pytest.mark.timeout(60)
def test_what_a_cross_encoder_answers_with_400s(bert: Engine) -> None:
    if _real(bert):
        pytest.skip("the built-in engine's answers (SGLang's differ where the README says)")
    # its numbers are no list of outputs: SGLang's response models refuse them (its
    # /v1/classify with a 500); /v1/score's pooled hidden states in SGLang's words
    for path, body in (
        ("/v1/classify", {"input": "w5 w6"}),
        ("/v1/embeddings", {"input": "w5 w6"}),
        ("/v1/score", {"query": "w5", "items": ["w6"]}),
    ):
        status, out = bert.request("POST", path, body)
        assert status == 400 and "one number" in out["message"], (path, out)
    body = {"query": "w5", "items": ["w6"], "return_pooled_hidden_states": True}
    status, out = bert.request("POST", "/v1/score", body)
    assert status == 400 and out["message"].startswith(
        "return_pooled_hidden_states is not supported for BertForSequenceClassification."
    )
    # SGLang's request checks, in its words
    for body, words in (
        ({"query": QUERY, "documents": []}, "Documents cannot be empty"),
        ({"query": " ", "documents": ["w5"]}, "Query cannot be empty or whitespace only"),
        ({"query": QUERY, "documents": ["w5", ""]}, "Each document must be a non-empty string"),
    ):
        status, out = bert.request("POST", "/v1/rerank", body)
        assert status == 400 and out["message"] == words, out
    parts = [{"type": "text", "text": "w8"}]
    status, out = bert.request("POST", "/v1/rerank", {"query": QUERY, "documents": [parts]})
    assert status == 400 and out["param"] == "return_documents", out
    bad = {"text": [["w5", "w6"], ["w7"]], "is_cross_encoder_request": True}
    status, out = bert.request("POST", "/encode", bad)
    assert status == 400 and "text[1]" in out["error"]["message"], out
    long = {"query": QUERY, "documents": [" ".join(WORDS * 2)]}  # past its 64 positions
    status, out = bert.request("POST", "/v1/rerank", long)
    assert status == 400 and "context length" in out["message"], out
    assert bert.request("GET", "/health")[0] == 200


def test_reranker_templates_and_qwen3_vl_models_are_refused_on_a_pooling_engine() -> None:
    body = {"query": "q", "documents": ["d"]}
    text = 'Note that the answer can only be "yes" or "no".'
    with pytest.raises(OpenAIError, match="Detected Qwen3 reranker chat template"):
        cross_encoder_pairs(body, text, "/models/reranker")
    with pytest.raises(OpenAIError, match="Detected Qwen3-VL reranker"):
        cross_encoder_pairs(body, text + "<|vision_start|>", "/models/reranker")
    with pytest.raises(OpenAIError, match="Detected Qwen3-VL reranker"):
        cross_encoder_pairs(body, None, "/models/Qwen3-VL-Reranker-2B")
    assert cross_encoder_pairs(body, "{{ messages }}", "/models/bge") == [["q", "d"]]


def test_encoder_architectures_and_a_bad_activation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SGLang's is_generation_model: these serve as pooling models by themselves
    config = BertConfig(architectures=["BertForSequenceClassification"])
    assert pooling_kind(config, False) == "classify"
    for name in ("BertModel", "Contriever", "XLMRobertaModel"):
        assert pooling_kind(BertConfig(architectures=[name]), False) == "embed"
    # get_cross_encoder_activation_function: only torch.nn.modules classes are loaded
    bad = make_bert(
        tmp_path / "bad",
        "BertForSequenceClassification",
        sbert_ce_default_activation_function="os.system",
    )
    with pytest.raises(ValueError, match=r"restricted to torch\.nn\.modules"):
        load_pooling_model(bad, "classify")
    good = make_bert(
        tmp_path / "good",
        "BertForSequenceClassification",
        sbert_ce_default_activation_function=SIGMOID,
    )
    model = load_pooling_model(good, "classify")
    assert model.cross_encoder and model.encoder and isinstance(model.activation, torch.nn.Sigmoid)
    scores, states = model.pool([[2, 5, 6, 3, 7, 3]], types=[[0, 0, 0, 0, 1, 1]])
    assert 0 < scores[0] < 1 and states == [None]
    # --enable-mis fuses items behind a causal mask: an encoder is refused at start
    args = parse_args(["--model", str(good), "--enable-mis"])
    assert serve_pooling(args, "classify", None) == 2  # type: ignore[arg-type]
    assert "decoder models only" in capsys.readouterr().out
    # the pooling engine applies no adapters: SGLang's LoRA flags are refused, not ignored
    for flags in (["--enable-lora"], ["--lora-paths", "a=/x"]):
        args = parse_args(["--model", str(good), *flags])
        assert serve_pooling(args, "classify", None) == 2  # type: ignore[arg-type]
        said = capsys.readouterr().out
        assert f"option={flags[0]}" in said and "applies no LoRA adapters" in said, said


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_a_cross_encoders_weights_update_from_disk_between_passes(tmp_path: Path) -> None:
    # SGLang's weight routes serve a pooling model as a generating one: a trainer updating its
    # reranker reward model; the pairs score as the new checkpoint scores them. Started with
    # --allow-auto-truncate: a pair past the context keeps its first context - 6 tokens and
    # their token types (managers/utils.py:260, validate_input_length), as SGLang cuts it
    first = make_bert(tmp_path / "a", "BertForSequenceClassification", seed=4)
    second = make_bert(tmp_path / "b", "BertForSequenceClassification", seed=5)
    body = {"query": QUERY, "documents": DOCUMENTS[:2], "return_documents": False}
    long = {"query": QUERY, "documents": [" ".join(WORDS * 2)], "return_documents": False}
    with serving(first, tmp_path / "engine.log", "--allow-auto-truncate") as engine:
        status, before = engine.request("POST", "/v1/rerank", body)
        assert status == 200, before
        status, out = engine.request(
            "POST", "/update_weights_from_disk", {"model_path": str(second)}
        )
        assert status == 200 and out["success"], out
        status, after = engine.request("POST", "/v1/rerank", body)
        cut_status, cut = engine.request("POST", "/v1/rerank", long)
    assert status == 200, after
    assert cut_status == 200, cut
    new = Engine(engine.url, second, engine.log_file)
    keep = _context(new) - 6
    assert _pair_length(new, QUERY, long["documents"][0]) > keep
    logit, scale = _reference(new, QUERY, long["documents"][0], keep)
    assert_close([cut[0]["score"]], [logit], terms=_terms(new, keep), scale=scale)
    for answer in after:
        doc = DOCUMENTS[answer["index"]]
        logit, scale = _reference(new, QUERY, doc)
        length = _pair_length(new, QUERY, doc)
        assert_close([answer["score"]], [logit], terms=_terms(new, length), scale=scale)
    assert {a["index"]: a["score"] for a in before} != {a["index"]: a["score"] for a in after}


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_pairs_and_plain_texts_batched_together_each_score_as_alone(bert: Engine) -> None:
    # a pass may take pairs (token types 0 and 1) and texts (types 0) together: each row its own
    before = None if _real(bert) else bert.request("GET", "/server_info")[1]["internal_states"][0]
    bodies: list[dict[str, Any]] = []
    for i in range(24):
        doc = DOCUMENTS[i % len(DOCUMENTS)]
        if i % 2:
            bodies.append({"text": [[QUERY, doc]], "is_cross_encoder_request": True})
        else:
            bodies.append({"text": f"{QUERY} {doc}"})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: bert.request("POST", "/encode", b), bodies))
    for body, (status, out) in zip(bodies, answers, strict=True):
        assert status == 200, out
        if isinstance(body["text"], list):
            (query, doc), (out,) = body["text"][0], out
            logit, scale = _reference(bert, query, doc)
            length = _pair_length(bert, query, doc)
        else:
            logit, scale = _reference(bert, body["text"])
            length = out["meta_info"]["prompt_tokens"]
        terms = _terms(bert, length)
        assert_close([out["embedding"]], [logit], terms=terms, scale=scale, dtype=_dtype(bert))
    if before is None:
        return  # the counters below are the built-in engine's
    after = bert.request("GET", "/server_info")[1]["internal_states"][0]
    assert after["passes"] - before["passes"] < 24  # requests that waited together ran together
