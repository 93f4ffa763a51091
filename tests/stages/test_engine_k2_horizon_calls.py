"""K2 Horizon's tool calls (``stages.engine.k2_horizon_calls``, ``--tool-call-parser
k2_horizon``) and reasoning (``--reasoning-parser k2_horizon``) read whole and streamed, as
SGLang 0.5.23's ``K2V3Detector``s read them (held to them on random answers in
``test_engine_sglang_k2_horizon.py``), and a request's reasoning tokens counted to its own
effort's end tag; these cases need no SGLang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stages.engine.parse_routes import _read_calls, _separated
from stages.engine.protocol import REASONING_END_KEY, RequestError, request_options
from stages.engine.reasoning import PARSERS
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
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "code": {"$ref": "#/$defs/unit"}, "when": {"type": ["string", "null"]},
                       "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}},
]  # fmt: skip
G, GE, C, CE = "<ifm|tool_calls>", "</ifm|tool_calls>", "<ifm|tool_call>", "</ifm|tool_call>"


def _arg(key: str, value: str, kind: str | None = None) -> str:
    typed = "" if kind is None else f"<ifm|arg_type>{kind}</ifm|arg_type>"
    return f"<ifm|arg_key>{key}</ifm|arg_key>{typed}<ifm|arg_value>{value}</ifm|arg_value>"


WEATHER = (f"{C}get_weather\n{_arg('city', 'Paris')}\n{_arg('days', ' 3 ')}{_arg('code', '7')}"
           f"{_arg('when', 'null')}{_arg('either', '5')}{CE}")  # fmt: skip
NOTE = (f"{C}note{_arg('n', '007', 'string')}{_arg('items', '[1, 2]')}"
        f"{_arg('raw', 'x y', 'integer')}{CE}")  # fmt: skip
JSON_CALL = f'{C}{{"name": "get_weather", "arguments": "{{\\"days\\": \\"4\\"}}"}}{CE}'
GHOST = f"{C}ghost{_arg('a', '1')}{CE}"
ANSWER = f"I'll check.\n{G}\n{WEATHER}\n{NOTE}\n{GHOST}\n{JSON_CALL}\n{GE} after"
WEATHER_ARGS = {"city": "Paris", "days": 3, "code": "7", "when": "null", "either": 5}
NOTE_ARGS = {"n": "007", "items": [1, 2], "raw": "x y"}


def _read(text: str) -> tuple[str, list[tuple[int, str, dict[str, Any]]]]:
    content, calls = ToolCallParser(TOOLS, "k2_horizon").indexed(text, {})
    return content, [(i, c["name"], json.loads(c["arguments"])) for i, c in calls]


def _stream(text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "k2_horizon"))
    content, pieces = _feed(stream, text, step)
    return content, _calls_of(pieces + stream.unsent())


@pytest.mark.parametrize("step", STEPS)
def test_k2_horizon_reads_a_group_of_tagged_typed_and_json_calls(step: int) -> None:
    """k2_v3_detector.py:81: the group read as a whole, the text around it the content as it
    is; each value by its parameter's type (``$ref`` followed; a union or a type list with null
    has its own rules), else by its type tag, else JSON where it reads; a JSON call's arguments
    as a JSON string too; a tool not offered dropped; each call numbered by its place;
    streamed, the same, the calls at the group's end tag."""
    content, calls = _read(ANSWER)
    assert content == "I'll check.\n after"
    assert calls == [
        (0, "get_weather", WEATHER_ARGS),
        (1, "note", NOTE_ARGS),
        (2, "get_weather", {"days": 4}),
    ]
    whole = ToolCallParser(TOOLS, "k2_horizon").parse(ANSWER)
    assert _stream(ANSWER, step) == whole
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "k2_horizon"))
    sent, pieces = _feed(stream, ANSWER[: ANSWER.index(GE) + len(GE)], step)
    assert (sent, len(_calls_of(pieces))) == ("I'll check.\n", 3)  # before the answer ends


