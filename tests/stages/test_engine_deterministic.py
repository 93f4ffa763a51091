"""SGLang's ``--enable-deterministic-inference`` on the engine's own passes
(``stages.engine.batch_invariant``): a request's tokens and log-probs are bit for bit the same
alone and in batches of other requests that join and leave at other steps, greedy and sampled
(a row without ``sampling_seed`` draws with SGLang's 42); they are still the model's (transformers'
whole forward within the float tolerance). Without the flag the same batches differ in the last
bits. Models whose passes cannot be made so are refused at start, naming why."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.server import parse_args
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_linear_attention import CONFIGS as HYBRIDS
from tests.stages.test_engine_linear_attention import _model as _hybrid
from tests.stages.test_engine_llama_forward import CONFIGS, EAGER_ONLY, _model

# Llama's layer, q/k norms with a head width of their own, sliding windows of 4 on every
# layer, Gemma 2's (soft caps, a sliding layer then a full one, four norms), Phi-3's LongRoPE
# (its frequencies by the longest position: each row's own), GPT-NeoX's (each head's q, k and
# v together: strided, GELU without a gate), GPT-2's (Conv1D, learned positions) and
# Nemotron's (squared ReLU without a gate, LayerNorm1P); mixtures of
# experts (the model's own blocks): Qwen3-MoE's (a dense layer, then experts), Qwen2-MoE's
# (a shared expert, its gate one element a row), Mixtral's, gpt-oss's (transposed, biased
# experts, a biased router, sinks), OLMoE's and GLM-4-MoE's (a float32 router's sigmoid,
# grouped top-k, shared experts)
FAMILIES = ["llama", "qwen3", "mistral-sliding", "gemma2", "phi3-longrope", "gpt_neox", "gpt2"]
FAMILIES += ["nemotron"]
ROPE_BY_LENGTH = {"phi3-longrope"}
MIXTURES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "olmoe", "glm4_moe"]
MIXTURES += ["deepseek_v2", "deepseek_v3"]  # (their latent attention over the experts)
V = 97  # (SIZES' vocabulary)
STEPS = 6


def _runs(model: torch.nn.Module, deterministic: bool, temperature: float) -> list[dict]:
    """Each of 8 prompts' (tokens, log-probs), and a mixture's routed experts (SGLang's
    ``return_routed_experts``, which rollout routing replay takes to the learner): alone,
    then in two batch layouts (two waves joining at different steps)."""
    routed = hasattr(model.config, "num_experts_per_tok")
    rng = random.Random(3)
    # (lengths shared: rows of one length attend together)
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (5, 9, 5, 14, 9, 9, 21, 14)]
    params = SamplingParams(max_new_tokens=STEPS, temperature=temperature, ignore_eos=True)
    layouts = (
        [[[i]] for i in range(8)],
        [[[0, 1, 2, 3], [4, 5, 6, 7]]],
        [[[7, 2], [0, 1, 3, 4, 5, 6]]],
    )
    answers = []
    for layout in layouts:
        got: dict[int, Any] = {}
        for waves in layout:
            scheduler = Scheduler(
                model, max_running=16, deterministic=deterministic, routed_experts=routed
            )
            futures = []
            for wave in waves:
                inputs = [
                    GenerateInput(
                        f"p{i}", prompts[i], params, True, routed_experts=0 if routed else None
                    )
                    for i in wave
                ]
                futures.append((wave, scheduler.submit_many(inputs)))
                for _ in range(2):
                    scheduler.step()
            scheduler.run_until_idle()
            for wave, future in futures:
                for i, result in zip(wave, future.result(timeout=10), strict=True):
                    got[i] = (
                        result.output_ids,
                        result.output_token_logprobs,
                        result.extra.get("routed_experts"),
                    )
        answers.append(got)
    return [prompts, *answers]


@pytest.mark.numerics  # rerun on every CPU kernel by .ci/run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES + MIXTURES)
@torch.inference_mode()
def test_a_request_answers_alike_alone_and_in_any_batch(family: str) -> None:
    model = _model(CONFIGS[family](), "eager" if family in EAGER_ONLY else "sdpa")
    for temperature in (0.0, 1.0):
        prompts, alone, first, second = _runs(model, True, temperature)
        assert alone == first == second, family
        assert all((routes is not None) == (family in MIXTURES) for *_, routes in alone.values())
    # still the model's answers: greedy, as transformers' whole forwards (LongRoPE's whole
    # forward takes every position's frequencies by the longest, where a decode step computes
    # its own token's alone: as the engine's passes without the flag, run alone)
    prompts, alone, _, _ = _runs(model, True, 0.0)
    _, plain, first, second = _runs(model, False, 0.0)
    terms = forward_terms(model.config, 32)
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        want = []
        for _ in range(STEPS):
            lps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(lps.argmax()))
            want.append(float(lps[ids[-1]]))
        if family in ROPE_BY_LENGTH:
            ids, want = list(prompt) + plain[i][0], plain[i][1]
        assert alone[i][0] == ids[len(prompt) :], (family, i)
        assert_close(alone[i][1], want, terms=terms)
    # without the flag, batches round otherwise (what the flag is for)
    alone = plain
    assert alone != first or alone != second


@pytest.mark.timeout(60)
def test_models_whose_passes_cannot_be_made_batch_invariant_are_refused() -> None:
    with pytest.raises(ValueError, match="runs on transformers'"):
        Scheduler(_hybrid(HYBRIDS["qwen3_5"]()), deterministic=True)
    with pytest.raises(ValueError, match=r"transformers' \(turned off\)"):
        Scheduler(_model(CONFIGS["llama"]()), deterministic=True, fast_forward=False)
    on = Scheduler(_model(CONFIGS["llama"]()), deterministic=True)
    assert on.deterministic and on.prefix_cache_stats()["enabled"] is False
    assert parse_args(
        ["--model", "m", "--enable-deterministic-inference"]
    ).enable_deterministic_inference


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_samples_without_a_seed_draw_with_42_and_with_seeds_of_their_own_differ() -> None:
    """As SGLang's deterministic sampling: a request's samples without ``sampling_seed`` all
    draw with 42, alike (the generator gives each its own: ``sampling.seed``)."""
    scheduler = Scheduler(_model(CONFIGS["llama"]()), max_running=8, deterministic=True)
    prompt = [5, 9, 13, 40]

    def draws(seeds: list[int | None]) -> list[list[int]]:
        inputs = [
            GenerateInput(
                f"s{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=8, temperature=1.0, ignore_eos=True, sampling_seed=seed
                ),
                True,
            )
            for i, seed in enumerate(seeds)
        ]
        future = scheduler.submit_many(inputs)
        scheduler.run_until_idle()
        return [r.output_ids for r in future.result(timeout=10)]

    unseeded = draws([None, None, None])
    assert unseeded[0] == unseeded[1] == unseeded[2] == draws([42])[0]
    seeded = draws([1, 2, 3])
    assert len({tuple(ids) for ids in seeded}) == 3


def test_the_rows_found_give_each_row_what_it_is_alone() -> None:
    """``rows_for``: a number of rows at which each of the products given computes a row
    alike at any place and beside anything; ``linear`` then matches a row computed alone in
    a chunk of as many rows."""
    from stages.engine.batch_invariant import CANDIDATES, linear, rows_for

    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    rows = rows_for([(weight, bias), (torch.randn(200, 48, generator=gen), None)])
    assert rows in CANDIDATES
    x = torch.randn(3 * rows + 5, 48, generator=gen)
    whole = linear(x, weight, bias, rows=rows)
    for i in (0, rows - 1, rows, 3 * rows + 4):
        alone = torch.cat((x[i : i + 1], x.new_zeros(rows - 1, 48)))
        assert torch.equal(whole[i], torch.nn.functional.linear(alone, weight, bias)[0])


def test_the_heads_products_give_each_row_what_it_is_alone() -> None:
    """``batched`` (latent attention's expansion a head): with the rows ``rows_for`` finds
    for its weight ``[heads, in, out]`` (strided, as a head's value expansion is), a row of
    ``[n, heads, in]`` is what it is in a chunk of its own."""
    from stages.engine.batch_invariant import CANDIDATES, batched, rows_for

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 40, 24, generator=gen).transpose(1, 2)  # [heads, 24, 40]
    rows = rows_for([(weight, None)])
    assert rows in CANDIDATES
    x = torch.randn(2 * rows + 3, 6, 24, generator=gen)
    whole = batched(x, weight, rows=rows)
    assert whole.shape == (2 * rows + 3, 6, 40)
    for i in (0, rows, 2 * rows + 2):
        alone = torch.cat((x[i : i + 1], x.new_zeros(rows - 1, 6, 24))).transpose(0, 1)
        assert torch.equal(whole[i], torch.bmm(alone.contiguous(), weight)[:, 0])


@pytest.mark.numerics
@pytest.mark.parametrize("width", [1, 24, 80])
def test_activations_computed_by_rows_give_each_row_what_it_is_alone(width: int) -> None:
    """``by_rows``: an elementwise function whose kernels round an element by where it falls
    in the loop (sigmoid, silu, softplus, gelu; one element a row: a shared expert's gate)
    gives each row what it gives that row alone, at any place among any number of rows."""
    from stages.engine.batch_invariant import by_rows

    x = torch.randn(64, width, generator=torch.Generator().manual_seed(2)) * 3
    functions = (torch.sigmoid, F.silu, F.softplus, F.gelu)
    for function in functions:
        whole = by_rows(function, x)
        torch.testing.assert_close(whole, function(x))  # (the function's values)
        for start, n in ((0, 1), (7, 1), (5, 2), (9, 17), (30, 33)):
            part = by_rows(function, x[start : start + n])
            assert torch.equal(part, whole[start : start + n]), (function, start, n)


@pytest.mark.numerics
@pytest.mark.timeout(120)
@torch.inference_mode()
def test_rows_with_a_lora_adapter_answer_alike_alone_and_beside_others(tmp_path) -> None:
    """An adapter's products run the model's rows at a time too, checked when it loads
    (``batch_invariant.holds``): its rows, and base rows beside them, are bit for bit what
    they are alone; an adapter whose products would not be is refused, naming the flag."""
    from stages.engine import scheduler as scheduler_module
    from stages.engine.loader import load_model
    from stages.engine.lora_adapters import AdapterError
    from tests.stages.test_engine_lora import _adapter
    from tests.stages.tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path / "m", seed=3)
    _adapter(base, tmp_path / "a", seed=1, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = load_model(str(base), device="cpu").model
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 60) for _ in range(n)] for n in (4, 7, 4, 11, 7, 5)]
    params = SamplingParams(max_new_tokens=STEPS, temperature=1.0, ignore_eos=True)

    def run(rows: list[int]) -> dict[int, Any]:
        scheduler = Scheduler(model, max_running=8, deterministic=True)
        loaded = scheduler.load_adapter("a", str(tmp_path / "a"))
        scheduler.run_until_idle()  # (no scheduler thread: this runs its commands)
        loaded.result(timeout=10)
        inputs = [
            GenerateInput(f"p{i}", prompts[i], params, True, lora="a" if i % 2 else None)
            for i in rows
        ]
        future = scheduler.submit_many(inputs)
        scheduler.run_until_idle()
        answers = zip(rows, future.result(timeout=10), strict=True)
        return {i: (r.output_ids, r.output_token_logprobs) for i, r in answers}

    alone: dict[int, Any] = {}
    for i in range(len(prompts)):
        alone |= run([i])
    assert run(list(range(len(prompts)))) == alone == run([5, 0, 3]) | run([1, 2, 4])

    scheduler = Scheduler(model, max_running=8, deterministic=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler_module, "invariant_holds", lambda products, rows: False)
        with pytest.raises(AdapterError, match="--enable-deterministic-inference: adapter 'a'"):
            scheduler.load_adapter("a", str(tmp_path / "a"))
