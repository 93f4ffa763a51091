"""Tool calls in generated text: the Qwen 2.5 / Hermes format, whole or as it streams.

What SGLang's ``Qwen25Detector`` (``--tool-call-parser qwen25``; ``hermes`` is the same format)
reads: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>``
and ``</tool_call>`` (newlines around the JSON), several calls one after another. The text before
the first call is the message's content (stripped); a call naming a tool the request did not
offer, or whose JSON does not parse, is dropped and logged, as there. Each call becomes
``{"name", "arguments"}`` with the arguments as a JSON string (``ensure_ascii=False``).

Streamed (``StreamingToolCalls``): text is passed on as it comes until a ``<tool_call>`` begins
(a tail that could be the start of one is held back, so only whitespace before a call may
have gone out before it began); a call goes out as SGLang sends it: its name first, as soon as
it is whole, then its arguments in pieces as they are generated (the JSON of what parses so
far), the rest once its ``</tool_call>`` arrives.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import structlog

__all__ = [
    "PARSERS",
    "StreamingToolCalls",
    "ToolCallParser",
    "call_tag",
    "parser_for_template",
]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<tool_call>", "</tool_call>"
# SGLang's --tool-call-parser names this format goes by
PARSERS = ("qwen25", "qwen", "hermes")


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs (None: none known)."""
    return "qwen25" if template and BEGIN in template else None


def call_tag(tools: list[dict[str, Any]], parser: str) -> dict[str, Any]:
    """The structural tag that constrains an answer to tool calls to ``tools``, one or more
    and nothing else, as SGLang builds it for ``tool_choice`` ``required`` or a named function
    (``FunctionCallParser.get_legacy_structural_tag(at_least_one=True)``): a structure per tool
    framed as the detector of ``parser`` frames a call (``structure_info``:
    ``<tool_call>\\n{"name":"NAME", "arguments":`` ... ``}\\n</tool_call>``, Hermes without
    the newlines), whose body follows the tool's ``parameters`` when it is ``strict``, else is
    any JSON."""
    newline = "" if parser == "hermes" else "\n"
    structures = []
    for tool in tools:
        fn = tool["function"]
        structures.append(
            {
                "begin": f'{BEGIN}{newline}{{"name":{json.dumps(fn["name"])}, "arguments":',
                "schema": (fn.get("parameters") or {}) if fn.get("strict") else {},
                "end": f"}}{newline}{END}",
            }
        )
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [BEGIN],
        "at_least_one": True,
    }


class ToolCallParser:
    """Tool calls of one request (``tools``: the request's ``tools``, validated)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.names = {t["function"]["name"] for t in tools}

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """``(content, calls)`` of a whole generated text."""
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        calls = []
        rest = text[at:]
        while True:
            start = rest.find(BEGIN)
            if start == -1:
                break
            end = rest.find(END, start)
            if end == -1:
                log.warning("tool_call_incomplete", text=rest[start : start + 200])
                break
            call = self.call(rest[start + len(BEGIN) : end])
            if call is not None:
                calls.append(call)
            rest = rest[end + len(END) :]
        return text[:at].strip(), calls

    def call(self, body: str) -> dict[str, str] | None:
        """One call's ``{name, arguments}`` from the text between the tags; None (logged) if
        it is not a JSON object naming an offered tool."""
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=body[:200])
            return None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or name not in self.names:
            log.warning("tool_call_unknown_function", name=str(name)[:100])
            return None
        arguments = obj.get("parameters") or obj.get("arguments") or {}
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


class StreamingToolCalls:
    """Feeds a sample's text deltas; hands back content to send now and pieces of tool calls.

    A piece is ``{"index", "name", "arguments"}``: a call's first piece names it (``name``, with
    ``arguments`` "") as soon as its name is whole; the next ones (``name`` None) add to its
    arguments, the JSON text ``json.dumps`` gives of them (``ensure_ascii=False``), so the
    pieces of a call add up to what the non-streamed answer holds. As SGLang's
    ``BaseFormatDetector.parse_streaming_increment``: while the arguments are incomplete, what
    goes out is what the JSON of the arguments parsed so far (open strings, objects and lists
    closed) has in common with the last such JSON; the rest goes once ``</tool_call>`` arrives.
    A call whose name is not an offered tool is dropped (logged) before anything of it goes out.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.pending = ""  # text not passed on yet (inside a call: the call's text so far)
        self.in_call = False
        self.calls = 0  # calls begun (named) so far: the next one's index
        self.named = False  # the current call's name went out
        self.dropped = False  # the current call names no offered tool
        self.sent = ""  # the current call's arguments sent so far
        self.last_json: str | None = None  # its arguments' JSON at the last delta

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += delta
        content, pieces = "", []
        while True:
            if not self.in_call:
                at = self.pending.find(BEGIN)
                if at == -1:
                    keep = _partial_tail(self.pending, BEGIN)
                    cut = len(self.pending) - keep
                    if not self.calls:  # text after a call is not content (SGLang drops it)
                        content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    break
                if not self.calls:
                    content += self.pending[:at].rstrip() if at else ""
                self.pending = self.pending[at + len(BEGIN) :]
                self.in_call = True
                self.named = self.dropped = False
                self.sent, self.last_json = "", None
            end = self.pending.find(END)
            if end == -1:
                pieces += self._partial(self.pending)
                break
            pieces += self._whole(self.pending[:end])
            self.pending = self.pending[end + len(END) :]
            self.in_call = False
        return content, pieces

    def _partial(self, body: str) -> list[dict[str, Any]]:
        """Pieces of the call being generated (``body``: its text so far)."""
        if self.dropped:
            return []
        out = []
        if not self.named:
            name = _partial_name(body)
            if name is None:
                return []
            if name not in self.parser.names:
                log.warning("tool_call_unknown_function", name=name[:100])
                self.dropped = True
                return []
            out.append({"index": self.calls, "name": name, "arguments": ""})
            self.named = True
            self.calls += 1
        now = _partial_arguments(body)
        if now is not None:
            if self.last_json is not None and now != self.last_json:
                more = _common_prefix(self.last_json, now)[len(self.sent) :]
                if more:
                    out.append({"index": self.calls - 1, "name": None, "arguments": more})
                    self.sent += more
            self.last_json = now
        return out

    def _whole(self, body: str) -> list[dict[str, Any]]:
        """The rest of a call whose ``</tool_call>`` arrived (``body``: all its text)."""
        if self.dropped:
            return []
        call = self.parser.call(body)  # logs what it drops
        if call is None:
            return []
        out = []
        if not self.named:
            out.append({"index": self.calls, "name": call["name"], "arguments": ""})
            self.calls += 1
        arguments = call["arguments"]
        if not arguments.startswith(self.sent):  # cannot happen with well-formed pieces
            log.warning("tool_call_pieces_diverged", sent=self.sent[:200], whole=arguments[:200])
        elif len(arguments) > len(self.sent):
            out.append(
                {"index": self.calls - 1, "name": None, "arguments": arguments[len(self.sent) :]}
            )
        return out

    def flush(self) -> str:
        """At the end: text held back that turned out not to start a call (a call never
        closed is dropped and logged)."""
        if self.in_call:
            log.warning("tool_call_incomplete", text=self.pending[:200])
            self.pending = ""
            return ""
        rest, self.pending = self.pending, ""
        return rest if not self.calls else ""


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _partial_name(body: str) -> str | None:
    """The call's name once it is whole (the format writes it first)."""
    match = _NAME.match(body)
    if match is None:
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) else None


