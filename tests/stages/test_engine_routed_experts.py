"""``return_routed_experts`` on the built-in engine, as SGLang 0.5.23 returns them: the experts
each token was run with, in every layer, held to the ``top_k_index`` transformers' own experts
modules get in one forward pass over the whole sequence.

SGLang's source: ``state_capturer/routed_experts.py`` and ``state_capturer/base.py`` (a
``[tokens, layers, k]`` int32 buffer, zeroed, that layers without experts never write;
``get_topk``: the rows of positions ``[start, seqlen - 1)``), ``scheduler_components/
batch_result_processor.py`` (``_maybe_collect_routed_experts``: at the finish, ``seqlen`` the
prompt and the output through its stop), ``managers/scheduler.py`` (``handle_generate_request``:
the start checked, an abort with a 400, with or without the server's flag),
``detokenizer_manager.py`` (``_b64_encode_per_request``: base64 of ``numpy().tobytes()``),
``tokenizer_manager.py`` (``meta_info["routed_experts"]`` after the hidden states) and
``entrypoints/openai/serving_completions.py``, ``serving_chat.py`` (``sglext.routed_experts``:
the first choice's; in a stream, its own chunk after the choices).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import torch

from stages.engine.protocol import GenerateInput, RequestError, SamplingParams, parse_generate
from stages.engine.routed_experts import ExpertsCapture
from stages.engine.scheduler import Scheduler
from tests.stages.engine_setup import (
    builtin_engine,
    experts_routing,
    load_reference,
    pass_through_template,
    run_with_retraction,
)
from tests.stages.tiny_model import (
    make_gpt_oss_model,
    make_tiny_model,
    make_tiny_moe_model,
    with_tiny_words,
)

PROMPT = [5, 17, 33, 8, 50, 41, 7]
LAYERS, K = 3, 2  # make_tiny_moe_model's: layer 1 dense
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("models") / "moe", seed=5)


@pytest.fixture(scope="module")
def reference(model: Path) -> torch.nn.Module:
    return load_reference(model)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    template = pass_through_template(model.parent)
    flags = ("--enable-return-routed-experts", "--chat-template", str(template))
    with builtin_engine(model, *flags) as engine:
        yield engine


def _routing(reference: torch.nn.Module, ids: list[int], k: int = K) -> np.ndarray:
    """transformers' routing of ``ids`` in one pass: each layer's experts module's
    ``top_k_index`` ``[len, layers, k]``, 0 where a layer has no experts."""
    out = np.zeros((len(ids), len(reference.model.layers), k), dtype=np.int32)
    for i, index in experts_routing(reference, ids).items():
        out[:, i] = index.numpy()
    return out


def _decoded(value: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(value), dtype="<i4").reshape(-1, LAYERS, K)


def _expected(reference: torch.nn.Module, prompt: list[int], output: list[int], start: int):
    """SGLang's rows: every token the model ran (the last output token never did), from
    ``start`` on."""
    sequence = prompt + output
    return _routing(reference, sequence[: len(sequence) - 1])[start:]


@pytest.mark.timeout(120)
def test_deepseeks_latent_attention_layers_route_as_transformers(tmp_path: Path) -> None:
    """DeepSeek-V3's layout on the engine's passes (its latent attention, its grouped top-k
    router by its own module): a sample's routing is transformers' of its sequence."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=K, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=2, topk_group=1, pad_token_id=0, eos_token_id=1,
        bos_token_id=None,
    )  # fmt: skip
    path = with_tiny_words(tmp_path / "deepseek", config, 9)
    reference = load_reference(path)
    scheduler = Scheduler(load_reference(path), max_running=4, routed_experts=True)
    assert scheduler.forward_path == "fast", scheduler.forward_path_why
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    future = scheduler.submit(GenerateInput("d", PROMPT, params, False, routed_experts=0))
    scheduler.run_until_idle()
    result = future.result(timeout=0)
    got = _decoded(result.extra["routed_experts"])
    assert (got == _expected(reference, PROMPT, result.output_ids, 0)).all()
    assert (got[:, 0] == 0).all() and (got[:, 1:] > 0).any()  # the dense first layer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])  # forward path
