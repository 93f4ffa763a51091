"""``/parse_function_call`` and ``/separate_reasoning`` on a real built-in engine, answered as
SGLang 0.5.23's ``http_server.parse_function_call_request`` / ``separate_reasoning_request``
answer them (the expected answers are what SGLang's own ``FunctionCallParser`` and
``ReasoningParser`` give for the same bodies)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from stages.engine.deepseek_calls import BEGIN, END, SECTION, SECTION_END, SEP
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [_tool("get_weather"), _tool("add")]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
ADD = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
UNKNOWN = '{"name": "launch", "arguments": {}}'
ERROR_KEYS = {"object", "message", "type", "param", "code"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_model(tmp_path_factory.mktemp("parse") / "model", seed=5)
    with builtin_engine(model) as u:
        yield u


def _post(url: str, path: str, body: Any) -> requests.Response:
    return requests.post(url + path, json=body, timeout=10)


def _calls(url: str, text: str, parser: str | None, tools: Any = TOOLS) -> dict[str, Any]:
    resp = _post(
        url, "/parse_function_call", {"text": text, "tools": tools, "tool_call_parser": parser}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _call(index: int, name: str, parameters: str) -> dict[str, Any]:
    return {"tool_index": index, "name": name, "parameters": parameters}


def _separate(url: str, text: str, parser: str, **more: Any) -> dict[str, Any]:
    resp = _post(url, "/separate_reasoning", {"text": text, "reasoning_parser": parser, **more})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.timeout(30)
def test_each_tool_call_format_is_read_as_sglang_reads_it(url: str) -> None:
    # tool_index: the tool's place in tools (parse_base_json), parameters: the arguments as
    # JSON (ensure_ascii=False), parameters before arguments
    weather, add = (
        _call(0, "get_weather", '{"city": "Zürich"}'),
        _call(1, "add", '{"a": 1, "b": 2}'),
    )
    qwen = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
    for parser in ("qwen25", "qwen"):
        assert _calls(url, qwen, parser) == {
            "normal_text": "Let me check.",
            "calls": [weather, add],
        }
    hermes = f"Sure <tool_call>{ADD}</tool_call>"
    assert _calls(url, hermes, "hermes") == {"normal_text": "Sure", "calls": [add]}
    llama = f"<|python_tag|>{WEATHER};{ADD} done"
    assert _calls(url, llama, "llama3") == {"normal_text": "done", "calls": [weather, add]}
    assert _calls(url, WEATHER, "llama3") == {"normal_text": "", "calls": [weather]}
    mistral = f"Hi [TOOL_CALLS] [{WEATHER}, {ADD}] bye"
    assert _calls(url, mistral, "mistral") == {"normal_text": "Hi bye", "calls": [weather, add]}
    compact = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
    assert _calls(url, compact, "mistral") == {"normal_text": "", "calls": [add]}
    # qwen25 needs the newlines around a call (qwen25_detector.py:38-39), hermes does not and
    # reads a last call without its end tag (hermes_detector.py:149)
    bare = f"Sure <tool_call>{ADD}</tool_call>"
    assert _calls(url, bare, "qwen25") == {"normal_text": bare, "calls": []}
    unclosed = f"<tool_call>{WEATHER}</tool_call><tool_call>{ADD}"
    assert _calls(url, unclosed, "hermes") == {"normal_text": "", "calls": [weather, add]}
    # pythonic: tool_index is the call's place in the list (pythonic_detector.py:118)
    pythonic = "I'll call [add(a=1, b=2), get_weather(city='Zürich')]"
    assert _calls(url, pythonic, "pythonic") == {
        "normal_text": "I'll call ",
        "calls": [
            _call(0, "add", '{"a": 1, "b": 2}'),
            _call(1, "get_weather", weather["parameters"]),
        ],
    }
    # qwen3_coder: the values typed by the tool's schema, tool_index the call's place
    # (qwen3_coder_detector.detect_and_parse), a tool not offered kept
    typed = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                },
            },
        }
    ]
    coder = ("Sum:\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
             "<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
             "<function=launch>\n</function>\n</tool_call>")  # fmt: skip
    assert _calls(url, coder, "qwen3_coder", typed) == {
        "normal_text": "Sum:\n",
        "calls": [_call(0, "add", '{"a": 1, "b": 2.5}'), _call(1, "launch", "{}")],
    }
    for alias in ("step3p5", "nanbeige"):  # SGLang's Qwen3CoderDetector too
        assert _calls(url, coder, alias, typed) == _calls(url, coder, "qwen3_coder", typed)
    # deepseekv3 / deepseekv31: the calls between DeepSeek's tokens, the text before them
    # stripped (deepseekv3_detector.py, deepseekv31_detector.py detect_and_parse)
    v3 = (f"Let me check. {SECTION}{BEGIN}function{SEP}get_weather\n```json\n"
          f'{{"city": "Zürich"}}\n```{END}\n{BEGIN}function{SEP}add\n```json\n'
          f'{{"a": 1, "b": 2}}\n```{END}{SECTION_END}')  # fmt: skip
    assert _calls(url, v3, "deepseekv3") == {
        "normal_text": "Let me check.",
        "calls": [weather, add],
    }
    v31 = f'{SECTION}{BEGIN}add{SEP}{{"a": 1, "b": 2}}{END}{SECTION_END}'
    assert _calls(url, v31, "deepseekv31") == {"normal_text": "", "calls": [add]}
    # kimi_k2: the call named by its id, or (a bare counter) by its arguments' keys; the
    # arguments as written, tool_index the call's place (kimik2_detector.py detect_and_parse)
    kimi = ("Hi <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|><|tool_call_begin|>5'
            '<|tool_call_argument_begin|>{"a": 1, "b": 2}<|tool_call_end|>'
            "<|tool_calls_section_end|>")  # fmt: skip
    assert _calls(url, kimi, "kimi_k2", [*typed, TOOLS[0]]) == {
        "normal_text": "Hi ",
        "calls": [weather, _call(1, "add", '{"a": 1, "b": 2}')],
    }
    # glm45 (also glm): the name line and typed <arg_key>/<arg_value> pairs, tool_index the
    # named tool's place (glm4_moe_detector.py detect_and_parse)
    glm = ("Sum:\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
           "<arg_key>b</arg_key>\n<arg_value>2.5</arg_value>\n</tool_call>")  # fmt: skip
    for name in ("glm45", "glm"):
        assert _calls(url, glm, name, typed) == {
            "normal_text": "Sum:",
            "calls": [_call(0, "add", '{"a": 1, "b": 2.5}')],
        }


@pytest.mark.timeout(30)
def test_calls_to_functions_not_in_tools_are_dropped(url: str) -> None:
    add = _call(1, "add", '{"a": 1, "b": 2}')
    qwen = f"<tool_call>\n{UNKNOWN}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
    assert _calls(url, qwen, "qwen25") == {"normal_text": "", "calls": [add]}
    assert _calls(url, f"<|python_tag|>{UNKNOWN};{ADD}", "llama3")["calls"] == [add]
    assert _calls(url, f"[TOOL_CALLS] [{ADD}, {UNKNOWN}]", "mistral")["calls"] == [add]
    pythonic = _calls(url, "[add(a=1, b=2), launch(x=1)]", "pythonic")
    assert pythonic["calls"] == [_call(0, "add", '{"a": 1, "b": 2}')]
    # ... a pythonic call's tool_index counts the calls dropped before it (pythonic_detector.py:118)
    pythonic = _calls(url, "[launch(x=1), add(a=1, b=2)]", "pythonic")
    assert pythonic["calls"] == [_call(1, "add", '{"a": 1, "b": 2}')]
    # where SGLang's parser raises (a call that is not an object; its route answers 500), the
    # text as it is, no calls, as SGLang's chat route reads it
    text = f"<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n[1]\n</tool_call>"
    assert _calls(url, text, "qwen25") == {"normal_text": text, "calls": []}
    # the last tool of a name is the one indexed; unnamed tools are skipped
    tools = [{"function": {}}, _tool("add"), _tool("get_weather"), _tool("add")]
    assert _calls(url, f"<tool_call>\n{ADD}\n</tool_call>", "hermes", tools)["calls"] == [
        _call(3, "add", '{"a": 1, "b": 2}')
    ]
    # no tools: the text as it is, whatever it holds (parse_non_stream)
    text = f"<tool_call>\n{ADD}\n</tool_call>"
    for body in ({"text": text, "tools": []}, {"text": text}):
        answer = _post(url, "/parse_function_call", {**body, "tool_call_parser": "qwen25"}).json()
        assert answer == {"normal_text": text, "calls": []}
    # a text without the format's marker stays as it is (not stripped)
    assert _calls(url, "  just text ", "qwen25") == {"normal_text": "  just text ", "calls": []}
    # but minimax-m3 reads calls without tools (parses_without_tools), each numbered in its block
    tags = ("<tool_call>", '<invoke name="any">', "<a>1", "</a>", "</invoke>",
            '<invoke name="b">', "</invoke>", "</tool_call>")  # fmt: skip
    m3 = "".join(f"]<]minimax[>[{tag}" for tag in tags)
    for body in ({"text": "ok " + m3, "tools": []}, {"text": "ok " + m3}):
        answer = _post(url, "/parse_function_call", {**body, "tool_call_parser": "minimax-m3"})
        assert answer.json() == {
            "normal_text": "ok ",
            "calls": [_call(0, "any", '{"a": "1"}'), _call(1, "b", "{}")],
        }


@pytest.mark.timeout(30)
def test_reasoning_is_separated_as_the_parser_reads_it_by_default(url: str) -> None:
    # deepseek-r1: reasoning until </think>, with or without <think>
    for text in ("<think>Let me see.</think>It is 4.", "Let me see.</think>It is 4."):
        assert _separate(url, text, "deepseek-r1") == {
            "reasoning_text": "Let me see.",
            "text": "It is 4.",
        }
    assert _separate(url, "still thinking", "DeepSeek-R1")["reasoning_text"] == "still thinking"
    # qwen3: no thinking switch on this route, so only a text that opens <think> reasons
    assert _separate(url, "<think>hmm</think>\n\nYes.", "qwen3") == {
        "reasoning_text": "hmm",
        "text": "\n\nYes.",
    }
    assert _separate(url, "hmm</think>Yes.", "qwen3") == {
        "reasoning_text": "",
        "text": "hmm</think>Yes.",
    }
    # ... and a <tool_call> before </think> ends the reasoning
    assert _separate(url, "<think>look it up<tool_call>x", "qwen3") == {
        "reasoning_text": "look it up",
        "text": "<tool_call>x",
    }
    # qwen3-thinking and minimax always reason
    for name in ("qwen3-thinking", "minimax"):
        assert _separate(url, "hmm</think>Yes.", name)["reasoning_text"] == "hmm"


@pytest.mark.timeout(30)
def test_the_other_base_detector_formats_are_separated_with_their_tags(url: str) -> None:
    # KimiDetector (never forced) and MistralDetector: their own tags, reasoning only opened
    assert _separate(url, "◁think▷hmm◁/think▷Yes.", "kimi") == {
        "reasoning_text": "hmm",
        "text": "Yes.",
    }
    assert _separate(url, "hmm◁/think▷Yes.", "Kimi")["reasoning_text"] == ""
    assert _separate(url, "[THINK]hmm[/THINK]Yes.", "mistral") == {
        "reasoning_text": "hmm",
        "text": "Yes.",
    }
    assert _separate(url, "hmm[/THINK]Yes.", "mistral")["reasoning_text"] == ""
    # Qwen3's split under other names: a <tool_call> ends the reasoning
    for name in ("glm45", "nemotron_3", "deepseek-v3", "mimo", "poolside_v1"):
        assert _separate(url, "<think>look<tool_call>x", name) == {
            "reasoning_text": "look",
            "text": "<tool_call>x",
        }
        assert _separate(url, "hmm</think>Yes.", name)["reasoning_text"] == ""
    # MiniMaxAppendThinkDetector: no reasoning, <think> put before the text
    whole = "<think>hmm</think>Yes."
    assert _separate(url, "hmm</think>Yes.", "minimax-append-think", return_blocks=True) == {
        "reasoning_text": "",
        "text": whole,
        "reasoning_blocks": [],
        "text_blocks": [whole],
        "blocks": [{"type": "text", "text": whole}],
    }


@pytest.mark.timeout(30)
def test_hunyuan_calls_and_reasoning_are_read_as_its_detectors_read_them(url: str) -> None:
    # hunyuan_detector.py detect_and_parse: the text before <tool_calls> stripped, a tool not
    # offered dropped, tool_index the last tool of the name; values of untyped parameters text
    hy = ("Sum:\n<tool_calls>\n<tool_call>add<tool_sep>\n<arg_key>a</arg_key>\n"
          "<arg_value>1</arg_value>\n</tool_call>\n<tool_call>launch<tool_sep></tool_call>\n"
          "</tool_calls>")  # fmt: skip
    tools = [_tool("add"), _tool("get_weather"), _tool("add")]
    assert _calls(url, hy, "hunyuan", tools) == {
        "normal_text": "Sum:",
        "calls": [_call(2, "add", '{"a": "1"}')],
    }
    # reasoning_parser.py HunyuanDetector: <think> tags, <tool_calls> ending them too
    assert _separate(url, "<think>look<tool_calls>x", "hunyuan") == {
        "reasoning_text": "look",
        "text": "<tool_calls>x",
    }
    assert _separate(url, "hmm</think>Yes.", "hunyuan")["reasoning_text"] == ""


@pytest.mark.timeout(30)
def test_return_blocks_adds_the_blocks(url: str) -> None:
    answer = _separate(url, "<think>a</think>b", "qwen3", return_blocks=True)
    assert list(answer) == ["reasoning_text", "text", "reasoning_blocks", "text_blocks", "blocks"]
    assert answer == {
        "reasoning_text": "a",
        "text": "b",
        "reasoning_blocks": ["a"],
        "text_blocks": ["b"],
        "blocks": [{"type": "reasoning", "text": "a"}, {"type": "text", "text": "b"}],
    }
    # no reasoning: no reasoning block; return_blocks read as pydantic reads a bool
    assert _separate(url, "b", "qwen3", return_blocks="yes") == {
        "reasoning_text": "",
        "text": "b",
        "reasoning_blocks": [],
        "text_blocks": ["b"],
        "blocks": [{"type": "text", "text": "b"}],
    }
    assert list(_separate(url, "b", "qwen3", return_blocks=0)) == ["reasoning_text", "text"]


def _refused(url: str) -> dict[str, int]:
    return requests.get(url + "/get_server_info", timeout=10).json()["refused_requests"]


@pytest.mark.timeout(30)
def test_bad_requests_get_sglangs_answers_and_the_engine_serves_on(url: str) -> None:
    before = _refused(url)
    invalid = {
        "/parse_function_call": [
            {"tools": TOOLS, "tool_call_parser": "qwen25"},  # no text
            {"text": 3, "tool_call_parser": "qwen25"},
            {"text": "x", "tools": None, "tool_call_parser": "qwen25"},
            {"text": "x", "tools": [{"type": "function"}], "tool_call_parser": "qwen25"},
            {"text": "x", "tools": [{"function": {"name": 1}}], "tool_call_parser": "qwen25"},
            {"text": "x", "tools": [{"function": {"parameters": []}}], "tool_call_parser": "qwen"},
            {"text": "x", "tool_call_parser": 1},
            {"text": "x", "tool_call_parser": "qwen25", "rid": 5},
            [1, 2],
        ],
        "/separate_reasoning": [
            {"reasoning_parser": "qwen3"},
            {"text": "x"},
            {"text": "x", "reasoning_parser": None},
            {"text": "x", "reasoning_parser": "qwen3", "return_blocks": "maybe"},
            {"text": "x", "reasoning_parser": "qwen3", "return_blocks": 2},
        ],
    }  # fmt: skip
    for path, bodies in invalid.items():
        for body in bodies:
            resp = _post(url, path, body)
            answer = resp.json()
            assert resp.status_code == 400 and set(answer) == ERROR_KEYS, (body, answer)
            assert (answer["type"], answer["code"], answer["param"]) == ("Bad Request", 400, None)
    # formats SGLang reads that the engine does not: a 400 that says so (type "400", as
    # SGLang's HTTPException); a model-specific one: SGLang's own 400
    for path, field, name in (
        ("/parse_function_call", "tool_call_parser", "beam"),
        ("/separate_reasoning", "reasoning_parser", "beam"),
    ):
        resp = _post(url, path, {"text": "x", field: name})
        assert resp.status_code == 400 and resp.json()["type"] == "400", resp.text
        assert "built-in engine does not read" in resp.json()["message"]
    for path, field in (
        ("/parse_function_call", "tool_call_parser"),
        ("/separate_reasoning", "reasoning_parser"),
    ):
        resp = _post(url, path, {"text": "x", field: "deepseekv4"})
        assert resp.json()["message"] == (
            "'deepseekv4' output is parsed with its model's tokenizer; this server does not "
            "serve that model"
        )  # fmt: skip
    # a name SGLang does not know, or none: its parser classes raise and its route lets it out
    for path, body in (
        ("/parse_function_call", {"text": "x", "tools": TOOLS, "tool_call_parser": "nope"}),
        ("/parse_function_call", {"text": "x", "tools": []}),  # null: "Unsupported ... None"
        ("/parse_function_call", {"text": "x", "tool_call_parser": "Qwen25"}),  # case counts
        ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}),
        ("/separate_reasoning", {"text": "x", "reasoning_parser": ""}),
    ):
        resp = _post(url, path, body)
        assert (resp.status_code, resp.text) == (500, "Internal Server Error"), body
    after = _refused(url)
    for path, more in (("/parse_function_call", 9 + 1 + 1), ("/separate_reasoning", 5 + 1 + 1)):
        key = f"POST {path} 400"
        assert after.get(key, 0) - before.get(key, 0) == more, (key, after)
    assert _calls(url, f"<tool_call>\n{ADD}\n</tool_call>", "qwen25")["calls"]
    out = _post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] >= 1
