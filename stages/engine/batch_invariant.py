"""Batch-invariant passes: SGLang's ``--enable-deterministic-inference``, on the engine's own
(Llama-family) passes.

A request's floats must not depend on what else runs beside it. Two things in a batched pass
make them depend on it:

- A matrix product's row is computed otherwise for another number of rows: the CPU's GEMM
  picks its kernel and blocking by the shape, and a row of a 1-row ``F.linear`` is not that
  row of a 2-row one (measured here: up to 5.7e-6 apart in log-probs). Given a fixed number of
  rows, each row's result depends on that row alone, not on the other rows nor on its place
  among them, for some numbers and not others: 32 rows on this machine's default kernels, but
  not on MKL's AVX2 ones (``MKL_CBWR=AVX2``), where 16, 24 and 48 rows are. ``rows_for``
  finds, at start, the first number of rows (of ``CANDIDATES``) that is so for each of the
  model's own products (its weights and biases, on its device, with this machine's kernels),
  and ``linear`` runs a product that many rows at a time, the last chunk padded with zeros.
- Attention over a batch reduces each row's softmax and its weighted sum over the batch's
  columns, masked ones included: how many there are (the longest row's) changes how the sum
  is split. ``LlamaForward`` then attends over each row's own columns alone, the rows of one
  length together (a batched product computes each of its items as it computes one alone).

Elementwise operations and the norms (a reduction within one token's vector) do not depend on
the other rows. What remains is SGLang's own list: the prefix cache is turned off (a prompt
computed on top of a cached prefix splits its products otherwise; SGLang turns its radix cache
off for backends without batch-invariant prefix attention), a row without ``sampling_seed``
draws with seed 42 (SGLang's), and a retracted request's re-prefill computes its tokens in one
pass where they were computed a step at a time. Mixtures of experts (a layer's experts run on
however many tokens were routed to each), latent attention and the models that run on
transformers' passes are refused with the flag.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CANDIDATES", "DEFAULT_SEED", "linear", "rows_for"]

# the numbers of rows tried, in this order: on this CPU 32 rows cost 1.5-2.0x 8 rows' time,
# and 64 rows as two products of 32 cost 1.1-1.5x one of 64 (16: 1.1-1.8x and 1.4-2.2x)
CANDIDATES = (32, 48, 64, 24, 16, 96, 128)
DEFAULT_SEED = 42  # a row's sampling seed when it gives none (SGLang's, in this mode)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rows: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed ``rows`` rows at a time (``x``'s leading dims
    flattened), so that each row's result is what it is alone (``rows`` from ``rows_for``)."""
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    m = flat.shape[0]
    pad = -m % rows
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad, width)))
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in flat.split(rows)])
    return out[:m].reshape(*lead, out.shape[-1])


@torch.no_grad()
def rows_for(products: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """The first of ``CANDIDATES`` for which every product ``(weight, bias)`` gives each
    row the same result at any place among that many rows, beside any others and beside the
    zeros that pad a last chunk (tried with seeded random rows); ValueError if none does."""
    distinct = {
        (tuple(w.shape), w.dtype, w.device, w.stride(), b is None): (w, b) for w, b in products
    }
    gen = torch.Generator().manual_seed(0)
    for rows in CANDIDATES:
        if all(_alike(w, b, rows, gen) for w, b in distinct.values()):
            return rows
    raise ValueError(
        f"no number of rows in {CANDIDATES} gives this machine's matrix products rows that are "
        "what they are alone"
    )


def _alike(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, gen: Any) -> bool:
    width = weight.shape[1]
    x = torch.randn(2 * rows, width, generator=gen).to(weight.device, weight.dtype)
    alone = F.linear(x[:rows], weight, bias)
    for _ in range(3):  # the first rows again, at other places among other rows
        order = torch.randperm(2 * rows, generator=gen)[:rows].to(weight.device)
        mine = order < rows
        if not torch.equal(F.linear(x[order], weight, bias)[mine], alone[order[mine]]):
            return False
    padded = torch.cat((x[:3], x.new_zeros(rows - 3, width)))
    return torch.equal(F.linear(padded, weight, bias)[:3], alone[:3])
