"""Built-in reward functions, in the form TRL uses: ``f(completions, **kwargs) -> list[float]``.

The scorer calls every function with the completions of one whole group (decoded text) and, as
keyword lists aligned with them, ``prompts``, ``completion_ids``, ``finish_reason`` and every
key of the prompt's ``meta`` (``answer`` for the built-in tasks). A function takes the keywords
it needs and must accept the rest through ``**kwargs``. It may return ``None`` for a completion
it does not apply to (TRL's convention); that completion then gets nothing from it.

- ``exact_match``: 1.0 when the stripped completion equals the stripped ``answer``.
- ``math_verify``: 1.0 when Hugging Face's ``math-verify`` finds the completion's last
  ``\\boxed{...}`` (or, without one, the whole text) mathematically equal to ``answer``.
- ``env_reward``: the reward a rollout's environment gave (``env_reward``, from trajectories);
  ``None`` (nothing) for a sample without one.
- ``reasoning_gym``: the score (0 to 1) that a reasoning-gym dataset's own ``score_answer``
  gives the completion's answer (inside ``<answer>...</answer>`` when it has those tags, as
  reasoning-gym's prompts ask, else the whole completion, stripped) for the prompt's item,
  which ``meta.reasoning_gym`` names (``kind: reasoning_gym`` sources put it there); ``None``
  (nothing) for a prompt of another source.
- ``verifiers``: the score a ``verifiers`` environment's rubric (its parser, reward functions
  and weights) gives the completion as a one-turn rollout of the prompt's row, for prompts of a
  ``kind: verifiers`` source (``meta.verifiers`` names the environment; ``verifiers_reward.py``);
  ``None`` (nothing) for a prompt of another source.
- ``chain_answer``: 1.0 when the final answer written after the worked steps
  (``12+34=46;46-5=41;#41``: the text after the one ``#``) is exactly ``answer``; 0.0 for a
  malformed completion (no ``#``, several, no integer after it) and for one cut off by the
  token limit (``finish_reason`` ``length``, when the caller passes it).

Registered as entry points of the group ``inflight.rewards``; a pipeline names them
(``rewards: [{fn: exact_match}]``) or any other function by dotted path. Nothing here decodes
tokens, combines weights or guards against slow functions: the scorer's runner does that.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "chain_answer",
    "env_reward",
    "exact_match",
    "last_boxed",
    "math_verify",
    "reasoning_gym",
    "verifiers",
]

_FINAL = re.compile(r"[^#]*#(-?[0-9]+)")  # worked steps (no '#'), then '#' and the answer


def exact_match(completions: list[str], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where the completion (stripped) is exactly the answer (as a string, stripped)."""
    return [
        float(a is not None and c.strip() == str(a).strip())
        for c, a in zip(completions, answer, strict=True)
    ]


def env_reward(
    completions: list[str], env_reward: list[float | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """The environment's reward of each trajectory (None where there is none)."""
    if env_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in env_reward]


def chain_answer(
    completions: list[str],
    answer: list[Any],
    finish_reason: list[str | None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 where the answer after the worked steps (``...;#41``) is exactly ``answer``.

    The completion (stripped) must be the worked steps, one ``#`` and an integer, nothing after
    it; which steps were written is not checked. A completion that stopped at the token limit
    scores 0 even when its text ends in the right digits (more digits could have followed).
    """
    reasons = finish_reason if finish_reason is not None else [None] * len(completions)
    scores = []
    for completion, gold, reason in zip(completions, answer, reasons, strict=True):
        found = _FINAL.fullmatch(completion.strip())
        ok = found is not None and gold is not None and reason != "length"
        scores.append(float(ok and found.group(1) == str(gold).strip()))
    return scores


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced (cut off): try an earlier one
    return None


def math_verify(completions: list[str], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where ``math-verify`` judges the completion's final answer equal to ``answer``.

    Needs the ``math-verify`` package (``pip install math-verify``). Its parsing timeouts use
    ``SIGALRM``, so it must run in a process's main thread, as the scorer's workers do.
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(
            "the math_verify reward needs the math-verify package: pip install math-verify"
        ) from exc
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(0.0)
            continue
        boxed = last_boxed(completion)
        predicted = parse(completion if boxed is None else boxed)
        expected = parse(str(gold))
        scores.append(float(bool(predicted) and bool(expected) and verify(expected, predicted)))
    return scores


def reasoning_gym(
    completions: list[str],
    reasoning_gym: list[dict[str, Any] | None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """The reasoning-gym dataset's ``score_answer`` of each completion's answer for its item."""
    if reasoning_gym is None:
        return [None] * len(completions)
    from reasoning_gym.utils import extract_answer

    from stages.feeder.reasoning_gym_source import dataset

    scores: list[float | None] = []
    for completion, spec in zip(completions, reasoning_gym, strict=True):
        if not isinstance(spec, dict):
            scores.append(None)
            continue
        data = dataset(spec["dataset"], spec.get("options") or {}, spec["size"], spec["seed"])
        tagged = extract_answer(completion, tag_name="answer")
        answer = tagged if tagged is not None else completion.strip()
        scores.append(float(data.score_answer(answer=answer, entry=data[spec["index"]])))
    return scores


def verifiers(completions: list[str], **kwargs: Any) -> list[float | None]:
    """The verifiers environment's rubric score of each completion, for its prompt's row."""
    from stages.scorer.verifiers_reward import score

    return score(completions, kwargs)
