"""A chat request's tool ``parameters`` as SGLang 0.5.23 takes them
(``OpenAIServingChat._validate_request``, ``function_call/utils.normalize_json_schema_types``).

Each tool's ``parameters`` (the request's tools, then those of its system and developer
messages) first has its non-standard ``type`` names rewritten in place to JSON Schema's, the
names database and ORM tooling exports: ``varchar``, ``text``, ``uuid``, ``date``... as
``string``, ``bool`` as ``boolean``, ``bigint`` as ``integer``, ``decimal`` as ``number``,
``tuple`` as ``array``, ``map`` as ``object``; a name with parameters (``varchar(255)``), in
capitals or with spaces around, as its base; ``int…``/``uint…``/``long…``/``short…``/
``unsigned…`` as ``integer``, ``num…``/``float…`` as ``number``, ``list…`` as ``array`` and
``dict…`` as ``object`` where the prefix is the whole name or is followed by a digit, ``[``, ``<``,
``(`` or a space (``int32``, ``list[str]``, not ``internal``); in a list of types, duplicates
after rewriting dropped; other names left as they are. It walks every place a schema holds
schemas (``properties``, ``items``, ``anyOf``, ``$defs``...). The rewritten schema is what the
chat template shows the model and what the tool-call readers type values by, as there.

Then the schema must be a valid JSON Schema (draft 2020-12's metaschema, ``jsonschema``'s
``Draft202012Validator.check_schema``): else SGLang's 400, ``Tool {i} function has invalid
'parameters' schema: ...`` (``i`` counting the request's tools, then the messages'), or for a
schema nested too deep ``... is too deeply nested or contains a cycle.``

A schema found valid is remembered by its JSON text (the last ``_KNOWN_MAX``): an agent offers
the same tools with every call, and the metaschema check costs about a millisecond each.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["normalize_types", "schema_error"]

_STANDARD = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_ALIASES = {
    **dict.fromkeys(
        ("str", "text", "varchar", "char", "enum", "uuid", "date", "datetime", "time",
         "timestamp", "binary", "blob", "bytea", "bytes", "varbinary"),
        "string",
    ),
    "bool": "boolean",
    **dict.fromkeys(("bigint", "smallint", "tinyint"), "integer"),
    **dict.fromkeys(("double", "decimal", "real", "numeric"), "number"),
    **dict.fromkeys(("arr", "tuple", "set"), "array"),
    "map": "object",
}  # fmt: skip
_PREFIXES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)
_BOUNDARY = frozenset("0123456789[<( \t")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def _type(raw: Any) -> Any:
    """One ``type`` name as JSON Schema's (``_normalize_single_type``)."""
    if not isinstance(raw, str) or raw in _STANDARD:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD:
        return base
    if base in _ALIASES:
        return _ALIASES[base]
    for prefixes, target in _PREFIXES:
        for prefix in prefixes:
            if base == prefix or (
                len(base) > len(prefix)
                and base.startswith(prefix)
                and base[len(prefix)] in _BOUNDARY
            ):
                return target
    return raw


def normalize_types(schema: Any) -> None:
    """Rewrite ``schema``'s ``type`` names in place (``normalize_json_schema_types``)."""
    if isinstance(schema, list):
        for item in schema:
            normalize_types(item)
        return
    if not isinstance(schema, dict):
        return
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            schema["type"] = _type(kind)
        elif isinstance(kind, list):
            rewritten: list[Any] = []
            for item in kind:
                if (name := _type(item)) not in rewritten:
                    rewritten.append(name)
            schema["type"] = rewritten
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for value in schema[key].values():
                normalize_types(value)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for value in schema[key]:
                normalize_types(value)
    for key in _SCHEMAS:
        if key in schema:
            normalize_types(schema[key])


_KNOWN_MAX = 512
_KNOWN_VALID: set[str] = set()  # the JSON texts of schemas found valid


def schema_error(index: int, parameters: Any) -> str | None:
    """Normalize the ``index``-th tool's ``parameters`` in place and check them: SGLang's
    refusal, or None (no parameters: nothing to check)."""
    if parameters is None:
        return None
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        normalize_types(parameters)
        try:
            key = json.dumps(parameters)
        except (TypeError, ValueError):  # not JSON's (a caller's own objects): checked each time
            key = None
        if key is not None and key in _KNOWN_VALID:
            return None
        Draft202012Validator.check_schema(parameters)
        if key is not None:
            if len(_KNOWN_VALID) >= _KNOWN_MAX:
                _KNOWN_VALID.clear()
            _KNOWN_VALID.add(key)
    except SchemaError as exc:
        return f"Tool {index} function has invalid 'parameters' schema: {exc}"
    except RecursionError:
        return (
            f"Tool {index} function 'parameters' schema is too deeply nested or contains a cycle."
        )
    return None
