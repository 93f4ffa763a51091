"""Delta weight updates: an engine given only the changed values holds, bit for bit, what one
given every tensor holds; the encoder sends whole tensors where that is smaller."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.engine.model_weights import WeightLoadError, load_named_tensors
from stages.weights.delta import DeltaEncoder
from tests.stages.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=1, hidden=32, layers=2)


def _engine(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def test_deltas_in_bfloat16_give_the_engine_exactly_what_full_updates_give(model_dir):
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_engine, delta_engine = _engine(model_dir), _engine(model_dir)
    encoder = DeltaEncoder(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    sent, kinds = [], set()
    for step in range(6):
        with torch.no_grad():  # a small step: most float32 moves stay inside a bfloat16 step
            for p in learner.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-4)
        weights = [(n, p.detach()) for n, p in learner.named_parameters()]
        load_named_tensors(full_engine, [(n, t.to(torch.bfloat16)) for n, t in weights])
        update = list(encoder.encode(weights, full=step == 0))
        kinds.update(n.rsplit(".", 1)[-1] for n, _ in update if ".delta_" in n)
        load_named_tensors(delta_engine, update)
        sent.append(sum(t.numel() * t.element_size() for _, t in update))
        for (name, a), b in zip(
            full_engine.state_dict().items(), delta_engine.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (step, name)
    assert all(s < 0.5 * sent[0] for s in sent[1:]), sent
    assert {"delta_zmask", "delta_zdiff", "delta_esc"} <= kinds  # bfloat16: compressed
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(full_engine(input_ids=ids).logits, delta_engine(input_ids=ids).logits)


def test_a_tensor_that_mostly_changed_goes_whole_and_one_that_did_not_goes_not_at_all():
    encoder = DeltaEncoder()
    a, b = torch.zeros(100), torch.zeros(100)
    list(encoder.encode([("a", a), ("b", b)], full=True))
    a2, b2 = a.clone(), torch.ones(100)
    a2[[3, 50]] = 1.0
    out = dict(encoder.encode([("a", a2), ("b", b2), ("c", torch.ones(3))], full=False))
    assert out["a.delta_idx"].tolist() == [3, 50] and out["a.delta_val"].tolist() == [1.0, 1.0]
    assert torch.equal(out["b"], b2) and torch.equal(out["c"], torch.ones(3))  # c: new, whole
    assert list(encoder.encode([("a", a2)], full=False)) == []  # nothing moved since
    # a seventh of the values: a bit per value is smaller than an index per changed one
    a3 = a2.clone()
    a3[::7] += 1.0
    out = dict(encoder.encode([("a", a3)], full=False))
    assert sorted(out) == ["a.delta_mask", "a.delta_val"] and out["a.delta_mask"].numel() == 13
    engine = torch.nn.Module()
    engine.a = torch.nn.Parameter(a2.clone())
    load_named_tensors(engine, list(out.items()))
    assert torch.equal(engine.a.data, a3)


def test_a_delta_split_over_calls_and_bad_deltas(model_dir):
    engine = _engine(model_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    weight = engine.get_parameter(name)
    before = weight.detach().clone()
    idx = torch.tensor([0, 7, 100], dtype=torch.int32)
    val = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    load_named_tensors(engine, [(name + ".delta_idx", idx)])  # its values in the next call
    assert torch.equal(weight, before)
    load_named_tensors(engine, [(name + ".delta_val", val)])
    assert weight.view(-1)[[0, 7, 100]].tolist() == [1.0, 2.0, 3.0]
    after = weight.detach().clone()
    garbage = torch.tensor([1, 2, 3], dtype=torch.uint8)
    for bad, why in (
        ([(name + ".delta_idx", torch.tensor([10**6])), (name + ".delta_val", val[:1])], "outside"),
        ([(name + ".delta_idx", idx), (name + ".delta_val", val[:2])], "2 values for 3 positions"),
        ([("model.nope.weight.delta_idx", idx), ("model.nope.weight.delta_val", val)], "no such"),
        (
            [
                (name + ".delta_zmask", garbage),
                (name + ".delta_zdiff", garbage),
                (name + ".delta_esc", val[:0]),
            ],
            "not zlib data",
        ),
    ):
        with pytest.raises(WeightLoadError, match=why):
            load_named_tensors(engine, bad)
    assert torch.equal(weight, after)
