"""Generator throughput: one request per group against one request per sample, same engine.

Run: ``python bench/generator.py [--prompts 512 --group-size 4 --max-new-tokens 5 --in-flight 64
--reps 7 --json auto|stdlib|both --modes group,per_sample --engine-threads 1]``

Starts a real built-in engine on the shipped model (``python -m pipeline.cli engine --model
configs/models/arith-tiny``, with ``OMP_NUM_THREADS=--engine-threads`` as ``configs/default.yaml``
runs it) and drives it with the generator stage itself (``stages.generator.stage.Generator``:
its controller, slots, client and rollout building), in this process, on uvloop as an actor
runs it. Only the stage's surroundings are stand-ins: prompts come from a list (the arithmetic
task's training problems, tokenized with the model's tokenizer), rollouts go to a counter with
unlimited credit, and the controller's target is pinned to ``--in-flight`` samples.

Each repetition runs the same prompts once per mode, ``group_requests`` on and off (and, with
``--json both``, once per JSON codec of the client: orjson and the standard library), the order
rotating between repetitions, after one warm-up run of each mode. Reported per mode: samples/s
(wall time of the stage's ``run``), the generator's CPU seconds per 1000 samples
(``resource.getrusage`` of this process: HTTP client, JSON, parsing, controller, rollouts) and the
engine's (``/proc/PID/stat``), each as the median and min-max over the repetitions. Prints exactly
one JSON line on stdout. It does not measure ZeroMQ sending (see ``bench/transport.py``) or the
engine's decode speed (``bench/engine.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Run as a script, bench/ would come first on sys.path; the repository root is what we need.
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

from transformers import AutoTokenizer  # noqa: E402

from bench._engines import engine_server  # noqa: E402
from pipeline.ledger import LedgerReporter  # noqa: E402
from stages.feeder.arithmetic import ArithmeticConfig, problems  # noqa: E402
from stages.generator import client as client_module  # noqa: E402
from stages.generator.controller import ControllerConfig  # noqa: E402
from stages.generator.stage import Generator, GeneratorConfig, SamplingConfig  # noqa: E402

MODEL = ROOT / "configs" / "models" / "arith-tiny"
MODES = {"group": True, "per_sample": False}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Quiet:
    """A logger that drops everything (the stage logs decisions; the bench does not read them)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Prompts:
    def __init__(self, prompts: list[dict[str, Any]]) -> None:
        self.prompts = prompts

    async def __aiter__(self):
        for p in self.prompts:
            yield SimpleNamespace(data=p)

    def ack(self, msg: SimpleNamespace) -> None:
        """A prompt is processed once its group went on (nothing to keep here)."""


class _Sink:
    """The rollouts port: unlimited credit, counts what it gets."""

    def __init__(self) -> None:
        self.samples = self.tokens = 0

    def credit(self) -> int:
        return 1 << 30

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        self.samples += len(data["samples"])
        self.tokens += sum(len(x["completion_ids"]) for x in data["samples"])


async def _run_stage(
    url: str, prompts: list[dict[str, Any]], args: argparse.Namespace, grouped: bool, run_dir: Path
) -> tuple[float, int, int]:
    """(wall seconds of the stage's run, samples out, tokens out)."""
    config = GeneratorConfig(
        engines=[url],
        group_size=args.group_size,
        group_requests=grouped,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens),
        max_lag=4,
        outbox=args.in_flight,
        controller=ControllerConfig(
            start=args.in_flight, min_in_flight=args.in_flight, max_in_flight=args.in_flight
        ),
    )
    sink = _Sink()

    async def publish(topic: str, payload: dict[str, Any]) -> None:
        pass

    ctx = SimpleNamespace(
        stage="generator",
        replica=0,
        run_dir=run_dir,
        mode="async",
        version=0,
        log=_Quiet(),
        inputs={"prompts": _Prompts(prompts)},
        outputs={"rollouts": sink},
        metrics=lambda **values: None,
        ledger=LedgerReporter(lambda payload: None),  # no run: nothing to account to
        publish=publish,
    )
    stage = Generator(config, ctx)
    await stage.setup()
    try:
        start = time.perf_counter()
        await stage.run()
        wall = time.perf_counter() - start
    finally:
        await stage.close()
    assert stage.counts["dropped"] == 0, stage.counts
    return wall, sink.samples, sink.tokens


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.run(coro)
    return uvloop.run(coro)


