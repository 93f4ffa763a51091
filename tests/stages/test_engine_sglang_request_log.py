"""The request log's rendering held to SGLang 0.5.23's own functions
(``utils/request_logger.py``: ``_dataclass_to_string_truncated``,
``_transform_data_for_logging``, ``RequestLogger._compute_metadata``;
``watermarking/core.py``'s ``redact_watermark_secrets``): random request-like values, cut at
random lengths with random keys skipped, render alike, text and JSON, secrets redacted alike.

Runs where SGLang's source is importable (``test_engine_sglang_shapes.py``'s docstring says how);
skipped elsewhere.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

sglang: Any = pytest.importorskip("sglang.srt.utils.request_logger")
watermarks: Any = pytest.importorskip("sglang.srt.sampling.watermarking.core")

from stages.engine import request_log as ours  # noqa: E402

_KEYS = ["text", "input_ids", "rid", "sampling_params", "watermark", "watermark_key", "key",
         "key_b", "watermark_config", "meta_info", "output_ids", "lora_path", "stream"]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth > 3 or kind < 0.35:
        return rng.choice([None, True, 0, -3, 2.5, "", "ab", "ünï ✓", "x" * rng.randint(0, 40),
                           b"raw"])  # fmt: skip
    if kind < 0.6:
        items = [_value(rng, depth + 1) for _ in range(rng.randint(0, 12))]
        return items if rng.random() < 0.8 else tuple(items)
    if kind < 0.7:
        return list(range(rng.randint(0, 30)))
    return {rng.choice(_KEYS): _value(rng, depth + 1) for _ in range(rng.randint(0, 6))}


def test_rendering_equals_sglangs_on_random_requests() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        data = _value(rng)
        if rng.random() < 0.7:
            data = {rng.choice(_KEYS): _value(rng) for _ in range(rng.randint(1, 8))}
        length = rng.choice([2, 3, 4, 7, 16, 2048])
        skip = set(rng.sample(_KEYS, rng.randint(0, 3)))
        assert ours.truncated(data, length, skip) == sglang._dataclass_to_string_truncated(
            data, length, skip
        ), data
        assert ours.for_json(data, length, skip) == sglang._transform_data_for_logging(
            data, length, skip
        ), data
        assert ours.redacted(data) == watermarks.redact_watermark_secrets(data), data


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_logs_what_sglangs_does(level: int) -> None:
    logger = sglang.RequestLogger(True, level, "text", None)
    length, skip, out_skip = logger.metadata
    none = frozenset()  # SGLang's None: nothing skipped
    assert ours.limits(level) == (length, frozenset(skip or none), frozenset(out_skip or none))
