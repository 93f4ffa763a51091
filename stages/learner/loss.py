"""The learner's per-token policy-gradient loss with truncated importance sampling (TIS).

Per completion token, with ``rho = exp(old_logp - sampler_logp)`` (detached; ``old_logp`` is the
learner's log-prob before this optimizer step) and ``w = min(rho, C)``::

    term = -w * A * logp                                             (default)
    term = -w * min(r * A, clip(r, 1 - eps, 1 + eps) * A),  r = exp(logp - old_logp)  (ppo_clip)
         + kl_coef * (exp(ref - logp) - (ref - logp) - 1)            (kl_coef > 0; k3 estimator)

With PPO-clip the TIS weight corrects for the sampler/learner mismatch (sampler -> old policy)
and the clipped ratio for the epochs already taken on the batch (old -> current); at ``r = 1``
(the first epoch) its gradient equals the default term's. MIS drops tokens whose ``rho`` lies
outside ``[mis_low, mis_high]`` from the policy term (they still count in the length a sequence
is averaged over, and in the KL term).

The loss is a *sum* over the micro-batch divided by a step-wide ``denominator``
(``loss_denominator``), so the losses of the micro-batches of an optimizer step add up to the
full-batch loss whatever the micro-batch sizes: gradient accumulation gives the same gradient.
Statistics come back as detached float64 *sums* (add them over micro-batches and ranks, then
``summarize``). Masked positions may hold anything, NaN and inf included: they are replaced
before any arithmetic, so they reach neither the loss, the gradient nor the statistics. The mask
is that of the *trained* tokens: padding is masked, and so are the tokens of a multi-turn
trajectory that a tool or an environment inserted (their sampler log-prob and version mean
nothing); "tokens" and "length" below always mean trained tokens.

Not here: advantages (``advantages.py``), forward passes and padding (``batching.py``), the
optimizer, distributed reduction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from stages.learner.loss_config import LossConfig

__all__ = ["LossConfig", "loss_denominator", "policy_loss", "stat_keys", "summarize"]

# exp() arguments are clamped to this range: ratios beyond e^20 are noise, and float32 stays finite
# even for their squares (ESS).
_MAX_LOG_RATIO = 20.0


def loss_denominator(
    lengths: Sequence[int] | torch.Tensor, normalize: Literal["sequence", "token"]
) -> float:
    """What to pass as ``policy_loss(denominator=...)`` for one optimizer step.

    ``lengths``: the trained (sampled) token counts of *every* sample of the step (all
    micro-batches; all ranks when the gradient is summed over ranks), or a mask of trained
    tokens ``[B, T]``. ``sequence`` -> the number of samples, those with no trained token
    included (they add 0 to the loss, like a sample with a zero advantage, and the step's scale
    stays that of its batch size); ``token`` -> the number of trained tokens. Never below 1, so a
    step without tokens gives a zero loss rather than NaN.
    """
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.sum(-1) if lengths.dim() == 2 else lengths
        lengths = [int(n) for n in lengths.reshape(-1).tolist()]
    if normalize == "sequence":
        return float(max(len(lengths), 1))
    if normalize == "token":
        return float(max(sum(int(n) for n in lengths), 1))
    raise ValueError(f"normalize must be 'sequence' or 'token', got {normalize!r}")


def policy_loss(
    logp: torch.Tensor,
    *,
    sampler_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    denominator: float | torch.Tensor,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss, and its statistics (detached float64 sums).

    ``logp`` ``[B, T]``: the learner's log-probs of the completion tokens, with grad.
    ``sampler_logp``, ``old_logp`` (and ``ref_logp``) ``[B, T]``: treated as constants; for
    single-epoch training pass ``old_logp=logp.detach()``. ``advantages`` ``[B]``. ``mask``
    ``[B, T]`` (bool or 0/1): the trained tokens, i.e. real completion tokens that the model
    sampled (False for padding and for tool-inserted tokens). ``denominator``: see
    ``loss_denominator``. With ``normalize: sequence`` each sequence is averaged over its
    trained tokens; one without any adds exactly 0.

    Stats: ``tokens`` (trained), ``sequences``, ``tis_clipped`` (trained tokens with rho > C),
    ``mis_dropped``, ``k3_mismatch`` (sum of ``exp(d) - d - 1``, ``d = sampler_logp -
    old_logp``), ``w_sum`` and ``w_sq_sum`` (sums of rho and rho^2, for the ESS),
    ``ppo_clipped`` (kept tokens whose clipped branch is the active one; with ``ppo_clip``),
    ``kl_ref`` (sum of the k3 KL to the reference; with ``ref_logp``).
    """
    shape = logp.shape
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, tokens], got {tuple(shape)}")
    others = {"sampler_logp": sampler_logp, "old_logp": old_logp, "mask": mask}
    if ref_logp is not None:
        others["ref_logp"] = ref_logp
    for name, t in others.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(shape)}")
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp (the reference log-probs)")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [{shape[0]}], got {tuple(advantages.shape)}")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def clean(t: torch.Tensor) -> torch.Tensor:  # garbage in masked slots never reaches math
        return torch.where(mask, t.to(dtype), zero)

    lp = clean(logp)
    old = clean(old_logp.detach())
    sampler = clean(sampler_logp.detach())
    adv = advantages.detach().to(dtype)[:, None]

    log_rho = (old - sampler).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = log_rho.exp()
    w = rho.clamp(max=config.tis_cap)
    keep = mask
    if config.mis_low is not None and config.mis_high is not None:
        keep = mask & (rho >= config.mis_low) & (rho <= config.mis_high)

    if config.ppo_clip is None:
        policy = -w * adv * lp
        clipped = None
    else:
        eps = config.ppo_clip
        ratio = (lp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        policy = -w * torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        with torch.no_grad():
            clipped = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
    term = torch.where(keep, policy, zero)

    kl = None
    if ref_logp is not None:
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.kl_coef > 0):
            d = (clean(ref_logp.detach()) - lp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            kl = torch.where(mask, d.exp() - d - 1, zero)
        if config.kl_coef > 0:
            term = term + config.kl_coef * kl

    if config.normalize == "sequence":
        lengths = mask.sum(-1).clamp(min=1).to(dtype)  # no trained token: 0 / 1, not 0 / 0
        total = (term.sum(-1) / lengths).sum()
    else:
        total = term.sum()
    loss = total / denominator

    with torch.no_grad():
        f64 = torch.float64
        delta = (sampler - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).to(f64)
        rho64 = log_rho.to(f64).exp()
        stats = {
            "tokens": mask.sum().to(f64),
            "sequences": torch.tensor(float(shape[0]), dtype=f64, device=logp.device),
            "tis_clipped": (mask & (rho > config.tis_cap)).sum().to(f64),
            "mis_dropped": (mask & ~keep).sum().to(f64),
            "k3_mismatch": torch.where(mask, delta.exp() - delta - 1, 0.0).sum(),
            "w_sum": torch.where(mask, rho64, 0.0).sum(),
            "w_sq_sum": torch.where(mask, rho64**2, 0.0).sum(),
        }
        if clipped is not None:
            stats["ppo_clipped"] = (keep & clipped).sum().to(f64)
        if kl is not None:
            stats["kl_ref"] = kl.detach().to(f64).sum()
    return loss, stats


def stat_keys(config: LossConfig, *, with_ref: bool) -> list[str]:
    """The keys of ``policy_loss``'s stats under ``config`` (``with_ref``: given ``ref_logp``),
    the same on every rank whatever its samples: what ranks sum together."""
    keys = ["tokens", "sequences", "tis_clipped", "mis_dropped", "k3_mismatch", "w_sum", "w_sq_sum"]
    if config.ppo_clip is not None:
        keys.append("ppo_clipped")
    if with_ref:
        keys.append("kl_ref")
    return keys


def summarize(stats: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics from summed ``policy_loss`` stats: per-token fractions and means, and the ESS.

    ``ess = (sum rho)^2 / (tokens * sum rho^2)`` in ``(0, 1]`` (1 = on-policy). Empty when no
    token was seen; ``ppo_clip_frac`` and ``kl_ref`` only when their sums are present.
    """
    tokens = float(stats["tokens"])
    if tokens <= 0:
        return {}
    w_sum, w_sq_sum = float(stats["w_sum"]), float(stats["w_sq_sum"])
    out = {
        "tis_clip_frac": float(stats["tis_clipped"]) / tokens,
        "mis_drop_frac": float(stats["mis_dropped"]) / tokens,
        "mismatch_kl": float(stats["k3_mismatch"]) / tokens,
        "ess": w_sum**2 / (tokens * w_sq_sum) if w_sq_sum > 0 else math.nan,
    }
    if "ppo_clipped" in stats:
        out["ppo_clip_frac"] = float(stats["ppo_clipped"]) / tokens
    if "kl_ref" in stats:
        out["kl_ref"] = float(stats["kl_ref"]) / tokens
    return out
