"""Kimi K3's chat encoding (``stages.engine.kimi_k3_encoding`` through ``chat_request``) against
SGLang 0.5.23's own: on random requests, the messages, tools, kwargs and continued text our
route hands the template are those ``serving_chat._encode_messages`` hands
``apply_chat_template`` (key order included), or both refuse the request; usage's prompt tokens
are ``_reported_prompt_tokens``'.

``serving_chat`` does not import here (its multimodal stack), so its functions and
``OpenAIServingChat``'s methods on this path are read out of its source and run on a stand-in
for the server. Skipped unless SGLang's protocol imports
(``PYTHONPATH=/tmp/sgl/x:/tmp/sgldeps:/tmp/xgr/t``: ``test_engine_sglang_shapes.py``'s
docstring says how).
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import logging
import random
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")

import orjson  # noqa: E402

from stages.engine.openai_api import OpenAIError  # noqa: E402
from stages.engine.openai_chat import ChatSettings, chat_request  # noqa: E402
from tests.stages.test_engine_sglang_template_dump import _message, _tool  # noqa: E402
from tests.stages.tool_tokenizers import char_tokenizer  # noqa: E402

FUNCTIONS = ("neutralize_kimi_k3_image_placeholder", "neutralize_kimi_k3_image_placeholder_value",
             "normalize_assistant_tool_call_arguments", "parse_tool_call_arguments")  # fmt: skip
METHODS = ("_prepare_kimi_k3_messages", "_effective_tools", "_encode_messages",
           "_reported_prompt_tokens", "_handle_last_assistant_message")  # fmt: skip
SPOT = "<|kimi_image_placeholder|>"


class ThinkingMode:
    CHAT, THINKING = "chat", "thinking"


def _sglang_serving() -> tuple[Any, dict[str, Any]]:
    """A stand-in ``OpenAIServingChat`` with SGLang's own methods of the K3 path (its
    ``apply_chat_template`` records what it gets) and the module's functions."""
    path = Path(inspect.getfile(protocol)).parent / "serving_chat.py"
    tree = ast.parse(path.read_text())
    nodes: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                             and n.name in FUNCTIONS]  # fmt: skip
    constants = [n for n in tree.body if isinstance(n, ast.Assign)]
    nodes += [n for n in constants if getattr(n.targets[0], "id", "").startswith("KIMI_K3_IMAGE")]
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OpenAIServingChat"]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert {m.name for m in methods} == set(METHODS)
    scope: dict[str, Any] = {
        "Any": Any, "orjson": orjson, "copy": copy, "logger": logging.getLogger("sglang_k3"),
        "ChatCompletionRequest": protocol.ChatCompletionRequest,
        "ChatCompletionMessageGenericParam": protocol.ChatCompletionMessageGenericParam,
        "Tool": protocol.Tool, "ThinkingMode": ThinkingMode,
    }  # fmt: skip
    body = [*nodes, ast.ClassDef("Serving", [], [], methods, [])]
    exec(compile(ast.fix_missing_locations(ast.Module(body, [])), str(path), "exec"), scope)
    seen: dict[str, Any] = {}

    def apply_chat_template(messages: Any, **kwargs: Any) -> list[int]:
        seen.update(messages=messages, kwargs=kwargs, prefix=None)
        return [7]

    def append(self: Any, ids: list[int], prefix: str) -> list[int]:
        seen["prefix"] = prefix
        return ids

    serving = scope["Serving"]()
    serving.chat_encoding_spec, serving._encoding_adapter = "kimi_k3", None
    serving._KIMI_K3_GENERATION_STUB_TOKENS = 3
    serving._append_assistant_prefix_to_prompt_ids = append.__get__(serving)
    tokenizer = SimpleNamespace(apply_chat_template=apply_chat_template)
    serving.tokenizer_manager = SimpleNamespace(tokenizer=tokenizer)
    return serving, {"seen": seen, **scope}


TEXTS = ["hi", "", SPOT, f"a{SPOT}b{SPOT}", "<|kimi_image_placeholder", "x y"]
EFFORTS = ["low", "medium", "high", "max", "none", "xhigh", "minimal", 0.5, None]
KWARGS = {"thinking_effort": ["mine", None], "tool_choice": ["mine"], "tokenize": [True],
          "return_dict": [False], "image_prompts": [["p"]], "reasoning_effort": ["high", None],
          "x": [1, None], "tools": [[]]}  # fmt: skip
FORMATS = [
    {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"strict": False, "schema": {}, "name": "b",
                                            "description": None}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": True,
                                            "name": "c"}},
]  # fmt: skip


def _spotted(value: Any, r: random.Random) -> Any:
    """``value`` with its strings sometimes holding the image placeholder."""
    if isinstance(value, str) and r.random() < 0.4:
        return r.choice(TEXTS) if value else value
    if isinstance(value, list):
        return [_spotted(v, r) for v in value]
    if isinstance(value, dict):
        kept = ("type", "role", "phase")
        return {k: v if k in kept else _spotted(v, r) for k, v in value.items()}
    return value


def _valid(r: random.Random) -> dict[str, Any]:
    """A random message SGLang's models take."""
    while True:
        message = _message(r)
        try:
            protocol.ChatCompletionRequest(messages=[copy.deepcopy(message)])
        except ValueError:
            continue
        return message


