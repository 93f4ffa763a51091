"""The JSON bodies of the engine's native routes: read as FastAPI reads them (``read_body``;
their fields are typed by ``control_fields`` and ``generate_contract``), and the answers the
routes give: the engine's JSON (``dumps``, ``loads``), SGLang's validation shape
(``invalid``), a native route's ``{error: {message}}`` (``bad_request``) and the weight
routes' ``{success, message}`` (``failure``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web

from stages.engine.protocol import is_int

__all__ = [
    "bad_request",
    "dumps",
    "failure",
    "invalid",
    "is_int",
    "json_response",
    "loads",
    "read_body",
]

try:  # the engine's JSON: orjson parses and writes several times faster; json is the fallback
    import orjson

    def dumps(obj: Any) -> bytes:
        """An answer's JSON: orjson's, or (an integer past 64 bits, which a request may carry
        into its answer: ``/v1/responses`` echoes its ``metadata``) Python's, written as
        orjson writes the rest (compact, UTF-8, ``NaN`` and ``Infinity`` as ``null``), as
        SGLang's pydantic writes such an integer."""
        try:
            return orjson.dumps(obj)
        except TypeError:  # orjson: "Integer exceeds 64-bit range"
            text = json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False)
            return text.encode("utf-8", "replace")

    def loads(raw: bytes) -> Any:
        """A request body as FastAPI reads it (Starlette: Python's ``json.loads``), through
        orjson where the two agree. They do not on integers beyond 64 bits (orjson: a float,
        from 19 digits on for a negative one), which any run of 19 digits sends to Python's
        parser, nor on what orjson refuses and Python's takes (``NaN``, ``Infinity``, numbers
        beyond a double, UTF-16 and UTF-32 bytes): Python's then reads it, or raises its own
        error at its own position. A string with a lone surrogate (``"\\ud800"``), which
        no text can hold, is refused as orjson refuses it (SGLang's pydantic models refuse
        it in every field typed ``str``: a 400 either way), so that it never reaches a
        tokenizer, a log or an engine state every later answer writes out."""
        if _LONG_DIGITS.search(raw) is None:
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError:
                pass
        body = json.loads(raw)
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            orjson.loads(raw)  # raises its error, at its position
            raise ValueError("a string holds a lone surrogate") from None
        return body

except ImportError:  # pragma: no cover - depends on the environment
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _finite(obj: Any) -> Any:
    """``obj`` with ``NaN`` and the infinities as None (what orjson writes for them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(value) for value in obj]
    return obj


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


def failure(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


def json_response(obj: Any) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json")


def bad_request(message: str) -> web.Response:
    """A native route's 400: ``{"error": {"message": "<field>: <problem>"}}``."""
    return web.json_response({"error": {"message": message}}, status=400)


def invalid(message: str, kind: str = "Bad Request", *, status: int = 400) -> web.Response:
    """SGLang's ``ErrorResponse``: by default its answer to a body that fails its request
    struct (its ``RequestValidationError`` handler), ``{object: "error", message, type: "Bad
    Request", param: null, code: 400}``; ``kind``: another ``type``; ``status``: another
    status (its ``HTTPException`` handler's, whose ``type`` is the status)."""
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status=status,
    )
