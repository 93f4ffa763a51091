"""Group-relative advantages: each sample's reward against the other samples of its prompt.

``group_advantages(rewards, group_index)`` takes a flat batch (samples of the same prompt share a
group index; groups may have different sizes, e.g. after the learner dropped stale samples) and
returns one advantage per sample, vectorized with ``index_add_`` (no Python loop over samples or
groups). Baselines: the group mean (default), or leave-one-out (the mean of the *other* samples,
RLOO), optionally divided by the group's reward standard deviation.

``one_group_advantages(rewards)`` is the same for the samples of one prompt, as Python floats:
the learner takes groups one message at a time, and a dozen tensor operations on 4 rewards cost
50 us where this costs 2.

Not here: reward shaping, per-token advantages, whitening across the whole batch.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["group_advantages", "one_group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per sample, ``[N]`` (float32 at least, the rewards' dtype if wider).

    ``mean``: ``A_i = r_i - mean(group)``. ``leave_one_out``: ``A_i = r_i - mean(others)``
    ``= n/(n-1) * (r_i - mean(group))``; a group of one sample has no baseline and gets ``A = 0``.
    ``std_normalize`` divides by ``std(group) + eps`` with the *population* std
    (``unbiased=False``): it is defined for groups of any size (a group of one has std 0, so its
    advantage stays 0), and a group whose rewards are all equal gets 0 rather than 0/0.

    A group whose rewards are all equal gets exactly 0 whatever the rounding of its mean (the
    learner skips the forward and backward passes of samples whose advantage is 0).
    """
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            "rewards and group_index must be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype)
    if r.numel() == 0:
        return r.clone()
    _, dense = torch.unique(group_index, return_inverse=True)
    groups = int(dense.max()) + 1
    zeros = torch.zeros(groups, dtype=dtype, device=r.device)
    count = zeros.clone().index_add_(0, dense, torch.ones_like(r))
    total = zeros.clone().index_add_(0, dense, r)
    centered = r - (total / count)[dense]
    # all equal: exactly 0 (n * x / n need not round back to x)
    low = zeros.clone().scatter_reduce_(0, dense, r, "amin", include_self=False)
    high = zeros.clone().scatter_reduce_(0, dense, r, "amax", include_self=False)
    centered = torch.where((low == high)[dense], torch.zeros_like(r), centered)
    if baseline == "mean":
        adv = centered
    else:
        n = count[dense]
        adv = torch.where(n > 1, centered * n / (n - 1).clamp(min=1), torch.zeros_like(r))
    if std_normalize:
        var = zeros.clone().index_add_(0, dense, centered**2)
        std = (var / count).sqrt()
        adv = adv / (std[dense] + eps)
    return adv


def one_group_advantages(
    rewards: list[float],
    *,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """``group_advantages`` of one group (every sample of one prompt), in float64: within
    float32 rounding of it, and exactly 0 for a group whose rewards are all equal."""
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    n = len(rewards)
    if n == 0 or min(rewards) == max(rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if baseline == "mean":
        adv = centered
    else:
        adv = [c * n / (n - 1) for c in centered] if n > 1 else [0.0] * n
    if std_normalize:
        std = math.sqrt(sum(c * c for c in centered) / n)
        adv = [a / (std + eps) for a in adv]
    return adv
