"""Trajectories: one episode's tokens after its prompt, each sampled by the model or inserted.

A rollout builds a :class:`Trajectory` turn by turn: ``sampled(generation)`` appends what one
engine call produced (token ids, the sampler's log-prob and the policy version of every token),
``inserted(token_ids)`` appends what a tool or an environment put in (no log-prob, no version:
never trained). ``context`` is the prompt and every token so far, the input of the next turn.
The learner trains on the sampled tokens only (``loss_mask``), and reads lag and staleness from
their versions only.

On the wire (``rollout_group`` / ``scored_group`` samples, ``stages.schemas``) the trajectory is
``completion_ids`` (every token after the prompt), ``loss_mask`` (uint8: 1 sampled, 0 inserted),
``sampler_logprobs`` (0.0 where inserted) and ``versions`` (-1 where inserted), plus the
sample's own ``prompt_ids`` when a rollout started from a context other than the prompt it was
given (a chat template with tool descriptions, say), and ``rollout`` (what happened: turns, tool
calls, the environment's reward...).

Not here: talking to engines, running tools or environments (``api.py`` and the rollouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["INSERTED_VERSION", "Generation", "Trajectory", "final_turn"]

INSERTED_VERSION = -1  # the "version" of a token a tool or an environment inserted


@dataclass
class Generation:
    """What one engine call produced: tokens, the sampler's log-prob and version of each."""

    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per token
    versions: np.ndarray  # int32, one per token
    finish_reason: str  # "stop" | "length" | "abort"
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32).reshape(-1)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, dtype=np.int32).reshape(-1)
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"a generation has {n} tokens, {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions"
            )

    def truncated(self, n: int) -> Generation:
        """The first ``n`` tokens (what follows a tool call's end is not kept)."""
        return Generation(
            self.token_ids[:n], self.logprobs[:n], self.versions[:n], "stop", self.cached_tokens
        )


@dataclass
class Trajectory:
    """One episode: the context it started from and every token after it.

    ``finish_reason`` says why the episode ended (``stop``: the model finished; ``length``:
    its last turn hit the token limit; ``max_turns`` / ``max_tokens``: the episode's budget;
    ``done``: the environment ended it; ``env_error``: the environment failed). ``reward`` is
    the environment's (None when there is none); ``info`` is what the rollout wants the scorer,
    the metrics and the logs to see (turns, tool calls...): numbers, strings, booleans.
    """

    prompt_ids: np.ndarray
    finish_reason: str = "stop"
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    turns: int = 0  # engine calls that sampled into this trajectory
    _parts: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = field(
        default_factory=list, repr=False
    )
    _context: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32).reshape(-1)
        if len(self.prompt_ids) == 0:
            raise ValueError("a trajectory needs a prompt of at least one token")
        self._context = self.prompt_ids.tolist()

    # ------------------------------------------------------------------ building
    def sampled(self, generation: Generation) -> None:
        """Append what the model sampled in one turn (trained)."""
        self._parts.append((generation.token_ids, generation.logprobs, generation.versions))
        self._context.extend(generation.token_ids.tolist())
        self.turns += 1

    def inserted(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append tokens a tool or an environment put in (context, never trained)."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if len(ids):
            self._parts.append((ids, None, None))
            self._context.extend(ids.tolist())

    # ------------------------------------------------------------------ reading
    @property
    def context(self) -> list[int]:
        """The prompt and every token so far: the input of the next turn (a copy)."""
        return list(self._context)

    @property
    def length(self) -> int:
        """Tokens after the prompt, sampled and inserted."""
        return len(self._context) - len(self.prompt_ids)

    @property
    def completion_ids(self) -> np.ndarray:
        return _cat([ids for ids, _, _ in self._parts], np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        """uint8 per token after the prompt: 1 sampled (trained), 0 inserted."""
        return _cat(
            [np.full(len(ids), lp is not None, dtype=np.uint8) for ids, lp, _ in self._parts],
            np.uint8,
        )

    @property
    def logprobs(self) -> np.ndarray:
        return _cat(
            [
                lp if lp is not None else np.zeros(len(ids), np.float32)
                for ids, lp, _ in self._parts
            ],
            np.float32,
        )

    @property
    def versions(self) -> np.ndarray:
        return _cat(
            [
                v if v is not None else np.full(len(ids), INSERTED_VERSION, np.int32)
                for ids, _, v in self._parts
            ],
            np.int32,
        )

    @property
    def sampled_tokens(self) -> int:
        return sum(len(ids) for ids, lp, _ in self._parts if lp is not None)

    @property
    def inserted_tokens(self) -> int:
        return sum(len(ids) for ids, lp, _ in self._parts if lp is None)

    def last_sampled(self) -> np.ndarray:
        """The tokens the model sampled after the last inserted ones: its final answer."""
        tail: list[np.ndarray] = []
        for ids, lp, _ in reversed(self._parts):
            if lp is None:
                break
            tail.append(ids)
        return _cat(tail[::-1], np.int32)


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def final_turn(completion_ids: Sequence[int] | np.ndarray, loss_mask: Any = None) -> list[int]:
    """The tokens the model sampled after the last inserted ones (its final answer): the whole
    completion when nothing was inserted (``loss_mask`` None or all 1)."""
    if isinstance(completion_ids, np.ndarray):
        ids = completion_ids.tolist()
    else:
        ids = [int(t) for t in completion_ids]
    if loss_mask is None:
        return ids
    mask = np.asarray(loss_mask).reshape(-1)
    inserted = np.flatnonzero(mask == 0)
    return ids[int(inserted[-1]) + 1 :] if len(inserted) else ids
