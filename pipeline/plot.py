"""``inflight plot RUN_DIR [--out FILE.png]``: one picture of a run, drawn from its logs.

Four panels against the learner's step, each with the run's elapsed time on its top axis:
training reward (per step, and smoothed), held-out accuracy (every evaluation), lag in policy
versions (mean and max per step) and samples/s (the learner's, and what the generators
produced). The figures come from the events the replicas logged (``RUN_DIR/logs/*.jsonl``),
through the same metric names the trackers get (``pipeline.tracking.metrics``), so the picture
can be drawn while the run goes on, after it ended, or after it was killed.
``run.plot: true`` draws ``RUN_DIR/plot.png`` at the end of ``inflight run``.

Needs matplotlib (``pip install 'inflight-rl[plot]'``); draws with its object API (no pyplot,
no display). It only reads the run directory and writes the one image.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.log_view import LogTail
from pipeline.tracking.backends import missing_packages
from pipeline.tracking.metrics import MetricMapper, event_wall

__all__ = ["PlotError", "Series", "add_plot_arguments", "read_series", "run_plot", "write_plot"]

# (x, y) points of one metric: learner step and value; `walls` maps steps to elapsed seconds
Series = dict[str, list[tuple[int, float]]]

_PANELS = (
    ("training reward", (("train/reward", "reward"),), "reward"),
    ("held-out accuracy", (("eval/accuracy", "greedy accuracy"),), "accuracy"),
    ("lag (policy versions)", (("train/lag", "mean"), ("train/lag_max", "max")), "versions"),
    (
        "throughput",
        (
            ("train/samples_per_s", "learner (mean since start)"),
            ("generator/samples_per_s", "generators"),
        ),
        "samples/s",
    ),
)


class PlotError(Exception):
    """Nothing to plot yet (``nothing_yet``), or no matplotlib / no run directory; the message
    says what to do."""

    def __init__(self, message: str, *, nothing_yet: bool = False) -> None:
        super().__init__(message)
        self.nothing_yet = nothing_yet


def read_series(run_dir: Path) -> tuple[Series, list[tuple[int, float]], float | None]:
    """Every metric of the run as ``{name: [(step, value), ...]}``, the learner's
    ``(step, elapsed_s)`` pairs, and the run's start (Unix seconds) when its logs say."""
    tail = LogTail(run_dir)
    events = tail.poll(final=True)
    start = None
    for event in events:  # the first process of the run; a resume continues its clock
        if event.get("event") == "run_started" and event.get("stage") == "supervisor":
            start = event_wall(event)
            break
    if start is None and events:
        start = event_wall(events[0])
    mapper = MetricMapper(_replicas(events))
    series: Series = {}
    walls = []
    for event in events:
        record = mapper.map(event)
        if record is None:
            continue
        for name, value in record.metrics.items():
            series.setdefault(name, []).append((record.step, value))
        if event.get("event") == "train_step" and start is not None:
            walls.append((record.step, record.wall - start))
    return series, walls, start


def _replicas(events: Sequence[dict]) -> dict[str, int]:
    """Replicas per stage, from the supervisor's run_started (the trackers get it from the
    config; a plot reads only the logs)."""
    for event in reversed(events):
        stages = event.get("stages")
        if event.get("event") == "run_started" and isinstance(stages, dict):
            return {k: v for k, v in stages.items() if isinstance(v, int)}
    return {}


