"""The EBNF grammar of a whole GLM assistant turn with tools, as text.

As SGLang 0.5.23 writes it (``generate_glm_grammar`` in ``function_call/glm4_moe_detector.py``)
and installs it under ``--tool-call-parser glm47`` on every chat request with tools, a
``tool_choice`` other than ``none`` and no ``strict`` tool (its ``full_assistant_ebnf``: the chat
template's own special tokens, the template's ``<think>`` taken as already written, one
assistant turn); ``tests/stages/test_engine_glm_grammar.py`` holds the text to SGLang's, byte
for byte, where SGLang imports.

The grammar accepts, in order:

- with ``thinking``, the reasoning up to ``</think>`` (the template opens ``<think>``; GLM-4.5's
  ``\\n<think>`` is written by the model), holding none of ``</think>`` and the tool-call tags;
- text holding none of GLM's special tokens (``<|assistant|>``, ``<think>``, the tags);
- ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` blocks (any
  number, at least one when ``required``, at most one without ``parallel``), GLM-4.5's with a
  newline before each block, after the name and between the tags. NAME is an offered tool's;
  a tool whose schema lists every property it takes (``properties``, or branches of
  ``anyOf``/``oneOf``/``allOf`` that each do, and nothing that allows more) has those keys, in
  any order, any number of times; another has any keys. A value is held shallowly to its
  property's ``enum`` (each value as its text, else as JSON) or ``type`` (a number; ``true`` or
  ``false``; ``null``; a JSON array or object; for a string or anything else, text without the
  special tokens); under a branching schema every value is text.

Where SGLang's function raises (a ``type`` that is an object or a list holding one; an ``enum``
or a branch list that is a number or null; two tools whose name and place join to the same text,
``a1`` first and ``a`` eleventh), this raises the same error; SGLang then logs it and constrains
nothing.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from functools import lru_cache
from typing import Any

from stages.engine.qwen3_coder_calls import _properties  # get_schema_properties

__all__ = ["glm_grammar", "glm_lark", "glm_turn"]

THINK, THINK_END = "<think>", "</think>"
CALL, CALL_END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
ASSISTANT = "<|assistant|>"
_TAGS = (CALL, CALL_END, KEY, KEY_END, VALUE, VALUE_END)
_SPECIAL = (THINK, THINK_END, *_TAGS, ASSISTANT)

_TEXT = "text_without_special_tokens"
_TYPES = {
    "string": _TEXT, "number": "basic_number", "integer": "basic_number",
    "boolean": "basic_boolean", "null": "basic_null", "array": "basic_array",
    "object": "basic_object",
}  # fmt: skip
_JSON_RULES = (
    r"basic_string ::= (([\"] basic_string_1 [\"]))",
    r'basic_string_1 ::= "" | [^"\\\x00-\x1F] basic_string_1 | "\\" escape basic_string_1',
    r'escape ::= ["\\//bfnrt] | "u" [A-Fa-f0-9]{4}',
    r'basic_integer ::= "-"? ("0" | [1-9] [0-9]*) ".0"?',
    r'basic_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    r'basic_array ::= "[" ("" | ws basic_any (ws "," ws basic_any)*) ws "]"',
    r'basic_object ::= "{" ("" | ws basic_string ws ":" ws basic_any'
    r' ( ws "," ws basic_string ws ":" ws basic_any)*) ws "}"',
    r"ws ::= [ \n\t]*",
    "basic_any ::= basic_number | basic_string | basic_boolean | basic_null | basic_array"
    " | basic_object",
    'basic_boolean ::= "true" | "false"',
    'basic_null ::= "null"',
)
_OPEN_KEYWORDS = ("$ref", "$dynamicRef", "patternProperties", "dependentSchemas", "if", "then",
                  "else")  # fmt: skip
_SHORT = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
_QUOTED = '"\\'  # marked in an EBNF string


def glm_grammar(
    functions: list[dict] | None,
    *,
    thinking: bool,
    version: str = "glm47",
    required: bool = False,
    parallel: bool = True,
) -> str:
    """SGLang's grammar (root ``root``) of one assistant turn offered ``functions`` (OpenAI
    tool ``function`` objects; none: text only), ``version`` ``"glm45"`` or ``"glm47"``
    (NotImplementedError for another; SGLang asks for ``glm47``). SGLang passes the request's
    ``enable_thinking`` (true when not given) as ``thinking``; ``required`` for ``tool_choice``
    ``required`` or a named tool (then ``functions`` holds only tools of that name);
    ``parallel_tool_calls`` as ``parallel``."""
    if version not in ("glm45", "glm47"):
        raise NotImplementedError(f"Unsupported chat_template_version: {version}")
    sep = '"\\n"' if version == "glm45" else ""
    lines = [
        "root ::= assistant_turn",
        "assistant_turn ::= thinking_block text_block tool_call_blocks",
    ]
    if thinking:
        opening = '"\\n<think>" ' if version == "glm45" else ""
        lines.append(f'thinking_block ::= {opening}thinking_block_content "{THINK_END}"')
        lines += _excluding("thinking_block_content", (*_TAGS, THINK_END))
    else:
        lines.append('thinking_block ::= ""')
    lines += _excluding(_TEXT, _SPECIAL)
    lines.append(f"text_block ::= ( {sep} {_TEXT} )?")
    if functions:
        lines += _call_rules(functions, sep, required, parallel)
    else:
        lines.append('tool_call_blocks ::= ""')
    seen: dict[str, str] = {}
    for line in lines:
        name = line.split("::=")[0].strip()
        if seen.setdefault(name, line) != line:
            raise ValueError(f"Duplicate non-terminal found: {name}")
    return "\n".join(seen.values())


# the grammar's text rules, each as one lexeme of llguidance's (what it excludes; the name)
_LEXEMES = {
    "thinking_block_content": ((*_TAGS, THINK_END), "THINKING_TEXT"),
    _TEXT: (_SPECIAL, "PLAIN_TEXT"),
}
_AUTOMATON = re.compile(r"s_[0-9a-f]{16}_\d+ ::= ")  # a rule of an exclusion automaton
_DEFINED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:")  # a rule's or a terminal's definition
_NAMES = re.compile(r"\b[A-Z][A-Z0-9_]*\b")
# a Lark string or regular expression (kept as it is), or a name
_WORDS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/|\b[A-Za-z_][A-Za-z0-9_]*\b')
_ANY = "/(.|\\n)*/"


def glm_turn(
    functions: list[dict] | None,
    *,
    thinking: bool,
    tokenizer: Any,
    required: bool = False,
    parallel: bool = True,
) -> str:
    """The grammar of a GLM-4.7 answer as the engine compiles it: ``glm_grammar``'s, written
    by ``glm_lark`` where the tokenizer writes each tag as one token (GLM's own, whose tags
    are added tokens); SGLang's text as it is where it spells them out (its character rules
    then follow a tag letter by letter, which one lexeme of text cannot give back)."""
    text = glm_grammar(functions, thinking=thinking, required=required, parallel=parallel)
    return glm_lark(text) if _tags_whole(tokenizer) else text


@lru_cache(maxsize=8)
def _tags_whole(tokenizer: Any) -> bool:
    encode = getattr(tokenizer, "encode", None)
    return encode is not None and all(
        len(encode(tag, add_special_tokens=False)) == 1 for tag in _SPECIAL
    )


@lru_cache(maxsize=64)
def glm_lark(text: str) -> str:
    """``glm_grammar``'s ``text`` (GLM-4.7's: GLM-4.5's newlines after text would need the
    lexeme to give one back) as the Lark grammar the engine compiles (llguidance's conversion
    of the EBNF), the same language written for llguidance: each text rule one lexeme (any
    text holding none of its words, ``/(.|\\n)*/ & ~(...)``; between its pieces, the tags it
    may hold) instead of a rule per state of the words' automaton, whose character-by-character
    rules llguidance cannot follow over a real vocabulary (a step's mask exceeds its item
    limit); and every definition that writes a tag a rule, not a terminal, so that the engine
    takes the tags as the tokenizer's tokens (``grammar._token_literals``; a terminal is
    text)."""
    import llguidance

    # the automaton's rules left out before the conversion (most of the text: its time)
    lines = [ln for ln in text.split("\n") if not _AUTOMATON.match(ln)]
    for i, line in enumerate(lines):
        name = line.split(" ::= ", 1)[0]
        if name in _LEXEMES:
            lines[i] = f'{name} ::= "{_LEXEMES[name][1]}"'  # a placeholder, replaced below
    parts = {}
    for part in re.split(r"(?m)^(?=\S)", llguidance.grammar_from("ebnf", "\n".join(lines))):
        name = part.split(":", 1)[0] if _DEFINED.match(part) else part
        if name.lower() in _LEXEMES:
            name = name.lower()
            words, terminal = _LEXEMES[name]
            either = " | ".join(json.dumps(w) for w in words)
            # the tags the text may hold (the reasoning's <think>): tokens, which a lexeme's
            # text never holds, so between its pieces
            between = " | ".join(json.dumps(w) for w in _SPECIAL if w not in words)
            body = f"{terminal} (({between}) {terminal})*" if between else terminal
            part = f"{name}: {body}\n{terminal}: {_ANY} & ~({_ANY} ({either}) {_ANY})\n\n"
        parts[name] = part
    tagged = {n for n, part in parts.items() if n.isupper() and any(t in part for t in _SPECIAL)}
    tagged |= {n.upper() for n in _LEXEMES}  # now rules: what holds them, a rule too
    while True:  # and the terminals that hold those
        more = {
            n for n, part in parts.items() if n.isupper() and set(_NAMES.findall(part)) & tagged
        }
        if more <= tagged:
            break
        tagged |= more

    def rename(match: re.Match[str]) -> str:
        word = match.group()
        return word.lower() if word in tagged else word

    return "".join(_WORDS.sub(rename, part) for part in parts.values())


def _call_rules(functions: list[dict], sep: str, required: bool, parallel: bool) -> list[str]:
    hashes = [_hash(f["name"] + str(i)) for i, f in enumerate(functions)]  # place: a tool twice
    count = ("+" if required else "*") if parallel else ("" if required else "?")
    lines = [
        f"tool_call_blocks ::= ( {sep} tool_call_unit ){count}",
        f'tool_call_unit ::= "{CALL}" single_tool_call "{CALL_END}"',
        "single_tool_call ::= " + " | ".join(f"call_{h}" for h in hashes),
    ]
    for function, h in zip(functions, hashes, strict=True):
        schema = function.get("parameters") or {}
        properties = _properties(schema)
        if not _closed(schema):
            properties = {}
        branching = bool(properties) and any(k in schema for k in ("allOf", "anyOf", "oneOf"))
        pairs = " | ".join(
            f'"{KEY}{_literal(key)}{KEY_END}" {sep} "{VALUE}" '
            f'({_TEXT if branching else _value_rule(value)}) "{VALUE_END}"'
            for key, value in properties.items()
        )
        if pairs:
            arguments = f"( ( {pairs} ) ( {sep} ( {pairs} ) )* )?"
        else:
            arguments = (
                f'( "{KEY}" {_TEXT} "{KEY_END}" {sep} "{VALUE}" {_TEXT} "{VALUE_END}" {sep} )*'
            )
        lines.append(f'call_{h} ::= "{_literal(function["name"])}" {sep} ( arguments_{h} {sep} )?')
        lines.append(f"arguments_{h} ::= {arguments}")
    return [*lines, *_JSON_RULES]


def _value_rule(schema: Any) -> str:
    """The rule of a property's value: its ``enum``'s texts, else its ``type``'s."""
    if not isinstance(schema, dict):
        return _TEXT
    if "enum" in schema:
        choices = [
            f'"{_literal(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))}"'
            for v in schema["enum"]
        ]
        if len(choices) > 1:
            return f"({' | '.join(choices)})"
        return choices[0] if choices else _TEXT
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return " | ".join(_TYPES.get(k, _TEXT) for k in kind) or _TEXT
        return _TYPES.get(kind, _TEXT)
    return _TEXT


