"""GLM's whole-turn tool grammar (``stages.engine.glm_grammar``).

- where SGLang imports (``test_engine_sglang_shapes.py``'s docstring says how), the text is
  ``generate_glm_grammar``'s (``function_call/glm4_moe_detector.py``, called with the arguments
  ``get_structure_constraint`` gives it) on random tool lists, or both raise the same error;
- always: the grammar compiles as the engine compiles an EBNF grammar (``GrammarSet``, with
  llguidance) for a tiny byte-level tokenizer that writes GLM's tags character by character, and
  takes or refuses hand-written answers; its compile and mask costs are printed (``-s``).

Two ways llguidance reads this grammar otherwise than xgrammar (SGLang's default backend) are
left out of the answers: its lexer is greedy, so text holding the start of a tag that may come
next and then leaving it (``<t `` before a possible ``<tool_call>``, ``</b>`` in the reasoning)
is refused; and it takes a tokenizer's added tokens (GLM's tags) as special tokens, which the
grammar's quoted tags do not match. With a realistic vocabulary (32K) the per-character rules of
the text also pass llguidance's limit of Earley items at the first token.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from stages.engine.glm_grammar import glm_grammar, glm_turn
from stages.engine.grammar import GrammarSet
from tests.stages.tiny_model import BYTE_CHARS, EOS_ID, make_byte_model

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"enum": ["C", "F"]},
            "hourly": {"type": "boolean"},
        },
    },
}
FREE = {"name": "run", "parameters": {"type": "object"}}  # any keys


# -- SGLang's text -----------------------------------------------------------------------------
NAMES = ["get_weather", "a", "a1", "f", 'say "hi"', "back\\slash", "ünï", "😀", "new\nline",
         "tab\t", "", "{x}", "a::=b", "ctl\x01"]  # fmt: skip
KEYS = ["city", "a", 'q"k', "ü", "", "<arg_key>", "x\ny", "\\"]
ENUM_VALUES = ["C", "", 'say "x"', "é", 1, 2.5, -0.0, True, False, None, [1, "a"], {"k": "v"},
               "\u2028", "a\\b"]  # fmt: skip
TYPES = ["string", "number", "integer", "boolean", "null", "array", "object", "foo", None]


def _schema(r: random.Random, depth: int = 0) -> Any:
    """A random property schema: types (lists of them too), enums, nested objects, branches."""
    roll = r.random()
    if roll < 0.3:
        kind = r.choice(TYPES) if r.random() < 0.7 else r.sample(TYPES[:-1], r.randint(0, 3))
        schema: dict[str, Any] = {"type": kind}
    elif roll < 0.5:
        schema = {"enum": r.sample(ENUM_VALUES, r.randint(0, 4))}
        if r.random() < 0.3:
            schema["type"] = r.choice(TYPES)
    elif roll < 0.65 and depth < 2:
        schema = _object(r, depth + 1)
    elif roll < 0.75 and depth < 2:
        schema = {r.choice(["anyOf", "oneOf", "allOf"]): [_schema(r, depth + 1) for _ in "ab"]}
    elif roll < 0.8:
        schema = {"$ref": "#/$defs/x"}
    elif roll < 0.9:
        return r.choice([{}, True, False, "string", 3, None, []])
    else:
        schema = {"description": "no type"}
    if r.random() < 0.02:  # SGLang raises on these
        schema = r.choice([{"type": {"x": 1}}, {"type": [["string"]]}, {"enum": 3}])
    return schema


def _object(r: random.Random, depth: int) -> Any:
    """A random object schema: properties or none, closed or open, or branches of objects."""
    roll = r.random()
    if roll < 0.1:
        return r.choice([None, {}, [], "x", 5, False, True, {"type": "object"}])
    if roll < 0.3 and depth < 3:
        keywords = r.sample(["anyOf", "oneOf", "allOf"], r.randint(1, 3))
        schema: dict[str, Any] = {k: [_object(r, depth + 1) for _ in range(r.randint(0, 3))]
                                  for k in keywords}  # fmt: skip
        keyword = keywords[0]
        if r.random() < 0.2:
            schema["properties"] = {"top": _schema(r, depth)}
        if r.random() < 0.05:
            schema[keyword] = r.choice([None, 3, "ab", {"k": {}}])  # SGLang raises on some
        return schema
    schema = {"type": "object"}
    if r.random() < 0.85:
        keys = r.sample(KEYS, r.randint(0, 4))
        schema["properties"] = {k: _schema(r, depth) for k in keys}
    elif r.random() < 0.5:
        schema["properties"] = r.choice([[], "p", None])
    for keyword, values in (
        ("additionalProperties", [False, True, {}, None, {"type": "string"}]),
        ("unevaluatedProperties", [False, True]),
        ("$ref", ["#/x"]), ("if", [{}]), ("patternProperties", [{}]), ("required", [["a"]]),
    ):  # fmt: skip
        if r.random() < 0.12:
            schema[keyword] = r.choice(values)
    return schema


def _tools(r: random.Random) -> list[dict[str, Any]] | None:
    if r.random() < 0.05:
        return r.choice([None, []])
    tools = []
    for _ in range(r.randint(1, 12) if r.random() < 0.2 else r.randint(1, 4)):
        name = r.choice(NAMES) if r.random() < 0.8 else "".join(r.sample('ab1_é"\\', 3))
        tool: dict[str, Any] = {"name": name, "description": "d"}
        if r.random() < 0.9:
            tool["parameters"] = _object(r, 0)
        tools.append(tool)
    return tools


def _outcome(make: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """``("text", the grammar)``, or the error's type (and a ValueError's message)."""
    try:
        return ("text", make(*args, **kwargs))
    except Exception as exc:
        return (type(exc).__name__, str(exc) if isinstance(exc, ValueError) else "")


@pytest.mark.timeout(120)
def test_the_grammar_is_sglangs() -> None:
    pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    from sglang.srt.entrypoints.openai.protocol import Function
    from sglang.srt.function_call.glm4_moe_detector import (
        GlmSpecialTokenConfig,
        generate_glm_grammar,
    )

    r = random.Random(0)
    seen: dict[str, int] = {}
    cases = [([{"name": "a1"}, *[{"name": "x"}] * 9, {"name": "a"}], "ValueError")]  # a1+0 = a+10
    cases += [(_tools(r), "") for _ in range(3000)]
    for tools, expected in cases:
        thinking, required, parallel = (r.random() < 0.5 for _ in range(3))
        version = r.choice(["glm45", "glm47"])
        functions = None if tools is None else [Function(**t) for t in tools]
        theirs = _outcome(
            generate_glm_grammar, thinking, functions, GlmSpecialTokenConfig(), version, True,
            False, required=required, parallel_tool_calls=parallel,
        )  # fmt: skip
        ours = _outcome(
            glm_grammar, tools, thinking=thinking, version=version, required=required,
            parallel=parallel,
        )  # fmt: skip
        assert ours == theirs, (tools, thinking, version, required, parallel)
        assert theirs[0] == (expected or theirs[0])
        seen[theirs[0]] = seen.get(theirs[0], 0) + 1
        if theirs[0] == "text":  # typed and enumerated values seen
            seen["typed"] = seen.get("typed", 0) + ("(basic_number)" in theirs[1])
            seen["enum"] = seen.get("enum", 0) + ('" | "' in theirs[1])
    assert seen["text"] > 2500 and seen["TypeError"] > 10 and seen["ValueError"] >= 1, seen
    assert seen["typed"] > 100 and seen["enum"] > 100, seen
    assert _outcome(glm_grammar, None, thinking=True, version="glm46") == _outcome(
        generate_glm_grammar, True, None, GlmSpecialTokenConfig(), "glm46", True, False
    )


def test_the_exclusion_automaton_is_sglangs() -> None:
    """On any words (the grammar's are fixed): words inside words, characters to escape."""
    pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    from sglang.srt.function_call.glm4_moe_detector import _glm_cached_string_exclude

    from stages.engine.glm_grammar import _excluding

    r = random.Random(1)
    for _ in range(400):
        words = tuple(
            "".join(r.choices('ab<>"\\]^-\n\té', k=r.randint(0, 5))) for _ in range(r.randint(0, 5))
        )
        assert _excluding("x", words) == _glm_cached_string_exclude("x", words), words


# -- llguidance --------------------------------------------------------------------------------
TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<think>", "</think>", "<|assistant|>")  # fmt: skip


@pytest.fixture(scope="module", params=["spelled", "tokens"])
def grammars(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The engine's grammars for a byte-level tokenizer that writes GLM's tags character by
    character, or (``tokens``) has them as added tokens, as GLM's own tokenizer has them
    (llguidance takes those as special tokens)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("glm") / "m"
    make_byte_model(path, seed=4, chars=BYTE_CHARS + "\n _<>/|ABCFKPRT")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if request.param == "tokens":
        tokenizer.add_tokens(list(TAGS))
    return GrammarSet(tokenizer, len(tokenizer), [EOS_ID])


def _tokens(grammars: GrammarSet, text: str) -> list[int]:
    tokenizer = grammars._tokenizer
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens) == text
    return tokens


def _takes(grammars: GrammarSet, tools: Any, text: str, **options: Any) -> bool:
    """Whether the grammar of ``tools`` (thinking unless said), as the chat route sends it
    (``glm_turn``), takes ``text`` as a whole turn."""
    options.setdefault("thinking", True)
    if options.get("version", "glm47") == "glm47":
        options.pop("version", None)
        grammar = glm_turn(tools, tokenizer=grammars._tokenizer, **options)
    else:  # GLM-4.5's: SGLang's text (the chat route sends GLM-4.7's alone)
        grammar = glm_grammar(tools, **options)
    matcher = grammars.start("ebnf", grammar).matcher
    tokens = _tokens(grammars, text)
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    assert matcher.consume_tokens(tokens), matcher.get_error()
    return matcher.is_accepting()


def _call(name: str, *pairs: tuple[str, str], sep: str = "") -> str:
    args = "".join(f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>" for k, v in pairs)
    return f"{sep}<tool_call>{name}{args}{sep}</tool_call>"


def test_an_answer_with_reasoning_text_and_calls_is_taken(grammars: GrammarSet) -> None:
    call = _call("get_weather", ("city", "Paris"))
    assert _takes(grammars, [WEATHER], "reasoning</think>some text" + call)
    assert _takes(grammars, [WEATHER], "r</think>" + call + call)
    assert _takes(grammars, [WEATHER], "r</think>just text")
    assert _takes(grammars, [WEATHER], "</think>")
    assert not _takes(grammars, [WEATHER], "no end of reasoning" + call)  # it must close
    assert not _takes(grammars, [WEATHER], "a</think>b</think>")
    assert not _takes(grammars, [WEATHER], "a<tool_call>b</think>")
    assert _takes(grammars, [WEATHER], "a <b> <|x|> <think> c</think>")
    assert _takes(grammars, [WEATHER], "some text" + call, thinking=False)
    assert not _takes(grammars, [WEATHER], "r</think>some text" + call, thinking=False)
    assert not _takes(grammars, [WEATHER], "r</think>" + call + "text after")


def test_values_are_held_to_their_property(grammars: GrammarSet) -> None:
    def takes(*pairs: tuple[str, str]) -> bool:
        return _takes(grammars, [WEATHER], "</think>" + _call("get_weather", *pairs))

    assert takes(("days", "2"), ("unit", "F"), ("hourly", "true"), ("days", "-1.5e3"))
    assert not takes(("days", "two"))
    assert not takes(("days", ""))
    assert not takes(("unit", "K"))
    assert not takes(("hourly", "yes"))
    assert not takes(("country", "FR"))  # a key the schema does not have
    assert takes(("city", "a < b / c"))
    assert not takes(("city", "a</arg_value>b"))
    assert not takes(("city", "a<think>b"))
    assert _takes(grammars, [WEATHER, FREE], "</think>" + _call("run", ("any", "thing")))
    assert not _takes(grammars, [WEATHER, FREE], "</think>" + _call("run", ("any", "a<arg_key>")))


def test_names_tags_and_counts_are_held(grammars: GrammarSet) -> None:
    one = _call("get_weather", ("city", "Paris"))
    assert not _takes(grammars, [WEATHER], "</think>" + _call("get_time"))
    assert not _takes(grammars, [WEATHER], "</think>see <tool_call> here" + one)
    assert not _takes(grammars, [WEATHER], "</think>see <|assistant|> here")
    assert not _takes(grammars, [WEATHER], "</think>see <think> here")
    assert _takes(grammars, [WEATHER], "</think>see <b> </b> here" + one)
    assert not _takes(grammars, [WEATHER], "</think>text", required=True)
    assert _takes(grammars, [WEATHER], "</think>text" + one, required=True)
    assert not _takes(grammars, [WEATHER], "</think>" + one + one, parallel=False)
    assert _takes(grammars, [WEATHER], "</think>" + one, parallel=False)
    assert _takes(grammars, [WEATHER], "</think>", parallel=False)
    assert not _takes(grammars, [WEATHER], "</think>" + one + one, parallel=False, required=True)
    assert not _takes(grammars, None, "</think>text" + one)
    assert _takes(grammars, None, "</think>text")


def test_glm45_writes_newlines_between_its_parts(grammars: GrammarSet) -> None:
    pairs = (("city", "Paris"), ("days", "3"))
    call45, call47 = _call("get_weather", *pairs, sep="\n"), _call("get_weather", *pairs)
    assert call45 == (
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    assert _takes(grammars, [WEATHER], "\n<think>r</think>\ntext" + call45, version="glm45")
    assert _takes(grammars, [WEATHER], "\ntext" + call45, version="glm45", thinking=False)
    assert not _takes(grammars, [WEATHER], "r</think>text" + call45, version="glm45")
    assert not _takes(grammars, [WEATHER], "\n<think>r</think>\ntext" + call47, version="glm45")
    assert not _takes(grammars, [WEATHER], "r</think>text" + call45, version="glm47")


def test_compile_and_mask_costs(grammars: GrammarSet) -> None:
    """Printed, not held tightly: what the grammar of five tools costs the engine."""
    tools = [
        {**WEATHER, "name": f"tool_{i}"} if i % 2 else {**FREE, "name": f"tool_{i}"}
        for i in range(5)
    ]
    text = glm_turn(tools, thinking=True, tokenizer=grammars._tokenizer)
    again = glm_turn(json.loads(json.dumps(tools)), thinking=True, tokenizer=grammars._tokenizer)
    assert again == text  # the same text each time: the engine's cache of compiled grammars
    assert not grammars.compiled("ebnf", text)
    start = time.perf_counter()
    grammars.start("ebnf", text)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    matcher = grammars.start("ebnf", text).matcher
    again = time.perf_counter() - start
    assert grammars.compiled("ebnf", text)  # the engine's cache (keyed by the text) has it
    answer = "let me see</think>sure" + _call("tool_1", ("city", "Paris"), ("days", "2")) * 3
    tokens = _tokens(grammars, answer)
    start = time.perf_counter()
    for token in tokens:
        matcher.compute_bitmask()
        assert matcher.consume_token(token), matcher.get_error()
    per_token = (time.perf_counter() - start) / len(tokens)
    assert matcher.is_accepting()
    print(
        f"\nglm grammar of 5 tools: {len(text)} characters; compiled in {compiled * 1e3:.1f} ms, "
        f"from the cache in {again * 1e3:.2f} ms; mask {per_token * 1e6:.0f} us a token "
        f"({len(tokens)} tokens, vocabulary {len(grammars._tokenizer)})"
    )
    assert compiled < 5 and per_token < 0.05
