"""Tool calls in K2 Horizon's IFM format (SGLang's ``--tool-call-parser k2_horizon``), its
calls in one group::

    <ifm|tool_calls>
    <ifm|tool_call>get_weather<ifm|arg_key>city</ifm|arg_key><ifm|arg_value>Paris</ifm|arg_value></ifm|tool_call>
    </ifm|tool_calls>

A call's body is the function's name and its arguments as key and value tags (``<ifm|arg_type>``
between them in the typed dialect), or JSON: an object ``{"name", "arguments"}`` (the arguments
also as ``parameters``, as a JSON string, or the call under ``function``), or an array of them.

As SGLang 0.5.23 reads them (``function_call/k2_v3_detector.py``, ``K2V3Detector``;
``tests/stages/test_engine_sglang_k2_horizon.py`` holds this module to it on random answers where
SGLang imports):

- whole (``parse``): an answer without ``<ifm|tool_call>`` is content as it is. Otherwise its
  leading reasoning blocks (``<ifm|think>`` ... ``</ifm|think>``, or the ``think_fast`` /
  ``think_faster`` pairs, spaces before each; one never closed, or the start of an opening tag,
  runs to the end) are content as they are and the rest is read: where a group
  ``<ifm|tool_calls>`` ... ``</ifm|tool_calls>`` is there (its first opening tag, closed), the
  group alone, all or nothing: only spaces between its calls, each call read, one at least;
  then the content is the text around the group as it is, or where the group fails the whole
  answer as it came. Without a closed group, each ``<ifm|tool_call>`` ... ``</ifm|tool_call>`` is
  read on its own (one that fails stays in the content as it is, one never closed and what
  follows it too), and the content loses every group tag. A call's body: JSON where it starts
  ``{`` or ``[`` (each item an object with a non-empty string name, its arguments an object, a
  JSON string of one, or null), else a name up to the first ``<ifm|arg_key>`` and key, optional
  type and value tags with nothing but spaces between them. Each value is read by its
  parameter's type in the tool's schema (``$ref`` to ``$defs`` / ``definitions`` followed; a
  union, ``anyOf``/``oneOf`` or several types, has none), else by its type tag: ``string`` kept
  as text (a JSON value written as JSON text), ``any`` as it is, another type JSON where it
  reads; untyped, JSON where it reads in the tags, as it is in JSON calls. Calls to tools not
  offered are dropped (their block still taken out). ``/parse_function_call`` numbers each call
  by its place among the calls.
- streamed (``stream``): the text before the first tag of a call or group as it comes (leading
  reasoning blocks too; a tail that may begin a tag waits), a group's calls at its end tag and
  after it the text as it comes; calls that are not in a closed group only at the end, as a
  group closed after them would leave them content: the whole answer's, in all. (SGLang's
  stream reads each call at its end tag, inside a group or not, without the group's all or
  nothing, and drops the spaces between a group's calls.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag); a strict tool under ``auto`` constrains nothing.

A value nested too deep for Python's JSON reader makes the detector raise: the answer is then
content as it came, without calls (the chat route's ``except``; SGLang's ``/parse_function_call``
answers 500 there).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls, PieceStream
from stages.engine.qwen3_coder_calls import _properties, _schema_type

__all__ = ["CALL", "GROUP", "K2HorizonCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

GROUP, GROUP_END = "<ifm|tool_calls>", "</ifm|tool_calls>"
CALL, CALL_END = "<ifm|tool_call>", "</ifm|tool_call>"
ARG_KEY = "<ifm|arg_key>"
# the reasoning blocks an answer may lead with (each effort's tags)
THINK_TAGS = (
    ("<ifm|think>", "</ifm|think>"),
    ("<ifm|think_fast>", "</ifm|think_fast>"),
    ("<ifm|think_faster>", "</ifm|think_faster>"),
)
_MARKERS = (CALL, GROUP, GROUP_END)  # what ends the plain text of a stream
_ARGUMENT = re.compile(
    r"<ifm\|arg_key>(.*?)</ifm\|arg_key>\s*"
    r"(?:<ifm\|arg_type>(.*?)</ifm\|arg_type>\s*)?"
    r"<ifm\|arg_value>(.*?)</ifm\|arg_value>",
    re.DOTALL,
)

Read = list[tuple[str, dict[str, Any]]]  # (name, arguments) of each call of a block
Listed = list[tuple[int, dict[str, str]]]
Pieces = list[dict[str, Any]]


class _Malformed(ValueError):
    """A block the detector forwards as text (its ``_parse_block``'s except)."""


class K2HorizonCalls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, their parameters' schemas)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.schemas: dict[Any, Any] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            self.schemas.setdefault(fn.get("name"), fn.get("parameters"))  # the first of a name

    def has_tool_call(self, text: str) -> bool:
        return CALL in text

    def listed(self, text: str) -> tuple[str, Listed]:
        if CALL not in text:
            return text, []
        try:
            return self._listed(text)
        except RecursionError:  # out of the detector: serving_chat's except Exception
            log.warning("tool_call_unparsed", format="k2_horizon", error="nested too deep")
            return text, []

    def _listed(self, text: str) -> tuple[str, Listed]:
        lead = leading_reasoning(text)
        work = text[lead:]
        start, end = closed_group(work)
        if end != -1:
            read = self.group(work[start + len(GROUP) : end])
            if read is None:  # the whole group or nothing: the text as it came
                return text, []
            return text[:lead] + work[:start] + work[end + len(GROUP_END) :], self.kept(read, 0)
        content, calls, at = [], [], 0
        while (begin := work.find(CALL, at)) != -1:
            content.append(work[at:begin])
            stop = work.find(CALL_END, begin + len(CALL))
            if stop == -1:  # never closed: content as it is
                at = begin
                break
            at = stop + len(CALL_END)
            read = self.block(work[begin + len(CALL) : stop])
            if read is None:
                content.append(work[begin:at])
            else:
                calls += self.kept(read, len(calls))
        content.append(work[at:])
        return text[:lead] + _ungrouped("".join(content)), calls

    def group(self, body: str) -> Read | None:
        """The calls of a group (``body``: its text between its tags); None where it fails:
        text other than spaces between its calls, a call never closed or not read, none."""
        read: Read = []
        at = 0
        while at < len(body):
            begin = body.find(CALL, at)
            if begin == -1:
                return read if read and not body[at:].strip() else None
            if body[at:begin].strip():
                return None
            stop = body.find(CALL_END, begin + len(CALL))
            if stop == -1:
                return None
            calls = self.block(body[begin + len(CALL) : stop])
            if calls is None:
                return None
            read += calls
            at = stop + len(CALL_END)
        return read or None

    def block(self, body: str) -> Read | None:
        """The calls of one call block (``body``: its text between its tags); None where it is
        malformed (forwarded as text)."""
        stripped = body.strip()
        try:
            if stripped.startswith(("{", "[")):
                return self._json(stripped)
            return self._tagged(body)
        except (ValueError, TypeError) as exc:  # json's errors are ValueErrors
            log.warning("tool_call_unparsed", format="k2_horizon", error=str(exc)[:200])
            return None

    def _json(self, text: str) -> Read:
        value = json.loads(text)
        read: Read = []
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, Mapping):
                raise _Malformed("a JSON call that is not an object")
            fn = item.get("function", item)
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _Malformed("a JSON call without a function name")
            name = fn["name"]
            arguments = fn.get("arguments", fn.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = json.loads(arguments) if arguments.strip() else {}
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, Mapping):
                raise _Malformed("arguments that are not an object")
            read.append(
                (
                    name,
                    {k: self._value(v, name, k, None, tagged=False) for k, v in arguments.items()},
                )
            )
        return read

    def _tagged(self, body: str) -> Read:
        first = body.find(ARG_KEY)
        name = (body if first == -1 else body[:first]).strip()
        if not name:
            raise _Malformed("a call without a function name")
        if first == -1:
            return [(name, {})]
        rest = body[first:]
        arguments: dict[str, Any] = {}
        at = 0
        for match in _ARGUMENT.finditer(rest):
            if rest[at : match.start()].strip():
                raise _Malformed("text between arguments")
            key = match.group(1).strip()
            if not key:
                raise _Malformed("an argument without a key")
            kind = match.group(2).strip() if match.group(2) else None
            arguments[key] = self._value(match.group(3), name, key, kind, tagged=True)
            at = match.end()
        if rest[at:].strip():
            raise _Malformed("text after the arguments")
        return [(name, arguments)]

    def _value(self, value: Any, name: str, key: str, kind: str | None, *, tagged: bool) -> Any:
        """An argument's value by its parameter's type, else its type tag (``_coerce_value``)."""
        target = self._type(name, key) or kind
        if target == "any":
            return value
        if target == "string":
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str) or (target is None and not tagged):
            return value
        try:
            return json.loads(value.strip())
        except json.JSONDecodeError:
            return value

    def _type(self, name: str, key: str) -> Any:
        """A parameter's type in its tool's schema, ``$ref`` followed; None for a union, or
        where the schema says none (``_argument_type``)."""
        if name not in self.schemas:
            return None
        root = self.schemas[name]
        schema = _resolved(_properties(root).get(key), root)
        if schema is None:
            return None
        kind = schema.get("type")
        if "anyOf" in schema or "oneOf" in schema:
            return None
        if isinstance(kind, list) and len([k for k in kind if k != "null"]) > 1:
            return None
        return _schema_type(schema)

    def kept(self, read: Read, first: int) -> Listed:
        """The calls of ``read`` to tools offered, numbered on from ``first`` (others dropped,
        logged)."""
        calls: Listed = []
        for name, arguments in read:
            if name not in self.schemas:
                log.warning("tool_call_unknown_function", name=name[:100])
                continue
            text = json.dumps(arguments, ensure_ascii=False)
            calls.append((first + len(calls), {"name": name, "arguments": text}))
        return calls

    def stream(self) -> _K2HorizonStream:
        return _K2HorizonStream(self)


