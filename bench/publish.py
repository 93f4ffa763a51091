"""Weight publishing on CPU: publish time against a raw broadcast, and the built-in engine's
decode throughput while it is updated every few decode steps against undisturbed.

Run: ``python bench/publish.py [--part all|publish|updates]`` (default ``all``, about 1.5 min
on 2 cores). Prints exactly one JSON line on stdout (logs go to stderr).

Part ``publish`` (``--bucket-mb 64 --runs 7 --dtype bfloat16 --backend gloo``): builds a random
Qwen2-style model of about 50M parameters with Hugging Face names (bfloat16 by default: what an
engine serves), starts two engine processes that answer SGLang's ``/init_weights_update_group``
and ``/update_weights_from_distributed`` with a ``WeightReceiver`` (the routes as in
``tests/stages/test_weights_publisher.py``), connects one ``WeightPublisher`` and times, per run:

- ``publish``: ``WeightPublisher.publish`` of all weights (open each engine's update session,
  pack, announce each bucket over HTTP, broadcast, unpack, every engine answers, close the
  sessions);
- ``raw``: the same bucket sizes, packed beforehand, broadcast in the same group after one HTTP
  request that tells the engines to receive that many bytes (``/bench_raw_receive``).

Medians over ``--runs``. These engines receive into fresh buffers and do not copy into a model,
so this part measures publishing overhead, not model loading.

Part ``updates`` (key ``engine_tokens_per_s``): two real built-in engines (``python -m
pipeline.cli engine``, ``--engine-threads`` torch threads each, float32) serve a random
Qwen2-style model of about 13M parameters (``tests/stages/tiny_model.py``: vocab 16384, hidden
256, 6 layers, 4 heads, 2 KV heads, MLP 768, untied lm_head, no tokenizer). Each engine gets a
steady load: ``--concurrency`` greedy ``ignore_eos`` requests (random prompts of
``--prompt-len`` tokens, ``max_new_tokens`` uniform in ``--new-tokens``), each re-submitted as
soon as it finishes. Windows of ``--window-s`` alternate A B B A A B B A (``--rounds`` pairs;
short windows, so each pair sees about the same background load): in A the engines
run undisturbed, in B a ``WeightPublisher`` (gloo, ``--update-bucket-mb``, flattened buckets)
publishes the full weights (two weight sets in turn) whenever both engines have run
``--update-every-steps`` decode steps since the last update landed. Both phases poll
``/get_server_info`` alike; tokens/s is the delta of its ``tokens_generated`` over a window,
summed over the engines. Also reported: decode steps/s and tokens per step, updates and the
decode steps between them, the time the schedulers spent applying weights (from the engines'
``weights_applied`` log events), CPU use in cores per phase (engine scheduler threads, engine
event loops, the engines' other threads, this process, and the rest of the machine), tokens per
CPU second the schedulers got (what updates cost inside the engine, whatever other processes
took), tokens per CPU second of the engines and this process together (on a machine of their
own, saturated by them, the throughput ratio would be this ratio), and the ratio of each
adjacent A,B pair (``ratio_per_round``: the machine may be shared).

On one small machine the publisher (pack + send) and the engines share the same cores; on a real
deployment the publisher lives on the learner's machine. This process publishes with
``--publisher-threads`` torch threads (default 1): with 2, on 2 cores already busy with the
engines, the OpenMP copy in the packing thread spins waiting for a core and costs several times
the CPU of the copy itself. Not measured: NCCL, GPUs, more than two engines, tensor-parallel
engines, SGLang.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import structlog
import torch
from aiohttp import web

# Run as a script, this folder comes first on sys.path: put the repository root there instead
# (the repo's packages, and tests/ for the tiny model).
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

from pipeline.processes import kill_with_parent  # noqa: E402
from stages.weights.buckets import pack_buckets  # noqa: E402
from stages.weights.publisher import WeightPublisher  # noqa: E402
from stages.weights.receiver import WeightReceiver  # noqa: E402


def qwen2_style(dtype: torch.dtype, *, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A random ~50M-parameter Qwen2-shaped state dict (untied lm_head), in checkpoint order."""
    vocab, hidden, inter, layers, heads, kv_heads = 32000, 512, 1408, 6, 8, 2
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    out = [("model.embed_tokens.weight", w(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", w(hidden)),
            (p + "self_attn.q_proj.weight", w(heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", w(heads * head_dim)),
            (p + "self_attn.k_proj.weight", w(kv_heads * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", w(kv_heads * head_dim)),
            (p + "self_attn.v_proj.weight", w(kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", w(kv_heads * head_dim)),
            (p + "self_attn.o_proj.weight", w(hidden, heads * head_dim)),
            (p + "post_attention_layernorm.weight", w(hidden)),
            (p + "mlp.gate_proj.weight", w(inter, hidden)),
            (p + "mlp.up_proj.weight", w(inter, hidden)),
            (p + "mlp.down_proj.weight", w(hidden, inter)),
        ]
    out += [("model.norm.weight", w(hidden)), ("lm_head.weight", w(vocab, hidden))]
    return out


async def _engine(conn: Any) -> None:
    """One engine process: SGLang's weight routes plus the raw-broadcast baseline route."""
    receiver = WeightReceiver()

    def answer(ok: bool, message: str) -> web.Response:
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def init_group(request: web.Request) -> web.Response:
        b = await request.json()
        try:
            await asyncio.to_thread(
                receiver.init_group,
                b["master_address"],
                b["master_port"],
                b["rank_offset"],
                b["world_size"],
                b["group_name"],
                b["backend"],
            )
        except Exception as exc:
            return answer(False, f"Failed to initialize custom process group: {exc}.")
        return answer(True, "Succeeded to initialize custom process group.")

    async def update(request: web.Request) -> web.Response:
        b = await request.json()
        try:
            await asyncio.to_thread(
                receiver.receive, b["names"], b["dtypes"], b["shapes"], b.get("load_format")
            )
        except Exception as exc:
            return answer(False, f"Failed to update parameter online: {exc}")
        return answer(True, "Succeeded to update parameter online.")

    raw_buffers: dict[int, torch.Tensor] = {}

    async def raw_receive(request: web.Request) -> web.Response:
        sizes = (await request.json())["sizes"]

        def receive_all() -> None:
            assert receiver._group is not None
            for size in sizes:
                # reused like the receiver's own buffer, so both sides pay the same allocation
                if size not in raw_buffers:
                    raw_buffers[size] = torch.empty(size, dtype=torch.uint8)
                receiver._group.broadcast(raw_buffers[size], src=0)

        await asyncio.to_thread(receive_all)
        return answer(True, "received")

    app = web.Application(client_max_size=1 << 26)
    app.add_routes(
        [
            web.post("/init_weights_update_group", init_group),
            web.post("/update_weights_from_distributed", update),
            web.post("/update_weight_version", lambda _: answer(True, "version set")),
            # the update session (SGLang 0.5.23), and /server_info naming the built-in engine,
            # which the publisher does not pause: what it frames each update with there
            web.post("/begin_weight_update", lambda _: answer(True, "Success")),
            web.post("/end_weight_update", lambda _: answer(True, "Success")),
            web.get("/server_info", lambda _: web.json_response({"engine": "inflight-builtin"})),
            web.post("/bench_raw_receive", raw_receive),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    conn.send(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await asyncio.Event().wait()


def _engine_main(conn: Any) -> None:
    asyncio.run(_engine(conn))


async def _raw(pub: WeightPublisher, session: aiohttp.ClientSession, flats: list[Any]) -> float:
    """Broadcast pre-packed buffers in the publisher's group after one announcing request."""
    group = pub._usable_group()
    started = time.perf_counter()
    posts = [
        asyncio.ensure_future(
            session.post(url + "/bench_raw_receive", json={"sizes": [f.numel() for f in flats]})
        )
        for url in pub.engine_urls
    ]

    def broadcast() -> None:
        for flat in flats:
            group.broadcast(flat, src=0)

    await asyncio.to_thread(broadcast)
    for resp in await asyncio.gather(*posts):
        assert (await resp.json())["success"], resp
        resp.release()
    return time.perf_counter() - started


async def publish_part(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    weights = qwen2_style(dtype)
    params = sum(t.numel() for _, t in weights)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    bucket_bytes = int(args.bucket_mb * 2**20)
    flats = [b.flat for b in pack_buckets(weights, bucket_bytes)]

    ctx = mp.get_context("spawn")
    procs, urls = [], []
    pub: WeightPublisher | None = None
    publish_s: list[float] = []
    raw_s: list[float] = []
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_engine_main, args=(child,), daemon=True)
            p.start()
            procs.append(p)
            if not parent.poll(60):
                raise RuntimeError("bench engine did not start within 60 s")
            urls.append(f"http://127.0.0.1:{parent.recv()}")
        pub = WeightPublisher(
            urls, backend=args.backend, bucket_mb=args.bucket_mb, load_format=args.load_format
        )
        await pub.connect()
        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # warm-up: connections, allocators, page tables
                await pub.publish(weights, version=0)
                await _raw(pub, session, flats)
            for run in range(args.runs):
                # Alternate, so drift in machine load hits both alike.
                publish_s.append((await pub.publish(weights, version=run + 1)).seconds)
                raw_s.append(await _raw(pub, session, flats))
    finally:
        if pub is not None:
            await pub.close()
        for p in procs:
            p.kill()
            p.join(timeout=5)
    publish, raw = statistics.median(publish_s), statistics.median(raw_s)
    return {
        "model": "random qwen2-style (untied lm_head)",
        "params": params,
        "dtype": args.dtype,
        "bytes": nbytes,
        "engines": 2,
        "backend": args.backend,
        "load_format": args.load_format,
        "bucket_mb": args.bucket_mb,
        "buckets": len(flats),
        "runs": args.runs,
        "publish_s": round(publish, 4),
        "raw_broadcast_s": round(raw, 4),
        "ratio": round(publish / raw, 3),
        "ratio_of_best": round(min(publish_s) / min(raw_s), 3),
        "publish_gb_s": round(nbytes / publish / 1e9, 3),
        "publish_s_all": [round(x, 4) for x in publish_s],
        "raw_broadcast_s_all": [round(x, 4) for x in raw_s],
    }


# ---- part "updates": real built-in engines, updated every few decode steps ---------------------

_TINY = {"vocab": 16384, "hidden": 256, "layers": 6, "heads": 4, "kv_heads": 2, "intermediate": 768}
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class _Engine:
    url: str
    proc: subprocess.Popen[bytes]
    log_file: Path
    out_file: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_engines(
    model_dir: Path, logs: Path, args: argparse.Namespace, engines: list[_Engine]
) -> None:
    """Start the engines, appending each to ``engines`` at once (the caller stops them)."""
    threads = str(args.engine_threads)
    die_with_parent = kill_with_parent()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }
    for i in range(2):
        port = _free_port()
        log_file, out_file = logs / f"engine{i}.jsonl", logs / f"engine{i}.out"
        with open(out_file, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pipeline.cli",
                    "engine",
                    "--model",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--max-running",
                    str(args.max_running),
                    "--log-file",
                    str(log_file),
                    "--log-level",
                    "debug",  # weights_applied, read below, is a debug event
                    *(["--event-loop-turns"] if args.event_loop_turns else []),
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        engines.append(_Engine(f"http://127.0.0.1:{port}", proc, log_file, out_file))


def _stop_engines(engines: list[_Engine]) -> None:
    for e in engines:
        if e.proc.poll() is None:
            e.proc.terminate()
    for e in engines:
        try:
            e.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait(timeout=15)


async def _wait_healthy(session: aiohttp.ClientSession, engines: list[_Engine]) -> None:
    deadline = time.monotonic() + 120
    for e in engines:
        while True:
            if e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.url} exited with {e.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {e.url} not healthy within 120 s")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(e.url + "/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.2)


async def _info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/get_server_info") as r:
        r.raise_for_status()
        body: dict[str, Any] = await r.json()
        return body


async def _steps(session: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    infos = await asyncio.gather(*(_info(session, u) for u in urls))
    return [int(i["decode_steps"]) for i in infos]


def _cpu_s(pid: int | str) -> float:
    """User + system CPU seconds of a process (all its threads, live or ended) or thread."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _thread_cpu(pid: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            out[int(task.name)] = _cpu_s(f"{pid}/task/{task.name}")
    return out


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # minus idle and iowait


@dataclass
class _Snap:
    t: float
    wall: float
    infos: list[dict[str, Any]]
    engine_cpu: list[float]
    engine_threads: list[dict[int, float]]
    bench_cpu: float
    machine: float


async def _snap(session: aiohttp.ClientSession, engines: list[_Engine]) -> _Snap:
    infos = await asyncio.gather(*(_info(session, e.url) for e in engines))
    return _Snap(
        t=time.perf_counter(),
        wall=time.time(),
        infos=list(infos),
        engine_cpu=[_cpu_s(e.proc.pid) for e in engines],
        engine_threads=[_thread_cpu(e.proc.pid) for e in engines],
        bench_cpu=time.process_time(),
        machine=_machine_busy_s(),
    )


@dataclass
class _Window:
    phase: str
    start: _Snap
    end: _Snap
    updates: list[tuple[float, float, int]] = field(default_factory=list)  # end t, s, steps

    @property
    def seconds(self) -> float:
        return self.end.t - self.start.t

    def delta(self, key: str) -> list[int]:
        return [b[key] - a[key] for a, b in zip(self.start.infos, self.end.infos, strict=True)]


class _Load:
    """``concurrency`` request loops per engine, each re-submitting as soon as its request ends."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], args: argparse.Namespace):
        self.session, self.urls, self.args = session, urls, args
        self.stop = asyncio.Event()
        self.finished = 0
        self.tasks = [
            asyncio.create_task(self._loop(url, random.Random(1000 * e + i), f"e{e}w{i}"))
            for e, url in enumerate(urls)
            for i in range(args.concurrency)
        ]

    async def _loop(self, url: str, rng: random.Random, tag: str) -> None:
        lo, hi = self.args.new_tokens
        vocab = _TINY["vocab"]
        n = 0
        while not self.stop.is_set():
            body = {
                "input_ids": [rng.randrange(3, vocab) for _ in range(self.args.prompt_len)],
                "rid": f"{tag}-{n}",
                "sampling_params": {
                    "temperature": 0,
                    "ignore_eos": True,
                    "max_new_tokens": rng.randint(lo, hi),
                },
            }
            n += 1
            async with self.session.post(url + "/generate", json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"{url}/generate answered {r.status}: {text[:300]}")
            self.finished += 1

    def check(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError("load generator failed") from task.exception()

    async def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.gather(
                *(
                    self.session.post(u + "/abort_request", json={"abort_all": True})
                    for u in self.urls
                )
            )
        _, pending = await asyncio.wait(self.tasks, timeout=10)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _Poller:
    """Reads every engine's decode steps each ``period`` seconds, in both phases alike (so the
    polling load on the engines does not differ between them)."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], period: float) -> None:
        self.session, self.urls, self.period = session, urls, period
        self.steps: list[int] = []
        self._fresh = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.steps = await _steps(self.session, self.urls)
            self._fresh.set()
            await asyncio.sleep(self.period)

    async def next(self) -> list[int]:
        """The steps of the next poll to complete (raises if polling failed)."""
        self._fresh.clear()
        waiter = asyncio.ensure_future(self._fresh.wait())
        await asyncio.wait([waiter, self.task], return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            waiter.cancel()
            self.task.result()
            raise RuntimeError("poller ended")
        return self.steps

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _update_loop(
    poller: _Poller,
    every: int,
    stop: asyncio.Event,
    publish: Any,
    out: list[tuple[float, float, int]],
) -> None:
    """Publish whenever every engine has run ``every`` decode steps since the last update landed.

    Records (landed at, seconds, decode steps during the publish: the fewest of the engines')."""
    base = await poller.next()
    while not stop.is_set():
        steps = await poller.next()
        if min(s - b for s, b in zip(steps, base, strict=True)) < every:
            continue
        started = time.perf_counter()
        await publish()
        landed = time.perf_counter()
        base = await _steps(poller.session, poller.urls)
        out.append((landed, landed - started, min(b - s for s, b in zip(steps, base, strict=True))))


def _applied(log_file: Path) -> list[tuple[float, float]]:
    """(wall time, seconds) of every ``weights_applied`` event in an engine's log."""
    out = []
    for line in log_file.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            event = json.loads(line)
            if event.get("event") == "weights_applied":
                ts = datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()
                out.append((ts, float(event["seconds"])))
    return out


async def _drive(engines: list[_Engine], model_dirs: list[Path], args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM  # only this part needs it

    weight_sets = [
        [
            (n, t.detach())
            for n, t in AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            .state_dict()
            .items()
        ]
        for d in model_dirs
    ]
    urls = [e.url for e in engines]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _wait_healthy(session, engines)
        pub = WeightPublisher(
            urls,
            backend=args.backend,
            bucket_mb=args.update_bucket_mb,
            load_format="flattened_bucket",
        )
        load: _Load | None = None
        poller: _Poller | None = None
        version = 0
        last_stats: list[Any] = []

        async def publish() -> None:
            nonlocal version
            version += 1
            last_stats[:] = [await pub.publish(weight_sets[version % 2], version=version)]

        try:
            await pub.connect()
            load = _Load(session, urls, args)
            poller = _Poller(session, urls, args.poll_s)
            await asyncio.sleep(args.warmup_s)
            for _ in range(2):  # warm-up: group connections, buffers, page tables
                await publish()
            await asyncio.sleep(1.0)
            windows: list[_Window] = []
            for r in range(args.rounds):
                for phase in ("undisturbed", "updated")[:: 1 if r % 2 == 0 else -1]:
                    load.check()
                    stop, updates = asyncio.Event(), []
                    updater = None
                    if phase == "updated":
                        updater = asyncio.create_task(
                            _update_loop(poller, args.update_every_steps, stop, publish, updates)
                        )
                    start = await _snap(session, engines)
                    await asyncio.sleep(args.window_s)
                    end = await _snap(session, engines)
                    stop.set()
                    if updater is not None:
                        await updater  # an update in flight lands before the next window opens
                    windows.append(_Window(phase, start, end, updates))
                    await asyncio.sleep(0.5)
            load.check()
            final = await asyncio.gather(*(_info(session, u) for u in urls))
            versions = [f["weight_version"] for f in final]
            if versions != [str(version)] * len(urls):
                raise RuntimeError(f"engines report versions {versions}, last published {version}")
        finally:
            if poller is not None:
                await poller.close()
            if load is not None:
                await load.close()
            await pub.close()
    return windows, weight_sets[0], last_stats[0], load.finished


def _summarize(
    windows: list[_Window], engines: list[_Engine], args: argparse.Namespace
) -> dict[str, Any]:
    n = len(engines)
    # The scheduler thread: the engine's busiest thread other than the main one (event loop).
    sched: list[int] = []
    for i, e in enumerate(engines):
        used: dict[int, float] = {}
        for w in windows:
            for tid, cpu in w.end.engine_threads[i].items():
                used[tid] = used.get(tid, 0.0) + cpu - w.start.engine_threads[i].get(tid, 0.0)
        used.pop(e.proc.pid, None)
        sched.append(max(used, key=used.__getitem__))
    applied = [_applied(e.log_file) for e in engines]

    phases: dict[str, dict[str, Any]] = {}
    for phase in ("undisturbed", "updated"):
        ws = [w for w in windows if w.phase == phase]
        secs = sum(w.seconds for w in ws)
        tokens = [sum(w.delta("tokens_generated")[i] for w in ws) for i in range(n)]
        steps = [sum(w.delta("decode_steps")[i] for w in ws) for i in range(n)]
        landed = [u for w in ws for u in w.updates if u[0] <= w.end.t]

        def cpu(fn: Any, ws: list[_Window] = ws, secs: float = secs) -> float:
            return round(sum(fn(w) for w in ws) / secs, 3)

        def tcpu(w: _Window, i: int, tid: int) -> float:
            return w.end.engine_threads[i].get(tid, 0.0) - w.start.engine_threads[i].get(tid, 0.0)

        apply_s = [
            sum(s for ts, s in applied[i] for w in ws if w.start.wall <= ts <= w.end.wall)
            for i in range(n)
        ]
        engine_cpu = cpu(
            lambda w: sum(b - a for a, b in zip(w.start.engine_cpu, w.end.engine_cpu, strict=True))
        )
        bench_cpu = cpu(lambda w: w.end.bench_cpu - w.start.bench_cpu)
        machine = cpu(lambda w: w.end.machine - w.start.machine)
        sched_cpu = cpu(lambda w: sum(tcpu(w, i, sched[i]) for i in range(n)))
        loop_cpu = cpu(lambda w: sum(tcpu(w, i, e.proc.pid) for i, e in enumerate(engines)))
        phases[phase] = {
            "tokens_per_s": sum(tokens) / secs,
            "per_engine": [round(t / secs, 1) for t in tokens],
            "per_window": [round(sum(w.delta("tokens_generated")) / w.seconds, 1) for w in ws],
            "steps_per_s": round(sum(steps) / secs / n, 2),
            "tokens_per_step": round(sum(tokens) / max(1, sum(steps)), 2),
            # Throughput per CPU second the schedulers actually got: what updates cost inside
            # the engine, apart from the CPU other processes took from it.
            "tokens_per_scheduler_cpu_s": sum(tokens) / (sched_cpu * secs),
            # Throughput per CPU second of the engines and this process together: on a machine
            # of its own, saturated by them, tokens/s would be this times the cores.
            "tokens_per_own_cpu_s": sum(tokens) / ((engine_cpu + bench_cpu) * secs),
            "steps": sum(steps) / n,
            "updates": len(landed),
            "publish_s": [u[1] for u in landed],
            "steps_during_publish": [u[2] for u in landed],
            "apply_s": sum(apply_s) / n,
            "seconds": secs,
            "cpu_cores": {
                "engine_schedulers": sched_cpu,
                "engine_event_loops": loop_cpu,
                "engine_other_threads": round(engine_cpu - sched_cpu - loop_cpu, 3),
                "bench_process": bench_cpu,
                "rest_of_machine": round(machine - engine_cpu - bench_cpu, 3),
                "machine": machine,
            },
        }
    a, b = phases["undisturbed"], phases["updated"]
    updates = b["updates"]
    # Each round is an adjacent A,B pair: its ratio sees about the same background load.
    rate = {id(w): sum(w.delta("tokens_generated")) / w.seconds for w in windows}
    pairs = [
        rate[id(windows[i + (windows[i].phase == "undisturbed")])]
        / rate[id(windows[i + (windows[i].phase == "updated")])]
        for i in range(0, len(windows) - 1, 2)
    ]
    return {
        "undisturbed": round(a["tokens_per_s"], 1),
        "updated": round(b["tokens_per_s"], 1),
        "ratio": round(b["tokens_per_s"] / a["tokens_per_s"], 3),
        "goal": 0.9,
        "ratio_per_round": [round(r, 3) for r in pairs],
        "ratio_median_of_rounds": round(statistics.median(pairs), 3),
        "updates": updates,
        "decode_steps_between_updates": round(b["steps"] / updates, 2) if updates else None,
        "update_every_steps": args.update_every_steps,
        "updates_per_s": round(updates / b["seconds"], 2),
        "publish_s_median": round(statistics.median(b["publish_s"]), 4) if updates else None,
        "decode_steps_during_publish_median": (
            statistics.median(b["steps_during_publish"]) if updates else None
        ),
        "apply_s_per_update": round(b["apply_s"] / updates, 4) if updates else None,
        "apply_share_of_time": round(b["apply_s"] / b["seconds"], 4),
        "steps_per_s": {"undisturbed": a["steps_per_s"], "updated": b["steps_per_s"]},
        "tokens_per_step": {"undisturbed": a["tokens_per_step"], "updated": b["tokens_per_step"]},
        "tokens_per_scheduler_cpu_s": {
            "undisturbed": round(a["tokens_per_scheduler_cpu_s"], 1),
            "updated": round(b["tokens_per_scheduler_cpu_s"], 1),
            "ratio": round(b["tokens_per_scheduler_cpu_s"] / a["tokens_per_scheduler_cpu_s"], 3),
        },
        "tokens_per_own_cpu_s": {
            "undisturbed": round(a["tokens_per_own_cpu_s"], 1),
            "updated": round(b["tokens_per_own_cpu_s"], 1),
            "ratio": round(b["tokens_per_own_cpu_s"] / a["tokens_per_own_cpu_s"], 3),
        },
        "per_engine": {"undisturbed": a["per_engine"], "updated": b["per_engine"]},
        "per_window": {"undisturbed": a["per_window"], "updated": b["per_window"]},
        "cpu_cores": {"undisturbed": a["cpu_cores"], "updated": b["cpu_cores"]},
    }


def updates_part(args: argparse.Namespace) -> dict[str, Any]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/ is not an installed package
    from tests.stages.tiny_model import make_tiny_model

    engines: list[_Engine] = []
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        root = Path(tmp)
        dirs = [
            make_tiny_model(
                root / f"model{s}", seed=s, with_tokenizer=False, max_positions=1024, **_TINY
            )
            for s in (1, 2)
        ]
        threads = torch.get_num_threads()
        try:
            _start_engines(dirs[0], root, args, engines)
            torch.set_num_threads(args.publisher_threads)
            windows, weights, stats, finished = asyncio.run(_drive(engines, dirs, args))
        except BaseException:
            for e in engines:
                tail = e.out_file.read_text(errors="replace")[-2000:] if e.out_file.exists() else ""
                print(f"--- {e.url} output (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            torch.set_num_threads(threads)
            _stop_engines(engines)
        result = _summarize(windows, engines, args)
    params = sum(t.numel() for _, t in weights)
    result.update(
        {
            "model": {**_TINY, "params": params, "dtype": "float32", "tied": False},
            "bytes_per_update": stats.bytes,
            "buckets_per_update": stats.buckets,
            "bucket_mb": args.update_bucket_mb,
            "engines": len(engines),
            "engine_threads": args.engine_threads,
            "concurrency_per_engine": args.concurrency,
            "max_running": args.max_running,
            "prompt_len": args.prompt_len,
            "new_tokens": list(args.new_tokens),
            "window_s": args.window_s,
            "windows": "".join("A" if w.phase == "undisturbed" else "B" for w in windows),
            "poll_s": args.poll_s,
            "publisher_threads": args.publisher_threads,
            "requests_finished": finished,
        }
    )
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    # SIGTERM ends the run through the finally clauses that stop the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"bench": "publish", "part": args.part}
    if args.part in ("publish", "all"):
        result.update(asyncio.run(publish_part(args)))
    if args.part in ("updates", "all"):
        result["engine_tokens_per_s"] = updates_part(args)
    result.update(
        {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    )
    return result


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo_n, hi_n


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="all", choices=["all", "publish", "updates"])
    parser.add_argument("--backend", default="gloo")
    publish_args = parser.add_argument_group("part publish")
    publish_args.add_argument("--bucket-mb", type=float, default=64)
    publish_args.add_argument("--runs", type=int, default=7)
    publish_args.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    publish_args.add_argument(
        "--load-format", default="flattened_bucket", type=lambda s: None if s == "none" else s
    )
    updates_args = parser.add_argument_group("part updates")
    updates_args.add_argument("--update-every-steps", type=int, default=4)
    updates_args.add_argument("--update-bucket-mb", type=float, default=16)
    updates_args.add_argument("--window-s", type=float, default=4)
    updates_args.add_argument("--rounds", type=int, default=4, help="A B, then B A, ...")
    updates_args.add_argument("--warmup-s", type=float, default=4)
    updates_args.add_argument("--engine-threads", type=int, default=1)
    updates_args.add_argument(
        "--event-loop-turns", action="store_true", help="the engines' --event-loop-turns"
    )
    updates_args.add_argument(
        "--publisher-threads",
        type=int,
        default=1,
        help="torch threads of this process while it publishes (packing)",
    )
    updates_args.add_argument("--poll-s", type=float, default=0.02, help="decode-step polling")
    updates_args.add_argument("--concurrency", type=int, default=48, help="requests per engine")
    updates_args.add_argument("--max-running", type=int, default=64)
    updates_args.add_argument("--prompt-len", type=int, default=16)
    updates_args.add_argument("--new-tokens", type=_range, default=(64, 192), metavar="LO,HI")
    print(json.dumps(main(parser.parse_args())), flush=True)
