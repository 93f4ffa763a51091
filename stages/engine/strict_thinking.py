"""Strict thinking: ``--enable-strict-thinking`` and a request's ``max_thinking_tokens``.

As SGLang 0.5.23 filters a reasoning model's thinking (``srt/constrained/
reasoner_grammar_backend.py``, ``ReasonerGrammarObject.fill_vocab_mask``), for the samples
whose reasoning the engine follows (``require_reasoning``, which a thinking chat request sets)
with a ``--reasoning-parser``:

- while a sample thinks, the tokens of its parser's excluded tags cannot be drawn (Qwen3's
  ``<tool_call>``, ``</tool_call>``, ``<|im_end|>`` and ``<|endoftext|>``, GLM-4.5's; every id
  each tag encodes to, as SGLang's ``_get_think_excluded_token_ids`` takes them): no tool call
  or end of turn inside the reasoning;
- once it has thought its budget (``max_thinking_tokens``, else the server's
  ``SGLANG_MAX_THINK_TOKENS``; negative: none), only the next token of the reasoning's end tag
  can be drawn, so the reasoning ends there and the answer follows: budget forcing.

What is filtered is the distribution the token is drawn from, so the log-probs reported are
those of the filtered distribution, as SGLang's: a forced end tag's is 0. A learner that
recomputes them under its own weights sees the unfiltered ones; its importance weights correct
the difference as for any other sampler setting.

One difference from SGLang 0.5.23: there a request's budget applies only when the parser has
excluded tags or ``SGLANG_MAX_THINK_TOKENS`` is set (its ``enable_token_filter``); with a parser
without excluded tags (DeepSeek-R1's) and no server budget, SGLang ignores the request's. Here
it applies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stages.engine.reasoning import PARSERS, end_tag_ids

__all__ = ["BUDGET_ENV", "StrictThinking"]

BUDGET_ENV = "SGLANG_MAX_THINK_TOKENS"  # the server's budget (SGLang's envs; -1: none)
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class StrictThinking:
    """An engine's strict thinking: the reasoning's end tag and excluded tags as token ids,
    and its budget (-1: none)."""

    end: tuple[int, ...]
    excluded: tuple[int, ...]
    budget: int = -1

    @classmethod
    def of(
        cls,
        parser: str,
        tokenizer: Any,
        environ: Mapping[str, str] = os.environ,
        vocab_size: int | None = None,
    ) -> StrictThinking:
        """For ``--reasoning-parser parser`` on ``tokenizer`` (a model of ``vocab_size``
        logits: an excluded id beyond them cannot be drawn anyway); ValueError (SGLang's words)
        for a tag the tokenizer encodes to nothing, an end tag the model cannot draw or a budget
        that is not an integer."""
        fmt = PARSERS[parser.lower()]
        end = end_tag_ids(fmt, tokenizer)
        if not end:
            raise ValueError(f"think_end_token '{fmt.end}' could not be encoded by the tokenizer.")
        if vocab_size is not None and max(end) >= vocab_size:
            raise ValueError(
                f"think_end_token '{fmt.end}' is token ids {list(end)}, beyond the model's "
                f"{vocab_size} logits"
            )
        excluded: list[int] = []
        for tag in fmt.excluded:
            ids = tokenizer.encode(tag, add_special_tokens=False)
            if not ids:
                raise ValueError(
                    f"think_excluded_token '{tag}' could not be encoded by the tokenizer. All "
                    "excluded tokens must be encodable for strict reasoning mode to function "
                    "correctly."
                )
            excluded += [i for i in ids if vocab_size is None or i < vocab_size]
        raw = environ.get(BUDGET_ENV, "").strip()
        try:
            budget = int(raw) if raw else -1
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={raw!r}: expected an integer") from None
        return cls(end, tuple(excluded), max(budget, -1))

    def limit(self, requested: int | None) -> int:
        """A sample's budget: the request's ``max_thinking_tokens``, else the server's
        (-1: none; SGLang clamps a lower one to -1)."""
        return self.budget if requested is None else max(requested, -1)

    def mask(
        self, logits: torch.Tensor, free: list[int], forced: list[int], ends: list[int]
    ) -> None:
        """Before a draw: the rows ``free`` (still within their budget) cannot take an
        excluded token, and each of the rows ``forced`` only the token of ``ends`` at the same
        place (the next of the end tag's)."""
        if free and self.excluded:
            cols = torch.tensor(self.excluded, device=logits.device)
            if len(free) == 1:
                logits[free[0]].index_fill_(0, cols, _NEG_INF)
            else:
                rows = torch.tensor(free, device=logits.device)
                logits[rows.unsqueeze(1), cols.unsqueeze(0)] = _NEG_INF
        if forced:
            device = logits.device
            rows = torch.tensor(forced, device=device)
            cols = torch.tensor(ends, device=device)
            kept = logits[rows, cols]
            logits.index_fill_(0, rows, _NEG_INF)
            logits[rows, cols] = kept
