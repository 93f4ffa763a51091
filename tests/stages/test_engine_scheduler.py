"""The scheduler driven step by step in-process: in-flight weight updates and batching."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen2ForCausalLM

from stages.engine.model_weights import WeightLoadError, load_named_tensors
from stages.engine.protocol import GenerateInput, SamplingParams, SequenceResult
from stages.engine.scheduler import Scheduler
from stages.hf import cache_argument
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import (
    hf_greedy,
    load_reference,
    run_with_retraction,
    two_tiny_models,
)
from tests.stages.tiny_model import make_tiny_model

# the name models' forward takes the cache by (transformers renamed it)
CACHE_ARG = cache_argument(Qwen2ForCausalLM.forward) or "past_key_values"

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return two_tiny_models(tmp_path_factory)


@torch.no_grad()
def _continue_with_stale_cache(
    old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], before: list[int], total: int
) -> list[int]:
    """Greedy tokens after ``before``: the cache of prompt + before[:-1] comes from ``old``."""
    cache = DynamicCache()
    context = prompt + before
    old(torch.tensor([context[:-1]]), **{CACHE_ARG: cache}, use_cache=True)
    out, last = [], context[-1]
    for pos in range(len(context) - 1, len(context) - 1 + total - len(before)):
        logits = new(
            torch.tensor([[last]]),
            **{CACHE_ARG: cache},
            use_cache=True,
            position_ids=torch.tensor([[pos]]),
        ).logits
        last = int(logits[0, -1].argmax())
        out.append(last)
    return out


@pytest.mark.timeout(60)
def test_weights_applied_mid_generation(models: tuple[Path, Path]) -> None:
    model_a, model_b = load_reference(models[0]), load_reference(models[1])
    engine_model = load_reference(models[0])
    scheduler = Scheduler(engine_model, max_running=4, weight_version="0")
    prompt = [7, 8, 9, 10]
    long = scheduler.submit(GenerateInput("long", prompt, GREEDY, True))
    other = scheduler.submit(GenerateInput("other", [40, 41], GREEDY, True))
    for _ in range(5):  # prefill gives one token, each step one more: 6 tokens at version 0
        scheduler.step()
    applied = scheduler.apply_weights(list(model_b.state_dict().items()), 1)
    scheduler.run_until_idle()
    assert applied.result(timeout=0) is None

    result = long.result(timeout=0)
    assert result.finish_reason == {"type": "length", "length": 30}
    assert result.output_token_weight_versions == ["0"] * 6 + ["1"] * 24
    assert result.weight_version == "1"
    before = result.output_ids[:6]
    assert (
        before
        == model_a.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[
            0, 4:
        ].tolist()
    )
    # After the switch: the new weights on top of the old weights' KV cache, kept as it was.
    assert result.output_ids[6:] == _continue_with_stale_cache(model_a, model_b, prompt, before, 30)
    assert other.result(timeout=0).output_token_weight_versions == ["0"] * 6 + ["1"] * 24

    fresh = scheduler.submit(GenerateInput("fresh", prompt, GREEDY, True))
    scheduler.run_until_idle()
    expected = model_b.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert fresh.result(timeout=0).output_ids == expected[0, 4:].tolist()
    assert fresh.result(timeout=0).output_token_weight_versions == ["1"] * 30


@pytest.mark.timeout(60)
def test_bad_weights_are_rejected_whole(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(model, max_running=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = [
        ("model.norm.weight", torch.zeros(32)),
        ("model.nope.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(2, 2)),
    ]
    future = scheduler.apply_weights(bad, "9")
    scheduler.step()
    with pytest.raises(WeightLoadError, match=r"model\.nope\.weight.*lm_head\.weight"):
        future.result(timeout=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scheduler.weight_version == "0"


@pytest.mark.timeout(60)
def test_tied_embeddings_update_through_either_name(tmp_path: Path) -> None:
    model = load_reference(make_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    new = torch.randn_like(model.lm_head.weight)
    load_named_tensors(model, [("lm_head.weight", new)])
    assert torch.equal(model.model.embed_tokens.weight, new)
    load_named_tensors(model, [("model.embed_tokens.weight", new * 2)])
    assert torch.equal(model.lm_head.weight, new * 2)


@pytest.mark.timeout(60)
def test_retract_then_continue_recomputes_and_matches(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(model, max_running=4)
    futures = [
        scheduler.submit(GenerateInput(f"r{i}", [3 + i, 9, 27][: i + 1], GREEDY, False))
        for i in range(3)
    ]
    for _ in range(4):
        scheduler.step()
    scheduler.pause("retract")
    scheduler.step()
    assert scheduler.counts() == {"num_running_reqs": 0, "num_waiting_reqs": 3}
    scheduler.resume()
    scheduler.run_until_idle()
    for i, future in enumerate(futures):
        prompt = [3 + i, 9, 27][: i + 1]
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
        assert future.result(timeout=0).output_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.timeout(60)
def test_stop_strings_and_top_logprobs_survive_a_retraction(models: tuple[Path, Path]) -> None:
    """What a sequence watches (the tail it decodes for stop strings, its top log-probs) is
    its own, not its row's: a retraction in the middle changes nothing of the result."""
    model = load_reference(models[0])
    prompt = [3, 9, 27]
    free = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    free = free[0, len(prompt) :].tolist()
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 (the "tokenizer")
    stop = words(free[8:10])
    end = next(k for k in range(1, 31) if stop in words(free[:k]))
    params = SamplingParams(
        temperature=0.0, max_new_tokens=30, ignore_eos=True, stop=(stop,), stop_window=12
    )
    for retract in (False, True):
        scheduler = Scheduler(model, max_running=4, decode_tail=words)
        other = scheduler.submit(GenerateInput("other", [5, 6], GREEDY, False))
        future = scheduler.submit(GenerateInput("s", prompt, params, True, None, 3))
        run_with_retraction(scheduler, 4, retract)
        result = future.result(timeout=0)
        assert result.output_ids == free[:end]
        assert result.finish_reason == {"type": "stop", "matched": stop}
        tops = result.output_top_logprobs
        assert tops is not None and len(tops) == end and all(len(t) == 3 for t in tops)
        assert [t[0][1] for t in tops] == free[:end]  # greedy: the most likely was drawn
        assert other.result(timeout=0).output_top_logprobs is None