def _stats(values: list[float], digits: int) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


_CODECS = {
    "orjson": (client_module._dumps, client_module._loads, client_module._DECODE_ERRORS),
    "stdlib": (client_module._std_dumps, json.loads, (ValueError,)),
}


def _use_codec(name: str) -> None:
    """Make the generator's client encode and parse JSON with ``name``."""
    client_module._dumps, client_module._loads, client_module._DECODE_ERRORS = _CODECS[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=512, help="prompts per run")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--in-flight", type=int, default=64, help="samples in flight (target)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--json",
        choices=["auto", "stdlib", "both"],
        default="auto",
        help="the client's JSON codec: auto (orjson when installed), stdlib, or both, "
        "interleaved, to compare them",
    )
    parser.add_argument(
        "--modes", default="group,per_sample", help="which of group,per_sample to run"
    )
    parser.add_argument("--engine-threads", type=int, default=1)
    args = parser.parse_args()
    if args.json == "both" and client_module.JSON_CODEC != "orjson":
        raise SystemExit("--json both: orjson is not installed")
    auto = "orjson" if client_module.JSON_CODEC == "orjson" else "stdlib"
    codecs = {"auto": [auto], "stdlib": ["stdlib"], "both": list(_CODECS)}[args.json]
    runs = [
        f"{mode}/{codec}" if len(codecs) > 1 else mode
        for mode in args.modes.split(",")
        for codec in codecs
    ]
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (known: {', '.join(MODES)})")

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    texts = [p.text for p in problems(ArithmeticConfig(), "train")]
    step = max(1, len(texts) // args.prompts)
    chosen = texts[::step][: args.prompts]
    ids = tokenizer(chosen, return_attention_mask=False)["input_ids"]
    prompts = [
        {"prompt_id": f"arith:{t}", "input_ids": list(row), "meta": None}
        for t, row in zip(chosen, ids, strict=True)
    ]

    results: dict[str, dict[str, list[float]]] = {run: {} for run in runs}
    with (
        tempfile.TemporaryDirectory() as tmp,
        open(Path(tmp) / "engine.out", "wb") as log,
        engine_server(
            MODEL,
            module=("pipeline.cli", "engine"),
            env={"OMP_NUM_THREADS": str(args.engine_threads)},
            output=log,
        ) as (url, proc),
    ):
        for mode, grouped in MODES.items():  # warm-up: connections, first-call costs
            _run(_run_stage(url, prompts[:32], args, grouped, Path(tmp) / f"warm-{mode}"))
        for rep in range(args.reps):
            # rotate the order, so that drift of the machine is shared by every run
            shift = rep % len(runs)
            for run in runs[shift:] + runs[:shift]:
                mode, _, codec = run.partition("/")
                _use_codec(codec or codecs[0])
                cpu0, engine0 = _own_cpu_s(), _cpu_s(proc.pid)
                wall, samples, _tokens = _run(
                    _run_stage(url, prompts, args, MODES[mode], Path(tmp) / f"run-{rep}")
                )
                cpu, engine_cpu = _own_cpu_s() - cpu0, _cpu_s(proc.pid) - engine0
                assert samples == len(prompts) * args.group_size, samples
                r = results[run]
                r.setdefault("samples_per_s", []).append(samples / wall)
                r.setdefault("generator_cpu_s_per_1000", []).append(1000 * cpu / samples)
                r.setdefault("engine_cpu_s_per_1000", []).append(1000 * engine_cpu / samples)

    out: dict[str, Any] = {
        "bench": "generator_group_vs_per_sample",
        "model": "configs/models/arith-tiny",
        "prompts": len(prompts),
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "in_flight": args.in_flight,
        "reps": args.reps,
        "json": codecs[0] if len(codecs) == 1 else "both",
        "engine_threads": args.engine_threads,
    }
    for run, r in results.items():
        out[run] = {
            "samples_per_s": _stats(r["samples_per_s"], 1),
            "generator_cpu_s_per_1000": _stats(r["generator_cpu_s_per_1000"], 3),
            "engine_cpu_s_per_1000": _stats(r["engine_cpu_s_per_1000"], 3),
        }
    if "group" in out and "per_sample" in out:
        out["group_over_per_sample"] = round(
            out["group"]["samples_per_s"]["median"] / out["per_sample"]["samples_per_s"]["median"],
            2,
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
