"""SGLang's ``--enable-fp32-lm-head`` (``layers/logits_processor.py``: the hidden states and the
head's weight both in float32): a bfloat16 model's sampled tokens' log-probs are the float32
product's, on both of the engine's forward paths, and not the bfloat16 one's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stages.engine.lm_head import fp32_wanted
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.server import parse_args
from tests.stages.tiny_model import spread_weights

PROMPT = [5, 9, 13, 40, 41, 7]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return spread_weights(model, std=0.2).to(torch.bfloat16).eval()


def _run(model: torch.nn.Module, fast: bool, fp32: bool) -> tuple[list[int], list[float], Any]:
    scheduler = Scheduler(
        model, max_running=4, hidden_states_mode="full", fast_forward=fast, fp32_lm_head=fp32
    )
    assert scheduler.forward_path == ("fast" if fast else "transformers")
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    future = scheduler.submit(GenerateInput("r", PROMPT, params, True, hidden_states="full"))
    scheduler.run_until_idle()
    result = future.result(timeout=10)
    block, *steps = result.extra["hidden_states"]
    drawn_from = torch.tensor([block[-1], *steps], dtype=torch.float32)  # a row a token
    return result.output_ids, result.output_token_logprobs, drawn_from


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fast", [True, False], ids=["fast-forward", "transformers-forward"])
@torch.inference_mode()
def test_the_logprobs_are_the_float32_products_of_the_hidden_states(fast: bool) -> None:
    model = _model()
    weight = model.get_output_embeddings().weight.float()
    ids, logprobs, hidden = _run(model, fast, fp32=True)
    want = torch.log_softmax(hidden @ weight.T, dim=-1)  # bfloat16 values, float32 products
    assert ids == want.argmax(-1).tolist()
    chosen = want[torch.arange(len(ids)), torch.tensor(ids)]
    assert max(abs(a - b) for a, b in zip(logprobs, chosen.tolist(), strict=True)) < 2e-5
    # the head in bfloat16: its logits rounded, the log-probs off by far more
    plain_ids, plain, _ = _run(_model(), fast, fp32=False)  # (the same weights)
    pairs = zip(plain_ids, ids, strict=True)
    same = next((k for k, (a, b) in enumerate(pairs) if a != b), len(ids))
    assert same >= 2  # the tokens drawn from the same states (then rounding may pick others)
    apart = [abs(a - b) for a, b in zip(plain[:same], chosen[:same].tolist(), strict=True)]
    assert max(apart) > 1e-3


def test_the_flag_and_the_configs_key_turn_it_on() -> None:
    assert parse_args(["--model", "m", "--enable-fp32-lm-head"]).enable_fp32_lm_head is True
    assert parse_args(["--model", "m"]).enable_fp32_lm_head is False
    config = AutoConfig.for_model("llama")
    assert not fp32_wanted(False, config) and fp32_wanted(True, config)
    config.enable_lm_head_fp32 = True  # SGLang reads it off the config too
    assert fp32_wanted(False, config)
