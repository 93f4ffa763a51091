"""What the tiny-model scripts in this folder (``make_arith_model.py``, ``make_longtail_model.py``,
``make_calc_model.py``, ``make_guess_model.py``) share: character tokenizers and their ids, the
randomly initialised Qwen2 they warm-start and its optimizer, the supervised loss on chosen
segments only, batched greedy or sampled decoding, progress messages, and writing the model
folder and the JSON line.

The scripts import it as ``tiny_lm``: run as ``python configs/models/make_X_model.py``, their
folder is first on ``sys.path``; a test that imports a script puts the folder there first. It
holds no task, no training loop and no stop rule: each script keeps its own. Everything here is
deterministic on one CPU thread given the seeds and generators passed in.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from stages.feeder.arithmetic import (
    EOS_ID,
    PAD_ID,
    _char_tokenizer,  # the arithmetic tokenizers' construction, for the same kind of tokenizer
)

Segments = Sequence[tuple[list[int], bool]]  # a row: (token ids, trained) pieces in order


def char_tokenizer(chars: str, added: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """``<pad>`` 0, ``<eos>`` 1, one token per character of ``chars``, then ``added`` as added
    tokens that are not special: each one id, matched whole, kept by ``skip_special_tokens``."""
    tok = _char_tokenizer(chars)
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def char_codec(
    chars: str,
) -> tuple[Callable[[str], list[int]], Callable[[Sequence[int]], str]]:
    """``encode`` and ``decode`` with the ids ``char_tokenizer(chars)`` gives: ``encode`` is one id
    per character (no special tokens); ``decode`` drops ``<pad>`` and ``<eos>`` (as
    ``skip_special_tokens``)."""
    ids = {c: i + 2 for i, c in enumerate(chars)}
    text = {i: c for c, i in ids.items()}

    def encode(s: str) -> list[int]:
        return [ids[c] for c in s]

    def decode(tokens: Sequence[int]) -> str:
        return "".join(text.get(int(i), "") for i in tokens)

    return encode, decode


def add_model_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """``--out`` (default ``out``), ``--seed`` and the model's shape (arith-tiny's by default)."""
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=256)


def model_shape(args: argparse.Namespace) -> dict[str, int]:
    """The shape ``add_model_arguments`` parsed, as ``build_model``'s keywords."""
    return {
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "intermediate": args.intermediate,
    }


def build_model(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    seed: int,
    vocab_size: int,
    max_positions: int,
    init_range: float = 0.1,
) -> Qwen2ForCausalLM:
    """A randomly initialised float32 ``Qwen2ForCausalLM`` with tied embeddings (seeded)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
        initializer_range=init_range,
    )
    return Qwen2ForCausalLM(config).float()


def segments_batch(rows: Sequence[Segments]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (``<pad>``) ids of ``rows`` and their next-token labels: the label at t is
    token t+1 where that token lies in a trained segment, else -100."""
    flat = []
    for segments in rows:
        ids: list[int] = []
        targets: list[int] = []
        for piece, trained in segments:
            ids += piece
            targets += piece if trained else [-100] * len(piece)
        flat.append((ids, targets[1:]))  # the logit at t predicts token t+1
    width = max(len(ids) for ids, _ in flat)
    batch = torch.full((len(flat), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(flat), width), -100, dtype=torch.long)
    for r, (ids, targets) in enumerate(flat):
        batch[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(targets)] = torch.tensor(targets)
    return batch, labels


def segments_loss(model: torch.nn.Module, rows: Sequence[Segments]) -> torch.Tensor:
    """Mean next-token cross-entropy over the trained segments of ``rows`` (teacher forcing)."""
    ids, labels = segments_batch(rows)
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )


def deterministic() -> None:
    """One CPU thread and deterministic kernels: the same command gives the same weights."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def model_and_optimizer(
    args: argparse.Namespace, *, vocab_size: int, max_positions: int, init_range: float = 0.1
) -> tuple[Qwen2ForCausalLM, torch.optim.Optimizer]:
    """The model of the parsed shape and ``--seed`` in training mode, and its AdamW at ``--lr``
    (no weight decay)."""
    model = build_model(
        **model_shape(args),
        seed=args.seed,
        vocab_size=vocab_size,
        max_positions=max_positions,
        init_range=init_range,
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return model, optimizer


def sft_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimizer step on ``loss`` (gradients cleared first)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def log_evaluation(
    history: list[tuple],
    step: int,
    loss: torch.Tensor,
    stats: Mapping[str, float],
    shown: Sequence[str],
) -> None:
    """Append ``(step, *stats[shown])`` (rounded) to ``history`` and print it with the loss."""
    history.append((step, *(round(stats[k], 3) for k in shown)))
    print(f"step {step} loss {loss.item():.3f} {history[-1]}", file=sys.stderr)


def stop_rule_unmet(step: int, history: Sequence[tuple], shown: Sequence[str]) -> int:
    """Say that no evaluation in ``step`` steps met the stop rule; the exit status (1)."""
    print(
        f"no evaluation met the stop rule in {step} steps (last evaluations as (step, "
        f"{', '.join(shown)}): {history[-10:]})",
        file=sys.stderr,
    )
    return 1


def _by_length(prompts: Sequence[list[int]]) -> dict[int, list[int]]:
    """Indices of ``prompts`` grouped by prompt length (so a batch needs no padding)."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return groups


@torch.no_grad()
def _decode_same_length(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    max_new_tokens: int,
    stop_ids: Collection[int],
) -> torch.Tensor:
    """[rows, max_new_tokens] completions of equal-length ``prompts`` (PAD after a stop id)."""
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long)
    out = model(input_ids=prompts, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1].float()
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    tokens = torch.full((prompts.shape[0], max_new_tokens), PAD_ID, dtype=torch.long)
    for step in range(max_new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
        tokens[:, step] = nxt
        done |= torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return tokens


def sample(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids: Collection[int] = (EOS_ID,),
) -> list[list[int]]:
    """One completion per prompt: token ids up to and including the first of ``stop_ids``
    (``<eos>``) when one is produced, else ``max_new_tokens`` ids. Greedy at temperature 0;
    prompts of the same length decode together, shortest first."""
    was_training = model.training
    model.eval()
    result: list[list[int]] = [[] for _ in prompts]
    for _, idx in sorted(_by_length(prompts).items()):
        batch = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        tokens = _decode_same_length(model, batch, temperature, generator, max_new_tokens, stop_ids)
        for row, i in zip(tokens.tolist(), idx, strict=True):
            end = next((k + 1 for k, t in enumerate(row) if t in stop_ids), len(row))
            result[i] = row[:end]
    model.train(was_training)
    return result


def save_model(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, *, max_new_tokens: int
) -> None:
    """Write ``model`` (safetensors, with a greedy generation config of ``max_new_tokens``) and
    ``tokenizer`` into ``out``."""
    model.generation_config = GenerationConfig(
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, max_new_tokens=max_new_tokens, do_sample=False
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def save_and_report(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    record: dict,
    out: Path,
    started: float,
    *,
    max_new_tokens: int,
) -> int:
    """``save_model``, then print ``record`` as one JSON line with the seconds since ``started``
    (``time.perf_counter``) at its end; the exit status (0)."""
    save_model(model, tokenizer, out, max_new_tokens=max_new_tokens)
    record["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(record))
    return 0


def model_record(args: argparse.Namespace, model: torch.nn.Module, **shape: object) -> dict:
    """The head of a script's JSON line: where the model went (``--out``), its size and its
    shape (``model_shape(args)``, then ``shape``)."""
    return {
        "out": str(args.out),
        "params": sum(p.numel() for p in model.parameters()),
        "shape": {**model_shape(args), **shape},
    }
