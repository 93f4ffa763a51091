"""A tiny ``verifiers`` environment for the tests, loaded by module name as verifiers loads any
(``verifiers.load_environment("tests.stages.vf_tiny_env", **env_args)``).

Its questions are sums written in the tiny test model's words (``w10 w11``: the answer is
``w21``), in memory, ``size`` of them for training and ``eval_size`` held out (other ones but
for the first ``shared``, which repeat training questions). The
rubric is a right-answer check (weight 1) and the share of the completion's words that are in the
question (weight 0.5, async, so both kinds of reward function are exercised); the parser takes
the last assistant message's text, stripped.

``kind``: ``single`` (a ``vf.SingleTurnEnv``), ``multi`` (``Hinted``: a ``vf.MultiTurnEnv``
that answers each turn with a hint, ``turns`` model turns), ``no_prompt`` (a dataset with
neither ``prompt`` nor ``question``, built lazily), ``rubric_raises`` (its reward function
raises), ``env_raises`` (its ``env_response`` raises), ``group`` (a rubric with a group reward
function). A chat template for the tiny model's word tokenizer is ``TEMPLATE``.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM = "w100 w101"  # the system prompt, in words the tiny tokenizer knows
HINT = "w7 w8"  # what the multi-turn environment answers each turn
# roles as words: system w4, user w5, assistant w6; each message ends with w3
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w4{% elif m['role'] == 'user' %}w5{% else %}w6{% endif %}"
    " {{ m['content'] }} w3 "
    "{% endfor %}{% if add_generation_prompt %}w6 {% endif %}"
)


def _rows(count: int, first: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(first, first + count):  # distinct questions for i below 50
        a, b = 10 + i % 50, 11 + (7 * i) % 50
        rows.append({"question": f"w{a} w{b}", "answer": f"w{a + b}", "info": {"n": i}})
    return rows


def correct(completion: Any, answer: str, parser: vf.Parser, **kwargs: Any) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


async def overlap(completion: Any, prompt: Any, parser: vf.Parser) -> float:
    words = (parser.parse_answer(completion) or "").split()
    question = set(str(prompt[-1]["content"]).split())
    return sum(w in question for w in words) / len(words) if words else 0.0


def broken(completion: Any, **kwargs: Any) -> float:
    raise ZeroDivisionError("the rubric's own bug")


def by_rank(completions: list, **kwargs: Any) -> list[float]:
    """A group reward function: it compares the group's completions."""
    return [float(i == 0) for i in range(len(completions))]


class Hinted(vf.MultiTurnEnv):
    """Answers every model turn with ``HINT`` (or raises, with ``fail``)."""

    def __init__(self, fail: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail = fail

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        if self.fail:
            raise RuntimeError("the environment's own bug")
        return [vf.UserMessage(content=HINT)]


def load_environment(
    kind: str = "single", size: int = 40, eval_size: int = 10, shared: int = 0, turns: int = 2
) -> vf.Environment:
    funcs: list[Any] = [correct, overlap]
    if kind == "rubric_raises":
        funcs.append(broken)
    if kind == "group":
        funcs.append(by_rank)
    rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.5, 1.0][: len(funcs)])
    train = Dataset.from_list(_rows(size, 0))
    held_rows = _rows(shared, 0) + _rows(eval_size - shared, size)  # `shared` repeat train's
    held = Dataset.from_list(held_rows) if eval_size else None
    common: dict[str, Any] = {"system_prompt": SYSTEM, "rubric": rubric, "parser": vf.Parser()}
    if kind == "no_prompt":
        empty = Dataset.from_list([{"text": "w9"}])
        return vf.SingleTurnEnv(dataset=lambda: empty, **common)
    if kind in ("multi", "env_raises"):
        return Hinted(
            fail=kind == "env_raises", max_turns=turns, dataset=train, eval_dataset=held, **common
        )
    if kind in ("single", "rubric_raises", "group"):
        return vf.SingleTurnEnv(dataset=train, eval_dataset=held, **common)
    raise ValueError(f"no kind {kind!r}")
