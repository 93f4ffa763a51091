"""Inkling's tool calls (``stages.engine.inkling_calls``, ``--tool-call-parser inkling``) and
reasoning (``stages.engine.inkling_reasoning``, ``--reasoning-parser inkling``) read whole and
streamed, as SGLang 0.5.23's ``InklingDetector``s read them (held to them on random answers in
``test_engine_sglang_inkling.py``), and an engine serving them; these cases need no SGLang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from stages.engine.inkling_reasoning import END_ID, InklingReasoning
from stages.engine.parse_routes import _read_calls, _separated
from stages.engine.reasoning import PARSERS, ReasoningSettings
from stages.engine.template_detection import template_parsers
from stages.engine.tool_calls import (
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
)
from tests.stages.test_engine_tool_formats import STEPS, _feed

SEARCH = {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
    "type": "object", "properties": {"q": {"enum": ["a"]}}, "required": ["q"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}, SEARCH]
MM, J, T, E = ("<|message_model|>", "<|content_invoke_tool_json|>",
               "<|content_invoke_tool_text|>", "<|end_message|>")  # fmt: skip
THINK, TEXT, STOP = "<|content_thinking|>", "<|content_text|>", "<|content_model_end_sampling|>"
WEATHER = f'{MM}get_weather{J}{{"name": "get_weather", "args": {{"city": "Zürich"}}}}{E}'
GHOST = f'{MM}ghost{J} {{"args": {{}}, "name": "ghost"}}\n{E}'
SHELL = f"{MM}{T}ls -la é{E}"
ANSWER = f"{MM}{TEXT}Looking.{E}{WEATHER}{GHOST}{SHELL}{STOP}"
CALLS = [("get_weather", '{"city": "Zürich"}'), ("ghost", "{}"),
         ("", '{"text": "ls -la \\u00e9"}')]  # fmt: skip


def _stream(text: str, step: int) -> tuple[str, list[tuple[int, str | None, str]], int]:
    stream = StreamingToolCalls(ToolCallParser(TOOLS, "inkling"))
    content, pieces = _feed(stream, text, step)
    return content, [(p["index"], p["name"], p["arguments"]) for p in pieces], stream.calls


@pytest.mark.parametrize("step", STEPS)
def test_inkling_reads_every_call_message(step: int) -> None:
    """inkling_detector.py:70 (``_parse_canonical``): every marker frames a call, its header
    out of the content, the framing tokens dropped; a call to a tool not offered kept; a raw-text
    call unnamed, its body the ``text`` argument; each ``tool_index`` its place. Streamed, each
    call whole at its end token (a raw-text call's piece without a name, as SGLang's chat route
    sends it)."""
    reader = ToolCallParser(TOOLS, "inkling")
    assert reader.has_tool_call(ANSWER)
    content, calls = reader.indexed(ANSWER, {})
    assert content == "Looking."
    assert [(i, c["name"], c["arguments"]) for i, c in calls] == [
        (i, n, a) for i, (n, a) in enumerate(CALLS)
    ]
    streamed = [(i, n or None, a) for i, (n, a) in enumerate(CALLS)]
    assert _stream(ANSWER, step) == ("Looking.", streamed, 3)
    plain = f"{MM}{TEXT}no calls{E}"  # no marker: left as it is (parse_non_stream)
    assert ToolCallParser(TOOLS, "inkling").parse(plain) == (plain, [])


def test_inkling_recovers_one_call_or_keeps_the_text() -> None:
    """inkling_detector.py:123 (``_recover_last_json_call``): one marker that does not frame a
    call (a body that is not strict JSON, ``NaN``, ``args`` not an object, an end never come)
    fails them all; the last JSON marker's body, read laxly to the next end or the end of the
    answer, is the one call, the content empty; else the text less its framing tokens. Streamed,
    the rest after such a call passes through as content; what is held at the end is dropped.
    A body nested past the recursion limit: the text, no calls (SGLang's chat route)."""
    nan = f'{MM}search{J}{{"name": "search", "args": {{"n": NaN}}}}{E}'
    content, calls = ToolCallParser(TOOLS, "inkling").parse(f"Hi {WEATHER}{nan} bye")
    assert (content, calls) == ("", [{"name": "search", "arguments": '{"n": NaN}'}])
    cut = f'Hi {MM}search{J}{{"name": "search", "args": {{}}}}'
    assert ToolCallParser(TOOLS, "inkling").parse(cut)[1] == [{"name": "search", "arguments": "{}"}]
    bad = f"Hi {MM}x{J}{{bad{E} bye"
    assert ToolCallParser(TOOLS, "inkling").parse(bad) == ("Hi x{bad bye", [])
    assert _stream(f"{bad}{MM}{TEXT}more", 1000) == ("Hi x{bad byemore", [], 0)
    assert _stream(f"{bad}{MM}{TEXT}more", 5)[0].startswith("Hi {bad bye")  # its header gone
    assert _stream(f"ok {MM}partial", 3) == ("ok ", [], 0)  # a header held, dropped
    deep = f'{MM}x{J}{{"name": "x", "args": {{"d": {"[" * 20000}{"]" * 20000}}}}}{E}'
    assert ToolCallParser(TOOLS, "inkling").parse(deep) == (deep, [])


def test_inkling_is_forced_by_its_own_legacy_tag_and_named_by_no_template() -> None:
    """``get_structure_constraint``: forced, and ``auto`` with a strict tool, the legacy tag of
    the detector's ``structure_info`` (a trigger a tool, its header); plain ``auto`` (SGLang's
    token-triggered tag) not constrained here; SGLang detects no template as Inkling's."""
    forced = forced_calls(TOOLS, "inkling", named=False, parallel=True)
    tag = json.loads(forced["structural_tag"])
    assert tag["triggers"] == [f"{MM}get_weather{J}", f"{MM}search{J}"]
    assert tag["structures"][1] == {
        "begin": f'{MM}search{J}{{"name":"search","args":',
        "schema": SEARCH["function"]["parameters"],
        "end": "}" + E,
    }
    assert tag["structures"][0]["schema"] == {} and tag["at_least_one"] is True
    assert answer_format("inkling", forced) == "inkling"
    assert json.loads(strict_calls(TOOLS, "inkling")["structural_tag"])["at_least_one"] is False
    assert strict_calls(TOOLS[:1], "inkling") is None
    assert template_parsers(f"{{{{ '{MM}{J}{THINK}' }}}}") == {
        "reasoning_parser": None,
        "tool_call_parser": None,
    }


def _streamed(reader: InklingReasoning, text: str, step: int) -> tuple[str, str]:
    thought = content = ""
    for i in range(0, len(text), step):
        more, said = reader.feed(text[i : i + step])
        thought, content = thought + more, content + said
    more, said = reader.finish()
    return thought + more, content + said


@pytest.mark.parametrize("step", STEPS)
def test_inkling_reasoning_is_its_thinking_messages(step: int) -> None:
    """reasoning_parser.py:1448 (``_parse_blocks``): ``<|content_thinking|>`` messages are the
    reasoning, ``<|content_text|>`` ones content, a call's message content whole, header and
    all, for the tool-call reader; a ``<|message_model|>`` inside a message its text, another
    framing token dropped; held or streamed, the same; the tail of a framing token begun is
    dropped at the end of a stream."""
    think = f"{MM}{THINK}Plan {MM}it.<|content_xml|>{E}"
    text = think + ANSWER
    content = f"Looking.{WEATHER}{GHOST}{SHELL}"
    assert InklingReasoning().parse(text) == (f"Plan {MM}it.", content)
    for stream in (True, False):
        assert _streamed(InklingReasoning(stream_reasoning=stream), text, step) == (
            f"Plan {MM}it.",
            content,
        )
    assert ToolCallParser(TOOLS, "inkling").parse(content)[0] == "Looking."
    held = InklingReasoning(stream_reasoning=False)
    assert held.feed(f"{MM}{THINK}a") == ("", "")
    assert held.feed(f"b{E}") == ("ab", "")
    assert held.feed(f"{MM}{THINK}cut") == ("", "") and held.finish() == ("cut", "")
    assert _streamed(InklingReasoning(), "ok <|end_mess", step) == ("", "ok ")
    assert InklingReasoning().parse("ok <|end_mess") == ("", "ok <|end_mess")


def test_inkling_routes_and_settings_read_as_sglangs() -> None:
    """``/parse_function_call``: each call numbered by its place, calls only with tools;
    ``/separate_reasoning``: the typed messages. A served tokenizer's reasoning ends at Inkling's
    own id for ``<|end_message|>`` (``get_think_end_token_ids``), whatever it encodes the tag
    to, and every chat answer keeps its special tokens."""
    names = [t["function"]["name"] for t in TOOLS]
    content, calls = _read_calls(ANSWER, names, "inkling", TOOLS)
    assert content == "Looking."
    assert [(c["tool_index"], c["name"]) for c in calls] == [
        (0, "get_weather"), (1, "ghost"), (2, "")
    ]  # fmt: skip
    assert _read_calls(ANSWER, [], "inkling", []) == (ANSWER, [])
    fmt = PARSERS["inkling"]
    assert _separated(f"{MM}{THINK}plan{E}{MM}{TEXT}ok{E}", fmt, True) == {
        "reasoning_text": "plan", "text": "ok", "reasoning_blocks": ["plan"],
        "text_blocks": ["ok"],
        "blocks": [{"type": "reasoning", "text": "plan"}, {"type": "text", "text": "ok"}],
    }  # fmt: skip

    class Bytes:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(text.encode())

    settings = ReasoningSettings.of("inkling", None, Bytes())
    assert settings.end_ids == (END_ID,) == (200010,)
    request = settings.request(None, None)
    assert request.counted and request.keep_special
    assert settings.request({"enable_thinking": False}, "none").counted  # always on

    from types import SimpleNamespace

    from stages.engine.anthropic_messages import _thinking

    chat: dict[str, Any] = {}  # apply_reasoning_enabled: Inkling's off switch is its effort
    served = SimpleNamespace(reasoning=ReasoningSettings.of("inkling", "{{ x }}", Bytes()))
    _thinking({"type": "disabled"}, served, chat)  # type: ignore[arg-type]
    assert chat == {"reasoning_effort": "none"}
    _thinking({"type": "adaptive"}, served, chat)  # type: ignore[arg-type]
    assert chat == {"reasoning_effort": "none"}  # on: left as it is (always reasons)


INKLING_TOKENS = (MM, THINK, TEXT, E, STOP, J, T, "<|message_user|>", "<|endoftext|>")
# a template as a Jinja one would open Inkling's turn: reasoning off unless the request asks
TEMPLATE = (
    "{% if not enable_thinking is defined %}{% set enable_thinking = false %}{% endif %}"
    "{%- for m in messages %}{{ m['content'] }}.{% endfor %}<|message_model|>"
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An engine serving a tiny byte-level model whose Inkling framing tokens are special
    tokens, with both parsers named."""
    from transformers import AutoTokenizer

    from tests.stages.test_engine_server import serving
    from tests.stages.tiny_model import BYTE_CHARS, make_byte_model

    root = tmp_path_factory.mktemp("inkling")
    model = make_byte_model(root / "model", seed=4, chars=BYTE_CHARS + " _\n", words=INKLING_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": list(INKLING_TOKENS)})
    assert all(i < len(tokenizer) for i in tokenizer.convert_tokens_to_ids(list(INKLING_TOKENS)))
    tokenizer.save_pretrained(model)
    flags = ("--tool-call-parser", "inkling", "--reasoning-parser", "inkling",
             "--chat-template", TEMPLATE)  # fmt: skip
    with serving(model, root / "engine.log", *flags) as eng:
        yield eng


@pytest.mark.timeout(120)
def test_an_inkling_engine_answers_a_forced_call_and_counts_reasoning(engine: Any) -> None:
    """Through the ``openai`` client: a named tool is constrained by Inkling's own legacy tag
    (the request does not reason: its template's toggle is off), its message kept with its
    special tokens, passed through the reasoning parser to the tool-call reader, whole and
    streamed; a thinking request counts every token as reasoning, as SGLang does with Inkling's
    end id (200010) that this vocabulary has not."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from tests.stages.tiny_model import EOS_ID

    client = OpenAI(base_url=engine.url + "/v1", api_key="none")
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    # no whitespace between the JSON's tokens (the grammar allows it; the tiny model likes it)
    spaces = {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ")}
    ask: dict[str, Any] = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "search"}}, "max_tokens": 200,
        "logit_bias": {str(EOS_ID): 40, **spaces},
    }  # fmt: skip
    got = client.chat.completions.create(**ask)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("search", {"q": "a"})
    ]
    streamed: dict[int, list[str]] = {}
    assert not choice.message.content and got.usage.reasoning_tokens == 0
    for chunk in client.chat.completions.create(**ask, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed.setdefault(delta.index, []).append(delta.function.name or "")
            streamed[delta.index].append(delta.function.arguments or "")
    assert {i: "".join(parts) for i, parts in streamed.items()} == {0: 'search{"q": "a"}'}
    thinking = {"model": "m", "messages": ask["messages"], "max_tokens": 5,
                "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}  # fmt: skip
    got = client.chat.completions.create(**thinking)
    assert got.usage.completion_tokens == got.usage.reasoning_tokens == 5
