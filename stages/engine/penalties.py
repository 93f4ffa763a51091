"""SGLang's penalties and logit bias on the rows of a batch: the logits a row's sampling reads.

As SGLang 0.5's penalizers change the logits (``srt/sampling/penaltylib``, applied as
``SamplingBatchInfo.apply_logits_bias`` does with its default overlap scheduler: the additive
ones, then the scaling one, then the bias), each counting the row's *output* tokens only:

- ``frequency_penalty`` f and ``presence_penalty`` p: ``logits -= f * count + p * (count > 0)``;
- ``min_new_tokens`` m: while fewer than m tokens are out, EOS and ``stop_token_ids`` get
  ``-inf`` (they cannot be drawn; a stop string can still end the sample);
- ``repetition_penalty`` r on every token that is out: ``logits * r`` where negative, else
  ``logits / r``;
- ``logit_bias``: added to its tokens' logits.

The sampler then reads the changed logits: the token drawn, its log-prob and the top log-probs
are the changed distribution's, as SGLang's are. ``Penalties`` keeps, per slot of the batch
(``sampling.SlotSampler``'s), the coefficients and each row's output tokens so far (a
``[slots, capacity]`` history, grown as rows get longer), and applies a penalty by gathering and
scattering at those tokens: a step costs in proportion to the rows' output lengths, not to the
vocabulary (SGLang's dense ``[rows, vocab]`` tables would take several passes over every row's
whole vocabulary each step). A batch where no running row asks for a penalty or a bias pays one
check a step. A sequence that comes back after a retraction counts the tokens it made before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.engine.protocol import SamplingParams

__all__ = ["Penalties"]

_NEUTRAL = (0.0, 0.0, 1.0)  # frequency, presence, repetition


class _Row:
    """One penalized row: its parameters, how many tokens it has made, its bias and stops."""

    __slots__ = ("bias_ids", "bias_values", "made", "minimum", "params", "stop_ids")

    def __init__(
        self, params: SamplingParams, made: Sequence[int], eos_token_ids: frozenset[int]
    ) -> None:
        self.params = params
        self.made = len(made)
        self.bias_ids: torch.Tensor | None = None  # on the logits' device, at the first step
        self.bias_values: torch.Tensor | None = None
        self.minimum = params.min_new_tokens
        # SGLang's min_new_tokens masks EOS and stop_token_ids whether or not ignore_eos
        self.stop_ids = sorted(eos_token_ids | params.stop_token_ids) if self.minimum else []


class Penalties:
    """The penalties of ``slots`` rows (see the module); the sampler moves them with its rows."""

    def __init__(self, slots: int, eos_token_ids: frozenset[int]) -> None:
        self.slots = slots
        self.eos_token_ids = eos_token_ids
        self.rows: list[_Row | None] = [None] * slots
        self.active: set[int] = set()  # the slots with a row here
        # per slot: frequency, presence, repetition (neutral for a slot without a row here)
        self._coef = torch.tensor([_NEUTRAL] * slots)
        self._history = torch.zeros((slots, 16), dtype=torch.long)  # output tokens so far
        self._length = torch.zeros(slots, dtype=torch.long)  # how many of them
        self._device: torch.device | None = None  # the logits', once a step has run

    def __bool__(self) -> bool:
        return bool(self.active)

    # ---- rows joining, leaving, moving -----------------------------------------------------

    def add(
        self, slots: list[int], params: list[SamplingParams], made: list[Sequence[int]]
    ) -> None:
        """Rows with penalties or a bias join ``slots`` (``made``: each one's output tokens so
        far)."""
        for slot, p, done in zip(slots, params, made, strict=True):
            self.rows[slot] = _Row(p, done, self.eos_token_ids)
            self.active.add(slot)
        coef = [(p.frequency_penalty, p.presence_penalty, p.repetition_penalty) for p in params]
        index = torch.tensor(slots, device=self._coef.device)
        self._coef[index] = torch.tensor(coef, device=self._coef.device)
        self._grow(max(len(done) for done in made) + 1)
        self._length[index] = torch.tensor([len(done) for done in made], device=index.device)
        for slot, done in zip(slots, made, strict=True):
            if done:
                self._history[slot, : len(done)] = torch.tensor(list(done))

    def remove(self, holes: list[int], movers: list[int], dead: list[int]) -> None:
        """As ``SlotSampler.remove``: rows ``dead`` leave, ``movers[i]`` moves to ``holes[i]``."""
        for slot in dead:
            row = self.rows[slot]
            if row is not None:
                self.rows[slot] = None
                self.active.discard(slot)
        device = self._coef.device
        if holes:
            dst = torch.tensor(holes, device=device)
            src = torch.tensor(movers, device=device)
            for table in (self._coef, self._history, self._length):
                table[dst] = table[src]
            for h, m in zip(holes, movers, strict=True):
                self.rows[h], self.rows[m] = self.rows[m], None
                if m in self.active:
                    self.active.discard(m)
                    self.active.add(h)
        # a row without penalties may join a slot left or moved from: it finds nothing there
        cleared = [slot for slot in (*dead, *movers) if slot not in self.active]
        if cleared:
            index = torch.tensor(cleared, device=device)
            self._coef[index] = torch.tensor(_NEUTRAL, device=device)
            self._length[index] = 0

    def _grow(self, length: int) -> None:
        capacity = self._history.shape[1]
        if length > capacity:
            grown = torch.zeros((self.slots, max(length, 2 * capacity)), dtype=torch.long)
            grown[:, :capacity] = self._history
            self._history = grown.to(self._history.device)

    # ---- one step ------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Change the logits ([hi-lo, vocab]) of rows ``lo..hi-1`` in place."""
        here = [slot for slot in self.active if lo <= slot < hi]
        if not here:
            return
        x = logits if logits.dtype == torch.float32 else logits.float()
        if self._device != x.device:  # the first step: the tables go where the logits are
            self._coef, self._history, self._length = (
                t.to(x.device) for t in (self._coef, self._history, self._length)
            )
            self._device = x.device
        length = self._length[lo:hi]
        longest = int(length.max())
        if longest:
            self._penalize_seen(x, lo, hi, length, longest)
        vocab = x.shape[1]
        for slot in here:
            row = self.rows[slot]
            assert row is not None
            if row.made < row.minimum:
                x[slot - lo, [t for t in row.stop_ids if 0 <= t < vocab]] = float("-inf")
            if row.params.logit_bias:
                if row.bias_ids is None or row.bias_ids.device != x.device:
                    row.bias_ids = torch.tensor(
                        [t for t, _ in row.params.logit_bias], device=x.device
                    )
                    row.bias_values = torch.tensor(
                        [b for _, b in row.params.logit_bias], device=x.device
                    )
                x[slot - lo].index_add_(0, row.bias_ids, row.bias_values)
        if x is not logits:
            logits.copy_(x)

    def _penalize_seen(
        self, x: torch.Tensor, lo: int, hi: int, length: torch.Tensor, longest: int
    ) -> None:
        """Frequency, presence and repetition at the tokens each row has made (gathered and
        scattered: a token made twice is one position written twice with the same value)."""
        coef = self._coef[lo:hi]
        freq, presence, scale = coef[:, 0:1], coef[:, 1:2], coef[:, 2:3]
        history = self._history[lo:hi, :longest]
        made = torch.arange(longest, device=x.device)[None, :] < length[:, None]
        # positions past a row's length point at its first token (written with the same value
        # as that token's own position); a row with none has no penalty to write at all
        has = length[:, None] > 0
        history = torch.where(made, history, history[:, :1])
        x.scatter_add_(1, history, (-freq * made).expand_as(history).contiguous())
        presence = torch.where(has, presence, 0.0)
        scale = torch.where(has, scale, 1.0)
        seen = x.gather(1, history) - presence
        x.scatter_(1, history, torch.where(seen < 0, seen * scale, seen / scale))

    def count(self, tokens: torch.Tensor, lo: int, hi: int) -> None:
        """Rows ``lo..hi-1`` drew ``tokens``."""
        here = [slot for slot in self.active if lo <= slot < hi]
        if not here:
            return
        for slot in here:
            self.rows[slot].made += 1  # type: ignore[union-attr]
        self._grow(int(self._length[lo:hi].max()) + 1)
        length = self._length[lo:hi]
        rows = torch.arange(lo, hi, device=length.device)
        self._history[rows, length] = tokens.to(length.device)
        length += 1
