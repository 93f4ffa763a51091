"""Pick the next token of every running row and report its log-probability.

Greedy rows (temperature 0 or top_k 1) take the argmax and report ``log_softmax(logits)`` at
it. Sampled rows draw from ``softmax(logits / temperature)`` restricted by top-k, top-p and
min-p, and report ``log_softmax(logits / temperature)`` at the drawn token: the
temperature-scaled distribution *before* the top-k/top-p/min-p truncation. That is what SGLang
returns by default (its sampler takes ``log(probs)`` of the temperature-scaled softmax;
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would switch it to the raw logits, which this engine does
not offer).

A row with ``sampling_seed`` draws from its own ``torch.Generator`` seeded with it, so the
same request gives the same tokens whatever else is in the batch; other rows share the
engine's generator (``--seed``). No penalties, logit bias or grammar masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stages.engine.protocol import SamplingParams

__all__ = ["sample_next"]


def sample_next(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """Next token and its log-prob for each row of ``logits`` ([rows, vocab], float32)."""
    rows = logits.shape[0]
    tokens = [0] * rows
    logprobs = [0.0] * rows
    greedy = [i for i in range(rows) if params[i].greedy]
    sampled = [i for i in range(rows) if not params[i].greedy]

    if greedy:
        idx = torch.tensor(greedy)
        sub = logits.index_select(0, idx)
        choice = sub.argmax(dim=-1)
        lp = torch.log_softmax(sub, dim=-1).gather(1, choice[:, None])[:, 0]
        for k, i in enumerate(greedy):
            tokens[i] = int(choice[k])
            logprobs[i] = float(lp[k])

    if sampled:
        idx = torch.tensor(sampled)
        temps = torch.tensor([params[i].temperature for i in sampled], dtype=logits.dtype)
        scaled = logits.index_select(0, idx) / temps[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        probs = _truncate(logp.exp(), [params[i] for i in sampled])
        for k, i in enumerate(sampled):
            tok = int(torch.multinomial(probs[k], 1, generator=generators[i]))
            tokens[i] = tok
            logprobs[i] = float(logp[k, tok])
    return tokens, logprobs


def _truncate(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude (multinomial renormalizes)."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = probs.shape[-1]
    if (
        all(k == -1 or k >= vocab for k in top_k)
        and all(p >= 1.0 for p in top_p)
        and not any(min_p)
    ):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    ranks = torch.arange(vocab)[None, :]
    k_t = torch.tensor([k if k != -1 else vocab for k in top_k])[:, None]
    keep &= ranks < k_t
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= before < torch.tensor(top_p, dtype=probs.dtype)[:, None]
    keep &= sorted_p >= sorted_p[:, :1] * torch.tensor(min_p, dtype=probs.dtype)[:, None]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs)
    filtered.scatter_(1, order, sorted_p * keep)
    return filtered
