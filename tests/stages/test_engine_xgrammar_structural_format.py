"""``stages.engine.structural_format`` against xgrammar 0.2.7 (SGLang 0.5.23's default grammar
backend, which compiles the newer structural-tag form): random formats of every served type,
and for each, strings made to follow it and strings changed from those, accepted or not by
xgrammar's grammar (``Grammar.from_structural_tag``, ``testing._is_grammar_accept_string``) and by
the llguidance grammar this engine writes (a matcher over a byte tokenizer, a byte a token).

Skipped unless xgrammar imports: ``pip install --target DIR --no-deps xgrammar==0.2.7
apache-tvm-ffi`` and ``PYTHONPATH=DIR`` (its CPU wheel needs nothing more here).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

xgrammar: Any = pytest.importorskip("xgrammar")

import llguidance  # noqa: E402
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from stages.engine.structural_format import FormatError, format_grammar  # noqa: E402

pytestmark = pytest.mark.timeout(600)


class _Bytes:
    """llguidance's view of a tokenizer whose tokens are the 256 bytes (and an EOS)."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]
        self.eos_token_id = 256
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)


def _ours(fmt: dict) -> str:
    return format_grammar({"type": "structural_tag", "format": fmt}, json.dumps)


def _we_accept(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def _xgrammar_accepts(fmt: dict, text: str) -> bool:
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag), text)