def test_k2_horizon_group_is_all_or_nothing_and_lone_calls_each_alone() -> None:
    """k2_v3_detector.py:94 and :228: a group with text between its calls, or a call it cannot
    read, leaves the whole answer as it came; without a closed group each call is read alone
    (one it cannot read, and one never closed, stay as they are) and the group tags leave the
    content; streamed, the lone calls go out at the end, as a group closed later would leave
    them content."""
    bad = f"x {G}{WEATHER} junk {NOTE}{GE}"
    assert _read(bad) == (bad, [])
    assert _read(f"x {G}{C}note<ifm|arg_key>a</ifm|arg_key>{CE}{GE}") == (
        f"x {G}{C}note<ifm|arg_key>a</ifm|arg_key>{CE}{GE}",
        [],
    )
    lone = f"a{GE}b {WEATHER} {C}{{bad{CE} {G}{NOTE}{C}note"
    assert _read(lone) == (
        f"ab  {C}{{bad{CE} {C}note",
        [(0, "get_weather", WEATHER_ARGS), (1, "note", NOTE_ARGS)],
    )
    for step in STEPS:
        assert _stream(lone, step) == ToolCallParser(TOOLS, "k2_horizon").parse(lone)
    later = f"{WEATHER} then {G}{NOTE}{GE}"  # the closed group alone is read
    assert _read(later) == (f"{WEATHER} then ", [(0, "note", NOTE_ARGS)])
    assert _stream(later, 1) == (
        f"{WEATHER} then ",
        [{"name": "note", "arguments": json.dumps(NOTE_ARGS)}],
    )


def test_k2_horizon_leading_reasoning_is_content_as_it_is() -> None:
    """k2_v3_detector.py:323: reasoning blocks that lead the answer (separate_reasoning false,
    or no reasoning parser) are content as they are, calls inside them not read; one never
    closed takes the whole answer."""
    think = f"<ifm|think>plan {WEATHER}</ifm|think>\n <ifm|think_fast>more</ifm|think_fast>\n"
    text = think + f"{G}{NOTE}{GE}"
    assert _read(text) == (think, [(0, "note", NOTE_ARGS)])
    for step in STEPS:
        assert _stream(text, step) == ToolCallParser(TOOLS, "k2_horizon").parse(text)
    open_block = f"<ifm|think_faster>plan {G}{NOTE}{GE}"
    assert _read(open_block) == (open_block, [])
    assert _read(f"plain {GE} text") == (f"plain {GE} text", [])  # no call: as it is


def test_k2_horizon_answers_as_it_came_where_the_detector_raises() -> None:
    """A value nested past Python's JSON reader makes the detector raise: the chat route answers
    the text as it is, without calls, and so does the stream; a number past the digits Python
    reads is a malformed call, left as it is."""
    deep = f"{G}{C}note{_arg('a', '[' * 20000 + ']' * 20000)}{CE}{GE}"
    assert _read(deep) == (deep, [])
    assert _stream(deep, 1000) == (deep, [])
    long = f"ok {C}note{_arg('a', '1' * 5000)}{CE}"
    assert _read(long) == (long, [])


def test_k2_horizon_is_forced_by_json_schema_and_named_by_its_template() -> None:
    """Its detector has no structural tag (k2_v3_detector.py:585): a forced choice is SGLang's
    JSON array of calls, a strict tool constrains nothing; a template with its think, group and
    call tags names the format."""
    forced = forced_calls(TOOLS, "k2_horizon", named=False, parallel=True)
    assert "json_schema" in forced
    assert answer_format("k2_horizon", forced) == "json_array"
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    assert strict_calls(strict, "k2_horizon") is None
    found = template_parsers("<ifm|think>{{ '<ifm|tool_calls><ifm|tool_call>' }}")
    assert found == {"reasoning_parser": "k2_horizon", "tool_call_parser": "k2_horizon"}
    assert template_parsers("{{ '<ifm|tool_calls><ifm|tool_call>' }}")["tool_call_parser"] is None


