"""``/v1/score``'s fields in combination: random bodies (a valid one with one, two, three or
five of its fields changed, each to one of a few dozen values: the placeholder and anchor ids,
rows of the right and wrong widths, nulls, the MIS delimiter...), against a real engine; every
answer must be a 200 or a 400, and the engine must serve on. ``bench/engine_fuzz.py`` sends
each field every value alone; this one mixes the embedding overrides, the setwise readout and
the multi-item mode, whose checks depend on each other.

Run (prints one JSON line):

    python bench/score_fuzz.py [--engine lm|lm-nocache|classifier|mis] [--requests 3000] [--seed 1]

``lm``: a tiny generating model with the prefix cache on; ``lm-nocache``: with
``--disable-radix-cache``; ``classifier``: a reward model on the pooling engine, cache off;
``mis``: a 10,240-token model with ``--enable-mis``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.stages.test_engine_server import serving  # noqa: E402
from tests.stages.tiny_model import make_tiny_classifier, make_tiny_model  # noqa: E402

ROW = [0.5] * 32  # the tiny models' embedding width
VALUES = [
    None, 0, 1, -1, 7, 12, 127, 128, 9999, 10**20, True, False, 0.5, "", "x", "w7", "w12",
    "w5 w7", [], [[]], [7], [5, 7, 12], [[7]], [[12, 7]], [[12, 7], [7]], [[9999]], [ROW],
    [ROW[:31]], [None], [[ROW]], [[ROW], None], {"a": 1},
]  # fmt: skip
FIELDS = [
    "query", "items", "embed_override_token_id", "query_embed_overrides",
    "item_embed_overrides", "label_token_ids", "apply_softmax", "temperature",
    "return_token_logprobs", "item_first", "return_pooled_hidden_states",
    "score_extraction_token",
]  # fmt: skip
BASE = {"query": [5, 7], "items": [[12, 7]], "label_token_ids": [3],
        "embed_override_token_id": 7, "score_extraction_token": "w12"}  # fmt: skip


def _engine(kind: str, root: Path) -> tuple[Path, list[str]]:
    if kind == "classifier":
        return make_tiny_classifier(root / "m", seed=4, labels=("a", "b")), [
            "--disable-radix-cache"
        ]
    if kind == "mis":
        return make_tiny_model(root / "m", seed=1, vocab=10240), ["--enable-mis"]
    flags = ["--disable-radix-cache"] if kind == "lm-nocache" else []
    return make_tiny_model(root / "m", seed=1), flags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["lm", "lm-nocache", "classifier", "mis"], default="lm")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="score-fuzz-"))
    model, flags = _engine(args.engine, root)
    answers: collections.Counter[int] = collections.Counter()
    problems: list[str] = []
    started = time.perf_counter()
    with serving(model, root / "engine.log", *flags) as engine:
        for _ in range(args.requests):
            body = dict(BASE)
            for field in rng.sample(FIELDS, rng.choice((1, 1, 1, 2, 3, 5))):
                body[field] = rng.choice(VALUES)
            if rng.random() < 0.5:
                body.pop("score_extraction_token")
            if rng.random() < 0.3:  # rows that fit: the query's and the item's one placeholder
                body.update(query_embed_overrides=[ROW], item_embed_overrides=[[ROW]])
            try:
                status, _ = engine.request("POST", "/v1/score", body)
            except Exception as exc:  # an answer that is no JSON: a 5xx page
                status = getattr(exc, "code", 0)
            answers[status] += 1
            if status not in (200, 400):
                problems.append(f"{status}: {json.dumps(body)[:300]}")
        health, _ = engine.request("GET", "/health")
    ok = not problems and health == 200
    print(
        json.dumps(
            {
                "bench": "score_fuzz",
                "engine": args.engine,
                "seed": args.seed,
                "seconds": round(time.perf_counter() - started, 1),
                "ok": ok,
                "answers": {str(k): v for k, v in sorted(answers.items())},
                "problems": problems[:5],
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
