"""Reward functions run in worker processes, each call under a timeout.

A reward function is user code: it may be slow, hang, crash the interpreter or use ``SIGALRM``
(``math-verify`` does), none of which may stop the stage's event loop. ``RewardRunner`` keeps
a small pool of worker processes (``stages.workers.FunctionPool``, shared with tools) and sends
every call (one function, one batch of completions) to an idle worker. The event loop waits on
the pipe without blocking; a call that has not answered after ``timeout_s`` gets its worker
killed and replaced (``concurrent.futures.ProcessPoolExecutor`` cannot cancel a running call).
A call that raises, times out, kills its worker, returns the wrong number of values, or values
that are not finite numbers gives those completions reward 0 with an ``error`` in their info; it
is counted (``errors``, ``timeouts``), logged as ``reward_failed``, and scoring goes on.

Functions are named, never passed: each worker resolves the names itself through the plugin
registry (entry points of ``inflight.rewards`` or dotted paths ``package.module:name``), so a
function must be reachable by name from a fresh interpreter: closures and lambdas built at run
time cannot be used (a function, ``functools.partial`` or even a lambda assigned to a module-level
name can). The runner resolves every name in its own process too, at construction, so an
unknown name fails with a ``PluginError`` before any work arrives.

Workers are started with ``forkserver`` where available (Linux: forking a clean single-threaded
server, never the stage process with its threads), else ``spawn``; on Linux they get SIGKILL
when that server, and so the stage process, dies. Not here: decoding, grouping (the stage).
"""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.workers import FunctionPool, InlinePool, Worker, resolve_function

__all__ = ["RewardRunner", "resolve_reward"]


def resolve_reward(name: str) -> Callable[..., Any]:
    """The reward function ``name`` names (entry point or dotted path); PluginError otherwise."""
    return resolve_function("reward", name)


