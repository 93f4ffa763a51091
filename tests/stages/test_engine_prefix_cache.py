"""Prefix reuse in the built-in engine (``stages.engine.prefix_cache``): the radix tree on its
own, then the scheduler driven step by step (a next turn prefills only its new tokens and gives
what a cold engine gives; batched admissions mixing hits and misses; reuse across a weight
update; eviction and the memory bound; abort, retraction and a failed step), then one real
server process (``cached_tokens``, ``/get_server_info``, ``/flush_cache``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from transformers import DynamicCache, Qwen2ForCausalLM

from stages.engine.prefix_cache import PrefixCache, Stamp
from stages.engine.protocol import GenerateInput, SamplingParams, SequenceResult
from stages.engine.scheduler import Scheduler
from stages.hf import cache_argument
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import builtin_engine, load_reference, two_tiny_models
from tests.stages.tiny_model import make_tiny_model, tiny_config

# the name models' forward takes the cache by (transformers renamed it)
CACHE_ARG = cache_argument(Qwen2ForCausalLM.forward) or "past_key_values"

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

# log-probs of the tiny models over sequences of at most 128 tokens (tests/numerics.py)
TERMS = forward_terms(tiny_config(), 128)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return two_tiny_models(tmp_path_factory)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _run(scheduler: Scheduler, *inputs: tuple[str, list[int], int]) -> list[SequenceResult]:
    """Submit ``(rid, input_ids, max_new_tokens)`` together (greedy) and run them to the end."""
    future = scheduler.submit_many(
        [GenerateInput(r, ids, _greedy(n), True) for r, ids, n in inputs]
    )
    scheduler.run_until_idle()
    return future.result(timeout=0)


def _same(hit: SequenceResult, cold: SequenceResult) -> None:
    assert hit.output_ids == cold.output_ids
    assert_close(hit.output_token_logprobs, cold.output_token_logprobs, terms=TERMS)


def _record_prefills(scheduler: Scheduler) -> list[tuple[int, int]]:
    """(rows, new-token width) of every prefill pass (fast path: decode passes are separate)."""
    calls: list[tuple[int, int]] = []
    fast = scheduler._fast
    assert fast is not None
    run = fast.prefill

    def prefill(ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(ids.shape))
        return run(ids, *args, **kwargs)

    fast.prefill = prefill  # type: ignore[method-assign]
    return calls


# ---- the tree on its own ---------------------------------------------------------------------


def _kv_of(values: list[int]) -> Any:
    """KV stand-in: one tensor [1, 1, L, 2] whose rows are the tokens' own values."""

    def kv_of(a: int, b: int) -> list[torch.Tensor]:
        t = torch.tensor(values[a:b], dtype=torch.float32)
        return [torch.stack((t, -t), -1)[None, None]]

    return kv_of


def _joined(match: Any) -> list[int]:
    return [int(x) for piece in match.pieces for x in piece[0][0, 0, :, 0]]


@pytest.mark.timeout(10)
def test_tree_matches_splits_and_evicts_the_least_recently_used_leaf() -> None:
    live = Stamp(0, "0")
    cache = PrefixCache(max_tokens=100, max_age=2)
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 9, 9]
    cache.insert(a, _kv_of([10 * t for t in a]), live)
    cache.insert(b, _kv_of([10 * t for t in b]), live)  # splits a's node after 3 tokens
    assert cache.stats()["tokens"] == 6 + 2 and cache.stats()["nodes"] == 3
    assert all(t.untyped_storage().nbytes() == t.nbytes for _, kv, _ in cache.nodes() for t in kv)

    m = cache.match([1, 2, 3, 4, 5, 6, 7], 6, live)  # longest match, through the split
    assert m.length == 6 and _joined(m) == [10, 20, 30, 40, 50, 60] and m.stamp == live
    m = cache.match([1, 2, 3, 4, 5, 6], 5, live)  # capped by the limit, mid-edge
    assert m.length == 5 and _joined(m) == [10, 20, 30, 40, 50]
    m = cache.match([1, 2, 3, 9, 8], 4, live)
    assert m.length == 4 and _joined(m) == [10, 20, 30, 90]
    assert cache.match([7, 1, 2], 2, live).length == 0
    cache.match([1, 2, 3, 4, 5, 6, 7], 6, live)  # a's path is now newer than b's leaf

    cache.max_tokens = 7
    assert cache.insert([1, 2, 3, 4], _kv_of([0] * 4), live) == 0  # held already
    stats = cache.stats()
    assert stats["tokens"] == 6 and stats["evictions"] == 1 and stats["evicted_tokens"] == 2
    assert cache.match([1, 2, 3, 9, 9, 9], 5, live).length == 3  # b's leaf went
    m = cache.match([1, 2, 3, 4, 5, 6, 7], 6, live)
    assert m.length == 6 and _joined(m) == [10, 20, 30, 40, 50, 60]  # its KV, split twice
    stats = cache.stats()
    assert stats["lookups"] == 7 and stats["hits"] == 6
    assert stats["hit_tokens"] == 6 + 5 + 4 + 6 + 3 + 6


