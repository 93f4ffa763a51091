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
  length together (a batched product of contiguous operands computes each of its items as it
  computes one alone; of strided ones, on baseline kernels, not).
- Some elementwise kernels (sigmoid, silu, softplus, gelu: measured) round an element
  otherwise by where it falls in their loop over a contiguous tensor, which depends on how
  many rows there are. ``by_rows`` runs such a function with the rows laid apart, so that it
  loops over each alike; a gate's half of a gate/up product is apart already.
- A dynamic or LongRoPE rotary embedding takes its frequencies by the largest position it is
  given (the batch's); ``LlamaForward`` then gives it each row's positions alone.

The norms (a reduction within one token's vector), exp, tanh and the arithmetic do not depend
on the other rows. What remains is SGLang's own list: the prefix cache is turned off (a prompt
computed on top of a cached prefix splits its products otherwise; SGLang turns its radix cache
off for backends without batch-invariant prefix attention), a row without ``sampling_seed``
draws with seed 42 (SGLang's), and a retracted request's re-prefill computes its tokens in one
pass where they were computed a step at a time. The models that run on transformers' passes
are refused with the flag.

Latent attention's absorbed decode takes each head's query through its own key expansion and
its output through its own value expansion: a product a head, as one batched product over the
heads (``batched``: ``torch.bmm`` of a fixed number of rows at a time, checked as ``linear``'s
products are, a weight ``[heads, in, out]``).

A mixture of experts runs each expert on however many tokens were routed to it, and its router
and shared experts on the batch's tokens, all in the model's own module. ``Products`` runs that
module with every product in it (``F.linear``, and ``x @ w`` with a 2-D ``w``, transformers'
per-expert loop, its ``eager`` experts implementation) made a fixed number of rows at a time
too; ``products_in`` lists those products, for ``rows_for``. Each token's experts are then added
up in the experts' order, as they are alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "CANDIDATES",
    "DEFAULT_SEED",
    "Products",
    "batched",
    "by_rows",
    "holds",
    "linear",
    "products_in",
    "rows_apart",
    "rows_for",
]

# the numbers of rows tried, in this order: on this CPU 32 rows cost 1.5-2.0x 8 rows' time,
# and 64 rows as two products of 32 cost 1.1-1.5x one of 64 (16: 1.1-1.8x and 1.4-2.2x)
CANDIDATES = (32, 48, 64, 24, 16, 96, 128)
DEFAULT_SEED = 42  # a row's sampling seed when it gives none (SGLang's, in this mode)
_Product = tuple[torch.Tensor, torch.Tensor | None]


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


def batched(x: torch.Tensor, weight: torch.Tensor, *, rows: int) -> torch.Tensor:
    """``x`` ``[n, heads, in]`` times each head's ``weight`` ``[heads, in, out]``:
    ``[n, heads, out]``, computed ``rows`` of the ``n`` at a time (one ``torch.bmm`` over the
    heads each, the last padded with zeros), so that each row's result is what it is alone."""
    n, heads, width = x.shape
    pad = -n % rows
    each = x.transpose(0, 1)  # [heads, n, in]
    if pad:
        each = torch.cat((each, each.new_zeros(heads, pad, width)), 1)
    out = torch.cat([torch.bmm(chunk.contiguous(), weight) for chunk in each.split(rows, 1)], 1)
    return out[:, :n].transpose(0, 1)


@torch.no_grad()
def rows_for(products: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """The first of ``CANDIDATES`` for which every product ``(weight, bias)`` gives each
    row the same result at any place among that many rows, beside any others and beside the
    zeros that pad a last chunk (tried with seeded random rows); ValueError if none does."""
    distinct = _distinct(products)
    for rows in CANDIDATES:
        if holds(distinct, rows):
            return rows
    raise ValueError(
        f"no number of rows in {CANDIDATES} gives this machine's matrix products rows that are "
        "what they are alone"
    )


@torch.no_grad()
def holds(products: Iterable[tuple[torch.Tensor, torch.Tensor | None]], rows: int) -> bool:
    """Whether every product gives each row what it is alone at ``rows`` rows (``rows_for``'s
    test: products that come later, a LoRA adapter's, are checked against the rows found)."""
    gen = torch.Generator().manual_seed(0)
    return all(_alike(w, b, rows, gen) for w, b in _distinct(products))


def _distinct(products: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> list[_Product]:
    """One product of each shape, dtype, device, layout and bias or not."""
    seen = {(tuple(w.shape), w.dtype, w.device, w.stride(), b is None): (w, b) for w, b in products}
    return list(seen.values())


def _alike(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, gen: Any) -> bool:
    """Whether the product computes each row, at any place among ``rows`` rows and beside the
    zeros that pad a last chunk, as it does among the first ``rows``: ``F.linear`` of a 2-D
    weight, or ``batched``'s ``torch.bmm`` over the heads of a 3-D one ``[heads, in, out]``."""
    if weight.dim() == 3:  # (a product a head: rows [n, heads, in], as batched runs a chunk)
        shape = (weight.shape[0], weight.shape[1])

        def run(chunk: torch.Tensor) -> torch.Tensor:
            return torch.bmm(chunk.transpose(0, 1).contiguous(), weight).transpose(0, 1)
    else:
        shape = (weight.shape[1],)

        def run(chunk: torch.Tensor) -> torch.Tensor:
            return F.linear(chunk, weight, bias)

    x = torch.randn(2 * rows, *shape, generator=gen).to(weight.device, weight.dtype)
    alone = run(x[:rows])
    for _ in range(3):  # the first rows again, at other places among other rows
        order = torch.randperm(2 * rows, generator=gen)[:rows].to(weight.device)
        mine = order < rows
        if not torch.equal(run(x[order])[mine], alone[order[mine]]):
            return False
    padded = torch.cat((x[:3], x.new_zeros(rows - 3, *shape)))
    return torch.equal(run(padded)[:3], alone[:3])


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
# functions whose kernels round an element otherwise by where it falls in a contiguous
# tensor's loop (measured on this machine's three kernel settings: sigmoid, silu, softplus and
# gelu; not exp, tanh, erf, cos, sin, rsqrt), which depends on how many rows there are
_ROUNDED_BY_PLACE = frozenset(
    {torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.silu, F.gelu, F.softplus}
)


class Products(TorchFunctionMode):
    """While entered (on this thread), every ``F.linear`` and every ``x @ w`` of a 2-D ``w``
    (as ``F.linear(x, w.mT)``) runs ``rows`` rows at a time (``linear``); with ``rows``
    None, each runs as it is and its ``(weight, bias)`` goes to ``seen``."""

    def __init__(self, rows: int | None, seen: list[_Product] | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.seen = seen

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.rows is not None and func in _ROUNDED_BY_PLACE:
            return _by_rows(func, args, kwargs)
        product = _product(func, args, kwargs)
        if product is None:
            return func(*args, **kwargs)
        x, weight, bias = product
        if self.rows is None:
            if self.seen is not None:
                self.seen.append((weight, bias))
            return func(*args, **kwargs)
        return linear(x, weight, bias, rows=self.rows)


def _product(func: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any, Any] | None:
    """(x, weight, bias) of a call that is ``F.linear(x, weight, bias)``; None otherwise."""
    if func is F.linear:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return args[0], args[1], bias
    if func in _MATMULS and not kwargs and len(args) == 2:
        x, w = args
        if isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 2:
            return x, w.mT, None
    return None


def by_rows(func: Callable, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``func(x, *args, **kwargs)`` (elementwise) with ``x``'s rows (its last dim) laid apart,
    a gap after each, and a row of zeros after them: the kernel then runs its loop over each
    row, the same for every row however many there are (one element a row, a shared
    expert's gate, included), where a contiguous tensor's elements go through one loop whose
    vectorized part and scalar rest fall by the number of rows, and a single row's through
    another."""
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    rows = flat.shape[0]
    laid = flat.new_zeros(rows + 1, width + 1)[:, :width]
    laid[:rows] = flat
    return func(laid, *args, **kwargs)[:rows].reshape(x.shape)


def rows_apart(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """``act`` (an activation) computed ``by_rows``."""
    return lambda x: by_rows(act, x) if x.dim() > 1 and x.numel() else act(x)


def _by_rows(func: Callable, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or kwargs.get("inplace") or not x.numel():
        return func(*args, **kwargs)
    return by_rows(func, x, *args[1:], **kwargs)


@torch.no_grad()
def products_in(module: torch.nn.Module, width: int, like: torch.Tensor) -> list[_Product]:
    """The products ``module`` (a mixture of experts' block) computes on a few tokens of
    ``width`` (of ``like``'s dtype and device): its router's, its shared experts', and one
    routed expert's of each shape (its experts are alike)."""
    seen: list[_Product] = []
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, 4, width, generator=gen).to(like.device, like.dtype)
    with Products(None, seen):
        module(tokens)
    return seen
