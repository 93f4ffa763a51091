"""Tool calls written as JSON objects: SGLang's ``qwen25`` (also ``qwen``), ``hermes``,
``llama3`` and ``mistral`` formats, and the JSON array that a forced tool choice gets where the
format has no structural tag.

As SGLang 0.5.23 reads them (``function_call/qwen25_detector.py``, ``hermes_detector.py``,
``llama32_detector.py``, ``mistral_detector.py``, ``json_array_parser.py``,
``base_format_detector.py``; ``serving_chat._process_tool_calls``). A call is a JSON object;
its name must be an offered tool (else it is dropped and logged), its arguments are
``parameters`` or else ``arguments`` (``{}`` when neither; a falsy ``parameters`` gives way to
``arguments``, which are kept as they are, ``null`` and ``[]`` too), as JSON text
(``ensure_ascii=False``). Where a value that should be a call is not an object, or its name is
a list or an object, SGLang's ``parse_base_json`` raises (its ``/parse_function_call`` answers
500; its chat route keeps the text as content, no calls): here the whole answer is unreadable,
no calls and the text as it is, on both routes.

- ``qwen25``: ``<tool_call>\n`` and ``\n</tool_call>`` around each call (the newlines
  needed: ``<tool_call>{...}</tool_call>`` is no call, the answer text as it is); the content
  is the text before the first call (stripped), the rest is dropped. A tag holds a call object
  or a JSON list of them; one that is not JSON is dropped (logged).
- ``hermes``: ``<tool_call>`` and ``</tool_call>``, newlines or not, and a last call whose end
  tag never came is read too; but one tag that is not JSON (an unfinished last call too) makes
  the whole answer unreadable, as any error does in ``HermesDetector.detect_and_parse``.
- ``llama3``: calls follow ``<|python_tag|>`` (the text before it is content, as it is), or
  make up an answer that begins with ``{``; one after another, one character (``;``) between
  two, each decoded right where it starts. Where one cannot be, an object of Python literals
  there (``{'name': 'f', ...}``, braces counted) is read with ``ast.literal_eval``; failing
  that, the calls go on at the next ``{"name":``. The text after the last call is content
  (stripped).
- ``mistral``: content is the text before ``[TOOL_CALLS`` (stripped). ``[TOOL_CALLS] [`` then
  a JSON array of call objects (an array that is not valid JSON: no calls), the text after the
  array content again, joined with a space; or ``[TOOL_CALLS]name[ARGS]{...}`` once or more
  (``]`` after either marker may be missing; the text between two is dropped, the text after
  the last, when a call was read, is content). Only the first array is read.
- ``json_array`` (not a ``--tool-call-parser``): what ``tool_choice`` ``required`` or a named
  function is constrained to for ``pythonic``: the whole answer is ``[{"name", "parameters"},
  ...]`` (or one such object), no content; any other answer has no calls.

Streamed (``stream()``): content goes out as it comes, but for a tail that could begin a
marker and whitespace that a call would strip; a call's name as soon as it is whole, then its
arguments in pieces (``partial_json.CallPieces``), the rest once its object is whole (a
compact Mistral call, a Llama call of Python literals, or a list of calls in one
``<tool_call>``, goes out whole once it closes: name, then arguments). Content after the calls
goes out where it is known to be content: for Llama, at the end (a later call would drop it).
Where SGLang's streaming depends on where the deltas split (it reads only the buffer it holds,
so a ``;`` or ``, `` split from the next call, or a name and arguments in one delta, lose a call
or its arguments; ``]`` deleted from Mistral content; an unknown Mistral call, or the rest of an
unknown JSON call, sent as content; a list in a ``<tool_call>`` never read), this gives what the
whole answer gives, which is what SGLang streams when the deltas are small. Differences that
remain: a Llama answer that begins with ``{`` is read as calls from its start even if a
``<|python_tag|>`` comes later (SGLang's stream does so; its whole-answer reading would make
the text before the tag content); a call already named stays named even if its object turns
out not to be JSON; and an answer found unreadable only later (a Hermes tag that is not JSON, a
call that is not an object) has had the calls before it sent, and the stream goes on with the
calls after it, where the whole answer has none. A call unfinished at the end gets the rest of
its partial arguments' JSON (``unsent``), as SGLang's ``_check_for_unstreamed_tool_args`` sends
it; a Hermes call whose end tag never came, but whose JSON is whole, gets its rest there too.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable, Container
from typing import Any

import structlog

from stages.engine.partial_json import CallPieces, bracket_end, closed_prefix, partial_tail

__all__ = ["HermesCalls", "JsonArrayCalls", "Llama3Calls", "MistralCalls", "Qwen25Calls"]

log = structlog.get_logger("stages.engine.tool_calls")

Pieces = list[dict[str, Any]]
_DECODER = json.JSONDecoder()


class _Unreadable(ValueError):
    """The answer cannot be read for calls at all (SGLang: an exception out of the parser)."""


def quiet_ast(read: Callable[[str], Any], text: str) -> Any:
    """``read(text)`` (``ast.literal_eval``, ``ast.parse``) without Python's warnings for
    invalid escapes, which keep their backslash, as SGLang's ``_run_ast_quiet`` reads them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return read(text)