@pytest.mark.timeout(10)
def test_a_linear_attention_prefix_ends_where_a_state_was_kept() -> None:
    """A linear-attention model's prefix ends only where a state was kept (a sequence's end,
    through splits); at most ``max_states`` are kept, the least recently used dropped first,
    and a state leaves with its node."""
    live = Stamp(0, "0")
    cache = PrefixCache(max_tokens=100, max_age=2, states=True, max_states=2)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    state_a, state_b = [torch.full((2,), 1.0)], [torch.full((2,), 2.0)]
    cache.insert(a, _kv_of(a), live, state=state_a)
    cache.insert(b, _kv_of(b), live, state=state_b)  # splits a's node after 3 tokens
    state_a[0] += 5  # (copied when kept)
    m = cache.match([*a, 7], 7, live, states=True)
    assert m.length == 6 and m.state is not None and m.state[0].tolist() == [1.0, 1.0]
    assert cache.match([*a, 7], 7, live).state is None  # (asked without states: none given)
    # a prefix that ends mid-edge, or at the split (no state there): none at all
    assert cache.match([1, 2, 3, 4, 5, 8], 6, live, states=True).length == 0
    assert cache.match([1, 2, 3, 7], 4, live, states=True).length == 0
    assert cache.match([1, 2, 3, 7], 4, live).length == 3  # (KV alone: the usual match)
    cache.insert([1, 2, 3], _kv_of([1, 2, 3]), live, state=[torch.full((2,), 3.0)])
    m = cache.match([1, 2, 3, 7], 4, live, states=True)  # the split's end now has one
    assert m.length == 3 and m.state is not None and m.state[0].tolist() == [3.0, 3.0]
    stats = cache.stats()
    assert stats["states"] == 2 and stats["state_evictions"] == 1  # b's, the oldest, went
    assert stats["state_bytes"] == 2 * 2 * 4
    assert cache.match([*b, 7], 6, live, states=True).length == 3  # back to [1, 2, 3]'s
    cache.max_tokens = 3  # evicts both leaves: their states go with them
    cache.insert([1, 2, 3], _kv_of([1, 2, 3]), live)
    assert cache.stats()["states"] == 1 and cache.match([*a, 7], 7, live, states=True).length == 3
    cache.flush()
    assert cache.stats()["states"] == 0


@pytest.mark.timeout(10)
def test_linear_attention_states_are_bounded_by_bytes_and_by_the_room_rows_leave() -> None:
    """SGLang's ``--mamba-full-memory-ratio``: the states take at most that times the bytes of
    ``max_tokens`` tokens of KV (measured at the first insert), the least recently used
    (matched or inserted) dropped first. Its ``--max-mamba-cache-size``: ``room_for_states``,
    what running rows leave of it, drops the oldest at once and bounds the next."""
    live = Stamp(0, "0")
    cache = PrefixCache(max_tokens=40, max_age=2, states=True, state_ratio=0.5)
    assert cache.stats()["max_state_bytes"] is None  # no KV seen yet to measure it by
    seqs = [[i, 100 + i] for i in range(1, 5)]

    def state(value: float) -> list[torch.Tensor]:
        return [torch.full((16,), float(value))]  # 64 bytes

    for i, seq in enumerate(seqs):
        cache.insert(seq, _kv_of(seq), live, state=state(i))
    stats = cache.stats()  # 40 tokens of 8 bytes, times 0.5: 160 bytes, two states
    assert stats["max_state_bytes"] == 160 and stats["max_states"] is None
    assert (stats["states"], stats["state_bytes"], stats["state_evictions"]) == (2, 128, 2)
    assert cache.match([*seqs[1], 0], 3, live, states=True).length == 0  # the oldest went
    assert cache.match([*seqs[3], 0], 3, live, states=True).length == 2
    m = cache.match([*seqs[2], 0], 3, live, states=True)  # now the most recently used
    assert m.length == 2 and m.state is not None and m.state[0][0] == 2.0
    cache.insert(seqs[0], _kv_of(seqs[0]), live, state=state(9))
    assert cache.match([*seqs[3], 0], 3, live, states=True).length == 0
    assert cache.match([*seqs[2], 0], 3, live, states=True).length == 2
    cache.room_for_states(1)  # rows took all but one
    assert cache.stats()["states"] == 1 and cache.stats()["state_bytes"] == 64
    assert cache.match([*seqs[2], 0], 3, live, states=True).length == 2  # the newest stays
    cache.room_for_states(-2)  # more rows than states: none kept, the next dropped at once
    cache.insert(seqs[1], _kv_of(seqs[1]), live, state=state(5))
    stats = cache.stats()
    assert (stats["states"], stats["state_bytes"], stats["max_states"]) == (0, 0, 0)
    assert stats["tokens"] == 8  # the KV stays, to be passed through
    cache.room_for_states(3)
    cache.insert([7, 8], _kv_of([7, 8]), live, state=state(1))
    cache.flush()
    assert cache.stats()["state_bytes"] == 0


