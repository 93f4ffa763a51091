"""What another live thread's idle OpenMP team costs the thread that runs torch's kernels
(``stages/engine/torch_threads.py``: why the engine loads its model on a thread that ends).

Run: ``python bench/torch_threads.py [--rounds 3000] [--repeats 5] [--threads 2]``

A decode-sized piece of work (``--rounds`` times: a ``[32, 256]`` by ``[768, 256]`` linear, an
attention-sized matmul ``[32, 2, 2, 64]`` x ``[32, 2, 64, 160]`` and its softmax), timed on a
fresh thread in three settings, each ``--repeats`` times in a process of its own (an OpenMP
team lives as long as its thread):

- ``alone``: no other thread ever ran a parallel region;
- ``beside_idle_team``: the main thread ran the same work first (its team of ``--threads`` now
  idle, as after loading a model on it);
- ``after_thread_ended``: a thread of its own ran it first and ended.

Prints the seconds of each (median, min, max) and ``beside_over_alone``: one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import sys, threading, time, torch
torch.set_num_threads(int(sys.argv[3]))
rounds, mode = int(sys.argv[1]), sys.argv[2]
def work():
    a, w, k = torch.randn(32, 256), torch.randn(768, 256), torch.randn(32, 2, 160, 64)
    start = time.perf_counter()
    for _ in range(rounds):
        y = torch.nn.functional.linear(a, w)
        torch.matmul(y[:, :256].view(32, 2, 2, 64), k.transpose(-1, -2)).softmax(-1)
    return time.perf_counter() - start
def on_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]
if mode == "beside_idle_team":
    work()
elif mode == "after_thread_ended":
    on_thread()
time.sleep(0.2)
print(on_thread())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    modes = ("alone", "beside_idle_team", "after_thread_ended")
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:  # alternated: the machine's drift spread over all three
            argv = [sys.executable, "-c", _CHILD, str(args.rounds), mode, str(args.threads)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
            seconds[mode].append(float(done.stdout.split()[-1]))
    spread = {
        mode: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
               "max": round(max(v), 3)}
        for mode, v in seconds.items()
    }  # fmt: skip
    ratio = statistics.median(seconds["beside_idle_team"]) / statistics.median(seconds["alone"])
    print(
        json.dumps(
            {
                "bench": "torch_threads",
                "threads": args.threads,
                "rounds": args.rounds,
                "seconds": spread,
                "beside_over_alone": round(ratio, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
