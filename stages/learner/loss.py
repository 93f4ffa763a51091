"""The learner's per-token policy-gradient loss with truncated importance sampling (TIS).

Per completion token, with ``rho = exp(old_logp - sampler_logp)`` (detached; ``old_logp`` is the
learner's log-prob before this optimizer step), ``w = min(rho, C)`` and ``A`` the sequence's
advantage (or the token's own, on-policy distillation: ``distill.py``), by ``objective``::

    pg     term = -w * A * logp                                                    (default)
    ppo    term = -w * min(r * A, clip(r, 1 - lo, 1 + hi) * A),  r = exp(logp - old_logp)
    gspo   the same with r = s_i * exp(logp - sg(logp)),  s_i = exp(mean_t(logp - old_logp))
    cispo  term = -w * sg(clip(r, 1 - lo, 1 + hi)) * A * logp
           + kl_coef * (exp(ref - logp) - (ref - logp) - 1)            (kl_coef > 0; k3 estimator)

``lo``/``hi`` are ``clip_low``/``clip_high`` (DAPO's clip-higher: ``hi > lo``). PPO (Schulman et
al. 2017) clips each token's ratio; GSPO (Zheng et al. 2025) the sequence's, the geometric mean
of its tokens' ratios over the trained tokens, in its GSPO-token form (the value ``s_i`` at every
token, the gradient ``s_i`` times the token's); CISPO (MiniMax-M1, 2025) clips the ratio as a
detached weight on the log-prob, so no token loses its gradient. The TIS weight corrects for the
sampler/learner mismatch (sampler -> old policy) and the clipped ratio for the epochs already
taken on the batch (old -> current); at ``r = 1`` (a batch's first epoch) all four give the same
gradient. With ``ratio_base: sampler`` the ratio is taken to the sampler's log-probs instead
(``r = exp(logp - sampler_logp)``, PipelineRL's choice, clipping from the first epoch on) and
``w = 1``: the ratio itself corrects for the mismatch. MIS drops tokens whose ``rho`` lies
outside ``[mis_low, mis_high]`` from the policy term (they still count in the length a sequence
is averaged over, and in the KL term).

Normalization (``normalize``): ``sequence`` averages each sequence over its trained tokens, then
over the step's sequences; ``token`` sums over the step's trained tokens and divides by their
number (DAPO); ``fixed`` divides each sequence's sum by ``fixed_length`` and averages over the
step's sequences, and ``none`` the same without the constant (Dr. GRPO, Liu et al. 2025: no
length bias).

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

import torch

from stages.learner.loss_config import LossConfig

__all__ = [
    "LossConfig",
    "loss_denominator",
    "policy_loss",
    "stat_keys",
    "step_denominator",
    "summarize",
]

# exp() arguments are clamped to this range: ratios beyond e^20 are noise, and float32 stays finite
# even for their squares (ESS).
_MAX_LOG_RATIO = 20.0


def loss_denominator(lengths: Sequence[int] | torch.Tensor, config: LossConfig | str) -> float:
    """What to pass as ``policy_loss(denominator=...)`` for one optimizer step.

    ``lengths``: the trained (sampled) token counts of *every* sample of the step (all
    micro-batches; all ranks when the gradient is summed over ranks), or a mask of trained
    tokens ``[B, T]``. ``config`` (or its ``normalize``): ``sequence`` and ``none`` -> the
    number of samples, those with no trained token included (they add 0 to the loss, like a
    sample with a zero advantage, and the step's scale stays that of its batch size); ``fixed``
    -> the number of samples times ``fixed_length``; ``token`` -> the number of trained tokens.
    Never below 1, so a step without tokens gives a zero loss rather than NaN.
    """
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.sum(-1) if lengths.dim() == 2 else lengths
        lengths = [int(n) for n in lengths.reshape(-1).tolist()]
    return step_denominator(len(lengths), sum(int(n) for n in lengths), config)


def step_denominator(sequences: float, tokens: float, config: LossConfig | str) -> float:
    """``loss_denominator`` from a step's counts: its samples and its trained tokens (summed
    over micro-batches and ranks)."""
    normalize = config if isinstance(config, str) else config.normalize
    if normalize in ("sequence", "none"):
        return float(max(sequences, 1))
    if normalize == "fixed":
        if isinstance(config, str):
            raise ValueError("normalize 'fixed' needs the LossConfig (its fixed_length)")
        return float(max(sequences * config.fixed_length, 1))
    if normalize == "token":
        return float(max(tokens, 1))
    raise ValueError(f"normalize must be sequence, token, fixed or none, got {normalize!r}")


def _policy_term(
    lp: torch.Tensor,
    old: torch.Tensor,
    sampler: torch.Tensor,
    rho: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's policy term (before masking) under ``config.objective``, and which tokens
    are clipped (None for ``pg``). See the module's docstring for the formulas."""
    if config.objective == "pg":
        return -rho.clamp(max=config.tis_cap) * adv * lp, None
    if config.ratio_base == "old":
        base, w = old, rho.clamp(max=config.tis_cap)
    else:  # the ratio to the sampler corrects for the mismatch itself
        base, w = sampler, torch.ones_like(rho)
    low, high = 1 - config.clip_low, 1 + config.clip_high
    log_ratio = lp - base
    if config.objective == "gspo":
        # s_i = exp(mean over the sequence's trained tokens of log_ratio); per token
        # sg(s_i) * exp(lp - sg(lp)): the value s_i, the gradient s_i * d lp (GSPO-token)
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        seq = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / lengths
        s = seq.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        ratio = s * (lp - lp.detach()).exp()
    else:
        ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    if config.objective == "cispo":
        weight = ratio.detach().clamp(low, high)
        with torch.no_grad():
            clipped = (ratio < low) | (ratio > high)
        return -w * weight * adv * lp, clipped
    policy = -w * torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    return policy, clipped


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
    single-epoch training pass ``old_logp=logp.detach()``. ``advantages`` ``[B]`` (one per
    sequence) or ``[B, T]`` (one per token: on-policy distillation; masked slots may hold
    anything). ``mask``
    ``[B, T]`` (bool or 0/1): the trained tokens, i.e. real completion tokens that the model
    sampled (False for padding and for tool-inserted tokens). ``denominator``: see
    ``loss_denominator``. With ``normalize: sequence`` each sequence is averaged over its
    trained tokens; one without any adds exactly 0.

    Stats: ``tokens`` (trained), ``sequences``, ``tis_clipped`` (trained tokens with rho > C),
    ``mis_dropped``, ``k3_mismatch`` (sum of ``exp(d) - d - 1``, ``d = sampler_logp -
    old_logp``), ``w_sum`` and ``w_sq_sum`` (sums of rho and rho^2, for the ESS),
    ``clipped`` (kept tokens whose ratio is clipped: the clipped branch active for ppo and gspo,
    the weight clipped for cispo; with those objectives),
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
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be [{shape[0]}] or [{shape[0]}, {shape[1]}], got "
            f"{tuple(advantages.shape)}"
        )

    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def clean(t: torch.Tensor) -> torch.Tensor:  # garbage in masked slots never reaches math
        return torch.where(mask, t.to(dtype), zero)

    lp = clean(logp)
    old = clean(old_logp.detach())
    sampler = clean(sampler_logp.detach())
    adv = advantages.detach()
    adv = adv.to(dtype)[:, None] if adv.dim() == 1 else clean(adv)

    log_rho = (old - sampler).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = log_rho.exp()
    keep = mask
    if config.mis_low is not None and config.mis_high is not None:
        keep = mask & (rho >= config.mis_low) & (rho <= config.mis_high)
    policy, clipped = _policy_term(lp, old, sampler, rho, adv, mask, config)
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
    else:  # token, fixed, none: a plain sum (loss_denominator holds the rest)
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
            stats["clipped"] = (keep & clipped).sum().to(f64)
        if kl is not None:
            stats["kl_ref"] = kl.detach().to(f64).sum()
    return loss, stats


def stat_keys(config: LossConfig, *, with_ref: bool) -> list[str]:
    """The keys of ``policy_loss``'s stats under ``config`` (``with_ref``: given ``ref_logp``),
    the same on every rank whatever its samples: what ranks sum together."""
    keys = ["tokens", "sequences", "tis_clipped", "mis_dropped", "k3_mismatch", "w_sum", "w_sq_sum"]
    if config.clipped_objective:
        keys.append("clipped")
    if with_ref:
        keys.append("kl_ref")
    return keys


def summarize(stats: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics from summed ``policy_loss`` stats: per-token fractions and means, and the ESS.

    ``ess = (sum rho)^2 / (tokens * sum rho^2)`` in ``(0, 1]`` (1 = on-policy). Empty when no
    token was seen; ``clip_frac`` and ``kl_ref`` only when their sums are present.
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
    if "clipped" in stats:
        out["clip_frac"] = float(stats["clipped"]) / tokens
    if "kl_ref" in stats:
        out["kl_ref"] = float(stats["kl_ref"]) / tokens
    return out
