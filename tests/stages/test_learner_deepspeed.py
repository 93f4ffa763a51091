"""The learner's DeepSpeed trainer with real gloo process groups: ranks, ZeRO, micro-batches.

One optimizer step over the same 8 samples must give the same gradient and the same new weights
whether it runs on one rank in one micro-batch, on two ZeRO-2 ranks in micro-batches of one, or on
two ZeRO-3 ranks with an uneven split (the ranks then run different numbers of micro-batches and
pad with empty ones). A step whose loss is not finite is skipped on every rank and leaves no
gradient behind. Each configuration runs in fresh processes, as the supervisor starts ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.numerics import (
    adam_first_step_tolerance,
    approx,
    assert_close,
    backward_terms,
    tolerance,
)
from tests.stages.learner_setup import join_rank, run_ranks
from tests.stages.tiny_model import make_tiny_model

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(240)]

LR, EPS = 1e-2, 1.0


def _samples(nan: bool = False) -> list:
    from stages.learner.trainer import TrainSample

    rng = np.random.default_rng(0)
    # two samples a prompt, as a group's: micro-batches of 2 run each prompt once (one run's
    # micro-batches of 1 run every row whole)
    prompts = [rng.integers(3, 60, 4 + i % 3) for i in range(4)]
    out = []
    for i in range(8):
        n = 3 + i % 4
        lp = (-rng.random(n) * 2).astype(np.float32)
        if nan and i == 5:
            lp[0] = np.nan
        out.append(
            TrainSample(
                prompt_ids=prompts[i // 2],
                completion_ids=rng.integers(3, 60, n),
                sampler_logprobs=lp,
                versions=np.zeros(n, dtype=np.int64),
                advantage=float(rng.normal()),
                reward=float(i % 2),
            )
        )
    return out


def _rank(rank, world, port, model_dir, zero, micro, split, nan_first, out):
    join_rank(rank, world, port)
    import structlog

    from stages.learner.config import DeepSpeedSection, LearnerConfig, OptimConfig
    from stages.learner.trainer import Trainer

    config = LearnerConfig(
        model=str(model_dir),
        batch_size=8,
        train_micro_batch=micro,
        forward_micro_batch=2,
        # an Adam epsilon above the gradients: the first update nearly linear in them
        optim=OptimConfig(lr=LR, eps=EPS, grad_clip=0.0),
        deepspeed=DeepSpeedSection(zero_stage=zero),
    )
    trainer = Trainer(config, structlog.get_logger())
    trainer.setup()
    lo, hi = split[rank], split[rank + 1]
    results = {}
    if nan_first:
        results["nan"] = trainer.step(_samples(nan=True)[lo:hi], policy_version=0)
        snap = trainer.snapshot(2**20)
        if rank == 0:
            results["after_nan"] = {k: v.clone() for k, v in snap.items()}
    results["clean"] = trainer.step(_samples()[lo:hi], policy_version=0)
    snap = trainer.snapshot(2**20)
    if rank == 0:
        results["weights"] = {k: v.clone() for k, v in snap.items()}
        torch.save(results, out)
    trainer.close()


def _run(model_dir, tmp_path, *, world, zero, micro, split, nan_first=False) -> dict:
    out = tmp_path / f"w{world}-z{zero}-m{micro}-{nan_first}.pt"
    run_ranks(_rank, world, model_dir, zero, micro, split, nan_first, str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=1, hidden=32, layers=2)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """One rank, micro-batches of 2; a NaN step (in the third micro-batch) before the clean one."""
    return _run(
        model_dir,
        tmp_path_factory.mktemp("ref"),
        world=1,
        zero=0,
        micro=2,
        split=[0, 8],
        nan_first=True,
    )


def _grad_terms(model_dir) -> int:
    """The rule's terms for a gradient of the 8 samples (tests/numerics.py), in micro-batches
    of one at most, and an all-reduce."""
    config = AutoConfig.from_pretrained(model_dir)
    samples = _samples()
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    return backward_terms(config, max(lengths), sum(lengths), micro_batches=len(samples) + 1)


def _same_weights(model_dir, a: dict, b: dict) -> None:
    """The weights after one AdamW step on the same samples agree within the rule, each
    gradient's scale read back from the step it caused (``|u| = |g| / (|g| + eps)``)."""
    assert a.keys() == b.keys()
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    terms = _grad_terms(model_dir)
    for name in a:
        u = float((before[name] - a[name]).abs().max()) / LR
        grad_scale = EPS * u / (1 - u)
        atol = adam_first_step_tolerance(
            LR, EPS, tolerance(terms, grad_scale), float(a[name].abs().max())
        )
        assert_close(b[name], a[name], atol=atol, msg=name)


def _same_grad_norm(model_dir, a: float, b: float) -> None:
    """One more sum for the norm, of every parameter's square."""
    params = AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
    assert b == approx(a, terms=_grad_terms(model_dir) + params)


