"""Batch-invariant passes: SGLang's ``--enable-deterministic-inference``, on the engine's own
(Llama-family) passes.

A request's floats must not depend on what else runs beside it. Two things in a batched pass
make them depend on it:

- A matrix product's row is computed otherwise for another number of rows: the CPU's GEMM
  picks its kernel and blocking by the shape, and a row of a 1-row ``F.linear`` is not that
  row of a 2-row one (measured here: up to 5.7e-6 apart in log-probs). Given exactly ``ROWS``
  rows, each row's result depends on that row alone: not on the other rows nor on its place
  among them (checked for 16, 32 and 64 rows, widths 64 to 32000). ``linear`` runs a product
  over any number of rows ``ROWS`` at a time, the last chunk padded with zeros.
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

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_SEED", "ROWS", "linear"]

# the rows of every product: 32 rows cost 1.5-2.0x 8 rows' time on the CPU, and 64 rows
# as two products of 32 cost 1.1-1.5x one of 64 (16: 1.1-1.8x and 1.4-2.2x)
ROWS = 32
DEFAULT_SEED = 42  # a row's sampling seed when it gives none (SGLang's, in this mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed ``ROWS`` rows at a time (``x``'s leading dims
    flattened), so that each row's result is what it is alone."""
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    m = flat.shape[0]
    pad = -m % ROWS
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad, width)))
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in flat.split(ROWS)])
    return out[:m].reshape(*lead, out.shape[-1])
