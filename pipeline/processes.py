"""Child processes that die with the process that started them.

Replicas, the engines a generator launches and benchmark servers each run in their own process
group (so a Ctrl-C reaches only the supervisor), which also means a parent killed with SIGKILL
would leave them running, holding ports and GPU memory. On Linux, ``PR_SET_PDEATHSIG`` has the
kernel send them SIGKILL when their parent dies. Elsewhere this does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

__all__ = ["kill_with_parent"]

_PR_SET_PDEATHSIG = 1


def kill_with_parent(parent: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when ``parent`` (default: us) dies.

    libc is looked up here, before the fork: the child only makes the call, so nothing in it
    can block on a lock another thread held at fork time.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid() if parent is None else parent

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
