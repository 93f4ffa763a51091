"""The tools a chat template sees (``stages.engine.template_dump``) against SGLang 0.5.23's own
pydantic models: ``ChatCompletionRequest(...).tools[i].model_dump()``, what
``serving_chat._process_messages`` passes ``apply_chat_template``, on random tools (fields in
random orders, left out, null, keys that are no field, bools pydantic reads from words and
numbers, the tool's ``defer_loading`` or none), compared as the JSON a template's ``tojson``
writes (key order included); and the Anthropic route's tools as SGLang's converts them.

Skipped unless SGLang's protocol imports (its environment, or its wheel's source:
``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")

from stages.engine.template_dump import (  # noqa: E402
    DumpError,
    content_format,
    template_message,
    template_tool,
)
from tests.stages.tool_tokenizers import QWEN_LIKE  # noqa: E402

KEYS = ["name", "description", "parameters", "strict", "defer_loading", "extra", "examples"]
VALUES: dict[str, list[Any]] = {
    "description": [None, "d", ""],
    "parameters": [None, {"type": "object"}, {"properties": {"a": {}}}],
    "strict": [None, True, False, "yes", 1, "off", 0, "T"],
    "defer_loading": [None, True, "no", 0],
    "extra": [1, None],
    "examples": [[1]],
}


def _tool(r: random.Random) -> dict[str, Any]:
    keys = r.sample(KEYS, r.randint(0, len(KEYS)))
    if "name" not in keys:
        keys.insert(r.randint(0, len(keys)), "name")
    fn = {key: "f" if key == "name" else r.choice(VALUES[key]) for key in keys}
    tool: dict[str, Any] = {"function": fn}
    if r.random() < 0.7:
        tool = {"type": "function", **tool}
    if r.random() < 0.5:
        tool["defer_loading"] = r.choice(VALUES["defer_loading"])
    return tool


@pytest.mark.timeout(120)
def test_template_tools_are_sglangs_dump() -> None:
    """``protocol.py:810`` (``Function``: ``_capture_key_order``, ``_serialize``), ``:844``
    (``Tool``, ``_propagate_defer_loading``)."""
    r = random.Random(5)
    for _ in range(3000):
        tool = _tool(r)
        request = protocol.ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], tools=[tool]
        )
        want = json.dumps(request.tools[0].model_dump())
        assert json.dumps(template_tool(tool)) == want, tool


def _sglang_function(module: Any, name: str) -> Any:
    """One function of an SGLang module that does not import here (``serving_chat`` needs its
    multimodal stack), read out of its source and run in its module's imports' stead."""
    import ast
    import inspect

    import orjson

    path = Path(inspect.getfile(protocol)).parent / f"{module}.py"
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    scope: dict[str, Any] = {"Any": Any, "orjson": orjson}
    exec(compile(ast.Module([node], []), str(path), "exec"), scope)
    return scope[name]


ROLES = ["user", "system", "assistant", "tool", "developer", "function", "System", "root",
         "latest_reminder", "User", "bot", 3]  # fmt: skip
PARTS = [
    {"type": "text", "text": "a"}, {"type": "text", "text": "b c"}, {"type": "text"},
    {"type": "thinking", "thinking": "t"}, {"type": "reasoning", "text": "r"},
    {"type": "thinking", "thinking": "t", "text": "u"}, {"type": "tool_reference", "name": "f"},
    {"type": "tool_reference"}, {"type": "text", "text": 5}, {"type": "input_text", "text": "x"},
    {"type": "image_url", "image_url": {"url": "http://x"}}, "plain",
]  # fmt: skip
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
    {"function": {"name": "g", "arguments": {"b": [1]}}, "index": 0},
    {"id": "c2", "function": {"name": "f", "arguments": "[1]"}},
    {"id": "c3", "function": {"name": "f", "arguments": "{"}},
    {"id": "c4", "function": {"arguments": "{}"}},
    {"id": 7, "function": {"name": "f", "arguments": "{}"}},
    {"id": "c5", "type": "other", "function": {"name": "f"}},
    {"id": "c6"},
]  # fmt: skip
EXTRA = {
    "name": ["bob", None, 1], "tool_call_id": ["c1", None], "phase": ["commentary", "x", None],
    "reasoning_content": ["why", None], "prefix": [True, "yes", None, "maybe"], "extra": [1],
    "tools": [[{"type": "function", "function": {"name": "f"}}], [{"function": {}}]],
}  # fmt: skip


def _message(r: random.Random) -> dict[str, Any]:
    message: dict[str, Any] = {"role": r.choice(ROLES)}
    kind = r.random()
    if kind < 0.4:
        message["content"] = r.choice(["hi", "", "x y"])
    elif kind < 0.8:
        message["content"] = [r.choice(PARTS) for _ in range(r.randint(0, 3))]
    elif kind < 0.9:
        message["content"] = None
    for key in r.sample(list(EXTRA), r.randint(0, 3)):
        message[key] = r.choice(EXTRA[key])
    if r.random() < 0.3:
        message["tool_calls"] = [r.choice(CALLS) for _ in range(r.randint(0, 2))]
    return message


@pytest.mark.timeout(300)
def test_template_messages_are_sglangs_dump() -> None:
    """``serving_chat._process_messages`` (``:2035`` ``normalize_assistant_tool_call_
    arguments``, ``:2133`` a null content made ``""``, ``process_content_for_template_format``,
    ``normalize_tool_content``) on ``protocol.ChatCompletionMessageParam``'s dumps, in either
    content format: the same message, key order included, or refused where SGLang refuses."""
    from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

    normalize = _sglang_function("serving_chat", "normalize_assistant_tool_call_arguments")
    parse = _sglang_function("serving_chat", "parse_tool_call_arguments")
    normalize.__globals__["parse_tool_call_arguments"] = parse
    tool_content = _sglang_function("serving_chat", "normalize_tool_content")
    r = random.Random(11)
    served = refused = 0
    for _ in range(6000):
        message, fmt = _message(r), r.choice(["string", "openai"])
        try:
            request = protocol.ChatCompletionRequest(messages=[message])
            want = request.messages[0].model_dump()
            normalize(want)
            if want.get("content") is None:
                want["content"] = ""
            want = process_content_for_template_format(want, fmt, [], [], [], [])
            want["content"] = tool_content(want["role"], want.get("content"))
        except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
            with pytest.raises(DumpError):
                template_message(message, 0, fmt)
            refused += 1
            continue
        parts = message.get("content") or ()
        if any(isinstance(p, dict) and p.get("type") in MEDIA for p in parts):
            with pytest.raises(DumpError, match="text parts only"):  # a text model here
                template_message(message, 0, fmt)
            continue
        assert json.dumps(template_message(message, 0, fmt)) == json.dumps(want), message
        served += 1
    assert served > 2000 and refused > 1000


MEDIA = ("image_url", "video_url", "audio_url", "input_audio")
TEMPLATES = [
    QWEN_LIKE, "", "{{ messages }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for message in messages %}{% for c in message['content'] %}{{ c.text }}{% endfor %}"
    "{% endfor %}",
    "{% for message in messages %}{% for c in message.content | reverse %}{% endfor %}{% endfor %}",
    "{% for msg in messages %}{% for c in msg.content[1:] %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for c in m['content'] if c is string %}{% endfor %}{% endfor %}",
    "{% for x in messages %}{% for c in x.content %}{% endfor %}{% endfor %}",
    "{% for message in messages %}{% for c in message.parts %}{% endfor %}{% endfor %}",
    "{{ 'image' }}", "vision", "{% for %}", "{% for message in messages %}",
    "{% for m in messages %}{% for c in m.content is defined %}{% endfor %}{% endfor %}",
]  # fmt: skip


def test_content_formats_are_sglangs() -> None:
    """``jinja_template_utils.detect_jinja_template_content_format`` on templates that iterate
    over a message's content in each way it recognizes, and in ways it does not."""
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    for template in TEMPLATES:
        want = detect_jinja_template_content_format(template) if template else "string"
        assert content_format(template) == want, template
