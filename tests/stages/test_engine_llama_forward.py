"""The engine's own forward passes (``LlamaForward``) against transformers' on each model family
they cover: prefill of left-padded prompts of different lengths (logits and the cache), and
decode steps over the slot cache the scheduler uses."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GPT2Config,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)
from transformers.cache_utils import DynamicCache

from stages.engine.kv_batch import BatchKV
from stages.engine.llama_forward import LlamaForward
from stages.engine.model_weights import load_named_tensors
from stages.engine.scheduler import Scheduler, _layer_masks, _sliding_window
from stages.hf import cache_argument, output_cache
from tests.numerics import assert_close, forward_terms

# the name models' forward takes the cache by (transformers renamed it)
CACHE_ARG = cache_argument(Qwen2ForCausalLM.forward) or "past_key_values"

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

SIZES = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_LATENT = dict(
    SIZES,
    num_key_value_heads=6,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
)
# (GPT-NeoX's heads are all q/k/v heads)
_NEOX = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"} | {"rotary_pct": 0.25}


def _gpt2() -> GPT2Config:
    config = GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=6, n_inner=80, n_positions=256)
    config.intermediate_size = config.n_inner  # (the name tests.numerics reads)
    return config


CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "llama-bias-tied": lambda: LlamaConfig(
        **SIZES, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "llama-rope-scaled": lambda: LlamaConfig(
        **SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "qwen2": lambda: Qwen2Config(**SIZES),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=16),  # q/k norms, head_dim != hidden/heads
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
    # mixtures of experts: the model's own module for the MLP (a dense first layer here)
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SIZES,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=[0],
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(  # a shared expert and its gate; biased q/k/v
        **SIZES,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    ),
    "mixtral": lambda: MixtralConfig(
        **SIZES, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    # sliding windows of 4 (shorter than the prompts): every layer (Mistral's, with no layer
    # types), the last (Qwen2's max_window_layers), or gpt-oss's first, with attention sinks,
    # biases and half-width rotary tables
    "mistral-sliding": lambda: MistralConfig(**SIZES, sliding_window=4),
    "qwen2-sliding": lambda: Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "gpt_oss": lambda: GptOssConfig(
        **{**SIZES, "num_hidden_layers": 3},
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Gemma's layer (four norms, a scaled embedding, GELU): Gemma 2's soft caps, Gemma 3's
    # rotary tables by layer type; a sliding layer then a full one
    "gemma2": lambda: Gemma2Config(
        **SIZES,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3_text": lambda: Gemma3TextConfig(
        **SIZES,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # OLMo's layer: norms after the attention and the MLP only, q and k normed whole; OLMo 3's
    # sliding layers and rotary tables by layer type
    "olmo2": lambda: Olmo2Config(**SIZES),
    # OLMoE: a mixture of experts, q and k normed whole, q/k/v clipped (to bite: 0.5)
    "olmoe": lambda: OlmoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
    "olmo3": lambda: Olmo3Config(
        **SIZES, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    # Phi-3's own fused q/k/v and gate/up projections; Phi-4-mini's partial rotary embedding
    # (a head's first half rotated) and a sliding window of 4 on every layer
    "phi3": lambda: Phi3Config(**SIZES, pad_token_id=0),
    "phi3-partial-sliding": lambda: Phi3Config(
        **SIZES, pad_token_id=0, partial_rotary_factor=0.5, sliding_window=4
    ),
    # Phi-3-128k's and Phi-4-mini's long rotary tables (LongRoPE), taken from position 8 on
    "phi3-longrope": lambda: Phi3Config(
        **SIZES,
        pad_token_id=0,
        original_max_position_embeddings=8,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.5],
            "long_factor": [3.0, 5.0],
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 8,
        },
    ),
    # GLM-4.5's: a mixture with shared experts after a dense first layer, q/k normed, biased
    # q/k/v, half of each head rotated
    "glm4_moe": lambda: Glm4MoeConfig(
        **SIZES,
        head_dim=16,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
    ),
    # SmolLM3's: no rotary embedding on every other layer here (``no_rope_layers``)
    "smollm3": lambda: SmolLM3Config(**SIZES, pad_token_id=0, no_rope_layer_interval=2),
    # Granite's multipliers: the embedding, the attention's scores, each residual branch and
    # the logits
    "granite": lambda: GraniteConfig(
        **SIZES,
        embedding_multiplier=3.0,
        attention_multiplier=0.05,
        residual_multiplier=0.4,
        logits_scaling=2.5,
    ),
    # Seed-OSS (biased q/k/v); Ministral (a sliding window by layer types)
    "seed_oss": lambda: AutoConfig.for_model("seed_oss", **SIZES, head_dim=16),
    "ministral": lambda: AutoConfig.for_model(
        "ministral", **SIZES, head_dim=8, sliding_window=4, layer_types=["sliding_attention"] * 2
    ),
    # neighbouring dimensions rotated together (GLM's style): Helium; ERNIE 4.5 (biases on
    # every projection); GLM-4 (Gemma's four norms under its own names, its own gate_up_proj,
    # half of each head rotated)
    "helium": lambda: AutoConfig.for_model("helium", **SIZES, head_dim=8),
    "ernie4_5": lambda: AutoConfig.for_model("ernie4_5", **SIZES, head_dim=16, use_bias=True),
    "glm4": lambda: AutoConfig.for_model("glm4", **SIZES, head_dim=16, pad_token_id=0),
    # Hunyuan: q and k normed after their rotation
    "hunyuan_v1_dense": lambda: AutoConfig.for_model(
        "hunyuan_v1_dense", **SIZES, head_dim=16, pad_token_id=0
    ),
    # EXAONE 4: OLMo 2's norms, a sliding layer, then a full one that rotates nothing
    "exaone4": lambda: AutoConfig.for_model(
        "exaone4", **SIZES, head_dim=16, sliding_window=4, sliding_window_pattern=2
    ),
    # MLPs without a gate: Apertus (xIELU, its norms named otherwise, q/k normed), Arcee
    # (ReLU²), Nemotron (ReLU², LayerNorm1P, half of each head rotated)
    "apertus": lambda: AutoConfig.for_model(
        "apertus", **SIZES, head_dim=8, rope_parameters={"rope_type": "default"}
    ),
    "arcee": lambda: AutoConfig.for_model("arcee", **SIZES, head_dim=8, mlp_bias=True),
    "nemotron": lambda: AutoConfig.for_model("nemotron", **SIZES, head_dim=8),
    # StableLM: LayerNorms, a quarter of each head rotated; sequential, or parallel residuals
    # from one norm with q and k normed by head
    "stablelm": lambda: AutoConfig.for_model("stablelm", **SIZES),
    "stablelm-parallel": lambda: AutoConfig.for_model(
        "stablelm", **SIZES, use_parallel_residual=True, qk_layernorm=True
    ),
    # Phi-2: one LayerNorm, the attention and an MLP without a gate side by side, part of each
    # head rotated (its 40% here: half), q and k normed, a biased LM head
    "phi": lambda: AutoConfig.for_model(
        "phi", **SIZES, partial_rotary_factor=0.5, qk_layernorm=True
    ),
    # GPT-2: learned positions, Conv1D projections, LayerNorms, GELU
    "gpt2": lambda: _gpt2(),
    # GPT-NeoX (Pythia): each head's q, k and v together, a quarter of each head rotated,
    # LayerNorms, GELU; parallel residuals, or not
    "gpt_neox": lambda: AutoConfig.for_model("gpt_neox", **_NEOX),
    "gpt_neox-sequential": lambda: AutoConfig.for_model(
        "gpt_neox", **_NEOX, use_parallel_residual=False
    ),
    # DeepSeek's multi-head latent attention (q through a low rank, or V2-Lite's one projection;
    # a value width of its own; neighbouring dimensions rotated, V3's evens then odds out) over
    # its mixture with a shared expert, after a dense first layer
    "deepseek_v3": lambda: AutoConfig.for_model("deepseek_v3", **_LATENT, q_lora_rank=16),
    "deepseek_v3-halves": lambda: AutoConfig.for_model(
        "deepseek_v3", **_LATENT, q_lora_rank=None, rope_interleave=False
    ),
    "deepseek_v2": lambda: AutoConfig.for_model("deepseek_v2", **_LATENT, q_lora_rank=None),
}
EAGER_ONLY = {"gpt_oss", "gemma2"}  # (transformers has no sdpa for them)


def _model(config, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # far from ties, and biases that matter
    return model


def _prompts(model, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """Left-padded random prompts of ``lengths``: ids, mask, positions (as the scheduler)."""
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, model.config.vocab_size, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _reference_prefill(model, ids, mask, positions) -> tuple[torch.Tensor, DynamicCache]:
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **{CACHE_ARG: DynamicCache()},
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1], output_cache(out)


def _prefilled(model, attn: str, lengths: list[int]) -> tuple[BatchKV, torch.Tensor]:
    """A slot cache holding left-padded prompts of ``lengths`` (the scheduler's layout)."""
    ids, mask, positions = _prompts(model, lengths)
    last, cache = _reference_prefill(model, ids, mask, positions)
    kv = BatchKV(8, {"sdpa": "bool4d", "eager": "additive4d"}[attn], device=torch.device("cpu"))
    kv.admit(cache, ids, torch.tensor(lengths), None)
    first = last.argmax(-1)
    kv.set_pending(0, len(lengths), first, torch.zeros(len(lengths)))
    return kv, first


def _reference(model, kv: BatchKV) -> torch.Tensor:
    ids, positions, mask = kv.decode_inputs()
    window, all_slide = _sliding_window(model)
    out = model(
        input_ids=ids,
        attention_mask=_layer_masks(mask, window, all_slide),  # as the scheduler gives them
        position_ids=positions,
        **{CACHE_ARG: kv.cache},
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
@torch.inference_mode()
def test_prefill_and_decode_match_transformers(family: str, attn: str) -> None:
    if attn == "sdpa" and family in EAGER_ONLY:
        pytest.skip(f"{family}: eager attention only")
    model = _model(CONFIGS[family](), attn)
    fast, why = LlamaForward.build(model)
    assert fast is not None, why
    lengths = [3, 9, 5, 1, 7]
    kv, _ = _prefilled(model, attn, lengths)
    ids, mask, positions = _prompts(model, lengths)
    cache, logits = fast.prefill(ids, mask, positions)
    expected_logits, expected_cache = _reference_prefill(model, ids, mask, positions)
    terms = forward_terms(model.config, max(lengths) + 6)  # numerics.py: the suite's rule
    assert_close(logits, expected_logits, terms=terms)
    for ours, theirs in zip(cache.layers, expected_cache.layers, strict=True):
        real = mask.bool()[:, None, :, None]  # padding columns are never attended to
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert_close(a * real, b * real, terms=terms)
    for _ in range(6):
        expected = _reference(model, kv)  # writes the pending column...
        got = fast.decode(*kv.decode_inputs(), kv)  # ...and this writes it again, the same
        assert_close(got, expected, terms=terms)
        kv.push(expected.argmax(-1), torch.zeros(kv.rows))


UPDATED = {
    "qwen2": [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.bias",
        "model.layers.1.mlp.up_proj.weight",
    ],
    "qwen3_moe": [  # a dense layer's MLP, then a layer of experts' own tensors and router
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.gate.weight",
    ],
    "gpt2": [  # Conv1D weights ([in, out]), which the passes read through transposed views
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.mlp.c_proj.weight",
    ],
    "phi3": [  # the model's own fused projections, loaded whole
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.1.mlp.gate_up_proj.weight",
    ],
}


@pytest.mark.parametrize("family", ["llama", "granite", "gemma3_text", "gpt2"])
@torch.inference_mode()
def test_embeddings_given_as_the_prompt_are_scaled_as_the_model_scales_them(family: str) -> None:
    """Granite multiplies given input embeddings too, and GPT-2 adds its positions' to them;
    Gemma's scale is its embedding module's, so given ones are taken as they are
    (transformers' ``inputs_embeds`` forward, each)."""
    model = _model(CONFIGS[family]())
    fast, _ = LlamaForward.build(model)
    ids, mask, positions = _prompts(model, [4, 6])
    embeds = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator())
    _, logits = fast.prefill(ids, mask, positions, embeds=embeds)
    out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, logits_to_keep=1)
    assert_close(logits, out.logits[:, -1], terms=forward_terms(model.config, 6))


