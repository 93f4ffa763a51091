"""The learner with multi-turn samples: tokens a tool inserted are context, never loss.

A trajectory's completion mixes tokens the model sampled (``loss_mask`` 1: trained, with a real
sampler log-prob and policy version) and tokens a tool or an environment inserted (0: sampler
log-prob and version meaningless, here NaN and -1). Checked against values computed by hand over
the sampled tokens only: the loss and its gradient (garbage in the inserted slots must not leak,
exactly), both normalizations, the entropy, the statistics, the lag and the staleness drop, the
scored-group fields (``loss_mask``, a sample's own ``prompt_ids``), and one real DeepSpeed step on
two gloo ranks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch
from transformers import AutoModelForCausalLM

from pipeline.ledger import LedgerReporter
from stages.learner.config import LearnerConfig
from stages.learner.loss import LossConfig, loss_denominator, policy_loss, summarize
from stages.learner.overlong import OverlongConfig, overlong_penalty
from stages.learner.trainer import Trainer, TrainSample, sample_lags, token_counts
from tests.numerics import (
    adam_first_step_tolerance,
    approx,
    assert_close,
    backward_terms,
    forward_terms,
    tolerance,
)
from tests.stages.learner_setup import join_rank, one_torch_thread, run_ranks, tiny_policy
from tests.stages.tiny_model import make_tiny_model
from transport.message import Message

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(60)]

LOG = math.log
NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


# ---- the loss over a trained-token mask -----------------------------------------------------

# Three sequences. Row 0: sampled, inserted, inserted, sampled; row 1: only inserted tokens;
# row 2: one sampled token (then padding). Inserted and padding slots hold garbage everywhere.
MASK = [[True, False, False, True], [False, False, False, False], [True, False, False, False]]
LOGP = [[LOG(0.5), NAN, -INF, LOG(0.25)], [NAN, INF, -INF, NAN], [-1.0, NAN, NAN, NAN]]
# rho = exp(old - sampler), old = logp: 3 (truncated to C = 2), 0.5; nothing; 1
SAMPLER = [
    [LOG(0.5) - LOG(3.0), NAN, 0.0, LOG(0.25) - LOG(0.5)],
    [0.0, -INF, NAN, INF],
    [-1.0, INF, 0.0, NAN],
]
# ref - logp: log 2 (k3 = 2 - log 2 - 1, d k3/d logp = -1), 0; nothing; 0
REF = [[LOG(0.5) + LOG(2.0), INF, NAN, LOG(0.25)], [NAN, NAN, INF, -INF], [-1.0, NAN, -INF, 0.0]]
ADV = [1.5, -1.0, 2.0]
K3 = 2 - LOG(2.0) - 1


def _masked_loss(normalize: str, denominator: float, *, mask=MASK, logp=LOGP, cols=None):
    def pick(rows):
        t = torch.tensor(rows, dtype=torch.float64)
        return t if cols is None else t[:, cols]

    lp = pick(logp).requires_grad_(True)
    loss, stats = policy_loss(
        lp,
        sampler_logp=pick(SAMPLER),
        old_logp=lp.detach(),
        advantages=torch.tensor(ADV, dtype=torch.float64),
        mask=torch.tensor(mask),
        config=LossConfig(tis_cap=2.0, kl_coef=0.5, normalize=normalize),
        denominator=denominator,
        ref_logp=pick(REF),
    )
    loss.backward()
    return loss.item(), lp.grad, stats


def test_inserted_tokens_with_garbage_give_the_hand_computed_sequence_loss():
    # the denominator counts every sequence, row 1 (nothing sampled) included
    denominator = loss_denominator(torch.tensor(MASK), "sequence")
    assert denominator == 3
    loss, grad, stats = _masked_loss("sequence", denominator)
    # row 0 averages its 2 sampled tokens; row 1 adds exactly 0; row 2: -1 * 2 * (-1)
    row0 = ((-2 * 1.5 * LOG(0.5) + 0.5 * K3) + (-0.5 * 1.5 * LOG(0.25))) / 2
    assert loss == pytest.approx((row0 + 0.0 + 2.0) / 3, rel=1e-12)
    # d/dlogp: -w A (+ kl_coef * (1 - exp(ref - logp))), over the row's sampled tokens, over 3
    expected = torch.tensor(
        [[(-3.0 - 0.5) / 2, 0, 0, -0.75 / 2], [0, 0, 0, 0], [-2.0, 0, 0, 0]], dtype=torch.float64
    )
    torch.testing.assert_close(grad, expected / 3, rtol=1e-12, atol=0)
    assert stats["tokens"].item() == 3 and stats["sequences"].item() == 3
    assert stats["tis_clipped"].item() == 1
    assert stats["kl_ref"].item() == pytest.approx(K3)
    assert stats["w_sum"].item() == pytest.approx(3 + 0.5 + 1)
    assert stats["w_sq_sum"].item() == pytest.approx(9 + 0.25 + 1)
    # mismatch d = sampler - old: -log 3 and log 2 (and 0)
    k3_mismatch = (1 / 3 + LOG(3.0) - 1) + K3
    assert stats["k3_mismatch"].item() == pytest.approx(k3_mismatch)
    metrics = summarize(stats)
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["mismatch_kl"] == pytest.approx(k3_mismatch / 3)
    assert metrics["ess"] == pytest.approx(4.5**2 / (3 * 10.25))


def test_inserted_tokens_with_garbage_give_the_hand_computed_token_loss():
    denominator = loss_denominator(torch.tensor(MASK), "token")
    assert denominator == 3  # sampled tokens only
    loss, grad, _ = _masked_loss("token", denominator)
    total = (-2 * 1.5 * LOG(0.5) + 0.5 * K3) + (-0.5 * 1.5 * LOG(0.25)) + 2.0
    assert loss == pytest.approx(total / 3, rel=1e-12)
    expected = torch.tensor(
        [[-3.5, 0, 0, -0.75], [0, 0, 0, 0], [-2.0, 0, 0, 0]], dtype=torch.float64
    )
    torch.testing.assert_close(grad, expected / 3, rtol=1e-12, atol=0)


@pytest.mark.parametrize("normalize", ["sequence", "token"])
def test_inserted_columns_change_nothing_at_all(normalize):
    """The same rows with the inserted columns cut out: the very same loss, gradient and stats."""
    with_inserted = _masked_loss(normalize, 3.0)
    # rows 0 and 2 keep columns 0 and 3; row 2's column 3 is padding in both
    cut_mask = [[True, True], [False, False], [True, False]]
    cut = _masked_loss(normalize, 3.0, mask=cut_mask, cols=[0, 3])
    assert with_inserted[0] == cut[0]
    assert torch.equal(with_inserted[1][:, [0, 3]], cut[1])
    assert torch.count_nonzero(with_inserted[1][:, [1, 2]]) == 0
    for key, value in cut[2].items():
        assert torch.equal(with_inserted[2][key], value), key


# ---- the trainer's micro-batch: forward over everything, loss over sampled tokens ----------


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """In float64: these tests check which tokens train, not float32 rounding (numerics.py)."""
    return tiny_policy(torch.float64)


def _trainer(model: torch.nn.Module, **loss: Any) -> Trainer:
    """A trainer whose engine is a plain model: enough for one micro-batch's loss."""
    config = LearnerConfig(model="unused", device="cpu", loss=LossConfig(**loss))
    trainer = Trainer(config, structlog.get_logger())
    trainer.engine = model
    return trainer