@pytest.mark.timeout(10)
def test_a_namespace_shares_prefixes_with_itself_only() -> None:
    """SGLang's RadixKey: requests of one (extra_key, cache_salt) match each other's prefixes,
    never another namespace's or the default one's; trees go as the default's do."""
    live = Stamp(0, "0")
    cache = PrefixCache(max_tokens=100, max_age=0)
    seq = [1, 2, 3, 4, 5]
    tenant = ("a", None)
    ctx = [*seq, 6]
    cache.insert(seq, _kv_of([10 * t for t in seq]), live, tenant)
    assert cache.match(ctx, 5, live).length == 0  # not the default namespace's
    assert cache.match(ctx, 5, live, ("b", None)).length == 0
    assert cache.match(ctx, 5, live, ("a", "salt")).length == 0
    m = cache.match(ctx, 5, live, tenant)
    assert m.length == 5 and _joined(m) == [10, 20, 30, 40, 50]
    cache.insert(seq, _kv_of([7] * 5), live)  # the default's own copy, its own KV
    assert _joined(cache.match(ctx, 5, live)) == [7] * 5
    assert cache.stats()["tokens"] == 10 and cache.stats()["versions"] == 1
    cache.max_tokens = 10  # evicting the oldest leaf empties the tenant's tree
    cache.insert([9], _kv_of([9]), live)
    assert cache.match(ctx, 5, live, tenant).length == 0
    assert cache.match(ctx, 5, live).length == 5  # the default's is newer: it stays
    assert cache.age_out(1) == 6 and cache.stats()["tokens"] == 0  # version 0 goes whole


@pytest.mark.timeout(10)
def test_tree_reuses_older_kv_only_for_a_continuation_and_ages_it_out() -> None:
    old, live = Stamp(0, "0"), Stamp(1, "1")
    cache = PrefixCache(max_tokens=100, max_age=1)
    seq = [5, 6, 7, 8]
    cache.insert(seq, _kv_of(seq), old)
    assert cache.match([*seq, 1, 2], 5, old).length == 4  # its own version: any prefix
    assert cache.match([5, 6, 7], 2, old).length == 2
    m = cache.match([*seq, 1, 2], 5, live)  # older: a continuation of the whole sequence
    assert m.length == 4 and m.stamp == old
    assert cache.match([5, 6, 7], 2, live).length == 0  # older, and only part of it
    assert cache.match(seq, 3, live).length == 0  # the sequence itself continues nothing
    assert cache.stats()["stale_hits"] == 1

    # the same tokens computed by the live weights: their own tree, preferred
    cache.insert(seq, _kv_of([-t for t in seq]), live)
    m = cache.match([*seq, 1], 4, live)
    assert m.stamp == live and _joined(m) == [-5, -6, -7, -8]
    assert cache.stats()["versions"] == 2 and cache.stats()["tokens"] == 8

    assert cache.age_out(1) == 0  # one version old: kept
    assert cache.age_out(2) == 4  # two: its tree goes
    assert cache.insert([1, 2], _kv_of([1, 2]), old) == 0  # too old to be held at all
    stats = cache.stats()
    assert stats["tokens"] == 4 and stats["aged_out_tokens"] == 4 and stats["versions"] == 1
    assert cache.flush() == 4 and cache.stats()["tokens"] == 0


@pytest.mark.timeout(10)
def test_a_scored_prompt_is_held_as_a_prefix_and_scoring_takes_live_kv_only() -> None:
    """What prompt scoring asks of the tree: ``live_only`` matches skip older versions' KV
    (a prompt's log-probs are the live weights' own), and a scored prompt (``served``
    false) is no whole sequence, so no later version reuses it as an episode's past."""
    old, live = Stamp(0, "0"), Stamp(1, "1")
    cache = PrefixCache(max_tokens=100, max_age=1)
    served, scored = [5, 6, 7, 8], [1, 2, 3]
    cache.insert(served, _kv_of(served), old)
    cache.insert(scored, _kv_of(scored), old, served=False)
    assert cache.stats()["sequences"] == 1  # the served one alone is a whole sequence
    assert cache.match([*served, 9], 5, live).length == 4  # an episode continuing it
    assert cache.match([*served, 9], 5, live, live_only=True).length == 0
    assert cache.match([*scored, 9], 4, live).length == 0  # nothing continues a scored prompt
    assert cache.match([*scored, 9], 4, old, live_only=True).length == 3  # its own version's
    cache.insert(scored, _kv_of([-t for t in scored]), live, served=False)
    m = cache.match([*scored, 4], 3, live, live_only=True)
    assert m.stamp == live and _joined(m) == [-1, -2, -3]


