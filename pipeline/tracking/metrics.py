"""Turn a run's structured log events into named metric points on the learner's step axis.

Every replica writes JSON events to ``RUN_DIR/logs/*.jsonl``; ``MetricMapper.map(event)`` turns
one of them into a ``Record`` (a learner step, a wall time and ``{name: value}``), or None when
the event carries no metrics. The names, by event:

- the learner's ``train_step`` (rank 0): ``train/FIELD`` for every number in it
  (``train/reward``, ``train/solved``, ``train/lag``, ``train/lag_max``, ``train/entropy``,
  ``train/grad_norm``, ``train/samples_per_s``, ``train/mismatch_kl`` ...); its ``step`` is the
  step of every later event until the next one;
- ``eval`` (held-out evaluation): ``eval/accuracy``, ``eval/reward``, ... at its own ``step``;
- a stage's ``metrics``: ``STAGE/FIELD`` for each number (``generator/in_flight``,
  ``scorer/reward_mean``, ``feeder/sent``), plus rates of its running counters between two
  events of the same replica (``generator/samples_per_s`` from ``emitted``,
  ``generator/tokens_per_s`` from ``tokens``: the tokens its engines produced) and
  ``generator/engine_lag`` (live policy version minus the engines' version). A stage with
  several replicas has ``STAGE.R/FIELD`` per replica and the sum over replicas of ``in_flight``
  and the rates under ``STAGE/``. A component inside a stage's process (the weight publisher)
  logs ``COMPONENT/FIELD``; channel metrics (``in.PORT.*``, ``out.PORT.*``) go under
  ``channels/STAGE/``;
- the supervisor's running ``ledger``: ``ledger/FIELD``.

Booleans, strings, lists and mappings are not metrics and are left out. An event without a
step is placed at the learner's latest step (0 before the first), and every record keeps the
event's own wall time (``ts``). This module only maps: it reads no files and writes to no
tracker (``pipeline.tracking.feed`` and ``pipeline.plot`` do).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.log_view import event_wall

__all__ = ["MetricMapper", "Record", "event_wall"]

# Event keys that say who or when, never what was measured.
_NOT_METRICS = frozenset(
    {"ts", "level", "event", "stage", "replica", "version", "component", "step", "final"}
)
_SKIP_IN = {
    "eval": frozenset({"policy_version"}),
    "metrics": frozenset({"uptime_s"}),
}
# Running counters of a stage's metrics -> the rate logged next to them (first one found wins).
_RATES = (
    ("emitted", "samples_per_s"),
    ("samples", "samples_per_s"),
    ("tokens", "tokens_per_s"),
    ("sent", "prompts_per_s"),
)
# Per-replica values that add up over a stage's replicas.
_SUMMED = ("in_flight", "samples_per_s", "tokens_per_s", "prompts_per_s")


@dataclass(frozen=True)
class Record:
    """Metrics measured at one moment: learner ``step``, ``wall`` (Unix seconds), values."""

    step: int
    wall: float
    metrics: dict[str, float]


def _numbers(event: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in event.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and key not in _NOT_METRICS
        and key not in skip
        and math.isfinite(value)
    }


class MetricMapper:
    """Maps events to ``Record``s, keeping what rates and the step axis need between events.

    ``replicas``: replicas per stage (from the config); a stage not named has one. Feed it the
    events of one run in time order (``LogTail.poll`` gives them so).
    """

    def __init__(self, replicas: Mapping[str, int] | None = None) -> None:
        self.step = 0
        self._replicas = dict(replicas or {})
        self._counters: dict[tuple[str, Any, str], tuple[float, float]] = {}
        self._latest: dict[tuple[str, str], dict[Any, float]] = {}

    def map(self, event: Mapping[str, Any]) -> Record | None:
        wall = event_wall(event)
        name = event.get("event")
        if wall is None or not isinstance(name, str):
            return None
        if name == "train_step":
            step = event.get("step")
            if event.get("replica") not in (0, None) or not _is_int(step):
                return None
            self.step = step
            return Record(step, wall, _prefixed("train/", _numbers(event)))
        if name == "eval":
            step = event.get("step")
            values = _numbers(event, _SKIP_IN["eval"])
            return Record(step if _is_int(step) else self.step, wall, _prefixed("eval/", values))
        if name == "metrics":
            values = self._metrics(event, wall)
            return Record(self.step, wall, values) if values else None
        if name == "ledger" and event.get("stage") == "supervisor":
            return Record(self.step, wall, _prefixed("ledger/", _numbers(event)))
        return None

    def _metrics(self, event: Mapping[str, Any], wall: float) -> dict[str, float]:
        stage, replica = str(event.get("stage", "?")), event.get("replica")
        values = _numbers(event, _SKIP_IN["metrics"])
        several = self._replicas.get(stage, 1) > 1
        who = f"{stage}.{replica}" if several else stage
        component = event.get("component")
        if isinstance(component, str) and component:
            return _prefixed(f"{component}/", values)
        if any(key.startswith(("in.", "out.")) for key in event):
            return _prefixed(f"channels/{who}/", values)
        for counter, rate in _RATES:
            if counter in values and rate not in values:
                measured = self._rate(stage, replica, counter, values[counter], wall)
                if measured is not None:
                    values[rate] = measured
        version, engine_version = event.get("version"), event.get("engine_version")
        if _is_int(version) and _is_int(engine_version):
            values["engine_lag"] = float(version - engine_version)
        out = _prefixed(f"{who}/", values)
        if several:
            for key in _SUMMED:
                if key in values:
                    latest = self._latest.setdefault((stage, key), {})
                    latest[replica] = values[key]
                    out[f"{stage}/{key}"] = sum(latest.values())
        return out

    def _rate(
        self, stage: str, replica: Any, counter: str, value: float, wall: float
    ) -> float | None:
        key = (stage, replica, counter)
        before = self._counters.get(key)
        self._counters[key] = (wall, value)
        if before is None:
            return None
        then, was = before
        if wall <= then or value < was:  # a restarted replica counts from 0 again
            return None
        return (value - was) / (wall - then)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prefixed(prefix: str, values: Mapping[str, float]) -> dict[str, float]:
    return {prefix + key: value for key, value in values.items()}
