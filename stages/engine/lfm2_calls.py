"""Tool calls in Liquid's LFM2 format (SGLang's ``--tool-call-parser lfm2``)::

    <|tool_call_start|>[get_weather(city="Paris", days=2), now()]<|tool_call_end|>

or a block holding JSON calls, ``[{"name": ..., "arguments": {...}}]``.

As SGLang 0.5.23 reads them (``function_call/lfm2_detector.py``, ``Lfm2Detector``;
``tests/stages/test_engine_sglang_lfm2.py`` holds this module to it on random texts where SGLang
imports):

- whole (``parse``): the content is the text before the first ``<|tool_call_start|>``,
  stripped. Each block up to its ``<|tool_call_end|>`` is read, stripped: where it begins ``{``
  or ``[{``, as JSON calls (``parameters`` before ``arguments``; a tool not offered dropped),
  and, where that gives none, as Python: one call or a list of calls, keyword arguments only,
  each a literal (strings, numbers, signs on them, ``True``/``False``/``None`` and
  ``true``/``false``/``null``, lists, tuples, sets as lists, dicts, ``**{...}`` merged,
  f-strings without placeholders), named by a name or a dotted name of a tool offered, JSON
  without NaN or infinities; a call that breaks one of these is dropped (logged). Text Python
  cannot read is read again as the model most likely meant it (``_rewrites``): zero-padded
  integers unpadded, raw newlines, tabs, returns and NULs in strings escaped, a string whose
  quotes the model nested without escaping closed at the one quote that makes the block read
  with as many calls, parameters named by Python keywords (``from=``) renamed for the reading;
  the first rewrite that reads wins; where none does, each top-level call is read alone
  (``_salvaged``). JSON that is not a list of call objects, or nested too deep, leaves the
  whole answer as it came, without calls (the detector raises).
  ``/parse_function_call`` numbers a Python call by its place in its list, a JSON call by its
  tool's place in ``tools``.
- streamed (``stream``): the content before the first block as it comes (a tail that may begin
  the tag, and trailing whitespace, wait; leading whitespace goes out before a block shows it
  should not), each block's calls whole at its end tag: the whole answer's. (SGLang's stream
  also sends the text after and between blocks, and the end tags of nothing, as content.)
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (its detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.marked_stream import ContentFirst
from stages.engine.partial_json import ListedCalls
from stages.engine.tool_formats import quiet_ast

__all__ = ["BEGIN", "END", "Lfm2Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<|tool_call_start|>", "<|tool_call_end|>"
_BLOCKS = re.compile(re.escape(BEGIN) + "(.*?)" + re.escape(END), re.DOTALL)
_NAMED = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_RENAMED = "_pyreservedkw_"  # a Python keyword used as a parameter name, while it is read
_CLOSERS = set(",)]}:")  # what may follow a string's closing quote
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\x00"}

Listed = list[tuple[int, dict[str, str]]]


class _Unreadable(Exception):
    """A block the detector raises on: the whole answer is then as it came, without calls."""


def _parse(text: str) -> ast.Module:
    return quiet_ast(ast.parse, text)


class Lfm2Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        # a name's place in tools: the last tool of the name (_get_tool_indices)
        self.places = {(t.get("function") or {}).get("name"): i for i, t in enumerate(tools)}

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def listed(self, text: str) -> tuple[str, Listed]:
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        calls: Listed = []
        try:
            for block in _BLOCKS.finditer(text):
                calls += self.block(block.group(1))
        except _Unreadable as exc:  # out of the detector: serving_chat's except Exception
            log.warning("tool_call_unparsed", format="lfm2", error=str(exc)[:200])
            return text, []
        return text[:at].strip(), calls

    def block(self, body: str) -> Listed:
        """The calls of one block (``body``: its text between the tags), each with its
        ``tool_index``; _Unreadable where the detector raises."""
        body = body.strip()
        if body.startswith(("[{", "{")):
            calls = self._json(body)
            if calls:
                return calls
        try:
            return self._python(body)
        except Exception as exc:  # (the detector's own catch-all: no calls)
            log.warning("tool_call_unparsed", format="lfm2", error=str(exc)[:200])
            return []

    def _json(self, body: str) -> Listed:
        """JSON calls (``parse_base_json``); none where the text is not JSON."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return []
        except RecursionError as exc:
            raise _Unreadable("JSON nested too deep") from exc
        calls: Listed = []
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict):
                raise _Unreadable(f"a JSON call that is not an object: {str(item)[:50]}")
            name = item.get("name")
            try:
                known = bool(name) and name in self.places
            except TypeError as exc:  # an unhashable name
                raise _Unreadable(f"a JSON call named {str(name)[:50]}") from exc
            if not known:
                log.warning("tool_call_unknown_function", name=str(name)[:100])
                continue
            arguments = item.get("parameters") or item.get("arguments", {})
            text = json.dumps(arguments, ensure_ascii=False)
            calls.append((self.places[name], {"name": name, "arguments": text}))
        return calls

    def _python(self, body: str) -> Listed:
        """Python calls (``_parse_pythonic_content``); raises where the detector's own
        catch-all gives none."""
        renamed = False
        try:
            module = _parse(body)
        except (SyntaxError, ValueError):
            for candidate, flag in _rewrites(body):
                try:
                    module = _parse(candidate)
                except (SyntaxError, ValueError):
                    continue
                renamed = flag
                break
            else:
                salvaged = _salvaged(body)
                if not salvaged:
                    raise
                found = (self._call(c, i, flag) for i, (c, flag) in enumerate(salvaged))
                return [call for call in found if call is not None]
        node = getattr(module.body[0], "value", None) if module.body else None
        if isinstance(node, ast.List):
            nodes = node.elts
        elif isinstance(node, ast.Call):
            nodes = [node]
        else:
            log.warning("tool_call_unparsed", format="lfm2", error="not a call or a list")
            return []
        if not all(isinstance(n, ast.Call) for n in nodes):
            log.warning("tool_call_unparsed", format="lfm2", error="not all calls")
            return []
        found = (self._call(n, i, renamed) for i, n in enumerate(nodes))
        return [call for call in found if call is not None]

    def _call(self, node: ast.Call, place: int, renamed: bool) -> tuple[int, dict] | None:
        """One call with its place in its list; None (logged) where it is dropped."""
        name = _dotted(node.func)
        if name is None or name not in self.places or node.args:
            log.warning("tool_call_dropped", format="lfm2", name=str(name)[:100])
            return None
        arguments: dict[Any, Any] = {}
        for kw in node.keywords:
            try:
                value = _literal(kw.value)
            except ValueError as exc:
                log.warning("tool_call_dropped", format="lfm2", name=name, error=str(exc)[:100])
                return None
            if kw.arg is not None:
                arguments[kw.arg] = value
            elif isinstance(value, dict):  # **{...}: later keys win
                arguments.update(value)
            else:
                log.warning("tool_call_dropped", format="lfm2", name=name, error="** not a dict")
                return None
        if renamed:
            arguments = {_restored(k): v for k, v in arguments.items()}
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError) as exc:
            log.warning("tool_call_dropped", format="lfm2", name=name, error=str(exc)[:100])
            return None
        return place, {"name": name, "arguments": text}

    def stream(self) -> _Lfm2Stream:
        return _Lfm2Stream(self)


