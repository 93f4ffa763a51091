"""Child processes that die with the process that started them, optionally pinned to cores.

Replicas, the engines a generator launches and benchmark servers each run in their own process
group (so a Ctrl-C reaches only the supervisor), which also means a parent killed with SIGKILL
would leave them running, holding ports and GPU memory. On Linux, ``PR_SET_PDEATHSIG`` has the
kernel send them SIGKILL when their parent dies. ``child_preexec(cores=...)`` also pins the child
to those CPU cores before it runs anything (``sched_setaffinity``), so that placement holds from
its first instruction on, threads it starts included. Elsewhere this does nothing.
Which cores is the placement plan's business (``pipeline.placement``), not this module's.

``name_thread(name)`` gives the calling thread that name in the operating system too (``top -H``,
``/proc/PID/task/TID/comm``, py-spy), so that tools can tell, say, an engine's scheduler from
the event loop of the process it shares (``bench/stage_cpu.py`` splits a process's CPU by it).

``exit_now(code)`` ends a child that has closed its sockets and flushed its logs without the
interpreter's teardown, which takes 0.5 s of CPU once torch and transformers are loaded: paid by
every replica and engine at every end and restart.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Collection
from typing import NoReturn

__all__ = ["child_preexec", "exit_now", "kill_with_parent", "name_thread"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def kill_with_parent(parent: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when ``parent`` (default: us) dies."""
    return child_preexec(parent=parent)


def child_preexec(
    *, cores: Collection[int] | None = None, parent: int | None = None
) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child dies with ``parent`` (default: us) and, given ``cores``,
    runs only on those CPU cores.

    libc and the affinity mask are prepared here, before the fork: the child only makes the
    calls, so nothing in it can block on a lock another thread held at fork time. A child that
    cannot be pinned fails to start (the parent gets the OSError), rather than running unpinned.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    parent = os.getpid() if parent is None else parent
    mask = None
    if cores is not None:
        if not cores:
            raise ValueError("cannot pin a process to no cores")
        size = max(128, (max(cores) // 64 + 1) * 8)  # bytes; glibc's cpu_set_t is 128
        mask = (ctypes.c_uint8 * size)()
        for core in cores:
            mask[core // 8] |= 1 << (core % 8)
        setaffinity = libc.sched_setaffinity
        setaffinity.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        if mask is not None and setaffinity(0, size, mask) != 0:
            errno = ctypes.get_errno()
            raise OSError(
                errno, f"sched_setaffinity to cores {sorted(cores)}: {os.strerror(errno)}"
            )

    return preexec


def name_thread(name: str) -> None:
    """Name the calling thread ``name`` (its first 15 bytes) for the operating system; Linux
    only, and never fails (a name is for tools to read, nothing depends on it)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code``, skipping the interpreter's
    teardown (atexit handlers, module and object finalizers).

    Only for a process that has already released what it holds: sockets closed, log files
    flushed, children ended. Its own open files are closed by the kernel.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream has nothing left to write
    os._exit(code)
