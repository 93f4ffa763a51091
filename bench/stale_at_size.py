"""Stale drops at a model size users train: a random model of Qwen2.5-0.5B's shape on the default
task with a small learner batch.

At this size a learner step takes tens of seconds on CPU while the engine keeps generating, so
whatever the generator keeps ahead of the learner (in flight, and queued in every inbox on the
way) is what goes stale: issue 24 measured 83% of the generated samples dropped as older than
``max_lag`` with ``batch_size=32`` before the generator bounded its lead by the learner's pace
(``stages.generator.controller``, the queue gate).

The script makes (once, into ``--model-dir``) a randomly initialised ``Qwen2ForCausalLM`` with
Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 key-value heads, MLP 4864, vocabulary
151,936, tied embeddings: 494M parameters) and the default task's tokenizer (nothing downloaded),
then runs ``inflight run configs/default.yaml`` on it with ``stages.learner.batch_size=32`` (and
``sync_batch``, micro-batches 8 / 16, no evaluation, no checkpoint) for ``--steps`` steps, plus
any ``KEY=VALUE`` overrides, and reads the run's ledger and learner log.

    python bench/stale_at_size.py [--steps 4] [--model-dir runs/qwen05-shape] [KEY=VALUE ...]

Prints one JSON line: samples generated (every sample that reached the learner; and all the
generator sent, with those still on the way at the end), trained, skipped without signal,
dropped stale and the stale share of what was generated, the learner's
median step time and the wall time. The goal (issue 24): stale drops at most 2% of generated.

Not here: accuracy (a random model learns nothing in a few steps), GPU figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "configs" / "models" / "arith-tiny"
SHAPE = {  # Qwen2.5-0.5B's config.json, less what a random model needs no say in
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
}


def make_model(out: Path) -> None:
    """The random 0.5B-shaped model with the arithmetic tokenizer (skipped if already there)."""
    if (out / "model.safetensors").is_file():
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = json.loads((TOKENIZER / "config.json").read_text())
    config = Qwen2Config(
        **SHAPE,
        bos_token_id=tokenizer.get("bos_token_id"),
        eos_token_id=tokenizer["eos_token_id"],
        pad_token_id=tokenizer.get("pad_token_id"),
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"made {out} ({params / 1e6:.0f}M parameters)", file=sys.stderr)


def overrides(model: Path, steps: int) -> list[str]:
    m = str(model)
    return [
        f"stages.feeder.source.tokenizer={m}",
        f"stages.generator.launch.model={m}",
        f"stages.scorer.tokenizer={m}",
        f"stages.learner.model={m}",
        f"stages.learner.steps={steps}",
        "stages.learner.batch_size=32",
        "stages.generator.sync_batch=32",
        "stages.learner.train_micro_batch=8",
        "stages.learner.forward_micro_batch=16",
        "stages.learner.eval.source=null",
        "stages.learner.checkpoint.every=0",
        "stages.learner.checkpoint.at_end=false",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "qwen05-shape")
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("more", nargs="*", help="KEY=VALUE overrides, after the bench's own")
    args = parser.parse_args()
    make_model(args.model_dir)
    run_dir = args.run_dir or ROOT / "runs" / f"stale_at_size-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "configs/default.yaml"]
    cmd += [*overrides(args.model_dir, args.steps), *args.more, "--run-dir", str(run_dir), "-q"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"inflight run exited {done.returncode}; see {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = summary["ledger"]["samples"]
    steps = []
    for line in (run_dir / "logs" / "learner.0.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "train_step":
            steps.append(event)
    emitted = 0
    for line in (run_dir / "logs" / "generator.0.jsonl").read_text().splitlines():
        event = json.loads(line)
        if "emitted" in event:  # its metrics, and generator_done when it ran out of prompts
            emitted = event["emitted"]
    trained, no_signal = samples.get("trained", 0), samples.get("no_signal", 0)
    dropped = samples.get("dropped", {})
    stale = dropped.get("stale", 0)
    generated = trained + no_signal + sum(dropped.values())
    result = {
        "bench": "stale_at_size",
        "params_m": 494,
        "steps": len(steps),
        "batch_size": 32,
        "overrides": args.more,
        "generated": generated,
        "emitted_by_generator": emitted,  # with those still on the way when the run ended
        "trained": trained,
        "no_signal": no_signal,
        "stale": stale,
        "dropped": dropped,
        "stale_share": round(stale / generated, 4) if generated else None,
        "step_s_median": round(statistics.median(e["step_s"] for e in steps), 1) if steps else None,
        "wall_s": round(wall, 1),
        "run_dir": str(run_dir),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
