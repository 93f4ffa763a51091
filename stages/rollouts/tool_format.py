"""How tools are offered to the model, how its calls are read and how answers go back in.

Two formats (``rollout.tool_format``; ``auto`` picks ``chat_template`` when the tokenizer has a
chat template that uses ``tools``, else ``tags``):

``tags``, Inflight's simple format for tiny and base models. The episode starts from the
feeder's ``input_ids`` unchanged (the tools are not described in it). The model calls a tool by
writing ``<tool_call>NAME(ARGS)</tool_call>``, where ARGS is empty, a JSON object (the keyword
arguments), or, for a tool with exactly one parameter, that argument's text (whitespace around
it dropped, a JSON string literal unquoted, then converted to the parameter's type: integer,
number, boolean, string, else parsed as JSON). The Hermes form
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` is read too. One call per turn:
the turn ends at the first ``</tool_call>`` (passed in ``stop_token_ids`` when it is one token of
the vocabulary; otherwise the model generates on and its tokens after the one that completes
``</tool_call>`` are dropped). The answer is inserted as ``<tool_response>TEXT</tool_response>``
(tokenized without special tokens) and the model goes on. A finished turn with ``<tool_call>``
but no ``</tool_call>``, or ``</tool_call>`` with no ``<tool_call>`` before it, is a malformed
call (answered, the episode goes on). Example, with a calculator::

    prompt   123*456=
    sampled  <tool_call>calc(123*456)</tool_call>
    inserted <tool_response>56088</tool_response>
    sampled  56088<eos>

``chat_template``, for chat models (Hermes / Qwen style). The episode renders its own context:
``tokenizer.apply_chat_template(messages, tools=[schemas], add_generation_prompt=True)``, from
the prompt's ``meta["messages"]`` (the feeder keeps the conversation there for every prompt it
rendered with a chat template; or ``meta["prompt"]``) when it holds chat messages, else
``meta["text"]`` as one user message;
a text some chat template already rendered is refused (there is nothing to render from). Calls
are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the assistant turn
(several allowed, run at once); the turn ends at the model's end-of-turn token or EOS (both in
``stop_token_ids``). The answers are inserted as the template renders them: the conversation
with the assistant turn and one ``tool`` message per call (``add_generation_prompt=True``) must
extend the conversation without them, and what the context does not have yet is inserted. A
template that rewrites earlier turns (not append-only) fails with an error that says to use
``tool_format: tags``; the format checks this once when it is made.

Not here: running the tools (``tools.py``), the episode loop and its budgets
(``tool_rollout.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from stages.rollouts.trajectory import Generation

if TYPE_CHECKING:
    from stages.rollouts.tools import ToolSpec

__all__ = [
    "TOOL_CALL",
    "TOOL_CALL_END",
    "TOOL_RESPONSE",
    "TOOL_RESPONSE_END",
    "ChatTemplateFormat",
    "TagsFormat",
    "ToolCall",
    "ToolEpisode",
    "ToolFormat",
    "ToolFormatError",
    "Turn",
    "make_tool_format",
    "parse_json_call",
    "parse_tags_call",
    "template_takes_tools",
]

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
_NAME_ARGS = re.compile(r"([A-Za-z_][\w.\-]*)\s*\((.*)\)", re.DOTALL)
_BLOCK = re.compile(re.escape(TOOL_CALL) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_TAGS_HINT = "write <tool_call>NAME(ARGS)</tool_call>"
_JSON_HINT = 'write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'


class ToolFormatError(ValueError):
    """A format that cannot be used with this tokenizer or prompt (the message says the fix)."""


@dataclass
class ToolCall:
    """One call as the model wrote it: ``arguments`` (a JSON object), or ``raw`` (the text of a
    one-parameter ``NAME(TEXT)`` call), or ``error`` (why it could not be read)."""

    name: str
    arguments: Any = None
    raw: str | None = None
    error: str | None = None


@dataclass
class Turn:
    """What a model turn gave: the tokens the trajectory keeps, and the calls in them."""

    generation: Generation
    calls: list[ToolCall] = field(default_factory=list)


class ToolEpisode(Protocol):
    """One episode's side of a format (a chat format follows the conversation)."""

    prompt_ids: list[int]

    def sampling(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """Sampling overrides for every turn (``stop_token_ids``: ``base``'s and the format's)."""
        ...

    def read(self, generation: Generation) -> Turn: ...

    def answer_ids(self, calls: Sequence[ToolCall], texts: Sequence[str]) -> list[int]:
        """The tokens to insert after the last turn: the answers, as the format writes them."""
        ...


class ToolFormat(Protocol):
    name: str

    def episode(self, prompt: Mapping[str, Any]) -> ToolEpisode: ...


def make_tool_format(kind: str, tokenizer: Any, specs: Sequence[ToolSpec]) -> ToolFormat:
    """The format ``kind`` (``auto``, ``chat_template``, ``tags``) for this tokenizer."""
    if tokenizer is None:
        raise ToolFormatError("tools read and write text: set rollout.tokenizer")
    if kind == "auto":
        kind = "chat_template" if template_takes_tools(tokenizer) else "tags"
    if kind == "tags":
        return TagsFormat(tokenizer, specs)
    if kind == "chat_template":
        return ChatTemplateFormat(tokenizer, specs)
    raise ToolFormatError(f"unknown tool_format {kind!r}: one of auto, chat_template, tags")


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer has a chat template that uses ``tools``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        return any(isinstance(t, str) and "tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


# ------------------------------------------------------------------------------------- parsing
def parse_json_call(body: str, hint: str = _JSON_HINT) -> ToolCall:
    """A Hermes call ``{"name": ..., "arguments": {...}}`` (``arguments`` may be a JSON string,
    ``parameters`` is read as ``arguments``)."""
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return ToolCall("", error=f"not valid JSON ({exc}); {hint}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f'a call needs a string "name"; {hint}')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # left a string: reported as bad arguments
    return ToolCall(obj["name"], arguments=arguments if arguments is not None else {})


def parse_tags_call(body: str) -> ToolCall:
    """The text between ``<tool_call>`` and ``</tool_call>``: ``NAME(ARGS)`` or Hermes JSON."""
    body = body.strip()
    if body.startswith("{"):
        return parse_json_call(body, _TAGS_HINT)
    match = _NAME_ARGS.fullmatch(body)
    if match is None:
        return ToolCall("", error=f"cannot read {_short(body)}; {_TAGS_HINT}")
    name, args = match.group(1), match.group(2).strip()
    if not args:
        return ToolCall(name, arguments={})
    if args.startswith("{"):
        try:
            value = json.loads(args)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return ToolCall(name, arguments=value)
    return ToolCall(name, raw=args)


def _short(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")


def _with_stops(base: Mapping[str, Any], stops: Sequence[int]) -> dict[str, Any]:
    if not stops:
        return {}
    return {"stop_token_ids": sorted({*(base.get("stop_token_ids") or ()), *stops})}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------------------------- tags
class TagsFormat:
    """``<tool_call>NAME(ARGS)</tool_call>`` / ``<tool_response>TEXT</tool_response>``."""

    name = "tags"

    def __init__(self, tokenizer: Any, specs: Sequence[ToolSpec]) -> None:
        self.tokenizer = tokenizer
        end = _encode(tokenizer, TOOL_CALL_END)
        self.stop_id: int | None = end[0] if len(end) == 1 else None

    def episode(self, prompt: Mapping[str, Any]) -> _TagsEpisode:
        return _TagsEpisode(self, [int(i) for i in prompt["input_ids"]])

    def call_end(self, ids: Sequence[int]) -> int | None:
        """How many of ``ids`` to keep: up to the token completing the first ``</tool_call>``."""
        if self.stop_id is not None and self.stop_id in ids:
            return list(ids).index(self.stop_id) + 1
        if TOOL_CALL_END not in _decode(self.tokenizer, ids):
            return None
        lo, hi = 1, len(ids)  # the shortest prefix whose text has it
        while lo < hi:
            mid = (lo + hi) // 2
            if TOOL_CALL_END in _decode(self.tokenizer, ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo


class _TagsEpisode:
    def __init__(self, fmt: TagsFormat, prompt_ids: list[int]) -> None:
        self.fmt, self.prompt_ids = fmt, prompt_ids

    def sampling(self, base: Mapping[str, Any]) -> dict[str, Any]:
        return _with_stops(base, [] if self.fmt.stop_id is None else [self.fmt.stop_id])

    def read(self, generation: Generation) -> Turn:
        ids = generation.token_ids.tolist()
        end = self.fmt.call_end(ids)
        if end is None:
            text = _decode(self.fmt.tokenizer, ids)
            if generation.finish_reason == "stop" and TOOL_CALL in text:
                error = f"{TOOL_CALL} without {TOOL_CALL_END}; {_TAGS_HINT}"
                return Turn(generation, [ToolCall("", error=error)])
            return Turn(generation)
        text = _decode(self.fmt.tokenizer, ids[:end])
        before = text[: text.find(TOOL_CALL_END)]
        start = before.rfind(TOOL_CALL)
        if start < 0:
            call = ToolCall("", error=f"{TOOL_CALL_END} without {TOOL_CALL} before it")
        else:
            call = parse_tags_call(before[start + len(TOOL_CALL) :])
        return Turn(generation.truncated(end), [call])

    def answer_ids(self, calls: Sequence[ToolCall], texts: Sequence[str]) -> list[int]:
        text = "".join(f"{TOOL_RESPONSE}{t}{TOOL_RESPONSE_END}" for t in texts)
        return _encode(self.fmt.tokenizer, text)


# ------------------------------------------------------------------------------------- chat
class ChatTemplateFormat:
    """Tools in the tokenizer's chat template; Hermes ``<tool_call>{json}</tool_call>`` calls."""

    name = "chat_template"

    def __init__(self, tokenizer: Any, specs: Sequence[ToolSpec]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ToolFormatError(
                "tool_format chat_template: the tokenizer has no chat template; use "
                "tool_format: tags"
            )
        self.tokenizer = tokenizer
        self.tools = [s.schema for s in specs]
        self.special = _special_texts(tokenizer)
        self.stop_ids = _turn_end_ids(tokenizer, self.special)
        self._probe(specs[0].name if specs else "tool")

    def render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def episode(self, prompt: Mapping[str, Any]) -> _ChatEpisode:
        messages = self.messages(prompt)
        try:
            text = self.render(messages, True)
        except Exception as exc:  # the template is the model's code
            raise ToolFormatError(
                f"prompt {prompt.get('prompt_id')!r}: the chat template cannot render it with "
                f"the tools: {type(exc).__name__}: {exc}"
            ) from exc
        return _ChatEpisode(self, messages, text)

    def messages(self, prompt: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation to render: the prompt's chat messages, else its text as one user
        message."""
        meta = prompt.get("meta") or {}
        for key in ("messages", "prompt"):
            value = meta.get(key)
            if _is_messages(value):
                return [dict(m) for m in value]
        where = f"prompt {prompt.get('prompt_id')!r}"
        text = meta.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ToolFormatError(
                f"{where}: tool_format chat_template renders the conversation itself and needs "
                "meta['messages'] (chat messages: add the prompt column to the source's "
                "meta_fields) or meta['text']; this prompt has neither"
            )
        if any(s in text for s in self.special):
            raise ToolFormatError(
                f"{where}: its text was already rendered by a chat template (without the "
                "tools), and there are no chat messages to render again: set the source's "
                "chat_template: false, or keep the messages in meta (meta_fields)"
            )
        return [{"role": "user", "content": text}]

    def insertion(
        self, conversation: list[dict[str, Any]], text: str, content: str, tools: list[dict]
    ) -> tuple[str, str]:
        """The rendered conversation once ``tools`` answered the assistant's ``content``, and
        what of it follows ``text + content`` (the context so far); ToolFormatError when the
        template does not simply append."""
        assistant = {"role": "assistant", "content": content}
        base = self.render([*conversation, assistant], False)
        full = self.render([*conversation, assistant, *tools], True)
        if not (base.startswith(text + content) and full.startswith(base)):
            raise ToolFormatError(
                "the chat template is not append-only: rendering the conversation with the "
                "tool answers changes what it rendered before (earlier turns are rewritten), "
                "so answers cannot be inserted after the model's tokens; use tool_format: tags"
            )
        return full, full[len(text + content) :]

    def _probe(self, name: str) -> None:
        """Fail now, not in the run, when the template cannot answer tools by appending."""
        conversation = [{"role": "user", "content": "Hi"}]
        try:
            text = self.render(conversation, True)
            content = f'{TOOL_CALL}{{"name": "{name}", "arguments": {{}}}}{TOOL_CALL_END}'
            tool = {"role": "tool", "name": name, "content": "42"}
            self.insertion(conversation, text, content, [tool])
        except ToolFormatError:
            raise
        except Exception as exc:
            raise ToolFormatError(
                f"the chat template cannot render a tool call and its answer ({exc}); use "
                "tool_format: tags"
            ) from exc


class _ChatEpisode:
    def __init__(self, fmt: ChatTemplateFormat, messages: list[dict], text: str) -> None:
        self.fmt, self.messages, self.text = fmt, messages, text
        self.prompt_ids = _encode(fmt.tokenizer, text)
        self.content, self.stop_text = "", ""  # the last turn's text and its stop token's

    def sampling(self, base: Mapping[str, Any]) -> dict[str, Any]:
        return _with_stops(base, self.fmt.stop_ids)

    def read(self, generation: Generation) -> Turn:
        ids = generation.token_ids.tolist()
        tokenizer = self.fmt.tokenizer
        stopped = generation.finish_reason == "stop" and bool(ids) and ids[-1] in self.fmt.stop_ids
        self.content = _decode(tokenizer, ids[:-1] if stopped else ids)
        self.stop_text = _decode(tokenizer, ids[-1:]) if stopped else ""
        if generation.finish_reason != "stop":
            return Turn(generation)
        calls = [parse_json_call(m.group(1).strip()) for m in _BLOCK.finditer(self.content)]
        end = self.content.rfind(TOOL_CALL_END)
        rest = self.content[end + len(TOOL_CALL_END) :] if calls else self.content
        if TOOL_CALL in rest:
            calls.append(ToolCall("", error=f"{TOOL_CALL} without {TOOL_CALL_END}; {_JSON_HINT}"))
        return Turn(generation, calls)

    def answer_ids(self, calls: Sequence[ToolCall], texts: Sequence[str]) -> list[int]:
        tools = [
            {"role": "tool", "name": c.name, "content": t}
            for c, t in zip(calls, texts, strict=True)
        ]
        full, tail = self.fmt.insertion(self.messages, self.text, self.content, tools)
        if self.stop_text and tail.startswith(self.stop_text):
            tail = tail[len(self.stop_text) :]  # the model's own end-of-turn is in the context
        self.messages = [*self.messages, {"role": "assistant", "content": self.content}, *tools]
        self.text = full
        return _encode(self.fmt.tokenizer, tail)


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
            for m in value
        )
    )


def _special_texts(tokenizer: Any) -> set[str]:
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return {t for t in texts if t}


def _turn_end_ids(tokenizer: Any, special: set[str]) -> list[int]:
    """EOS and the template's end-of-turn token: the special token right after an assistant
    message's content."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    mark = "Inflight-end-of-turn-probe"
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": mark}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that needs more: EOS alone then
        return sorted(ids)
    after = text.split(mark, 1)[1] if mark in text else ""
    first = next((s for s in special if after.startswith(s)), None)
    if first is not None:
        ids.update(_encode(tokenizer, first)[:1])
    return sorted(ids)
