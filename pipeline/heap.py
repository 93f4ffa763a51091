"""The cyclic garbage collector, set for a stage's steady state.

A stage process holds a large heap that never becomes garbage: torch, transformers and their
modules, a tokenizer, a model (about a million container objects in the process that runs the
feeder, generator, scorer and an in-process engine). Python's full collections walk all of it,
and they come often in a pipeline: every message lives until its consumer acknowledges it,
long enough to survive the young generations, so the old one keeps growing with objects that
die there. Measured on ``configs/default.yaml`` (issue 24): the shared process spent 6.0 s of
its 23.5 s of CPU in 25 full collections of about 240 ms each, holding the GIL (the in-process
engine's scheduler waited meanwhile), and 1.7 s in 4,700 young ones.

``settle()``, called once a replica has set up (``pipeline.actor``) and once an engine process
has loaded its model (``stages.engine.server``), collects the young generations and freezes
what is left (``gc.freeze``: later collections skip it), and makes the youngest generation
larger, so that fewer objects in flight are promoted at all. It does not collect the old
generation first: that walked the whole heap for 0.1-0.2 s of CPU per replica and freed 30 to
100 objects (measured on ``configs/default.yaml``, issue 24). Cycles among the frozen objects
that become garbage later are not freed until the heap is settled again: a process that runs
several replicas (``pipeline.host``) calls ``resettle()`` (a full collection first) when one of
them fails while others go on, so that what a replica that crashed and restarts held (an
in-process engine's model among it) is not kept for good.

While a replica sets up (``hold()`` until its ``settle()``, or ``release()`` when its setup
fails) there are no full collections at all: importing torch, transformers and DeepSpeed and
loading a model grows the heap from nothing to about 400,000 container objects, and Python
walks all of it again each time it has grown by a quarter: 6 full collections in a learner's
start-up, 0.72 s of CPU in collections against 0.19 s with the hold (``python
bench/gc_startup.py``), at the moment every process of the run is starting on the same cores.
The young collections go on, so cycles that die young are still freed; what is left at the end
(about 500 objects of a learner's start-up, against 30) is frozen with the rest. In a process
that runs several replicas the hold lasts until the last of them has set up (the in-process
engine's generator, seconds after the feeder).
``INFLIGHT_GC=default`` keeps Python's settings (to compare).
"""

from __future__ import annotations

import gc
import os

__all__ = ["YOUNG_THRESHOLD", "hold", "release", "resettle", "settle"]

# Container allocations (less deallocations) between young collections; Python's default: 700.
YOUNG_THRESHOLD = 20_000
# The full collections' threshold while replicas set up: never reached (it counts collections
# of the middle generation, about 90 in a learner's start-up).
_HELD = 1_000_000

_holds = 0  # replicas of this process setting up
_oldest: int | None = None  # the full collections' threshold before the first hold


def _default() -> bool:
    return os.environ.get("INFLIGHT_GC") == "default"


def hold() -> None:
    """A replica starts setting up: no full collections until it settles (see the module)."""
    global _holds, _oldest
    if _default():
        return
    if _holds == 0:
        young, older, oldest = gc.get_threshold()
        _oldest = oldest
        gc.set_threshold(young, older, _HELD)
    _holds += 1


def release() -> None:
    """A replica's setup failed: its hold ends without freezing anything."""
    global _holds
    if _default():
        return
    _holds = max(0, _holds - 1)
    _set_thresholds()


def settle() -> None:
    """A replica has set up: its hold ends; collect the young, freeze what survives, and space
    young collections out (see the module)."""
    global _holds
    if _default():
        return
    _holds = max(0, _holds - 1)
    _freeze()


def resettle() -> None:
    """Unfreeze, collect everything, then freeze again: what became garbage among the frozen
    objects (now in the old generation) is freed."""
    gc.unfreeze()
    if _default():
        return
    gc.collect()
    _freeze()


def _freeze() -> None:
    gc.collect(1)
    gc.freeze()
    _set_thresholds()


def _set_thresholds() -> None:
    _, older, oldest = gc.get_threshold()
    if _holds:
        oldest = _HELD
    elif _oldest is not None:
        oldest = _oldest
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