def _dotted(node: ast.expr) -> str | None:
    """A call's name: a name, or names joined by dots; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _literal(node: ast.expr) -> Any:
    """An argument's value (``_get_parameter_value``); ValueError for what is not a literal
    with a JSON form."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise ValueError(f"no JSON form: {type(node.value).__name__}")
    if isinstance(node, ast.Dict):
        return {
            _literal(k): _literal(v)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    if isinstance(node, ast.List | ast.Set):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(v) for v in node.elts)
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name):
        if node.id in _NAMED:
            return _NAMED[node.id]
        raise ValueError(f"a name: {node.id}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _literal(node.operand)
        if isinstance(inner, int | float) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
        raise ValueError(f"a sign on {inner!r}"[:100])
    raise ValueError(f"not a literal: {type(node).__name__}")


def _restored(key: Any) -> Any:
    """A parameter name as the model wrote it, out of its renaming for the reading."""
    if isinstance(key, str) and key.endswith(_RENAMED) and keyword.iskeyword(key[: -len(_RENAMED)]):
        return key[: -len(_RENAMED)]
    return key


# ---- what a model most likely meant (lfm2_detector.py's recovery ladder) -----------------------


def _string_end(text: str, at: int) -> int:
    """Where the string whose opening quote is at ``at`` ends (its closing quote's place + 1,
    or the text's length); a backslash escapes the character after it."""
    quote, i = text[at], at + 1
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return len(text)


def _outside_strings(text: str, rewrite: Any) -> str:
    """``text`` with each run outside its strings handed to ``rewrite`` (``(run, i)`` → the
    new run and where to go on), strings kept as they are."""
    out, i = [], 0
    while i < len(text):
        if text[i] in "'\"":
            end = _string_end(text, i)
            out.append(text[i:end])
            i = end
            continue
        piece, i = rewrite(text, i)
        out.append(piece)
    return "".join(out)


def _unpadded(text: str) -> str:
    """Zero-padded decimal integers outside strings without their zeros (``07`` → ``7``)."""

    def rewrite(text: str, i: int) -> tuple[str, int]:
        if text[i].isalpha() or text[i] == "_":  # a name, digits and all
            end = i
            while end < len(text) and (text[end].isalnum() or text[end] == "_"):
                end += 1
            return text[i:end], end
        if not text[i].isdigit():
            return text[i], i + 1
        end = i
        while end < len(text) and (text[end].isdigit() or text[end] == "_"):
            end += 1
        digits = text[i:end].replace("_", "")
        after = text[end] if end < len(text) else ""
        padded = digits[0] == "0" and digits.strip("0") and (i == 0 or text[i - 1] != ".")
        if padded and after not in (".", "e", "E", "j", "J"):
            return str(int(digits)), end
        return text[i:end], end

    return _outside_strings(text, rewrite)


def _escaped_controls(text: str) -> str:
    """Raw newlines, returns, tabs and NULs inside strings escaped (``_escape_ctrl_chars``);
    a string never closed runs to the end."""
    out, quote, i = [], None, 0
    while i < len(text):
        char = text[i]
        if quote is None:
            quote = char if char in "'\"" else None
            out.append(char)
        elif char == "\\" and i + 1 < len(text):
            out.append(text[i : i + 2])
            i += 2
            continue
        elif char == quote:
            quote = None
            out.append(char)
        else:
            out.append(_ESCAPES.get(char, char))
        i += 1
    return "".join(out)


def _keywords_renamed(text: str) -> tuple[str, bool]:
    """Python keywords used as parameter names (``f(from=1)``) renamed, outside strings
    (``_rename_reserved_kwargs``); whether any was."""
    out, last, renamed, i = [], "", False, 0
    while i < len(text):
        char = text[i]
        if char in "'\"":
            end = _string_end(text, i)
            out.append(text[i:end])
            last, i = char, end
            continue
        if char.isalpha() or char == "_":
            end = i
            while end < len(text) and (text[end].isalnum() or text[end] == "_"):
                end += 1
            name, look = text[i:end], end
            while look < len(text) and text[look].isspace():
                look += 1
            assigned = text[look : look + 1] == "=" and text[look + 1 : look + 2] != "="
            if keyword.iskeyword(name) and assigned and last in ("(", ","):
                out.append(name + _RENAMED)
                renamed = True
            else:
                out.append(name)
            last, i = name[-1], end
            continue
        out.append(char)
        if not char.isspace():
            last = char
        i += 1
    return "".join(out), renamed


def _top_level(text: str, strings: bool = True) -> list[str]:
    """A block's calls split at its top-level commas, one pair of enclosing brackets off
    (``strings``: commas inside strings kept; else only brackets counted, which a broken
    quote cannot upset)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    parts, start, depth, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        if strings and char in "'\"":
            i = _string_end(text, i)
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _call_count(module: ast.Module) -> int:
    node = getattr(module.body[0], "value", None) if module.body else None
    if isinstance(node, ast.List):
        return sum(isinstance(e, ast.Call) for e in node.elts)
    return int(isinstance(node, ast.Call))


def _requoted(text: str) -> tuple[str, bool]:
    """The first string whose quotes the model nested without escaping them closed at the one
    later quote after which the block reads, with as many calls as its brackets say, its
    inner quotes escaped (``_escape_nested_quotes_in_strings``); whether one was."""
    calls = len(_top_level(text, strings=False))
    i = 0
    while i < len(text):
        quote = text[i]
        if quote not in "'\"":
            i += 1
            continue
        closers = _quotes(text, i + 1, quote)
        if not closers:
            return text, False
        if _closes(text, closers[0]):
            i = closers[0] + 1
            continue
        found = []
        for close in (c for c in closers if _closes(text, c)):
            inner = "".join(
                "\\" + text[j] if text[j] == quote and not _escaped(text, j) else text[j]
                for j in range(i + 1, close)
            )
            candidate = text[:i] + quote + inner + quote + text[close + 1 :]
            try:
                module = _parse(_escaped_controls(candidate))
            except (SyntaxError, ValueError):
                continue
            if calls > 1 and _call_count(module) < calls:
                continue
            found.append(candidate)
        return (found[0], True) if len(found) == 1 else (text, False)
    return text, False


def _quotes(text: str, start: int, quote: str) -> list[int]:
    """The places of ``quote`` from ``start`` that no backslash escapes."""
    places, j = [], start
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            places.append(j)
        j += 1
    return places


def _closes(text: str, at: int) -> bool:
    """A quote at ``at`` could close a string: what follows it, spaces skipped, is one of
    ``,)]}:``."""
    rest = text[at + 1 :].lstrip()
    return bool(rest) and rest[0] in _CLOSERS


def _escaped(text: str, at: int) -> bool:
    """The character at ``at`` follows an odd run of backslashes."""
    return (len(text[:at]) - len(text[:at].rstrip("\\"))) % 2 == 1


def _rewrites(text: str) -> list[tuple[str, bool]]:
    """The readings to try of a block Python cannot read, in order, each with whether its
    parameter names were renamed (``_recovery_candidates``)."""
    escaped = _escaped_controls(_unpadded(text))
    out = [(escaped, False)]
    requoted, changed = _requoted(escaped)
    if changed:
        out.append((_escaped_controls(requoted), False))
    for candidate, _ in list(out):
        renamed, changed = _keywords_renamed(candidate)
        if changed:
            out.append((renamed, True))
            requoted, changed = _requoted(renamed)
            if changed:
                out.append((_escaped_controls(requoted), True))
    return out


def _salvaged(text: str) -> list[tuple[ast.Call, bool]]:
    """The calls of a block no rewrite makes readable, each top-level call read alone (split
    both ways, the way that reads more wins; ``_salvage_calls_from_unparsable_block``)."""
    best: list[tuple[ast.Call, bool]] = []
    for strings in (True, False):
        parts = _top_level(text, strings)
        if len(parts) < 2:
            continue
        calls = []
        for part in parts:
            for candidate, renamed in [(part, False), *_rewrites(part)]:
                try:
                    module = _parse(candidate)
                except (SyntaxError, ValueError):
                    continue
                node = getattr(module.body[0], "value", None) if module.body else None
                if isinstance(node, ast.Call):
                    calls.append((node, renamed))
                break
        if len(calls) > len(best):
            best = calls
    return best


class _Lfm2Stream(ContentFirst):
    begin, end = BEGIN, END

    def __init__(self, reader: Lfm2Calls) -> None:
        super().__init__()
        self.reader = reader

    def whole(self, key: int, text: str) -> list[dict[str, Any]]:
        try:
            calls = self.reader.block(text[len(BEGIN) : -len(END)])
        except _Unreadable as exc:  # (the whole answer then has none)
            log.warning("tool_call_unparsed", format="lfm2", error=str(exc)[:200])
            return []
        pieces: list[dict[str, Any]] = []
        for i, (_, call) in enumerate(calls):
            pieces += self.pieces.whole((key, i), call["name"], call["arguments"])
        return pieces
