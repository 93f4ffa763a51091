"""Tool calls in GLM-4.7's format (SGLang's ``--tool-call-parser glm47``, GLM-4.7 and GLM-5):
GLM-4.5's tags without the newlines, a call's name followed by its pairs::

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>

As SGLang 0.5.23 reads them (``function_call/glm47_moe_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): each ``<tool_call>`` up to the next ``</tool_call>`` is a call, its name
  the text before its first ``<arg_key>`` (as it is: a name with spaces around it is no tool's),
  its arguments each ``<arg_key>KEY</arg_key>`` followed by ``<arg_value>VALUE</arg_value>``.
  The content is the text outside the calls (before, between and after them) joined and
  stripped. A call to a tool not offered is dropped (logged).
- a value is read by what its parameter's schema allows (``types``): the JSON types a key can
  take, through ``$ref``, ``anyOf``/``oneOf`` (a union; with sibling arguments, only the
  branches they fit), ``allOf`` (an intersection), ``type``, ``enum`` and ``const``. One type
  (or number and integer together: number) reads the value as that type: a string keeps the
  text (its JSON reading if that is a string), a number or integer turns a JSON string of one
  into it, others read JSON, else a Python literal, else the text. No type or several: JSON, else
  the text, and a JSON reading of a type the schema forbids goes back to the text where the
  schema takes a string. A function whose union leaves a key's type open reads its arguments
  twice, the second time knowing its siblings' values (``_Typing.arguments``).
- an answer whose values cannot be written as JSON (a Python set) or whose schema cannot be
  walked has no calls, its text the content (the detector's ``except Exception``).
- streamed (``stream``): content as it comes (a tail that may begin ``<tool_call>`` waits; so
  does whitespace, which the whole answer strips at its ends); a call is named once its
  ``<arg_key>`` or ``</tool_call>`` comes, its arguments go out as its pairs close (all at
  ``</tool_call>`` for a function whose union needs its siblings, as SGLang buffers them). A
  call cut short keeps what of its arguments went out, closed at the end (``unsent``), where the
  whole answer has it as content (SGLang's stream names it too); one cut short before it was
  named is content, as the whole answer has it. A key given twice: the whole answer keeps its
  last value, which a stream that sent the first cannot (logged ``tool_call_pieces_diverged``).

Differences from SGLang's stream, which writes each value as it comes: it names calls to tools
not offered, sends the name stripped, and a value of an object, array or boolean type as the
model wrote it; here the stream gives what the whole answer gives.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.glm_calls import _number, literal, unquoted
from stages.engine.marked_stream import _FAILS, BlockStream, OutsideText
from stages.engine.tool_formats import _Unreadable, offered_call

__all__ = ["Glm47Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END, KEY = "<tool_call>", "</tool_call>", "<arg_key>"
_CALLS = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)  # func_call_regex
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)
_UNSET = object()
# a value's JSON type as the detector names it (``_json_type``); a float that is whole is an
# integer; any other Python type: the detector's KeyError, the answer unread
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number",
               str: "string", list: "array", dict: "object"}  # fmt: skip

Pieces = list[dict[str, Any]]


def json_type(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return "integer"
    try:
        return _JSON_TYPES[type(value)]
    except KeyError:
        raise _Unreadable(f"a value of type {type(value).__name__} is not JSON") from None


def _same(a: Any, b: Any) -> bool:
    """JSON equality (``_json_equal``): types first, so ``1`` is not ``true``."""
    if json_type(a) != json_type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=False))
    return a == b


def _pointer(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` names; KeyError, IndexError, TypeError or ValueError where
    it names none."""
    target = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        target = target[int(part)] if isinstance(target, list) else target[part]
    return target


