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
``INFLIGHT_GC=default`` keeps Python's settings (to compare).
"""

from __future__ import annotations

import gc
import os

__all__ = ["YOUNG_THRESHOLD", "resettle", "settle"]

# Container allocations (less deallocations) between young collections; Python's default: 700.
YOUNG_THRESHOLD = 20_000


def settle() -> None:
    """Collect the young, freeze what survives, and space young collections out (see the
    module)."""
    if os.environ.get("INFLIGHT_GC") == "default":
        return
    gc.collect(1)
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def resettle() -> None:
    """Unfreeze, collect everything, then ``settle``: what became garbage among the frozen
    objects (now in the old generation) is freed."""
    gc.unfreeze()
    if os.environ.get("INFLIGHT_GC") != "default":
        gc.collect()
    settle()
