"""Tool calls in SGLang's ``qwen25``, ``hermes``, ``llama3``, ``mistral``, ``pythonic``,
``qwen3_coder``, ``deepseekv3``, ``deepseekv31`` and ``kimi_k2`` formats (and the JSON array a
forced ``pythonic`` call is constrained to), read whole and streamed, against SGLang 0.5.23's
``function_call/qwen25_detector.py``, ``hermes_detector.py``, ``base_format_detector.py``,
``llama32_detector.py``, ``mistral_detector.py``, ``pythonic_detector.py``,
``qwen3_coder_detector.py``, ``deepseekv3_detector.py``, ``deepseekv31_detector.py``,
``kimik2_detector.py``, ``json_array_parser.py``, ``function_call_parser.py`` and
``serving_chat.py`` (each test names the lines it follows); and through a real engine with
``--tool-call-parser``."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import structlog

from stages.engine.deepseek_calls import BEGIN, END, SECTION, SECTION_END, SEP
from stages.engine.kimi_calls import ARGUMENTS as KIMI_ARGUMENTS
from stages.engine.kimi_calls import BEGIN as KIMI_BEGIN
from stages.engine.kimi_calls import END as KIMI_END
from stages.engine.kimi_calls import SECTION as KIMI_SECTION
from stages.engine.kimi_calls import SECTION_END as KIMI_SECTION_END
from stages.engine.kimi_calls import history_calls
from stages.engine.openai_chat import ChatSettings, chat_request, chat_response, chat_stream
from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    forced_calls,
)
from tests.stages.test_engine_chat import _calls_of, _native
from tests.stages.test_engine_grammar import TOOL_TEMPLATE, TOOLS
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.tiny_model import BYTE_CHARS, make_byte_model

OFFERED = [{"type": "function", "function": {"name": n}} for n in ("add", "mul")]
STEPS = [1, 2, 3, 7, 1000]


def _stream(parser: str, text: str, step: int) -> tuple[str, list[dict[str, Any]], int]:
    """(content, pieces, calls named) of ``text`` fed ``step`` characters at a time."""
    stream = StreamingToolCalls(ToolCallParser(OFFERED, parser))
    return (*_feed(stream, text, step), stream.calls)


def _feed(stream: StreamingToolCalls, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """(content, pieces) of ``text`` fed to ``stream`` ``step`` characters at a time, flushed."""
    content, pieces = "", []
    for i in range(0, len(text), step):
        more, new = stream.feed(text[i : i + step])
        content += more
        pieces += new
    return content + stream.flush(), pieces


def _whole(parser: str, text: str) -> tuple[str, list[dict[str, str]]]:
    return ToolCallParser(OFFERED, parser).parse(text)


def _chat(parser: str, text: str) -> dict[str, Any]:
    """The non-streamed chat choice of an answer ``text`` read with ``parser``."""
    options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True,
               "tools": OFFERED, "tool_parser": parser}  # fmt: skip
    (choice,) = chat_response([_native(text, {"type": "stop", "matched": 1})], options)["choices"]
    return choice


def _call(name: str, arguments: str) -> dict[str, str]:
    return {"name": name, "arguments": arguments}


# ---- qwen25 / hermes ---------------------------------------------------------------------------

ADD = '{"name": "add", "arguments": {"a": 1}}'
MUL = '{"name": "mul", "parameters": {"b": "é"}}'


def test_qwen25_reads_only_calls_with_the_newlines_around_them() -> None:
    """qwen25_detector.py:38-39 (bot_token "<tool_call>\\n", eot_token "\\n</tool_call>"), :45
    (has_tool_call: the bot_token in the text), :55-62 (the text before it stripped; findall of
    bot(.*?)eot): without the newlines there is no call, and the answer is the text as it is;
    "qwen" is the same detector (function_call_parser.py:103-104)."""
    for parser in ("qwen25", "qwen", None):
        reader = ToolCallParser(OFFERED, parser)
        text = f"Sure <tool_call>{ADD}</tool_call>"
        assert not reader.has_tool_call(text) and reader.parse(text) == (text, [])
        assert reader.parse(f"Sure\n<tool_call>\n{ADD}\n</tool_call>\n bye") == (
            "Sure",
            [_call("add", '{"a": 1}')],
        )
        # the begin tag with its newline, but no newline before the end tag: no call
        assert reader.parse(f"<tool_call>\n{ADD}</tool_call>") == ("", [])
        # a "<tool_call>" without its newline is text inside the body: that body is not JSON
        text = f"<tool_call>\n{MUL}<tool_call>{ADD}\n</tool_call>"
        assert reader.parse(text) == ("", [])
    assert _chat("qwen25", f"Sure <tool_call>{ADD}</tool_call>")["message"] == {
        "role": "assistant", "content": f"Sure <tool_call>{ADD}</tool_call>",
        "reasoning_content": None,
    }  # fmt: skip


def test_hermes_reads_calls_with_or_without_newlines_and_an_unclosed_last_one() -> None:
    """hermes_detector.py:147-151 (bot "<tool_call>", eot "</tool_call>", the regex
    <tool_call>(.*?)</tool_call>|<tool_call>(.*): a last call needs no end tag), :161-162 (the
    text before the first tag stripped), :169-172 (an empty body skipped, each JSON stripped)."""
    text = f"Sure <tool_call>{ADD}</tool_call>\n<tool_call>\n{MUL}\n</tool_call> bye"
    calls = [_call("add", '{"a": 1}'), _call("mul", '{"b": "é"}')]
    assert _whole("hermes", text) == ("Sure", calls)
    assert _whole("hermes", f"<tool_call>{ADD}</tool_call><tool_call>{MUL}") == ("", calls)
    assert _whole("hermes", f"<tool_call></tool_call><tool_call>{ADD}</tool_call><tool_call>") == (
        "",
        calls[:1],
    )


def test_a_tag_may_hold_a_json_list_of_calls() -> None:
    """base_format_detector.py:79-80 (parse_base_json: a list is its calls, anything else one
    call), reached from qwen25_detector.py:66-67 and hermes_detector.py:172-176; the unknown
    tool in it dropped (:85-88)."""
    listed = f'[{ADD}, {{"name": "div"}}, {MUL}]'
    calls = [_call("add", '{"a": 1}'), _call("mul", '{"b": "é"}')]
    assert _whole("qwen25", f"ok\n<tool_call>\n{listed}\n</tool_call>") == ("ok", calls)
    assert _whole("hermes", f"ok<tool_call>{listed}</tool_call>") == ("ok", calls)
    assert _whole("qwen25", "<tool_call>\n[]\n</tool_call>") == ("", [])


def test_arguments_are_json_of_parameters_or_else_arguments_kept_as_they_are() -> None:
    """base_format_detector.py:94-97: json.dumps(act.get("parameters") or act.get("arguments",
    {}), ensure_ascii=False): null and [] stay, a falsy "parameters" gives way to "arguments",
    neither is {}."""
    for parser, (begin, end) in (("qwen25", ("<tool_call>\n", "\n</tool_call>")),
                                 ("hermes", ("<tool_call>", "</tool_call>"))):  # fmt: skip
        for call, arguments in (
            ('{"name": "add", "arguments": null}', "null"),
            ('{"name": "add", "arguments": []}', "[]"),
            ('{"name": "add", "arguments": "x"}', '"x"'),
            ('{"name": "add", "parameters": null, "arguments": {"a": 2}}', '{"a": 2}'),
            ('{"name": "add", "parameters": {}}', "{}"),
            ('{"name": "add"}', "{}"),
        ):
            assert _whole(parser, begin + call + end)[1] == [_call("add", arguments)], parser


def test_a_tag_that_is_not_json_drops_its_call_or_for_hermes_the_whole_answer() -> None:
    """qwen25_detector.py:65-72: a body that json.loads refuses is logged and skipped;
    hermes_detector.py:167-180: any error ends the reading, the answer is the text as it is and
    no calls (an unfinished last call too); the chat route then answers that text
    (serving_chat.py:3180-3192)."""
    with structlog.testing.capture_logs() as logs:
        text = f"Hi\n<tool_call>\n{{not json}}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
        assert _whole("qwen25", text) == ("Hi", [_call("add", '{"a": 1}')])
    assert [e["event"] for e in logs] == ["tool_call_unparsed"]
    for text in (
        f"Hi <tool_call>{{not json}}</tool_call><tool_call>{ADD}</tool_call>",
        f"Hi <tool_call>{ADD}</tool_call><tool_call>{ADD[:-4]}",  # cut short
        f"Hi <tool_call>{ADD}</tool_call><tool_call>\n",  # a body of whitespace is not empty
    ):
        assert _whole("hermes", text) == (text, [])
        choice = _chat("hermes", text)
        assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"


def test_a_call_that_is_not_a_json_object_leaves_the_answer_unread() -> None:
    """base_format_detector.py:84-85: act.get of a value that is not an object raises
    AttributeError, `name in tool_indices` of a list or object name TypeError; qwen25, llama3 and
    mistral let it out (/parse_function_call answers 500, http_server.py:1761), the chat route
    keeps the text (serving_chat.py:3215-3217). Not copied: here both routes answer the text as
    it is, no calls. Hermes catches it itself (hermes_detector.py:178-180): the same answer."""
    cases = [
        ("qwen25", f"ok\n<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n[1]\n</tool_call>"),
        ("qwen25", '<tool_call>\n"add"\n</tool_call>'),
        ("qwen25", '<tool_call>\n{"name": ["add"]}\n</tool_call>'),
        ("hermes", f"<tool_call>{ADD}</tool_call><tool_call>[{ADD}, 2]</tool_call>"),
        ("hermes", '<tool_call>{"name": {"n": "add"}}</tool_call>'),
        ("llama3", '<|python_tag|>{"name": ["add"]}'),
        ("mistral", '[TOOL_CALLS] [{"name": {"n": "add"}}]'),
    ]
    for parser, text in cases:
        assert _whole(parser, text) == (text, []), parser
        assert _chat(parser, text)["message"]["content"] == text
    # a name that is falsy, or a value that cannot be a tool's name: dropped, as there (:85-88)
    for name in ("{}", "[]", "3", "null"):
        assert _whole("qwen25", f'<tool_call>\n{{"name": {name}}}\n</tool_call>') == ("", [])


def test_pythonic_tool_index_counts_the_dropped_calls_and_the_chat_index_does_not() -> None:
    """pythonic_detector.py:86,118: tool_index is the call's place in the list (enumerate over
    all of them, whatever is dropped: an unknown tool, a call of an attribute, an argument that
    is no literal); serving_chat.py:3195-3203: the chat route numbers the calls it answers in
    order (index=index); base_format_detector.py:92: elsewhere the tool's place in tools."""
    reader = ToolCallParser(OFFERED, "pythonic")
    text = "[launch(x=1), add(a=1), os.exit(), mul(b=-1), mul(c=2)]"
    assert reader.indexed(text, {"add": 0, "mul": 1}) == (
        "",
        [(1, _call("add", '{"a": 1}')), (4, _call("mul", '{"c": 2}'))],
    )
    calls = _chat("pythonic", text)["message"]["tool_calls"]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add"), (1, "mul")]
    qwen = f"<tool_call>\n{MUL}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
    assert [i for i, _ in ToolCallParser(OFFERED).indexed(qwen, {"add": 5, "mul": 7})[1]] == [7, 5]
    calls = _chat("qwen25", qwen)["message"]["tool_calls"]
    assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize("step", STEPS)
def test_qwen25_and_hermes_stream_as_the_whole_answer_reads(step: int) -> None:
    """The pieces of each call (base_format_detector.py parse_streaming_increment: the name,
    then the arguments' JSON in pieces) add up to the whole answer's calls, for the same rules:
    the newlines Qwen 2.5 needs, a list of calls in one tag (sent once its tag closes; SGLang's
    stream reads none), arguments as written; a last Hermes call without its end tag goes out at
    the end (unsent)."""
    texts = {
        "qwen25": [
            f"Sure\n<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n[{MUL}, {ADD}]\n</tool_call>",
            '<tool_call>\n{"name": "mul", "arguments": null}\n</tool_call>',
            f"Sure <tool_call>{ADD}</tool_call>",
        ],
        "hermes": [
            f"Sure <tool_call>{ADD}</tool_call><tool_call>[{MUL}]</tool_call><tool_call>{ADD}",
            '<tool_call>\n{"name": "mul", "arguments": []}\n</tool_call>',
        ],
    }
    for parser, cases in texts.items():
        for text in cases:
            stream = StreamingToolCalls(ToolCallParser(OFFERED, parser))
            content, pieces = "", []
            for i in range(0, len(text), step):
                more, new = stream.feed(text[i : i + step])
                content, pieces = content + more, pieces + new
            content += stream.flush()
            pieces += stream.unsent()
            whole_content, whole_calls = _whole(parser, text)
            assert _calls_of(pieces) == whole_calls and stream.calls == len(whole_calls)
            assert content.rstrip() == (whole_content if whole_calls else text)
            assert stream.unsent() == []


