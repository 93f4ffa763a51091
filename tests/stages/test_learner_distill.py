"""On-policy distillation in the learner (``stages/learner/distill.py``): per-token advantages
from scored samples' ``teacher_logprobs``, hand-computed; what ``skip_no_signal`` makes of them;
a group without teacher values dropped and counted (``no_teacher``), malformed ones a bad group;
and the trainer's micro-batch weighing each token by its own advantage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from stages.learner.distill import DistillConfig
from stages.learner.trainer import without_passes
from tests.numerics import approx, assert_close
from tests.stages.test_learner_masks import (  # noqa: F401  (model: a fixture)
    _grads,
    _group,
    _item,
    _learner,
    _reference,
    _sample,
    _terms,
    _trainer,
    model,
)

pytestmark = pytest.mark.timeout(60)


def _taught(item, teacher):
    return {**item, "teacher_logprobs": np.array(teacher, dtype=np.float32)}


def _two(rewards=(1.0, 0.0)):
    """Two samples (sampler log-probs -0.5 on sampled tokens), the second with a tool's token."""
    return [
        _taught(_item([0, 0, 0], reward=rewards[0]), [-0.1, -2.0, -0.5]),
        _taught(_item([0, -1, 0], [1, 0, 1], reward=rewards[1]), [-0.5, -9.0, -1.5]),
    ]


@pytest.mark.parametrize(
    ("options", "first", "second"),
    [
        # A = +-0.5 (rewards 1, 0); A_t = A + 0.5 * (teacher - (-0.5)); inserted: 0
        ({}, [0.7, -0.25, 0.5], [-0.5, 0.0, -1.0]),
        ({"with_reward": False}, [0.2, -0.75, 0.0], [0.0, 0.0, -0.5]),
        ({"clip": 1.0}, [0.7, 0.0, 0.5], [-0.5, 0.0, -1.0]),  # the gap -1.5 clipped to -1
    ],
)
def test_teacher_logprobs_make_each_sampled_tokens_advantage(tmp_path, options, first, second):
    learner = _learner(tmp_path, max_lag=4, step=0, distill=DistillConfig(coef=0.5, **options))
    a, b = learner._samples_of(_group(_two()))
    assert (a.advantage, b.advantage) == (0.5, -0.5)  # the reward's, as without distillation
    assert a.token_advantages.dtype == np.float32
    np.testing.assert_allclose(a.token_advantages, first, rtol=0, atol=1e-7)
    np.testing.assert_allclose(b.token_advantages, second, rtol=0, atol=1e-7)
    assert learner.counts["no_teacher"] == learner.counts["bad_groups"] == 0
    # teacher_kl: sampler - teacher over the sampled tokens, -0.4 + 1.5 + 0 + 0 + 1
    assert learner._distill_metrics() == {"no_teacher": 0, "teacher_kl": pytest.approx(2.1 / 5)}


def test_equal_rewards_keep_their_passes_while_the_teacher_disagrees(tmp_path):
    learner = _learner(tmp_path, max_lag=4, step=0, distill=DistillConfig(coef=1.0))
    config = learner.config
    for s in learner._samples_of(_group(_two(rewards=(1.0, 1.0)))):
        assert s.advantage == 0.0 and s.carries_signal and not without_passes(config, s)
    # the teacher agrees with the sampler on every sampled token: nothing to learn, no passes
    agree = [_taught(_item([0, 0]), [-0.5, -0.5]), _taught(_item([0, 0], [1, 0]), [-0.5, -7.0])]
    for s in learner._samples_of(_group(agree, name="same")):
        assert not s.carries_signal and without_passes(config, s)
    plain = _learner(tmp_path, max_lag=4, step=0)  # distill off: teacher_logprobs are ignored
    assert all(s.token_advantages is None for s in plain._samples_of(_group(_two())))


