"""The learner's optimizer step against plain torch doing the same work (goal: <= 1.3x).

``Trainer.step`` is timed exactly as the learner stage calls it: DeepSpeed (ZeRO-0, fp32) on a
gloo process group of one rank, the default learner settings of ``configs/default.yaml``
(AdamW lr 3e-4, cosine schedule, grad clip 1.0, TIS cap 2, batch 256 = one micro-batch).
The baseline is a plain torch loop over the same micro-batches: ``collate``, the same forward
(``completion_logprobs``) and loss (``policy_loss``, same denominator), ``backward``,
``clip_grad_norm_``, ``AdamW.step`` and the scheduler, nothing else (no metrics, no
collectives). Both start from the same weights and train on the same batches in the same
order, steps interleaved, so drift in the machine hits both alike; the largest weight
difference between the two at the end is reported as a check that they did the same work.

Samples are realistic arithmetic rollouts: held-out-style ``a+b=`` / ``a-b=`` prompts (4 to 6
tokens) in groups of 4, completions of 2 to 5 tokens (the answer's digits, or a wrong answer,
then ``<eos>``), rewards drawn from {0, 1}, group-mean advantages, and sampler log-probs that
are the model's own plus noise (sd 0.05), as a bf16 sampler's would be.

Two sizes: the default model (``configs/models/arith-tiny``, 248K parameters, batch 256), where
fixed per-step overhead matters most, and a 19M-parameter model of the same shape family
(hidden 512, 6 layers; random weights, batch 64) where the model's own work dominates. Each
size runs with 1 and 2 torch threads, each configuration in a fresh process.

The learner runs each group's prompt once (``share_prompts``, its default) where the plain loop
runs every row whole; ``--whole-rows`` has the learner do the same. ``--context N`` puts N
random tokens before each group's prompt, the prompt lengths real tasks have.

    python bench/learner.py [--steps 24] [--warmup 3] [--threads 1,2] [--sizes default,20m]
        [--context N] [--whole-rows]

Prints one JSON line: per configuration the median, min-max and p10-p90 step time of both, and
their ratio (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "configs" / "models" / "arith-tiny"

SIZES = {
    "default": {"model": "default", "batch": 256, "micro": 256},
    "20m": {"model": "20m", "batch": 64, "micro": 64},
}

_PROBE = r"""
import copy, json, os, random, sys, time
import numpy as np, structlog, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
sys.path.insert(0, os.environ["INFLIGHT_ROOT"])
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
from functools import partial
from transformers import AutoModelForCausalLM, AutoTokenizer
from stages.feeder.arithmetic import ArithmeticConfig, problems
from stages.learner.advantages import group_advantages
from stages.learner.batching import collate, completion_logprobs, micro_batches, no_grad_logprobs
from stages.learner.batching import pad_right
from stages.learner.config import DeepSpeedSection, LearnerConfig, OptimConfig
from stages.learner.loss import LossConfig, policy_loss
from stages.learner.trainer import Trainer, TrainSample, lr_factor

config = LearnerConfig(
    model=args["model"], steps=550, batch_size=args["batch"], train_micro_batch=args["micro"],
    forward_micro_batch=args["micro"], share_prompts=args["share_prompts"],
    optim=OptimConfig(lr=3e-4, grad_clip=1.0, schedule="cosine", min_lr_ratio=0.1),
    loss=LossConfig(tis_cap=2.0), deepspeed=DeepSpeedSection(zero_stage=0),
)
trainer = Trainer(config, structlog.get_logger())
trainer.setup()

# plain torch: the same initial weights, optimizer and schedule
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
model.config.use_cache = False
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.0)
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, partial(lr_factor, optim=config.optim, horizon=config.steps))

tok = AutoTokenizer.from_pretrained(args["model"])
eos = tok.eos_token_id
rng = random.Random(0)
pool = list(problems(ArithmeticConfig(ops="+-", max_operand=99), "train"))

def batch_of_samples(n):
    groups = []
    for _ in range(n // 4):
        p = rng.choice(pool)
        prompt = np.asarray(tok(p.text)["input_ids"], dtype=np.int64)
        if args["context"]:  # a longer prompt, as real tasks have: random tokens before it
            head = [rng.randrange(3, model.config.vocab_size) for _ in range(args["context"])]
            prompt = np.concatenate([np.asarray(head, dtype=np.int64), prompt])
        comps = []
        for _ in range(4):
            answer = p.answer if rng.random() < 0.6 else str(rng.randrange(0, 199))
            ids = tok(answer)["input_ids"][:4] + [eos]
            comps.append(np.asarray(ids, dtype=np.int64))
        groups.append((prompt, comps))
    prompts = [g[0] for g in groups for _ in range(4)]
    comps = [c for g in groups for c in g[1]]
    with torch.no_grad():
        lps = no_grad_logprobs(model, prompts, comps, pad_id=trainer.pad_id, micro_batch=64)
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in comps])
    adv = group_advantages(rewards, torch.arange(len(comps)) // 4, baseline="mean",
                           std_normalize=False).tolist()
    out = []
    for i, (p, c, lp) in enumerate(zip(prompts, comps, lps)):
        noisy = (lp.numpy() + np.random.default_rng(i).normal(0, 0.05, len(lp))).astype(np.float32)
        out.append(TrainSample(p, c, np.minimum(noisy, 0.0), np.zeros(len(c), np.int64),
                               adv[i], float(rewards[i])))
    return out

