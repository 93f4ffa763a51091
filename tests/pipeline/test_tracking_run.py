"""Trackers through a real ``inflight run``: written by the supervisor, read back with each
tool's reader; a tracker that cannot write is logged once, counted, and the run goes on."""

from __future__ import annotations

import json

import pytest

from tests.pipeline.runs import REPO, events, run_inflight
from tests.pipeline.test_tracking import read_wandb_history

STEPS = 8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_default_run_feeds_all_three_trackers_and_draws_its_plot(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("matplotlib")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)  # the defaults: offline, in the run directory
    run_dir = tmp_path / "run"
    done = run_inflight(
        "run",
        str(REPO / "configs" / "default.yaml"),
        f"stages.learner.steps={STEPS}",
        "run.trackers=[tensorboard, wandb, mlflow]",
        "run.plot=true",
        "--run-dir",
        str(run_dir),
        "-q",
        timeout=100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"plot: {run_dir / 'plot.png'}" in done.stdout
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and "trackers" not in summary  # none failed
    assert not [e for e in events(run_dir, "supervisor") if e["event"] == "tracker_failed"]
    steps = list(range(1, STEPS + 1))

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [s.step for s in tb.Scalars("train/reward")] == steps
    assert [s.step for s in tb.Scalars("eval/accuracy")] == [0, STEPS]
    # the other stages' metrics arrive too (every replica's final channel metrics at least)
    assert tb.Scalars("channels/generator/out.rollouts.sent")[-1].value > 0

    rows, config = read_wandb_history(run_dir)
    assert sorted(r["learner_step"] for r in rows if "train/reward" in r) == steps
    assert config["stages"]["learner"]["steps"] == STEPS

    ids = json.loads((run_dir / "trackers.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store so
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/reward")] == steps
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["stages.learner.steps"] == str(STEPS)


@pytest.mark.timeout(60)
def test_a_tracker_that_cannot_write_is_logged_once_counted_and_the_run_goes_on(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("a file where the log directory should be")
    done = run_inflight(
        "run",
        str(REPO / "configs" / "example.yaml"),
        "stages.numbers.count=600",
        "run.metrics_every_s=0.5",
        "run.trackers=[tensorboard]",
        "--run-dir",
        str(run_dir),
        "-q",
        timeout=50,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    failed = [e for e in events(run_dir, "supervisor") if e["event"] == "tracker_failed"]
    assert len(failed) == 1
    assert failed[0]["tracker"] == "tensorboard" and failed[0]["component"] == "trackers"
    assert failed[0]["phase"] == "open"
    trackers = json.loads((run_dir / "summary.json").read_text())["trackers"]
    assert trackers["tensorboard"]["written"] == 0 and trackers["tensorboard"]["dropped"] > 0
    assert "tensorboard" in trackers["tensorboard"]["error"]
