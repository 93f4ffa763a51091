"""Tool calls in DeepSeek's marked format (SGLang's ``--tool-call-parser deepseekv3`` and
``deepseekv31``): calls between special tokens, each a function's name and its arguments as
JSON.

    deepseekv3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json
                 {"city": "Paris"}
                 ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseekv31: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}
                 <｜tool▁call▁end｜><｜tool▁calls▁end｜>   (no newline before the end token)

As SGLang 0.5.23 reads them (``function_call/deepseekv3_detector.py``,
``deepseekv31_detector.py``; ``tests/stages/test_engine_sglang_detectors.py`` holds this module
to them on random texts where SGLang imports):

- whole (``parse``): the content is the text before the calls, stripped; every
  ``<｜tool▁call▁begin｜>`` up to the next ``<｜tool▁call▁end｜>`` is a call, its name and
  arguments read as the detector's pattern reads them (V3: the name between the last
  ``<｜tool▁sep｜>`` and the last "\\n```json\\n", the arguments up to "\\n```" before the end
  token; V3.1: the name up to the last ``<｜tool▁sep｜>``, the arguments after it); arguments
  read by Python's ``json`` (NaN too) and passed on as ``parse_base_json`` passes them (a
  falsy value: ``{}``); a name the request did not offer is dropped (logged). A call whose
  text does not have that shape, or whose arguments are not JSON, makes the whole answer
  unreadable: no calls, the text as it is (the detector's ``except Exception``). The text
  after the calls is dropped.
- streamed (``stream``): content as it comes (a tail that may begin a marker, and whitespace,
  wait for what follows); a call is named once its name is whole (V3: at "\\n```json\\n",
  V3.1: at the separator), its arguments go out in pieces as their JSON grows, the rest when
  its end token comes; at the end, a call cut short gets the rest of its partial arguments'
  JSON (``unsent``, SGLang's ``_check_for_unstreamed_tool_args``).

The calls begin at ``<｜tool▁calls▁begin｜>`` or at a ``<｜tool▁call▁begin｜>`` without it,
whole and streamed. SGLang's stream reads both so; its whole-answer reading only the first,
so that an answer of bare calls, which a forced ``tool_choice`` with ``deepseekv31`` gets (its
structural tag begins each call at ``<｜tool▁call▁begin｜>``), has no calls there, and an
answer with a bare call before the section marker has that call in its content. Here both
read as calls. SGLang's stream reads a marker only when it comes whole in one delta (one
token: a real tokenizer's), sends calls to tools not offered and the text between calls as
content, drops "```" and the end tokens from content, and with V3 can run one call's arguments
into the next's; this gives what the whole answer gives (checked against SGLang's stream on
answers fed a token at a time: the same names and arguments where the tools are offered). As
in the other formats (``stages.engine.tool_formats``), a call named in the stream stays named
if its text turns out to be unreadable, and the calls before it have gone out.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog

from stages.engine.marked_stream import MarkedStream, whole_calls
from stages.engine.partial_json import closed_prefix, partial_tail
from stages.engine.tool_formats import (
    _call,
    _Content,
    _either,
    _Objects,
    _skip_space,
    _Unreadable,
)

__all__ = ["FRAMES", "DeepSeekV3Calls", "DeepSeekV31Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

SECTION = "<｜tool▁calls▁begin｜>"
SECTION_END = "<｜tool▁calls▁end｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
# structure_info of each (tool_calls._FRAMES): before the name, the name as it is (not as JSON),
# after it, the call's end, the trigger
FRAMES = {
    "deepseekv3": (SECTION + BEGIN + "function" + SEP, False, "\n```json\n",
                   "\n```" + END + SECTION_END, SECTION),
    "deepseekv31": (BEGIN, False, SEP, END, BEGIN),
}  # fmt: skip
_b, _s, _e = re.escape(BEGIN), re.escape(SEP), re.escape(END)
_CALL = re.compile(_b + ".*?" + _e, re.DOTALL)  # func_call_regex

Pieces = list[dict[str, Any]]


class DeepSeekV3Calls:
    """SGLang's ``DeepSeekV3Detector`` (``--tool-call-parser deepseekv3``)."""

    # func_detail_regex: (name group, arguments group)
    _detail = re.compile(_b + "(.*)" + _s + "(.*)\n```json\n(.*)\n```" + _e, re.DOTALL)
    _groups = (2, 3)
    name_end = "\n```json\n"  # what follows a name (streamed: the name is whole there)
    args_end = "\n```" + END  # what follows the arguments

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return _start(text) != -1

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        return whole_calls(text, _start(text), _CALL, self.call)

    def call(self, text: str) -> dict[str, str] | None:
        """``{name, arguments}`` of one call's text (from its begin token to its end token);
        None (logged) for a tool not offered; ``_Unreadable`` when it has not the format's
        shape or its arguments are not JSON."""
        return _call(self.decoded(text), self.names, _either)

    def decoded(self, text: str) -> dict[str, Any]:
        """One call's text as the object ``parse_base_json`` reads: ``{name, parameters}``."""
        detail = self._detail.search(text)
        if detail is None:
            raise _Unreadable(f"a call is not {type(self).__name__[:-5]}'s: {text[:200]!r}")
        name, raw = (detail.group(g) for g in self._groups)
        try:
            return {"name": name, "parameters": json.loads(raw)}
        except (ValueError, RecursionError) as exc:
            raise _Unreadable(f"a call's arguments are not JSON: {exc}") from exc

    def head(self, body: str) -> tuple[str, str] | None:
        """``(name, arguments so far)`` of a call being written (``body``: its text after the
        begin token), once its name is whole."""
        sep = body.find(SEP)
        if sep == -1:
            return None
        rest = body[sep + len(SEP) :]
        at = rest.find(self.name_end)
        if at == -1:
            return None
        return rest[:at], rest[at + len(self.name_end) :]

    def stream(self) -> _DeepSeekStream:
        return _DeepSeekStream(self)