def _either(obj: dict[str, Any]) -> Any:
    """A call's arguments as ``parse_base_json`` takes them."""
    return obj.get("parameters") or obj.get("arguments", {})


def _call(obj: Any, names: set[str], arguments: Callable[[dict], Any]) -> dict[str, str] | None:
    """``{name, arguments}`` of a decoded call object; None (logged) for a tool not offered."""
    if not isinstance(obj, dict):
        raise _Unreadable(f"a call is a JSON object, not {type(obj).__name__}")
    name = obj.get("name")
    if name and isinstance(name, list | dict):  # parse_base_json: `name in tool_indices` raises
        raise _Unreadable(f"a call's name is a string, not {type(name).__name__}")
    if not isinstance(name, str) or name not in names:
        log.warning("tool_call_unknown_function", name=str(name)[:100])
        return None
    return {"name": name, "arguments": json.dumps(arguments(obj), ensure_ascii=False)}


def _strict_loads(text: str) -> Any:
    """JSON as orjson reads it (SGLang checks with orjson): no NaN or Infinity."""

    def refuse(word: str) -> Any:
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


def offered_call(name: str, arguments: Any, offered: Container[str]) -> dict[str, str] | None:
    """``{name, arguments}`` of a call to a tool ``offered``, its arguments as JSON; None
    (logged) for another (``parse_base_json``); ``_Unreadable`` where the arguments are not
    JSON (a Python set, bytes)."""
    if not name or name not in offered:
        log.warning("tool_call_unknown_function", name=name[:100])
        return None
    try:
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    except (TypeError, ValueError) as exc:
        raise _Unreadable(f"a call's arguments are not JSON: {exc}") from exc


class MarkedCalls:
    """A format whose answer has calls where its ``marker`` is: the names of the tools
    offered, and that test."""

    marker: str

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return self.marker in text


class _Objects:
    """The call objects of one stream: what of each went out, and which were dropped."""

    def __init__(self, names: set[str], arguments: Callable[[dict], Any]) -> None:
        self.names = names
        self.arguments = arguments
        self.pieces = CallPieces()
        self.dropped: set[int] = set()  # where objects naming no offered tool begin
        self.open: int | None = None  # where a named object not yet whole begins

    def partial(self, key: int, raw: str) -> Pieces:
        """Pieces of the object that begins at ``key``, written so far as ``raw``."""
        if key in self.dropped:
            return []
        name, arguments = _partial_call(raw)
        if not self.pieces.named(key):
            if name is None:
                return []
            if name not in self.names:
                log.warning("tool_call_unknown_function", name=name[:100])
                self.dropped.add(key)
                return []
            self.open = key
        return self.pieces.partial(key, name or "", arguments)

    def whole(self, key: int, obj: Any) -> Pieces:
        """Pieces of the object at ``key``, now decoded as ``obj``."""
        self.open = None
        if key in self.dropped:
            return []
        try:
            call = _call(obj, self.names, self.arguments)
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return []
        if call is None:
            return []
        return self.pieces.whole(key, call["name"], call["arguments"])


