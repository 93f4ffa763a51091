"""``inflight plot``: a PNG from a run's logs; clear messages when there is nothing to draw."""

from __future__ import annotations

import pytest

from pipeline import plot
from tests.pipeline.runs import run_inflight
from tests.pipeline.test_tracking import append, ev, learner_events

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, steps: int = 30) -> None:
    logs = run_dir / "logs"
    append(logs / "supervisor.jsonl", ev(0, "supervisor", "run_started", stages={"learner": 1}))
    append(logs / "learner.0.jsonl", ev(0.5, "learner.0", "eval", step=0, accuracy=0.5))
    append(logs / "learner.0.jsonl", *learner_events(range(1, steps + 1), start=1))
    append(logs / "learner.0.jsonl", ev(steps + 2, "learner.0", "eval", step=steps, accuracy=0.8))
    append(
        logs / "generator.0.jsonl",
        *(ev(2 * i, "generator.0", "metrics", emitted=300 * i) for i in range(1, steps // 2)),
    )


def test_plot_of_a_run_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    series, walls, start = plot.read_series(tmp_path)
    assert [s for s, _ in series["train/reward"]] == list(range(1, 31))
    assert series["eval/accuracy"] == [(0, 0.5), (30, 0.8)]
    assert series["generator/samples_per_s"][0][1] == pytest.approx(150.0)
    assert walls[0] == (1, pytest.approx(2.0)) and start is not None
    out = plot.write_plot(tmp_path, tmp_path / "pictures" / "run.png")
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 30_000  # four panels of lines, not an empty canvas


@pytest.mark.timeout(60)
def test_plot_command(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "run")
    done = run_inflight("plot", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "run" / "plot.png")
    assert (tmp_path / "run" / "plot.png").read_bytes()[:8] == PNG

    (tmp_path / "young" / "logs").mkdir(parents=True)  # started, no train step yet
    append(tmp_path / "young" / "logs" / "supervisor.jsonl", ev(0, "supervisor", "run_started"))
    young = run_inflight("plot", str(tmp_path / "young"), "--out", str(tmp_path / "y.png"))
    assert young.returncode == 1 and "Traceback" not in young.stderr
    assert "no train steps" in young.stderr and "nothing to plot" in young.stderr
    assert not (tmp_path / "y.png").exists()

    missing = run_inflight("plot", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "run directory not found" in missing.stderr


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    write_run(tmp_path)
    monkeypatch.setattr(plot, "missing_packages", lambda names: {"plot": "pip install 'X[plot]'"})
    with pytest.raises(plot.PlotError, match=r"matplotlib: pip install 'X\[plot\]'"):
        plot.write_plot(tmp_path)
    assert not (tmp_path / "plot.png").exists()
