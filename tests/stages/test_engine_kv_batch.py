"""``kv_batch.BatchKV.remove``: rows leave, the last live rows move into the freed slots, and
every moved row keeps its keys and values (in every layer's store), tokens, log-probs, mask
and start, whether the moves go as runs of slice copies or by index; and ``admit``: rows join
with their prompts' keys and values closed up and picked."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.cache_utils import DynamicCache

from stages.engine import kv_batch
from stages.engine.kv_batch import BatchKV

SLOTS, WIDTH = 32, 6


def _filled(seed: int, mixed: bool) -> BatchKV:
    """``SLOTS`` rows of random prompts (lengths 1..WIDTH) and three decode steps' tokens;
    ``mixed``: the layers' keys and values differ in shape (two stores, not one)."""
    gen = torch.Generator().manual_seed(seed)
    cache = _prefill(gen, SLOTS, WIDTH, mixed)
    kv = BatchKV(SLOTS, device=torch.device("cpu"))
    ids = torch.randint(2, 50, (SLOTS, WIDTH), generator=gen)
    lengths = torch.randint(1, WIDTH + 1, (SLOTS,), generator=gen)
    lo, hi = kv.admit(cache, ids, lengths, None)
    kv.set_pending(lo, hi, torch.randint(2, 50, (SLOTS,), generator=gen), torch.rand(SLOTS))
    for _ in range(3):  # decode steps: each layer's pending column written, then the next token
        for layer in kv.layers:
            shape = (SLOTS, 2, 1, layer.k.shape[-1])
            layer.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        kv.push(torch.randint(2, 50, (SLOTS,), generator=gen), torch.rand(SLOTS))
    return kv


def _rows(kv: BatchKV) -> list[list[torch.Tensor]]:
    """Each live slot's window (physical columns of the current ``start..end``) in every
    tensor that moves with it."""
    s, p = kv.start - kv.base, kv.end - kv.base + 1
    return [
        [
            *(t[slot, :, s:p].clone() for layer in kv.layers for t in (layer.k, layer.v)),
            *(t[slot, s:p].clone() for t in (kv.tokens, kv.logprobs, kv.mask)),
            kv.row_start[slot].clone(),
        ]
        for slot in range(kv.rows)
    ]


