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
when that server, and so the stage process, dies. Rewards computed behind HTTP (a reward
server's ``url``, an engine's ``judge``: ``remote.py``) need no worker: they run on the caller's
event loop, each under its own ``timeout_s``, and their failures give 0 the same way. Not here:
decoding, grouping (the stage).
"""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from stages.scorer.spec import RewardSpec
from stages.workers import FunctionPool, InlinePool, Worker, resolve_function

if TYPE_CHECKING:
    from stages.scorer.remote import RemoteReward

__all__ = ["EngineSite", "Outcome", "RewardRunner", "checked_values", "resolve_reward"]

_POOL_COUNTS = ("calls", "errors", "timeouts", "lost", "restarts")


def resolve_reward(name: str) -> Callable[..., Any]:
    """The reward function ``name`` names (entry point or dotted path); PluginError otherwise."""
    return resolve_function("reward", name)


# ---------------------------------------------------------------------------------- worker side
def checked_values(values: Any, n: int) -> tuple[list[float | None], dict[int, str]] | str:
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
    return checked_values(fn(**own), n)


# ---------------------------------------------------------------------------------- parent side
@dataclass
class Outcome:
    """What one call of one function gave for a batch."""

    values: list[float | None]
    bad: dict[int, str] = field(default_factory=dict)  # completion index -> problem
    error: str | None = None  # the whole call failed


@dataclass(frozen=True)
class EngineSite:
    """What a reward needs to start an engine of its own (``reward_model.launch``): the
    launching stage's ``name`` (``STAGE.REPLICA``), where engines log, the run's engine API key
    and log level."""

    name: str
    log_dir: Path
    api_key: str | None = None
    log_level: str = "info"


class RewardRunner:
    """A pool of ``workers`` processes that score batches with weighted reward functions
    (``workers`` 0: they run in this process, on its event loop, with no time limit), and the
    rewards computed behind HTTP (``url``, ``reward_model``, ``judge``: ``remote.py``, on this
    event loop). ``site`` (an ``EngineSite``): where a reward model's own engine
    (``reward_model.launch``) is started from; without one such a reward is refused.

    ``specs`` are ``RewardSpec``s or ``(function name, weight)`` pairs; a completion's reward is
    the weighted sum of the rewards' values (a ``None`` value adds nothing), or 0 when any of
    them failed for it. No process starts when no reward is a function.
    Use ``async with RewardRunner(...) as runner`` (or ``start()`` / ``aclose()``).
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | tuple[str, float]],
        workers: int = 2,
        timeout_s: float = 10.0,
        *,
        start_timeout_s: float = 120.0,
        log: Any = None,
        site: EngineSite | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a RewardRunner needs at least one reward function")
        rewards = [
            s if isinstance(s, RewardSpec) else RewardSpec(fn=s[0], weight=s[1]) for s in specs
        ]
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards are listed more than once: {names}")
        functions = list(dict.fromkeys(r.fn for r in rewards if r.fn is not None))
        self.log = log if log is not None else structlog.get_logger("reward")
        self._inline = workers == 0
        self._pool: FunctionPool | InlinePool | None = None
        if functions and self._inline:  # in this process: no pickling, no hand-over, no limit
            self._pool = InlinePool(
                "reward", functions, adapter=_score_kwargs, label="reward", log=self.log
            )
        elif functions:
            self._pool = FunctionPool(
                "reward",
                functions,
                workers=workers,
                timeout_s=timeout_s,
                adapter=_score_batch,
                label="reward",
                start_timeout_s=start_timeout_s,
                log=self.log,
            )
        self._remote: dict[str, RemoteReward] = {}
        if any(r.fn is None for r in rewards):
            from stages.scorer.remote import RemoteReward  # aiohttp: not in worker processes

            self._remote = {
                r.name: RemoteReward(r, self.log, site) for r in rewards if r.fn is None
            }
        self.rewards = rewards
        self.specs = [(r.name, float(r.weight)) for r in rewards]
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self._bad_results = 0  # calls that returned unusable values (the pool saw them as ok)

    async def __aenter__(self) -> RewardRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def counts(self) -> dict[str, int]:
        """``calls``, ``errors`` (raised, died, unusable values, failed HTTP calls),
        ``timeouts``, ``restarts``."""
        pool = self._pool.counts if self._pool is not None else dict.fromkeys(_POOL_COUNTS, 0)
        remote = [r.counts for r in self._remote.values()]
        errors = pool["errors"] + pool["lost"] + self._bad_results
        return {
            "calls": pool["calls"] + sum(r["calls"] for r in remote),
            "errors": errors + sum(r["errors"] for r in remote),
            "timeouts": pool["timeouts"] + sum(r["timeouts"] for r in remote),
            "restarts": pool["restarts"],
        }

    @property
    def _all(self) -> set[Worker]:
        return self._pool.live if self._pool is not None else set()

    async def start(self) -> None:
        """Start the workers; raises PluginError when a worker cannot resolve a function."""
        for remote in self._remote.values():
            await remote.start()
        if self._pool is not None:
            await self._pool.start()

    async def score(self, kwargs: Mapping[str, Any], **context: Any) -> list[tuple[float, dict]]:
        """``(reward, info)`` per completion of ``kwargs["completions"]``.

        ``kwargs`` are the keyword lists every function gets, aligned with ``completions``.
        ``info`` maps each reward's name to its value (None when it gave none) and has
        ``error`` when one failed for that completion. ``context`` (e.g. ``group_id``) is added
        to ``reward_failed`` log events.
        """
        n = len(kwargs["completions"])
        payload: Any = None
        if self._pool is not None:
            payload = (
                dict(kwargs)
                if self._inline
                else pickle.dumps(dict(kwargs), protocol=pickle.HIGHEST_PROTOCOL)  # once for all
            )
        outcomes = await asyncio.gather(
            *(
                self._call(r.fn, r.name, payload, n, context)
                if r.fn is not None
                else self._remote[r.name].score(kwargs, n, context)
                for r in self.rewards
            )
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
        """``counts``, ``workers_idle``, and for HTTP rewards ``http_retries``,
        ``http_split_calls`` (refused calls tried again a sample a call) and ``failed_<kind>``
        (samples that failed, by kind)."""
        stats = {**self.counts, "workers_idle": self._pool.idle() if self._pool else 0}
        if self._remote:
            stats["http_retries"] = sum(r.counts["retries"] for r in self._remote.values())
            stats["http_split_calls"] = sum(r.counts["split"] for r in self._remote.values())
            for remote in self._remote.values():
                for kind, samples in remote.failed.items():
                    stats[f"failed_{kind}"] = stats.get(f"failed_{kind}", 0) + samples
        return stats

    async def aclose(self) -> None:
        """Kill every worker (a reward function has nothing to save) and wait for them; close
        the HTTP rewards' connections."""
        for remote in self._remote.values():
            await remote.aclose()
        if self._pool is not None:
            await self._pool.aclose()

    # ---------------------------------------------------------------- calls
    async def _call(
        self, fn: str, name: str, payload: Any, n: int, context: Mapping[str, Any]
    ) -> Outcome:
        assert self._pool is not None
        reply = await self._pool.call(fn, payload)
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
        return Outcome(values, bad)

    def _failed(self, name: str, n: int, error: str, context: Mapping[str, Any]) -> Outcome:
        self.log.warning("reward_failed", fn=name, error=error, completions=n, **context)
        return Outcome([None] * n, error=error)