def test_a_group_lacking_teacher_logprobs_is_dropped_counted_and_logged_once(tmp_path):
    learner = _learner(tmp_path, max_lag=4, step=0, distill=DistillConfig(coef=0.5))
    with capture_logs() as logs:
        for name in ("g1", "g2"):
            first, second = _two()
            del second["teacher_logprobs"]  # the teacher failed for it
            assert learner._samples_of(_group([first, second], name=name)) == []
    assert learner.counts["no_teacher"] == 4 and learner.counts["groups"] == 0
    assert learner.ctx.inputs["groups"].acked == ["g1", "g2"]
    fates = [(r["reason"], [row[2] for row in r["fates"]]) for r in learner.ctx.reports]
    assert fates == [("no_teacher", [0, 1]), ("no_teacher", [0, 1])]
    dropped = [e for e in logs if e["event"] == "group_dropped"]
    assert len(dropped) == 1 and dropped[0]["group_id"] == "g1"
    assert "1 of its 2 samples have no teacher_logprobs" in dropped[0]["reason"]
    # malformed values are a malformed group
    first, second = _two()
    second["teacher_logprobs"] = np.zeros(2, dtype=np.float32)
    assert learner._samples_of(_group([first, second], name="bad")) == []
    assert learner.counts["bad_groups"] == 1


def test_a_micro_batch_weighs_each_token_by_its_own_advantage(model):  # noqa: F811
    prompt, completion, mask = [5, 6, 7], [20, 30, 21, 22], [1, 0, 1, 1]
    plain_prompt, plain = [8, 9], [23, 24]
    with torch.no_grad():  # sampler = learner: rho = 1
        lp, _ = _reference(model, prompt, completion)
        plain_lp, _ = _reference(model, plain_prompt, plain)
    taught = _sample(prompt, completion, lp.tolist(), [0, -1, 0, 0], mask, advantage=0.3)
    taught.token_advantages = np.array([0.5, np.nan, -2.0, 1.25], dtype=np.float32)
    samples = [taught, _sample(plain_prompt, plain, plain_lp.tolist(), [0, 0], advantage=-1.0)]
    loss, stats, _ = _trainer(model)._micro_step(samples, [0, 1], 2.0, None, None)
    got = _grads(model, loss)

    lp, _ = _reference(model, prompt, completion)
    plain_lp, _ = _reference(model, plain_prompt, plain)
    adv = torch.tensor([0.5, -2.0, 1.25], dtype=torch.float64)
    # the TIS weights of the sampler log-probs as they travel (float32): 1 within rounding
    rho = (lp.detach() - torch.from_numpy(taught.sampler_logprobs).double()).exp()[[0, 2, 3]]
    plain_rho = (plain_lp.detach() - torch.from_numpy(samples[1].sampler_logprobs).double()).exp()
    hand = (-(rho * adv * lp[[0, 2, 3]]).mean() + (plain_rho * plain_lp).mean()) / 2
    logp_terms, grad_terms = _terms(model, *samples)
    assert loss.item() == approx(hand.item(), terms=logp_terms, dtype=torch.float64)
    for a, b in zip(got, _grads(model, hand), strict=True):
        assert_close(a, b, terms=grad_terms)
    assert stats["tokens"].item() == 5


def test_distilling_without_a_teacher_upstream_is_a_config_error():
    from pipeline.config import load_pipeline
    from pipeline.config.errors import ConfigError
    from pipeline.registry import resolve

    config = Path(__file__).resolve().parents[2] / "configs" / "distill.yaml"
    with pytest.raises(ConfigError, match=r"distill\.yaml:\d+: stages\.learner\.distill\.coef"):
        load_pipeline(config, ["~stages.scorer.teacher"], resolve=lambda n: resolve("stage", n))
    with pytest.raises(ConfigError, match="a teacher has exactly one of url"):
        load_pipeline(
            config,
            ["stages.scorer.teacher.url=http://127.0.0.1:9"],
            resolve=lambda n: resolve("stage", n),
        )
