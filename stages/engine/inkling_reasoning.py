"""Reasoning in Inkling's answers (SGLang's ``--reasoning-parser inkling``): a run of typed
messages, each opened by ``<|message_model|>`` and a content token, closed by an end token::

    <|message_model|><|content_thinking|>reasoning<|end_message|>
    <|message_model|><|content_text|>the answer<|end_message|><|content_model_end_sampling|>

A ``<|content_thinking|>`` message is reasoning, a ``<|content_text|>`` one content; a tool call
(``<|content_invoke_tool_json|>`` or ``<|content_invoke_tool_text|>``, ``stages.engine.
inkling_calls``) is content whole, its header, marker, body and end token kept for the
tool-call reader. Whether a request reasons does not change the reading, nor does
``force_nonempty_content``: the detector takes neither.

As SGLang 0.5.23 reads it (``parser/reasoning_parser.py``, ``InklingDetector``;
``tests/stages/test_engine_sglang_inkling.py`` holds this module to it on random answers where
SGLang imports), token by framing token (``inkling_calls.CONTROL``), the text between them going
where the message open then sends it:

- ``<|message_model|>`` outside a message opens a header (its text dropped unless a call marker
  follows); inside one it is the message's text;
- a call marker, anywhere, opens a call message (the header before it, marker and all, into
  the content); in a call message every framing token is its text, an end token closing it;
- ``<|content_thinking|>`` / ``<|content_text|>`` open reasoning / content, an end token
  (``<|end_message|>``, ``<|content_model_end_sampling|>``) closes what is open; any other
  framing token is dropped; text outside any message is content;
- streamed (``feed``, ``finish``): a tail that may begin a framing token is held back (the
  longest such); at the end what is held back is dropped, as the detector drops it; with
  ``stream_reasoning`` false, a message's reasoning goes out when something closes it, or at the
  end.

The reasoning's end, for its tokens counted and a grammar released after it, is the token id
SGLang names for it (``get_think_end_token_ids``: ``<|end_message|>``'s 200010), not the
served tokenizer's encoding of the tag (``ThinkFormat.end_ids``).

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import re

from stages.engine.inkling_calls import CONTROL, INVOKE_JSON, INVOKE_TEXT, MESSAGE_MODEL

__all__ = ["END_ID", "InklingReasoning"]

END_ID = 200010  # <|end_message|> in Inkling's vocabulary (INKLING_SPECIAL_TOKEN_IDS)
_KINDS = {"<|content_thinking|>": "reasoning", "<|content_text|>": "content"}
_ENDS = frozenset({"<|end_message|>", "<|content_model_end_sampling|>"})
_TOKEN = re.compile("|".join(re.escape(t) for t in sorted(CONTROL)))
_LONGEST = max(map(len, CONTROL))


def _begun(text: str) -> int:
    """The longest tail of ``text`` that begins a framing token (``_partial_control_length``)."""
    for n in range(min(len(text), _LONGEST - 1), 0, -1):
        tail = text[-n:]
        if any(len(tail) < len(t) and t.startswith(tail) for t in CONTROL):
            return n
    return 0


class InklingReasoning:
    """One answer's reasoning and content."""

    def __init__(self, *, stream_reasoning: bool = True) -> None:
        self.stream_reasoning = stream_reasoning
        self.held = ""  # a framing token begun at the end of what came
        self.kind: str | None = None  # the message open: header, reasoning, content, tool
        self.header = ""
        self.pending = ""  # stream_reasoning false: reasoning not yet sent

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer (``detect_and_parse``)."""
        whole = InklingReasoning(stream_reasoning=self.stream_reasoning)
        reasoning, content = whole._read(text)
        if whole.kind == "reasoning":
            reasoning += whole.pending
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the text added to a stream."""
        text = self.held + delta
        cut = len(text) - _begun(text)
        self.held = text[cut:]
        return self._read(text[:cut])

    def finish(self) -> tuple[str, str]:
        """What a stream still holds at its end: reasoning held back, not the tail."""
        reasoning = self.pending if self.kind == "reasoning" else ""
        self.held, self.pending, self.header, self.kind = "", "", "", None
        return reasoning, ""

    def _read(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []

        def send(part: str) -> None:
            if self.kind == "reasoning":
                if self.stream_reasoning:
                    reasoning.append(part)
                else:
                    self.pending += part
            elif self.kind == "header":
                self.header += part
            elif part or self.kind is not None:  # content, a call's text, text outside
                content.append(part)

        def close_reasoning() -> None:
            if self.kind == "reasoning" and not self.stream_reasoning:
                reasoning.append(self.pending)
                self.pending = ""

        at = 0
        for found in _TOKEN.finditer(text):
            send(text[at : found.start()])
            token, at = found.group(0), found.end()
            if token == MESSAGE_MODEL:
                if self.kind in (None, "header"):  # a header opens
                    self.header, self.kind = "", "header"
                else:  # inside a message: its text
                    send(token)
            elif token in (INVOKE_JSON, INVOKE_TEXT):  # a call, framed for the tool-call reader
                close_reasoning()
                if self.kind == "header":
                    content += [MESSAGE_MODEL, self.header, token]
                    self.header = ""
                else:
                    content.append(token)
                self.kind = "tool"
            elif self.kind == "tool":
                content.append(token)
                if token in _ENDS:
                    self.kind = None
            elif token in _KINDS:
                close_reasoning()
                self.header, self.kind = "", _KINDS[token]
            elif token in _ENDS:
                close_reasoning()
                self.header, self.kind = "", None
        send(text[at:])
        return "".join(reasoning), "".join(content)
