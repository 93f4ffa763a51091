"""Tool calls in Inkling's format (SGLang's ``--tool-call-parser inkling``): typed messages framed
by special tokens that decode literally, a call one message of its own::

    <|message_model|>get_weather<|content_invoke_tool_json|>{"name": "get_weather",
    "args": {"city": "Paris"}}<|end_message|>

A call is a JSON payload after ``<|content_invoke_tool_json|>`` up to the next
``<|end_message|>``, its ``name`` a string and its ``args`` an object; or, after
``<|content_invoke_tool_text|>``, a raw-text invocation whose body becomes the arguments
``{"text": BODY}`` of a call without a name. The header before a marker (``<|message_model|>``
and the text after it, up to the marker) is not content.

As SGLang 0.5.23 reads them (``function_call/inkling_detector.py``, ``InklingDetector``;
``tests/stages/test_engine_sglang_inkling.py`` holds this module to it on random answers where
SGLang imports):

- whole (``detect_and_parse``): without a marker, the answer is content as it is
  (``parse_non_stream``: nothing read); else every marker must frame a call (a JSON body that
  reads strictly, ``NaN`` and ``Infinity`` refused, an object with a string ``name`` and an
  object ``args``, closed by ``<|end_message|>``), and then the content is the text around the
  calls, each one's header taken out, the framing tokens dropped; where one does not, one call
  is recovered from the last JSON marker, read up to the next ``<|end_message|>`` or the end of
  the answer (its framing tokens dropped, ``NaN`` taken, a ``name`` that is not empty needed),
  the content then empty; where that fails too, the content is the answer less its framing
  tokens, without calls;
- calls to tools not offered are kept (logged), as that detector surfaces them; each call's
  ``tool_index`` is its place among the calls (on ``/parse_function_call`` too); a raw-text
  call's name is empty;
- streamed (``parse_streaming_increment``): text before a marker goes out as it comes, less a
  tail that may be a header forming (a last ``<|message_model|>`` with no framing token after
  it) or a framing token begun; a call goes out whole, name and arguments in one piece, once
  its ``<|end_message|>`` comes (a raw-text call's piece has no name, as SGLang's chat route
  sends it: ``if call_item.name``); a body that does not read as a call makes the stream
  recover one call from the last JSON marker of what it holds (dropping the rest of that
  step's content and calls, as the detector does), then pass the rest of the answer through as
  content, less its framing tokens. At the end what was held back is dropped (the detector has
  no ``finish``), so a stream may end with less content than the whole answer has;
- a JSON body nested past Python's recursion limit makes the detector raise: whole, the answer
  is then its text without calls (what SGLang's chat route answers); streamed, that step's
  content and calls are dropped and the rest of the answer passed through as content, where
  SGLang's stream raises;
- framing tokens are taken out of content one kind after another; a token spelled around
  another (``<|end<|content_text|>_message|>``) is left or taken as the order of SGLang's set
  of them has it, which Python's string hashing decides: such text may differ.

``tool_choice`` ``required`` or named, and ``auto`` with a ``strict`` tool: SGLang's legacy
structural tag of the detector's ``structure_info`` (``call_tag``): each tool's call begins
``<|message_model|>NAME<|content_invoke_tool_json|>{"name":"NAME","args":`` and ends
``}<|end_message|>``, its trigger the header, a strict tool's arguments held to its
parameters. **Not served**: SGLang's ``auto`` tag without a strict tool
(``get_auto_tool_call_structural_tag``), which holds every payload after the
``<|content_invoke_tool_json|>`` token to ``{"name": string, "args": object}`` from the first
token on (``InklingAnswerFrame.owns_turn``), is a tag of token ids (``token_triggered_tags``)
that this engine's grammar compiler refuses (``stages.engine.structural_format``); such a
request is not constrained here.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from stages.engine.partial_json import ListedCalls

__all__ = [
    "CONTROL",
    "END_MESSAGE",
    "INVOKE_JSON",
    "INVOKE_TEXT",
    "MESSAGE_MODEL",
    "InklingCalls",
    "call_tag",
    "strip_control",
]

log = structlog.get_logger("stages.engine.tool_calls")

MESSAGE_MODEL = "<|message_model|>"
INVOKE_JSON = "<|content_invoke_tool_json|>"
INVOKE_TEXT = "<|content_invoke_tool_text|>"
END_MESSAGE = "<|end_message|>"
# the framing tokens both readers key on (inkling_tokenizer.INKLING_CONTROL_TOKENS): the
# tokenizer's special tokens and two more the model may write
CONTROL = frozenset({
    "<|endoftext|>", "<|message_user|>", MESSAGE_MODEL, "<|message_system|>",
    "<|message_tool|>", "<|content_text|>", "<|content_image|>",
    "<|content_model_end_sampling|>", "<|content_thinking|>", END_MESSAGE,
    "<|content_audio_input|>", "<|content_tool_error|>", "<|content_xml|>", "<|audio_end|>",
    INVOKE_JSON, INVOKE_TEXT, "<|content_invoke_tool|>", "<|model_trigger_generation|>",
})  # fmt: skip

Pieces = list[dict[str, Any]]


def strip_control(text: str) -> str:
    """``text`` without its framing tokens (``_clean_normal_text``)."""
    for token in CONTROL:
        text = text.replace(token, "")
    return text


def _no_constant(value: str) -> Any:
    raise ValueError(f"{value} is not a valid JSON number")


def _marker(text: str, start: int) -> tuple[int, str]:
    """The first call marker at or after ``start`` and which (-1, "": none)."""
    found = [(at, m) for m in (INVOKE_JSON, INVOKE_TEXT) if (at := text.find(m, start)) != -1]
    return min(found) if found else (-1, "")


def _header_at(text: str) -> int:
    """Where a header that may still be forming begins: a last ``<|message_model|>`` with no
    framing token after it (-1: none; ``_pending_tool_header_start``)."""
    at = text.rfind(MESSAGE_MODEL)
    if at == -1:
        return -1
    rest = text[at + len(MESSAGE_MODEL) :]
    return -1 if any(token in rest for token in CONTROL) else at


def _unheaded(text: str) -> str:
    """``text`` less a header at its end (``_split_trailing_tool_header``)."""
    at = _header_at(text)
    return text if at == -1 else text[:at]


def _begun(text: str) -> int:
    """How much of the end of ``text`` may begin a framing token: for each token, the shortest
    tail that begins it, the longest of those (``_ends_with_partial_token``)."""
    most = 0
    for token in CONTROL:
        for n in range(1, min(len(text), len(token) - 1) + 1):
            if token.startswith(text[-n:]):
                most = max(most, n)
                break
    return most


def _call(payload: Any, index: int) -> dict[str, Any] | None:
    """A payload as a call (``_tool_call_item``): None unless its ``name`` is a string and its
    ``args`` an object."""
    if not isinstance(payload, Mapping):
        return None
    name, args = payload.get("name"), payload.get("args")
    if not isinstance(name, str) or not isinstance(args, Mapping):
        log.warning("tool_call_unparsed", format="inkling", payload=str(payload)[:200])
        return None
    return {"index": index, "name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _json_call(body: str, index: int) -> dict[str, Any] | None:
    """A JSON body read strictly (``_canonical_json_call``)."""
    try:
        payload = json.loads(body.strip(), parse_constant=_no_constant)
    except ValueError:  # (not RecursionError: SGLang's reading raises on it)
        return None
    return _call(payload, index)


def _text_call(body: str, index: int) -> dict[str, Any]:
    """A raw-text invocation: no name, its body the ``text`` argument (ASCII-escaped, as
    ``json.dumps`` writes it by default)."""
    return {"index": index, "name": "", "arguments": json.dumps({"text": strip_control(body)})}


def _recovered(text: str, index: int) -> dict[str, Any] | None:
    """One call from the last JSON marker, read to the next end or the end of ``text``, lax
    (``NaN`` taken), its name not empty (``_recover_last_json_call``)."""
    at = text.rfind(INVOKE_JSON)
    if at == -1:
        return None
    start = at + len(INVOKE_JSON)
    end = text.find(END_MESSAGE, start)
    body = strip_control(text[start:] if end == -1 else text[start:end]).strip()
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, Mapping) or not payload.get("name"):
        return None
    return _call(payload, index)


def _framed(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """Every call of ``text`` where every marker frames one (``_parse_canonical``), else
    None."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    at = 0
    while at < len(text):
        found, marker = _marker(text, at)
        if found == -1:
            content.append(text[at:])
            break
        content.append(_unheaded(text[at:found]))
        start = found + len(marker)
        end = text.find(END_MESSAGE, start)
        if end == -1:
            return None
        body = text[start:end]
        call = (
            _json_call(body, len(calls)) if marker == INVOKE_JSON else _text_call(body, len(calls))
        )
        if call is None:
            return None
        calls.append(call)
        at = end + len(END_MESSAGE)
    return strip_control("".join(content)), calls


