"""The KV cache of the running batch: left-padded rows that join and leave between steps.

Every row's real tokens end at the right edge; shorter rows are padded on the left, and
``mask`` ([rows, length], 1 = real token) tells attention which columns to ignore. Rows that
join (a freshly prefilled group) are merged by left-padding whichever side is shorter; rows
that leave are dropped with ``index_select`` and columns that became padding in every row are
trimmed, so the cache never grows past the longest live row.

Each layer keeps its keys and values in a buffer with spare room (grown by doubling), and a
decode step writes its one new column in place instead of concatenating the whole cache as
``DynamicLayer`` does. The cache object handed to the model is a transformers
``DynamicCache`` whose layers are these buffers, so any model that takes a ``DynamicCache``
works. Sliding-window and linear-attention layers are not supported.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["BatchKV"]


class _BufferLayer(DynamicLayer):
    """One layer's keys/values in a preallocated buffer; ``update`` appends in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._k = self._v = keys  # replaced by _store
        self._len = 0
        self._store(keys, values)

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, length, d = keys.shape
        capacity = max(2 * length, length + 32)
        self._k = keys.new_empty((b, h, capacity, d))
        self._v = values.new_empty((b, h, capacity, values.shape[-1]))
        self._k[:, :, :length] = keys
        self._v[:, :, :length] = values
        self._len = length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._k[:, :, : self._len]
        self.values = self._v[:, :, : self._len]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = key_states.shape[-2]
        if self._len + q > self._k.shape[-2]:
            self._store(self.keys, self.values)  # regrow with room to spare
        self._k[:, :, self._len : self._len + q] = key_states
        self._v[:, :, self._len : self._len + q] = value_states
        self._len += q
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len


class BatchKV:
    """The running rows' KV cache and padding mask (row order = the scheduler's row order)."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        # Take the per-layer tensors of a cache filled by a forward pass (e.g. a prefill).
        self.layers = [_BufferLayer(layer.keys, layer.values) for layer in cache.layers]
        self.mask = mask
        self.cache = DynamicCache()
        self.cache.layers = list(self.layers)
        self.cache.layer_class_to_replicate = None

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    def step_mask(self) -> torch.Tensor:
        """The attention mask of a decode step: the cache's mask plus one real column."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)
        return self.mask

    def merge(self, other: BatchKV) -> None:
        """Append ``other``'s rows after this batch's rows."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)])
            values = torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)])
            mine._store(keys, values)
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), trimming columns that are padding everywhere."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        real_cols = mask.any(dim=0).nonzero()
        start = int(real_cols[0]) if real_cols.numel() else mask.shape[1]
        self.mask = mask[:, start:].contiguous()
        for layer in self.layers:
            layer._store(
                layer.keys.index_select(0, idx)[:, :, start:],
                layer.values.index_select(0, idx)[:, :, start:],
            )


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Pad the sequence dimension (-2 for KV [b, h, s, d], -1 for a mask [b, s]) on the left."""
    dim = -1 if t.dim() == 2 else -2
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    # Zeros, not garbage: a masked column still enters attention as 0 * value.
    return torch.cat([t.new_zeros(shape), t], dim=dim)
