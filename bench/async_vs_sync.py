"""Wall time to a held-out accuracy target, async against sync, over several seeds.

Runs ``inflight run CONFIG`` as a user would, in both modes and with every seed (``run.seed=S``):
``async`` (generation never waits for training, weights land in flight) and ``run.mode=sync``
(generate a batch with the current weights, score, train, publish, repeat), each with an
evaluation every ``--eval-every`` steps, and reads from the run logs when the held-out greedy
accuracy reached the target. One evaluation of 300 prompts is noisy (about +-0.03), so the target
counts as reached at the end of the first ``--window`` consecutive evaluations whose mean reaches
it. Time counts from the evaluation at step 0, when training starts (start-up, the same code in
both modes, is left out; ``from_launch_s`` has it in). Runs alternate between the modes (async
seed 0, sync seed 0, async seed 1...) so that a drift of the machine hits both.

Per mode it reports the median and spread (min, max) over seeds of the time to target from
training start and from launch, and of the step at target, and the ratio of the medians
sync / async (the goal: ``--goal``, else 1.6 for ``default.yaml`` and 1.8 for ``longtail.yaml``).
A run that never reaches the target counts as infinitely slow in the median (a median that is
not reached is ``null``, and so is the ratio); a run that fails (exit status, time-out, no
evaluations in its logs) is reported with its run directory and the tail of its output, and the
bench goes on.

    python bench/async_vs_sync.py [--config configs/default.yaml] [--seeds 0 1 2]
        [--target T] [--goal G] [--eval-every 10] [--window 3] [--steps N] [--out DIR] [--keep]
        [KEY=VALUE ...] [--async KEY=VALUE ...] [--sync KEY=VALUE ...]

Positional ``KEY=VALUE`` overrides go to every run, ``--async`` / ``--sync`` ones only to that
mode's runs (its placement, threads...). Everything goes under ``--out`` (default: a fresh
``runs/async_vs_sync-CONFIG-TIME``): ``async_vs_sync.json`` (the JSON line printed on stdout,
the only line this prints on stdout; progress goes to stderr), ``async_vs_sync.png`` (held-out
accuracy against wall time from training start, one line per run), and ``runs/MODE-seedS`` run
directories with each run's console output in ``runs/MODE-seedS.out``. Run directories of runs
that succeeded are deleted at the end unless ``--keep``; those of failed runs are kept.

Not here: choosing placements (pass them as overrides) and any timing inside a run (the run
logs have it).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("async", "sync")
# per shipped config (by file name): the accuracy target and the sync/async goal of issue 9
# (default.yaml was 0.85 while the evaluation took the first 300 held-out problems, the easy
# "0+x" ones; on 300 spread over the split the same runs end at 0.80-0.83)
TARGETS = {"default.yaml": 0.78, "longtail.yaml": 0.5}
GOALS = {"default.yaml": 1.6, "longtail.yaml": 1.8}


class RunFailed(Exception):
    """A run that exited badly or left no usable evaluations."""


def _say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / f"{name}.jsonl"
    if not path.is_file():
        raise RunFailed(f"no log {path}")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a killed process
    return out


def _ts(event: dict) -> float:
    return datetime.strptime(event["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def reached_at(evals: list[dict], target: float, window: int) -> dict | None:
    """The evaluation ending the first ``window`` consecutive ones whose mean reaches ``target``."""
    for i in range(window - 1, len(evals)):
        if sum(e["accuracy"] for e in evals[i - window + 1 : i + 1]) / window >= target:
            return evals[i]
    return None


def read_run(run_dir: Path, target: float, window: int) -> dict[str, Any]:
    """Time to target and the run's figures, from its logs and summary."""
    started = [e for e in _events(run_dir, "supervisor") if e.get("event") == "run_started"]
    learner = _events(run_dir, "learner.0")
    evals = [e for e in learner if e.get("event") == "eval"]
    if not started or not evals:
        raise RunFailed(f"{run_dir}: no run_started event or no evaluation in the logs")
    launched, start = _ts(started[0]), _ts(evals[0])  # training starts after the step-0 eval
    hit = reached_at(evals, target, window)
    steps = [e for e in learner if e.get("event") == "train_step"]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    train_s = _ts(steps[-1]) - start if steps else None
    tokens = sum(e.get("tokens", 0) for e in steps)
    samples = sum(e.get("samples", 0) for e in steps)
    return {
        "reached": hit is not None,
        "time_to_target_s": None if hit is None else round(_ts(hit) - start, 1),
        "from_launch_s": None if hit is None else round(_ts(hit) - launched, 1),
        "step_at_target": None if hit is None else hit["step"],
        "start_s": round(start - launched, 1),
        "eval_before": evals[0]["accuracy"],
        "eval_after": summary.get("eval_after", evals[-1]["accuracy"]),
        "best_eval": max(e["accuracy"] for e in evals),
        "wall_s": summary.get("wall_s"),
        "steps": summary.get("steps", len(steps)),
        "s_per_step": None if not steps else round(train_s / len(steps), 3),
        "completion_tokens_mean": None if not samples else round(tokens / samples, 1),
        "mean_lag": summary.get("mean_lag"),
        "stale_dropped": summary.get("stale_dropped"),
        "curve": [[round(_ts(e) - start, 1), e["step"], round(e["accuracy"], 4)] for e in evals],
    }