# ---- llama3 ------------------------------------------------------------------------------------

LLAMA = (
    'Let me. <|python_tag|>{"name": "add", "arguments": {"a": 1, "b": "x\\"é"}};'
    '{"name": "mul", "parameters": {"c": [1, {"d": null}], "e": -2.5}} Done.'
)


def test_llama3_reads_json_objects_after_the_python_tag() -> None:
    """llama32_detector.py detect_and_parse: split at the first <|python_tag|> (the text before
    it content, as it is), raw_decode each object, skip one separator character, the stripped
    rest content; parse_base_json: "parameters" or else "arguments"."""
    parser = ToolCallParser(OFFERED, "llama3")
    assert parser.has_tool_call(LLAMA) and parser.has_tool_call('{"name": "add"}')
    assert not parser.has_tool_call(' {"name": "add"}')  # has_tool_call: startswith("{")
    assert parser.parse(LLAMA) == (
        "Let me. Done.",
        [
            {"name": "add", "arguments": '{"a": 1, "b": "x\\"é"}'},
            {"name": "mul", "arguments": '{"c": [1, {"d": null}], "e": -2.5}'},
        ],
    )
    # no tag, but the answer begins with an object: all of it is calls
    assert parser.parse('{"name": "add", "arguments": {}}') == (
        "",
        [{"name": "add", "arguments": "{}"}],
    )
    # _convert_python_dict_to_json: an object of Python literals
    assert parser.parse("<|python_tag|>{'name': 'mul', 'arguments': {'a': 'b'}}")[1] == [
        {"name": "mul", "arguments": '{"a": "b"}'}
    ]


def test_llama3_drops_unknown_tools_and_skips_to_the_next_call(capsys) -> None:
    """parse_base_json: an unknown function is logged and dropped; detect_and_parse: what does
    not decode is skipped up to the next '{"name":'; a value that is not an object makes the
    whole answer unreadable (SGLang's parser raises: the text stays as it is, no calls)."""
    with structlog.testing.capture_logs() as logs:
        text = (
            '<|python_tag|>{"name": "div", "arguments": {}}; oops {"name": "add", "arguments": {}}'
        )
        assert _whole("llama3", text) == ("", [{"name": "add", "arguments": "{}"}])
    assert {"event": "tool_call_unknown_function", "name": "div", "log_level": "warning"} in logs
    assert _whole("llama3", "<|python_tag|>[1, 2]") == ("<|python_tag|>[1, 2]", [])
    # an unfinished call is no call: its text is the rest, so content
    assert _whole("llama3", 'ok<|python_tag|>{"name": "add"') == ('ok{"name": "add"', [])


@pytest.mark.parametrize("step", STEPS)
def test_llama3_streams_names_then_argument_pieces(step: int) -> None:
    """base_format_detector.py parse_streaming_increment: the name once whole (Allow ~STR),
    then the arguments' JSON in pieces (common prefix of successive parses), the rest when the
    object is complete; the pieces add up to the whole answer's calls, content likewise."""
    content, pieces, calls = _stream("llama3", LLAMA, step)
    whole_content, whole_calls = _whole("llama3", LLAMA)
    assert _calls_of(pieces) == whole_calls and calls == 2
    assert content == whole_content
    if step == 1:
        assert sum(p["name"] is None and p["index"] == 1 for p in pieces) > 2
    # an unknown call goes out not at all, not even as content (SGLang's stream would leak it)
    content, pieces, _ = _stream("llama3", '<|python_tag|>{"name": "div", "arguments": {}}', step)
    assert (content, pieces) == ("", [])
    # a tail that could begin the tag waits; at the end it was content
    content, pieces, _ = _stream("llama3", "a <|python_", step)
    assert (content, pieces) == ("a <|python_", [])


# ---- mistral -----------------------------------------------------------------------------------

MISTRAL = (
    'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": "[x]"}}, '
    '{"name": "div", "arguments": {}}, {"name": "mul", "arguments": {"b": [2]}}] Bye.'
)
COMPACT = '[TOOL_CALLS]add[ARGS]{"a": 1} [TOOL_CALLS]mul[ARGS]{"b": {"c": "}"}} tail'


def test_mistral_reads_the_array_or_compact_calls() -> None:
    """mistral_detector.py detect_and_parse: the text before [TOOL_CALLS stripped; the first
    [TOOL_CALLS] [ array (brackets counted outside strings), unknown tools dropped, the text
    after it joined with a space; or [TOOL_CALLS]name[ARGS]{...} calls, the stripped rest
    content when a call was read."""
    assert _whole("mistral", MISTRAL) == (
        "Sure. Bye.",
        [
            {"name": "add", "arguments": '{"a": "[x]"}'},
            {"name": "mul", "arguments": '{"b": [2]}'},
        ],
    )
    assert _whole("mistral", COMPACT) == (
        "tail",
        [
            {"name": "add", "arguments": '{"a": 1}'},
            {"name": "mul", "arguments": '{"b": {"c": "}"}}'},
        ],
    )
    # streaming variants without "]" after the markers (_try_parse_compact_args_format)
    assert _whole("mistral", '[TOOL_CALLSadd[ARGS{"a": 2}')[1] == [
        {"name": "add", "arguments": '{"a": 2}'}
    ]
    # an array that is not JSON: no calls (the warning of detect_and_parse), content around it
    assert _whole("mistral", "Hi [TOOL_CALLS] [{'name': 'add'}] x") == ("Hi x", [])
    # an array never closed: no calls, the text before the marker
    assert _whole("mistral", 'Hi [TOOL_CALLS] [{"name": "add"') == ("Hi", [])
    assert not ToolCallParser(OFFERED, "mistral").has_tool_call("[TOOL_CALL")


@pytest.mark.parametrize("step", STEPS)
def test_mistral_streams_as_the_whole_answer_reads(step: int) -> None:
    """parse_streaming_increment: array calls as base_format_detector streams them (name, then
    argument pieces); a compact call once its arguments are whole, as a name and then all its
    arguments (the two ToolCallItems there); "]" stays in content (SGLang deletes it)."""
    for text in (MISTRAL, COMPACT, "No calls [1] here. "):
        content, pieces, _ = _stream("mistral", text, step)
        whole_content, whole_calls = _whole("mistral", text)
        assert _calls_of(pieces) == whole_calls
        assert content == (whole_content if whole_calls else text)
    _, pieces, _ = _stream("mistral", COMPACT, step)
    assert [p["arguments"] for p in pieces if p["index"] == 1] == ["", '{"b": {"c": "}"}}']


# ---- pythonic ----------------------------------------------------------------------------------

PYTHONIC = 'Calling: [add(a=1, b="x"), sub(c=2), mul(d=[1, {"e": None}], f=True)] now'


def test_pythonic_reads_a_list_of_calls_with_ast() -> None:
    """pythonic_detector.py detect_and_parse: the regex's match parsed with ast, the text
    around it content; unknown functions and calls with non-literal arguments (a negative
    number is an operation) dropped one by one; a match that is not a list of calls: none."""
    with structlog.testing.capture_logs() as logs:
        assert _whole("pythonic", PYTHONIC) == (
            "Calling:  now",
            [
                {"name": "add", "arguments": '{"a": 1, "b": "x"}'},
                {"name": "mul", "arguments": '{"d": [1, {"e": null}], "f": true}'},
            ],
        )
        assert _whole("pythonic", "[add(a=-1), mul(b=1e999), mul(c=b'x'), add(d=2)]") == (
            "",
            [{"name": "add", "arguments": '{"d": 2}'}],
        )
    assert [e["event"] for e in logs].count("tool_call_skipped") == 3
    parser = ToolCallParser(OFFERED, "pythonic")
    assert parser.has_tool_call("<|python_start|>[add()]<|python_end|>")
    assert not parser.has_tool_call("[1, 2]") and not parser.has_tool_call("add(a=1)")
    assert parser.parse("<|python_start|>[add()]<|python_end|>") == (
        "",
        [{"name": "add", "arguments": "{}"}],
    )
    # the match reaches the last ")]": two lists are one Python expression, not a list
    assert parser.parse("[add(a=1)] or [mul(b=2)]") == ("", [])
    # a dict key that is no literal: the whole list is dropped (SGLang's outer except)
    assert parser.parse("[add(a={**x}), mul()]") == ("", [])


@pytest.mark.parametrize("step", STEPS)
def test_pythonic_streams_each_closed_list_whole(step: int) -> None:
    """parse_streaming_increment: content up to a "[", held until its brackets close, the
    bracketed text then read alone; each call one piece with its name and all its arguments
    (ToolCallItem(name, parameters) there); text that is no call list is content."""
    content, pieces, calls = _stream("pythonic", PYTHONIC, step)
    assert content == "Calling:  now" and calls == 2
    assert [(p["index"], p["name"]) for p in pieces] == [(0, "add"), (1, "mul")]
    assert [p["arguments"] for p in pieces] == [
        c["arguments"] for c in _whole("pythonic", PYTHONIC)[1]
    ]
    # lists read one by one, numbered on; a "[" never closed is content at the end
    text = "a [1] [add()] b [mul(x=1)] [open"
    content, pieces, _ = _stream("pythonic", text, step)
    assert content == "a [1]  b  [open"
    assert [(p["index"], p["name"]) for p in pieces] == [(0, "add"), (1, "mul")]
    content, _, _ = _stream("pythonic", "<|python_start|>[add()]<|python_end|>", step)
    assert content == ""


# ---- qwen3_coder -------------------------------------------------------------------------------

TYPED = [
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object",
     "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                    "scale": {"type": "number"}, "dry": {"type": "boolean"},
                    "lines": {"type": "array"}, "opts": {"type": "object"},
                    "note": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}},
]  # fmt: skip
CODER = (
    "I will edit it.\n<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
    "<parameter=line>\n12\n</parameter>\n<parameter=scale>\n3\n</parameter>\n"
    "<parameter=dry>\nTrue\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n"
    "<parameter=opts>\n{'k': 'v'}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=ghost>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_reads_xml_calls_with_values_typed_by_the_schema() -> None:
    """qwen3_coder_detector.detect_and_parse and _convert_param_value: each <function=NAME>
    with its <parameter=KEY> values, one newline trimmed off each end, converted by the
    parameter's JSON-schema type (an integer, a number without "." whole as an integer, a
    boolean, an array as JSON, an object as a Python literal when not JSON, null), an
    undeclared parameter as text; calls to tools not offered kept; the content is the text
    before the first <tool_call>, as it is."""
    reader = ToolCallParser(TYPED, "qwen3_coder")
    content, calls = reader.parse(CODER)
    assert content == "I will edit it.\n"
    assert [c["name"] for c in calls] == ["edit", "ghost"]
    assert json.loads(calls[0]["arguments"]) == {
        "path": "src/a.py", "line": 12, "scale": 3, "dry": True, "lines": [1, 2],
        "opts": {"k": "v"}, "note": None, "extra": "7",
    }  # fmt: skip
    assert calls[1]["arguments"] == '{"x": "1"}'
    # an unclosed parameter ends at the next tag or the end; an unclosed block of <function=
    content, calls = reader.parse("<tool_call><function=run><parameter=a>x<parameter=b>\ny\n")
    assert content == "" and json.loads(calls[0]["arguments"]) == {"a": "x", "b": "y"}
    # no <tool_call>: no calls, the text as it is
    assert reader.parse("<function=run></function>") == ("<function=run></function>", [])
    _, indexed = reader.indexed(CODER, {})  # /parse_function_call: the call's place
    assert [i for i, _ in indexed] == [0, 1]
    assert (
        template_parsers("<tool_call>\n<function={{ name }}>\n<parameter=")["tool_call_parser"]
        == "qwen3_coder"
    )


@pytest.mark.parametrize("step", STEPS)
def test_qwen3_coder_streams_a_parameter_at_a_time(step: int) -> None:
    """parse_streaming_increment: the call named once <function=NAME> is whole, then "{", each
    parameter's "KEY": VALUE once it has ended (", " between), "}" at </function>; the pieces
    add up to the whole answer's arguments; text outside the blocks is content."""
    stream = StreamingToolCalls(ToolCallParser(TYPED, "qwen3_coder"))
    content, pieces = "", []
    for i in range(0, len(CODER), step):
        more, new = stream.feed(CODER[i : i + step])
        content, pieces = content + more, pieces + new
    content += stream.flush()
    # the newline between the two blocks is outside both: content, as SGLang streams it
    assert content == "I will edit it.\n\n" and stream.unsent() == []
    named = [(p["index"], p["name"]) for p in pieces if p["name"]]
    assert named == [(0, "edit"), (1, "ghost")]
    whole = ToolCallParser(TYPED, "qwen3_coder").parse(CODER)[1]
    for index, call in enumerate(whole):
        added = "".join(p["arguments"] for p in pieces if p["index"] == index)
        assert json.loads(added) == json.loads(call["arguments"])
    assert pieces[1]["arguments"] == "{" and pieces[2]["arguments"] == '"path": "src/a.py"'
    # a "<" that begins no tag is content; one that may is held, and dropped at the end
    content, _, _ = _stream("qwen3_coder", "a < b <x <tool", step)
    assert content == "a < b <x "


def test_chat_response_reads_qwen3_coder_calls() -> None:
    """The chat route's whole answer: content before the calls, each call with its JSON
    arguments, finish_reason tool_calls."""
    options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True,
               "tools": TYPED, "tool_parser": "qwen3_coder"}  # fmt: skip
    out = chat_response([_native(CODER, {"type": "stop", "matched": 1})], options)
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will edit it.\n"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["edit", "ghost"]
    assert json.loads(calls[0]["function"]["arguments"])["line"] == 12