@pytest.mark.parametrize("family", sorted(UPDATED))
@torch.inference_mode()
def test_weights_loaded_by_name_reach_the_fused_projections(family: str) -> None:
    model = _model(CONFIGS[family]())
    fast, _ = LlamaForward.build(model)
    kv, _ = _prefilled(model, "sdpa", [4, 6])
    before = fast.decode(*kv.decode_inputs(), kv).clone()
    torch.manual_seed(5)
    names = UPDATED[family]
    params = model.state_dict()
    load_named_tensors(model, [(n, torch.randn_like(params[n])) for n in names])
    expected = _reference(model, kv)
    got = fast.decode(*kv.decode_inputs(), kv)
    assert_close(got, expected, terms=forward_terms(model.config, 6))
    assert not torch.allclose(got, before, atol=1e-3)  # the update changed the answer


def _greedy_rounds(
    scheduler: Scheduler, vocab: int, *, cached: bool
) -> list[tuple[list[int], list[float]]]:
    """Greedy answers (ids, log-probs) of prompts, then of prompts that extend the first
    prompts and their answers (their prefixes from the prefix cache, if ``cached``)."""
    from stages.engine.protocol import GenerateInput, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(5 * i + 3) % vocab for i in range(9)], [7, 3, 11], [12, 30, 4, 4, 29]]
    out: list[tuple[list[int], list[float]]] = []
    for round_ in range(2):
        if round_:
            prompts = [[*p, *ids, 9] for p, (ids, _) in zip(prompts, out, strict=True)]
        future = scheduler.submit_many(
            [GenerateInput(f"r{round_}-{i}", p, params, True) for i, p in enumerate(prompts)]
        )
        scheduler.run_until_idle()
        results = future.result(timeout=30)
        assert all(r.cached_tokens > 0 for r in results) == (cached and bool(round_))
        out += [(r.output_ids, r.output_token_logprobs) for r in results]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "family", ["deepseek_v3", "phi3-partial-sliding", "glm4", "gpt_neox", "gpt2"]
)
@torch.inference_mode()
def test_the_scheduler_answers_on_the_engines_passes_as_on_transformers(family: str) -> None:
    """Served end to end (the slot cache, the prefix cache: DeepSeek's latents, a sliding
    window, GPT-NeoX's layout), greedy answers and their log-probs equal those on
    transformers' passes."""
    model = _model(CONFIGS[family]())
    fast = Scheduler(model, max_running=8)
    assert fast.forward_path == "fast", fast.forward_path_why
    got = _greedy_rounds(fast, model.config.vocab_size, cached=True)
    slow = Scheduler(model, max_running=8, fast_forward=False)
    # (a sliding window's prefix cache is off there: padding would count in the window)
    want = _greedy_rounds(slow, model.config.vocab_size, cached=slow._prefix is not None)
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert_close(lps, ref_lps, terms=forward_terms(model.config, 24))


