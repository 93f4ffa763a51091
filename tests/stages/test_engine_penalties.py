"""SGLang's penalties and logit bias on the built-in engine (``stages.engine.sampling``):
``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``, ``min_new_tokens`` and
``logit_bias`` against a reference written from SGLang 0.5's penalizers
(``srt/sampling/penaltylib/frequency_penalty.py`` ``_cumulate_output_tokens``/``_apply``,
``presence_penalty.py``, ``repetition_penalty.py`` ``apply_scaling_penalties``,
``min_new_tokens.py``; ``sampling_batch_info.py`` ``apply_logits_bias``: additive, then scaling,
then the bias) over a plain transformers forward; their checks as ``SamplingParams.verify``
has them (``sampling_params.py``); through the scheduler (rows joining, leaving and moving, a
retraction) and the routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from stages.engine.openai_chat import ChatSettings, chat_request
from stages.engine.protocol import GenerateInput, RequestError, SamplingParams, parse_generate
from stages.engine.sampling import SlotSampler
from stages.engine.scheduler import Scheduler
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import load_reference, two_tiny_models
from tests.stages.tiny_model import EOS_ID

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

EOS = frozenset({EOS_ID})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return two_tiny_models(tmp_path_factory)


def _penalized(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """SGLang's penalizers on one row of logits, from the output so far (dense, as there)."""
    x = logits.clone().float()
    vocab = x.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
    x -= params.frequency_penalty * counts  # scatter_add_ of the penalty per output token
    x -= params.presence_penalty * (counts > 0).float()  # scatter_ of the penalty
    if len(output) < params.min_new_tokens:
        stops = torch.zeros(vocab)
        stops[sorted(EOS | params.stop_token_ids)] = float("-inf")
        x += stops
    scale = torch.where(counts > 0, params.repetition_penalty, 1.0)
    x = torch.where(x < 0, x * scale, x / scale)
    bias = torch.zeros(vocab)
    for token, value in params.logit_bias:
        bias[token] = value
    return x + bias


@torch.no_grad()
def _reference(model: torch.nn.Module, prompt: list[int], params: SamplingParams):
    """Greedy decoding of ``prompt`` under ``params``' penalties with full forwards: the
    output ids and each one's log-prob under the penalized distribution."""
    output: list[int] = []
    logprobs: list[float] = []
    for _ in range(params.max_new_tokens):
        logits = model(torch.tensor([prompt + output])).logits[0, -1]
        x = _penalized(logits, params, output)
        token = int(x.argmax())
        logprobs.append(float(torch.log_softmax(x, -1)[token]))
        output.append(token)
        if not params.ignore_eos and token in EOS | params.stop_token_ids:
            break
    return output, logprobs