def test_every_row_gets_the_routing_of_the_passes_that_computed_its_tokens(
    model: Path, reference: torch.nn.Module, fast: bool
) -> None:
    """Prompts of several lengths in one left-padded prefill, two samples sharing one prompt's
    pass, a start past 0, a prefill-only request, a request whose prompt the prefix cache
    holds (its prefix's routing kept there with its KV, by a request that did not ask), one
    that does not ask, and a retraction and re-prefill: each answer is transformers' routing
    of its sequence, the dense layer 0s."""
    long_prompt = [(7 * i) % 120 + 3 for i in range(40)]  # more than IN_BATCH_PREFIX tokens
    scheduler = Scheduler(
        load_reference(model), max_running=8, routed_experts=True, fast_forward=fast
    )
    assert scheduler.forward_path == ("fast" if fast else "transformers")
    assert scheduler.routed_experts
    sample = SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True)
    # the long prompt in the prefix cache first, from a request that does not ask
    warm = scheduler.submit(GenerateInput("warm", long_prompt, sample, False))
    scheduler.run_until_idle()
    assert "routed_experts" not in warm.result(timeout=0).extra
    cases = {  # rid: (prompt, start, max_new_tokens)
        "short": (PROMPT[:3], 0, 7),
        "a": (PROMPT, 0, 7),
        "b": (PROMPT, 0, 7),  # the same prompt: one pass for both
        "from-4": ([*PROMPT, 9, 10], 4, 7),
        "scored": (PROMPT, 2, 0),  # prefill-only: its prompt's routing
        "cached": (long_prompt, 0, 7),
    }
    futures = {}
    # first a prefill one column wide, run alone to its end (bench/engine_fuzz.py --moe found
    # it failing)
    cases = {"one": ([9], 0, 4), **cases}
    for rid, (prompt, start, new) in cases.items():
        params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
        inp = GenerateInput(rid, prompt, params, False, routed_experts=start)
        futures[rid] = scheduler.submit(inp)
        if rid == "one":
            scheduler.run_until_idle()
    plain = scheduler.submit(GenerateInput("plain", long_prompt, sample, False))
    run_with_retraction(scheduler, 3, True)
    assert plain.result(timeout=0).cached_tokens > 0  # the cache held the long prompt
    for rid, (prompt, start, _) in cases.items():
        result = futures[rid].result(timeout=0)
        got = _decoded(result.extra["routed_experts"])
        want = _expected(reference, prompt, result.output_ids, start)
        assert got.shape == want.shape, rid
        assert (got == want).all(), rid
        assert (got[:, 1] == 0).all()  # the dense layer
        assert set(np.unique(got[:, [0, 2]])) <= set(range(8))
    assert futures["a"].result(timeout=0).retractions == 1  # re-prefilled, routed anew
    assert futures["cached"].result(timeout=0).cached_tokens > 0  # as SGLang's radix cache
    assert "routed_experts" not in plain.result(timeout=0).extra


