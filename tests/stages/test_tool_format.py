"""Tool formats: how calls are read from model turns and how answers are inserted, for
Inflight's tags and for a chat template (tokenizers built in the tests, never downloaded)."""

from __future__ import annotations

import numpy as np
import pytest

from stages.rollouts.tool_format import (
    ChatTemplateFormat,
    TagsFormat,
    ToolCall,
    ToolFormatError,
    make_tool_format,
    parse_tags_call,
    template_takes_tools,
)
from stages.rollouts.tools import ToolSpec
from stages.rollouts.trajectory import Generation
from tests.stages.test_tools import add, calc
from tests.stages.tool_tokenizers import (
    NOT_APPEND_ONLY,
    calc_tokenizer,
    chat_tokenizer,
    plain_tokenizer,
)

SPECS = [ToolSpec.from_function(calc), ToolSpec.from_function(add)]


def _generation(tokenizer, text: str, finish: str = "stop", version: int = 3) -> Generation:
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = -np.arange(1, len(ids) + 1, dtype=np.float32) / 10
    return Generation(ids, logprobs, np.full(len(ids), version), finish)


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


# ------------------------------------------------------------------------------------ tags
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("calc(123*456)", ToolCall("calc", raw="123*456")),
        (" calc( 1 + 2 ) ", ToolCall("calc", raw="1 + 2")),
        ('add({"a": 1, "b": 2})', ToolCall("add", arguments={"a": 1, "b": 2})),
        ("nothing()", ToolCall("nothing", arguments={})),
        ('calc({"not json)', ToolCall("calc", raw='{"not json')),  # the one argument's text
        ('{"name": "add", "arguments": {"a": 1}}', ToolCall("add", arguments={"a": 1})),
        ('{"name": "add", "arguments": "{\\"a\\": 1}"}', ToolCall("add", arguments={"a": 1})),
    ],
)
def test_tags_calls_are_read(body, expected):
    assert parse_tags_call(body) == expected


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("calc 1", "cannot read 'calc 1'; write <tool_call>NAME(ARGS)</tool_call>"),
        ("(1)", "cannot read '(1)'"),
        ('{"name": 1}', 'a call needs a string "name"'),
        ('{"name": "add",', "not valid JSON"),
    ],
)
def test_unreadable_tags_calls_say_why(body, error):
    call = parse_tags_call(body)
    assert call.error is not None and error in call.error


def test_tags_one_token_call_end_stops_generation_and_the_answer_is_inserted():
    tok = calc_tokenizer()
    fmt = make_tool_format("auto", tok, SPECS)  # no chat template: tags
    assert isinstance(fmt, TagsFormat) and fmt.stop_id == tok.convert_tokens_to_ids("</tool_call>")
    episode = fmt.episode({"prompt_id": "p", "input_ids": [5, 6], "meta": {}})
    assert episode.prompt_ids == [5, 6]
    assert episode.sampling({"stop_token_ids": [1]}) == {"stop_token_ids": sorted([1, fmt.stop_id])}
    generation = _generation(tok, "<tool_call>calc(123*456)</tool_call>")
    assert len(generation.token_ids) == 15  # the tags are single tokens
    turn = episode.read(generation)
    assert turn.calls == [ToolCall("calc", raw="123*456")]
    assert turn.generation.token_ids.tolist() == generation.token_ids.tolist()
    answer = episode.answer_ids(turn.calls, ["56088"])
    assert _text(tok, answer) == "<tool_response>56088</tool_response>"
    assert answer == tok.encode("<tool_response>56088</tool_response>", add_special_tokens=False)
    assert len(answer) == 7


