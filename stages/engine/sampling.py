"""Pick the next token of every running row, report its log-probability, and see who finished.

Greedy rows (temperature 0 or top_k 1) take the argmax and report ``log_softmax(logits)`` at
it. Sampled rows draw from ``softmax(logits / temperature)`` restricted by top-k, top-p and
min-p, and report ``log_softmax(logits / temperature)`` at the drawn token: the
temperature-scaled distribution *before* the top-k/top-p/min-p truncation. That is what SGLang
returns by default (its sampler takes ``log(probs)`` of the temperature-scaled softmax;
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would switch it to the raw logits, which this engine does
not offer).

``SlotSampler`` keeps every row's parameters in per-slot tensors (slots are the rows of the
batched KV cache, ``kv_batch.BatchKV``), so a step is a handful of tensor operations whatever
the batch: one inverse-CDF draw for all rows that share the engine's generator (``--seed``),
an ``argmax`` for greedy rows, truncation only while some row asks for it, and one vectorized
finish test (length limit, EOS, ``stop_token_ids``). A row with ``sampling_seed`` draws its
uniform number from its own ``torch.Generator``, so the same request gives the same tokens
whatever else is in the batch. Penalties and logit bias change the logits first (``penalize``,
before the top log-probs are read and a token drawn: ``stages.engine.penalties``); no grammar
masks.

Rows that ask for their sampling support (SGLang 0.5.23's ``return_sampling_mask``: greedy, or
a finite ``top_k``) leave it in ``captured`` after each draw: the tokens the truncated
distribution could have drawn (its positive weights after top-k, top-p and min-p), most likely
first, their log-probs under that distribution renormalized, and the drawn token's (the
behaviour policy's log-prob, which the returned ``log_softmax`` is not once a row truncates).
A greedy row's support is its token, at log-prob 0. As SGLang's ``Sampler._build_sampling_
mask_output`` reports it, from this sampler's own truncation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.engine.penalties import Penalties
from stages.engine.protocol import SamplingParams

# a top_k (or token id) no vocabulary reaches: a larger top_k keeps every token all the same
_BEYOND_ANY_VOCAB = 2**31 - 1

__all__ = ["SlotSampler", "Support"]

# a row's sampling support after a draw: (token ids most likely first, their log-probs under the
# truncated distribution renormalized, the drawn token's log-prob there; None: the drawn token
# is not in it, which the draw rules out)
Support = tuple[list[int], list[float], float | None]


class SlotSampler:
    """Sampling parameters of ``slots`` rows; rows ``0..rows-1`` are live (as in ``BatchKV``)."""

    def __init__(
        self, slots: int, eos_token_ids: frozenset[int], generator: torch.Generator
    ) -> None:
        self.slots = slots
        self.generator = generator
        self.eos_token_ids = eos_token_ids
        # Three tables (float, long, bool) so that moving rows is three copies; the named
        # per-slot columns below are views into them.
        self._floats = torch.zeros((slots, 3))
        self._longs = torch.zeros((slots, 3), dtype=torch.long)
        self._longs[:, 2:] = -1
        self._bools = torch.zeros((slots, 2), dtype=torch.bool)
        self._views()
        self.generators: list[torch.Generator | None] = [None] * slots
        # Per-slot flags (greedy, truncating, custom stop ids) behind the counts below, so a
        # step only pays for what some live row uses.
        self._flags: list[tuple[bool, bool, bool]] = [(False, False, False)] * slots
        self.n_greedy = self.n_truncating = self.n_stop_ids = 0
        self.seeded: set[int] = set()
        self.capture: set[int] = set()  # slots that report their sampling support
        self.captured: dict[int, Support] = {}  # the last draw's, by slot
        self.penalties = Penalties(slots, eos_token_ids)  # false while no row has any
        self.rows = 0
        self._is_eos: torch.Tensor | None = None
        self._work: torch.Tensor | None = None  # [slots, vocab] scratch of every step
        # where the tables are: the logits' device, once a step has run there (``_follow``)
        self.device = torch.device("cpu")

    def _views(self) -> None:
        self.temperature = self._floats[:, 0]  # 1 for greedy rows: their log-probs are unscaled
        self.top_p = self._floats[:, 1]
        self.min_p = self._floats[:, 2]
        self.top_k = self._longs[:, 0]  # 0 = off
        self.limit = self._longs[:, 1]  # logical column of the last allowed token
        self.stop_ids = self._longs[:, 2:]  # -1 = none
        self.greedy = self._bools[:, 0]
        self.check_stop = self._bools[:, 1]  # EOS and stop ids apply (not ignore_eos)

    # ---- rows joining, leaving, moving -----------------------------------------------------

    def add(
        self,
        params: Sequence[SamplingParams],
        limits: Sequence[int],
        generators: Sequence[torch.Generator | None],
        made: Sequence[Sequence[int]] = (),
        capture: Sequence[bool] = (),
    ) -> None:
        """Rows ``rows..rows+len(params)-1`` join (``limits``: see ``finished``; ``made``:
        each one's output tokens so far, if any, which its penalties count; ``capture``:
        whether each reports its sampling support, ``captured``)."""
        lo, hi = self.rows, self.rows + len(params)
        if hi > self.slots:
            raise RuntimeError(f"{hi} rows exceed the sampler's {self.slots} slots")
        width = max((len(p.stop_token_ids) for p in params), default=0)
        if width > self.stop_ids.shape[1]:
            grown = torch.full((self.slots, 2 + width), -1, dtype=torch.long, device=self.device)
            grown[:, : self._longs.shape[1]] = self._longs
            self._longs = grown
            self._views()
        temps, greedy, top_k, top_p, min_p, stops = [], [], [], [], [], []
        stop_rows, penalized = [], []
        for offset, (p, gen) in enumerate(zip(params, generators, strict=True)):
            slot = lo + offset
            is_greedy = p.greedy
            truncating = not is_greedy and (p.top_k not in (-1, 0) or p.top_p < 1 or p.min_p > 0)
            self._set_flags(slot, (is_greedy, truncating, bool(p.stop_token_ids)))
            temps.append(1.0 if is_greedy else p.temperature)
            greedy.append(is_greedy)
            top_k.append(0 if p.top_k == -1 else min(p.top_k, _BEYOND_ANY_VOCAB))
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            stops.append(not p.ignore_eos)
            # (ids no vocabulary has cannot be drawn; past 64 bits no tensor holds them)
            stop_rows.append(sorted(t for t in p.stop_token_ids if 0 <= t < _BEYOND_ANY_VOCAB))
            seeded = gen is not None and not is_greedy
            self.generators[slot] = gen if seeded else None
            if seeded:
                self.seeded.add(slot)
            if capture and capture[offset]:
                self.capture.add(slot)
            if p.penalized:
                penalized.append(slot)
        self.temperature[lo:hi] = torch.tensor(temps)
        self.greedy[lo:hi] = torch.tensor(greedy)
        self.top_k[lo:hi] = torch.tensor(top_k)
        self.top_p[lo:hi] = torch.tensor(top_p)
        self.min_p[lo:hi] = torch.tensor(min_p)
        self.check_stop[lo:hi] = torch.tensor(stops)
        self.limit[lo:hi] = torch.tensor(list(limits))
        self.stop_ids[lo:hi] = -1
        if width:
            padded = [ids + [-1] * (width - len(ids)) for ids in stop_rows]
            self.stop_ids[lo:hi, :width] = torch.tensor(padded)
        self.rows = hi
        if penalized:
            self.penalties.add(
                penalized,
                [params[slot - lo] for slot in penalized],
                [made[slot - lo] if made else () for slot in penalized],
            )

    def remove(self, holes: list[int], movers: list[int], dead: list[int]) -> None:
        """Rows ``dead`` leave; row ``movers[i]`` moves into slot ``holes[i]`` (see BatchKV)."""
        if self.penalties:
            self.penalties.remove(holes, movers, dead)
        for slot in dead:
            self._set_flags(slot, (False, False, False))
            self.seeded.discard(slot)
            self.capture.discard(slot)
            self.generators[slot] = None
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for table in (self._floats, self._longs, self._bools):
                table[dst] = table[src]
            for h, m in zip(holes, movers, strict=True):
                self._flags[h], self._flags[m] = self._flags[m], (False, False, False)
                self.generators[h], self.generators[m] = self.generators[m], None
                for slots in (self.seeded, self.capture):
                    if m in slots:
                        slots.discard(m)
                        slots.add(h)
        self.rows -= len(dead)

    def clear(self) -> None:
        """Every row leaves (a retraction, or a failed step)."""
        self.remove([], [], list(range(self.rows)))

    def _set_flags(self, slot: int, flags: tuple[bool, bool, bool]) -> None:
        old = self._flags[slot]
        self.n_greedy += flags[0] - old[0]
        self.n_truncating += flags[1] - old[1]
        self.n_stop_ids += flags[2] - old[2]
        self._flags[slot] = flags

    # ---- one step ------------------------------------------------------------------------

    def penalize(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Apply the penalties and logit bias of rows ``lo..hi-1`` to ``logits`` ([hi-lo,
        vocab], in place) before anything reads them."""
        if self.penalties:
            self.penalties.apply(logits, lo, hi)

    def sample(self, logits: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ([hi-lo], long) and their log-probs (float32) for rows ``lo..hi-1``.

        ``logits`` ([hi-lo, vocab], after ``penalize``) is overwritten. Draws use the inverse
        CDF (one uniform number per row, a cumulative sum and a binary search): per-token
        random numbers (``multinomial``, exponential races) cost ~20 ns each on CPU, 40 ms a
        step at 64 rows of a 32K vocabulary. Every pass writes into a buffer kept between
        steps. Penalized rows count the tokens drawn.
        """
        tokens, logprobs = self._draw(logits, lo, hi)
        if self.penalties:
            self.penalties.count(tokens, lo, hi)
        return tokens, logprobs

    def _draw(self, logits: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits if logits.dtype == torch.float32 else logits.float()
        rows, vocab = x.shape
        if x.device != self.device:
            self._follow(x.device)
        if self._is_eos is None or self._is_eos.numel() < vocab:
            self._is_eos = self._eos_table(vocab)
        if self._work is None or self._work.shape[1] != vocab:
            self._work = torch.empty((self.slots, vocab), dtype=torch.float32, device=x.device)
        e = self._work[:rows]
        self.captured = {}
        watched = sorted(slot for slot in self.capture if lo <= slot < hi) if self.capture else []
        if self.n_greedy == self.rows:  # every live row is greedy
            top, tokens = x.max(dim=-1, keepdim=True)
            torch.sub(x, top, out=e)
            if watched:
                self._capture(watched, tokens[:, 0], lo, None)
            # log_softmax at the argmax: (x - max) - log(sum(exp(x - max))), the first term 0
            return tokens[:, 0], -e.exp_().sum(dim=-1).log_()
        x.div_(self.temperature[lo:hi, None])
        top = x.amax(dim=-1, keepdim=True)
        torch.sub(x, top, out=e)
        e.exp_()
        support = None
        if self.n_truncating:
            total = e.sum(dim=-1, keepdim=True)
            kept = _truncate(e / total, self.top_k[lo:hi], self.top_p[lo:hi], self.min_p[lo:hi])
            if watched:  # read before the cumulative sum overwrites them
                support = self._support(kept, watched, lo)
            cdf = kept.cumsum_(dim=-1)
        else:
            cdf = e.cumsum_(dim=-1)
            total = cdf[:, -1:].clone()
        mass = cdf[:, -1:]
        # u in [0, mass): the first column whose cumulative weight passes u has a weight of its
        # own, so a token outside the truncated support is never drawn (u == mass, which float
        # rounding of rand * mass allows, would find none)
        below = torch.nextafter(mass, torch.zeros_like(mass))
        # the uniform numbers come from CPU generators (the same draws on any device)
        draw = torch.rand((rows, 1), generator=self.generator).to(x.device) * mass
        tokens = torch.searchsorted(cdf, torch.minimum(draw, below), right=True)[:, 0]
        for slot in self.seeded:
            if lo <= slot < hi:
                r = slot - lo
                u = torch.rand(1, generator=self.generators[slot]).to(x.device) * mass[r]
                tokens[r] = torch.searchsorted(cdf[r], torch.minimum(u, below[r]), right=True)[0]
        tokens.clamp_(max=vocab - 1)
        if self.n_greedy:
            tokens = torch.where(self.greedy[lo:hi], x.argmax(dim=-1), tokens)
        if watched:
            self._capture(watched, tokens, lo, support)
        # log_softmax(x / T) at the drawn token: (x - max) - log(sum(exp(x - max)))
        logprobs = (x.gather(1, tokens[:, None]) - top - total.log_())[:, 0]
        return tokens, logprobs

    def _support(
        self, kept: torch.Tensor, watched: list[int], lo: int
    ) -> dict[int, tuple[list[int], list[float]]]:
        """The watched sampled rows' supports in ``kept`` (their truncated weights): token ids
        by weight, most first, and their log-probs renormalized over the support."""
        sampled = [slot for slot in watched if not self._flags[slot][0]]
        if not sampled:
            return {}
        index = torch.tensor([slot - lo for slot in sampled], device=kept.device)
        weights = kept.index_select(0, index)
        k = min(int(self.top_k.index_select(0, index + lo).max()), weights.shape[1])
        if k <= 0:  # a finite top_k is asked of them (protocol): the whole row otherwise
            k = weights.shape[1]
        values, ids = weights.topk(k, dim=-1)
        lengths = (values > 0).sum(dim=-1).tolist()
        logprobs = (values / weights.sum(dim=-1, keepdim=True)).log_()
        return {
            slot: (row_ids[:n], row_lps[:n])
            for slot, n, row_ids, row_lps in zip(
                sampled, lengths, ids.tolist(), logprobs.tolist(), strict=True
            )
        }

    def _capture(
        self,
        watched: list[int],
        tokens: torch.Tensor,
        lo: int,
        support: dict[int, tuple[list[int], list[float]]] | None,
    ) -> None:
        """``captured`` for the watched rows, once their tokens are drawn."""
        index = torch.tensor([s - lo for s in watched], device=tokens.device)
        for slot, token in zip(watched, tokens.index_select(0, index).tolist(), strict=True):
            if self._flags[slot][0]:  # greedy: the argmax alone, certain
                self.captured[slot] = ([token], [0.0], 0.0)
                continue
            if support is None or slot not in support:  # a finite top_k truncates (protocol)
                raise RuntimeError(f"row {slot} asked for its sampling support without top_k")
            ids, lps = support[slot]
            at = ids.index(token) if token in ids else -1
            self.captured[slot] = (ids, lps, lps[at] if at >= 0 else None)

    def finished(
        self, tokens: torch.Tensor, lo: int, hi: int, column: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(done, by_token)``: which of rows ``lo..hi-1`` are done now that ``tokens`` sit in
        logical ``column``, and which of them by their token.

        A row is done when, unless it set ``ignore_eos``, it drew an EOS token or one of its
        ``stop_token_ids`` (``by_token``), or when ``column`` reaches its limit
        (``max_new_tokens``).
        """
        assert self._is_eos is not None, "sample() sizes the EOS table"
        stop = self._is_eos[tokens]
        if self.n_stop_ids:
            stop = stop | (self.stop_ids[lo:hi] == tokens[:, None]).any(dim=1)
        by_token = stop & self.check_stop[lo:hi]
        return (self.limit[lo:hi] <= column) | by_token, by_token

    def _eos_table(self, size: int) -> torch.Tensor:
        size = max(size, 1 + max(self.eos_token_ids, default=0))
        table = torch.zeros(size, dtype=torch.bool)
        if self.eos_token_ids:
            table[torch.tensor(sorted(self.eos_token_ids))] = True
        return table.to(self.device)

    def _follow(self, device: torch.device) -> None:
        """The tables go where the logits are (the model's device: the first step there)."""
        self._floats, self._longs, self._bools = (
            t.to(device) for t in (self._floats, self._longs, self._bools)
        )
        self._views()
        self.device = device
        self._is_eos = None  # made again there


def _truncate(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude (multinomial renormalizes).

    ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 leave a row as it is.
    """
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep = ranks < k
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= before < top_p[:, None]
    keep &= sorted_p >= sorted_p[:, :1] * min_p[:, None]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs)
    filtered.scatter_(1, order, sorted_p * keep)
    return filtered
