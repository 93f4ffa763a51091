"""The server's event loop and the scheduler's steps taking turns at the interpreter.

The engine serves HTTP on an event loop and steps the model on a thread of its own, in one
process: both run Python under one GIL. On CPU a step is hundreds of small torch calls, each
of which lets the GIL go, and whenever the loop has work it takes the GIL at one of them: the
two threads' Python then interleaves at the grain of those calls, and that costs the scheduler
more than the loop's own work. Its Python runs slower after each of the loop's bursts (user
time, not system calls; the same with both threads on one core). Measured on arith-tiny's
steps (64 rows, one thread, in process): a second Python thread holding the GIL about 30% of
the time raised the scheduler's CPU per step by 20-70%, the same work in another process by
nothing measurable; a GIL-free competitor (hashing) by about 8%.

``Turns`` has the two take turns instead: the scheduler runs each step in its turn, the loop
holds the turn for whatever it runs between two polls of its sockets (``turn_taking_loop``,
whose selector lets it go around each poll). A step that ends while the loop waits for the
turn hands it over; the loop lets it go at every poll, so a step that waits goes next. A
request that arrives during a step is read once the step ends, as SGLang's scheduler takes
new requests between its steps.

The server takes turns with ``--event-loop-turns`` only: it pays where a step is mostly Python
(arith-tiny on CPU: less CPU a sample, more samples a second), and costs where a step is mostly
the model's own compute, GIL-free, which the loop's work used to overlap (a 10M-parameter model's
streams ~10% slower); the figures are in ``bench/RESULTS.md``. A weight update's routes
and the controls around them lift the turns while they run (``Turns.suspended``), so a publish
does not wait for a step at each exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Turns", "turn_taking_loop"]


class Turns:
    """The turns of a scheduler's steps and an event loop (see the module's docstring).

    The scheduler runs each step through ``step``; the loop holds the turn between
    ``loop_acquire`` and ``loop_release`` (``turn_taking_loop`` does both around its waits for
    its sockets). A step that ends while the loop waits for the turn hands it over and waits
    until the loop has taken it, so that the next step cannot take it back first; the loop
    lets it go whenever it polls its sockets, and a step that waits has it then, however busy
    the loop (the poll lets the GIL go too, and the step's thread takes the turn meanwhile).
    ``close()``
    ends the turns: a step then runs without waiting (a scheduler stopping while the loop,
    which stops it, holds the turn). ``suspended()`` lifts them for a while (a weight update,
    whose every exchange would otherwise wait for a step to end): the loop and the steps run
    as they come meanwhile.
    """

    _POLL_S = 0.1  # how often a step that waits for the turn looks whether the turns closed
    _HANDOVER_S = 0.05  # the longest a step waits for the loop to take a turn handed over

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop_waits = False
        self._loop_took = threading.Event()
        self._closed = False
        self._suspended = 0  # how many suspensions are in force (the loop's thread counts)
        self._loop_holds = False
        self.handovers = 0  # how many times a step handed the turn to the loop

    # -- the event loop's side ---------------------------------------------------------------
    def loop_acquire(self) -> None:
        if self._suspended:
            return
        self._loop_waits = True
        self._lock.acquire()
        self._loop_waits = False
        self._loop_holds = True
        self._loop_took.set()

    def loop_release(self) -> None:
        """Let the turn go (nothing if the loop does not hold it)."""
        if self._loop_holds:
            self._loop_holds = False
            self._lock.release()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No turns while in it (entered and left on the loop's thread; nests)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def suspend(self) -> None:
        """``suspended()``'s entry, for a suspension that spans requests (``resume`` ends it)."""
        self._suspended += 1

    def resume(self) -> None:
        self._suspended -= 1

    # -- the scheduler's side ----------------------------------------------------------------
    def step(self, run: Callable[[], T]) -> T:
        """``run()`` in the scheduler's turn."""
        lock = self._lock
        if self._suspended:
            return run()
        while not lock.acquire(timeout=self._POLL_S):
            if self._closed or self._suspended:
                return run()
        try:
            return run()
        finally:
            self._loop_took.clear()
            lock.release()
            if self._loop_waits:  # the loop waits: its turn, before the next step's
                self.handovers += 1
                self._loop_took.wait(self._HANDOVER_S)

    def close(self) -> None:
        self._closed = True


class _TurnTakingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A selector whose ``select`` lets the turn go while the loop polls its sockets: the loop
    holds it for whatever it runs in between. It is let go at every poll, with callbacks ready
    too (``select(0)``), so that a step that waits goes first; with no step waiting the loop
    takes it straight back."""

    def __init__(self, turns: Turns) -> None:
        super().__init__()
        self._turns = turns

    def select(self, timeout: float | None = None) -> Any:
        self._turns.loop_release()  # (nothing before its first turn)
        try:
            return super().select(timeout)
        finally:
            self._turns.loop_acquire()


def turn_taking_loop(turns: Turns) -> asyncio.AbstractEventLoop:
    """A new event loop (asyncio's own: uvloop's polling cannot be wrapped) that holds
    ``turns`` except while it polls its sockets."""
    return asyncio.SelectorEventLoop(_TurnTakingSelector(turns))
