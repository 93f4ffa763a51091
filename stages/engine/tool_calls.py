"""Tool calls in generated text, whole or as it streams, in the format SGLang's
``--tool-call-parser`` names: ``qwen25`` (also ``qwen``), ``hermes``, here; ``llama3``,
``mistral`` (``stages.engine.tool_formats``) and ``pythonic`` (``stages.engine.pythonic_calls``);
and how a forced ``tool_choice`` constrains an answer to calls in that format (``forced_calls``).

What SGLang's ``Qwen25Detector`` (``--tool-call-parser qwen25``; ``hermes`` is the same format)
reads: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>``
and ``</tool_call>`` (newlines around the JSON), several calls one after another. The text before
the first call is the message's content (stripped); a call naming a tool the request did not
offer, or whose JSON does not parse, is dropped and logged, as there. Each call becomes
``{"name", "arguments"}`` with the arguments as a JSON string (``ensure_ascii=False``).

Streamed (``StreamingToolCalls``; this format's): text is passed on as it comes until a
``<tool_call>`` begins (a tail that could be the start of one is held back, so only whitespace
before a call may have gone out before it began); a call goes out as SGLang sends it: its name
first, as soon as it is whole, then its arguments in pieces as they are generated (the JSON of
what parses so far), the rest once its ``</tool_call>`` arrives.

Forced (``tool_choice`` ``required`` or a named function), as SGLang's
``FunctionCallParser.get_structure_constraint``: a format with a structure (all but
``pythonic``) gets the structural tag of its calls (``call_tag``) and its answer is read in that
format; ``pythonic`` has none, so the answer is constrained by JSON schema to
``[{"name", "parameters"}, ...]`` (``utils.get_json_schema_constraint``: one item at most with
``parallel_tool_calls`` false) and read as that array (``answer_format``: ``json_array``).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import structlog

from stages.engine.partial_json import CallPieces, closed_prefix, partial_tail
from stages.engine.pythonic_calls import PythonicCalls
from stages.engine.tool_formats import JsonArrayCalls, Llama3Calls, MistralCalls

__all__ = [
    "PARSERS",
    "StreamingToolCalls",
    "ToolCallParser",
    "answer_format",
    "call_tag",
    "forced_calls",
    "parser_for_template",
]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<tool_call>", "</tool_call>"
# the formats of other modules, by the name the engine reads them by
_FORMATS = {
    "llama3": Llama3Calls,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
    "json_array": JsonArrayCalls,  # a forced answer where the format has no structural tag
}
# SGLang's --tool-call-parser names the engine reads
PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic")
# each format's call as SGLang's detectors frame it (structure_info): (begin before the name,
# end, trigger); a format not here has no structural tag
_FRAMES = {
    "qwen25": ('<tool_call>\n{"name":', "}\n</tool_call>", BEGIN),
    "qwen": ('<tool_call>\n{"name":', "}\n</tool_call>", BEGIN),
    "hermes": ('<tool_call>{"name":', "}</tool_call>", BEGIN),
    "llama3": ('<|python_tag|>{"name":', "}", "<|python_tag|>"),
    "mistral": ('[TOOL_CALLS] [{"name":', "}]", "[TOOL_CALLS]"),
}


class CallStream(Protocol):
    """A sample's text deltas in, content to send now and pieces of tool calls out."""

    calls: int  # calls named so far

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]: ...

    def flush(self) -> str: ...

    def unsent(self) -> list[dict[str, Any]]: ...


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs (None: none known)."""
    return "qwen25" if template and BEGIN in template else None


def call_tag(tools: list[dict[str, Any]], parser: str) -> dict[str, Any]:
    """The structural tag that constrains an answer to tool calls to ``tools``, one or more
    and nothing else, as SGLang builds it for ``tool_choice`` ``required`` or a named function
    (``FunctionCallParser.get_legacy_structural_tag(at_least_one=True)``): a structure per tool
    framed as the detector of ``parser`` frames a call (``structure_info``:
    ``<tool_call>\\n{"name":"NAME", "arguments":`` ... ``}\\n</tool_call>``, Hermes without
    the newlines, Llama 3 ``<|python_tag|>{"name":"NAME", "arguments":`` ... ``}``, Mistral
    ``[TOOL_CALLS] [{"name":"NAME", "arguments":`` ... ``}]``), whose body follows the tool's
    ``parameters`` when it is ``strict``, else is any JSON."""
    begin, end, trigger = _FRAMES[parser]
    structures = []
    for tool in tools:
        fn = tool["function"]
        structures.append(
            {
                "begin": f'{begin}{json.dumps(fn["name"])}, "arguments":',
                "schema": (fn.get("parameters") or {}) if fn.get("strict") else {},
                "end": end,
            }
        )
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [trigger],
        "at_least_one": True,
    }


def forced_calls(
    tools: list[dict[str, Any]], parser: str | None, *, named: bool, parallel: Any
) -> dict[str, str]:
    """The ``sampling_params`` that constrain an answer to calls to ``tools`` (``named``: the
    one tool ``tool_choice`` names; ``parallel``: ``parallel_tool_calls``): the structural tag
    of ``parser``'s calls, or for a format without one (``pythonic``, or no tool-call format
    at all) SGLang's JSON schema of an array of ``{name, parameters}``
    (``get_json_schema_constraint``). ValueError, in
    SGLang's words, for tools whose ``$defs`` disagree."""
    if parser in _FRAMES:
        return {"structural_tag": json.dumps(call_tag(tools, parser))}
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters")
                or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if named else {"type": "object", "anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    if not named:
        defs: dict[str, Any] = {}
        for tool in tools:
            parameters = tool["function"].get("parameters") or {}
            for name, value in (parameters.get("$defs") or {}).items():
                if defs.setdefault(name, value) != value:
                    raise ValueError(
                        f"Tool definition '{name}' has multiple schemas, which is not supported."
                    )
        if defs:
            schema["$defs"] = defs
    return {"json_schema": json.dumps(schema)}


def answer_format(parser: str | None, forced: Mapping[str, str] | None) -> str | None:
    """The format an answer is read in: ``parser``'s, or where a forced call was constrained
    by JSON schema, that array (``json_array``)."""
    return "json_array" if forced and "json_schema" in forced else parser


class ToolCallParser:
    """Tool calls of one request (``tools``: the request's ``tools``, validated) in the format
    ``parser`` names (one of ``PARSERS``, or ``json_array``; None: Qwen 2.5's)."""

    def __init__(self, tools: Iterable[dict[str, Any]], parser: str | None = None) -> None:
        self.names = {t["function"]["name"] for t in tools}
        self.format = _FORMATS[parser](self.names) if parser in _FORMATS else None

    def has_tool_call(self, text: str) -> bool:
        if self.format is not None:
            return self.format.has_tool_call(text)
        return BEGIN in text

    def stream(self) -> CallStream:
        """A stream of this request's answer."""
        return self.format.stream() if self.format is not None else _TaggedStream(self)

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """``(content, calls)`` of a whole generated text."""
        if self.format is not None:
            return self.format.parse(text)
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
    ``arguments`` "", or for ``pythonic`` all of them) as soon as its name is whole; the next
    ones (``name`` None) add to its arguments, the JSON text ``json.dumps`` gives of them
    (``ensure_ascii=False``), so the pieces of a call add up to what the non-streamed answer
    holds (each format's module says where SGLang's stream differs). ``calls``: how many calls
    were named.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._stream = parser.stream()

    @property
    def calls(self) -> int:
        return self._stream.calls

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        return self._stream.feed(delta)

    def flush(self) -> str:
        """At the end: content held back (a call never finished is dropped and logged)."""
        return self._stream.flush()

    def unsent(self) -> list[dict[str, Any]]:
        """At the end, after ``flush``: the piece that closes the arguments of a call cut
        short, as SGLang sends it (``partial_json.CallPieces.unsent``)."""
        return self._stream.unsent()


