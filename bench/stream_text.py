"""What a streamed sample's text costs the engine, by the sample's length.

Run (prints one JSON line):

    python bench/stream_text.py [--lengths 5,64,256,1024] [--repeats 5]

A chunk per token (``--stream-interval`` 1), on arith-tiny's tokenizer (its Rust backend, as
the engine decodes): CPU microseconds per sample of

- ``incremental``: ``stages.engine.incremental_text.IncrementalText``, as SGLang's detokenizer
  decodes (two windows of a token or two a chunk, then the end);
- ``whole_so_far``: decoding the whole output so far at every chunk (what the engine did
  before, holding back a trailing incomplete character), whose cost grows with the length.

The minimum of ``--repeats`` runs of 64 samples each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.detokenize import decoder  # noqa: E402
from stages.engine.incremental_text import IncrementalText  # noqa: E402
from stages.engine.loader import load_model  # noqa: E402


def _incremental(decode, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        state = IncrementalText(prompt, decode, True)
        ids: list[int] = []  # the sample's output so far, as the engine keeps it
        for token in out[:-1]:
            ids.append(token)
            state.update(ids)
        state.final(out, False)


def _whole_so_far(decode, prompts, outputs) -> list[str]:
    texts = []
    for out in outputs:
        text, ids = "", []
        for token in out[:-1]:
            ids.append(token)
            now = decode(ids, True)
            if not now.endswith("\ufffd"):
                text = now
        texts.append(text + decode(out, True))
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="5,64,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model(ROOT / "configs" / "models" / "arith-tiny")
    decode = decoder(loaded.tokenizer)
    vocab = loaded.vocab_size
    result: dict[str, dict[str, float]] = {}
    for length in (int(n) for n in args.lengths.split(",")):
        prompts = [[random.randrange(3, vocab) for _ in range(8)] for _ in range(64)]
        outputs = [[random.randrange(3, vocab) for _ in range(length)] for _ in range(64)]
        row = {}
        for name, way in (("incremental", _incremental), ("whole_so_far", _whole_so_far)):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.process_time()
                way(decode, prompts, outputs)
                best = min(best, time.process_time() - start)
            row[name] = round(1e6 * best / len(outputs), 1)
        row["ratio"] = round(row["incremental"] / row["whole_so_far"], 2)
        result[str(length)] = row
    print(json.dumps({"bench": "stream_text", "us_per_sample": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
