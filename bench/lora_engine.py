"""The built-in engine with a LoRA adapter merged into its weights against applied per request.

Run: ``python bench/lora_engine.py [--model arith|mid|DIR] [--rank 8] [--rows 64 256] [--runs 5]``
(``mid``: arith-tiny's tokenizer on ``bench/engine_profile.py``'s 10M-parameter model, made in a
temporary folder). Prints one JSON line on stdout.

One ``Scheduler`` (no server, no HTTP: the model work and the scheduler's bookkeeping only) on
this process's torch threads generates ``--rows`` greedy samples of ``--new`` tokens from the
model's own prompts, three ways, alternated per run: ``base`` (the model as shipped), ``merged``
(a random ``peft`` LoRA of rank ``--rank`` on every linear layer but the head, merged into the
weights: what an in-flight LoRA update over the weight group does, ``stages.engine.model_weights``)
and ``unmerged`` (the same adapter loaded with ``load_adapter`` and named by every request:
``stages.engine.lora_adapters``, the path SGLang's ``lora_path`` takes), plus ``mixed`` (half the
rows on the adapter, half on the base model: two adapters' users in one batch). Reports the
median (min-max) CPU seconds per 1,000 sampled tokens of each, and each against ``base``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402


def _adapter(model_dir: Path, folder: Path, rank: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    peft = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    peft.save_pretrained(folder)
    return peft.merge_and_unload().eval()


def _cpu_per_1k(model, rows: int, new: int, lora, prompts) -> float:
    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler

    sched = Scheduler(model, max_running=rows, prefix_cache_tokens=0)
    if lora is not None:
        sched.load_adapter("a", str(lora[0]))
        sched.run_until_idle()
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    inputs = [
        GenerateInput(
            f"r{i}",
            prompts[i % len(prompts)],
            params,
            True,
            lora="a" if lora is not None and i < rows * lora[1] else None,
        )
        for i in range(rows)
    ]
    start = time.process_time()
    future = sched.submit_many(inputs)
    sched.run_until_idle()
    seconds = time.process_time() - start
    tokens = sum(len(r.output_ids) for r in future.result(timeout=1))
    return 1000 * seconds / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="arith")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from stages.engine.loader import load_model

    scratch = tempfile.TemporaryDirectory()
    if args.model == "arith":
        args.model = str(ROOT / "configs" / "models" / "arith-tiny")
    elif args.model == "mid":
        from bench.engine_profile import _mid_model

        args.model = str(_mid_model(Path(scratch.name) / "mid"))
    loaded = load_model(args.model, device="cpu")
    tok = loaded.tokenizer
    prompts = [tok.encode(f"{a}+{b}=") for a in range(3, 9) for b in range(11, 17)]
    results: dict = {"model": args.model, "rank": args.rank, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "adapter"
        merged = _adapter(Path(args.model), folder, args.rank)
        base = loaded.model
        ways = {
            "base": (base, None),
            "merged": (merged, None),
            "unmerged": (base, (folder, 1.0)),
            "mixed": (base, (folder, 0.5)),
        }
        for rows in args.rows:
            samples: dict[str, list[float]] = {k: [] for k in ways}
            _cpu_per_1k(base, rows, args.new, None, prompts)  # warm-up
            for _ in range(args.runs):
                for name, (model, lora) in ways.items():
                    samples[name].append(_cpu_per_1k(model, rows, args.new, lora, prompts))
            med = {k: statistics.median(v) for k, v in samples.items()}
            results[f"rows_{rows}"] = {
                k: {
                    "cpu_s_per_1k_tokens": round(med[k], 4),
                    "range": [round(min(v), 4), round(max(v), 4)],
                    "vs_base": round(med[k] / med["base"], 3),
                }
                for k, v in samples.items()
            }
    scratch.cleanup()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