def _partial_call(raw: str) -> tuple[str | None, str | None]:
    """(its name once whole, the JSON of its arguments so far) of a call object being
    written (``parameters`` if it has them, else ``arguments``; None before either)."""
    found: list[Any] = []
    for strings in (False, True):
        text = closed_prefix(raw, strings=strings)
        try:
            found.append(json.loads(text) if text is not None else None)
        except ValueError:
            found.append(None)
    named, whole = found
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(whole, dict):
        return (name if isinstance(name, str) else None), None
    arguments = whole["parameters"] if "parameters" in whole else whole.get("arguments")
    return (
        name if isinstance(name, str) else None,
        None if arguments is None else json.dumps(arguments, ensure_ascii=False),
    )


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class _Tail:
    """Content that follows the calls, stripped, after a space if content went before it:
    sent as it comes but for whitespace, which waits for what follows it."""

    def __init__(self) -> None:
        self.sent = 0

    def more(self, text: str, start: int, after_content: bool) -> str:
        body = text[start:].strip()
        if len(body) <= self.sent:
            return ""
        out = (" " if after_content and not self.sent else "") + body[self.sent :]
        self.sent = len(body)
        return out


class _Content:
    """Content before a marker, as it comes: a tail that could begin ``marker`` waits, and so
    does whitespace (``strip``: what a call would strip), for what follows it."""

    def __init__(self, marker: str, strip: bool) -> None:
        self.marker, self.strip, self.sent, self.any = marker, strip, 0, False

    def more(self, text: str, upto: int | None) -> str:
        """Content up to ``upto`` (the marker's place; None: not found yet)."""
        if upto is None:
            upto = len(text) - partial_tail(text, self.marker)
        if self.strip:
            upto = max(self.sent, len(text[:upto].rstrip()))
        out, self.sent = text[self.sent : upto], max(self.sent, upto)
        self.any = self.any or bool(out.strip())
        return out

    def rest(self, text: str) -> str:
        """At the end, with no marker: what waited."""
        out, self.sent = text[self.sent :], len(text)
        return out


# ---- qwen25 / hermes ----------------------------------------------------------------------------


def _calls(value: Any, names: set[str]) -> list[dict[str, str]]:
    """The calls of a decoded value, a call object or a list of them (``parse_base_json``)."""
    items = value if isinstance(value, list) else [value]
    return [c for c in (_call(v, names, _either) for v in items) if c is not None]


class Qwen25Calls:
    """SGLang's ``Qwen25Detector`` (``--tool-call-parser qwen25`` or ``qwen``)."""

    begin, end = "<tool_call>\n", "\n</tool_call>"  # qwen25_detector.py:38-39
    _blocks = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)  # :61
    reads_unclosed = False  # a last call without its end tag is a call (Hermes)

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return self.begin in text

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(self.begin)
        if at == -1:
            return text, []
        calls = []
        try:
            for body in self._bodies(text):
                calls += self.block(body)
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return text, []
        return text[:at].strip(), calls

    def _bodies(self, text: str) -> list[str]:
        return self._blocks.findall(text)

    def block(self, body: str) -> list[dict[str, str]]:
        """The calls of one tag's ``body``; none (logged) where it is not JSON."""
        try:
            value = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=body[:200])
            return []
        except (ValueError, RecursionError) as exc:  # SGLang catches JSONDecodeError alone
            raise _Unreadable(str(exc)) from exc
        return _calls(value, self.names)

    def stream(self) -> _TaggedStream:
        return _TaggedStream(self)


class HermesCalls(Qwen25Calls):
    """SGLang's ``HermesDetector`` (``--tool-call-parser hermes``)."""

    begin, end = "<tool_call>", "</tool_call>"  # hermes_detector.py:147-148
    _blocks = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # :149
    reads_unclosed = True

    def _bodies(self, text: str) -> list[str]:
        return [closed or rest for closed, rest in self._blocks.findall(text) if closed or rest]

    def block(self, body: str) -> list[dict[str, str]]:
        """The calls of one tag's ``body``; a body that is not JSON makes the whole answer
        unreadable (``detect_and_parse``'s ``except Exception``: the text as it is)."""
        try:
            value = json.loads(body.strip())
        except (ValueError, RecursionError) as exc:
            raise _Unreadable(str(exc)) from exc
        return _calls(value, self.names)