@pytest.mark.timeout(60)
def test_an_abort_in_the_waiting_queue_answers_with_the_tokens_sglangs_tokenizer_had(
    models: tuple[Path, Path],
) -> None:
    """A retracted sample aborted while it waits is answered by SGLang's tokenizer
    (``_handle_abort_req``) with the tokens it had been sent (``state.output_ids``): a request
    not streamed gets its output handed over every 50 tokens (``OutputStreamer.accept``,
    ``DEFAULT_FORCE_STREAM_INTERVAL``), so those up to the last multiple of 50, their
    log-probs and versions; none (fewer than 50): the version of its first span; a stream
    gets the tokens its chunks carried."""
    model = load_reference(models[0])
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    calls: list[list[tuple[int, object]]] = []

    first: list[str] = []

    async def run() -> list[SequenceResult]:
        scheduler = Scheduler(model, max_running=4)
        first.append(scheduler.weight_version)
        plain = scheduler.submit(GenerateInput("plain", [3, 9], long, True))
        short = scheduler.submit(GenerateInput("short", [4, 9], long, True))
        streamed = scheduler.submit_async(
            [GenerateInput("streamed", [5, 9], long, True)], stream=calls.append
        )
        for step in range(62):
            if step == 20:  # retracted at 20 tokens; the short one aborted after an update
                scheduler.pause("retract")
                scheduler.set_weight_version("v2")
                scheduler.abort("short")
                scheduler.resume()
            scheduler.step()
            await asyncio.sleep(0)  # the loop takes the stream's hand-overs
        scheduler.pause("retract")
        scheduler.step()
        scheduler.abort(None, abort_all=True)
        scheduler.step()
        await asyncio.sleep(0)
        return [plain.result(timeout=5), short.result(timeout=5), (await streamed)[0]]

    plain, short, streamed = asyncio.run(run())
    waiting = {"type": "abort", "message": "Abort in waiting queue"}
    assert plain.finish_reason == waiting and len(plain.output_ids) == 50
    assert plain.output_token_logprobs is not None and len(plain.output_token_logprobs) == 50
    versions = plain.output_token_weight_versions
    assert len(versions) == 50 and versions[0] == first[0] and versions[-1] == "v2"
    assert short.output_ids == [] and short.output_token_weight_versions == []
    assert short.weight_version == first[0] != "v2"  # its first span's, not the live one
    sent = [e[0] for batch in calls for _, e in batch if not isinstance(e, SequenceResult)]
    assert streamed.finish_reason == waiting and len(sent) > 50
    assert streamed.output_ids == sent


