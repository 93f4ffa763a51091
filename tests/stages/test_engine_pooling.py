"""Pooling models on the built-in engine as real servers, as SGLang 0.5.23 serves them: a reward
model (``Qwen2ForSequenceClassification``: ``/classify``, ``/encode``, ``/v1/classify``) and a
causal LM with ``--is-embedding`` (``/v1/embeddings`` through the ``openai`` client), against
transformers' own forward of each prompt alone (``srt/models/llama_reward.py``: the last
token's hidden state through ``score``; ``llama.py``: ``Pooler(LAST, normalize=True)``;
``tokenizer_manager.py`` ``_handle_batch_output``; ``serving_embedding.py``,
``serving_classify.py``).

Against real SGLang servers when the environment names them (each with the local folder of the
model it serves, which transformers reads as the reference), started for instance with::

    python -m sglang.launch_server --model-path RM_DIR --is-embedding --port 30010
    python -m sglang.launch_server --model-path LM_DIR --is-embedding --port 30011

- ``INFLIGHT_SGLANG_REWARD_URL`` and ``INFLIGHT_SGLANG_REWARD_MODEL``: a reward model (a
  ``*ForSequenceClassification`` checkpoint with one label);
- ``INFLIGHT_SGLANG_EMBEDDING_URL`` and ``INFLIGHT_SGLANG_EMBEDDING_MODEL``: a causal LM served
  as an embedding model;
- ``INFLIGHT_SGLANG_URL``: a generating server (the refusal of pooling routes).

Compared there at bfloat16's tolerance (the server's dtype); the checks of what only the
built-in engine refuses (unknown fields, ids outside the vocabulary...) run on it alone."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from stages.engine.encode_routes import NOT_EMBEDDING
from stages.engine.pooling import Pooler, PoolingFailed, load_pooling_model, pooling_kind
from tests.numerics import assert_close, forward_terms
from tests.stages import engine_setup
from tests.stages.engine_setup import classifier_reference
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model

PROMPTS = ["w5 w6 w7 w8", "w9", "w10 w11 w12 w13 w14 w15 w16", "w17 w18"]


REWARD_URL = os.environ.get("INFLIGHT_SGLANG_REWARD_URL", "")
EMBEDDING_URL = os.environ.get("INFLIGHT_SGLANG_EMBEDDING_URL", "")
GENERATING_URL = os.environ.get("INFLIGHT_SGLANG_URL", "")


def _outside(url: str, variable: str, log: Path) -> Engine:
    """The real server at ``url``, with the model folder ``variable`` names."""
    model = os.environ.get(variable, "")
    if not model:
        pytest.skip(f"set {variable} to the served model's folder")
    return Engine(url.rstrip("/"), Path(model), log)


def _dtype(engine: Engine) -> torch.dtype | None:
    """The tolerance's dtype: a real server's bfloat16, float32 (None) for the built-in one."""
    return torch.bfloat16 if _real(engine) else None


def _real(engine: Engine) -> bool:
    return engine.url.rstrip("/") in {u.rstrip("/") for u in (REWARD_URL, EMBEDDING_URL) if u}


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("reward")
    if REWARD_URL:
        yield _outside(REWARD_URL, "INFLIGHT_SGLANG_REWARD_MODEL", root / "none.log")
        return
    model = make_tiny_classifier(root / "model", seed=3)
    with serving(model, root / "engine.log") as engine:
        yield engine


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("classifier")
    if REWARD_URL:  # SGLang's reward model (one label) stands in for the 3-label classifier
        yield _outside(REWARD_URL, "INFLIGHT_SGLANG_REWARD_MODEL", root / "none.log")
        return
    model = make_tiny_classifier(root / "model", seed=4, labels=("neg", "neu", "pos"))
    with serving(model, root / "engine.log") as engine:
        yield engine


EMBEDDER_NAME = "embedder-v1"  # the built-in embedder's --served-model-name


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("embedder")
    if EMBEDDING_URL:
        yield _outside(EMBEDDING_URL, "INFLIGHT_SGLANG_EMBEDDING_MODEL", root / "none.log")
        return
    model = make_tiny_model(root / "model", seed=5)
    flags = ("--is-embedding", "--served-model-name", EMBEDDER_NAME)
    with serving(model, root / "engine.log", *flags) as engine:
        yield engine


def _scores(engine: Engine, prompt: list[int]) -> tuple[list[float], float]:
    """transformers' outputs of the classification model for ``prompt`` alone, and their
    rounding's scale (``classifier_reference``)."""
    return classifier_reference(engine.model_dir, prompt)