def _unthought(text: str) -> str:
    return text.replace("<think>", "").replace("</think>", "")


class TrinityCalls(Qwen25Calls):
    """SGLang's ``TrinityDetector`` (``--tool-call-parser trinity``): Qwen 2.5's calls, read
    after ``<think>`` and ``</think>`` are taken out of the text (so calls written inside the
    reasoning count); a stream takes them out of each delta, as SGLang's does."""

    def has_tool_call(self, text: str) -> bool:
        return super().has_tool_call(_unthought(text))

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        return super().parse(_unthought(text))

    def stream(self) -> _UnthoughtStream:  # type: ignore[override]
        return _UnthoughtStream(_TaggedStream(self))


class _UnthoughtStream:
    def __init__(self, inner: _TaggedStream) -> None:
        self.inner = inner

    @property
    def calls(self) -> int:
        return self.inner.calls

    def feed(self, delta: str) -> tuple[str, Pieces]:
        return self.inner.feed(_unthought(delta))

    def flush(self) -> str:
        return self.inner.flush()

    def unsent(self) -> Pieces:
        return self.inner.unsent()


class _TaggedStream:
    def __init__(self, reader: Qwen25Calls) -> None:
        self.reader = reader
        self.text = ""
        self.pos = 0  # where the text not passed on (or read) yet begins
        self.body: int | None = None  # inside a tag: where its body begins
        self.blocks = 0  # tags begun: the current one's key
        self.objects = _Objects(reader.names, _either)
        self.last: Pieces = []  # Hermes: what is left of a call whose tag never closed

    @property
    def calls(self) -> int:
        return self.objects.pieces.count

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, begin, content, pieces = self.text, self.reader.begin, "", []
        while True:
            if self.body is None:
                at = text.find(begin, self.pos)
                if at == -1:
                    cut = len(text) - partial_tail(text[self.pos :], begin)
                    if not self.blocks:  # the text after a call is not content (SGLang drops it)
                        content += text[self.pos : cut]
                    self.pos = cut
                    break
                if not self.blocks:
                    content += text[self.pos : at].rstrip()
                self.body, self.blocks = at + len(begin), self.blocks + 1
            end = text.find(self.reader.end, self.body)
            if end == -1:
                pieces += self._partial(text[self.body :])
                break
            pieces += self._whole(text[self.body : end])
            self.body, self.pos = None, end + len(self.reader.end)
        return content, pieces

    def _partial(self, body: str) -> Pieces:
        """Pieces of the call whose tag is open (``body``: its text so far); a list of calls
        goes out once its tag closes."""
        start = _skip_space(body, 0)
        if start == len(body) or body[start] != "{":
            return []
        return self.objects.partial((self.blocks, 0), body[start:])

    def _whole(self, body: str) -> Pieces:
        """The rest of the calls of the current tag, now closed (``body``: all its text)."""
        self.objects.open = None
        try:
            calls = self.reader.block(body)  # logs what it drops
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=body[:200])
            return []
        out: Pieces = []
        for j, call in enumerate(calls):
            if (self.blocks, j) not in self.objects.dropped:
                out += self.objects.pieces.whole((self.blocks, j), call["name"], call["arguments"])
        return out

    def flush(self) -> str:
        if self.body is None:
            rest, self.pos = self.text[self.pos :], len(self.text)
            return "" if self.blocks else rest
        body, self.body, self.pos = self.text[self.body :], None, len(self.text)
        if self.reader.reads_unclosed and body:
            self.last = self._whole(body)
        else:
            log.warning("tool_call_incomplete", text=body[:200])
        return ""

    def unsent(self) -> Pieces:
        out, self.last = self.last, []
        return out + self.objects.pieces.unsent()


# ---- llama3 ------------------------------------------------------------------------------------

TAG = "<|python_tag|>"
_NEXT = '{"name":'


