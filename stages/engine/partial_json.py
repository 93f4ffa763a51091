"""JSON text as a model generates it, and the pieces of tool calls that go out meanwhile.

What every streamed tool-call format needs (SGLang: ``function_call/utils.py``,
``BaseFormatDetector.parse_streaming_increment``): what a JSON value written so far parses to
with its open strings, objects and lists closed (``closed_prefix``), where a bracketed value
ends (``bracket_end``), and ``CallPieces``, which turns a call's name and its arguments' JSON as
they grow into the pieces a stream sends: the name once, then arguments in pieces that add up
to the whole. ``ListedCalls`` is what a format whose reader numbers its own calls shares.

This module knows nothing of any one format, of HTTP or of the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import structlog

__all__ = [
    "CallPieces",
    "ListedCalls",
    "PieceStream",
    "bracket_end",
    "closed_prefix",
    "common_prefix",
    "partial_tail",
]

log = structlog.get_logger("stages.engine.tool_calls")


def closed_prefix(raw: str, *, strings: bool = True) -> str | None:
    """The longest prefix of the JSON value that ``raw`` begins with that can be made valid
    by closing what is open: a value complete so far is kept whole, an unfinished string is
    cut before an unfinished escape and closed (``strings`` false: left out, as a name is
    read only once whole), an unfinished number, literal, key or key without value is left
    out. None if nothing can be kept yet."""
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
                if is_key or not strings:
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


def bracket_end(text: str, start: int) -> int:
    """Where the object or list that opens at ``start`` closes (the index after it), -1
    while it is open: brackets of its own kind counted outside double-quoted strings, a
    backslash escaping the next character (SGLang's ``MistralDetector._extract_json_value``
    and ``_extract_json_array``)."""
    opening = text[start]
    closing = "}" if opening == "{" else "]"
    depth, in_string, escaped = 0, False, False
    for k in range(start, len(text)):
        ch = text[k]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
        elif not in_string and ch == opening:
            depth += 1
        elif not in_string and ch == closing:
            depth -= 1
            if depth == 0:
                return k + 1
    return -1


def common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def partial_tail(text: str, token: str) -> int:
    """How many characters at the end of ``text`` could begin ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class ListedCalls(ABC):
    """A tool-call format whose reader numbers the calls it reads (``pythonic``, Qwen3-Coder's,
    Kimi K2's, gpt-oss's): ``listed`` gives each call with its ``tool_index``, ``parse`` the
    calls alone."""

    @abstractmethod
    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(tool_index, call)])`` of a whole answer, each call ``{name,
        arguments}``."""

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """``(content, calls)`` of a whole answer."""
        content, listed = self.listed(text)
        return content, [call for _, call in listed]


class PieceStream:
    """What a format's stream of one answer keeps: its text so far and the pieces of its calls
    that went out (``calls``: how many were named; ``unsent``: what closes a call cut
    short)."""

    def __init__(self, pieces: CallPieces | None = None) -> None:
        self.text = ""
        self.pieces = pieces or CallPieces()

    @property
    def calls(self) -> int:
        return self.pieces.count

    def unsent(self) -> list[dict[str, Any]]:
        return self.pieces.unsent()


class CallPieces:
    """What of each streamed call has gone out. A call is known by a key of the caller's (where
    it begins in the text); its first piece names it (``{"index", "name", "arguments": ""}``),
    the next ones (``name`` None) add to its arguments: while they are unfinished, what the
    JSON of the arguments parsed so far has in common with the last such JSON; once the call
    is whole, the rest (SGLang's ``parse_streaming_increment``)."""

    def __init__(self) -> None:
        self.count = 0  # calls named so far: the next one's index
        self._calls: dict[Any, list[Any]] = {}  # key -> [index, arguments sent, last JSON]

    def named(self, key: Any) -> bool:
        return key in self._calls

    def partial(self, key: Any, name: str, arguments: str | None) -> list[dict[str, Any]]:
        """Pieces for a call still being written: ``arguments``, the JSON of what of its
        arguments parses so far (None: none yet)."""
        out = self._name(key, name)
        call = self._calls[key]
        if arguments is not None:
            if call[2] is not None and arguments != call[2]:
                more = common_prefix(call[2], arguments)[len(call[1]) :]
                if more:
                    out.append({"index": call[0], "name": None, "arguments": more})
                    call[1] += more
            call[2] = arguments
        return out

    def whole(self, key: Any, name: str, arguments: str) -> list[dict[str, Any]]:
        """Pieces for a call now whole (``arguments``: its arguments' JSON)."""
        out = self._name(key, name)
        index, sent, _ = self._calls[key]
        if not arguments.startswith(sent):  # cannot happen with well-formed pieces
            log.warning("tool_call_pieces_diverged", sent=sent[:200], whole=arguments[:200])
        elif len(arguments) > len(sent):
            out.append({"index": index, "name": None, "arguments": arguments[len(sent) :]})
            self._calls[key][1] = arguments
        self._calls[key][2] = arguments  # the last JSON is the whole: nothing is left unsent
        return out

    def unsent(self) -> list[dict[str, Any]]:
        """At the end: the rest of the last call's arguments as last parsed, when it was cut
        short (SGLang's ``_check_for_unstreamed_tool_args``: the JSON of its partial arguments,
        open strings, objects and lists closed, less what went out)."""
        if not self._calls:
            return []
        call = max(self._calls.values(), key=lambda c: c[0])
        index, sent, last = call
        if last is None or not last.startswith(sent) or len(last) == len(sent):
            return []
        call[1] = last
        return [{"index": index, "name": None, "arguments": last[len(sent) :]}]

    def _name(self, key: Any, name: str) -> list[dict[str, Any]]:
        if key in self._calls:
            return []
        self._calls[key] = [self.count, "", None]
        self.count += 1
        return [{"index": self.count - 1, "name": name, "arguments": ""}]
