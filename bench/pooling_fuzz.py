"""Whether every request field of a pooling engine's routes takes any JSON value without a 5xx.

Run (prints one JSON line; exit 1 when it finds a problem):

    python bench/pooling_fuzz.py [--engine classifier|cross-encoder|embedder|mlp-reward]
        [--concurrency 8] [--engine-args "--disable-radix-cache ..."]

``inflight engine`` (as users start it) on a tiny pooling model of ``--engine``'s kind:

- ``classifier``: a decoder reward model (``Qwen2ForSequenceClassification``, three labels);
- ``cross-encoder``: a BERT cross-encoder (``BertForSequenceClassification``, one label: its
  answers are numbers);
- ``embedder``: a BERT embedder (``BertModel``, ``--is-embedding``);
- ``mlp-reward``: a ``Qwen2ForRewardModel`` checkpoint (its config naming code it does not
  ship), which the engine builds itself.

Each gets one request for every field of ``/encode``, ``/classify``, ``/v1/embeddings``,
``/v1/classify``, ``/v1/score`` and ``/v1/rerank`` and every value of
``bench/engine_fuzz.py``'s ``VALUES``, each put on a body the route would otherwise serve, and
each value inside a query-document pair, a document and a content part. A problem is an
answer with a 5xx status, a request that times out or loses its connection, a traceback in
the engine's log, or the engine not answering ``/health`` and a plain request afterwards.
Reported: the statuses by route and the problems (route, field, status: how many, and the
first value).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402

from bench._engines import engine_server  # noqa: E402
from bench.engine_fuzz import VALUES, report  # noqa: E402
from tests.stages.tiny_encoders import make_bert  # noqa: E402
from tests.stages.tiny_model import make_mlp_reward, make_tiny_classifier  # noqa: E402

# (route, its fields, a body it serves); texts in both tokenizers' words (w5...)
_ROUTES = [
    ("/encode", ("text", "input_ids", "rid", "dimensions", "return_pooled_hidden_states",
                 "is_cross_encoder_request", "sampling_params", "embed_overrides"),
     {"text": ["w5 w6", "w7"]}),
    ("/classify", ("text", "input_ids", "is_cross_encoder_request"),
     {"text": [["w5 w6", "w7"], ["w8", "w9 w10"]], "is_cross_encoder_request": True}),
    ("/v1/embeddings", ("input", "encoding_format", "dimensions", "embed_override_token_id",
                        "embed_overrides", "model", "user"), {"input": ["w5 w6", "w7"]}),
    ("/v1/classify", ("input", "model"), {"input": "w5 w6"}),
    ("/v1/score", ("query", "items", "label_token_ids", "apply_softmax", "item_first",
                   "temperature", "return_pooled_hidden_states", "return_token_logprobs",
                   "score_extraction_token", "embed_override_token_id",
                   "query_embed_overrides", "item_embed_overrides"),
     {"query": "w5 w6", "items": ["w7", "w8 w9"]}),
    ("/v1/rerank", ("query", "documents", "top_n", "return_documents", "instruct", "model"),
     {"query": "w5 w6", "documents": ["w7", "w8 w9"]}),
]  # fmt: skip


def requests_to_send() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """``(route, field, value, body)`` of every request."""
    out = []
    for path, fields, body in _ROUTES:
        for field in fields:
            for value in VALUES:
                out.append((path, field, value, {**body, field: value}))
    for value in VALUES:  # inside the structures
        pair = {"text": [["w5", value]], "is_cross_encoder_request": True}
        out.append(("/encode", "text[0][1]", value, pair))
        out.append(("/v1/rerank", "documents[0]", value, {"query": "w5", "documents": [value]}))
        parts = {"query": "w5", "documents": [[value]], "return_documents": False}
        out.append(("/v1/rerank", "documents[0][0]", value, parts))
        text_part = {"query": [{"type": "text", "text": value}], "documents": ["w6"]}
        out.append(("/v1/rerank", "query[0].text", value, text_part))
    return out


async def _fuzz(url: str, concurrency: int, timeout_s: float) -> dict[str, Any]:
    statuses: collections.Counter[str] = collections.Counter()
    problems: dict[str, dict[str, Any]] = {}
    todo = requests_to_send()
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def send(path: str, field: str, value: Any, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()  # NaN and Infinity as Python writes them
            async with gate:
                try:
                    async with s.post(
                        url + path, data=data, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        status: int | str = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    status = type(exc).__name__
            statuses[f"{path} {status}"] += 1
            if isinstance(status, str) or status >= 500:
                found = problems.setdefault(f"{path} {field} {status}", {"count": 0})
                found["count"] += 1
                found.setdefault("first", repr(value)[:120])

        await asyncio.gather(*(send(*request) for request in todo))
        async with s.post(url + "/encode", json={"text": "w5 w6"}) as r:
            if r.status != 200:
                problems["after"] = {"count": 1, "first": f"/encode {r.status}"}
        async with s.get(url + "/health") as r:
            if r.status != 200:
                problems["after health"] = {"count": 1, "first": f"{r.status}"}
    return {"requests": len(todo), "answers": dict(sorted(statuses.items())),
            "problems": problems}  # fmt: skip


def _model(kind: str, folder: Path) -> tuple[Path, list[str]]:
    """The model of ``kind`` under ``folder``, and the flags it is served with."""
    if kind == "classifier":
        labels = ("neg", "neu", "pos")
        return make_tiny_classifier(folder / "rm", seed=3, labels=labels), []
    if kind == "cross-encoder":
        return make_bert(folder / "ce", "BertForSequenceClassification", seed=1), []
    if kind == "embedder":
        return make_bert(folder / "emb", "BertModel", seed=2), ["--is-embedding"]
    return make_mlp_reward(folder / "mlp", "Qwen2ForRewardModel", seed=4), []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        choices=["classifier", "cross-encoder", "embedder", "mlp-reward"],
        default="cross-encoder",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a request")
    parser.add_argument("--engine-args", default="", help="more flags for the engine")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, flags = _model(args.engine, Path(tmp))
        log = Path(tmp) / "engine.log"
        start = time.perf_counter()
        with (
            open(log, "wb") as output,
            engine_server(
                model, *flags, *shlex.split(args.engine_args), env={"OMP_NUM_THREADS": "1"},
                output=output,
            ) as (url, _),
        ):  # fmt: skip
            result = asyncio.run(_fuzz(url, args.concurrency, args.timeout))
        seconds = time.perf_counter() - start
        text = log.read_text(errors="replace")
    head = {"bench": "pooling_fuzz", "engine": args.engine, "engine_args": args.engine_args,
            "seconds": round(seconds, 1)}  # fmt: skip
    return report(head, result, text)


if __name__ == "__main__":
    sys.exit(main())
