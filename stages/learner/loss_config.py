"""The loss's options (``LossConfig``): what ``loss.py`` computes, checked before anything runs.

Apart from ``loss.py`` so that validating a config (``inflight validate``, the supervisor) does not
import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CLIP_DEFAULTS", "LossConfig"]

# (clip_low, clip_high) when an objective is chosen without them: PPO's usual 0.2; GSPO's paper
# (sequence-level ratios move far less than token ones: 3e-4 and 4e-4); CISPO as MiniMax-M1 ran it
# (no lower bound on the weight, only the upper one tuned; 0.28 as DAPO's clip-higher).
CLIP_DEFAULTS = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


@dataclass
class LossConfig:
    objective: Literal["pg", "ppo", "gspo", "cispo"] = field(
        default="pg",
        metadata={
            "doc": "pg: policy gradient weighted by TIS; ppo: clipped ratio (DAPO with clip_high "
            "> clip_low); gspo: clipped sequence-level ratio; cispo: clipped, detached ratio as "
            "the weight of the log-prob"
        },
    )
    ratio_base: Literal["old", "sampler"] = field(
        default="old",
        metadata={
            "doc": "the ratio that ppo/gspo/cispo clip: current over 'old' (the learner before "
            "this batch; TIS weighs sampler -> old; 1 on a batch's first epoch) or over "
            "'sampler' (the engine's log-probs, as PipelineRL does; no TIS weight on top)"
        },
    )
    clip_low: float | None = field(
        default=None,
        metadata={
            "min": 0.0,
            "doc": "ratios below 1 - clip_low are clipped (default by objective)",
        },
    )
    clip_high: float | None = field(
        default=None,
        metadata={
            "min": 0.0,
            "doc": "ratios above 1 + clip_high are clipped (default by objective)",
        },
    )
    tis_cap: float = field(
        default=2.0,
        metadata={"doc": "C in min(rho, C), rho = exp(old_logp - sampler_logp); .inf = no cap"},
    )
    mis_low: float | None = field(
        default=None,
        metadata={"min": 0.0, "doc": "MIS: drop tokens whose rho is below this (with mis_high)"},
    )
    mis_high: float | None = field(
        default=None,
        metadata={"min": 0.0, "doc": "MIS: drop tokens whose rho is above this (with mis_low)"},
    )
    ppo_clip: float | None = field(
        default=None,
        metadata={
            "min": 0.0,
            "doc": "shorthand for objective ppo with clip_low = clip_high = this",
        },
    )
    normalize: Literal["sequence", "token", "fixed", "none"] = field(
        default="sequence",
        metadata={
            "doc": "'sequence': mean over each sequence's tokens, divided by the step's "
            "sequences; 'token': divided by the step's tokens; 'fixed': each sequence's sum "
            "divided by fixed_length, then by the step's sequences (Dr. GRPO); 'none': each "
            "sequence's sum, divided by the step's sequences"
        },
    )
    fixed_length: int = field(
        default=0,
        metadata={"min": 0, "doc": "normalize: fixed: the constant length (e.g. max_new_tokens)"},
    )
    kl_coef: float = field(
        default=0.0,
        metadata={"min": 0.0, "doc": "weight of the KL to the reference model (k3); 0 = off"},
    )

    def __post_init__(self) -> None:
        issues = []
        if not self.tis_cap > 0:
            issues.append(f"tis_cap must be > 0, got {self.tis_cap}")
        if (self.mis_low is None) != (self.mis_high is None):
            issues.append("give both mis_low and mis_high (MIS on) or neither (MIS off)")
        elif self.mis_low is not None and self.mis_high is not None:
            if self.mis_low < 0:
                issues.append(f"mis_low must be >= 0, got {self.mis_low}")
            if not self.mis_low < self.mis_high:
                issues.append(
                    f"mis_low must be < mis_high, got mis_low={self.mis_low}, "
                    f"mis_high={self.mis_high}"
                )
        if self.objective not in ("pg", "ppo", "gspo", "cispo"):
            issues.append(f"objective must be pg, ppo, gspo or cispo, got {self.objective!r}")
        elif self.ppo_clip is not None:
            if not 0 < self.ppo_clip < 1:
                issues.append(f"ppo_clip must be in (0, 1), got {self.ppo_clip}")
            elif self.objective not in ("pg", "ppo"):
                issues.append(
                    f"ppo_clip is objective ppo's symmetric clip; objective {self.objective} "
                    "takes clip_low and clip_high"
                )
            else:
                self.objective = "ppo"
                for name in ("clip_low", "clip_high"):
                    given = getattr(self, name)
                    if given is None:
                        setattr(self, name, self.ppo_clip)
                    elif given != self.ppo_clip:
                        issues.append(
                            f"ppo_clip={self.ppo_clip} and {name}={given} disagree: give one"
                        )
        if self.objective == "pg":
            for name in ("clip_low", "clip_high"):
                if getattr(self, name) is not None:
                    issues.append(f"{name} needs objective ppo, gspo or cispo (objective is pg)")
            if self.ratio_base != "old":
                issues.append("ratio_base needs objective ppo, gspo or cispo (objective is pg)")
        elif self.objective in CLIP_DEFAULTS:
            low, high = CLIP_DEFAULTS[self.objective]
            self.clip_low = low if self.clip_low is None else self.clip_low
            self.clip_high = high if self.clip_high is None else self.clip_high
            # cispo's weight may go down to 0 (clip_low = 1: no lower bound); ratios stay >= 0
            top = 1.0 if self.objective == "cispo" else 1.0 - 1e-12
            if not 0 < self.clip_low <= top:
                bound = "(0, 1]" if self.objective == "cispo" else "(0, 1)"
                issues.append(f"clip_low must be in {bound}, got {self.clip_low}")
            if not (self.clip_high > 0 and math.isfinite(self.clip_high)):
                issues.append(f"clip_high must be > 0 and finite, got {self.clip_high}")
        if self.ratio_base not in ("old", "sampler"):
            issues.append(f"ratio_base must be 'old' or 'sampler', got {self.ratio_base!r}")
        if self.normalize not in ("sequence", "token", "fixed", "none"):
            issues.append(
                f"normalize must be 'sequence', 'token', 'fixed' or 'none', got {self.normalize!r}"
            )
        elif self.normalize == "fixed" and self.fixed_length < 1:
            issues.append("normalize: fixed needs fixed_length >= 1 (e.g. the max_new_tokens)")
        elif self.normalize != "fixed" and self.fixed_length:
            issues.append(f"fixed_length needs normalize: fixed (normalize is {self.normalize})")
        if not self.kl_coef >= 0:
            issues.append(f"kl_coef must be >= 0, got {self.kl_coef}")
        if issues:
            raise ValueError("; ".join(issues))

    @property
    def clipped_objective(self) -> bool:
        """ppo, gspo or cispo: a ratio is clipped, so a batch may be trained several epochs."""
        return self.objective != "pg"