def test_tags_text_after_the_call_end_is_not_kept_when_the_end_is_many_tokens():
    tok = plain_tokenizer()
    fmt = TagsFormat(tok, SPECS)
    assert fmt.stop_id is None
    episode = fmt.episode({"input_ids": [5]})
    assert episode.sampling({"stop_token_ids": [1]}) == {}  # nothing to stop at: generate on
    generation = _generation(tok, 'I add: <tool_call>add({"a": 2})</tool_call> and more<tool_c')
    turn = episode.read(generation)
    kept = turn.generation
    assert _text(tok, kept.token_ids) == 'I add: <tool_call>add({"a": 2})</tool_call>'
    n = len(kept.token_ids)
    assert kept.finish_reason == "stop"
    assert kept.logprobs.tolist() == generation.logprobs[:n].tolist()
    assert kept.versions.tolist() == generation.versions[:n].tolist()
    assert turn.calls == [ToolCall("add", arguments={"a": 2})]
    # one call per turn: the first call end ends it
    two = episode.read(_generation(tok, "<tool_call>calc(1)</tool_call><tool_call>calc(2)"))
    assert two.calls == [ToolCall("calc", raw="1")]
    assert _text(tok, two.generation.token_ids) == "<tool_call>calc(1)</tool_call>"


def test_tags_turns_without_a_complete_call():
    tok = calc_tokenizer()
    episode = TagsFormat(tok, SPECS).episode({"input_ids": [5]})
    answer = episode.read(_generation(tok, "56088<eos>"))
    assert answer.calls == [] and answer.generation.finish_reason == "stop"
    unclosed = episode.read(_generation(tok, "<tool_call>calc(1<eos>"))
    assert unclosed.calls[0].error == (
        "<tool_call> without </tool_call>; write <tool_call>NAME(ARGS)</tool_call>"
    )
    cut_off = episode.read(_generation(tok, "<tool_call>calc(1", finish="length"))
    assert cut_off.calls == [] and cut_off.generation.finish_reason == "length"
    no_open = episode.read(_generation(tok, "calc(1)</tool_call>"))
    assert no_open.calls[0].error == "</tool_call> without <tool_call> before it"


# ------------------------------------------------------------------------------------ chat
def _chat_prompt(tok, **meta):
    return {"prompt_id": "p7", "input_ids": [9], "meta": {"task": "t", **meta}}


def test_auto_picks_the_chat_template_when_it_takes_tools():
    assert template_takes_tools(chat_tokenizer())
    assert isinstance(make_tool_format("auto", chat_tokenizer(), SPECS), ChatTemplateFormat)
    no_tools = chat_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert isinstance(make_tool_format("auto", no_tools, SPECS), TagsFormat)
    with pytest.raises(ToolFormatError, match="has no chat template; use tool_format: tags"):
        make_tool_format("chat_template", calc_tokenizer(), SPECS)


def test_chat_episodes_render_their_own_prompt_with_the_tools():
    tok = chat_tokenizer()
    fmt = ChatTemplateFormat(tok, SPECS)
    assert fmt.stop_ids == sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}]
    from_messages = fmt.episode(_chat_prompt(tok, messages=messages, text="ignored"))
    rendered = tok.apply_chat_template(
        messages, tools=[s.schema for s in SPECS], add_generation_prompt=True, tokenize=False
    )
    assert _text(tok, from_messages.prompt_ids) == rendered
    assert '"name": "calc"' in rendered and rendered.endswith("<|im_start|>assistant\n")
    from_text = fmt.episode(_chat_prompt(tok, text="2*3?"))
    assert _text(tok, from_text.prompt_ids).endswith("<|im_start|>user\n2*3?<|im_end|>\n"
                                                     "<|im_start|>assistant\n")  # fmt: skip
    with pytest.raises(ToolFormatError, match=r"prompt 'p7': .* needs meta\[.messages.\]"):
        fmt.episode({"prompt_id": "p7", "input_ids": [9], "meta": {}})
    templated = "<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ToolFormatError, match="already rendered by a chat template"):
        fmt.episode(_chat_prompt(tok, text=templated))


