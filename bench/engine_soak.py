"""Whether a built-in engine survives what RL and agent code throws at it at once.

Run (prints one JSON line; exit 1 when it finds a problem):

    python bench/engine_soak.py [--seconds 60] [--clients 12] [--seed 0] [--max-running 32]
        [--engine-args "--enable-metrics --stream-interval 3 ..."]

``inflight engine`` (``python -m stages.engine.server``, as users start it) on arith-tiny with a
pass-through chat template (and ``--engine-args``), driven by ``--clients`` connections for
``--seconds``, each sending one request after another, its kind drawn at random:

- ``/generate``: ``n`` 4 with stop strings and log-probs, batches (texts and ids), streamed
  (read whole, or dropped after one to three events), prefill-only scoring (``max_new_tokens``
  0, the prompt's log-probs), a request aborted by its ``rid`` while it runs, bodies SGLang
  refuses, and a raw socket that sends a request and closes at once;
- constrained decoding: a ``regex`` (``/generate``, streamed or not, and
  ``/v1/completions``), a ``json_schema`` (``/generate``) or a chat ``response_format``, a
  pattern not seen before now and then (compiled while the load goes on), at times aborted by
  its ``rid`` at once (while it compiles: SGLang's 400 ``Aborted by AbortReq.``, the
  ``/v1`` streams' error event); a regex answer that stops must match its pattern whole;
- the OpenAI routes: streamed chat (dropped mid-stream or read whole, ``n`` up to 2,
  log-probs, usage), chat with tools, completions (text, ids, lists, ``echo``, streamed),
  Responses (streamed or not), Anthropic's messages, tokenize and detokenize, Ollama's chat;
- a prompt given as embeddings (``input_embeds``, at times streamed or a batch): served by an
  engine without the prefix cache (``--engine-args=--disable-radix-cache``), else SGLang's 400;
- the engine's state: ``/v1/loads``, ``/server_info``, ``/model_info``, ``/v1/models``,
  ``/health_generate``;

and a new engine every 2-5 s takes this one's weights (``--load-format remote_instance``),
while one more connection, every 0.2-0.8 s, pauses generation (``abort``, ``retract`` or
``in_place``) and continues it, releases the KV cache and the weights while paused and takes
them back (a colocated trainer's turn; refused with a 400 while a new engine is taking the
weights, which is then what that release must get), reloads the weights from disk, sets a new
weight version (aborting everything, at times) or flushes the cache.

A problem is: an answer whose status is not the one its kind expects (a 5xx above all), an
abort that does not end as SGLang ends one, a scored prompt without its log-probs, a request
still running or waiting once the load stops, ``/health_generate`` not 200 then, a greedy
answer then that differs from the one before the load (the weights not as they were after
all the releases and reloads), a new engine that serves another greedy answer or neither
comes up nor exits saying the weights were released, or a traceback in the engine's log.
Reported: the answers by kind and status, the problems (each kind's count and first five),
the refusals the engine counted (``/server_info``'s ``refused_requests``), and the engine's
resident memory at the start, every tenth of the run and at the end (what it keeps growing
by, if anything).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402

from bench._engines import engine_server, free_port  # noqa: E402

ARITH = ROOT / "configs" / "models" / "arith-tiny"
PASS_THROUGH = "{% for m in messages %}{{ m.content }}{% endfor %}"
# how SGLang 0.5.23 ends an aborted request: running, or waiting (stages/engine/scheduler.py)
ABORT_MESSAGES = {"Aborted", "Abort in waiting queue"}
# a release while a new engine takes this one's weights (/send_weights_to_remote_instance)
LENDING = "the weights are being sent to a remote instance"
COMPILING = "Aborted by AbortReq."  # aborted while its grammar compiled: SGLang's 400
RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class Soak:
    """The answers seen, and the problems among them (see the module's docstring)."""

    def __init__(
        self, url: str, rng: random.Random, *, reasoning: bool = False, embeds: bool = False
    ) -> None:
        self.url, self.rng = url, rng
        self.reasoning = reasoning  # the engine has a --reasoning-parser
        # the engine serves input_embeds prompts (no prefix cache), else refuses them
        self.serves_embeds = embeds
        self.model = "default"  # the served model's name (/v1/models), for /v1/responses
        self.answers: collections.Counter[str] = collections.Counter()
        # per kind: how many problems, and the first few
        self.problems: dict[str, dict[str, Any]] = {}

    def problem(self, kind: str, what: str) -> None:
        found = self.problems.setdefault(kind, {"count": 0, "first": []})
        found["count"] += 1
        if len(found["first"]) < 5:
            found["first"].append(what[:400])

    def seen(self, kind: str, status: int, expected: tuple[int, ...] = (200,)) -> bool:
        self.answers[f"{kind} {status}"] += 1
        if status not in expected:
            self.problem(kind, f"status {status}, expected {expected}")
            return False
        return True

    def finished(self, kind: str, meta: dict[str, Any], aborts: set[str] = ABORT_MESSAGES) -> None:
        """A native answer's finish reason: stop, length, or an abort as SGLang's."""
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort" and reason.get("message") not in aborts:
            self.problem(kind, f"abort reason {reason}")
        elif reason.get("type") not in ("stop", "length", "abort"):
            self.problem(kind, f"finish reason {reason}")

    # -- the request kinds ---------------------------------------------------------------------
    def _native(self, *, stream: bool = False, n: int = 4, **params: Any) -> dict[str, Any]:
        rng = self.rng
        sampling = {"temperature": 1.0, "max_new_tokens": rng.randint(int(stream), 12), "n": n}
        if rng.random() < 0.3:
            sampling["stop"] = ["1", "22"]
        return {
            "text": f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=",
            "stream": stream,
            "return_logprob": rng.random() < 0.5,
            "sampling_params": {**sampling, **params},
        }

    async def generate(self, s: aiohttp.ClientSession) -> None:
        async with s.post(self.url + "/generate", json=self._native()) as r:
            answer = await r.json()
            if self.seen("generate", r.status):
                for sample in answer:
                    self.finished("generate", sample["meta_info"])

    async def batch(self, s: aiohttp.ClientSession) -> None:
        body = self._native(n=1)
        if self.rng.random() < 0.5:
            body["text"] = [body["text"], "3+4=", "5-2="]
        else:
            del body["text"]
            body["input_ids"] = [[5, 6, 7], [8, 9]]
        async with s.post(self.url + "/generate", json=body) as r:
            await r.read()
            self.seen("batch", r.status)

    async def stream(self, s: aiohttp.ClientSession) -> None:
        drop = self.rng.choice([None, None, 1, 2, 3])
        async with s.post(self.url + "/generate", json=self._native(stream=True)) as r:
            if self.seen("stream", r.status):
                await self._events("stream", r, drop, native=True)

    async def _events(
        self, kind: str, r: aiohttp.ClientResponse, drop: int | None, *, native: bool = False
    ) -> None:
        """Read server-sent events (leave after ``drop`` of them); the stream must end with
        ``[DONE]``, a native one's chunks as SGLang's."""
        count = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return
            chunk = json.loads(line[6:])
            if native and chunk["meta_info"]["finish_reason"] is not None:
                self.finished(kind, chunk["meta_info"])
            count += 1
            if drop is not None and count >= drop:
                return
        self.problem(kind, "the stream ended without [DONE]")

    async def score(self, s: aiohttp.ClientSession) -> None:
        prompt = [5, 6, 7, 8, 9]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
        async with s.post(self.url + "/generate", json=body) as r:
            meta = (await r.json())["meta_info"] if self.seen("score", r.status) else {}
        if meta and meta["finish_reason"]["type"] != "abort":
            if len(meta["input_token_logprobs"]) != len(prompt):
                self.problem("score", f"{len(meta['input_token_logprobs'])} prompt log-probs")

    async def embeds(self, s: aiohttp.ClientSession) -> None:
        """A prompt given as embeddings (``input_embeds``), at times streamed or a batch:
        served without the prefix cache, SGLang's 400 with it."""
        width = json.loads((ARITH / "config.json").read_text())["hidden_size"]
        rows = [
            [self.rng.gauss(0, 0.5) for _ in range(width)] for _ in range(self.rng.randint(1, 6))
        ]
        body = self._native(stream=self.rng.random() < 0.3, n=self.rng.choice([1, 2]))
        del body["text"]
        body["input_embeds"] = [rows, rows[:1]] if self.rng.random() < 0.3 else rows
        async with s.post(self.url + "/generate", json=body) as r:
            if not self.seen("embeds", r.status, (200,) if self.serves_embeds else (400,)):
                return
            if not self.serves_embeds:
                await r.read()
            elif body["stream"]:
                await self._events("embeds", r, None, native=True)
            else:
                answer = await r.json()
                for sample in answer if isinstance(answer, list) else [answer]:
                    self.finished("embeds", sample["meta_info"])

    async def abort(self, s: aiohttp.ClientSession) -> None:
        rid = f"soak-{self.rng.random()}"
        body = {**self._native(n=1), "rid": rid}
        body["sampling_params"].update(max_new_tokens=20, stop=None)
        sent = asyncio.ensure_future(s.post(self.url + "/generate", json=body))
        await asyncio.sleep(self.rng.random() * 0.05)
        async with s.post(self.url + "/abort_request", json={"rid": rid}) as r:
            self.seen("abort_request", r.status)
        async with await sent as r:
            if self.seen("aborted", r.status):
                self.finished("aborted", (await r.json())["meta_info"])

    async def refused(self, s: aiohttp.ClientSession) -> None:
        body = self.rng.choice([
            {"text": 5},
            {"text": "x", "sampling_params": {"n": "x"}},
            {"text": "x", "logprob_start_len": 99, "return_logprob": True},
            {"text": "x", "return_logprob": "no"},
        ])  # fmt: skip
        async with s.post(self.url + "/generate", json=body) as r:
            await r.read()
            self.seen("refused", r.status, (400,))

    async def dropped(self, s: aiohttp.ClientSession) -> None:
        """A client that sends a whole request and closes its socket at once."""
        host, port = self.url[len("http://") :].split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(self._native(stream=self.rng.random() < 0.5)).encode()
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await asyncio.sleep(self.rng.random() * 0.02)
        writer.close()
        self.answers["dropped"] += 1

    async def grammar(self, s: aiohttp.ClientSession) -> None:
        """A constrained request (see the module's docstring), aborted at once at times."""
        rng = self.rng
        k = rng.randint(1, 8) if rng.random() < 0.7 else rng.randint(9, 400)  # new at times
        regex, rid = f"[0-9]{{{k}}}", f"soak-g{rng.random()}"
        route = rng.choice(["generate", "generate", "schema", "completions", "chat"])
        stream = route != "schema" and rng.random() < 0.4
        params = {"temperature": 1.0, "max_new_tokens": min(k, 12) + 1}
        if route in ("generate", "schema"):
            path = "/generate"
            params.update(
                {"regex": regex} if route == "generate" else
                {"json_schema": json.dumps({"enum": [rng.randint(0, 10 ** (k % 9 + 1))]})}
            )  # fmt: skip
            body = {"text": "7+8=", "rid": rid, "stream": stream, "sampling_params": params}
        elif route == "completions":
            path = "/v1/completions"
            body = {"model": "m", "prompt": "7+8=", "max_tokens": params["max_new_tokens"],
                    "regex": regex, "rid": rid, "stream": stream}  # fmt: skip
        else:
            path = "/v1/chat/completions"
            schema = {"type": "integer", "maximum": 10 ** (k % 15 + 1) + k}  # new at times
            answer_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
            body = {"model": "m", "messages": [{"role": "user", "content": "7+8="}],
                    "max_tokens": 12, "rid": rid, "stream": stream,
                    "response_format": answer_format}  # fmt: skip
        kind = f"grammar-{route}" + ("-stream" if stream else "")
        sent = asyncio.ensure_future(s.post(self.url + path, json=body))
        if rng.random() < 0.3:
            await asyncio.sleep(rng.random() * 0.01)
            async with s.post(self.url + "/abort_request", json={"rid": rid}) as r:
                self.seen("abort_request", r.status)
        async with await sent as r:
            data = await r.read()
        if r.status == 400 and COMPILING.encode() in data:
            self.answers[f"{kind} 400 compiling"] += 1
            return
        if not self.seen(kind, r.status):
            return
        if stream:
            events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                self.problem(kind, "the stream ended without [DONE]")
                return
            chunks = [json.loads(event) for event in events[:-1]]
            errors = [chunk["error"] for chunk in chunks if "error" in chunk]
            if any(error.get("message") != COMPILING for error in errors):
                self.problem(kind, f"error event {errors}")
            elif errors:
                self.answers[f"{kind} error event"] += 1
            elif route == "generate" and chunks:
                self.finished(kind, chunks[-1]["meta_info"], ABORT_MESSAGES | {COMPILING})
            return
        answer = json.loads(data)
        if route in ("generate", "schema"):
            meta = answer["meta_info"]
            self.finished(kind, meta)
            reason = meta["finish_reason"]
            if (
                route == "generate"
                and reason["type"] == "stop"
                and not re.fullmatch(regex, answer["text"])
            ):
                self.problem(kind, f"{answer['text']!r} stopped outside {regex}")
        elif route == "chat" and answer["choices"][0]["finish_reason"] == "stop":
            # (with --reasoning-parser the schema holds from the reasoning's end on, which
            # arith-tiny never writes: its end tag is 8 unknown tokens, as SGLang encodes it)
            message = answer["choices"][0]["message"]
            content = message["content"] or ""
            if not self.reasoning and not re.fullmatch(r"-?[0-9]+", content.strip()):
                self.problem(kind, f"{message} stopped outside its schema")

    async def chat(self, s: aiohttp.ClientSession) -> None:
        rng = self.rng
        body = {
            "model": "m", "messages": [{"role": "user", "content": "12+5="}],
            "n": rng.choice([1, 2]), "stream": True, "max_tokens": rng.randint(1, 10),
            "logprobs": rng.random() < 0.5, "stream_options": {"include_usage": True},
        }  # fmt: skip
        async with s.post(self.url + "/v1/chat/completions", json=body) as r:
            if self.seen("chat-stream", r.status):
                await self._events("chat-stream", r, rng.choice([None, None, 1, 3]))

    async def tools(self, s: aiohttp.ClientSession) -> None:
        add = {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        }
        body = {"model": "m", "messages": [{"role": "user", "content": "3+3="}], "max_tokens": 8,
                "tools": [{"type": "function", "function": add}],
                "stream": self.rng.random() < 0.5}  # fmt: skip
        async with s.post(self.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            self.seen("chat-tools", r.status)

    async def completions(self, s: aiohttp.ClientSession) -> None:
        rng = self.rng
        body = {
            "model": "m", "prompt": rng.choice(["1+1=", [5, 6, 7], ["2+2=", "3+3="]]),
            "max_tokens": rng.randint(1, 8), "logprobs": rng.choice([None, 0, 2]),
            "echo": rng.random() < 0.3, "stream": rng.random() < 0.5, "n": rng.choice([1, 3]),
        }  # fmt: skip
        async with s.post(self.url + "/v1/completions", json=body) as r:
            await r.read()
            self.seen("completions", r.status)

    async def responses(self, s: aiohttp.ClientSession) -> None:
        body = {"model": self.model, "input": "3+4=", "max_output_tokens": self.rng.randint(3, 8),
                "stream": self.rng.random() < 0.5}  # fmt: skip
        async with s.post(self.url + "/v1/responses", json=body) as r:
            await r.read()
            self.seen("responses", r.status)

    async def messages(self, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "max_tokens": self.rng.randint(1, 8),
                "stream": self.rng.random() < 0.5,
                "messages": [{"role": "user", "content": "5+5="}]}  # fmt: skip
        async with s.post(self.url + "/v1/messages", json=body) as r:
            await r.read()
            self.seen("messages", r.status)

    async def tokens(self, s: aiohttp.ClientSession) -> None:
        async with s.post(self.url + "/v1/tokenize", json={"model": "m", "prompt": "12+34="}) as r:
            tokens = (await r.json())["tokens"] if self.seen("tokenize", r.status) else [5]
        async with s.post(self.url + "/v1/detokenize", json={"model": "m", "tokens": tokens}) as r:
            await r.read()
            self.seen("detokenize", r.status)

    async def ollama(self, s: aiohttp.ClientSession) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "1+1="}],
                "stream": self.rng.random() < 0.5, "options": {"num_predict": 4}}  # fmt: skip
        async with s.post(self.url + "/api/chat", json=body) as r:
            await r.read()
            self.seen("ollama", r.status)

    async def state(self, s: aiohttp.ClientSession) -> None:
        path = self.rng.choice(["/v1/loads", "/server_info", "/model_info", "/v1/models"])
        async with s.get(self.url + path) as r:
            await r.read()
            self.seen("state", r.status)
        async with s.get(self.url + "/health_generate") as r:  # 503 while paused in place
            self.seen("health_generate", r.status, (200, 503))

    # -- the drivers ---------------------------------------------------------------------------
    def kinds(self) -> list[Callable[[aiohttp.ClientSession], Awaitable[None]]]:
        return [
            self.generate, self.batch, self.stream, self.score, self.abort, self.refused,
            self.dropped, self.grammar, self.chat, self.tools, self.completions, self.responses,
            self.messages, self.tokens, self.ollama, self.state, self.embeds,
        ]  # fmt: skip

    async def client(self, stop: float) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            kinds = self.kinds()
            while time.monotonic() < stop:
                kind = self.rng.choice(kinds)
                try:
                    await kind(s)
                except RETRYABLE as exc:
                    self.problem(kind.__name__, f"{type(exc).__name__}: {exc}")

    async def replicas(self, stop: float, greedy: dict[str, Any], want: list[int]) -> None:
        """Every 2-5 s a new engine takes this one's weights (``--load-format
        remote_instance``) while the load and the controls go on: it must come up answering
        ``greedy`` with ``want`` (the weights as they are, whatever the releases and reloads),
        or exit saying this engine's weights were released (a colocated trainer's turn), never
        hang and never serve other weights."""
        seed_port = self.url.rsplit(":", 1)[1]
        while time.monotonic() + 5 < stop:
            await asyncio.sleep(self.rng.uniform(2, 5))
            port = free_port()
            cmd = [sys.executable, "-m", "stages.engine.server", "--model", str(ARITH),
                   "--port", str(port), "--load-format", "remote_instance",
                   "--remote-instance-weight-loader-seed-instance-ip", "127.0.0.1",
                   "--remote-instance-weight-loader-seed-instance-service-port", seed_port,
                   "--remote-instance-weight-loader-send-weights-group-ports",
                   f"[{free_port()}]"]  # fmt: skip
            with tempfile.TemporaryFile() as out:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdout=out, stderr=out, cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                try:
                    await self._replica(proc, f"http://127.0.0.1:{port}", out, greedy, want)
                finally:
                    if proc.returncode is None:
                        proc.terminate()
                        await proc.wait()

    async def _replica(
        self, proc: Any, url: str, out: Any, greedy: dict[str, Any], want: list[int]
    ) -> None:
        deadline = time.monotonic() + 120
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    out.seek(0)
                    said = out.read().decode(errors="replace")
                    if "the weights are released" in said:
                        self.answers["replica refused (weights released)"] += 1
                    else:
                        self.problem("replica", f"exited {proc.returncode}: {said[-600:]}")
                    return
                try:
                    async with s.post(url + "/generate", json=greedy) as r:
                        if r.status == 200:
                            got = (await r.json())["output_ids"]
                            self.answers["replica up"] += 1
                            if got != want:
                                self.problem("replica", f"greedy {got}, the seed's {want}")
                            return
                except RETRYABLE:
                    pass
                await asyncio.sleep(0.3)
        self.problem("replica", "not up and not exited 120 s after it started")

    async def control(self, stop: float) -> None:
        version = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            while time.monotonic() < stop:
                await asyncio.sleep(self.rng.uniform(0.2, 0.8))
                version += 1
                action = self.rng.choice(["pause", "memory", "disk", "version", "flush"])
                if action == "pause":
                    mode = self.rng.choice(["abort", "retract", "in_place"])
                    calls = [("/pause_generation", {"mode": mode}), ("/continue_generation", {})]
                elif action == "memory":  # a colocated trainer's turn: paused, memory let go
                    mode = self.rng.choice(["abort", "retract"])
                    calls = [
                        ("/pause_generation", {"mode": mode}),
                        ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                        ("/resume_memory_occupation", {"tags": ["weights"]}),
                        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
                        ("/continue_generation", {}),
                    ]
                elif action == "disk":
                    body = {"model_path": str(ARITH), "weight_version": f"d{version}"}
                    calls = [("/update_weights_from_disk", body)]
                elif action == "version":
                    aborts = self.rng.random() < 0.3
                    body = {"new_version": f"v{version}", "abort_all_requests": aborts}
                    calls = [("/update_weight_version", body)]
                else:
                    calls = [("/flush_cache", {})]
                lending = False  # a release refused while a new engine takes the weights
                for path, body in calls:
                    if lending and path == "/resume_memory_occupation":
                        continue  # nothing was released
                    try:
                        async with s.post(self.url + path, json=body) as r:
                            text = "" if r.status == 200 else await r.text()
                            if path == "/release_memory_occupation" and LENDING in text:
                                lending = True  # the engine's answer then: a 400, no release
                                self.seen(path, r.status, (400,))
                            elif not self.seen(path, r.status):
                                self.problem(path, text[:300])
                    except RETRYABLE as exc:
                        self.problem(path, f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(self.rng.uniform(0, 0.2))


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _soak(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    soak = Soak(url, random.Random(args.seed), reasoning="--reasoning-parser" in args.engine_args)
    rss = [_rss_kb(pid)]
    greedy = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            soak.model = (await r.json())["data"][0]["id"]
        async with s.get(url + "/server_info") as r:
            soak.serves_embeds = not (await r.json())["prefix_cache"]["enabled"]
        async with s.post(url + "/generate", json=greedy) as r:
            before = (await r.json())["output_ids"]
        stop = time.monotonic() + args.seconds

        async def sample_rss() -> None:
            while time.monotonic() < stop:
                await asyncio.sleep(args.seconds / 10)
                rss.append(_rss_kb(pid))

        load = [soak.client(stop) for _ in range(args.clients)]
        await asyncio.gather(
            *load, soak.control(stop), soak.replicas(stop, greedy, before), sample_rss()
        )
        async with s.post(url + "/continue_generation", json={}) as r:  # whatever was paused
            soak.seen("/continue_generation", r.status)
        deadline = time.monotonic() + 30
        while True:  # what was in flight drains
            async with s.get(url + "/server_info") as r:
                info = await r.json()
            left = info["num_running_reqs"] + info["num_waiting_reqs"]
            if not left or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        if left:
            soak.problem("drain", f"{left} requests still running or waiting 30 s after the load")
        async with s.get(url + "/health_generate") as r:
            if r.status != 200:
                soak.problem("drain", f"/health_generate {r.status} after the load")
        async with s.post(url + "/generate", json=greedy) as r:  # the weights as they were
            after = (await r.json())["output_ids"]
        if after != before:
            soak.problem("weights", f"greedy output {after} after the load, {before} before")
    rss.append(_rss_kb(pid))
    return {
        "answers": dict(sorted(soak.answers.items())),
        "problems": dict(soak.problems),
        "refused_requests": info["refused_requests"],
        "rss_mb": [round(kb / 1024, 1) for kb in rss],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--engine-args", default="", help="more flags for the engine")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template, log = Path(tmp) / "chat.jinja", Path(tmp) / "engine.log"
        template.write_text(PASS_THROUGH)
        flags = ["--max-running", str(args.max_running), "--chat-template", str(template)]
        flags += shlex.split(args.engine_args)
        with (
            open(log, "wb") as output,
            engine_server(ARITH, *flags, env={"OMP_NUM_THREADS": "1"}, output=output) as (
                url,
                proc,
            ),
        ):
            result = asyncio.run(_soak(url, proc.pid, args))
        text = log.read_text(errors="replace")
    if "Traceback" in text:
        at = text.index("Traceback")
        result["problems"]["engine log"] = {"count": text.count("Traceback"),
                                            "first": [text[at : at + 2000]]}  # fmt: skip
    result = {"bench": "engine_soak", "seconds": args.seconds, "clients": args.clients,
              "seed": args.seed, "engine_args": args.engine_args, "ok": not result["problems"],
              **result}  # fmt: skip
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
