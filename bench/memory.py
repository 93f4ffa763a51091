"""Learner peak memory at 8x the batch size over 1x, at fixed micro-batch sizes (goal <= 1.1).

Each measurement is a fresh process that sets up the real learner (``Trainer``: DeepSpeed on
gloo, one rank) and runs one optimizer step with every pass the learner has: the reference
model's no-grad pass (``kl_coef > 0``), the learner's own no-grad pass before a reused batch
(``epochs: 2`` with PPO-clip) and the backward passes. Peak memory is the process's peak RSS
during the step minus its RSS before it (glibc returns big buffers to the OS at once, so RSS
follows live tensors). A third run does the same 8x batch with micro-batches as large as the
batch, the way a learner that "just runs the batch" would, to show what the two sizes prevent.

    python bench/memory.py [--batch 16] [--factor 8] [--vocab 8192] [--completion 96]

Prints one JSON line.
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

_PROBE = r"""
import json, os, resource, sys
import numpy as np, structlog, torch
torch.set_num_threads(1)
sys.path.insert(0, os.environ["INFLIGHT_ROOT"])
from stages.learner.config import DeepSpeedSection, LearnerConfig, OptimConfig
from stages.learner.loss import LossConfig
from stages.learner.trainer import Trainer, TrainSample

args = json.loads(sys.argv[1])
config = LearnerConfig(
    model=args["model"], batch_size=args["batch"], train_micro_batch=args["train_mb"],
    forward_micro_batch=args["forward_mb"], epochs=2,
    loss=LossConfig(ppo_clip=0.2, kl_coef=0.01), optim=OptimConfig(lr=1e-5),
    deepspeed=DeepSpeedSection(zero_stage=0),
)
trainer = Trainer(config, structlog.get_logger())
trainer.setup()
rng = np.random.default_rng(0)
def samples(n):
    return [TrainSample(rng.integers(3, args["vocab"], 32), rng.integers(3, args["vocab"],
            args["completion"]), np.full(args["completion"], -1.0, np.float32),
            np.zeros(args["completion"], np.int64), float(rng.normal()), 1.0) for _ in range(n)]
trainer.step(samples(min(2, args["batch"])), 0)  # lazy allocations (optimizer state) first
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
def high_water():  # VmHWM: this process image's peak RSS (ru_maxrss carries over exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
batch = samples(args["batch"])
trainer.step(batch, 0)
print(json.dumps({"peak_over_start_mb": (high_water() - before) / 2**20}))
trainer.close()
"""


def _measure(model: str, *, batch: int, train_mb: int, forward_mb: int, args) -> float:
    env = {
        **os.environ,
        "INFLIGHT_ROOT": str(ROOT),
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
    }
    spec = {
        "model": model,
        "batch": batch,
        "train_mb": train_mb,
        "forward_mb": forward_mb,
        "vocab": args.vocab,
        "completion": args.completion,
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_over_start_mb"]


def _model(path: Path, vocab: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--factor", type=int, default=8)
    parser.add_argument("--train-mb", type=int, default=4)
    parser.add_argument("--forward-mb", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--completion", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "model", args.vocab)
        one = _measure(
            model, batch=args.batch, train_mb=args.train_mb, forward_mb=args.forward_mb, args=args
        )
        big = args.batch * args.factor
        many = _measure(
            model, batch=big, train_mb=args.train_mb, forward_mb=args.forward_mb, args=args
        )
        whole = _measure(model, batch=big, train_mb=big, forward_mb=big, args=args)
    print(
        json.dumps(
            {
                "bench": "memory",
                "batch": args.batch,
                "factor": args.factor,
                "train_micro_batch": args.train_mb,
                "forward_micro_batch": args.forward_mb,
                "peak_mb_1x": round(one, 1),
                "peak_mb_8x": round(many, 1),
                "ratio": round(many / one, 3),
                "goal": 1.1,
                "peak_mb_8x_whole_batch_passes": round(whole, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
