"""Read, filter, follow and render the JSON-line logs of a run: ``inflight logs RUN_DIR``.

A run writes one file per process under ``RUN_DIR/logs/``: ``{stage}.{replica}.jsonl`` for each
stage replica and ``supervisor.jsonl``, whose last event is ``run_finished``. ``LogTail`` reads what
was appended to all of them since the last poll (whole lines only), ``LogFilter`` picks events by
stage, level and event name, and ``render`` makes one readable console line of an event::

    05:10:00.123 INFO  square.0 v3 replica_started port=5555

Usage: ``inflight logs RUN_DIR [-f] [--stage S]... [--level L] [--event E]... [--json|--csv]``,
or ``python -m pipeline.log_view`` with the same arguments. ``--csv`` writes the chosen events'
fields as one table (``--event train_step --csv > steps.csv``). ``-f`` ends with the run: at
its ``run_finished``, or once the supervisor that started it is gone (killed without a chance to
finish: its ``run_started`` names its pid, start time and host).

It only reads: it never writes, rotates or deletes logs, and knows nothing about the processes
that write them beyond that file layout. Raw stdout/stderr captures (``*.out``) are not read.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

__all__ = [
    "LEVELS",
    "LogFilter",
    "LogTail",
    "add_logs_arguments",
    "process_identity",
    "render",
    "run_logs",
    "write_csv",
]

LEVELS = ("debug", "info", "warning", "error", "critical")
_RANK = {name: rank for rank, name in enumerate(LEVELS)}


def _check_level(level: str) -> str:
    if level.lower() not in _RANK:
        raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")
    return level.lower()


# --------------------------------------------------------------------------- filtering


@dataclass(frozen=True)
class LogFilter:
    """Which events to show; an empty filter shows everything.

    ``stages``: a stage name (``square``, ``supervisor``) or one replica (``square.1``); any
    entry may match. A component that runs inside another stage's process (the weight publisher
    in the learner's rank 0) marks its events ``component: NAME`` and is matched by that name.
    ``level``: the minimum level. ``events``: fnmatch globs on the event name
    (``replica_*``); any may match. The three criteria must all hold.
    """

    stages: Sequence[str] = ()
    level: str | None = None
    events: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "events", tuple(self.events))
        if self.level is not None:
            object.__setattr__(self, "level", _check_level(self.level))

    def match(self, event: Mapping[str, Any]) -> bool:
        if self.stages:
            stage = event.get("stage")
            who = f"{stage}.{event.get('replica')}"
            component = event.get("component")
            if not any(s in (stage, who, component) for s in self.stages):
                return False
        # An event with a missing or unknown level counts as info rather than vanishing.
        if self.level is not None and _rank(event) < _RANK[self.level]:
            return False
        if self.events:
            name = str(event.get("event", ""))
            if not any(fnmatchcase(name, glob) for glob in self.events):
                return False
        return True


def _rank(event: Mapping[str, Any]) -> int:
    return _RANK.get(str(event.get("level", "info")).lower(), _RANK["info"])


# --------------------------------------------------------------------------- reading


@dataclass
class _File:
    """Read position in one file; ``partial`` is a last line still waiting for its newline."""

    path: Path
    stage: str
    replica: int | None
    offset: int = 0
    partial: bytes = b""
    line_no: int = 0
    last_ts: str | None = None
    is_supervisor: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_supervisor = self.path.name == "supervisor.jsonl"


class LogTail:
    """Incremental reader of every ``RUN_DIR/logs/*.jsonl``, including files created later.

    ``poll()`` returns the matching events appended since the previous poll, merged in ``ts``
    order (ordering holds within one poll; each file is already in order). A line that is not a
    JSON object becomes an ``unparsable_log_line`` warning event rather than being dropped.
    With ``from_start=False`` files present at construction are read from their current end.
    A missing ``logs/`` directory is read as empty: it may not have been created yet.
    """

    def __init__(
        self, run_dir: Path | str, *, filt: LogFilter | None = None, from_start: bool = True
    ) -> None:
        self._logs = Path(run_dir) / "logs"
        self._filt = filt if filt is not None else LogFilter()
        self._files: dict[Path, _File] = {}
        self._finished = False
        self._owner: dict[str, Any] = {}  # who the latest run_started says runs the run
        if not from_start:
            for path in sorted(self._logs.glob("*.jsonl")):
                self._skip_to_end(self._track(path))

    @property
    def finished(self) -> bool:
        """True once the supervisor's ``run_finished`` was read, whatever the filter (and no
        later ``run_started``: a resumed run goes on in the same files)."""
        return self._finished

    def supervisor_gone(self) -> int | None:
        """The pid of the supervisor that started the run read so far when it is no longer
        running on this host (killed before it could log ``run_finished``); None while it runs,
        or when that cannot be told (no ``run_started`` read yet, another host)."""
        pid, start, host = (self._owner.get(k) for k in ("pid", "pid_start", "host"))
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        if isinstance(host, str) and host != socket.gethostname():
            return None
        now = _start_ticks(pid)
        if now is None:  # no /proc (not Linux): whether the pid exists is all there is to know
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return pid
            except OSError:  # it exists, owned by another user
                pass
            return None
        if now == -1 or (isinstance(start, int) and now != start):
            return pid  # gone, a zombie, or the pid now belongs to another process
        return None

    def poll(self, *, final: bool = False) -> list[dict[str, Any]]:
        """New matching events of all files, in ts order.

        ``final=True`` also takes a last line that has no newline (a writer that died
        mid-line), for a last read once nothing more will be written.
        """
        events: list[dict[str, Any]] = []
        for path in sorted(self._logs.glob("*.jsonl")):
            f = self._files.get(path) or self._track(path)
            events.extend(e for e in self._read(f, final=final) if self._filt.match(e))
        events.sort(key=_ts_key)  # stable: same-ts events keep their file order
        return events

    def _track(self, path: Path) -> _File:
        stage, _, replica = path.name[: -len(".jsonl")].rpartition(".")
        if stage and replica.isdigit():
            f = _File(path, stage, int(replica))
        else:
            f = _File(path, path.name[: -len(".jsonl")], None)
        self._files[path] = f
        return f

    def _skip_to_end(self, f: _File) -> None:
        data = f.path.read_bytes()
        f.offset = data.rfind(b"\n") + 1  # a trailing partial line is read once it completes
        f.line_no = data.count(b"\n", 0, f.offset)
        if f.is_supervisor and f.offset:
            # which run is on and whether it finished: its run_started and run_finished lines
            for raw in data[: f.offset].split(b"\n"):
                if b'"run_started"' in raw or b'"run_finished"' in raw:
                    self._parse(f, raw)

    def _read(self, f: _File, *, final: bool) -> list[dict[str, Any]]:
        try:
            with open(f.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < f.offset:
                    # Truncated or replaced: start over rather than wait past its end forever.
                    f.offset, f.partial, f.line_no = 0, b"", 0
                fh.seek(f.offset)
                data = fh.read()
        except FileNotFoundError:  # removed between glob and open
            return []
        f.offset += len(data)
        lines = (f.partial + data).split(b"\n")
        f.partial = lines.pop()
        if final and f.partial:
            lines.append(f.partial)
            f.partial = b""
        events = []
        for raw in lines:
            f.line_no += 1
            if raw.strip():
                events.append(self._parse(f, raw))
        return events

    def _parse(self, f: _File, raw: bytes) -> dict[str, Any]:
        try:
            event = json.loads(raw)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
            event = None
        if not isinstance(event, dict):
            event = {
                "level": "warning",
                "event": "unparsable_log_line",
                "stage": f.stage,
                "replica": f.replica,
                "file": str(f.path),
                "line_no": f.line_no,
                "text": raw[:200].decode("utf-8", "replace"),
            }
            if f.last_ts is not None:  # sort it next to its neighbours in the file
                event = {"ts": f.last_ts, **event}
            return event
        if isinstance(event.get("ts"), str):
            f.last_ts = event["ts"]
        if f.is_supervisor and event.get("event") == "run_finished":
            self._finished = True
        elif f.is_supervisor and event.get("event") == "run_started":
            self._finished = False
            self._owner = {k: event.get(k) for k in ("pid", "pid_start", "host")}
        return event


def process_identity() -> dict[str, Any]:
    """This process as a ``run_started`` names it: ``pid``, ``pid_start`` (its start time in
    clock ticks after boot, from ``/proc``; None elsewhere) and ``host``, so that a reader can
    tell it is gone even after its pid was given to another process."""
    pid = os.getpid()
    start = _start_ticks(pid)
    return {
        "pid": pid,
        "pid_start": start if start not in (None, -1) else None,
        "host": socket.gethostname(),
    }


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` (``/proc/PID/stat`` field 22); -1 when it is gone or a zombie,
    None when ``/proc`` cannot say (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc/self") else None
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # killed, not yet reaped by its parent
        return -1
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def event_wall(event: Mapping[str, Any]) -> float | None:
    """The event's ``ts`` (``2026-11-21T05:10:00.123456Z``) as Unix seconds, or None."""
    ts = event.get("ts")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _ts_key(event: Mapping[str, Any]) -> str:
    ts = event.get("ts")
    return ts if isinstance(ts, str) else ""


# --------------------------------------------------------------------------- rendering

_HEAD = frozenset({"ts", "level", "event", "stage", "replica", "version"})
_BLOCKS = ("exception", "stack")  # multi-line fields, printed indented below the line
_LABEL = {"debug": "DEBUG", "info": "INFO", "warning": "WARN", "error": "ERROR", "critical": "CRIT"}
_LEVEL_COLOR = {
    "debug": "\x1b[34m",
    "info": "\x1b[32m",
    "warning": "\x1b[33m",
    "error": "\x1b[31m",
    "critical": "\x1b[1;31m",
}
_DIM, _BOLD, _RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"
_BARE = re.compile(r"[\w.:/@%+,-]+")  # strings printed without quotes
# Log content must not drive the terminal: control characters are shown escaped.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127) if c != 9}


def render(event: Mapping[str, Any], *, color: bool) -> str:
    """One readable line for ``event`` (plus indented lines for an exception)."""
    ts = event.get("ts")
    clock = ts[11:23] if isinstance(ts, str) and len(ts) >= 23 and ts[10] == "T" else "--:--:--.---"
    level = str(event.get("level", "?")).lower()
    label = _LABEL.get(level, level.upper()[:5]).ljust(5)
    stage, replica = event.get("stage", "?"), event.get("replica")
    who = f"{stage}" if replica is None or stage == "supervisor" else f"{stage}.{replica}"
    version = event.get("version")
    name = str(event.get("event", "?")).translate(_CONTROL)
    compact = name == "metrics"

    pairs = [
        f"{str(key).translate(_CONTROL)}={_value(value, compact)}"
        for key, value in event.items()
        if key not in _HEAD and not (key in _BLOCKS and isinstance(value, str))
    ]
    if color:
        clock = f"{_DIM}{clock}{_RESET}"
        label = f"{_LEVEL_COLOR.get(level, '')}{label}{_RESET}"
        name = f"{_BOLD}{name}{_RESET}"
    vtag = f"v{'-' if version is None else version}"
    line = " ".join([clock, label, who.translate(_CONTROL), vtag.translate(_CONTROL), name, *pairs])
    for key in _BLOCKS:
        block = event.get(key)
        if isinstance(block, str):
            line += "".join(f"\n    {text.translate(_CONTROL)}" for text in block.splitlines())
    return line


def _significant(value: float) -> str:
    """Four significant digits; large values stay positional (12350, not 1.235e+04)."""
    if math.isfinite(value) and 1e4 <= abs(value) < 1e15:
        return f"{round(value, 3 - math.floor(math.log10(abs(value)))):.0f}"
    return f"{value:.4g}"


def _value(value: Any, compact: bool) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return _significant(value) if compact else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else json.dumps(value)
    return json.dumps(value, default=str, separators=(",", ":"))


# --------------------------------------------------------------------------- command line


def add_logs_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``inflight logs``; ``run_logs`` takes the parsed result."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new events until the run ends (exit 1 if its supervisor was killed)",
    )
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="S",
        help="only this stage (square), replica (square.1) or supervisor; repeatable",
    )
    parser.add_argument("--level", metavar="L", help=f"minimum level: {', '.join(LEVELS)}")
    parser.add_argument(
        "--event",
        action="append",
        default=[],
        metavar="E",
        help="only events whose name matches this glob (replica_*, metrics); repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON events")
    parser.add_argument(
        "--csv",
        action="store_true",
        help="print the events' fields as CSV (header: every field, in order of first "
        "appearance), e.g. --event train_step --csv > steps.csv",
    )
    parser.add_argument(
        "--interval", type=float, default=0.2, metavar="SECONDS", help="poll interval with -f"
    )


def run_logs(args: argparse.Namespace) -> int:
    """Print (and with ``-f`` follow) a run's events; returns the process exit code."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return _fail(f"run directory not found: {run_dir}")
    if not (run_dir / "logs").is_dir():
        return _fail(f"no logs/ directory in {run_dir}; is it a run directory?")
    try:
        filt = LogFilter(stages=args.stage, level=args.level, events=args.event)
    except ValueError as exc:
        return _fail(str(exc))
    as_csv = getattr(args, "csv", False)
    if as_csv and (args.follow or args.json):
        return _fail("--csv makes one table of what the logs hold: not with -f or --json")

    color = not args.json and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    tail = LogTail(run_dir, filt=filt)
    try:
        if as_csv:
            write_csv(tail.poll(final=True), sys.stdout)
            sys.stdout.flush()
            return 0
        if not args.follow:
            _show(tail.poll(final=True), as_json=args.json, color=color)
            return 0
        while True:
            events = tail.poll()
            gone = None if tail.finished else tail.supervisor_gone()
            if tail.finished or gone is not None:
                # run_finished comes after every replica exited; one more read drains the rest
                # (and what replicas wrote as they died with a killed supervisor), shown in ts
                # order with this read: a replica's last line read late still precedes the end.
                events = sorted(events + tail.poll(final=True), key=_ts_key)
                _show(events, as_json=args.json, color=color)
                if tail.finished:
                    return 0
                print(
                    f"inflight logs: the run's supervisor (pid {gone}) is gone without "
                    "finishing the run (killed?); no more events will come",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            _show(events, as_json=args.json, color=color)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `inflight logs RUN | head`: the reader is gone, stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        return _fail(f"cannot read logs: {exc}")


def _show(events: Iterable[dict[str, Any]], *, as_json: bool, color: bool) -> None:
    out = sys.stdout
    for event in events:
        out.write((json.dumps(event) if as_json else render(event, color=color)) + "\n")
    out.flush()


def write_csv(events: Sequence[Mapping[str, Any]], out: Any) -> None:
    """``events`` as CSV on ``out``: one column per field, in order of first appearance; a
    field an event lacks is empty; lists and mappings are JSON; booleans true/false."""
    fields = list(dict.fromkeys(key for event in events for key in event))
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for event in events:
        writer.writerow({key: _cell(value) for key, value in event.items()})


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str, separators=(",", ":"))
    return value


def _fail(message: str) -> int:
    print(f"inflight logs: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="inflight logs", description=__doc__.splitlines()[0])
    add_logs_arguments(_parser)
    sys.exit(run_logs(_parser.parse_args()))