_ALPHABET = "ab<>/x1 \n|"  # "|" begins the ends of tags, and nothing else
# xgrammar's regex syntax (Python's), with texts that follow each pattern
_PATTERNS = {
    r"[a-z]+\d?": ["ab", "x1", "b"],
    r"(ab|c)*.x": ["abcqx", "\nx", "cc/x"],
    r"a*": ["", "a", "aaa"],
    r"^[\w-]+\s$": ["a-b ", "x_\n"],
    r"\D{1,3}/?": ["ab", "<>/", "x/"],
    r"[^<]+<": ["ab<", " x<"],
    r"(?:x|<\/)+": ["x", "</x"],
}
_SCHEMAS = [
    {"type": "integer"},
    {"type": "string", "maxLength": 3},
    {"type": "boolean"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
]
_VALUES = {0: ["0", "12", "-3"], 1: ['""', '"ab"', '"x"'], 2: ["true", "false"]}
_VALUES[3] = ['{"a":1}', '{ "a" : 2 }', '{"a":-1}', '{"a":1,"z":2}']  # the last: not strict
_VALUES[4] = ["[]", "[1]", "[1, 2]"]


class _Gen:
    """Random formats of the served types, and strings that follow them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def exclude(self) -> str:
        """An exclude, never part of a tag's end (the module's docstring)."""
        return "".join(self.rng.choice("abx<") for _ in range(self.rng.randint(2, 3)))

    def word(self, lo: int = 1, hi: int = 3) -> str:
        return "".join(self.rng.choice("abx<>/") for _ in range(self.rng.randint(lo, hi)))

    def fmt(self, depth: int, tail: bool, framed: bool = True, quantified: bool = False) -> dict:
        """A format; ``tail``: free text may be here (end of everything or of a tag);
        ``framed``: a bare JSON value may be here (not next to another one: see the module's
        docstring); ``quantified``: the direct content of a quantifier, which is not another
        (xgrammar 0.2.7 rejects "x" for repeat 0..1 of repeat 0..-1 of "x")."""
        kinds = ["const_string", "tag"]
        if not quantified:  # a pattern's lexeme, repeated, may be read greedily (see above)
            kinds += ["tags_with_separator", "pattern_then_text"]
        if framed:
            kinds.append("json_schema")
        if not quantified:
            kinds.append("repeat")
        if depth > 0:
            kinds += ["sequence", "or", "tag", "tag"]
            if not quantified:
                kinds += ["optional", "star", "plus"]
        if tail:
            kinds += ["any_text", "triggered_tags", "triggered_tags", "regex"]
        kind = self.rng.choice(kinds)
        d = depth - 1
        if kind == "const_string":
            return {"type": kind, "value": self.word()}
        if kind == "json_schema":
            return {"type": kind, "json_schema": self.rng.choice(_SCHEMAS)}
        if kind == "any_text":
            most = self.rng.choice([None, None, 0, 2, 5])
            return {
                "type": kind,
                "excludes": [self.exclude() for _ in range(self.rng.randint(0, 2))],
                **({} if most is None else {"max_chars": most}),
            }
        if kind == "regex":
            return {"type": kind, "pattern": self.rng.choice(list(_PATTERNS))}
        if kind == "pattern_then_text":  # a pattern anywhere, with the text that ends it
            pattern = {"type": "regex", "pattern": self.rng.choice(list(_PATTERNS))}
            text = {"type": "const_string", "value": self.rng.choice(["<", "a>", "|", "x/"])}
            return {"type": "sequence", "elements": [pattern, text]}

        if kind == "tag":
            return self.tag(d)
        if kind in ("sequence", "or"):
            n = self.rng.randint(1, 3)
            alone = n == 1  # JSON values as alternatives: see the module's docstring
            free = tail and (n == 1 if kind == "or" else True)  # no free text in alternatives
            # in a sequence or alternatives of two or more, no part that may go on or be empty
            # (the module's docstring: where two lexemes match at one place, llguidance's
            # lexer commits)
            fixed = quantified or n > 1
            elements = [
                self.fmt(d, free and (kind == "or" or i == n - 1), framed and alone, fixed)
                for i in range(n)
            ]
            return {"type": kind, "elements": elements}
        if kind in ("optional", "star", "plus"):
            content = self.fmt(d, False, framed and kind == "optional", True)
            return {"type": kind, "content": content}
        if kind == "repeat":
            low = self.rng.randint(0, 2)
            high = self.rng.choice([-1, low, low + 1, low + 2])
            content = self.fmt(min(d, 0), False, framed and high in (0, 1), True)
            return {"type": kind, "min": low, "max": high, "content": content}
        tags = [
            self.tag(min(d, 1), begin=f"<t{i}" + self.word(0, 1) + ">")
            for i in range(self.rng.randint(1, 2))
        ]
        flags = {
            "at_least_one": self.rng.random() < 0.4,
            "stop_after_first": self.rng.random() < 0.4,
        }
        if kind == "tags_with_separator":
            return {
                "type": kind,
                "tags": tags,
                "separator": self.rng.choice([",", "", "\n", "ab"]),
                **flags,
            }
        triggers = sorted({t["begin"][:3] for t in tags})
        excludes = [self.exclude()] if self.rng.random() < 0.3 else []
        return {"type": kind, "triggers": triggers, "tags": tags, "excludes": excludes, **flags}

    def tag(self, depth: int, begin: str | None = None) -> dict:
        # an end begins with a character that begins nothing else: a part of the content that
        # may go on cannot begin like the end (the module's docstring)
        ends = ["|" + self.rng.choice(["/", "//", "|/", "/|", "x/"]) + ">" for _ in range(2)]
        ends = ends[: self.rng.randint(1, 2)]
        return {
            "type": "tag",
            "begin": begin or "<" + self.word(1, 2) + ">",
            "content": self.fmt(max(depth, 0), True),
            "end": ends[0] if len(ends) == 1 else ends,
        }

    def text(self, fmt: dict) -> str:
        """A string that follows ``fmt`` (most of the time: free text is drawn at random)."""
        rng, kind = self.rng, fmt["type"]
        if kind == "const_string":
            return fmt["value"]
        if kind == "json_schema":
            return rng.choice(_VALUES[_SCHEMAS.index(fmt["json_schema"])])
        if kind == "any_text":
            return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 6)))
        if kind == "regex":
            return rng.choice(_PATTERNS[fmt["pattern"]])
        if kind == "tag":
            end = fmt["end"] if isinstance(fmt["end"], str) else rng.choice(fmt["end"])
            return fmt["begin"] + self.text(fmt["content"]) + end
        if kind == "sequence":
            return "".join(self.text(e) for e in fmt["elements"])
        if kind == "or":
            return self.text(rng.choice(fmt["elements"]))
        if kind == "optional":
            return self.text(fmt["content"]) if rng.random() < 0.5 else ""
        if kind in ("star", "plus"):
            n = rng.randint(1 if kind == "plus" else 0, 3)
            return "".join(self.text(fmt["content"]) for _ in range(n))
        if kind == "repeat":
            high = fmt["max"] if fmt["max"] >= 0 else fmt["min"] + 2
            return "".join(self.text(fmt["content"]) for _ in range(rng.randint(fmt["min"], high)))
        tags = fmt["tags"]
        many = 1 if fmt["stop_after_first"] else rng.randint(0, 3)
        if fmt["at_least_one"]:
            many = max(many, 1)
        picked = [self.text(rng.choice(tags)) for _ in range(many)]
        if kind == "tags_with_separator":
            return fmt["separator"].join(picked)
        free = [
            "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 4)))
            for _ in range(many + 1)
        ]
        if fmt["at_least_one"]:
            free[0] = ""
        return "".join(f + p for f, p in zip(free, [*picked, ""], strict=True))

    def changed(self, text: str) -> str:
        """``text`` with a character added, dropped or replaced, or cut short."""
        rng = self.rng
        i = rng.randint(0, len(text))
        move = rng.randint(0, 3)
        if move == 0:
            return text[:i] + rng.choice(_ALPHABET) + text[i:]
        if move == 1:
            return text[:i] + text[i + 1 :]
        if move == 2:
            return text[:i] + rng.choice(_ALPHABET) + text[i + 1 :]
        return text[:i]


def _literal_begins_another(fmt: Any, inside_or: bool = False) -> bool:
    """Whether two strings under one ``or`` (literals, tags' begins) begin one another
    (``">"`` and ``">xb"``)."""
    found: list[str] = []

    def walk(node: Any, under: bool) -> None:
        if isinstance(node, dict):
            if under and node.get("type") == "const_string":
                found.append(node["value"])
            if under and node.get("type") == "tag":
                found.append(node["begin"])
            for value in node.values():
                walk(value, under or node.get("type") == "or")
        elif isinstance(node, list):
            for item in node:
                walk(item, under)

    walk(fmt, inside_or)
    return any(a != b and b.startswith(a) for a in found for b in found)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_formats_accept_what_xgrammar_accepts(seed):
    rng = random.Random(seed)
    gen = _Gen(rng)
    compared = accepted = refused = 0
    differences: list[tuple[str, str, bool, bool]] = []
    for _ in range(400):
        fmt = gen.fmt(depth=rng.randint(0, 3), tail=True)
        if _literal_begins_another(fmt):  # the module's docstring: llguidance commits
            continue
        try:
            grammar = _ours(fmt)
        except FormatError:
            refused += 1  # the generator stays in what is served; an empty trigger or the like
            continue
        texts = [gen.text(fmt) for _ in range(6)]
        texts += [gen.changed(t) for t in texts for _ in range(2)]
        for text in texts:
            ours, theirs = _we_accept(grammar, text), _xgrammar_accepts(fmt, text)
            compared += 1
            accepted += theirs
            if ours != theirs:
                differences.append((json.dumps(fmt), text, ours, theirs))
    assert not differences, differences[:5]
    assert compared > 5000 and accepted > compared // 4 and refused < 40, (compared, accepted)


# ---- qwen_xml and deepseek_xml (Qwen3-Coder's and DeepSeek V3.2's parameters) -----------------

_XML_KINDS = {  # a property's schema, and values that follow it (raw, as written)
    "string": ({"type": "string"}, ["Oslo", "a b\nc", "", " x ", "1 < 2"]),
    "enum": ({"type": "string", "enum": ["on", "off"]}, ["on", " off\n", "of"]),
    "short": ({"type": "string", "maxLength": 3}, ["ab", " abc ", "abcd", ""]),
    "integer": ({"type": "integer"}, ["3", "\n-12\n", "1.5", "x"]),
    "number": ({"type": "number"}, ["1.5", " 2 ", "1e3", "."]),
    "boolean": ({"type": "boolean"}, ["true", " false ", "yes"]),
    "object": (
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        ['{"a": 1}', " {} ", "{a}"],
    ),
    "array": ({"type": "array", "items": {"type": "integer"}}, ["[1, 2]", " [] ", "[x]"]),
    "untyped": ({}, ["text", " [1] ", '{"k": "v"}', "{x"]),
    "nullable": ({"type": ["string", "null"]}, ["null", "text", " "]),
}


_DSML = "\uff5cDSML\uff5c"


def _xml_param(style: str, name: str, value: str, rng: random.Random) -> str:
    if style == "qwen_xml":
        return f"<parameter={name}>{value}</parameter>"
    string = rng.choice(["true", "false", "maybe"][: 2 + (rng.random() < 0.1)])
    return f'<{_DSML}parameter name="{name}" string="{string}">{value}</{_DSML}parameter>'


def _xml_case(rng: random.Random, style: str = "qwen_xml") -> tuple[dict, list[str]]:
    """A random object schema in an XML style and texts of its parameters."""
    names = rng.sample(["city", "days", "opt", "x_1", "mode"], rng.randint(0, 4))
    kinds = {n: rng.choice(list(_XML_KINDS)) for n in names}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {n: _XML_KINDS[k][0] for n, k in kinds.items()},
        "required": [n for n in names if rng.random() < 0.5],
    }
    if rng.random() < 0.3:
        schema["additionalProperties"] = True
    texts = []
    for _ in range(8):
        parts = []
        for n in names:
            if n in schema["required"] or rng.random() < 0.6:
                value = rng.choice(_XML_KINDS[kinds[n]][1])
                parts.append(rng.choice(["", "\n", " "]) + _xml_param(style, n, value, rng))
        if schema.get("additionalProperties") and rng.random() < 0.5:
            extra = rng.choice(["v", " 2 ", "[1]"])
            parts.append("\n" + _xml_param(style, "extra", extra, rng))
        if rng.random() < 0.2 and len(parts) > 1:
            rng.shuffle(parts)
        texts.append("".join(parts) + rng.choice(["", "\n", " \n"]))
    return schema, texts


@pytest.mark.parametrize("style", ["qwen_xml", "deepseek_xml"])
@pytest.mark.parametrize("seed", [0, 1])
def test_xml_parameters_accept_what_xgrammar_accepts(seed, style):
    rng = random.Random(seed)
    gen = _Gen(rng)
    compared = accepted = 0
    differences = []
    for _ in range(150):
        schema, texts = _xml_case(rng, style)
        content = {"type": "json_schema", "json_schema": schema, "style": style}
        fmt = {"type": "tag", "begin": "<f>\n", "content": content, "end": "\n</function>"}
        grammar = _ours(fmt)
        for body in texts + [gen.changed(t) for t in texts]:
            text = "<f>\n" + body + "\n</function>"
            ours, theirs = _we_accept(grammar, text), _xgrammar_accepts(fmt, text)
            compared += 1
            accepted += theirs
            if ours != theirs:
                differences.append((json.dumps(schema), text, ours, theirs))
    differences.sort(key=lambda d: len(d[0]) + len(d[1]))
    assert not differences, differences[:3]
    assert compared > 2000 and accepted > compared // 5, (compared, accepted)
