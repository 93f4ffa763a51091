"""What another Python thread in the engine's process costs the scheduler's steps, and what taking
turns (``stages.engine.loop_turns``) saves.

Run (prints one JSON line; on an otherwise idle machine):

    python bench/loop_turns.py [--rounds 8] [--steps 150] [--repeats 3]

Steps ``stages.engine.scheduler.Scheduler`` on arith-tiny in this process, as the default config's
engine runs (64 rows, groups of 4 identical prompts, 5 new tokens, new groups admitted as rows
finish, one torch thread), while a competitor does the event loop's kind of work: bursts of
40 us of pure Python with 100 us pauses (about 30% of the time). Reported per mode, the
scheduler thread's CPU per step (``time.thread_time``; the median of the rounds, the first
dropped, and its range, the medians of ``--repeats`` runs of each mode alternated):

- ``alone``: no competitor;
- ``thread``: the competitor on a thread of this process (the GIL shared, as the event loop
  shares it with the scheduler);
- ``process``: the same competitor in another process (no GIL shared);
- ``turns``: the competitor on a thread that takes turns with the steps (``Turns``: each burst
  in ``loop_acquire``/``loop_release``, each step in ``Turns.step``), as the server's loop does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stages.engine.loop_turns import Turns  # noqa: E402
from stages.engine.protocol import GenerateInput, SamplingParams  # noqa: E402
from stages.engine.scheduler import Scheduler  # noqa: E402
from stages.feeder.arithmetic import ArithmeticConfig, make_tokenizer, problems  # noqa: E402

ARITH = ROOT / "configs" / "models" / "arith-tiny"
_BURST_S, _PAUSE_S = 40e-6, 100e-6
_COMPETITOR = (
    "import time\n"
    "while True:\n"
    "    t = time.perf_counter()\n"
    f"    while time.perf_counter() - t < {_BURST_S}: pass\n"
    f"    time.sleep({_PAUSE_S})\n"
)


def _prompts(count: int) -> list[list[int]]:
    tok = make_tokenizer()
    texts = [p.text for p in problems(ArithmeticConfig(), "train")]
    return [tok.encode(texts[i % len(texts)]) for i in range(count)]


def _run(mode: str, args: argparse.Namespace, model: torch.nn.Module) -> list[float]:
    turns = Turns() if mode == "turns" else None
    sched = Scheduler(model, max_running=64, seed=0, fast_forward=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    pool = _prompts(512)
    live: list = []
    made = [0]

    def top_up() -> None:
        live[:] = [f for f in live if not f.done()]
        while len(live) < 128:
            prompt = pool[(made[0] // 4) % len(pool)]
            live.extend(
                sched.submit(GenerateInput(f"r{made[0]}-{k}", prompt, params, True))
                for k in range(4)
            )
            made[0] += 1

    stop = threading.Event()

    def burst() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < _BURST_S:
            pass

    def competitor() -> None:
        while not stop.is_set():
            if turns is None:
                burst()
            else:
                turns.loop_acquire()
                try:
                    burst()
                finally:
                    turns.loop_release()
            time.sleep(_PAUSE_S)

    child = thread = None
    if mode == "process":
        child = subprocess.Popen([sys.executable, "-c", _COMPETITOR])
    elif mode in ("thread", "turns"):
        thread = threading.Thread(target=competitor, daemon=True)
        thread.start()
    per_step = []
    try:
        for _ in range(args.rounds + 1):
            top_up()
            cpu, steps = time.thread_time(), sched.steps
            for _ in range(args.steps):
                if turns is None:
                    sched.step()
                else:
                    turns.step(sched.step)
                top_up()
            per_step.append(1e3 * (time.thread_time() - cpu) / max(1, sched.steps - steps))
    finally:
        stop.set()
        if child is not None:
            child.kill()
            child.wait()
        if thread is not None:
            thread.join(5)
    return per_step[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ARITH, dtype=torch.float32).eval()
    modes = ("alone", "thread", "process", "turns")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(statistics.median(_run(mode, args, model)))
    alone = statistics.median(runs["alone"])
    print(
        json.dumps(
            {
                "bench": "loop_turns",
                "rounds": args.rounds,
                "steps": args.steps,
                "repeats": args.repeats,
                "scheduler_cpu_ms_per_step": {
                    m: {
                        "median": round(statistics.median(v), 3),
                        "min": round(min(v), 3),
                        "max": round(max(v), 3),
                    }
                    for m, v in runs.items()
                },
                "over_alone": {m: round(statistics.median(v) / alone, 3) for m, v in runs.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
