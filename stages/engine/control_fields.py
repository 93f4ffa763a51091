"""The native routes' bodies typed as SGLang 0.5.23 types them before the route runs: FastAPI
reads each into its request struct (``managers/io_struct.py``, msgspec Structs that
``msgspec_struct_pydantic_core_schema`` hands to pydantic as typed dicts: lax conversions,
other keys ignored). What it cannot read is a 400 in SGLang's validation shape (``type: "Bad
Request"``); what it can is converted (``"abort_all": "yes"`` is true) and left to the route's
own checks. A body that is no JSON, or none where the struct is not optional, is refused as
FastAPI refuses it there (``request_body.read_body``).

The routes: ``/pause_generation``, ``/continue_generation``, ``/abort_request``,
``/update_weight_version``, ``/slow_down``, ``/configure_logging``, ``/set_internal_state``, the
weight-update group's three, the update session's two, ``/update_weights_from_tensor``,
``/update_weights_from_disk``, ``/update_weights_from_ipc``, ``/get_weights_by_name``,
``/weights_checker`` and ``/start_profile`` (optional bodies), memory release and resume, the three
LoRA routes, ``/open_session`` and ``/close_session``, ``/parse_function_call``,
``/separate_reasoning``, and ``/encode`` and ``/classify`` (``EmbeddingReqInput``, a dataclass as
``/generate``'s is). ``serialized_named_tensors`` is read as its ``Base64Bytes`` marker reads it:
each string decoded (``Expected base64-encoded bytes`` when it is none), the route handed the
bytes."""

from __future__ import annotations

import base64
import binascii
import enum
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BeforeValidator
from typing_extensions import Required, TypedDict

from stages.engine.request_body import invalid, read_body
from stages.engine.request_fields import Checker, Ids, MaybeStrings

__all__ = [
    "ABORT",
    "BEGIN_UPDATE",
    "CHECK_WEIGHTS",
    "CLOSE_SESSION",
    "CLOSE_SESSIONS",
    "CONFIGURE_LOGGING",
    "CONTINUE",
    "DESTROY_GROUP",
    "ENCODE",
    "END_UPDATE",
    "INIT_GROUP",
    "INIT_SEND_GROUP",
    "LOAD_LORA",
    "LOAD_LORA_TENSORS",
    "MEMORY",
    "OPEN_SESSION",
    "PARSE_FUNCTION_CALL",
    "PAUSE",
    "PROFILE",
    "SEND_WEIGHTS",
    "SEPARATE_REASONING",
    "SET_INTERNAL_STATE",
    "SLOW_DOWN",
    "UNLOAD_LORA",
    "UPDATE_DISK",
    "UPDATE_DISTRIBUTED",
    "UPDATE_IPC",
    "UPDATE_TENSOR",
    "UPDATE_VERSION",
    "WEIGHTS_BY_NAME",
    "typed_body",
]

Selector = Literal["target", "draft", "all"]


def _base64(value: Any) -> Any:
    """SGLang's ``Base64Bytes`` marker: strings (in lists, at any depth) decoded, the rest left
    to ``list[bytes]``."""
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError("Expected base64-encoded bytes") from exc
    if isinstance(value, list):
        return [_base64(item) for item in value]
    return value


Base64Payloads = Annotated[list[bytes], BeforeValidator(_base64)]


class _Base(TypedDict, total=False):  # BaseReq
    rid: str | None
    http_worker_ipc: str | None


class PauseFields(_Base, total=False):  # PauseGenerationReqInput
    mode: Literal["abort", "retract", "in_place"]


class ContinueFields(_Base, total=False):  # ContinueGenerationReqInput
    torch_empty_cache: bool


class AbortFields(_Base, total=False):  # AbortReq
    abort_all: bool
    finished_reason: dict[str, str | int | list[int] | None] | None
    abort_message: str | None
    weight_versions: Any


class UpdateVersionFields(_Base, total=False):  # UpdateWeightVersionReqInput
    new_version: Required[str]
    abort_all_requests: bool


class SlowDownFields(_Base, total=False):  # SlowDownReqInput
    forward_sleep_time: Required[float | None]


class InitGroupFields(_Base, total=False):  # InitWeightsUpdateGroupReqInput
    master_address: Required[str]
    master_port: Required[int]
    rank_offset: Required[int]
    world_size: Required[int]
    group_name: str
    backend: str