@pytest.mark.timeout(60)
def test_a_sample_aborted_during_an_in_place_pause_ends_at_its_next_pass(
    models: tuple[Path, Path],
) -> None:
    """As SGLang 0.5.23's scheduler (``abort_request`` sets ``to_finish``; the next pass
    appends its token, then ``Req.update_finish_state`` ends it): a running sample aborted
    while paused in place stays until ``resume``, then ends at its next decode pass with that
    pass's token; one retracted meanwhile keeps the mark and ends at the prefill that
    re-admits it, with its token; an ``abort`` pause ends the marked at once."""
    model = load_reference(models[0])
    prompts = {"a": [3, 9, 4], "b": [5, 9, 4], "c": [6, 9, 4]}
    scheduler = Scheduler(model, max_running=4)
    futures = {
        rid: scheduler.submit(GenerateInput(rid, p, GREEDY, True)) for rid, p in prompts.items()
    }
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def held(rid: str, then: str = "") -> list[int]:
        """Pause in place, abort ``rid`` (then pause again in mode ``then``): its tokens
        before."""
        scheduler.pause("in_place")
        scheduler.step()
        before = scheduler.outputs_so_far()[rid]
        scheduler.abort(rid)
        if then:
            scheduler.pause(then)
        assert scheduler.step() is False  # paused: no pass
        return before

    for _ in range(4):
        scheduler.step()
    before = held("a")
    assert not futures["a"].done() and scheduler.counts()["num_running_reqs"] == 3
    scheduler.resume()
    scheduler.step()
    a = futures["a"].result(timeout=0)
    assert a.finish_reason == aborted and len(a.output_ids) == len(before) + 1
    assert a.output_ids == hf_greedy(model, prompts["a"], len(a.output_ids))
    before = held("b", then="retract")
    assert not futures["b"].done()
    scheduler.resume()
    scheduler.step()  # b's prefill again, then a decode pass of c's
    b = futures["b"].result(timeout=0)
    assert b.finish_reason == aborted and len(b.output_ids) == len(before) + 1
    assert b.output_ids == hf_greedy(model, prompts["b"], len(b.output_ids))
    before = held("c", then="abort")
    c = futures["c"].result(timeout=0)
    assert c.finish_reason == aborted and c.output_ids == before
    assert scheduler.counts()["num_running_reqs"] == 0