def test_a_chat_stream_sends_qwen3_coder_calls_as_tool_call_deltas() -> None:
    """The chat route's stream (serving_chat._process_tool_call_stream): the named delta with
    its id, then the argument deltas, which add up to the whole answer's; finish tool_calls."""
    options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True, "tools": TYPED,
               "tool_parser": "qwen3_coder", "stream": True, "include_usage": False,
               "continuous_usage_stats": False}  # fmt: skip
    half = len(CODER) // 2

    async def run() -> list[dict]:
        async def batches():
            yield [_native(CODER[:half], None)]
            yield [_native(CODER, {"type": "stop", "matched": 1})]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = [c for c in calls if c["id"]]
    assert [c["function"]["name"] for c in first] == ["edit", "ghost"]
    added = "".join(c["function"]["arguments"] for c in calls if c["index"] == 0)
    assert json.loads(added) == json.loads(
        ToolCallParser(TYPED, "qwen3_coder").parse(CODER)[1][0]["arguments"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- a forced call: the JSON array -------------------------------------------------------------


def test_forced_calls_take_each_formats_constraint() -> None:
    """function_call_parser.py get_structure_constraint: a detector with structure_info gets
    get_legacy_structural_tag(at_least_one=True) (llama32_detector / mistral_detector
    structure_info); pythonic (supports_structural_tag False) gets utils.get_json_schema_constraint
    (named: that tool's item; required: anyOf and $defs; maxItems 1 without parallel calls)."""
    from stages.engine.tool_calls import answer_format, forced_calls

    tools = [t | {"function": t["function"] | {"strict": True}} for t in TOOLS]
    tag = json.loads(forced_calls(tools, "llama3", named=False, parallel=True)["structural_tag"])
    assert tag["triggers"] == ["<|python_tag|>"] and tag["at_least_one"] is True
    assert tag["structures"][1] == {
        "begin": '<|python_tag|>{"name":"mul", "arguments":',
        "schema": TOOLS[1]["function"]["parameters"],
        "end": "}",
    }
    tag = json.loads(forced_calls(tools, "mistral", named=True, parallel=True)["structural_tag"])
    assert tag["triggers"] == ["[TOOL_CALLS]"]
    assert tag["structures"][0]["begin"] == '[TOOL_CALLS] [{"name":"add", "arguments":'
    assert tag["structures"][0]["end"] == "}]"
    forced = forced_calls(TOOLS[1:], "pythonic", named=True, parallel=False)
    assert json.loads(forced["json_schema"]) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "properties": {
                "name": {"type": "string", "enum": ["mul"]},
                "parameters": TOOLS[1]["function"]["parameters"],
            },
            "required": ["name", "parameters"],
        },
        "maxItems": 1,
    }
    assert answer_format("pythonic", forced) == "json_array"
    assert answer_format("llama3", {"structural_tag": "{}"}) == "llama3"
    schema = json.loads(
        forced_calls(OFFERED, "pythonic", named=False, parallel=True)["json_schema"]
    )
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    clash = [
        {"type": "function", "function": {"name": n, "parameters": {"$defs": {"X": {"type": t}}}}}
        for n, t in (("a", "string"), ("b", "number"))
    ]
    with pytest.raises(ValueError, match="Tool definition 'X' has multiple schemas"):
        forced_calls(clash, "pythonic", named=False, parallel=True)


@pytest.mark.parametrize("step", STEPS)
def test_a_forced_pythonic_answer_is_read_as_the_json_array(step: int) -> None:
    """serving_chat.py _process_tool_calls (is_required, detector not owning the format):
    orjson.loads of the whole answer, an object taken as a list of one, "parameters" as the
    arguments, content ""; anything else: no calls, the text as it is. Streamed:
    _process_tool_call_stream's JsonArrayParser (base_format_detector streaming)."""
    text = '[\n {"name": "add", "parameters": {"a": 1}},\n {"name": "mul", "parameters": {}}\n]'
    calls = [{"name": "add", "arguments": '{"a": 1}'}, {"name": "mul", "arguments": "{}"}]
    assert _whole("json_array", text) == ("", calls)
    assert _whole("json_array", '{"name": "mul", "parameters": {"b": 2}}')[1] == [
        {"name": "mul", "arguments": '{"b": 2}'}
    ]
    for bad in ('[{"name": "add"', '[{"parameters": {}}]', '"add"', "[NaN]"):
        assert _whole("json_array", bad) == (bad, [])
    content, pieces, _ = _stream("json_array", text, step)
    assert content == "" and _calls_of(pieces) == calls


def test_chat_response_reads_each_format_by_the_options_parser() -> None:
    """chat_response with options["tool_parser"]: finish_reason stop becomes tool_calls
    (_process_tool_calls), content the detector's normal text."""
    minimax = _minimax(("add", [("a", "1")]), ("mul", []))
    for parser, text in (
        ("llama3", LLAMA), ("mistral", MISTRAL), ("pythonic", PYTHONIC), ("minimax-m2", minimax),
    ):  # fmt: skip
        options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True,
                   "tools": OFFERED, "tool_parser": parser}  # fmt: skip
        out = chat_response([_native(text, {"type": "stop", "matched": 1})], options)
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "tool_calls", parser
        message = choice["message"]
        assert message["content"] == _whole(parser, text)[0]
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["add", "mul"]


# ---- through the engine ------------------------------------------------------------------------

CHARS = BYTE_CHARS + " <>_/\n|()=';"
ASK = {"model": "m", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 400}


def _format_engine(
    parser: str, tmp_path_factory: Any, chars: str, words: tuple[str, ...]
) -> Iterator[Engine]:
    """A byte-level model (``words`` tokens of their own) served with ``--tool-call-parser``."""
    root = tmp_path_factory.mktemp(f"tools-{parser}")
    # (DeepSeek V3.2's prompts are its encoding's, whose tool preamble is 1,600 tokens here)
    positions = 4096 if parser == "deepseekv32" else 512
    model_dir = make_byte_model(
        root / "model", seed=4, chars=chars, words=words, max_positions=positions
    )
    (root / "template.jinja").write_text(TOOL_TEMPLATE)
    with serving(
        model_dir, root / "engine.log", "--chat-template", str(root / "template.jinja"),
        "--tool-call-parser", parser,
    ) as eng:  # fmt: skip
        eng.parser = parser  # type: ignore[attr-defined]
        yield eng


def _forced_sampling(engine: Engine, parser: str) -> dict[str, Any]:
    """The sampling params of a ``tool_choice`` ``required`` request to ``engine``."""
    settings = ChatSettings.of(
        _tokenizer(engine), engine.model_dir, chat_template=TOOL_TEMPLATE, tool_call_parser=parser
    )
    body = {"messages": ASK["messages"], "tools": TOOLS, "tool_choice": "required"}
    return chat_request(body, settings, 512)[0]["sampling_params"]


def _forced_answers(client: openai.OpenAI, ask: dict[str, Any]) -> Iterator[list[Any]]:
    """The calls of each answer (3 a request) to ``ask`` with ``tool_choice`` required, then
    named (``mul``): one or more, each to an allowed tool with the arguments ``a`` and ``b``
    (the answer may end for its length, in a call after them)."""
    for choice, names in (
        ("required", {"add", "mul"}),
        ({"type": "function", "function": {"name": "mul"}}, {"mul"}),
    ):
        out = client.chat.completions.create(**ask, tool_choice=choice, n=3)
        for c in out.choices:
            assert c.message.tool_calls and c.finish_reason in ("tool_calls", "length"), c
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name in names and set(arguments) == {"a", "b"}
            yield c.message.tool_calls


def _streamed_as_whole(client: openai.OpenAI, forced: dict[str, Any]) -> None:
    """``forced``'s first choice has calls, and its stream's pieces add up to them (an answer
    cut short: its last call, cut short too, streamed and closed, but not in the whole)."""
    (choice,) = client.chat.completions.create(**forced).choices
    whole = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or ()]  # fmt: skip
    streamed = _streamed_calls(client, forced)
    if choice.finish_reason == "length":
        streamed = streamed[: len(whole)]
    assert whole and whole == streamed


def _streamed_calls(client: openai.OpenAI, ask: dict[str, Any]) -> list[dict[str, str]]:
    """The calls of the first choice of ``ask`` streamed, its pieces added up."""
    pieces: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            call = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [pieces[i] for i in sorted(pieces)]


@pytest.fixture(scope="module", params=["llama3", "pythonic"])
def format_engine(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Engine]:
    """``<|python_tag|>`` a token."""
    yield from _format_engine(request.param, tmp_path_factory, CHARS, ("<|python_tag|>",))


@pytest.mark.timeout(180)
def test_a_forced_tool_choice_answers_with_calls_in_the_engines_format(
    format_engine: Engine,
) -> None:
    """tool_choice required or named through the openai client: llama3 constrained by its
    structural tag (llama32_detector structure_info), pythonic by SGLang's JSON schema
    (get_json_schema_constraint) and read as that array (_process_tool_calls); the streamed
    pieces add up to the non-streamed calls. (A named pythonic call is left out: SGLang's
    schema for it has no "type": "object", so a random model may write any array.)"""
    parser = format_engine.parser  # type: ignore[attr-defined]
    client = openai.OpenAI(base_url=format_engine.url + "/v1", api_key="unused", max_retries=0)
    choices: list[tuple[Any, set[str]]] = [("required", {"add", "mul"})]
    if parser == "llama3":
        choices.append(({"type": "function", "function": {"name": "mul"}}, {"mul"}))
    for (choice, names), seed in itertools.product(choices, (2, 3)):  # seeds whose answer ends
        out = client.chat.completions.create(**ASK, tools=TOOLS, tool_choice=choice, seed=seed)
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name in names and set(arguments) == {"a", "b"}
    native = _forced_sampling(format_engine, parser)
    assert set(native) & {"structural_tag", "json_schema"} == (
        {"structural_tag"} if parser == "llama3" else {"json_schema"}
    )
    ask = {**ASK, "tools": TOOLS, "tool_choice": "required", "seed": 7}
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert whole and [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ] == _streamed_calls(client, ask)


