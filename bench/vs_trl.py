"""Inflight against TRL's GRPOTrainer on the same task, side by side, as a user would run each.

The simplest alternative to Inflight on one machine is TRL's one-process ``GRPOTrainer``: generate
a batch with ``transformers.generate``, score it, take one optimizer step, repeat. This bench
runs both on one shipped config and reports the wall time each takes to reach held-out accuracy
targets. TRL is an optional extra (``pip install -e '.[trl]'``); CI never installs it.

What TRL is given, read from the config (so that only the system differs):

- the same model folder and tokenizer, the train prompts in the feeder's order (its split,
  shuffled per epoch with the feeder's seed; TRL's own shuffling off), the same reward function
  (``stages.scorer.rewards``, called as TRL calls reward functions);
- ``batch_size`` samples a step in groups of ``group_size`` (one generation batch per step, one
  optimizer step per batch, no gradient accumulation), ``temperature``, ``max_new_tokens``;
- the loss as Inflight's defaults make it: advantage ``r - mean(r)`` over the group
  (``scale_rewards="none"``), no KL (``beta=0``), one pass over each batch (so no clipping), the
  sum over a sample's tokens normalised by a constant (``loss_type="dr_grpo"``: Inflight divides
  by the number of sequences, TRL's by sequences x ``max_new_tokens``; Adam makes the constant
  moot but for gradient clipping);
- AdamW with the learner's ``lr``, betas, ``eps``, ``weight_decay``, ``grad_clip``, warm-up and
  its cosine schedule down to ``min_lr_ratio``; ``steps`` optimizer steps; float32 on CPU with
  ``--trl-threads`` torch threads (2: the whole machine; Inflight's stages share it);
- the learner's evaluation: the same held-out prompts (``eval.max_prompts`` spread over the eval
  split), greedy, ``eval.max_new_tokens``, every ``--eval-every`` steps and at step 0, counted
  correct as ``exact_match`` counts. Evaluation time is taken out of TRL's training time (it
  stops the loop there; in Inflight the engine evaluates beside training).

What cannot be matched: TRL has no asynchronous mode without vLLM (its generation and training
alternate in one process), and it samples with ``generate`` (padding each batch to its longest
sample) where Inflight's engine batches continuously; Inflight corrects the sampler/learner
mismatch with truncated importance sampling, which TRL does not need on-policy.

Runs alternate (Inflight seed 0, TRL seed 0, Inflight seed 1, ...) so that a drift of the machine
hits both. Per system it reports, for each target, the median and spread over runs of the time
to the target from training start and from launch (the end of the first ``--window``
consecutive evaluations whose mean reaches it), the samples per second while training, the
accuracy at the end, the launch-to-end wall time (the process's, for TRL), the CPU seconds of the
whole run (every process, as the kernel counts a finished process tree: user + system, imports,
evaluation and start-up included) and those per 256 trained samples; and the ratio
Inflight / TRL of the median times. It writes ``vs_trl.json`` (the one JSON line it prints),
``vs_trl.png`` (held-out accuracy against seconds from training start, every run) and each
run's output under ``--out``.

    python bench/vs_trl.py [--config configs/default.yaml] [--runs 3] [--targets 0.78 0.8]
        [--eval-every 10] [--window 3] [--steps N] [--out DIR] [KEY=VALUE ...]

``KEY=VALUE`` overrides go to the Inflight runs (and are read for TRL where they name a setting
above). Not here: GPU runs, TRL with vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)


# ------------------------------------------------------------------------- the TRL side
def _settings(config_path: Path, overrides: list[str]) -> dict[str, Any]:
    """What TRL must match, from the validated pipeline config (overrides applied)."""
    from pipeline.config import load_pipeline
    from pipeline.registry import resolve

    loaded = load_pipeline(config_path, overrides, resolve=lambda use: resolve("stage", use))
    stages = loaded.config.stages
    gen = next(s.options for s in stages.values() if s.use == "generator")
    learner = next(s.options for s in stages.values() if s.use == "learner")
    feeder = next(s.options for s in stages.values() if s.use == "feeder")
    scorer = next(s.options for s in stages.values() if s.use == "scorer")
    return {
        "model": str(gen.launch.model),
        "source": feeder.source,
        "feeder_seed": feeder.seed,
        "group_size": gen.group_size,
        "temperature": gen.sampling.temperature,
        "max_new_tokens": gen.sampling.max_new_tokens,
        "batch_size": learner.batch_size,
        "steps": learner.steps,
        "optim": learner.optim,
        "rewards": [r.fn for r in scorer.rewards],
        "eval_source": learner.eval.source or feeder.source,
        "eval_prompts": learner.eval.max_prompts,
        "eval_new_tokens": learner.eval.max_new_tokens,
    }


def trl_worker(config: Path, overrides: list[str], seed: int, eval_every: int, out: Path) -> None:
    """One TRL run, in its own process; writes its evaluations and timings to ``out``."""
    launched = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.registry import resolve
    from stages.feeder.sources import load_prompts
    from stages.feeder.stage import feed_order
    from stages.learner.evaluate import spread

    s = _settings(config, overrides)
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    tokenizer.padding_side = "left"
    train = load_prompts(s["source"], "train", tokenizer=tokenizer).prompts
    per_step = s["batch_size"] // s["group_size"]
    rows: list[dict[str, Any]] = []
    for epoch in range(math.ceil(s["steps"] * per_step / len(train)) + 1):
        for i in feed_order(len(train), epoch, seed=s["feeder_seed"], shuffle=True):
            p = train[i]
            rows.append({"prompt": tokenizer.decode(p["input_ids"]), **p["meta"]})
    dataset = Dataset.from_list(rows[: s["steps"] * per_step])
    eval_split = load_prompts(s["eval_source"], "eval", tokenizer=tokenizer).prompts
    held_out = spread(eval_split, s["eval_prompts"])

    rewards = [resolve("reward", name) for name in s["rewards"]]
    optim = s["optim"]
    args = GRPOConfig(
        output_dir=str(out.parent / f"{out.stem}-trl"),
        seed=seed,
        use_cpu=True,
        per_device_train_batch_size=s["batch_size"],
        num_generations=s["group_size"],
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_k=0,
        top_p=1.0,
        beta=0.0,
        scale_rewards="none",
        loss_type="dr_grpo",
        learning_rate=optim.lr,
        warmup_steps=optim.warmup_steps,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.beta1,
        adam_beta2=optim.beta2,
        adam_epsilon=optim.eps,
        max_grad_norm=optim.grad_clip,
        lr_scheduler_type="cosine_with_min_lr" if optim.schedule == "cosine" else "constant",
        lr_scheduler_kwargs={"min_lr_rate": optim.min_lr_ratio}
        if optim.schedule == "cosine"
        else None,
        max_steps=s["steps"],
        shuffle_dataset=False,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        # TRL 1.16 turns both on by default (GRPOConfig(use_cpu=True).bf16 is True): bf16
        # autocast, whose matmuls run 7x slower on a CPU without bf16 instructions (py-spy:
        # bf16_dot_with_fp32_arith), and activations recomputed in the backward pass. Inflight's
        # learner trains in float32 and recomputes nothing.
        bf16=False,
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    evals: list[dict[str, Any]] = []
    clock = {"eval_s": 0.0, "start": 0.0}

    def evaluate(step: int) -> None:
        began = time.monotonic()
        model.eval()
        enc = tokenizer(
            [tokenizer.decode(p["input_ids"]) for p in held_out],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.no_grad():
            out_ids = model.generate(
                **enc,
                max_new_tokens=s["eval_new_tokens"],
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out_ids[:, enc["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        answers = [p["meta"].get("answer") for p in held_out]
        scores = rewards[0](completions=texts, answer=answers)
        model.train()
        ended = time.monotonic()
        train_s = began - clock["start"] - clock["eval_s"]
        clock["eval_s"] += ended - began
        evals.append(
            {
                "step": step,
                "accuracy": sum(scores) / len(scores),
                "train_s": round(train_s, 2),
                "from_launch_s": round(began - launched, 2),
            }
        )

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["start"] = time.monotonic()
            evaluate(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % eval_every == 0 or state.global_step == s["steps"]:
                evaluate(state.global_step)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Evaluate()],
    )
    trainer.train()
    train_s = time.monotonic() - clock["start"] - clock["eval_s"]
    out.write_text(
        json.dumps(
            {
                "evals": evals,
                "train_s": round(train_s, 2),
                "wall_s": round(time.monotonic() - launched, 2),
                "samples": s["steps"] * s["batch_size"],
            }
        )
    )


# ----------------------------------------------------------------------------- the bench
def _timed(cmd: list[str], log: Path, **kwargs: Any) -> tuple[int, float]:
    """Run ``cmd`` (output to ``log``); its exit code and the CPU seconds of its process tree
    (what its processes and every descendant they waited for used)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return done.returncode, round(cpu, 1)


