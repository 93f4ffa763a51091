"""SGLang's priority scheduling (``--enable-priority-scheduling`` and the flags around it), as
its 0.5.23 scheduler and tokenizer apply it.

- A request's ``priority`` is its own, else ``--default-priority-value`` (the tokenizer's
  ``_set_default_priority``), else the lowest there is (the scheduler's
  ``_set_or_validate_priority``: ``sys.maxsize`` when low values go first, else
  ``-sys.maxsize - 1``).
- The waiting queue is served by priority, then by when each request last began to wait
  (``SchedulePolicy._sort_by_priority_and_fcfs``); high values first, low values with
  ``--schedule-low-priority-values-first``.
- With the batch full, a waiting request takes the slot of a running one whose priority is
  lower by more than ``--priority-scheduling-preemption-threshold`` (``PrefillAdder
  .preempt_to_schedule``: the lowest running first, the newest of equals first); the one
  preempted goes back to the queue with what it generated (its ``num_retractions`` counted).
  ``--disable-priority-preemption`` turns that off.
- A full queue (``--max-queued-requests``) drops its least preferred request for a new one
  that is strictly preferred to it (``_abort_on_queued_limit``).
- Without the flag, priorities are ignored, or refused with
  ``--abort-on-priority-when-disabled`` (``_set_or_validate_priority``).

This module holds the rules; the scheduler (``stages.engine.scheduler``) keeps the queue and
the rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

__all__ = ["PREEMPTED", "Priorities", "from_flags"]

log = structlog.get_logger("stages.engine.priority")

# how a preempted row's KV goes to the prefix cache: as an abort's would (no session keeps it)
PREEMPTED = {"type": "abort", "message": "preempted"}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Priorities:
    """The server's priority settings (``enabled``: ``--enable-priority-scheduling``)."""

    enabled: bool = False
    low_first: bool = False  # --schedule-low-priority-values-first
    preempt: bool = True  # not --disable-priority-preemption
    threshold: int = 10  # --priority-scheduling-preemption-threshold
    default: int | None = None  # --default-priority-value
    abort_when_disabled: bool = False  # --abort-on-priority-when-disabled

    @property
    def _sign(self) -> int:  # SGLang's priority_sign: ascending by value * sign
        return 1 if self.low_first else -1

    def value(self, asked: int | None) -> int | None:
        """A request's priority as the scheduler holds it (None: priorities are off)."""
        if not self.enabled:
            return None
        if asked is None:
            asked = self.default
        if asked is None:
            return sys.maxsize if self.low_first else -sys.maxsize - 1
        return asked

    def refuses(self, asked: int | None) -> bool:
        """Whether a request asking ``asked`` is refused (``PRIORITY_DISABLED``)."""
        return not self.enabled and asked is not None and self.abort_when_disabled

    def rank(self, priority: int, queued: float) -> tuple[int, float]:
        """The waiting queue's order: smaller first."""
        return (priority * self._sign, queued)

    def ordered(self, waiting: Sequence[T], key: Callable[[T], tuple[int, float]]) -> list[T]:
        """``waiting`` in the order it is served; ``key``: an item's (priority, queued)."""
        return sorted(waiting, key=lambda item: self.rank(*key(item)))

    def victims(
        self,
        unplaced: Sequence[T],
        running: Sequence[T],
        key: Callable[[T], tuple[int, float]],
    ) -> list[T]:
        """The running items to preempt so that ``unplaced`` (waiting items with no slot, in
        the order they are served) take their slots: one each while the next lowest running
        item is lower by more than the threshold."""
        if not self.preempt or not unplaced or not running:
            return []
        sign = self._sign
        # the least preferred first: the lowest priority, then the newest
        lowest = sorted(running, key=lambda item: (-key(item)[0] * sign, -key(item)[1]))
        out = []
        for new, old in zip(unplaced, lowest, strict=False):
            if (key(new)[0] - key(old)[0]) * -sign <= self.threshold:
                break
            out.append(old)
        return out

    def evicted(self, new: T, waiting: Sequence[T], key: Callable[[T], tuple[int, float]]) -> Any:
        """The waiting item a full queue drops for ``new``: its least preferred (the newest of
        equals), when ``new`` is strictly preferred to it; else None (``new`` is refused)."""
        if not self.enabled or not waiting:
            return None
        sign = self._sign
        worst = max(waiting, key=lambda item: (key(item)[0] * sign, key(item)[1]))
        return worst if key(new)[0] * sign < key(worst)[0] * sign else None


def from_flags(args: Any) -> Priorities:
    """The settings of the server's flags, checked as SGLang's ``validation_hook`` checks
    them (ValueError: a scheduling policy that priorities do not combine with)."""
    enabled = bool(args.enable_priority_scheduling)
    # (--schedule-policy and --retraction-policy are SGLang's flags the engine takes:
    # sglang_flags.TAKEN)
    taken = getattr(args, "sglang_taken", {})
    policy = taken.get("schedule_policy", "fcfs")
    if taken.get("retraction_policy") == "priority" and not enabled:
        raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")
    if enabled and policy not in ("fcfs", "lof"):
        raise ValueError(
            "To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'. "
            f"'{policy}' is not supported."
        )
    if not enabled and args.disable_priority_preemption:
        log.warning(
            "engine_flag_without_effect",
            message="--disable-priority-preemption has no effect without "
            "--enable-priority-scheduling",
        )
    if not enabled and args.default_priority_value is not None:
        log.warning(
            "engine_flag_without_effect",
            message="--default-priority-value has no effect without --enable-priority-scheduling",
        )
    return Priorities(
        enabled=enabled,
        low_first=bool(args.schedule_low_priority_values_first),
        preempt=not args.disable_priority_preemption,
        threshold=int(args.priority_scheduling_preemption_threshold),
        default=args.default_priority_value,
        abort_when_disabled=bool(args.abort_on_priority_when_disabled),
    )
