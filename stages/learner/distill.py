"""On-policy distillation in the learner: per-token advantages from a teacher's log-probs.

``DistillConfig`` is ``stages.<learner>.distill``. With ``coef > 0`` each token ``t`` the model
sampled gets its own advantage::

    A_t = A + coef * (teacher_t - sampler_t)        with_reward: true (the default)
    A_t =     coef * (teacher_t - sampler_t)        with_reward: false (distillation alone)

``A`` is the sample's group advantage from its reward (``advantage``, ``overlong`` as without
distillation), ``teacher_t`` the teacher's log-prob of the token given everything before it
(the scorer's ``teacher_logprobs``, ``stages/scorer/teacher.py``), ``sampler_t`` the sampler's.
``teacher_t - sampler_t`` is minus the one-sample estimate of the per-token reverse KL,
``log pi_student - log pi_teacher``, on the student's own sample: tokens the teacher finds
likelier than the student did are pushed up, the others down. Each token has its own term,
nothing summed over the tokens after it (a discount of 0), as in Thinking Machines' "On-policy
distillation" (2025) and Tinker's cookbook (``advantages = -(sampled_logprobs -
teacher_logprobs)``). ``clip`` bounds ``|teacher_t - sampler_t|`` (off by default). Tokens a tool
or an environment inserted get 0 (they are not trained). The loss then weighs each trained
token by its own advantage, every other rule unchanged (TIS, clipping, normalization).

A sample without ``teacher_logprobs`` (the teacher failed for it, or no scorer asked one) cannot
be distilled: the learner drops its whole group (ledger fate and count ``no_teacher``; the first
drop is logged) rather than train it on the reward alone.

The sampler's log-probs are at the sampling temperature and the teacher's at 1 (an engine's
prefill-only scoring reads raw logits): sample at temperature 1 when distilling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["DistillConfig", "token_advantages"]


@dataclass
class DistillConfig:
    coef: float = field(
        default=0.0,
        metadata={
            "min": 0.0,
            "doc": "weight of the teacher's per-token term, teacher_logprob - sampler_logprob "
            "(minus the reverse KL to the teacher), in each sampled token's advantage; 0: off. "
            "Needs a scorer with a teacher upstream",
        },
    )
    with_reward: bool = field(
        default=True,
        metadata={
            "doc": "add the term to the group advantage of the reward (false: distillation "
            "alone; the rewards are still reported)"
        },
    )
    clip: float | None = field(
        default=None,
        metadata={"min": 0.0, "doc": "bound |teacher_logprob - sampler_logprob| to this (off)"},
    )

    @property
    def on(self) -> bool:
        return self.coef > 0


def token_advantages(
    advantage: float,
    teacher: np.ndarray,
    sampler: np.ndarray,
    sampled: np.ndarray | None,
    config: DistillConfig,
) -> np.ndarray:
    """Each completion token's advantage (float32): see the module's docstring. ``sampled``:
    the trained tokens (None: all); the others get 0."""
    gap = np.asarray(teacher, dtype=np.float64) - np.asarray(sampler, dtype=np.float64)
    if config.clip is not None:
        gap = np.clip(gap, -config.clip, config.clip)
    out = config.coef * gap + (advantage if config.with_reward else 0.0)
    if sampled is not None:
        out = np.where(sampled, out, 0.0)
    return out.astype(np.float32)
