"""Kimi K3's chat encoding (``stages.engine.kimi_k3_encoding``): what the template gets, read
back out of a template that prints it, as SGLang 0.5.23's ``_encode_messages`` hands it over;
usage's prompt tokens less the generation stub. ``test_engine_sglang_kimi_k3_encoding.py``
holds the same to SGLang's own functions."""

from __future__ import annotations

import asyncio
import json
import string
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from stages.engine import chat_template
from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings, chat_request, chat_response, chat_stream
from stages.engine.tokenize_routes import TokenizeRoutes
from tests.stages.tool_tokenizers import char_tokenizer

# prints what it gets, one line each; "UNSET" for a kwarg it did not get
PRINTS = (
    '{% macro v(x) %}{% if x is defined %}{{ x | tojson }}{% else %}"UNSET"{% endif %}'
    "{% endmacro %}"
    "M={{ messages | tojson }}\n"
    "T={{ v(tools) }}\n"
    'K={"thinking_effort": {{ v(thinking_effort) }}, "tool_choice": {{ v(tool_choice) }}, '
    '"response_format": {{ v(response_format) }}, "reasoning_effort": {{ v(reasoning_effort) }}, '
    '"image_prompts": {{ v(image_prompts) }}, "tokenize": {{ v(tokenize) }}, '
    '"return_dict": {{ v(return_dict) }}, "x": {{ v(x) }}}\n'
    "G={{ add_generation_prompt | tojson }}\n$"
)
TOKENIZER = char_tokenizer(string.printable, template=PRINTS)
K3 = ChatSettings(TOKENIZER, None, tool_parser="kimi_k3", encoding="kimi_k3")
HELLO = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
SPOT, SPACED = "<|kimi_image_placeholder|>", "<| kimi_image_placeholder |>"


def _seen(body: dict[str, Any], settings: ChatSettings = K3) -> dict[str, Any]:
    """What the template printed for ``body``: ``M``, ``T``, ``K``, ``G`` and the ``rest``."""
    native, _ = chat_request(body, settings, 4096)
    printed, rest = TOKENIZER.decode(native["input_ids"]).split("\n$")
    seen = {line[0]: json.loads(line[2:]) for line in printed.split("\n")}
    seen["rest"] = rest
    return seen


def test_messages_are_sglangs_whole_dump() -> None:
    """``msg.model_dump()`` (``_apply_jinja_template``): a non-user message's fields in the
    model's order (its top-level nulls then dropped by ``apply_chat_template`` where
    transformers' ``_normalize_chat_messages`` drops them, 5.2x; nested nulls kept); a user
    message's role and content; a null content ``""`` (``_prepare_kimi_k3_messages``); developer
    made system; history calls' index null."""
    messages = [
        {"role": "developer", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "Assistant", "content": None, "tool_calls": [
            {"id": "add:0", "function": {"name": "add", "arguments": '{"a": 1}'}}],
         "prefix": "yes", "phase": "commentary"},
        {"role": "tool", "content": "2", "tool_call_id": "add:0"},
    ]  # fmt: skip
    seen = _seen({"messages": messages})["M"]
    fields = ["tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix"]
    dumped = [
        {"role": "system", "content": "be brief", **dict.fromkeys(fields), "name": "ops"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", **dict.fromkeys(fields), "phase": "commentary",
         "tool_calls": [{"id": "add:0", "index": None, "type": "function",
                         "function": {"name": "add", "arguments": {"a": 1}}}], "prefix": True},
        {"role": "tool", "content": "2", **dict.fromkeys(fields), "tool_call_id": "add:0"},
    ]  # fmt: skip
    if chat_template._DROPS_NONE:  # this transformers drops the top-level nulls; 5.19 keeps them
        dumped = [{k: v for k, v in m.items() if v is not None} for m in dumped]
    assert seen == dumped
    assert [list(m) for m in seen] == [list(m) for m in dumped]