@pytest.mark.parametrize(
    ("parser", "cut", "arguments"),
    [
        ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": "x', {"a": "x"}),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "mul", "arguments": {"b": [true, "q',
            {"b": [True, "q"]},
        ),
        ("pythonic", '[add(a="x', None),
        ("qwen25", '<tool_call>\n{"name": "add", "arguments": {"a": "x', {"a": "x"}),
        ("hermes", '<tool_call>{"name": "mul", "parameters": {"b": [1, "q', {"b": [1, "q"]}),
        ("deepseekv3", f'{SECTION}{BEGIN}function{SEP}add\n```json\n{{"a": "x', {"a": "x"}),
        ("deepseekv31", f'{SECTION}{BEGIN}mul{SEP}{{"b": [1, "q', {"b": [1, "q"]}),
    ],
)
def test_a_call_cut_short_is_closed_by_its_last_piece(parser: str, cut: str, arguments) -> None:
    """serving_chat._check_for_unstreamed_tool_args: at the end, the rest of the last call's
    partial arguments (their JSON, what is open closed); pythonic sends a call whole or not at
    all, so nothing is left."""
    stream = StreamingToolCalls(ToolCallParser(OFFERED, parser))
    pieces = []
    for ch in cut:
        pieces += stream.feed(ch)[1]
    stream.flush()
    pieces += stream.unsent()
    if arguments is None:
        assert pieces == []
        return
    assert json.loads("".join(p["arguments"] for p in pieces)) == arguments
    assert stream.unsent() == []  # once


# ---- deepseek --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["deepseekv3", "deepseekv31", "deepseekv32"])
def deepseek_engine(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Engine]:
    """DeepSeek's tool-call tokens tokens of their own, and their characters too, so that text
    with them is encoded (a forced call's frame; V3.2's DSML tags are text)."""
    chars, words = CHARS + "`\uff5c\u2581DSML", (SECTION, SECTION_END, BEGIN, SEP, END)
    yield from _format_engine(request.param, tmp_path_factory, chars, words)


@pytest.mark.timeout(180)
def test_a_forced_tool_choice_answers_with_deepseek_calls(deepseek_engine: Engine) -> None:
    """tool_choice required or named with deepseekv3 / deepseekv31 / deepseekv32: constrained by
    the structural tag of the detector's structure_info (deepseekv3_detector.py: the section
    marker, the call's tokens, "function", the name, a json code block; deepseekv31_detector.py:
    the call's tokens around the name and the JSON, triggered by the call's begin token;
    deepseekv32: DeepSeek V3.2's own tag, as SGLang's detector gets it from xgrammar, DSML
    invokes whose parameters are DSML parameter tags: native_tags.py), read back as calls (bare
    calls too: stages.engine.deepseek_calls, dsml_calls), streamed in pieces that add up to
    them; a strict tool's arguments follow its parameters."""
    from stages.engine.deepseek_calls import FRAMES

    parser = deepseek_engine.parser  # type: ignore[attr-defined]
    client = openai.OpenAI(base_url=deepseek_engine.url + "/v1", api_key="unused", max_retries=0)
    # V3.2's parameter tags take a few hundred characters (a token each here) a call, and its
    # reader takes none from a block never closed: one call, the block closed after it
    ask = {**ASK, "max_tokens": 120, "tools": TOOLS}
    if parser == "deepseekv32":
        ask.update(max_tokens=400, parallel_tool_calls=False)
    for calls in _forced_answers(client, ask):
        # (a V3.2 parameter marked string="true", which xgrammar's tag leaves to the model, is
        # read as its text: SGLang's detector)
        values = [v for c in calls for v in json.loads(c.function.arguments).values()]
        assert all(0 <= int(v) <= 9 for v in values), calls
    native = _forced_sampling(deepseek_engine, parser)
    tag = json.loads(native["structural_tag"])
    if parser == "deepseekv32":
        calls = tag["format"]["elements"][1]
        assert calls["at_least_one"] is True
        assert calls["tags"][1]["begin"] == f'<{DSML}invoke name="mul">\n'
        assert calls["tags"][1]["content"]["json_schema"] == TOOLS[1]["function"]["parameters"]
    else:
        before, _, after, end, trigger = FRAMES[parser]
        assert tag["triggers"] == [trigger] and tag["at_least_one"] is True
        assert tag["structures"][1] == {
            "begin": before + "mul" + after,
            "schema": TOOLS[1]["function"]["parameters"],
            "end": end,
        }
    _streamed_as_whole(client, {**ask, "tool_choice": "required", "seed": 7})


def _deepseek(parser: str, *calls: tuple[str, str], before: str = "", after: str = "") -> str:
    """An answer of ``calls`` ``(name, arguments' text)`` as DeepSeek V3 or V3.1 writes it."""
    if parser == "deepseekv3":
        body = [f"{BEGIN}function{SEP}{n}\n```json\n{a}\n```{END}" for n, a in calls]
    else:
        body = [f"{BEGIN}{n}{SEP}{a}{END}" for n, a in calls]
    return before + SECTION + "\n".join(body) + SECTION_END + after


@pytest.mark.parametrize("parser", ["deepseekv3", "deepseekv31"])
def test_deepseek_reads_calls_between_its_tokens(parser: str) -> None:
    """deepseekv3_detector.py / deepseekv31_detector.py detect_and_parse: the content is the
    text before the section marker, stripped; each call's name and JSON arguments
    (parse_base_json: a tool not offered dropped, falsy arguments as {}); an answer with a call
    that is not JSON has no calls and its text as it is; the text after the calls is dropped;
    the chat choice has them as tool_calls, finish_reason tool_calls."""
    text = _deepseek(
        parser, ("add", '{"a": 1, "s": "é"}'), ("ghost", "{}"), ("mul", "null"),
        before="Let me add. ", after=" done",
    )  # fmt: skip
    assert _whole(parser, text) == (
        "Let me add.", [_call("add", '{"a": 1, "s": "é"}'), _call("mul", "{}")]
    )  # fmt: skip
    broken = _deepseek(parser, ("add", '{"a": 1}'), ("mul", '{"b": 2'))
    assert _whole(parser, broken) == (broken, [])
    assert _whole(parser, "no calls here ") == ("no calls here ", [])
    choice = _chat(parser, text)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me add."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add", "mul"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("parser", ["deepseekv3", "deepseekv31"])
def test_deepseek_streams_as_the_whole_answer_reads(parser: str, step: int) -> None:
    """Streamed: content up to the calls (a marker's start held back), each call named once its
    name is whole, its arguments in pieces that add up to the whole answer's, nothing of the
    text after them; a V3.1 answer of bare calls (what its structural tag forces) read as
    calls, whole and streamed, as SGLang's stream reads it."""
    text = _deepseek(
        parser, ("add", '{"a": [1, {"b": "x y"}], "c": true}'), ("ghost", '{"z": 1}'),
        ("mul", '{"b": 2}'), before="Sure <", after=" bye",
    )  # fmt: skip
    content, pieces, named = _stream(parser, text, step)
    want = _whole(parser, text)
    assert (content, _calls_of(pieces), named) == (want[0], want[1], 2)
    assert pieces[0] == {"index": 0, "name": "add", "arguments": ""}
    bare = text.replace(SECTION, "").replace(SECTION_END, "")
    assert _whole(parser, bare)[1] == want[1]
    assert _calls_of(_stream(parser, bare, step)[1]) == want[1]


# ---- kimi_k2 -----------------------------------------------------------------------------------

KIMI_TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {}, "b": {}}}}},
]  # fmt: skip


def _kimi(*calls: tuple[str, str], before: str = "", after: str = "") -> str:
    """An answer of ``calls`` ``(id, arguments' text)`` as Kimi K2 writes it."""
    body = "".join(f"{KIMI_BEGIN}{i}{KIMI_ARGUMENTS}{a}{KIMI_END}" for i, a in calls)
    return f"{before}{KIMI_SECTION}{body}{KIMI_SECTION_END}{after}"


def test_kimi_k2_names_calls_by_their_id_or_their_arguments() -> None:
    """kimik2_detector.py detect_and_parse: the content is the text before the section marker,
    as it is; a call's name from its id (functions.NAME:N, NAME:N), or for a bare counter (or no
    id) the only tool's or the one whose properties best match its arguments' keys
    (_infer_tool_name); an id of neither kind drops the call; the arguments as written; a name
    not offered kept; tool_index the call's place (listed)."""
    reader = ToolCallParser(KIMI_TOOLS, "kimi_k2")
    text = _kimi(
        ("functions.get:0", '{"city": "Oslo"}'), ("7", '{"a": 1, "b":2}'), ("odd id", "{}"),
        (" add:3 ", ' {"a": {"b": 1}} '), ("functions.launch:1", "{}"), ("4", '{"zz": 1}'),
        before="Checking. ", after=" done",
    )  # fmt: skip
    content, calls = reader.parse(text)
    assert content == "Checking. "
    assert calls == [
        _call("get", '{"city": "Oslo"}'), _call("add", '{"a": 1, "b":2}'),
        _call("add", '{"a": {"b": 1}}'), _call("launch", "{}"),
    ]  # fmt: skip
    assert reader.indexed(text, {})[1][2] == (2, _call("add", '{"a": {"b": 1}}'))
    only = ToolCallParser(KIMI_TOOLS[:1], "kimi_k2")
    assert only.parse(_kimi(("0", '{"x": 1}')))[1] == [_call("get", '{"x": 1}')]
    assert reader.parse("no section " + KIMI_BEGIN) == ("no section " + KIMI_BEGIN, [])


@pytest.mark.parametrize("step", STEPS)
def test_kimi_k2_streams_as_the_whole_answer_reads(step: int) -> None:
    """Streamed: content up to the section marker, each call named once its id is whole (a bare
    counter with several tools: once its arguments are), its arguments as written in pieces,
    nothing of the text after the calls."""
    text = _kimi(
        ("functions.get:0", '{"city": "Oslo, \\"N\\""}'), ("5", '{"a": [1, 2]}'),
        ("functions.add:2", '{"b": 3}'), before="Sure <", after=" bye",
    )  # fmt: skip
    stream = StreamingToolCalls(ToolCallParser(KIMI_TOOLS, "kimi_k2"))
    content, pieces = "", []
    for i in range(0, len(text), step):
        more, new = stream.feed(text[i : i + step])
        content += more
        pieces += new
    content += stream.flush()
    assert (content, _calls_of(pieces)) == ToolCallParser(KIMI_TOOLS, "kimi_k2").parse(text)
    assert pieces[0] == {"index": 0, "name": "get", "arguments": ""}


