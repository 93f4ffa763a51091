"""``--reasoning-parser``: the reasoning of an answer to ``/v1/chat/completions`` split out as
``reasoning_content``, as SGLang 0.5 does (``srt/parser/reasoning_parser.py``:
``BaseReasoningFormatDetector``, ``DeepSeekR1Detector``, ``Qwen3Detector`` and the other
detectors that are it with their own tags and defaults;
``serving_chat.py``: ``_build_chat_response``, ``_process_reasoning_stream``,
``_get_reasoning_from_request``; ``parser/template_detection.py``; ``protocol.py``:
``ChatCompletionRequest.normalize_reasoning_inputs``; ``usage_processor.py``), the parser on its
own and through a real engine and the ``openai`` client."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer

from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings, chat_request, chat_response
from stages.engine.reasoning import (
    PARSERS,
    ReasoningCount,
    ReasoningSettings,
    ThinkParser,
    Toggle,
    normalize_effort,
    reasoning_tokens,
    template_toggle,
    think_parser,
    thinking_on,
)
from tests.stages.engine_setup import EngineProcess
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import BYTE_CHARS, make_byte_model, make_tagged_byte_model

R1, QWEN3 = PARSERS["deepseek-r1"], PARSERS["qwen3"]


class _Encoder:
    """A tokenizer that encodes any text as one token a character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _parse(fmt, text: str, **kw) -> tuple[str, str]:
    return ThinkParser(fmt, **{"force": False, **kw}).parse(text)


def _streamed(fmt, parts: list[str], **kw) -> tuple[str, str]:
    parser = think_parser(fmt, **{"force": False, **kw})
    reasoning = content = ""
    for part in parts:
        r, c = parser.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


# -- the parser -----------------------------------------------------------------------------------


def test_whole_answers_split_as_sglang_detectors_do() -> None:
    # DeepSeekR1Detector.__init__: force_reasoning=True whatever it is given, so the text before
    # </think> is reasoning with or without <think> (detect_and_parse: leading start tags cut)
    assert _parse(R1, "I think</think>42") == ("I think", "42")
    assert _parse(R1, "<think><think>a</think>b") == ("a", "b")
    assert _parse(R1, "cut short") == ("cut short", "")  # "Assume reasoning was truncated"
    # Qwen3Detector: force_reasoning False by default: no tags, no reasoning...
    assert _parse(QWEN3, "just an answer") == ("", "just an answer")
    assert _parse(QWEN3, "a</think>b") == ("", "a</think>b")
    # ... but an answer that opens <think> reasons; forced, the start may be in the prompt
    assert _parse(QWEN3, "<think>a</think>b") == ("a", "b")
    assert _parse(QWEN3, "a</think>b", force=True) == ("a", "b")
    # tool_start_token="<tool_call>": a call before </think> ends the reasoning, kept as content
    assert _parse(QWEN3, "<think>plan<tool_call>{}") == ("plan", "<tool_call>{}")
    assert _parse(R1, "plan<tool_call>{}") == ("plan<tool_call>{}", "")  # R1 has none
    # qwen3-thinking: ReasoningParser forces reasoning for it
    assert _parse(PARSERS["qwen3-thinking"], "a</think>b") == ("a", "b")
    # continue_final_message: the continued message's tags count (previous_content)
    assert _parse(QWEN3, "more</think>b", previous="<think>so far") == ("more", "b")
    assert _parse(QWEN3, "<think>x", previous="<think>a</think>b") == ("", "x")
    # force_nonempty_content: an answer with no content gets its reasoning as content
    assert _parse(R1, "only thoughts", nonempty=True) == ("", "only thoughts")


def test_a_stream_holds_back_what_may_be_a_tag_and_adds_up_to_the_whole_answer() -> None:
    # _parse_streaming_increment_impl: a buffer that is the start of a tag waits; the reasoning
    # goes out as it comes, less a tail that may be the start of </think>
    parser = ThinkParser(QWEN3, force=False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>I am</th") == ("I am", "")
    assert parser.feed("ink>ok") == ("", "ok")
    assert parser.feed(" <tool") == ("", " <tool")  # not reasoning any more: content as it is
    # stream_reasoning False: the reasoning goes out whole, at its end
    parser = ThinkParser(R1, force=True, stream_reasoning=False)
    assert parser.feed("a") == ("", "") and parser.feed("b</think>c") == ("ab", "c")
    # finish(): an answer cut short inside its reasoning flushes what was held back
    parser = ThinkParser(R1, force=True)
    assert parser.feed("abc</thi") == ("abc", "")
    assert parser.finish() == ("</thi", "")
    # a well-formed answer, [<think>]reasoning</think>content or cut short in its reasoning,
    # streams to what it splits into whole, however its text is cut into deltas
    rng = random.Random(7)
    pieces = ["<", "</", "thin", "k", "a b", "\n", "x", "/"]  # no ">": never a whole tag
    for _ in range(300):
        thought, said = ("".join(rng.choice(pieces) for _ in range(4)) for _ in "ts")
        for text in (f"<think>{thought}</think>{said}", f"{thought}</think>{said}", thought):
            for fmt in (R1, PARSERS["qwen3-thinking"]):
                whole = _parse(fmt, text)
                cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 3)))
                parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
                assert _streamed(fmt, parts) == whole, (text, parts)
                assert _streamed(fmt, list(text)) == whole, text


