"""What SGLang 0.5.23 checks of a ``/generate`` body before its route runs, in its order and
with its answers (``http_server.generate_request``):

1. FastAPI reads the body into ``GenerateReqInput`` (``managers/io_struct.py``), a dataclass
   that pydantic validates in its lax mode, other keys ignored (``GenerateFields`` here). What
   it cannot read is its ``RequestValidationError``: 400 with SGLang's ``ErrorResponse``,
   ``type: "Bad Request"``.
2. ``api_contract.generate_contract_error``: the JSON body against the ``sglang.api.v1``
   ``GenerateRequest`` schema, the one the Rust server decodes with serde, strictly (no
   ``true`` for a number, no ``2.0`` for an integer, ``"yes"`` no boolean) and with serde's
   words; an unknown key of ``sampling_params`` is refused, others ignored. Its answer: 400
   ``{"error": "<the words>"}``.

What passes both is the route's to check (``protocol.parse_generate``, SGLang's other checks).
"""

from __future__ import annotations

from array import array
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import PlainValidator
from typing_extensions import TypedDict

from stages.engine.request_body import invalid, read_body
from stages.engine.request_fields import Checker, Ids, MaybeStrings, OneOrMany

__all__ = ["contract_error", "read", "refusal"]


def _int64_rows(value: Any) -> Any:
    """``input_ids``' own validator (``validate_optional_list_i64_1d_2d``): null, a list of
    int64s or a list of such lists, judged by the first element, with its words."""
    if value is None:
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be list or null; got {type(value).__name__}")
    if not value:
        return value
    if isinstance(value[0], int):
        return _int64s(value)
    if isinstance(value[0], list):
        for i, row in enumerate(value):
            try:
                _int64s(row)
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from None
        return value
    raise ValueError(f"elements must be int or list; got {type(value[0]).__name__}")


def _int64s(row: Any) -> list[int]:
    if row is None:
        raise ValueError("must not be None")
    if not isinstance(row, list):
        raise ValueError(f"must be list; got {type(row).__name__}")
    if row and not isinstance(row[0], int):
        raise ValueError(f"elements must be int; got {type(row[0]).__name__}")
    try:
        array("q", row)  # what fits a signed 64-bit integer, as SGLang packs it
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"contains non-int64 element: {exc}") from None
    return row


MaybeInts = list[int | None] | int | None
Hidden = bool | Literal["last"]


class GenerateFields(TypedDict, total=False):  # GenerateReqInput, as pydantic reads it
    rid: OneOrMany
    session_id: str | None
    text: list[str] | str | None
    input_ids: Annotated[Ids, PlainValidator(_int64_rows)]
    input_embeds: list[list[list[float]]] | list[list[float]] | None
    image_data: Any  # images, video, audio: what this engine refuses anyway
    video_data: Any
    audio_data: Any
    mm_hashes: list[str] | list[list[str]] | None
    mm_content_hashes: list[str | None] | list[list[str | None]] | None
    use_audio_in_video: bool
    video_config: dict[str, Any] | None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None
    watermark: Any
    return_logprob: list[bool] | bool | None
    logprob_start_len: list[int] | int | None
    top_logprobs_num: list[int] | int | None
    token_ids_logprob: Ids
    return_sampling_mask: list[bool] | bool | None
    sampling_logprobs_mode: (
        list[Literal["selected", "support"] | None] | Literal["selected", "support"] | None
    )
    return_text_in_logprobs: bool
    return_flat_raw_top_logprobs: bool
    return_flat_raw_output_top_logprobs: bool
    return_flat_raw_top_logprobs_b64: bool
    stream: bool
    log_metrics: bool
    return_hidden_states: list[Hidden] | Hidden
    return_routed_experts: bool
    routed_experts_start_len: int
    return_indexer_topk: bool
    modalities: list[str] | None
    session_params: dict[str, Any] | None
    lora_path: MaybeStrings
    lora_id: MaybeStrings
    custom_logit_processor: MaybeStrings
    positional_embed_overrides: Any
    bootstrap_host: MaybeStrings
    bootstrap_port: MaybeInts
    bootstrap_room: MaybeInts
    bootstrap_pair_key: MaybeStrings
    decode_tp_size: MaybeInts
    routed_dp_rank: int | None
    data_parallel_rank: int | None
    disagg_prefill_dp_rank: int | None
    routing_key: str | None
    conversation_id: str | None
    http_worker_ipc: str | None
    background: bool
    require_reasoning: bool
    max_thinking_tokens: int | None
    priority: int | None
    extra_key: OneOrMany
    no_logs: bool
    custom_labels: dict[str, str] | None
    return_bytes: bool
    return_entropy: bool
    return_prompt_token_ids: bool
    external_trace_header: dict[str, Any] | None
    received_time: float | None
    need_wait_for_mm_inputs: bool | None
    num_items_assigned: dict[str, list[int]] | None
    encoder_urls: list[str] | None
    max_dynamic_patch: int | None
    min_dynamic_patch: int | None
    image_max_dynamic_patch: int | None
    video_max_dynamic_patch: int | None
    images_config: dict[Any, Any] | None
    mm_processor_kwargs: dict[Any, Any] | None
    multi_item_delimiter_indices: Ids
    token_indices_to_pool: Ids
    cache_salt: OneOrMany
    kv_hints: list[dict[str, Any] | None] | dict[str, Any] | None


