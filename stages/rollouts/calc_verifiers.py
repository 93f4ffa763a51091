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

from stages.feeder.arithmetic import ArithmeticConfig, problems
from stages.rollouts.examples import calc

__all__ = ["load_environment"]

TASK = ArithmeticConfig(ops="*", min_operand=100, max_operand=999)  # the calculator's


def _rows(split: str, size: int, seed: int) -> list[dict[str, str]]:
    chosen = random.Random(seed).sample(list(problems(TASK, split)), size)
    return [{"question": p.text, "answer": p.answer} for p in chosen]


def correct(completion: Any, answer: str, parser: vf.Parser, **kwargs: Any) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def load_environment(
    size: int = 20000, eval_size: int = 200, seed: int = 0, max_turns: int = 3
) -> vf.Environment:
    return vf.ToolEnv(
        tools=[calc],
        max_turns=max_turns,
        dataset=Dataset.from_list(_rows("train", size, seed)),
        eval_dataset=Dataset.from_list(_rows("eval", eval_size, seed)),
        rubric=vf.Rubric(funcs=[correct], weights=[1.0]),
        parser=vf.Parser(),
    )
