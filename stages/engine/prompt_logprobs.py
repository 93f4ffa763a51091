"""Input (prompt) log-probs: ``logprob_start_len`` and prefill-only scoring (``max_new_tokens: 0``).

How RL code gets reference or teacher log-probs of given tokens from an engine: it sends the
prompt and completion as ``input_ids`` with ``return_logprob``, ``logprob_start_len`` where the
part it wants begins, and ``max_new_tokens: 0``.

As SGLang 0.5 answers it (``SchedulerLogprobResultProcessor._process_input_token_logprobs``,
``logprob_processor``: ``log_softmax`` of the raw logits, no temperature): for a prompt of ``L``
tokens and a start ``s`` (``0 <= s <= L``), ``input_token_logprobs`` has ``L - s`` entries
``[logprob, token_id, text or None]``, one per prompt token from ``s`` on; entry ``k`` (``k >= 1``)
is the log-prob of token ``s + k`` under the logits after tokens ``0 .. s + k - 1``, and entry 0's
log-prob is ``None`` (SGLang drops the last position's, which is the sampled token's, and puts
``None`` in front, whatever ``s``). ``input_top_logprobs`` (with ``top_logprobs_num``) has one
entry per token likewise: ``None`` first, then the ``top_logprobs_num`` most likely tokens at
the position before each token. ``input_token_ids_logprobs`` (with ``token_ids_logprob``) the
same for the tokens asked for, in the order asked.

The built-in engine computes them in a pass of their own, before a request's samples are
admitted, on top of the prompt's longest prefix in the prefix cache up to ``logprob_start_len``
(as SGLang stops its prefix match there: the positions whose log-probs are asked for are
computed), the live weights' KV only; the prompt's KV then goes into the cache, so a request
that also generates is prefilled on top of it, and the samples of one prompt scored together
(a teacher's or a reference's batch: prompt and completion, the start at the completion)
compute the prompt once.
A prefill-only request (``max_new_tokens: 0``) that asks for ``top_logprobs_num`` or
``token_ids_logprob`` also gets the distribution after its last prompt token, as SGLang 0.5.23
computes it without sampling (``ModelRunner.compute_logprobs_only``): one entry of
``output_top_logprobs`` and of ``output_token_ids_logprobs``, with no output token (how
SGLang's ``/v1/score`` reads a label's probability, and how an LLM judge asks for the
log-probs of ``Yes`` and ``No`` without generating). Positions are turned into log-probs a
chunk at a time, so a long prompt never holds
``[L, vocab]`` logits at once. This module holds the arithmetic; the scheduler calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["POSITIONS_PER_CHUNK", "TOKENS_PER_PASS", "next_token_logprobs", "prompt_logprobs"]

POSITIONS_PER_CHUNK = 256  # positions whose logits exist at once (x vocab floats)
TOKENS_PER_PASS = 8192  # prompts scored in one forward pass hold at most this many tokens (padded)


Steps = list[list[tuple[float, int]] | None]  # per position: (logprob, token id) pairs, or None


def prompt_logprobs(
    hidden: torch.Tensor,
    ids: list[int],
    start: int,
    top: int,
    head: Callable[[torch.Tensor], torch.Tensor],
    wanted: Sequence[int] | None = None,
    offset: int = 0,
) -> tuple[list[float | None], Steps | None, Steps | None]:
    """``(logprobs, tops, picked)`` of prompt tokens ``start ..``: ``hidden`` ``[L - offset,
    H]`` is the final (normed) hidden state at each prompt position from ``offset`` (``<=
    start``: the positions before it came from the prefix cache) on, ``head`` maps it to
    logits. ``tops`` is None unless ``top`` > 0, ``picked`` (the log-probs of the ``wanted``
    tokens) unless ``wanted`` is given."""
    if not 0 <= offset <= max(start, 0):
        raise ValueError(f"offset {offset} is beyond the start {start}")
    length = len(ids)
    if start >= length:
        return [], ([] if top else None), (None if wanted is None else [])
    logprobs: list[float | None] = [None]
    tops: Steps | None = [None] if top else None
    picked: Steps | None = None if wanted is None else [None]
    columns = None
    if wanted is not None:
        columns = torch.tensor(wanted, dtype=torch.long, device=hidden.device)
    # position p's logits give the log-prob of token p + 1: positions start .. length - 2
    targets = torch.tensor(ids[start + 1 :], dtype=torch.long, device=hidden.device)
    for lo in range(start, length - 1, POSITIONS_PER_CHUNK):
        hi = min(lo + POSITIONS_PER_CHUNK, length - 1)
        logits = head(hidden[lo - offset : hi - offset])
        if logits.dtype in (torch.float16, torch.bfloat16):  # as the sampler: in float32
            logits = logits.float()
        lps = torch.log_softmax(logits, dim=-1)
        chosen = lps.gather(1, targets[lo - start : hi - start, None])[:, 0]
        logprobs.extend(chosen.tolist())
        if tops is not None:
            values, indices = lps.topk(min(top, lps.shape[1]), dim=-1)
            for vals, toks in zip(values.tolist(), indices.tolist(), strict=True):
                tops.append(list(zip(vals, toks, strict=True)))
        if picked is not None and columns is not None:
            for vals in lps.index_select(1, columns).tolist():
                picked.append(list(zip(vals, wanted, strict=True)))  # type: ignore[arg-type]
    return logprobs, tops, picked


def scoring_passes(lengths: list[int]) -> list[list[int]]:
    """Prompts (by index) grouped into scoring passes: sorted by length, each pass at most
    ``TOKENS_PER_PASS`` padded tokens (a longer prompt alone) and at most half padding."""
    parts: list[list[int]] = []
    part: list[int] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        padded = (len(part) + 1) * lengths[i]  # the sorted order makes it the widest
        if part and (padded > TOKENS_PER_PASS or padded > 2 * (total + lengths[i])):
            parts.append(sorted(part))
            part, total = [], 0
        part.append(i)
        total += lengths[i]
    if part:
        parts.append(sorted(part))
    return parts


def next_token_logprobs(
    last: torch.Tensor,
    top: int,
    head: Callable[[torch.Tensor], torch.Tensor],
    wanted: Sequence[int] | None = None,
) -> tuple[list[tuple[float, int]] | None, list[tuple[float, int]] | None]:
    """``(top, picked)`` of the distribution after the prompt: ``last`` ``[H]`` is the final
    hidden state at its last position. ``top`` (its ``top`` most likely tokens) is None unless
    ``top`` > 0, ``picked`` (the ``wanted`` tokens', in that order) unless ``wanted`` is given."""
    logits = head(last[None])
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    lps = torch.log_softmax(logits, dim=-1)[0]
    tops = None
    if top:
        values, indices = lps.topk(min(top, lps.shape[0]))
        tops = list(zip(values.tolist(), indices.tolist(), strict=True))
    picked = None
    if wanted is not None:
        columns = torch.tensor(list(wanted), dtype=torch.long, device=lps.device)
        picked = list(zip(lps.index_select(0, columns).tolist(), wanted, strict=True))
    return tops, picked
