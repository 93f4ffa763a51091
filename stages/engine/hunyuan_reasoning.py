"""Whether a chat request to a Hunyuan model reasons (SGLang's ``--reasoning-parser hunyuan``),
and the ``reasoning_effort`` its chat template is given.

The answer's reasoning is read as SGLang's base detector reads ``<think>`` ... ``</think>``
(``stages.engine.reasoning``: ``HunyuanDetector``, its tags as the served tokenizer spells
them, ``hunyuan_calls.tokens``, and ``<tool_calls>`` ending the reasoning too); what is its own
is how a request decides (SGLang 0.5.23: ``parser/hunyuan_reasoning.py``,
``entrypoints/openai/serving_chat.py``):

- a Hy3 template whose reasoning is set by effort (``template_detection``'s
  ``hunyuan_reasoning_effort`` rule: it has ``reasoning_effort``, ``reasoning_mode_token`` and
  ``no_think``; ``uses_hunyuan_reasoning_effort``): the request's ``reasoning_effort`` (or
  ``reasoning.effort``), else ``chat_template_kwargs.reasoning_effort``, is normalized
  (``normalize_hunyuan_reasoning_effort``, ``serving_chat.py:1817``): none: ``high``; ``none``
  or ``no_think``: ``no_think``; ``minimal`` or ``low``: ``low``; ``medium``, ``high``,
  ``xhigh`` or ``max``: ``high``; anything else (``ultra``, a number) a 400 in SGLang's words.
  The template gets that as ``reasoning_effort`` (the kwarg itself is taken out), and the
  request reasons unless it is ``no_think`` (``_get_reasoning_from_request``,
  ``serving_chat.py:3538-3541``): on by default.
- any other template: the request reasons when its effort is set and is not ``none`` or
  ``no_think`` (``serving_chat.py:3542-3545``), the effort being
  ``chat_template_kwargs.reasoning_effort`` where it has one, else ``reasoning_effort`` (for
  every parser but Hunyuan's effort templates, ``_convert_to_internal_request`` moves the kwarg
  into the request's field, ``serving_chat.py:1291-1307``; the template is given the same value
  either way): off by default.

Only this parser's requests are read so; the other parsers' are as they were.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EFFORT_ERROR", "normalized_effort", "thinks"]

EFFORT_ERROR = (
    "Hunyuan reasoning_effort must be one of none, minimal, low, medium, high, xhigh, or max"
)
_OFF = ("none", "no_think")


def normalized_effort(
    effort: Any, kwargs: dict[str, Any] | None
) -> tuple[str, dict[str, Any] | None]:
    """``(reasoning_effort, chat_template_kwargs)`` of a request to an effort template: the
    request's effort (else the kwarg's) as the template takes it, the kwargs without
    ``reasoning_effort``. ValueError (SGLang's message) for an effort it does not take."""
    if effort is None and kwargs is not None:
        effort = kwargs.get("reasoning_effort")
    if effort is None:
        level = "high"
    elif effort in _OFF:
        level = "no_think"
    elif effort in ("minimal", "low"):
        level = "low"
    elif effort in ("medium", "high", "xhigh", "max"):
        level = "high"
    else:
        raise ValueError(EFFORT_ERROR)
    if kwargs is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "reasoning_effort"}
    return level, kwargs


def thinks(effort_template: bool, kwargs: dict[str, Any] | None, effort: Any) -> bool:
    """Whether the request reasons (``effort_template``: the template sets reasoning by effort,
    whose request's ``effort`` and ``kwargs`` ``normalized_effort`` has read)."""
    if effort_template:
        return normalized_effort(effort, kwargs)[0] != "no_think"
    given = (kwargs or {}).get("reasoning_effort")
    if given is None:
        given = effort
    return given is not None and given not in _OFF
