"""A verifiers environment's rubric as a reward function, for single completions.

``rewards: [{fn: verifiers}]`` with prompts of a ``kind: verifiers`` source and the default
``single_turn`` rollout: each completion becomes the state verifiers scores after a one-turn
rollout (the environment's own ``init_state`` of the prompt's row, the completion as one
assistant message, ``is_truncated`` when it stopped at the token limit) and the environment's
rubric scores it: its parser, reward functions and weights. A rubric with group reward functions
scores each prompt's completions as one group (the scorer hands a function whole groups), else
each completion on its own. A prompt of another source gets nothing (``None``).

Rubric reward functions may be async: they run on an event loop of the calling thread (the
scorer's worker processes, where ``math-verify``'s timeouts work), or with ``workers: 0``, where
the scorer's own loop is running, on a thread of their own. A reward function that raises or
returns something that is not a number fails the call (the scorer counts it and gives the batch
0), rather than scoring 0 silently as verifiers does. Trajectories (the ``verifiers`` agent's
episodes) are refused: their rubric already scored them, and ``env_reward`` passes that on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from stages.verifiers_env import (
    VerifiersError,
    environment_of,
    package,
    rollout_input,
    rubric_failures,
)

__all__ = ["score"]

_MODEL = "policy"
_LOCAL = threading.local()  # an event loop per thread that scores with no loop running
_SPARE: dict[str, Any] = {}  # the thread (and its loop) for calls from a running loop
_SPARE_LOCK = threading.Lock()


def score(completions: Sequence[str], kwargs: dict[str, Any]) -> list[float | None]:
    """The rubric's reward of each completion (None where the prompt is of another source);
    ``kwargs`` are the scorer's keyword lists (``verifiers``, ``messages``, ``finish_reason``,
    and the meta keys the row's fields are in)."""
    if "trajectories" in kwargs:
        raise VerifiersError(
            "the verifiers reward scores single completions (rollout single_turn); the "
            "verifiers agent's episodes were scored by the environment's rubric already: use "
            "rewards [{fn: env_reward}] with it"
        )
    named = kwargs.get("verifiers") or [None] * len(completions)
    rows = [
        {key: values[i] for key, values in kwargs.items() if isinstance(values, list)}
        for i in range(len(completions))
    ]
    reasons = kwargs.get("finish_reason") or [None] * len(completions)
    mine = [i for i, spec in enumerate(named) if isinstance(spec, dict)]
    scores: list[float | None] = [None] * len(completions)
    if not mine:
        return scores
    for i in mine:  # made here, on the calling thread, before the rubric runs anywhere
        environment_of(rows[i])
    batch = [(rows[i], completions[i], reasons[i] == "length") for i in mine]
    for i, value in zip(mine, _run(_score_all(batch)), strict=True):
        scores[i] = value
    return scores


async def _score_all(batch: list[tuple[dict, str, bool]]) -> list[float]:
    """The rewards of ``(row, completion, truncated)`` items, in order."""
    with rubric_failures() as failed:
        states = [await _state(row, text, cut) for row, text, cut in batch]
        groups: dict[str, list[int]] = {}  # a prompt's completions, by environment and prompt
        for i, (row, _, _) in enumerate(batch):
            named = row["verifiers"]
            key = json.dumps([named["env"], named["env_args"], row["messages"]], default=str)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            rubric = environment_of(batch[members[0]][0]).rubric
            if rubric.has_group_rewards:
                await rubric.score_group([states[i] for i in members])
            else:
                await asyncio.gather(*(rubric.score_rollout(states[i]) for i in members))
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise VerifiersError(f"the environment's rubric failed: {failed[0]}{more}")
    return [float(state["reward"]) for state in states]


async def _state(row: dict[str, Any], text: str, truncated: bool) -> Any:
    """The state a one-turn rollout of ``row`` that answered ``text`` ends in."""
    package()
    from verifiers.legacy.clients import OpenAIChatCompletionsClient
    from verifiers.legacy.utils.message_utils import normalize_messages

    env = environment_of(row)
    # init_state resolves a client; this one is never called (the completion is already made)
    state = await env.init_state(rollout_input(row), OpenAIChatCompletionsClient(None), _MODEL)
    answer = [{"role": "assistant", "content": text}]
    state["completion"] = normalize_messages(answer, field_name="completion")
    state["is_completed"] = True
    state["is_truncated"] = truncated
    return state


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to its end from synchronous code: on this thread's own loop (kept, so that
    what a rubric binds to its loop lives on), or when a loop is already running here, on a
    thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_LOCAL, "loop", None)
        if loop is None or loop.is_closed():
            loop = _LOCAL.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    return asyncio.run_coroutine_threadsafe(coro, _spare_loop()).result()


def _spare_loop() -> asyncio.AbstractEventLoop:
    with _SPARE_LOCK:
        loop = _SPARE.get("loop")
        if loop is None:
            loop = _SPARE["loop"] = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="verifiers-rubric", daemon=True)
            thread.start()
    return loop