class InklingCalls(ListedCalls):
    """The calls of answers to one request (its tools only name them in the log)."""

    def __init__(self, tools: Iterable[dict[str, Any]]) -> None:
        self.names = {n for t in tools if (n := (t.get("function") or {}).get("name"))}

    def has_tool_call(self, text: str) -> bool:
        return INVOKE_JSON in text or INVOKE_TEXT in text

    def listed(self, text: str) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        if not self.has_tool_call(text):  # parse_non_stream: nothing read, the text
            return text, []
        try:
            read = _framed(text)
            if read is None:
                one = _recovered(text, 0)
                read = ("", [one]) if one is not None else (strip_control(text), [])
        except RecursionError as exc:  # out of the detector: the chat route's except
            log.warning("tool_call_unparsed", format="inkling", error=str(exc)[:200])
            return text, []
        content, calls = read
        for call in calls:
            self._check(call["name"])
        return content, [
            (c["index"], {"name": c["name"], "arguments": c["arguments"]}) for c in calls
        ]

    def _check(self, name: str) -> None:
        if name and name not in self.names:  # surfaced all the same, as SGLang's
            log.warning("tool_call_unknown_function", name=name[:100])

    def stream(self) -> _InklingStream:
        return _InklingStream(self)


class _InklingStream:
    """One answer's calls as they come (``parse_streaming_increment``)."""

    def __init__(self, reader: InklingCalls) -> None:
        self.reader = reader
        self.buffer = ""
        self.calls = 0  # calls sent (the next one's index)
        self.passing = False  # a call failed to frame: the rest is content

    def feed(self, delta: str) -> tuple[str, Pieces]:
        self.buffer += delta
        if self.passing:
            out, self.buffer = strip_control(self.buffer), ""
            return out, []
        try:
            return self._read()
        except RecursionError as exc:  # SGLang's stream raises here
            log.warning("tool_call_unparsed", format="inkling", error=str(exc)[:200])
            self.passing, self.buffer = True, ""
            return "", []

    def _read(self) -> tuple[str, Pieces]:
        content: list[str] = []
        pieces: Pieces = []
        while self.buffer:
            found, marker = _marker(self.buffer, 0)
            if found == -1:
                cut = _header_at(self.buffer)
                if cut == -1:
                    cut = len(self.buffer) - _begun(self.buffer)
                content.append(strip_control(self.buffer[:cut]))
                self.buffer = self.buffer[cut:]
                break
            before = _unheaded(self.buffer[:found])
            start = found + len(marker)
            end = self.buffer.find(END_MESSAGE, start)
            if end == -1:  # the call's region not whole: its header and body wait
                content.append(strip_control(before))
                self.buffer = self.buffer[found:]
                break
            body = self.buffer[start:end]
            if marker == INVOKE_JSON:
                call = _json_call(body, self.calls)
                if call is None:
                    return self._recover()
            else:
                call = _text_call(body, self.calls)
            content.append(strip_control(before))
            pieces.append(self._piece(call))
            self.calls += 1
            self.buffer = self.buffer[end + len(END_MESSAGE) :]
        return "".join(content), pieces

    def _recover(self) -> tuple[str, Pieces]:
        """A call failed to frame (``_stream_recover_or_fallback``): one call recovered from
        what is held, else that as content; the rest of the answer content."""
        self.passing = True
        held, self.buffer = self.buffer, ""
        call = _recovered(held, self.calls)
        if call is None:
            return strip_control(held), []
        self.calls += 1
        return "", [self._piece(call)]

    def _piece(self, call: dict[str, Any]) -> dict[str, Any]:
        self.reader._check(call["name"])
        # a raw-text call has no name: SGLang's chat route sends it as arguments alone
        return {**call, "name": call["name"] or None}

    def flush(self) -> str:
        """At the end: what was held back is dropped (the detector has no ``finish``)."""
        self.buffer = ""
        return ""

    def unsent(self) -> Pieces:
        return []


def call_tag(tools: list[dict[str, Any]], *, at_least_one: bool = True) -> dict[str, Any]:
    """SGLang's legacy structural tag of calls to ``tools``
    (``FunctionCallParser.get_legacy_structural_tag`` with this detector's ``structure_info``):
    each tool's call framed as a message of its own, its header the trigger, a ``strict``
    tool's arguments held to its parameters (else any JSON); ``at_least_one``: calls only."""
    structures, triggers = [], []
    for tool in tools:
        fn = tool["function"]
        name = fn["name"]
        trigger = f"{MESSAGE_MODEL}{name}{INVOKE_JSON}"
        structures.append(
            {
                "begin": f'{trigger}{{"name":"{name}","args":',
                "schema": (fn.get("parameters") or {}) if fn.get("strict") else {},
                "end": "}" + END_MESSAGE,
            }
        )
        if trigger not in triggers:
            triggers.append(trigger)
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": triggers,
        "at_least_one": at_least_one,
    }