def test_the_other_detectors_split_with_their_own_tags_and_force_rules() -> None:
    kimi, mistral = PARSERS["kimi"], PARSERS["mistral"]
    # KimiDetector: ◁think▷ ... ◁/think▷, force_reasoning=False whatever it is given
    assert _parse(kimi, "◁think▷a◁/think▷b") == ("a", "b")
    assert _parse(kimi, "a◁/think▷b", force=True) == ("", "a◁/think▷b")
    assert _parse(kimi, "<think>a</think>b") == ("", "<think>a</think>b")
    # kimi_k2 (KimiK2Detector): <think> tags, the tool calls' section ends the reasoning too
    k2 = PARSERS["kimi_k2"]
    assert _parse(k2, "<think>a</think>b") == ("a", "b")
    section = "<|tool_calls_section_begin|><|tool_call_begin|>"
    assert _parse(k2, f"<think>a{section}x") == ("a", f"{section}x")
    assert thinking_on(k2, None, None, None)
    assert not thinking_on(k2, None, {"thinking": False}, None)
    # MistralDetector: [THINK] ... [/THINK], forced as the request decides, no tool start
    assert _parse(mistral, "[THINK]a[/THINK]b") == ("a", "b")
    assert _parse(mistral, "a[/THINK]b", force=True) == ("a", "b")
    assert _parse(mistral, "[THINK]plan<tool_call>x") == ("plan<tool_call>x", "")
    # Glm45Detector, Nemotron3Detector and Qwen3Detector's subclasses: Qwen3's split
    for name in ("glm45", "nemotron_3", "deepseek-v3", "mimo", "poolside_v1"):
        assert _parse(PARSERS[name], "<think>plan<tool_call>{}") == ("plan", "<tool_call>{}")
        assert _parse(PARSERS[name], "a</think>b") == ("", "a</think>b")
        assert _parse(PARSERS[name], "a</think>b", force=True) == ("a", "b")
    # a stream holds back what may be the start of the format's own tags
    parser = ThinkParser(kimi, force=False)
    assert parser.feed("◁th") == ("", "") and parser.feed("ink▷ab◁/") == ("ab", "")
    assert parser.feed("think▷c") == ("", "c")
    # Gemma4Detector: <|channel>thought\n ... <channel|>; its start token alone opens it in a
    # whole answer, the label is taken out with it; reasoning when enable_thinking is true
    gemma = PARSERS["gemma4"]
    assert _parse(gemma, "<|channel>thought\nplan<channel|>Hi") == ("plan", "Hi")
    assert _parse(gemma, "<|channel>plan<channel|>Hi") == ("<|channel>plan", "Hi")
    assert _parse(gemma, "plan<channel|>Hi", force=True) == ("plan", "Hi")
    parts = ["<|channel>", "thou", "ght\n", "pl", "an<chan", "nel|>H", "i"]
    assert _streamed(gemma, parts) == ("plan", "Hi")
    assert not thinking_on(gemma, None, None, None)
    assert thinking_on(gemma, None, {"enable_thinking": True}, None)
    # GraniteThinkingDetector: the content's leading newlines go; newline-only content is not
    # swapped for the reasoning under force_nonempty_content, an absent one is
    granite = PARSERS["granite_thinking_parser"]
    assert _parse(granite, "<think>plan\n</think>\n\nHi") == ("plan\n", "Hi")
    assert _parse(granite, "<think>plan</think>\n", nonempty=True) == ("plan", "")
    assert _parse(granite, "<think>plan</think>", nonempty=True) == ("", "plan")
    assert _parse(granite, "<think>plan<tool_call>x") == ("plan", "<tool_call>x")
    assert _streamed(granite, ["<think>pl", "an</think>", "\n", "\nHi", "\nthere"]) == (
        "plan",
        "Hi\nthere",
    )
    settings = ReasoningSettings.of("granite_thinking_parser", None, _Encoder())
    assert settings.request({"enable_thinking": False}, None).nonempty  # ReasoningParser's rule
    assert not settings.request(None, None).nonempty
    # IQuestQ1ReasoningDetector: thinking, and forced, unless a switch is set and none is true
    iquest = ReasoningSettings.of("iquest_q1", None, _Encoder())
    for kwargs, on in ((None, True), ({"thinking": False}, False),
                       ({"thinking": False, "enable_thinking": True}, True)):  # fmt: skip
        request = iquest.request(kwargs, None)
        assert (request.force, request.counted) == (on, on), kwargs
    assert iquest.request(None, None).parser().parse("plan</think>Hi") == ("plan", "Hi")
    assert iquest.request({"thinking": False}, None).parser().parse("Hi") == ("", "Hi")
    # Ling3Detector: GLM-4.5's split, its force_nonempty_content on whatever the request says
    ling3 = ReasoningSettings.of("ling3", None, _Encoder())
    assert ling3.request(None, None).nonempty
    assert ling3.request(None, None).parser().parse("<think>plan") == ("", "plan")
    assert ling3.request(None, None).parser().parse("<think>a</think>b") == ("a", "b")
    # MiniMaxAppendThinkDetector: no split; <think> before the answer (the first delta's)
    append = PARSERS["minimax-append-think"]
    assert _parse(append, "a</think>b", force=True, nonempty=True) == ("", "<think>a</think>b")
    parser = ThinkParser(append, force=True)
    assert [parser.feed("a</th"), parser.feed("ink>b"), parser.finish()] == [
        ("", "<think>a</th"),
        ("", "ink>b"),
        ("", ""),
    ]