class UpdateDistributedFields(_Base, total=False):  # UpdateWeightsFromDistributedReqInput
    names: Required[list[str]]
    dtypes: Required[list[str]]
    shapes: Required[list[list[int]]]
    group_name: str
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    load_format: str | None
    selector: Literal["target", "draft", "all"]
    torch_empty_cache: bool


class DestroyGroupFields(_Base, total=False):  # DestroyWeightsUpdateGroupReqInput
    group_name: str


class InitSendGroupFields(_Base, total=False):  # InitWeightsSendGroupForRemoteInstanceReqInput
    master_address: Required[str]
    ports: Required[str]
    group_rank: Required[int]
    world_size: Required[int]
    group_name: str
    backend: str


class SendWeightsFields(_Base, total=False):  # SendWeightsToRemoteInstanceReqInput
    master_address: Required[str]
    ports: Required[str]
    group_name: str


class BeginUpdateFields(_Base, total=False):  # BeginWeightUpdateReqInput
    selector: Selector


class EndUpdateFields(_Base, total=False):  # EndWeightUpdateReqInput
    pass


class UpdateTensorFields(_Base, total=False):  # UpdateWeightsFromTensorReqInput
    serialized_named_tensors: Required[Base64Payloads]
    load_format: str | None
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None
    selector: Selector
    torch_empty_cache: bool


class UpdateIpcFields(_Base, total=False):  # UpdateWeightsFromIPCReqInput
    zmq_handles: Required[dict[str, str]]
    flush_cache: bool
    weight_version: str | None
    torch_empty_cache: bool


class UpdateDiskFields(_Base, total=False):  # UpdateWeightFromDiskReqInput
    model_path: Required[str]
    load_format: str | None
    abort_all_requests: bool
    weight_version: str | None
    is_async: bool
    torch_empty_cache: bool
    keep_pause: bool
    recapture_cuda_graph: bool
    token_step: int
    flush_cache: bool
    manifest: dict[str, Any] | None


class WeightsByNameFields(_Base, total=False):  # GetWeightsByNameReqInput
    name: Required[str]
    truncate_size: int


class MemoryFields(_Base, total=False):  # Release- and ResumeMemoryOccupationReqInput
    tags: list[str] | None


class CheckWeightsFields(_Base, total=False):  # CheckWeightsReqInput
    action: str
    allow_quant_error: bool
    skip_tensor_list: list[str] | None
    selector: Selector


class LoadLoraFields(_Base, total=False):  # LoadLoRAAdapterReqInput
    lora_name: Required[str]
    lora_path: Required[str]
    pinned: bool
    lora_id: str | None


class UnloadLoraFields(_Base, total=False):  # UnloadLoRAAdapterReqInput
    lora_name: Required[str]
    lora_id: str | None


class LoadLoraTensorsFields(_Base, total=False):  # LoadLoRAAdapterFromTensorsReqInput
    lora_name: Required[str]
    config_dict: Required[dict[str, Any]]
    serialized_named_tensors: Required[Base64Payloads]
    pinned: bool
    added_tokens_config: dict[str, int] | None
    lora_id: str | None
    load_format: str | None
    expected_checksums: dict[str, str] | None


class ProfileReqType(enum.Enum):  # its name, as its values print
    START_PROFILE = 1
    STOP_PROFILE = 2


class ProfileFields(_Base, total=False):  # ProfileReq
    req_type: ProfileReqType
    output_dir: str | None
    start_step: int | None
    num_steps: int | None
    activities: list[str] | None
    profile_by_stage: bool
    with_stack: bool | None
    record_shapes: bool | None
    profile_id: str | None
    merge_profiles: bool
    profile_prefix: str | None
    profile_stages: list[str] | None
    detailed_annotations: bool


class FunctionFields(TypedDict, total=False):  # io_struct.Function
    description: str | None
    name: str | None
    parameters: dict[str, Any] | None


class ToolFields(TypedDict, total=False):  # io_struct.Tool
    function: Required[FunctionFields]
    type: str


class ParseFunctionCallFields(_Base, total=False):  # ParseFunctionCallReq
    text: Required[str]
    tools: list[ToolFields]
    tool_call_parser: str | None


class OpenSessionFields(_Base, total=False):  # OpenSessionReqInput
    capacity_of_str_len: Required[int]
    session_id: str | None
    streaming: bool | None
    timeout: float | None


class CloseSessionFields(_Base, total=False):  # CloseSessionReqInput
    session_id: Required[str]


class CloseSessionsFields(_Base, total=False):  # Inflight's /close_sessions: many at once
    session_ids: Required[list[str]]