def test_k2_horizon_routes_read_as_sglangs() -> None:
    """``/parse_function_call``: each call numbered by its place, calls only with tools;
    ``/separate_reasoning``: no request, so ``K2V3Detector``'s defaults: forced, ``high``'s
    tags, a call's tag ending the reasoning."""
    names = [t["function"]["name"] for t in TOOLS]
    content, calls = _read_calls(ANSWER, names, "k2_horizon", TOOLS)
    assert content == "I'll check.\n after"
    assert [(c["tool_index"], c["name"]) for c in calls] == [
        (0, "get_weather"),
        (1, "note"),
        (2, "get_weather"),
    ]
    assert _read_calls(ANSWER, [], "k2_horizon", []) == (ANSWER, [])
    fmt = PARSERS["k2_horizon"]
    assert _separated("plan</ifm|think>ok", fmt, False) == {"reasoning_text": "plan", "text": "ok"}
    assert _separated("a</ifm|think_fast>b", fmt, False)["text"] == ""
    assert _separated(f"plan{G}{NOTE}{GE}", fmt, False) == {
        "reasoning_text": "plan",
        "text": f"{G}{NOTE}{GE}",
    }


TAGS = ("<ifm|think>", "</ifm|think>", "<ifm|think_fast>", "</ifm|think_fast>",
        "<ifm|think_faster>", "</ifm|think_faster>", G, GE, C, CE, "<ifm|arg_key>",
        "</ifm|arg_key>", "<ifm|arg_value>", "</ifm|arg_value>")  # fmt: skip
# a template as K2 Horizon's writes its turns: its reasoning opened for the request's effort
TEMPLATE = (
    "{%- for m in messages %}{{ m['content'] }}.{% endfor %}"
    "{%- if reasoning_effort == 'low' %}<ifm|think_faster>"
    "{%- elif reasoning_effort == 'medium' %}<ifm|think_fast>{% else %}<ifm|think>{% endif %}"
    "{#- <ifm|tool_calls><ifm|tool_call> #}"
)