def test_apertus_reasons_in_blocks_with_tool_calls_inside_them_as_content() -> None:
    """Apertus2509Detector: any number of <|inner_prefix|> blocks, the text around them content,
    a tool-call block inside one content (for the tool-call reader), one never closed to the
    end; never forced (text without a block is content); streamed in small pieces: the same."""
    fmt = PARSERS["apertus2509"]
    text = ('a<|inner_prefix|>think <|tools_prefix|>[{"f": {}}]<|tools_suffix|> more'
            "<|inner_suffix|>b<|inner_prefix|>again")  # fmt: skip
    reader = think_parser(fmt, force=True)
    assert reader.parse(text) == (
        "think  moreagain",
        'a<|tools_prefix|>[{"f": {}}]<|tools_suffix|>b',
    )
    assert reader.parse("plain") == ("", "plain")
    parts = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert _streamed(fmt, parts, force=True) == think_parser(fmt, force=False).parse(text)


def test_reasoning_tokens_are_counted_to_the_end_tag_as_sglang_scheduler_does() -> None:
    # Req.update_reasoning_tokens: tokens up to and with the end sequence; all while it has none
    assert reasoning_tokens([1, 2, 9, 3], [9]) == 3
    assert reasoning_tokens([1, 2, 3], [9]) == 3
    assert reasoning_tokens([1, 8, 8, 9, 3], [8, 9]) == 4
    assert reasoning_tokens([1, 2], []) == 0  # no end tokens: not counted
    count = ReasoningCount([8, 9])  # as a stream grows, an end split between steps
    assert [count.update(ids) for ids in ([1, 8], [1, 8, 9, 2], [1, 8, 9, 2, 8, 9])] == [2, 3, 3]


def test_reasoning_the_model_opens_itself_is_counted_from_its_start_tag() -> None:
    """Req.update_self_opened_reasoning_tokens (minimax-m3, a request that does not require
    reasoning): none unless the answer opens with the start tag's tokens; then those and the
    tokens up to and with the end tag, searched after the start tag."""
    assert reasoning_tokens([5, 6, 1, 9, 3], [9], [5, 6]) == 4
    assert reasoning_tokens([5, 7, 1, 9, 3], [9], [5, 6]) == 0  # not opened: none
    assert reasoning_tokens([1, 5, 6, 9], [9], [5, 6]) == 0
    assert reasoning_tokens([9, 1, 9], [9], [9]) == 3  # the end searched after the start
    assert reasoning_tokens([5, 6, 1, 2], [9], [5, 6]) == 4  # never ended: all of it
    count = ReasoningCount([8, 9], [5, 6])  # as a stream grows, the start tag split too
    steps = ([5], [5, 6], [5, 6, 8], [5, 6, 8, 9, 1], [5, 6, 8, 9, 1, 2])
    assert [count.update(ids) for ids in steps] == [0, 2, 3, 4, 4]
    assert PARSERS["minimax-m3"].self_opens and not PARSERS["qwen3"].self_opens