def test_models_it_does_not_cover_say_why() -> None:
    bloom = AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=32, n_head=2))
    assert "model_type 'bloom'" in LlamaForward.unsupported(bloom)
    partial = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES))
    partial.config.rope_parameters = {
        **partial.config.rope_parameters,
        "partial_rotary_factor": 0.5,
    }
    assert "partial_rotary_factor 0.5" in LlamaForward.unsupported(partial)
    chunked = AutoModelForCausalLM.from_config(Qwen2Config(**SIZES))
    chunked.config.layer_types = ["full_attention", "chunked_attention"]
    assert "layer types ['chunked_attention', 'full_attention']" in LlamaForward.unsupported(
        chunked
    )
    gelu = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES, hidden_act="gelu"))
    assert "hidden_act" in LlamaForward.unsupported(gelu)
    # a family's model whose modules it cannot read: transformers' passes, saying why
    odd = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES))
    del odd.model.layers[1].post_attention_layernorm
    fast, why = LlamaForward.build(odd)
    assert fast is None and "post_attention_layernorm" in why, why
    assert Scheduler(odd).forward_path == "transformers"
    # the scheduler takes the fast path where it can, and model(...) where it cannot
    assert Scheduler(_model(CONFIGS["llama"]())).forward_path == "fast"
    off = Scheduler(_model(CONFIGS["llama"]()), fast_forward=False)
    assert (off.forward_path, off.forward_path_why) == ("transformers", "turned off")
    assert Scheduler(bloom).forward_path == "transformers"


@torch.inference_mode()
def test_a_second_forward_of_the_same_model_shares_the_fused_weights() -> None:
    model = _model(CONFIGS["llama"]())
    first, second = LlamaForward(model), LlamaForward(model)
    assert first.layers[0].qkv is second.layers[0].qkv
    q = model.model.layers[0].self_attn.q_proj.weight
    load_named_tensors(model, [("model.layers.0.self_attn.q_proj.weight", torch.ones_like(q))])
    assert bool((first.layers[0].qkv[: q.shape[0]] == 1).all())