def _ids(engine: Engine, text: str) -> list[int]:
    return _tokenizer(engine).encode(text)


def _terms(engine: Engine, prompt: list[int]) -> int:
    return forward_terms(AutoConfig.from_pretrained(engine.model_dir), len(prompt))


def _agree(
    engine: Engine, got: list[float], prompt: list[int], want: list[float] | None = None
) -> None:
    """``got`` equals transformers' outputs for ``prompt`` (or ``want``, another answer of the
    same) within the float rule of a forward over it, at the scale of the head's terms."""
    reference, scale = _scores(engine, prompt)
    expected = reference if want is None else want
    assert_close(got, expected, terms=_terms(engine, prompt), scale=scale, dtype=_dtype(engine))


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_classify_gives_the_reward_models_score_of_each_prompt(reward: Engine) -> None:
    rids = [f"batch-{i}" for i in range(len(PROMPTS))]
    status, out = reward.request("POST", "/classify", {"text": PROMPTS, "rid": rids})
    assert status == 200, out
    assert [a["meta_info"]["id"] for a in out] == rids
    for answer, text in zip(out, PROMPTS, strict=True):
        ids = _ids(reward, text)
        assert list(answer) == ["embedding", "meta_info"]
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["prompt_tokens"] == len(ids) and meta["num_retractions"] == 0
        assert isinstance(meta["weight_version"], str) and meta["e2e_latency"] > 0
        assert len(answer["embedding"]) == 1  # one label: the reward
        _agree(reward, answer["embedding"], ids)
    # /encode is the same request; input_ids alone
    ids = _ids(reward, PROMPTS[2])
    status, one = reward.request("POST", "/encode", {"input_ids": ids, "rid": "solo"})
    assert status == 200, one
    assert one["meta_info"]["id"] == "solo"
    _agree(reward, one["embedding"], ids, out[2]["embedding"])
    if _real(reward):
        return  # SGLang 0.5.23 keeps a tensor there, for its Python API's scoring
    # with the hidden state the head read
    status, one = reward.request(
        "POST", "/encode", {"input_ids": ids, "return_pooled_hidden_states": True}
    )
    assert status == 200, one
    model = AutoModelForSequenceClassification.from_pretrained(reward.model_dir).eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    assert_close(one["pooled_hidden_state"], hidden.tolist(), terms=_terms(reward, ids))


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_concurrent_requests_share_passes_and_each_gets_its_own_score(reward: Engine) -> None:
    before = reward.request("GET", "/server_info")[1]["internal_states"][0]
    bodies = [{"input_ids": _ids(reward, PROMPTS[i % 4]) + [3] * (i % 5)} for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: reward.request("POST", "/classify", b), bodies))
    for body, (status, out) in zip(bodies, answers, strict=True):
        assert status == 200, out
        ids = body["input_ids"]
        _agree(reward, out["embedding"], ids)
    if _real(reward):
        return  # the counters below are the built-in engine's
    after = reward.request("GET", "/server_info")[1]["internal_states"][0]
    assert after["requests"] - before["requests"] == 24
    assert after["passes"] - before["passes"] < 24  # requests that waited together ran together