# ---- the scheduler ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_next_turns_prefill_only_new_tokens_and_match_a_cold_engine(
    models: tuple[Path, Path], attn: str, fast: bool
) -> None:
    hot = Scheduler(load_reference(models[0], attn), max_running=4, fast_forward=fast)
    cold = Scheduler(
        load_reference(models[0], attn), max_running=4, fast_forward=fast, prefix_cache_tokens=0
    )
    context = [7, 8, 9, 10, 11, 12]
    for turn, inserted in enumerate([[], [40, 41, 42], [50, 51, 52, 53, 54, 55, 56]]):
        context = context + inserted
        before = hot.prefix_cache_stats()["prefill_tokens"]
        (hit,) = _run(hot, (f"t{turn}", context, 9))
        (ref,) = _run(cold, (f"t{turn}", context, 9))
        _same(hit, ref)
        computed = hot.prefix_cache_stats()["prefill_tokens"] - before
        if turn:
            # all but the last sampled token of the previous turn and what was inserted
            assert hit.cached_tokens == len(context) - len(inserted) - 1
            assert computed == len(inserted) + 1
            assert hit.cached_weight_version == "0"
        else:
            assert hit.cached_tokens == 0 and computed == len(context)
            assert hit.cached_weight_version is None
        assert ref.cached_tokens == 0
        context = context + hit.output_ids
    stats = hot.prefix_cache_stats()
    assert stats["lookups"] == 3 and stats["hits"] == 2
    assert stats["tokens"] == len(context) - 1  # one branch, every turn's KV held once
    assert cold.prefix_cache_stats() == {
        "enabled": False,
        "prefill_tokens": stats["prefill_tokens"] + stats["hit_tokens"],
        "token_hit_rate": 0.0,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_scoring_on_cached_prefixes_equals_scoring_whole_prompts(
    models: tuple[Path, Path], attn: str, fast: bool
) -> None:
    """Prompt log-probs computed on top of the prefix cache equal a cold engine's: a teacher's
    batch (one prompt, several completions, the start at the prompt's end) whose first row
    leaves the prompt to the rest, the same batch again, and a prompt that continues a
    generated sequence."""
    hot = Scheduler(load_reference(models[0], attn), max_running=8, fast_forward=fast)
    cold = Scheduler(
        load_reference(models[0], attn), max_running=8, fast_forward=fast, prefix_cache_tokens=0
    )

    def score(rows: list[list[int]], start: int) -> list[tuple[SequenceResult, SequenceResult]]:
        pairs = []
        for scheduler in (hot, cold):
            future = scheduler.submit_many(
                [
                    GenerateInput(f"s{i}", ids, _greedy(0), True, logprob_start=start)
                    for i, ids in enumerate(rows)
                ]
            )
            scheduler.run_until_idle()
            pairs.append(future.result(timeout=0))
        for hit, ref in zip(*pairs, strict=True):
            assert hit.input_token_logprobs is not None and ref.input_token_logprobs is not None
            assert [t for _, t in hit.input_token_logprobs] == [
                t for _, t in ref.input_token_logprobs
            ]
            assert hit.input_token_logprobs[0][0] is None and ref.cached_tokens == 0
            got = [lp for lp, _ in hit.input_token_logprobs[1:]]
            assert_close(got, [lp for lp, _ in ref.input_token_logprobs[1:]], terms=TERMS)
        return list(zip(*pairs, strict=True))

    prompt = [(5 * i + 2) % 90 + 3 for i in range(36)]
    rows = [prompt + t for t in ([40, 41, 42, 43], [50, 51], [60, 61, 62, 63, 64, 65], [70])]
    start = len(prompt) - 1
    assert [h.cached_tokens for h, _ in score(rows, start)] == [0, start, start, start]
    assert [h.cached_tokens for h, _ in score(rows, start)] == [start] * 4
    (gen,) = _run(hot, ("g", prompt[:20], 4))  # leaves its sequence: all but its last token
    _run(cold, ("g", prompt[:20], 4))
    held = prompt[:20] + gen.output_ids[:-1]
    ((hit, _),) = score([[*held, 80, 81]], len(held) + 1)
    assert hit.cached_tokens == len(held)
    stats = hot.prefix_cache_stats()
    # a lookup per prompt scored (the looks that held three back are not counted) and the
    # generation's (19 tokens of the first prompt); every context token computed or reused
    assert (stats["lookups"], stats["hits"]) == (10, 9)
    assert stats["hit_tokens"] == 7 * start + 19 + len(held)
    cold_stats = cold.prefix_cache_stats()
    assert cold_stats["prefill_tokens"] == stats["prefill_tokens"] + stats["hit_tokens"]


@pytest.mark.timeout(120)
def test_prompts_that_share_an_opening_compute_it_once_and_a_running_prompt_is_shared(
    models: tuple[Path, Path],
) -> None:
    """SGLang's in-batch prefix caching (``schedule_policy.py``: a prompt with at most 32
    tokens cached that shares 32 or more with one admitted before it waits for that one's KV)
    and its ``cache_unfinished_req`` (a prefilled prompt is in the tree before it finishes)."""
    model = load_reference(models[0])
    hot = Scheduler(model, max_running=8)
    cold = Scheduler(model, max_running=8, prefix_cache_tokens=0)
    system = [(3 * i + 5) % 90 + 3 for i in range(40)]  # a system prompt all of them share
    asks = {"a": [100, 101], "b": [102, 103, 104], "c": [105], "short": [106]}
    inputs = [(r, system + q, 5) for r, q in asks.items() if r != "short"]
    inputs.append(("short", system[:20] + asks["short"], 5))  # shares too little: not held
    calls = _record_prefills(hot)
    results = _run(hot, *inputs)
    for hit, ref in zip(results, _run(cold, *inputs), strict=True):
        _same(hit, ref)
    # the first of them with the short one, then the rest on top of the first one's KV
    assert {r.rid: r.cached_tokens for r in results} == {
        "a": 0, "b": len(system), "c": len(system), "short": 0,
    }  # fmt: skip
    assert calls == [(2, 42), (2, 3)]  # each wave one pass (padding under half of it)
    # a prompt already running: the next request of it (a group's sample sent apart) reuses
    # it, once it is longer than 32 tokens (shorter ones are held when they finish)
    prompt = [(7 * i + 1) % 90 + 3 for i in range(40)]
    first = hot.submit(GenerateInput("r1", prompt, _greedy(30), True))
    hot.step()
    second = hot.submit(GenerateInput("r2", prompt, _greedy(3), True))
    hot.step()
    assert not first.done()  # still running when the second was prefilled
    hot.run_until_idle()
    assert not first.result(timeout=0).cached_tokens  # nothing of it was held before it
    assert second.result(timeout=0).cached_tokens == len(prompt) - 1


@pytest.mark.timeout(120)
def test_one_admission_mixes_hits_misses_groups_and_lengths(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    hot = Scheduler(model, max_running=16, admit_fraction=0.0)
    cold = Scheduler(model, max_running=16, prefix_cache_tokens=0)
    firsts = {"a": [3, 4, 5], "b": [20, 21, 22, 23, 24, 25, 26, 27], "c": [60]}
    outs = _run(hot, *((r, p, 6) for r, p in firsts.items()))
    done = dict(zip(firsts, outs, strict=True))
    nexts = {
        "a1": firsts["a"] + done["a"].output_ids + [90],  # short prefix, 2 new tokens
        "b1": firsts["b"] + done["b"].output_ids + [91, 92, 93],  # long prefix
        "b2": firsts["b"] + done["b"].output_ids[:3],  # a strict prefix of b's sequence
        "c1": firsts["c"] + done["c"].output_ids + list(range(100, 127)),  # many new tokens
        "m": [70, 71, 72, 73],  # a miss
    }
    group = [("g0", nexts["b1"], 5), ("g1", nexts["b1"], 5)]  # two samples of one context
    calls = _record_prefills(hot)
    results = _run(hot, *((r, ids, 5) for r, ids in nexts.items()), *group)
    refs = _run(cold, *((r, ids, 5) for r, ids in nexts.items()), *group)
    for hit, ref in zip(results, refs, strict=True):
        _same(hit, ref)
    cached = {r.rid: r.cached_tokens for r in results}
    assert cached == {
        "a1": len(nexts["a1"]) - 2,
        "b1": len(nexts["b1"]) - 4,
        "b2": len(nexts["b2"]) - 1,
        "c1": len(nexts["c1"]) - 28,
        "m": 0,
        "g0": len(nexts["b1"]) - 4,
        "g1": len(nexts["b1"]) - 4,
    }
    # sorted by new tokens and cut where padding would exceed half a pass: the 28 new tokens
    # of c1 go alone; the group's context is prefilled once
    assert sorted(calls) == [(1, 28), (4, 4)]


@pytest.mark.timeout(60)
def test_a_request_equal_to_or_inside_a_cached_sequence(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    hot = Scheduler(model, max_running=4)
    cold = Scheduler(model, max_running=4, prefix_cache_tokens=0)
    prompt = [30, 31, 32, 33, 34]
    (first,) = _run(hot, ("p", prompt, 8))
    held = prompt + first.output_ids[:-1]  # what the cache holds of it
    for rid, ids in [("equal", held), ("inside", held[:7]), ("prompt", prompt), ("one", [30])]:
        (hit,) = _run(hot, (rid, ids, 6))
        (ref,) = _run(cold, (rid, ids, 6))
        _same(hit, ref)
        assert hit.cached_tokens == len(ids) - 1  # the last token is computed for its logits


@torch.no_grad()
def _stale_then_new(
    old: torch.nn.Module, new: torch.nn.Module, prefix: list[int], rest: list[int], n: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and log-probs of ``new`` after ``prefix + rest`` where the KV of
    ``prefix`` was computed by ``old``."""
    cache = DynamicCache()
    old(torch.tensor([prefix]), **{CACHE_ARG: cache}, use_cache=True)
    ids, position, out, lps = rest, len(prefix), [], []
    for _ in range(n):
        positions = torch.arange(position, position + len(ids))[None]
        logits = new(
            torch.tensor([ids]), **{CACHE_ARG: cache}, use_cache=True, position_ids=positions
        ).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        lps.append(torch.log_softmax(logits, -1)[token])
        position += len(ids)
        ids = [token]
    return out, torch.stack(lps)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_a_next_turn_reuses_its_prefix_across_a_weight_update(
    models: tuple[Path, Path], fast: bool
) -> None:
    model_a, model_b = load_reference(models[0]), load_reference(models[1])
    hot = Scheduler(
        load_reference(models[0]), max_running=4, fast_forward=fast, prefix_cache_max_age=1
    )
    prompt = [7, 8, 9, 10]
    (first,) = _run(hot, ("t0", prompt, 6))
    hot.apply_weights(list(model_b.state_dict().items()), 1)
    hot.step()
    turn = prompt + first.output_ids + [44, 45]
    (second,) = _run(hot, ("t1", turn, 7))
    # the previous turn's KV (version 0) is kept, as if the episode had kept running
    assert second.cached_tokens == len(prompt) + 5 and second.cached_weight_version == "0"
    assert second.output_token_weight_versions == ["1"] * 7
    expected, lps = _stale_then_new(
        model_a, model_b, turn[: second.cached_tokens], turn[second.cached_tokens :], 7
    )
    assert second.output_ids == expected
    assert_close(second.output_token_logprobs, lps, terms=TERMS)

    # a new sample of the same prompt is no continuation: the new weights compute it all
    (fresh,) = _run(hot, ("new", prompt, 6))
    assert fresh.cached_tokens == 0
    assert fresh.output_ids == _stale_then_new(model_b, model_b, prompt[:1], prompt[1:], 6)[0]

    # one version later the version-0 KV is too old (max_age 1): dropped, the turn recomputed
    hot.set_weight_version("2")
    hot.step()
    stats = hot.prefix_cache_stats()
    assert stats["aged_out_tokens"] == len(turn) + 6  # the episode's turns 1 and 2
    assert stats["tokens"] == len(prompt) + 5  # the new sample's (version 1) stays
    context = turn + second.output_ids + [46]
    (third,) = _run(hot, ("t2", context, 3))
    assert third.cached_tokens == 0 and third.cached_weight_version is None
    assert third.output_ids == _stale_then_new(model_b, model_b, context[:1], context[1:], 3)[0]


@pytest.mark.timeout(60)
def test_max_age_zero_drops_cached_prefixes_at_every_version(models: tuple[Path, Path]) -> None:
    hot = Scheduler(load_reference(models[0]), max_running=4, prefix_cache_max_age=0)
    (first,) = _run(hot, ("t0", [3, 4, 5], 4))
    hot.set_weight_version("1")
    hot.step()
    assert hot.prefix_cache_stats()["tokens"] == 0
    (second,) = _run(hot, ("t1", [3, 4, 5, *first.output_ids, 9], 2))
    assert second.cached_tokens == 0


@pytest.mark.timeout(60)
def test_eviction_keeps_the_bound_least_recently_used_first(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    hot = Scheduler(model, max_running=4, prefix_cache_tokens=25)
    cold = Scheduler(model, max_running=4, prefix_cache_tokens=0)
    prompts = {
        "a": [3, 4, 5, 6, 7, 8],
        "b": [13, 14, 15, 16, 17, 18],
        "c": [23, 24, 25, 26, 27],
        "d": [33, 34, 35, 36, 37, 38],
    }
    held: dict[str, list[int]] = {}

    def turn(rid: str, ids: list[int], n: int) -> SequenceResult:
        (out,) = _run(hot, (rid, ids, n))
        assert hot.prefix_cache_stats()["tokens"] <= 25
        return out

    for rid in "abc":  # 10, 10 and 9 tokens: a goes
        held[rid] = prompts[rid] + turn(rid, prompts[rid], 5).output_ids
    assert turn("b-again", held["b"][:8], 2).cached_tokens == 7  # b is used: c is older now
    held["d"] = prompts["d"] + turn("d", prompts["d"], 5).output_ids  # 10 more: c goes
    b = turn("b1", held["b"] + [99], 3)
    assert b.cached_tokens == 10
    _same(b, _run(cold, ("b1", held["b"] + [99], 3))[0])
    assert turn("c1", held["c"] + [99], 3).cached_tokens == 0
    assert turn("a1", held["a"] + [99], 3).cached_tokens == 0
    stats = hot.prefix_cache_stats()
    assert stats["evictions"] >= 3
    nodes = hot._prefix.nodes()  # type: ignore[union-attr]
    assert sum(len(tokens) for tokens, _, _ in nodes) == stats["tokens"]
    # what is held is its own memory, never a view keeping a larger tensor alive
    assert all(t.untyped_storage().nbytes() == t.nbytes for _, kv, _ in nodes for t in kv)
    assert stats["bytes"] == sum(t.nbytes for _, kv, _ in nodes for t in kv)

    turn("long", list(range(30, 60)), 4)  # longer than the bound: held up to it
    assert hot.prefix_cache_stats()["tokens"] == 25


@pytest.mark.timeout(60)
def test_aborted_and_retracted_rows_leave_no_corrupt_entry(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    hot = Scheduler(model, max_running=4)
    cold = Scheduler(model, max_running=4, prefix_cache_tokens=0)
    prompt = [40, 41, 42, 43]
    aborted = hot.submit(GenerateInput("x", prompt, _greedy(50), True))
    others = hot.submit_many([GenerateInput(f"r{i}", [50 + i, 9], _greedy(12), True)
                              for i in range(2)])  # fmt: skip
    for _ in range(4):
        hot.step()
    hot.abort("x")  # its KV (prompt and 4 of its 5 tokens) is kept
    hot.pause("retract")  # the r rows go back to the queue: nothing is kept of them
    hot.step()
    partial = aborted.result(timeout=0)
    assert partial.finish_reason["type"] == "abort" and len(partial.output_ids) == 5
    assert hot.prefix_cache_stats()["tokens"] == len(prompt) + 4  # the aborted row's KV
    hot.resume()
    hot.run_until_idle()
    refs = _run(cold, ("r0", [50, 9], 12), ("r1", [51, 9], 12))
    for r, ref in zip(others.result(timeout=0), refs, strict=True):
        _same(r, ref)
    # the aborted request's continuation (a client retrying) reuses what it had computed
    again = prompt + partial.output_ids
    (hit,) = _run(hot, ("x2", again, 8))
    assert hit.cached_tokens == len(again) - 1
    _same(hit, _run(cold, ("x2", again, 8))[0])


@pytest.mark.timeout(60)
def test_a_failed_step_leaves_nothing_and_the_thread_logs_the_counters(
    models: tuple[Path, Path],
) -> None:
    hot = Scheduler(load_reference(models[0]), max_running=4)
    assert hot._fast is not None
    decode = hot._fast.decode
    calls = []

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return decode(*args)

    hot._fast.decode = failing  # type: ignore[method-assign]
    with capture_logs() as logs:
        hot.start()
        try:
            failed = hot.submit(GenerateInput("f", [5, 6, 7], _greedy(10), True))
            with pytest.raises(RuntimeError, match="device lost"):
                failed.result(timeout=30)
            assert hot.prefix_cache_stats()["tokens"] == 0
            ok = hot.submit(GenerateInput("ok", [5, 6, 7], _greedy(4), True)).result(timeout=30)
            assert ok.cached_tokens == 0
        finally:
            hot.stop()
    (stopped,) = [e for e in logs if e["event"] == "scheduler_stopped"]
    assert stopped["prefix_cache"]["tokens"] == 3 + 3
    assert stopped["prefix_cache"]["lookups"] == 2


@pytest.mark.timeout(60)
def test_a_failed_prefill_fails_the_requests_it_was_admitting(models: tuple[Path, Path]) -> None:
    """Taken from the queue, not running yet: they fail with the pass, and nothing hangs."""
    hot = Scheduler(load_reference(models[0]), max_running=4)
    assert hot._fast is not None
    prefill = hot._fast.prefill
    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return prefill(*args, **kwargs)

    hot._fast.prefill = failing  # type: ignore[method-assign]
    hot.start()
    try:
        failed = hot.submit_many(
            [GenerateInput(f"f{i}", [5, 6, 7 + i], _greedy(4), True) for i in range(2)]
        )
        with pytest.raises(RuntimeError, match="device lost"):
            failed.result(timeout=30)
        ok = hot.submit(GenerateInput("f0", [5, 6, 7], _greedy(4), True)).result(timeout=30)
        assert len(ok.output_ids) == 4 and hot.counts() == {
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
        }
    finally:
        hot.stop()


# ---- a real server ---------------------------------------------------------------------------


def _call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return json.loads(text) if resp.headers.get_content_type() == "application/json" else text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("server")
    model_dir = make_tiny_model(root / "model", vocab=128, seed=1)
    flags = ["--prefix-cache-tokens", "4096", "--prefix-cache-max-age", "1"]
    flags += ["--log-file", str(root / "engine.log")]
    with builtin_engine(model_dir, *flags) as url:
        yield url


@pytest.mark.timeout(90)
def test_server_reports_cached_tokens_counters_and_flushes(server: str) -> None:
    def generate(ids: list[int], n: int) -> dict[str, Any]:
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": n}
        body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        return _call(server + "/generate", "POST", body)

    prompt = [5, 17, 33, 8, 90, 12]
    first = generate(prompt, 6)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["cached_weight_version"] is None
    turn = prompt + first["output_ids"] + [70, 71, 72]
    second = generate(turn, 6)
    assert second["meta_info"]["cached_tokens"] == len(prompt) + 5
    assert second["meta_info"]["cached_weight_version"] == "0"
    info = _call(server + "/get_server_info")["prefix_cache"]
    assert info["enabled"] and info["max_tokens"] == 4096 and info["max_age"] == 1
    assert info["lookups"] == 2 and info["hits"] == 1 and info["hit_rate"] == 0.5
    assert info["hit_tokens"] == len(prompt) + 5
    assert info["prefill_tokens"] == len(prompt) + 4
    assert info["tokens"] == len(turn) + 5 and info["bytes"] > 0

    assert _call(server + "/flush_cache", "POST").startswith("Cache flushed.")
    assert _call(server + "/get_server_info")["prefix_cache"]["tokens"] == 0
    assert _call(server + "/flush_cache").startswith("Cache flushed.")  # GET too, as SGLang
    # UpdateWeightsFromDistributedReqInput's bool ("yes" would be true: pydantic's lax mode)
    update = {"names": [], "dtypes": [], "shapes": [], "flush_cache": "maybe"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        _call(server + "/update_weights_from_distributed", "POST", update)
    assert refused.value.code == 400 and b"flush_cache: Input should be" in refused.value.read()
    cold = generate(turn, 6)  # the same turn computed whole
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == second["output_ids"]
    hot_lps = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    cold_lps = [lp for lp, _, _ in cold["meta_info"]["output_token_logprobs"]]
    assert_close(hot_lps, cold_lps, terms=TERMS)


@pytest.mark.timeout(90)
def test_extra_key_and_cache_salt_keep_prefixes_apart(server: str) -> None:
    """The same next turn sent under another ``extra_key`` or ``cache_salt`` reuses nothing;
    under its own, what it left."""
    prompt = [9, 19, 29, 39, 49, 59]

    def generate(ids: list[int], **space: str) -> dict[str, Any]:
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
        return _call(server + "/generate", "POST", {"input_ids": ids, "sampling_params": params,
                                                     **space})  # fmt: skip

    first = generate(prompt, extra_key="tenant-a")
    turn = prompt + first["output_ids"] + [70, 71]
    assert generate(turn)["meta_info"]["cached_tokens"] == 0  # the default namespace
    assert generate(turn, extra_key="tenant-b")["meta_info"]["cached_tokens"] == 0
    salted = generate(turn, extra_key="tenant-a", cache_salt="s")
    assert salted["meta_info"]["cached_tokens"] == 0
    own = generate(turn, extra_key="tenant-a")
    assert own["meta_info"]["cached_tokens"] == len(prompt) + 3
    assert own["output_ids"] == salted["output_ids"]  # the same answer, computed whole there
    batch = _call(server + "/generate", "POST", {
        "input_ids": [turn, turn], "extra_key": ["tenant-a", "tenant-c"],
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2},
    })  # fmt: skip
    assert [b["meta_info"]["cached_tokens"] > 0 for b in batch] == [True, False]
