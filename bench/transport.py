"""Channel throughput against raw pyzmq, between two processes over ipc.

Run: ``python bench/transport.py [--size-mb 64 --count 32 --small-count 20000]``
CURVE's cost: ``python bench/transport.py --curve`` (the channel with and without CURVE, tcp).

Measures (1) small messages (a ~100-byte payload) in messages/s and (2) large messages (one
``--size-mb`` bfloat16 torch tensor each) in GB/s, each through a Sender -> Receiver channel
and through raw pyzmq sending the same encoded frames (``send_multipart(copy=False)``) on the
same socket types (DEALER -> ROUTER) and transport (ipc). The receiver runs in a spawned child
process and times the steady state: from the end of a short warm-up to the last message. The
raw baseline is bounded the same way as the channel (high-water mark = channel capacity) so
neither side can queue gigabytes. Prints exactly one JSON line on stdout.

With ``--curve`` the two sides are the channel without and with CURVE (the run's keys, as
off one host), over tcp on loopback: ``ratio`` is CURVE's throughput over plain.

It measures throughput only: no latency percentiles, no multi-producer fan-in, no GPU copies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

# This file is bench/transport.py: run as a script, its folder comes first on sys.path and
# would shadow the transport package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

from transport import Message, Receiver, Schema, Sender, encode, ipc_address, tcp_address
from transport.security import CurveKeys

SMALL = Schema("small", 1, {"id": "int", "payload": "bytes"})
LARGE = Schema("large", 1, {"id": "int", "weights": "array"})
WARMUP = {"small": 500, "large": 2}


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # the actors' loop when installed
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _loop_name() -> str:
    loop = _loop()
    loop.close()
    return type(loop).__module__.split(".")[0]


# ---------------------------------------------------------------------------------------------
# receiver side (child process)


def receive(
    mode: str, kind: str, address: str, total: int, capacity: int, conn: Any, curve: Any
) -> None:
    """Child entry point: receive ``total`` messages, report the steady-state timing."""
    quiet_logs()
    if mode == "raw":
        conn.send(_receive_raw(address, total, capacity, conn))
        return
    loop = _loop()
    try:
        receiving = _receive_channel(kind, address, total, capacity, conn, curve)
        conn.send(loop.run_until_complete(receiving))
    finally:
        loop.close()


def _receive_raw(address: str, total: int, capacity: int, conn: Any) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.rcvhwm = capacity
    sock.bind(address)
    conn.send("ready")
    warmup = total - conn.recv()
    nbytes = 0
    for i in range(total):
        frames = sock.recv_multipart(copy=False)
        if i == warmup - 1:
            start = time.perf_counter()
        elif i >= warmup:
            nbytes += sum(len(f) for f in frames[1:])
    elapsed = time.perf_counter() - start
    sock.close()
    ctx.term()
    return {"elapsed_s": elapsed, "messages": total - warmup, "bytes": nbytes}


async def _receive_channel(
    kind: str, address: str, total: int, capacity: int, conn: Any, curve: CurveKeys | None
) -> dict:
    ctx = zmq.asyncio.Context()
    r = Receiver(
        "bench",
        address,
        [SMALL, LARGE],
        capacity=capacity,
        expected_producers=["bench.0"],
        ctx=ctx,
        curve=curve,
    )
    await r.start()
    conn.send("ready")
    warmup = total - conn.recv()
    i = 0
    async for msg in r:
        if i == warmup - 1:
            start = time.perf_counter()
            received = r.stats()["bytes"]
        if kind == "large":
            assert msg.data["weights"].numel() > 0  # decoded (zero-copy) into a tensor
        i += 1
    elapsed = time.perf_counter() - start
    stats = r.stats()
    await r.aclose()
    ctx.term()
    return {
        "elapsed_s": elapsed,
        "messages": i - warmup,
        "bytes": stats["bytes"] - received,
        "rejected": sum(stats["rejected"].values()),
    }


# ---------------------------------------------------------------------------------------------
# sender side (this process)


def message(kind: str, size_mb: int) -> Message:
    if kind == "small":
        return Message("small", {"id": 1, "payload": os.urandom(100)})
    import torch

    weights = torch.ones(size_mb * 1024 * 1024 // 2, dtype=torch.bfloat16)
    return Message("large", {"id": 1, "weights": weights})


def send_raw(address: str, msg: Message, count: int, capacity: int, conn: Any) -> dict:
    frames = encode(msg)  # the same bytes the channel sends, encoded once
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = capacity
    sock.connect(address)
    try:
        for _ in range(count):
            sock.send_multipart(frames, copy=False)
        # Close only once everything arrived: a peer closing while the receiver's pipe is full
        # can lose the unread tail (raw ZeroMQ has no end-of-stream handshake).
        return wait_result(conn, "raw")
    finally:
        sock.close()
        ctx.term()


def wait_result(conn: Any, what: str) -> dict:
    if not conn.poll(120):
        raise RuntimeError(f"{what}: receiver did not finish")
    return conn.recv()


async def send_channel(
    address: str, msg: Message, count: int, curve: CurveKeys | None = None
) -> dict:
    ctx = zmq.asyncio.Context()
    s = Sender("bench", [address], [SMALL, LARGE], identity="bench.0", ctx=ctx, curve=curve)
    await s.start()
    for _ in range(count):
        await s.send(msg.kind, msg.data)
    await s.aclose(timeout_s=30)
    ctx.term()
    return s.stats()


def run_one(
    mode: str, kind: str, msg: Message, count: int, capacity: int, scheme: str = "ipc"
) -> dict:
    """One timed run; ``mode``: raw (pyzmq), channel, or curve (the channel with CURVE)."""
    total = count + WARMUP[kind]
    curve = CurveKeys.generate() if mode == "curve" else None
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        address = ipc_address(tmp, "in") if scheme == "ipc" else tcp_address()
        spawn = mp.get_context("spawn")
        parent, child = spawn.Pipe()
        args = (mode, kind, address, total, capacity, child, curve)
        proc = spawn.Process(target=receive, args=args)
        proc.start()
        try:
            if not parent.poll(60) or parent.recv() != "ready":
                raise RuntimeError(f"{mode}/{kind}: receiver did not start")
            parent.send(count)
            if mode == "raw":
                result = send_raw(address, msg, total, capacity, parent)
            else:
                loop = _loop()
                try:
                    sent = loop.run_until_complete(send_channel(address, msg, total, curve))
                finally:
                    loop.close()
                result = wait_result(parent, "channel")
                result["credit_wait_s"] = sent["credit_wait_s"]
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if result["messages"] != count:
        raise RuntimeError(f"{mode}/{kind}: received {result['messages']} of {count}")
    return result


def quiet_logs() -> None:
    """Warnings and errors only, on stderr: stdout carries the one JSON line."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def rate(kind: str, result: dict) -> float:
    if kind == "small":
        return result["messages"] / result["elapsed_s"]
    return result["bytes"] / result["elapsed_s"] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=64, help="large message size (MiB)")
    parser.add_argument("--count", type=int, default=32, help="large messages per run")
    parser.add_argument("--small-count", type=int, default=20000, help="small messages per run")
    parser.add_argument(
        "--capacity",
        type=int,
        default=64,
        help="channel inbox bound for small messages (the default inbox)",
    )
    parser.add_argument(
        "--large-capacity",
        type=int,
        default=4,
        help="channel inbox bound for large messages (bounds memory in flight)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="runs per measurement, raw and channel alternating; medians reported",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="CURVE's cost: the channel without and with CURVE, over tcp on loopback",
    )
    args = parser.parse_args()
    quiet_logs()
    base, other = ("channel", "curve") if args.curve else ("raw", "channel")
    scheme = "tcp" if args.curve else "ipc"

    out: dict[str, Any] = {"bench": "transport_curve" if args.curve else "transport"}
    samples: dict[str, dict[str, list[float]]] = {}
    credit_wait: dict[str, float] = {}
    for kind, key, count, capacity, digits in (
        ("small", "small_msgs_per_s", args.small_count, args.capacity, 0),
        ("large", "large_gb_per_s", args.count, args.large_capacity, 3),
    ):
        msg = message(kind, args.size_mb)
        rates: dict[str, list[float]] = {base: [], other: []}
        waits = []
        for _ in range(args.repeat):
            for mode in (base, other):
                result = run_one(mode, kind, msg, count, capacity, scheme)
                rates[mode].append(rate(kind, result))
                if mode == other:
                    waits.append(result["credit_wait_s"])
        low, high = statistics.median(rates[base]), statistics.median(rates[other])
        out[key] = {
            other: round(high, digits),
            base: round(low, digits),
            "ratio": round(high / low, 3),
        }
        samples[kind] = {mode: [round(r, digits) for r in rs] for mode, rs in rates.items()}
        credit_wait[kind] = round(statistics.median(waits), 3)
    out.update(
        {
            "size_mb": args.size_mb,
            "count": args.count,
            "small_count": args.small_count,
            "small_payload_bytes": 100,
            "capacity": args.capacity,
            "large_capacity": args.large_capacity,
            "repeat": args.repeat,
            "samples": samples,
            "channel_credit_wait_s": credit_wait,
            "transport": scheme,
            "sockets": "DEALER->ROUTER",
            "loop": _loop_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "zmq": zmq.zmq_version(),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
