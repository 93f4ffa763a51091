"""The JSON bodies of the engine's native routes: read, and their fields checked, with the
field's name in the error (``RequestError``); the weight routes' failure answer.

SGLang reads each body into its request struct (``io_struct``, through
``msgspec_utils.msgspec_struct_pydantic_core_schema``): a field of the wrong type is refused,
unknown fields are ignored. ``base_request`` checks the fields every SGLang request has.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from stages.engine.protocol import RequestError, is_int

__all__ = [
    "bad_request",
    "base_request",
    "dumps",
    "failure",
    "field",
    "invalid",
    "is_int",
    "json_response",
    "lax_bool",
    "loads",
    "option",
    "read_body",
]

try:  # the engine's JSON: orjson parses and writes several times faster; json is the fallback
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
    dumps: Callable[[Any], bytes] = orjson.dumps
except ImportError:  # pragma: no cover - depends on the environment
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def read_body(raw: bytes, content_type: str | None) -> tuple[Any, web.Response | None]:
    """``(body, None)`` of a request's bytes as FastAPI (0.132 and later: strict content
    types) reads a body parameter, or ``(None, SGLang's 400 for them)``: none at all is ``body:
    Field required``; bytes sent as JSON (``application/json`` or ``application/*+json``) are
    parsed (``json_invalid`` at the character it stopped at when they are no JSON); bytes sent
    as anything else, or with no content type, stay bytes, which the route's struct then
    refuses as it refuses any body that is no object."""
    if not raw:
        return None, invalid("body: Field required")
    if not _json_media(content_type):
        return raw, None
    try:
        return loads(raw), None
    except (UnicodeDecodeError, ValueError) as exc:
        return None, invalid(f"body.{getattr(exc, 'pos', 0)}: JSON decode error")


def _json_media(content_type: str | None) -> bool:
    """Whether FastAPI reads a body with this ``Content-Type`` as JSON."""
    if not content_type:
        return False
    kind, _, sub = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


# pydantic's strings for a bool (any case)
_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    ok = is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise RequestError(name, f"expected {kind.__name__}, got {value!r}")
    return value


def base_request(body: dict[str, Any]) -> dict[str, Any]:
    """``body``, its fields of every SGLang request (``io_struct.BaseReq``: ``rid``,
    ``http_worker_ipc``, strings or null) checked; other unknown fields are ignored there."""
    for name in ("rid", "http_worker_ipc"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise RequestError(name, f"expected a string, got {body[name]!r}")
    return body


def option(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` checked as ``field`` checks it; ``default`` when absent (or null, where
    the default is null)."""
    if name not in body or (body[name] is None and default is None):
        return default
    return field(body, name, kind)


def failure(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


def json_response(obj: Any) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json")


def bad_request(message: str) -> web.Response:
    """A native route's 400: ``{"error": {"message": "<field>: <problem>"}}``."""
    return web.json_response({"error": {"message": message}}, status=400)


def lax_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """``body[name]`` (``default`` when absent) as pydantic reads a bool from JSON: also
    ``1``/``0`` and strings such as ``"yes"`` or ``"off"``."""
    value = body.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise RequestError(name, f"Input should be a valid boolean, got {value!r}")


def invalid(message: str, kind: str = "Bad Request") -> web.Response:
    """SGLang's ``ErrorResponse`` with status 400: by default its answer to a body that fails
    its request struct (its ``RequestValidationError`` handler), ``{object: "error", message,
    type: "Bad Request", param: null, code: 400}``; ``kind``: another ``type``."""
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": 400},
        status=400,
    )
