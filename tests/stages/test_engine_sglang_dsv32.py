"""DeepSeek V3.2's prompt encoding (``stages.engine.dsv32_encoding``) against SGLang 0.5.23's own
(``entrypoints/openai/encoding_dsv32.py``, DeepSeek's encoder) on random conversations: system
messages with tools and response formats, developer turns, user turns, assistant turns with
reasoning and DSML calls, runs of tool results in every order and place, thinking or not, and
every way the encoder refuses them: the same text, or the same refusal.

Skipped unless SGLang's encoder imports (its wheel's source: ``test_engine_sglang_shapes.py``'s
docstring says how).
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

ds: Any = pytest.importorskip("sglang.srt.entrypoints.openai.encoding_dsv32")

from stages.engine.dsv32_encoding import EncodingError, UnknownRole, encode  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "adds {a}",
                                      "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "ünï", "parameters": None, "description": None}},
]  # fmt: skip
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "x"}}},
    {"id": "c2", "type": "function", "function": {"name": "ünï", "arguments": {}}},
    {"id": "c3", "type": "function", "function": {"name": "add", "arguments": '{"s": [1, {}]}'}},
    {"id": "c4", "type": "function", "function": {"name": None, "arguments": {"k": None}}},
    {"id": "c5", "type": "function", "function": {"name": "add", "arguments": "[1]"}},
]  # fmt: skip
TEXTS = ["", "hi", "{x} {}", "a\nb", "ünï", None]


def _message(r: random.Random) -> dict[str, Any]:
    role = r.choice(["system", "user", "user", "assistant", "assistant", "tool", "tool",
                     "developer", "function"])  # fmt: skip
    message: dict[str, Any] = {"role": role, "content": r.choice(TEXTS)}
    if role == "system" and r.random() < 0.5:
        message["tools"] = r.sample(TOOLS, r.randint(1, 2))
    if role in ("system", "developer") and r.random() < 0.2:
        message["response_format"] = {"type": "json_object"}
    if role == "developer" and r.random() < 0.4:
        message["tools"] = TOOLS[:1]
    if role == "assistant":
        if r.random() < 0.5:
            message["tool_calls"] = [r.choice(CALLS) for _ in range(r.randint(1, 3))]
        if r.random() < 0.5:
            message["reasoning_content"] = r.choice(["because", ""])
    return message


def _conversation(r: random.Random) -> list[dict[str, Any]]:
    """A conversation in the shape agents send: a system turn or not, then user turns, each
    answered, calls followed by their results."""
    out = [_message(r) | {"role": "system"}] if r.random() < 0.6 else []
    for _ in range(r.randint(1, 3)):
        out.append({"role": r.choice(["user", "user", "developer"]), "content": r.choice(TEXTS)})
        if r.random() < 0.8:
            answer = _message(r) | {"role": "assistant"}
            out.append(answer)
            for call in answer.get("tool_calls") or ():
                out.append({"role": "tool", "content": r.choice(TEXTS), "tool_call_id": call["id"]})
    return out


def _outcome(run: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    try:
        return "text", run(*args, **kwargs)
    except (EncodingError, ds.DS32EncodingError) as exc:
        return "refused", str(exc)
    except (UnknownRole, NotImplementedError) as exc:
        return "unknown role", str(exc)
    except (ValueError, IndexError, KeyError, AttributeError) as exc:
        return type(exc).__name__, ""


@pytest.mark.timeout(120)
def test_dsv32_prompts_are_deepseeks_encoders() -> None:
    """``encoding_dsv32.encode_messages`` (``render_message``, ``drop_thinking_messages``):
    the same prompt text, or the same refusal in the same words."""
    r = random.Random(3)
    texts = refusals = 0
    for _ in range(20000):
        if r.random() < 0.5:
            messages = _conversation(r)
        else:
            messages = [_message(r) for _ in range(r.randint(1, 7))]
        thinking = r.random() < 0.5
        mode = "thinking" if thinking else "chat"
        mine = _outcome(encode, copy.deepcopy(messages), thinking)
        theirs = _outcome(ds.encode_messages, copy.deepcopy(messages), thinking_mode=mode)
        assert mine == theirs, (messages, thinking)
        texts += mine[0] == "text"
        refusals += mine[0] != "text"
    assert texts > 5000 and refusals > 5000
