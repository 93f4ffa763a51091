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

_MODEL = {"kimi_k2": "kimi"}  # the parser's model in xgrammar's registry


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


@pytest.mark.parametrize("parser", sorted(NATIVE_TAGS))
def test_the_tags_are_xgrammars_own_and_compile_here(parser: str) -> None:
    rng = random.Random(0)
    for _ in range(60):
        tools = _tools(rng)
        name = rng.choice(tools)["function"]["name"]
        for choice in ("required", "auto", {"type": "function", "function": {"name": name}}):
            for parallel in (True, False):
                ours = native_tag(parser, tools, choice, parallel=parallel)
                theirs = xgrammar.get_model_structural_tag(
                    model=_MODEL[parser], tools=tools, tool_choice=choice, reasoning=False,
                    parallel_tool_calls=parallel,
                ).model_dump()  # fmt: skip
                assert ours == theirs, (tools, choice, parallel)
                assert format_grammar(json.loads(json.dumps(ours)), json.dumps)
