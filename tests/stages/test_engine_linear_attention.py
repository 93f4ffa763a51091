"""Hybrid models whose layers are partly linear attention, served by the built-in engine on
transformers' passes: Qwen3.5's and Qwen3-Next's gated delta nets, the Mamba layers of Granite 4
(``granitemoehybrid``), Nemotron-H, Jamba, Bamba and OLMo's hybrid, LFM2's (and LFM2-MoE's)
short convolutions, Falcon-H1's layers that run attention and a Mamba mixer side by side.
Such a layer keeps a state a row (its convolution's last inputs, its recurrent state), not a KV
a token: ``kv_batch.BatchKV`` keeps them in slots, copied in from the prefill and moved with
their row, and the scheduler turns the prefix cache off (a state cannot be cut at a token).

The reference is the plainest computation there is: each step a whole forward over the
sequence alone, no cache, no padding. Rows of prompts of different lengths are prefilled
together (left-padded), two samples share a prefill, rows join while others decode and leave
at different steps (their slots move): the answers must not see any of it."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import serving
from tests.stages.tiny_model import make_tiny_qwen3_5_model, qwen3_5_config, spread_weights

V = 64
_BASE = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
)  # fmt: skip
_GATED_DELTA = dict(
    head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)  # fmt: skip
_EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)  # fmt: skip
_MAMBA = dict(
    num_hidden_layers=4, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
    mamba_d_conv=4,
)  # fmt: skip

CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen3_5": lambda: qwen3_5_config(vocab_size=V),
    "qwen3_5_moe": lambda: AutoConfig.for_model(
        "qwen3_5_moe_text", **_BASE, **_GATED_DELTA, **_EXPERTS
    ),
    "qwen3_next": lambda: AutoConfig.for_model("qwen3_next", **_BASE, **_GATED_DELTA, **_EXPERTS),
    "lfm2": lambda: AutoConfig.for_model(
        "lfm2",
        **_BASE,
        num_hidden_layers=4,
        conv_L_cache=3,
        block_ff_dim=96,
        layer_types=["conv", "conv", "full_attention", "conv"],
    ),
    "lfm2_moe": lambda: AutoConfig.for_model(
        "lfm2_moe",
        **_BASE,
        num_hidden_layers=4,
        conv_L_cache=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=1,
        layer_types=["conv", "conv", "full_attention", "conv"],
    ),
    "granite4": lambda: AutoConfig.for_model(
        "granitemoehybrid",
        **_BASE,
        **_MAMBA,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    ),
    "bamba": lambda: AutoConfig.for_model("bamba", **_BASE, **_MAMBA, attn_layer_indices=[1]),
    "nemotron_h": lambda: AutoConfig.for_model(
        "nemotron_h",
        **_BASE,
        num_hidden_layers=4,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        layers_block_type=["mamba", "moe", "attention", "mlp"],
    ),
    "jamba": lambda: AutoConfig.for_model(
        "jamba",
        **_BASE,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
    ),
    # attention and a Mamba mixer side by side in every layer (transformers' "hybrid" layers)
    "falcon_h1": lambda: AutoConfig.for_model(
        "falcon_h1",
        **_BASE,
        num_hidden_layers=3,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
    ),
    "olmo_hybrid": lambda: AutoConfig.for_model(
        "olmo_hybrid",
        **_BASE,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
    # Kimi Delta Attention layers and a latent-attention (MLA) one, a mixture of experts after
    # the first layer's dense MLP
    "kimi_linear": lambda: AutoConfig.for_model(
        "kimi_linear",
        **{**_BASE, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        num_hidden_layers=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def _model(config: Any, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return spread_weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def _whole_forwards(
    model: torch.nn.Module, prompt: list[int], n: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each step a whole forward over the sequence alone."""
    ids: list[int] = list(prompt)
    logprobs: list[float] = []
    for _ in range(n):
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
        lps = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        ids.append(int(lps.argmax()))
        logprobs.append(float(lps[ids[-1]]))
    return ids[len(prompt) :], logprobs


