"""The engine on CUDA draws what it draws on CPU: its sampler's tables follow the logits to the
model's device, and the uniform numbers of its draws come from CPU generators, so a seed gives
the same tokens on either device (up to a draw on the edge of float rounding). Skipped where
CUDA is absent; the device machine runs it (and the server tests with ``--device cuda``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stages.engine.loader import load_model
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=8),
    SamplingParams(temperature=1.0, max_new_tokens=8),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, max_new_tokens=8),
    SamplingParams(temperature=1.0, sampling_seed=7, max_new_tokens=8),
    SamplingParams(
        temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2, max_new_tokens=8,
        stop_token_ids=frozenset({5}), min_new_tokens=2,
    ),
]  # fmt: skip


def _run(model: Path, device: str) -> list[tuple[list[int], list[float]]]:
    loaded = load_model(model, device=device)
    scheduler = Scheduler(loaded.model, max_running=8, eos_token_ids=loaded.eos_token_ids, seed=3)
    inputs = [GenerateInput(f"r{i}", [3, 4, 5, 6], p, True) for i, p in enumerate(PARAMS)]
    future = scheduler.submit_many(inputs)
    scheduler.run_until_idle()
    return [(r.output_ids, r.output_token_logprobs) for r in future.result(timeout=0)]


@pytest.mark.timeout(120)
def test_the_engine_draws_the_same_tokens_on_cuda_as_on_cpu(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", vocab=128, seed=1)
    on_cpu, on_cuda = _run(model, "cpu"), _run(model, "cuda")
    for (ids, lps), (cuda_ids, cuda_lps) in zip(on_cpu, on_cuda, strict=True):
        assert cuda_ids == ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lps, cuda_lps, strict=True))
