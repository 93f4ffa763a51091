"""Tool calls in IQuest Q1's format (SGLang's ``--tool-call-parser iquest_q1``): GLM-4.7's
pairs between IQuest's own tags::

    <iquest_tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></iquest_tool_call>

As SGLang 0.5.23 reads them (``function_call/iquest_q1_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``listed``): each ``<iquest_tool_call>`` up to the next ``</iquest_tool_call>`` (one
  never closed ends the reading) is a call if its name (the text before its first
  ``<arg_key>``, stripped) is not empty and nothing but its pairs follows it, each with a key;
  its values read as GLM-4.7's (``glm47_calls``), a string parameter (typed knowing the
  other values) keeping its text as written. A block that is no call stays in the content, as
  it is; a call is taken out of it, and dropped (logged) if its tool was not offered. The
  content is the rest, as it is (not stripped). Calls are numbered in order (``tool_index``).
- streamed (``stream``): content as it comes (a tail that may begin the tag waits), each
  call whole at its end tag, a block that is no call content then; at the end, a call never
  closed is content, its tag included: what SGLang's stream sends, which is its whole answer.
- ``tool_choice`` naming a tool: the answer is constrained to that tool's ``parameters`` and
  read as its arguments (``NamedArguments``: SGLang's ``IQuestQ1JsonToolParser``); ``required``:
  SGLang's JSON array of calls, as for a format without a structural tag.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog

from stages.engine.glm47_calls import _FAILS, _PAIR, Glm47Calls, _one_type, _Typing
from stages.engine.marked_stream import ReadBlocks
from stages.engine.partial_json import ListedCalls, PieceStream
from stages.engine.tool_formats import _strict_loads

__all__ = ["IQuestQ1Calls", "NamedArguments"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END, KEY = "<iquest_tool_call>", "</iquest_tool_call>", "<arg_key>"

Pieces = list[dict[str, Any]]


class IQuestQ1Calls(ListedCalls):
    """The calls of answers to one request (``tools``: its tools, their parameters)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.calls = Glm47Calls(tools)
        self.functions = self.calls.functions

    def has_tool_call(self, text: str) -> bool:
        return BEGIN in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        calls: list[tuple[int, dict[str, str]]] = []
        content, kept, at = [], 0, 0
        try:
            while (start := text.find(BEGIN, at)) != -1:
                end = text.find(END, start + len(BEGIN))
                if end == -1:
                    break
                at = end + len(END)
                call = self.read(text[start + len(BEGIN) : end])
                if call is False:
                    continue  # no call: the block stays in the content
                content.append(text[kept:start])
                kept = at
                if call is not None:
                    calls.append((len(calls), call))
        except _FAILS as exc:  # raised out of the detector: serving_chat's except Exception
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return text, []
        return "".join(content) + text[kept:], calls

    def read(self, body: str) -> dict[str, str] | bool | None:
        """One block's call (``_parse_body``, then ``parse_base_json``): ``{name, arguments}``,
        None (logged) for a tool not offered, False for a block that is no call."""
        cut = body.find(KEY)
        name = (body[:cut] if cut != -1 else body).strip()
        rest = body[cut:] if cut != -1 else ""
        pairs = _PAIR.findall(rest)
        if not name or _PAIR.sub("", rest).strip() or any(not k.strip() for k, _ in pairs):
            return False
        typing = self.functions.get(name) or _Typing([None])
        arguments = typing.arguments(pairs)
        for key, value in pairs:  # a string keeps its text as written
            if _one_type(typing.allowed(key.strip(), arguments)) == "string":
                arguments[key.strip()] = value
        return self.calls.offered(name, arguments)

    def stream(self) -> ReadBlocks:
        return ReadBlocks(self, BEGIN, END)


class NamedArguments:
    """A forced call to the one tool ``tool_choice`` names, its answer constrained to that
    tool's ``parameters``: the answer is the call's arguments as written, if it is a JSON
    object (``IQuestQ1JsonToolParser`` with a tool name); streamed, the name, then the text as
    it comes."""

    def __init__(self, names: set[str]) -> None:
        (self.name,) = names

    def has_tool_call(self, text: str) -> bool:
        return True  # the answer is read whatever it is, as there

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        try:
            value = _strict_loads(text)
        except ValueError as exc:
            value, error = None, str(exc)
        else:
            error = "Named tool arguments must be a JSON object."
        if not isinstance(value, dict):
            log.warning("tool_call_unparsed", error=error, text=text[:200])
            return text, []
        return "", [{"name": self.name, "arguments": text}]

    def stream(self) -> _NamedStream:
        return _NamedStream(self.name)


class _NamedStream(PieceStream):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, delta: str) -> tuple[str, Pieces]:
        if not delta:
            return "", []
        self.text += delta
        named = self.pieces.partial(0, self.name, None)  # the name, the first time
        return "", [*named, {"index": 0, "name": None, "arguments": delta}]

    def flush(self) -> str:
        return ""
