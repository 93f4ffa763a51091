"""The control and weight-update routes' bodies typed as SGLang 0.5.23 types them before the
route runs: FastAPI reads each into its request struct (``managers/io_struct.py``, msgspec
Structs that ``msgspec_struct_pydantic_core_schema`` hands to pydantic as typed dicts: lax
conversions, other keys ignored). What it cannot read is a 400 in SGLang's validation shape
(``type: "Bad Request"``); what it can is converted (``"abort_all": "yes"`` is true) and left
to the route's own checks. The routes: ``/pause_generation``, ``/continue_generation``,
``/abort_request``, ``/update_weight_version``, ``/slow_down``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``. (An empty body, which
FastAPI would refuse, stays taken where the routes took it: pause, continue, destroy.)"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from typing_extensions import Required, TypedDict

from stages.engine.protocol import RequestError
from stages.engine.request_body import bad_request, invalid, json_body
from stages.engine.request_fields import Checker

__all__ = [
    "ABORT",
    "CONTINUE",
    "DESTROY_GROUP",
    "INIT_GROUP",
    "PAUSE",
    "SLOW_DOWN",
    "UPDATE_DISTRIBUTED",
    "UPDATE_VERSION",
    "typed_body",
]


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


PAUSE = Checker(PauseFields)
CONTINUE = Checker(ContinueFields)
ABORT = Checker(AbortFields)
UPDATE_VERSION = Checker(UpdateVersionFields)
SLOW_DOWN = Checker(SlowDownFields)
INIT_GROUP = Checker(InitGroupFields)
UPDATE_DISTRIBUTED = Checker(UpdateDistributedFields)
DESTROY_GROUP = Checker(DestroyGroupFields)


async def typed_body(
    request: web.Request, check: Checker, *, allow_empty: bool = False
) -> dict[str, Any] | web.Response:
    """``request``'s JSON body with its fields as ``check``'s struct reads them, or the 400
    that answers it (the route's own for a body that is no JSON object)."""
    try:
        body = await json_body(request, allow_empty=allow_empty)
    except RequestError as exc:
        return bad_request(str(exc))
    try:
        return check(body)
    except ValueError as exc:
        return invalid(str(exc))