@pytest.mark.timeout(120)
def test_a_prefix_from_the_cache_brings_its_routing(
    model: Path, reference: torch.nn.Module
) -> None:
    """The prefix cache keeps every token's routing beside its KV, whoever computed it: the
    next turn of a finished episode and a prompt scored first by a request that did not ask
    take their prefixes from it, and answer transformers' routing of the whole sequence."""
    scheduler = Scheduler(load_reference(model), max_running=8, routed_experts=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    turn1 = [(5 * i) % 110 + 3 for i in range(36)]
    first = scheduler.submit(GenerateInput("turn1", turn1, params, False))
    scored_prompt = [(11 * i) % 100 + 4 for i in range(40)]
    only = SamplingParams(temperature=1.0, max_new_tokens=0)
    scored = scheduler.submit(GenerateInput("score", scored_prompt, only, True, logprob_start=0))
    scheduler.run_until_idle()
    assert "routed_experts" not in first.result(timeout=0).extra  # not asked
    assert scored.result(timeout=0).input_token_logprobs
    turn2 = [*turn1, *first.result(timeout=0).output_ids, 9, 10]
    futures = {
        "turn2": scheduler.submit(GenerateInput("t2", turn2, params, False, routed_experts=0)),
        "after": scheduler.submit(
            GenerateInput("after", scored_prompt, params, False, routed_experts=3)
        ),
    }
    scheduler.run_until_idle()
    for name, prompt, start in (("turn2", turn2, 0), ("after", scored_prompt, 3)):
        result = futures[name].result(timeout=0)
        assert result.cached_tokens >= 32, name  # the prefix came from the cache
        want = _expected(reference, prompt, result.output_ids, start)
        assert (_decoded(result.extra["routed_experts"]) == want).all(), name


@pytest.mark.timeout(120)
def test_gpt_oss_routes_through_its_own_router(tmp_path: Path) -> None:
    """gpt-oss picks its experts from the router's logits (no softmax first) and calls its
    experts module with keyword-able ``router_indices``: the same capture holds."""
    path = make_gpt_oss_model(tmp_path / "gpt-oss")
    reference = load_reference(path, "eager")  # (gpt-oss has no sdpa in transformers)
    scheduler = Scheduler(load_reference(path, "eager"), max_running=4, routed_experts=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    prompts = {"a": [40, 41, 42, 43, 44], "b": [40, 41, 42, 43, 44], "c": [50, 51]}
    futures = {
        rid: scheduler.submit(GenerateInput(rid, prompt, params, False, routed_experts=0))
        for rid, prompt in prompts.items()
    }
    scheduler.run_until_idle()
    for rid, prompt in prompts.items():
        result = futures[rid].result(timeout=0)
        sequence = prompt + result.output_ids
        want = _routing(reference, sequence[:-1])
        got = np.frombuffer(base64.b64decode(result.extra["routed_experts"]), dtype="<i4")
        assert (got.reshape(want.shape) == want).all(), rid


@pytest.mark.timeout(120)
def test_an_aborted_sample_has_the_rows_it_ran_unless_it_waited(
    model: Path, reference: torch.nn.Module
) -> None:
    """Aborted while running (SGLang's scheduler collects them at its finish): the rows of
    every token it ran. Aborted while it waited after a retraction: none, as SGLang's
    tokenizer answers such an abort."""
    scheduler = Scheduler(load_reference(model), max_running=4, routed_experts=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=80, ignore_eos=True)
    running = scheduler.submit(GenerateInput("run", PROMPT, params, False, routed_experts=0))
    waiting = scheduler.submit(GenerateInput("wait", PROMPT[:4], params, False, routed_experts=0))
    for _ in range(55):  # past 50 tokens: SGLang's tokenizer has 50 of the waiting one's
        scheduler.step()
    scheduler.abort("run")
    scheduler.step()
    result = running.result(timeout=0)
    assert result.finish_reason["message"] == "Aborted"
    want = _expected(reference, PROMPT, result.output_ids, 0)
    assert (_decoded(result.extra["routed_experts"]) == want).all()
    scheduler.pause("retract")
    scheduler.step()
    scheduler.abort("wait")
    scheduler.resume()
    scheduler.run_until_idle()
    result = waiting.result(timeout=0)
    assert result.finish_reason["message"] == "Abort in waiting queue"
    assert len(result.output_ids) == 50
    assert "routed_experts" not in result.extra


def test_a_model_without_experts_is_refused_at_start(tmp_path: Path) -> None:
    dense = load_reference(make_tiny_model(tmp_path / "dense"))
    with pytest.raises(ValueError, match="routes no experts"):
        Scheduler(dense, routed_experts=True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ExpertsCapture(dense)


def test_without_the_servers_flag_none_come_but_the_start_is_checked() -> None:
    """SGLang checks ``routed_experts_start_len`` whatever its flag (an abort with a 400, in
    its words) and answers without routed experts when it has no capturer."""

    def parse(body: dict, enabled: bool) -> list[int | None]:
        inputs, _ = parse_generate(
            {"input_ids": [PROMPT, PROMPT[:3]], **body},
            vocab_size=128, context_length=512, encode=None, routed_experts=enabled,
        )  # fmt: skip
        return [inp.routed_experts for inp in inputs]

    assert parse({"return_routed_experts": True}, True) == [0, 0]
    assert parse({"return_routed_experts": True, "routed_experts_start_len": 3}, True) == [3, 3]
    assert parse({"return_routed_experts": True}, False) == [None, None]
    assert parse({"routed_experts_start_len": 99}, True) == [None, None]  # not asked: unchecked
    # an indexer's top-k: none here either (SGLang's capturer is CUDA's, behind its flag)
    assert parse({"return_indexer_topk": True}, True) == [None, None]
    for enabled in (True, False):
        with pytest.raises(RequestError) as high:
            parse({"return_routed_experts": True, "routed_experts_start_len": 4}, enabled)
        assert str(high.value) == (
            "routed_experts_start_len: "
            "recv_req.routed_experts_start_len=4 is higher than the number of input tokens "
            "len(req.origin_input_ids)=3. Please use a smaller routed_experts_start_len."
        )
        with pytest.raises(RequestError, match=r"=-1 is lower than 0\. Please use a non-neg"):
            parse({"return_routed_experts": True, "routed_experts_start_len": -1}, enabled)


@pytest.mark.timeout(120)
def test_generate_and_the_openai_routes_answer_them(url: str, reference: torch.nn.Module) -> None:
    info = requests.get(url + "/server_info", timeout=30).json()
    assert info["enable_return_routed_experts"] is True
    # /generate, n = 2: each sample its own, after the hidden states' place, before e2e_latency
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "temperature": 1.0, "n": 2},
        "return_routed_experts": True,
        "routed_experts_start_len": 1,
    }
    answers = requests.post(url + "/generate", json=body, timeout=60).json()
    for answer in answers:
        meta = answer["meta_info"]
        keys = list(meta)
        assert keys.index("routed_experts") == keys.index("e2e_latency") - 1
        want = _expected(reference, PROMPT, answer["output_ids"], 1)
        assert (_decoded(meta["routed_experts"]) == want).all()
    # streamed: only the last chunk has them
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True) as r:
        chunks = [
            json.loads(line[len(b"data: ") :])
            for line in r.iter_lines()
            if line.startswith(b"data: {")
        ]
    last = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert len(last) == 2
    assert all("routed_experts" not in c["meta_info"] for c in chunks if c not in last.values())
    for chunk in last.values():
        want = _expected(reference, PROMPT, chunk["output_ids"], 1)
        assert (_decoded(chunk["meta_info"]["routed_experts"]) == want).all()
    # the refusal, SGLang's 400
    bad = requests.post(url + "/generate", json={**body, "routed_experts_start_len": 8})
    assert bad.status_code == 400 and "is higher than the number of input tokens" in bad.text

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    extra = {"return_routed_experts": True, "return_token_ids": True}
    completion = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=5, temperature=0, extra_body=extra
    )
    output = completion.choices[0].model_extra["token_ids"]
    want = _expected(reference, PROMPT, output, 0)
    assert (_decoded(completion.model_extra["sglext"]["routed_experts"]) == want).all()
    # a stream: one chunk with sglext, no choices, after the choices' last chunks
    stream = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body=extra,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert (_decoded(chunks[-1].model_extra["sglext"]["routed_experts"]) == want).all()
    # the chat route: the rendered messages' routing (the template writes the words and a space)
    words = " ".join(f"w{i}" for i in PROMPT)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": words}], max_tokens=4,
        temperature=0, extra_body={"return_routed_experts": True},
    )  # fmt: skip
    routed = _decoded(chat.model_extra["sglext"]["routed_experts"])
    assert routed.shape[0] == chat.usage.prompt_tokens + chat.usage.completion_tokens - 1
    streamed = list(
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": words}], max_tokens=4,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"return_routed_experts": True},
        )
    )  # fmt: skip
    sglext = [c.model_extra["sglext"] for c in streamed if (c.model_extra or {}).get("sglext")]
    assert len(sglext) == 1 and streamed[-1].usage is not None  # before the usage chunk
    assert (_decoded(sglext[0]["routed_experts"]) == routed).all()  # greedy: the same tokens
    # not asked: no sglext
    plain = client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
    assert "sglext" not in (plain.model_extra or {})


@pytest.mark.parametrize("kind", ["classify", "embed"])
def test_a_pooling_engine_refuses_the_flag_before_it_loads(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reward or embedding model generates nothing to route: the engine says so and exits 2
    (the folder is never read)."""
    from stages.engine.pooling_server import serve_pooling
    from stages.engine.server import parse_args

    args = parse_args(["--model", "/nonexistent", "--enable-return-routed-experts"])
    assert serve_pooling(args, kind, None) == 2  # type: ignore[arg-type]
    assert "--enable-return-routed-experts" in capsys.readouterr().out
