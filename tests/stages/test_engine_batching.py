"""The scheduler's batched decode loop, driven step by step in-process: rows of different
lengths joining and leaving, shared prefills for identical prompts, seeded sampling, weight
updates and retraction over the slot KV layout (``kv_batch.BatchKV``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import hf_greedy, load_reference, two_tiny_models
from tests.stages.tiny_model import EOS_ID

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return two_tiny_models(tmp_path_factory)


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


def _count_passes(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Record (rows, width) of every forward pass the scheduler runs (either path)."""
    calls: list[tuple[int, int]] = []

    def counted(run: Any, ids_of: Any) -> Any:
        def pass_(*args: Any, **kwargs: Any) -> Any:
            calls.append(tuple(ids_of(args, kwargs).shape))
            return run(*args, **kwargs)

        return pass_

    fast = scheduler._fast
    if fast is not None:
        fast.prefill = counted(fast.prefill, lambda a, kw: a[0])
        fast.decode = counted(fast.decode, lambda a, kw: a[0])
    else:
        scheduler.model.forward = counted(scheduler.model.forward, lambda a, kw: kw["input_ids"])
    return calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])  # forward path
@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # bool vs additive 4D masks
def test_mixed_batch_matches_each_request_alone(
    models: tuple[Path, Path], attn: str, fast: bool
) -> None:
    model = load_reference(models[0], attn)
    scheduler = Scheduler(model, max_running=6, admit_fraction=0.0, fast_forward=fast)
    assert scheduler.forward_path == ("fast" if fast else "transformers")
    first = {
        "long": ([7, 8, 9, 10, 11], _greedy(70)),  # outlives storage: the window moves
        "short": ([40], _greedy(3)),
        "mid": ([3, 4], _greedy(12)),
    }
    futures = {
        rid: scheduler.submit(GenerateInput(rid, p, sp, True)) for rid, (p, sp) in first.items()
    }
    for _ in range(5):
        scheduler.step()
    # Join mid-run: one longer prompt than anything running, and a stop token.
    free = hf_greedy(model, [90, 91, 92, 93, 94, 95, 96], 20)
    stop = free[4]
    later = {
        # stop_token_ids apply only without ignore_eos
        "wide": (
            [90, 91, 92, 93, 94, 95, 96],
            SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=frozenset({stop})),
        ),
        "tiny": ([5], _greedy(1)),
    }
    for rid, (p, sp) in later.items():
        futures[rid] = scheduler.submit(GenerateInput(rid, p, sp, True))
    scheduler.run_until_idle()
    assert scheduler._kv.relayouts >= 2  # the long row moved the window at least once

    for rid, (prompt, sp) in {**first, **later}.items():
        result = futures[rid].result(timeout=0)
        expected = hf_greedy(model, prompt, sp.max_new_tokens)
        if rid == "wide":
            expected = expected[: expected.index(stop) + 1]
            assert result.finish_reason == {"type": "stop", "matched": stop}
        else:
            assert result.finish_reason == {"type": "length", "length": sp.max_new_tokens}
        assert result.output_ids == expected, rid
        assert_close(
            result.output_token_logprobs,
            _hf_logprobs(model, prompt, result.output_ids),
            terms=forward_terms(model.config, len(prompt) + len(result.output_ids)),
        )
        assert result.output_token_weight_versions == ["0"] * len(expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_identical_prompts_are_prefilled_once(models: tuple[Path, Path], fast: bool) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(model, max_running=8, fast_forward=fast)
    calls = _count_passes(scheduler)
    group = [GenerateInput(f"g{i}", [11, 12, 13], _greedy(6), True) for i in range(4)]
    other = GenerateInput("o", [50, 51], _greedy(6), True)
    future = scheduler.submit_many([*group, other])
    scheduler.run_until_idle()
    results = future.result(timeout=0)
    assert calls[0] == (2, 3)  # one prefill of the two distinct prompts
    assert [r.rid for r in results] == ["g0", "g1", "g2", "g3", "o"]
    expected = hf_greedy(model, [11, 12, 13], 6)
    assert all(r.output_ids == expected for r in results[:4])
    assert results[4].output_ids == hf_greedy(model, [50, 51], 6)
    lps = [r.output_token_logprobs for r in results[:4]]
    assert all(lp == lps[0] for lp in lps)


@pytest.mark.timeout(60)
def test_group_samples_differ_and_eos_ends_rows_at_their_own_step(
    models: tuple[Path, Path],
) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(model, max_running=16, seed=3, eos_token_ids=[EOS_ID])
    sp = SamplingParams(temperature=1.5, max_new_tokens=12)
    future = scheduler.submit_many([GenerateInput(f"s{i}", [20, 21], sp, True) for i in range(12)])
    scheduler.run_until_idle()
    results = future.result(timeout=0)
    outputs = {tuple(r.output_ids) for r in results}
    assert len(outputs) > 1  # one prefill, then each row draws its own tokens
    for r in results:
        assert len(r.output_token_logprobs) == len(r.output_ids) <= 12
        if r.finish_reason["type"] == "stop":
            assert r.output_ids[-1] == EOS_ID and EOS_ID not in r.output_ids[:-1]
        # the reported log-prob is log_softmax(logits / T) at the drawn token
        with torch.no_grad():
            logits = model(torch.tensor([[20, 21, *r.output_ids]])).logits[0, 1:-1] / 1.5
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.output_ids)[:, None])
        terms = forward_terms(model.config, 2 + len(r.output_ids))
        assert_close(r.output_token_logprobs, expected[:, 0], terms=terms)


