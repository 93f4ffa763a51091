"""The calculator task as a ``verifiers`` environment (``configs/calculator_verifiers.yaml``): a
``vf.ToolEnv`` offering ``calc`` (``stages.rollouts.examples``), written as any verifiers
environment is, with nothing of Inflight in it but the task's problems.

``load_environment(size, eval_size, seed, max_turns)``: ``size`` train-split problems of the
calculator's task (``123*456=``, the split its chat model was warm-started on) and ``eval_size``
held-out ones as the eval dataset; the rubric is 1.0 when the final answer (the last assistant
message, stripped) is the product. verifiers' ``ToolEnv`` runs the model's tool calls and sends
their answers back as ``tool`` messages until the model answers without one.
"""

from __future__ import annotations

import random
from typing import Any

import verifiers as vf
from datasets import Dataset

from stages.feeder.arithmetic import ArithmeticConfig, Problem, is_held_out
from stages.rollouts.examples import calc

__all__ = ["load_environment"]

TASK = ArithmeticConfig(ops="*", min_operand=100, max_operand=999)  # the calculator's


def _rows(split: str, size: int, seed: int) -> list[dict[str, str]]:
    """``size`` distinct problems of ``split``, drawn uniformly: the operands are drawn and a
    problem of the other split is drawn again (listing the split's 729,000 problems to sample
    from took 5 s of every process that loaded the environment)."""
    rng = random.Random(seed)
    low, high = TASK.min_operand, TASK.max_operand
    chosen: dict[str, Problem] = {}
    while len(chosen) < size:
        a, b = rng.randint(low, high), rng.randint(low, high)
        text = f"{a}*{b}="
        if text not in chosen and is_held_out(text, TASK) == (split == "eval"):
            chosen[text] = Problem(text, str(a * b))
    return [{"question": p.text, "answer": p.answer} for p in chosen.values()]


def correct(completion: Any, answer: str, parser: vf.Parser, **kwargs: Any) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def load_environment(
    size: int = 20000, eval_size: int = 200, seed: int = 0, max_turns: int = 3
) -> vf.Environment:
    env = vf.ToolEnv(
        tools=[calc],
        max_turns=max_turns,
        dataset=Dataset.from_list(_rows("train", size, seed)),
        eval_dataset=Dataset.from_list(_rows("eval", eval_size, seed)),
        rubric=vf.Rubric(funcs=[correct], weights=[1.0]),
        parser=vf.Parser(),
    )
    # verifiers marks a tool strict by default, and with a tool-call parser named a strict tool
    # holds an auto answer's calls to the format's grammar (SGLang's should_constrain_auto),
    # which the tiny calculator model, trained on free text, does not keep to: not strict here
    for tool in env.tool_defs:
        tool.strict = False
    return env