def _reference(model, prompt, completion):
    """Log-probs and entropies of every completion token, from one unpadded full forward, in
    the model's dtype."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0]
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    token = logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    return token, -(logp.exp() * logp).sum(-1).detach()


def _sample(prompt, completion, sampler, versions, mask=None, advantage=1.0) -> TrainSample:
    return TrainSample(
        prompt_ids=np.array(prompt),
        completion_ids=np.array(completion),
        sampler_logprobs=np.array(sampler, dtype=np.float32),
        versions=np.array(versions),
        advantage=advantage,
        reward=0.0,
        loss_mask=None if mask is None else np.array(mask, dtype=bool),
    )


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _terms(model: torch.nn.Module, *samples: TrainSample) -> tuple[int, int]:
    """The rule's terms for these samples' log-probs and for the model's gradients."""
    positions = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    return (
        forward_terms(model.config, positions),
        backward_terms(model.config, positions, tokens),
    )


def test_a_micro_batch_trains_only_sampled_tokens_with_the_rest_as_context(model):
    prompt = [5, 6, 7]
    completion = [20, 30, 31, 21, 22]  # sampled, a tool's two tokens, sampled, sampled
    mask = [1, 0, 0, 1, 1]
    plain_prompt, plain = [8, 9], [23, 24]
    with torch.no_grad():
        lp, _ = _reference(model, prompt, completion)
        plain_lp, _ = _reference(model, plain_prompt, plain)
    # rho = 3 (truncated to 2), 0.5, 1.2 on the sampled tokens; garbage where inserted
    rhos = {0: 3.0, 3: 0.5, 4: 1.2}
    sampler = [float(lp[j]) - LOG(rhos[j]) if j in rhos else NAN for j in range(5)]
    samples = [
        _sample(prompt, completion, sampler, [2, -1, -1, 3, 3], mask, advantage=0.7),
        _sample(plain_prompt, plain, plain_lp.tolist(), [3, 3], advantage=-1.0),
    ]
    trainer = _trainer(model)
    loss, stats, entropy = trainer._micro_step(samples, [0, 1], 2.0, None, None)
    got = _grads(model, loss)

    lp, ent = _reference(model, prompt, completion)
    plain_lp, plain_ent = _reference(model, plain_prompt, plain)
    # the weights from the sampler log-probs as they travel (float32), in float64
    sampled = lp[[0, 3, 4]]
    sampler_32 = torch.from_numpy(samples[0].sampler_logprobs[[0, 3, 4]]).double()
    rho = (sampled.detach() - sampler_32).exp()
    weights = rho.clamp(max=2.0)
    plain_w = (plain_lp.detach() - torch.from_numpy(samples[1].sampler_logprobs).double()).exp()
    assert rho.tolist() == pytest.approx([3.0, 0.5, 1.2], rel=1e-6)  # float32's rounding
    hand = (-(weights * 0.7 * sampled).mean() + (plain_w * 1.0 * plain_lp).mean()) / 2
    expected = _grads(model, hand)
    logp_terms, grad_terms = _terms(model, *samples)
    assert loss.item() == approx(hand.item(), terms=logp_terms, dtype=torch.float64)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, terms=grad_terms)
    assert stats["tokens"].item() == 5 and stats["tis_clipped"].item() == 1
    w_sum = float(rho.sum() + plain_w.sum())  # the statistic sums rho before truncation
    assert stats["w_sum"].item() == approx(w_sum, terms=logp_terms, dtype=torch.float64)
    # the entropy metric sums over sampled positions only
    ent_sum = float(ent[[0, 3, 4]].sum() + plain_ent.sum())
    assert entropy == approx(ent_sum, terms=logp_terms, dtype=torch.float64)


