"""How an aborted request ends, as SGLang 0.5.23 ends it.

Whoever aborts it (``/abort_request``, an aborting pause, ``abort_all_requests`` of a weight
update, a client gone), SGLang's scheduler ends a running request with ``FINISH_ABORT()``
(``ABORTED_RUNNING``), while one still in its waiting queue (behind a full batch, or sent back
by a retracting pause) is answered by its tokenizer (``TokenizerManager._handle_abort_req``:
``ABORTED_WAITING``, and a ``meta_info`` of fewer fields, ``tokenizer_answer``), and one whose
grammar is compiling is failed with a 400 (``GrammarManager.abort_requests``:
``ABORTED_COMPILING``). A reason with an error status turns a request not streamed into an
error answer (``TokenizerManager._handle_abort_finish_reason``:
``raise_aborted_with_error``), and ends a ``/v1/completions`` or chat stream with an error
event (``streaming_error``).
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from stages.engine.request_error import AbortedWithError

__all__ = [
    "ABORTED_COMPILING",
    "ABORTED_RUNNING",
    "ABORTED_WAITING",
    "PRIORITY_DISABLED",
    "PRIORITY_EVICTED",
    "QUEUE_FULL",
    "error_status",
    "raise_aborted_with_error",
    "streaming_error",
    "tokenizer_answer",
]

ABORTED_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
# a new request while the waiting queue holds --max-queued-requests (_abort_on_queued_limit)
QUEUE_FULL = {"type": "abort", "status_code": 503, "message": "The request queue is full."}
# a waiting request that a full queue dropped for a preferred new one (priority scheduling)
PRIORITY_EVICTED = {
    "type": "abort",
    "status_code": 503,
    "message": "The request is aborted by a higher priority request.",
}
# a request with a priority on a server that refuses them (_set_or_validate_priority)
PRIORITY_DISABLED = {
    "type": "abort",
    "status_code": 503,
    "message": "Using priority is disabled for this server. Please send a new request without "
    "a priority.",
}
# how SGLang's scheduler answers these, by its send_abort_output: as its tokenizer answers an
# abort in the waiting queue
_TOKENIZERS = (ABORTED_WAITING, QUEUE_FULL, PRIORITY_EVICTED, PRIORITY_DISABLED)
ABORTED_COMPILING = {
    "type": "abort",
    "message": "Aborted by AbortReq.",
    "status_code": 400,
    "err_type": "BadRequestError",
}

# what _handle_abort_req's meta_info holds, in its order: who, why, the version, the latency,
# the versions' spans (Inflight's per-token versions after them), the log-prob fields of
# add_logprob_to_meta_info, the count; then the time it was sent at
_HEAD = ("id", "finish_reason", "weight_version", "e2e_latency", "weight_versions")
_LOGPROBS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def error_status(reason: dict[str, Any] | None) -> int | None:
    """The status of a finish reason that is an abort with an error (400 to 599), else
    None: a graceful abort (``/abort_request``, a pause, a client gone) has none."""
    if not reason or reason.get("type") != "abort":
        return None
    status = reason.get("status_code")
    return status if isinstance(status, int) and 400 <= status < 600 else None


def raise_aborted_with_error(reasons: Iterable[dict[str, Any] | None]) -> None:
    """AbortedWithError for the first of ``reasons`` (the finish reasons of a request's
    samples) that is an abort with a status from 400 to 599."""
    for reason in reasons:
        status = error_status(reason)
        if status is not None:
            raise AbortedWithError(str(reason.get("message")), status)


def streaming_error(reason: dict[str, Any]) -> dict[str, Any]:
    """The event a ``/v1/completions`` or chat stream ends with when one of its samples is
    aborted with an error status (``error_status``): SGLang 0.5.23's
    ``create_streaming_error_response(message, status.name, status.value)``
    (``serving_chat._generate_chat_stream``, ``serving_completions``; its scheduler's
    ``HTTPStatus`` reaches the route through its default pickle IPC), which the ``openai``
    client raises as an ``APIError``."""
    status = reason["status_code"]
    try:
        name = HTTPStatus(status).name
    except ValueError:  # not a status HTTPStatus names (none of the engine's own)
        name = str(status)
    message = reason.get("message", "Generation aborted.")
    return {"error": {"object": "error", "message": message, "type": name, "param": None,
                      "code": status}}  # fmt: skip


def tokenizer_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """A native ``/generate`` answer (or a stream's last chunk) of a sample aborted while it
    waited (or refused by a full queue, or for its priority), with the ``meta_info`` SGLang's
    tokenizer gives it: without ``prompt_tokens``, ``num_retractions``, the cache and reasoning
    counts, time stats and masks. Any other answer as it is."""
    meta = answer.get("meta_info")
    if meta is None or meta.get("finish_reason") not in _TOKENIZERS:
        return answer
    kept = {key: meta[key] for key in _HEAD if key in meta}
    if "output_token_weight_versions" in meta:  # Inflight's, after SGLang's versions
        kept["output_token_weight_versions"] = meta["output_token_weight_versions"]
    kept.update(
        (key, value)
        for key, value in meta.items()
        if key in _LOGPROBS or key.startswith(("input_top_logprobs_", "output_top_logprobs_"))
    )  # (the flat top log-probs: ``flat_logprobs``)
    kept["completion_tokens"] = meta["completion_tokens"]
    if "response_sent_to_client_ts" in meta:
        kept["response_sent_to_client_ts"] = meta["response_sent_to_client_ts"]
    return {**answer, "meta_info": kept}