def test_a_k2_horizon_request_reads_its_efforts_tags_and_carries_its_end_tag(
    tmp_path: Path,
) -> None:
    """ReasoningParser (``model_type == "k2_horizon"``): the effort in
    ``chat_template_kwargs`` before the request's ``reasoning_effort`` picks the tags (none:
    ``high``'s, another: ``medium``'s); serving_chat._process_messages: a thinking request
    carries its end tag's tokens to the scheduler (``custom_params``, with the client's own),
    which counts its reasoning tokens to them and gates its grammar on them."""
    from transformers import AutoTokenizer

    from stages.engine.openai_chat import ChatSettings, chat_request, chat_response
    from tests.stages.tiny_model import make_tagged_byte_model

    model = make_tagged_byte_model(tmp_path / "model", TAGS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = ChatSettings.of(
        tokenizer, model, chat_template=TEMPLATE, tool_call_parser="k2_horizon",
        reasoning_parser="k2_horizon",
    )  # fmt: skip
    assert settings is not None and settings.reasoning is not None
    assert settings.reasoning.always  # the template's rule: always reasoning
    ask = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    tags = {"high": "think", "medium": "think_fast", "low": "think_faster", "none": "think_fast"}
    for body, tag in [
        (ask, "think"),
        *(({**ask, "reasoning_effort": effort}, tag) for effort, tag in tags.items()),
        ({**ask, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
         "think"),
        ({**ask, "chat_template_kwargs": {"reasoning_effort": 5}}, "think_fast"),
    ]:  # fmt: skip
        native, options = chat_request({**body, "custom_params": {"mine": 1}}, settings, 512)
        end = f"</ifm|{tag}>"
        assert native["require_reasoning"] is True
        assert native["sampling_params"]["custom_params"] == {
            "mine": 1,
            REASONING_END_KEY: tokenizer.encode(end, add_special_tokens=False),
        }
        text = f"plan</ifm|think>{end}ok {G}{NOTE}{GE}"
        result = {"text": text, "output_ids": [3], "meta_info": {
            "id": "r", "finish_reason": {"type": "stop", "matched": 1}, "prompt_tokens": 2,
            "completion_tokens": 1, "weight_version": "0"}}  # fmt: skip
        choice = chat_response([result], options)["choices"][0]
        thought, content = ("plan", f"{end}ok ") if tag == "think" else ("plan</ifm|think>", "ok ")
        assert choice["message"]["reasoning_content"] == thought, body
        assert choice["message"]["content"] == content
        assert choice["finish_reason"] == "tool_calls"
    ids = tokenizer.encode("</ifm|think_fast>", add_special_tokens=False)
    allowed = settings.reasoning.selectable
    assert len(allowed) == 3 and tuple(ids) in allowed
    sampling = {"custom_params": {REASONING_END_KEY: ids}}
    assert request_options(sampling, think_ends=allowed)["think_end"] == tuple(ids)
    assert request_options(sampling)["think_end"] is None  # not one the server has
    for bad in ([], [-1], [1.0], "1", [True], [1] * 33, [10**6]):
        with pytest.raises(RequestError, match="reasoning end token IDs"):
            request_options({"custom_params": {REASONING_END_KEY: bad}}, vocab_size=1000)


@pytest.mark.timeout(180)
def test_a_k2_horizon_request_counts_its_reasoning_tokens_to_its_efforts_end_tag(
    tmp_path: Path,
) -> None:
    """An engine with ``--reasoning-parser k2_horizon``: a chat request's reasoning ends at its
    own effort's end tag (SGLang's request-selected terminator: ``Req.update_reasoning_tokens``
    with it, ``ReasonerGrammarObject.set_request_think_end_ids``), whole and streamed; on
    ``/generate`` the end tag a request names in ``custom_params`` counts where it is one of
    the server's, the server's own (``high``'s) where it is not, and one that is not a list
    of token ids is refused, as SGLang's ``SamplingParams.verify`` refuses it."""
    import requests
    from transformers import AutoTokenizer

    from tests.stages.test_engine_server import serving
    from tests.stages.tiny_model import make_tagged_byte_model

    model = make_tagged_byte_model(tmp_path / "model", TAGS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tag = "</ifm|think_faster>"
    faster, high = (tokenizer.convert_tokens_to_ids(t) for t in (tag, "</ifm|think>"))
    flags = ("--reasoning-parser", "k2_horizon", "--chat-template", TEMPLATE)
    with serving(model, tmp_path / "engine.log", *flags) as eng:
        chat = eng.url + "/v1/chat/completions"
        ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               "logit_bias": {str(faster): 100.0}}  # fmt: skip
        for effort, want in (("low", 1), ("high", 4), (None, 4), ("medium", 4)):
            body = {**ask, "reasoning_effort": effort}
            got = requests.post(chat, json=body, timeout=60).json()
            assert got["usage"]["reasoning_tokens"] == want, (effort, got)
            message = got["choices"][0]["message"]
            split = ("", tag * 3) if effort == "low" else (tag * 4, "")
            assert (message["reasoning_content"] or "", message["content"]) == split
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            reply = requests.post(chat, json=streamed, timeout=60)
            events = [line for line in reply.text.splitlines() if line.startswith("data: {")]
            assert json.loads(events[-1][6:])["usage"]["reasoning_tokens"] == want, effort
        # a grammar waits for the request's own end tag: after it, the regex's text
        body = {**ask, "reasoning_effort": "low", "regex": "ab", "logit_bias": {str(faster): 50.0}}
        got = requests.post(chat, json=body, timeout=60).json()
        assert got["choices"][0]["message"]["content"] == "ab", got
        sampling = {"max_new_tokens": 3, "logit_bias": {str(faster): 100.0}}
        native = {"input_ids": [5, 6], "require_reasoning": True, "sampling_params": sampling}
        ids = tokenizer.encode(tag, add_special_tokens=False)
        for end, want in ((ids, 1), ([high + 1], 3), (None, 3)):
            custom = {} if end is None else {REASONING_END_KEY: end}
            body = {**native, "sampling_params": {**sampling, "custom_params": custom}}
            got = requests.post(eng.url + "/generate", json=body, timeout=60).json()
            assert got["meta_info"]["reasoning_tokens"] == want, (end, got)
        bad = {**native, "sampling_params": {"custom_params": {REASONING_END_KEY: [-1]}}}
        reply = requests.post(eng.url + "/generate", json=bad, timeout=60)
        assert reply.status_code == 400 and "reasoning end token IDs" in reply.text
