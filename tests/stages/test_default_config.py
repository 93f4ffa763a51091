"""``configs/default.yaml``, shortened, end to end in CI: the shipped model, every stage, eval.

The full run (350 steps, about two minutes) is what the README's first command does and what
``bench/async_vs_sync.py`` measures; here a few steps check that the shipped config and model
work together as a user starts them and that the run leaves its summary.
"""

from __future__ import annotations

import pytest

from tests.pipeline.runs import REPO, events, run_to_summary

pytestmark = pytest.mark.slow


def _three_steps(run_dir, *overrides: str) -> dict:
    """The default config shortened to 3 steps (a smaller eval, no checkpoints), run to its
    summary."""
    return run_to_summary(
        "configs/default.yaml",
        run_dir,
        "stages.learner.steps=3",
        "stages.learner.eval.max_prompts=40",
        "stages.learner.checkpoint.every=0",
        *overrides,
        timeout=230,
    )


@pytest.mark.timeout(240)
def test_default_config_shortened_runs_to_its_summary(tmp_path):
    assert (REPO / "configs/models/arith-tiny/model.safetensors").exists()
    run_dir = tmp_path / "run"
    summary = _three_steps(run_dir)
    assert summary["steps"] == 3 and summary["samples"] == 3 * 256
    # groups whose rewards were all equal had no passes, and the ledger says so
    samples = summary["ledger"]["samples"]
    assert 0 < summary["no_signal"] == samples["no_signal"] < 3 * 256
    assert samples["trained"] + samples["no_signal"] == 3 * 256
    # the shipped model starts partly right (warm start), never above 0.6
    assert 0.2 <= summary["eval_before"] <= 0.6
    assert summary["status"] == "succeeded"
    evals = [e for e in events(run_dir, "learner.0") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3]
    assert (run_dir / "checkpoints" / "step-000003" / "model.safetensors").exists()


@pytest.mark.timeout(240)
def test_dynamic_sampling_fills_each_step_with_groups_that_carry_signal(tmp_path):
    run_dir = tmp_path / "run"
    summary = _three_steps(run_dir, "stages.learner.dynamic_sampling=true")
    assert summary["steps"] == 3 and summary["samples"] == 3 * 256
    # every sample of every step is in a group whose rewards differ; the others were set aside
    # (processed: acknowledged, their fate no_signal), and the ledger balances
    samples = summary["ledger"]["samples"]
    assert summary["no_signal"] == 0 and samples["trained"] == 3 * 256
    assert summary["set_aside"] > 0 and samples["no_signal"] == summary["set_aside"]
    assert summary["ledger"]["unaccounted"] == 0
    (done,) = [e for e in events(run_dir, "learner.0") if e["event"] == "learner_done"]
    assert done["set_aside"] == summary["set_aside"]


@pytest.mark.timeout(240)
def test_a_lora_learner_sends_its_adapters_as_files_that_requests_name(tmp_path):
    """``publish.lora_transport: files`` (how SGLang takes adapters), on the built-in engine,
    which speaks the same routes: each version's adapter is a peft folder loaded by name, the
    older ones unloaded and removed, and samples come from the adapter of their version."""
    run_dir = tmp_path / "run"
    summary = _three_steps(
        run_dir,
        "stages.learner.lora.rank=4",
        "stages.learner.optim.lr=0.01",
        "stages.learner.publish.lora_transport=files",
        "run.mode=sync",  # samples of the learner's own version: no mismatch unless misnamed
    )
    assert summary["status"] == "succeeded" and summary["steps"] == 3
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == [
        "policy-v2",
        "policy-v3",
    ]
    engine = [e for e in events(run_dir, "host") if "lora_name" in e]  # the shared process
    loaded = [e["lora_name"] for e in engine if e["event"] == "lora_adapter_loaded"]
    unloaded = [e["lora_name"] for e in engine if e["event"] == "lora_adapter_unloaded"]
    assert loaded == ["policy-v1", "policy-v2", "policy-v3"] and unloaded == loaded[:2]
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    # sampled by the adapter the learner trains: no mismatch (38 and 60 at steps 2 and 3
    # when requests name no adapter: the base model samples)
    assert [e["lag_max"] for e in steps] == [0, 0, 0]
    assert all(e["mismatch_kl"] < 1e-3 for e in steps), steps
    evals = [e for e in events(run_dir, "learner.0") if e["event"] == "eval"]
    assert [e["versions"] for e in evals] == [[0], [3]]