class Llama3Calls:
    """SGLang's ``Llama32Detector`` (``--tool-call-parser llama3``)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return TAG in text or text.startswith("{")

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        if TAG in text:
            before, actions = text.split(TAG, 1)
        elif text.startswith("{"):
            before, actions = "", text
        else:
            return text, []
        calls, safe = [], 0
        try:
            for step in _llama3_steps(actions, 0, final=True):
                if step[0] == "call":
                    call = _call(step[2], self.names, _either)
                    if call is not None:
                        calls.append(call)
                    safe = step[3]
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return text, []
        return before + (actions[safe:].strip() if safe < len(actions) else ""), calls

    def stream(self) -> _Llama3Stream:
        return _Llama3Stream(self.names)


def _llama3_steps(actions: str, i: int, *, final: bool) -> Any:
    """What ``Llama32Detector.detect_and_parse`` reads from ``i`` on: ``("call", start, value,
    next)`` for each decoded value, ``("skip", next)`` past what is not one, and (``final``
    false: the text may go on) ``("open", start)`` for an object still being written, after
    which, or where the text may still decide, it stops."""
    while i < len(actions):
        try:
            value, end = _DECODER.raw_decode(actions, i)
        except json.JSONDecodeError:
            pass
        else:
            yield ("call", i, value, end + 1)  # one separator character after it
            i = end + 1
            continue
        if not final and actions[i] in "{[" and bracket_end(actions, i) == -1:
            if actions[i] == "{":
                yield ("open", i)
            return  # a list still open: read once it closes
        end = _brace_end(actions, i)
        if end > i:
            as_json = _python_dict(actions[i:end])
            if as_json is not None and as_json != actions[i:end]:
                yield ("call", i, json.loads(as_json), end + 1)
                i = end + 1
                continue
        elif not final and actions[i:].lstrip().startswith("{"):
            return  # Python literals may still close
        found = actions.find(_NEXT, i + 1)
        if found == -1:
            return
        yield ("skip", found)
        i = found


def _brace_end(text: str, start: int) -> int:
    """Where the braces counted from ``start`` (strings not minded) first come back to none,
    or ``start`` if they do not."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return start


def _python_dict(text: str) -> str | None:
    """The JSON of a dict written as Python literals; None if it is not one."""
    try:
        value = quiet_ast(ast.literal_eval, text.strip())
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    except Exception:  # SGLang: any failure means "not a dict"
        return None


class _Llama3Stream:
    def __init__(self, names: set[str]) -> None:
        self.text = ""
        self.before = _Content(TAG, strip=False)
        self.actions: int | None = None  # where the calls begin
        self.next = 0  # in the calls' text: where the next call may begin
        self.safe = 0  # ... and where content after the last call read begins
        self.objects = _Objects(names, _either)

    @property
    def calls(self) -> int:
        return self.objects.pieces.count

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        content = ""
        if self.actions is None:
            if self.before.sent == 0 and self.text.startswith("{"):
                self.actions = 0
            else:
                at = self.text.find(TAG)
                content = self.before.more(self.text, None if at == -1 else at)
                if at == -1:
                    return content, []
                self.actions = at + len(TAG)
        actions, pieces = self.text[self.actions :], []
        for step in _llama3_steps(actions, self.next, final=False):
            if step[0] == "call":
                pieces += self.objects.whole(step[1], step[2])
                self.next = self.safe = step[3]
            elif step[0] == "skip":
                self.next = step[1]
            else:
                pieces += self.objects.partial(step[1], actions[step[1] :])
        return content, pieces

    def flush(self) -> str:
        if self.actions is None:
            return self.before.rest(self.text)
        if self.objects.open is not None:
            log.warning("tool_call_incomplete", text=self.text[self.actions :][-200:])
            return ""
        actions = self.text[self.actions :]
        return actions[self.safe :].strip()

    def unsent(self) -> Pieces:
        return self.objects.pieces.unsent()


# ---- mistral -----------------------------------------------------------------------------------

MARKER, BOT, ARGS = "[TOOL_CALLS", "[TOOL_CALLS] [", "[ARGS"
_WAIT = "wait"  # a compact call that more text may yet complete


