"""Tool calls in Cohere Command's format (SGLang's ``--tool-call-parser cohere_command4``)::

    <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}]<|END_ACTION|>

As SGLang 0.5.23 reads them (``function_call/cohere_command4_detector.py``;
``tests/stages/test_engine_sglang_detectors.py`` holds this module to it on random texts where
SGLang imports):

- whole (``parse``): the content is the text before the first ``<|START_ACTION|>``, as it is
  (what follows the block is dropped); the block's body (up to ``<|END_ACTION|>``, or the end)
  is a JSON array of calls, or one call object, each ``{tool_name or name, parameters}``
  (``tool_call_id`` left: the response names its calls itself); calls to tools not offered
  are dropped (logged), items that are not objects skipped. A body that is not JSON: no calls,
  the content still the text before it.
- a body cut short (no ``<|END_ACTION|>``, or JSON not finished): SGLang reads what
  ``partial_json_parser`` makes of it; here the calls whose JSON is complete so far, what is
  open closed (``partial_json.closed_prefix``), which is the same for an answer cut between
  calls and may keep less of a call cut inside a number or a word.
- streamed (``stream``): content before the block as it comes (a tail that may begin the tag
  waits), the calls whole at ``<|END_ACTION|>``, then nothing: the whole answer's. (SGLang's
  stream sends the text after the block as content and reads a second block too; its whole
  answer does neither.) A block never closed gives no calls, as SGLang's stream gives none.
- ``tool_choice`` ``required`` or named: SGLang's JSON array of calls (the detector has no
  structural tag).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from stages.engine.partial_json import PieceStream, closed_prefix, partial_tail
from stages.engine.tool_formats import MarkedCalls, _strict_loads, _Unreadable

__all__ = ["CohereCalls"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<|START_ACTION|>", "<|END_ACTION|>"

Pieces = list[dict[str, Any]]


class CohereCalls(MarkedCalls):
    """The calls of answers to one request (``names``: the tools offered)."""

    marker = BEGIN

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        at = text.find(BEGIN)
        if at == -1:
            return text, []
        body = text[at + len(BEGIN) :]
        end = body.find(END)
        try:
            return text[:at], self.calls(body[:end] if end != -1 else body)
        except _Unreadable as exc:  # raised out of the detector: serving_chat's except Exception
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return text, []

    def calls(self, body: str) -> list[dict[str, str]]:
        """The calls of a block's body (``_normalize_calls``, ``parse_base_json``)."""
        try:
            value = _strict_loads(body)
        except ValueError:  # SGLang's partial_json_parser then, which takes NaN too
            closed = closed_prefix(body.lstrip())
            try:
                value = json.loads(closed) if closed is not None else None
            except ValueError:
                value = None
            if value is None:
                log.warning("tool_call_unparsed", error="the block is not JSON", text=body[:200])
                return []
        items = [value] if isinstance(value, dict) else value if isinstance(value, list) else []
        out = []
        for item in items:
            if not isinstance(item, dict):
                continue
            name = item.get("name", item.get("tool_name"))
            try:
                offered = bool(name) and name in self.names
            except TypeError as exc:  # a name that is a list or an object
                raise _Unreadable(f"a call's name is not a string: {exc}") from exc
            if not offered:
                log.warning("tool_call_unknown_function", name=str(name)[:100])
                continue
            arguments = item.get("parameters") or item.get("arguments", {})
            out.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
        return out

    def stream(self) -> _CohereStream:
        return _CohereStream(self)


class _CohereStream(PieceStream):
    def __init__(self, reader: CohereCalls) -> None:
        super().__init__()
        self.reader = reader
        self.sent = 0  # content sent
        self.done = False  # the block read

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.text += delta
        if self.done:
            return "", []
        at = self.text.find(BEGIN)
        upto = len(self.text) - partial_tail(self.text, BEGIN) if at == -1 else at
        content, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        if at == -1:
            return content, []
        end = self.text.find(END, at + len(BEGIN))
        if end == -1:
            return content, []
        self.done = True
        try:
            calls = self.reader.calls(self.text[at + len(BEGIN) : end])
        except _Unreadable as exc:
            log.warning("tool_call_unparsed", error=str(exc)[:200])
            return content, []
        pieces = []
        for i, call in enumerate(calls):
            pieces += self.pieces.whole(i, call["name"], call["arguments"])
        return content, pieces

    def flush(self) -> str:
        if BEGIN in self.text:
            if not self.done:
                log.warning("tool_call_incomplete", text=self.text[-200:])
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
