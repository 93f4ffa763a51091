"""Structured logging of one Inflight process: JSON lines in the run directory.

``configure_process_logging`` is called once when a process starts (a stage replica, the
supervisor), never at import time. From then on every structlog event of the process, and every
record of the standard library's ``logging`` (transformers, deepspeed, asyncio, ``warnings``), is
one JSON object on one line of that process's log file::

    {"ts": "2026-11-21T05:10:00.123456Z", "level": "info", "event": "replica_started",
     "stage": "square", "replica": 0, "version": 3, "port": 5555}

``stage``, ``replica`` and ``version`` are added by a processor, so the events of every task carry
them without binding; ``version`` is read as each event is emitted, so a weight update shows in the
next line. ``ts``, ``level``, ``stage``, ``replica`` and ``version`` are reserved: a value passed
under one of those keys is replaced, so name the subject of an event differently
(``target="square.1"``). Per-task context can still be added with
``structlog.contextvars.bind_contextvars``.

Each line is written with one ``write`` on an ``O_APPEND`` descriptor, unbuffered, so a reader
(``inflight logs -f``) sees whole events as soon as they happen and lines never interleave.
This module does not rotate, compress or ship files, and does not read them back: see
``pipeline.log_view``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
from structlog.typing import FilteringBoundLogger

from pipeline.log_view import LEVELS, render

__all__ = [
    "ReplicaLog",
    "adopt_library_loggers",
    "close_process_logging",
    "configure_process_logging",
    "set_process_level",
]

_LEVEL_NO = {name: getattr(logging, name.upper()) for name in LEVELS}
# Key order of every JSON line: the fixed head first, so the files read well with `less`.
_HEAD = ("ts", "level", "event", "stage", "replica", "version")


def configure_process_logging(
    log_file: Path,
    *,
    stage: str,
    replica: int,
    level: str = "info",
    version: Callable[[], int] = lambda: 0,
    console: bool = False,
    console_level: str = "info",
) -> FilteringBoundLogger:
    """Send this process's structlog events and stdlib ``logging`` records to ``log_file``.

    ``level`` filters what reaches the file; with ``console=True`` a readable view of events at
    ``console_level`` or above also goes to stderr. Calling it again replaces the previous
    configuration (closing its file); ``close_process_logging`` undoes it. Returns a logger; a
    ``structlog.get_logger()`` anywhere in the process logs the same way.
    """
    file_level = _level_no(level, "level")
    console_no = _level_no(console_level, "console_level") if console else None
    close_process_logging()

    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sink = _Sink(log_file, file_level, console_no)
    sink_logger = _SinkLogger(sink)
    min_level = file_level if console_no is None else min(file_level, console_no)
    structlog.configure(
        processors=_processors(stage, replica, version),
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=lambda *_args: sink_logger,
        # Not cached, so loggers created before a reconfiguration (tests) follow the new one.
        cache_logger_on_first_use=False,
    )
    log: FilteringBoundLogger = structlog.get_logger().bind()

    root = logging.getLogger()
    handler = _StdlibHandler(log)
    saved_root_level = root.level
    root.addHandler(handler)
    root.setLevel(min_level)
    # A line per HTTP request (httpx logs every one at INFO: each call of an openai agent) is
    # noise in a run's log, and rendering it costs more than the call's routing: debug only.
    for name in _PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(
            logging.NOTSET if min_level <= logging.DEBUG else logging.WARNING
        )
    logging.captureWarnings(True)
    adopt_library_loggers()

    global _active
    _active = _Active(sink, handler, saved_root_level)
    return log


class ReplicaLog:
    """The log of one stage replica that shares its process with others (``pipeline.host``):
    its own file, its own ``stage``, ``replica`` and ``version`` on every event, whatever the
    process's configuration. ``logger`` is what the replica logs through; ``close()`` closes
    the file (events logged afterwards are dropped)."""

    def __init__(
        self,
        log_file: Path,
        *,
        stage: str,
        replica: int,
        level: str = "info",
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        file_level = _level_no(level, "level")
        log_file = Path(log_file)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self._sink = _Sink(log_file, file_level, None)
        self.logger: FilteringBoundLogger = structlog.wrap_logger(
            _SinkLogger(self._sink),
            processors=_processors(stage, replica, version),
            wrapper_class=structlog.make_filtering_bound_logger(file_level),
        )

    def close(self) -> None:
        self._sink.close()


def _processors(stage: str, replica: int, version: Callable[[], int]) -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,  # exc_info -> "exception" string
        _identity(stage, replica, version),
        _timestamp,
        _to_sink,
    ]


_PER_REQUEST_LOGGERS = ("httpx", "httpcore")


def adopt_library_loggers() -> None:
    """Route libraries that keep their own console handler into this process's log file.

    transformers gives its root logger a stderr handler and turns propagation off the first time
    it logs; call this again after importing it (the actor does, after a stage's ``setup``).
    """
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


def close_process_logging() -> None:
    """Undo ``configure_process_logging``: detach from stdlib logging and close the file.

    Events logged afterwards through a logger from the closed configuration are dropped; new
    ``structlog.get_logger()`` calls fall back to structlog's defaults (stdout). Idempotent.
    """
    global _active
    active, _active = _active, None
    if active is None:
        return
    root = logging.getLogger()
    root.removeHandler(active.handler)
    root.setLevel(active.saved_root_level)
    logging.captureWarnings(False)
    structlog.reset_defaults()
    active.sink.close()


def set_process_level(level: str) -> None:
    """Change what this process's configuration logs, while it runs: events at ``level`` or
    above reach its file and the console (stdlib records too). Loggers from
    ``structlog.get_logger()`` follow it; one bound before (``configure_process_logging``'s
    own return value) keeps the level it was made with. ValueError for an unknown level;
    without a configuration only the stdlib root logger's level changes."""
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"Unknown level: {level!r}")
    logging.getLogger().setLevel(number)
    active = _active
    if active is None:
        return
    active.sink.set_level(number)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(number))
    active.handler.relog(structlog.get_logger().bind())  # stdlib records through the new one