def _resolved(schema: Any, root: Any) -> dict[str, Any] | None:
    """A parameter's schema with its local ``$ref``s followed (``#/$defs/...``,
    ``#/definitions/...``), the keys beside a reference winning; a loop: None."""
    if not isinstance(schema, Mapping):
        return None
    out = dict(schema)
    seen: set[str] = set()
    while isinstance(ref := out.get("$ref"), str):
        if ref in seen:
            return None
        seen.add(ref)
        where = next((w for w in ("$defs", "definitions") if ref.startswith(f"#/{w}/")), None)
        if where is None:
            return out
        defs = root.get(where, {}) if isinstance(root, Mapping) else {}
        target = defs.get(ref[len(where) + 3 :]) if isinstance(defs, Mapping) else None
        if not isinstance(target, Mapping):
            return out
        out = {**target, **{k: v for k, v in out.items() if k != "$ref"}}
    return out


def _ungrouped(text: str) -> str:
    """``text`` without its group tags (the opening ones first)."""
    return text.replace(GROUP, "").replace(GROUP_END, "")


def leading_reasoning(text: str) -> int:
    """Where the text after an answer's leading reasoning blocks begins (``_split_leading_
    reasoning``): past each block and the spaces before it; the whole text where one is never
    closed or what is left, stripped, begins an opening tag."""
    at = 0
    while at < len(text):
        rest = text[at:]
        stripped = rest.lstrip()
        tags = next(((s, e) for s, e in THINK_TAGS if stripped.startswith(s)), None)
        if tags is None:
            if stripped and any(s.startswith(stripped) for s, _ in THINK_TAGS):
                return len(text)
            return at
        end = stripped.find(tags[1], len(tags[0]))
        if end == -1:
            return len(text)
        at += len(rest) - len(stripped) + end + len(tags[1])
    return len(text)