@pytest.mark.timeout(60)
def test_v1_classify_answers_labels_and_softmax_probabilities(classifier: Engine) -> None:
    ids = _ids(classifier, PROMPTS[0])
    status, out = classifier.request("POST", "/v1/classify", {"input": [PROMPTS[0], "w3"]})
    assert status == 200, out
    assert list(out) == ["id", "object", "created", "model", "data", "usage"]
    assert out["id"].startswith("classify-") and out["object"] == "list"
    first = out["data"][0]
    logits = torch.tensor(_scores(classifier, ids)[0])
    config = AutoConfig.from_pretrained(classifier.model_dir)
    assert first["index"] == 0 and first["num_classes"] == config.num_labels
    assert first["label"] == config.id2label[int(logits.argmax())]
    probs = torch.softmax(logits, 0).tolist()
    _agree(classifier, first["probs"], ids, probs)  # at most the logits' error
    assert out["usage"]["prompt_tokens"] == len(ids) + 1 == out["usage"]["total_tokens"]
    assert out["usage"]["completion_tokens"] == 0


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_v1_embeddings_through_the_openai_client_are_the_normalized_last_hidden_state(
    embedder: Engine,
) -> None:
    client = openai.OpenAI(base_url=embedder.url + "/v1", api_key="unused", max_retries=0)
    texts = PROMPTS[:3]
    got = client.embeddings.create(model="m", input=texts)  # base64, the client's default
    floats = client.embeddings.create(model="m", input=texts, encoding_format="float")
    model = AutoModelForCausalLM.from_pretrained(embedder.model_dir).eval()
    tokens = 0
    for i, text in enumerate(texts):
        ids = _ids(embedder, text)
        tokens += len(ids)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            last = out.hidden_states[-1][0, -1]  # after the final norm: the head's input
            assert_close(model.lm_head(last), out.logits[0, -1], terms=model.config.hidden_size)
        want = torch.nn.functional.normalize(last, dim=-1).tolist()
        terms = forward_terms(model.config, len(ids))
        assert got.data[i].index == i and got.data[i].object == "embedding"
        assert_close(got.data[i].embedding, want, terms=terms, dtype=_dtype(embedder))
        assert_close(floats.data[i].embedding, want, terms=terms, dtype=_dtype(embedder))
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    if not _real(embedder):  # --served-model-name: the answers' model, /model_info's name
        assert got.model == EMBEDDER_NAME
        info = embedder.request("GET", "/model_info")[1]
        assert info["served_model_name"] == EMBEDDER_NAME
        assert info["model_path"] == str(embedder.model_dir)
        models = embedder.request("GET", "/v1/models")[1]
        assert [card["id"] for card in models["data"]] == [EMBEDDER_NAME]
    # base64 is little-endian float32, as SGLang packs it
    status, raw = embedder.request(
        "POST", "/v1/embeddings", {"input": [[5, 6, 7]], "encoding_format": "base64"}
    )
    assert status == 200, raw
    packed = base64.b64decode(raw["data"][0]["embedding"])
    values = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert math.isclose(math.fsum(v * v for v in values), 1.0, rel_tol=1e-5)