def _partial_arguments(body: str) -> str | None:
    """The JSON (``json.dumps``) of the arguments written so far, open strings, objects and
    lists closed; None before any of them can be parsed."""
    match = _ARGUMENTS.search(body, _NAME.match(body).end() if _NAME.match(body) else 0)
    if match is None:
        return None
    text = _closed_prefix(body[match.end() :])
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False)


def _closed_prefix(raw: str) -> str | None:
    """The longest prefix of the JSON value that ``raw`` begins with that can be made valid
    by closing what is open: a value complete so far is kept whole, an unfinished string is
    cut before an unfinished escape and closed, an unfinished number, literal, key or
    key without value is left out. None if nothing can be kept yet."""
    stack: list[str] = []
    safe: tuple[int, int] | None = None  # (cut, depth): raw[:cut] + closers of that depth
    expect_key = False
    i, n = 0, len(raw)

    def closed(cut: int, depth: int, tail: str = "") -> str:
        return raw[:cut] + tail + "".join("}" if c == "{" else "]" for c in reversed(stack[:depth]))

    while i < n:
        c = raw[i]
        if c in " \t\r\n":
            i += 1
        elif c == '"':
            is_key = bool(stack) and stack[-1] == "{" and expect_key
            j = i + 1
            while j < n and raw[j] != '"':
                if raw[j] == "\\":
                    width = 6 if j + 1 < n and raw[j + 1] == "u" else 2
                    if j + width > n:
                        break  # an unfinished escape: the string stops before it
                    j += width
                else:
                    j += 1
            if j >= n or raw[j] != '"':  # the text ends inside this string
                if is_key:
                    break
                return closed(min(j, n), len(stack), '"')
            if not stack:
                return raw[: j + 1]
            if not is_key:
                safe = (j + 1, len(stack))
            i = j + 1
        elif c in "{[":
            stack.append(c)
            expect_key = c == "{"
            safe = (i + 1, len(stack))
            i += 1
        elif c in "}]":
            if not stack:
                return None
            stack.pop()
            if not stack:
                return raw[: i + 1]
            safe = (i + 1, len(stack))
            expect_key = False
            i += 1
        elif c == ",":
            expect_key = bool(stack) and stack[-1] == "{"
            i += 1
        elif c == ":":
            expect_key = False
            i += 1
        else:  # a number or a literal: whole only once something follows it
            j = i
            while j < n and raw[j] not in ",}] \t\r\n":
                j += 1
            if j == n:
                break
            if not stack:
                return raw[:j]
            safe = (j, len(stack))
            i = j
    return None if safe is None else closed(*safe)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _partial_tail(text: str, token: str) -> int:
    """How many characters at the end of ``text`` could begin ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
