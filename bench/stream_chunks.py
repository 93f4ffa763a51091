"""What streaming costs the engine's event loop in Python: the routes' own work, without HTTP.

Run (prints one JSON line):

    python bench/stream_chunks.py [--repeats 15] [--rounds 150] [--new-tokens 5]

A stand-in scheduler hands the routes what ``stages.engine.scheduler.Scheduler`` hands them: per
step, one event per sample to a streamed request (``(index, (token, logprob, version, top,
cached, input_lps, input_tops, picked, input_picked, mask, retractions, time_stats, hidden))``),
and each sample's ``SequenceResult`` at its last token. 16 requests of ``n`` = 4 on arith-tiny's
tokenizer and vocabulary, with log-probs, take ``--new-tokens`` steps together, as
``bench/engine_profile.py compare`` drives a real server:

- ``generate``: ``/generate`` not streamed (``stages.engine.server.generate``, then JSON);
- ``generate-stream``: streamed (``stream_generate``'s chunks, each batch as its events: the
  first pulled, the rest pushed in the scheduler's hand-overs, as the server writes them);
- ``completions``: ``/v1/completions`` with ``logprobs: 0``, not streamed;
- ``completions-stream``: streamed (``completion_stream`` over ``stream_generate``'s progress);
- ``chat``: ``/v1/chat/completions`` with ``logprobs: true`` (the prompt's text as its one
  message, through a pass-through chat template: the same ids), not streamed;
- ``chat-stream``: streamed (``chat_stream`` over ``stream_generate``'s progress).

Reported: the CPU per request of each, the minimum and the median of ``--repeats`` runs of
``--rounds`` rounds (the stand-in's own steps not counted), and each streamed form's extra over
its twin. This is the part of a stream's cost that is Python of the engine's; the rest (the
request task's wake-ups, aiohttp and the socket writes) only ``engine_profile.py compare``
sees, under the machine's noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from pipeline import heap  # noqa: E402
from stages.detokenize import decoder  # noqa: E402
from stages.engine.chunk_stream import Last  # noqa: E402
from stages.engine.loader import load_model  # noqa: E402
from stages.engine.openai_api import (  # noqa: E402
    completion_request,
    completion_response,
    completion_stream,
)
from stages.engine.openai_chat import (  # noqa: E402
    ChatSettings,
    chat_request,
    chat_response,
    chat_stream,
)
from stages.engine.protocol import SAMPLING_MASK_MAX_TOKENS, SequenceResult  # noqa: E402
from stages.engine.server import generate  # noqa: E402
from stages.engine.streaming import _events, stream_generate  # noqa: E402
from stages.engine.token_bytes import TokenBytes, token_bytes  # noqa: E402

FORMS = (
    "generate",
    "generate-stream",
    "completions",
    "completions-stream",
    "chat",
    "chat-stream",
)
PASS_THROUGH = "{% for m in messages %}{{ m.content }}{% endfor %}"  # the message's text
GROUP = 4
REQUESTS = 16


class _Scheduler:
    """The scheduler's side of ``submit_async``, stepped by hand (``step``)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.live: list[tuple[list[Any], Any, asyncio.Future, list[list[int]]]] = []

    def adapter_names(self) -> tuple[str, ...]:
        return ()

    think_end: tuple[int, ...] = ()  # no --reasoning-parser
    sampling_mask_max_tokens = SAMPLING_MASK_MAX_TOKENS
    hidden_states_mode = None  # no --return-hidden-states-mode
    strict_thinking = None  # no --enable-strict-thinking
    logit_processors = None  # no --enable-custom-logit-processor
    think_start: tuple[int, ...] = ()
    think_ends: tuple[tuple[int, ...], ...] = ()
    request_log = None  # no request log
    routed_experts = False  # no --enable-return-routed-experts
    prefix_cache_on = True  # SGLang's radix cache on
    auto_truncate = False  # no --allow-auto-truncate
    lora = False  # no --enable-lora
    preferred_sampling_params = None  # no --preferred-sampling-params

    def abort_many(self, rids: Any, message: str = "") -> None:
        pass

    def submit_async(self, inputs: list[Any], stream: Any = None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.live.append((inputs, stream, future, [[] for _ in inputs]))
        return future

    def step(self, last: bool) -> None:
        handed: list[tuple[Any, list[tuple[int, Any]]]] = []
        for inputs, stream, future, ids in self.live:
            events: list[tuple[int, Any]] = []
            for i, inp in enumerate(inputs):
                token = random.randrange(3, self.vocab)
                ids[i].append(token)
                if not last:
                    event = (token, -0.5, "0", None, 0, None, None, None, None, None, 0, None)
                    event += (None,)  # no hidden states
                    events.append((i, event))
                    continue
                n = len(ids[i])
                result = SequenceResult(
                    inp.rid, len(inp.input_ids), ids[i], {"type": "length", "length": n},
                    "0", ["0"] * n, [-0.5] * n,
                )  # fmt: skip
                events.append((i, result))
            if stream is not None:
                handed.append((stream, events))
            if last:
                future.set_result([result for _, result in events])
        if handed:  # on the loop after the step, in one call, as the scheduler's outbox does
            asyncio.get_running_loop().call_soon(_call_each, handed)
        if last:
            self.live = []


def _call_each(handed: list[tuple[Any, list[tuple[int, Any]]]]) -> None:
    for stream, events in handed:
        stream(events)


async def _request(
    form: str, loaded: Any, sched: _Scheduler, decode: Any, prompt: list[int], new: int, text: str
) -> int:
    """One request of ``form`` (``text``: the prompt's, for the chat route); the bytes its answer
    would be (every event's, when streamed)."""
    if form.startswith("chat"):
        body = {
            "model": "default", "messages": [{"role": "user", "content": text}],
            "n": GROUP, "temperature": 1.0, "max_tokens": new, "logprobs": True,
            "stream": form.endswith("stream"),
        }  # fmt: skip
        native, options = chat_request(body, _chat_settings(loaded), loaded.context_length)
        if not options["stream"]:
            results = await generate(loaded, sched, decode, native)
            return len(orjson.dumps(chat_response(results, options)))
        batches = chat_stream(
            stream_generate(loaded, sched, decode, native, progress=True), options
        )
    elif form.startswith("completions"):
        body = {
            "model": "default", "prompt": prompt, "n": GROUP, "temperature": 1.0,
            "max_tokens": new, "logprobs": 0, "stream": form.endswith("stream"),
        }  # fmt: skip
        native, options = completion_request(body)
        if not options["stream"]:
            results = await generate(loaded, sched, decode, native)
            return len(orjson.dumps(completion_response(results, options, decode, _tokens(loaded))))
        batches = completion_stream(
            stream_generate(loaded, sched, decode, native, progress=True),
            options,
            decode,
            _tokens(loaded),
        )
    else:
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": new, "n": GROUP},
            "return_logprob": True,
        }
        if form == "generate":
            return len(orjson.dumps(await generate(loaded, sched, decode, body)))
        batches = stream_generate(loaded, sched, decode, {**body, "stream": True})
    # as the server writes them: the first batch pulled, the rest pushed in the hand-overs
    first = await anext(batches)
    size = len(_events(first, orjson.dumps))
    if isinstance(first, Last):
        return size
    done = asyncio.get_running_loop().create_future()

    def sink(batch: list[Any]) -> None:
        nonlocal size
        size += len(_events(batch, orjson.dumps))
        if isinstance(batch, Last):
            done.set_result(None)

    batches.push(sink, done.set_exception)
    await done
    return size


