"""LFM2's tool calls (``stages.engine.lfm2_calls``, ``--tool-call-parser lfm2``) read whole and
streamed, as SGLang 0.5.23's ``function_call/lfm2_detector.py`` reads them (held to it on random
answers in ``test_engine_sglang_lfm2.py``); these cases need no SGLang."""

from __future__ import annotations

import json

import pytest

from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
)
from tests.stages.test_engine_chat import _calls_of
from tests.stages.test_engine_tool_formats import STEPS, _feed


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [_tool("run"), _tool("get_weather"), _tool("fs.read"), _tool("get_weather")]
S, E = "<|tool_call_start|>", "<|tool_call_end|>"


def _read(text: str) -> list[tuple[int, str, dict]]:
    _, calls = ToolCallParser(TOOLS, "lfm2").indexed(text, {})
    return [(i, c["name"], json.loads(c["arguments"])) for i, c in calls]


@pytest.mark.parametrize("step", STEPS)
def test_lfm2_reads_python_and_json_calls(step: int) -> None:
    """lfm2_detector.py:816: the content the text before the first block, stripped; a block of
    Python calls (literals of every JSON kind, JSON's spellings, signs, sets and tuples as
    lists, ``**{...}``, dotted names), each numbered by its place in its list; a block of JSON
    calls, each numbered by its tool's place (the last of its name); calls to tools not
    offered, with positional arguments or with values that are not literals dropped; streamed,
    the same."""
    text = (
        f"  I'll check.\n{S}[get_weather(city='Zürich', days=+3, alerts=null, hours={{1, 2}}, "
        f"span=(1, -2.5), **{{'units': 'metric'}}), ghost(a=1), run('ls'), run(cmd=x), "
        f"fs.read(path=f'/tmp')]{E} between "
        f'{S}[{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}]{E} after'
    )
    weather = {"city": "Zürich", "days": 3, "alerts": None, "hours": [1, 2], "span": [1, -2.5],
               "units": "metric"}  # fmt: skip
    assert _read(text) == [
        (0, "get_weather", weather),
        (4, "fs.read", {"path": "/tmp"}),
        (3, "get_weather", {"city": "Oslo"}),
    ]
    reader = ToolCallParser(TOOLS, "lfm2")
    content, calls = reader.parse(text)
    assert content == "I'll check."
    streamed, pieces = _feed(StreamingToolCalls(ToolCallParser(TOOLS, "lfm2")), text, step)
    assert (streamed.strip(), _calls_of(pieces)) == (content, calls)


def test_lfm2_reads_what_the_model_meant_where_python_cannot() -> None:
    """lfm2_detector.py's recovery: nested unescaped quotes closed at the one quote that reads,
    zero-padded integers, raw newlines in strings, Python keywords as parameter names; where no
    rewrite reads, each call alone (the readable ones kept)."""
    shell = f"{S}[run(command='sed -n '360,450p' f.py')]{E}"
    assert _read(shell) == [(0, "run", {"command": "sed -n '360,450p' f.py"})]
    assert _read(f"{S}[get_weather(month=07, note='a\nb', from='x')]{E}") == [
        (0, "get_weather", {"month": 7, "note": "a\nb", "from": "x"})
    ]
    assert _read(f"{S}[run(command='ok'), get_weather(city=Paris London), run(n=1)]{E}") == [
        (0, "run", {"command": "ok"}),
        (1, "run", {"n": 1}),
    ]
    # an ambiguous quote is no guess: that call is dropped, the one after it read alone
    assert _read(f"{S}[run(a='x 'y', b='z')]{E}") == []
    assert _read(f"{S}[run(a='x 'y', b='z'), run(c=1)]{E}") == [(0, "run", {"c": 1})]


def test_lfm2_answers_as_it_came_where_the_detector_raises() -> None:
    """A JSON block whose items are not call objects makes SGLang's detector raise: the chat
    route then answers the text as it is, without calls; a block never closed is no call and
    the content is what precedes it."""
    bad = f'ok {S}[{{"name": "run", "arguments": {{}}}}, 5]{E}'
    assert ToolCallParser(TOOLS, "lfm2").parse(bad) == (bad, [])
    assert ToolCallParser(TOOLS, "lfm2").parse(f"ok {S}[run(n=1)]") == ("ok", [])


def test_lfm2_is_forced_by_json_schema_and_named_by_its_template() -> None:
    forced = forced_calls(TOOLS, "lfm2", named=False, parallel=True)
    assert answer_format("lfm2", forced) == "json_array"
    assert (
        template_parsers("{{ '<|tool_call_start|>' }}{{ '<|tool_call_end|>' }}")["tool_call_parser"]
        == "lfm2"
    )
    assert template_parsers("{{ '<|tool_call_start|>' }}")["tool_call_parser"] is None
