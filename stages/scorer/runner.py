"""Reward functions run in worker processes, each call under a timeout.

A reward function is user code: it may be slow, hang, crash the interpreter or use ``SIGALRM``
(``math-verify`` does), none of which may stop the stage's event loop. ``RewardRunner`` keeps
its own small pool of worker processes, each connected by a pipe, and sends every call (one
function, one batch of completions) to an idle worker. The event loop waits on the pipe without
blocking; a call that has not answered after ``timeout_s`` gets its worker killed and replaced
(``concurrent.futures.ProcessPoolExecutor`` cannot cancel a running call, hence our own pool).
A call that raises, times out, kills its worker, returns the wrong number of values, or values
that are not finite numbers gives those completions reward 0 with an ``error`` in their info; it
is counted (``errors``, ``timeouts``), logged as ``reward_failed``, and scoring goes on.

Functions are named, never passed: each worker resolves the names itself through the plugin
registry (entry points of ``inflight.rewards`` or dotted paths ``package.module:name``), so a
function must be reachable by name from a fresh interpreter: closures and lambdas built at run
time cannot be used (a function, ``functools.partial`` or even a lambda assigned to a module-level
name can). The runner resolves every name in its own process too, at construction, so an
unknown name fails with a ``PluginError`` before any work arrives.

Workers are started with ``forkserver`` where available (Linux: forking a clean single-threaded
server, never the stage process with its threads), else ``spawn``; on Linux they get SIGKILL
when that server, and so the stage process, dies. Not here: decoding, grouping (the stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import structlog

from pipeline.processes import kill_with_parent
from pipeline.registry import PluginError, resolve

__all__ = ["RewardRunner", "resolve_reward"]

_INLINE_SEND_BYTES = 64 * 1024  # bigger requests are written from a thread (the pipe may fill)


def resolve_reward(name: str) -> Callable[..., Any]:
    """The reward function ``name`` names (entry point or dotted path); PluginError otherwise."""
    fn = resolve("reward", name)
    if not callable(fn):
        raise PluginError(f"reward {name!r} resolved to {fn!r}, which is not callable")
    return fn


# ---------------------------------------------------------------------------------- worker side
def _checked(values: Any, n: int) -> tuple[list[float | None], dict[int, str]] | str:
    """A function's return value as ``(values, bad items)``, or why it is unusable as a whole."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        return f"returned {type(values).__name__}, expected a list of {n} numbers"
    if len(values) != n:
        return f"returned {len(values)} values for {n} completions"
    out: list[float | None] = []
    bad: dict[int, str] = {}
    for i, v in enumerate(values):
        if v is None:  # TRL's "does not apply to this completion"
            out.append(None)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            x = float(v)
        except (TypeError, ValueError):
            bad[i] = f"value {i} is not a number: {type(v).__name__}"
            out.append(None)
            continue
        if not math.isfinite(x):
            bad[i] = f"value {i} is {x}"
            out.append(None)
            continue
        out.append(x)
    return out, bad


