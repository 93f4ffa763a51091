"""The console of ``inflight run``: one live status block, and the events that matter as lines.

``Console`` consumes the run's log events (the dicts ``pipeline.log_view.LogTail`` reads from
``RUN_DIR/logs``) and keeps a picture of the run: optimizer step k of N, elapsed time and ETA,
the last step's reward, solved fraction and mean lag, samples/s, generated tokens/s, samples in
flight and the last held-out accuracy. On a terminal that picture is one status block redrawn
in place (``rich.live``, at most ``_REDRAW_PER_S`` times a second); elsewhere (CI, ``| tee``)
it is one plain line every ``every_s`` seconds. Only events that matter become permanent lines
above it: the run's start and end, every evaluation, checkpoints, a learner resuming, the
learner's summary, and every warning or error (as ``inflight logs`` shows it). Everything else
(each ``train_step``, metrics, decisions) only updates the picture.

The ETA comes from a smoothed step rate (``StepRate``: an exponentially weighted mean of
seconds per step over the recent steps, by the events' own timestamps), never from the time
since the start, which includes seconds of start-up.

It only shows: it reads nothing but the events it is fed and writes nothing but the console.
``inflight run --console events`` bypasses it (every event, one line each); ``-q`` shows
nothing. The supervisor feeds it (``Supervisor._console``): ``inflight run CONFIG`` shows it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, TextIO

from rich.console import Console as RichConsole
from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pipeline.log_view import LEVELS, event_wall, render

__all__ = ["Console", "StepRate", "total_steps"]

_REDRAW_PER_S = 4.0
_RANK = {name: rank for rank, name in enumerate(LEVELS)}
# info events printed as lines of their own; warnings and errors always are
_LINES = frozenset(
    {
        "run_started",
        "eval",
        "checkpoint_saved",
        "learner_resumed",
        "learner_done",
        "run_finished",
    }
)


# --------------------------------------------------------------------------- step rate


class StepRate:
    """Seconds per optimizer step, smoothed over the recent steps, and the ETA it gives.

    An exponentially weighted mean: each step's duration (from two successive ``train_step``
    timestamps; a jump of n steps counts as n steps of dt/n) weighs ``2 ** (-age / half_life)``
    where ``age`` is in steps. The weights are normalized (sum of weighted seconds over sum of
    weighted steps), so the first steps are not biased towards an initial guess. A step number
    that goes back (a learner resumed from a checkpoint) starts the estimate afresh. Time
    before the first step (start-up, loading) is never part of it.

    Measured on the default run (12 runs of 350 steps on 2 shared cores): the ETA shown at each
    step from 10% to 90% of the run was within 20% of the real time to the last step at every
    step in 8 runs, and at 48-94% of the steps in the other 4; the worst error per run had a
    median of 14% (6-31%). The misses were the machine changing speed by a quarter midway (other
    work on the same cores), which no estimate from the past can see coming. Half-lives of 20
    to 70 steps did about as well; 10 followed the noise.
    """

    def __init__(self, half_life_steps: float = 50.0) -> None:
        if half_life_steps <= 0:
            raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
        self.half_life = half_life_steps
        self.step: int | None = None
        self.at: float | None = None  # timestamp of the last step
        self._seconds = 0.0  # weighted sums
        self._steps = 0.0
        self._samples = 0.0

    def add(self, step: int, at: float, samples: int | None = None) -> None:
        """Step ``step`` ended at ``at`` (seconds, any epoch) with ``samples`` trained."""
        if self.step is None or self.at is None or step <= self.step:
            if self.step is not None and step < self.step:
                self._seconds = self._steps = self._samples = 0.0
            self.step, self.at = step, at
            return
        n, dt = step - self.step, max(at - self.at, 0.0)
        decay = 2.0 ** (-n / self.half_life)
        self._seconds = self._seconds * decay + dt
        self._steps = self._steps * decay + n
        self._samples = self._samples * decay + (samples or 0) * 1.0
        self.step, self.at = step, at

    @property
    def seconds_per_step(self) -> float | None:
        return self._seconds / self._steps if self._steps > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        return self._samples / self._seconds if self._seconds > 0 and self._samples else None

    def eta(self, total: int, now: float) -> float | None:
        """Seconds until step ``total`` at ``now``; None before there is a rate.

        Counts down within a step (``now`` past the last step), but never below the steps
        still to come after the one under way.
        """
        per = self.seconds_per_step
        if per is None or self.step is None or self.at is None:
            return None
        left = max(total - self.step, 0)
        if left == 0:
            return 0.0
        return left * per - min(max(now - self.at, 0.0), per)


# --------------------------------------------------------------------------- the console


def total_steps(stages: Mapping[str, Any]) -> int | None:
    """The optimizer steps a pipeline trains: ``steps`` of its learner stage, if it has one.

    ``stages`` maps stage names to their config sections (``PipelineConfig.stages``). The
    learner is the stage whose options have an integer ``steps``; when several do, the one
    that ``use``\\ s ``learner`` (or is named so). None when no stage trains.
    """
    found = {
        name: section.options.steps
        for name, section in stages.items()
        if isinstance(getattr(section.options, "steps", None), int)
        and not isinstance(section.options.steps, bool)
        and section.options.steps > 0
    }
    if len(found) > 1:
        found = {n: s for n, s in found.items() if "learner" in (n, str(stages[n].use))} or found
    return next(iter(found.values())) if len(found) == 1 else None


class Console:
    """The picture of a run made of its events; ``feed`` each event, ``tick`` now and then.

    ``total``: the run's optimizer steps (``total_steps``), None for a pipeline that does not
    train. ``out``: where it writes (stdout). ``live``: a redrawn block (default: when ``out``
    is a terminal) or plain lines. ``every_s``: seconds between plain status lines. ``level``:
    below it, no permanent line (the picture still follows every event). ``clock``: wall-clock
    seconds (event timestamps are wall clock), injectable for tests. Use as a context manager,
    or ``start()``/``stop()``.
    """

    def __init__(
        self,
        *,
        total: int | None,
        out: TextIO | None = None,
        live: bool | None = None,
        every_s: float = 10.0,
        level: str = "info",
        clock: Callable[[], float] = time.time,
        width: int | None = None,
        half_life_steps: float = 50.0,
    ) -> None:
        if level not in _RANK:
            raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.total = total
        self.out = out if out is not None else sys.stdout
        self.live = _isatty(self.out) if live is None else live
        self.every_s = every_s
        self.level = _RANK[level]
        self.clock = clock
        self.rate = StepRate(half_life_steps)
        self.started = clock()
        self.run_dir: str | None = None
        self.step: int | None = None
        self.last: dict[str, Any] = {}  # the last train_step
        self.evaluation: dict[str, Any] | None = None  # the last eval
        self.first_evaluation: float | None = None  # the first one's accuracy, for the end
        self.in_flight: dict[str, int] = {}  # per generator replica
        self.tokens: dict[str, tuple[float, int]] = {}  # replica -> (ts, cumulative tokens)
        self.tokens_per_s: dict[str, float] = {}
        self.running: set[str] = set()  # replicas started and not yet exited
        self.restarts = 0
        self.warnings = 0
        self.finished = False  # run_finished seen
        self.lines = 0  # permanent lines written
        self._status_at = self.started  # last plain status line (or start)
        self._drawn_at = 0.0
        self._rich: RichConsole | None = None
        self._live: Live | None = None
        if self.live:
            self._rich = RichConsole(
                file=self.out, force_terminal=True, width=width, highlight=False
            )

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Console:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._rich is not None and self._live is None:
            self._live = Live(
                _Block(self),
                console=self._rich,
                auto_refresh=False,  # redrawn by tick(), from the caller's loop: no thread
                transient=True,  # the end summary replaces the block
                redirect_stdout=self.out is sys.stdout,
                redirect_stderr=self.out is sys.stdout,
            )
            self._live.start()

    def stop(self) -> None:
        """Remove the block (a terminal) and leave the permanent lines."""
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()
        self.out.flush()

    # ----------------------------------------------------------------- events
    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one event: update the picture, print it when it is one that matters."""
        name = event.get("event")
        at = event_wall(event)
        who = f"{event.get('stage')}.{event.get('replica')}"
        if name == "train_step":
            self._train_step(event, at)
        elif name == "eval":
            self.evaluation = dict(event)
            if self.first_evaluation is None and _number(event.get("accuracy")):
                self.first_evaluation = event["accuracy"]
        elif name == "run_started":
            self.run_dir = event.get("run_dir")
        elif name == "run_finished":
            self.finished = True  # its line is the last one: no status line after it
        elif name in ("replica_started", "engine_started"):
            self.running.add(who)
        elif name in ("replica_stopped", "replica_finished", "engine_stopping"):
            self.running.discard(who)
        elif name in ("replica_failed", "replica_exited"):  # the supervisor's word on one
            self.running.discard(str(event.get("replica_name")))
        elif name == "replica_restarting":
            self.restarts += 1
        elif name == "metrics" or name == "inflight_decision":
            self._generation(event, who, at)
        rank = _RANK.get(str(event.get("level", "info")).lower(), _RANK["info"])
        if rank >= _RANK["warning"]:
            self.warnings += 1
        if rank >= self.level and (rank >= _RANK["warning"] or name in _LINES):
            self._print(self._line(event, rank))

    def _train_step(self, event: Mapping[str, Any], at: float | None) -> None:
        step = event.get("step")
        if not isinstance(step, int):
            return
        if at is not None:
            samples = event.get("samples")
            self.rate.add(step, at, samples if isinstance(samples, int) else None)
        self.step = step
        self.last = dict(event)

    def _generation(self, event: Mapping[str, Any], who: str, at: float | None) -> None:
        """What a generator says of itself: samples in flight, tokens generated so far."""
        if isinstance(event.get("in_flight"), int) and event.get("scope", "all") == "all":
            self.in_flight[who] = event["in_flight"]
        tokens = event.get("tokens")
        if event.get("event") != "metrics" or not isinstance(tokens, int) or at is None:
            return
        before = self.tokens.get(who)
        self.tokens[who] = (at, tokens)
        if before is not None and at > before[0] and tokens >= before[1]:
            self.tokens_per_s[who] = (tokens - before[1]) / (at - before[0])
        elif before is not None and tokens < before[1]:  # restarted: counts from 0 again
            self.tokens_per_s.pop(who, None)

    # ----------------------------------------------------------------- output
    def tick(self) -> None:
        """Redraw the block (at most ``_REDRAW_PER_S`` a second), or print the plain status
        line when ``every_s`` has passed since the last one."""
        now = self.clock()
        if self._live is not None:
            if now - self._drawn_at >= 1.0 / _REDRAW_PER_S:
                self._drawn_at = now
                self._live.refresh()
        elif not self.live and not self.finished and now - self._status_at >= self.every_s:
            self._status_at = now
            self._write(f"{_wall_clock(now)} {self.status_line(now)}")

    def status_line(self, now: float | None = None) -> str:
        """The picture as one plain line (what a non-terminal gets every ``every_s``)."""
        now = self.clock() if now is None else now
        return " | ".join(p for p in (self._progress_text(now), self._figures_text()) if p)

    def _progress_text(self, now: float) -> str:
        parts = []
        if self.total is not None:
            step = min(self.step or 0, self.total)
            parts.append(f"step {step}/{self.total} {100.0 * step / self.total:.0f}%")
        parts.append(f"elapsed {_clock(now - self.started)}")
        if self.total is not None and self.step is not None:
            parts.append(f"ETA {_clock(self.rate.eta(self.total, now))}")
        else:  # starting up, or a pipeline that does not train
            parts.append(_plural(len(self.running), "replica") + " up")
        if self.restarts:
            parts.append(_plural(self.restarts, "restart"))
        return ", ".join(parts)

    def _figures_text(self) -> str:
        return "  ".join(f"{label} {value}" for label, value in self._figures())

    def _figures(self) -> list[tuple[str, str]]:
        last = self.last
        figures = []
        for key, label, fmt in (
            ("reward", "reward", "{:.3f}"),
            ("solved", "solved", "{:.3f}"),
            ("lag", "lag", "{:.2f}"),
        ):
            if _number(last.get(key)):
                figures.append((label, fmt.format(last[key])))
        if self.rate.samples_per_s is not None:
            figures.append(("samples/s", f"{self.rate.samples_per_s:,.0f}"))
        if self.tokens_per_s:
            figures.append(("tokens/s", _si(sum(self.tokens_per_s.values()))))
        if self.in_flight:
            figures.append(("in flight", str(sum(self.in_flight.values()))))
        if self.evaluation is not None and _number(self.evaluation.get("accuracy")):
            ev = self.evaluation
            figures.append(("eval", f"{ev['accuracy']:.3f} @{ev.get('step', '?')}"))
        return figures

    def block(self, now: float | None = None) -> Group:
        """The live block: a progress line, and the figures line."""
        now = self.clock() if now is None else now
        elapsed = _clock(now - self.started)
        head = Table.grid(padding=(0, 1))
        cells: list[Any] = []
        if self.total is not None:
            step = min(self.step or 0, self.total)
            cells += [
                ProgressBar(total=self.total, completed=step, width=30),
                Text(f"step {step}/{self.total}", style="bold"),
                Text(f"{100.0 * step / self.total:3.0f}%"),
            ]
        cells.append(Text(f"elapsed {elapsed}", style="dim"))
        if self.total is not None and self.step is not None:
            cells.append(Text(f"ETA {_clock(self.rate.eta(self.total, now))}", style="bold cyan"))
        else:
            cells.append(Text(_plural(len(self.running), "replica") + " up"))
        if self.restarts:
            cells.append(Text(_plural(self.restarts, "restart"), style="yellow"))
        head.add_row(*cells)
        figures = Text(no_wrap=True, overflow="ellipsis")
        for i, (label, value) in enumerate(self._figures()):
            if i:
                figures.append("  ")
            figures.append(f"{label} ", style="dim")
            figures.append(value)
        return Group(head, figures) if figures else Group(head)

    def _line(self, event: Mapping[str, Any], rank: int) -> Text | str:
        """One permanent line for ``event``: a sentence for the events that matter, the
        ``inflight logs`` line for warnings and errors."""
        clock = _event_clock(event.get("ts"))
        name = event.get("event")
        text = None
        if name == "eval":
            text = self._eval_text(event)
        elif name == "checkpoint_saved":
            text = f"checkpoint at step {event.get('step')}: {event.get('path')}"
        elif name == "learner_resumed":
            text = (
                f"learner resumed at step {event.get('step')} (policy version "
                f"{event.get('policy_version')}) from {event.get('checkpoint') or 'no checkpoint'}"
            )
        elif name == "learner_done":
            text = self._learner_done_text(event)
        elif name == "run_started":
            text = self._run_started_text(event)
        elif name == "run_finished":
            text = self._run_finished_text(event)
        if text is None or rank >= _RANK["warning"]:
            rendered = render(event, color=self.live)
            return Text.from_ansi(rendered) if self.live else rendered
        if not self.live:
            return f"{clock} {text}"
        line = Text(f"{clock} ", style="dim")
        style = "bold" if name in ("eval", "run_finished", "learner_done") else ""
        if name == "run_finished":
            style = "bold green" if event.get("status") == "succeeded" else "bold red"
        line.append(text, style=style)
        return line

    def _eval_text(self, event: Mapping[str, Any]) -> str:
        acc = event.get("accuracy")
        shown = f"{acc:.3f}" if _number(acc) else str(acc)
        failed = event.get("failed")
        extra = f", {failed} failed" if isinstance(failed, int) and failed else ""
        step = event.get("step")
        when = "before training" if step == 0 else f"at step {step}"
        episodes = ""  # evaluations that played episodes (eval.rollout) say how they went
        if _number(event.get("turns_mean")):
            episodes = f", {event['turns_mean']:.2f} turns"
            if _number(event.get("tool_use")) and event["tool_use"]:
                episodes += f", tool use {event['tool_use']:.2f}"
            if _number(event.get("solved")):
                episodes += f", solved {event['solved']:.2f}"
        return (
            f"eval {when}: held-out accuracy {shown}{episodes} ({event.get('prompts')} "
            f"prompts{extra}, {_seconds(event.get('seconds'))})"
        )

    def _learner_done_text(self, event: Mapping[str, Any]) -> str:
        parts = [f"learner done: {event.get('steps')} steps"]
        if isinstance(event.get("samples"), int):
            parts[0] += f", {event['samples']:,} samples in {_seconds(event.get('train_s'))}"
        if _number(event.get("mean_lag")):
            parts.append(f"mean lag {event['mean_lag']:.2f}")
        if event.get("no_signal"):
            parts.append(f"{event['no_signal']:,} without signal (no passes)")
        if event.get("set_aside"):
            parts.append(f"{event['set_aside']:,} set aside without signal (dynamic sampling)")
        if event.get("stale_dropped"):
            parts.append(f"{event['stale_dropped']} stale samples dropped")
        first = self.first_evaluation
        after = event.get("eval_after")
        if _number(after):
            before = f"{first:.3f} -> " if _number(first) else ""
            parts.append(f"held-out accuracy {before}{after:.3f}")
        return ", ".join(parts)

    def _run_started_text(self, event: Mapping[str, Any]) -> str:
        stages = event.get("stages")
        listed = (
            ", ".join(f"{n}" if r == 1 else f"{n} x{r}" for n, r in stages.items())
            if isinstance(stages, Mapping)
            else "?"
        )
        goal = f", {self.total} steps" if self.total is not None else ""
        return f"run started: {event.get('config')} ({listed}){goal} in {event.get('run_dir')}"

    def _run_finished_text(self, event: Mapping[str, Any]) -> str:
        wall = self.clock() - self.started
        text = (
            f"run {event.get('status')} (exit {event.get('exit_code')}) after {_clock(wall)}: "
            f"{event.get('reason')}"
        )
        restarts = event.get("restarts")
        if isinstance(restarts, Mapping) and restarts:
            text += f"; restarts {', '.join(f'{k} {v}' for k, v in restarts.items())}"
        if self.warnings:
            text += f"; {self.warnings} warning{'s' if self.warnings != 1 else ''} above"
        if self.run_dir:
            text += f"; summary in {self.run_dir}/summary.json"
        return text

    def _print(self, line: Text | str) -> None:
        self.lines += 1
        if self._rich is not None:
            self._rich.print(line)
        else:
            self._write(str(line))

    def _write(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


class _Block:
    """What ``Live`` draws: the console's block as of each redraw."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __rich__(self) -> Group:
        return self.console.block()


# --------------------------------------------------------------------------- helpers


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _event_clock(ts: Any) -> str:
    """``HH:MM:SS`` of an event, in the logs' clock (UTC), as ``inflight logs`` shows it."""
    return ts[11:19] if isinstance(ts, str) and len(ts) >= 19 and ts[10] == "T" else "--:--:--"


def _clock(seconds: float | None) -> str:
    """``M:SS`` or ``H:MM:SS``; ``-:--`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--"
    total = max(round(seconds), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _wall_clock(seconds: float) -> str:
    """``HH:MM:SS`` (UTC) of a wall-clock time: the clock of the log events' lines."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%H:%M:%S")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if _number(value) else "? s"


def _si(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"