def _reached(evals: list[dict[str, Any]], target: float, window: int) -> dict[str, Any] | None:
    for i in range(window - 1, len(evals)):
        if sum(e["accuracy"] for e in evals[i - window + 1 : i + 1]) / window >= target:
            return evals[i]
    return None


def _spread(values: list[float | None], digits: int = 1) -> dict[str, float | None]:
    finite = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    median = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        median = None if a is None or b is None else (a + b) / 2
    return {
        "median": None if median is None else round(median, digits),
        "min": round(min(finite), digits) if finite else None,
        "max": round(max(finite), digits) if len(finite) == len(values) else None,
    }


def run_inflight(config: str, seed: int, eval_every: int, overrides: list[str], out: Path) -> dict:
    from bench.async_vs_sync import _events, _ts

    run_dir = out / f"inflight-seed{seed}"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, f"run.seed={seed}"]
    cmd += [f"stages.learner.eval.every={eval_every}", *overrides, "--run-dir", str(run_dir), "-q"]
    code, cpu_s = _timed(cmd, run_dir.with_suffix(".out"))
    if code != 0:
        raise SystemExit(f"inflight run failed ({code}): {run_dir}")
    started = [e for e in _events(run_dir, "supervisor") if e.get("event") == "run_started"]
    learner = _events(run_dir, "learner.0")
    evals = [e for e in learner if e.get("event") == "eval"]
    launched, start = _ts(started[0]), _ts(evals[0])
    steps = [e for e in learner if e.get("event") == "train_step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "evals": [
            {
                "step": e["step"],
                "accuracy": e["accuracy"],
                "train_s": round(_ts(e) - start, 2),
                "from_launch_s": round(_ts(e) - launched, 2),
            }
            for e in evals
        ],
        "train_s": round(_ts(steps[-1]) - start, 2),
        "wall_s": summary.get("wall_s"),
        "cpu_s": cpu_s,
        "samples": sum(e.get("samples", 0) for e in steps),
    }


