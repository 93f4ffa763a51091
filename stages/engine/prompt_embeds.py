"""``/generate``'s ``input_embeds``: prompts given as embeddings rather than token ids.

As SGLang 0.5.23 serves them (``GenerateReqInput._determine_batch_size``,
``TokenizerManager._tokenize_one_request``, ``Scheduler.handle_generate_request``):

- beside ``text`` or ``input_ids`` the field is dropped;
- as the prompt, with the prefix cache on (the default), the request is refused in SGLang's
  words: cached prefixes are keyed by token ids, which such a prompt has none of;
- with the cache off (``--disable-radix-cache``), one prompt is a list of rows of the model's
  embedding width (``[[...], ...]``), a batch a list of those; each prompt stands for as many
  tokens as it has rows, and its ids are SGLang's stand-ins, token 1 in every position
  (``prompt_tokens``, ``input_token_logprobs``' ids and the text's decoding window see those, as
  SGLang's do). The first pass runs the rows where the model's embedding layer would have put
  its output; the tokens generated after them are embedded as usual.

What SGLang would take and then fail on deep in a forward pass (rows of another width, rows of
unequal length, an empty prompt, a value that is not finite) is refused with a 400 naming the
row (``input_embeds[i][j]``).

``PositionalEmbeds`` are SGLang's other form, which only its ``/v1/score`` route makes (embedding
overrides, ``stages.engine.openai_score``): a prompt of token ids some of whose positions take
given rows in place of their tokens' embeddings. No JSON body can carry them (SGLang's field
holds tensors); such a prompt takes nothing from the prefix cache and leaves nothing in it, as
in SGLang (``Req.skip_radix_cache_insert``), since its ids do not determine its KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stages.engine.request_error import RequestError

__all__ = [
    "STAND_IN",
    "PositionalEmbeds",
    "PromptPositions",
    "embeds_prompt",
    "embeds_rows",
    "read_embeds",
]

_FLOAT32_MAX = torch.finfo(torch.float32).max
STAND_IN = 1  # the id SGLang's scheduler gives each position of an embeddings prompt


@dataclass(frozen=True, eq=False)
class PromptPositions:
    """The position ids of a prompt's tokens where they are not 0, 1, 2...: an item of a
    ``/v1/score`` request under ``--enable-mis`` (the query, its delimiter at the query's last
    position, the item after it: ``openai_score``). No JSON body can carry them either; such a
    prompt keeps out of the prefix cache likewise."""

    ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PositionalEmbeds:
    """Rows in place of some of a prompt's token embeddings (SGLang's ``PositionalEmbeds``):
    ``rows[k]`` (float32, the model's embedding width) at prompt position ``positions[k]``."""

    positions: tuple[int, ...]
    rows: torch.Tensor


def embeds_prompt(body: dict[str, Any], prefix_cache: bool, width: int | None) -> bool:
    """Whether ``body``'s prompt is its ``input_embeds`` (neither ``text`` nor ``input_ids``
    given). With the prefix cache on (``prefix_cache``) such a prompt is SGLang's 400, and
    without a model to read its rows against (``width`` None) this engine's."""
    if body.get("input_embeds") is None or body.get("text") is not None:
        return False
    if body.get("input_ids") is not None:
        return False
    if prefix_cache:
        raise RequestError(
            "input_embeds",
            "input_embeds is provided while disable_radix_cache is False. Please add "
            "`--disable-radix-cache` when you launch the server if you want to use input_embeds "
            "as inputs.",
        )
    if width is None:
        raise RequestError("input_embeds", "this route takes no prompt as embeddings")
    return True


def read_embeds(value: Any, width: int) -> tuple[list[list[int]], list[torch.Tensor], bool]:
    """``input_embeds`` as prompts: each prompt's stand-in ids, its rows as a float32 tensor
    ``[tokens, width]``, and whether it was a batch (SGLang: a batch when the first prompt's
    first row is itself a list)."""
    if not isinstance(value, list) or not value:
        raise RequestError("input_embeds", "expected a non-empty list of embedding rows")
    first = value[0]
    if not isinstance(first, list) or not first:
        raise RequestError("input_embeds[0]", "expected a non-empty list")
    batch = isinstance(first[0], list)
    prompts = value if batch else [value]
    ids: list[list[int]] = []
    tensors: list[torch.Tensor] = []
    for i, rows in enumerate(prompts):
        name = f"input_embeds[{i}]" if batch else "input_embeds"
        if not isinstance(rows, list) or not rows:
            raise RequestError(name, "expected a non-empty list of embedding rows")
        tensor = embeds_rows(rows, name, width)
        ids.append([STAND_IN] * len(rows))
        tensors.append(tensor)
    return ids, tensors, batch


def embeds_rows(rows: list[Any], name: str, width: int) -> torch.Tensor:
    """``rows`` (of field ``name``) as a float32 tensor ``[len(rows), width]``; a 400 naming the
    first row of another width or value that is not a finite float32 number."""
    for j, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            got = f"{len(row)} values" if isinstance(row, list) else type(row).__name__
            raise RequestError(
                f"{name}[{j}]",
                f"expected a row of {width} numbers (the model's embedding width), got {got}",
            )
    try:
        tensor = torch.tensor(rows, dtype=torch.float32)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise _bad_value(name, rows) from None
    if not bool(torch.isfinite(tensor).all()):
        raise _bad_value(name, rows)
    return tensor.reshape(len(rows), width)


def _bad_value(name: str, rows: list[list[Any]]) -> RequestError:
    """The error of the first value of ``rows`` that is not a finite float32 number."""
    for j, row in enumerate(rows):
        for k, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, int | float):
                return RequestError(f"{name}[{j}][{k}]", f"expected a number, got {x!r}")
            if not math.isfinite(x) or abs(x) > _FLOAT32_MAX:
                return RequestError(f"{name}[{j}][{k}]", f"expected a finite number, got {x!r}")
    return RequestError(name, "expected rows of finite numbers")