def test_leading_inserted_tokens_equal_a_longer_prompt(model):
    """Tokens a tool inserted before the first sampled one are exactly a longer context."""
    prompt, tool, answer = [5, 6, 7], [40, 41, 42], [20, 21]
    with torch.no_grad():
        lp, _ = _reference(model, prompt + tool, answer)
    sampler = (lp - 0.3).tolist()
    ref = [lp + 0.2]
    masked = _sample(prompt, tool + answer, [NAN] * 3 + sampler, [-1] * 3 + [0, 0], [0, 0, 0, 1, 1])
    longer = _sample(prompt + tool, answer, sampler, [0, 0])
    garbage = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
    trainer = _trainer(model, kl_coef=0.1)
    loss_a, stats_a, ent_a = trainer._micro_step(
        [masked], [0], 1.0, [torch.cat([garbage, ref[0]])], None
    )
    grads_a = _grads(model, loss_a)
    loss_b, stats_b, ent_b = trainer._micro_step([longer], [0], 1.0, ref, None)
    grads_b = _grads(model, loss_b)
    logp_terms, grad_terms = _terms(model, masked)
    assert math.isfinite(loss_a.item())
    assert loss_a.item() == approx(loss_b.item(), terms=logp_terms, dtype=torch.float64)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert_close(a, b, terms=grad_terms)
    assert ent_a == approx(ent_b, terms=logp_terms, dtype=torch.float64)
    for key in stats_b:
        got, want = stats_a[key].item(), stats_b[key].item()
        assert got == approx(want, terms=logp_terms, dtype=torch.float64), key


def test_a_sample_with_nothing_sampled_adds_zero(model):
    tool_only = _sample([5, 6], [30, 31, 32], [NAN] * 3, [-1] * 3, [0, 0, 0], advantage=5.0)
    trainer = _trainer(model)
    loss, stats, entropy = trainer._micro_step([tool_only], [0], 1.0, None, None)
    assert loss.item() == 0.0 and entropy == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in _grads(model, loss))
    assert stats["tokens"].item() == 0
    assert summarize(stats) == {}


