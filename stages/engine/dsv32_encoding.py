"""DeepSeek V3.2's prompt format, which SGLang 0.5.23 renders in Python rather than through a
chat template (its ``dsv32`` chat encoding: ``--tool-call-parser deepseekv32``, or a DeepSeek
V3 architecture whose tokenizer has no chat template; ``entrypoints/openai/encoding_dsv32.py``,
DeepSeek's own encoder, and ``serving_chat._apply_jinja_template``'s branch for it).

``encode(messages, thinking)`` is the prompt's text: the BOS, then each message:

- ``system``: its content, then (``\\n\\n``) the tools' description (``render_tools``: the tools'
  functions as JSON lines in DeepSeek's tool-use preamble, which writes calls as DSML
  ``invoke`` blocks); ``developer``: a user turn of the tools, then ``# The user's message is:``
  and its content; ``user``: ``<｜User｜>CONTENT<｜Assistant｜>``; each user or developer turn
  then ``<think>`` if it is the last user turn of a thinking request, else ``</think>``;
- ``tool``: the results of the assistant's calls before them, in ``<function_results>``, each a
  ``<result>``, the last followed by ``<think>`` or ``</think>`` as a user turn is;
- ``assistant``: (after the last user turn of a thinking request, its reasoning and
  ``</think>``) its content, its calls as a DSML block (each argument a ``parameter`` tag,
  ``string="true"`` and the text for a string, else its JSON), then ``<｜end▁of▁sentence｜>``.

A thinking request drops the reasoning of assistant turns before the last user turn, and the
messages other than system, user, tool and assistant ones before it (``drop_thinking_messages``;
an index past the shortened list then fails as DeepSeek's encoder fails). What it refuses
raises ``EncodingError`` with its words (SGLang's 400); a role it does not know raises
``UnknownRole`` (SGLang's 500, its ``NotImplementedError``).

``tests/stages/test_engine_sglang_dsv32.py`` holds ``encode`` to SGLang's encoder on random
conversations where SGLang imports. This module knows nothing of HTTP or tokenizers.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ASSISTANT", "BOS", "EOS", "USER", "EncodingError", "UnknownRole", "encode"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, UNTHINK = "<think>", "</think>"
DSML = "｜DSML｜"
_TOOLS_PREAMBLE = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml}function_calls>
...
</{dsml}function_calls>
<function_results>
...
</function_results>
{think}...thinking about results{unthink}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""  # noqa: E501 (DeepSeek's text, line for line)
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


class EncodingError(ValueError):
    """A conversation DeepSeek's encoder refuses (``DS32EncodingError``), in its words."""


class UnknownRole(Exception):  # (SGLang: NotImplementedError, its 500 and not a 400)
    """A message role DeepSeek's encoder has no rendering for."""


def _json(value: Any) -> str:
    """``to_json``: JSON as written, non-ASCII kept (escaped where it cannot be written)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except Exception:  # (the encoder's bare fallback)
        return json.dumps(value, ensure_ascii=True)


def _tools(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(_json(tool["function"]) for tool in tools)
    return _TOOLS_PREAMBLE.format(dsml=DSML, think=THINK, unthink=UNTHINK, schemas=schemas)


def _last_user(messages: list[dict[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") in ("user", "developer"):
            return index
    return -1


def _arguments(call: dict[str, Any]) -> str:
    """A call's arguments as DSML parameter tags, one a line."""
    raw = call["function"]["arguments"]
    arguments = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(arguments, dict):
        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
    lines = []
    for key, value in arguments.items():
        text, string = (value, "true") if isinstance(value, str) else (_json(value), "false")
        lines.append(f'<{DSML}parameter name="{key}" string="{string}">{text}</{DSML}parameter>')
    return "\n".join(lines)


def _turn_end(index: int, last_user: int, thinking: bool) -> str:
    return THINK if index == last_user and thinking else UNTHINK


def _render(index: int, messages: list[dict[str, Any]], thinking: bool) -> str:
    """One message's text (``render_message``)."""
    if not 0 <= index < len(messages):
        raise EncodingError(
            f"Index {index} out of range for messages list of length {len(messages)}"
        )
    message, last_user = messages[index], _last_user(messages)
    role, content = message.get("role"), message.get("content")
    tools, calls = message.get("tools"), message.get("tool_calls")
    response_format = message.get("response_format")
    if role == "system":
        text = content or ""
        if tools:
            text += "\n\n" + _tools(tools)
        if response_format:
            text += "\n\n" + _RESPONSE_FORMAT + _json(response_format)
        return text
    if role == "developer":
        if not content:
            raise EncodingError(f"Invalid message for role `{role}`: {message}")
        inner = "\n\n" + _tools(tools) if tools else ""
        if response_format:
            inner += "\n\n" + _RESPONSE_FORMAT + _json(response_format)
        inner += f"\n\n# The user's message is: {content}"
        return f"{USER}{inner}{ASSISTANT}" + _turn_end(index, last_user, thinking)
    if role == "user":
        return f"{USER}{content}{ASSISTANT}" + _turn_end(index, last_user, thinking)
    if role == "tool":
        return _tool_result(index, messages, last_user, thinking)
    if role == "assistant":
        block = ""
        if calls:
            invokes = "\n".join(
                f'<{DSML}invoke name="{call["function"].get("name")}">\n{_arguments(call)}\n'
                f"</{DSML}invoke>"
                for call in calls
            )
            block = f"\n\n<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>"
        reasoning = ""
        if thinking and index > last_user:
            if not (message.get("reasoning_content") or calls):
                raise EncodingError(
                    "ThinkingMode: thinking, invalid message without reasoning_content/"
                    f"tool_calls `{message}` after last user message"
                )
            reasoning = (message.get("reasoning_content") or "") + UNTHINK
        return f"{reasoning}{content or ''}{block}{EOS}"
    raise UnknownRole(f"Unknown role: {role}")


def _tool_result(index: int, messages: list[dict[str, Any]], last_user: int, thinking: bool) -> str:
    """A tool message: the ``order``-th result of the assistant turn before the run."""
    before = index - 1
    assistant = messages[before]
    while before >= 0 and assistant.get("role") == "tool":
        before -= 1
        assistant = messages[before]
    if not (index == 0 or (before >= 0 and assistant.get("role") == "assistant")):
        raise EncodingError(f"Invalid messages at {index}:\n{assistant}")
    order = index - before
    calls = assistant.get("tool_calls")
    if not (calls and len(calls) >= order):
        raise EncodingError("No tool calls but found tool output")
    text = "\n\n<function_results>" if order == 1 else ""
    text += f"\n<result>{messages[index].get('content')}</result>"
    if order == len(calls):
        text += "\n</function_results>"
        text += "\n\n" + (THINK if index >= last_user and thinking else UNTHINK)
    return text


def _without_old_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``drop_thinking_messages``: before the last user turn, assistant turns lose their
    reasoning and messages of roles other than system, user and tool are left out."""
    last_user = _last_user(messages)
    kept = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "system", "tool") or index >= last_user:
            kept.append(message)
        elif role == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning_content"})
    return kept


def encode(messages: list[dict[str, Any]], thinking: bool) -> str:
    """The prompt's text of ``messages`` (``encode_messages``, from the BOS)."""
    full = _without_old_thinking(messages) if thinking else messages
    return BOS + "".join(_render(index, full, thinking) for index in range(len(messages)))