def types(
    schema: Any,
    root: Any,
    key: str | None = None,
    siblings: dict[str, Any] | None = None,
    value: Any = _UNSET,
    seen: frozenset[int] = frozenset(),
) -> set[str] | None:
    """The JSON types ``schema`` allows ``key``'s value (no key: the schema's own value), None
    where it says nothing (``_argument_types``); ``siblings``: the other arguments, which
    choose among a union's branches; ``value``: the value itself, which narrows an enum."""
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    seen = seen | {id(schema)}
    found: list[set[str]] = []

    def keep(allowed: set[str] | None) -> None:
        if allowed is not None:
            found.append(allowed)

    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        try:
            target = _pointer(root, ref)
        except (KeyError, IndexError, TypeError, ValueError):
            pass
        else:
            keep(types(target, root, key, siblings, value, seen))
    if key is not None:
        keep(types(schema.get("properties", {}).get(key), root, value=value, seen=seen))
    else:
        named = schema.get("type")
        if isinstance(named, str):
            found.append({named, "integer"} if named == "number" else {named})
        elif isinstance(named, list):
            found.append(set(named) | ({"integer"} if "number" in named else set()))
        allowed = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(allowed, list):
            found.append({json_type(a) for a in allowed if value is _UNSET or _same(value, a)})
    for union in ("anyOf", "oneOf"):
        branches = schema.get(union)
        if isinstance(branches, list):
            each = [
                types(branch, root, key, siblings, value, seen)
                for branch in branches
                if key is None or _fits(branch, root, siblings or {})
            ]
            if each and all(t is not None for t in each):
                found.append(set().union(*each))  # type: ignore[arg-type]
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            keep(types(branch, root, key, siblings, value, seen))
    return set.intersection(*found) if found else None


def _fits(branch: Any, root: Any, siblings: dict[str, Any]) -> bool:
    """Whether each known argument's value is of a type ``branch`` allows it
    (``_matches_discriminators``)."""
    for name, value in siblings.items():
        allowed = types(branch, root, name, value=value)
        if allowed is not None and json_type(value) not in allowed:
            return False
    return True


def _one_type(allowed: set[str] | None) -> str | None:
    """``get_argument_type``: the one type, number for number-or-integer, else None."""
    if allowed == {"number", "integer"}:
        return "number"
    return next(iter(allowed)) if allowed and len(allowed) == 1 else None


def _needs_siblings(schema: Any) -> bool:
    """Whether a union leaves some key's type open until its siblings are known
    (``_needs_argument_context``)."""
    keys: set[Any] = set()
    seen: set[int] = set()
    union = False

    def visit(node: Any) -> None:
        nonlocal union
        if not isinstance(node, dict) or id(node) in seen:
            return
        seen.add(id(node))
        keys.update(node.get("properties", {}))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            try:
                visit(_pointer(schema, ref))
            except (KeyError, IndexError, TypeError, ValueError):
                pass
        for word in ("anyOf", "oneOf", "allOf"):
            branches = node.get(word)
            if isinstance(branches, list):
                union |= word != "allOf"
                for branch in branches:
                    visit(branch)

    visit(schema)
    for key in keys if union else ():
        allowed = types(schema, schema, key)
        if allowed is None or (len(allowed) > 1 and allowed != {"number", "integer"}):
            return True
    return False


def _coerced(value: Any, kind: str | None) -> Any:
    """A JSON string read for a number or integer parameter turned into one where it is."""
    if isinstance(value, str) and kind == "integer":
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(value, str) and kind == "number":
        return _number(value)
    return value


def _read(raw: str, kind: str) -> Any:
    """``parse_arguments``: JSON; JSON of the text as a JSON string's contents; for a string,
    the text less matching quotes; a Python literal; the text. Errors its steps do not catch
    leave the whole answer unread."""
    try:
        return _coerced(json.loads(raw), kind)
    except ValueError:
        pass
    try:
        return _coerced(json.loads(json.loads('{"tmp": "' + raw + '"}')["tmp"]), kind)
    except (ValueError, KeyError):
        pass
    except (TypeError, RecursionError) as exc:
        raise _Unreadable(f"a value cannot be read: {exc!r}") from exc
    return unquoted(raw) if kind == "string" else literal(raw)