checked_generate = Checker(GenerateFields)


def read(raw: bytes, content_type: str | None) -> tuple[Any, web.Response | None]:
    """``(body, None)`` of a ``/generate`` request's bytes, or ``(None, SGLang's 400)``:
    FastAPI's when they are no JSON or none at all (``read_body``), then ``refusal``'s."""
    body, refused = read_body(raw, content_type)
    if refused is not None:
        return None, refused
    return body, refusal(body)


def refusal(body: Any) -> web.Response | None:
    """SGLang's 400 for ``body`` when one of its two checks refuses it (its answer's shape
    says which), else None, with ``body``'s fields converted as the first one reads them."""
    if not isinstance(body, dict):  # pydantic's words for a dataclass
        return invalid("Input should be a dictionary or an instance of GenerateReqInput")
    try:
        typed = checked_generate(dict(body))
    except ValueError as exc:
        return invalid(str(exc))
    broken = contract_error(body)
    if broken is not None:
        return web.json_response({"error": broken}, status=400)
    body.update(typed)
    return None


# ---- the sglang.api.v1 JSON contract: serde's rules and words --------------------------------


def contract_error(body: Any) -> str | None:
    """What the ``GenerateRequest`` schema finds wrong with ``body`` (serde's words, as the
    Rust server and SGLang's Python one answer them), or None."""
    try:
        _request(body)
    except _Broken as exc:
        return str(exc)
    return None


class _Broken(ValueError):
    pass


