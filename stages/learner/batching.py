"""Micro-batches, padding, and completion log-probs from a causal LM.

The learner never runs a forward pass over a whole optimizer-step batch ("two batch sizes"):
``micro_batches`` splits a batch into micro-batches bounded by a sample count and optionally a
padded-token budget, ``collate`` right-pads one micro-batch, ``completion_logprobs`` runs the
model on it and picks each completion token's log-prob (and, optionally, the entropy of the
distribution it was drawn from), and ``no_grad_logprobs`` does the forward-only pass (old or
reference log-probs, metrics) micro-batch by micro-batch, so its peak memory is set by the
micro-batch, never by the batch.

Memory: logits are computed only from the first completion position on when the model accepts
``logits_to_keep`` (transformers' causal LMs do), gathered to the completion tokens, and the
log-sum-exp is computed once and reused for the entropy; ``log_softmax`` over ``[B, L, V]`` is
never materialized. The KV cache is turned off.

Not here: the loss (``loss.py``), moving models between devices, sequence packing.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

__all__ = [
    "Batch",
    "collate",
    "completion_logprobs",
    "micro_batches",
    "no_grad_logprobs",
    "pad_right",
]


def micro_batches(
    lengths: Sequence[int], size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Split sample indices ``0..len(lengths)-1``, in order, into micro-batches.

    Each holds at most ``size`` samples and, when ``max_tokens`` is given, at most
    ``max_tokens`` padded tokens (``len(mb) * max(lengths in mb)``; pass the full prompt +
    completion lengths). A sample longer than ``max_tokens`` on its own gets a micro-batch of its
    own (the budget cannot be met, but the sample is not dropped). Greedy: a micro-batch is
    closed when the next sample would break a bound. No empty micro-batch is ever returned.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (or None), got {max_tokens}")
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, int(n))
        too_many = len(current) + 1 > size
        too_long = max_tokens is not None and (len(current) + 1) * grown > max_tokens
        if current and (too_many or too_long):
            out.append(current)
            current, grown = [], int(n)
        current.append(i)
        longest = grown
    if current:
        out.append(current)
    return out


@dataclass
class Batch:
    """One right-padded micro-batch.

    ``input_ids`` / ``attention_mask`` ``[B, L]``: prompt + completion, then padding.
    ``completion_ids`` / ``completion_mask`` ``[B, Lc]``: the completion tokens, left-aligned.
    ``logit_index`` ``[B, Lc]``: for each completion token, the position in ``input_ids`` whose
    logits predict it (``prompt_len + j - 1``; 0 in padding slots).

    Collated with ``share_prompts`` when some rows have the same prompt (a group's samples):
    ``prompts`` ``[U, Lp]``, each distinct prompt once, right-padded; ``prompt_lengths``
    ``[U]``; ``prompt_of`` ``[B]``, the row of ``prompts`` each sample's prompt is. Otherwise
    None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logit_index: torch.Tensor
    prompts: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    prompt_of: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            **{
                f.name: None
                if (t := getattr(self, f.name)) is None
                else t.to(device, non_blocking=non_blocking)
                for f in fields(self)
            }
        )

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


def collate(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    share_prompts: bool = False,
) -> Batch:
    """Right-pad ``prompt + completion`` token ids into a ``Batch`` (on CPU).

    Every prompt needs at least one token (the first completion token is predicted from the
    prompt's last position). Completions may be empty. The rows are filled in numpy (a few
    hundred samples per micro-batch: per-row torch indexing would cost more than the masks).
    ``share_prompts``: also each distinct prompt once (``Batch.prompts``), when rows share one.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("collate needs at least one sample")
    rows = len(prompts)
    p_len = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=rows)
    c_len = np.fromiter((len(c) for c in completions), dtype=np.int64, count=rows)
    if p_len.min() < 1:
        raise ValueError(
            f"sample {int(np.argmin(p_len))} has an empty prompt; prompts need >= 1 token"
        )
    total = p_len + c_len
    width, c_width = int(total.max()), int(c_len.max())
    input_ids = np.full((rows, width), pad_id, dtype=np.int64)
    completion_ids = np.full((rows, c_width), pad_id, dtype=np.int64)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        p, t = int(p_len[i]), int(total[i])
        input_ids[i, :p] = prompt
        if t > p:
            input_ids[i, p:t] = completion
            completion_ids[i, : t - p] = completion
    attention_mask = (np.arange(width)[None, :] < total[:, None]).astype(np.int64)
    steps = np.arange(c_width)[None, :]
    completion_mask = steps < c_len[:, None]
    logit_index = np.where(completion_mask, p_len[:, None] - 1 + steps, 0)
    batch = Batch(
        torch.from_numpy(input_ids),
        torch.from_numpy(attention_mask),
        torch.from_numpy(completion_ids),
        torch.from_numpy(completion_mask),
        torch.from_numpy(logit_index),
    )
    if share_prompts:
        _distinct_prompts(batch, input_ids, p_len, pad_id)
    return batch


def _distinct_prompts(batch: Batch, input_ids: np.ndarray, p_len: np.ndarray, pad_id: int) -> None:
    """Fill ``batch``'s distinct prompts, when some rows share one."""
    seen: dict[bytes, int] = {}
    first: list[int] = []
    prompt_of = np.empty(len(p_len), dtype=np.int64)
    for i, n in enumerate(p_len.tolist()):
        key = input_ids[i, :n].tobytes()
        at = seen.setdefault(key, len(first))
        if at == len(first):
            first.append(i)
        prompt_of[i] = at
    if len(first) == len(p_len):
        return  # no prompt twice: nothing to share
    lengths = p_len[first]
    width = int(lengths.max())
    prompts = input_ids[first, :width].copy()
    prompts[np.arange(width)[None, :] >= lengths[:, None]] = pad_id
    batch.prompts = torch.from_numpy(prompts)
    batch.prompt_lengths = torch.from_numpy(lengths)
    batch.prompt_of = torch.from_numpy(prompt_of)