def test_kimi_k2_call_ids_count_the_conversations_calls() -> None:
    """serving_chat._process_tool_call_id for kimi_k2: functions.NAME:K, K the calls of the
    request's assistant messages before (_get_history_tool_calls_cnt) plus the call's place;
    streamed too (the first piece of each call)."""
    earlier = {"id": "functions.get:0", "type": "function",
               "function": {"name": "get", "arguments": "{}"}}  # fmt: skip
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "tool_calls": [earlier, earlier | {"id": "x"}]},
        {"role": "tool", "content": "1", "tool_call_id": "functions.get:0"},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "user", "content": "b"},
    ]
    assert history_calls(messages) == 2
    options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True,
               "tools": KIMI_TOOLS, "tool_parser": "kimi_k2", "kimi_ids_from": 2, "stream": True,
               "include_usage": False, "continuous_usage_stats": False}  # fmt: skip
    text = _kimi(("functions.get:0", '{"city": "Oslo"}'), ("functions.add:1", '{"a": 1}'))
    done = _native(text, {"type": "stop", "matched": 1})
    (choice,) = chat_response([done], options)["choices"]
    want = ["functions.get:2", "functions.add:3"]
    assert [c["id"] for c in choice["message"]["tool_calls"]] == want

    async def run() -> list[dict]:
        async def batches():
            yield [_native(text[: len(text) // 2], None)]
            yield [done]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(run()) if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert [c["id"] for c in calls if c["id"]] == want
    options["kimi_ids_from"] = None  # another parser: fresh ids
    (choice,) = chat_response([done], options)["choices"]
    assert all(c["id"].startswith("call_") for c in choice["message"]["tool_calls"])


@pytest.fixture(scope="module")
def kimi_engine(tmp_path_factory) -> Iterator[Engine]:
    """Kimi K2's tool-call tokens tokens of their own."""
    words = (KIMI_SECTION, KIMI_SECTION_END, KIMI_BEGIN, KIMI_ARGUMENTS, KIMI_END)
    yield from _format_engine("kimi_k2", tmp_path_factory, CHARS, words)


@pytest.mark.timeout(180)
def test_a_forced_tool_choice_answers_with_kimi_calls(kimi_engine: Engine) -> None:
    """tool_choice required or named with kimi_k2: constrained by Kimi's own structural tag, as
    SGLang 0.5.23's detector gets it from xgrammar (``get_model_structural_tag("kimi")``, in
    the newer form: one section of calls, each with its index as ``\\d+``; native_tags.py);
    read back with ids counting the conversation's calls; streamed in pieces that add up to
    them."""
    client = openai.OpenAI(base_url=kimi_engine.url + "/v1", api_key="unused", max_retries=0)
    earlier = {"id": "functions.add:0", "type": "function",
               "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    messages = [*ASK["messages"], {"role": "assistant", "content": "", "tool_calls": [earlier]},
                {"role": "tool", "content": "3", "tool_call_id": "functions.add:0"}]  # fmt: skip
    ask = {**ASK, "messages": messages, "max_tokens": 400, "tools": TOOLS}
    for calls in _forced_answers(client, ask):
        assert [c.id for c in calls] == [f"functions.{c.function.name}:{1 + k}"
                                         for k, c in enumerate(calls)]  # fmt: skip
    native = _forced_sampling(kimi_engine, "kimi_k2")
    first, calls, last = json.loads(native["structural_tag"])["format"]["elements"]
    assert first["value"] == KIMI_SECTION and last["value"] == KIMI_SECTION_END
    assert calls["type"] == "tags_with_separator" and calls["at_least_one"] is True
    assert calls["tags"][1]["begin"] == f"{KIMI_BEGIN}functions.mul:"
    index, arguments, schema = calls["tags"][1]["content"]["elements"]
    assert index["pattern"] == r"\d+" and arguments["value"] == KIMI_ARGUMENTS
    assert schema["json_schema"] == TOOLS[1]["function"]["parameters"]
    _streamed_as_whole(client, {**ask, "tool_choice": "required", "seed": 7})


@pytest.fixture(scope="module")
def coder_engine(tmp_path_factory) -> Iterator[Engine]:
    """Qwen3-Coder's call tags tokens of their own."""
    yield from _format_engine(
        "qwen3_coder", tmp_path_factory, CHARS, ("<tool_call>", "</tool_call>")
    )


@pytest.mark.timeout(180)
def test_a_forced_tool_choice_answers_with_qwen3_coder_calls(coder_engine: Engine) -> None:
    """tool_choice required or named with qwen3_coder: constrained by Qwen3-Coder's own
    structural tag, as SGLang 0.5.23's detector gets it from xgrammar (``qwen_3_coder``: each
    call ``<tool_call>\\n<function=NAME>\\n`` its parameters in the qwen_xml style; the engine
    used to answer with SGLang's JSON array, as SGLang without xgrammar would); read back as
    calls whose arguments follow the tools' schemas; streamed in pieces that add up to them."""
    client = openai.OpenAI(base_url=coder_engine.url + "/v1", api_key="unused", max_retries=0)
    ask = {**ASK, "tools": TOOLS}
    for calls in _forced_answers(client, ask):
        for call in calls:
            arguments = json.loads(call.function.arguments)
            assert all(type(v) is int and 0 <= v <= 9 for v in arguments.values()), call
    native = _forced_sampling(coder_engine, "qwen3_coder")
    tag = json.loads(native["structural_tag"])["format"]
    assert tag["type"] == "triggered_tags" and tag["at_least_one"] is True
    assert tag["tags"][1]["begin"] == "<tool_call>\n<function=mul>\n"
    assert tag["tags"][1]["content"]["style"] == "qwen_xml"
    _streamed_as_whole(client, {**ask, "tool_choice": "required", "seed": 7})


def test_a_native_tag_the_grammars_cannot_mean_falls_back_to_the_frame_and_says_so() -> None:
    """A tool whose parameters the XML styles cannot be written for here (a union of an object
    and a string): the forced calls are constrained as before these tags (Qwen3-Coder:
    SGLang's JSON array; DeepSeek V3.2: its frame's legacy tag), and a warning names why;
    definitions the parameters refer to are followed."""
    from stages.engine.native_tags import served_tag
    from stages.engine.tool_calls import forced_calls

    union = {"anyOf": [{"type": "object"}, {"type": "string"}]}
    tools = [{"type": "function", "function": {"name": "get", "strict": True, "parameters": {
        "type": "object", "properties": {"q": union}}}}]  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        assert served_tag("qwen3_coder", tools, "required") is None
    (warning,) = [e for e in logs if e["event"] == "native_tool_tag_not_served"]
    assert warning["parser"] == "qwen3_coder" and "anyOf" in warning["reason"]
    assert set(forced_calls(tools, "qwen3_coder", named=False, parallel=True)) == {"json_schema"}
    legacy = json.loads(forced_calls(tools, "deepseekv32", named=False, parallel=True)[
        "structural_tag"])  # fmt: skip
    assert "structures" in legacy
    refs = {"type": "object", "properties": {"q": {"$ref": "#/$defs/Q"}}, "$defs": {"Q": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip
    tools[0]["function"]["parameters"] = refs
    assert served_tag("qwen3_coder", tools, "required") is not None


# ---- glm45 ---------------------------------------------------------------------------------------

GLM_PROPERTIES = {"city": {"type": "string"}, "days": {"type": "integer"},
                  "temp": {"type": "number"}, "opts": {"type": "object"},
                  "tags": {"type": "string"}}  # fmt: skip
GLM_TOOLS = [
    {"type": "function", "function": {
        "name": "get", "parameters": {"type": "object", "properties": GLM_PROPERTIES}}},
]  # fmt: skip
GLM = ("Checking.\n<tool_call>get\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>temp</arg_key>\n"
       '<arg_value>"21.5"</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{"a": [1, 2]}'
       '</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["x"]</arg_value>\n'
       "<arg_key>more</arg_key>\n<arg_value>{'k': (1, 2)}</arg_value>\n</tool_call>\n"
       "<tool_call>ghost\n</tool_call> after")  # fmt: skip


def test_glm45_reads_each_value_by_its_parameters_type() -> None:
    """glm4_moe_detector.py detect_and_parse and parse_arguments: the content before the first
    <tool_call>, stripped; the name line; each value as JSON (a number type's JSON string made a
    number), a string type keeping text and writing a list back as JSON, an undeclared one read
    as a Python literal; a tool not offered dropped; a value JSON cannot write (a set) leaves
    the whole answer unread."""
    reader = ToolCallParser(GLM_TOOLS, "glm45")
    content, calls = reader.parse(GLM)
    assert content == "Checking."
    assert [c["name"] for c in calls] == ["get"]
    assert json.loads(calls[0]["arguments"]) == {
        "city": "北京", "days": 3, "temp": 21.5, "opts": {"a": [1, 2]}, "tags": '["x"]',
        "more": {"k": [1, 2]},
    }  # fmt: skip
    unreadable = "<tool_call>get\n<arg_key>x</arg_key><arg_value>{1, 2}</arg_value></tool_call>"
    assert reader.parse(unreadable) == (unreadable, [])


@pytest.mark.parametrize("step", STEPS)
def test_glm45_streams_as_the_whole_answer_reads(step: int) -> None:
    """Streamed: content up to the first <tool_call>, the call named once its name line is whole,
    its arguments as its pairs close, adding up to the whole answer's; nothing after."""
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "glm45"))
    content, pieces = "", []
    for i in range(0, len(GLM), step):
        more, new = stream.feed(GLM[i : i + step])
        content += more
        pieces += new
    content += stream.flush()
    assert (content, _calls_of(pieces)) == ToolCallParser(GLM_TOOLS, "glm45").parse(GLM)
    assert pieces[0] == {"index": 0, "name": "get", "arguments": ""}
    cut = GLM[: GLM.index("<arg_key>temp")]  # cut short: its closed pairs, closed
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "glm45"))
    pieces = stream.feed(cut)[1]
    stream.flush()
    pieces += stream.unsent()
    assert json.loads("".join(p["arguments"] for p in pieces)) == {"city": "北京", "days": 3}


LING3 = ("Sure. <tool_call> get\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
         "<tool_call>get<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
         "<tool_call>get</tool_call>")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_ling3_reads_glm_calls_with_or_without_the_names_newline(step: int) -> None:
    """ling3_detector.py: GLM-4.5's reading, the name after any space and up to a newline, the
    first <arg_key> or </tool_call> (glm45 needs the newline); streamed, the same calls."""
    reader = ToolCallParser(GLM_TOOLS, "ling3")
    content, calls = reader.parse(LING3)
    assert content == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get", {"days": 3}), ("get", {"city": "Oslo"}), ("get", {})
    ]  # fmt: skip
    assert [c["name"] for c in ToolCallParser(GLM_TOOLS, "glm45").parse(LING3)[1]] == []
    content, pieces = _feed(StreamingToolCalls(ToolCallParser(GLM_TOOLS, "ling3")), LING3, step)
    assert _calls_of(pieces) == calls and content.strip() == "Sure."


IQUEST = ("ok <iquest_tool_call>get<arg_key>days</arg_key><arg_value>3</arg_value>"
          '<arg_key>city</arg_key><arg_value>"Oslo"</arg_value></iquest_tool_call> mid '

          "<iquest_tool_call>get stray<arg_key>days</arg_key><arg_value>1</arg_value>x"
          "</iquest_tool_call><iquest_tool_call>ghost</iquest_tool_call> end")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_iquest_q1_reads_glm47_pairs_between_its_own_tags(step: int) -> None:
    """iquest_q1_detector.py: a call a block whose name and pairs hold nothing else, values
    read as GLM-4.7's, a string keeping its text as written (quotes too); a block with stray
    text stays in the content, a tool not offered is dropped but taken out; the content not
    stripped; streamed: the same content and calls, each call at its end tag."""
    reader = ToolCallParser(GLM_TOOLS, "iquest_q1")
    content, listed = reader.indexed(IQUEST, {})
    assert content == (
        "ok  mid <iquest_tool_call>get stray<arg_key>days</arg_key><arg_value>1</arg_value>x"
        "</iquest_tool_call> end"
    )
    assert listed == [(0, {"name": "get", "arguments": '{"days": 3, "city": "\\"Oslo\\""}'})]
    streamed, pieces = _feed(
        StreamingToolCalls(ToolCallParser(GLM_TOOLS, "iquest_q1")), IQUEST, step
    )
    assert (streamed, _calls_of(pieces)) == (content, [listed[0][1]])
    cut = "a <iquest_tool_call>get<arg_key>days</arg_key>"
    assert _feed(StreamingToolCalls(ToolCallParser(GLM_TOOLS, "iquest_q1")), cut, step) == (cut, [])


def test_a_forced_iquest_q1_call_to_a_named_tool_is_its_arguments() -> None:
    """iquest_q1_detector.py IQuestQ1JsonToolParser: a named tool_choice constrains the answer to
    that tool's parameters and reads it as its arguments, as written (streamed: the name, then
    the text); required: SGLang's JSON array of calls."""
    from stages.engine.tool_calls import answer_format

    named = forced_calls(GLM_TOOLS, "iquest_q1", named=True, parallel=True)
    assert json.loads(named["json_schema"]) == GLM_TOOLS[0]["function"]["parameters"]
    assert answer_format("iquest_q1", named, named=True) == "json_arguments"
    required = forced_calls(GLM_TOOLS, "iquest_q1", named=False, parallel=True)
    assert json.loads(required["json_schema"])["type"] == "array"
    assert answer_format("iquest_q1", required) == "json_array"
    reader = ToolCallParser(GLM_TOOLS, "json_arguments")
    assert reader.parse('{"days": 3,  "city": "Oslo"}') == (
        "", [{"name": "get", "arguments": '{"days": 3,  "city": "Oslo"}'}]
    )  # fmt: skip
    assert reader.parse("[1]") == ("[1]", [])
    stream = StreamingToolCalls(reader)
    pieces = stream.feed('{"days":')[1] + stream.feed(" 3}")[1]
    assert _calls_of(pieces) == [{"name": "get", "arguments": '{"days": 3}'}]


