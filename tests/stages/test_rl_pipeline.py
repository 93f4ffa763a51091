"""The whole RL loop as a user runs it: feeder -> generator (+ engine) -> scorer -> learner.

A random tiny model on the arithmetic task (it learns nothing in a few steps; these tests check
the loop, not the learning: ``test_default_config`` does that). Every run is ``inflight run`` in
a subprocess with real engines, ZeroMQ channels, DeepSpeed on gloo and weight publishing.
"""

from __future__ import annotations

import json

import pytest

from tests.pipeline.runs import events, run_inflight
from tests.stages.rl_config import rl_config as _config
from tests.stages.tiny_model import make_arith_model

pytestmark = pytest.mark.slow

_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_arith_model(tmp_path_factory.mktemp("model") / "arith", seed=0)


def _run(config, run_dir, *more, timeout=170):
    result = run_inflight(
        "run", str(config), *more, "--run-dir", str(run_dir), "-q", timeout=timeout, env=_ENV
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(180)
def test_async_loop_trains_publishes_evaluates_and_checkpoints(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    # debug: the engine's and publisher's per-update events are looked at below
    summary = _run(_config(tmp_path, model_dir), run_dir, "run.log_level=debug")
    for key in (
        "eval_before",
        "eval_after",
        "steps",
        "samples",
        "wall_s",
        "mean_lag",
        "tis_clip_frac",
        "ess",
    ):
        assert key in summary, key
    assert summary["steps"] == 4 and summary["samples"] == 64
    assert summary["policy_version"] == 4 and summary["publishes"]["published"] == 4
    assert summary["status"] == "succeeded"
    # same weights and kernels on CPU: the sampler's log-probs are the learner's
    assert summary["mismatch_kl"] < 1e-4 and summary["ess"] > 0.99
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(e["lag_max"] <= 2 for e in steps)  # max_lag holds at the learner
    # the engine received every version while generating
    applied = {
        e["weight_version"]
        for e in events(run_dir, "generator-0-engine.0")
        if e["event"] == "weight_version_set"
    }
    assert {1, 2, 3, 4} <= {int(v) for v in applied}
    # the final checkpoint is a Hugging Face folder transformers can load
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = run_dir / "checkpoints" / "step-000004"
    assert (last / "COMPLETE").exists() and (last / "model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(last)
    assert AutoTokenizer.from_pretrained(last)("1+2=")["input_ids"]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-000002", "step-000004"]


@pytest.mark.timeout(200)
def test_sync_mode_trains_on_fresh_samples_only(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    summary = _run(_config(tmp_path, model_dir, steps=3, mode="sync"), run_dir)
    assert summary["steps"] == 3
    assert summary["mean_lag"] == 0 and summary["stale_dropped"] == 0
    batches = [e for e in events(run_dir, "generator.0") if e["event"] == "sync_batch_done"]
    assert len(batches) >= 2


@pytest.mark.timeout(240)
def test_two_learner_ranks_zero2(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    summary = _run(_config(tmp_path, model_dir, steps=3, learners=2, zero=2), run_dir)
    assert summary["steps"] == 3 and summary["samples"] == 48
    ready = [e for e in events(run_dir, "learner.*") if e["event"] == "deepspeed_ready"]
    assert sorted(e["rank"] for e in ready) == [0, 1] and all(e["world"] == 2 for e in ready)
    # each rank saved its own groups (taken uids, part-trained groups) with the checkpoint
    groups = sorted((run_dir / "checkpoints" / "step-000002" / "groups").glob("rank-*.json"))
    assert [g.name for g in groups] == ["rank-0.json", "rank-1.json"]
    seen = [set(json.loads(g.read_text())["seen"]) for g in groups]
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # each rank took groups of its own


def _feeder_saved_next(run_dir) -> int:
    try:
        return int(json.loads((run_dir / "state" / "feeder.0.json").read_text())["next"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.timeout(300)
def test_a_killed_supervisor_resumes_to_the_same_end_on_its_schedule(tmp_path, model_dir):
    import os
    import signal

    from stages.learner.config import OptimConfig
    from stages.learner.trainer import lr_factor
    from tests.pipeline.runs import alive, kill_tree, spawned_pids, start_inflight, wait_for

    steps, schedule = (
        20,  # steps of this tiny model take tens of milliseconds: room to kill it midway
        ["stages.learner.optim.warmup_steps=3", "stages.learner.optim.schedule=cosine"],
    )
    config = _config(tmp_path, model_dir, steps=steps)
    run_dir = tmp_path / "run"
    proc = start_inflight("run", str(config), *schedule, "--run-dir", str(run_dir), "-q", env=_ENV)

    def trained() -> list[dict]:
        return [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]

    try:
        wait_for(lambda: len(trained()) >= 5, 150, "5 train steps")
        # and the feeder has saved a position past its first prompts (acknowledgements chain
        # back to it from the learner, so 5 fast steps of this tiny model can beat them)
        wait_for(lambda: _feeder_saved_next(run_dir) > 0, 30, "the feeder to save its position")
        os.kill(proc.pid, signal.SIGKILL)  # the supervisor, as a crash or the OOM killer would
        proc.wait(timeout=10)
        # its replicas follow it (they watch their parent)
        wait_for(lambda: not any(map(alive, spawned_pids(run_dir))), 30, "the replicas to exit")
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    killed_at = max(e["step"] for e in trained())
    assert killed_at < steps
    # a checkpoint newer than the last one, whose writing was cut short (no COMPLETE marker),
    # must never be loaded (checkpoints are taken every 2 steps: this one's step is odd)
    partial = run_dir / "checkpoints" / f"step-{killed_at + 1 + killed_at % 2:06d}"
    (partial / "deepspeed").mkdir(parents=True)
    (partial / "deepspeed" / "latest").write_text("state")
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    result = run_inflight(
        "run", str(config), *schedule, "--resume", str(run_dir), "-q", timeout=170, env=_ENV
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    assert "eval_before" in summary  # kept from the first run
    (resumed,) = [e for e in events(run_dir, "learner.0") if e["event"] == "learner_resumed"]
    assert resumed["step"] % 2 == 0 and resumed["step"] <= killed_at  # a checkpoint every 2
    after = [e for e in trained() if e["ts"] > resumed["ts"]]
    assert [e["step"] for e in after] == list(range(resumed["step"] + 1, steps + 1))
    # the learning-rate schedule goes on where the checkpoint left it (not from warm-up again)
    optim = OptimConfig(lr=0.001, warmup_steps=3, schedule="cosine")
    for e in trained():
        expected = 0.001 * lr_factor(e["step"] - 1, optim=optim, horizon=steps)
        assert e["lr"] == pytest.approx(expected, abs=1e-5)  # logged to 5 decimals
    # the feeder goes on from its saved position; the resumed run's ledger balances
    fed = [e for e in events(run_dir, "feeder.0") if e["event"] == "feeder_resumed"]
    assert fed and fed[-1]["next"] > 0
    assert summary["ledger"]["unaccounted"] == 0 and "incomplete" not in summary["ledger"]