@pytest.mark.timeout(60)
def test_bad_requests_get_sglangs_answers_and_are_counted(reward: Engine, embedder: Engine) -> None:
    vocab = AutoConfig.from_pretrained(reward.model_dir).vocab_size
    context = reward.request("GET", "/server_info")[1]["context_length"]
    sglang = [  # refused with these words by SGLang 0.5.23 too
        (reward, "/classify", {"input_ids": [5] * context}, "longer than the model's context"),
        (reward, "/encode", {"input_ids": [[5], [6]], "rid": ["a", "a"]}, "Duplicate request"),
        (reward, "/encode", {"input_ids": [[5], [6]], "rid": "one"}, "The rid should be a list"),
        (reward, "/encode", {"input_ids": [5], "dimensions": 8}, "matryoshka"),
        (embedder, "/v1/embeddings", {"input": ""}, "Input cannot be empty"),
        (embedder, "/v1/embeddings", {"input": ["w5", "  "]}, "index 1 cannot be empty"),
        (embedder, "/v1/embeddings", {"input": [5, -1]}, "must be non-negative"),
        (embedder, "/v1/embeddings", {"input": "w5", "encoding_format": "hex"}, "'float' or"),
        # EmbeddingRequest's and ClassifyRequest's own types (pydantic's words in SGLang's 400)
        (embedder, "/v1/embeddings", {"input": "w5", "dimensions": "x"}, "valid integer"),
        (embedder, "/v1/embeddings", {"input": "w5", "user": 1}, "valid string"),
        (reward, "/v1/classify", {"input": [[5]]}, "valid string"),
        (reward, "/v1/classify", {"input": "w5", "priority": "high"}, "valid integer"),
        # EmbeddingReqInput's (/encode, /classify: pydantic's dataclass, before the route)
        (reward, "/encode", {"input_ids": [5], "dimensions": "x"}, "dimensions: Input should"),
        (reward, "/classify", {"input_ids": "5"}, "input_ids.list[list[int]]: Input should"),
        (
            reward,
            "/v1/decisions",
            {"input": "x", "questions": [{"id": "q", "type": "yes_no", "question": "ok?"}]},
            "/v1/decisions requires a generation model",
        ),
        (  # serving_decisions.py:160 (_validate_server), SystemOneServing without a head
            reward,
            "/v1/systemone",
            {"state": "x", "model": "m", "questions": {"q": {"type": "noul", "instructions": "?"}}},
            "/v1/systemone requires a generation model",
        ),
    ]
    ours = [  # what SGLang takes, ignores or fails on otherwise, refused here
        (reward, "/classify", {"text": "w5", "input_ids": [5]}, "exactly one of input_ids"),
        (reward, "/classify", {"input_ids": [5, vocab + 9]}, "outside the vocabulary"),
        (reward, "/encode", {"input_ids": [5], "image_data": "x.png"}, "image_data"),
        (embedder, "/v1/classify", {"input": "w5"}, "needs a classification model"),
        (reward, "/generate", {"text": "w5"}, "does not generate"),
        (reward, "/v1/chat/completions", {"messages": []}, "needs a generating model"),
        (reward, "/api/chat", {"model": "m", "messages": []}, "needs a generating model"),
    ]
    for engine, path, body, words in sglang + ([] if _real(reward) else ours):
        status, out = engine.request("POST", path, body)
        assert status == 400, (path, body, out)
        message = out["message"] if "message" in out else out["error"]["message"]
        assert words in message, (path, body, message)
    # the body read first: SystemOneRequest's refusal is FastAPI's 422 (http_server.py:653)
    status, out = reward.request("POST", "/v1/systemone", {"state": "x", "questions": {}})
    assert status == 422, out
    assert [error["loc"] for error in out["detail"]] == [["body", "model"], ["body", "questions"]]
    # other keys ignored, as SGLang's models ignore them; what pydantic converts, converted
    status, out = embedder.request(
        "POST", "/v1/embeddings", {"input": "w5", "bogus": 1, "rid": "r1", "priority": "2"}
    )
    assert status == 200 and len(out["data"]) == 1, out
    status, out = reward.request(
        "POST", "/classify", {"input_ids": ["5"], "log_metrics": "yes", "priority": "2"}
    )
    assert status == 200 and len(out["embedding"]) == 1, out
    status, out = reward.request("POST", "/encode", {"input_ids": [5], "typo": 1})  # ignored
    assert status == 200 and len(out["embedding"]) == 1, out
    if not _real(reward):  # and counted
        assert reward.request("GET", "/server_info")[1]["ignored_fields"]["POST /encode typo"]
        ignored = embedder.request("GET", "/server_info")[1]["ignored_fields"]
        assert ignored["POST /v1/embeddings bogus"] == 1
    for engine in (reward, embedder):
        assert engine.request("GET", "/health_generate")[0] == 200  # still serving
        if not _real(engine):
            refused = engine.request("GET", "/server_info")[1]["refused_requests"]
            assert sum(refused.values()) >= 5