# ---------------------------------------------------------------------------------- worker side
def _checked(values: Any, n: int) -> tuple[list[float | None], dict[int, str]] | str:
    """A function's return value as ``(values, bad items)``, or why it is unusable as a whole."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        return f"returned {type(values).__name__}, expected a list of {n} numbers"
    if len(values) != n:
        return f"returned {len(values)} values for {n} completions"
    out: list[float | None] = []
    bad: dict[int, str] = {}
    for i, v in enumerate(values):
        if v is None:  # TRL's "does not apply to this completion"
            out.append(None)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            x = float(v)
        except (TypeError, ValueError):
            bad[i] = f"value {i} is not a number: {type(v).__name__}"
            out.append(None)
            continue
        if not math.isfinite(x):
            bad[i] = f"value {i} is {x}"
            out.append(None)
            continue
        out.append(x)
    return out, bad


def _score_batch(fn: Callable[..., Any], payload: bytes) -> Any:
    """The pool's adapter (runs in a worker): call ``fn`` on the pickled keyword lists; the
    checked values, or a string saying why they are unusable."""
    return _score_kwargs(fn, pickle.loads(payload))


def _score_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """``_score_batch`` of keyword lists that are not pickled (``workers: 0``): each function
    gets lists of its own, as it would from a pickle."""
    own = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    n = len(own["completions"])  # before the call: a function may change its lists
    return _checked(fn(**own), n)


# ---------------------------------------------------------------------------------- parent side
@dataclass
class _Outcome:
    """What one call of one function gave for a batch."""

    values: list[float | None]
    bad: dict[int, str] = field(default_factory=dict)  # completion index -> problem
    error: str | None = None  # the whole call failed


class RewardRunner:
    """A pool of ``workers`` processes that score batches with weighted reward functions
    (``workers`` 0: they run in this process, on its event loop, with no time limit).

    ``specs`` are ``(name, weight)`` pairs; a completion's reward is the weighted sum of the
    functions' values (a ``None`` value adds nothing), or 0 when any function failed for it.
    Use ``async with RewardRunner(...) as runner`` (or ``start()`` / ``aclose()``).
    """

    def __init__(
        self,
        specs: Sequence[tuple[str, float]],
        workers: int = 2,
        timeout_s: float = 10.0,
        *,
        start_timeout_s: float = 120.0,
        log: Any = None,
    ) -> None:
        if not specs:
            raise ValueError("a RewardRunner needs at least one reward function")
        names = [name for name, _ in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions are listed more than once: {names}")
        self._inline = workers == 0
        self._pool: FunctionPool | InlinePool
        if self._inline:  # in this process: no pickling, no hand-over, no time limit
            self._pool = InlinePool("reward", names, adapter=_score_kwargs, label="reward", log=log)
        else:
            self._pool = FunctionPool(
                "reward",
                names,
                workers=workers,
                timeout_s=timeout_s,
                adapter=_score_batch,
                label="reward",
                start_timeout_s=start_timeout_s,
                log=log,
            )
        self.specs = [(name, float(weight)) for name, weight in specs]
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self.log = self._pool.log
        self._bad_results = 0  # calls that returned unusable values (the pool saw them as ok)

    async def __aenter__(self) -> RewardRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def counts(self) -> dict[str, int]:
        """``calls``, ``errors`` (raised, died, or unusable values), ``timeouts``, ``restarts``."""
        pool = self._pool.counts
        errors = pool["errors"] + pool["lost"] + self._bad_results
        return {
            "calls": pool["calls"],
            "errors": errors,
            "timeouts": pool["timeouts"],
            "restarts": pool["restarts"],
        }

    @property
    def _all(self) -> set[Worker]:
        return self._pool.live

    async def start(self) -> None:
        """Start the workers; raises PluginError when a worker cannot resolve a function."""
        await self._pool.start()

    async def score(self, kwargs: Mapping[str, Any], **context: Any) -> list[tuple[float, dict]]:
        """``(reward, info)`` per completion of ``kwargs["completions"]``.

        ``kwargs`` are the keyword lists every function gets, aligned with ``completions``.
        ``info`` maps each function's name to its value (None when it gave none) and has
        ``error`` when one failed for that completion. ``context`` (e.g. ``group_id``) is added
        to ``reward_failed`` log events.
        """
        n = len(kwargs["completions"])
        payload: Any = (
            dict(kwargs)
            if self._inline
            else pickle.dumps(dict(kwargs), protocol=pickle.HIGHEST_PROTOCOL)  # once for all
        )
        outcomes = await asyncio.gather(
            *(self._call(name, payload, n, context) for name, _ in self.specs)
        )
        scored = []
        for i in range(n):
            info: dict[str, Any] = {}
            errors = []
            total = 0.0
            for (name, weight), outcome in zip(self.specs, outcomes, strict=True):
                value = outcome.values[i]
                info[name] = value
                problem = outcome.error or outcome.bad.get(i)
                if problem is not None:
                    errors.append(f"{name}: {problem}")
                elif value is not None:
                    total += weight * value
            if errors:
                info["error"] = "; ".join(errors)
                total = 0.0
            scored.append((total, info))
        return scored

    def stats(self) -> dict[str, int]:
        return {**self.counts, "workers_idle": self._pool.idle()}

    async def aclose(self) -> None:
        """Kill every worker (a reward function has nothing to save) and wait for them."""
        await self._pool.aclose()

    # ---------------------------------------------------------------- calls
    async def _call(
        self, name: str, payload: bytes, n: int, context: Mapping[str, Any]
    ) -> _Outcome:
        reply = await self._pool.call(name, payload)
        if not reply.ok:
            return self._failed(name, n, reply.error, context)
        if isinstance(reply.value, str):  # unusable as a whole (wrong length, not a list)
            self._bad_results += 1
            return self._failed(name, n, reply.value, context)
        values, bad = reply.value
        if bad:
            self._bad_results += 1
            first = next(iter(bad.values()))
            self.log.warning("reward_failed", fn=name, error=first, completions=len(bad), **context)
        return _Outcome(values, bad)

    def _failed(self, name: str, n: int, error: str, context: Mapping[str, Any]) -> _Outcome:
        self.log.warning("reward_failed", fn=name, error=error, completions=n, **context)
        return _Outcome([None] * n, error=error)