class MistralCalls(MarkedCalls):
    """SGLang's ``MistralDetector`` (``--tool-call-parser mistral``)."""

    marker = MARKER

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(MARKER)
        if at == -1:
            return text, []
        normal, part = text[:at].strip(), text[at:]
        try:
            if BOT in part:
                calls, rest = self._array(part)
                if rest is None:
                    return normal, []
            else:
                calls, rest = self._compact(part)
                if not calls:
                    return normal, []
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc))
            return text, []
        return ((normal + " " + rest).strip() if rest else normal), calls

    def _array(self, part: str) -> tuple[list[dict[str, str]], str | None]:
        """The calls of the first array and the text after it (None: it never closes)."""
        start = part.find(BOT) + len(BOT) - 1
        end = bracket_end(part, start)
        if end == -1:
            return [], None
        array = part[start:end]
        try:
            value = json.loads(array)
        except json.JSONDecodeError as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=array[:200])
            value = []
        return _calls(value, self.names), part[part.find(array) + len(array) :].strip()

    def _compact(self, part: str) -> tuple[list[dict[str, str]], str]:
        calls, rest = [], part
        while rest:
            found = _compact_call(rest)
            if not isinstance(found, tuple):
                break
            call = _call({"name": found[0], "arguments": found[1]}, self.names, _either)
            if call is not None:
                calls.append(call)
            rest = rest[found[2] :].strip()
        return calls, rest

    def stream(self) -> _MistralStream:
        return _MistralStream(self.names)


def _compact_call(text: str) -> tuple[str, Any, int] | str | None:
    """``(name, arguments, end)`` of the first ``[TOOL_CALLS]name[ARGS]{...}`` in ``text``
    (``MistralDetector._try_parse_compact_args_format``); ``_WAIT`` where more text could
    complete it, None where none can."""
    start = text.find(MARKER)
    if start == -1:
        return _WAIT
    i = start + len(MARKER)
    i += i < len(text) and text[i] == "]"
    i = _skip_space(text, i)
    at = text.find(ARGS, i)
    if at == -1:
        return _WAIT
    name = text[i:at].strip()
    if not name:
        return None
    j = at + len(ARGS)
    j += j < len(text) and text[j] == "]"
    j = _skip_space(text, j)
    if j >= len(text):
        return _WAIT
    if text[j] not in "{[":
        return None
    end = bracket_end(text, j)
    if end == -1:
        return _WAIT
    try:
        return name, _strict_loads(text[j:end]), end
    except ValueError:
        return None


class _Array:
    """The call objects of a JSON array (its ``[`` at ``start``), read as they are written:
    each whole one as it closes, the one being written in pieces."""

    def __init__(self, start: int, objects: _Objects, *, bracketed: bool = True) -> None:
        self.start, self.objects, self.bracketed = start, objects, bracketed
        self.pos, self.after_item = start + 1, False
        self.end: int | None = None  # after its ``]``, once closed
        self.broken = False  # not an array of objects: no more calls are read

    def read(self, text: str) -> Pieces:
        out: Pieces = []
        while self.end is None and not self.broken:
            i = _skip_space(text, self.pos)
            if i >= len(text):
                break
            c = text[i]
            if c == "]":
                self.end = i + 1
            elif c == "," and self.after_item:
                self.pos, self.after_item = i + 1, False
            elif c == "{" and not self.after_item:
                try:
                    value, end = _DECODER.raw_decode(text, i)
                except json.JSONDecodeError:
                    if bracket_end(text, i) != -1:
                        self._broke(text, i)
                        continue
                    out += self.objects.partial(i, text[i:])
                    break
                out += self.objects.whole(i, value)
                self.pos, self.after_item = end, True
            else:
                self._broke(text, i)
        if self.broken and self.end is None and self.bracketed:
            end = bracket_end(text, self.start)
            self.end = None if end == -1 else end
        return out

    def _broke(self, text: str, i: int) -> None:
        log.warning("tool_call_unparsed", error="not an array of call objects", text=text[i:][:200])
        self.broken = True