class DeepSeekV31Calls(DeepSeekV3Calls):
    """SGLang's ``DeepSeekV31Detector`` (``--tool-call-parser deepseekv31``)."""

    _detail = re.compile(_b + "(.*)" + _s + "(.*)" + _e, re.DOTALL)
    _groups = (1, 2)
    args_end = END

    def head(self, body: str) -> tuple[str, str] | None:
        sep = body.find(SEP)
        if sep == -1:
            return None
        return body[:sep], body[sep + len(SEP) :]


def _start(text: str) -> int:
    """Where the calls begin: the first section marker or call begin token (-1: none)."""
    found = [i for i in (text.find(SECTION), text.find(BEGIN)) if i != -1]
    return min(found) if found else -1


def _arguments(raw: str) -> str | None:
    """The JSON of what of a call's arguments (an object being written) parses so far."""
    start = _skip_space(raw, 0)
    if start == len(raw) or raw[start] != "{":
        return None
    closed = closed_prefix(raw[start:])
    try:
        value = json.loads(closed) if closed is not None else None
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class _DeepSeekStream(MarkedStream):
    begin, end = BEGIN, END

    def __init__(self, reader: DeepSeekV3Calls) -> None:
        self.objects = _Objects(reader.names, _either)  # what of each call went out
        super().__init__(self.objects.pieces)
        self.reader = reader
        self.before = _Content(SECTION, strip=True)

    def content(self, text: str) -> tuple[str, int | None]:
        at = _start(text)
        if at == -1:  # a tail that may begin either marker waits
            held = max(partial_tail(text, SECTION), partial_tail(text, BEGIN))
            return self.before.more(text, len(text) - held), None
        return self.before.more(text, at), at

    def rest(self, text: str) -> str:
        return self.before.rest(text)

    def partial(self, key: int, body: str) -> Pieces:
        head = self.reader.head(body)
        objects = self.objects
        if head is None or key in objects.dropped:
            return []
        name, raw = head
        if not objects.pieces.named(key) and name not in self.reader.names:
            log.warning("tool_call_unknown_function", name=name[:100])
            objects.dropped.add(key)
            return []
        raw = raw[: len(raw) - partial_tail(raw, self.reader.args_end)]
        return objects.pieces.partial(key, name, _arguments(raw))

    def whole(self, key: int, text: str) -> Pieces:
        try:
            decoded = self.reader.decoded(text)
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return []
        return self.objects.whole(key, decoded)  # logs a tool not offered