def test_a_multi_token_end_is_matched_across_false_starts() -> None:
    """The scheduler's match of the end of a reasoning (TokenSequenceMatcher.advance): the
    longest start of the end sequence the last tokens finish with."""
    from stages.engine.scheduler import _matched

    def run(end: tuple[int, ...], tokens: list[int]) -> list[int]:
        out, m = [], 0
        for t in tokens:
            m = _matched(end, m, t)
            out.append(m)
        return out

    assert run((5, 5, 6), [5, 5, 5, 6]) == [1, 2, 2, 3]
    assert run((1, 2, 1, 3), [1, 2, 1, 2, 1, 3]) == [1, 2, 3, 2, 3, 4]
    assert run((9,), [1, 9]) == [0, 1]


# -- whether a request reasons ---------------------------------------------------------------------

QWEN3_TOGGLE = (
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "{%- endif %}"
)


def test_the_template_toggle_is_detected_by_sglang_rules() -> None:
    # REASONING_MODE_RULES, in order
    assert template_toggle(QWEN3_TOGGLE) == (False, Toggle("enable_thinking", True))
    off = "{%- set enable_thinking = enable_thinking | default(false) -%}"
    assert template_toggle(off) == (False, Toggle("enable_thinking", False))
    on_by_filter = "{%- set thinking = thinking | d(true) -%}{% generation %}x{% endgeneration %}"
    assert template_toggle(on_by_filter) == (False, Toggle("thinking", True))
    assert template_toggle("{% set t = thinking | default(true, true) %}") == (False, None)
    opens = "{{ '<|im_start|>assistant\\n<think>\\n' }}"  # force_reasoning_pattern
    assert template_toggle(opens) == (True, Toggle(special="always"))
    assert template_toggle("{{ messages }}") == (False, None)
    assert template_toggle(None) == (False, None)


def test_whether_a_request_reasons_follows_get_reasoning_from_request() -> None:
    qwen_toggle = Toggle("enable_thinking", True)
    assert thinking_on(QWEN3, qwen_toggle, None, None)
    assert not thinking_on(QWEN3, qwen_toggle, {"enable_thinking": False}, None)
    assert thinking_on(QWEN3, None, {"other": 1}, None)  # the parser's default: enable_thinking
    assert thinking_on(R1, None, {"enable_thinking": False}, None)  # "always"
    off = Toggle("thinking", False)
    assert not thinking_on(R1, off, None, None) and thinking_on(R1, off, {"thinking": True}, None)
    mistral = Toggle(special="mistral")
    assert thinking_on(QWEN3, mistral, None, "low") and not thinking_on(
        QWEN3, mistral, None, "none"
    )


def test_without_a_template_toggle_the_parsers_reasoning_default_decides() -> None:
    # _get_reasoning_from_request with no reasoning_config: the detector's reasoning_default
    v3, mimo, mistral = PARSERS["deepseek-v3"], PARSERS["mimo"], PARSERS["mistral"]
    # explicit_thinking / explicit_enable_thinking: off unless the switch is true
    assert not thinking_on(v3, None, None, None)
    assert not thinking_on(v3, None, {"thinking": 1}, None)
    assert thinking_on(v3, None, {"thinking": True}, None)
    assert not thinking_on(mimo, None, {"thinking": True}, None)
    assert thinking_on(mimo, None, {"enable_thinking": True}, None)
    effort, kwargs = normalize_effort({"reasoning_effort": "low"})  # sets both switches
    assert thinking_on(PARSERS["poolside_v1"], None, kwargs, effort)
    # mistral: a reasoning_effort other than none, whatever the switches
    assert not thinking_on(mistral, None, {"enable_thinking": True}, None)
    assert thinking_on(mistral, None, None, 0.5) and not thinking_on(mistral, None, None, "none")
    # kimi, minimax-append-think: "always"; nemotron_3, glm45: on unless enable_thinking false
    assert thinking_on(PARSERS["kimi"], None, {"enable_thinking": False}, None)
    assert thinking_on(PARSERS["minimax-append-think"], None, {"thinking": False}, "none")
    assert thinking_on(PARSERS["nemotron_3"], None, {}, None)
    assert not thinking_on(PARSERS["glm45"], None, {"enable_thinking": False}, None)
    # the template's toggle, when there is one, wins
    assert thinking_on(v3, Toggle("enable_thinking", True), None, None)
    off = {"enable_thinking": False}
    assert not thinking_on(PARSERS["kimi"], Toggle("enable_thinking", True), off, None)
    # _patch_reasoning_skip_special_tokens: mistral's answers keep their special tokens (its
    # tags) when the request has a reasoning_effort other than none
    settings = ReasoningSettings("mistral", mistral, False, None, ())
    assert settings.request(None, "high").keep_special
    assert not settings.request(None, "none").keep_special
    assert not settings.request({"enable_thinking": True}, None).keep_special