class _MistralStream:
    def __init__(self, names: set[str]) -> None:
        self.text = ""
        self.before = _Content(MARKER, strip=True)
        self.objects = _Objects(names, _either)
        self.at: int | None = None  # where the marker is
        self.array: _Array | None = None
        self.compact: int | None = None  # where the next compact call may be
        self.settled = False  # compact: no more calls can come (the rest is content)
        self.after = _Tail()

    @property
    def calls(self) -> int:
        return self.objects.pieces.count

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        text, content = self.text, ""
        if self.at is None:
            at = text.find(MARKER)
            content = self.before.more(text, None if at == -1 else at)
            if at == -1:
                return content, []
            self.at = at
        if self.array is None and self.compact is None:
            part = text[self.at :]
            if part.startswith(BOT):
                self.array = _Array(self.at + len(BOT) - 1, self.objects)
            elif BOT.startswith(part):
                return content, []
            else:
                self.compact = self.at
        if self.array is not None:
            pieces = self.array.read(text)
            if self.array.end is not None:
                content += self.after.more(text, self.array.end, self.before.any)
            return content, pieces
        pieces = self._compact()
        if self.settled and self.calls:
            content += self.after.more(text, self.compact or 0, self.before.any)
        return content, pieces

    def _compact(self) -> Pieces:
        out: Pieces = []
        while not self.settled:
            found = _compact_call(self.text[self.compact :])
            if found == _WAIT:
                break
            if found is None:
                self.settled = True
                break
            name, arguments, end = found
            key = self.compact or 0
            if name in self.objects.names:
                arguments = json.dumps(arguments, ensure_ascii=False)
                out += self.objects.pieces.whole(key, name, arguments)
            else:
                log.warning("tool_call_unknown_function", name=name[:100])
            self.compact = key + end
        return out

    def flush(self) -> str:
        if self.at is None:
            return self.before.rest(self.text)
        if self.array is not None:
            if self.objects.open is not None and self.array.end is None:
                log.warning("tool_call_incomplete", text=self.text[self.at :][-200:])
            return ""
        if self.compact is not None and self.calls:
            return self.after.more(self.text, self.compact, self.before.any)
        return ""

    def unsent(self) -> Pieces:
        return self.objects.pieces.unsent()


# ---- the JSON array of a forced call -----------------------------------------------------------


def _parameters(obj: dict[str, Any]) -> Any:
    return obj.get("parameters", {})


class JsonArrayCalls:
    """What ``serving_chat._process_tool_calls`` (whole) and ``JsonArrayParser`` (streamed)
    read when ``tool_choice`` forced calls by JSON schema: ``[{"name", "parameters"}, ...]``."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def has_tool_call(self, text: str) -> bool:
        return True  # the answer is read whatever it is, as there

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        try:
            value = _strict_loads(text)
        except ValueError as exc:
            log.warning("tool_call_unparsed", error=str(exc), text=text[:200])
            return text, []
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in items
        ):
            log.warning("tool_call_unparsed", error="not a JSON array of calls", text=text[:200])
            return text, []
        calls = [
            {"name": v["name"], "arguments": json.dumps(_parameters(v), ensure_ascii=False)}
            for v in items
        ]
        return "", calls

    def stream(self) -> _JsonArrayStream:
        return _JsonArrayStream(self.names)


class _JsonArrayStream:
    def __init__(self, names: set[str]) -> None:
        self.text = ""
        self.objects = _Objects(names, _parameters)
        self.array: _Array | None = None
        self.other = False  # neither a list nor an object: no calls

    @property
    def calls(self) -> int:
        return self.objects.pieces.count

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        if self.array is None and not self.other:
            i = _skip_space(self.text, 0)
            if i >= len(self.text):
                return "", []
            if self.text[i] == "[":
                self.array = _Array(i, self.objects)
            elif self.text[i] == "{":  # one call: the item of a list opened before it
                self.array = _Array(i - 1, self.objects, bracketed=False)
            else:
                self.other = True
        return "", self.array.read(self.text) if self.array is not None else []

    def flush(self) -> str:
        if self.objects.open is not None:
            log.warning("tool_call_incomplete", text=self.text[-200:])
        return ""

    def unsent(self) -> Pieces:
        return self.objects.pieces.unsent()