COHERE = ('Sure <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get", "parameters": '
          '{"days": 3}}, {"tool_name": "ghost", "parameters": {}}, {"name": "get", "parameters":'
          ' 0, "arguments": {"city": "Oslo"}}]<|END_ACTION|> after')  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_cohere_command4_reads_its_action_block(step: int) -> None:
    """cohere_command4_detector.py: the content before <|START_ACTION|>, the block's JSON array
    of {tool_name or name, parameters} (a falsy parameters: its arguments), a tool not offered
    dropped, the text after the block dropped; a block cut short read as far as its JSON
    closes; not JSON: no calls; streamed, the same (calls at <|END_ACTION|>); a forced choice
    gets SGLang's JSON array; the template's own tag picks the format."""
    tools = [*GLM_TOOLS, {"type": "function", "function": {"name": "ghost2"}}]
    reader = ToolCallParser(tools, "cohere_command4")
    content, calls = reader.parse(COHERE)
    assert content == "Sure "
    assert calls == [{"name": "get", "arguments": '{"days": 3}'},
                     {"name": "get", "arguments": '{"city": "Oslo"}'}]  # fmt: skip
    cut = COHERE[: COHERE.index(', {"tool_name": "ghost"') + 5]
    assert reader.parse(cut) == ("Sure ", calls[:1])
    assert reader.parse("x<|START_ACTION|>not json<|END_ACTION|>") == ("x", [])
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(tools, "cohere_command4")), COHERE,
                             step)  # fmt: skip
    assert (streamed, _calls_of(pieces)) == (content, calls)
    forced = forced_calls(GLM_TOOLS, "cohere_command4", named=False, parallel=True)
    assert set(forced) == {"json_schema"}


G = "\uff5cGCML\uff5c"  # GigaChat 3.5's GCML marker
GCML = (f'Sure</s>\n<{G}tool_calls><{G}invoke name="get"><{G}parameter name="city" string="true">'
        f'Oslo</{G}parameter><{G}parameter name="days" string="false">3</{G}parameter></{G}invoke>'
        f'<{G}invoke name="ghost"></{G}invoke></{G}tool_calls>')  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_gigachat35_reads_gcml_invokes(step: int) -> None:
    """gigachat35_detector.py: each closed invoke a call (string="true": the text; else JSON),
    a tool not offered dropped; the content before the block less its trailing </s> and
    newline; a block without an invoke leaves the whole answer content; streamed, the same."""
    reader = ToolCallParser(GLM_TOOLS, "gigachat35")
    content, calls = reader.parse(GCML)
    assert (content, calls) == (
        "Sure",
        [{"name": "get", "arguments": '{"city": "Oslo", "days": 3}'}],
    )
    assert reader.parse(f"x</s><{G}tool_calls>junk") == (f"x</s><{G}tool_calls>junk", [])
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "gigachat35"))
    streamed, pieces = _feed(stream, GCML, step)
    assert (streamed, _calls_of(pieces)) == (content, calls)
    assert template_parsers(f"{{{{ '<{G}tool_calls>' }}}}")["tool_call_parser"] == "gigachat35"


APERTUS = (' Sure <|tools_prefix|>[{"get": {"days": 3}}, {"ghost": {}}, "x", {"get": null}]'
           '<|tools_suffix|> mid <|tools_prefix|>[bad<|tools_suffix|> end')  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_apertus2509_reads_its_blocks_of_named_objects(step: int) -> None:
    """apertus2509_detector.py: each block a JSON list of {NAME: arguments} objects (null: {}),
    a tool not offered and an item that is no object skipped, calls numbered in order; a block
    that is not JSON makes the rest content; the content the text outside the blocks, stripped;
    streamed, the same; a forced choice framed as its structure_info; the template's tag picks
    the format."""
    content, listed = ToolCallParser(GLM_TOOLS, "apertus2509").indexed(APERTUS, {})
    assert content == "Sure  mid <|tools_prefix|>[bad<|tools_suffix|> end"
    assert listed == [(0, {"name": "get", "arguments": '{"days": 3}'}),
                      (1, {"name": "get", "arguments": "{}"})]  # fmt: skip
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "apertus2509"))
    streamed, pieces = _feed(stream, APERTUS, step)
    assert (streamed.lstrip(), _calls_of(pieces)) == (content, [c for _, c in listed])
    tag = json.loads(
        forced_calls(GLM_TOOLS, "apertus2509", named=False, parallel=True)["structural_tag"]
    )
    assert tag["structures"][0]["begin"] == '<|tools_prefix|>[{"get": '
    assert tag["structures"][0]["end"] == "}]<|tools_suffix|>"
    assert tag["triggers"] == ["<|tools_prefix|>"]


SPARK_TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
    "o": {"type": "object"}, "s": {"type": "string"}}}}}]  # fmt: skip
SPARK = ("a <tool_call>get\n<arg_key>n</arg_key><arg_value>7</arg_value><arg_key>x</arg_key>"
         "<arg_value>2.0</arg_value><arg_key>ok</arg_key><arg_value>1</arg_value><arg_key>o"
         '</arg_key><arg_value>{"k": 1}</arg_value><arg_key>s</arg_key><arg_value>NULL</arg_value>'
         "<arg_key></arg_key><arg_value>y</arg_value>\n</tool_call> b <tool_call> </tool_call>"
         "<tool_call>ghost</tool_call> c")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_spark25_reads_values_by_their_declared_type(step: int) -> None:
    """spark25_detector.py _convert_value: an integer, a whole number as an integer, 1 as true,
    an object as JSON, null in any case null, an empty key skipped, compact JSON; a block without
    a name content, a tool not offered dropped and taken out; streamed, the same; a forced
    choice not constrained (parses_required_natively) and read in the format."""
    content, listed = ToolCallParser(SPARK_TOOLS, "spark25").indexed(SPARK, {})
    assert content == "a  b <tool_call> </tool_call> c"
    assert listed == [
        (0, {"name": "get", "arguments": '{"n":7,"x":2,"ok":true,"o":{"k":1},"s":null}'})
    ]
    stream = StreamingToolCalls(ToolCallParser(SPARK_TOOLS, "spark25"))
    streamed, pieces = _feed(stream, SPARK, step)
    assert (streamed, _calls_of(pieces)) == (content, [listed[0][1]])
    assert forced_calls(SPARK_TOOLS, "spark25", named=False, parallel=True) == {}


S3 = "<\uff5c{}\uff5c>".format  # Step-3's special tokens
STEP3 = (f"Sure {S3('tool_calls_begin')}{S3('tool_call_begin')}function{S3('tool_sep')}"
         '<steptml:invoke name="get"><steptml:parameter name="days"> 3 </steptml:parameter>'
         '<steptml:parameter name="city">"Oslo"</steptml:parameter></steptml:invoke>'
         f"{S3('tool_call_end')}{S3('tool_call_begin')}tool{S3('tool_sep')}"
         '<steptml:invoke name="get">x</steptml:invoke>'
         f"{S3('tool_call_end')}{S3('tool_calls_end')} after")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_step3_reads_steptml_invokes(step: int) -> None:
    """step3_detector.py: calls of type function in a closed section, a value JSON where its
    type is not string (a string keeps its quotes), stripped; the content before and after the
    section; a section never closed leaves the text content; streamed, the same."""
    reader = ToolCallParser(GLM_TOOLS, "step3")
    content, calls = reader.parse(STEP3)
    assert (content, calls) == ("Sure  after", [{"name": "get",
                                "arguments": '{"days": 3, "city": "\\"Oslo\\""}'}])  # fmt: skip
    cut = STEP3[: STEP3.index(S3("tool_calls_end"))]
    assert reader.parse(cut) == (cut, [])
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(GLM_TOOLS, "step3")), STEP3, step)
    assert (streamed, _calls_of(pieces)) == (content, calls)


POOLSIDE = ("Sure\n<tool_call>get\n<arg_key>days</arg_key>\n<arg_value>\n3\n</arg_value>\n"
            "<arg_key>city</arg_key><arg_value>\nOslo\n\n</arg_value><arg_key>more</arg_key>"
            "<arg_value>{1, 2}</arg_value></tool_call><tool_call>ghost</tool_call> x")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_poolside_v1_reads_values_by_their_declared_type(step: int) -> None:
    """poolside_v1_detector.py: the content before the first call as it is, the name up to its
    newline or first <arg_key>, one newline off each end of a value, an integer read as JSON, a
    string kept, an undeclared value JSON or the text (a Python set is not JSON: the text); a tool
    not offered dropped; streamed, the same."""
    reader = ToolCallParser(GLM_TOOLS, "poolside_v1")
    content, calls = reader.parse(POOLSIDE)
    assert (content, calls) == ("Sure\n", [{"name": "get",
        "arguments": '{"days": 3, "city": "Oslo\\n", "more": "{1, 2}"}'}])  # fmt: skip
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "poolside_v1"))
    assert _feed(stream, POOLSIDE, step) == (content, [
        {"index": 0, "name": "get", "arguments": ""},
        {"index": 0, "name": None, "arguments": calls[0]["arguments"]},
    ])  # fmt: skip


DOTS_TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "$defs": {"n": {"type": "number"}},
        "properties": {"days": {"type": "integer"}, "temp": {"$ref": "#/$defs/n"},
                       "ok": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
                       "opts": {"type": "object"}, "city": {"type": "string"}}}}},
]  # fmt: skip
DOTS = ('  Sure \n<dots_function_call>\n<invoke name="get">\n'
        "<parameter name=days> 3 </parameter>\n<parameter name='temp'>2.0</parameter>"
        "<parameter name=ok>1</parameter>"
        '<parameter name="opts">{"a": [1]}</parameter><parameter name="city">NULL</parameter>'
        "<parameter name=x>{bad</parameter></invoke>\n<invoke name=ghost></invoke>\n"
        "</dots_function_call> between <dots_function_call>"
        '{"name": "get", "arguments": {"days": 1}}</dots_function_call>'
        "<dots_function_call>{bad}</dots_function_call> after")  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_dots_reads_invokes_and_json_calls_in_its_blocks(step: int) -> None:
    """dots_detector.py: the content the text before the first block, stripped; an invoke's
    values by their parameter's type ($ref and anyOf followed; a whole number an integer,
    booleans "1", "null" in any case None, an undeclared one kept), names unquoted; a block of
    one JSON call; a tool not offered dropped, a block that is not JSON none; streamed, the
    same; a forced choice SGLang's JSON array (no structural tag)."""
    from stages.engine.tool_calls import answer_format, forced_calls

    reader = ToolCallParser(DOTS_TOOLS, "dots")
    content, calls = reader.parse(DOTS)
    first = '{"days": 3, "temp": 2, "ok": true, "opts": {"a": [1]}, "city": null, "x": "{bad"}'
    assert (content, calls) == ("Sure", [{"name": "get", "arguments": first},
                                         {"name": "get", "arguments": '{"days": 1}'}])  # fmt: skip
    assert reader.parse("no calls ") == ("no calls ", [])
    stream = StreamingToolCalls(ToolCallParser(DOTS_TOOLS, "dots"))
    streamed, pieces = _feed(stream, DOTS, step)
    assert (streamed.strip(), _calls_of(pieces)) == (content, calls)
    forced = forced_calls(DOTS_TOOLS, "dots", named=False, parallel=True)
    assert answer_format("dots", forced) == "json_array"


CPM_TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}},
]  # fmt: skip
CPM = ('Sure <function name="get"><param name="city"> 北京 </param><param name="days">3'
       "</param><param name='opts'>{'k': (1, 2)}</param></function> and "
       '<function name="get"><param name="days">1</param></function> then '
       '<function name="get"><param name="city">a</param><param name="bogus">1</param>'
       '</function><function name="free"><param name="n"><![CDATA[1 < 2]]></param></function>'
       '<function name="free"><param name="n">&zz;</param></function> end')  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_minicpm5_reads_xml_calls_and_keeps_the_rest_as_content(step: int) -> None:
    """minicpm5_detector.py: each <function> block read as XML (a value kept as text where its
    type is string, else JSON or a Python literal), else by patterns (an undefined entity: the
    value as written); a block without the tool's required keys, with a key it does not
    declare, or to a tool not offered stays in the content, the rest of which is as it is;
    streamed, the same."""
    reader = ToolCallParser(CPM_TOOLS, "minicpm5")
    content, calls = reader.parse(CPM)
    assert content == (
        'Sure  and <function name="get"><param name="days">1</param></function> then '
        '<function name="get"><param name="city">a</param><param name="bogus">1</param>'
        "</function> end"
    )
    assert calls == [
        {"name": "get", "arguments": '{"city": "北京", "days": 3, "opts": {"k": [1, 2]}}'},
        {"name": "free", "arguments": '{"n": "1 < 2"}'},
        {"name": "free", "arguments": '{"n": "&zz;"}'},
    ]
    stream = StreamingToolCalls(ToolCallParser(CPM_TOOLS, "minicpm5"))
    assert _feed(stream, CPM, step)[0] == content
    unreadable = '<function name="free"><param name="n">{1, 2}</param></function>'
    assert reader.parse(unreadable) == (unreadable, [])  # a set is no JSON: no calls