# --------------------------------------------------------------------------- internals


@dataclass
class _Active:
    """What the current configuration installed, so that closing it can remove exactly that."""

    sink: _Sink
    handler: _StdlibHandler
    saved_root_level: int


_active: _Active | None = None


def _level_no(name: str, what: str) -> int:
    level = _LEVEL_NO.get(str(name).lower())
    if level is None:
        raise ValueError(f"unknown log {what} {name!r}; choose one of {', '.join(LEVELS)}")
    return level


class _Sink:
    """Where every finished event goes: the JSON-lines file and, optionally, stderr."""

    def __init__(self, path: Path, file_level: int, console_level: int | None) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(path, flags, 0o644)
        self._file_level = file_level
        self._console_level = console_level
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        level = _LEVEL_NO.get(event.get("level", ""), logging.INFO)
        # Serialize outside the lock: a value's __str__ may itself log.
        line = _json_line(event) if level >= self._file_level else None
        text = None
        if self._console_level is not None and level >= self._console_level:
            color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
            text = render(event, color=color) + "\n"
        with self._lock:
            if self._fd is None:  # closed by a reconfiguration: this logger is stale
                return
            if line is not None:
                view = memoryview(line)
                while view:  # one write in practice; loop only on a short write
                    view = view[os.write(self._fd, view) :]
            if text is not None:
                sys.stderr.write(text)
                sys.stderr.flush()

    def set_level(self, level: int) -> None:
        """Events at ``level`` or above reach the file, and the console where it has one."""
        self._file_level = level
        if self._console_level is not None:
            self._console_level = level

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _json_line(event: dict[str, Any]) -> bytes:
    ordered = {key: event[key] for key in _HEAD if key in event}
    ordered.update(event)
    try:
        text = json.dumps(ordered, default=str)
    except (TypeError, ValueError) as exc:  # e.g. a tuple as a dict key: keep the event readable
        head = {key: ordered[key] for key in _HEAD if key in ordered}
        text = json.dumps({**head, "log_error": repr(exc), "repr": repr(ordered)}, default=str)
    return (text + "\n").encode("utf-8", "backslashreplace")


class _SinkLogger:
    """The object structlog wraps: every level method hands the finished event to the sink."""

    def __init__(self, sink: _Sink) -> None:
        self._sink = sink

    def msg(self, event: dict[str, Any]) -> None:
        self._sink.emit(event)

    debug = info = warning = warn = error = critical = fatal = exception = msg


def _to_sink(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Hand the dict itself to _SinkLogger: rendering happens there, once per destination.
    return (dict(event_dict),), {}


def _identity(
    stage: str, replica: int, version: Callable[[], int]
) -> Callable[[Any, str, MutableMapping[str, Any]], MutableMapping[str, Any]]:
    def add_identity(
        _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        event_dict["stage"] = stage
        event_dict["replica"] = replica
        try:
            event_dict["version"] = version()
        except Exception as exc:  # a broken version callback must not cost the event itself
            event_dict["version"] = None
            event_dict["version_error"] = repr(exc)
        return event_dict

    return add_identity


def _timestamp(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    # Always six fractional digits, so timestamps sort as strings (log_view merges files by ts).
    event_dict["ts"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return event_dict


def _stdlib_level(levelno: int) -> int:
    """The standard level at or below ``levelno`` (custom levels such as TRACE=5 map down)."""
    for level in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= level:
            return level
    return logging.DEBUG


def _cpu_kernel_notice(logger: str, message: str) -> bool:
    """Whether a record is transformers' notice that a CUDA kernel (causal-conv1d's,
    flash-linear-attention's: a linear-attention model's, such as Qwen3.5's) falls back to
    its PyTorch reference in a process without CUDA: there is nothing to install on a CPU, so
    it is information, not a warning (with CUDA, where the kernels would run, it stays one)."""
    if not logger.startswith("transformers") or "falling back to its reference PyTorch" not in (
        message
    ):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


class _StdlibHandler(logging.Handler):
    """Turns a stdlib ``LogRecord`` into a ``stdlib_log`` event of this process."""

    def __init__(self, log: FilteringBoundLogger) -> None:
        super().__init__()
        self._log = log

    def relog(self, log: FilteringBoundLogger) -> None:
        """Log through ``log`` from now on (the process's level changed)."""
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            kw: dict[str, Any] = {"logger": record.name, "message": message}
            if record.exc_info:
                kw["exc_info"] = record.exc_info
            if record.stack_info:
                kw["stack"] = record.stack_info
            level = _stdlib_level(record.levelno)
            if level == logging.WARNING and _cpu_kernel_notice(record.name, message):
                level = logging.INFO
            self._log.log(level, "stdlib_log", **kw)
        except Exception:
            self.handleError(record)  # the stdlib's own contract: report on stderr, go on