class SeparateReasoningFields(_Base, total=False):  # SeparateReasoningReqInput
    text: Required[str]
    reasoning_parser: Required[str]
    return_blocks: bool


class ConfigureLoggingFields(_Base, total=False):  # ConfigureLoggingReq
    log_requests: bool | None
    log_requests_level: int | None
    log_requests_format: str | None
    log_level: str | None
    dump_requests_folder: str | None
    dump_requests_threshold: int | None
    crash_dump_folder: str | None
    dump_requests_exclude_meta_keys: list[str] | None


class SetInternalStateFields(_Base, total=False):  # SetInternalStateReq
    server_args: Required[dict[str, int | float]]


class EncodeFields(TypedDict, total=False):  # EmbeddingReqInput, as pydantic reads it
    rid: list[str] | str | None
    text: list[list[str]] | list[str] | str | None
    input_ids: Ids
    input_embeds: list[list[list[float]]] | list[list[float]] | None
    image_data: Any  # images, video, audio: what this engine refuses anyway
    video_data: Any
    audio_data: Any
    embed_override_token_id: int | None
    embed_overrides: Any
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None
    log_metrics: bool
    modalities: list[str] | None
    is_cross_encoder_request: bool
    lora_path: MaybeStrings
    lora_id: MaybeStrings
    positional_embed_overrides: Any
    routing_key: str | None
    http_worker_ipc: str | None
    background: bool
    priority: int | None
    dimensions: int | None
    return_pooled_hidden_states: bool
    return_prompt_token_ids: bool
    external_trace_header: dict[str, Any] | None
    received_time: float | None
    multi_item_delimiter_indices: Ids
    token_indices_to_pool: Ids
    decision_layout: Ids


PAUSE = Checker(PauseFields)
CONTINUE = Checker(ContinueFields)
ABORT = Checker(AbortFields)
UPDATE_VERSION = Checker(UpdateVersionFields)
SLOW_DOWN = Checker(SlowDownFields)
CONFIGURE_LOGGING = Checker(ConfigureLoggingFields)
SET_INTERNAL_STATE = Checker(SetInternalStateFields)
INIT_GROUP = Checker(InitGroupFields)
UPDATE_DISTRIBUTED = Checker(  # Inflight's: a delta update's base (weight_routes)
    UpdateDistributedFields, extensions=("base_version",)
)
DESTROY_GROUP = Checker(DestroyGroupFields)
INIT_SEND_GROUP = Checker(InitSendGroupFields)
SEND_WEIGHTS = Checker(SendWeightsFields)
BEGIN_UPDATE = Checker(BeginUpdateFields)
END_UPDATE = Checker(EndUpdateFields)
UPDATE_TENSOR = Checker(UpdateTensorFields)
UPDATE_DISK = Checker(UpdateDiskFields)
UPDATE_IPC = Checker(UpdateIpcFields)
WEIGHTS_BY_NAME = Checker(WeightsByNameFields)
MEMORY = Checker(MemoryFields)
CHECK_WEIGHTS = Checker(CheckWeightsFields)
LOAD_LORA = Checker(LoadLoraFields)
UNLOAD_LORA = Checker(UnloadLoraFields)
LOAD_LORA_TENSORS = Checker(LoadLoraTensorsFields)
PROFILE = Checker(ProfileFields)
PARSE_FUNCTION_CALL = Checker(ParseFunctionCallFields)
SEPARATE_REASONING = Checker(SeparateReasoningFields)
OPEN_SESSION = Checker(OpenSessionFields)
CLOSE_SESSION = Checker(CloseSessionFields)
CLOSE_SESSIONS = Checker(CloseSessionsFields)
ENCODE = Checker(EncodeFields)


async def typed_body(
    request: web.Request, check: Checker, *, optional: bool = False, dataclass: str = ""
) -> dict[str, Any] | web.Response:
    """``request``'s JSON body with its fields as ``check``'s struct reads them, or SGLang's
    400 for it. ``optional``: the route's struct parameter defaults to none there (an empty
    body is the struct's defaults); else an empty body is FastAPI's ``body: Field
    required``. ``dataclass``: the struct is this pydantic dataclass, whose words a body that
    is no object gets."""
    raw = await request.read()
    if optional and not raw:
        return {}
    body, refused = read_body(raw, request.headers.get("Content-Type"))
    if refused is not None:
        return refused
    if dataclass and not isinstance(body, dict):
        return invalid(f"Input should be a dictionary or an instance of {dataclass}")
    try:
        return check(body)
    except ValueError as exc:
        return invalid(str(exc))