def test_token_counts_and_lags_read_only_sampled_tokens():
    samples = [
        _sample([1], [2, 3, 4, 5], [0.0] * 4, [4, -1, -1, 2], [1, 0, 0, 1]),
        _sample([1], [2, 3], [0.0] * 2, [5, 5]),  # old-shaped: every token sampled
        _sample([1], [2, 3], [0.0] * 2, [-1, -1], [0, 0]),
    ]
    assert token_counts(samples) == (4, 4)  # sampled, inserted
    assert sample_lags(samples, 6).tolist() == [2, 4, 1, 1]
    assert sample_lags([], 6).size == 0
    assert samples[1].sampled.all() and samples[1].sampled_versions.tolist() == [5, 5]


# ---- the stage: scored-group fields and the staleness drop -----------------------------------


class _Inbox:
    def __init__(self) -> None:
        self.acked: list[str] = []

    def ack(self, msg: Message) -> None:
        self.acked.append(msg.data["group_id"])


class _Ctx:
    def __init__(self, run_dir: Path) -> None:
        self.log = structlog.get_logger()
        self.inputs = {"groups": _Inbox()}
        self.replicas, self.replica, self.run_dir, self.stages = 1, 0, run_dir, {}
        self.reports: list[dict[str, Any]] = []
        self.ledger = LedgerReporter(self.reports.append)


def _learner(tmp_path: Path, *, max_lag: int, step: int, **options: Any):
    from stages.learner.stage import Learner

    config = LearnerConfig(model="unused", device="cpu", max_lag=max_lag, **options)
    learner = Learner(config, _Ctx(tmp_path))
    learner.step = step  # the current policy version (publish.every = 1, no offset)
    return learner


def _item(versions, mask=None, prompt=None, reward=0.0) -> dict[str, Any]:
    n = len(versions)
    item: dict[str, Any] = {
        "completion_ids": np.arange(10, 10 + n, dtype=np.int32),
        "sampler_logprobs": np.where(np.array(mask or [1] * n) == 1, -0.5, 0.0).astype(np.float32),
        "versions": np.array(versions, dtype=np.int32),
        "reward": reward,
    }
    if mask is not None:
        item["loss_mask"] = np.array(mask, dtype=np.uint8)
    if prompt is not None:
        item["prompt_ids"] = np.array(prompt, dtype=np.int32)
    return item


def _group(items: list[dict[str, Any]], name: str = "g") -> Message:
    for i, item in enumerate(items):
        item["sample_index"] = i
    data = {"uid": f"f.0:{name}", "group_id": name, "group_size": len(items)}
    return Message("scored_group", {**data, "prompt_ids": np.array([3, 4, 5]), "samples": items})


def test_staleness_reads_only_sampled_versions(tmp_path):
    learner = _learner(tmp_path, max_lag=2, step=6)  # versions below 4 are too old
    msg = _group(
        [
            _item([5, -1, -1, 4], [1, 0, 0, 1]),  # -1 on inserted tokens: not stale
            _item([5, 0], [1, 0]),  # an old version on an inserted token: ignored
            _item([-1, -1], [0, 0]),  # nothing sampled: nothing to be stale
            _item([6, 3, 6]),  # old-shaped, one sampled token too old: dropped
            _item([6, -1, 3], [1, 0, 1]),  # a sampled token too old: dropped
        ]
    )
    kept = learner._samples_of(msg)
    assert [s.index for s in kept] == [0, 1, 2]
    assert learner.counts["stale"] == 2
    stale = [r for r in learner.ctx.reports if r.get("reason") == "stale"]
    assert [row[2] for r in stale for row in r["fates"]] == [3, 4]


def test_scored_group_loss_mask_and_own_prompt_ids(tmp_path):
    learner = _learner(tmp_path, max_lag=4, step=0)
    msg = _group(
        [
            _item([0, 0]),  # old-shaped: the group's prompt, every token sampled
            _item([0, -1, 0], [1, 0, 1], prompt=[7, 8, 9, 10]),
            _item([0, 0], [1, 1], prompt=[11]),  # all ones: the same as no mask
        ]
    )
    a, b, c = learner._samples_of(msg)
    assert a.prompt_ids.tolist() == [3, 4, 5] and a.loss_mask is None
    assert b.prompt_ids.tolist() == [7, 8, 9, 10]
    assert b.loss_mask.tolist() == [True, False, True]
    assert c.prompt_ids.tolist() == [11] and c.loss_mask is None
    assert learner.counts["bad_groups"] == 0


