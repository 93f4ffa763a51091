"""What streaming costs an aiohttp server with nothing to compute: the floor under the engine's.

Run (prints one JSON line):

    python bench/stream_floor.py [--rounds 6] [--seconds 3] [--tokens 5] [--group 4]

A server on aiohttp and uvloop (what ``inflight engine`` serves HTTP with) answers two routes
whose answers are ready-made bytes, paced by one timer that steps every live request together
every ``--step-ms``, as the engine's scheduler hands a model pass's tokens over:

- ``/plain``: one JSON body (``--group`` samples' answers) after ``--tokens`` steps, as a
  request that is not streamed is answered (``web.Response``);
- ``/stream``: server-sent events, written as the engine writes a stream
  (``stages.engine.streaming.write_events``): the headers with the first step's events through
  aiohttp, the events of each step after it straight to the connection from the stepping
  callback, the last step's with ``data: [DONE]`` through aiohttp's ``write_eof``.

The events and bodies are the sizes of the engine's for ``n`` 4 on arith-tiny (a chunk a sample
and step; four answers with log-probs). A client on this machine keeps ``--in-flight`` samples
in flight (requests of ``--group``), as ``bench/engine_profile.py compare`` does, and the
server's CPU per request is taken over short phases of each route in turn, ``--rounds`` times,
the order reversed every other round. Reported: each route's CPU per request (median, min and
max), and the stream's extra per request and per sample (median of the rounds' paired
differences): what a stream costs before any chunk is built, to set beside the engine's
``n-stream`` over ``n``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JSON = {"Content-Type": "application/json"}  # engines read a body as JSON only when told
sys.path.insert(0, str(ROOT))

from bench._engines import free_port, wait_health  # noqa: E402

# a native chunk of n-stream (one sample's output so far) and a sample's whole answer, the
# sizes of the engine's on arith-tiny (5 tokens, log-probs, compact JSON)
_META = {"id": "0" * 32, "finish_reason": None, "prompt_tokens": 5, "reasoning_tokens": 0}
_CHUNK = {"text": "12", "output_ids": [5, 6], "meta_info": {**_META, "completion_tokens": 2}}
_CHUNK["meta_info"].update(
    cached_tokens=0,
    weight_version="default",
    input_token_logprobs=[],
    output_token_logprobs=[[-0.51, 5, None], [-0.02, 6, None]],
    output_token_logprobs_length=2,
)
_CHUNK["index"] = 0
_ANSWER = {
    "text": "1234",
    "output_ids": [5, 6, 7, 8, 2],
    "meta_info": {
        **_META,
        "finish_reason": {"type": "stop", "matched": 2},
        "completion_tokens": 5,
        "cached_tokens": 0,
        "weight_version": "default",
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.51, 5, None]] * 5,
        "output_token_logprobs_length": 5,
        "output_token_weight_versions": ["default"] * 5,
        "e2e_latency": 0.0123,
    },
}


def _serve(port: int, tokens: int, group: int, step_s: float) -> None:
    import uvloop
    from aiohttp import web

    event = b"data: " + json.dumps(_CHUNK, separators=(",", ":")).encode() + b"\n\n"
    events = event * group  # a step's events of one request: one write
    body = json.dumps([_ANSWER] * group, separators=(",", ":")).encode()
    live: list[list[Any]] = []  # [steps left, future, transport or None]

    class EventStream(web.StreamResponse):
        _send_headers_immediately = False  # the headers go with the first events, as the engine's

    def step() -> None:
        done = []
        for entry in live:
            entry[0] -= 1
            left, future, transport = entry
            if left == 0:
                done.append(entry)
                future.set_result(None)
            elif transport is not None:  # a stream past its first events: straight to it
                transport.write(b"%x\r\n%b\r\n" % (len(events), events))
        for entry in done:
            live.remove(entry)
        asyncio.get_running_loop().call_later(step_s, step)

    def wait(steps: int, transport: Any = None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        live.append([steps, future, transport])
        return future

    async def plain(request: web.Request) -> web.Response:
        await request.read()
        await wait(tokens)
        return web.Response(body=body, content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        await wait(1)
        response = EventStream(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(events)  # the headers with the first step's events
        await wait(tokens - 1, request.transport)
        await response.write_eof(events + b"data: [DONE]\n\n")
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/plain", plain)
        app.router.add_post("/stream", stream)
        app.router.add_get("/health", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        asyncio.get_running_loop().call_later(step_s, step)
        await asyncio.Event().wait()

    uvloop.run(main())


async def _drive(url: str, seconds: float, connections: int) -> int:
    """Requests answered in ``seconds``, ``connections`` of them in flight at a time."""
    import aiohttp

    answered = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def worker() -> None:
            nonlocal answered
            while time.monotonic() < stop:
                async with session.post(url, data=b'{"input_ids": [5, 6, 7]}', headers=JSON) as r:
                    await r.read()
                    answered += r.status == 200

        await asyncio.gather(*(worker() for _ in range(connections)))
    return answered


def _cpu(pid: int) -> float:
    """The process's CPU seconds so far (user and system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--tokens", type=int, default=5, help="steps a request takes")
    parser.add_argument("--group", type=int, default=4, help="samples a request")
    parser.add_argument("--in-flight", type=int, default=64, help="samples in flight")
    parser.add_argument("--step-ms", type=float, default=6.0, help="time between two steps")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server's own process
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens: at least 2 (a first event and a last)")
    if args.serve is not None:
        _serve(args.serve, args.tokens, args.group, args.step_ms / 1000)
        return 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--tokens", str(args.tokens),
         "--group", str(args.group), "--step-ms", str(args.step_ms)],
    )  # fmt: skip
    connections = max(1, args.in_flight // args.group)
    per_request: dict[str, list[float]] = {"plain": [], "stream": []}
    try:
        wait_health(url, server, timeout=30)
        for r in range(args.rounds):
            for route in ("plain", "stream") if r % 2 == 0 else ("stream", "plain"):
                asyncio.run(_drive(f"{url}/{route}", 0.5, connections))  # settle
                before = _cpu(server.pid)
                answered = asyncio.run(_drive(f"{url}/{route}", args.seconds, connections))
                per_request[route].append(1e6 * (_cpu(server.pid) - before) / max(1, answered))
    finally:
        server.terminate()
        server.wait(30)
    extra = [s - p for p, s in zip(per_request["plain"], per_request["stream"], strict=True)]
    print(
        json.dumps(
            {
                "bench": "stream_floor",
                "tokens": args.tokens,
                "group": args.group,
                "in_flight": args.in_flight,
                "step_ms": args.step_ms,
                "rounds": args.rounds,
                "server_cpu_us_per_request": {k: _spread(v) for k, v in per_request.items()},
                "stream_extra_us_per_request": _spread(extra),
                "stream_extra_us_per_sample": _spread([e / args.group for e in extra]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
