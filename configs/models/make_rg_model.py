"""Make ``configs/models/rg-arith-tiny``: the model of the reasoning-gym example
(``configs/reasoning_gym.yaml``), a tiny Qwen2-style causal LM for reasoning-gym's
``basic_arithmetic`` with two terms of one or two digits (``Calculate 13 - 92.`` -> ``-79``:
reasoning-gym's phrasing, negative results), a task none of the other shipped models has seen,
warm-started so that the RL run starts partly right.

Usage (from the repository root; about a minute on one CPU thread; needs reasoning-gym)::

    python configs/models/make_rg_model.py [--out configs/models/rg-arith-tiny]

The items are the ones the example's feeder serves (``TASK``: reasoning-gym's own generator,
same size, seed and options), split the way the feeder splits them (a question hashes to the
train or the held-out side of ``eval_fraction``, ``stages.feeder.sources``): the warm start
trains on train-split items only. The tokenizer is one token per character the task's questions
and answers use (``<pad>`` 0, ``<eos>`` 1, then ``CHARS``); prompts are encoded for the warm
start exactly as the run will encode them (``loaded_encoder``). A randomly initialised model of
arith-tiny's shape (248K parameters) is trained supervised on ``prompt + answer + <eos>`` (loss on
the answer and ``<eos>``) and stopped as soon as its greedy accuracy on a sample of held-out
items lies in ``[--min-acc, --max-acc]`` (judged as the example's reward judges it: the
dataset's own ``score_answer`` of the completion). One JSON line reports the figures on other
held-out items.

The same command gives the same weights: everything is seeded and runs deterministically on
one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tiny_lm import (
    add_model_arguments,
    char_codec,
    char_tokenizer,
    deterministic,
    log_evaluation,
    model_and_optimizer,
    model_record,
    sample,
    save_and_report,
    segments_loss,
    sft_step,
    stop_rule_unmet,
)
from transformers import AutoTokenizer

from stages.feeder.arithmetic import EOS_ID
from stages.feeder.reasoning_gym_source import dataset, items
from stages.feeder.sources import _held_out, _split_key

# what configs/reasoning_gym.yaml's feeder makes (keep the two in step)
TASK = {
    "name": "basic_arithmetic",
    "options": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "format_style": "simple",
    },
    "size": 60000,
    "seed": 0,
}
EVAL_FRACTION, SPLIT_SEED = 0.02, 0
CHARS = " +-.0123456789Caceltu"  # every character of the questions and answers
CONTEXT = 64  # the longest question is 20 characters, answers at most 4
MAX_NEW_TOKENS = 6
_, decode = char_codec(CHARS)


def loaded_encoder() -> Callable[[str], list[int]]:
    """``encode`` as the run's stages will encode the prompts: the tokenizer saved into a
    Qwen2 model folder and loaded back with ``AutoTokenizer`` (transformers 5 loads it as
    ``Qwen2Tokenizer``, whose byte-level pre-tokenizer drops the spaces of this vocabulary)."""
    with tempfile.TemporaryDirectory() as folder:
        char_tokenizer(CHARS).save_pretrained(folder)
        (Path(folder) / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        tok = AutoTokenizer.from_pretrained(folder)
    return lambda text: tok.encode(text, add_special_tokens=False)


encode = loaded_encoder()


def split_items() -> tuple[list[dict], list[dict]]:
    """The task's items as (train, held-out), as the feeder splits them."""
    train, held_out = [], []
    for item in items(TASK["name"], TASK["options"], TASK["size"], TASK["seed"]):
        key = _split_key(item["prompt"])
        (held_out if _held_out(key, SPLIT_SEED, EVAL_FRACTION) else train).append(item)
    return train, held_out


def accuracy(model: torch.nn.Module, chosen: Sequence[dict]) -> float:
    """Greedy accuracy, each completion scored by the dataset's own ``score_answer``."""
    data = dataset(TASK["name"], TASK["options"], TASK["size"], TASK["seed"])
    outs = sample(model, [encode(i["prompt"]) for i in chosen], max_new_tokens=MAX_NEW_TOKENS)
    right = 0.0
    for item, out in zip(chosen, outs, strict=True):
        if out and out[-1] == EOS_ID:
            entry = data[item["reasoning_gym"]["index"]]
            right += float(data.score_answer(answer=decode(out).strip(), entry=entry))
    return right / max(len(chosen), 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, Path(__file__).parent / "rg-arith-tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sft-items", type=int, default=20000, help="train items trained on")
    parser.add_argument("--min-acc", type=float, default=0.4, help="stop at this accuracy...")
    parser.add_argument("--max-acc", type=float, default=0.5, help="...and no higher")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-sample", type=int, default=300)
    parser.add_argument("--max-steps", type=int, default=6000)
    args = parser.parse_args(argv)

    deterministic()
    started = time.perf_counter()
    train, held_out = split_items()
    rng = random.Random(args.seed)
    sft = rng.sample(train, min(args.sft_items, len(train)))
    picked = random.Random(args.seed + 1).sample(held_out, len(held_out))
    eval_sample, reported = picked[: args.eval_sample], picked[args.eval_sample :]
    model, optimizer = model_and_optimizer(args, vocab_size=2 + len(CHARS), max_positions=CONTEXT)

    step, history = 0, []
    while step < args.max_steps:
        batch = rng.sample(sft, args.batch)
        rows = [
            [(encode(i["prompt"]), False), ([*encode(i["answer"]), EOS_ID], True)] for i in batch
        ]
        loss = segments_loss(model, rows)
        sft_step(optimizer, loss)
        step += 1
        if step % args.eval_every:
            continue
        acc = accuracy(model, eval_sample)
        log_evaluation(history, step, loss, {"accuracy": acc}, ("accuracy",))
        if args.min_acc <= acc <= args.max_acc:
            break
    else:
        return stop_rule_unmet(step, history, ("accuracy",))

    model.eval()
    record = {
        **model_record(args, model, vocab=2 + len(CHARS), context=CONTEXT),
        "task": TASK,
        "steps": step,
        "train_s": round(time.perf_counter() - started, 1),
        "held_out_items": len(reported),
        "held_out_accuracy": round(accuracy(model, reported), 4),
        "last_evaluations": history[-4:],
    }
    return save_and_report(
        model, char_tokenizer(CHARS), record, args.out, started, max_new_tokens=MAX_NEW_TOKENS
    )


if __name__ == "__main__":
    sys.exit(main())
