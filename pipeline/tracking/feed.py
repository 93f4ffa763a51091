"""``TrackerFeed``: the supervisor's task that feeds a run's experiment trackers from its logs.

One writer per run: the supervisor tails the structured events every replica writes to
``RUN_DIR/logs/*.jsonl`` (its own ``LogTail``), maps them to metrics
(``pipeline.tracking.metrics``) and writes them to each tracker in ``run.trackers``: one
TensorBoard log directory, one W&B run, one MLflow run for the whole experiment, with the
run's resolved config as hyperparameters. A tracker per process would split one experiment into
as many runs as there are replicas; the learner's step is the x-axis instead, and every point
keeps the wall time of the event it came from.

Tracker calls (imports, ``wandb.init``, file writes) run on one worker thread, in order, so the
supervisor's event loop never waits on a disk or a tracker service. A tracker that raises
(disk full, an unwritable directory, a store that went away) is logged once as a supervisor
event (``tracker_failed``), counted and disabled; the others and the run go on.
``counters()`` says, per tracker, how many records it wrote and how many it dropped after a
failure; the supervisor puts them in ``summary.json`` when one failed.

It reads events from where they are when it is made (``from_start=False``): a resumed run's
trackers get the new events, not the earlier process's again. It does not decide which
trackers exist (``pipeline.tracking.backends``) and does not log the run's own console.

Usage (what the supervisor does)::

    feed = TrackerFeed(["tensorboard"], run_dir, params=loaded.resolved(), project="default",
                       run_name=run_dir.name, log=log)   # before the replicas start
    feed.start()                                          # once they are started
    ...
    counters = await feed.aclose("succeeded")             # drains the last events, closes
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.log_view import LogTail
from pipeline.tracking.backends import Tracker, open_tracker
from pipeline.tracking.metrics import MetricMapper, Record

__all__ = ["TrackerFeed"]

_CLOSE_TIMEOUT_S = 60.0  # a tracker that will not close (a hung service) no longer holds the end


@dataclass
class _State:
    tracker: Tracker | None = None
    written: int = 0  # records written
    dropped: int = 0  # records not written because the tracker had failed
    error: str | None = None  # what made it fail (then it is disabled)
    phase: str | None = None  # open | params | log | flush | close


class TrackerFeed:
    """Tails ``run_dir``'s logs and writes their metrics to the trackers named in ``names``.

    ``params``: the run's config (plain data) logged once as hyperparameters. ``project``,
    ``run_name``: W&B project / MLflow experiment and the run's name there. ``log``: the
    supervisor's structlog logger (``tracker_failed`` goes there). ``replicas``: replicas per
    stage, for per-replica metric names. ``interval_s``: how often the logs are read.
    ``opener``: makes a tracker by name (tests pass their own).
    """

    def __init__(
        self,
        names: Sequence[str],
        run_dir: Path,
        *,
        params: Mapping[str, Any],
        project: str,
        run_name: str,
        log: Any,
        replicas: Mapping[str, int] | None = None,
        interval_s: float = 1.0,
        opener: Callable[..., Tracker] = open_tracker,
    ) -> None:
        self.run_dir = Path(run_dir)
        self._names = list(dict.fromkeys(names))
        self._params = params
        self._project, self._run_name = project, run_name
        self._log = log
        self._interval = interval_s
        self._opener = opener
        self._tail = LogTail(self.run_dir, from_start=False)
        self._mapper = MetricMapper(replicas)
        self._states = {name: _State() for name in self._names}
        self._stop = asyncio.Event()
        self._status = "succeeded"
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trackers")

    # ------------------------------------------------------------------ API
    def start(self) -> None:
        """Open the trackers and start feeding them (a task on the running loop)."""
        self._task = asyncio.create_task(self._run(), name="tracker-feed")

    async def aclose(self, status: str = "succeeded") -> dict[str, dict[str, Any]]:
        """Write the events still in the logs, close every tracker with the run's ``status``
        (succeeded, failed, stopped) and return ``counters()``."""
        self._status = status
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                for state in self._states.values():
                    if state.tracker is not None and state.error is None:
                        state.error, state.phase = "did not close in time", "close"
                self._log.warning("tracker_close_timeout", after_s=_CLOSE_TIMEOUT_S)
            except Exception:  # its own failure: logged, the run's end goes on
                self._log.exception("tracker_feed_failed")
        self._pool.shutdown(wait=False)
        return self.counters()

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per tracker: ``written``, ``dropped`` and, when it failed, ``error`` and ``phase``."""
        out = {}
        for name, s in self._states.items():
            out[name] = {"written": s.written, "dropped": s.dropped}
            if s.error is not None:
                out[name].update(error=s.error, phase=s.phase)
        return out

    @property
    def failed(self) -> bool:
        return any(s.error is not None for s in self._states.values())

    # ------------------------------------------------------------- the task
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        await self._call(loop, self._open_all)
        while True:
            stopping = self._stop.is_set()
            # the last read also takes a line a killed writer left without its newline
            records = [r for e in self._tail.poll(final=stopping) if (r := self._mapper.map(e))]
            if records:
                await self._call(loop, self._write, records)
            if stopping:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._interval)
        await self._call(loop, self._close_all)

    async def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
        failed = await loop.run_in_executor(self._pool, fn, *args)
        for name in failed:  # logged here, on the loop: once per tracker, when it failed
            s = self._states[name]
            self._log.warning(
                "tracker_failed",
                tracker=name,
                phase=s.phase,
                error=s.error,
                written=s.written,
                action="disabled; the run goes on",
            )

    # ----------------------------------------------------- on the worker thread
    def _fail(self, name: str, phase: str, exc: BaseException) -> None:
        s = self._states[name]
        s.error, s.phase = f"{type(exc).__name__}: {exc}"[:500], phase
        tracker, s.tracker = s.tracker, None
        if tracker is not None and phase != "close":
            with contextlib.suppress(Exception):  # release what it holds; it failed already
                tracker.close("failed")

    def _open_all(self) -> list[str]:
        failed = []
        for name, s in self._states.items():
            try:
                s.tracker = self._opener(
                    name, self.run_dir, project=self._project, run_name=self._run_name
                )
                s.tracker.log_params(self._params)
            except Exception as exc:
                self._fail(name, "open" if s.tracker is None else "params", exc)
                failed.append(name)
        return failed

    def _write(self, records: list[Record]) -> list[str]:
        failed = []
        for name, s in self._states.items():
            if s.tracker is None:
                if s.error is not None:
                    s.dropped += len(records)
                continue
            done, phase = 0, "log"
            try:
                for record in records:
                    s.tracker.log_metrics(record.metrics, record.step, record.wall)
                    done += 1
                phase = "flush"
                s.tracker.flush()
            except Exception as exc:
                s.dropped += len(records) - done
                self._fail(name, phase, exc)
                failed.append(name)
            s.written += done
        return failed

    def _close_all(self) -> list[str]:
        failed = []
        for name, s in self._states.items():
            if s.tracker is None:
                continue
            try:
                s.tracker.close(self._status)
            except Exception as exc:
                self._fail(name, "close", exc)
                failed.append(name)
            s.tracker = None
        return failed
