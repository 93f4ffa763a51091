"""How close two floating-point results of the same computation must be: the suite's one rule.

Two computations of one value that differ only in the order of their additions (another CPU's
kernels: ``ATEN_CPU_CAPABILITY=default``, ``avx2``, ``avx512``; another batch shape, padding or
micro-batching) round differently. For a sum of ``n`` terms in a format with machine epsilon
``eps``, each order's error is at most about ``n * eps / 2`` times the sum of the magnitudes
added (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2), so two orders
differ by at most ``n * eps`` times that magnitude. A result built from several reductions in a
row (a model's forward pass) carries each one's error, to first order their sum. Hence the rule:

    |actual - expected| <= terms * eps(dtype) * scale

- ``terms``: the reduction lengths along the longest path to one value, added up
  (``forward_terms`` and ``backward_terms`` count them for a decoder-only transformer);
- ``eps``: the machine epsilon of the less precise of the two sides (``float32``: 2**-23);
- ``scale``: the magnitude of what was added, taken as the largest finite ``|expected|`` of the
  whole tensor: an element near 0 that is the difference of large terms carries their rounding,
  not its own (pass ``scale`` where the inputs are known to be larger, e.g. logits behind
  log-probs).

It is a worst-case bound, met with room on every kernel (typical rounding grows like ``sqrt(n)``),
and far below what a wrong formula changes. Where a test checks logic (a mask, a padding, a
micro-batch split, a formula by hand) rather than float32 arithmetic, it computes in float64 and
the same rule gives tolerances near 1e-13: nothing a CPU does moves a result that far, and any
wrong formula does.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch

__all__ = [
    "adam_first_step_tolerance",
    "approx",
    "assert_close",
    "backward_terms",
    "forward_terms",
    "tolerance",
]


def tolerance(terms: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The rule: ``terms * eps(dtype) * scale``."""
    return float(terms) * torch.finfo(dtype).eps * float(scale)


def forward_terms(config: Any, positions: int) -> int:
    """Reduction lengths along one logit's path through a decoder-only transformer (Llama,
    Qwen2/3, Mistral layout) over ``positions`` tokens, and the log-softmax over the vocabulary.

    Per layer: the input norm, the q/k/v projections (hidden), q/k norms where the model has
    them, attention scores (head_dim), softmax and weighted values (positions), the output
    projection (heads * head_dim), the post-attention norm, gate/up (hidden), down
    (intermediate). Then the final norm, the head (hidden) and the log-softmax (vocab).
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qk_norm = head_dim if config.model_type == "qwen3" else 0
    layer = (
        hidden  # input norm
        + hidden  # q, k, v projections
        + qk_norm
        + head_dim  # scores
        + 2 * positions  # softmax, weighted values
        + heads * head_dim  # output projection
        + hidden  # post-attention norm
        + hidden  # gate, up
        + config.intermediate_size  # down
    )
    return config.num_hidden_layers * layer + 2 * hidden + config.vocab_size


def backward_terms(config: Any, positions: int, tokens: int, micro_batches: int = 1) -> int:
    """A weight gradient's path: the forward's reductions, the same ones transposed on the way
    back, the sum over the ``tokens`` that use the weight, and one addition per accumulated
    micro-batch."""
    return 2 * forward_terms(config, positions) + tokens + micro_batches


def adam_first_step_tolerance(
    lr: float, eps: float, grad_tolerance: float, weight_scale: float
) -> float:
    """How far two float32 first AdamW steps may land apart when their gradients differ by up
    to ``grad_tolerance``: the step ``lr * g / (|g| + eps)`` has slope at most ``lr / eps`` in
    ``g``, and each side rounds ``w - step`` once. A test keeps ``eps`` above its gradients
    (the step then nearly linear in ``g``): a smaller one lets a step's sign flip on a gradient
    near 0 and the bound grows with ``1 / eps``."""
    return lr / eps * grad_tolerance + tolerance(2, weight_scale)


def _dtype(*values: Any) -> torch.dtype:
    """The less precise floating dtype among the tensors in ``values`` (the side whose rounding
    dominates); float32 where none is a floating tensor (lists of an engine's log-probs)."""
    floats = [v.dtype for v in values if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return max(floats or [torch.float32], key=lambda d: torch.finfo(d).eps)


def _scale(expected: torch.Tensor) -> float:
    finite = expected[torch.isfinite(expected)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _record(diff: float, atol: float) -> None:
    """With ``INFLIGHT_NUMERICS_MARGINS=FILE``, append how much of its tolerance a comparison
    used (one JSON line: test, used): how the suite's margins are measured on each CPU."""
    path = os.environ.get("INFLIGHT_NUMERICS_MARGINS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        used = diff / atol if atol > 0 else (0.0 if diff == 0 else math.inf)
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "used": used}) + "\n")


def assert_close(
    actual: torch.Tensor | Sequence[float],
    expected: torch.Tensor | Sequence[float],
    *,
    terms: int = 0,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    msg: str | None = None,
) -> None:
    """``actual`` equals ``expected`` within the rule, elementwise; NaNs and infinities must sit
    in the same places. ``dtype`` defaults to the less precise of the two tensors' (float32 for
    lists); ``atol`` replaces the rule where a test derives its bound from it (say how)."""
    dtype = dtype or _dtype(actual, expected)
    a = torch.as_tensor(actual, dtype=torch.float64)
    b = torch.as_tensor(expected, dtype=torch.float64)
    if atol is None:
        atol = tolerance(terms, _scale(b) if scale is None else scale, dtype)
    if a.shape == b.shape:
        both = torch.isfinite(a) & torch.isfinite(b)
        _record(float((a - b)[both].abs().max()) if both.any() else 0.0, atol)
    torch.testing.assert_close(
        a,
        b,
        rtol=0.0,
        atol=atol,
        equal_nan=True,
        msg=None if msg is None else (lambda report: f"{msg}: {report}"),
    )


class _Approx:
    """``pytest.approx`` that also records its margin (see ``_record``)."""

    def __init__(self, expected: float, atol: float) -> None:
        self.expected, self.atol = expected, atol
        self._inner = pytest.approx(expected, rel=0.0, abs=atol)

    def __eq__(self, actual: object) -> bool:
        if isinstance(actual, int | float) and math.isfinite(actual):
            _record(abs(float(actual) - self.expected), self.atol)
        return self._inner == actual

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._inner)


def approx(
    expected: float,
    *,
    terms: int,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A scalar within the rule, for ``actual == approx(...)`` (``scale`` defaults to
    ``|expected|``)."""
    scale = abs(expected) if scale is None else scale
    return _Approx(expected, tolerance(terms, scale, dtype))