@pytest.mark.timeout(60)
def test_seeded_rows_are_the_same_alone_and_in_a_batch(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=15, ignore_eos=True,
                            sampling_seed=1234)  # fmt: skip

    alone = Scheduler(model, max_running=8, seed=1)
    single = alone.submit(GenerateInput("x", [30, 31, 32], seeded, True))
    alone.run_until_idle()

    crowded = Scheduler(model, max_running=8, seed=2)
    noise = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True)
    others = [crowded.submit(GenerateInput(f"n{i}", [60 + i] * (i + 1), noise, True))
              for i in range(4)]  # fmt: skip
    crowded.step()
    crowded.step()  # the seeded row joins a running batch
    batched = crowded.submit(GenerateInput("x", [30, 31, 32], seeded, True))
    crowded.run_until_idle()
    assert all(f.done() for f in others)
    assert batched.result(timeout=0).output_ids == single.result(timeout=0).output_ids


@pytest.mark.timeout(60)
def test_weight_update_mid_run_records_versions_per_row(models: tuple[Path, Path]) -> None:
    model_a, model_b = load_reference(models[0]), load_reference(models[1])
    scheduler = Scheduler(load_reference(models[0]), max_running=4, admit_fraction=0.0)
    early = scheduler.submit(GenerateInput("early", [7, 8], _greedy(40), True))
    for _ in range(3):  # prefill + 3 decode steps: 4 tokens at version 0
        scheduler.step()
    mid = scheduler.submit(GenerateInput("mid", [9, 10, 11, 12], _greedy(10), True))
    scheduler.step()  # mid joins: 2 tokens at version 0 (prefill + decode), early: 5
    scheduler.apply_weights(list(model_b.state_dict().items()), 7)
    scheduler.step()
    late = scheduler.submit(GenerateInput("late", [13], _greedy(5), True))
    scheduler.set_weight_version("8")  # a version bump without new weights
    scheduler.run_until_idle()

    e, m, la = (f.result(timeout=0) for f in (early, mid, late))
    assert e.output_token_weight_versions == ["0"] * 5 + ["7"] + ["8"] * 34
    assert m.output_token_weight_versions == ["0"] * 2 + ["7"] + ["8"] * 7
    assert la.output_token_weight_versions == ["8"] * 5
    assert e.weight_version == "8"
    # the first 5 tokens came from model a; afterwards model b continued on a's KV cache
    assert e.output_ids[:5] == hf_greedy(model_a, [7, 8], 5)
    assert la.output_ids == hf_greedy(model_b, [13], 5)


@pytest.mark.timeout(60)
def test_retract_then_continue_keeps_outputs_and_versions(models: tuple[Path, Path]) -> None:
    model_a, model_b = load_reference(models[0]), load_reference(models[1])
    scheduler = Scheduler(load_reference(models[0]), max_running=8)
    group = scheduler.submit_many([GenerateInput(f"g{i}", [3, 4, 5], _greedy(12), True)
                                   for i in range(3)])  # fmt: skip
    solo = scheduler.submit(GenerateInput("solo", [6], _greedy(8), True))
    for _ in range(4):  # 5 tokens each
        scheduler.step()
    scheduler.pause("retract")
    scheduler.apply_weights(list(model_b.state_dict().items()), 1)
    scheduler.step()
    assert scheduler.counts() == {"num_running_reqs": 0, "num_waiting_reqs": 4}
    scheduler.resume()
    scheduler.run_until_idle()

    before = hf_greedy(model_a, [3, 4, 5], 5)
    for r in group.result(timeout=0):
        assert r.output_ids[:5] == before
        # recomputed on continue: model b over prompt + the 5 tokens kept
        assert r.output_ids[5:] == hf_greedy(model_b, [3, 4, 5, *before], 7)
        assert r.output_token_weight_versions == ["0"] * 5 + ["1"] * 7
        assert len(r.output_token_logprobs) == 12
    s = solo.result(timeout=0)
    assert s.output_ids[:5] == hf_greedy(model_a, [6], 5)
    assert s.output_token_weight_versions == ["0"] * 5 + ["1"] * 3


@pytest.mark.timeout(60)
def test_abort_by_group_rid_and_rid_clash(models: tuple[Path, Path]) -> None:
    scheduler = Scheduler(load_reference(models[0]), max_running=4)
    group = scheduler.submit_many(
        [GenerateInput(f"q_{i}", [5, 6], _greedy(50), True, group_rid="q") for i in range(3)]
    )
    scheduler.step()
    clash = scheduler.submit_many([GenerateInput("q_1", [5], _greedy(5), True)])
    aborted = scheduler.abort("q")
    scheduler.run_until_idle()
    with pytest.raises(ValueError, match="q_1"):
        clash.result(timeout=0)
    assert aborted.result(timeout=0) == 3
    for r in group.result(timeout=0):
        assert r.finish_reason["type"] == "abort"
        assert 0 < len(r.output_ids) < 50