@pytest.mark.numerics
@pytest.mark.timeout(60)
def test_info_routes_and_chat_template_tokenizing_for_a_reward_model(reward: Engine) -> None:
    status, info = reward.request("GET", "/model_info")
    assert status == 200 and info["is_generation"] is False
    assert reward.request("GET", "/ping")[0] == 200
    config = AutoConfig.from_pretrained(reward.model_dir)
    assert info["architectures"] == config.architectures
    status, models = reward.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["object"] == "model"
    status, tags = reward.request("GET", "/api/tags")  # Ollama's list, served for any model
    assert status == 200 and tags["models"][0]["details"]["format"] == "sglang"
    # a conversation rendered with the reward model's own template, then scored
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]
    status, tokens = reward.request(
        "POST", "/v1/tokenize", {"messages": messages, "add_generation_prompt": False}
    )
    assert status == 200, tokens
    tokenizer = _tokenizer(reward)
    want = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False, return_dict=False
    )
    assert tokens["tokens"] == list(want)
    status, out = reward.request("POST", "/classify", {"input_ids": tokens["tokens"]})
    assert status == 200 and len(out["embedding"]) == 1
    # /v1/rerank on a reward model: SGLang's cross-encoder path (serving_rerank), each
    # [query, document] pair encoded as the tokenizer encodes a text pair (here: one after
    # the other) and scored by the head, the score its first output
    docs = ["w7 w8", "w9", "w10 w11 w12"]
    status, ranked = reward.request("POST", "/v1/rerank", {"query": "w5 w6", "documents": docs})
    assert status == 200, ranked
    pairs = tokenizer([["w5 w6", doc] for doc in docs])["input_ids"]
    assert [a["meta_info"]["prompt_tokens"] for a in ranked] == [
        len(pairs[a["index"]]) for a in ranked
    ]
    want = [_scores(reward, list(ids))[0][0] for ids in pairs]
    assert [a["index"] for a in ranked] == sorted(range(3), key=lambda i: -want[i])
    for answer in ranked:
        _agree(reward, [answer["score"]], list(pairs[answer["index"]]))


@pytest.mark.timeout(60)
def test_a_generating_engine_refuses_pooling_routes_as_sglang_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("generating")
    if GENERATING_URL:
        engine = Engine(GENERATING_URL.rstrip("/"), root, root / "none.log")
        context = contextlib.nullcontext(engine)
    else:
        context = serving(make_tiny_model(root / "model", seed=6), root / "engine.log")
    with context as engine:
        for path, body in (("/encode", {"text": "w5"}), ("/classify", {"input_ids": [5]})):
            status, out = engine.request("POST", path, body)
            assert (status, out) == (400, {"error": {"message": NOT_EMBEDDING}})
        status, out = engine.request("POST", "/v1/embeddings", {"input": "w5"})
        assert status == 400 and out["message"] == NOT_EMBEDDING and out["object"] == "error"


def test_what_a_checkpoint_serves_follows_sglangs_architecture_list() -> None:
    class Config:
        def __init__(self, *architectures: str) -> None:
            self.architectures = list(architectures)

    assert pooling_kind(Config("LlamaForSequenceClassification"), False) == "classify"
    assert pooling_kind(Config("Qwen2ForSequenceClassification"), True) == "classify"
    assert pooling_kind(Config("MistralModel"), False) == "embed"
    assert pooling_kind(Config("Qwen2ForCausalLM"), True) == "embed"
    assert pooling_kind(Config("Qwen2ForCausalLM"), False) is None
    assert pooling_kind(Config("Qwen2ForRewardModel"), False) == "classify"  # built here
    with pytest.raises(ValueError, match="remote-code reward model"):
        pooling_kind(Config("InternLM2ForRewardModel"), False)