@pytest.mark.numerics  # rerun on every CPU kernel by .ci/run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(CONFIGS))
@torch.inference_mode()
def test_rows_that_join_and_leave_answer_as_a_whole_forward(family: str) -> None:
    model = _model(CONFIGS[family]())
    scheduler = Scheduler(model, max_running=16)
    assert scheduler.forward_path == "transformers"
    rng = random.Random(1)
    asked: list[tuple[list[int], int]] = []
    futures = []
    for wave in range(2):  # the second wave joins rows that decode (the states' room grows)
        inputs = []
        for i in range(4):
            prompt = [rng.randrange(3, V) for _ in range(rng.randrange(1, 12))]
            new = rng.randrange(1, 8)  # rows leave at different steps: the others move
            params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
            for j in range(2):  # two samples of the prompt: one prefill, two slots
                inputs.append(GenerateInput(f"w{wave}-{i}-{j}", prompt, params, True))
                asked.append((prompt, new))
        futures.append(scheduler.submit_many(inputs))
        for _ in range(3):
            scheduler.step()
    scheduler.run_until_idle()
    results = [r for future in futures for r in future.result(timeout=60)]
    terms = forward_terms(model.config, 24)
    for (prompt, new), result in zip(asked, results, strict=True):
        ids, logprobs = _whole_forwards(model, prompt, new)
        assert result.output_ids == ids, (prompt, result.rid)
        assert_close(result.output_token_logprobs, logprobs, terms=terms)


