"""Environments in worker processes: one instance per episode, each call under a timeout.

An environment plugin is a class (an entry point of ``inflight.environments`` or
``package.module:Class``) built with ``rollout.env_options`` as keyword arguments, with
``reset(prompt) -> observation`` and ``step(action) -> (observation, reward, done)`` or
``(observation, reward, done, info)``; either may be ``async``, and ``close()`` is called when
the episode ends if the class has one. A ``gymnasium.Env`` whose observations and actions are
text works as it is: a class of one, or a registered id (``Name-v0``, or
``package.module:Name-v0`` to import what registers it; ``gymnasium.make(id, **env_options)``);
its ``reset(seed=..., options={"prompt": prompt})`` is seeded from the prompt's id, so the samples
of one prompt play the same task, and ``terminated or truncated`` ends the episode. ``prompt``
is the feeder's prompt map (``meta`` holds what the task gave: the answer, the secret...);
observations and actions are text.

Environments are user code: they may hang, raise or crash their interpreter. ``EnvPool`` keeps
``env_workers`` worker processes (``stages.workers``), each hosting the instances of the
episodes given to it (round robin); calls to one worker are served one at a time. A reset or step
that raises ends its episode with ``EnvError("raised")``; one that returns something else than
the tuple above with ``EnvError("bad_step")``; one that does not answer within ``env_timeout_s``
gets its worker killed and replaced (``timeout``), and every other episode that lived on that
worker ends at its next call (``lost``), as they do when a worker dies. Each case is counted
(``env_errors_KIND``) and logged sparsely; the generator goes on. A pool whose workers cannot be
started again raises ``PoolBroken`` (the stage fails: nothing could be played any more).

Not here: the episode loop (``env_rollout.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib
import inspect
import itertools
import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pipeline.registry import PluginError, resolve
from stages.rollouts.api import EnvError, RolloutConfig
from stages.workers import (
    PoolBroken,
    Worker,
    WorkerLost,
    exchange,
    kill,
    prepare_worker,
    reap,
    serve,
    spawn_worker,
    wait_ready,
)

__all__ = ["EnvEpisode", "EnvPool", "resolve_environment"]

_START_TIMEOUT_S = 120.0
_BAD_STEP = "BadStep"


def resolve_environment(name: str) -> Callable[..., Any]:
    """What makes the environment ``name`` names: its class (entry point or dotted path), or
    ``gymnasium.make`` of a Gymnasium id (``Name-v0``, ``package.module:Name-v0``, which
    imports the module that registers it); PluginError if it names nothing of the kind."""
    try:
        cls = resolve("environment", name)
    except PluginError:
        made = _gymnasium_id(name)
        if made is None:
            raise
        return made
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in _METHODS):
        raise PluginError(
            f"environment {name!r} resolved to {cls!r}: expected a class with reset(prompt) and "
            "step(action)"
        )
    return cls


def _gymnasium_id(name: str) -> Callable[..., Any] | None:
    """``gymnasium.make`` for ``name`` when it is a registered Gymnasium id, else None."""
    if "-v" not in name:
        return None
    try:
        import gymnasium
    except ImportError:
        return None
    module, _, env_id = name.rpartition(":")
    try:
        if module:  # the module that registers it
            importlib.import_module(module)
        gymnasium.spec(env_id)  # raises if unknown
    except Exception as exc:
        raise PluginError(f"environment {name!r}: not a registered Gymnasium id ({exc})") from exc
    return functools.partial(gymnasium.make, env_id)


def _is_gymnasium(env: Any) -> bool:
    gymnasium = sys.modules.get("gymnasium")
    return gymnasium is not None and isinstance(env, gymnasium.Env)


def _seed_of(prompt: Mapping[str, Any]) -> int:
    """A Gymnasium episode's seed: the same for the samples of one prompt (a group plays one
    task), from its ``prompt_id``."""
    key = str(prompt.get("prompt_id", "")).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big")


_METHODS = ("reset", "step")


# ---------------------------------------------------------------------------------- worker side
class BadStep(Exception):
    """What ``step`` returned is not ``(observation, reward, done[, info])``."""


def _env_worker_main(conn: Connection, name: str, options: dict[str, Any]) -> None:
    prepare_worker()
    try:
        cls = resolve_environment(name)
    except Exception as exc:  # reported to the stage, which fails its setup with it
        conn.send(("failed", str(exc)))
        return
    conn.send(("ready", os.getpid()))
    envs: dict[int, Any] = {}
    loop = asyncio.new_event_loop()  # for environments whose methods are coroutines

    def run(value: Any) -> Any:
        return loop.run_until_complete(value) if inspect.isawaitable(value) else value

    def handle(request: tuple[str, int, Any]) -> Any:
        op, key, arg = request
        if op == "reset":
            envs.pop(key, None)
            env = envs[key] = cls(**options)
            if _is_gymnasium(env):  # reset(*, seed, options) -> (observation, info)
                return _text(env.reset(seed=_seed_of(arg), options={"prompt": arg}), "reset")
            return _text(run(env.reset(arg)), "reset")
        if op == "step":
            value = run(envs[key].step(arg))
            if isinstance(value, tuple) and len(value) == 5:  # Gymnasium's
                observation, reward, terminated, truncated, info = value
                value = (observation, reward, bool(terminated) or bool(truncated), info)
            return _step_result(value)
        env = envs.pop(key, None)  # "close"
        if env is not None and callable(getattr(env, "close", None)):
            run(env.close())
        return None

    serve(conn, handle)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple) and len(value) == 2:  # Gymnasium's reset: (observation, info)
        value = value[0]
    if not isinstance(value, str):
        raise BadStep(f"{what} returned a {type(value).__name__} observation, not text")
    return value


def _step_result(value: Any) -> tuple[str, float, bool, dict[str, Any]]:
    if not isinstance(value, tuple) or len(value) not in (3, 4):
        raise BadStep(
            f"step returned {type(value).__name__}, not (observation, reward, done[, info])"
        )
    observation, reward, done = value[:3]
    info = value[3] if len(value) == 4 else {}
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise BadStep(f"step's reward is a {type(reward).__name__}, not a number") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise BadStep(f"step's reward is {reward}")
    if not isinstance(info, Mapping):
        raise BadStep(f"step's info is a {type(info).__name__}, not a map")
    return _text(observation, "step"), reward, bool(done), dict(info)


# ---------------------------------------------------------------------------------- stage side
@dataclass(eq=False)
class _Slot:
    worker: Worker
    lock: asyncio.Lock
    generation: int = 0  # bumped at every replacement: episodes of an older one are lost


class EnvPool:
    """The environment workers of one process; ``episode(prompt)`` opens one episode."""

    def __init__(self, config: RolloutConfig, log: Any) -> None:
        self.name, self.options = config.environment, dict(config.env_options)
        self.timeout_s = config.env_timeout_s
        self.log = log
        self.slots: list[_Slot] = []
        self.counts: Counter[str] = Counter()
        self._keys = itertools.count()
        self._next = itertools.cycle(range(config.env_workers))
        self._workers = config.env_workers
        self._broken: str | None = None
        self.closing = False  # set by close(): episodes cut short now are not failures

    @classmethod
    async def start(cls, config: RolloutConfig, log: Any) -> EnvPool:
        resolve_environment(config.environment)  # here first: a config error before workers
        pool = cls(config, log)
        started = await asyncio.gather(
            *(pool._start_worker() for _ in range(pool._workers)), return_exceptions=True
        )
        for outcome in started:
            if isinstance(outcome, Worker):
                pool.slots.append(_Slot(outcome, asyncio.Lock()))
        failed = [o for o in started if isinstance(o, BaseException)]
        if failed:
            await pool.aclose()
            raise failed[0]
        return pool

    def episode(self, prompt: Mapping[str, Any]) -> EnvEpisode:
        slot = self.slots[next(self._next)]
        return EnvEpisode(self, slot, next(self._keys), prompt)

    def stats(self) -> dict[str, int]:
        return {f"env_{k}": v for k, v in self.counts.items()}

    def close_soon(self) -> None:
        """The caller is about to cancel the episodes: their ends are not failures (nothing is
        logged, counted or restarted from now on)."""
        self.closing = True

    async def aclose(self) -> None:
        self.closing = True
        workers = [s.worker for s in self.slots]
        for worker in workers:
            kill(worker)
        await reap(workers)

    # ------------------------------------------------------------------ calls
    async def call(self, slot: _Slot, generation: int, request: tuple[str, int, Any]) -> Any:
        async with slot.lock:
            if self.closing:
                raise EnvError("closed", "the environment workers are shutting down")
            if self._broken is not None:
                raise PoolBroken(f"environment workers cannot be restarted: {self._broken}")
            if slot.generation != generation:
                raise self._failed("lost", "its environment worker was replaced meanwhile")
            self.counts["calls"] += 1
            try:
                status, value = await exchange(slot.worker, request, self.timeout_s)
            except asyncio.TimeoutError:
                await self._replace(slot, "timeout")
                raise self._failed(
                    "timeout", f"{request[0]} did not answer within {self.timeout_s} s"
                ) from None
            except WorkerLost as exc:
                await self._replace(slot, "lost")
                raise self._failed("lost", str(exc)) from None
            except asyncio.CancelledError:
                # its reply would answer the next request: this worker cannot be trusted again
                # (the next call finds it dead and starts another; shutting down, nothing does)
                kill(slot.worker)
                slot.generation += 1
                raise
        if status == "ok":
            return value
        kind = "bad_step" if str(value).startswith(_BAD_STEP) else "raised"
        raise self._failed(kind, f"{request[0]}: {value}")

    def _failed(self, kind: str, message: str) -> EnvError:
        self.counts[f"errors_{kind}"] += 1
        n = self.counts[f"errors_{kind}"]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of each kind
            self.log.warning("env_failed", kind=kind, error=message, count=n, env=self.name)
        return EnvError(kind, message)

    async def _start_worker(self) -> Worker:
        worker = await asyncio.to_thread(
            spawn_worker, _env_worker_main, (self.name, self.options), label="environment"
        )
        await wait_ready(worker, _START_TIMEOUT_S)
        return worker

    async def _replace(self, slot: _Slot, reason: str) -> None:
        old = slot.worker
        kill(old)
        slot.generation += 1
        if self.closing:
            return
        self.counts["workers_replaced"] += 1
        self.log.info("env_worker_replaced", pid=old.pid, reason=reason)
        await reap([old])
        try:
            slot.worker = await self._start_worker()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._broken = str(exc)
            self.log.error("env_worker_restart_failed", error=str(exc))


class EnvEpisode:
    """One episode's environment instance, on one worker: ``async with`` closes it."""

    def __init__(self, pool: EnvPool, slot: _Slot, key: int, prompt: Mapping[str, Any]) -> None:
        self.pool, self.slot, self.key, self.prompt = pool, slot, key, dict(prompt)
        self.generation = slot.generation

    async def __aenter__(self) -> EnvEpisode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.slot.generation != self.generation or self.pool.closing:
            return  # its worker is gone (or going), and the instance with it
        with contextlib.suppress(EnvError):  # counted and logged by the pool
            await self._call("close", None)

    async def reset(self) -> str:
        return await self._call("reset", self.prompt)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return await self._call("step", action)

    async def _call(self, op: str, arg: Any) -> Any:
        return await self.pool.call(self.slot, self.generation, (op, self.key, arg))