def _greedy(n: int, **kw: Any) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def _check(model: torch.nn.Module, prompt: list[int], params: SamplingParams, result) -> None:
    ids, lps = _reference(model, prompt, params)
    assert result.output_ids == ids
    assert_close(
        result.output_token_logprobs,
        lps,
        terms=forward_terms(model.config, len(prompt) + len(ids)),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_penalized_rows_match_sglangs_penalizers_while_rows_join_leave_and_move(
    models: tuple[Path, Path], fast: bool
) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(
        load_reference(models[0]), max_running=6, eos_token_ids=EOS, fast_forward=fast
    )
    plain = _reference(model, [7, 8, 9], _greedy(6))[0]
    eos_up = ((EOS_ID, 60.0),)
    cases = {
        "short": ([40], _greedy(2)),  # leaves first: the rows after it move
        "freq": ([7, 8, 9], _greedy(14, frequency_penalty=1.5, presence_penalty=0.5)),
        "rep": ([7, 8, 9], _greedy(14, repetition_penalty=1.9)),
        "negative": ([3, 4], _greedy(10, frequency_penalty=-2.0, presence_penalty=-1.0)),
        # EOS pushed up: without min_new_tokens the first token would end it
        "min": ([5, 6], _greedy(12, ignore_eos=False, min_new_tokens=6, logit_bias=eos_up)),
        "bias": ([7, 8, 9], _greedy(6, logit_bias=((plain[0], -80.0), (33, 5.0)))),
    }
    futures = {
        rid: scheduler.submit(GenerateInput(rid, p, sp, True)) for rid, (p, sp) in cases.items()
    }
    for _ in range(3):
        scheduler.step()
    # joining slots that penalized rows left or moved from: a plain row finds nothing there
    late = {
        "late": ([11, 12], _greedy(8, presence_penalty=2.0, repetition_penalty=1.3)),
        "plain": ([13, 14], _greedy(9)),
        "plain2": ([15], _greedy(7)),
    }
    for rid, (prompt, sp) in late.items():
        futures[rid] = scheduler.submit(GenerateInput(rid, prompt, sp, True))
    scheduler.run_until_idle()
    for rid, (prompt, sp) in {**cases, **late}.items():
        _check(model, prompt, sp, futures[rid].result(timeout=0))
    mins = futures["min"].result(timeout=0)
    assert len(mins.output_ids) == 7 and mins.output_ids[-1] == EOS_ID  # EOS as soon as allowed
    assert mins.finish_reason == {"type": "stop", "matched": EOS_ID}
    assert futures["bias"].result(timeout=0).output_ids[0] != plain[0]
    # the penalties changed something: the penalized rows differ from the plain greedy ones
    unpenalized = _reference(model, [7, 8, 9], _greedy(14))[0]
    assert futures["rep"].result(timeout=0).output_ids != unpenalized


@pytest.mark.timeout(60)
def test_a_retracted_sequence_keeps_counting_the_tokens_it_made(models: tuple[Path, Path]) -> None:
    model = load_reference(models[0])
    scheduler = Scheduler(load_reference(models[0]), max_running=4, eos_token_ids=EOS)
    params = _greedy(12, frequency_penalty=2.0, repetition_penalty=1.5)
    future = scheduler.submit(GenerateInput("r", [3, 4, 5], params, True))
    for _ in range(5):
        scheduler.step()
    scheduler.pause("retract")
    scheduler.step()
    assert scheduler.counts() == {"num_running_reqs": 0, "num_waiting_reqs": 1}
    scheduler.resume()
    scheduler.run_until_idle()
    _check(model, [3, 4, 5], params, future.result(timeout=0))


@pytest.mark.timeout(60)
def test_top_logprobs_are_read_after_the_penalties(models: tuple[Path, Path]) -> None:
    scheduler = Scheduler(load_reference(models[0]), max_running=2, eos_token_ids=EOS)
    params = _greedy(4, logit_bias=((21, 30.0),))
    future = scheduler.submit(GenerateInput("t", [9, 10], params, True, top_logprobs_num=2))
    scheduler.run_until_idle()
    result = future.result(timeout=0)
    assert result.output_ids == [21] * 4
    for (best, _), lp in zip(result.output_top_logprobs, result.output_token_logprobs, strict=True):
        assert best[1] == 21 and best[0] == pytest.approx(lp, abs=1e-6)


def test_the_sampler_moves_a_rows_penalty_with_it_and_clears_it_when_it_leaves() -> None:
    sampler = SlotSampler(3, EOS, torch.Generator().manual_seed(0))
    biased = _greedy(5, logit_bias=((4, 9.0),), frequency_penalty=1.0)
    other = _greedy(5, presence_penalty=0.5)
    sampler.add([_greedy(5), other, biased], [5] * 3, [None] * 3, [[], [6], [4, 4]])
    logits = torch.zeros(3, 8)
    sampler.penalize(logits, 0, 3)
    assert logits[2, 4] == 9.0 - 2.0 and logits[1, 6] == -0.5 and logits[1].count_nonzero() == 1
    assert not logits[0].any()
    sampler.remove([0], [2], [0])  # row 0 leaves, the biased row moves into its slot
    assert sampler.penalties.active == {0, 1}
    logits = torch.zeros(2, 8)
    sampler.penalize(logits, 0, 2)
    assert logits[0, 4] == 7.0 and logits[0].count_nonzero() == 1
    tokens, _ = sampler.sample(logits, 0, 2)
    assert tokens[0] == 4
    logits = torch.zeros(2, 8)
    sampler.penalize(logits, 0, 2)
    assert logits[0, 4] == 6.0  # the drawn token counted
    sampler.remove([0], [1], [0])  # the biased row leaves, the other moves into its slot
    sampler.add([_greedy(5)], [5], [None])  # a plain row takes the slot moved from
    logits = torch.zeros(2, 8)
    sampler.penalize(logits, 0, 2)
    assert not logits[1].any() and logits[0, 6] == -0.5  # nothing of the others is left
    sampler.clear()
    assert not sampler.penalties


def test_penalties_are_checked_as_sglang_checks_them() -> None:
    def parse(sampling: dict[str, Any]) -> SamplingParams:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, **sampling}}
        return parse_generate(body, vocab_size=50, context_length=64, encode=None)[0][0].params

    bad = [
        ({"frequency_penalty": 2.5}, "frequency_penalty: must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty: must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty: must be in (0, 2]"),
        ({"repetition_penalty": 2.5}, "repetition_penalty: must be in (0, 2]"),
        ({"min_new_tokens": 9}, "min_new_tokens: must be in [0, max_new_tokens (8)], got 9"),
        ({"min_new_tokens": 1.5}, "min_new_tokens: expected an integer"),
        ({"frequency_penalty": "high"}, "frequency_penalty: expected a finite number"),
        ({"logit_bias": [1]}, "logit_bias: expected an object"),
        ({"logit_bias": {"a": 1}}, "logit_bias.a: keys must be token ids"),
        ({"logit_bias": {"50": 1}}, "logit_bias: keys must be token ids in [0, 49], got 50"),
        ({"logit_bias": {"3": "up"}}, "logit_bias.3: expected a finite number"),
    ]
    for sampling, words in bad:
        with pytest.raises(RequestError) as info:
            parse(sampling)
        assert words in str(info.value), (sampling, str(info.value))
    # SGLang keys the bias by int(key): "7" and "07" are one token, the later value kept
    assert parse({"logit_bias": {"7": 1, "07": -2.5, "3": 0}}).logit_bias == ((7, -2.5), (3, 0.0))
    neutral = parse({"frequency_penalty": None, "repetition_penalty": 1, "logit_bias": {},
                     "min_new_tokens": 0, "custom_params": {"a": 1}})  # fmt: skip
    assert not neutral.penalized


