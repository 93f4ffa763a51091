"""``stages.engine.native_tags`` against xgrammar 0.2.7's ``get_model_structural_tag`` (what
SGLang 0.5.23's detectors ask it for): the same tag, field for field, for random tools (strict
or not, with or without parameters), each tool choice and ``parallel_tool_calls``, called as
SGLang calls it (``reasoning`` false). And each tag compiles here (``structural_format``).

Skipped unless xgrammar imports (see ``test_engine_xgrammar_structural_format.py``).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

xgrammar: Any = pytest.importorskip("xgrammar")

from stages.engine.native_tags import NATIVE_TAGS, native_tag  # noqa: E402
from stages.engine.structural_format import format_grammar  # noqa: E402

_MODEL = {  # the parser's model in xgrammar's registry
    "kimi_k2": "kimi", "qwen3_coder": "qwen_3_coder", "step3p5": "qwen_3_coder",
    "nanbeige": "qwen_3_coder", "deepseekv32": "deepseek_v3_2",
}  # fmt: skip


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    tools = []
    for i in range(rng.randint(1, 3)):
        fn: dict[str, Any] = {"name": f"tool_{i}", "description": "d"}
        if rng.random() < 0.8:
            fn["parameters"] = {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"][: rng.randint(0, 1)]}  # fmt: skip
        if rng.random() < 0.7:
            fn["strict"] = rng.random() < 0.6
        tools.append({"type": "function", "function": fn})
    return tools


def _choices(tools: list[dict[str, Any]], rng: random.Random) -> list[Any]:
    name = rng.choice(tools)["function"]["name"]
    return ["required", "auto", {"type": "function", "function": {"name": name}}]


@pytest.mark.parametrize("parser", sorted(NATIVE_TAGS))
def test_the_tags_are_xgrammars_own_and_compile_here(parser: str) -> None:
    """Where SGLang's detector passes the tools on as they are (Kimi's forced calls: see the
    next test), the tag is xgrammar's builder's."""
    rng = random.Random(0)
    for _ in range(60):
        tools = _tools(rng)
        for choice in _choices(tools, rng):
            if parser == "kimi_k2" and choice != "auto":
                continue
            for parallel in (True, False):
                ours = native_tag(parser, tools, choice, parallel=parallel)
                theirs = xgrammar.get_model_structural_tag(
                    model=_MODEL[parser], tools=tools, tool_choice=choice, reasoning=False,
                    parallel_tool_calls=parallel,
                ).model_dump()  # fmt: skip
                assert ours == theirs, (tools, choice, parallel)
                assert format_grammar(json.loads(json.dumps(ours)), json.dumps)


@pytest.mark.parametrize("parser", sorted(NATIVE_TAGS))
def test_the_tags_are_what_sglangs_detectors_send(parser: str) -> None:
    """SGLang 0.5.23's ``FunctionCallParser.get_structure_constraint`` (with xgrammar on the
    path, as SGLang installs it), for ``required``, a named function and ``auto`` with a
    strict tool."""
    pytest.importorskip("sglang.srt.function_call.function_call_parser")
    from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    rng = random.Random(1)
    for _ in range(60):
        tools = _tools(rng)
        for choice in _choices(tools, rng):
            if choice == "auto" and not any(t["function"].get("strict") for t in tools):
                continue  # SGLang constrains nothing then
            for parallel in (True, False):
                sglang = FunctionCallParser([Tool(**t) for t in tools], parser)
                asked = ToolChoice(**choice) if isinstance(choice, dict) else choice
                kind, tag = sglang.get_structure_constraint(asked, parallel_tool_calls=parallel)
                theirs = json.loads(json.dumps(tag.model_dump(mode="json")))
                assert kind == "structural_tag"
                assert native_tag(parser, tools, choice, parallel=parallel) == theirs