def _closed(schema: Any) -> bool:
    """Whether ``schema`` names every property an object of it may have."""
    if not isinstance(schema, dict):
        return schema is False
    if any(k in schema for k in _OPEN_KEYWORDS) or any(
        schema.get(k, False) is not False for k in ("additionalProperties", "unevaluatedProperties")
    ):
        return False
    branches = [b for k in ("allOf", "anyOf", "oneOf") for b in schema.get(k, [])]
    no_more = "additionalProperties" in schema  # present here only as false
    if isinstance(schema.get("properties"), dict):
        return not branches and (bool(schema["properties"]) or no_more)
    if branches:
        return all(_closed(b) for b in branches)
    return no_more


@lru_cache(maxsize=8)
def _excluding(name: str, words: tuple[str, ...]) -> tuple[str, ...]:
    """Rules of ``name``: any text holding none of ``words``, one rule a state of their
    Aho-Corasick automaton (the states' names hashed from the words)."""
    words = tuple(sorted({w for w in words if w}))
    if not words:
        return (f"{name} ::= [^]*",)
    goto: list[dict[str, int]] = [{}]
    ends: set[int] = set()
    for word in words:
        state = 0
        for ch in word:
            if ch not in goto[state]:
                goto[state][ch] = len(goto)
                goto.append({})
            state = goto[state][ch]
        ends.add(state)
    fail = [0] * len(goto)
    queue = deque(goto[0].values())
    while queue:  # breadth first: a state's fallback is settled before its children's
        state = queue.popleft()
        for ch, child in goto[state].items():
            queue.append(child)
            fallback = fail[state]
            while fallback and ch not in goto[fallback]:
                fallback = fail[fallback]
            fail[child] = goto[fallback].get(ch, 0)
            if fail[child] in ends:  # a word ends inside this one
                ends.add(child)

    def step(state: int, ch: str) -> int:
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    prefix = _hash("\x00".join(words))
    chars = sorted(set("".join(words)))
    others = "".join(_escape(c, "\\]^-") for c in chars)
    rules = [f"{name} ::= s_{prefix}_0"]
    for state in range(len(goto)):
        if state in ends:
            continue
        moves = sorted((step(state, c), c) for c in chars)
        choices = [f"[^{others}] s_{prefix}_0"]
        choices += [f'"{_escape(c, _QUOTED)}" s_{prefix}_{to}' for to, c in moves if to not in ends]
        rules.append(f's_{prefix}_{state} ::= {" | ".join(choices)} | ""')
    return tuple(rules)


def _escape(ch: str, marked: str) -> str:
    """``ch`` in an EBNF string or character class: ``marked`` characters after a backslash,
    control and non-ASCII characters as escapes."""
    if ch in marked:
        return "\\" + ch
    if ch in _SHORT:
        return _SHORT[ch]
    return ch if " " <= ch <= "~" else f"\\x{ord(ch):02X}"


def _literal(text: str) -> str:
    """``text`` inside an EBNF string literal, escaped as JSON."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
