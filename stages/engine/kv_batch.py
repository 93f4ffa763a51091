"""The running batch's KV cache in preallocated slots, with the tokens each row produced.

Layout. Each layer keeps its keys and values in one zero-initialized tensor
``[slots, kv_heads, columns, head_dim]``; rows live in slots ``0..rows-1``. Every row's cached
tokens end at the same column: the *pending* column ``end``, where a decode step writes the
keys and values of the token each row sampled last (rows are left-padded, each from its own
``row_start``). A decode step therefore writes one column of every layer in place and hands
attention views ``[:rows, :, start:end+1]`` of the storage (at least 16 columns wide where the
storage has them left of ``start``, masked for every row: ``view_start``): nothing is copied or
concatenated.
The attention mask lives in a preallocated ``[slots, columns]`` tensor (bool, or additive for
eager attention) set once per row when it joins, so a step passes a view of it too, as a 4D
mask that transformers uses as it is (no mask construction per step). The sampled token ids and
their log-probs are written into ``[slots, columns]`` tracks aligned with the same columns:
the next step's input ids are a view of the token track, and a finished row's output and
log-probs are one slice of it.

Columns are *logical* (they only grow: ``end`` advances by one per decode step, so it doubles
as the step clock that per-token weight versions are keyed on); ``base`` maps them onto the
storage (physical = logical - base). When the storage runs out of room on the right (decode)
or on the left (a joining prompt longer than the free columns before ``end``), the live window
is moved (or the storage grown by doubling): amortized, one small copy every many steps.

Rows join after a prefill: the prefill's ``DynamicCache`` (left-padded, width ``W``) is copied
into columns ``end-W..end-1`` of the new slots; identical prompts are prefilled once and copied
into every slot that wants them. Prefixes kept across requests (``prefix_cache``) leave a row
as copies of its columns (``row_kv``) and come back as the past of a prefill (``past``: one
left-padded cache of several rows' prefixes); such a prefill has padding between a row's prefix
and its new tokens, which ``admit(columns=...)`` closes as it copies. A row that leaves frees
its slot by moving the last live row into it (its window only); columns that became padding in
every row are dropped by moving ``start``. The cache object handed to the model is a
transformers ``DynamicCache`` whose layers are these slots, so any model that takes a
``DynamicCache`` works. A sliding-window layer keeps every column too (the scheduler masks
what lies outside its window).

Linear-attention layers (Qwen3.5's and Qwen3-Next's gated delta nets, LFM2's convolutions:
transformers' ``LinearAttentionLayer``) keep no column per token but a fixed state per row: its
convolution's last inputs and its recurrent state. Each such layer keeps them in slot storage
too (``[slots, ...]``, grown by doubling as rows join), copied in from the prefill when a row
joins and moved with the row when it changes slot; a decode step hands the model views of the
live rows' states, which transformers' layers update in place. Such a state cannot be cut at a
token: the prefix cache keeps a row's states whole (``row_states``) at the end of what it ran,
and a prefill on such a prefix goes on from them (``past(..., states)``); Falcon-H1's layers,
which run attention and a Mamba mixer side by side, keep both.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

__all__ = ["CACHELESS_LAYER_TYPES", "MASK_KINDS", "STATE_LAYER_TYPES", "BatchKV", "pass_cache"]

# The layer types (a config's ``layer_types``) whose cache is a state per row, not (only) a
# column per token: transformers' ``LinearAttentionLayer``, and its
# ``LinearAttentionAndFullAttentionLayer`` for layers that run attention and a Mamba mixer side
# by side (Falcon-H1's ``hybrid``), which keep both
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid"})
# The layer types without attention in a hybrid model's ``layer_types`` (Nemotron-H's MLPs and
# mixtures of experts): no cache at all
CACHELESS_LAYER_TYPES = frozenset({"mlp", "moe"})

# How the attention mask reaches the model: a 4D bool view (sdpa), a 4D additive view (eager),
# or a 2D view that transformers turns into the mask it needs (any other attention).
MASK_KINDS = ("bool4d", "additive4d", "2d")


class _SlotLayer(DynamicLayer):
    """One layer's keys/values in slot storage; ``update`` writes the pending column."""

    def __init__(self, owner: BatchKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.k, self.v = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.keys = self.values = None  # type: ignore[assignment]  # views after each update

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.owner
        n, p, s = kv.rows, kv.end - kv.base, kv.view_start - kv.base
        q = key_states.shape[-2]
        self.k[:n, :, p : p + q] = key_states
        self.v[:n, :, p : p + q] = value_states
        self.keys = self.k[:n, :, s : p + q]
        self.values = self.v[:n, :, s : p + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.view_start

    def get_max_length(self) -> int:
        return -1


class _SlotStates(LinearAttentionLayer):
    """One linear-attention layer's states in slot storage (``conv``, ``recurrent``:
    ``[capacity, ...]``, either may be None); ``view(n)`` points the layer's states at the
    first ``n`` slots, which the model's pass then updates in place."""

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None, kernel: Any):
        LinearAttentionLayer.__init__(self)
        self.set_states(conv, recurrent, kernel)

    def set_states(
        self, conv: torch.Tensor | None, recurrent: torch.Tensor | None, kernel: Any
    ) -> None:
        self.conv, self.recurrent = conv, recurrent
        self.conv_kernel_size[0] = kernel
        self.is_conv_states_initialized[0] = conv is not None
        self.is_recurrent_states_initialized[0] = recurrent is not None
        self.has_previous_state[0] = True  # a decode step's: the prefill's went in
        some = conv if conv is not None else recurrent
        assert some is not None
        self.dtype, self.device = some.dtype, some.device

    def stores(self) -> list[torch.Tensor]:
        return [t for t in (self.conv, self.recurrent) if t is not None]

    def view(self, n: int) -> None:
        if self.conv is not None:
            self.conv_states[0] = self.conv[:n]
        if self.recurrent is not None:
            self.recurrent_states[0] = self.recurrent[:n]


class _SlotBoth(_SlotStates, _SlotLayer):
    """A layer that runs attention and a state side by side (Falcon-H1's): its keys and values
    as a ``_SlotLayer``'s, its states as a ``_SlotStates``' (``set_states`` once allocated)."""

    def __init__(self, owner: BatchKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        LinearAttentionLayer.__init__(self)
        _SlotLayer.__init__(self, owner, keys, values)

    def get_seq_length(self) -> int:  # the attention's (the state's counts nothing here)
        return _SlotLayer.get_seq_length(self)


def pass_cache(layer_types: list[str] | None) -> DynamicCache:
    """A fresh cache for a prefill pass: a ``DynamicLayer`` a layer, for the layers of
    ``STATE_LAYER_TYPES`` a ``LinearAttentionLayer`` (``hybrid``: a
    ``LinearAttentionAndFullAttentionLayer``, both) and for those without attention
    (``CACHELESS_LAYER_TYPES``) a ``DummyLayer``, as transformers lays out a hybrid model's
    (``layer_types`` None: a ``DynamicLayer`` a layer)."""
    cache = DynamicCache()
    if layer_types:
        cache.layer_class_to_replicate = None  # type: ignore[assignment]
        cache.layers = [
            LinearAttentionAndFullAttentionLayer()
            if kind == "hybrid"
            else LinearAttentionLayer()
            if kind in STATE_LAYER_TYPES
            else DummyLayer()
            if kind in CACHELESS_LAYER_TYPES
            else DynamicLayer()
            for kind in layer_types
        ]
    return cache


class BatchKV:
    """Slot storage for up to ``slots`` rows; the scheduler's row ``i`` lives in slot ``i``."""

    def __init__(
        self,
        slots: int,
        mask_kind: str = "bool4d",
        *,
        device: torch.device,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        if mask_kind not in MASK_KINDS:
            raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
        self.slots = slots
        self.mask_kind = mask_kind
        # the dtype the linear-attention layers' recurrent states are kept in between passes
        # (stages.engine.ssm_dtype; None: the dtype the pass makes them in)
        self.state_dtype = state_dtype
        self.device = device
        self.rows = 0
        self.end = 0  # logical pending column (also the decode-step clock)
        self.start = 0  # logical first column any live row uses
        self.base = 0  # physical column = logical column - base
        self.columns = 0
        self.margin = 8  # room kept left of `end` for joining prompts (grows with them)
        self.layers: list[_SlotLayer] = []  # the attention layers'
        self.states: list[_SlotStates] = []  # the linear-attention layers'
        self._both: list[bool] = []  # for each attention layer, whether it keeps a state too
        self._capacity = 0  # the rows the states' storage holds
        self._allocated = False
        self._stores: list[torch.Tensor] = []  # [tensors, slots, heads, columns, head_dim]
        self._shapes: list[tuple[int, int, torch.dtype]] = []  # (heads, head_dim, dtype)
        self._members: list[tuple[int, int]] = []  # tensor i = _stores[s][j]: (s, j)
        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = None
        self.row_start = torch.zeros(slots, dtype=torch.long, device=device)
        self.mask = torch.zeros((slots, 0), dtype=torch.bool, device=device)
        self.tokens = torch.zeros((slots, 0), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((slots, 0), dtype=torch.float32, device=device)
        self.relayouts = 0

    # ---- a decode step ---------------------------------------------------------------------

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [rows, 1], position_ids [rows, 1], attention mask) of the next step."""
        if self.end - self.base + 1 >= self.columns:
            self._relayout(left=0)
        n, p, s = self.rows, self.end - self.base, self.view_start - self.base
        ids = self.tokens[:n, p : p + 1]
        positions = (self.end - self.row_start[:n])[:, None]
        mask = self.mask[:n, s : p + 1]
        for states in self.states:
            states.view(n)
        if self.mask_kind != "2d":
            mask = mask[:, None, None, :]
        return ids, positions, mask

    @property
    def view_start(self) -> int:
        """The logical column a decode step's attention starts at: ``start``, or further left
        (columns every row masks) so that it reads at least ``_MIN_VIEW`` columns where the
        storage has them. PyTorch's CPU softmax, and the product of the probabilities and the
        values, are 2 to 7 times slower on rows shorter than 16 floats (a vector) than on 16:
        a short context such as arith-tiny's 8 to 14 columns."""
        return max(self.base, min(self.start, self.end + 1 - _MIN_VIEW))

    def push(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Record every row's next token after a decode step; the pending column advances."""
        p = self.end - self.base + 1
        self.tokens[: self.rows, p] = tokens
        self.logprobs[: self.rows, p] = logprobs
        self.end += 1

    # ---- rows joining ----------------------------------------------------------------------

    def admit(
        self,
        prefill: DynamicCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        source: torch.Tensor | None,
        columns: torch.Tensor | None = None,
    ) -> tuple[int, int]:
        """Add the rows of a prefill; returns their slots ``(lo, hi)``.

        ``prefill`` and ``ids`` ([U, W]) hold U left-padded prompts; new row ``j`` takes prompt
        ``source[j]`` (all U in order when ``source`` is None), whose real length is
        ``lengths[j]``. Their first sampled token goes in with ``set_pending``. ``columns``
        ([U, W], optional): column ``c`` of prompt ``u`` is column ``columns[u, c]`` of the
        prefill's keys and values (a prefill on top of cached prefixes has padding between
        the prefix and the new tokens of a row; this closes it).
        """
        width = ids.shape[1]
        count = ids.shape[0] if source is None else source.shape[0]
        lo, hi = self.rows, self.rows + count
        if hi > self.slots:
            raise RuntimeError(f"{hi} rows exceed the cache's {self.slots} slots")
        if not self._allocated:
            self._allocate(prefill, width)
        self.margin = max(self.margin, width)
        if self.rows == 0:
            self.start = self.end  # nothing to keep: start afresh at the left of the storage
            if self.columns > 4 * _pow2(2 * self.margin + 32):
                self.columns = 0  # the long rows are gone: give their memory back
            self._relayout(left=width)
        elif self.end - self.base < width:
            self._relayout(left=width)
        p = self.end - self.base
        if columns is not None:
            columns = columns[:, None, :, None]
        attention = [layer for layer in prefill.layers if _is_kv(layer)]
        for layer, given in zip(self.layers, attention, strict=True):
            keys, values = given.keys, given.values
            if columns is not None:  # (values as wide as keys, or not: latent attention's)
                keys = keys.gather(2, columns.expand(-1, keys.shape[1], -1, keys.shape[3]))
                values = values.gather(2, columns.expand(-1, values.shape[1], -1, values.shape[3]))
            if source is not None:
                keys, values = keys.index_select(0, source), values.index_select(0, source)
            layer.k[lo:hi, :, p - width : p] = keys
            layer.v[lo:hi, :, p - width : p] = values
        if self.states:
            self._admit_states(prefill, lo, hi, source)
        self.tokens[lo:hi, p - width : p] = ids if source is None else ids.index_select(0, source)
        starts = self.end - lengths.to(self.device)
        self.row_start[lo:hi] = starts
        self._set_mask(lo, hi)
        self.start = min(self.start, int(starts.min())) if lo else int(starts.min())
        self.rows = hi
        return lo, hi

    def _admit_states(
        self, prefill: DynamicCache, lo: int, hi: int, source: torch.Tensor | None
    ) -> None:
        """The linear-attention states a prefill left, into slots ``lo..hi-1``."""
        if hi > self._capacity:
            self._grow_states(hi)
        given = [layer for layer in prefill.layers if _is_state(layer)]
        for states, layer in zip(self.states, given, strict=True):
            for store, new in (
                (states.conv, layer.conv_states[0]),
                (states.recurrent, layer.recurrent_states[0]),
            ):
                if store is not None:
                    store[lo:hi] = new if source is None else new.index_select(0, source)

    def _grow_states(self, rows: int) -> None:
        """Room in the states' storage for ``rows`` rows (doubling, up to the slots), the live
        rows' states kept."""
        capacity = min(self.slots, max(_pow2(rows), 8))
        n = self.rows
        for states in self.states:
            for name in ("conv", "recurrent"):
                old = getattr(states, name)
                if old is not None:
                    new = old.new_zeros((capacity, *old.shape[1:]))
                    new[:n] = old[:n]
                    setattr(states, name, new)
        self._capacity = capacity

    def set_pending(self, lo: int, hi: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """The first sampled token of rows ``lo..hi-1`` (just admitted)."""
        p = self.end - self.base
        self.tokens[lo:hi, p] = tokens
        self.logprobs[lo:hi, p] = logprobs

    # ---- rows leaving ----------------------------------------------------------------------

    def remove(self, dead: list[int]) -> tuple[list[int], list[int]]:
        """Drop rows ``dead``; returns ``(holes, movers)``: row ``movers[i]`` now lives in slot
        ``holes[i]`` (the last live rows fill the freed slots below the new row count)."""
        gone = set(dead)
        n = self.rows - len(gone)
        holes = sorted(s for s in gone if s < n)
        movers = [s for s in range(n, self.rows) if s not in gone]
        if holes:
            self._move(holes, movers, self.start - self.base, self.end - self.base + 1)
        self.rows = n
        # Columns every remaining row treats as padding are dropped from the window.
        self.start = int(self.row_start[:n].min()) if n else self.end
        return holes, movers

    def _move(self, holes: list[int], movers: list[int], s: int, p: int) -> None:
        """Row ``movers[i]``'s window (physical columns ``s..p-1``) and start into slot
        ``holes[i]``: every layer's keys and values at once (one store per shape), the tracks.

        Rows that join together (a group's samples) sit side by side and mostly leave together,
        so the moves come in runs of neighbouring slots: each run is one slice copy. That is
        half the CPU of a gather and scatter by index, which reads and writes the same bytes
        twice, on a cache the model's pass has just flushed. Moves that form many runs go by
        index, in a few calls (``tests/stages/test_engine_kv_batch.py`` takes both ways)."""
        runs = _runs(holes, movers)
        if len(runs) > _MAX_RUNS:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for store in self._stores:
                store[:, dst, :, s:p] = store[:, src, :, s:p]
            for track in (self.tokens, self.logprobs, self.mask):
                track[dst, s:p] = track[src, s:p]
            self.row_start[dst] = self.row_start[src]
            for store in self._state_stores():
                store[dst] = store[src]
            return
        for store in self._stores:
            window = store[:, :, :, s:p]
            for h, m, k in runs:
                window[:, h : h + k] = window[:, m : m + k]
        for track in (self.tokens, self.logprobs, self.mask):
            window = track[:, s:p]
            for h, m, k in runs:
                window[h : h + k] = window[m : m + k]
        for h, m, k in runs:
            self.row_start[h : h + k] = self.row_start[m : m + k]
            for store in self._state_stores():
                store[h : h + k] = store[m : m + k]

    def _state_stores(self) -> list[torch.Tensor]:
        return [store for states in self.states for store in states.stores()]

    def clear(self) -> None:
        """Drop every row (the storage stays allocated)."""
        self.rows = 0
        self.start = self.end

    def nbytes(self) -> int:
        """The bytes the storage takes: every layer's keys and values (or states), and the row
        tracks."""
        tracks = (self.mask, self.tokens, self.logprobs, *self._state_stores())
        return sum(t.numel() * t.element_size() for t in (*self._stores, *tracks))

    def release(self) -> int:
        """Free the storage of every layer's keys and values (no row may be live); the next
        admission allocates it afresh. Returns the bytes freed."""
        if self.rows:
            raise RuntimeError(f"{self.rows} rows are live: their KV cache cannot be released")
        freed = self.nbytes()
        self.start = self.end
        self.columns = 0
        self._stores = []
        for layer in self.layers:  # no view may keep the old storage alive
            layer.k = layer.v = layer.k.new_empty(0)
            layer.keys = layer.values = None  # type: ignore[assignment]
        for states in self.states:
            states.conv = None if states.conv is None else states.conv[:0].clone()
            if states.recurrent is not None:
                states.recurrent = states.recurrent[:0].clone()
            states.conv_states[0] = states.recurrent_states[0] = None
        self._capacity = 0
        self.mask = self.mask.new_empty((self.slots, 0))
        self.tokens = self.tokens.new_empty((self.slots, 0))
        self.logprobs = self.logprobs.new_empty((self.slots, 0))
        return freed

    def row_track(self, slots: list[int], first: int) -> tuple[list[list[int]], list[list[float]]]:
        """Tokens and log-probs of ``slots`` from logical column ``first`` to ``end``."""
        idx = torch.tensor(slots, device=self.device)
        a, b = first - self.base, self.end - self.base + 1
        return (
            self.tokens.index_select(0, idx)[:, a:b].tolist(),
            self.logprobs.index_select(0, idx)[:, a:b].tolist(),
        )

    # ---- prefixes kept across requests (prefix_cache) -----------------------------------

    def row_kv(self, slot: int, first: int, last: int) -> list[torch.Tensor]:
        """Keys and values of row ``slot`` over logical columns ``first..last-1``: one view per
        store (``[tensors, heads, last-first, head_dim]``); copy what you keep."""
        a, b = first - self.base, last - self.base
        return [store[:, slot, :, a:b] for store in self._stores]

    def pass_kv(self, cache: DynamicCache, row: int, first: int, last: int) -> list[torch.Tensor]:
        """Keys and values of row ``row`` of a forward pass's own ``cache`` (not the slots')
        over its columns ``first..last-1``, laid out as ``row_kv`` gives a slot's: one tensor
        per store (copies). What a prompt scored outside the slots leaves to the prefix cache,
        before any row was admitted too."""
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        if not self._members:
            self._shapes = [(t.shape[1], t.shape[3], t.dtype) for t in tensors]
            self._members = [member for member, _ in self._grouped()]
        count = 1 + max((s for s, _ in self._members), default=-1)
        parts: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for (s, _), t in zip(self._members, tensors, strict=True):
            parts[s].append(t[row, :, first:last])
        return [torch.stack(part) for part in parts]

    def row_states(self, slot: int) -> list[torch.Tensor]:
        """The linear-attention states of the row in ``slot`` (views: copy what you keep),
        each layer's convolution's, then its recurrent one's, as ``past`` takes them."""
        return [store[slot] for store in self._state_stores()]

    def past(
        self,
        rows: list[list[list[torch.Tensor]]],
        width: int,
        states: list[list[torch.Tensor] | None] | None = None,
    ) -> DynamicCache:
        """A left-padded ``DynamicCache`` of ``width`` columns for a prefill on top of cached
        prefixes: row ``r`` is the concatenation of the pieces ``rows[r]`` (each one tensor per
        store, as ``row_kv`` gives them), right-aligned; padding is zeros. A model with
        linear-attention layers: ``states[r]``, row ``r``'s states after its prefix
        (``row_states``; None: zeros, a row without a prefix), which the pass goes on from;
        such a row's new tokens must not be padded (padding would go through its state)."""
        count = len(rows)
        first = next(pieces[0] for pieces in rows if pieces)  # a piece: [tensors, heads, n, dim]
        stores = [
            part.new_zeros((part.shape[0], count, part.shape[1], width, part.shape[3]))
            for part in first
        ]
        for r, pieces in enumerate(rows):
            column = width - sum(piece[0].shape[-2] for piece in pieces)
            for piece in pieces:
                n = piece[0].shape[-2]
                for store, part in zip(stores, piece, strict=True):
                    store[:, r, :, column : column + n] = part
                column += n
        views = [stores[s][j] for s, j in self._members]
        cache = DynamicCache()
        if not self.states:
            for i in range(len(views) // 2):
                cache.update(views[2 * i], views[2 * i + 1], i)
            return cache
        cache.layer_class_to_replicate = None  # type: ignore[assignment]
        zeros = [torch.zeros_like(store[0]) for store in self._state_stores()]
        given = [zeros if row is None else row for row in (states or [None] * count)]
        kv, held = iter(range(len(views) // 2)), iter(range(len(zeros)))
        layers: list[Any] = []
        for slot in self.cache.layers:
            if not isinstance(slot, (_SlotLayer, _SlotStates)):
                layers.append(DummyLayer())
                continue
            layer: Any = (
                LinearAttentionAndFullAttentionLayer()
                if isinstance(slot, _SlotBoth)
                else LinearAttentionLayer()
                if isinstance(slot, _SlotStates)
                else DynamicLayer()
            )
            if isinstance(slot, _SlotLayer):
                i = next(kv)
                layer.update(views[2 * i], views[2 * i + 1])
            if isinstance(slot, _SlotStates):
                found = {}
                for name in ("conv", "recurrent"):
                    if getattr(slot, name) is not None:
                        h = next(held)  # (row_states' order: each layer's conv, recurrent)
                        found[name] = torch.stack([row[h] for row in given])
                layer.lazy_initialization(
                    conv_states=found.get("conv"),
                    recurrent_states=found.get("recurrent"),
                    conv_kernel_size=slot.conv_kernel_size[0],
                )
                for name, tensor in found.items():
                    getattr(layer, f"{name}_states")[0].copy_(tensor)
                layer.has_previous_state[0] = True  # the pass goes on from these states
            layers.append(layer)
        cache.layers = layers
        return cache

    # ---- storage -----------------------------------------------------------------------

    def _allocate(self, prefill: DynamicCache, width: int) -> None:
        for layer in prefill.layers:
            if type(layer) not in _SERVED_LAYERS:
                raise ValueError(
                    f"cache layer {type(layer).__name__} is not supported: the built-in engine "
                    "serves attention layers kept whole and linear-attention layers"
                )
        attention = [layer for layer in prefill.layers if _is_kv(layer)]
        self.margin = max(self.margin, width)
        self.columns = _pow2(2 * self.margin + 32)
        self.base = self.end - self.margin
        self.start = self.end
        self._shapes = [
            (t.shape[1], t.shape[3], t.dtype)
            for layer in attention
            for t in (layer.keys, layer.values)
        ]
        self._both = [_is_state(layer) for layer in attention]
        self._build_stores(self.columns)
        slot_layers = iter(self.layers)
        self.cache.layers = []
        for layer in prefill.layers:
            slot: Any = next(slot_layers) if _is_kv(layer) else layer
            if _is_state(layer):
                conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
                kept = _empty_like(recurrent, self.state_dtype)
                args = (_empty_like(conv), kept, layer.conv_kernel_size[0])
                if _is_kv(layer):
                    slot.set_states(*args)
                else:
                    slot = _SlotStates(*args)
                self.states.append(slot)
            self.cache.layers.append(slot)
        self._allocated = True
        self.mask = self._mask_like(self.columns)
        self.tokens = torch.zeros((self.slots, self.columns), dtype=torch.long, device=self.device)
        self.logprobs = torch.zeros((self.slots, self.columns), device=self.device)

    def _relayout(self, left: int) -> None:
        """Move the live window so that ``left`` columns (at least the margin) precede ``end``
        and there is room on the right; grow the storage (doubling) when it is too small."""
        span = self.end - self.start  # cached columns of the longest row
        new_p = max(left, self.margin, span)
        room = max(32, new_p)
        columns = max(self.columns, _pow2(new_p + room))
        new_base = self.end - new_p
        s_old, s_new = self.start - self.base, self.start - new_base
        w = span + 1  # the pending column travels too
        n = self.rows
        fresh = columns != self.columns
        # (no rows: nothing to keep, and no storage after ``release``)
        windows = [store[:, :n, :, s_old : s_old + w].clone() for store in self._stores if n]
        if fresh:
            self._build_stores(columns)
        for store, window in zip(self._stores if n else (), windows, strict=True):
            store[:, :n, :, s_new : s_new + w] = window
        for name in ("tokens", "logprobs"):
            old = getattr(self, name)
            new = old.new_zeros((self.slots, columns)) if fresh else old
            if n:
                new[:n, s_new : s_new + w] = old[:n, s_old : s_old + w].clone()
            setattr(self, name, new)
        self.columns, self.base = columns, new_base
        if fresh:
            self.mask = self._mask_like(columns)
        self._set_mask(0, n)
        self.relayouts += 1

    def _set_mask(self, lo: int, hi: int) -> None:
        cols = torch.arange(self.columns, device=self.device) + self.base
        real = cols[None, :] >= self.row_start[lo:hi, None]
        if self.mask_kind == "additive4d":
            self.mask[lo:hi] = torch.where(real, 0.0, torch.finfo(self.mask.dtype).min)
        else:
            self.mask[lo:hi] = real

    def _build_stores(self, columns: int) -> None:
        """Zeroed storage for every layer's keys and values: one tensor per distinct shape and
        dtype (usually one for the whole model), so moving rows is one copy, not 2 per layer.
        Zeros, not garbage: a masked column still enters attention as 0 * value."""
        grouped = self._grouped()
        self._members = [member for member, _ in grouped]
        self._stores = []
        for heads, dim, dtype, size in dict.fromkeys(shape for _, shape in grouped):
            store = torch.zeros(
                (size, self.slots, heads, columns, dim), dtype=dtype, device=self.device
            )
            self._stores.append(store)
        views = [self._stores[s][j] for s, j in self._members]
        if not self.layers:
            both = self._both or [False] * (len(views) // 2)
            self.layers = [
                (_SlotBoth if both[i] else _SlotLayer)(self, views[2 * i], views[2 * i + 1])
                for i in range(len(views) // 2)
            ]
        else:
            for i, layer in enumerate(self.layers):
                layer.k, layer.v = views[2 * i], views[2 * i + 1]

    def _grouped(self) -> list[tuple[tuple[int, int], tuple[int, int, torch.dtype, int]]]:
        """For each tensor of ``_shapes`` (a layer's keys, then its values), its place
        ``(store, index)`` and its store's ``(heads, head_dim, dtype, tensors)``: one store
        per distinct shape and dtype, in the order they first appear."""
        groups: dict[tuple[int, int, torch.dtype], list[int]] = {}
        for i, shape in enumerate(self._shapes):
            groups.setdefault(shape, []).append(i)
        out: list[Any] = [None] * len(self._shapes)
        for s, (shape, members) in enumerate(groups.items()):
            for j, i in enumerate(members):
                out[i] = ((s, j), (*shape, len(members)))
        return out

    def _mask_like(self, columns: int) -> torch.Tensor:
        if self.mask_kind == "additive4d":
            dtype = self._stores[0].dtype if self._stores else torch.float32
            return torch.full(
                (self.slots, columns), torch.finfo(dtype).min, dtype=dtype, device=self.device
            )
        return torch.zeros((self.slots, columns), dtype=torch.bool, device=self.device)


# The fewest columns a decode step's attention reads (``BatchKV.view_start``).
_MIN_VIEW = 16

# Moves in more runs than this go by index (a copy per run costs a call each).
_MAX_RUNS = 8


def _runs(holes: list[int], movers: list[int]) -> list[tuple[int, int, int]]:
    """``(hole, mover, count)``: slots ``mover..mover+count-1`` move to ``hole..``, for each
    run of moves where both sides are neighbouring slots (``holes`` ascending)."""
    runs: list[tuple[int, int, int]] = []
    for h, m in zip(holes, movers, strict=True):
        if runs:
            h0, m0, k = runs[-1]
            if h == h0 + k and m == m0 + k:
                runs[-1] = (h0, m0, k + 1)
                continue
        runs.append((h, m, 1))
    return runs


def _is_state(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_kv(layer: Any) -> bool:
    """Whether a pass's cache ``layer`` holds keys and values (attention's, alone or beside a
    state), not only a state or nothing (a layer without attention)."""
    return isinstance(layer, DynamicLayer)


# the cache layers of a pass the slots take
_SERVED_LAYERS = (
    DynamicLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    DummyLayer,
)


def _empty_like(
    state: torch.Tensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """No rows of ``state``'s shape, in ``dtype`` (None: its own; a ``state`` of None: the
    layer keeps no such state)."""
    return None if state is None else state.new_zeros((0, *state.shape[1:]), dtype=dtype)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