def test_content_lists_keep_their_text_parts_alone() -> None:
    """``_prepare_kimi_k3_messages``: a list content's text parts as ``{type, text}``, thinking
    parts and tool references dropped, a tool message's list not joined."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                          {"type": "text", "text": "c"}]},
        {"role": "tool", "content": [{"type": "text", "text": "d"},
                                     {"type": "tool_reference", "name": "add"}]},
    ]  # fmt: skip
    seen = _seen({"messages": messages})["M"]
    assert seen[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert seen[1]["content"] == [{"type": "text", "text": "c"}]
    assert seen[2]["content"] == [{"type": "text", "text": "d"}]


def test_the_image_placeholder_is_spaced_out_in_texts_reasoning_and_arguments() -> None:
    """``neutralize_kimi_k3_image_placeholder(_value)``: in string and part texts, an
    assistant's reasoning and its calls' arguments (parsed or kept as text); not in names."""
    messages = [
        {"role": "system", "content": f"s{SPOT}"},
        {"role": "user", "content": [{"type": "text", "text": f"u{SPOT}"}]},
        {"role": "assistant", "content": SPOT, "reasoning_content": f"r{SPOT}", "tool_calls": [
            {"id": "x:0", "function": {"name": SPOT, "arguments": {"k": [f"{SPOT}v"]}}},
            {"id": "x:1", "function": {"name": "y", "arguments": f'{{"k": "{SPOT}"}}'}},
            {"id": "x:2", "function": {"name": "y", "arguments": f"not json {SPOT}"}}]},
        {"role": "tool", "content": SPOT, "tool_call_id": "x:0", "name": SPOT},
    ]  # fmt: skip
    seen = _seen({"messages": messages})["M"]
    assert seen[0]["content"] == f"s{SPACED}"
    assert seen[1]["content"] == [{"type": "text", "text": f"u{SPACED}"}]
    assert seen[2]["content"] == SPACED and seen[2]["reasoning_content"] == f"r{SPACED}"
    calls = [call["function"] for call in seen[2]["tool_calls"]]
    assert calls[0] == {"name": SPOT, "arguments": {"k": [f"{SPACED}v"]}}
    assert calls[1]["arguments"] == {"k": SPACED}
    assert calls[2]["arguments"] == f"not json {SPACED}"
    assert seen[3]["content"] == SPACED and seen[3]["name"] == SPOT


def test_history_arguments_that_are_no_json_object_are_kept_as_text() -> None:
    """``normalize_assistant_tool_call_arguments(strict=False)``: where the generic path
    refuses text arguments that are no JSON object, Kimi K3's keeps them as they came."""
    for arguments in ("{", "[1]", "3"):
        call = {"id": "f:0", "function": {"name": "f", "arguments": arguments}}
        body = {"messages": [*HELLO, {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "user", "content": "again"}]}  # fmt: skip
        assert _seen(body)["M"][1]["tool_calls"][0]["function"]["arguments"] == arguments
        with pytest.raises(OpenAIError, match=r"function\.arguments must be"):
            chat_request(body, ChatSettings(TOKENIZER, None), 4096)


def test_tools_are_dumped_as_set_every_one_whatever_the_choice() -> None:
    """``tool.model_dump(exclude_unset=True, by_alias=True)`` for the request's tools, all of
    them with a named or ``none`` choice too, and for a system or developer message's (a root
    or assistant message's keep the plain dump); no tools: null."""
    tools = [
        {"function": {"parameters": {"type": "object"}, "name": "add", "strict": "yes",
                      "extra": 1}},
        {"type": "function", "function": {"name": "neg", "strict": None},
         "defer_loading": "off"},
    ]  # fmt: skip
    want = [
        {"function": {"parameters": {"type": "object"}, "name": "add", "strict": True}},
        {"type": "function", "function": {"name": "neg", "defer_loading": False},
         "defer_loading": False},
    ]  # fmt: skip
    assert _seen({"messages": HELLO})["T"] is None
    assert _seen({"messages": HELLO, "tools": tools})["T"] == want
    named = {"type": "function", "function": {"name": "neg"}}
    for choice in ("none", named, "required"):
        assert _seen({"messages": HELLO, "tools": tools, "tool_choice": choice})["T"] == want
    own = [{"function": {"name": "neg"}}]
    messages = [{"role": "system", "content": "", "tools": own},
                {"role": "root", "content": "", "tools": own}, *HELLO]  # fmt: skip
    seen = _seen({"messages": messages})["M"]
    assert seen[0]["tools"] == [{"function": {"name": "neg"}}]
    plain = {"name": "neg", "description": None, "parameters": None}
    assert seen[1]["tools"] == [{"type": "function", "function": plain, "defer_loading": None}]


