"""Weight publishing against a raw broadcast of the same bytes, to two live engine processes.

Run: ``python bench/publish.py [--bucket-mb 64 --runs 7 --dtype bfloat16 --backend gloo]``

Builds a random Qwen2-style model of about 50M parameters with Hugging Face names (bfloat16 by
default: what an engine serves), starts two engine processes that answer SGLang's
``/init_weights_update_group`` and ``/update_weights_from_distributed`` with a ``WeightReceiver``
(the routes as in ``tests/stages/test_weights_publisher.py``), connects one ``WeightPublisher``
and times, per run:

- ``publish``: ``WeightPublisher.publish`` of all weights (pack, announce each bucket over HTTP,
  broadcast, unpack, every engine answers);
- ``raw``: the same bucket sizes, packed beforehand, broadcast in the same group after one HTTP
  request that tells the engines to receive that many bytes (``/bench_raw_receive``).

Prints exactly one JSON line on stdout (medians over ``--runs``; logs go to stderr). Engines
receive into fresh buffers and do not copy into a model, so this measures publishing overhead,
not model loading. Not measured: NCCL, more than two engines, tensor-parallel engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import structlog
import torch
from aiohttp import web

# Run as a script, this folder comes first on sys.path; keep the repo's packages importable.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

from stages.weights.buckets import pack_buckets
from stages.weights.publisher import WeightPublisher
from stages.weights.receiver import WeightReceiver


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
    """One engine process: SGLang's two weight routes plus the raw-broadcast baseline route."""
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

    async def raw_receive(request: web.Request) -> web.Response:
        sizes = (await request.json())["sizes"]

        def receive_all() -> None:
            assert receiver._group is not None
            for size in sizes:
                receiver._group.broadcast(torch.empty(size, dtype=torch.uint8), src=0)

        await asyncio.to_thread(receive_all)
        return answer(True, "received")

    app = web.Application(client_max_size=1 << 26)
    app.add_routes(
        [
            web.post("/init_weights_update_group", init_group),
            web.post("/update_weights_from_distributed", update),
            web.post("/update_weight_version", lambda _: answer(True, "version set")),
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


async def main(args: argparse.Namespace) -> dict[str, Any]:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    dtype = getattr(torch, args.dtype)
    weights = qwen2_style(dtype)
    params = sum(t.numel() for _, t in weights)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    bucket_bytes = int(args.bucket_mb * 2**20)
    flats = [b.flat for b in pack_buckets(weights, bucket_bytes)]

    ctx = mp.get_context("spawn")
    procs, urls = [], []
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
    publish_s: list[float] = []
    raw_s: list[float] = []
    try:
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
        await pub.close()
        for p in procs:
            p.kill()
            p.join(timeout=5)
    publish, raw = statistics.median(publish_s), statistics.median(raw_s)
    return {
        "bench": "publish",
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
        "cpus": mp.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument(
        "--load-format", default="flattened_bucket", type=lambda s: None if s == "none" else s
    )
    print(json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