@pytest.mark.timeout(60)
def test_streamed_tokens_go_out_every_stream_interval(models: tuple[Path, Path]) -> None:
    """SGLang 0.5's rule (``OutputStreamer.accept``): with an interval k > 1 a streamed
    sequence's tokens go out once it has 1, k + 1, 2k + 1... of them (the first, then whenever
    k are unsent), with 1 after every token; a request's own ``stream_interval`` before the
    server's; the last token comes with the whole result."""
    model = load_reference(models[0])
    base = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    calls: list[list[tuple[int, object]]] = []

    async def run() -> None:
        scheduler = Scheduler(model, max_running=4, stream_interval=2)
        inputs = [
            GenerateInput(f"s{k}", [5, 6], dataclasses.replace(base, stream_interval=k), False)
            for k in (None, 3, 1)
        ]
        future = scheduler.submit_async(inputs, stream=calls.append)
        scheduler.run_until_idle()
        await future

    asyncio.run(run())
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    sent: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals: dict[int, SequenceResult] = {}
    for batch in calls:
        for index, event in batch:
            if isinstance(event, SequenceResult):
                finals[index] = event
            else:
                tokens[index].append(event[0])
        for index in {i for i, e in batch if not isinstance(e, SequenceResult)}:
            sent[index].append(len(tokens[index]))
    assert sent == {0: [1, 3, 5, 7], 1: [1, 4, 7], 2: [1, 2, 3, 4, 5, 6, 7]}
    for index in range(3):  # every token, the held ones too, in order
        assert tokens[index] == finals[index].output_ids[:7]
        assert len(finals[index].output_ids) == 8
    with pytest.raises(ValueError, match="stream_interval"):
        Scheduler(model, stream_interval=0)


@pytest.mark.timeout(60)
def test_a_streamed_request_gets_one_hand_over_per_model_pass(models: tuple[Path, Path]) -> None:
    """A request's samples that finish together come to its stream in one call (one write of
    the server's), after the tokens of the passes before, each pass in a call of its own even
    while the loop has taken none of them yet; a sample that finishes later comes with the
    tokens of the others in its pass."""
    model = load_reference(models[0])
    calls: list[list[tuple[int, object]]] = []

    async def run() -> None:
        scheduler = Scheduler(model, max_running=8)
        params = [
            SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (3, 3, 3, 4)
        ]
        inputs = [GenerateInput(f"s{i}", [5, 6], p, False) for i, p in enumerate(params)]
        future = scheduler.submit_async(inputs, stream=calls.append)
        scheduler.run_until_idle()  # every call waits for the loop, which runs after
        await future

    asyncio.run(run())
    kinds = [
        sorted((index, isinstance(event, SequenceResult)) for index, event in batch)
        for batch in calls
    ]
    tokens = [(i, False) for i in range(4)]
    # the prefill's first tokens, the first decode's, then three samples' results with the
    # fourth's third token, then its result
    assert kinds == [tokens, tokens, [(0, True), (1, True), (2, True), (3, False)], [(3, True)]]


@pytest.mark.timeout(60)
def test_a_streamed_chunk_waits_while_its_text_may_be_ending_in_a_stop_string(
    models: tuple[Path, Path],
) -> None:
    """SGLang 0.5 (``OutputStreamer.accept``, ``Req.check_match_stop_str_prefix``): a chunk
    that is due is not sent while the text of the sequence's last tokens ends in the start of
    a stop string; its tokens go out with the next chunk that is sent, none lost. With an
    interval k, that next chunk comes as soon as k or more are unsent."""
    model = load_reference(models[0])
    prompt = [3, 9, 27]
    free = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    free = free[0, len(prompt) :].tolist()
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 (the "tokenizer")
    stop = words(free[3:5]) + " never"  # the 4th and 5th tokens start it; it never matches

    def starts_stop(k: int) -> bool:  # the text of the first k tokens ends in the start of it
        text = words(free[:k])
        return any(text.endswith(stop[:i]) for i in range(1, len(stop) + 1))

    for every in (1, 2):
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=12,
            ignore_eos=True,
            stop=(stop,),
            stop_window=8,
            stream_interval=every,
        )
        calls: list[list[tuple[int, object]]] = []

        async def run(params: SamplingParams = params, calls: list = calls) -> None:
            scheduler = Scheduler(model, max_running=4, decode_tail=words)
            future = scheduler.submit_async(
                [GenerateInput("s", prompt, params, False)], stream=calls.append
            )
            scheduler.run_until_idle()
            await future

        asyncio.run(run())
        tokens: list[int] = []
        sent: list[int] = []  # how many tokens had come with each chunk sent
        for batch in calls:
            if any(isinstance(e, SequenceResult) for _, e in batch):
                (final,) = [e for _, e in batch if isinstance(e, SequenceResult)]
                continue
            tokens += [e[0] for _, e in batch]
            sent.append(len(tokens))
        assert starts_stop(4) and starts_stop(5)
        unsent, expected = 0, []
        for k in range(1, 12):  # the rule, after each token but the last
            unsent += 1
            if (every == 1 or unsent >= every or k == unsent) and not starts_stop(k):
                expected.append(k)
                unsent = 0
        assert 4 not in sent and 5 not in sent and 6 in sent, sent
        assert sent == expected
        assert tokens == final.output_ids[: sent[-1]] and final.output_ids == free