def test_reasoning_effort_and_reasoning_are_normalized_as_chat_completion_request_does() -> None:
    assert normalize_effort({}) == (None, None)
    kw = {"thinking": False, "enable_thinking": False}
    assert normalize_effort({"reasoning_effort": "none"}) == ("none", kw)
    given = {"enable_thinking": True}  # the request's own kwargs win (setdefault)
    assert normalize_effort({"reasoning_effort": "none", "chat_template_kwargs": given}) == (
        "none",
        {"enable_thinking": True, "thinking": False},
    )
    assert normalize_effort({"reasoning": {"enabled": "yes"}})[1] == {
        "thinking": True,
        "enable_thinking": True,
    }
    assert normalize_effort({"reasoning": {"effort": "0.5"}})[0] == 0.5
    assert normalize_effort({"reasoning_effort": 0})[0] == 0.0
    for bad in (True, 1.5, "lots"):
        with pytest.raises(ValueError) as err:
            normalize_effort({"reasoning_effort": bad})
        assert err.value.field == "reasoning_effort"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="invalid reasoning effort"):
        normalize_effort({"reasoning": {"effort": "lots"}})


# -- the chat route -----------------------------------------------------------------------------

# byte-level, every character in the tiny model's alphabet; Qwen3's toggle
TEMPLATE = (
    "{%- for m in messages %}{{ m.content }}.{% endfor %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}-{% endif %}"
    "{%- if add_generation_prompt %}:{% endif %}"
)
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level model whose tags are whole tokens, added as Qwen3's are (not special),
    the only way to write them: the end of the reasoning is one token."""
    root = tmp_path_factory.mktemp("reasoning-model")
    tags = ("<think>", "</think>", "<tool_call>", "</tool_call>")
    model = make_tagged_byte_model(root / "model", tags)
    (root / "template.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    template = model_dir.parent / "template.jinja"
    flags = ("--chat-template", str(template), "--reasoning-parser", "qwen3")
    with serving(model_dir, model_dir.parent / "engine.log", *flags) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def _tokens(engine: Engine, text: str) -> int:
    return len(AutoTokenizer.from_pretrained(engine.model_dir).encode(text))


def _end_id(engine: Engine) -> int:
    return AutoTokenizer.from_pretrained(engine.model_dir).convert_tokens_to_ids("</think>")


OFF = {"reasoning_effort": "none"}  # the template's enable_thinking false: no reasoning asked


@pytest.mark.timeout(60)
def test_a_thinking_request_gets_its_grammar_after_its_reasoning(engine: Engine, client) -> None:
    """require_reasoning (serving_chat: a thinking request's; ReasonerGrammarObject): the
    grammar applies from the token after </think>, so the answer may reason first: with
    </think> favoured, it ends its reasoning at once, then writes what the regex allows. The
    reasoning tokens are counted up to and with </think> (Req.update_reasoning_tokens)."""
    end = _end_id(engine)
    ask = dict(model="m", messages=HELLO, max_tokens=30, temperature=0, logit_bias={str(end): 100})
    out = client.chat.completions.create(**ask, extra_body={"regex": "cd"})
    message = out.choices[0].message
    assert message.content == "cd" and message.model_extra["reasoning_content"] is None
    assert out.usage.model_extra["reasoning_tokens"] == 1
    assert out.usage.completion_tokens_details.reasoning_tokens == 1
    # separate_reasoning false: the text whole, the reasoning still counted
    whole = client.chat.completions.create(
        **ask, extra_body={"regex": "cd", "separate_reasoning": False}
    )
    assert whole.choices[0].message.content == "</think>cd"
    assert whole.usage.model_extra["reasoning_tokens"] == 1
    # natively: require_reasoning defers the grammar; without it, the grammar is there at once
    prompt = {
        "input_ids": [29, 30, 9, 7],
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 10,
            "regex": "cd",
            "logit_bias": {str(end): 100},
        },
    }
    deferred = engine.generate({**prompt, "require_reasoning": True})
    assert deferred["output_ids"][0] == end and deferred["text"].endswith("cd")
    assert deferred["meta_info"]["reasoning_tokens"] == 1  # SGLang 0.5.23's meta_info has it
    plain = engine.generate(prompt)
    assert plain["text"] == "cd" and plain["meta_info"]["reasoning_tokens"] == 0
    # streamed: each chunk's count so far
    body = {**prompt, "require_reasoning": True, "stream": True}
    reply = requests.post(engine.url + "/generate", json=body, stream=True, timeout=30)
    events = [
        json.loads(line[6:]) for line in reply.iter_lines() if line[6:] not in (b"", b"[DONE]")
    ]
    assert {e["meta_info"]["reasoning_tokens"] for e in events} == {1}
    assert events[-1]["meta_info"]["finish_reason"] is not None


@pytest.mark.timeout(60)
def test_the_reasoning_comes_as_reasoning_content(engine: Engine, client) -> None:
    """Not thinking (reasoning_effort none: the template's switch off, nothing counted), the
    grammar applies at once; Qwen3Detector reads an answer that opens <think> all the same,
    and leaves one that does not as content."""
    ask = dict(model="m", messages=HELLO, max_tokens=30, temperature=0, reasoning_effort="none")
    out = client.chat.completions.create(**ask, extra_body={"regex": "<think>ab</think>cd"})
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "ab" and message.content == "cd"
    assert out.usage.model_extra["reasoning_tokens"] == 0
    assert out.usage.completion_tokens_details is None
    plain = client.chat.completions.create(**ask, extra_body={"regex": "ab</think>cd"})
    assert plain.choices[0].message.content == "ab</think>cd"
    assert plain.choices[0].message.model_extra["reasoning_content"] is None
    thinking = client.chat.completions.create(model="m", messages=HELLO, max_tokens=1)
    assert thinking.usage.prompt_tokens + 1 == out.usage.prompt_tokens  # the template's "-"


@pytest.mark.timeout(60)
def test_a_streamed_answer_sends_reasoning_deltas_then_content_deltas(
    engine: Engine, client
) -> None:
    stream = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, reasoning_effort="none",
        extra_body={"regex": "<think>abc</think>de", "logprobs": True},
    )  # fmt: skip
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas[1:])
    assert (thought, content) == ("abc", "de")
    # a delta carries reasoning or content, never both; the reasoning ones all come first
    kinds = []
    for d in deltas[1:]:
        thinks, says = bool(d.model_extra.get("reasoning_content")), bool(d.content)
        assert not (thinks and says)
        if thinks or says:
            kinds.append("r" if thinks else "c")
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    # every token's log-prob went out once, with the first chunk of its step
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == chunks[-1].usage.completion_tokens
    # thinking: the reasoning tokens in the usage chunk
    end = _end_id(engine)
    counted = list(client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, logit_bias={str(end): 100},
        extra_body={"regex": "de"},
    ))  # fmt: skip
    assert counted[-1].usage.model_extra["reasoning_tokens"] == 1
    assert "".join(c.choices[0].delta.content or "" for c in counted if c.choices) == "de"


@pytest.mark.timeout(60)
def test_reasoning_fields_sglang_refuses_are_refused_with_its_status(engine: Engine) -> None:
    url = engine.url + "/v1/chat/completions"
    for body, field in (
        ({"reasoning_effort": True}, "reasoning_effort"),
        ({"reasoning_effort": 2}, "reasoning_effort"),
        ({"reasoning": {"effort": "lots"}}, "reasoning"),
        ({"separate_reasoning": "maybe"}, "separate_reasoning"),  # "yes": pydantic's true
    ):
        reply = requests.post(url, json={"messages": HELLO, "max_tokens": 2, **body}, timeout=30)
        assert reply.status_code == 400, (body, reply.text)
        assert field in reply.text
    native = {"input_ids": [29, 30], "require_reasoning": "yes"}
    reply = requests.post(engine.url + "/generate", json=native, timeout=30)
    assert reply.status_code == 400  # SGLang 0.5.23's JSON contract: a boolean
    assert reply.json() == {"error": 'invalid type: string "yes", expected a boolean'}
    info = requests.get(engine.url + "/model_info", timeout=30).json()
    assert info["reasoning_parser"] == "qwen3" and info["tool_call_parser"] is None


def test_the_reasoning_is_split_before_tool_calls_are_read(model_dir: Path) -> None:
    """``_build_chat_response``: the reasoning parser first; the tool calls are read in the
    text after it (a call inside the reasoning is not one)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = ChatSettings.of(
        tokenizer, model_dir, chat_template=TEMPLATE, tool_call_parser="qwen25",
        reasoning_parser="deepseek-r1",
    )  # fmt: skip
    assert settings is not None
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    body = {"messages": HELLO, "tools": tools, "max_tokens": 20}
    _, options = chat_request(body, settings, context_length=512)
    text = 'add?</think>ok<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = tokenizer.encode(text)
    result = {
        "text": text, "output_ids": ids,
        "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 1},
                      "prompt_tokens": 3, "completion_tokens": len(ids), "weight_version": "0",
                      # what the engine's scheduler reports for a thinking request
                      "reasoning_tokens": reasoning_tokens(ids, settings.reasoning.end_ids)},
    }  # fmt: skip
    answer = chat_response([result], options)
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "add?" and message["content"] == "ok"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["usage"]["reasoning_tokens"] == len(tokenizer.encode("add?</think>"))
    with pytest.raises(ValueError, match="--reasoning-parser 'beam'"):
        ChatSettings.of(tokenizer, model_dir, chat_template=TEMPLATE, reasoning_parser="beam")
    with pytest.raises(OpenAIError, match="separate_reasoning"):
        chat_request({**body, "separate_reasoning": 1}, settings, context_length=512)


@pytest.mark.timeout(120)
def test_a_forced_call_without_a_tool_call_parser_is_a_json_array_left_in_the_content(
    engine: Engine, client
) -> None:
    """No --tool-call-parser: tool_choice required is SGLang's JSON schema of a
    [{name, parameters}] array (get_json_schema_constraint), which SGLang 0.5.23 then leaves in
    the content, reading no calls without a parser (_tool_call_parsing_active) (not thinking
    here: a favoured </think> would be favoured inside the JSON's strings too)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        }
    ]
    newline = AutoTokenizer.from_pretrained(engine.model_dir).encode("\n")[0]  # JSON needs none
    out = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=200, temperature=0, tools=tools,
        tool_choice="required", reasoning_effort="none", logit_bias={str(newline): -100},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    (call,) = json.loads(choice.message.content)
    assert call["name"] == "add" and isinstance(call["parameters"]["a"], int)
    assert choice.message.model_extra["reasoning_content"] is None


# -- the other formats, each through an engine of its own -----------------------------------------

# no thinking switch: the parser's reasoning_default decides
PLAIN = (
    "{%- for m in messages %}{{ m.content }}.{% endfor %}"
    "{%- if add_generation_prompt %}:{% endif %}"
)
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
# (glm45 and nemotron_3 read as qwen3, poolside_v1 as mimo: the parser checks above cover them;
# an engine each would add seconds of start-up for nothing new)
# per parser: its template, and requests (more of the body, the regex its answer follows) with
# what SGLang answers for that text: (reasoning_content, content, usage.reasoning_tokens). A
# thinking request (reasoning tokens counted) has its end tag favoured, its grammar after it.
OTHERS: dict[str, tuple[str, list[tuple[dict, str, tuple]]]] = {
    "kimi": (TEMPLATE, [
        (OFF, "◁think▷ab◁/think▷cd", ("ab", "cd", 0)),
        ({}, "cd", (None, "◁/think▷cd", 1)),  # thinking, yet its detector is never forced
    ]),
    "mistral": (PLAIN, [  # thinking: a reasoning_effort other than none
        ({}, r"\[THINK\]ab\[/THINK\]cd", ("ab", "cd", 0)),
        ({}, r"ab\[/THINK\]cd", (None, "ab[/THINK]cd", 0)),
        ({"reasoning_effort": "high"}, "cd", (None, "cd", 1)),
    ]),
    "deepseek-v3": (PLAIN, [  # thinking: chat_template_kwargs.thinking true
        (THINK, "ab</think>cd", (None, "ab</think>cd", 0)),
        ({"chat_template_kwargs": {"thinking": True}}, "cd", (None, "cd", 1)),
    ]),
    "mimo": (PLAIN, [  # thinking: enable_thinking true
        ({}, "ab</think>cd", (None, "ab</think>cd", 0)),
        (THINK, "cd", (None, "cd", 1)),
    ]),
    "minimax-append-think": (PLAIN, [  # always thinking; the answer whole, <think> before it
        ({}, "cd", (None, "<think></think>cd", 1)),
    ]),
}  # fmt: skip


@pytest.fixture(scope="module")
def other_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """An engine per parser of ``OTHERS``, all started at once, on a byte model with every
    format's tags as whole tokens (as ``model_dir``'s)."""
    root = tmp_path_factory.mktemp("reasoning-formats")
    words = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    words += ["◁think▷", "◁/think▷", "[THINK]", "[/THINK]"]
    model = make_byte_model(root / "model", seed=4, chars=BYTE_CHARS + "\n", words=tuple(words))
    # each tag in the vocabulary under its own text, as a tokenizer keeps its added tokens (a
    # tag of other than ASCII is not its byte-level spelling)
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    level = ByteLevel(add_prefix_space=False, use_regex=False)
    for word in words:
        vocab[word] = vocab.pop(level.pre_tokenize_str(word)[0][0])
    (model / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(words)
    tokenizer.save_pretrained(model)
    procs: dict[str, tuple[EngineProcess, Path]] = {}
    try:
        for name, (template, _) in OTHERS.items():
            (root / f"{name}.jinja").write_text(template)
            log = root / f"{name}.log"
            flags = ("--chat-template", str(root / f"{name}.jinja"), "--reasoning-parser", name)
            proc = EngineProcess(
                model, "--max-running", "8", "--log-file", str(log), *flags, tail=log
            )
            procs[name] = proc, log
        yield {
            name: Engine(proc.wait_up(60), model, log, proc.engine_id)
            for name, (proc, log) in procs.items()
        }
    finally:
        codes = {name: proc.stop(15) for name, (proc, _) in procs.items()}
    assert set(codes.values()) == {0}, codes


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(OTHERS))
def test_each_other_format_is_split_as_sglang_splits_it(
    other_engines: dict[str, Engine], name: str
) -> None:
    """A chat answer of a known text, whole and streamed, split as SGLang's detector for the
    parser splits it; whether the request thinks (and so forces the reasoning, defers its
    grammar and counts its reasoning tokens) as ``_get_reasoning_from_request`` decides."""
    engine = other_engines[name]
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    end = tokenizer.convert_tokens_to_ids(PARSERS[name].end)
    for more, regex, (thought, said, counted) in OTHERS[name][1]:
        bias = {"logit_bias": {str(end): 100}} if counted else {}
        ask = dict(model="m", messages=HELLO, max_tokens=30, temperature=0, **bias)
        extra = {**more, "regex": regex}
        out = client.chat.completions.create(**ask, extra_body=extra)
        message = out.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (thought, said)
        assert out.usage.model_extra["reasoning_tokens"] == counted, (more, regex)
        chunks = list(client.chat.completions.create(**ask, extra_body=extra, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        assert (streamed, "".join(d.content or "" for d in deltas)) == (thought or "", said)


def test_cohere_reasons_until_its_end_tag_or_a_block_and_answers_in_its_text_block() -> None:
    """CohereCommand4Detector: reasoning up to <|END_THINKING|> (an echoed start tag out), the
    content the text block's inside; an action block is content whole (for the tool-call
    reader); an answer cut short in its reasoning has no content; streamed, the same."""
    fmt = PARSERS["cohere_command4"]
    text = "<|START_THINKING|>hm<|END_THINKING|><|START_TEXT|>yes<|END_TEXT|>"
    assert think_parser(fmt, force=False).parse(text) == ("hm", "yes")
    action = 'hm<|END_THINKING|><|START_ACTION|>[{"tool_name": "f"}]<|END_ACTION|>'
    assert think_parser(fmt, force=False).parse(action) == ("hm", action[18:])
    assert think_parser(fmt, force=False).parse("still thinking") == ("still thinking", "")
    for answer in (text, action):
        parts = [answer[i : i + 4] for i in range(0, len(answer), 4)]
        assert _streamed(fmt, parts) == think_parser(fmt, force=False).parse(answer)


def test_an_effort_in_the_template_kwargs_is_the_requests_effort(model_dir: Path) -> None:
    """SGLang 0.5.23 (serving_chat.py:1291-1307) moves ``chat_template_kwargs.reasoning_effort``
    into the request's ``reasoning_effort``, over the field, for every parser but Hunyuan's
    effort template: Mistral's template then reasons for an effort given there alone, and the
    template gets the moved value. A template with an effort kwarg (Nemotron 3's
    ``low_effort``) gets it set by a ``low`` effort (``_apply_jinja_template``)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mistral = TEMPLATE + "{# reasoning_effort [THINK] #}"
    settings = ChatSettings.of(
        tokenizer, model_dir, chat_template=mistral, reasoning_parser="mistral"
    )
    assert settings is not None
    seen: list[dict] = []
    settings.render = lambda messages, tools, kwargs, **_: seen.append(dict(kwargs)) or [1]  # type: ignore[method-assign]
    moved, _ = chat_request(
        {"messages": HELLO, "chat_template_kwargs": {"reasoning_effort": "high"}},
        settings,
        context_length=512,
    )
    plain, _ = chat_request({"messages": HELLO}, settings, context_length=512)
    assert moved.get("require_reasoning") is True and "require_reasoning" not in plain
    assert seen[0]["reasoning_effort"] == "high"
    over, _ = chat_request(
        {"messages": HELLO, "reasoning_effort": "high",
         "chat_template_kwargs": {"reasoning_effort": "none"}},
        settings, context_length=512,
    )  # fmt: skip
    assert "require_reasoning" not in over and seen[-1]["reasoning_effort"] == "none"
    nemotron = TEMPLATE + "{# low_effort truncate_history_thinking #}"
    settings = ChatSettings.of(tokenizer, model_dir, chat_template=nemotron)
    assert settings is not None
    settings.render = lambda messages, tools, kwargs, **_: seen.append(dict(kwargs)) or [1]  # type: ignore[method-assign]
    for effort, wanted in (("low", True), ("high", None), (None, None)):
        body = (
            {"messages": HELLO}
            if effort is None
            else {"messages": HELLO, "reasoning_effort": effort}
        )
        chat_request(body, settings, context_length=512)
        assert seen[-1].get("low_effort") is wanted, effort