def run_trl(config: str, seed: int, eval_every: int, overrides: list[str], out: Path) -> dict:
    result = out / f"trl-seed{seed}.json"
    cmd = [sys.executable, str(Path(__file__)), "--trl-worker", "--config", config]
    cmd += ["--seed", str(seed), "--eval-every", str(eval_every), "--result", str(result)]
    cmd += overrides
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    began = time.monotonic()
    code, cpu_s = _timed(cmd, out / f"trl-seed{seed}.out", env=env)
    if code != 0:
        raise SystemExit(f"TRL run failed ({code}): see {out}/trl-seed{seed}.out")
    data = json.loads(result.read_text())
    data["wall_s"] = round(time.monotonic() - began, 2)  # the process, imports included
    data["cpu_s"] = cpu_s
    return data


def summarize(runs: list[dict], targets: list[float], window: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in targets:
        hits = [_reached(r["evals"], target, window) for r in runs]
        out[f"to_{target}"] = {
            "train_s": _spread([h["train_s"] if h else None for h in hits]),
            "from_launch_s": _spread([h["from_launch_s"] if h else None for h in hits]),
        }
    out["samples_per_s"] = _spread([r["samples"] / r["train_s"] for r in runs])
    out["end_accuracy"] = [round(r["evals"][-1]["accuracy"], 3) for r in runs]
    out["wall_s"] = _spread([r["wall_s"] for r in runs])
    out["cpu_s"] = _spread([r["cpu_s"] for r in runs])
    out["cpu_s_per_256"] = _spread([r["cpu_s"] / r["samples"] * 256 for r in runs], digits=3)
    return out


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        for i, run in enumerate(runs):
            xs = [e["train_s"] for e in run["evals"]]
            ys = [e["accuracy"] for e in run["evals"]]
            ax.plot(xs, ys, color=color, alpha=0.8, label=name if i == 0 else None)
    ax.set_xlabel("seconds from training start")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.78, 0.8])
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.config), args.overrides, args.seed, args.eval_every, args.result)
        return
    out = args.out or ROOT / "runs" / f"vs_trl-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"inflight": [], "trl": []}
    for seed in range(args.runs):
        for name, run in (("inflight", run_inflight), ("trl", run_trl)):
            results[name].append(run(args.config, seed, args.eval_every, args.overrides, out))
            last = results[name][-1]
            print(f"{name} seed {seed}: {last['evals'][-1]} wall {last['wall_s']}", file=sys.stderr)
    report: dict[str, Any] = {
        "bench": "vs_trl",
        "config": args.config,
        "runs": args.runs,
        "window": args.window,
        "overrides": args.overrides,
        **{name: summarize(runs, args.targets, args.window) for name, runs in results.items()},
    }
    for target in args.targets:
        a = report["inflight"][f"to_{target}"]["train_s"]["median"]
        b = report["trl"][f"to_{target}"]["train_s"]["median"]
        report[f"ratio_to_{target}"] = None if a is None or b is None else round(a / b, 3)
    (out / "runs.json").write_text(json.dumps(results))
    plot(results, out / "vs_trl.png")
    line = json.dumps(report)
    (out / "vs_trl.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