@pytest.mark.numerics  # rerun on every CPU kernel by .ci/run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(CONFIGS))
@torch.inference_mode()
def test_an_episodes_next_turn_goes_on_from_the_states_its_last_turn_left(family: str) -> None:
    """Multi-turn episodes: each turn is the last one's prompt and answer and a few tokens
    more. Its prefix comes from the prefix cache (all but the last turn's last token, whose
    states the finished row left there) and only the rest is prefilled, in the same admission
    as fresh prompts and as other turns of other lengths; the answers are still the whole
    forwards'. Jamba's Mamba scan cannot go on from a state (it starts from zeros): its
    prefix cache is off and every turn is prefilled whole."""
    model = _model(CONFIGS[family]())
    scheduler = Scheduler(model, max_running=16)
    reuses = family != "jamba"
    assert scheduler.prefix_cache_stats()["enabled"] is reuses
    rng = random.Random(2)
    prompts = [[rng.randrange(3, V) for _ in range(rng.randrange(2, 12))] for _ in range(3)]
    extras = [0] * len(prompts)  # the tokens each turn adds after the last turn's answer
    for turn in range(3):
        asked = [(p, rng.randrange(2, 7)) for p in prompts]
        fresh = [([rng.randrange(3, V) for _ in range(rng.randrange(1, 9))], 3) for _ in range(2)]
        inputs = [
            GenerateInput(
                f"t{turn}-{i}", p, SamplingParams(n, temperature=0.0, ignore_eos=True), True
            )
            for i, (p, n) in enumerate(asked + fresh)
        ]
        future = scheduler.submit_many(inputs)
        scheduler.run_until_idle()
        results = future.result(timeout=60)
        for (prompt, n), result in zip(asked + fresh, results, strict=True):
            ids, logprobs = _whole_forwards(model, prompt, n)
            assert result.output_ids == ids, (turn, prompt)
            assert_close(
                result.output_token_logprobs, logprobs, terms=forward_terms(model.config, 48)
            )
        cached = [r.cached_tokens for r in results]
        if turn and reuses:  # the last turn's sequence: its prompt and all but its last token
            kept = [len(p) - 1 - extra for p, extra in zip(prompts, extras, strict=True)]
            assert cached == [*kept, 0, 0]
        else:
            assert cached == [0] * len(results)
        extras = [rng.randrange(1, 4) for _ in prompts]
        prompts = [
            [*p, *r.output_ids, *(rng.randrange(3, V) for _ in range(k))]
            for p, r, k in zip(prompts, results[: len(prompts)], extras, strict=True)
        ]


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_a_retraction_and_released_memory_leave_the_answers_as_they_were() -> None:
    """A retracting pause sends running rows back to wait (their states dropped: they are
    prefilled again with what they generated); released memory takes the states' storage,
    which the next rows allocate afresh."""
    model = _model(CONFIGS["qwen3_next"]())
    scheduler = Scheduler(model, max_running=8)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    want = [_whole_forwards(model, prompt, 8)[0] for prompt in prompts]
    future = scheduler.submit_many(
        [GenerateInput(f"a{i}", p, params, True) for i, p in enumerate(prompts)]
    )
    for _ in range(4):
        scheduler.step()
    paused = scheduler.pause("retract")
    scheduler.step()
    assert paused.done() and scheduler._kv.rows == 0  # every row went back to wait
    scheduler.resume()
    scheduler.run_until_idle()
    assert [r.output_ids for r in future.result(timeout=30)] == want
    for change in (scheduler.release_memory, scheduler.resume_memory):
        done = change(None)
        scheduler.run_until_idle()
        done.result(timeout=10)
    future = scheduler.submit_many(
        [GenerateInput(f"b{i}", p, params, True) for i, p in enumerate(prompts)]
    )
    scheduler.run_until_idle()
    assert [r.output_ids for r in future.result(timeout=30)] == want


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_sglangs_mamba_cache_flags_bound_the_states_of_rows_and_of_the_cache() -> None:
    """SGLang's ``--max-mamba-cache-size``: the states of the rows running and of the prefix
    cache together, which caps the rows; the cache keeps what the rows leave, and the next
    turn still goes on from its state. ``--mamba-full-memory-ratio``: the cache's states in
    that times the bytes of its KV. Values that leave no state are refused at start; a model
    without linear attention ignores both, as SGLang's."""
    model = _model(CONFIGS["qwen3_5"]())
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(6)]

    def run(scheduler: Scheduler, prompts: list[list[int]], size: int | None = None) -> Any:
        future = scheduler.submit_many(
            [GenerateInput(f"r{i}", p, params, True) for i, p in enumerate(prompts)]
        )
        while not future.done():
            scheduler.step()
            if size is not None:
                assert scheduler._kv.rows + scheduler.prefix_cache_stats()["states"] <= size
        return future.result(timeout=10)

    scheduler = Scheduler(model, max_running=8, mamba_cache_size=5)
    assert scheduler.max_running == 5
    results = run(scheduler, prompts, 5)  # five run, then the sixth: one state makes room
    stats = scheduler.prefix_cache_stats()
    assert (stats["states"], stats["max_states"], stats["state_evictions"]) == (5, 5, 1)
    turn = [*prompts[5], *results[5].output_ids, 9]
    (again,) = run(scheduler, [turn], 5)
    assert again.cached_tokens == len(turn) - 2  # its last token's state was never computed
    assert again.output_ids == _whole_forwards(model, turn, 3)[0]

    # 64 tokens of 256 bytes of KV, times 2.5: two states of 18,432 bytes
    scheduler = Scheduler(model, max_running=8, prefix_cache_tokens=64, mamba_memory_ratio=2.5)
    run(scheduler, prompts)
    stats = scheduler.prefix_cache_stats()
    assert stats["max_state_bytes"] == 40960 and stats["max_states"] is None
    assert (stats["states"], stats["state_bytes"], stats["state_evictions"]) == (2, 36864, 4)

    with pytest.raises(ValueError, match="too small to serve any requests"):
        Scheduler(model, mamba_cache_size=0)
    with pytest.raises(ValueError, match="give a ratio > 0"):
        Scheduler(model, mamba_memory_ratio=0.0)
    dense = Scheduler(_model(AutoConfig.for_model("qwen2", **_BASE, num_hidden_layers=1)),
                      max_running=8, mamba_cache_size=0, mamba_memory_ratio=0.0)  # fmt: skip
    assert dense.max_running == 8 and "states" not in dense.prefix_cache_stats()


