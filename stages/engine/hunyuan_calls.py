"""Tool calls in Tencent Hunyuan's format (SGLang's ``--tool-call-parser hunyuan``)::

    <tool_calls>
    <tool_call>get_weather<tool_sep>
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
    </tool_calls>

Hy3's shipping tokenizer spells each of these special tokens with a suffix
(``<tool_calls:opensource>``, ``</tool_calls:opensource>``...): ``tokens`` reads the served
tokenizer's vocabulary for them, the bare tags where it has none (the reasoning parser's
``<think>`` too).

As SGLang 0.5.23 reads them (``function_call/hunyuan_detector.py``, ``HunyuanDetector``;
``tests/stages/test_engine_sglang_hunyuan.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): an answer without ``<tool_calls>`` is content, as it is. With it, the
  content is the text before the first ``<tool_calls>``, stripped, and each ``<tool_call>`` up
  to the next ``</tool_call>`` anywhere in the answer is a call: its name the text up to its
  first ``<tool_sep>`` (or up to an ``<arg_key>`` or the end tag), stripped, its arguments each
  ``<arg_key>KEY</arg_key>`` and ``<arg_value>VALUE</arg_value>`` after it (whitespace
  between them), the key stripped, a key met again keeping its first place and its last value.
  A value is read by its parameter's types (its schema's ``type``, else those of its
  ``anyOf``, else ``oneOf``, else a string; aliases such as ``int``, ``float``, ``bool``,
  ``dict`` and names such as ``uint32`` read as JSON's; ``null`` left out), the parameter's
  schema the first tool of the name's (its ``properties``, or those of its branches): a boolean
  ``true``/``false`` in any case, an integer as Python's ``int`` reads it, a number (a float
  where the text has ``.``, ``e`` or ``E``, else an integer), then for any other type JSON, then
  for a string the text; with none of these, JSON, else the text. A call to a tool not offered
  is dropped (logged). Where reading a value raises (its parameter's schema has a ``type`` that
  is a list, as ``["string", "null"]``, or not a string, or is of another shape, as ``true``
  or an ``anyOf`` that is not a list of objects; JSON nested too deep), the answer has no calls
  and is content, as it came (the detector's ``except Exception``). ``/parse_function_call``
  numbers a call by its tool's place in ``tools`` (the last of its name).
- streamed (``stream``): the content before ``<tool_calls>`` as it comes (a tail that may
  begin the tag, and trailing whitespace, wait; leading whitespace goes out before a call shows
  it should not), then each call whole at its end tag: the whole answer's. Where a call cannot
  be read the rest of the answer goes out as content, from where the content stopped (the calls
  before it have gone out: a stream cannot know a later call will fail). (SGLang's stream names
  a call once its ``<tool_sep>`` comes, a call to a tool not offered too, sends its arguments
  as its pairs close, the content unstripped and the text after ``</tool_calls>`` as content
  too, none of which its whole reading has.)
- ``tool_choice`` ``required`` or named: not constrained (the detector
  ``parses_required_natively`` and has no structural tag), the answer read in this format; nor
  are a ``strict`` tool's calls under ``auto``.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream
from stages.engine.qwen3_coder_calls import _properties
from stages.engine.tool_formats import _Content

__all__ = ["HunyuanCalls", "closing", "tokens", "writes_calls"]

log = structlog.get_logger("stages.engine.tool_calls")

# the special tokens by their bare names (the reasoning's <think> among them)
_NAMES = ("tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value", "think")
# a vocabulary entry that spells one: the bare tag, or with a suffix (re.match: "$" also takes a
# last newline, as SGLang's pattern does)
_SPELLING = re.compile(r"<(" + "|".join(_NAMES) + r")(?::[^>]+)?>$")
# the markers a chat template writing these calls has (_is_hunyuan's first test)
_TEMPLATE = (re.compile(r"<tool_calls(?::[^>]+)?>"), re.compile(r"<tool_sep(?::[^>]+)?>"))
_SPELLED: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
# a schema type's spellings that are JSON's (_TYPE_ALIASES), and the prefixes of the names read
# as integers and numbers
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string",
            "enum": "string", "bool": "boolean", "binary": "boolean", "int": "integer",
            "float": "number", "double": "number", "list": "array", "dict": "object",
            "map": "object"}  # fmt: skip
_INTEGERS = ("int", "uint", "long", "short", "unsigned")
_NUMBERS = ("num", "float")
_SCALARS = {"string", "boolean", "integer", "number"}

Pieces = list[dict[str, Any]]


class _Unreadable(Exception):
    """A value whose reading raises in the detector: the whole answer is content."""


def tokens(tokenizer: Any = None) -> dict[str, str]:
    """Each of the format's special tokens by its bare name (``tool_calls``, ``tool_call``,
    ``tool_sep``, ``arg_key``, ``arg_value``, ``think``) as ``tokenizer``'s vocabulary spells it
    (``resolve_hunyuan_tokens``: the bare tag or a suffixed one, the last of a name in the
    vocabulary's order), the bare tag where it has none (no tokenizer: all bare)."""
    if tokenizer is None:
        return {name: f"<{name}>" for name in _NAMES}
    try:
        return dict(_SPELLED[tokenizer])
    except (KeyError, TypeError):  # not read yet, or a tokenizer without weak references
        pass
    found: dict[str, str] = {}
    try:
        vocab = tokenizer.get_vocab()
    except Exception as exc:  # SGLang warns and reads the bare tags
        log.warning("hunyuan_vocab_unreadable", error=str(exc)[:200])
        vocab = None
    if isinstance(vocab, dict):
        for token in vocab:
            match = _SPELLING.match(token) if isinstance(token, str) else None
            if match:
                found[match.group(1)] = token
    for name in _NAMES:
        found.setdefault(name, f"<{name}>")
    try:
        _SPELLED[tokenizer] = found
    except TypeError:
        pass
    return dict(found)


def writes_calls(template: str) -> bool:
    """A chat template writes these calls: it has ``<tool_calls>`` and ``<tool_sep>``, bare or
    suffixed (SGLang's ``template_detection._is_hunyuan``, which finds them in the template or
    the vocabulary)."""
    return all(marker.search(template) for marker in _TEMPLATE)


def closing(tag: str) -> str:
    """The end tag of ``tag`` (``<x:s>``: ``</x:s>``)."""
    return "</" + tag[1:] if tag.startswith("<") else tag


def _kind(raw: Any) -> Any:
    """A schema's ``type`` as JSON's name for it (``_normalize_type``); raises as the
    detector's does for one that is not a string."""
    exact = _ALIASES.get(raw)
    if exact is not None:
        return exact
    lower = raw.lower()
    if lower.startswith(_INTEGERS):
        return "integer"
    if lower.startswith(_NUMBERS):
        return "number"
    return raw


def _types(schema: Any) -> set[Any]:
    """The types a parameter's schema allows, but null (``_get_types``): its ``type``, else
    its ``anyOf``'s, else its ``oneOf``'s, else a string's. _Unreadable where the detector's
    reading raises."""
    try:
        if "type" in schema:
            options = [schema]
        elif "anyOf" in schema:
            options = schema["anyOf"]
        elif "oneOf" in schema:
            options = schema["oneOf"]
        else:
            options = [{"type": "string"}]
        return {_kind(option.get("type", "string")) for option in options} - {"null"}
    except Exception as exc:  # a schema of another shape (a list of types, not an object)
        raise _Unreadable(f"a parameter's schema: {exc!r}"[:200]) from exc


def _json(raw: str) -> Any:
    """``raw`` as JSON; ValueError where it is not; _Unreadable where reading it raises
    anything else (nested too deep)."""
    try:
        return json.loads(raw)
    except ValueError:
        raise
    except Exception as exc:
        raise _Unreadable(f"a value: {exc!r}"[:200]) from exc


def _value(raw: str, types: set[Any]) -> Any:
    """A value's text read for a parameter of ``types`` (``_parse_value``)."""
    if "boolean" in types and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if "integer" in types:
        try:
            return int(raw)
        except ValueError:
            pass
    if "number" in types:
        try:
            return float(raw) if "." in raw or "e" in raw or "E" in raw else int(raw)
        except ValueError:
            pass
    if types - _SCALARS:
        try:
            return _json(raw)
        except ValueError:
            pass
    if "string" in types:
        return raw
    try:
        return _json(raw)
    except ValueError:
        return raw


class HunyuanCalls:
    """The calls of answers to one request (``tools``: its tools, their parameters' schemas;
    ``spelled``: the special tokens as the served tokenizer spells them, ``tokens``)."""

    def __init__(
        self, tools: Iterable[dict[str, Any]], spelled: Mapping[str, str] | None = None
    ) -> None:
        self.tools = list(tools)
        # the names offered (_get_tool_indices: those not empty)
        self.names = {(t.get("function") or {}).get("name") for t in self.tools} - {None, ""}
        spelled = spelled or tokens()
        call, sep = spelled["tool_call"], spelled["tool_sep"]
        key, value = spelled["arg_key"], spelled["arg_value"]
        self.begin, self.end = spelled["tool_calls"], closing(spelled["tool_calls"])
        self.call_begin, self.call_end = call, closing(call)
        # a call: its name up to <tool_sep> (or before an <arg_key> or its end), its body up to
        # its end (tool_call_regex)
        self.calls = re.compile(
            f"{re.escape(call)}(.*?)(?:{re.escape(sep)}|(?={re.escape(key)}|"
            f"{re.escape(self.call_end)}))(.*?){re.escape(self.call_end)}",
            re.DOTALL,
        )
        # a key and its value (func_args_regex)
        self.pairs = re.compile(
            f"{re.escape(key)}(.*?){re.escape(closing(key))}\\s*"
            f"{re.escape(value)}(.*?){re.escape(closing(value))}",
            re.DOTALL,
        )

    def has_tool_call(self, text: str) -> bool:
        return self.begin in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(self.begin)
        if at == -1:
            return text, []
        calls = []
        try:
            for match in self.calls.finditer(text):
                call = self.call(match)
                if call is not None:
                    calls.append(call)
        except _Unreadable as exc:  # the detector's except Exception: the text, no calls
            log.warning("tool_call_unparsed", format="hunyuan", error=str(exc))
            return text, []
        return text[:at].strip(), calls

    def call(self, match: re.Match[str]) -> dict[str, str] | None:
        """``{name, arguments}`` of one call (``match``: of ``self.calls``); None (logged) for
        a tool not offered; _Unreadable where a value's reading raises."""
        name = match.group(1).strip()
        if name not in self.names:
            log.warning("tool_call_unknown_function", name=name[:100])
            return None
        schemas = self._schemas(name)
        arguments: dict[str, Any] = {}
        for key, raw in self.pairs.findall(match.group(2)):
            key = key.strip()
            arguments[key] = _value(raw, _types(schemas.get(key, {})))
        try:
            text = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise _Unreadable(f"arguments not JSON: {exc!r}"[:200]) from exc
        return {"name": name, "arguments": text}

    def _schemas(self, name: str) -> dict[str, Any]:
        """The parameters' schemas of the first tool named ``name`` (``_get_arg_schema``)."""
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == name:
                return _properties(fn.get("parameters"))
        return {}

    def stream(self) -> _HunyuanStream:
        return _HunyuanStream(self)


class _HunyuanStream(PieceStream):
    """One answer's stream: content until ``<tool_calls>``, then each call at its end tag."""

    def __init__(self, reader: HunyuanCalls) -> None:
        super().__init__()
        self.reader = reader
        self.before = _Content(reader.begin, strip=True)
        self.begun = False  # <tool_calls> came: the content has ended
        self.pos = 0  # where the calls not yet read begin
        self.failed = False  # a call could not be read: the rest is content

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text = self.text
        if self.failed:
            return self._rest(), []
        content, end = "", self.reader.call_end
        # (only the delta and what may end a tag before it are searched: the rest was)
        if not self.begun:
            begin = self.reader.begin
            at = text.find(begin, max(0, len(text) - len(delta) - len(begin) + 1))
            content = self.before.more(text, None if at == -1 else at)
            if at == -1:
                return content, []
            self.begun = True  # (the calls before it, and in this delta, are read now)
        elif text.find(end, max(self.pos, len(text) - len(delta) - len(end) + 1)) == -1:
            return content, []  # no call has ended since
        pieces: Pieces = []
        # a call that has ended is the whole answer's (its match cannot change with more text)
        for match in self.reader.calls.finditer(text, self.pos):
            self.pos = match.end()
            try:
                call = self.reader.call(match)
            except _Unreadable as exc:  # the whole answer is content: the rest goes out as such
                log.warning("tool_call_unparsed", format="hunyuan", error=str(exc))
                self.failed = True
                return content + self._rest(), pieces
            if call is not None:
                pieces += self.pieces.whole(match.start(), call["name"], call["arguments"])
        return content, pieces

    def _rest(self) -> str:
        """The text not sent as content yet (after a call that cannot be read)."""
        out = self.text[self.before.sent :]
        self.before.sent = len(self.text)
        return out

    def flush(self) -> str:
        if self.failed:
            return self._rest()
        if not self.begun:
            return self.before.rest(self.text)
        if self.reader.call_begin in self.text[self.pos :]:  # a call never ended: dropped
            log.warning("tool_call_incomplete", text=self.text[self.pos :][:200])
        return ""
