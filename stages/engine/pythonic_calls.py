"""Tool calls written as a Python list of calls: SGLang's ``pythonic`` format (Llama 4).

As SGLang 0.5.23's ``function_call/pythonic_detector.py`` reads them:
``[get_weather(city="Paris", days=2), now()]``, keyword arguments only, each a literal (a
string, number, ``True``/``False``/``None``, or a list or dict of them; a negative number is an
operation, not a literal, so it is not one). ``<|python_start|>`` and ``<|python_end|>`` are
taken out of the text first.

Whole: the (stripped) text is searched for SGLang's pattern of a bracketed call list (``.*``
within it reaches as far as it can); what it matches is parsed with ``ast``, the text around it
is the content. Calls are dropped, and logged, one by one: a call of anything but a plain name,
of a tool not offered, or with an argument that is not a literal or has no JSON form (bytes,
``inf``). If the match is not a list of calls, or does not parse, there are no calls. A call's
``tool_index`` there is its place in the list, the calls dropped before it counted
(``listed``); the chat route numbers the calls it answers with in order, as SGLang's does.

Streamed (``stream()``), as SGLang streams it: text goes out as content up to a ``[``, from
which it waits until its brackets close (strings not minded); the bracketed text is then read
as a whole answer alone, its calls going out each in one piece (name and arguments together)
and its other text as content; and so on. Where this differs from SGLang: every closed list in
a delta is read, not one a delta (SGLang leaves the others until more text comes, or for good at
the end); text still held at the end (a ``[`` never closed) goes out as content, where SGLang
drops it; and the calls are numbered on across lists, where SGLang numbers each list's from 0
and counts the calls it dropped.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls, partial_tail
from stages.engine.tool_formats import quiet_ast

__all__ = ["PythonicCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

_TOKENS = ("<|python_start|>", "<|python_end|>")
# SGLang's PythonicDetector.tool_call_regex: calls followed by a comma, then the last calls
_NAME = r"[a-zA-Z]+\w*"
_FOLLOWED = rf"{_NAME}\(({_NAME}=.*,\s*)*({_NAME}=.*\s)?\),\s*"
_LAST = rf"{_NAME}\(({_NAME}=.*,\s*)*({_NAME}=.*\s*)?\)\s*"
_CALLS = re.compile(rf"\[({_FOLLOWED})*({_LAST})+\]", re.DOTALL)


class _Unreadable(Exception):
    """Not a list of calls at all."""


def _untokened(text: str) -> str:
    for token in _TOKENS:
        text = text.replace(token, "")
    return text


class PythonicCalls(ListedCalls):
    """SGLang's ``PythonicDetector`` (``--tool-call-parser pythonic``)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return _CALLS.search(_untokened(text.strip())) is not None

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(place, call)])``: each call with its place in the list, the calls
        dropped counted (``tool_index`` there: ``pythonic_detector.py:86,118``)."""
        text = _untokened(text.strip())
        match = _CALLS.search(text)
        if match is None:
            return text, []
        content = text[: match.start()] + text[match.end() :]
        try:
            tree = quiet_ast(ast.parse, match.group())
            value = getattr(tree.body[0], "value", None)
            if not isinstance(value, ast.List) or any(
                not isinstance(e, ast.Call) for e in value.elts
            ):
                return content, []
            calls = [(i, self._call(e)) for i, e in enumerate(value.elts)]
        except (SyntaxError, ValueError, RecursionError, _Unreadable) as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=match.group()[:200])
            return content, []
        return content, [(i, call) for i, call in calls if call is not None]

    def _call(self, call: ast.Call) -> dict[str, str] | None:
        if not isinstance(call.func, ast.Name):
            return None
        name = call.func.id
        if name not in self.names:
            log.warning("tool_call_unknown_function", name=name[:100])
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in call.keywords}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError) as exc:
            log.warning("tool_call_skipped", name=name[:100], error=str(exc))
            return None
        return {"name": name, "arguments": text}

    def stream(self) -> _PythonicStream:
        return _PythonicStream(self)


def _literal(node: ast.expr) -> Any:
    """An argument's value (``PythonicDetector._get_parameter_value``): ValueError or TypeError
    drop its call; a dict key that is no value at all, the whole list (``_Unreadable``)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise ValueError(f"Constant has no JSON representation: {type(node.value).__name__}")
    if isinstance(node, ast.Dict):
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.List):
        return [_literal(v) for v in node.elts]
    raise ValueError("Tool call arguments must be literals")


def _key(node: ast.expr | None) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if node is not None and hasattr(node, "value"):  # SGLang keys the dict by a syntax node
        raise TypeError(f"a dict key that is not a literal: {type(node).__name__}")
    raise _Unreadable(f"a dict key that is not a literal: {type(node).__name__}")


def _closing(text: str, start: int) -> int:
    """The index of the ``]`` that closes the ``[`` at ``start``, -1 while it is open."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


class _PythonicStream:
    def __init__(self, calls: PythonicCalls) -> None:
        self.reader = calls
        self.held = ""  # text not passed on yet
        self.calls = 0  # calls sent so far: the next one's index

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        text = self.held + delta
        keep = max(partial_tail(text, token) for token in _TOKENS)
        text, tail = _untokened(text[: len(text) - keep]), text[len(text) - keep :]
        content, pieces = "", []
        while (start := text.find("[")) != -1:
            content += text[:start]
            end = _closing(text, start)
            if end == -1:
                break
            normal, calls = self.reader.parse(text[start : end + 1])
            content += normal
            for call in calls:
                pieces.append({"index": self.calls, **call})
                self.calls += 1
            text = text[end + 1 :]
        else:
            content, text = content + text, ""
        self.held = text[text.find("[") :] + tail if text else tail
        return content, pieces

    def flush(self) -> str:
        rest, self.held = _untokened(self.held), ""
        return rest

    def unsent(self) -> list[dict[str, Any]]:
        return []  # a call goes out whole, in one piece
