"""GLM-4.7's tool calls on the chat route (``--tool-call-parser glm47``), as SGLang 0.5.23's
``serving_chat.py`` serves them (its ``glm_constraint``, lines 1836-1856, and
``function_call_parser.py`` ``get_structure_constraint``): every request with tools and a
``tool_choice`` other than ``none`` gets the EBNF grammar of its whole answer
(``generate_glm_grammar``: reasoning, text, calls), applied from its first token
(``ebnf_full_assistant``: not deferred past the reasoning), forced calls read in GLM-4.7's
format; through a real engine serving a tiny model whose vocabulary holds GLM's tags, and
unit checks of the sampling params the route builds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from stages.engine.glm_grammar import glm_turn
from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings, chat_request
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.tiny_model import BYTE_CHARS, make_tagged_byte_model

TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<think>", "</think>", "<|assistant|>")  # fmt: skip
# GLM-4.7's own words for its format (what the template inference reads), then the messages,
# and the assistant's turn opened in its reasoning, as GLM-4.7's template opens it
TEMPLATE = (
    "{# <tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
    "</arg_value></tool_call> #}{% for m in messages %}{{ m.content }}:{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)


def _tool(name: str, strict: bool = False) -> dict[str, Any]:
    digits = {"type": "object", "additionalProperties": False,
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}  # fmt: skip
    fn = {"name": name, "parameters": digits, **({"strict": True} if strict else {})}
    return {"type": "function", "function": fn}


TOOLS = [_tool("add"), _tool("mul")]
ASK = {"model": "m", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 160}


@pytest.fixture(scope="module")
def glm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("glm47")
    # the tags' characters too: a real vocabulary writes any text (llguidance cannot force a
    # byte the vocabulary has no token of)
    model_dir = make_tagged_byte_model(root / "model", TAGS, chars=BYTE_CHARS + "\n<>/_| ")
    (root / "template.jinja").write_text(TEMPLATE)
    with serving(
        model_dir, root / "engine.log", "--chat-template", str(root / "template.jinja"),
        "--tool-call-parser", "glm47", "--reasoning-parser", "glm45",
    ) as eng:  # fmt: skip
        yield eng


def _settings(engine: Engine, parser: str | None = "glm47") -> ChatSettings:
    settings = ChatSettings.of(
        _tokenizer(engine), engine.model_dir, chat_template=TEMPLATE, tool_call_parser=parser,
        reasoning_parser="glm45",
    )  # fmt: skip
    assert settings is not None
    return settings


def _sampling(settings: ChatSettings, **body: Any) -> dict[str, Any]:
    native = chat_request({"messages": ASK["messages"], "tools": TOOLS, **body}, settings, 512)[0]
    return {**native["sampling_params"], "require_reasoning": native.get("require_reasoning")}


@pytest.mark.timeout(60)
def test_every_request_with_tools_gets_the_grammar_of_its_whole_answer(glm_engine: Engine) -> None:
    """serving_chat.py:1836 glm_constraint: tools, tool_choice not none, no strict tool: the
    grammar of the answer (thinking unless chat_template_kwargs.enable_thinking is false; at
    least one call when required; a named tool's alone; one call without parallel_tool_calls),
    applied with the reasoning (ebnf_full_assistant); protocol.py:1264: with another
    constraint, that one (no error even for a forced choice); a strict tool: the same grammar
    here (SGLang asks xgrammar for its GLM-4.7 tag); without --tool-call-parser or with
    tool_choice none: nothing."""
    settings = _settings(glm_engine)
    tokenizer = settings.tokenizer
    functions = [t["function"] for t in TOOLS]
    auto = _sampling(settings)
    assert auto["ebnf"] == glm_turn(functions, thinking=True, tokenizer=tokenizer)
    assert auto["ebnf_full_assistant"] is True and auto["require_reasoning"] is True
    off = _sampling(settings, chat_template_kwargs={"enable_thinking": False})
    assert off["ebnf"] == glm_turn(functions, thinking=False, tokenizer=tokenizer)
    required = _sampling(settings, tool_choice="required", parallel_tool_calls=False)
    assert required["ebnf"] == glm_turn(
        functions, thinking=True, required=True, parallel=False, tokenizer=tokenizer
    )
    assert "json_schema" not in required and "structural_tag" not in required
    named = _sampling(settings, tool_choice={"type": "function", "function": {"name": "mul"}})
    assert named["ebnf"] == glm_turn(
        functions[1:], thinking=True, required=True, tokenizer=tokenizer
    )
    answer_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    theirs = _sampling(settings, tool_choice="required", response_format=answer_format)
    assert "ebnf" not in theirs and "json_schema" in theirs
    strict = [_tool("add", strict=True)]
    assert _sampling(settings, tools=strict)["ebnf"] == glm_turn(
        [strict[0]["function"]], thinking=True, tokenizer=tokenizer
    )
    with pytest.raises(OpenAIError, match="cannot be combined"):
        _sampling(settings, tools=strict, tool_choice="required", response_format=answer_format)
    assert "ebnf" not in _sampling(settings, tool_choice="none")
    unnamed = _settings(glm_engine, parser=None)  # SGLang's default: no parser, no grammar
    assert unnamed.tool_parser is None and "ebnf" not in _sampling(unnamed)


def _accepted(engine: Engine, grammar: str, ids: list[int], finished: bool) -> bool:
    """Whether the grammar, compiled as the engine compiles it, takes ``ids`` from the first
    (and, ``finished``, ends there or at the EOS that ends them)."""
    from stages.engine.grammar import GrammarSet

    tokenizer = _tokenizer(engine)
    vocab = json.loads((engine.model_dir / "config.json").read_text())["vocab_size"]
    constraint = GrammarSet(tokenizer, vocab, [tokenizer.eos_token_id]).start("ebnf", grammar)
    if any(constraint.accept(token) is not None for token in ids):
        return False
    return constraint.terminated or constraint.matcher.is_accepting() or not finished


@pytest.mark.timeout(180)
def test_glm47_answers_follow_their_grammar_from_the_first_token(glm_engine: Engine) -> None:
    """Sampled answers (auto, required, a named tool; three seeds each, the tags' logits raised
    so that a random model writes calls) are token for token what the request's grammar
    takes, their reasoning included (reasoning_content split off at </think>), calls to the
    offered tools only with numbers for a and b; a forced answer ends in calls (or its
    length); streamed, the same calls."""
    client = openai.OpenAI(base_url=glm_engine.url + "/v1", api_key="unused", max_retries=0)
    settings = _settings(glm_engine)
    tokenizer = _tokenizer(glm_engine)
    raised = {"</think>": 6, "<tool_call>": 6, "</tool_call>": 6, "<arg_key>": 3,
              "</arg_key>": 3, "<arg_value>": 3, "</arg_value>": 3}  # fmt: skip
    bias = {str(tokenizer.convert_tokens_to_ids(t)): v for t, v in raised.items()}
    mul = {"type": "function", "function": {"name": "mul"}}
    calls = 0
    for choice, names in (("auto", {"add", "mul"}), ("required", {"add", "mul"}), (mul, {"mul"})):
        grammar = _sampling(settings, tool_choice=choice)["ebnf"]
        for seed in range(3):
            ask = {**ASK, "tools": TOOLS, "tool_choice": choice, "seed": seed, "logit_bias": bias}
            (c,) = client.chat.completions.create(
                **ask, extra_body={"return_token_ids": True}
            ).choices
            ids = c.model_extra["response_token_ids"]
            assert _accepted(glm_engine, grammar, ids, c.finish_reason != "length"), c
            text = tokenizer.decode(ids)
            if "</think>" in text:  # the reasoning split off where the grammar ended it
                head = text.split("</think>", 1)[0].strip()
                assert (c.message.reasoning_content or "").strip() == head
            for call in c.message.tool_calls or ():
                arguments = json.loads(call.function.arguments)
                assert call.function.name in names and set(arguments) <= {"a", "b"}
                assert all(isinstance(v, int | float) for v in arguments.values())
            calls += len(c.message.tool_calls or ())
            assert c.finish_reason in (("tool_calls", "length") if choice != "auto" else
                                       ("tool_calls", "length", "stop"))  # fmt: skip
            whole = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]
            pieces: dict[int, list[str]] = {}
            for chunk in client.chat.completions.create(**ask, stream=True):
                for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    piece = pieces.setdefault(delta.index, ["", ""])
                    piece[0] += delta.function.name or ""
                    piece[1] += delta.function.arguments or ""
            assert [tuple(pieces[i]) for i in sorted(pieces)][: len(whole)] == whole
    assert calls >= 5
