"""What the learner does with samples the token limit cut off (DAPO, Yu et al. 2025, section 3.4).

``OverlongConfig`` is ``stages.<learner>.overlong``. Two independent options:

- ``filter``: a truncated sample (``finish_reason`` ``length``) trains nothing. Its group's
  advantages are computed with it (its reward is what the scorer gave), then its advantage is
  set to 0 and none of its tokens are trained: it leaves the token count that ``normalize:
  token`` divides by and skips the passes (in the ledger as ``no_signal``; counted as
  ``overlong_filtered``).
- Soft overlong punishment (``max_tokens`` > 0): with ``L = max_tokens`` and ``B = buffer``, a
  sample of ``n`` sampled tokens gets, added to its reward before the group's advantages::

      0                          n <= L - B
      (L - B - n) / B * penalty  L - B < n <= L
      -penalty                   n > L

  (the reward the learner reports and counts as solved stays the scorer's). ``n`` counts the
  tokens the model sampled, not those a tool or an environment inserted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OverlongConfig", "overlong_penalty"]


@dataclass
class OverlongConfig:
    filter: bool = field(
        default=False,
        metadata={
            "doc": "truncated samples (finish_reason length) train nothing (DAPO's overlong "
            "filtering): advantage 0, no trained tokens"
        },
    )
    max_tokens: int = field(
        default=0,
        metadata={
            "min": 0,
            "doc": "soft overlong punishment: L, the sampled tokens a sample may have (0: off)",
        },
    )
    buffer: int = field(
        default=0,
        metadata={"min": 0, "doc": "soft overlong punishment: the ramp's length B before L"},
    )
    penalty: float = field(
        default=1.0, metadata={"min": 0.0, "doc": "soft overlong punishment: the most it takes"}
    )

    def __post_init__(self) -> None:
        if self.max_tokens and not 0 < self.buffer <= self.max_tokens:
            raise ValueError(
                f"overlong.buffer must be in [1, max_tokens={self.max_tokens}] when max_tokens "
                f"is set, got {self.buffer}"
            )
        if not self.max_tokens and self.buffer:
            raise ValueError("overlong.buffer needs overlong.max_tokens (the length L)")

    @property
    def shaping(self) -> bool:
        return self.max_tokens > 0


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """The soft overlong punishment (<= 0) of a sample with ``length`` sampled tokens."""
    if not config.shaping:
        return 0.0
    start = config.max_tokens - config.buffer
    if length <= start:
        return 0.0
    if length <= config.max_tokens:
        return (start - length) / config.buffer * config.penalty
    return -config.penalty