batches = [batch_of_samples(args["batch"]) for _ in range(6)]

def plain_step(samples):
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    denominator = float(max(len(samples), 1))
    for idx in micro_batches(lengths, config.train_micro_batch):
        part = [samples[i] for i in idx]
        b = collate([s.prompt_ids for s in part], [s.completion_ids for s in part],
                    pad_id=trainer.pad_id)
        logp, _ = completion_logprobs(model, b)
        sampler = pad_right([torch.from_numpy(s.sampler_logprobs) for s in part],
                            width=logp.shape[1])
        adv = torch.tensor([s.advantage for s in part], dtype=logp.dtype)
        loss, _ = policy_loss(logp, sampler_logp=sampler, old_logp=logp.detach(),
                              advantages=adv, mask=b.completion_mask, config=config.loss,
                              denominator=denominator)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)

ds, plain = [], []
for step in range(args["warmup"] + args["steps"]):
    samples = batches[step % len(batches)]
    t = time.perf_counter()
    metrics = trainer.step(samples, policy_version=0)
    ds.append(time.perf_counter() - t)
    t = time.perf_counter()
    plain_step(samples)
    plain.append(time.perf_counter() - t)
ds, plain = ds[args["warmup"]:], plain[args["warmup"]:]
diff = max(
    float((p.detach() - q.detach()).abs().max())
    for p, q in zip(trainer.engine.module.parameters(), model.parameters())
)
tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batches[0])
print(json.dumps({"ds": ds, "plain": plain, "params": sum(p.numel() for p in model.parameters()),
                  "tokens_per_batch": tokens, "max_weight_diff": diff,
                  "last_grad_norm": metrics["grad_norm"]}))
trainer.close()
"""


def _make_20m(path: Path) -> None:
    """A 19M-parameter Qwen2-style model with the arithmetic tokenizer (random weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    base = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config = Qwen2Config(
        vocab_size=base["vocab_size"],
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        pad_token_id=base.get("pad_token_id"),
        eos_token_id=base.get("eos_token_id"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    n = len(xs)

    def q(f: float) -> float:
        return round(1000 * xs[min(n - 1, int(f * (n - 1) + 0.5))], 2)

    return {"median_ms": q(0.5), "min_ms": q(0.0), "max_ms": q(1.0), "p10_ms": q(0.1),
            "p90_ms": q(0.9)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--threads", default="1,2", help="torch thread counts to try")
    ap.add_argument("--sizes", default="default,20m", help=f"from {sorted(SIZES)}")
    ap.add_argument(
        "--context", type=int, default=0, help="random tokens before each group's prompt"
    )
    ap.add_argument(
        "--whole-rows",
        action="store_true",
        help="the learner runs every row whole (share_prompts off), as the plain loop does",
    )
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            spec = SIZES[size]
            model = DEFAULT_MODEL
            if spec["model"] == "20m":
                model = Path(tmp) / "model-20m"
                _make_20m(model)
            for threads in [int(t) for t in args.threads.split(",")]:
                probe = {
                    "model": str(model),
                    "batch": spec["batch"],
                    "micro": spec["micro"],
                    "threads": threads,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "context": args.context,
                    "share_prompts": not args.whole_rows,
                }
                env = {**os.environ, "INFLIGHT_ROOT": str(ROOT), "OMP_NUM_THREADS": str(threads)}
                done = subprocess.run(
                    [sys.executable, "-c", _PROBE, json.dumps(probe)],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=tmp,
                    timeout=1200,
                )
                if done.returncode != 0:
                    sys.exit(f"{size} x{threads} failed:\n{done.stderr[-3000:]}")
                out = json.loads(done.stdout.strip().splitlines()[-1])
                ds, plain = _stats(out["ds"]), _stats(out["plain"])
                results.append(
                    {
                        "size": size,
                        "params": out["params"],
                        "batch": spec["batch"],
                        "train_micro_batch": spec["micro"],
                        "tokens_per_batch": out["tokens_per_batch"],
                        "context": args.context,
                        "share_prompts": not args.whole_rows,
                        "threads": threads,
                        "steps": args.steps,
                        "deepspeed_step": ds,
                        "plain_torch_step": plain,
                        "ratio": round(ds["median_ms"] / plain["median_ms"], 3),
                        "max_weight_diff": out["max_weight_diff"],
                    }
                )
    print(json.dumps({"bench": "learner", "goal_ratio": 1.3, "results": results}))


if __name__ == "__main__":
    main()
