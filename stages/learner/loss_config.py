"""The loss's options (``LossConfig``): what ``loss.py`` computes, checked before anything runs.

Apart from ``loss.py`` so that validating a config (``inflight validate``, the supervisor) does not
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["LossConfig"]


@dataclass
class LossConfig:
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
        metadata={"min": 0.0, "doc": "PPO-clip epsilon, for batches reused over several epochs"},
    )
    normalize: Literal["sequence", "token"] = field(
        default="sequence",
        metadata={
            "doc": "'sequence': mean over each sequence's tokens, divided by the step's "
            "sequences; 'token': divided by the step's tokens"
        },
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
        if self.ppo_clip is not None and not 0 < self.ppo_clip < 1:
            issues.append(f"ppo_clip must be in (0, 1), got {self.ppo_clip}")
        if self.normalize not in ("sequence", "token"):
            issues.append(f"normalize must be 'sequence' or 'token', got {self.normalize!r}")
        if not self.kl_coef >= 0:
            issues.append(f"kl_coef must be >= 0, got {self.kl_coef}")
        if issues:
            raise ValueError("; ".join(issues))