def test_chat_calls_are_read_and_answers_inserted_as_the_template_renders_them():
    tok = chat_tokenizer()
    fmt = ChatTemplateFormat(tok, SPECS)
    user = [{"role": "user", "content": "2*3 and 1+2?"}]
    episode = fmt.episode(_chat_prompt(tok, messages=user))
    context = list(episode.prompt_ids)
    assert episode.sampling({"stop_token_ids": [7]}) == {
        "stop_token_ids": sorted({7, *fmt.stop_ids})
    }
    content = (
        'Both.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    generation = _generation(tok, content + "<|im_end|>")
    turn = episode.read(generation)
    assert turn.calls == [
        ToolCall("calc", arguments={"expression": "2*3"}),
        ToolCall("add", arguments={"a": 1, "b": 2}),
    ]
    assert turn.generation is generation  # a chat turn is kept whole
    context += generation.token_ids.tolist()
    answer = episode.answer_ids(turn.calls, ["6", "3.0"])
    context += answer
    conversation = [
        *user,
        {"role": "assistant", "content": content},
        {"role": "tool", "name": "calc", "content": "6"},
        {"role": "tool", "name": "add", "content": "3.0"},
    ]
    expected = tok.apply_chat_template(
        conversation, tools=[s.schema for s in SPECS], add_generation_prompt=True, tokenize=False
    )
    assert _text(tok, context) == expected  # the context is exactly the rendered conversation
    assert _text(tok, answer) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n3.0\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a second round goes on from there
    second = _generation(tok, '<tool_call>{"name": "calc"}</tool_call><|im_end|>')
    assert episode.read(second).calls == [ToolCall("calc", arguments={})]
    context += second.token_ids.tolist()
    context += episode.answer_ids([ToolCall("calc", arguments={})], ["error: missing"])
    conversation += [
        {"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'},
        {"role": "tool", "name": "calc", "content": "error: missing"},
    ]
    expected = tok.apply_chat_template(
        conversation, tools=[s.schema for s in SPECS], add_generation_prompt=True, tokenize=False
    )
    assert _text(tok, context) == expected


def test_chat_malformed_and_unfinished_turns():
    tok = chat_tokenizer()
    episode = ChatTemplateFormat(tok, SPECS).episode(_chat_prompt(tok, text="hi"))
    bad = episode.read(
        _generation(tok, '<tool_call>{"name": "calc",</tool_call><tool_call>{"name"<|im_end|>')
    )
    assert [c.error is not None for c in bad.calls] == [True, True]
    assert "not valid JSON" in bad.calls[0].error
    assert bad.calls[1].error.startswith("<tool_call> without </tool_call>")
    final = episode.read(_generation(tok, "It is 6.<|im_end|>"))
    assert final.calls == []
    cut_off = episode.read(_generation(tok, '<tool_call>{"name": "calc"}</tool_call>', "length"))
    assert cut_off.calls == []  # the turn did not end: the episode ends, no call is run


def test_a_template_that_is_not_append_only_is_refused():
    with pytest.raises(ToolFormatError, match=r"not append-only.*use tool_format: tags"):
        ChatTemplateFormat(chat_tokenizer(NOT_APPEND_ONLY), SPECS)
    # the same check guards every insertion
    fmt = ChatTemplateFormat(chat_tokenizer(), SPECS)
    episode = fmt.episode(_chat_prompt(None, text="hi"))
    fmt.tokenizer.chat_template = NOT_APPEND_ONLY
    turn = episode.read(_generation(fmt.tokenizer, '<tool_call>{"name": "calc"}</tool_call>'))
    with pytest.raises(ToolFormatError, match="not append-only"):
        episode.answer_ids(turn.calls, ["x"])


def test_a_turn_ended_by_eos_gets_the_templates_own_end_of_turn():
    tok = chat_tokenizer()
    fmt = ChatTemplateFormat(tok, SPECS)
    episode = fmt.episode(_chat_prompt(tok, text="hi"))
    content = '<tool_call>{"name": "calc"}</tool_call>'
    turn = episode.read(_generation(tok, content + "<eos>"))  # EOS, not <|im_end|>
    assert turn.calls == [ToolCall("calc", arguments={})]
    answer = _text(tok, episode.answer_ids(turn.calls, ["1"]))
    assert answer.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n")
