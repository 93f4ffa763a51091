"""A reward model's scores through the built-in engine (``rewards: [{reward_model: ...}]``)
against what a user would write instead: a reward function that runs the same model with
transformers in its own process.

Run: ``python bench/reward_model.py [--samples 256] [--batch 32] [--rounds 5] [--threads 1]
[--cross-encoder]``

Makes a random ``Qwen2ForSequenceClassification`` (one label; hidden 384, 6 layers, 6 heads,
2 KV heads, a 16,384-word vocabulary: about 15M parameters) with the tests' word tokenizer and a
chat template, and ``--samples`` samples (prompts of 24-64 words, completions of 8-128, seeded).
Both sides score them in scoring calls of ``--batch`` samples, one call after another, with
``--threads`` torch threads:

- ``engine_chat``: ``RewardRunner`` with ``reward_model: {url, input: chat}`` against ``inflight
  engine --model RM`` (a real server process): a ``/v1/tokenize`` call a sample renders the
  conversation with the model's template, then one ``/classify`` call a batch;
- ``engine_text``: the same with ``input: text`` (``{prompt} {completion}`` as text): one call;
- ``hf_chat``: in this process, the template applied to each conversation, the batch tokenized
  with right padding and run as one ``model(**batch)`` (transformers' own last-token pooling);
- ``hf_text``: the same on the plain texts.

``--cross-encoder``: a random ``BertForSequenceClassification`` instead (one label; hidden 384,
6 layers, 6 heads, a 16,384-word WordPiece vocabulary: a reranker's shape, such as
bge-reranker-base's smaller sibling) scoring each ``[prompt, completion]`` pair:

- ``engine_pair``: ``reward_model: {url, input: pair}`` (``/classify`` with SGLang's
  ``is_cross_encoder_request`` pairs, one call a batch);
- ``hf_pair``: in this process, the batch's pairs tokenized as a text pair with right padding
  and run as one ``model(**batch)``: what ``sentence_transformers.CrossEncoder.predict`` does.

Each round runs the sides in turn (order reversed every other round); reported: samples/s per
side, the CPU seconds per 1,000 samples (this process's, plus the engine process's from
``/proc`` for the engine sides), each as the median and min-max over the rounds, and the
largest difference between the engine's rewards and transformers' (same ids). Prints exactly one
JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from bench._engines import engine_server  # noqa: E402
from stages.scorer.runner import RewardRunner  # noqa: E402
from stages.scorer.spec import RewardModelSpec, RewardSpec  # noqa: E402
from tests.stages.tiny_encoders import make_bert  # noqa: E402
from tests.stages.tiny_model import make_tiny_classifier  # noqa: E402

VOCAB = 16384


def _samples(n: int, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(k))

    prompts = [words(rng.randint(24, 64)) for _ in range(n)]
    completions = [words(rng.randint(8, 128)) for _ in range(n)]
    return {"prompts": prompts, "completions": completions}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _chat_text(tokenizer, prompt: str, completion: str) -> str:
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return tokenizer.apply_chat_template(turns, tokenize=False)


@torch.inference_mode()
def _hf_scores(model, tokenizer, texts: list, batch: int) -> list[float]:
    """Each text's (or ``[query, document]`` pair's) first output, ``batch`` at a time."""
    out: list[float] = []
    for lo in range(0, len(texts), batch):
        part = texts[lo : lo + batch]
        if isinstance(part[0], list):  # pairs: the tokenizer's text-pair encoding
            queries, documents = zip(*part, strict=True)
            enc = tokenizer(list(queries), list(documents), padding=True, return_tensors="pt")
        else:
            enc = tokenizer(part, padding=True, return_tensors="pt")
        out += model(**enc).logits[:, 0].tolist()
    return out


async def _engine_scores(url: str, samples: dict[str, list], batch: int, how: str) -> list:
    """``how``: ``chat``, ``text`` or ``pair`` (the reward model's ``input``)."""
    template = "{prompt}{completion}" if how != "text" else "{prompt} {completion}"
    spec = RewardModelSpec(url=url, input=how, template=template)
    reward = RewardSpec(reward_model=spec, name="rm", concurrency=8)
    out: list[float] = []
    async with RewardRunner([reward]) as runner:
        n = len(samples["prompts"])
        for lo in range(0, n, batch):
            part = {k: v[lo : lo + batch] for k, v in samples.items()}
            out += [info["rm"] for _, info in await runner.score(part)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cross-encoder", action="store_true", help="a BERT cross-encoder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = _samples(args.samples)
    kinds = ("pair",) if args.cross_encoder else ("chat", "text")
    with tempfile.TemporaryDirectory() as tmp:
        if args.cross_encoder:
            path = make_bert(
                Path(tmp) / "ce", "BertForSequenceClassification", words=VOCAB - 5,
                hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                intermediate_size=1024, max_position_embeddings=512,
            )  # fmt: skip
            tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            path = make_tiny_classifier(
                Path(tmp) / "rm", seed=0, vocab=VOCAB, hidden=384, layers=6, heads=6,
                kv_heads=2, intermediate=1024, max_positions=1024,
            )  # fmt: skip
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        params = sum(p.numel() for p in model.parameters())
        pairs = list(zip(samples["prompts"], samples["completions"], strict=True))
        inputs = {
            "chat": lambda: [_chat_text(tokenizer, p, c) for p, c in pairs],
            "text": lambda: [f"{p} {c}" for p, c in pairs],
            "pair": lambda: [[p, c] for p, c in pairs],
        }
        env = {"OMP_NUM_THREADS": str(args.threads)}
        with engine_server(path, "--max-running", str(args.batch), env=env) as (url, proc):
            sides = {}
            for kind in kinds:
                sides[f"engine_{kind}"] = functools.partial(
                    lambda k: asyncio.run(_engine_scores(url, samples, args.batch, k)), kind
                )
                sides[f"hf_{kind}"] = functools.partial(
                    lambda k: _hf_scores(model, tokenizer, inputs[k](), args.batch), kind
                )
            rates: dict[str, list[float]] = {k: [] for k in sides}
            cpu: dict[str, list[float]] = {k: [] for k in sides}
            scores: dict[str, list[float]] = {}
            for r in range(args.rounds):
                for name in sides if r % 2 == 0 else reversed(list(sides)):
                    engine_cpu = _cpu_s(proc.pid)
                    own = time.process_time()
                    start = time.perf_counter()
                    scores[name] = sides[name]()
                    wall = time.perf_counter() - start
                    used = time.process_time() - own
                    if name.startswith("engine"):
                        used += _cpu_s(proc.pid) - engine_cpu
                    rates[name].append(args.samples / wall)
                    cpu[name].append(1000 * used / args.samples)
                    print(f"round {r} {name}: {args.samples / wall:.1f}/s", file=sys.stderr)
    differ = max(
        max(abs(a - b) for a, b in zip(scores[f"engine_{k}"], scores[f"hf_{k}"], strict=True))
        for k in kinds
    )

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                "max": round(max(values), 2)}  # fmt: skip

    print(
        json.dumps(
            {
                "model": "cross-encoder" if args.cross_encoder else "classifier",
                "parameters": params,
                "samples": args.samples,
                "batch": args.batch,
                "threads": args.threads,
                "samples_per_s": {k: summary(v) for k, v in rates.items()},
                "cpu_s_per_1k_samples": {k: summary(v) for k, v in cpu.items()},
                **{
                    f"engine_over_hf_{k}": round(
                        statistics.median(rates[f"engine_{k}"])
                        / statistics.median(rates[f"hf_{k}"]),
                        3,
                    )
                    for k in kinds
                },
                "max_abs_reward_difference": differ,
            }
        )
    )


if __name__ == "__main__":
    main()