def pad_right(
    values: Sequence[torch.Tensor], *, width: int | None = None, fill: float = 0.0
) -> torch.Tensor:
    """Stack 1-D tensors (e.g. per-sample sampler log-probs) into ``[B, width]``, right-padded.

    ``width`` defaults to the longest; the result matches ``Batch.completion_mask`` when the
    values are per completion token and ``width`` is ``Batch.completion_ids.shape[1]``.
    """
    if not values:
        raise ValueError("pad_right needs at least one tensor")
    width = max(int(v.numel()) for v in values) if width is None else width
    out = torch.full((len(values), width), fill, dtype=values[0].dtype, device=values[0].device)
    for i, v in enumerate(values):
        if v.numel() > width:
            raise ValueError(f"value {i} has {v.numel()} entries, more than width={width}")
        out[i, : v.numel()] = v.reshape(-1)
    return out


def completion_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token ``[B, Lc]`` (float32, or float64 for a float64 model; 0
    in padding slots), and entropy.

    Runs ``model(input_ids=...)`` (grad follows the caller's grad mode) on the batch's device,
    without the attention mask: the rows are right-padded, so under causal attention no real
    token sees a padding one, and the positions count from 0 either way. The mask would only
    cost a [B, 1, L, L] mask to build and SDPA's causal kernel (about 6% of the default task's
    forward and backward). A batch collated with ``share_prompts`` runs each distinct prompt
    once (``_shared_prompt_logits``). Logits are divided by ``temperature``,
    the sampler's, so the log-probs are those of the distribution the tokens were drawn from
    (the built-in engine and SGLang report the temperature-scaled log-prob, before top-k/top-p
    truncation). The entropy ``[B, Lc]`` (or None) is that of the full temperature-scaled
    distribution at each completion position, in nats; it is detached (a metric, and its graph
    would hold another ``[B, Lc, V]`` tensor) unless ``entropy_grad`` (for an entropy bonus).
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; greedy sampling (temperature 0) "
            "reports unscaled log-probs: pass 1.0"
        )
    mask = batch.completion_mask
    if mask.shape[1] == 0:
        dtype = torch.promote_types(_model_dtype(model), torch.float32)
        empty = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return empty, (empty.clone() if with_entropy else None)
    picked = _shared_prompt_logits(model, batch) if batch.prompts is not None else None
    if picked is None:
        # The earliest position whose logits predict a completion token; logits before it
        # are never needed.
        first = int(torch.where(mask, batch.logit_index, batch.input_ids.shape[1]).min())
        keep = batch.input_ids.shape[1] - first
        options = _forward_options(model, keep)
        out = model(input_ids=batch.input_ids, attention_mask=None, **options)
        logits = out.logits if hasattr(out, "logits") else out[0]
        offset = batch.input_ids.shape[1] - logits.shape[1]  # logits[:, k]: position offset + k
        index = (batch.logit_index - offset).clamp(min=0)
        picked = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
        del logits, out
    # bf16/fp16 logits are summed in float32; a float64 model keeps float64
    picked = picked.to(torch.promote_types(picked.dtype, torch.float32))
    if temperature != 1.0:
        picked = picked / temperature
    lse = torch.logsumexp(picked, dim=-1)
    token_logit = picked.gather(-1, batch.completion_ids[:, :, None]).squeeze(-1)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    logp = torch.where(mask, token_logit - lse, zero)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            probs = (picked - lse[:, :, None]).exp()
            entropy = torch.where(mask, lse - (probs * picked).sum(-1), zero)
    return logp, entropy


