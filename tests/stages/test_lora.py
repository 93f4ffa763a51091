"""LoRA: adapters only train, only they travel, an engine merges them into what the learner's
peft model computes; checkpoints in peft's format (and merged); bad targets refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.engine.model_weights import WeightLoadError, load_named_tensors
from stages.learner.lora import LoraSection, adapter_name, check_targets
from tests.stages.learner_setup import join_rank, run_ranks
from tests.stages.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=1, hidden=32, layers=2)


def _base(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_an_engine_merges_adapters_onto_the_weights_it_started_with(model_dir):
    model = _base(model_dir)
    name = "model.layers.0.self_attn.q_proj"
    w0 = model.get_parameter(f"{name}.weight").detach().clone()
    g = torch.Generator().manual_seed(0)
    a1, b1 = torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g)
    assert (
        load_named_tensors(model, [(f"{name}.lora_A.weight", a1), (f"{name}.lora_B.weight", b1)])
        == 2
    )
    weight = model.get_parameter(f"{name}.weight")
    torch.testing.assert_close(weight, w0 + b1 @ a1)
    # the next adapter replaces the last one (never W0 + both)
    a2, b2 = torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g)
    load_named_tensors(model, [(f"{name}.lora_A.weight", a2), (f"{name}.lora_B.weight", b2)])
    torch.testing.assert_close(weight, w0 + b2 @ a2)
    # a half in a call of its own goes with the other half last given
    load_named_tensors(model, [(f"{name}.lora_A.weight", a1)])
    torch.testing.assert_close(weight, w0 + b2 @ a1)
    # a full tensor for an adapted module is its new W0, the adapter stays on top
    load_named_tensors(model, [(f"{name}.weight", w0 * 2)])
    torch.testing.assert_close(weight, 2 * w0 + b2 @ a1)
    # a bad adapter changes nothing
    before = weight.detach().clone()
    for bad, why in (
        ([(f"{name}.lora_A.weight", torch.zeros(4, 31))], "want \\[r, 32\\]"),
        ([(f"{name}.lora_B.weight", torch.zeros(32, 3))], "rank 4, lora_B 3"),
        ([("model.nope.lora_A.weight", torch.zeros(4, 32))], "no such parameter"),
    ):
        with pytest.raises(WeightLoadError, match=why):
            load_named_tensors(model, bad)
    torch.testing.assert_close(weight, before, rtol=0, atol=0)


def test_targets_that_match_nothing_or_a_rank_too_large_are_refused(model_dir):
    model = _base(model_dir)
    assert len(check_targets(model, LoraSection(rank=4))) == 2 * 7  # every linear but lm_head
    assert check_targets(model, LoraSection(rank=4, target_modules=["q_proj", "v_proj"])) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    with pytest.raises(ValueError, match=r"'qproj' matches no linear module.*q_proj"):
        check_targets(model, LoraSection(rank=4, target_modules=["qproj"]))
    with pytest.raises(ValueError, match=r"lora\.rank 40 is larger than .* at most"):
        check_targets(model, LoraSection(rank=40, target_modules=["q_proj"]))
    assert adapter_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") == (
        "model.layers.0.mlp.up_proj",
        "lora_B",
    )
    assert adapter_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") is None


def _lora_rank(rank, world, port, model_dir, zero, out):
    """A LoRA learner (ZeRO ``zero``, ``world`` ranks) takes two steps, publishes, saves."""
    join_rank(rank, world, port)
    import structlog

    from stages.learner.config import DeepSpeedSection, LearnerConfig, OptimConfig
    from stages.learner.trainer import Trainer, TrainSample

    config = LearnerConfig(
        model=str(model_dir),
        batch_size=8,
        train_micro_batch=2,
        optim=OptimConfig(lr=5e-2),
        deepspeed=DeepSpeedSection(zero_stage=zero),
        lora=LoraSection(rank=4, alpha=8, merged_checkpoints=True),
    )
    trainer = Trainer(config, structlog.get_logger())
    trainer.setup()
    rng = np.random.default_rng(rank)
    samples = [
        TrainSample(
            prompt_ids=rng.integers(3, 60, 4),
            completion_ids=rng.integers(3, 60, 3),
            sampler_logprobs=np.full(3, -4.0, dtype=np.float32),
            versions=np.zeros(3, dtype=np.int64),
            advantage=float(rng.normal()),
            reward=0.0,
        )
        for _ in range(8 // world)
    ]
    for _ in range(2):
        trainer.step(samples, policy_version=0)
    published = [(n, t.clone()) for group in trainer.named_weights(1024) for n, t in group]
    trainer.save(f"{out}/ckpt", {"step": 2}, str(model_dir))
    if rank == 0:
        import deepspeed

        module = trainer.engine.module
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=zero == 3):
            logits = module(input_ids=ids).logits.detach()
            base = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" not in n}
        torch.save({"published": published, "logits": logits, "base": base}, f"{out}/rank0.pt")
    trainer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("zero", "world"), [(0, 1), (3, 2)])
def test_a_lora_learner_publishes_only_adapters_and_an_engine_computes_what_it_does(
    model_dir, tmp_path, zero, world
):
    run_ranks(_lora_rank, world, model_dir, zero, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    names = [n for n, _ in got["published"]]
    assert len(names) == 2 * 14 and all(
        n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names
    )
    # the base never trained
    original = _base(model_dir).state_dict()
    for name, value in got["base"].items():
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        torch.testing.assert_close(value, original[plain], rtol=0, atol=0)
    # an engine that started from the base model, given only the adapters, computes the same
    engine = _base(model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    before = engine(input_ids=ids).logits.detach()
    load_named_tensors(engine, got["published"])
    after = engine(input_ids=ids).logits.detach()
    assert (after - before).abs().max() > 1e-3  # the adapters did something
    torch.testing.assert_close(after, got["logits"], rtol=1e-5, atol=1e-5)
    # the checkpoint: the adapter in peft's format, and the merged model
    ckpt = tmp_path / "ckpt"
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 4
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged", dtype=torch.float32)
    torch.testing.assert_close(merged(input_ids=ids).logits, got["logits"], rtol=1e-5, atol=1e-5)
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(_base(model_dir), ckpt)
    torch.testing.assert_close(reloaded(input_ids=ids).logits, got["logits"], rtol=1e-5, atol=1e-5)