@pytest.mark.timeout(60)
def test_max_running_bounds_the_batch(models: tuple[Path, Path]) -> None:
    scheduler = Scheduler(load_reference(models[0]), max_running=2)
    futures = [scheduler.submit(GenerateInput(f"q{i}", [5, 6], GREEDY, False)) for i in range(5)]
    scheduler.step()
    assert scheduler.counts() == {"num_running_reqs": 2, "num_waiting_reqs": 3}
    scheduler.run_until_idle()
    outputs = {tuple(f.result(timeout=0).output_ids) for f in futures}
    assert len(outputs) == 1  # same prompt, greedy: same tokens whatever the batch


@pytest.mark.timeout(60)
def test_prompt_logprobs_agree_on_both_forward_paths(models: tuple[Path, Path]) -> None:
    """``logprob_start_len`` through the engine's own passes and through ``model(...)`` (the
    path of models that are not Llama-shaped): the same log-probs, and transformers' own."""
    model = load_reference(models[0])
    prompts = [[3, 9, 27, 4, 11], [8, 8, 2]]
    results = {}
    for fast in (True, False):
        scheduler = Scheduler(model, max_running=4, fast_forward=fast)
        futures = [
            scheduler.submit(
                GenerateInput(f"s{i}", p, SamplingParams(max_new_tokens=0), True, None, 2, 1)
            )
            for i, p in enumerate(prompts)
        ]
        scheduler.run_until_idle()
        results[fast] = [f.result(timeout=0) for f in futures]
    with torch.no_grad():
        for prompt, a, b in zip(prompts, results[True], results[False], strict=True):
            assert a.output_ids == [] and a.finish_reason == {"type": "length", "length": 0}
            assert [t for _, t in a.input_token_logprobs] == prompt[1:]
            assert a.input_token_logprobs[0][0] is None and a.input_top_logprobs[0] is None
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
            want = [expected[p - 1, prompt[p]].item() for p in range(2, len(prompt))]
            terms = forward_terms(model.config, len(prompt))
            assert_close([lp for lp, _ in a.input_token_logprobs[1:]], want, terms=terms)
            assert_close([lp for lp, _ in b.input_token_logprobs[1:]], want, terms=terms)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are Linux's")
def test_the_scheduler_thread_is_named_engine_for_the_operating_system(
    models: tuple[Path, Path],
) -> None:
    """Tools tell an in-process engine's work from its host's by it (bench/stage_cpu.py)."""
    scheduler = Scheduler(load_reference(models[0]), max_running=2)
    scheduler.start()
    try:
        done = scheduler.submit(GenerateInput("a", [7, 8, 9], GREEDY, True))
        assert done.result(timeout=30).output_ids
        assert scheduler._thread is not None
        comm = Path(f"/proc/self/task/{scheduler._thread.native_id}/comm").read_text()
        assert comm.strip() == "engine"
    finally:
        scheduler.stop()
