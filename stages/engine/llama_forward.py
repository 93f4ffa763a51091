"""The engine's forward passes for Llama-family models, without transformers' module machinery.

On a small model most of the time of ``model(...)`` is Python: module calls, mask and cache
bookkeeping, argument checks, output objects. For models built from the Llama decoder layer
(RMSNorm, q/k/v/o projections with rotary embeddings and grouped KV heads, a SiLU-gated MLP:
``llama``, ``qwen2``, ``qwen3``, ``mistral``), ``LlamaForward`` runs the same arithmetic
straight on the model's own tensors (and on the text model of a Qwen2-VL, Qwen2.5-VL or
Qwen3-VL, whose multimodal rotary positions its own rotary embedding turns into the same cos and
sin, and whose Qwen3-VL deepstack rows ``prefill`` adds after its first layers, as its text
model does): each layer's q, k and v projections as one matmul, gate and up as one, attention as
two batched matmuls. In their mixtures of experts (``qwen2_moe``, ``qwen3_moe``, ``mixtral``,
``gpt_oss``, ``olmoe``, ``glm4_moe``, Qwen3-VL-MoE's text) a layer of experts is the model's own
module (its router, shared expert and experts' kernels, and any hooks on them:
``routed_experts``), called on the normed hidden states as the decoder layer calls it. A
sliding-window layer (``layer_types``, or Mistral's ``sliding_window`` on every layer) attends
to its window's last keys, as transformers' masks let it; gpt-oss's attention sinks (a logit a
head, in each softmax, whose share is dropped) are in its softmax. Gemma 2's and Gemma 3's text
layers (``gemma2``, ``gemma3_text``) normalize the attention's output before its residual and
the MLP's on both sides, scale the embedding, soft-cap scores and logits where the model does,
and Gemma 3 rotates each layer type by its own table. OLMo 2 and 3 (``olmo2``, ``olmo3``) norm
after the attention and the MLP only, and q and k over all their heads at once (OLMoE too, which
then clips q, k and v). Phi-3's layers (``phi3``) and GLM-4's (``glm4``) hold q/k/v and gate/up
as fused projections of their own, which the passes take as they are; Phi-3 (Phi-4-mini), GLM-4
and GLM-4.5 (``glm4_moe``) rotate only the first part of each head (``partial_rotary_factor``);
GLM-4, ERNIE 4.5 (``ernie4_5``) and Helium (``helium``) rotate neighbouring dimensions together
where the others pair a head's halves; GLM-4 has Gemma's four norms under its own names; SmolLM3
(``smollm3``) rotates nothing on its ``no_rope_layers``, nor EXAONE 4 (``exaone4``, OLMo 2's
norms) on its full-attention layers when it has sliding ones; Hunyuan (``hunyuan_v1_dense``)
norms q and k after their rotation; Granite (``granite``) multiplies its embeddings, each
residual branch and its logits; Seed-OSS (``seed_oss``) and Ministral (``ministral``) are
Llama's layer. GPT-NeoX (``gpt_neox``, Pythia) holds each head's q, k and v together in its own
projection, rotates a quarter of each head, and adds the attention and the MLP to the layer's
input side by side (``use_parallel_residual``). GPT-2 (``gpt2``) adds learned positions'
embeddings to its inputs, rotates nothing, and stores its projections' weights as ``[in, out]``
(Conv1D), which the passes read through transposed views. StableLM (``stablelm``) and Phi-2
(``phi``) use LayerNorms and rotate part of each head; StableLM's parallel layers and Phi-2's
run the attention and the MLP side by side from one norm, and StableLM norms q and k head by
head. DeepSeek-V2's and V3's multi-head latent attention (``deepseek_v2``, ``deepseek_v3``:
Moonlight's, Kimi K2's) is ``latent_attention``'s, its cache the latents transformers' holds.
``decode`` takes one token per row over the slot cache (``kv_batch.BatchKV``: keys and values go
into its pending column, attention reads its views); ``prefill`` takes left-padded prompts,
optionally on top of the cached keys and values of their prefixes (``prefix_cache``), and
returns a ``DynamicCache`` of their keys and values, as ``model(...)`` would, for the slot cache
to admit. The norms, the rotary embedding and the activation are the model's own modules, so
their variants (rope scaling, norm details) stay exactly transformers'.

The fused projections cost no memory: the model's q/k/v (and gate/up) weights are made views
into one tensor per layer, so weights loaded into the model by name (``model_weights``, in-flight
updates) land in the fused tensor as they are copied. Any other model goes through
``model(...)`` (``unsupported`` says why). ``tests/stages/test_engine_llama_forward.py`` holds
both passes to transformers' own logits and caches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.pytorch_utils import Conv1D

from stages.engine.batch_invariant import Products as InvariantProducts
from stages.engine.batch_invariant import batched as invariant_batched
from stages.engine.batch_invariant import linear as invariant_linear
from stages.engine.batch_invariant import products_in as invariant_products
from stages.engine.batch_invariant import rows_apart as invariant_rows_apart
from stages.engine.batch_invariant import rows_for as invariant_rows
from stages.engine.latent_attention import LatentAttention, is_latent
from stages.engine.lm_head import is_fp32 as head_is_fp32
from stages.engine.lm_head import logits as head_logits

if TYPE_CHECKING:
    from stages.engine.lora_adapters import RowAdapters

__all__ = ["LlamaForward", "decoder_layers", "dense_mlp"]

_DENSE = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "qwen2_vl_text",
        "qwen2_5_vl_text",
        "qwen3_vl_text",
        "phi3",  # q/k/v and gate/up as the model's own fused projections
        "smollm3",  # no rotary embedding on some layers (``no_rope_layers``)
        "granite",  # multipliers on the embedding, the residual branches and the logits
        "gpt_neox",  # Pythia's: each head's q, k, v together, parallel residuals, LayerNorms
        "gpt2",  # learned positions, Conv1D projections (weights stored [in, out])
        "stablelm",  # LayerNorms, a quarter of each head rotated, parallel residuals or not
        "phi",  # Phi-2's: one LayerNorm, the attention and the MLP side by side
        "seed_oss",
        "ministral",
        "helium",
        "ernie4_5",
        "hunyuan_v1_dense",  # q and k normed after their rotation
        "exaone4",  # OLMo 2's norms; with a window, no rotation on its full-attention layers
        "glm4",  # Gemma's four norms (named otherwise), half of each head rotated
    }
)
# OLMo 2's and 3's layer: norms after the attention and the MLP only, q and k normed whole
_OLMO = frozenset({"olmo2", "olmo3"})
# the same decoder layer with a mixture of experts for the MLP of some or all layers: the
# model's own module runs it (its router, its experts' kernels), on the normed hidden states
_MIXTURES = frozenset(
    {
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_vl_moe_text",
        "mixtral",
        "gpt_oss",
        "olmoe",
        "glm4_moe",
        "deepseek_v2",  # (and V3's: multi-head latent attention, ``latent_attention``)
        "deepseek_v3",
    }
)
# Gemma's layer: norms after the attention and around the MLP, a scaled embedding, soft caps
_GEMMA = frozenset({"gemma2", "gemma3_text"})
# MLPs without a gate (up, its activation, down): Apertus's xIELU, Arcee's and Nemotron's ReLU²
_UNGATED = frozenset({"apertus", "arcee", "nemotron", "gpt_neox", "gpt2", "phi"})
_FAMILIES = _DENSE | _MIXTURES | _GEMMA | _OLMO | _UNGATED
# those whose activation is not SiLU (the model's own module computes it)
_ANY_ACT = _GEMMA | _UNGATED
# those whose attention rotates a head's first ``partial_rotary_factor`` of dimensions (paired
# as the family pairs them) and passes the rest through, as transformers' models do
_PARTIAL_ROTARY = frozenset({"phi3", "glm4_moe", "glm4", "nemotron", "gpt_neox", "stablelm", "phi"})
# those that rotate pairs of neighbouring dimensions (GLM's style) where rotate_half pairs a
# head's halves: their tables' first halves, each value twice
_INTERLEAVED = frozenset({"glm4", "ernie4_5", "helium", "deepseek_v2"})


def _text(model: Any) -> tuple[Any, Any]:
    """The config and the decoder (``layers``, ``embed_tokens``, ``rotary_emb``, ``norm``; or
    GPT-NeoX's ``embed_in`` and ``final_layer_norm``) of ``model``'s text: its own, or a
    vision-language model's language model's."""
    inner = _first(model, "model", "gpt_neox", "transformer")
    language = getattr(inner, "language_model", None)
    text_config = getattr(model.config, "text_config", None)
    if language is not None and text_config is not None:
        return text_config, language
    return model.config, inner


class _Layer:
    __slots__ = (
        "act",
        "after_attn",
        "after_mlp",
        "attn_norm",
        "down",
        "experts",
        "experts_products",
        "gate_up",
        "gate_up_bias",
        "gated",
        "heads_first",
        "index",
        "k_norm",
        "latent",
        "linear",
        "mlp_norm",
        "norm_after_rope",
        "o",
        "parallel",
        "q_norm",
        "qk_whole",
        "qkv",
        "qkv_bias",
        "residual",
        "rope",
        "rotate",
        "sinks",
        "window",
    )

    def __init__(
        self,
        layer: Any,
        index: int,
        window: int | None,
        rope: str | None,
        rotate: bool,
        side_by_side: bool = False,
    ) -> None:
        self.index = index
        # its products' function: F.linear, or batch_invariant.linear (batch_invariant())
        self.linear: Any = F.linear
        # what a mixture of experts' block runs within: nothing, or batch_invariant.Products
        self.experts_products: Any = contextlib.nullcontext()
        self.window = window  # a sliding-window layer's: it attends to its last this many
        self.rope = rope  # its rotary table (Gemma 3's differ by layer type; None: the one)
        self.rotate = rotate  # False: no rotary embedding (SmolLM3's NoPE layers)
        # Granite's: each branch's output scaled before its residual (None: not scaled)
        self.residual = getattr(layer, "residual_multiplier", None)
        attn, mlp = _one(layer, "self_attn", "attention", "attn"), layer.mlp
        # gpt-oss's attention sinks: a logit a head, in each softmax, whose share goes nowhere
        self.sinks = getattr(attn, "sinks", None)
        # the norms: before the attention and the MLP (Llama's; Apertus names them otherwise),
        # also after each (Gemma's), or after each only (OLMo 2's)
        before = _first(layer, "input_layernorm", "attention_layernorm", "ln_1")
        self.attn_norm = _same if before is None else before.forward
        after = _first(layer, "post_attention_layernorm", "feedforward_layernorm", "ln_2")
        # the attention and the MLP side by side, each on the layer's input (GPT-NeoX's and
        # StableLM's parallel residual; Phi-2's always: ``side_by_side``)
        self.parallel = bool(getattr(layer, "use_parallel_residual", side_by_side))
        if after is None and self.parallel:  # one norm for both (StableLM's, Phi-2's)
            after = before
        if after is None:
            raise AttributeError(
                f"{type(layer).__name__} has no post_attention_layernorm (or "
                "feedforward_layernorm, ln_2) before its MLP"
            )
        self.mlp_norm = after.forward
        self.after_attn = self.after_mlp = None
        if hasattr(layer, "post_feedforward_layernorm"):
            self.after_attn = layer.post_attention_layernorm.forward
            self.after_mlp = layer.post_feedforward_layernorm.forward
            pre = getattr(layer, "pre_feedforward_layernorm", None)
            self.mlp_norm = _same if pre is None else pre.forward
        elif hasattr(layer, "post_mlp_layernorm"):  # GLM-4's names for Gemma's four
            self.after_attn = layer.post_self_attn_layernorm.forward
            self.after_mlp = layer.post_mlp_layernorm.forward
        # q's and k's norms: before their rotation, or after it (Hunyuan's)
        self.norm_after_rope = hasattr(attn, "query_layernorm")
        q_norm = _first(
            attn, "query_layernorm" if self.norm_after_rope else "q_norm", "q_layernorm"
        )
        k_norm = _first(attn, "key_layernorm" if self.norm_after_rope else "k_norm", "k_layernorm")
        self.q_norm = None if q_norm is None else _head_norm(q_norm)
        self.k_norm = None if k_norm is None else _head_norm(k_norm)
        # q and k normed over all their heads at once (OLMo's), not head by head
        self.qk_whole = q_norm is not None and _norm_width(q_norm) != attn.head_dim
        # DeepSeek's multi-head latent attention (its own projections), or q/k/v as one
        # projection: the model's own (Phi-3's ``qkv_proj``) or fused here
        self.latent = LatentAttention(attn, attn.num_heads) if is_latent(attn) else None
        fused = getattr(attn, "qkv_proj", None)
        # GPT-NeoX's own q/k/v projection: each head's q, k and v together
        neox = getattr(attn, "query_key_value", None)
        self.heads_first = neox is not None
        gpt2 = getattr(attn, "c_attn", None)  # GPT-2's: q | k | v, a Conv1D ([in, out])
        if self.latent is not None:
            self.qkv = self.qkv_bias = None
        elif gpt2 is not None:
            self.qkv, self.qkv_bias = gpt2.weight.t(), gpt2.bias
        elif neox is not None:
            self.qkv, self.qkv_bias = neox.weight, neox.bias
        elif fused is not None:
            self.qkv, self.qkv_bias = fused.weight, fused.bias
        else:
            self.qkv, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _projection(_one(attn, "o_proj", "dense", "c_proj"))
        # a mixture of experts (the model's module, called on [..., tokens, hidden]), or the
        # gated MLP with gate and up as one projection (fused here, or Phi-3's and GLM-4's
        # own), or an MLP without a gate (Apertus's, Arcee's, Nemotron's: up alone)
        self.experts = None if dense_mlp(mlp) else mlp
        self.gated = True
        if self.experts is None:
            names = mlp_projections(mlp)
            self.gated = names[0] not in ("up_proj", "dense_h_to_4h", "c_fc", "fc1")
            if names[0] == "gate_proj":
                self.gate_up, self.gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
            else:
                own = _projection(getattr(mlp, names[0]))
                self.gate_up, self.gate_up_bias = own.weight, own.bias
            self.down = _projection(getattr(mlp, names[-1]))
            self.act = _one(mlp, "act_fn", "activation_fn", "act")
        else:
            self.gate_up = self.gate_up_bias = self.down = self.act = None


class LlamaForward:
    """``decode`` and ``prefill`` of a Llama-family model (check ``unsupported`` first)."""

    def __init__(self, model: Any) -> None:
        config, inner = _text(model)
        layers = _one(inner, "layers", "h")
        attn = _one(layers[0], "self_attn", "attention", "attn")
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", self.heads)  # (GPT-NeoX: none)
        # (GPT-NeoX's head_size; None: latent attention's)
        self.head_dim = _first(attn, "head_dim", "head_size")
        scaling = getattr(attn, "scaling", None)
        self.scaling = self.head_dim**-0.5 if scaling is None else scaling
        self.embed = _one(inner, "embed_tokens", "embed_in", "wte")
        # GPT-2's learned positions, added to the input embeddings (no rotary embedding)
        self.positions = getattr(inner, "wpe", None)
        # Gemma's embedding module scales what it looks up (not embeddings given as input)
        self.embed_scale = getattr(self.embed, "embed_scale", None)
        # Granite's: the model scales its input embeddings (given ones too) and its logits
        self.embed_mult = getattr(config, "embedding_multiplier", None)
        self.logit_div = getattr(config, "logits_scaling", None)
        # (a vision model's takes positions [3, rows, width] or [rows, width]: cos and sin alike)
        self.rotary = getattr(inner, "rotary_emb", None)
        self.final_norm = _one(inner, "norm", "final_layer_norm", "ln_f", "final_layernorm").forward
        self.lm_head = _first(model, "lm_head", "embed_out")
        # --enable-deterministic-inference: batch-invariant passes (``batch_invariant()``), the
        # rows of each of their products, and the product that takes them so many at a time
        self.deterministic = False
        self._rope_by_length = False  # (a dynamic or LongRoPE rotary embedding: _table)
        self.invariant_rows: int | None = None
        self._invariant: Any = None
        self._batched: Any = None  # (batch_invariant.batched, at invariant_rows)
        # OLMoE's clip of q, k and v (after their norms) to [-clip, clip] (None: none)
        self.clip = getattr(config, "clip_qkv", None)
        kind = getattr(config, "model_type", None)
        # gpt-oss's rotary embedding gives cos and sin for one half of a head
        self.half_rope = kind == "gpt_oss"
        # DeepSeek-V2 rotates neighbours; V3 (``rope_interleave``) too, with evens then odds
        self.split_pairs = kind == "deepseek_v3" and bool(getattr(config, "rope_interleave", 0))
        self.interleaved = kind in _INTERLEAVED
        # Gemma 2's soft caps: scores, logits -> cap * tanh(x / cap) (None: none)
        self.attn_cap = getattr(config, "attn_logit_softcapping", None)
        self.logit_cap = getattr(config, "final_logit_softcapping", None)
        windows = _windows(config, len(layers))
        by_type = self.rotary is not None and "layer_type" in _parameters(self.rotary.forward)
        types = getattr(config, "layer_types", None) or [None] * len(layers)
        rotates = getattr(config, "no_rope_layers", None) or [self.rotary is not None] * len(layers)
        if kind == "exaone4" and config.sliding_window is not None:  # full layers: no rotation
            rotates = [t == "sliding_attention" for t in config.layer_types]
        self.layers = [
            _Layer(
                layer,
                i,
                windows[i],
                types[i] if by_type else None,
                bool(rotates[i]),
                side_by_side=kind == "phi",
            )
            for i, layer in enumerate(layers)
        ]
        self._ropes = sorted({layer.rope for layer in self.layers}, key=str)

    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why ``model`` cannot take this path (None: it can)."""
        config, inner = _text(model)
        kind = getattr(config, "model_type", None)
        if kind not in _FAMILIES:
            return f"model_type {kind!r} is not one of {sorted(_FAMILIES)}"
        if kind not in _ANY_ACT and getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r} (only silu)"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention (an embedding model's)"
        kinds = set(getattr(config, "layer_types", None) or ())
        if kinds - {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(kinds)} (full and sliding-window attention only)"
        if getattr(config, "pretraining_tp", 1) != 1:
            return "pretraining_tp > 1"
        rope = getattr(config, "rope_parameters", None) or {}
        for params in [config.__dict__, rope, *(v for v in rope.values() if isinstance(v, dict))]:
            partial = params.get("partial_rotary_factor")
            if partial not in (None, 1, 1.0) and kind not in _PARTIAL_ROTARY:
                return f"partial_rotary_factor {partial} (rotary over whole heads only)"
        layers = _first(inner, "layers", "h")
        head = _first(model, "lm_head", "embed_out")
        positions = _first(inner, "rotary_emb", "wpe")
        if not layers or positions is None or head is None:
            return "not the Llama module layout (model.layers, rotary_emb, lm_head)"
        attn = _first(layers[0], "self_attn", "attention", "attn")
        fused = isinstance(getattr(attn, "qkv_proj", None), torch.nn.Linear)
        names = ("qkv_proj", "o_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
        if is_latent(attn):
            names = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
            if attn.kv_b_proj.bias is not None:
                return "latent attention's kv_b_proj has a bias (DeepSeek's has none)"
        elif hasattr(attn, "query_key_value"):
            names = ("query_key_value", "dense")
        elif hasattr(attn, "dense"):  # Phi-2's output projection
            names = ("q_proj", "k_proj", "v_proj", "dense")
        elif hasattr(attn, "c_attn"):
            names = ("c_attn", "c_proj")
            if getattr(config, "scale_attn_by_inverse_layer_idx", False):
                return "scale_attn_by_inverse_layer_idx (a scale by layer)"
            if getattr(config, "add_cross_attention", False):
                return "cross-attention layers"
        for name in names:
            if not isinstance(getattr(attn, name, None), _LINEAR):
                return f"self_attn.{name} is not a plain Linear"
        for index, layer in enumerate(layers):
            if not dense_mlp(layer.mlp) and kind not in _MIXTURES:
                return (
                    f"layers.{index}.mlp is not gate_proj, up_proj, down_proj "
                    "(or gate_up_proj, down_proj) Linears"
                )
        return None

    def batch_invariant(self) -> None:
        """From now on every row's floats are what they are alone (``stages.engine.
        batch_invariant``): its products a fixed number of rows at a time, its attention over
        its own columns."""
        head = self.lm_head.weight
        if head_is_fp32(self.lm_head):  # (--enable-fp32-lm-head)
            head = head.float()
        bias = self.lm_head.bias
        products = [(head, None if bias is None else bias.to(head.dtype))]
        for layer in self.layers:
            products.append((layer.o.weight, layer.o.bias))
            if layer.latent is not None:
                products += layer.latent.products()
            else:
                products.append((layer.qkv, layer.qkv_bias))
            if layer.experts is None:
                products += [
                    (layer.gate_up, layer.gate_up_bias),
                    (layer.down.weight, layer.down.bias),
                ]
                continue
            # the experts one at a time over their tokens (transformers' eager loop), each
            # product of the block (router, shared experts, experts) run as the rest
            for module in layer.experts.modules():
                if hasattr(module, "has_gate"):  # (transformers' use_experts_implementation)
                    module.config._experts_implementation = "eager"
            weight = layer.o.weight
            products += invariant_products(layer.experts, weight.shape[0], weight)
        rows = invariant_rows(products)
        self.invariant_rows = rows
        kinds = getattr(self.rotary, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        self._rope_by_length = any(
            isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds
        )
        self._invariant = functools.partial(invariant_linear, rows=rows)
        self._batched = functools.partial(invariant_batched, rows=rows)
        for layer in self.layers:
            layer.linear = self._invariant
            if layer.experts is not None:
                layer.experts_products = InvariantProducts(rows)
            elif not layer.gated:  # (a gate's slice has its rows apart already)
                layer.act = invariant_rows_apart(layer.act)
        self.deterministic = True

    @classmethod
    def build(cls, model: Any) -> tuple[LlamaForward | None, str | None]:
        """(the fast path, None), or (None, why not) for a model it does not cover (or one of
        its families whose modules it cannot read: the engine then serves it on transformers'
        passes, saying why, rather than failing to start)."""
        why = cls.unsupported(model)
        if why:
            return None, why
        try:
            return cls(model), None
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:  # a layout it misreads
            return None, f"its layout could not be read ({type(exc).__name__}: {exc})"

    # ---- the two passes ---------------------------------------------------------------------

    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        kv: Any,
        lora: RowAdapters | None = None,
        *,
        keep_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[rows, vocab]`` of one decode step: ``ids``/``positions`` ``[rows, 1]`` and
        ``mask`` as ``BatchKV.decode_inputs`` gives them; ``kv``'s pending column is written.
        ``lora``: the rows that take LoRA adapters (``lora_adapters``), if any. With
        ``keep_hidden``, ``(logits, the final (normed) hidden states [rows, hidden])``."""
        n = ids.shape[0]
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        h = self._embed(ids[:, 0], positions[:, 0])
        ropes = self._rotary(h, positions)  # each [n, 1, hd]: broadcast over the heads
        # True (or 0.0) where a row may attend -> True where it may not
        blocked = (~mask if mask.dtype == torch.bool else mask < 0).view(n, 1, 1, -1)
        windows: dict[int, tuple[torch.Tensor, int]] = {}
        # each row's columns (batch-invariant attention: _attend_rows)
        own = (~blocked).view(n, -1).sum(-1).tolist() if self.deterministic else []
        for layer, cache in zip(self.layers, kv.layers, strict=True):
            cos, sin = ropes[layer.rope]
            if layer.latent is not None:
                x = layer.attn_norm(h)
                out = layer.latent.decode(
                    x, cos, sin, cache, blocked, self._rotated, self._attend, layer.linear,
                    functools.partial(self._attend_rows, own=own) if self.deterministic else None,
                    self._batched,
                )  # fmt: skip
                h = self._rest(layer, h, out, lora)
                continue
            q, k, v = self._qkv(layer, layer.attn_norm(h), cos, sin, lora)  # [n, heads, hd]
            keys, values = cache.update(k.unsqueeze(2), v.unsqueeze(2))  # [n, nkv, L, hd]
            where = blocked
            if layer.window is not None:
                seen = windows.get(layer.window)
                if seen is None:
                    seen = windows[layer.window] = _window_of(blocked, layer.window)
                where, first = seen
                if first and not self.deterministic:  # (columns no row's window reaches)
                    keys, values, where = (
                        keys[:, :, first:],
                        values[:, :, first:],
                        where[..., first:],
                    )
            if self.deterministic:  # each row over its own columns
                out = self._attend_rows(
                    q.view(n, nkv, nh // nkv, 1, hd), keys, values, where.unsqueeze(-2),
                    layer.sinks, own,
                )  # fmt: skip
            else:
                scores = torch.matmul(q.view(n, nkv, nh // nkv, hd), keys.transpose(-1, -2))
                out = self._attend(scores, where, values, layer.sinks)  # [n, nkv, group, hd]
            h = self._rest(layer, h, out.reshape(n, nh * hd), lora)
        normed = self.final_norm(h)
        logits = self.logits(normed)
        return (logits, normed) if keep_hidden else logits

    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        past: DynamicCache | None = None,
        *,
        keep_hidden: bool = False,
        lora: RowAdapters | None = None,
        embeds: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> tuple[DynamicCache, torch.Tensor] | tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """(keys and values of every layer, last-position logits ``[rows, vocab]``) of
        left-padded prompts ``ids`` ``[rows, width]`` with ``mask`` 1 on real tokens; with
        ``keep_hidden``, also the final (normed) hidden state of every position ``[rows,
        width, hidden]`` (prompt log-probs: ``stages.engine.prompt_logprobs``).

        With ``past`` (``P`` columns of keys and values already computed, as ``model(...)``
        takes ``past_key_values``), ``mask`` covers the past and the new tokens
        (``[rows, P + width]``) and the returned cache holds both, as transformers returns it.
        ``embeds`` ``[rows, width, hidden]``: the input embeddings, in place of the ids'.
        ``deepstack`` (Qwen3-VL's): where its image pads are ``[rows, width]`` and the rows
        added there after each of the first layers, as its text model adds them.
        """
        rows, width = ids.shape
        before = 0 if past is None else past.get_seq_length()
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        group = nh // nkv
        h = self._embed(ids, positions) if embeds is None else self._scaled(embeds, positions)
        ropes = {  # each [rows, width, 1, hd] (None: no rotary embedding)
            kind: (None, None) if cos is None else (cos.unsqueeze(-2), sin.unsqueeze(-2))
            for kind, (cos, sin) in self._rotary(h, positions).items()
        }
        # causal over real keys; a padding position sees itself (no empty softmax row)
        query = torch.arange(width, device=ids.device)[:, None] + before
        key = torch.arange(before + width, device=ids.device)[None, :]
        allowed = (key <= query) & (mask.bool()[:, None, :] | (key == query))  # [rows, q, k]
        masks = {None: ~allowed[:, None, None]}  # [rows, 1, 1, query, key] by window
        own = mask.long().sum(-1).tolist() if self.deterministic else []  # each row's keys
        cache = DynamicCache()
        for i, layer in enumerate(self.layers):
            blocked = masks.get(layer.window)
            if blocked is None:  # a sliding window: the keys of the last that many positions
                at = mask.long().cumsum(-1) - 1  # [rows, keys]: each real key's position
                near = (at[:, before:, None] - at[:, None, :]) < layer.window
                blocked = masks[layer.window] = ~(allowed & (near | (key == query)))[:, None, None]
            cos, sin = ropes[layer.rope]
            if layer.latent is not None:  # (its cache: the latents)
                cached = None if past is None else (past.layers[i].keys, past.layers[i].values)
                x = layer.attn_norm(h)
                out, k, v = layer.latent.prefill(
                    x, cos, sin, cached, blocked, self._rotated, self._attend, layer.linear,
                    functools.partial(self._attend_rows, own=own) if self.deterministic else None,
                )  # fmt: skip
                cache.update(k, v, i)
                h = self._rest(layer, h, out, lora)
                continue
            q, k, v = self._qkv(layer, layer.attn_norm(h), cos, sin, lora)  # [rows, width, nh, hd]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [rows, nkv, width, hd]
            if past is not None:
                k = torch.cat((past.layers[i].keys, k), 2)
                v = torch.cat((past.layers[i].values, v), 2)
            cache.update(k, v, i)
            q = q.view(rows, width, nkv, group, hd).permute(0, 2, 3, 1, 4)
            if self.deterministic:  # each row over its own columns
                out = self._attend_rows(q, k, v, blocked, layer.sinks, own)
            else:
                scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2))
                out = self._attend(scores, blocked, v.unsqueeze(2), layer.sinks)
            out = out.permute(0, 3, 1, 2, 4).reshape(rows, width, nh * hd)
            h = self._rest(layer, h, out, lora)
            if deepstack is not None and i < len(deepstack[1]):
                where, added = deepstack
                h = h.clone()
                h[where] = h[where] + added[i].to(h.dtype)
        if keep_hidden:
            normed = self.final_norm(h)
            return cache, self.logits(normed[:, -1]), normed
        return cache, self.logits(self.final_norm(h[:, -1]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final (normed) hidden states (soft-capped where the model caps)."""
        # (in float32: --enable-fp32-lm-head; a fixed number of rows at a time: deterministic)
        logits = head_logits(self.lm_head, hidden, self._invariant if self.deterministic else None)
        if self.logit_cap is not None:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        if self.logit_div is not None:
            logits = logits / self.logit_div
        return logits

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.embed.weight)
        if self.embed_scale is not None:  # (Gemma's module scales only what it looks up)
            h = h * self.embed_scale.to(h.dtype)
        return self._scaled(h, positions)

    def _scaled(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Input embeddings as the model takes them: scaled (Granite's multiplier), with their
        positions' embeddings added (GPT-2's)."""
        if self.embed_mult is not None:
            embeds = embeds * self.embed_mult
        if self.positions is not None:
            embeds = embeds + F.embedding(positions, self.positions.weight)
        return embeds

    # ---- pieces -----------------------------------------------------------------------------

    def _qkv(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: RowAdapters | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of normed ``x`` ``[..., hidden]``, as ``[..., heads, hd]``."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        y = layer.linear(x, layer.qkv, layer.qkv_bias)
        if lora is not None:
            lora.add(layer.index, "qkv", x, y, layer.linear)
        lead = y.shape[:-1]
        if layer.heads_first:  # GPT-NeoX's: [heads, q | k | v]
            y = y.view(*lead, nh, 3 * hd)
            q, k, v = y[..., :hd], y[..., hd : 2 * hd], y[..., 2 * hd :]
        else:
            q, k = y[..., : nh * hd], y[..., nh * hd : (nh + nkv) * hd]
            v = y[..., (nh + nkv) * hd :]
        if layer.qk_whole:
            q, k = layer.q_norm(q), layer.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.reshape(*lead, nh, hd), k.reshape(*lead, nkv, hd), v.reshape(*lead, nkv, hd)
        before = layer.q_norm is not None and not layer.qk_whole and not layer.norm_after_rope
        if before:
            q, k = layer.q_norm(q), layer.k_norm(k)
        if layer.rotate:
            q, k = self._rotated(q, cos, sin), self._rotated(k, cos, sin)
        if layer.norm_after_rope:
            q, k = layer.q_norm(q), layer.k_norm(k)
        return q, k, v

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hd]`` rotated by ``cos`` and ``sin`` over its first
        ``cos.shape[-1]`` dimensions (a partial rotary embedding's), the rest as they are:
        rotate_half's pairs, or neighbours (``interleaved``); with ``split_pairs`` (DeepSeek-V3's
        ``rope_interleave``) neighbours, the rotated evens then the odds, ``cos`` and ``sin``
        each pair's (a whole rotated part: latent attention's)."""
        if self.split_pairs:  # DeepSeek-V3's: neighbours rotated, evens then odds out
            even, odd = x[..., ::2], x[..., 1::2]
            return torch.cat((even * cos - odd * sin, odd * cos + even * sin), -1)
        width = cos.shape[-1]
        part = x if width == x.shape[-1] else x[..., :width]
        if self.interleaved:
            turned = torch.stack((-part[..., 1::2], part[..., ::2]), -1).flatten(-2)
        else:
            half = width // 2
            turned = torch.cat((-part[..., half:], part[..., :half]), -1)
        out = part * cos + turned * sin
        return out if part is x else torch.cat((out, x[..., width:]), -1)

    def _rotary(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """The model's rotary embedding's cos and sin over the whole head (gpt-oss's gives
        them for one half, which rotates the other the same way), by the layers' ``rope``."""
        out: dict[str | None, tuple[Any, Any]] = {}
        if self.rotary is None:  # (GPT-2's: positions come with the embeddings)
            return {None: (None, None)}
        for kind in self._ropes:
            table = self._table(h, positions, kind)
            if isinstance(table, torch.Tensor):  # DeepSeek-V2's: each pair's e^(i angle)
                cos = torch.cat((table.real, table.real), -1).to(h.dtype)
                sin = torch.cat((table.imag, table.imag), -1).to(h.dtype)
            else:
                cos, sin = table
            if self.split_pairs:  # each pair's angle
                cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
            elif self.half_rope:
                cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            elif self.interleaved:  # each frequency twice, side by side
                half = cos.shape[-1] // 2
                cos = cos[..., :half].repeat_interleave(2, -1)
                sin = sin[..., :half].repeat_interleave(2, -1)
            out[kind] = (cos, sin)
        return out

    def _table(self, h: torch.Tensor, positions: torch.Tensor, kind: str | None) -> Any:
        """The rotary embedding's table for ``positions`` ``[rows, width]``: a dynamic or
        LongRoPE one takes its frequencies by the largest position it is given (transformers'
        ``dynamic_rope_update``), so the batch's, where deterministic passes take each row's."""
        args = () if kind is None else (kind,)
        if not (self.deterministic and self._rope_by_length) or positions.dim() != 2:
            return self.rotary(h, positions, *args)
        rows = [self.rotary(h[r : r + 1], positions[r : r + 1], *args) for r in range(len(h))]
        if isinstance(rows[0], torch.Tensor):
            return torch.cat(rows)
        return tuple(torch.cat(part) for part in zip(*rows, strict=True))

    def _attend_rows(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        blocked: torch.Tensor,
        sinks: torch.Tensor | None,
        own: list[int],
    ) -> torch.Tensor:
        """``_attend`` a row at a time over that row's own columns (batch-invariant): ``q``
        ``[rows, kv heads, group, queries, hd]``, ``keys``/``values`` ``[rows, kv heads,
        columns, hd]``, ``blocked`` ``[rows, 1, 1, queries, columns]`` (True: not attended),
        ``own[r]``: how many of the last columns are row ``r``'s (before them: left padding,
        or other rows' columns); its queries before those (padding) get zeros, which nothing
        reads."""
        queries, columns = q.shape[3], keys.shape[2]
        out = q.new_zeros(*q.shape[:-1], values.shape[-1])
        alike: dict[int, list[int]] = {}  # rows of one length go together: a batched product
        for r, count in enumerate(own):  # computes each of its items as it does one alone
            alike.setdefault(count, []).append(r)
        for count, rows in alike.items():
            first = columns - count
            asked = max(0, queries - count)  # their queries on their own columns
            at = torch.tensor(rows, device=q.device)
            # (contiguous: on strided operands, how many items there are changes how each is
            # computed, on baseline kernels; measured with GPT-NeoX's per-head q, k, v)
            keys_r = keys[at, :, first:].unsqueeze(2).contiguous()  # [rows, kv, 1, count, hd]
            q_r = q[at, :, :, asked:].contiguous()
            scores = torch.matmul(q_r, keys_r.transpose(-1, -2))
            where = blocked[at, :, :, asked:, first:]
            values_r = values[at, :, first:].unsqueeze(2).contiguous()
            out[at, :, :, asked:] = self._attend(scores, where, values_r, sinks)
        return out

    def _attend(
        self,
        scores: torch.Tensor,
        blocked: torch.Tensor,
        values: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax of ``scores`` ``[..., kv heads, group, (queries,) keys]`` over the keys not
        ``blocked`` (and each head's sink, its share then dropped), times ``values``."""
        scores = scores.mul_(self.scaling)
        if self.attn_cap is not None:
            scores = torch.tanh(scores / self.attn_cap) * self.attn_cap
        scores = scores.masked_fill_(blocked, float("-inf"))
        if sinks is not None:
            sink = sinks.view(self.kv_heads, -1, *[1] * (scores.dim() - 3))
            scores = torch.cat((scores, sink.to(scores.dtype).expand(*scores.shape[:-1], 1)), -1)
            probs = scores.float().softmax(-1)[..., :-1].to(values.dtype)
        else:
            probs = scores.float().softmax(-1).to(values.dtype)  # (no-op casts in float32)
        return torch.matmul(probs, values)

    @staticmethod
    def _rest(
        layer: _Layer, h: torch.Tensor, attended: torch.Tensor, lora: RowAdapters | None
    ) -> torch.Tensor:
        """The output projection, the residuals and the MLP (or the mixture of experts, to
        which adapters do not apply)."""
        if layer.experts is not None:
            o = layer.linear(attended, layer.o.weight, layer.o.bias)
            if lora is not None:
                lora.add(layer.index, "o", attended, o, layer.linear)
            h = h + o
            normed = layer.mlp_norm(h)
            step = normed.dim() == 2  # a decode step's rows: one token each
            with layer.experts_products:
                out = layer.experts(normed.unsqueeze(1) if step else normed)
            if isinstance(out, tuple):  # gpt-oss's: (hidden states, router scores)
                out = out[0]
            return h + (out.squeeze(1) if step else out)
        if layer.after_attn is not None:  # Gemma's, OLMo's
            return LlamaForward._post_norm_rest(layer, h, attended, lora)
        if lora is None and layer.residual is None and not layer.parallel:
            h = h + layer.linear(attended, layer.o.weight, layer.o.bias)
            z = layer.linear(layer.mlp_norm(h), layer.gate_up, layer.gate_up_bias)
            gated = _activated(layer, z)
            return h + layer.linear(gated, layer.down.weight, layer.down.bias)
        i, scale = layer.index, layer.residual
        o = layer.linear(attended, layer.o.weight, layer.o.bias)
        if lora is not None:
            lora.add(i, "o", attended, o, layer.linear)
        normed = layer.mlp_norm(h) if layer.parallel else None  # (of the layer's input)
        h = h + (o if scale is None else o * scale)
        if normed is None:
            normed = layer.mlp_norm(h)
        z = layer.linear(normed, layer.gate_up, layer.gate_up_bias)
        if lora is not None:
            lora.add(i, "gate_up", normed, z, layer.linear)
        gated = _activated(layer, z)
        down = layer.linear(gated, layer.down.weight, layer.down.bias)
        if lora is not None:
            lora.add(i, "down", gated, down, layer.linear)
        return h + (down if scale is None else down * scale)

    @staticmethod
    def _post_norm_rest(
        layer: _Layer, h: torch.Tensor, attended: torch.Tensor, lora: RowAdapters | None
    ) -> torch.Tensor:
        """``_rest`` of Gemma's and OLMo's layers: the attention's output normed before its
        residual, the MLP's likewise (after Gemma's norm before it)."""
        assert layer.after_attn is not None and layer.after_mlp is not None
        o = layer.linear(attended, layer.o.weight, layer.o.bias)
        if lora is not None:
            lora.add(layer.index, "o", attended, o, layer.linear)
        h = h + layer.after_attn(o)
        normed = layer.mlp_norm(h)
        z = layer.linear(normed, layer.gate_up, layer.gate_up_bias)
        if lora is not None:
            lora.add(layer.index, "gate_up", normed, z, layer.linear)
        gated = _activated(layer, z)
        down = layer.linear(gated, layer.down.weight, layer.down.bias)
        if lora is not None:
            lora.add(layer.index, "down", gated, down, layer.linear)
        return h + layer.after_mlp(down)


def decoder_layers(model: Any) -> Any:
    """The decoder layers of ``model``'s text (``LlamaForward``'s layout; GPT-2's ``h``)."""
    return _first(_text(model)[1], "layers", "h")


def _activated(layer: _Layer, z: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of the gate/up projection's output ``z`` (gate's columns first):
    ``act(gate) * up``, or ``act(up)`` without a gate."""
    if not layer.gated:
        return layer.act(z)
    mid = z.shape[-1] // 2
    return layer.act(z[..., :mid]) * z[..., mid:]


def _first(module: Any, *names: str) -> Any:
    """``module``'s first attribute of ``names`` that it has (None: none)."""
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    return None


# a projection's module: a Linear, or GPT-2's Conv1D (its weight [in, out])
_LINEAR = (torch.nn.Linear, Conv1D)


class _Proj:
    """A projection's weight ``[out, in]`` and bias, as ``F.linear`` takes them (a Conv1D's
    weight as a transposed view, so weights loaded into the module land in it)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def _projection(module: Any) -> Any:
    """``module`` itself (a Linear), or a Conv1D's weight and bias as a Linear holds them."""
    return _Proj(module.weight.t(), module.bias) if isinstance(module, Conv1D) else module


def _head_norm(norm: Any) -> Any:
    """A q or k norm's forward on ``[..., heads, hd]``: the module's own, or StableLM's norm by
    head (``norms``, which splits its input's second dimension: heads moved there and back)."""
    if not hasattr(norm, "norms"):
        return norm.forward
    return lambda x: norm(x.movedim(-2, 1)).movedim(1, -2)


def _norm_width(norm: Any) -> int:
    """How many values a q or k norm normalizes together (StableLM's: one head's)."""
    return norm.norms[0].weight.numel() if hasattr(norm, "norms") else norm.weight.numel()


def _parameters(fn: Any) -> Any:
    return inspect.signature(fn).parameters


def _one(module: Any, *names: str) -> Any:
    """``module``'s first attribute of ``names`` that it has; AttributeError naming them
    all where it has none."""
    found = _first(module, *names)
    if found is None:
        raise AttributeError(f"{type(module).__name__} has no {' or '.join(names)}")
    return found


def _same(x: torch.Tensor) -> torch.Tensor:
    """No norm (where a layer has none before its attention or its MLP)."""
    return x


def _window_of(blocked: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
    """A decode step's mask for a sliding layer of ``window``: ``blocked`` ``[rows, 1, 1,
    columns]`` (True: not attended) also blocking each row's keys before its last ``window``
    positions (its real keys counted: padding, wherever it lies, takes no place in it; the
    pending column, a row's newest, is last), and the first column any row's window reaches
    (0 on an accelerator: no host sync a step)."""
    counts = (~blocked).long().cumsum(-1)  # real keys up to each column
    far = counts <= counts[..., -1:] - window
    where = blocked | far
    if blocked.device.type != "cpu":
        return where, 0
    reached = (~far).view(far.shape[0], -1).any(0)
    return where, int(reached.long().argmax())


def _windows(config: Any, count: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' masks give them:
    by ``layer_types``, else (Mistral's) every layer's ``sliding_window`` unless it is off."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    on = isinstance(window, int) and getattr(config, "use_sliding_window", True) is not False
    return [window if on else None] * count


def dense_mlp(mlp: Any) -> bool:
    """Whether ``mlp`` is a layer's gated MLP of plain ``gate_proj``, ``up_proj`` and
    ``down_proj`` Linears, or of ``gate_up_proj`` (gate's rows, then up's) and ``down_proj``,
    or an MLP of ``up_proj`` and ``down_proj`` alone (else, in the mixture families, a mixture
    of experts)."""
    return all(isinstance(getattr(mlp, name, None), _LINEAR) for name in mlp_projections(mlp))


def mlp_projections(mlp: Any) -> tuple[str, ...]:
    """The names of a dense MLP's projections, in the engine's fused order."""
    if isinstance(getattr(mlp, "gate_up_proj", None), torch.nn.Linear):
        return ("gate_up_proj", "down_proj")
    if hasattr(mlp, "dense_h_to_4h"):  # GPT-NeoX's, without a gate
        return ("dense_h_to_4h", "dense_4h_to_h")
    if hasattr(mlp, "c_fc"):  # GPT-2's, without a gate
        return ("c_fc", "c_proj")
    if hasattr(mlp, "fc1"):  # Phi-2's, without a gate
        return ("fc1", "fc2")
    if not hasattr(mlp, "gate_proj") and isinstance(getattr(mlp, "up_proj", None), torch.nn.Linear):
        return ("up_proj", "down_proj")
    return ("gate_proj", "up_proj", "down_proj")


def _fuse(projections: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``projections`` stacked by output rows; each projection's own
    parameter becomes a view of it, so a copy into the parameter updates the fused tensor.
    Fusing again (a second ``LlamaForward`` of the same model) finds the same tensors."""
    done = getattr(projections[0], "_inflight_fused", None)
    if done is not None and _views_of(done[0], [p.weight for p in projections]):
        return done
    fused = _fuse_new(projections)
    projections[0]._inflight_fused = fused  # type: ignore[assignment]
    return fused


def _views_of(fused: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    row, size = 0, fused.element_size() * fused.shape[-1]
    for w in weights:
        if w.data_ptr() != fused.data_ptr() + row * size:
            return False
        row += w.shape[0]
    return row == fused.shape[0]


def _fuse_new(projections: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weights = [p.weight for p in projections]
    fused = torch.cat([w.detach() for w in weights])
    row = 0
    for w in weights:
        w.data = fused[row : row + w.shape[0]]
        row += w.shape[0]
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return fused, None
    filled = [
        b.detach() if b is not None else w.new_zeros(w.shape[0])
        for b, w in zip(biases, weights, strict=True)
    ]
    bias = torch.cat(filled)
    row = 0
    for p, b in zip(projections, filled, strict=True):
        if p.bias is not None:
            p.bias.data = bias[row : row + b.shape[0]]
        row += b.shape[0]
    return fused, bias
