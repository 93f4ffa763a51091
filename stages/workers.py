"""Worker processes for user code: reward functions, tools (and environments) run outside the
stage's process, each call under a timeout.

User code may be slow, hang, crash the interpreter or use ``SIGALRM`` (``math-verify`` does), none
of which may stop a stage's event loop. A worker is a child process connected by a pipe; the
event loop waits on the pipe without blocking (``exchange``), and a call that has not answered
in time gets its worker killed (``concurrent.futures.ProcessPoolExecutor`` cannot cancel a
running call, hence our own processes).

Two levels:

- The pieces, for a pool of your own (a stateful environment pool, say): ``spawn_worker`` starts
  ``target(conn, *args)`` in a child (``forkserver`` where available, else ``spawn``), which calls
  ``prepare_worker()`` first (it then ignores Ctrl-C and, on Linux, dies with the stage) and
  sends ``("ready", detail)`` or ``("failed", why)``; ``wait_ready`` reads that, ``exchange``
  sends one request and waits for its reply (``asyncio.TimeoutError`` or ``WorkerLost``),
  ``kill`` and ``reap`` end it. ``serve`` is a worker's loop: one reply per request, whatever the
  handler raises.
- ``FunctionPool``: ``workers`` identical processes, each resolving the same named functions
  through the plugin registry (one ``kind``: ``reward``, ``tool``...). ``call(name, request)``
  takes an idle worker, runs ``adapter(function, request)`` there, and returns a ``Reply``: ``ok``
  with the adapter's value, or ``error`` (it raised), ``timeout`` (its worker was killed and is
  being replaced) or ``lost`` (its worker died; replaced). Failures are counted, never raised;
  only a pool that cannot restart its workers raises (``PoolBroken``).

Functions are named, never passed: a function must be reachable by name from a fresh interpreter
(an entry point or a module-level name; closures built at run time cannot be used). The pool
resolves every name in its own process too, at construction, so an unknown name fails with a
``PluginError`` before any work arrives.

Not here: what a call means (``stages.scorer.runner``, ``stages.rollouts.tools``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import structlog

from pipeline.processes import kill_with_parent
from pipeline.registry import PluginError, resolve

__all__ = [
    "FunctionPool",
    "PoolBroken",
    "Reply",
    "Worker",
    "WorkerLost",
    "call_with_kwargs",
    "exchange",
    "kill",
    "mp_context",
    "prepare_worker",
    "reap",
    "resolve_function",
    "serve",
    "spawn_worker",
    "wait_ready",
]

_INLINE_SEND_BYTES = 64 * 1024  # bigger requests are written from a thread (the pipe may fill)


def resolve_function(kind: str, name: str) -> Callable[..., Any]:
    """The function ``name`` names among the plugins of ``kind``; PluginError otherwise."""
    fn = resolve(kind, name)
    if not callable(fn):
        raise PluginError(f"{kind} {name!r} resolved to {fn!r}, which is not callable")
    return fn


# ---------------------------------------------------------------------------------- worker side
def prepare_worker() -> None:
    """First thing a worker does: leave Ctrl-C to the supervisor, die with the stage (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent = kill_with_parent(os.getppid())
    if die_with_parent is not None:
        die_with_parent()


def serve(conn: Connection, handle: Callable[[Any], Any]) -> None:
    """Answer requests until the pipe closes: ``("ok", handle(request))``, or ``("error",
    "Type: message")`` when it raises or its value cannot be sent back."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the stage closed the pipe or died
        try:
            reply: tuple[str, Any] = ("ok", handle(request))
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable value: say so rather than die
            why = f"its value cannot be sent back ({type(exc).__name__}: {exc})"
            data = pickle.dumps(("error", why), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.send_bytes(data)
        except OSError:
            return


def call_with_kwargs(fn: Callable[..., Any], request: Any) -> Any:
    """The default adapter: ``request`` is a keyword-argument map."""
    return fn(**request)


def _pool_worker_main(
    conn: Connection, kind: str, names: list[str], adapter: Callable[[Any, Any], Any]
) -> None:
    """A ``FunctionPool`` worker: resolve the functions, then answer ``(name, request)`` calls."""
    prepare_worker()
    try:
        functions = {name: resolve_function(kind, name) for name in names}
    except Exception as exc:  # reported to the stage, which fails its setup with it
        conn.send(("failed", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    serve(conn, lambda request: adapter(functions[request[0]], request[1]))


# ---------------------------------------------------------------------------------- stage side
class WorkerLost(Exception):
    """The worker's pipe closed: it died (the message says how) or was killed."""


class PoolBroken(RuntimeError):
    """A pool whose workers cannot be restarted; every later call raises it too."""


@dataclass(eq=False)
class Worker:
    """One worker process and the stage's end of its pipe. ``label`` names it in messages."""

    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    label: str = "worker"

    @property
    def pid(self) -> int | None:
        return self.proc.pid


def mp_context() -> Any:
    """``forkserver`` where available (forks a clean single-threaded server, never the stage
    process with its threads), else ``spawn``."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def spawn_worker(target: Callable[..., None], args: Sequence[Any], *, label: str) -> Worker:
    """Start ``target(conn, *args)`` in a daemon child process. Blocking: the first start boots
    the forkserver (seconds), so call it with ``asyncio.to_thread`` from an event loop.
    ``target`` and ``args`` must be picklable (a module-level function)."""
    mp = mp_context()
    ours, theirs = mp.Pipe()
    proc = mp.Process(target=target, args=(theirs, *args), name=f"{label}-worker", daemon=True)
    proc.start()
    theirs.close()
    return Worker(proc, ours, label)


async def exchange(worker: Worker, request: Any, timeout: float) -> Any:
    """Send ``request`` to ``worker`` (none when it is None) and wait up to ``timeout`` s for its
    reply, without blocking the event loop. Raises ``asyncio.TimeoutError`` (the worker may still
    be busy: kill it) or ``WorkerLost``. A reply must be small (it is read at once)."""
    if request is not None:
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            if len(data) > _INLINE_SEND_BYTES:
                await asyncio.to_thread(worker.conn.send_bytes, data)
            else:
                worker.conn.send_bytes(data)
        except OSError as exc:
            raise WorkerLost(f"{worker.label} worker died ({exc})") from None
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    try:
        fd = worker.conn.fileno()
    except OSError:  # closed: killed meanwhile
        raise WorkerLost(f"{worker.label} worker was killed") from None
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
        raise WorkerLost(f"{worker.label} worker died (exit code {code})") from None


async def wait_ready(worker: Worker, timeout: float) -> Any:
    """Wait for a new worker's ``("ready", detail)`` and return ``detail``. Kills the worker and
    raises RuntimeError when it does not answer or dies, ``PluginError`` when it reports
    ``("failed", why)`` (it could not load what it runs)."""
    try:
        status, detail = await exchange(worker, None, timeout)
    except (asyncio.TimeoutError, WorkerLost) as exc:
        kill(worker)
        raise RuntimeError(f"a {worker.label} worker did not start: {exc!r}") from None
    except BaseException:
        kill(worker)
        raise
    if status != "ready":
        kill(worker)
        raise PluginError(
            f"a {worker.label} worker cannot load the {worker.label} functions: {detail}"
        )
    return detail


def kill(worker: Worker) -> None:
    """SIGKILL the worker and close our end of its pipe (nothing it holds is saved)."""
    with contextlib.suppress(Exception):
        worker.proc.kill()
    with contextlib.suppress(Exception):
        worker.conn.close()


async def reap(workers: Iterable[Worker], timeout: float = 5.0) -> None:
    """Wait (in threads) for killed workers to exit, so none is left a zombie."""
    await asyncio.gather(
        *(asyncio.to_thread(w.proc.join, timeout) for w in workers), return_exceptions=True
    )


@dataclass(frozen=True)
class Reply:
    """How one pool call went: ``value`` when ``ok``, else ``error`` says why."""

    status: Literal["ok", "error", "timeout", "lost"]
    value: Any = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class InlinePool:
    """``FunctionPool``'s interface without processes: ``adapter(function, request)`` runs in
    the caller's thread, on its event loop, one call at a time. No ``timeout_s`` can be
    enforced (a call that hangs stops the loop) and a crash takes the caller with it: for
    cheap functions that are trusted, where a process hand-over costs more than the call
    (the built-in rewards). A function that raises is an ``error`` reply, as in a worker."""

    def __init__(
        self,
        kind: str,
        names: Sequence[str],
        *,
        adapter: Callable[[Any, Any], Any] = call_with_kwargs,
        label: str = "",
        log: Any = None,
    ) -> None:
        if not names:
            raise ValueError(f"a pool of {kind} functions needs at least one function")
        self.functions = {name: resolve_function(kind, name) for name in names}
        self.adapter = adapter
        self.label = label or kind
        self.log = log if log is not None else structlog.get_logger(self.label)
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "lost": 0, "restarts": 0}
        self.live: set[Worker] = set()  # no worker processes

    def idle(self) -> int:
        return 1

    async def start(self) -> None:
        pass

    async def call(self, name: str, request: Any, *, timeout_s: float | None = None) -> Reply:
        """Run ``adapter(name's function, request)`` here and now (``timeout_s`` is ignored)."""
        self.counts["calls"] += 1
        try:
            return Reply("ok", self.adapter(self.functions[name], request))
        except Exception as exc:
            self.counts["errors"] += 1
            return Reply("error", error=f"{type(exc).__name__}: {exc}")

    def stats(self) -> dict[str, int]:
        return {**self.counts, "workers_idle": 1}

    async def aclose(self) -> None:
        pass


class FunctionPool:
    """``workers`` processes that run named functions of one plugin ``kind``, one call at a time
    each, every call under ``timeout_s``; a worker that times out or dies is replaced.

    ``adapter(function, request) -> value`` runs in the worker (a module-level function: it is
    pickled by name); the default calls ``function(**request)``. ``label`` names the workers in
    messages and log events (``{label}_worker_replaced``). Use ``async with`` or ``start()`` /
    ``aclose()``. ``counts``: ``calls``, ``errors`` (raised), ``timeouts``, ``lost``, ``restarts``.
    """

    def __init__(
        self,
        kind: str,
        names: Sequence[str],
        *,
        workers: int = 1,
        timeout_s: float = 10.0,
        adapter: Callable[[Any, Any], Any] = call_with_kwargs,
        label: str = "",
        start_timeout_s: float = 120.0,
        log: Any = None,
    ) -> None:
        if not names:
            raise ValueError(f"a pool of {kind} functions needs at least one function")
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        for name in names:
            resolve_function(kind, name)  # fail here, in the stage's setup, not in a worker later
        self.kind, self.names, self.adapter = kind, list(dict.fromkeys(names)), adapter
        self.label = label or kind
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self.log = log if log is not None else structlog.get_logger(self.label)
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "lost": 0, "restarts": 0}
        self._idle: asyncio.Queue[Worker | None] = asyncio.Queue()
        self._all: set[Worker] = set()
        self._replacing: set[asyncio.Task] = set()
        self._failure: str | None = None
        self._closed = False

    async def __aenter__(self) -> FunctionPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def live(self) -> set[Worker]:
        """The workers started and not killed (idle or busy)."""
        return self._all

    def idle(self) -> int:
        return self._idle.qsize()

    async def start(self) -> None:
        """Start the workers; raises PluginError when a worker cannot resolve a function."""
        started = await asyncio.gather(
            *(self._start_worker() for _ in range(self.workers)), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        for worker in started:
            if isinstance(worker, Worker):
                self._idle.put_nowait(worker)
        if failed:
            await self.aclose()
            raise failed[0]

    async def call(self, name: str, request: Any, *, timeout_s: float | None = None) -> Reply:
        """Run ``adapter(name's function, request)`` in an idle worker (waiting for one)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        worker = await self._idle.get()
        if worker is None:  # the pool is broken: wake the next waiter too, then fail
            self._idle.put_nowait(None)
            raise PoolBroken(f"{self.label} workers cannot be restarted: {self._failure}")
        self.counts["calls"] += 1
        try:
            status, value = await exchange(worker, (name, request), timeout)
        except asyncio.TimeoutError:
            self.counts["timeouts"] += 1
            self._replace(worker, "timeout")
            return Reply("timeout", error=f"timed out after {timeout} s")
        except WorkerLost as exc:
            self.counts["lost"] += 1
            self._replace(worker, "lost")
            return Reply("lost", error=str(exc))
        except BaseException:  # cancelled: the worker may be busy with it, so it cannot be reused
            self._replace(worker, "interrupted")
            raise
        self._idle.put_nowait(worker)
        if status != "ok":
            self.counts["errors"] += 1
            return Reply("error", error=value)
        return Reply("ok", value)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "workers_idle": self._idle.qsize()}

    async def aclose(self) -> None:
        """Kill every worker (a call has nothing to save) and wait for them."""
        self._closed = True
        for task in self._replacing:
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        workers, self._all = list(self._all), set()
        for worker in workers:
            kill(worker)
        await reap(workers)

    # ---------------------------------------------------------------- workers
    async def _start_worker(self) -> Worker:
        args = (self.kind, self.names, self.adapter)
        worker = await asyncio.to_thread(spawn_worker, _pool_worker_main, args, label=self.label)
        self._all.add(worker)  # from now on, aclose() kills it
        try:
            await wait_ready(worker, self.start_timeout_s)
        except BaseException:
            self._all.discard(worker)
            raise
        return worker

    def _replace(self, worker: Worker, reason: str) -> None:
        self._all.discard(worker)
        kill(worker)
        if self._closed:
            return
        self.counts["restarts"] += 1
        self.log.info(f"{self.label}_worker_replaced", pid=worker.pid, reason=reason)
        task = asyncio.create_task(self._restart(worker))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _restart(self, old: Worker) -> None:
        await reap([old])
        try:
            worker = await self._start_worker()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = str(exc)
            self.log.error(f"{self.label}_worker_restart_failed", error=str(exc))
            self._idle.put_nowait(None)
            return
        self._idle.put_nowait(worker)