def _tag_start(text: str) -> int:
    """How many characters at the end of ``text`` could begin a call's or group's tag (each
    has one ``<``, its first character: only what follows the last one can)."""
    at = text.rfind("<")
    if at == -1:
        return 0
    tail = text[at:]
    return len(tail) if any(m != tail and m.startswith(tail) for m in _MARKERS) else 0


def closed_group(text: str) -> tuple[int, int]:
    """``(start, end)`` of the first group opened in ``text`` and where it closes (-1: not)."""
    start = text.find(GROUP)
    if start == -1:
        return -1, -1
    return start, text.find(GROUP_END, start + len(GROUP))


class _K2HorizonStream(PieceStream):
    """An answer's stream: its text as content while nothing can change it (leading reasoning
    blocks, then the text before a tag of a call or group, less a tail that may begin one), a
    closed group's calls at its end tag and then the rest as it comes; the rest of the whole
    answer at the end (``flush``; its calls with ``unsent``). Each delta is searched once."""

    def __init__(self, reader: K2HorizonCalls) -> None:
        super().__init__()
        self.reader = reader
        self.at = 0  # where the leading reasoning's next block (or the text after it) begins
        self.closing: str | None = None  # the end tag of a leading block still open
        self.lead: int | None = None  # where the text after the leading reasoning begins
        self.first: int | None = None  # where the first tag of a call or group is
        self.opened: int | None = None  # where the first group opens
        self.searched = 0  # where the search for a tag (or the group's end) goes on
        self.said = 0  # the text sent as content, as it is (while no group has closed)
        self.after: int | None = None  # a group closed: the text from here on is content
        self.left: Pieces = []  # the calls read at the end, for unsent

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text = self.text
        if self.after is not None:
            out, self.after = text[self.after :], len(text)
            return out, []
        safe = self._leading() if self.lead is None else len(text)
        if self.lead is not None:
            end = self._group_end()
            if end != -1:
                return self._grouped(end)
            safe = self._plain()
        if safe <= self.said:
            return "", []
        out, self.said = text[self.said : safe], safe
        return out, []

    def _leading(self) -> int:
        """Through the leading reasoning blocks so far (``leading_reasoning``): how much of
        the text is content whatever follows (all of an open block, spaces; not what may begin
        an opening tag); ``lead`` set once the text after them begins."""
        text = self.text
        while True:
            if self.closing is not None:
                end = text.find(self.closing, self.searched)
                if end == -1:
                    self.searched = max(self.searched, len(text) - len(self.closing) + 1)
                    return len(text)
                self.at, self.closing = end + len(self.closing), None
            stripped = text[self.at :].lstrip()
            spaces = len(text) - self.at - len(stripped)
            if not stripped:
                return len(text)
            tags = next(((s, e) for s, e in THINK_TAGS if stripped.startswith(s)), None)
            if tags is None:
                if any(s.startswith(stripped) for s, _ in THINK_TAGS):
                    return self.at + spaces
                self.lead = self.searched = self.at
                return self.at
            self.closing = tags[1]
            self.searched = self.at + spaces + len(tags[0])

    def _group_end(self) -> int:
        """Where the first group closes (-1: none has yet); ``first``, ``opened`` kept."""
        text = self.text
        if self.first is None:
            found = [at for at in (text.find(m, self.searched) for m in _MARKERS) if at != -1]
            if not found:
                self.searched = max(self.searched, len(text) - len(GROUP_END) + 1)
                return -1
            self.first = self.searched = min(found)
        if self.opened is None:
            self.opened = text.find(GROUP, self.searched)
            if self.opened == -1:
                self.opened = None
                self.searched = max(self.searched, len(text) - len(GROUP) + 1)
                return -1
            self.searched = self.opened + len(GROUP)
        end = text.find(GROUP_END, self.searched)
        if end == -1:
            self.searched = max(self.searched, len(text) - len(GROUP_END) + 1)
        return end

    def _plain(self) -> int:
        """How much of the text is content whatever follows: up to the first tag of a call or
        group, less a tail that may begin one (or that the group tags taken out may join)."""
        upto = len(self.text) if self.first is None else self.first
        lead = self.lead or 0
        while True:  # a tag's start before a tag's start, which the tags taken out may join
            held = _tag_start(self.text[max(lead, upto - len(GROUP_END)) : upto])
            if not held:
                return upto
            upto -= held

    def _grouped(self, end: int) -> tuple[str, Pieces]:
        """The first group closes at ``end``: what comes before it, its calls (or its text,
        where it fails: the whole answer is then content), the text after it."""
        text, start = self.text, self.opened or 0
        self.after = len(text)
        try:
            read = self.reader.group(text[start + len(GROUP) : end])
            calls = None if read is None else self.reader.kept(read, 0)
        except RecursionError:  # the whole answer is content, as it came
            log.warning("tool_call_unparsed", format="k2_horizon", error="nested too deep")
            calls = None
        if calls is None:
            return text[self.said :], []
        pieces: Pieces = []
        for i, call in calls:
            pieces += self.pieces.whole(i, call["name"], call["arguments"])
        return text[self.said : start] + text[end + len(GROUP_END) :], pieces

    def flush(self) -> str:
        if self.after is not None:
            return ""
        content, calls = self.reader.listed(self.text)
        sent = self.text[: self.said]
        if not content.startswith(sent):  # (held back so that it cannot happen)
            log.warning("tool_call_stream_diverged", format="k2_horizon", sent=sent[-200:])
        for i, call in calls:
            self.left += self.pieces.whole(i, call["name"], call["arguments"])
        self.said = len(self.text)
        return content[len(sent) :]

    def unsent(self) -> Pieces:
        left, self.left = self.left, []
        return left + self.pieces.unsent()