def test_gigachat3_reads_its_one_json_call_to_the_end() -> None:
    """gigachat3_detector.py: the JSON call after "function call<|role_sep|>" and a newline to the
    end of the answer (a trailing </s> off), the content before <|message_sep|>; JSON that is not
    a call: no calls; not JSON: the whole answer content; streamed, the call at the end."""
    reader = ToolCallParser(GLM_TOOLS, "gigachat3")
    call = 'Sure<|message_sep|>function call<|role_sep|>\n{"name": "get", "arguments": {"days": 3}}'
    call += "</s>"
    assert reader.parse(call) == ("Sure", [{"name": "get", "arguments": '{"days": 3}'}])
    assert reader.parse("a<|function_call|>[1]") == ("a", [])
    assert reader.parse("a<|function_call|>{bad") == ("a<|function_call|>{bad", [])
    stream = StreamingToolCalls(ToolCallParser(GLM_TOOLS, "gigachat3"))
    content, pieces = _feed(stream, call, 5)
    assert (content, _calls_of(pieces + stream.unsent())) == reader.parse(call)


def test_a_forced_glm45_call_is_sglangs_json_array() -> None:
    """glm4_moe_detector.py supports_structural_tag False: a forced tool_choice gets SGLang's
    JSON schema of an array of calls, read as that array (get_structure_constraint)."""
    from stages.engine.tool_calls import answer_format, forced_calls, strict_calls

    forced = forced_calls(GLM_TOOLS, "glm45", named=False, parallel=True)
    assert set(forced) == {"json_schema"} and answer_format("glm45", forced) == "json_array"
    strict = [{"type": "function", "function": {**GLM_TOOLS[0]["function"], "strict": True}}]
    assert strict_calls(strict, "glm45") is None


