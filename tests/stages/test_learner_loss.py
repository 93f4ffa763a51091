"""The learner's loss and advantages: hand-computed values, masking, gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from stages.learner.advantages import group_advantages, one_group_advantages
from stages.learner.batching import collate, completion_logprobs, micro_batches, pad_right
from stages.learner.loss import LossConfig, loss_denominator, policy_loss, stat_keys, summarize
from tests.numerics import approx, assert_close, backward_terms, forward_terms
from tests.stages.learner_setup import one_torch_thread, tiny_policy

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

LOG = math.log
F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


def _loss(logp, *, sampler, old=None, adv, mask=None, config, denominator, ref=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, stats = policy_loss(
        logp,
        sampler_logp=torch.tensor(sampler, dtype=torch.float64),
        old_logp=logp.detach() if old is None else torch.tensor(old, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        mask=mask,
        config=config,
        denominator=denominator,
        ref_logp=None if ref is None else torch.tensor(ref, dtype=torch.float64),
    )
    loss.backward()
    return loss.item(), logp.grad, stats


# ---- advantages ---------------------------------------------------------------------------


def test_mean_baseline_with_uneven_groups_and_sparse_ids():
    r = torch.tensor([1.0, 0.0, 4.0, 2.0, 5.0, 3.0], dtype=F64)
    g = torch.tensor([7, 7, 3, 3, 3, 42])
    adv = group_advantages(r, g)
    # group 7: mean 0.5; group 3: mean 11/3; group 42 alone: mean 3.
    expected = torch.tensor([0.5, -0.5, 4 - 11 / 3, 2 - 11 / 3, 5 - 11 / 3, 0.0], dtype=F64)
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_baseline():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 9.0], dtype=F64)
    g = torch.tensor([0, 0, 0, 1, 2])
    adv = group_advantages(r, g, baseline="leave_one_out")
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; a lone sample has no baseline: 0.
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0], dtype=F64))


def test_std_normalization_uses_population_std():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 5.0], dtype=F64)
    g = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = group_advantages(r, g, std_normalize=True, eps=0.0 + 1e-12)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)  # unbiased=False
    expected = torch.tensor(
        [(2 / 3) / std0, (-1 / 3) / std0, (-1 / 3) / std0, 0.0, 0.0, 0.0], dtype=F64
    )
    torch.testing.assert_close(adv, expected)
    loo = group_advantages(r, g, baseline="leave_one_out", std_normalize=True)
    # eps (1e-6 by default) added to the std moves the result by about 1e-6 relative
    torch.testing.assert_close(loo[:3], expected[:3] * 1.5, rtol=1e-5, atol=0)
    assert torch.isfinite(loo).all()


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("std_normalize", [False, True])
def test_one_group_in_python_floats_equals_the_tensor_version(baseline, std_normalize):
    """What the learner computes per group message, against the batched tensor version."""
    gen = torch.Generator().manual_seed(0)
    for size in (1, 2, 4, 7):
        for _ in range(20):
            r = torch.randint(0, 3, (size,), generator=gen).to(F64) / 2
            options = {"baseline": baseline, "std_normalize": std_normalize}
            want = group_advantages(r, torch.zeros(size, dtype=torch.long), **options)
            got = one_group_advantages(r.tolist(), **options)
            torch.testing.assert_close(torch.tensor(got, dtype=F64), want, rtol=1e-9, atol=1e-12)
    assert one_group_advantages([0.11, 0.11, 0.11]) == [0.0, 0.0, 0.0]
    assert one_group_advantages([]) == []
    with pytest.raises(ValueError, match="baseline"):
        one_group_advantages([1.0], baseline="median")


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero():
    # in float32 0.11 * 3 / 3 is not 0.11: the mean alone would leave about 7e-9
    r = torch.tensor([0.11, 0.11, 0.11, 1.0, 0.0, 0.3, 0.3])
    g = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert (r[:3] - r[:3].sum() / 3).abs().max() > 0
    for baseline in ("mean", "leave_one_out"):
        for std in (False, True):
            adv = group_advantages(r, g, baseline=baseline, std_normalize=std)
            assert adv[[0, 1, 2, 5, 6]].tolist() == [0.0] * 5, (baseline, std)
            assert adv[3] > 0 > adv[4]


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), baseline="median")
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.zeros(2), torch.zeros(3, dtype=torch.long))
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


# ---- loss: hand-computed ------------------------------------------------------------------


def test_tis_truncates_rho_above_cap_only():
    # rho = [3, 0.5]: the first is truncated to C = 2, the second kept.
    logp = [[LOG(0.5), LOG(0.25)]]
    sampler = [[LOG(0.5) - LOG(3.0), LOG(0.25) - LOG(0.5)]]
    config = LossConfig(tis_cap=2.0, normalize="token")
    loss, grad, stats = _loss(logp, sampler=sampler, adv=[1.5], config=config, denominator=2)
    assert loss == pytest.approx(-(2 * 1.5 * LOG(0.5) + 0.5 * 1.5 * LOG(0.25)) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.5, -0.375]], dtype=torch.float64))
    assert stats["tis_clipped"].item() == 1 and stats["tokens"].item() == 2
    metrics = summarize(stats)
    assert metrics["tis_clip_frac"] == pytest.approx(0.5)
    assert metrics["ess"] == pytest.approx(3.5**2 / (2 * (9 + 0.25)))


def test_sequence_and_token_normalization():
    # Two sequences, lengths 2 and 1, rho = 1 everywhere: term = -A * logp.
    logp = [[-1.0, -2.0], [-3.0, 99.0]]
    mask = [[True, True], [True, False]]
    kwargs = dict(sampler=logp, adv=[1.0, 2.0], mask=mask)
    seq, seq_grad, _ = _loss(logp, config=LossConfig(), denominator=4, **kwargs)
    assert seq == pytest.approx((1.5 + 6.0) / 4)  # per-sequence means (1.5, 6), over 4 seqs
    expected = torch.tensor([[-0.5, -0.5], [-2.0, 0.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(seq_grad, expected)
    tok, tok_grad, _ = _loss(logp, config=LossConfig(normalize="token"), denominator=3, **kwargs)
    assert tok == pytest.approx((1 + 2 + 6) / 3)
    expected = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64) / 3
    torch.testing.assert_close(tok_grad, expected)


def test_per_token_advantages_weigh_each_token_with_masked_garbage():
    # on-policy distillation: A [B, T], NaN and inf where masked; rho = 1: term = -A_t * logp_t
    logp = [[-1.0, -2.0, -0.5], [-3.0, 99.0, 99.0]]
    mask = [[True, True, True], [True, False, False]]
    adv = [[0.5, -1.0, 2.0], [1.5, math.nan, math.inf]]
    kwargs = dict(sampler=logp, adv=adv, mask=mask)
    # terms 0.5, -2, 1 (mean -1/6) and 4.5 (mean 4.5), over 2 sequences
    seq, seq_grad, stats = _loss(logp, config=LossConfig(), denominator=2, **kwargs)
    assert seq == pytest.approx((-1 / 6 + 4.5) / 2, rel=1e-12)
    expected = torch.tensor([[-0.5 / 3, 1 / 3, -2 / 3], [-1.5, 0.0, 0.0]], dtype=F64) / 2
    torch.testing.assert_close(seq_grad, expected, rtol=0, atol=1e-12)
    assert stats["tokens"].item() == 4
    tok, tok_grad, _ = _loss(logp, config=LossConfig(normalize="token"), denominator=4, **kwargs)
    assert tok == pytest.approx((0.5 - 2 + 1 + 4.5) / 4, rel=1e-12)
    expected = torch.tensor([[-0.5, 1.0, -2.0], [-1.5, 0.0, 0.0]], dtype=F64) / 4
    torch.testing.assert_close(tok_grad, expected, rtol=0, atol=1e-12)
    # an advantage repeated over a sequence's tokens is that sequence's advantage
    same = _loss(logp, sampler=logp, adv=[[0.7] * 3, [-0.2] * 3], mask=mask,
                 config=LossConfig(), denominator=2)  # fmt: skip
    per_seq = _loss(logp, sampler=logp, adv=[0.7, -0.2], mask=mask, config=LossConfig(),
                    denominator=2)  # fmt: skip
    assert same[0] == per_seq[0]
    torch.testing.assert_close(same[1], per_seq[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"advantages must be \[2\] or \[2, 3\]"):
        _loss(logp, sampler=logp, adv=[[1.0] * 4] * 2, config=LossConfig(), denominator=1)


def test_ppo_clips_each_token_by_the_sign_of_its_own_advantage():
    # old = 0: r = 1.5 at both tokens; A = +1 clips the first (1.2, no gradient), A = -1 keeps
    # the second's gradient (-r * A = 1.5) and counts no clip
    logp = [[LOG(1.5), LOG(1.5)]]
    zeros = [[0.0, 0.0]]
    config = LossConfig(ppo_clip=0.2, normalize="token")
    loss, grad, stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[[1.0, -1.0]], config=config, denominator=1
    )
    assert loss == pytest.approx(-1.2 + 1.5, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.5]], dtype=F64), rtol=0, atol=1e-12)
    assert stats["clipped"].item() == 1


def test_mis_drops_tokens_outside_the_band():
    logp = [[-1.0, -1.0, -1.0]]
    sampler = [[-1.0 - LOG(0.1), -1.0, -1.0 - LOG(5.0)]]  # rho = 0.1, 1, 5
    config = LossConfig(mis_low=0.5, mis_high=2.0, tis_cap=10.0)
    loss, grad, stats = _loss(logp, sampler=sampler, adv=[1.0], config=config, denominator=1)
    # Only the middle token counts; the sequence is still averaged over its 3 tokens.
    assert loss == pytest.approx(1.0 / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1 / 3, 0.0]], dtype=torch.float64))
    assert stats["mis_dropped"].item() == 2
    assert summarize(stats)["mis_drop_frac"] == pytest.approx(2 / 3)


def test_ppo_clip_with_tis_weight():
    # old = 0, so r = exp(logp): r = 1.5 and 0.5 in each sequence; A = +1 and -1; rho = 1.
    eps = 0.2
    logp = [[LOG(1.5), LOG(0.5)], [LOG(1.5), LOG(0.5)]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    config = LossConfig(ppo_clip=eps, normalize="token")
    loss, grad, stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[1.0, -1.0], config=config, denominator=1
    )
    # A > 0: min(1.5, 1.2) = 1.2 (clipped, no grad); min(0.5, 0.8) = 0.5 (grad -r).
    # A < 0: min(-1.5, -1.2) = -1.5 (grad +r); min(-0.5, -0.8) = -0.8 (clipped, no grad).
    assert loss == pytest.approx(-(1.2 + 0.5 - 1.5 - 0.8))
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5], [1.5, 0.0]], dtype=torch.float64))
    assert stats["clipped"].item() == 2
    assert summarize(stats)["clip_frac"] == pytest.approx(0.5)
    # The TIS weight multiplies the clipped surrogate: rho = 2 (below C = 3) doubles everything.
    sampler = [[-LOG(2.0)] * 2] * 2
    weighted = LossConfig(ppo_clip=eps, normalize="token", tis_cap=3.0)
    loss2, grad2, _ = _loss(
        logp, sampler=sampler, old=zeros, adv=[1.0, -1.0], config=weighted, denominator=1
    )
    assert loss2 == pytest.approx(2 * loss)
    torch.testing.assert_close(grad2, 2 * grad)


def test_first_epoch_ppo_gradient_equals_plain_gradient():
    logp = [[-0.3, -1.2, -2.0]]
    sampler = [[-0.1, -1.5, -1.0]]
    plain = _loss(logp, sampler=sampler, adv=[0.7], config=LossConfig(), denominator=1)
    ppo = _loss(logp, sampler=sampler, adv=[0.7], config=LossConfig(ppo_clip=0.2), denominator=1)
    torch.testing.assert_close(plain[1], ppo[1])


def test_dapo_asymmetric_clipping():
    # old = 0: r = exp(logp). A = +1: 1.25 is inside [0.8, 1.28] (symmetric 0.2 would clip
    # it), 1.3 is clipped (no grad), 0.75 is below the band but min() keeps it (grad -r).
    # A = -1: 1.3 keeps its grad (+r), 0.75 is clipped to 0.8 (no grad), 0.85 inside.
    logp = [[LOG(1.25), LOG(1.3), LOG(0.75)], [LOG(1.3), LOG(0.75), LOG(0.85)]]
    zeros = [[0.0] * 3] * 2
    config = LossConfig(objective="ppo", clip_low=0.2, clip_high=0.28, normalize="token")
    loss, grad, stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[1.0, -1.0], config=config, denominator=6
    )
    assert loss == pytest.approx(-(1.25 + 1.28 + 0.75 - 1.3 - 0.8 - 0.85) / 6, abs=1e-12)
    expected = torch.tensor([[-1.25, 0.0, -0.75], [1.3, 0.0, 0.85]], dtype=F64) / 6
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert stats["clipped"].item() == 2
    symmetric = LossConfig(ppo_clip=0.2, normalize="token")
    _, sym_grad, sym_stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[1.0, -1.0], config=symmetric, denominator=6
    )
    assert sym_grad[0, 0] == 0.0 and sym_stats["clipped"].item() == 3  # 1.25 > 1.2


def test_gspo_clips_the_sequence_ratio():
    # Token ratios 1.5 and 0.5: s = sqrt(0.75) = 0.866..., inside [0.8, 1.2] though the first
    # token's own ratio is not. Each token's gradient is -w * s * A / length.
    s = math.sqrt(0.75)
    logp = [[LOG(1.5), LOG(0.5)]]
    zeros = [[0.0, 0.0]]
    config = LossConfig(objective="gspo", clip_low=0.2, clip_high=0.2)
    loss, grad, stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[1.0], config=config, denominator=1
    )
    assert loss == pytest.approx(-s, abs=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor([[-s / 2, -s / 2]], dtype=F64), rtol=0, atol=1e-12
    )
    assert stats["clipped"].item() == 0
    # the band [0.9, 1.1]: A > 0 keeps s below it (min() takes it); A < 0 takes the clipped
    # 0.9, whole sequence, no gradient
    narrow = LossConfig(objective="gspo", clip_low=0.1, clip_high=0.1)
    loss, grad, stats = _loss(
        logp, sampler=zeros, old=zeros, adv=[-1.0], config=narrow, denominator=1
    )
    assert loss == pytest.approx(0.9, abs=1e-12)
    assert grad.abs().max() == 0 and stats["clipped"].item() == 2
    # the TIS weight stays per token: rho = (2, 1), C = 3; a masked token is not in the mean
    sampler = [[-LOG(2.0), 0.0, 0.0]]
    loss, grad, _ = _loss(
        [[LOG(1.5), LOG(0.5), 7.0]],
        sampler=sampler,
        old=[[0.0, 0.0, 0.0]],
        adv=[1.0],
        mask=[[True, True, False]],
        config=LossConfig(objective="gspo", clip_low=0.2, clip_high=0.2, tis_cap=3.0),
        denominator=1,
    )
    assert loss == pytest.approx(-(2 * s + s) / 2, abs=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor([[-s, -s / 2, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )


def test_cispo_clips_a_detached_weight_and_keeps_every_gradient():
    # r = 1.5, 0.5, 1.0 against old; clip_low 1 (no lower bound), clip_high 0.28: weights 1.28,
    # 0.5, 1 multiply -A * logp; the clipped token keeps its gradient (PPO's would be 0).
    r = [1.5, 0.5, 1.0]
    logp = [[-0.5, -1.0, -2.0]]
    old = [[lp - LOG(x) for lp, x in zip(logp[0], r, strict=True)]]
    config = LossConfig(objective="cispo")
    assert (config.clip_low, config.clip_high) == (1.0, 0.28)
    for adv in (1.0, -2.0):
        loss, grad, stats = _loss(
            logp, sampler=old, old=old, adv=[adv], config=config, denominator=1
        )
        weights = [1.28, 0.5, 1.0]
        assert loss == pytest.approx(
            -adv * sum(w * x for w, x in zip(weights, logp[0], strict=True)) / 3, abs=1e-12
        )
        expected = torch.tensor([[-adv * w / 3 for w in weights]], dtype=F64)
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
        assert stats["clipped"].item() == 1


def test_ratio_to_the_sampler_replaces_the_tis_weight():
    # logp = log 0.5, sampler = log 0.25, old = logp (first epoch): r = 2 against the sampler.
    logp, sampler = [[LOG(0.5)]], [[LOG(0.25)]]
    to_sampler = LossConfig(objective="ppo", clip_low=0.2, clip_high=0.2, ratio_base="sampler")
    loss, grad, stats = _loss(logp, sampler=sampler, adv=[1.0], config=to_sampler, denominator=1)
    assert loss == pytest.approx(-1.2) and grad.item() == 0.0 and stats["clipped"].item() == 1
    # against old: r = 1 and the TIS weight min(rho = 2, C = 2) = 2 gives the gradient -2
    to_old = LossConfig(objective="ppo", clip_low=0.2, clip_high=0.2)
    loss, grad, _ = _loss(logp, sampler=sampler, adv=[1.0], config=to_old, denominator=1)
    assert loss == pytest.approx(-2.0) and grad.item() == pytest.approx(-2.0)
    # cispo against the sampler: the weight is clip(2, 0, 1.28), the gradient still flows
    cispo = LossConfig(objective="cispo", ratio_base="sampler")
    loss, grad, _ = _loss(logp, sampler=sampler, adv=[1.0], config=cispo, denominator=1)
    assert loss == pytest.approx(-1.28 * LOG(0.5)) and grad.item() == pytest.approx(-1.28)


def test_dr_grpo_fixed_and_no_length_normalization():
    # Two sequences, lengths 2 and 1, rho = 1: term = -A * logp; sums 3 and 6.
    logp = [[-1.0, -2.0], [-3.0, 99.0]]
    mask = [[True, True], [True, False]]
    kwargs = dict(sampler=logp, adv=[1.0, 2.0], mask=mask)
    fixed = LossConfig(normalize="fixed", fixed_length=4)
    denominator = loss_denominator([2, 1], fixed)
    assert denominator == 8
    loss, grad, _ = _loss(logp, config=fixed, denominator=denominator, **kwargs)
    assert loss == pytest.approx((3 + 6) / 8)
    expected = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected / 8)
    none = LossConfig(normalize="none")
    loss, grad, _ = _loss(logp, config=none, denominator=loss_denominator([2, 1], none), **kwargs)
    assert loss == pytest.approx((3 + 6) / 2)
    torch.testing.assert_close(grad, expected / 2)


def test_k3_values_for_reference_and_mismatch():
    # ref - logp = log 2: k3 = 2 - log 2 - 1, d k3 / d logp = 1 - 2 = -1.
    logp = [[-1.0]]
    config = LossConfig(kl_coef=0.5, normalize="token")
    loss, grad, stats = _loss(
        logp, sampler=logp, adv=[0.0], config=config, denominator=1, ref=[[-1.0 + LOG(2.0)]]
    )
    k3 = 2 - LOG(2.0) - 1
    assert loss == pytest.approx(0.5 * k3)
    torch.testing.assert_close(grad, torch.tensor([[-0.5]], dtype=torch.float64))
    assert stats["kl_ref"].item() == pytest.approx(k3)
    # Mismatch: d = sampler - old = log 2 -> the same k3; with d = 0 it is 0.
    _, _, stats = _loss(
        [[-1.0, -1.0]],
        sampler=[[-1.0 + LOG(2.0), -1.0]],
        adv=[0.0],
        config=LossConfig(),
        denominator=1,
    )
    assert stats["k3_mismatch"].item() == pytest.approx(k3)
    assert summarize(stats)["mismatch_kl"] == pytest.approx(k3 / 2)


@pytest.mark.parametrize("objective", ["pg", "ppo", "gspo", "cispo"])
@pytest.mark.parametrize("with_ref", [False, True])
def test_stat_keys_are_the_keys_of_the_stats(objective, with_ref):
    """What every rank sums, whatever its samples (a rank without passes has no stats)."""
    config = LossConfig(objective=objective, kl_coef=0.1 if with_ref else 0.0)
    ref = [[-1.0]] if with_ref else None
    *_, stats = _loss([[-1.0]], sampler=[[-1.0]], adv=[1.0], config=config, denominator=1, ref=ref)
    assert stat_keys(config, with_ref=with_ref) == list(stats)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="both mis_low and mis_high"):
        LossConfig(mis_low=0.5)
    with pytest.raises(ValueError, match="mis_low must be < mis_high"):
        LossConfig(mis_low=2.0, mis_high=1.0)
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="ppo_clip"):
        LossConfig(ppo_clip=1.5)
    assert LossConfig(ppo_clip=0.1).objective == "ppo"
    assert LossConfig(ppo_clip=0.1, clip_low=0.1).clip_high == 0.1  # a config read back
    for bad, why in (
        (dict(ppo_clip=0.1, clip_high=0.3), "disagree"),
        (dict(objective="gspo", ppo_clip=0.1), "takes clip_low and clip_high"),
        (dict(clip_high=0.3), "needs objective ppo"),
        (dict(ratio_base="sampler"), "needs objective ppo"),
        (dict(objective="ppo", clip_low=1.0), "clip_low must be in"),
        (dict(objective="cispo", clip_low=1.5), "clip_low must be in"),
        (dict(objective="ppo", clip_high=float("inf")), "clip_high must be"),
        (dict(objective="dpo"), "objective must be"),
        (dict(normalize="fixed"), "fixed_length"),
        (dict(fixed_length=4), "needs normalize: fixed"),
    ):
        with pytest.raises(ValueError, match=why):
            LossConfig(**bad)
    with pytest.raises(ValueError, match="needs ref_logp"):
        _loss([[-1.0]], sampler=[[-1.0]], adv=[1.0], config=LossConfig(kl_coef=0.1), denominator=1)
    assert loss_denominator([3, 0, 5], "sequence") == 3
    assert loss_denominator([3, 0, 5], "none") == 3
    assert loss_denominator([3, 0, 5], LossConfig(normalize="fixed", fixed_length=8)) == 24
    with pytest.raises(ValueError, match="fixed_length"):
        loss_denominator([3], "fixed")
    assert loss_denominator(torch.tensor([[1, 1, 0], [1, 0, 0]]), "token") == 3
    assert loss_denominator([], "token") == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(ppo_clip=0.2),
        dict(objective="gspo", ratio_base="sampler"),
        dict(objective="cispo", normalize="fixed", fixed_length=3),
    ],
)
def test_masked_garbage_changes_nothing(options):
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    config = LossConfig(mis_low=0.1, mis_high=10.0, kl_coef=0.1, **options)
    values = {k: torch.randn(2, 4) - 2 for k in ("logp", "sampler", "old", "ref")}
    adv = torch.tensor([1.0, -0.5])

    def run(fill: dict[str, float]):
        t = {k: torch.where(mask, v, fill[k]) for k, v in values.items()}
        logp = t["logp"].clone().requires_grad_(True)
        loss, stats = policy_loss(
            logp,
            sampler_logp=t["sampler"],
            old_logp=t["old"],
            advantages=adv,
            mask=mask,
            config=config,
            denominator=2,
            ref_logp=t["ref"],
        )
        loss.backward()
        return loss, logp.grad, stats

    clean = run(dict.fromkeys(values, 0.0))
    dirty = run({"logp": math.nan, "sampler": -math.inf, "old": math.inf, "ref": math.nan})
    assert torch.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(dirty[1], clean[1], rtol=0, atol=0)
    for key in clean[2]:
        torch.testing.assert_close(dirty[2][key], clean[2][key], rtol=0, atol=0)


# ---- gradient accumulation over micro-batches ---------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [
        dict(normalize="sequence"),
        dict(normalize="token"),
        dict(
            normalize="fixed",
            fixed_length=6,
            objective="gspo",
            ratio_base="sampler",
            clip_low=0.3,
            clip_high=0.5,
        ),
        dict(normalize="none", objective="cispo", ratio_base="sampler", clip_high=0.1),
    ],
)
def test_micro_batch_gradients_equal_full_batch(options):
    """In float64: the split is under test, not float32 rounding (tests/numerics.py)."""
    model = tiny_policy(F64)
    g = torch.Generator().manual_seed(1)
    c_lens = [1, 7, 3, 9, 2]
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (2, 5, 3, 4, 6)]
    completions = [torch.randint(3, 64, (n,), generator=g).tolist() for n in c_lens]
    # Per-sample constants, so every micro-batching sees the same numbers.
    with torch.no_grad():
        full = collate(prompts, completions, pad_id=0)
        base, _ = completion_logprobs(model, full)
    noise = [torch.randn(n, generator=g, dtype=F64) for n in c_lens + c_lens]
    sampler = [base[i, :n] + 0.4 * noise[i] for i, n in enumerate(c_lens)]
    ref = [base[i, :n] + 0.2 * noise[len(c_lens) + i] for i, n in enumerate(c_lens)]
    advantages = torch.randn(len(c_lens), generator=g, dtype=F64)
    config = LossConfig(mis_low=0.2, mis_high=5.0, kl_coef=0.05, **options)
    denominator = loss_denominator(c_lens, config)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    longest, tokens = max(lengths), sum(lengths)
    logp_terms = forward_terms(model.config, longest)

    def accumulate(groups: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for mb in groups:
            batch = collate([prompts[i] for i in mb], [completions[i] for i in mb], pad_id=0)
            logp, _ = completion_logprobs(model, batch)
            width = logp.shape[1]
            loss, _ = policy_loss(
                logp,
                sampler_logp=pad_right([sampler[i] for i in mb], width=width),
                old_logp=logp.detach(),
                advantages=advantages[mb],
                mask=batch.completion_mask,
                config=config,
                denominator=denominator,
                ref_logp=pad_right([ref[i] for i in mb], width=width),
            )
            loss.backward()
            total += loss.item()
        return total, [p.grad.clone() for p in model.parameters()]

    full_loss, full_grads = accumulate([list(range(len(c_lens)))])
    assert any(g.abs().sum() > 0 for g in full_grads)
    for groups in (
        micro_batches(lengths, 1),
        micro_batches(lengths, 2),
        micro_batches(lengths, 5, max_tokens=20),  # uneven sizes from the token budget
    ):
        loss, grads = accumulate(groups)
        # micro-batch losses add up: one more term each, on the scale of the largest
        scale = max(abs(full_loss), 1.0)
        assert loss == approx(full_loss, terms=logp_terms + len(groups), scale=scale, dtype=F64)
        for a, b in zip(grads, full_grads, strict=True):
            assert_close(a, b, terms=backward_terms(model.config, longest, tokens, len(groups)))


def test_learning_rate_schedules():
    from stages.learner.config import OptimConfig
    from stages.learner.trainer import lr_factor

    def factors(**kw):
        optim = OptimConfig(lr=1.0, **kw)
        return [round(lr_factor(s, optim=optim, horizon=6), 4) for s in range(6)]

    assert factors() == [1.0] * 6
    assert factors(warmup_steps=2) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # decay from 1 right after the warm-up to min_lr_ratio at the last of the 6 steps
    assert factors(warmup_steps=2, schedule="linear") == [0.5, 1.0, 1.0, 0.6667, 0.3333, 0.0]
    assert factors(schedule="linear") == [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    assert factors(schedule="linear", min_lr_ratio=0.5) == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    assert factors(schedule="cosine") == [1.0, 0.9045, 0.6545, 0.3455, 0.0955, 0.0]