def test_overlong_filter_keeps_truncated_samples_out_of_training(tmp_path):
    learner = _learner(tmp_path, max_lag=1, step=2, overlong=OverlongConfig(filter=True))
    items = [_item([2, 2], reward=r) for r in (1.0, 0.0, 0.0)] + [_item([0, 2], reward=1.0)]
    for item, reason in zip(items, ("stop", "length", "stop", "length"), strict=True):
        item["finish_reason"] = reason
    kept = learner._samples_of(_group(items))
    # advantages over all four (mean 0.5); the truncated one then trains nothing; the stale
    # truncated one is dropped as stale, not counted as filtered
    assert [s.index for s in kept] == [0, 1, 2]
    assert [s.advantage for s in kept] == [0.5, 0.0, -0.5]
    assert kept[1].sampled.tolist() == [False, False] and kept[0].loss_mask is None
    assert learner.counts["overlong_filtered"] == 1 and learner.counts["stale"] == 1
    assert token_counts(kept) == (4, 2)  # its tokens leave normalize: token's count


def test_soft_overlong_punishment_shapes_the_advantages_not_the_reward(tmp_path):
    # L = 4, B = 2: lengths 2 -> 0, 3 -> -0.5 * penalty, 4 -> -1 * penalty, 5 -> -penalty
    shaping = OverlongConfig(max_tokens=4, buffer=2, penalty=0.5)
    assert [overlong_penalty(n, shaping) for n in (2, 3, 4, 5)] == [0.0, -0.25, -0.5, -0.5]
    learner = _learner(tmp_path, max_lag=4, step=0, overlong=shaping)
    # the third sample's inserted token does not count: 3 sampled tokens
    items = [_item([0] * 2, reward=1.0), _item([0] * 5, reward=1.0), _item([0] * 4, [1, 0, 1, 1])]
    kept = learner._samples_of(_group(items))
    shaped = [1.0, 0.5, -0.25]
    mean = sum(shaped) / 3
    assert [s.advantage for s in kept] == pytest.approx([r - mean for r in shaped], abs=1e-12)
    assert [s.reward for s in kept] == [1.0, 1.0, 0.0]
    assert learner.counts["overlong_shaped"] == 2
    with pytest.raises(ValueError, match="buffer"):
        OverlongConfig(max_tokens=4, buffer=5)
    with pytest.raises(ValueError, match=r"needs overlong\.max_tokens"):
        OverlongConfig(buffer=2)


@pytest.mark.parametrize(
    ("item", "why"),
    [
        (dict(loss_mask=np.array([1, 0], dtype=np.uint8)), "loss_mask has 2 entries"),
        (dict(loss_mask=np.array([1, 2, 0], dtype=np.uint8)), "other than 0"),
        (dict(prompt_ids=np.array([], dtype=np.int32)), "prompt_ids is empty"),
    ],
)
def test_malformed_masks_and_prompts_drop_the_group(tmp_path, item, why, capsys):
    learner = _learner(tmp_path, max_lag=4, step=0)
    msg = _group([_item([0, 0, 0]), {**_item([0, 0, 0]), **item}])
    assert learner._samples_of(msg) == []
    assert learner.counts["bad_groups"] == 1
    assert learner.ctx.inputs["groups"].acked == ["g"]
    assert why in capsys.readouterr().out


# ---- one DeepSpeed step on two gloo ranks -------------------------------------------------

LR, EPS = 1e-2, 1.0  # an Adam epsilon above the gradients: a step nearly linear in them