def no_grad_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    micro_batch: int,
    max_tokens: int | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    device: torch.device | str | None = None,
    share_prompts: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward-only log-probs (and entropies) of every sample, one micro-batch at a time.

    Returns one 1-D float32 CPU tensor (a float64 model's: float64) per sample (its
    completion's length), in input order; with ``with_entropy``, a pair ``(logprobs,
    entropies)`` of such lists. Runs under ``torch.no_grad()`` in micro-batches of at most
    ``micro_batch`` samples / ``max_tokens`` padded tokens, on ``device`` (default: the
    model's). The model's train/eval mode is left as it is. ``share_prompts``: as ``collate``.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if device is None:
        device = _model_device(model)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    logps: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    entropies: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    with torch.no_grad():
        for mb in micro_batches(lengths, micro_batch, max_tokens):
            batch = collate(
                [prompts[i] for i in mb],
                [completions[i] for i in mb],
                pad_id=pad_id,
                share_prompts=share_prompts,
            ).to(device)
            logp, entropy = completion_logprobs(
                model, batch, with_entropy=with_entropy, temperature=temperature
            )
            logp, n = logp.cpu(), batch.completion_lengths.tolist()
            entropy = entropy.cpu() if entropy is not None else None
            for row, i in enumerate(mb):
                logps[i] = logp[row, : n[row]].clone()
                if entropy is not None:
                    entropies[i] = entropy[row, : n[row]].clone()
            del batch, logp, entropy
    return (logps, entropies) if with_entropy else logps


def _shared_prompt_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor | None:
    """The logits ``[B, Lc, V]`` that predict each completion token, with each distinct prompt
    run once: its keys and values, and the logits of its last position, go to every sample
    that has it (a group's G samples share one prompt), and the completions run on them. The
    same values as one pass over ``prompt + completion`` (the positions continue from each
    prompt's length; a shorter prompt's padding is masked), for fewer tokens; gradients flow
    back into the prompt's pass through the shared keys and values. None (the caller then runs
    the whole rows) when the model cannot be called so: no cache argument, or a cache that is
    not plain per-layer keys and values (sliding windows, linear attention)."""
    from stages.hf import CACHE_NAMES, output_cache

    names = _forward_names(model)
    cache_arg = next((n for n in CACHE_NAMES if n in names), None)
    inner = getattr(model, "module", model)  # DeepSpeed / DDP wrappers pass kwargs through
    if cache_arg is None or "position_ids" not in names or _SHARING.get(inner) is False:
        return None
    prompts, lengths, prompt_of = batch.prompts, batch.prompt_lengths, batch.prompt_of
    assert prompts is not None and lengths is not None and prompt_of is not None
    width = prompts.shape[1]
    keep = width - int(lengths.min()) + 1  # from the shortest prompt's last position on
    out = model(input_ids=prompts, **{**_forward_options(model, keep), "use_cache": True})
    cache = output_cache(out)
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        _SHARING[inner] = False  # known once per model: the whole rows from now on
        return None
    _SHARING[inner] = True
    logits = out.logits if hasattr(out, "logits") else out[0]
    last = (lengths - 1 - (width - logits.shape[1])).to(logits.device)
    head = logits[torch.arange(len(lengths), device=logits.device), last]  # [U, V]
    del out, logits
    cache.reorder_cache(prompt_of)  # every sample's own copy: index_select, with gradients
    rows, c_width = batch.completion_ids.shape
    steps = torch.arange(c_width, device=prompt_of.device)
    positions = lengths.index_select(0, prompt_of)[:, None] + steps[None, :]
    real = torch.arange(width, device=prompt_of.device)[None, :] < positions[:, :1]
    # the completions see their own prompt's tokens, not the padding after a shorter one's
    attention = None
    if not bool(real.all()):
        attention = torch.cat((real, torch.ones_like(real[:, :1]).expand(rows, c_width)), 1)
        attention = attention.long()
    out = model(
        input_ids=batch.completion_ids,
        attention_mask=attention,
        position_ids=positions,
        **{cache_arg: cache},
        **_forward_options(model, c_width),
    )
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.cat((head.index_select(0, prompt_of)[:, None], logits[:, : c_width - 1]), 1)


# model -> whether its cache can be shared (once known)
_SHARING: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    param = next(iter(model.parameters()), None)
    return torch.float32 if param is None else param.dtype


def _model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


_OPTION_CACHE: dict[tuple[type, type], frozenset[str]] = {}


def _forward_names(model: torch.nn.Module) -> frozenset[str]:
    """The keyword arguments the model's ``forward`` takes."""
    inner = getattr(model, "module", model)  # DeepSpeed / DDP wrappers pass kwargs through
    base = getattr(inner, "get_base_model", None)  # peft: what it does not take goes there
    base = base() if callable(base) else None
    key = (type(inner), type(base))
    names = _OPTION_CACHE.get(key)
    if names is None:
        try:
            names = frozenset(inspect.signature(inner.forward).parameters)
        except (TypeError, ValueError):
            names = frozenset()
        if "kwargs" in names and base is not None:
            names |= _forward_names(base)
        _OPTION_CACHE[key] = names
    return names


def _forward_options(model: torch.nn.Module, keep: int) -> dict[str, Any]:
    """Keyword options that save memory, for the ones the model's ``forward`` accepts."""
    names = _forward_names(model)
    options: dict[str, Any] = {}
    if "use_cache" in names:
        options["use_cache"] = False
    if "logits_to_keep" in names:
        options["logits_to_keep"] = keep
    elif "num_logits_to_keep" in names:  # transformers < 4.50
        options["num_logits_to_keep"] = keep
    return options