def test_reasoning_effort_becomes_thinking_effort() -> None:
    """``_encode_messages``: low, high, max as ``thinking_effort`` unless the kwargs set one;
    another effort logged and left out; no ``reasoning_effort`` kwarg, none moved from the
    kwargs either."""
    for effort in ("low", "high", "max"):
        kwargs = _seen({"messages": HELLO, "reasoning_effort": effort})["K"]
        assert kwargs["thinking_effort"] == effort and kwargs["reasoning_effort"] == "UNSET"
    body = {"messages": HELLO, "chat_template_kwargs": {"reasoning_effort": "max"}}
    assert _seen(body)["K"]["thinking_effort"] == "max"
    body = {"messages": HELLO, "reasoning_effort": "low",
            "chat_template_kwargs": {"thinking_effort": "mine"}}  # fmt: skip
    assert _seen(body)["K"]["thinking_effort"] == "mine"
    with capture_logs() as logs:
        kwargs = _seen({"messages": HELLO, "reasoning_effort": "medium"})["K"]
    assert kwargs["thinking_effort"] == "UNSET"
    assert [e["reasoning_effort"] for e in logs if e["event"] == "kimi_k3_effort_unsupported"] == [
        "medium"
    ]
    assert _seen({"messages": HELLO})["K"]["thinking_effort"] == "UNSET"


def test_tool_choice_and_response_format_are_kwargs() -> None:
    """``tool_choice`` ``required`` or ``none`` where there are tools (the request's or a system
    message's), under the request's own kwarg; ``response_format`` as set
    (``model_dump(exclude_unset=True, by_alias=True)``)."""
    tools = [TOOL]
    for choice in ("none", "required"):
        body = {"messages": HELLO, "tools": tools, "tool_choice": choice}
        assert _seen(body)["K"]["tool_choice"] == choice
    for choice in ("auto", {"type": "function", "function": {"name": "add"}}):
        body = {"messages": HELLO, "tools": tools, "tool_choice": choice}
        assert _seen(body)["K"]["tool_choice"] == "UNSET"
    assert _seen({"messages": HELLO, "tool_choice": "none"})["K"]["tool_choice"] == "UNSET"
    messages = [{"role": "developer", "content": "", "tools": tools}, *HELLO]
    assert _seen({"messages": messages, "tool_choice": "none"})["K"]["tool_choice"] == "none"
    body = {"messages": HELLO, "tools": tools, "tool_choice": "none",
            "chat_template_kwargs": {"tool_choice": "mine"}}  # fmt: skip
    assert _seen(body)["K"]["tool_choice"] == "mine"
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "name": "a"}}
    assert _seen({"messages": HELLO, "response_format": fmt})["K"]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}
    }  # fmt: skip
    fmt = {"type": "json_object"}
    assert _seen({"messages": HELLO, "response_format": fmt})["K"]["response_format"] == fmt
    assert _seen({"messages": HELLO})["K"]["response_format"] == "UNSET"


