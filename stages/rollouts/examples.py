"""The tool and the environment of the example configs (``configs/calculator.yaml``,
``configs/guess.yaml``), registered as ``calc`` (``inflight.tools``) and ``guess_number``
(``inflight.environments``), and two ``openai`` agents (``inflight.agents``): the smallest,
``one_completion``, and ``calc_agent``, a function-calling loop as any ``openai`` user writes
one (``configs/calculator_agent.yaml``). They are small on purpose: read them as templates for
your own.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Mapping
from typing import Any

__all__ = ["CALC_TOOL", "GuessNumber", "calc", "calc_agent", "one_completion"]

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS = 100  # a product of two huge numbers is still arithmetic, but not a useful one


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: Integers combined with +, -, *, // and %, and parentheses, e.g. "123*456".

    Returns:
        The value, as digits.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return str(_value(tree.body))


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
        if len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError(f"the value has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"only integers, + - * // % and parentheses are allowed, not {ast.dump(node)}")


class GuessNumber:
    """Guess a secret integer in ``1..high`` in at most ``max_guesses`` guesses.

    The prompt's ``meta["answer"]`` is the secret. Each action is one guess (the model's turn,
    decoded): after a wrong guess the observation is ``H`` (the secret is higher) or ``L``
    (lower). The episode ends when a guess is right (reward ``1 - turn_penalty * (guesses -
    1)``), after ``max_guesses`` wrong ones, or at a turn that is not an integer (reward 0 for
    both). ``info`` says whether it was ``solved`` and after how many ``guesses``.
    """

    def __init__(self, high: int = 100, max_guesses: int = 7, turn_penalty: float = 0.05) -> None:
        if high < 1 or max_guesses < 1:
            raise ValueError(f"need high >= 1 and max_guesses >= 1, got {high}, {max_guesses}")
        self.high, self.max_guesses, self.turn_penalty = high, max_guesses, turn_penalty
        self.secret, self.guesses = 0, 0

    def reset(self, prompt: Mapping[str, Any]) -> str:
        meta = prompt.get("meta") or {}
        try:
            self.secret = int(str(meta["answer"]).strip())
        except (KeyError, ValueError) as exc:
            raise ValueError(f"prompt {prompt.get('prompt_id')!r} has no integer answer") from exc
        self.guesses = 0
        return ""  # the prompt itself opens the game

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.guesses += 1
        text = action.strip()
        if not text.isdigit():
            return "", 0.0, True, {"solved": False, "guesses": self.guesses, "malformed": True}
        guess = int(text)
        if guess == self.secret:
            reward = 1.0 - self.turn_penalty * (self.guesses - 1)
            return "", reward, True, {"solved": True, "guesses": self.guesses}
        if self.guesses >= self.max_guesses:
            return "", 0.0, True, {"solved": False, "guesses": self.guesses}
        return ("H" if self.secret > guess else "L"), 0.0, False, {}


async def one_completion(client: Any, task: Mapping[str, Any]) -> float | None:
    """The smallest agent (``rollout: {use: openai_agent, agent: one_completion}``): one
    ``/v1/completions`` call on the prompt the feeder made; the scorer scores the answer."""
    await client.completions.create(model="policy", prompt=task["prompt_ids"])
    return None


CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an integer arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'Integers with + - * // % and parentheses, e.g. "123*456".',
                }
            },
            "required": ["expression"],
        },
    },
}


async def calc_agent(client: Any, task: Mapping[str, Any], max_turns: int = 3) -> float | None:
    """A function-calling agent as written for any OpenAI-compatible server: chat completions
    with the ``calc`` tool offered; each tool call is run and its answer sent back as a
    ``tool`` message, until the model answers without a call. The scorer scores that answer
    (``None``: no reward of the agent's own)."""
    messages: list[dict[str, Any]] = list(task.get("messages") or [])
    if not messages:
        messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC_TOOL]
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                answer = calc(**json.loads(call.function.arguments))
            except (ValueError, TypeError, ZeroDivisionError) as exc:
                answer = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return None
