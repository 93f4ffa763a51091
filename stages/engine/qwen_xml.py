"""``json_schema`` with ``style: qwen_xml`` in the newer structural-tag form: Qwen3-Coder's
parameters, ``<parameter=NAME>VALUE</parameter>`` one after another, as xgrammar 0.2.7 writes
their grammar (``Grammar.from_structural_tag``), for llguidance (``structural_format``).

As xgrammar reads a schema (``any_order`` false):

- an object's ``properties`` in their order, those in ``required`` always there, the others
  each there or not; then, with ``additionalProperties`` true or a schema, any number of
  parameters of other names (``[a-zA-Z_][a-zA-Z0-9_]*``); without it none (xgrammar's strict
  default); whitespace before each parameter and after the last;
- a value: a ``string`` (no other keyword but ``description`` and ``title``) raw text up to
  ``</parameter>``; a string ``enum`` or ``const`` its raw text; a string with ``maxLength``
  or ``minLength`` that many characters of any kind; ``integer``, ``number``, ``boolean``,
  ``null``, ``object`` and ``array`` their JSON; an untyped value raw text, a JSON array or a
  JSON object; a union of ``string`` with scalars raw text; all but the raw text with
  whitespace around it;
- the schema ``true`` (a tool that is not strict): any parameters of any names, untyped.

llguidance's lexer does not go back to a shorter lexeme once a longer one fails, so what could
share a beginning is one lexeme each: a parameter's opening with the whitespace before it, the
end that follows the parameters with the whitespace before it, and each value with what ends
it (whitespace, ``</parameter>``) where it is a regular language; JSON objects and arrays are
their own lexemes after a whitespace lexeme. Other schemas are refused with what and where.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["QwenXml"]

_WS = "[ \\n\\r\\t]*"
# keywords that do not change what a value may be
_NOTES = {"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly",
          "$comment"}  # fmt: skip
_SCALARS = {"integer", "number", "boolean", "null"}
_OBJECT_RULES = {
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "unevaluatedProperties", "if", "then", "else", "allOf", "anyOf",
    "oneOf", "not", "$ref",
}  # fmt: skip


_DSML = "\uff5cDSML\uff5c"
# each style's parameter: (the opening before the name, the regex of the rest of the opening,
# the close)
STYLES = {
    "qwen_xml": ("<parameter=", ">", "</parameter>"),
    "deepseek_xml": (
        f'<{_DSML}parameter name="',
        '" string="(true|false)">',
        f"</{_DSML}parameter>",
    ),
}


class QwenXml:
    """Writes the rules of a ``qwen_xml`` value (or ``deepseek_xml``: DeepSeek V3.2's
    ``<|DSML|parameter name="KEY" string="true|false">VALUE</|DSML|parameter>``, its bars
    fullwidth, read the same way) into a ``structural_format`` compiler's grammar
    (``compiler.lines``, ``compiler.rule``)."""

    def __init__(self, compiler: Any, error: type[Exception], style: str = "qwen_xml") -> None:
        self.c = compiler
        self.defs: dict[str, Any] = {}
        self.defs_key = "$defs"
        self.error = error
        self.names: dict[str, str] = {}  # shared lexemes, by what they are
        opening, self.after_name, close = STYLES[style]
        self.opening = compiler.regex_literal(opening)
        self.close = close
        self.close_re = compiler.regex_literal(close)
        self.style = style

    def shared(self, key: str, body: str) -> str:
        name = self.names.get(key)
        if name is None:
            self.c.count += 1
            name = self.names[key] = f"XML_{key.upper()}_{self.c.count}"
            self.c.lines.append(f"{name}: {body}")
        return name

    def ws(self) -> str:
        return self.shared("ws", "/[ \\n\\r\\t]+/") + "?"

    def grammar(self, schema: Any, path: str, tail: str) -> str:
        """The parameters of ``schema``, then ``tail`` (a Lark expression that begins with
        whitespace allowed before it: the end that follows, or nothing)."""
        if schema is True or schema == {}:
            return self.c.rule("xml", f"{self.other(path, {})}* {tail}".strip())
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise self.error(f"{path}: a {self.style} schema must be an object schema or true")
        extra = sorted(set(schema) & _OBJECT_RULES)
        if extra:  # keywords that would change which parameters may come (others are notes)
            raise self.error(f"{path}.{extra[0]}: not supported in the {self.style} style")
        self.defs = schema.get("$defs") or schema.get("definitions") or {}
        self.defs_key = "$defs" if "$defs" in schema else "definitions"
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        if not isinstance(properties, dict) or not set(required) <= set(properties):
            raise self.error(f"{path}.required: names properties the schema does not have")
        parts = []
        for name, value in properties.items():
            if not _is_name(name):
                raise self.error(f"{path}.properties: {name!r} is not a parameter name")
            opener = self.shared(f"open_{name}", f"/{_WS}{self.opening}{name}{self.after_name}/")
            item = f"{opener} {self.value(value, f'{path}.properties.{name}')}"
            parts.append(item if name in required else f"({item})?")
        more = schema.get("additionalProperties", False)
        if more is not False:
            parts.append(f"{self.other(f'{path}.additionalProperties', more)}*")
        return self.c.rule("xml", " ".join([*parts, tail]).strip())

    def other(self, path: str, schema: Any) -> str:
        """A parameter of any name whose value follows ``schema`` (``{}``/true: untyped)."""
        name = "[a-zA-Z_][a-zA-Z0-9_]*"
        opener = self.shared("open", f"/{_WS}{self.opening}{name}{self.after_name}/")
        value = self.value({} if schema is True else schema, path)
        return self.c.rule("xml_param", f"{opener} {value}")

    def value(self, schema: Any, path: str) -> str:
        """A value of ``schema`` with the ``</parameter>`` that ends it."""
        if schema is True or schema == {} or (isinstance(schema, dict) and set(schema) <= _NOTES):
            return self.untyped()
        if not isinstance(schema, dict):
            raise self.error(f"{path}: a schema object is required")
        if "$ref" in schema:  # a definition of the schema's own: read as it is
            ref = schema["$ref"]
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
            prefix = f"#/{self.defs_key}/"
            if not isinstance(ref, str) or not ref.startswith(prefix) or name not in self.defs:
                raise self.error(f"{path}.$ref: {ref!r} is not one of the schema's definitions")
            if set(schema) - _NOTES - {"$ref"}:
                raise self.error(f"{path}: a $ref with other keywords is not supported")
            return self.value(self.defs[name], f"{path}.$ref")
        kinds = schema.get("type")
        if isinstance(kinds, list) and "string" in kinds:
            if not set(kinds) - {"string"} <= _SCALARS or set(schema) - _NOTES - {"type"}:
                raise self.error(f"{path}: this union with string is not supported")
            return self.raw_text()
        if "anyOf" in schema:
            cases = schema["anyOf"]
            types = {c.get("type") for c in cases if isinstance(c, dict)}
            if "string" in types and types - {"string"} <= _SCALARS and len(types) == len(cases):
                return self.raw_text()
            raise self.error(f"{path}.anyOf: not supported in the {self.style} style")
        if "enum" in schema or "const" in schema:
            options = schema["enum"] if "enum" in schema else [schema["const"]]
            if options and all(isinstance(o, str) for o in options):
                return self.lexeme("|".join(self.c.regex_literal(o) for o in options))
        if kinds == "string":
            rest = set(schema) - _NOTES - {"type"}
            if not rest:
                return self.raw_text()
            if rest <= {"maxLength", "minLength"}:
                low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
                count = f"{{{low},{'' if high is None else int(high)}}}"
                return self.lexeme(f"(.|\\n){count}")
            raise self.error(f"{path}: a string with {sorted(rest)[0]} is not supported here")
        if kinds in _SCALARS or kinds in ("object", "array") or "enum" in schema:
            if self.defs:  # its references resolved against the schema's definitions
                schema = {**schema, self.defs_key: self.defs}
            value = self.c.rule("xml_json", f"%json {json.dumps(self.c.strict(schema))}")
            close = self.shared("close", f"/{_WS}{self.close_re}/")
            return f"{self.ws()} {value} {close}"
        raise self.error(f"{path}: this schema is not supported in the {self.style} style")

    def lexeme(self, pattern: str) -> str:
        """Whitespace, ``pattern``, whitespace and the close: one lexeme."""
        self.c.count += 1
        name = f"XML_VALUE_{self.c.count}"
        self.c.lines.append(f"{name}: /{_WS}({pattern}){_WS}{self.close_re}/")
        return name

    def raw_text(self) -> str:
        not_closed = f"/(.|\\n)*/ & ~/(.|\\n)*{self.close_re}(.|\\n)*/"
        text = self.shared("text", not_closed)
        return self.shared("string", f"{text} {json.dumps(self.close)}")

    def untyped(self) -> str:
        """Raw text, or a JSON array or object with whitespace around it."""
        close = self.shared("close", f"/{_WS}{self.close_re}/")
        json_any = self.c.rule("xml_json", '%json {"type": ["array", "object"]}')
        return self.c.rule("xml_any", f"{self.raw_text()} | {self.ws()} {json_any} {close}")


def _is_name(name: str) -> bool:
    import re

    return re.fullmatch("[a-zA-Z_][a-zA-Z0-9_]*", name) is not None
