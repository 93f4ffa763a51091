"""Tool calls in generated text: the Qwen 2.5 / Hermes format, whole or as it streams.

What SGLang's ``Qwen25Detector`` (``--tool-call-parser qwen25``; ``hermes`` is the same format)
reads: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>``
and ``</tool_call>`` (newlines around the JSON), several calls one after another. The text before
the first call is the message's content (stripped); a call naming a tool the request did not
offer, or whose JSON does not parse, is dropped and logged, as there. Each call becomes
``{"name", "arguments"}`` with the arguments as a JSON string (``ensure_ascii=False``).

Streamed (``StreamingToolCalls``): text is passed on as it comes until a ``<tool_call>`` begins
(a tail that could be the start of one is held back, so only whitespace before a call may
have gone out before it began); a call is passed on whole once its
``</tool_call>`` arrives, as one ``tool_calls`` delta with all its arguments (SGLang sends the
name first and then the arguments in pieces; clients that add the pieces up get the same call).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import structlog

__all__ = ["PARSERS", "StreamingToolCalls", "ToolCallParser", "parser_for_template"]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN, END = "<tool_call>", "</tool_call>"
# SGLang's --tool-call-parser names this format goes by
PARSERS = ("qwen25", "qwen", "hermes")


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs (None: none known)."""
    return "qwen25" if template and BEGIN in template else None


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
    """Feeds a sample's text deltas; hands back content to send now and finished calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.pending = ""  # text not passed on yet
        self.in_call = False
        self.calls = 0  # calls passed on so far
        self.content_sent = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, str]]]:
        self.pending += delta
        content, calls = "", []
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
            end = self.pending.find(END)
            if end == -1:
                break
            call = self.parser.call(self.pending[:end])
            if call is not None:
                calls.append(call)
                self.calls += 1
            self.pending = self.pending[end + len(END) :]
            self.in_call = False
        return content, calls

    def flush(self) -> str:
        """At the end: text held back that turned out not to start a call (a call never
        closed is dropped and logged)."""
        if self.in_call:
            log.warning("tool_call_incomplete", text=self.pending[:200])
            self.pending = ""
            return ""
        rest, self.pending = self.pending, ""
        return rest if not self.calls else ""


def _partial_tail(text: str, token: str) -> int:
    """How many characters at the end of ``text`` could begin ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