class _TaggedStream:
    """The Qwen 2.5 / Hermes stream. As SGLang's
    ``BaseFormatDetector.parse_streaming_increment``: while the arguments are incomplete, what
    goes out is what the JSON of the arguments parsed so far (open strings, objects and lists
    closed) has in common with the last such JSON; the rest goes once ``</tool_call>`` arrives.
    A call whose name is not an offered tool is dropped (logged) before anything of it goes out.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.pending = ""  # text not passed on yet (inside a call: the call's text so far)
        self.in_call = False
        self.pieces = CallPieces()
        self.blocks = 0  # <tool_call> blocks begun: the current one's key
        self.dropped = False  # the current call names no offered tool

    @property
    def calls(self) -> int:  # calls begun (named) so far: the next one's index
        return self.pieces.count

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += delta
        content, pieces = "", []
        while True:
            if not self.in_call:
                at = self.pending.find(BEGIN)
                if at == -1:
                    keep = partial_tail(self.pending, BEGIN)
                    cut = len(self.pending) - keep
                    if not self.calls:  # text after a call is not content (SGLang drops it)
                        content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    break
                if not self.calls:
                    content += self.pending[:at].rstrip() if at else ""
                self.pending = self.pending[at + len(BEGIN) :]
                self.in_call = True
                self.dropped = False
                self.blocks += 1
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
        name = ""
        if not self.pieces.named(self.blocks):
            name = _partial_name(body)
            if name is None:
                return []
            if name not in self.parser.names:
                log.warning("tool_call_unknown_function", name=name[:100])
                self.dropped = True
                return []
        return self.pieces.partial(self.blocks, name, _partial_arguments(body))

    def _whole(self, body: str) -> list[dict[str, Any]]:
        """The rest of a call whose ``</tool_call>`` arrived (``body``: all its text)."""
        if self.dropped:
            return []
        call = self.parser.call(body)  # logs what it drops
        if call is None:
            return []
        return self.pieces.whole(self.blocks, call["name"], call["arguments"])

    def flush(self) -> str:
        """At the end: text held back that turned out not to start a call (a call never
        closed is dropped and logged)."""
        if self.in_call:
            log.warning("tool_call_incomplete", text=self.pending[:200])
            self.pending = ""
            return ""
        rest, self.pending = self.pending, ""
        return rest if not self.calls else ""

    def unsent(self) -> list[dict[str, Any]]:
        return self.pieces.unsent()


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
    text = closed_prefix(body[match.end() :])
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False)