_CHAT: dict[int, ChatSettings] = {}


def _tokens(loaded: Any) -> TokenBytes:
    """The tokenizer's ``TokenBytes`` (the completions route's log-prob texts)."""
    return token_bytes(loaded.tokenizer)


def _chat_settings(loaded: Any) -> ChatSettings:
    """The chat route's settings for ``loaded`` (made once), with the pass-through template."""
    key = id(loaded)
    if key not in _CHAT:
        settings = ChatSettings.of(loaded.tokenizer, Path(loaded.path), chat_template=PASS_THROUGH)
        assert settings is not None  # arith-tiny has a tokenizer
        _CHAT[key] = settings
    return _CHAT[key]


async def _run(form: str, loaded: Any, decode: Any, rounds: int, new: int) -> float:
    """CPU microseconds per request of ``form`` over ``rounds`` rounds."""
    sched = _Scheduler(loaded.vocab_size)
    prompts = [[random.randrange(3, loaded.vocab_size) for _ in range(5)] for _ in range(64)]
    texts = [decode(prompt, True) for prompt in prompts]
    spent_stepping = 0.0
    start = time.process_time()
    for r in range(rounds):
        tasks = [
            asyncio.ensure_future(_request(form, loaded, sched, decode, prompts[p], new, texts[p]))
            for p in ((r + k) % 64 for k in range(REQUESTS))
        ]
        await asyncio.sleep(0)  # each request submits
        for step in range(new):
            t = time.process_time()
            sched.step(last=step == new - 1)
            spent_stepping += time.process_time() - t
            await asyncio.sleep(0)  # the hand-over
            await asyncio.sleep(0)  # the requests' tasks
        await asyncio.gather(*tasks)
    return 1e6 * (time.process_time() - start - spent_stepping) / (rounds * REQUESTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=5)
    args = parser.parse_args()
    heap.hold()  # the engine's garbage collector, as it runs (``stages.engine.server``)
    loaded = load_model(ROOT / "configs" / "models" / "arith-tiny")
    decode = decoder(loaded.tokenizer)
    heap.settle()
    runs: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.repeats):  # the forms in turn, so that drift touches them alike
        for form in FORMS:
            runs[form].append(asyncio.run(_run(form, loaded, decode, args.rounds, args.new_tokens)))
    best = {form: min(v) for form, v in runs.items()}
    print(
        json.dumps(
            {
                "bench": "stream_chunks",
                "requests": REQUESTS,
                "n": GROUP,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "rounds": args.rounds,
                "cpu_us_per_request": {
                    form: {"min": round(min(v), 1), "median": round(statistics.median(v), 1)}
                    for form, v in runs.items()
                },
                "stream_extra_us_per_request": {
                    "generate": round(best["generate-stream"] - best["generate"], 1),
                    "completions": round(best["completions-stream"] - best["completions"], 1),
                    "chat": round(best["chat-stream"] - best["chat"], 1),
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
