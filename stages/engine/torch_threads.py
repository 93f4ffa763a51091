"""Which thread runs torch's parallel work in an engine: the scheduler's, and no other that
lives on.

torch's CPU kernels run their parallel regions on OpenMP (libgomp) teams, one team per thread
that runs such a region, kept as long as that thread lives. Once libgomp manages more threads
than the machine has CPUs, it throttles how long a waiting thread spins at a barrier, so every
small region of every team pays for a sleep and a wake-up: on 2 cores, a thread's small matmuls
and softmaxes ran 2.1x slower while another live thread (the main thread, after loading a model)
held an idle team of 2, and as fast as alone once the other thread had ended
(``python bench/torch_threads.py``: 0.585 s alone, 1.237 s beside an idle team, 0.583 s after
the other thread ended, medians of 5).

So the engine's start-up work (loading the model, building the scheduler: its fused weights)
runs on a thread that ends when it is done (``in_passing_thread``), taking its team with it,
and the scheduler's thread is the one that keeps a team. The event loop's own work stays light
(no parallel kernels: what is heavy, such as a weight update, runs on the scheduler's thread;
an image prompt's positions are numpy's, ``images.Vision.prompt``). Nothing enforces this: a
parallel kernel on another thread that lives on brings the throttle back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_passing_thread"]

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args: Any, name: str = "engine-load") -> T:
    """``fn(*args)`` on a thread of its own that ends with it (what it raises, raised here)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