def test_nan_loss_skips_the_step_and_leaves_no_gradient(model_dir, tmp_path, reference):
    assert reference["nan"]["skipped"] == 1
    initial = _run(model_dir, tmp_path, world=1, zero=0, micro=8, split=[0, 8])
    # the clean step after a skipped one lands exactly where a clean step from scratch does
    _same_weights(model_dir, reference["weights"], initial["weights"])
    assert reference["clean"]["skipped"] == 0
    changed = sum(
        not torch.equal(reference["after_nan"][k], reference["weights"][k])
        for k in reference["weights"]
    )
    assert changed > 0


def test_zero2_two_ranks_micro_batches_of_one_match_one_rank(model_dir, tmp_path, reference):
    got = _run(model_dir, tmp_path, world=2, zero=2, micro=1, split=[0, 4, 8])
    _same_grad_norm(model_dir, reference["clean"]["grad_norm"], got["clean"]["grad_norm"])
    assert got["clean"]["samples"] == 8
    _same_weights(model_dir, reference["weights"], got["weights"])


def test_zero3_uneven_ranks_match_one_rank(model_dir, tmp_path, reference):
    # rank 0 holds 6 samples (3 micro-batches of 2), rank 1 holds 2 (1 micro-batch + 2 empty)
    got = _run(model_dir, tmp_path, world=2, zero=3, micro=2, split=[0, 6, 8])
    _same_grad_norm(model_dir, reference["clean"]["grad_norm"], got["clean"]["grad_norm"])
    _same_weights(model_dir, reference["weights"], got["weights"])


# ---- samples without signal: no passes, the same step -------------------------------------


def _no_signal_rank(rank, world, port, model_dir, out):
    """Two ZeRO-2 ranks; rank 1's four samples have advantage 0. Then a step where every
    sample has advantage 0. Each rank saves the token shapes its model was run on, per step:
    with ``skip_no_signal`` and then without, a fresh trainer each in the same group."""
    join_rank(rank, world, port)
    import dataclasses

    import structlog

    from stages.learner.config import DeepSpeedSection, LearnerConfig, OptimConfig
    from stages.learner.trainer import Trainer

    shapes: list[tuple[int, ...]] = []  # what each trainer's model was run on, per step
    for skip in (True, False):
        config = LearnerConfig(
            model=str(model_dir),
            batch_size=8,
            train_micro_batch=1,
            forward_micro_batch=2,
            skip_no_signal=skip,
            optim=OptimConfig(lr=LR, eps=EPS, grad_clip=0.0),
            deepspeed=DeepSpeedSection(zero_stage=2),
        )
        trainer = Trainer(config, structlog.get_logger())
        trainer.setup()
        trainer.engine.module.register_forward_pre_hook(
            lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        samples = [
            dataclasses.replace(s, advantage=0.0) if i >= 4 else s for i, s in enumerate(_samples())
        ]
        results: dict = {"steps": [], "shapes": []}
        for batch in (samples, [dataclasses.replace(s, advantage=0.0) for s in samples]):
            shapes.clear()
            results["steps"].append(trainer.step(batch[rank * 4 : rank * 4 + 4], policy_version=0))
            results["shapes"].append(list(shapes))
            if "weights" not in results:
                snap = trainer.snapshot(2**20)  # collective; rank 0's copy
                results["weights"] = (
                    None if snap is None else {k: v.clone() for k, v in snap.items()}
                )
        torch.save(results, f"{out}-{skip}.{rank}")
    trainer.close()


def test_samples_without_signal_have_no_passes_and_change_nothing(model_dir, tmp_path):
    out = str(tmp_path / "skip")
    run_ranks(_no_signal_rank, 2, model_dir, out)  # both settings in one group: half the start-up
    runs = {
        skip: [torch.load(f"{out}-{skip}.{r}", weights_only=False) for r in range(2)]
        for skip in (True, False)
    }
    skipped, kept = runs[True], runs[False]
    # rank 1's samples: only one-token (padding) passes, as many as rank 0's micro-batches
    assert skipped[1]["shapes"][0] == [(1, 1)] * 4
    assert all(numel > 1 for s in kept[1]["shapes"][0] for numel in [s[0] * s[1]])
    assert skipped[0]["steps"][0]["no_signal"] == 4 and kept[0]["steps"][0]["no_signal"] == 0
    for got in (skipped[0]["steps"][0], kept[0]["steps"][0]):
        assert got["samples"] == 8 and got["tokens"] == sum(
            len(s.completion_ids) for s in _samples()
        )
    # the same gradient, so the same step (the normalization still counts all 8 samples)
    _same_grad_norm(
        model_dir, kept[0]["steps"][0]["grad_norm"], skipped[0]["steps"][0]["grad_norm"]
    )
    _same_weights(model_dir, kept[0]["weights"], skipped[0]["weights"])
    # nothing with signal: one padding pass per rank, a zero gradient
    assert skipped[0]["steps"][1]["no_signal"] == 8
    assert [r["shapes"][1] for r in skipped] == [[(1, 1)], [(1, 1)]]
    assert skipped[0]["steps"][1]["grad_norm"] == 0.0