def _shown(value: Any) -> str:
    """serde's ``Unexpected``: how its messages name a value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _wrong(value: Any, expected: str) -> _Broken:
    return _Broken(f"invalid type: {_shown(value)}, expected {expected}")


def _bool(value: Any, expected: str = "a boolean") -> None:
    if not isinstance(value, bool):
        raise _wrong(value, expected)


def _int(value: Any, expected: str = "i64") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(value, expected)


def _uint(value: Any, expected: str) -> None:
    _int(value, expected)
    if value < 0:
        raise _Broken(f"invalid value: integer `{value}`, expected {expected}")


def _float(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(value, "f64")


def _str(value: Any, expected: str = "a string") -> None:
    if not isinstance(value, str):
        raise _wrong(value, expected)


def _seq(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _wrong(value, "a sequence")
    return value


def _map(value: Any, expected: str = "a map") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong(value, expected)
    return value


def _one_or_many(check: Any, name: str, nullable: bool = False) -> Any:
    """A ``...OrList`` type: one value (``check``'d) or a list of them (each may be null
    when ``nullable``)."""
    expected = f"a value or an array of values for {name}"

    def read(value: Any) -> None:
        if isinstance(value, list):
            for item in value:
                if not (nullable and item is None):
                    check(item)
        else:
            check(value, expected)

    return read


def _flat_or_batch(check: Any, name: str) -> Any:
    """``TokenIdsOrList``, ``StringListOrList``: a flat list (empty, or its first element a
    scalar) or a list of them."""

    def read(value: Any) -> None:
        if not isinstance(value, list):
            raise _wrong(value, f"a value or an array of values for {name}")
        rows = [value] if not value or check.scalar(value[0]) else value
        for row in rows:
            if set(map(type, _seq(row))) <= check.types:  # C speed: a prompt's ids
                continue
            for item in row:
                check(item)

    return read


class _Ids:
    """Token ids: i64 each (a number first makes the list flat)."""

    types = frozenset({int})  # exactly int: a bool is no id

    @staticmethod
    def scalar(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    def __call__(self, value: Any) -> None:
        _int(value)


class _Strings:
    types = frozenset({str})

    @staticmethod
    def scalar(value: Any) -> bool:
        return isinstance(value, str)

    def __call__(self, value: Any) -> None:
        _str(value)


def _watermark(value: Any) -> None:
    fields = {"enabled": _bool, "key": _str, "context_window": _int}
    for key, item in _map(value, "struct WatermarkRequestConfig").items():
        if key not in fields:
            raise _unknown(key, tuple(fields))
        if item is not None:
            fields[key](item)


def _strings(value: Any) -> None:
    for item in _seq(value):
        _str(item)


def _ints(value: Any) -> None:
    for item in _seq(value):
        _int(item)


def _floats_by_key(value: Any) -> None:
    for item in _map(value).values():
        _float(item)


_STRING_OR_LIST = _one_or_many(_str, "StringOrList")
_SAMPLING: dict[str, Any] = {  # SamplingParams: (check of a non-null value)
    "max_new_tokens": _int,
    "stop": _STRING_OR_LIST,
    "stop_token_ids": _ints,
    "stop_regex": _STRING_OR_LIST,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "logit_bias": _floats_by_key,
    "sampling_seed": _int,
    "custom_params": None,  # any value
    "beam_width": _int,
    "watermark": _watermark,
    "choice": _strings,
}


def _unknown(key: str, fields: tuple[str, ...]) -> _Broken:
    listed = ", ".join(f"`{f}`" for f in fields)
    return _Broken(f"unknown field `{key}`, expected one of {listed}")


def _sampling(value: Any) -> None:
    for key, item in _map(value, "struct SamplingParams").items():
        if key not in _SAMPLING:
            raise _unknown(key, tuple(_SAMPLING))
        if item is not None and _SAMPLING[key] is not None:
            _SAMPLING[key](item)


def _sampling_or_list(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            _sampling(item)
    else:
        _map(value, "a value or an array of values for SamplingParamsOrList")
        _sampling(value)


def _images_config(value: Any) -> None:
    for key, item in _map(value, "struct ImagesConfig").items():
        if key == "prefix" or (key == "image_mode" and item is not None):  # prefix: no null
            _str(item)


def _labels(value: Any) -> None:
    for item in _map(value).values():
        _str(item)


def _optional_strings(value: Any) -> None:
    for item in _seq(value):
        if item is not None:
            _str(item)


def _max_thinking(value: Any) -> None:
    _uint(value, "u64")


_TOKEN_IDS = _flat_or_batch(_Ids(), "TokenIdsOrList")
_FIELDS: dict[str, Any] = {  # GenerateRequest: (check of a non-null value); None: any value
    "rid": _STRING_OR_LIST,
    "text": _STRING_OR_LIST,
    "input_ids": _TOKEN_IDS,
    "stream": _bool,
    "sampling_params": _sampling_or_list,
    "return_logprob": _one_or_many(_bool, "BoolOrList"),
    "logprob_start_len": _one_or_many(_int, "Int64OrList"),
    "top_logprobs_num": _one_or_many(_int, "Int64OrList"),
    "token_ids_logprob": _TOKEN_IDS,
    "return_hidden_states": _one_or_many(_bool, "BoolOrList"),
    "return_text_in_logprobs": _bool,
    "bootstrap_host": _one_or_many(_str, "OptionalStringOrList", nullable=True),
    "bootstrap_port": _one_or_many(_int, "OptionalInt64OrList", nullable=True),
    "bootstrap_room": _one_or_many(_int, "OptionalInt64OrList", nullable=True),
    "bootstrap_pair_key": _one_or_many(_str, "OptionalStringOrList", nullable=True),
    "decode_tp_size": _one_or_many(_int, "OptionalInt64OrList", nullable=True),
    "routed_dp_rank": _int,
    "disagg_prefill_dp_rank": _int,
    "image_data": None,  # media: refused by the route (this engine reads text)
    "mm_hashes": _flat_or_batch(_Strings(), "StringListOrList"),
    "video_data": None,
    "audio_data": None,
    "extra_key": _STRING_OR_LIST,
    "priority": _int,
    "cache_salt": _STRING_OR_LIST,
    "require_reasoning": _bool,
    "lora_path": _one_or_many(_str, "OptionalStringOrList", nullable=True),
    "session_params": None,
    "kv_hints": None,  # SGLang's KV-cache hints: refused by the route
    "routing_key": _str,
    "max_thinking_tokens": _max_thinking,
    "session_id": _str,
    "custom_logit_processor": _one_or_many(_str, "OptionalStringOrList", nullable=True),
    "custom_labels": _labels,
    "images_config": _images_config,
    "return_sampling_mask": _one_or_many(_bool, "BoolOrList"),
    "modalities": _optional_strings,
}
_NOT_NULL = {"return_prompt_token_ids": _bool, "routed_experts_start_len": _int}


def _request(body: Any) -> None:
    for key, value in _map(body, "struct GenerateRequest").items():
        if key in _NOT_NULL:
            _NOT_NULL[key](value)
        elif value is not None and _FIELDS.get(key) is not None:
            _FIELDS[key](value)