def _check_remove(kv: BatchKV, dead: list[int]) -> list[tuple[int, int, int]]:
    before = _rows(kv)
    s, rows = kv.start - kv.base, kv.rows
    holes, movers = kv.remove(dead)
    # the reference: who lives where now
    where = list(range(rows))
    for hole, mover in zip(holes, movers, strict=True):
        where[hole] = mover
    assert kv.rows == rows - len(set(dead))
    assert sorted(where[: kv.rows]) == sorted(set(range(rows)) - set(dead))
    p = kv.end - kv.base + 1
    after = [
        [
            *(t[slot, :, s:p] for layer in kv.layers for t in (layer.k, layer.v)),
            *(t[slot, s:p] for t in (kv.tokens, kv.logprobs, kv.mask)),
            kv.row_start[slot],
        ]
        for slot in range(kv.rows)
    ]
    for slot in range(kv.rows):
        for got, want in zip(after[slot], before[where[slot]], strict=True):
            assert torch.equal(got, want), (dead, slot, where[slot])
    assert kv.start == (int(kv.row_start[: kv.rows].min()) if kv.rows else kv.end)
    return kv_batch._runs(holes, movers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mixed", [False, True], ids=["one-store", "two-stores"])
def test_moved_rows_keep_everything_they_had(mixed: bool) -> None:
    rng = random.Random(7)
    paths = set()
    for trial in range(60):
        kv = _filled(trial, mixed)
        while kv.rows > 1:
            if rng.random() < 0.5:  # a group of neighbouring slots (as a group's samples sit)
                first = rng.randrange(kv.rows)
                dead = list(range(first, min(kv.rows, first + rng.randint(1, 4))))
            else:  # scattered rows
                dead = rng.sample(range(kv.rows), rng.randint(1, kv.rows - 1))
            runs = _check_remove(kv, dead)
            paths.add("index" if len(runs) > kv_batch._MAX_RUNS else "runs" if runs else "none")
    assert paths == {"index", "runs", "none"}  # every path was taken


def test_moves_merge_into_runs_of_neighbouring_slots() -> None:
    assert kv_batch._runs([], []) == []
    assert kv_batch._runs([4, 5, 6, 7], [28, 29, 30, 31]) == [(4, 28, 4)]
    assert kv_batch._runs([1, 2, 9], [20, 21, 22]) == [(1, 20, 2), (9, 22, 1)]
    assert kv_batch._runs([1, 2, 3], [20, 22, 23]) == [(1, 20, 1), (2, 22, 2)]


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_a_short_context_is_read_through_a_wider_view_of_masked_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stages.engine.llama_forward import LlamaForward

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    fast = LlamaForward(model)
    kv = BatchKV(8, device=torch.device("cpu"))

    def join(rows: int, width: int) -> None:
        ids = torch.randint(2, 40, (rows, width))
        lengths = torch.randint(1, width + 1, (rows,))
        mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache, logits = fast.prefill(ids, mask, positions)
        lo, hi = kv.admit(cache, ids, lengths, None)
        kv.set_pending(lo, hi, logits.argmax(-1), torch.zeros(rows))

    def step() -> torch.Tensor:
        logits = fast.decode(*kv.decode_inputs(), kv)
        kv.push(logits.argmax(-1), torch.zeros(kv.rows))
        return logits

    join(4, 5)
    for _ in range(20):  # the first rows' columns...
        step()
    join(4, 3)
    kv.remove([0, 1, 2, 3])  # ...are masked for every row left: room to read
    assert kv.end - kv.start + 1 < kv_batch._MIN_VIEW <= kv.end - kv.base + 1
    mask = kv.decode_inputs()[2]
    width = kv.end - kv.start + 1
    assert mask.shape[-1] == kv_batch._MIN_VIEW
    assert not mask[..., : kv_batch._MIN_VIEW - width].any()  # the extra columns: masked
    assert kv.cache.layers[0].get_seq_length() == kv_batch._MIN_VIEW - 1
    wide = [step() for _ in range(3)]
    kv.end -= 3  # the same three steps again (their tokens are in the track) through start
    monkeypatch.setattr(kv_batch, "_MIN_VIEW", 1)
    for want in wide:
        assert kv.decode_inputs()[2].shape[-1] == kv.end - kv.start + 1
        torch.testing.assert_close(step(), want, rtol=1e-5, atol=1e-5)


def _prefill(gen: torch.Generator, rows: int, width: int, mixed: bool) -> DynamicCache:
    """A prefill's cache of 3 layers: ``rows`` prompts ``width`` wide, random keys and values;
    ``mixed``: the middle layer's head size differs (two stores, not one)."""
    cache = DynamicCache()
    for layer in range(3):
        dim = 4 if not mixed or layer != 1 else 8
        keys = torch.randn((rows, 2, width, dim), generator=gen)
        cache.update(keys, torch.randn(keys.shape, generator=gen), layer)
    return cache


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mixed", [False, True], ids=["one-store", "two-stores"])
def test_joining_rows_take_their_prompts_keys_and_values_closed_up_and_picked(
    mixed: bool,
) -> None:
    """``admit`` with ``columns`` (a prefill on cached prefixes: row ``u``'s column ``c`` is
    the pass's column ``columns[u, c]``) and ``source`` (new row ``j`` takes prompt
    ``source[j]``), after rows already live: each new row holds exactly its prompt's keys and
    values in every layer, its tokens, and the rows before it are untouched."""
    gen = torch.Generator().manual_seed(3)
    kv = BatchKV(SLOTS, device=torch.device("cpu"))
    first = _prefill(gen, 5, WIDTH, mixed)
    kv.admit(first, torch.randint(2, 50, (5, WIDTH), generator=gen), torch.full((5,), WIDTH), None)
    kept = [t[:5].clone() for layer in kv.layers for t in (layer.k, layer.v)]
    units, width = 3, WIDTH - 1
    prefill = _prefill(gen, units, WIDTH, mixed)
    columns = torch.stack([torch.randperm(WIDTH, generator=gen)[:width] for _ in range(units)])
    source = torch.tensor([2, 0, 2, 1])
    ids = torch.randint(2, 50, (units, width), generator=gen)
    lo, hi = kv.admit(prefill, ids, torch.full((len(source),), width), source, columns)
    assert (lo, hi) == (5, 9)
    p = kv.end - kv.base
    for layer, (keys, values, *_rest) in zip(kv.layers, prefill, strict=True):
        for got, sent in ((layer.k, keys), (layer.v, values)):
            for j, u in enumerate(source.tolist()):
                want = sent[u][:, columns[u]]
                assert torch.equal(got[lo + j, :, p - width : p], want), (j, u)
    assert all(
        torch.equal(t[:5], before)
        for t, before in zip(
            (t for layer in kv.layers for t in (layer.k, layer.v)), kept, strict=True
        )
    )
    assert torch.equal(kv.tokens[lo:hi, p - width : p], ids[source])
