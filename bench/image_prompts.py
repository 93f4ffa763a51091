"""Image prompts on the built-in engine (``image_data``) against what a user would run instead:
transformers' own batched ``generate`` of the model with its processor, as a VLM trainer's
rollout does in process.

Run: ``python bench/image_prompts.py [--prompts 32] [--new 32] [--rounds 3] [--threads 2]
[--system 0]``

Makes a random ``Qwen2_5_VLForConditionalGeneration`` (text: hidden 256, 4 layers, 8 heads, 2 KV
heads; vision: 4 blocks of hidden 128; about 6M parameters) with the tests' byte tokenizer
(``tests/stages/tiny_vlm.py``), and ``--prompts`` chat prompts of a random sentence and one
random 224x224 JPEG each (64 image tokens after the 2x2 merge), after a system message of
``--system`` tokens that they all share (none by default). Each side answers all of them
greedily with ``--new`` tokens (no end of text):

- ``engine``: ``inflight engine --model M`` (a real server process), the prompts sent at once
  as ``/generate`` requests with their images as ``data:`` URIs, its prefix cache flushed
  first (each round the same prompts: cached, they would skip the vision tower and prefill);
- ``hf``: in this process, the processor's batch (left padded) through ``model.generate``.

Each round runs both (order reversed every other round). Reported: prompts/s per side and the
CPU seconds per prompt (this process's, plus the engine's from ``/proc``), each as the median
and min-max over the rounds; whether the engine's tokens equal transformers'; and what reading
an image costs on the engine's event loop and on its pixel workers (``images.Vision``: the
caller's share, then the worker's, for a 448x448 and a 1024x1024 JPEG under Qwen2-VL's default
processor bounds, 15 tries each). Prints exactly one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench._engines import engine_server, process_cpu_s, spread  # noqa: E402
from tests.stages.tiny_vlm import IMAGE_TOKEN, load_processor, make_qwen_vl  # noqa: E402

TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}  # fmt: skip
VISION = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "depth": 4,
          "out_hidden_size": 256, "fullatt_block_indexes": [3], "window_size": 112}  # fmt: skip


def _jpeg(rng: random.Random, side: int) -> bytes:
    image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def _prompts(n: int, system: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    # the byte tokenizer's: a token a character
    head = f"<|im_start|>system\n{('be brief. ' * system)[:system]}<|im_end|>\n" if system else ""
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(["look", "at", "this", "what", "is", "it", "the", "red"])
                         for _ in range(rng.randint(4, 12)))  # fmt: skip
        text = f"{head}<|im_start|>user\n{words} {IMAGE_TOKEN}<|im_end|>\n<|im_start|>assistant\n"
        out.append((text, _jpeg(rng, 224)))
    return out


async def _engine(url: str, prompts: list[tuple[str, bytes]], new: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/flush_cache") as answer:  # every round uncached
            assert answer.status == 200, await answer.text()

        async def one(text: str, image: bytes) -> list[int]:
            uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
            body = {"text": text, "image_data": uri, "sampling_params": params}
            async with session.post(url + "/generate", json=body) as answer:
                assert answer.status == 200, await answer.text()
                return (await answer.json())["output_ids"]

        return list(await asyncio.gather(*(one(t, i) for t, i in prompts)))


@torch.inference_mode()
def _hf(model, processor, prompts: list[tuple[str, bytes]], new: int) -> list[list[int]]:
    texts = [t for t, _ in prompts]
    images = [Image.open(io.BytesIO(i)).convert("RGB") for _, i in prompts]
    batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    model.model.rope_deltas = None
    model.generation_config.eos_token_id = None  # no end of text, as ignore_eos
    out = model.generate(**batch, max_new_tokens=new, do_sample=False)
    return out[:, batch["input_ids"].shape[1] :].tolist()


def _reading(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """The caller's and the worker's milliseconds for one image, by its side in pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from stages.engine.loader import load_model

    Qwen2VLImageProcessorPil().save_pretrained(path)  # the default bounds
    vision = load_model(str(path)).vision
    rng = random.Random(1)
    out = {}
    for side in (448, 1024):
        uri = "data:image/jpeg;base64," + base64.b64encode(_jpeg(rng, side)).decode()
        caller, worker = [], []
        for _ in range(15):
            start = time.perf_counter()
            _, image = vision.prompt(f"a {IMAGE_TOKEN}", None, [uri], "image_data")
            read = time.perf_counter()
            image.pixels.result()
            caller.append(1000 * (read - start))
            worker.append(1000 * (time.perf_counter() - read))
        out[str(side)] = {"caller_ms": spread(caller), "worker_ms": spread(worker)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system", type=int, default=0, help="a shared system message's tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = _prompts(args.prompts, args.system)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_qwen_vl(Path(tmp) / "vl", text=TEXT, vision=VISION, max_pixels=448 * 448)
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        params = sum(p.numel() for p in model.parameters())
        processor = load_processor(path)
        processor.tokenizer.padding_side = "left"
        env = {"OMP_NUM_THREADS": str(args.threads)}
        flags = ("--max-running", str(args.prompts))
        with engine_server(path, *flags, env=env) as (url, proc):
            sides = {
                "engine": lambda: asyncio.run(_engine(url, prompts, args.new)),
                "hf": lambda: _hf(model, processor, prompts, args.new),
            }
            sides["engine"]()  # warm both once
            sides["hf"]()
            rates: dict[str, list[float]] = {k: [] for k in sides}
            cpu: dict[str, list[float]] = {k: [] for k in sides}
            answers: dict[str, list[list[int]]] = {}
            for r in range(args.rounds):
                for name in sides if r % 2 == 0 else reversed(list(sides)):
                    engine_cpu = process_cpu_s(proc.pid)
                    own = time.process_time()
                    start = time.perf_counter()
                    answers[name] = sides[name]()
                    wall = time.perf_counter() - start
                    used = time.process_time() - own
                    if name == "engine":
                        used += process_cpu_s(proc.pid) - engine_cpu
                    rates[name].append(args.prompts / wall)
                    cpu[name].append(used / args.prompts)
                    print(f"round {r} {name}: {args.prompts / wall:.2f}/s", file=sys.stderr)
        reading = _reading(path)
    print(
        json.dumps(
            {
                "model": "Qwen2_5_VLForConditionalGeneration",
                "parameters": params,
                "prompts": args.prompts,
                "new_tokens": args.new,
                "system_tokens": args.system,
                "threads": args.threads,
                "prompts_per_s": {k: spread(v) for k, v in rates.items()},
                "cpu_s_per_prompt": {k: spread(v) for k, v in cpu.items()},
                "engine_over_hf": round(
                    statistics.median(rates["engine"]) / statistics.median(rates["hf"]), 3
                ),
                "same_tokens": answers["engine"] == answers["hf"],
                "reading_an_image": reading,
            }
        )
    )


if __name__ == "__main__":
    main()