@pytest.mark.timeout(60)
async def test_a_pass_that_raises_fails_its_requests_and_the_thread_serves_on(tmp_path) -> None:
    model = load_pooling_model(make_tiny_classifier(tmp_path / "rm", seed=8), "classify")
    pooler = Pooler(model)
    pooler.start()
    try:
        (good,), _ = await pooler.encode([[5, 6, 7]])
        with pytest.raises(PoolingFailed, match="IndexError"):  # past the embedding table
            await pooler.encode([[5, model.loaded.vocab_size + 3]])
        (again,), _ = await pooler.encode([[5, 6, 7]])
        assert again == good and pooler.alive
        assert pooler.counts()["failed_requests"] == 1
    finally:
        pooler.stop()
    assert not pooler.alive
    with pytest.raises(PoolingFailed, match="not running"):
        await pooler.encode([[5]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
async def test_a_pooling_model_on_cuda_scores_as_on_cpu(tmp_path) -> None:
    folder = make_tiny_classifier(tmp_path / "rm", seed=9)
    rows = [[5, 6, 7, 8], [9], [10, 11, 12]]
    results = {}
    for device in ("cpu", "cuda"):
        pooler = Pooler(load_pooling_model(folder, "classify", device=device))
        pooler.start()
        try:
            results[device] = await pooler.encode(rows, hidden=True)
        finally:
            pooler.stop()
    config = AutoConfig.from_pretrained(folder)
    for i, row in enumerate(rows):
        terms = forward_terms(config, len(row))
        scale = classifier_reference(folder, row)[1]  # the scores: the head's terms' scale
        assert_close(results["cuda"][0][i], results["cpu"][0][i], terms=terms, scale=scale)
        # the hidden states the head read
        assert_close(results["cuda"][1][i], results["cpu"][1][i], terms=terms)


@pytest.mark.timeout(60)
async def test_the_generators_client_refuses_an_engine_that_serves_a_reward_model(
    reward: Engine,
) -> None:
    import aiohttp

    from stages.generator.client import EngineClient, EngineError

    async with aiohttp.ClientSession() as session:
        client = EngineClient(reward.url, session, timeout_s=10)
        with pytest.raises(EngineError, match="is_generation: false") as err:
            await client.check_key()
    assert not err.value.retryable


def test_a_reward_model_is_not_loaded_as_a_generating_model(tmp_path) -> None:
    from stages.engine.loader import load_model

    folder = make_tiny_classifier(tmp_path / "rm", seed=10)
    with pytest.raises(ValueError, match="reward \\(classification\\) model, which does not gen"):
        load_model(folder)  # what the in-process engine and the generating server load with


@pytest.mark.timeout(60)
def test_weights_checker_of_a_reward_model_answers_the_trainers_digests(reward: Engine) -> None:
    """``/weights_checker`` on a pooling server, as on a generating one: each tensor's digest
    (those ``weight_checker.checksums`` computes of the checkpoint), and a snapshot that a
    compare finds unchanged while requests are served."""
    from stages.engine.weight_checker import checksums

    post = functools.partial(requests.post, reward.url + "/weights_checker", timeout=60)
    answer = post(json={}).json()
    assert answer["success"] is True
    if not _real(reward):  # SGLang's own names differ where it fuses projections
        model = AutoModelForSequenceClassification.from_pretrained(reward.model_dir)
        model = model.to(engine_setup.ENGINE_DEVICE)  # a digest is of that device's kind
        assert answer["ranks"][0]["checksums"] == checksums(model)
    assert post(json={"action": "snapshot"}).json() == {"success": True, "message": "Success."}
    ids = _ids(reward, PROMPTS[0])
    assert requests.post(reward.url + "/classify", json={"input_ids": ids}, timeout=60).ok
    assert post(json={"action": "compare"}).json() == {"success": True, "message": "Success."}
    assert post(json={"action": "wipe"}).status_code == 400


@pytest.mark.timeout(60)
async def test_the_pooling_thread_runs_the_checker_between_passes(tmp_path) -> None:
    """Reset between passes, a reward model scores otherwise and a compare names its
    tensors; its weights copied back from the snapshot, it scores as before."""
    from stages.engine.weight_checker import WeightChecker, WeightCheckError

    model = load_pooling_model(make_tiny_classifier(tmp_path / "rm", seed=8), "classify")
    pooler, checker, net = Pooler(model), WeightChecker(), model.loaded.model
    kept = {name: t.detach().clone() for name, t in net.state_dict().items()}
    pooler.start()
    try:
        (good,), _ = await pooler.encode([[5, 6, 7]])
        await pooler.call(lambda: checker.handle(net, "snapshot"))
        await pooler.call(lambda: checker.handle(net, "reset_tensors"))
        (garbled,), _ = await pooler.encode([[5, 6, 7]])
        assert garbled != good
        with pytest.raises(WeightCheckError, match=r"name=score\.weight "):
            await pooler.call(lambda: checker.handle(net, "compare"))
        await pooler.call(lambda: net.load_state_dict(kept))
        await pooler.call(lambda: checker.handle(net, "compare"))
        (again,), _ = await pooler.encode([[5, 6, 7]])
        assert again == good
    finally:
        pooler.stop()
    with pytest.raises(PoolingFailed, match="not running"):
        await pooler.call(lambda: None)


@pytest.mark.timeout(60)
def test_loads_count_a_reward_models_passes_as_prefills(reward: Engine) -> None:
    """``/v1/loads`` of a pooling engine (SGLang serves it from the same ``http_server``): its
    layout, no request left when idle, no generation, and each pass a prefill of the prompts'
    tokens."""
    from tests.stages.test_engine_loads import CORE

    def load() -> dict:
        status, body = reward.request("GET", "/v1/loads?include=core")
        assert status == 200
        (found,) = body["loads"]
        assert list(found) == CORE
        return found

    before = load()
    prompt = [5, 6, 7, 8, 9]
    status, _ = reward.request("POST", "/classify", {"input_ids": [prompt, prompt[:3]]})
    assert status == 200
    after = load()
    assert after["num_running_reqs"] + after["num_waiting_reqs"] == 0
    assert after["decode_moments"] is None and after["gen_throughput"] == 0
    if not _real(reward):  # the built-in engine's own counts
        grew = after["total_prefill_uncached_tokens"] - before["total_prefill_uncached_tokens"]
        assert grew == len(prompt) + 3
        assert after["total_prefill_busy_us"] > before["total_prefill_busy_us"]
        assert after["max_running_requests"] == 8


@pytest.mark.timeout(60)
async def test_a_pass_under_way_runs_its_rows_and_the_rest_wait(tmp_path) -> None:
    """``Pooler.occupancy``: the rows of the pass under way and their tokens, and those
    queued behind it."""
    import threading

    model = load_pooling_model(make_tiny_classifier(tmp_path / "rm", seed=8), "classify")
    entered, release = threading.Event(), threading.Event()
    pool = model.pool

    def held(rows, dims, *more):  # the pass waits until the test has looked
        entered.set()
        assert release.wait(30)
        return pool(rows, dims, *more)

    model.pool = held  # type: ignore[method-assign]
    pooler = Pooler(model)
    pooler.start()
    try:
        first = asyncio.ensure_future(pooler.encode([[5, 6, 7], [8, 9]]))
        assert await asyncio.to_thread(entered.wait, 30)
        second = asyncio.ensure_future(pooler.encode([[5, 6, 7, 8]]))
        await asyncio.sleep(0.05)
        held_now = pooler.occupancy()
        assert (held_now["running"], held_now["used_tokens"]) == (2, 5)
        assert (held_now["waiting"], held_now["waiting_tokens"]) == (1, 4)
        release.set()
        await asyncio.gather(first, second)
        idle = pooler.occupancy()
        assert (idle["running"], idle["waiting"], idle["used_tokens"]) == (0, 0, 0)
        assert pooler.load.prefill_uncached_tokens == 9
    finally:
        release.set()
        pooler.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--enable-metrics"], "--enable-metrics"),
        (["--return-hidden-states-mode", "last"], "--return-hidden-states-mode"),
        (["--max-queued-requests", "4"], "--max-queued-requests"),
        (["--enable-priority-scheduling"], "--enable-priority-scheduling"),
    ],
    ids=["metrics", "hidden-states", "queue-limit", "priorities"],
)
def test_generation_options_are_refused_on_a_pooling_model(tmp_path, flags, named) -> None:
    """``--enable-metrics`` records generation and hidden states come with generated tokens:
    a pooling engine refuses them at start, saying why, rather than serving without them."""
    import subprocess

    from tests.stages.engine_setup import engine_command

    folder = make_tiny_classifier(tmp_path / "rm", seed=9)
    done = subprocess.run(
        [*engine_command(folder, *flags), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2
    assert named in done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "generates nothing" in said or "takes requests as they come" in said