def test_a_json_schema_that_is_not_strict_is_the_models_to_follow() -> None:
    """``to_sampling_params(renderer_handles_response_format=True)``: ``strict: false`` holds
    the answer to no grammar; strict or unsaid, the schema's grammar."""
    schema = {"type": "object"}
    for strict, held in ((False, False), (True, True), (None, True)):
        spec = {"name": "a", "schema": schema, "strict": strict}
        body = {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": spec}}
        native, _ = chat_request(body, K3, 4096)
        assert ("json_schema" in native["sampling_params"]) is held
        native, _ = chat_request(body, ChatSettings(TOKENIZER, None), 4096)
        assert "json_schema" in native["sampling_params"]


def test_the_encoder_kwargs_are_dropped_and_tools_refused() -> None:
    """``tokenize``, ``return_dict``, ``image_prompts`` popped; the others passed on; a
    ``tools`` kwarg is apply_chat_template's TypeError (400)."""
    given = {"tokenize": True, "return_dict": True, "image_prompts": ["p"], "x": 1}
    kwargs = _seen({"messages": HELLO, "chat_template_kwargs": given})["K"]
    assert kwargs["tokenize"] == kwargs["return_dict"] == kwargs["image_prompts"] == "UNSET"
    assert kwargs["x"] == 1
    with pytest.raises(OpenAIError, match="multiple values for keyword argument 'tools'"):
        chat_request({"messages": HELLO, "chat_template_kwargs": {"tools": []}}, K3, 4096)


def test_the_generation_prompt_always_a_continued_message_after_it() -> None:
    """``apply_chat_template(add_generation_prompt=True)``; a last assistant message stays one
    (not made the user's); with ``continue_final_message`` its text, spaced out, follows the
    prompt (``_append_assistant_prefix_to_prompt_ids``)."""
    messages = [*HELLO, {"role": "assistant", "content": f"so{SPOT}"}]
    seen = _seen({"messages": messages})
    assert seen["G"] is True and seen["M"][1]["role"] == "assistant" and seen["rest"] == ""
    seen = _seen({"messages": messages, "continue_final_message": True})
    assert seen["G"] is True and len(seen["M"]) == 1 and seen["rest"] == f"so{SPACED}"


def test_tokenize_renders_as_the_chat_route_and_refuses_add_generation_prompt() -> None:
    """``/v1/tokenize``'s messages: the chat route's prompt; ``add_generation_prompt`` given is
    SGLang's 400 under a chat encoding (``serving_tokenize``: "only with a Jinja chat
    template")."""
    loaded = SimpleNamespace(tokenizer=TOKENIZER, context_length=4096, vocab_size=100)
    routes = TokenizeRoutes(loaded, K3)  # type: ignore[arg-type]
    native, _ = chat_request({"messages": HELLO}, K3, 4096)
    assert routes._chat_ids({"messages": HELLO}) == native["input_ids"]
    for generation in (True, False):
        with pytest.raises(OpenAIError, match="only with a Jinja chat template"):
            routes._chat_ids({"messages": HELLO, "add_generation_prompt": generation})


def test_image_parts_are_refused_a_text_model() -> None:
    """The engine serves text models: an image part is a 400, as on the generic path."""
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(OpenAIError, match="text parts only"):
        chat_request({"messages": [{"role": "user", "content": [image]}]}, K3, 4096)


def _native(prompt_tokens: int, index: int = 0) -> dict[str, Any]:
    return {"text": "ok", "output_ids": [3, 4], "index": index,
            "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 1},
                          "prompt_tokens": prompt_tokens, "completion_tokens": 2,
                          "weight_version": "7"}}  # fmt: skip


def test_usage_counts_the_prompt_less_the_generation_stub() -> None:
    """``_reported_prompt_tokens``: prompt tokens less 3 (not below 0) in the answer's usage and
    meta_info, in a stream's usage chunk and its continuous usage; other encodings all of them."""
    body = {"messages": HELLO, "return_meta_info": True}
    native, options = chat_request(body, K3, 4096)
    tokens = len(native["input_ids"])
    out = chat_response([_native(tokens)], options)
    assert out["usage"]["prompt_tokens"] == tokens - 3
    assert out["choices"][0]["meta_info"]["prompt_tokens"] == tokens - 3
    assert chat_response([_native(2)], options)["usage"]["prompt_tokens"] == 0
    _, plain = chat_request(body, ChatSettings(TOKENIZER, None), 4096)
    assert chat_response([_native(tokens)], plain)["usage"]["prompt_tokens"] == tokens

    usage = {"include_usage": True, "continuous_usage_stats": True}
    stream = {**body, "stream": True, "return_meta_info": False, "stream_options": usage}
    _, options = chat_request(stream, K3, 4096)

    async def run() -> list[dict[str, Any]]:
        async def batches():
            yield [_native(tokens)]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    usages = [c["usage"] for c in asyncio.run(run()) if c.get("usage")]
    assert usages and all(u["prompt_tokens"] == tokens - 3 for u in usages)
