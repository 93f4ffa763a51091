"""Prompt scoring on the built-in engine with its prefix cache, against the same engine without.

Run: ``python bench/scoring.py [--prompt 256] [--completion 64] [--group 8] [--batches 4]
[--rounds 5]``. Prints one JSON line on stdout.

What a teacher (``stages/scorer/teacher.py``) or a reference model served by an engine is
asked each step: a group's samples as one ``/generate`` batch, each its prompt and its
completion as ``input_ids``, ``logprob_start_len`` at the prompt's last token and
``max_new_tokens: 0``. Two engine servers on ``bench/_engines.py``'s 22M-parameter model, one
as started by default (the prefix cache on: a group's prompt is computed once, the other rows
on top of its KV, as SGLang's radix cache and in-batch prefix caching serve them) and one with
``--prefix-cache-tokens 0`` (every row computes its whole sequence, as the engine scored
before). Each round starts each server in turn (the order reversed every other round), sends
it one group unmeasured, then the round's ``--batches`` groups of fresh random prompts, timed
one after the other, and stops it. Reported: the
median (min-max) wall seconds per group of each, their ratio per round, the engine's CPU
seconds per group (its process's user + system time), the tokens its prompts reused
(``cached_tokens``), and the largest difference between the two servers' log-probs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.loads(resp.read())


def _group(rng: random.Random, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompt = [rng.randrange(2, vocab) for _ in range(args.prompt)]
    rows = [
        prompt + [rng.randrange(2, vocab) for _ in range(args.completion)]
        for _ in range(args.group)
    ]
    return {
        "input_ids": rows,
        "return_logprob": True,
        "logprob_start_len": [args.prompt - 1] * args.group,
        "sampling_params": {"max_new_tokens": 0},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of a group")
    parser.add_argument("--completion", type=int, default=64, help="tokens of each completion")
    parser.add_argument("--group", type=int, default=8, help="completions of one prompt")
    parser.add_argument("--batches", type=int, default=4, help="groups per server a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from bench._engines import engine_server, make_model, process_cpu_s, spread

    vocab = 32000
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, vocab=vocab)
        settings = {
            "cached": ("--max-running", str(args.group)),
            "whole": ("--max-running", str(args.group), "--prefix-cache-tokens", "0"),
        }
        wall: dict[str, list[float]] = {name: [] for name in settings}
        cpu: dict[str, list[float]] = {name: [] for name in settings}
        reused: dict[str, int] = dict.fromkeys(settings, 0)
        largest = 0.0
        for r in range(args.rounds):
            bodies = [_group(rng, args, vocab) for _ in range(args.batches)]
            answers: dict[str, list[Any]] = {}
            for name in list(settings) if r % 2 == 0 else list(settings)[::-1]:
                # one server alive at a time (bench/shared_prefix.py says why)
                with engine_server(model, *settings[name]) as (url, proc):
                    _post(url, _group(rng, args, vocab))  # its first request, unmeasured
                    cpu0, start = process_cpu_s(proc.pid), time.perf_counter()
                    answers[name] = [_post(url, body) for body in bodies]
                    wall[name].append((time.perf_counter() - start) / args.batches)
                    cpu[name].append((process_cpu_s(proc.pid) - cpu0) / args.batches)
                outs = [out for batch in answers[name] for out in batch]
                reused[name] += sum(out["meta_info"]["cached_tokens"] for out in outs)
            for a, b in zip(answers["cached"], answers["whole"], strict=True):
                for x, y in zip(a, b, strict=True):
                    pairs = zip(
                        x["meta_info"]["input_token_logprobs"][1:],
                        y["meta_info"]["input_token_logprobs"][1:],
                        strict=True,
                    )
                    largest = max([largest, *(abs(p[0] - q[0]) for p, q in pairs)])
            print(
                f"round {r}: cached {wall['cached'][-1]:.3f} s a group, "
                f"whole {wall['whole'][-1]:.3f}",
                file=sys.stderr,
            )

    ratios = [w / c for w, c in zip(wall["whole"], wall["cached"], strict=True)]
    print(
        json.dumps(
            {
                "bench": "scoring",
                "prompt_tokens": args.prompt,
                "completion_tokens": args.completion,
                "group": args.group,
                "batches_per_round": args.batches,
                "rounds": args.rounds,
                "wall_s_per_group": {name: spread(v) for name, v in wall.items()},
                "engine_cpu_s_per_group": {name: spread(v) for name, v in cpu.items()},
                "whole_over_cached": spread(ratios),
                "cached_tokens_per_group": {
                    name: round(n / (args.rounds * args.batches), 1) for name, n in reused.items()
                },
                "largest_logprob_difference": largest,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
