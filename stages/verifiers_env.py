"""Environments of Prime Intellect's ``verifiers`` package (0.3.x), loaded once per process.

``environment(env, env_args)`` loads an environment the way verifiers does
(``verifiers.load_environment``: it imports the module named ``env``, dashes read as
underscores, a dotted ``package.module`` path as is, and calls its
``load_environment(**env_args)``), once per process for the same arguments. Two things of a
loaded environment are not as verifiers leaves them, on purpose:

- its signal handlers: a verifiers ``Environment`` installs SIGINT and SIGTERM handlers (tear
  down, then exit) when it is made. An Inflight stage keeps its own (the supervisor stops stages
  cleanly), so they are never installed; this also lets an environment be made off the main
  thread (the feeder reads prompts in a thread), where installing them would raise.
- its rubric's reward functions are watched: verifiers scores a reward function that raises (or
  returns something that is not a number) as 0 and logs it. Inside ``rubric_failures()`` such a
  failure is also recorded, so that the caller fails the episode (counted) instead of training
  on a made-up 0.

A prompt of a ``kind: verifiers`` source names its environment in ``meta.verifiers``
(``spec``); ``rollout_input(meta)`` rebuilds the row verifiers would give the environment
(``prompt``, ``answer``, ``info``, ``task``, ``example_id`` and the dataset's other columns).

Not here: the dataset as prompts (``stages.feeder.verifiers_source``), the rollout
(``stages.rollouts.verifiers_agent``), the reward (``stages.scorer.verifiers_reward``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pipeline.collector import Collector
from pipeline.config.typed import did_you_mean

__all__ = [
    "VerifiersError",
    "environment",
    "environment_of",
    "rollout_input",
    "rubric_failures",
    "spec",
]

SUPPORTED = (0, 3)  # verifiers 0.3.x: 0.4 changes the environment API (and pins openai < 3)
_LOCK = threading.Lock()  # one environment made at a time (signal.signal is patched meanwhile)
_LOADED: dict[tuple[str, str], Any] = {}
_FAILURES: Collector[str] = Collector("verifiers_rubric_failures")


class VerifiersError(ValueError):
    """An environment that cannot be loaded or used; the message names the key at fault."""


def package() -> Any:
    """The ``verifiers`` package (its classic API), checked to be a version this supports."""
    try:
        import verifiers
    except ImportError as exc:
        raise VerifiersError(
            "verifiers environments need the verifiers package: pip install 'verifiers>=0.3.1,"
            "<0.4' (or inflight-rl[verifiers])"
        ) from exc
    version = tuple(int(p) for p in verifiers.__version__.split(".")[:2] if p.isdigit())
    if version[:2] != SUPPORTED:
        raise VerifiersError(
            f"verifiers {verifiers.__version__} is installed; Inflight supports 0.3.x "
            "(0.4 changed the environment API): pip install 'verifiers>=0.3.1,<0.4'"
        )
    return verifiers


def spec(env: str, env_args: Mapping[str, Any], fields: Sequence[str], extra: Mapping) -> dict:
    """What ``meta.verifiers`` holds: the environment, and what of the row is not elsewhere in
    ``meta`` (``fields``: which of answer/info/task/example_id the row has; ``extra``: its
    other columns)."""
    return {"env": env, "env_args": dict(env_args), "fields": list(fields), "extra": dict(extra)}


def environment(env: str, env_args: Mapping[str, Any]) -> Any:
    """The environment ``env`` with ``env_args`` (made once per process); VerifiersError when it
    cannot be made, naming ``env`` or ``env_args``."""
    key = (env, json.dumps(dict(env_args), sort_keys=True, default=str))
    with _LOCK:
        made = _LOADED.get(key)
        if made is None:
            made = _LOADED[key] = _load(env, dict(env_args))
    return made


def environment_of(meta: Mapping[str, Any]) -> Any:
    """The environment a prompt's ``meta.verifiers`` names."""
    named = meta.get("verifiers")
    if not isinstance(named, Mapping) or not named.get("env"):
        raise VerifiersError(
            "this prompt names no verifiers environment (meta.verifiers): the verifiers agent and "
            "reward play prompts of a `source: {kind: verifiers, env: ...}`"
        )
    return environment(named["env"], named.get("env_args") or {})


