"""Tool calls in dots' format (SGLang's ``--tool-call-parser dots``)::

    <dots_function_call>
    <invoke name="search">
    <parameter name="query">weather in Shanghai</parameter>
    </invoke>
    </dots_function_call>

or a block holding one JSON call, ``{"name": ..., "arguments": {...}}``.

As SGLang 0.5.23 reads them (``function_call/dots_detector.py``, as installed: without the
optional ``json_repair``, which SGLang does not require;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): the content is the text before the first ``<dots_function_call>``,
  stripped. Each block up to its ``</dots_function_call>`` holds calls: where its text (stripped)
  begins with ``<invoke``, each ``<invoke name=NAME>`` ... ``</invoke>`` (the name unquoted),
  whose ``<parameter name=KEY>VALUE</parameter>`` values (stripped) are read by their
  parameter's type (``$ref`` to ``$defs`` and ``anyOf``/``oneOf``/``allOf`` branches followed to
  the first type that is not null; none: string): ``null`` in any case None, a string kept,
  integers and numbers as Python reads them (a whole number an integer) else the text,
  booleans true for ``true`` or ``1``, anything else JSON or the text; otherwise the block is one
  JSON object, a call (``parameters`` before ``arguments``). Calls to tools not offered are
  dropped (logged); a block that cannot be read gives none (logged).
- streamed (``stream``): the content before the first block as it comes (a tail that may begin
  the tag, and trailing whitespace, wait), each block's calls whole at its end tag: the whole
  answer's. (SGLang's stream also sends the text after and between blocks, without end tags,
  and a block that cannot be read, as content, and a JSON call before its end tag.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import ContentFirst
from stages.engine.qwen3_coder_calls import _properties

__all__ = ["BEGIN", "DotsCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<dots_function_call>", "</dots_function_call>"
_BLOCKS = re.compile(re.escape(BEGIN) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)
_INVOKE = re.compile(r"<invoke\s+name\s*=\s*([^>]+)>(.*?)</invoke>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter\s+name\s*=\s*([^>]+)>(.*?)</parameter>", re.DOTALL)
_REF = "#/$defs/"
# what reading a block raises where the detector gives up on that block
_FAILS = (ValueError, TypeError)

Pieces = list[dict[str, Any]]


class DotsCalls:
    """The calls of answers to one request (``tools``: its tools, their parameters' types)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.places: dict[Any, int] = {}
        self.schemas: dict[Any, Any] = {}
        for place, tool in enumerate(tools):
            fn = tool.get("function") or {}
            self.places[fn.get("name")] = place
            self.schemas.setdefault(fn.get("name"), fn.get("parameters"))  # the first of a name

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        calls: list[dict[str, str]] = []
        try:
            for block in _BLOCKS.finditer(text):
                calls += self.block(block.group(1))
        except RecursionError:  # out of the detector: serving_chat's except Exception
            return text, []
        return text[:at].strip(), calls

    def block(self, body: str) -> list[dict[str, str]]:
        """The calls of one block (``body``: its text between the tags); none, logged, where
        it cannot be read."""
        body = body.strip()
        calls = []
        try:
            if body.startswith("<invoke"):
                found = [self.invoke(m.group(1), m.group(2)) for m in _INVOKE.finditer(body)]
            else:
                found = [json.loads(body)]
                if not isinstance(found[0], dict):
                    raise TypeError("dots JSON tool call must be an object")
            for call in found:
                name = call.get("name")
                if not name or name not in self.places:
                    log.warning("tool_call_unknown_function", name=str(name)[:100])
                    continue
                arguments = call.get("parameters") or call.get("arguments", {})
                calls.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
        except _FAILS as exc:  # the calls read before the failure stay, as there
            log.warning("tool_call_unparsed", format="dots", error=str(exc)[:200])
        return calls

    def invoke(self, raw_name: str, body: str) -> dict[str, Any]:
        """``{name, arguments}`` of one ``<invoke>`` (its name as written, and its body)."""
        name = _unquoted(raw_name)
        schema = self.schemas.get(name)
        properties, defs = {}, {}
        if isinstance(schema, dict):
            properties = _properties(schema)
            found = schema.get("$defs", {})
            defs = found if isinstance(found, dict) else {}
        arguments: dict[str, Any] = {}
        for key, raw in _PARAMETER.findall(body):
            key = _unquoted(key)
            kind = (_type_of(properties[key], defs) or "string") if key in properties else "string"
            arguments[key] = _value(raw.strip(), kind)
        return {"name": name, "arguments": arguments}

    def stream(self) -> _DotsStream:
        return _DotsStream(self)


def _unquoted(raw: str) -> str:
    """A name as written, stripped and out of one pair of matching quotes."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw


def _type_of(schema: Any, defs: dict[str, Any], depth: int = 0) -> Any:
    """A parameter's ``type`` (None: none found): its own, else through a ``$ref`` to its
    ``$defs`` or the first branch of ``anyOf``, ``oneOf`` or ``allOf`` that is not null and has
    one, ten levels deep at most (``_resolve_param_type``)."""
    if not isinstance(schema, dict) or depth > 10:
        return None
    if "type" in schema:
        return schema["type"]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(_REF):
        return _type_of(defs.get(ref.rsplit("/", 1)[-1]), defs, depth + 1)
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        for branch in branches if isinstance(branches, list) else ():
            if isinstance(branch, dict) and branch.get("type") == "null":
                continue
            found = _type_of(branch, defs, depth + 1)
            if found is not None:
                return found
    return None


def _value(raw: str, kind: Any) -> Any:
    """A parameter's text read as its type says (``_convert_param_value``)."""
    if raw.lower() == "null":
        return None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = (kind if isinstance(kind, str) else str(kind)).lower()
    if kind in ("string", "str", "text"):
        return raw
    if kind in ("integer", "int"):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind in ("number", "float"):
        try:
            number = float(raw)
        except ValueError:
            return raw
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool"):
        return raw.lower() in ("true", "1")
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class _DotsStream(ContentFirst):
    begin, end = BEGIN, END

    def __init__(self, reader: DotsCalls) -> None:
        super().__init__()
        self.reader = reader

    def whole(self, key: int, text: str) -> Pieces:
        match = _BLOCKS.match(text)
        if match is None:  # (MarkedStream hands over a block from its tag to its end tag)
            return []
        try:
            calls = self.reader.block(match.group(1))
        except RecursionError:  # (the whole answer then has none)
            log.warning("tool_call_unparsed", format="dots", error="nested too deep")
            return []
        pieces: Pieces = []
        for i, call in enumerate(calls):
            pieces += self.pieces.whole((key, i), call["name"], call["arguments"])
        return pieces