def _cached_decode(
    model: torch.nn.Module, prompt: list[int], n: int, dtype: torch.dtype
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers' own cached decode of ``prompt``
    alone, its layers' recurrent states kept in ``dtype`` between passes (from the prefill's
    on: each step's pass copies its float32 state into them)."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    for layer in cache.layers:
        states = getattr(layer, "recurrent_states", None)
        if states and states[0] is not None:
            states[0] = states[0].to(dtype)
    ids, logprobs = list(prompt), []
    for step in range(n):
        lps = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        ids.append(int(lps.argmax()))
        logprobs.append(float(lps[ids[-1]]))
        if step < n - 1:
            out = model(input_ids=torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True)
    return ids[len(prompt) :], logprobs


# the families whose layers keep a recurrent state (LFM2's keep a convolution's only), less
# Bamba: transformers' cached decode of it does not answer as its whole forward does (1 of 8
# greedy answers here, float32 states too), and the engine's passes follow the whole forward's
_RECURRENT = sorted(set(CONFIGS) - {"lfm2", "lfm2_moe", "bamba"})


@pytest.mark.numerics  # rerun on every CPU kernel by .ci/run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", _RECURRENT)
@torch.inference_mode()
def test_sglangs_mamba_ssm_dtype_keeps_the_recurrent_states_in_it_between_passes(
    family: str,
) -> None:
    """``--mamba-ssm-dtype bfloat16``: a prompt's answer is transformers' cached decode of it
    with its recurrent states in bfloat16 (SGLang's Mamba pool keeps them so:
    configs/mamba_utils.py), not with float32 ones, SGLang's default and the engine's. (A row
    at a time: rounding to bfloat16 turns the last bits by which batched passes differ into
    whole bfloat16 steps, which the float32 tests above need not bound.)"""
    model = _model(CONFIGS[family]())
    rng = random.Random(1)
    scheduler = Scheduler(model, max_running=4, mamba_ssm_dtype="bfloat16")
    near = apart = 0.0  # from the bfloat16 states' answers, and from the float32 ones'
    for i in range(4):
        prompt = [rng.randrange(3, V) for _ in range(rng.randrange(1, 12))]
        new = rng.randrange(3, 10)
        params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        future = scheduler.submit(GenerateInput(f"r{i}", prompt, params, True))
        scheduler.run_until_idle()
        result = future.result(timeout=10)
        ids, logprobs = _cached_decode(model, prompt, new, torch.bfloat16)
        assert result.output_ids == ids, (prompt, result.rid)
        got = result.output_token_logprobs
        near = max(near, *(abs(a - b) for a, b in zip(got, logprobs, strict=True)))
        _, wide = _cached_decode(model, prompt, new, torch.float32)
        apart = max(apart, *(abs(a - b) for a, b in zip(got, wide, strict=True)))
    kept = {s.recurrent.dtype for s in scheduler._kv.states if s.recurrent is not None}
    assert kept == {torch.bfloat16}
    assert near < 1e-4 and apart > 1e-3, (near, apart)
    default = Scheduler(model, max_running=4)  # float32, SGLang's default
    future = default.submit(GenerateInput("f", [5, 6, 7], params, True))
    default.run_until_idle()
    assert future.result(timeout=10).output_ids
    assert {s.recurrent.dtype for s in default._kv.states if s.recurrent is not None} == {
        torch.float32
    }


def test_layer_types_it_cannot_keep_are_refused_at_start() -> None:
    """A hybrid whose layer types include one the slots cannot keep is refused, naming it."""
    model = _model(CONFIGS["qwen3_5"]())
    model.config.layer_types = ["linear_attention"] * 3 + ["chunked_attention"]
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\] are not supported"):
        Scheduler(model)


