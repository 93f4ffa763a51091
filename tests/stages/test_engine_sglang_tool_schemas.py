"""Tool ``parameters`` type names (``stages.engine.tool_schemas.normalize_types``) against SGLang
0.5.23's own ``function_call/utils.normalize_json_schema_types`` on random schemas: database and
ORM type names, parameterized, in capitals, with spaces, as prefixes and not, in lists with
duplicates, at every place a schema holds schemas: the same schema, rewritten in place.

Skipped unless SGLang's source imports (``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

utils: Any = pytest.importorskip("sglang.srt.function_call.utils")

from stages.engine.tool_schemas import normalize_types  # noqa: E402

NAMES = ["string", "integer", "varchar", "VARCHAR(255)", " text ", "int", "int32", "internal",
         "uint8", "long", "short int", "unsigned", "num", "numeric", "float64", "floaty",
         "list", "list[str]", "listing", "dict", "dict<str,int>", "dictionary", "tuple", "set",
         "map", "bool", "Boolean", "decimal(10,2)", "bigint", "uuid", "date", "blob", "enum",
         "null", "object", "array", "number", "weird", "", 5, None]  # fmt: skip
NESTS = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "anyOf",
         "oneOf", "allOf", "prefixItems", "items", "additionalProperties", "not", "if", "then",
         "else", "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
         "other"]  # fmt: skip


def _schema(r: random.Random, depth: int = 0) -> Any:
    if depth > 3 or r.random() < 0.2:
        return r.choice([True, {}, {"type": r.choice(NAMES)}, [1, 2]])
    schema: dict[str, Any] = {}
    if r.random() < 0.8:
        schema["type"] = (
            [r.choice(NAMES) for _ in range(r.randint(0, 4))] if r.random() < 0.3
            else r.choice(NAMES)
        )  # fmt: skip
    for key in r.sample(NESTS, r.randint(0, 3)):
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            schema[key] = {f"k{i}": _schema(r, depth + 1) for i in range(r.randint(0, 3))}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            schema[key] = [_schema(r, depth + 1) for _ in range(r.randint(0, 3))]
        else:
            schema[key] = _schema(r, depth + 1)
    return schema


def test_tool_schema_types_are_rewritten_as_sglang_rewrites_them() -> None:
    """``function_call/utils.py:113`` (``normalize_json_schema_types``)."""
    r = random.Random(9)
    changed = 0
    for _ in range(5000):
        schema = _schema(r)
        mine, theirs = copy.deepcopy(schema), copy.deepcopy(schema)
        normalize_types(mine)
        utils.normalize_json_schema_types(theirs)
        assert json.dumps(mine) == json.dumps(theirs), schema
        changed += json.dumps(mine) != json.dumps(schema)
    assert changed > 2000