def _worker_main(conn: Connection, names: list[str]) -> None:
    """A worker process: resolve the functions, then answer ``(name, pickled kwargs)`` calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the supervisor to handle
    die_with_parent = kill_with_parent(os.getppid())
    if die_with_parent is not None:
        die_with_parent()
    try:
        functions = {name: resolve_reward(name) for name in names}
    except Exception as exc:  # reported to the parent, which fails its setup with it
        conn.send(("failed", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            name, payload = conn.recv()
        except (EOFError, OSError):
            return  # the runner closed the pipe or died
        try:
            kwargs = pickle.loads(payload)
            checked = _checked(functions[name](**kwargs), len(kwargs["completions"]))
            reply = ("ok", checked) if isinstance(checked, tuple) else ("error", checked)
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


# ---------------------------------------------------------------------------------- parent side
class _WorkerLost(Exception):
    pass


@dataclass(eq=False)
class _Worker:
    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection


@dataclass
class _Outcome:
    """What one call of one function gave for a batch."""

    values: list[float | None]
    bad: dict[int, str] = field(default_factory=dict)  # completion index -> problem
    error: str | None = None  # the whole call failed


class RewardRunner:
    """A pool of ``workers`` processes that score batches with weighted reward functions.

    ``specs`` are ``(name, weight)`` pairs; a completion's reward is the weighted sum of the
    functions' values (a ``None`` value adds nothing), or 0 when any function failed for it.
    Use ``async with RewardRunner(...) as runner`` (or ``start()`` / ``aclose()``).
    """

    def __init__(
        self,
        specs: Sequence[tuple[str, float]],
        workers: int = 2,
        timeout_s: float = 10.0,
        *,
        start_timeout_s: float = 120.0,
        log: Any = None,
    ) -> None:
        if not specs:
            raise ValueError("a RewardRunner needs at least one reward function")
        names = [name for name, _ in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions are listed more than once: {names}")
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        for name in names:
            resolve_reward(name)  # fail here, in the stage's setup, not in a worker later
        self.specs = [(name, float(weight)) for name, weight in specs]
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self.log = log if log is not None else structlog.get_logger("scorer")
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "restarts": 0}
        methods = multiprocessing.get_all_start_methods()
        self._mp = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._replacing: set[asyncio.Task] = set()
        self._failure: str | None = None
        self._closed = False

    async def __aenter__(self) -> RewardRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the workers; raises PluginError when a worker cannot resolve a function."""
        started = await asyncio.gather(
            *(self._start_worker() for _ in range(self.workers)), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        for worker in started:
            if isinstance(worker, _Worker):
                self._idle.put_nowait(worker)
        if failed:
            await self.aclose()
            raise failed[0]

    async def score(self, kwargs: Mapping[str, Any], **context: Any) -> list[tuple[float, dict]]:
        """``(reward, info)`` per completion of ``kwargs["completions"]``.

        ``kwargs`` are the keyword lists every function gets, aligned with ``completions``.
        ``info`` maps each function's name to its value (None when it gave none) and has
        ``error`` when one failed for that completion. ``context`` (e.g. ``group_id``) is added
        to ``reward_failed`` log events.
        """
        n = len(kwargs["completions"])
        payload = pickle.dumps(dict(kwargs), protocol=pickle.HIGHEST_PROTOCOL)  # once for all
        outcomes = await asyncio.gather(
            *(self._call(name, payload, n, context) for name, _ in self.specs)
        )
        scored = []
        for i in range(n):
            info: dict[str, Any] = {}
            errors = []
            total = 0.0
            for (name, weight), outcome in zip(self.specs, outcomes, strict=True):
                value = outcome.values[i]
                info[name] = value
                problem = outcome.error or outcome.bad.get(i)
                if problem is not None:
                    errors.append(f"{name}: {problem}")
                elif value is not None:
                    total += weight * value
            if errors:
                info["error"] = "; ".join(errors)
                total = 0.0
            scored.append((total, info))
        return scored

    def stats(self) -> dict[str, int]:
        return {**self.counts, "workers_idle": self._idle.qsize()}

    async def aclose(self) -> None:
        """Kill every worker (a reward function has nothing to save) and wait for them."""
        self._closed = True
        for task in self._replacing:
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        workers, self._all = list(self._all), set()
        for worker in workers:
            self._kill(worker)
        await asyncio.gather(
            *(asyncio.to_thread(w.proc.join, 5.0) for w in workers), return_exceptions=True
        )

    # ---------------------------------------------------------------- calls
    async def _call(
        self, name: str, payload: bytes, n: int, context: Mapping[str, Any]
    ) -> _Outcome:
        worker = await self._idle.get()
        if worker is None:  # the pool is broken: wake the next waiter too, then fail
            self._idle.put_nowait(None)
            raise RuntimeError(f"reward workers cannot be restarted: {self._failure}")
        self.counts["calls"] += 1
        try:
            reply = await self._exchange(worker, (name, payload), self.timeout_s)
        except asyncio.TimeoutError:
            self.counts["timeouts"] += 1
            self._replace(worker, "timeout")
            return self._failed(name, n, f"timed out after {self.timeout_s} s", context)
        except _WorkerLost as exc:
            self.counts["errors"] += 1
            self._replace(worker, "lost")
            return self._failed(name, n, str(exc), context)
        except BaseException:  # cancelled: the worker may be busy with it, so it cannot be reused
            self._replace(worker, "interrupted")
            raise
        self._idle.put_nowait(worker)
        status, result = reply
        if status != "ok":
            self.counts["errors"] += 1
            return self._failed(name, n, result, context)
        values, bad = result
        if bad:
            self.counts["errors"] += 1
            first = next(iter(bad.values()))
            self.log.warning("reward_failed", fn=name, error=first, completions=len(bad), **context)
        return _Outcome(values, bad)

    def _failed(self, name: str, n: int, error: str, context: Mapping[str, Any]) -> _Outcome:
        self.log.warning("reward_failed", fn=name, error=error, completions=n, **context)
        return _Outcome([None] * n, error=error)

    async def _exchange(self, worker: _Worker, request: Any, timeout: float) -> Any:
        """Send ``request`` to ``worker`` (if any) and wait up to ``timeout`` s for its reply."""
        if request is not None:
            data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                if len(data) > _INLINE_SEND_BYTES:
                    await asyncio.to_thread(worker.conn.send_bytes, data)
                else:
                    worker.conn.send_bytes(data)
            except OSError as exc:
                raise _WorkerLost(f"reward worker died ({exc})") from None
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fd)
        try:
            return worker.conn.recv()  # a reply is small: the rest of it follows at once
        except (EOFError, OSError):
            worker.proc.join(1.0)
            code = worker.proc.exitcode
            raise _WorkerLost(f"reward worker died (exit code {code})") from None

    # ---------------------------------------------------------------- workers
    def _spawn(self) -> _Worker:
        ours, theirs = self._mp.Pipe()
        names = [name for name, _ in self.specs]
        proc = self._mp.Process(
            target=_worker_main, args=(theirs, names), name="reward-worker", daemon=True
        )
        proc.start()
        theirs.close()
        return _Worker(proc, ours)

    async def _start_worker(self) -> _Worker:
        worker = await asyncio.to_thread(self._spawn)  # the first start boots the forkserver
        self._all.add(worker)
        try:
            status, detail = await self._exchange(worker, None, self.start_timeout_s)
        except (asyncio.TimeoutError, _WorkerLost) as exc:
            self._kill(worker)
            raise RuntimeError(f"a reward worker did not start: {exc!r}") from None
        except BaseException:
            self._kill(worker)
            raise
        if status != "ready":
            self._kill(worker)
            raise PluginError(f"a reward worker cannot load the reward functions: {detail}")
        return worker

    def _kill(self, worker: _Worker) -> None:
        self._all.discard(worker)
        with contextlib.suppress(Exception):
            worker.proc.kill()
        with contextlib.suppress(Exception):
            worker.conn.close()

    def _replace(self, worker: _Worker, reason: str) -> None:
        self._kill(worker)
        if self._closed:
            return
        self.counts["restarts"] += 1
        self.log.info("reward_worker_replaced", pid=worker.proc.pid, reason=reason)
        task = asyncio.create_task(self._restart(worker))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _restart(self, old: _Worker) -> None:
        await asyncio.to_thread(old.proc.join, 5.0)  # reap it
        try:
            worker = await self._start_worker()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = str(exc)
            self.log.error("reward_worker_restart_failed", error=str(exc))
            self._idle.put_nowait(None)
            return
        self._idle.put_nowait(worker)