def rollout_input(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The row verifiers gives its environment (``RolloutInput``), from a prompt's meta."""
    named = meta["verifiers"]
    row = {name: meta.get(name) for name in named.get("fields", ())}
    row.update(named.get("extra") or {})
    row["prompt"] = [dict(m) for m in meta["messages"]]
    return row


def rubric_failures() -> contextlib.AbstractContextManager[list[str]]:
    """The list of the rubric reward functions that failed while scoring in this block (in this
    task and the tasks it starts), each as ``name: Type: message``."""
    return _FAILURES.collect()


# ------------------------------------------------------------------------------- loading
def _load(env: str, env_args: dict[str, Any]) -> Any:
    vf = package()
    from verifiers.legacy.utils.env_utils import env_module_name

    module_name = env_module_name(env)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a dotted path whose package is not there
        found = None
    if found is None:
        raise VerifiersError(
            f"`env` {env!r}: there is no module {module_name!r} to import: install the "
            f"environment (verifiers' `vf-install {env}`, or pip install its package), or name "
            "its module by dotted path"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the environment's own module: whatever it raises
        raise VerifiersError(
            f"`env` {env!r}: importing its module {module_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise VerifiersError(
            f"`env` {env!r}: module {module_name!r} has no load_environment function (what "
            "verifiers calls to make an environment)"
        )
    _check_args(env, load, env_args)
    try:  # environments map their datasets: no progress bar per map on the user's console
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:
        pass
    with _signals_kept():
        try:
            made = vf.load_environment(env, **env_args)
        except Exception as exc:  # verifiers wraps the environment's error: report that one
            cause = exc.__cause__ or exc
            raise VerifiersError(
                f"`env` {env!r} with env_args {env_args}: load_environment raised "
                f"{type(cause).__name__}: {cause}"
            ) from exc
    if not isinstance(made, vf.Environment):
        raise VerifiersError(
            f"`env` {env!r}: load_environment returned {type(made).__name__}, not a "
            "verifiers Environment"
        )
    _watch(made.rubric)
    return made


def _check_args(env: str, load: Any, env_args: dict[str, Any]) -> None:
    """``env_args`` that ``load_environment`` does not take are a config error at that key."""
    try:
        signature = inspect.signature(load)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**env_args)
    except TypeError as exc:
        takes = [
            name
            for name, p in signature.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        hints = "".join(did_you_mean(name, takes) for name in env_args if name not in takes)
        raise VerifiersError(
            f"`env_args` of {env!r}: its load_environment{signature} refuses them: {exc}"
            + (hints or f"; it takes: {', '.join(takes) or 'nothing'}")
        ) from None


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """While an environment is made on this thread, its ``signal.signal`` calls install nothing
    (other threads' calls go through)."""
    loader = threading.get_ident()
    real = signal.signal

    def keep(signum: Any, handler: Any) -> Any:
        if threading.get_ident() != loader:
            return real(signum, handler)
        return signal.getsignal(signum)

    signal.signal = keep
    try:
        yield
    finally:
        signal.signal = real


# ------------------------------------------------------------------------ rubric failures
def _watch(rubric: Any) -> None:
    for inner in getattr(rubric, "rubrics", ()) or ():  # a RubricGroup's rubrics
        _watch(inner)
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        rubric.funcs = [_watched(f) for f in funcs]


def _record(func: Any, problem: str) -> None:
    _FAILURES.note([f"{getattr(func, '__name__', repr(func))}: {problem}"])


def _checked(func: Any, value: Any) -> Any:
    """``value``, recorded as a failure when verifiers would turn it into a 0 (one function's
    value must be a number; a group function's, a list)."""
    if not isinstance(value, list | tuple):
        try:
            float(value)
        except (TypeError, ValueError):
            _record(func, f"returned {value!r}, not a number")
    return value


def _watched(func: Any) -> Any:
    """``func`` with its failures recorded (and still raised: verifiers scores them 0)."""
    if getattr(func, "_inflight_watched", False):
        return func
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                return _checked(func, await func(*args, **kwargs))
            except Exception as exc:
                _record(func, f"{type(exc).__name__}: {exc}")
                raise

    else:

        @functools.wraps(func)
        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                value = func(*args, **kwargs)
            except Exception as exc:
                _record(func, f"{type(exc).__name__}: {exc}")
                raise
            return _awaited(func, value) if inspect.isawaitable(value) else _checked(func, value)

    watched._inflight_watched = True  # type: ignore[attr-defined]
    return watched


async def _awaited(func: Any, value: Any) -> Any:
    try:
        return _checked(func, await value)
    except Exception as exc:
        _record(func, f"{type(exc).__name__}: {exc}")
        raise