def write_plot(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Draw ``run_dir``'s reward, accuracy, lag and samples/s into ``out`` (default
    ``RUN_DIR/plot.png``) and return its path. Raises PlotError when there is nothing to draw
    or matplotlib is missing."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "plot.png"
    if missing_packages(["plot"]):
        raise PlotError(f"plotting needs matplotlib: {missing_packages(['plot'])['plot']}")
    if not (run_dir / "logs").is_dir():
        raise PlotError(f"no logs/ directory in {run_dir}; is it a run directory?")
    series, walls, _ = read_series(run_dir)
    if not series.get("train/reward"):
        raise PlotError(
            f"no train steps in {run_dir / 'logs'} yet (no train_step event from the "
            "learner): nothing to plot",
            nothing_yet=True,
        )

    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    fig.suptitle(f"{run_dir.resolve().name}: {_headline(series)}")
    axes = fig.subplots(2, 2, sharex=True)
    clock = _Clock(walls)
    for ax, (title, lines, unit) in zip(axes.flat, _PANELS, strict=True):
        drawn = False
        for name, label in lines:
            points = series.get(name, [])
            if not points:
                continue
            x = np.array([p[0] for p in points], dtype=float)
            y = np.array([p[1] for p in points], dtype=float)
            if name == "eval/accuracy":
                ax.plot(x, y, marker="o", label=label)
            elif name == "train/reward" and len(y) >= 10:
                ax.plot(x, y, alpha=0.3, linewidth=0.8, label=label)
                ax.plot(x, _smooth(y), linewidth=2, label=f"{label} (smoothed)")
            else:
                ax.plot(x, y, linewidth=1.2, label=label)
            drawn = True
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if clock.usable:
            top = ax.secondary_xaxis("top", functions=(clock.to_time, clock.to_step))
            top.set_xlabel(f"elapsed ({clock.unit})", fontsize="small")
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


class _Clock:
    """Learner step <-> elapsed time, both increasing: interpolated between logged steps and
    extended at the run's mean pace beyond them (so the time axis has ticks everywhere)."""

    def __init__(self, walls: Sequence[tuple[int, float]]) -> None:
        import numpy as np

        by_step = dict(sorted(walls))  # a restarted learner may log a step twice: keep the last
        self.steps = np.array(list(by_step), dtype=float)
        seconds = np.maximum.accumulate(np.array(list(by_step.values()), dtype=float))
        self.usable = len(self.steps) >= 2 and seconds[-1] > seconds[0]
        self.unit, scale = ("min", 60.0) if len(seconds) and seconds[-1] > 600 else ("s", 1.0)
        self.times = seconds / scale
        if self.usable:
            self.pace = (self.times[-1] - self.times[0]) / (self.steps[-1] - self.steps[0])

    def to_time(self, step):
        return self._map(step, self.steps, self.times, self.pace)

    def to_step(self, time):
        return self._map(time, self.times, self.steps, 1.0 / self.pace)

    @staticmethod
    def _map(x, xs, ys, slope):
        import numpy as np

        x = np.asarray(x, dtype=float)
        inside = np.interp(x, xs, ys)
        below = ys[0] + (x - xs[0]) * slope
        above = ys[-1] + (x - xs[-1]) * slope
        return np.where(x < xs[0], below, np.where(x > xs[-1], above, inside))


def _smooth(y, span: int = 10):
    """Exponential moving average with the given span (pandas' ``ewm(span=...)`` weights)."""
    import numpy as np

    alpha, out, acc = 2.0 / (span + 1), np.empty_like(y), y[0]
    for i, value in enumerate(y):
        acc = alpha * value + (1 - alpha) * acc
        out[i] = acc
    return out


def _headline(series: Series) -> str:
    step, reward = series["train/reward"][-1]
    text = f"{step} steps, last reward {reward:.3f}"
    if series.get("eval/accuracy"):
        at, accuracy = series["eval/accuracy"][-1]
        text += f", held-out accuracy {accuracy:.3f} at step {at}"
    return text


# --------------------------------------------------------------------------- command line


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``inflight plot``; ``run_plot`` takes the parsed result."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    parser.add_argument(
        "--out", type=Path, metavar="FILE.png", help="where to write it (default RUN_DIR/plot.png)"
    )


def run_plot(args: argparse.Namespace) -> int:
    """Draw the plot; prints its path. 0 done, 1 nothing to plot yet, 2 bad input."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"inflight plot: run directory not found: {run_dir}", file=sys.stderr)
        return 2
    try:
        out = write_plot(run_dir, args.out)
    except PlotError as exc:
        print(f"inflight plot: {exc}", file=sys.stderr)
        return 1 if exc.nothing_yet else 2
    except OSError as exc:
        where = args.out or run_dir / "plot.png"
        print(f"inflight plot: cannot write {where}: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="inflight plot", description=__doc__.splitlines()[0])
    add_plot_arguments(_parser)
    sys.exit(run_plot(_parser.parse_args()))