@pytest.mark.timeout(180)
def test_a_qwen3_5_served_over_http_answers_scores_and_streams(tmp_path: Path) -> None:
    """``inflight engine`` on a Qwen3.5 checkpoint, as a user starts it: a batch with ``n``,
    a stream, an episode's next turn on its cached prefix, a prompt scored (``max_new_tokens:
    0``), and after new weights the new model's answers, equal the whole forwards'."""
    model_dir = make_tiny_qwen3_5_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 40, 41, 7, 100, 3], [17, 4], [60, 61, 62, 90, 21]]
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
    flags = ("--max-mamba-cache-size", "12", "--mamba-full-memory-ratio", "3",
             "--mamba-ssm-dtype", "float32")  # (SGLang's)  # fmt: skip
    with serving(model_dir, tmp_path / "engine.log", *flags) as eng, torch.inference_mode():
        info = requests.get(eng.url + "/server_info", timeout=30).json()
        assert info["forward_path"] == "transformers"
        assert info["prefix_cache"]["enabled"] is True
        assert (info["max_mamba_cache_size"], info["mamba_full_memory_ratio"]) == (12, 3.0)
        assert info["mamba_ssm_dtype"] == "float32"
        body = {"input_ids": prompts, "sampling_params": {**greedy, "n": 2}, "return_logprob": True}
        answers = requests.post(eng.url + "/generate", json=body, timeout=60).json()
        assert len(answers) == 6
        for k, answer in enumerate(answers):  # n: each prompt's samples side by side
            ids, logprobs = _whole_forwards(model, prompts[k // 2], 6)
            assert answer["output_ids"] == ids
            got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
            assert_close(got, logprobs, terms=forward_terms(model.config, 16))
        stream = {"input_ids": prompts[0], "sampling_params": greedy, "stream": True}
        with requests.post(eng.url + "/generate", json=stream, timeout=60, stream=True) as r:
            chunks = [
                json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")
            ]
        # (chunks that pile up while the client reads are merged into the newest)
        assert len(chunks) >= 2 and chunks[0]["meta_info"]["finish_reason"] is None
        ids, _ = _whole_forwards(model, prompts[0], 6)
        assert chunks[-1]["output_ids"] == ids
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        # the episode's next turn: its prefix from the states the stream's row left
        turn = [*prompts[0], *ids, 9]
        body = {"input_ids": turn, "sampling_params": greedy, "return_logprob": True}
        answer = requests.post(eng.url + "/generate", json=body, timeout=60).json()
        assert answer["meta_info"]["cached_tokens"] == len(turn) - 2
        assert answer["output_ids"] == _whole_forwards(model, turn, 6)[0]
        cache = requests.get(eng.url + "/server_info", timeout=30).json()["prefix_cache"]
        assert cache["max_states"] == 12 and 1 <= cache["states"] <= 12  # no row runs now
        score = {
            "input_ids": prompts[0], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0,
        }  # fmt: skip
        scored = requests.post(eng.url + "/generate", json=score, timeout=60).json()
        entries = scored["meta_info"]["input_token_logprobs"]
        whole = torch.log_softmax(model(input_ids=torch.tensor([prompts[0]])).logits[0], -1)
        want = [float(whole[i, tok]) for i, tok in enumerate(prompts[0][1:])]
        assert entries[0][0] is None and [e[1] for e in entries] == prompts[0]
        assert_close([e[0] for e in entries[1:]], want, terms=forward_terms(model.config, 8))
        # new weights by name (gated delta nets' A_log, dt_bias, conv1d too), as an update
        # from the learner lands: the answers are the new model's
        second = make_tiny_qwen3_5_model(tmp_path / "second", seed=8)
        update = {"model_path": str(second), "weight_version": "2"}
        assert requests.post(eng.url + "/update_weights_from_disk", json=update, timeout=60).ok
        new = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).eval()
        body = {"input_ids": prompts, "sampling_params": greedy}
        answers = requests.post(eng.url + "/generate", json=body, timeout=60).json()
        for prompt, answer in zip(prompts, answers, strict=True):
            assert answer["output_ids"] == _whole_forwards(new, prompt, 6)[0]
            assert answer["output_ids"] != _whole_forwards(model, prompt, 6)[0]
            assert answer["meta_info"]["weight_version"] == "2"
