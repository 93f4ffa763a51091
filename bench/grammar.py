"""What constrained decoding costs the engine's scheduler per token (``stages.engine.grammar``).

A byte-level BPE tokenizer of a realistic vocabulary is trained here on Python's own standard
library sources (nothing is downloaded), a JSON schema is compiled for it, and rows walk the
grammar for ``--steps`` tokens each: every step computes each row's mask, sets what it does not
allow to ``-inf`` in ``[rows, vocab]`` logits (``GrammarSet.constrain``), draws the most likely
allowed token from random logits and has each row's grammar take it (``Constraint.accept``).
Prints one JSON line: the vocabulary, the schema's compile time (first, and from the cache),
and per batch size the CPU time of a step per row, split into masks and acceptance.

``new_schemas``: ``--new`` schemas never seen (the schema with its property names changed)
compiled while an asyncio loop keeps a 1 ms timer going, as the engine's loop serves: the
compile time of each, and the loop's longest stall (how late its timer fired) when the loop
compiles them itself (``inline``, what the engine's routes did before) and when the grammar
worker does (``GrammarSet.compile_later``, what they do now: the loop only waits for llguidance
while it holds the GIL).

    python bench/grammar.py [--vocab 32000] [--rows 1,8,32] [--steps 64] [--repeats 5] [--new 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.engine.grammar import GrammarSet

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags"],
}


def train_tokenizer(vocab: int) -> tuple[object, int]:
    """A byte-level BPE tokenizer (GPT-2's alphabet, as Qwen's) trained on the standard
    library's sources; returns it (as transformers' fast tokenizer) and its EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train([str(f) for f in files], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    return tokenizer, tokenizer.eos_token_id


def walk(grammars: GrammarSet, rows: int, steps: int, vocab: int) -> tuple[float, float]:
    """CPU seconds per row-step of (masks applied, tokens accepted) over ``steps`` steps."""
    text = json.dumps(SCHEMA)
    constraints = [grammars.start("json_schema", text) for _ in range(rows)]
    gen = torch.Generator().manual_seed(rows)
    masking = accepting = 0.0
    live = list(range(rows))
    done = 0  # row-steps taken (a row whose grammar is complete stops)
    for _ in range(steps):
        if not live:
            break
        done += len(live)
        logits = torch.randn(len(live), vocab, generator=gen)
        start = time.process_time()
        grammars.constrain(logits, list(range(len(live))), [constraints[i] for i in live])
        masking += time.process_time() - start
        tokens = logits.argmax(dim=1).tolist()
        start = time.process_time()
        for i, token in zip(live, tokens, strict=True):
            assert constraints[i].accept(token) is None
        accepting += time.process_time() - start
        live = [i for i in live if not constraints[i].matcher.is_stopped()]
    return masking / done, accepting / done


def _schema(i: int) -> str:
    renamed = {f"{key}_{i}": value for key, value in SCHEMA["properties"].items()}
    required = [f"{key}_{i}" for key in SCHEMA["required"]]
    return json.dumps({**SCHEMA, "properties": renamed, "required": required})


def new_schemas(grammars: GrammarSet, count: int, offset: int, worker: bool) -> dict[str, float]:
    """Compile ``count`` unseen schemas on the loop (``worker`` False) or on the grammar worker,
    under a 1 ms timer: the median compile and the timer's longest stall, in ms."""

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        stall = 0.0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal stall
            while not done.is_set():
                due = loop.time() + 0.001
                await asyncio.sleep(0.001)
                stall = max(stall, loop.time() - due)

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        times = []
        for i in range(offset, offset + count):
            start = time.perf_counter()
            if worker:
                ready = loop.create_future()
                grammars.compile_later(
                    [("json_schema", _schema(i))],
                    lambda failed, ready=ready: loop.call_soon_threadsafe(ready.set_result, failed),
                )
                assert await ready is None
            else:
                grammars.start("json_schema", _schema(i))
                await asyncio.sleep(0)
            times.append(time.perf_counter() - start)
        done.set()
        await tick
        return {
            "compile_ms": round(statistics.median(times) * 1e3, 2),
            "loop_stall_ms": round(stall * 1e3, 2),
        }

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=8, help="unseen schemas compiled")
    args = parser.parse_args()
    tokenizer, eos = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    grammars = GrammarSet(tokenizer, vocab, [eos])
    start = time.perf_counter()
    grammars.start("json_schema", json.dumps(SCHEMA))
    first = time.perf_counter() - start  # the tokenizer's llguidance view and the schema
    start = time.perf_counter()
    grammars.start("json_schema", json.dumps(SCHEMA))
    cached = time.perf_counter() - start
    fresh = {"inline": [], "worker": []}
    for r in range(3):  # each way in turn, fresh schemas each time
        for way in ("inline", "worker"):
            offset = (2 * r + (way == "worker")) * args.new
            fresh[way].append(new_schemas(grammars, args.new, offset, way == "worker"))
    per_rows = {}
    for rows in (int(r) for r in args.rows.split(",")):
        runs = [walk(grammars, rows, args.steps, vocab) for _ in range(args.repeats)]
        masks = [m * 1e6 for m, _ in runs]
        accepts = [a * 1e6 for _, a in runs]
        per_rows[str(rows)] = {
            "mask_us_per_row": round(statistics.median(masks), 1),
            "mask_us_min_max": [round(min(masks), 1), round(max(masks), 1)],
            "accept_us_per_row": round(statistics.median(accepts), 1),
        }
    print(
        json.dumps(
            {
                "bench": "grammar",
                "vocab": vocab,
                "threads": torch.get_num_threads(),
                "first_start_ms": round(first * 1e3, 1),
                "cached_start_us": round(cached * 1e6, 1),
                "steps": args.steps,
                "repeats": args.repeats,
                "per_rows": per_rows,
                "new_schemas": {
                    way: {
                        key: {
                            "median": statistics.median(r[key] for r in runs),
                            "min_max": [min(r[key] for r in runs), max(r[key] for r in runs)],
                        }
                        for key in ("compile_ms", "loop_stall_ms")
                    }
                    for way, runs in fresh.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
