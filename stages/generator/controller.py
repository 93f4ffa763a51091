"""How many requests the generator keeps in flight, per engine, and why.

Four things bound it (DESIGN.md, "Generation batch-size control"):

- **Downstream credit** (a gate on the whole generator): samples may start only while they and
  the samples already in flight fit into the credit the scorer has granted plus the free slots of
  the generator's own small outbox. A slow scorer or learner therefore lowers the samples in
  flight instead of letting finished rollouts go stale in a queue.
- **Staleness** (a gate on the whole generator): a sample may start only while the engines'
  policy version is within ``max_lag`` of the newest published version.
- **The learner's pace** (a gate on the whole generator): samples the learner is not done with
  (in flight, queued anywhere downstream, or in the batch it trains: with chained
  acknowledgements a group is acknowledged back to the generator once the learner is done with
  it) stay within ``(max_lag - lag + 1) x publish.every x batch_size``, shared among the
  generators feeding it, where ``lag`` is how far the engines are behind the learner's version.
  Beyond that a sample started now would be older than ``max_lag`` when the learner takes it, and
  be dropped as stale, whatever the batch, model size or inbox sizes. The learner reports its
  batch, version and generators after each step (``pipeline.topics.PACE``).
- **Measured throughput** (a target per engine): hill climbing on tokens/s. While an engine is
  saturated (its target is what holds starts back), the target goes up by ``step`` every
  ``interval_s``; if tokens/s did not rise by ``gain`` after a raise, the raise is undone and the
  target holds for ``hold_intervals`` before probing again. Batch size helps an engine only up to
  the point its kernels saturate; beyond it, bigger batches only add latency and staleness.

Everything counts samples, never requests: a group request of G samples starts only when all G
fit (under the credit and under the engine's target), so neither bound is exceeded. A start that
cannot fit a bound even with nothing in flight there (a group larger than the target, or than all
the room downstream) goes ahead alone when nothing is in flight there, rather than never: it
overshoots that bound by less than one group instead of deadlocking.

Every change of a target and every gate opening or closing is returned as a :class:`Decision`
with its reason, for the stage to log. This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ControllerConfig", "Decision", "InFlightController"]


@dataclass
class ControllerConfig:
    start: int = field(default=8, metadata={"min": 1, "doc": "first per-engine target"})
    min_in_flight: int = field(default=1, metadata={"min": 1, "doc": "per-engine floor"})
    max_in_flight: int = field(default=128, metadata={"min": 1, "doc": "per-engine ceiling"})
    step: int = field(default=4, metadata={"min": 1, "doc": "target change per decision"})
    interval_s: float = field(default=2.0, metadata={"min": 0.01, "doc": "decision period"})
    gain: float = field(
        default=0.05, metadata={"min": 0.0, "doc": "tokens/s rise that justifies a raise"}
    )
    hold_intervals: int = field(
        default=5, metadata={"min": 0, "doc": "intervals to hold after an undone raise"}
    )


@dataclass
class Decision:
    scope: str  # an engine URL, or "all" for the gates
    value: int | bool  # the new target, or whether the gate is open
    reason: str
    detail: dict


@dataclass
class _Engine:
    target: int
    tokens: int = 0
    blocked: int = 0  # starts held back by the target during this interval
    last_tps: float | None = None
    last_action: str = "start"
    hold: int = 0


class InFlightController:
    def __init__(self, engines: Sequence[str], config: ControllerConfig) -> None:
        self.config = config
        start = min(max(config.start, config.min_in_flight), config.max_in_flight)
        self.engines = {url: _Engine(target=start) for url in engines}
        self._interval_start: float | None = None
        self._gates = {"credit": True, "lag": True, "queue": True}

    # ------------------------------------------------------------ per request
    def target(self, engine: str) -> int:
        return self.engines[engine].target

    def fits(self, engine: str, in_flight: int, size: int = 1) -> bool:
        """Whether ``size`` samples may start on ``engine``, which has ``in_flight`` already."""
        return in_flight == 0 or in_flight + size <= self.engines[engine].target

    def record_tokens(self, engine: str, tokens: int) -> None:
        self.engines[engine].tokens += tokens

    def record_blocked(self, engine: str) -> None:
        """A start was held back because this engine was at its target."""
        self.engines[engine].blocked += 1

    # ----------------------------------------------------------------- gates
    def gates(
        self,
        *,
        in_flight: int,
        room: int,
        version: int,
        newest: int,
        max_lag: int,
        size: int = 1,
        ahead: int | None = None,
        budget: int | None = None,
    ) -> tuple[bool, list[Decision]]:
        """Whether ``size`` new samples (one request) may start now, and the gate changes to log.

        ``room``: downstream credit plus free outbox slots; ``version``: the engines' policy
        version; ``newest``: the newest version published. ``ahead``: this generator's samples
        the learner is not done with (in flight, queued downstream, in its batch); ``budget``:
        how many of them there may be so that none is too old when the learner takes it
        (None: not known yet, no such gate).
        """
        credit_open = room > 0 and (in_flight == 0 or in_flight + size <= room)
        lag_open = newest - version <= max_lag
        queue_open = ahead is None or budget is None or ahead <= 0 or ahead + size <= budget
        gates = self._gates
        if (credit_open, lag_open, queue_open) == (gates["credit"], gates["lag"], gates["queue"]):
            return credit_open and lag_open and queue_open, []  # the common case: no change
        states = {
            "credit": (credit_open, {"in_flight": in_flight, "room": room, "size": size}),
            "lag": (lag_open, {"version": version, "newest": newest, "max_lag": max_lag}),
            "queue": (queue_open, {"ahead": ahead, "budget": budget, "size": size}),
        }
        changes = []
        for name, (is_open, detail) in states.items():
            if is_open != gates[name]:
                gates[name] = is_open
                changes.append(Decision("all", is_open, f"{name}_gate", detail))
        return credit_open and lag_open and queue_open, changes

    # ------------------------------------------------------------ throughput
    def decide(self, now: float) -> list[Decision]:
        """Every ``interval_s``: adjust each engine's target from its measured tokens/s."""
        if self._interval_start is None:
            self._interval_start = now
            return []
        elapsed = now - self._interval_start
        if elapsed < self.config.interval_s:
            return []
        self._interval_start = now
        cfg, decisions = self.config, []
        for url, e in self.engines.items():
            tps = e.tokens / elapsed
            saturated = e.blocked > 0
            e.tokens = e.blocked = 0
            detail = {"tokens_per_s": round(tps, 1), "last_tokens_per_s": e.last_tps}
            old = e.target
            if (
                e.last_action == "up"
                and e.last_tps is not None
                and tps < e.last_tps * (1 + cfg.gain)
            ):
                e.target = max(cfg.min_in_flight, e.target - cfg.step)
                e.last_action, e.hold = "down", cfg.hold_intervals
                reason = "throughput_flat"
            elif e.hold > 0:
                e.hold -= 1
                e.last_action = "hold"
                reason = ""
            elif saturated and e.target < cfg.max_in_flight:
                e.target = min(cfg.max_in_flight, e.target + cfg.step)
                e.last_action = "up"
                reason = "probe_up"
            else:
                e.last_action = "steady"
                reason = ""
            e.last_tps = tps
            if e.target != old:
                decisions.append(Decision(url, e.target, reason, {**detail, "was": old}))
        return decisions
