"""MiniMax-M3's tool calls (``stages.engine.minimax_m3_calls``, ``--tool-call-parser minimax-m3``)
read whole and streamed, as SGLang 0.5.23's ``function_call/minimax_m3.py`` reads them (held to
it on random answers in ``test_engine_sglang_minimax_m3.py``); these cases need no SGLang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stages.engine.minimax_m3_calls import NS
from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
)
from tests.stages.test_engine_chat import _calls_of
from tests.stages.test_engine_tool_formats import STEPS, _feed

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"},
            "score": {"type": "number"}, "fresh": {"type": "boolean"},
            "since": {"type": ["string", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
            "filter": {"type": "object", "properties": {"lang": {"type": "string"}},
                       "additionalProperties": {"type": "integer"}}}}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}},
]  # fmt: skip


def _m3(*tags: str) -> str:
    return "".join(NS + tag for tag in tags)


SEARCH = _m3(
    "<tool_call>\n", '<invoke name="search">\n',
    "<query>weather in Zürich\n", "</query>\n", "<limit> 3", "</limit>",
    "<score>2.0", "</score>", "<fresh>yes", "</fresh>", "<since>NULL", "</since>",
    "<tags>", "<item>a", "</item>", "<item>b", "</item>", "</tags>",
    "<pair>", "<item>x", "</item>", "<item>7", "</item>", "</pair>",
    "<filter>", "<lang>de", "</lang>", "<max>9", "</max>", "</filter>",
    "</invoke>\n", '<invoke name="ghost">', "<a>1", "</a>", "</invoke>\n",
    '<invoke name="note">', "<items>", "<item>1", "</item>", "<item>true", "</item>",
    "</items>", "<k>v", "</k>", "<k>w", "</k>", "</invoke>\n", "</tool_call>",
)  # fmt: skip
SEARCH_ARGS = {"query": "weather in Zürich", "limit": 3, "score": 2, "fresh": True,
               "since": None, "tags": ["a", "b"], "pair": ["x", 7],
               "filter": {"lang": "de", "max": 9}}  # fmt: skip
NOTE_ARGS = {"items": ["1", True], "k": ["v", "w"]}


@pytest.mark.parametrize("step", STEPS)
def test_minimax_m3_reads_typed_nested_and_listed_values(step: int) -> None:
    """minimax_m3.py:551 (``_parse_parameter``): each element by its schema (a whole number an
    integer, "yes" true, NULL none where null is allowed), arrays of <item>s (by items and
    prefixItems), an object's own and additionalProperties children, an untyped element's
    <item>s a list and a repeated key a list; a tool not offered dropped; content the text
    around the block, as it is; streamed, the same."""
    text = "I'll look.\n" + SEARCH + "\nDone."
    reader = ToolCallParser(TOOLS, "minimax-m3")
    content, calls = reader.parse(text)
    assert content == "I'll look.\n\nDone."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("search", SEARCH_ARGS),
        ("note", NOTE_ARGS),
    ]
    assert '"query": "weather in Zürich"' in calls[0]["arguments"]  # not ASCII-escaped
    assert reader.indexed(text, {})[1][1][0] == 1  # numbered by its place in its block
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(TOOLS, "minimax-m3")), text, step)
    assert (streamed, _calls_of(pieces)) == (content, calls)


@pytest.mark.parametrize("step", STEPS)
def test_minimax_m3_spacing_after_a_marker_is_not_text(step: int) -> None:
    """minimax_m3.py:55: whitespace between a marker and the tag after it goes, before reading
    (a marker before anything else stays)."""
    text = f'a {NS} <b> {NS}  \n<tool_call>{NS} <invoke name="note">{NS}\t<x>1{NS}</x>'
    text += f"{NS}\n</invoke>{NS} </tool_call> {NS}"
    reader = ToolCallParser(TOOLS, "minimax-m3")
    want = (f"a {NS}<b>  {NS}", [{"name": "note", "arguments": '{"x": "1"}'}])
    assert reader.parse(text) == want
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(TOOLS, "minimax-m3")), text, step)
    assert (streamed, _calls_of(pieces)) == want


def test_minimax_m3_reads_calls_without_tools_and_keeps_what_it_cannot_read() -> None:
    """minimax_m3.py:88 (``parses_without_tools``): with no tools every call is kept as named,
    its values untyped (JSON's literals alone); minimax_m3.py:76: a body that cannot be read
    (mismatched closing tag, a tag without ``>``, an element inside a value, a number past a
    float's range for a number) leaves the whole answer as it came; a block never closed is
    content."""
    loose = _m3("<tool_call>", '<invoke name="anything">', "<n>521", "</n>", "<b>true", "</b>",
                "</invoke>", "</tool_call>")  # fmt: skip
    assert ToolCallParser([], "minimax-m3").parse(loose) == (
        "",
        [{"name": "anything", "arguments": '{"n": "521", "b": true}'}],
    )
    for body in (["<a>1", "</b>"], ["<a"], ["<a>1", "<b>2", "</b>", "</a>"]):
        bad = "x " + _m3("<tool_call>", '<invoke name="note">', *body, "</invoke>", "</tool_call>")
        assert ToolCallParser(TOOLS, "minimax-m3").parse(bad) == (bad, [])
    huge = _m3("<tool_call>", '<invoke name="search">', "<score>1e400", "</score>", "</invoke>",
               "</tool_call>")  # fmt: skip
    assert ToolCallParser(TOOLS, "minimax-m3").parse(huge) == (huge, [])
    cut = "pre " + _m3("<tool_call>", '<invoke name="note">', "<a>1")
    assert ToolCallParser(TOOLS, "minimax-m3").parse(cut) == (cut, [])
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "minimax-m3"))
    assert _feed(stream, cut, 3) == (cut, [])


def test_minimax_m3_is_forced_by_json_schema_and_named_by_its_template() -> None:
    """Its detector has no structural tag (minimax_m3.py:92): a forced choice is SGLang's JSON
    array of calls, a strict tool constrains nothing; a template that writes its marker names
    the format."""
    forced = forced_calls(TOOLS, "minimax-m3", named=False, parallel=True)
    assert "json_schema" in forced
    assert answer_format("minimax-m3", forced) == "json_array"
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    assert strict_calls(strict, "minimax-m3") is None
    assert template_parsers("{{ ']<]minimax[>[<tool_call>' }}")["tool_call_parser"] == "minimax-m3"
    assert template_parsers("{{ '<minimax:tool_call>' }}")["tool_call_parser"] == "minimax-m2"


def test_a_minimax_m3_chat_answer_reasons_by_thinking_mode_and_calls_without_tools(
    tmp_path: Path,
) -> None:
    """serving_chat._get_reasoning_from_request: minimax-m3 reasons when the request's
    ``chat_template_kwargs.thinking_mode`` is ``enabled`` (before the template's own switches);
    ``_tool_call_parsing_active``: a request without tools still has its calls read (its
    detector ``parses_without_tools``), one with ``response_format`` JSON not; a stray
    ``</mm:think>`` leading an answer that does not reason is dropped."""
    from transformers import AutoTokenizer

    from stages.engine.openai_chat import ChatSettings, chat_request, chat_response
    from tests.stages.tiny_model import make_tagged_byte_model

    model = make_tagged_byte_model(tmp_path / "model", ("<mm:think>", "</mm:think>"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = "{%- for m in messages %}{{ m.content }}.{% endfor %}{{ ':' }}"
    settings = ChatSettings.of(
        tokenizer, model, chat_template=template, tool_call_parser="minimax-m3",
        reasoning_parser="minimax-m3",
    )  # fmt: skip
    assert settings is not None
    call = _m3("<tool_call>", '<invoke name="lookup">', "<q>x", "</q>", "</invoke>", "</tool_call>")

    def answer(body: dict[str, Any], text: str) -> dict[str, Any]:
        _, options = chat_request(body, settings, context_length=512)
        result = {"text": text, "output_ids": [3], "meta_info": {
            "id": "r", "finish_reason": {"type": "stop", "matched": 1}, "prompt_tokens": 2,
            "completion_tokens": 1, "weight_version": "0"}}  # fmt: skip
        return chat_response([result], options)["choices"][0]

    ask = {"messages": [{"role": "user", "content": "hi"}]}
    thinking = {**ask, "chat_template_kwargs": {"thinking_mode": "enabled"}}
    choice = answer(thinking, "plan</mm:think>ok" + call)
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "ok")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("lookup", '{"q": "x"}')
    ]
    assert choice["finish_reason"] == "tool_calls"
    message = answer(ask, " </mm:think>plain")["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "plain")
    as_json = {**ask, "response_format": {"type": "json_object"}}
    assert answer(as_json, call)["message"]["content"] == call  # data, not calls


@pytest.mark.timeout(120)
def test_an_answer_that_opens_its_reasoning_itself_counts_its_reasoning_tokens(
    tmp_path: Path,
) -> None:
    """An engine with ``--reasoning-parser minimax-m3``: a ``/generate`` answer that does not
    require reasoning but opens with ``<mm:think>`` has its reasoning tokens counted, whole and
    streamed (``Req.update_self_opened_reasoning_tokens``, which SGLang's scheduler runs for
    the parser's ``get_self_opened_think_start_token_ids``); one that does not open it, none."""
    import requests
    from transformers import AutoTokenizer

    from tests.stages.test_engine_server import serving
    from tests.stages.tiny_model import make_tagged_byte_model

    model = make_tagged_byte_model(tmp_path / "model", ("<mm:think>", "</mm:think>"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<mm:think>", "</mm:think>"))
    with serving(model, tmp_path / "engine.log", "--reasoning-parser", "minimax-m3") as eng:
        for token, want in ((start, 4), (end, 0)):
            sampling = {"max_new_tokens": 4, "logit_bias": {str(token): 100.0}}
            body = {"input_ids": [5, 6], "sampling_params": sampling}
            got = requests.post(eng.url + "/generate", json=body, timeout=60).json()
            assert got["output_ids"] == [token] * 4
            assert got["meta_info"]["reasoning_tokens"] == want
            reply = requests.post(eng.url + "/generate", json={**body, "stream": True}, timeout=60)
            events = [line for line in reply.text.splitlines() if line.startswith("data: {")]
            assert json.loads(events[-1][6:])["meta_info"]["reasoning_tokens"] == want
