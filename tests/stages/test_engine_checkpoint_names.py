"""A mixture-of-experts checkpoint updates a live model whole: transformers 5 saves (and Qwen's,
Mixtral's and OLMoE's checkpoints hold) one tensor an expert, where the model keeps one fused
parameter for a layer's experts; ``stages.engine.checkpoint_names`` converts them as
transformers' loader does. Before, ``/update_weights_from_disk`` left such experts out (their
names named no parameter) and answered success with the old experts in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages.engine.checkpoint_files import read_weights, weight_files
from stages.engine.model_weights import WeightLoadError, load_named_tensors, update_names

_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # block_sparse_moe.experts.N.w1
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "llama": {},  # nothing to convert
}


def _model(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **_SIZES, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_of_other_weights_updates_every_parameter(tmp_path: Path, family: str) -> None:
    """What ``/update_weights_from_disk`` does with a checkpoint folder: read the tensors the
    model takes, then load them; the model is then the checkpoint's, experts included."""
    saved = _model(family, seed=1)
    saved.save_pretrained(tmp_path)
    live = _model(family, seed=2)
    tensors, skipped = read_weights(weight_files(str(tmp_path)), update_names(live))
    assert skipped == []
    converted = family != "llama"
    assert any(".experts.0." in name for name, _ in tensors) == converted  # one an expert
    assert load_named_tensors(live, tensors) == len(tensors)
    want = saved.state_dict()
    got = live.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])
    ]
    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.equal(live(ids).logits, saved(ids).logits)


def test_some_of_a_layers_experts_are_refused_naming_the_parameter(tmp_path: Path) -> None:
    """Half of a layer's experts cannot make its fused parameter: refused, naming it and its
    shape, and the model is left as it was."""
    saved = _model("qwen3_moe", seed=1)
    saved.save_pretrained(tmp_path)
    live = _model("qwen3_moe", seed=2)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    tensors, _ = read_weights(weight_files(str(tmp_path)), update_names(live))
    half = [(n, t) for n, t in tensors if not any(f".experts.{e}." in n for e in (2, 3))]
    with pytest.raises(WeightLoadError, match=r"mlp\.experts\.gate_up_proj: shape \[2, "):
        load_named_tensors(live, half)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    with pytest.raises(WeightLoadError, match=r"mlp\.experts\.9\.gate: no such parameter"):
        load_named_tensors(live, [("model.layers.0.mlp.experts.9.gate", torch.zeros(2))])
