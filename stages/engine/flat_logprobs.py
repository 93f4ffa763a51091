"""Top log-probs as flat arrays (SGLang 0.5.23's ``return_flat_raw_top_logprobs``,
``return_flat_raw_output_top_logprobs`` and ``return_flat_raw_top_logprobs_b64``;
``io_struct.flat_top_logprobs_layout`` and ``build_flat_top_logprobs_arrays``,
``tokenizer_manager._build_flat_top_logprobs_fields``).

A teacher scoring a student's samples for distillation asks for the top-k log-probs at every
position; as nested ``[logprob, token_id, text]`` lists that is many small JSON arrays a
position. Flat, a side (``input``: the prompt's, from ``logprob_start_len``; ``output``: the
generated tokens', on the finished answer only) is four fields of ``meta_info`` in place of
its ``{side}_top_logprobs``:

- ``{side}_top_logprobs_val_flat`` and ``_idx_flat``: the log-probs and token ids, row after
  row (with ``_b64``: ``_val_flat_b64`` and ``_idx_flat_b64``, base64 of little-endian float32
  and int32, and their ``_dtype`` markers);
- ``{side}_top_logprobs_shape``: ``[rows, k]``;
- ``{side}_top_logprobs_null_prefix``: the leading positions without any (the prompt's first
  token), which precede the rows: position ``i``'s entry ``j`` is at
  ``(i - null_prefix) * k + j``.

Rows that are not rectangular after the leading nulls cannot be laid out so: the side is then
answered nested, and the fallback logged, as SGLang does. Requested with ``stream``, the input
side comes in every chunk; the output side is refused with a stream, as SGLang refuses it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from stages.engine.request_error import RequestError

__all__ = ["FlatTops", "flat_fields", "flat_request"]

log = structlog.get_logger("inflight.engine")

INPUT, OUTPUT, B64 = (
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
)


@dataclass(frozen=True, slots=True)
class FlatTops:
    """Which sides of a request's top log-probs are flat, and whether in base64."""

    input: bool
    output: bool
    b64: bool


def flat_request(body: dict[str, Any]) -> FlatTops | None:
    """A ``/generate`` body's flat top log-probs (None: nested, the default), checked as
    ``GenerateReqInput._validate_inputs`` checks them, in its words."""
    flags = []
    for name in (INPUT, OUTPUT, B64):
        value = body.get(name, False)
        if not isinstance(value, bool | None):
            raise RequestError(name, f"expected true or false, got {value!r}")
        flags.append(bool(value))
    flat_input, flat_output, b64 = flags
    if flat_output and body.get("stream"):
        raise RequestError(
            OUTPUT,
            "return_flat_raw_output_top_logprobs is only set on the finished response and "
            "does not support stream=True.",
        )
    if b64 and not (flat_input or flat_output):
        raise RequestError(
            B64,
            "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs or "
            "return_flat_raw_output_top_logprobs.",
        )
    return FlatTops(flat_input, flat_output, b64) if flat_input or flat_output else None


def flat_fields(
    side: str,
    steps: Sequence[Sequence[tuple[float, int]] | None],
    k: int,
    b64: bool,
    rid: str = "",
) -> dict[str, Any] | None:
    """``side``'s flat fields of ``steps`` (per position, its top ``(logprob, token id)``s or
    None), ``k`` the top log-probs asked for; None (logged) where the rows are ragged."""
    null = 0
    while null < len(steps) and not steps[null]:
        null += 1
    rows = steps[null:]
    width = len(rows[0]) if rows else k  # type: ignore[arg-type]
    for offset, row in enumerate(rows):
        if row is None or len(row) != width:
            log.error(
                "flat_top_logprobs_fallback",
                rid=rid,
                side=side,
                message="Flat top logprobs require rectangular rows with nulls only in the "
                f"leading prefix; row {null + offset} has {None if row is None else len(row)} "
                f"entries (expected {width}).",
            )
            return None
    values = [lp for row in rows for lp, _ in row]  # type: ignore[union-attr]
    ids = [tok for row in rows for _, tok in row]  # type: ignore[union-attr]
    prefix = f"{side}_top_logprobs"
    fields: dict[str, Any]
    if b64:
        fields = {
            f"{prefix}_val_flat_b64": _b64(np.asarray(values, dtype="<f4")),
            f"{prefix}_idx_flat_b64": _b64(np.asarray(ids, dtype="<i4")),
            f"{prefix}_val_flat_b64_dtype": "float32",
            f"{prefix}_idx_flat_b64_dtype": "int32",
        }
    else:
        fields = {f"{prefix}_val_flat": values, f"{prefix}_idx_flat": ids}
    fields[f"{prefix}_shape"] = [len(rows), width]
    fields[f"{prefix}_null_prefix"] = null
    return fields


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")