def test_trinity_reads_qwen_calls_with_think_tags_taken_out() -> None:
    """trinity_detector.py: Qwen 2.5's calls after <think> and </think> are taken out of the
    text (a call inside the reasoning counts), whole and streamed (each delta's tags)."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = f"<think>let me{call}</think> done"
    assert _whole("trinity", text) == ("let me", [{"name": "add", "arguments": '{"a": 1}'}])
    # a tag inside the call: Qwen 2.5's reader finds no JSON there
    closed_late = text.replace("}}\n</tool_call></think>", "}}</think>\n</tool_call>")
    assert _whole("qwen25", closed_late)[1] == []
    assert _whole("trinity", closed_late) == _whole("trinity", text)
    stream, content, pieces = StreamingToolCalls(ToolCallParser(OFFERED, "trinity")), "", []
    for delta in ("<think>", "let me", *call, "</think>", " done"):  # each tag a token
        more, new = stream.feed(delta)
        content, pieces = content + more, pieces + new
    assert content + stream.flush() == "let me"
    assert _calls_of(pieces) == [{"name": "add", "arguments": '{"a": 1}'}]


# ---- minimax-m2 ------------------------------------------------------------------------------

MINIMAX_PROPERTIES = {
    "a": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"},
    "cfg": {"type": "object"}, "s": {"type": "string"},
    "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
}  # fmt: skip
MINIMAX_TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": MINIMAX_PROPERTIES}}},
    {"type": "function", "function": {"name": "mul"}},
]  # fmt: skip


def _minimax(*calls: tuple[str, list[tuple[str, str]]]) -> str:
    body = "".join(
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
        + "</invoke>\n"
        for name, params in calls
    )
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>"


def test_minimax_m2_reads_invokes_typed_by_their_parameters() -> None:
    """minimax_m2.py detect_and_parse: each value by its parameter's types (integer, number,
    boolean words, JSON objects, text), undeclared ones as text (their newlines trimmed); a
    tool not offered dropped; the content the text outside the blocks; a nullable parameter
    null only when it says so (SGLang's makes it always null: the difference this module
    documents)."""
    reader = ToolCallParser(MINIMAX_TOOLS, "minimax-m2")
    params = [("a", "5"), ("x", "1.0"), ("on", "yes"), ("cfg", '{"k": [1]}'), ("s", "5"),
              ("opt", "7"), ("free", "\n12\n")]  # fmt: skip
    text = "Sure. " + _minimax(("add", params), ("ghost", [("a", "1")]), ("mul", [])) + " done"
    content, listed = reader.indexed(text, {"add": 0, "mul": 1})
    assert content == "Sure.  done"
    assert listed == [
        (0, {"name": "add", "arguments": '{"a": 5, "x": 1, "on": true, "cfg": {"k": [1]}, '
                                         '"s": "5", "opt": 7, "free": "12"}'}),
        (1, {"name": "mul", "arguments": "{}"}),
    ]  # fmt: skip
    assert reader.parse(_minimax(("add", [("opt", "null"), ("a", "None")])))[1] == [
        {"name": "add", "arguments": '{"opt": null, "a": null}'}
    ]
    cut = "pre " + _minimax(("add", [("a", "1")])).removesuffix("</minimax:tool_call>")
    assert reader.parse(cut) == (cut, [])  # a block never closed: content
    assert template_parsers("{{ '<minimax:tool_call>' }}")["tool_call_parser"] == "minimax-m2"
    forced = forced_calls(MINIMAX_TOOLS, "minimax-m2", named=False, parallel=True)
    assert "json_schema" in forced  # no structural tag: SGLang's JSON array


@pytest.mark.parametrize("step", STEPS)
def test_minimax_m2_streams_what_the_whole_answer_reads(step: int) -> None:
    text = "Sure. " + _minimax(
        ("add", [("a", "5"), ("cfg", '{"k": "<v>"}'), ("s", "a<b")]), ("mul", [])
    ) + " done"  # fmt: skip
    stream = StreamingToolCalls(ToolCallParser(MINIMAX_TOOLS, "minimax-m2"))
    content, pieces = "", []
    for i in range(0, len(text), step):
        more, new = stream.feed(text[i : i + step])
        content, pieces = content + more, pieces + new
    want_content, want_calls = ToolCallParser(MINIMAX_TOOLS, "minimax-m2").parse(text)
    assert content + stream.flush() == want_content
    assert _calls_of(pieces) == want_calls and len(want_calls) == 2
    # cut short inside a call: what closed went out, then unsent closes its arguments
    cut = text[: text.index("</parameter>", text.index('"s"')) - 1]
    stream = StreamingToolCalls(ToolCallParser(MINIMAX_TOOLS, "minimax-m2"))
    pieces = [p for i in range(0, len(cut), step) for p in stream.feed(cut[i : i + step])[1]]
    stream.flush()
    (call,) = _calls_of(pieces + stream.unsent())
    assert json.loads(call["arguments"]) == {"a": 5, "cfg": {"k": "<v>"}}


# ---- deepseekv32 -----------------------------------------------------------------------------

DSML = "\uff5cDSML\uff5c"


def _dsml(*invokes: str, before: str = "Sure.\n\n", closed: bool = True) -> str:
    end = f"</{DSML}function_calls>" if closed else ""
    return f"{before}<{DSML}function_calls>\n" + "".join(invokes) + end


def _invoke(name: str, body: str | None) -> str:
    if body is None:
        return f'<{DSML}invoke name="{name}"/>\n'
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'


def _param(key: str, value: str, string: bool) -> str:
    return f'<{DSML}parameter name="{key}" string="{str(string).lower()}">{value}</{DSML}parameter>'


def test_deepseekv32_reads_dsml_invokes() -> None:
    """deepseekv32_detector.py detect_and_parse: parameter tags (string="true": the text,
    stripped; else JSON, else the text), a JSON object body, a self-closing invoke; dropped: an
    invoke never closed, a body that is not an object or holds stray DSML, a tool not offered;
    the content the text before the block less its blank line; a block never closed: no
    calls."""
    params = _param("a", "1", False) + _param("s", " x ", True) + _param("q", "abc", False)
    text = _dsml(
        _invoke("add", params), _invoke("mul", '{"b": [1]}'), _invoke("add", None),
        _invoke("ghost", "{}"), _invoke("add", "[1]"), _invoke("add", params + f"<{DSML}x"),
    )  # fmt: skip
    assert _whole("deepseekv32", text) == ("Sure.", [
        {"name": "add", "arguments": '{"a": 1, "s": "x", "q": "abc"}'},
        {"name": "mul", "arguments": '{"b": [1]}'},
        {"name": "add", "arguments": "{}"},
    ])  # fmt: skip
    assert _whole("deepseekv32", _dsml(_invoke("add", "{}"), closed=False)) == ("Sure.", [])
    bare = "Hi\n\n" + _invoke("add", '{"a": 1}')  # no block: invokes from the first on
    assert _whole("deepseekv32", bare) == ("Hi", [{"name": "add", "arguments": '{"a": 1}'}])
    assert (
        template_parsers(f"{{{{ '<{DSML}function_calls>' }}}}")["tool_call_parser"] == "deepseekv32"
    )
    # forced: DeepSeek V3.2's own tag (native_tags.py, as SGLang's detector gets it from
    # xgrammar), its parameters in the deepseek_xml style; the answer it holds reads back
    tag = json.loads(forced_calls(TOOLS, "deepseekv32", named=False, parallel=True)[
        "structural_tag"])["format"]  # fmt: skip
    first, calls, last = tag["elements"]
    assert first["value"] == f"\n\n<{DSML}function_calls>\n"
    assert calls["tags"][0]["begin"] == f'<{DSML}invoke name="add">\n'
    assert calls["tags"][0]["content"]["style"] == "deepseek_xml"
    assert last["value"] == f"</{DSML}function_calls>"
    from stages.engine.structural_format import format_grammar

    answer = _dsml(_invoke("add", _param("a", "1", False) + _param("b", "2", False)), before="")
    lark = format_grammar({"format": tag}, json.dumps)
    assert lark and _whole("deepseekv32", answer)[1] == [
        {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    ]


@pytest.mark.parametrize("step", STEPS)
def test_deepseekv32_streams_what_the_whole_answer_reads(step: int) -> None:
    text = _dsml(_invoke("add", _param("a", "1", False)), _invoke("mul", None))
    content, pieces, calls = _stream("deepseekv32", text, step)
    assert (content, _calls_of(pieces)) == _whole("deepseekv32", text) and calls == 2
    # no call after all: every character is content, a stray tag and blank lines too
    plain = f"a <b>\n\n</{DSML}parameter> c\n"
    assert _stream("deepseekv32", plain, step)[:2] == (plain, [])


# ---- mimo ------------------------------------------------------------------------------------


def _mimo(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_mimo_reads_a_call_a_block_typed_by_its_parameters() -> None:
    """mimo_detector.py detect_and_parse: values HTML-unescaped and typed (integer, number,
    boolean, object, a Python literal, text); a call to a tool not offered is content, with
    the text since the block before; text between known calls and after the last dropped."""
    reader = ToolCallParser(MINIMAX_TOOLS, "mimo")
    text = (
        "Sure. " + _mimo("add", ("a", "5"), ("x", "2.0"), ("on", "TRUE"), ("cfg", "{'k': 1}"),
                         ("s", "a &lt; b"), ("opt", "null"), ("free", "x"))
        + " between " + _mimo("ghost", ("a", "1")) + " gone " + _mimo("mul") + " after"
    )  # fmt: skip
    content, listed = reader.indexed(text, {"add": 0, "mul": 1})
    assert content == "Sure.  between " + _mimo("ghost", ("a", "1"))
    assert listed == [
        (0, {"name": "add", "arguments": '{"a": 5, "x": 2, "on": true, "cfg": {"k": 1}, '
                                         '"s": "a < b", "opt": null, "free": "x"}'}),
        (1, {"name": "mul", "arguments": "{}"}),
    ]  # fmt: skip
    assert reader.parse(_mimo("add", ("cfg", "{1, 2}"))) == (_mimo("add", ("cfg", "{1, 2}")), [])


@pytest.mark.parametrize("step", STEPS)
def test_mimo_streams_what_the_whole_answer_reads(step: int) -> None:
    text = "Sure. " + _mimo("add", ("a", "5")) + " x " + _mimo("ghost") + " y" + _mimo("mul")
    stream = StreamingToolCalls(ToolCallParser(MINIMAX_TOOLS, "mimo"))
    content, pieces = "", []
    for i in range(0, len(text), step):
        more, new = stream.feed(text[i : i + step])
        content, pieces = content + more, pieces + new
    assert (content + stream.flush(), _calls_of(pieces)) == ToolCallParser(
        MINIMAX_TOOLS, "mimo"
    ).parse(text)
    assert len(pieces) == 4  # each call's name, then its arguments


# ---- interns1 --------------------------------------------------------------------------------

ACTION = "<|action_start|> <|plugin|>\n{}<|action_end|>"


def test_interns1_reads_json_calls_between_its_action_tokens() -> None:
    """internlm_detector.py detect_and_parse: a call a block (parameters or arguments; none:
    {}), a block not JSON skipped, a tool not offered dropped, the content before the calls
    stripped; a block that is JSON but not an object: the answer unread; none closed: no
    calls."""
    text = " Sure. " + "".join(ACTION.format(c) for c in (
        '{"name": "add", "parameters": {"a": 1}}', "not json", '{"name": "ghost"}',
        '{"name": "mul", "arguments": null}',
    ))  # fmt: skip
    assert _whole("interns1", text) == ("Sure.", [
        {"name": "add", "arguments": '{"a": 1}'}, {"name": "mul", "arguments": "{}"}])  # fmt: skip
    broken = text + ACTION.format("[1]")
    assert _whole("interns1", broken) == (broken, [])
    open_only = "x <|action_start|> <|plugin|>\n{"
    assert _whole("interns1", open_only) == (open_only, [])
    tag = json.loads(forced_calls(TOOLS, "interns1", named=True, parallel=True)["structural_tag"])
    assert tag["structures"][0]["begin"] == '<|action_start|> <|plugin|>\n{"name": "add", ' \
        '"parameters": '  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_interns1_streams_what_the_whole_answer_reads(step: int) -> None:
    for text in (
        "Sure.  " + ACTION.format('{"name": "add", "parameters": {"a": 1}}') + "\n"
        + ACTION.format('{"name": "mul"}'),
        " no calls <|action_start|> <|plugin|>\n{",  # space first, a marker never closed
    ):  # fmt: skip
        content, pieces, _ = _stream("interns1", text, step)
        assert (content, _calls_of(pieces)) == _whole("interns1", text)


# ---- gemma4 ----------------------------------------------------------------------------------

Q = '<|"|>'
GEMMA_ARGS = (f"city:{Q}Paris, FR{Q},days:2,ratio:2.5,on:true,tags:[{Q}a{Q},1,[2]],"
              f"o:{{k:{Q}}}{Q}}},x:hi")  # fmt: skip


GLM47_TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {**GLM_PROPERTIES, "unit": {"$ref": "#/$defs/unit"},
                                         "code": {"enum": ["7", 8]}},
        "$defs": {"unit": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "pick", "parameters": {"oneOf": [
        {"properties": {"kind": {"const": "n"}, "v": {"type": "integer"}}},
        {"properties": {"kind": {"const": "s"}, "v": {"type": "string"}}}]}}},
]  # fmt: skip
GLM47 = ("Checking. <tool_call>get<arg_key>city</arg_key><arg_value>北京</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>temp</arg_key>"
         '<arg_value>"21.5"</arg_value><arg_key>opts</arg_key><arg_value>{"a": [1, 2]}'
         "</arg_value><arg_key>tags</arg_key><arg_value>[\"x\"]</arg_value><arg_key>unit"
         "</arg_key><arg_value>7</arg_value><arg_key>code</arg_key><arg_value>7</arg_value>"
         "<arg_key>more</arg_key><arg_value>{'k': 1}</arg_value></tool_call> then "
         "<tool_call>pick<arg_key>kind</arg_key><arg_value>s</arg_value><arg_key>v</arg_key>"
         "<arg_value>12</arg_value></tool_call><tool_call>ghost</tool_call> after\n")  # fmt: skip


def test_glm47_reads_each_value_by_what_its_schema_allows() -> None:
    """glm47_moe_detector.py detect_and_parse and _parse_argument_pairs: the content the text
    outside the calls, joined and stripped; the name before the first <arg_key>; a string type
    (through $ref too) keeps the text, a list written back as it was; a number type's JSON string
    made a number; an enum of a string and a number reads 7 as the string it allows; an
    undeclared value read as JSON, else kept as text (no Python literal); a sibling's constant
    choosing the union branch that types v; a tool not offered dropped; a value JSON cannot
    write leaves the whole answer unread."""
    reader = ToolCallParser(GLM47_TOOLS, "glm47")
    content, calls = reader.parse(GLM47)
    assert content == "Checking.  then  after"
    assert [c["name"] for c in calls] == ["get", "pick"]
    assert json.loads(calls[0]["arguments"]) == {
        "city": "北京", "days": 3, "temp": 21.5, "opts": {"a": [1, 2]}, "tags": '["x"]',
        "unit": "7", "code": "7", "more": "{'k': 1}",
    }  # fmt: skip
    assert json.loads(calls[1]["arguments"]) == {"kind": "s", "v": "12"}
    numbered = GLM47.replace("<arg_value>s</arg_value>", "<arg_value>n</arg_value>")
    assert json.loads(reader.parse(numbered)[1][1]["arguments"]) == {"kind": "n", "v": 12}
    unreadable = "<tool_call>get<arg_key>opts</arg_key><arg_value>{1, 2}</arg_value></tool_call>"
    assert reader.parse(unreadable) == (unreadable, [])
    assert reader.parse("no calls ") == ("no calls ", [])
    assert reader.parse(" cut <tool_call>get<arg_key>") == ("cut <tool_call>get<arg_key>", [])


@pytest.mark.parametrize("step", STEPS)
def test_glm47_streams_what_the_whole_answer_reads(step: int) -> None:
    """Streamed: the content outside the calls as it comes (stripped at its ends, as the whole
    answer's), a call named at its first <arg_key>, its arguments as its pairs close (pick's,
    whose union needs its siblings, at its end), adding up to the whole answer's; a call cut
    short keeps its closed pairs, closed; one cut short before its name is content."""

    def streamed(text: str) -> tuple[str, list[dict[str, Any]], StreamingToolCalls]:
        stream = StreamingToolCalls(ToolCallParser(GLM47_TOOLS, "glm47"))
        return (*_feed(stream, text, step), stream)

    content, pieces, _ = streamed(GLM47)
    assert (content, _calls_of(pieces)) == ToolCallParser(GLM47_TOOLS, "glm47").parse(GLM47)
    assert pieces[0] == {"index": 0, "name": "get", "arguments": ""}
    picked = [p["arguments"] for p in pieces if p["index"] == 1]
    assert picked == ["", '{"kind": "s", "v": "12"}']
    content, pieces, stream = streamed(GLM47[: GLM47.index("<arg_key>temp")])
    assert content == "Checking."
    pieces += stream.unsent()
    assert json.loads("".join(p["arguments"] for p in pieces)) == {"city": "北京", "days": 3}
    assert streamed(" x <tool_call>ge")[:2] == (" x <tool_call>ge", [])
    content, pieces, _ = streamed("\n<tool_call>get</tool_call>\n")
    assert (content, _calls_of(pieces)) == ("", [{"name": "get", "arguments": "{}"}])


def test_gemma4_reads_its_own_notation() -> None:
    """gemma4_detector.py detect_and_parse: call:NAME{key:value,...} between its tokens, values
    strings between <|"|> marks, objects, lists, booleans, numbers, bare text; calls to tools not
    offered kept (tool_index -1); the content the text before the first call; a stray bracket
    skipped (SGLang's reader loops forever on it)."""
    text = (f"Sure. <|tool_call>call:add{{{GEMMA_ARGS}}}<tool_call|> mid "
            "<|tool_call>call:ghost{}<tool_call|>")  # fmt: skip
    content, listed = ToolCallParser(TOOLS, "gemma4").indexed(text, {})
    assert content == "Sure. "
    assert listed == [
        (0, {"name": "add", "arguments": '{"city": "Paris, FR", "days": 2, "ratio": 2.5, '
             '"on": true, "tags": ["a", 1, [2]], "o": {"k": "}"}, "x": "hi"}'}),
        (-1, {"name": "ghost", "arguments": "{}"}),
    ]  # fmt: skip
    stray = "<|tool_call>call:add{y:[1,2,b:[1,{a:2}],e:nan}<tool_call|>"
    assert _whole("gemma4", stray)[1] == [{"name": "add", "arguments": '{"y": [1, 2, "b:[1", '
                                           '{"a": 2}, "e:na"]}'}]  # fmt: skip
    assert _whole("gemma4", "x <|tool_call>call:add{a:1}") == ("x <|tool_call>call:add{a:1}", [])


@pytest.mark.parametrize("step", STEPS)
def test_gemma4_streams_what_the_whole_answer_reads(step: int) -> None:
    text = (f"Sure. <|tool_call>call:add{{a:{Q}x, y{Q}}}<tool_call|> mid <|tool_call>call:mul{{}}"
            "<tool_call|> after")  # fmt: skip
    content, pieces, _ = _stream("gemma4", text, step)
    assert (content, _calls_of(pieces)) == _whole("gemma4", text)
    # cut short before its end token: named (as SGLang's stream names it), no arguments, and
    # the text as it is for content, as the whole answer has it (no call)
    cut = "no call <|tool_call>call:add{a:1"
    content, pieces, _ = _stream("gemma4", cut, step)
    assert (content, _calls_of(pieces)) == (cut, [{"name": "add", "arguments": ""}])


# ---- this session's formats through the chat route's stream -----------------------------------

_SAMPLES = {
    "trinity": '<think>x<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call></think>',
    "minimax-m2": _minimax(("add", [("a", "1")]), ("mul", [])),
    "deepseekv32": _dsml(_invoke("add", _param("a", "1", False)), _invoke("mul", None)),
    "mimo": "ok " + _mimo("add", ("a", "1")) + _mimo("mul"),
    "interns1": "ok " + ACTION.format('{"name": "add", "parameters": {"a": 1}}')
    + ACTION.format('{"name": "mul"}'),
    "gemma4": "ok <|tool_call>call:add{a:1}<tool_call|><|tool_call>call:mul{}<tool_call|>",
    "gigachat3": "ok<|message_sep|>function call<|role_sep|>\n"
    '{"name": "add", "arguments": {"a": 1}}',
    "glm47": "ok <tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> and "
    "<tool_call>mul</tool_call>",
    "gpt-oss": "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>',
}  # fmt: skip


_SPECIAL = re.compile(r"(<\|[a-z]+\|>|</?think>|</?tool_call>|</?arg_key>|</?arg_value>)")


@pytest.mark.parametrize("parser", list(_SAMPLES))
def test_a_chat_stream_sends_each_new_formats_calls_as_tool_call_deltas(parser: str) -> None:
    """serving_chat._process_tool_call_stream with each format: named deltas with their ids,
    then argument deltas, adding up to what the whole answer's calls hold; finish tool_calls;
    the content the whole answer's."""
    text = _SAMPLES[parser]
    tools = MINIMAX_TOOLS if parser in ("minimax-m2", "mimo", "gemma4", "glm47") else OFFERED
    options = {"model": "m", "n": 1, "logprobs": False, "parse_tools": True, "tools": tools,
               "tool_parser": parser, "stream": True, "include_usage": False,
               "continuous_usage_stats": False}  # fmt: skip

    async def run() -> list[dict]:
        async def batches():  # 5 characters at a time, the special tokens whole
            cut = 0
            for part in _SPECIAL.split(text):
                step = len(part) if _SPECIAL.fullmatch(part) else 5
                for i in range(0, len(part), step):
                    cut += len(part[i : i + step])
                    yield [_native(text[:cut], None)]
            yield [_native(text, {"type": "stop", "matched": 1})]

        return [c async for batch in chat_stream(batches(), options) for c in batch]

    chunks = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for call in d.get("tool_calls") or ():
            got = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            got["name"] += call["function"].get("name") or ""
            got["arguments"] += call["function"].get("arguments") or ""
    content, whole = ToolCallParser(tools, parser).parse(text)
    assert [calls[i] for i in sorted(calls)] == whole and len(whole) >= 1
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