def _body(r: random.Random) -> dict[str, Any]:
    messages = [_spotted(_valid(r) if r.random() < 0.9 else _message(r), r)
                for _ in range(r.randint(1, 4))]  # fmt: skip
    for message in messages:
        if r.random() < 0.1 and isinstance(message.get("tool_calls"), list):
            fn = {"name": "f", "arguments": r.choice([f'{{"a": "{SPOT}"}}', f"{SPOT} no", "3"])}
            message["tool_calls"].append({"id": "f:0", "function": fn})
    if r.random() < 0.3:
        messages.append({"role": "assistant", "content": r.choice(TEXTS)})
    body: dict[str, Any] = {"messages": messages}
    if r.random() < 0.6:
        tools = [_tool(r) for _ in range(r.randint(0, 3))]
        for i, tool in enumerate(tools):
            tool["function"]["name"] = f"f{i}"
        body["tools"] = tools
    if r.random() < 0.6:
        named = {"type": "function", "function": {"name": "f0"}}
        body["tool_choice"] = r.choice(["auto", "none", "required", named])
    if r.random() < 0.5:
        body["reasoning_effort"] = r.choice(EFFORTS)
    if r.random() < 0.5:
        keys = r.sample(list(KWARGS), r.randint(0, 4))
        body["chat_template_kwargs"] = {k: r.choice(KWARGS[k]) for k in keys}
    if r.random() < 0.3:
        body["response_format"] = copy.deepcopy(r.choice(FORMATS))
    if r.random() < 0.4:
        body["continue_final_message"] = True
    return body


def _sglang(serving: Any, scope: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """What SGLang hands ``apply_chat_template`` for ``body`` (``_convert_to_internal_request``'s
    effort move, ``_apply_jinja_template``'s dumps, ``_encode_messages``)."""
    request = protocol.ChatCompletionRequest(**copy.deepcopy(body))
    kwargs = request.chat_template_kwargs
    effort = kwargs.pop("reasoning_effort", None) if kwargs else None
    if effort is not None:
        request.reasoning_effort = effort
    messages = [m.model_dump() for m in request.messages]
    for message in messages:
        scope["normalize_assistant_tool_call_arguments"](message, strict=False)
    serving._encode_messages(
        copy.deepcopy(messages), request, ThinkingMode.CHAT, tools=None, image_data=[]
    )
    seen = dict(scope["seen"])
    seen["kwargs"] = dict(seen["kwargs"])
    return seen


def _ours(body: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {"prefix": None}
    settings = ChatSettings(TOKENIZER, None, tool_parser="kimi_k3", encoding="kimi_k3")

    def render(messages: Any, tools: Any, kwargs: dict[str, Any]) -> list[int]:
        seen.update(messages=messages, tools=tools, kwargs=dict(kwargs))
        return [7]

    def prefix_ids(text: str) -> list[int]:
        seen["prefix"] = text
        return []

    settings.render, settings.prefix_ids = render, prefix_ids  # type: ignore[method-assign]
    chat_request(copy.deepcopy(body), settings, 4096)
    return seen


TOKENIZER = char_tokenizer(string.printable)
# refusals of tool_choice that SGLang makes past _encode_messages (_validate_tool_choice), and
# the engine's own for a forced call with an output constraint (openai_chat._tool_choice)
LATER = ("Tools cannot be empty if tool choice", "not found in tools list",
         "cannot be combined with response_format")  # fmt: skip


@pytest.mark.timeout(600)
def test_what_the_k3_template_gets_is_sglangs() -> None:
    """``_encode_messages``' kimi_k3 branch: the messages (``_prepare_kimi_k3_messages`` on the
    dumps, strict=False arguments), ``tools`` (every request tool, as set), the kwargs
    (``thinking_effort``, ``tool_choice``, ``response_format``, dropped encoder kwargs),
    ``add_generation_prompt`` always, the continued message's text; refused where SGLang's
    models refuse (and image parts: a text model here)."""
    serving, scope = _sglang_serving()
    r = random.Random(23)
    served = refused = media = later = 0
    for _ in range(8000):
        body = _body(r)
        try:
            want = _sglang(serving, scope, body)
        except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
            with pytest.raises(OpenAIError):
                _ours(body)
            refused += 1
            continue
        parts = [p for m in body["messages"] if isinstance(m.get("content"), list)
                 for p in m["content"]]  # fmt: skip
        if any(isinstance(p, dict) and p.get("type") == "image_url" for p in parts):
            with pytest.raises(OpenAIError) as refusal:
                _ours(body)
            assert any(words in str(refusal.value) for words in ("text parts only", *LATER))
            media += 1
            continue
        wanted_kwargs = want["kwargs"]
        if "tools" in (body.get("chat_template_kwargs") or {}):  # the TypeError, both
            with pytest.raises(OpenAIError, match="multiple values for keyword argument 'tools'"):
                _ours(body)
            refused += 1
            continue
        try:
            got = _ours(body)
        except OpenAIError as exc:  # refused by a check past the encoding (tool_choice's)
            assert any(words in str(exc) for words in LATER), (exc, body)
            later += 1
            continue
        assert json.dumps(got["messages"]) == json.dumps(want["messages"]), body
        assert json.dumps(got["tools"]) == json.dumps(wanted_kwargs.pop("tools")), body
        assert wanted_kwargs.pop("tokenize") is True and wanted_kwargs.pop("return_dict") is False
        assert got["kwargs"].pop("add_generation_prompt") is wanted_kwargs.pop(
            "add_generation_prompt"
        )
        assert json.dumps(got["kwargs"]) == json.dumps(wanted_kwargs), body
        assert got["prefix"] == want["prefix"], body
        served += 1
    print(f"served {served}, refused {refused}, image parts {media}, refused later {later}")
    assert served > 2000 and refused > 300


def test_usage_prompt_tokens_are_sglangs() -> None:
    """``_reported_prompt_tokens`` of any prompt length: ours."""
    from stages.engine.kimi_k3_encoding import reported_prompt_tokens

    serving, _ = _sglang_serving()
    for tokens in range(0, 50):
        assert reported_prompt_tokens(tokens) == serving._reported_prompt_tokens(
            {"prompt_tokens": tokens}
        )
