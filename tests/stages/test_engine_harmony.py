"""gpt-oss's Harmony format: ``--reasoning-parser gpt-oss`` and ``--tool-call-parser gpt-oss``
(``stages.engine.harmony``), as SGLang 0.5.23's ``HarmonyParser``, ``GptOssDetector``s and
``serving_chat``'s ``is_gpt_oss`` read them; held to SGLang's own code on random texts by
``test_engine_sglang_harmony.py`` where SGLang imports, and here on the cases that matter, then
through a real engine serving a tiny ``gpt_oss`` model and the ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from transformers import AutoTokenizer

from stages.engine.harmony import GptOssCalls, HarmonyReader, HarmonyReasoning, kept_stop_ids
from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings, chat_request
from stages.engine.tool_calls import ToolCallParser, forced_calls, strict_calls
from tests.stages.test_engine_grammar import TOOLS
from tests.stages.test_engine_server import Engine, serving
from tests.stages.test_engine_tool_formats import _streamed_calls
from tests.stages.tiny_model import make_gpt_oss_model

ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json"
    '<|message|>{"a": 1, "b": 2}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 3.<|return|>"
NAMES = {"add", "mul"}


def _tokens(text: str) -> list[str]:
    """``text`` as a model writes it: each of Harmony's tokens whole, the rest a character at
    a time."""
    import re

    return [p for part in re.split(r"(<\|[a-z]+\|>)", text) if part
            for p in ([part] if part.startswith("<|") else list(part))]  # fmt: skip


def test_reader_gives_each_message_as_its_event() -> None:
    whole = [(e.kind, e.content, e.raw) for e in HarmonyReader().whole(ANALYSIS + CALL + FINAL)]
    assert whole == [
        ("reasoning", "Need the weather.", ""),
        ("call", '{"a": 1, "b": 2}', CALL),
        ("normal", "It is 3.", ""),
    ]
    reader, streamed = HarmonyReader(), []
    for token in _tokens(ANALYSIS + FINAL):
        streamed += [(e.kind, e.content) for e in reader.feed(token)]
    # the analysis and the final message go out as they are written
    assert [c for k, c in streamed if k == "reasoning" and c] == list("Need the weather.")
    assert "".join(c for k, c in streamed if k == "normal") == "It is 3."
    # a message on a channel it does not know, or cut short: held back, never sent
    assert HarmonyReader().whole("<|channel|>other<|message|>x<|end|>") == []
    assert HarmonyReader().whole("<|channel|>commentary<|message|>x") == []


def test_reasoning_is_the_analysis_channel() -> None:
    parser = HarmonyReasoning()
    assert parser.parse(ANALYSIS + CALL + FINAL) == ("Need the weather.", CALL + "It is 3.")
    # without the special tokens (a tokenizer that skips them): the words are read
    assert HarmonyReasoning().parse("analysisI think.assistantfinalHi") == ("I think.", "Hi")
    # force_nonempty_content: reasoning alone becomes the content (whole answers)
    assert HarmonyReasoning(nonempty=True).parse(ANALYSIS) == ("", "Need the weather.")
    # no Harmony at all: content here (SGLang's reader would drop it), whole and streamed
    assert HarmonyReasoning().parse("plain words") == ("", "plain words")
    stream = HarmonyReasoning()
    assert stream.feed("plain ") == ("", "") and stream.feed("words") == ("", "")
    assert stream.finish() == ("", "plain words")
    stream = HarmonyReasoning()
    got = [stream.feed(t) for t in _tokens(ANALYSIS + FINAL)] + [stream.finish()]
    assert "".join(r for r, _ in got) == "Need the weather."
    assert "".join(c for _, c in got) == "It is 3."


def test_calls_are_read_from_commentary_messages_that_end_in_call() -> None:
    reader = GptOssCalls(NAMES)
    text = ANALYSIS + CALL + CALL.replace("add", "mul") + FINAL
    content, calls = reader.parse(text)
    assert content == "It is 3."
    assert calls == [
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"name": "mul", "arguments": '{"a": 1, "b": 2}'},
    ]
    # a tool not offered, arguments not JSON: dropped, the others numbered on
    bad = CALL.replace("add", "ghost") + CALL.replace('{"a": 1, "b": 2}', "{") + CALL
    assert reader.listed(bad)[1] == [(0, {"name": "add", "arguments": '{"a": 1, "b": 2}'})]
    # no new assistant message on the commentary channel: no calls (GptOssDetector.bot_token)
    assert not reader.has_tool_call(CALL.removeprefix("<|start|>assistant"))
    # streamed: each call whole, once its <|call|> comes
    stream, pieces, content = ToolCallParser(TOOLS, "gpt-oss").stream(), [], ""
    for token in _tokens(ANALYSIS + CALL + FINAL):
        more, new = stream.feed(token)
        content, pieces = content + more, pieces + new
        if token == "<|call|>":
            assert new == [{"index": 0, "name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert content == "It is 3." and len(pieces) == 1 and stream.flush() == ""


def test_forced_calls_are_framed_as_a_commentary_message_and_strict_auto_is_not() -> None:
    tag = json.loads(forced_calls(TOOLS, "gpt-oss", named=False, parallel=True)["structural_tag"])
    assert tag["at_least_one"] is True
    assert tag["structures"][0]["begin"] == (
        "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
    )
    assert tag["structures"][0]["end"] == "<|call|>"
    assert strict_calls(TOOLS, "gpt-oss") is None  # SGLang's Harmony tag holds every message


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss_model(tmp_path_factory.mktemp("gpt-oss") / "model")


def test_a_gpt_oss_model_keeps_its_special_tokens_and_refuses_effort_none(
    model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = ChatSettings.of(tokenizer, model_dir, tool_call_parser="gpt-oss")
    assert settings is not None and settings.model_type == "gpt_oss"
    ask = {"messages": [{"role": "user", "content": "ab"}], "skip_special_tokens": True}
    native, _ = chat_request(ask, settings, 512)
    assert native["sampling_params"]["skip_special_tokens"] is False  # serving_chat: is_gpt_oss
    with pytest.raises(OpenAIError, match="Harmony does not support reasoning effort none"):
        chat_request({**ask, "chat_template_kwargs": {"reasoning_effort": "none"}}, settings, 512)
    call = tokenizer.convert_tokens_to_ids("<|call|>")
    assert kept_stop_ids(tokenizer, "gpt-oss") == {call}
    assert kept_stop_ids(tokenizer, "qwen25") == frozenset()


@pytest.fixture(scope="module")
def harmony_engine(model_dir: Path) -> Iterator[Engine]:
    with serving(
        model_dir, model_dir.parent / "engine.log",
        "--tool-call-parser", "gpt-oss", "--reasoning-parser", "gpt-oss",
    ) as eng:  # fmt: skip
        yield eng


def _ids(engine: Engine, *tokens: str) -> list[int]:
    return AutoTokenizer.from_pretrained(engine.model_dir).convert_tokens_to_ids(list(tokens))


@pytest.mark.timeout(180)
def test_a_forced_tool_choice_answers_with_harmony_calls(harmony_engine: Engine) -> None:
    """tool_choice required or named: a commentary message to the function, held to its
    parameters (strict), after the reasoning (the grammar waits for its <|end|>, pushed here by a
    logit bias); gpt-oss stops at <|call|>, whose text is kept so that the call is read; the
    stream's calls are the whole answer's."""
    (end,) = _ids(harmony_engine, "<|end|>")
    client = openai.OpenAI(base_url=harmony_engine.url + "/v1", api_key="unused", max_retries=0)
    ask: dict[str, Any] = {
        "model": "m", "messages": [{"role": "user", "content": "ab"}], "tools": TOOLS,
        "max_tokens": 200, "logit_bias": {str(end): 8}, "seed": 3,
    }  # fmt: skip
    for choice, names in (
        ("required", NAMES),
        ({"type": "function", "function": {"name": "mul"}}, {"mul"}),
    ):
        out = client.chat.completions.create(**ask, tool_choice=choice, n=3)
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or ()) == 1, c
            (call,) = c.message.tool_calls
            assert call.function.name in names
            assert set(json.loads(call.function.arguments)) == {"a", "b"}
        assert out.usage.completion_tokens_details.reasoning_tokens >= 3
    forced = {**ask, "tool_choice": "required"}
    whole = client.chat.completions.create(**forced).choices[0].message.tool_calls
    assert whole and _streamed_calls(client, forced) == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


@pytest.mark.timeout(120)
def test_call_stop_text_is_kept_and_return_is_trimmed(harmony_engine: Engine) -> None:
    """detokenizer_manager.trim_matched_stop: with --tool-call-parser gpt-oss, an answer that
    stops at <|call|> keeps its text; any other stop token (<|return|>) is trimmed."""
    call, ret = _ids(harmony_engine, "<|call|>", "<|return|>")
    for token, text in ((call, "<|call|>"), (ret, "")):
        body = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "skip_special_tokens": False,
                                "logit_bias": {str(token): 100}},
        }  # fmt: skip
        out = requests.post(harmony_engine.url + "/generate", json=body, timeout=30).json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
        assert out["text"] == text


@pytest.mark.timeout(180)
def test_chat_answers_split_the_analysis_channel_from_the_rest(harmony_engine: Engine) -> None:
    """A model writing Harmony's tokens (pushed by logit biases): the reasoning and content are
    what the reader gives of its text with its special tokens (kept though the request asks to
    skip them: the model is gpt_oss), whole and streamed alike."""
    tokenizer = AutoTokenizer.from_pretrained(harmony_engine.model_dir)
    (call,) = _ids(harmony_engine, "<|call|>")
    bias = {str(i): 2.5 for i in _ids(harmony_engine, "<|channel|>", "<|message|>", "<|end|>",
                                      "<|start|>", "<|return|>")}  # fmt: skip
    client = openai.OpenAI(base_url=harmony_engine.url + "/v1", api_key="unused", max_retries=0)
    marked = 0
    for seed in range(6):
        ask: dict[str, Any] = {
            "model": "m", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 60,
            "seed": seed, "logit_bias": bias,
            "extra_body": {"skip_special_tokens": True, "return_output_ids_in_sglext": True},
        }  # fmt: skip
        out = client.chat.completions.create(**ask)
        ids = out.model_extra["sglext"]["output_ids"][0]
        if out.choices[0].finish_reason == "stop" and ids[-1] != call:
            ids = ids[:-1]  # the stop token, trimmed (<|call|> is kept)
        want = HarmonyReasoning().parse(tokenizer.decode(ids, skip_special_tokens=False))
        message = out.choices[0].message
        got = (getattr(message, "reasoning_content", None) or "", message.content or "")
        assert got == want, (seed, tokenizer.decode(ids, skip_special_tokens=False))
        marked += "<|" in tokenizer.decode(ids, skip_special_tokens=False)
        del ask["extra_body"]["return_output_ids_in_sglext"]
        reasoning = content = ""
        for chunk in client.chat.completions.create(**ask, stream=True):
            for c in chunk.choices:
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
        assert (reasoning, content) == want
    assert marked  # answers with Harmony's tokens, which skipping them would have changed


def test_the_parse_routes_read_harmony(harmony_engine: Engine) -> None:
    """/separate_reasoning and /parse_function_call with gpt-oss (no model needed)."""
    url = harmony_engine.url
    body = {"text": ANALYSIS + FINAL, "reasoning_parser": "gpt-oss"}
    out = requests.post(url + "/separate_reasoning", json=body, timeout=30).json()
    assert (out["reasoning_text"], out["text"]) == ("Need the weather.", "It is 3.")
    body = {"text": ANALYSIS + CALL, "tool_call_parser": "gpt-oss", "tools": TOOLS}
    out = requests.post(url + "/parse_function_call", json=body, timeout=30).json()
    assert out["normal_text"] == ""
    assert out["calls"] == [{"tool_index": 0, "name": "add", "parameters": '{"a": 1, "b": 2}'}]
