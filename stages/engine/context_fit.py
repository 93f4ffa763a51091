"""How a request is fitted to the model's context, as SGLang 0.5.23 fits it, with and without
``--allow-auto-truncate``.

Without the flag (``TokenizerManager._validate_one_request``, then the scheduler's
``validate_input_length`` and ``init_req_max_new_tokens``):

- a prompt as long as the context is refused;
- so is a ``max_new_tokens`` the request gives that the context cannot hold with the prompt;
- so is a prompt of ``max_req_input_len`` tokens or more: the context less 6 (``max_req_len``
  is the context less 1, ``max_req_input_len`` that less 5);
- then a sample generates at most the context less 2 less its prompt, so an unset
  ``max_new_tokens`` (128) is cut to what the context leaves, not refused.

With the flag nothing is refused: a prompt of ``max_req_input_len`` tokens or more keeps its
first ``max_req_input_len``, and a sample still generates at most the context less 2 less the
prompt as it was sent (cut to the context), none where that is below 1. SGLang logs a warning
for each; here ``input_truncated`` is logged sparsely with the count so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import structlog

from stages.engine.request_error import RequestError

log = structlog.get_logger("stages.engine.context_fit")

_truncated = itertools.count(1)  # prompts this process cut (--allow-auto-truncate)


def max_input(context_length: int) -> int:
    """SGLang's ``max_req_input_len``: the longest prompt it takes, the context less 6."""
    return context_length - 6


def truncated(ids: list[int], context_length: int, name: str) -> list[int]:
    """``ids`` as ``--allow-auto-truncate`` leaves them: their first ``max_input`` tokens where
    they are that long or longer (``validate_input_length``), else as they are."""
    most = max_input(context_length)
    if len(ids) < most:
        return ids
    count = next(_truncated)
    if count & (count - 1) == 0:  # 1, 2, 4, 8, ...: a client sending long prompts stays quiet
        log.warning(
            "input_truncated",
            field=name,
            tokens=len(ids),
            kept=most,
            count=count,
            why="--allow-auto-truncate: the prompt is longer than the context takes",
        )
    return ids[:most]


def fit(
    ids: list[int],
    params: Any,
    name: str,
    context_length: int,
    *,
    given: bool,
    sent: int | None = None,
) -> Any:
    """``params`` (``protocol.SamplingParams``) for a prompt of ``ids``, the context's cut of
    ``max_new_tokens`` (and ``min_new_tokens`` with it) made: see the module docstring.
    ``given``: whether the request named ``max_new_tokens`` (SGLang checks only those against
    the context); ``sent``: the prompt's length as it was sent, where ``--allow-auto-truncate``
    cut it to ``ids`` (None: not truncating, so a prompt the context cannot take is refused,
    RequestError)."""
    if sent is None:
        _refuse_unfit(ids, params, name, context_length, given)
        room = context_length - 2 - len(ids)
    else:
        room = max(0, context_length - 2 - min(sent, context_length))
    if params.max_new_tokens <= room:
        return params
    return replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))


def _refuse_unfit(ids: list[int], params: Any, name: str, context_length: int, given: bool) -> None:
    """SGLang's refusals of a request the context cannot take, in its words."""
    if len(ids) >= context_length:
        raise RequestError(
            name,
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens).",
        )
    if given and len(ids) + params.max_new_tokens > context_length:
        raise RequestError(
            name,
            "Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of "
            f"{len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the input "
            f"messages and {params.max_new_tokens} tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the "
            "limit.",
        )
    most = max_input(context_length)
    if len(ids) >= most:
        raise RequestError(
            name,
            f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({most} "
            "tokens). Use a shorter input or enable --allow-auto-truncate.",
        )


def max_new_given(raw: Any) -> bool:
    """Whether a request's ``sampling_params`` name a ``max_new_tokens`` (SGLang checks only
    those against the context)."""
    return isinstance(raw, Mapping) and raw.get("max_new_tokens") is not None