def _ds_samples() -> list[TrainSample]:
    """Six samples: tool output in the middle, at the start, interleaved, only; and plain ones.
    Inserted tokens carry NaN sampler log-probs and version -1; sampled ones versions 1 or 2."""
    rng = np.random.default_rng(3)
    masks = [
        [1, 1, 0, 0, 0, 1, 1],
        None,
        [0, 0, 0],
        [0, 0, 1, 1, 1],
        [1, 0, 1, 0, 1],
        [1, 1, 1],
    ]
    out = []
    for i, mask in enumerate(masks):
        n = len(mask) if mask is not None else 4
        sampled = np.ones(n, dtype=bool) if mask is None else np.array(mask, dtype=bool)
        lp = np.where(sampled, -rng.random(n) * 8, np.nan).astype(np.float32)
        versions = np.where(sampled, rng.integers(1, 3, n), -1)
        out.append(
            TrainSample(
                prompt_ids=rng.integers(3, 60, 3 + i % 3),
                completion_ids=rng.integers(3, 60, n),
                sampler_logprobs=lp,
                versions=versions,
                advantage=float(rng.normal()),
                reward=float(i % 2),
                loss_mask=None if mask is None else sampled,
            )
        )
    return out


def _ds_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_rank(rank, world, port)
    from stages.learner.config import DeepSpeedSection, OptimConfig

    config = LearnerConfig(
        model=model_dir,
        device="cpu",
        batch_size=6,
        train_micro_batch=2,
        forward_micro_batch=2,
        loss=LossConfig(normalize="token"),
        optim=OptimConfig(lr=LR, eps=EPS, grad_clip=0.0),
        deepspeed=DeepSpeedSection(zero_stage=2),
    )
    trainer = Trainer(config, structlog.get_logger())
    trainer.setup()
    mine = _ds_samples()[rank * 3 : rank * 3 + 3]  # rank 0 holds the sample with nothing sampled
    metrics = trainer.step(mine, policy_version=3)
    snap = trainer.snapshot(2**20)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": {k: v.clone() for k, v in snap.items()}}, out)
    trainer.close()


def _hand_step(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The new weights after one AdamW step on the sampled tokens' loss, the gradients, and the
    rule's terms for them; computed in float64 from the float32 checkpoint.

    The first AdamW step moves each weight by ``lr * g / (|g| + eps)`` (bias corrections cancel).
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    samples = _ds_samples()
    total = sum(int(s.sampled.sum()) for s in samples)
    loss = torch.zeros((), dtype=torch.float64)
    for s in samples:
        if not s.sampled.any():
            continue
        lp, _ = _reference(model, s.prompt_ids.tolist(), s.completion_ids.tolist())
        lp = lp[torch.from_numpy(s.sampled)]
        sampler = torch.from_numpy(s.sampler_logprobs[s.sampled]).double()
        w = (lp.detach() - sampler).clamp(-20, 20).exp().clamp(max=2.0)
        loss = loss - (w * s.advantage * lp).sum()
    (loss / total).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    weights = {
        n: (p - LR * grads[n] / (grads[n].abs() + EPS)).detach()
        for n, p in model.named_parameters()
    }
    positions = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    # 2 ranks, micro-batches of 2: 2 accumulations and 1 all-reduce
    return weights, grads, backward_terms(model.config, positions, tokens, micro_batches=3)


@pytest.mark.timeout(240)
def test_deepspeed_step_on_masked_samples_matches_the_sampled_tokens_loss(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=1, hidden=32, layers=2)
    out = tmp_path / "result.pt"
    run_ranks(_ds_rank, 2, str(model_dir), str(out))
    got = torch.load(out, weights_only=False)
    metrics = got["metrics"]

    samples = _ds_samples()
    sampled, inserted = token_counts(samples)
    assert (sampled, inserted) == (17, 10)
    assert metrics["tokens"] == sampled and metrics["inserted_tokens"] == inserted
    assert metrics["samples"] == 6 and metrics["skipped"] == 0
    versions = np.concatenate([s.sampled_versions for s in samples])
    assert metrics["lag_mean"] == pytest.approx(float(np.mean(3 - versions)))
    assert metrics["lag_max"] == 2  # inserted tokens' -1 would make it 4
    assert math.isfinite(metrics["entropy"]) and math.isfinite(metrics["ess"])

    weights, grads, grad_terms = _hand_step(model_dir)
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    params = sum(g.numel() for g in grads.values())
    # the norm: one more sum, of every parameter's square
    assert metrics["grad_norm"] == approx(norm, terms=grad_terms + params)
    assert got["weights"].keys() == weights.keys()
    for name, value in weights.items():
        g_scale, w_scale = float(grads[name].abs().max()), float(value.abs().max())
        atol = adam_first_step_tolerance(LR, EPS, tolerance(grad_terms, g_scale), w_scale)
        assert_close(got["weights"][name], value, atol=atol, msg=name)