def test_a_chat_models_generation_config_repetition_penalty_is_taken(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    # Qwen2.5's instruct models ship repetition_penalty 1.05 in generation_config.json: every
    # chat request that does not set its own takes it (it was refused before penalties came)
    (tmp_path / "generation_config.json").write_text('{"repetition_penalty": 1.05}')
    tokenizer = PreTrainedTokenizerFast.from_pretrained(models[0])  # as the engine loads it
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    settings = ChatSettings.of(tokenizer, tmp_path, chat_template=template)
    assert settings is not None
    # SGLang's --sampling-defaults openai: generation_config.json is not read
    plain = ChatSettings.of(tokenizer, tmp_path, chat_template=template, sampling_defaults="openai")
    assert plain is not None
    for chat, body, expected in (
        (settings, {}, 1.05), (settings, {"repetition_penalty": 1.2}, 1.2), (plain, {}, 1.0),
        (plain, {"repetition_penalty": 1.2}, 1.2),
    ):  # fmt: skip
        native, _ = chat_request({"messages": [{"role": "user", "content": "w5"}], **body},
                                 chat, 64)  # fmt: skip
        sp = parse_generate(native, vocab_size=tokenizer.vocab_size, context_length=64,
                            encode=tokenizer.encode)[0][0].params  # fmt: skip
        assert sp.repetition_penalty == expected and sp.penalized is (expected != 1.0)
