"""The scheduler's load counters, as SGLang 0.5.23's scheduler keeps them for ``/v1/loads``
(``scheduler_components/metrics_reporter.py``, ``Scheduler._accumulate_decode_moment``).

The scheduler thread records each decode step and each prefill; any thread reads the figures
(plain numbers, and the moments a new list each step: a read sees one step's update or the
next's, never half of one).

- ``gen_throughput``: tokens generated per second over the last ``DECODE_LOG_INTERVAL`` decode
  steps (SGLang's ``--decode-log-interval``, 40), measured when the interval closes; 0 once no
  interval closed for ``STALE_SECONDS`` (SGLang's ``GEN_THROUGHPUT_STALENESS_SECONDS``), and
  from a ``/pause_generation`` (whatever its mode) until an interval closes after it, as
  SGLang's ``pause_generation`` zeroes it.
- ``decode_moments``: the six running sums SGLang keeps of its decode steps: steps, batch
  sizes, step microseconds, batch size squared, batch size times microseconds, tokens
  generated (for a router's regression of step time on batch size). A step's microseconds
  here are its decode pass's (SGLang's: launch to launch, capped).
- ``total_prefill_busy_us``, ``total_prefill_uncached_tokens``: time in prefill passes and the
  prompt tokens they computed (not taken from the prefix cache), cumulative.
- ``cache_hit_rate``: the share of the last admission's prompt tokens that came from the
  prefix cache.
"""

from __future__ import annotations

import time

__all__ = ["DECODE_LOG_INTERVAL", "STALE_SECONDS", "LoadMeter"]

DECODE_LOG_INTERVAL = 40
STALE_SECONDS = 30.0


class LoadMeter:
    __slots__ = (
        "_interval_start",
        "_interval_steps",
        "_interval_tokens",
        "_last_interval",
        "_rate",
        "cache_hit_rate",
        "decode_moments",
        "prefill_busy_us",
        "prefill_uncached_tokens",
    )

    def __init__(self) -> None:
        now = time.perf_counter()
        self.decode_moments = [0.0] * 6
        self.prefill_busy_us = 0
        self.prefill_uncached_tokens = 0
        self.cache_hit_rate = 0.0
        self._rate = 0.0
        self._interval_start = self._last_interval = now
        self._interval_steps = self._interval_tokens = 0

    def decoded(self, batch: int, seconds: float, generated: int, now: float) -> None:
        """A decode step of ``batch`` rows took ``seconds`` and sampled ``generated`` tokens."""
        step_us = int(seconds * 1e6)
        if batch > 0 and step_us > 0:
            steps, rows, us, rows2, rows_us, tokens = self.decode_moments
            self.decode_moments = [  # one assignment: a reader sees all six or none
                steps + 1.0,
                rows + batch,
                us + step_us,
                rows2 + batch * batch,
                rows_us + batch * step_us,
                tokens + generated,
            ]
        self._interval_tokens += generated
        self._interval_steps += 1
        if self._interval_steps >= DECODE_LOG_INTERVAL:
            self._rate = self._interval_tokens / max(now - self._interval_start, 1e-9)
            self._interval_start = self._last_interval = now
            self._interval_steps = self._interval_tokens = 0

    def prefilled(self, seconds: float, uncached: int, hit: int) -> None:
        """A prefill took ``seconds``, computed ``uncached`` prompt tokens and took ``hit``
        from the prefix cache."""
        self.prefill_busy_us += max(int(seconds * 1e6), 0)
        self.prefill_uncached_tokens += uncached
        total = uncached + hit
        self.cache_hit_rate = hit / total if total else 0.0

    def idle(self, now: float) -> None:
        """Nothing decodes (paused, or no rows): the next interval starts afresh."""
        self._interval_start = now
        self._interval_steps = self._interval_tokens = 0

    def paused(self, now: float) -> None:
        """Generation paused: no throughput until an interval closes after it."""
        self._rate = 0.0
        self.idle(now)

    def gen_throughput(self, now: float) -> float:
        if now - self._last_interval > STALE_SECONDS:
            return 0.0
        return self._rate

    def moments(self) -> list[float] | None:
        """The decode moments, None before the first decode step (as SGLang)."""
        m = self.decode_moments
        return list(m) if m[0] > 0 else None