class _Typing:
    """One function's parameters (``schemas``: those of each tool of its name, the first
    typing its keys): the types of its keys and how its values are read."""

    def __init__(self, schemas: list[Any]) -> None:
        self.schema, self.schemas = schemas[0], schemas
        self._needs: bool | None = None

    @property
    def needs(self) -> bool:
        """Whether its values are read knowing their siblings; raises where a schema cannot
        be walked, as the detector does when it first asks."""
        if self._needs is None:
            self._needs = any(_needs_siblings(schema) for schema in self.schemas)
        return self._needs

    def allowed(self, key: str, siblings: dict[str, Any] | None = None, value: Any = _UNSET):
        return types(self.schema, self.schema, key, siblings, value)

    def arguments(self, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """The arguments of these ``(key, value)`` pairs (``_parse_argument_pairs``)."""
        known: dict[str, Any] = {}
        if len(pairs) > 1 and self.needs:  # first the values whose type is certain
            for key, raw in pairs:
                key = key.strip()
                alone = self.arguments([(key, raw)])[key]
                native = self.allowed(key, value=raw)
                if isinstance(alone, str) or native is None or "string" not in native:
                    known[key] = alone
        out: dict[str, Any] = {}
        for key, raw in pairs:
            key = key.strip()
            kind = _one_type(self.allowed(key, known))
            value = _read(raw, kind or "string")
            if kind == "string":
                value = value if isinstance(value, str) else raw
            elif kind is None:  # JSON of a type the schema forbids: the text, if it may be
                fits, native = self.allowed(key, known, value), self.allowed(key, known, raw)
                if fits is not None and json_type(value) not in fits and "string" in (native or ()):
                    value = raw
            out[key] = known[key] = value
        return out


class Glm47Calls:
    """The calls of answers to one request (``tools``: its tools, their parameters)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        schemas: dict[str, list[Any]] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            if isinstance(fn.get("name"), str):
                schemas.setdefault(fn["name"], []).append(fn.get("parameters"))
        self.functions = {name: _Typing(each) for name, each in schemas.items()}

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        if BEGIN not in text:
            return text, []
        calls, outside, at = [], [], 0
        try:
            for match in _CALLS.finditer(text):
                outside.append(text[at : match.start()])
                at = match.end()
                call = self.call(match.group())
                if call is not None:
                    calls.append(call)
        except _FAILS as exc:  # the detector's except Exception
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return text, []
        return ("".join(outside) + text[at:]).strip(), calls

    def call(self, text: str) -> dict[str, str] | None:
        """``{name, arguments}`` of one call's text (``<tool_call>`` to ``</tool_call>``), None
        (logged) for a call to a tool not offered."""
        body = text[len(BEGIN) : -len(END)]
        cut = body.find(KEY)
        name = body if cut == -1 else body[:cut]
        return self.offered(name, self.arguments(name, body[cut:]) if cut != -1 else {})

    def offered(self, name: str, arguments: dict[str, Any]) -> dict[str, str] | None:
        return offered_call(name, arguments, self.functions)

    def arguments(self, name: str, pairs_text: str) -> dict[str, Any]:
        typing = self.functions.get(name) or _Typing([None])
        return typing.arguments(_PAIR.findall(pairs_text))

    def stream(self) -> _Glm47Stream:
        return _Glm47Stream(self)


class _Glm47Stream(BlockStream):
    begin, end = BEGIN, END

    def __init__(self, reader: Glm47Calls) -> None:
        super().__init__()
        self.reader = reader
        self.content = OutsideText()
        self.dropped: set[int] = set()  # where calls to tools not offered begin

    def outside(self, text: str, block_next: bool) -> str:
        out = self.content.more(text)
        self.content.called = self.content.called or block_next
        return out

    def opened(self, key: int, body: str) -> Pieces:
        cut = body.find(KEY)
        if cut == -1 or key in self.dropped:
            return []
        name = body[:cut]
        typing = self.reader.functions.get(name)
        if not self.pieces.named(key) and typing is None:
            log.warning("tool_call_unknown_function", name=name[:100])
            self.dropped.add(key)
            return []
        try:
            if typing is None or typing.needs:  # its arguments wait for the whole call
                return self.pieces.partial(key, name, None)
            so_far = json.dumps(typing.arguments(_PAIR.findall(body, cut)), ensure_ascii=False)
        except _FAILS:
            return self.pieces.partial(key, name, None)
        return self.pieces.partial(key, name, so_far)

    def closed(self, key: int, block: str) -> tuple[str, Pieces]:
        if key in self.dropped:
            return "", []
        try:
            call = self.reader.call(block)
        except _FAILS as exc:
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return "", []
        if call is None:
            return "", []
        return "", self.pieces.whole(key, call["name"], call["arguments"])

    def flush(self) -> str:
        rest = self.text[self.pos :]
        if rest.startswith(BEGIN) and self.pieces.named(self.pos):
            log.warning("tool_call_incomplete", text=rest[:200])
            return ""
        out = self.content.more(rest)  # a call cut short before its name: content
        return out + self.content.rest()