def run_one(
    config: str, run_dir: Path, overrides: list[str], timeout_s: float
) -> subprocess.CompletedProcess | str:
    """Run the pipeline; its console output goes to ``run_dir`` + ``.out``."""
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, *overrides]
    cmd += ["--run-dir", str(run_dir), "-q"]
    log = run_dir.with_suffix(".out")
    with log.open("w") as out:
        try:
            return subprocess.run(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s"


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Median, min and max; ``None`` (not reached) counts as infinitely slow."""
    if not values:
        return {"median": None, "min": None, "max": None}
    ranked = [math.inf if v is None else float(v) for v in values]
    median = statistics.median(ranked)
    finite = [v for v in ranked if v != math.inf]
    return {
        "median": None if math.isinf(median) else round(median, 3),
        "min": round(min(finite), 3) if finite else None,
        "max": None if not finite or len(finite) < len(ranked) else round(max(finite), 3),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    return {
        "runs": len(runs),
        "failed": len(runs) - len(ok),
        "reached": sum(r["reached"] for r in ok),
        "time_to_target_s": spread([r["time_to_target_s"] for r in ok]),
        "from_launch_s": spread([r["from_launch_s"] for r in ok]),
        "step_at_target": spread([r["step_at_target"] for r in ok]),
        "s_per_step": spread([r["s_per_step"] for r in ok if r["s_per_step"] is not None]),
        "start_s": spread([r["start_s"] for r in ok]),
    }


def plot(path: Path, runs: dict[str, list[dict]], target: float, window: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"async": "tab:blue", "sync": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for mode in MODES:
        for i, r in enumerate(runs[mode]):
            if not r.get("curve"):
                continue
            t = [c[0] for c in r["curve"]]
            acc = [c[2] for c in r["curve"]]
            label = f"{mode} seed {r['seed']}" + ("" if r["reached"] else " (not reached)")
            style = styles[i % len(styles)]
            ax.plot(t, acc, style, color=colors[mode], label=label, lw=1.6, marker=".", ms=4)
            if r["reached"]:
                ax.plot([r["time_to_target_s"]], [target], "o", color=colors[mode], ms=6)
    ax.plot([], [], "o", color="grey", ms=6, label=f"target reached ({window}-eval mean)")
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.annotate(f"target {target}", (0, target), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("wall time from training start (s)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, help="accuracy target (default: per config)")
    parser.add_argument("--goal", type=float, help="sync/async goal (default: per config)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--window", type=int, default=3, help="evaluations averaged")
    parser.add_argument("--steps", type=int, default=0, help="learner steps (default: config)")
    parser.add_argument("--out", type=Path, help="output folder (default: a fresh one in runs/)")
    parser.add_argument("--keep", action="store_true", help="keep every run directory")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument(
        "--async", dest="async_", action="extend", nargs="+", default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--sync", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    for item in [*args.overrides, *args.async_, *args.sync]:
        if "=" not in item:
            parser.error(f"override {item!r} is not KEY=VALUE")
    name = Path(args.config).name
    if args.target is None:
        args.target = TARGETS.get(name, 0.85)
    if args.goal is None:
        args.goal = GOALS.get(name)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "runs" / f"async_vs_sync-{Path(args.config).stem}-{stamp}"
    (out / "runs").mkdir(parents=True, exist_ok=True)
    common = [f"stages.learner.eval.every={args.eval_every}", *args.overrides]
    if args.steps:
        common.append(f"stages.learner.steps={args.steps}")
    per_mode = {"async": args.async_, "sync": args.sync}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    began = time.monotonic()
    for seed in args.seeds:
        for mode in MODES:
            run_dir = out / "runs" / f"{mode}-seed{seed}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            overrides = [*common, f"run.mode={mode}", f"run.seed={seed}", *per_mode[mode]]
            _say(f"[async_vs_sync] {mode} seed {seed}: {' '.join(overrides)}")
            outcome = run_one(args.config, run_dir, overrides, args.run_timeout)
            record: dict[str, Any] = {"seed": seed, "run_dir": str(run_dir)}
            try:
                if isinstance(outcome, str):
                    raise RunFailed(outcome)
                if outcome.returncode:
                    raise RunFailed(f"exit status {outcome.returncode}")
                record.update(read_run(run_dir, args.target, args.window))
            except (RunFailed, OSError, ValueError, KeyError) as exc:
                record.update(
                    error=str(exc), reached=False, output_tail=_tail(run_dir.with_suffix(".out"))
                )
                try:  # a run that failed late still has a curve worth plotting
                    partial = read_run(run_dir, args.target, args.window)
                    record["curve"] = partial["curve"]
                except (RunFailed, OSError, ValueError, KeyError):
                    pass
                _say(f"[async_vs_sync] {mode} seed {seed} FAILED ({exc}); see {run_dir}")
            else:
                hit = (
                    f"{record['time_to_target_s']} s (step {record['step_at_target']})"
                    if record["reached"]
                    else "not reached"
                )
                _say(
                    f"[async_vs_sync] {mode} seed {seed}: time to {args.target} {hit}, accuracy "
                    f"{record['eval_before']:.3f} -> {record['eval_after']:.3f} "
                    f"(best {record['best_eval']:.3f})"
                )
            runs[mode].append(record)

    for record in (r for mode in MODES for r in runs[mode]):
        record["run_dir_kept"] = args.keep or "error" in record
    stats = {mode: summarize(runs[mode]) for mode in MODES}
    a = stats["async"]["time_to_target_s"]["median"]
    s = stats["sync"]["time_to_target_s"]["median"]
    ratio = None if not a or not s else round(s / a, 2)
    al, sl = stats["async"]["from_launch_s"]["median"], stats["sync"]["from_launch_s"]["median"]
    png = out / "async_vs_sync.png"
    title = (
        f"{args.config}: held-out accuracy, {len(args.seeds)} seeds per mode\n"
        f"median time to {args.target} from training start: sync / async = "
        + (f"{ratio}" if ratio else "n/a (a median run did not reach it)")
    )
    try:
        plot(png, runs, args.target, args.window, title)
    except Exception as exc:  # a plot must not lose the measurements
        _say(f"[async_vs_sync] plot failed: {type(exc).__name__}: {exc}")
        png = None
    result = {
        "bench": "async_vs_sync",
        "config": args.config,
        "seeds": args.seeds,
        "target": args.target,
        "window": args.window,
        "eval_every": args.eval_every,
        "overrides": {"common": common, **per_mode},
        "async_s": a,
        "sync_s": s,
        "ratio_sync_over_async": ratio,
        "ratio_from_launch": None if not al or not sl else round(sl / al, 2),
        "goal": args.goal,
        "goal_met": None if ratio is None or args.goal is None else ratio >= args.goal,
        "bench_s": round(time.monotonic() - began, 1),
        "out": str(out),
        "png": None if png is None else str(png),
        **{mode: stats[mode] for mode in MODES},
        "runs": runs,
    }
    line = json.dumps(result)
    (out / "async_vs_sync.json").write_text(line + "\n")
    for record in (r for mode in MODES for r in runs[mode]):
        if not record["run_dir_kept"]:
            shutil.rmtree(record["run_dir"], ignore_errors=True)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
