"""Structural tags in the newer form: ``{"type": "structural_tag", "format": {...}}``.

SGLang 0.5.23 takes this form (``protocol.StructuralTagResponseFormat``, xgrammar 0.2.7's
``StructuralTag``) on ``response_format`` and in ``sampling_params.structural_tag``, and its
default grammar backend, xgrammar, compiles it (``xgrammar_backend.dispatch_structural_tag``;
its llguidance backend takes only the legacy ``structures``/``triggers`` form). This module
writes the same language as a grammar for llguidance, the engine's backend, following the
grammar xgrammar builds for each format (``Grammar.from_structural_tag``):

- ``const_string`` its ``value``; ``json_schema`` (``style: json``) a JSON value of its schema,
  whose objects take no property they do not name unless they say (``additionalProperties``),
  as xgrammar compiles a schema (``strict_objects``); ``style: qwen_xml`` Qwen3-Coder's
  ``<parameter=KEY>VALUE</parameter>`` parameters (``stages.engine.qwen_xml``);
- ``sequence`` and ``or`` of ``elements``; ``optional``, ``star``, ``plus`` and ``repeat``
  (``min``, ``max``, -1 unbounded) of a ``content``;
- ``tag``: ``begin``, ``content``, then ``end`` (a string, or one of a list);
- ``any_text``: free text without any of its ``excludes``, of ``max_chars`` characters at most;
  in a tag's content it ends where one of the tag's ends begins (xgrammar's ``TagDispatch``
  with the ends excluded);
- ``regex``: its ``pattern`` as xgrammar reads it (``.`` any character, a newline too;
  ``\\d``, ``\\w``, ``\\s`` ASCII classes; a leading ``^`` and trailing ``$`` dropped);
- ``triggered_tags``: free text (without its ``triggers`` and ``excludes``) in which a trigger
  starts one of the ``tags`` that begin with it, the first trigger or exclude the text
  completes deciding, as ``TagDispatch`` scans; with ``at_least_one`` a tag comes first, with
  ``stop_after_first`` nothing comes after the first tag;
- ``tags_with_separator``: ``tags`` with ``separator`` between them and nothing else, none or
  more, at least one (``at_least_one``) or no more than one (``stop_after_first``).

Free text (``any_text``, ``triggered_tags``) and ``regex`` are taken where what follows them is
known: at the end of the whole format, or at the end of a tag's content (a pattern and the end
after it are one lexeme, so where the pattern ends is the regex engine's to find, as it is
xgrammar's parser's), and not in an alternative of ``or``. Elsewhere (followed by more of a
sequence, inside ``optional``...) llguidance's lexer, which commits to one lexeme where
xgrammar's parser keeps several, could not end them where xgrammar may, so they are refused, as
are the formats llguidance cannot be given the same meaning for here: ``grammar`` elements
(their lexemes would be matched greedily), the token formats (``token``, ``exclude_token``,
``any_tokens``, ``token_triggered_tags``, ``token_dispatch``, a tag's ``begin`` or ``end`` as a
token), ``dispatch``, the other XML styles of ``json_schema`` and ``qwen_xml_parameter``,
``any_order``, ``max_whitespace_cnt``, and ``any_text``'s ``max_tokens``. A refusal names the
field (``format.tags[0].content.type``...) and what is wrong there: the request's 400.

Differences left, for the same reason:

- where two lexemes can match at one place, llguidance takes the longer: alternatives of
  ``or`` one of whose strings begins another (``">"`` and ``">xb"`` before ``"x"``), or a part
  that may go on or be empty (``star``, ``plus``, ``optional``, ``repeat``,
  ``tags_with_separator``) followed by something that can begin the same way (a tag's end
  that begins like the repeated part, a separator before free text), so such a format may
  take less here than xgrammar takes;
- two JSON values with nothing between them, or JSON values as alternatives of ``or``:
  llguidance allows whitespace between or before them and reads adjacent numbers greedily;
- a pattern whose lexeme (with the text after it) could go on where what follows begins:
  read greedily here;
- an exclude that occurs inside the beginning of a tag's end that then does not complete:
  xgrammar does not see it (its scanner holds that text as a possible end), this engine
  refuses it.

Held to xgrammar on thousands of random formats without such parts and tens of thousands of
strings made from them: ``tests/stages/test_engine_xgrammar_structural_format.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from stages.engine.qwen_xml import QwenXml

__all__ = ["FormatError", "format_grammar", "is_new_form"]

_END = None  # what follows: the end of the whole output
_INNER = "inner"  # what follows: more of the format (no free text may end there)
_MAX_REPEAT = 256
_REFUSED = {
    "grammar": "an EBNF grammar element (llguidance would match its lexemes greedily)",
    "token": "token formats",
    "exclude_token": "token formats",
    "any_tokens": "token formats",
    "token_triggered_tags": "token formats",
    "token_dispatch": "token formats",
    "dispatch": "dispatch formats",
    "qwen_xml_parameter": "the Qwen XML parameter format",
}


class FormatError(ValueError):
    """A structural tag's format that is malformed or not served: what and where."""


def is_new_form(tag: Any) -> bool:
    """Whether a parsed structural tag is in the newer form (``format``, no ``structures``),
    as SGLang's ``is_legacy_structural_tag`` tells the two apart."""
    return isinstance(tag, dict) and tag.get("structures") is None and "format" in tag


def format_grammar(tag: dict[str, Any], literal: Callable[[str], str]) -> str:
    """The Lark grammar (for llguidance) of a structural tag in the newer form.
    ``literal(text)``: ``text`` as a sequence of the grammar (its added tokens as tokens)."""
    if tag.get("type", "structural_tag") != "structural_tag":
        raise FormatError(f"type: must be 'structural_tag', not {tag.get('type')!r}")
    unknown = sorted(set(tag) - {"type", "format"})
    if unknown:
        raise FormatError(f"{unknown[0]}: extra field not permitted")
    compiler = _Compiler(literal)
    body = compiler.node(tag.get("format"), "format", _END)
    return "\n".join(["%llguidance {}", f"start: {body}", *compiler.lines]) + "\n"


class _Compiler:
    def __init__(self, literal: Callable[[str], str]) -> None:
        self.literal = literal
        self.lines: list[str] = []
        self.count = 0
        self.alternatives = 0  # how many `or`s the node being compiled is in
        self.follow: Any = _END  # what follows the node being compiled

    def rule(self, kind: str, body: str) -> str:
        self.count += 1
        name = f"{kind}_{self.count}"
        self.lines.append(f"{name}: {body}")
        return name

    def text(self, value: str) -> str:
        return self.literal(value) if value else '""'

    def ends(self, follow: Any) -> str:
        """What must come after a node in ``follow``: nothing, or one of a tag's ends."""
        if not isinstance(follow, tuple):
            return ""
        return "(" + " | ".join(self.text(e) for e in follow) + ")"

    def node(self, fmt: Any, path: str, follow: Any) -> str:
        """A Lark expression for ``fmt`` followed by what ``follow`` says comes after it (the
        ends of the enclosing tag are part of the expression when ``follow`` holds them)."""
        self.follow = follow
        if not isinstance(fmt, dict):
            raise FormatError(f"{path}: an object is required, not {type(fmt).__name__}")
        kind = fmt.get("type")
        if kind in _REFUSED:
            raise FormatError(f"{path}.type: {_REFUSED[kind]} ({kind!r}) not supported")
        build = getattr(self, f"_{kind}", None) if isinstance(kind, str) else None
        if build is None:
            raise FormatError(f"{path}.type: unknown format type {kind!r}")
        allowed = _FIELDS[kind]
        extra = sorted(set(fmt) - allowed - {"type"})
        if extra:
            raise FormatError(f"{path}.{extra[0]}: extra field not permitted")
        return build(fmt, path, follow)

    def with_follow(self, expr: str, follow: Any) -> str:
        end = self.ends(follow)
        return f"{expr} {end}" if end else expr

    # ---- basic formats
    def _const_string(self, fmt: dict, path: str, follow: Any) -> str:
        value = _str(fmt, "value", path)
        return self.with_follow(self.rule("const", self.text(value)), follow)

    def _json_schema(self, fmt: dict, path: str, follow: Any) -> str:
        schema = fmt.get("json_schema")
        if schema is None:  # SGLang's _sanitize_structural_format: a missing schema is {}
            schema = {}
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise FormatError(f"{path}.json_schema: a JSON schema object or true is required")
        style = fmt.get("style", "json")
        if style not in ("json", "qwen_xml", "deepseek_xml"):
            raise FormatError(
                f"{path}.style: only 'json', 'qwen_xml' and 'deepseek_xml' are supported, "
                f"not {style!r}"
            )
        if fmt.get("any_order", False) is not False:
            raise FormatError(f"{path}.any_order: only false is supported")
        if fmt.get("max_whitespace_cnt") is not None:
            raise FormatError(f"{path}.max_whitespace_cnt: only null is supported")
        if style != "json":
            return self.qwen_xml(fmt.get("json_schema"), f"{path}.json_schema", follow, style)
        body = f"%json {json.dumps(strict_objects(schema))}"
        return self.with_follow(self.rule("json", body), follow)

    def qwen_xml(self, schema: Any, path: str, follow: Any, style: str = "qwen_xml") -> str:
        """Qwen3-Coder's parameters (``stages.engine.qwen_xml``), then what follows, whose
        whitespace before it is one lexeme with its text."""
        self.follow = follow
        self.tail_only(path, "a qwen_xml value")
        xml = QwenXml(self, FormatError, style)
        if not isinstance(follow, tuple):
            return xml.grammar(True if schema is None else schema, path, xml.ws())
        tails = []
        for end in follow:
            lit = self.text(end)
            head = lit[: json.JSONDecoder().raw_decode(lit)[1]] if lit.startswith('"') else ""
            self.count += 1
            name = f"XML_TAIL_{self.count}"
            if head:  # the end's text: with the whitespace before it
                self.lines.append(f"{name}: /[ \\n\\r\\t]*/ {head}")
                tails.append(f"{name} {lit[len(head) :].strip()}".strip())
            else:
                tails.append(f"{xml.ws()} {lit}")
        tail = tails[0] if len(tails) == 1 else "(" + " | ".join(tails) + ")"
        return xml.grammar(True if schema is None else schema, path, tail)

    def regex_literal(self, text: str) -> str:
        return _regex_literal(text)

    def strict(self, schema: Any) -> Any:
        return strict_objects(schema)

    def _any_text(self, fmt: dict, path: str, follow: Any) -> str:
        excludes = _strs(fmt, "excludes", path)
        if fmt.get("max_tokens") is not None:
            raise FormatError(f"{path}.max_tokens: only null is supported")
        most = fmt.get("max_chars")
        if most is not None and (type(most) is not int or most < 0):
            raise FormatError(f"{path}.max_chars: a non-negative integer or null is required")
        return self.free_text(path, [], excludes, follow, most)

    def _regex(self, fmt: dict, path: str, follow: Any) -> str:
        """A pattern, read as xgrammar reads it (``.`` any character, ``\\d``, ``\\w`` and
        ``\\s`` ASCII classes, ``^`` and ``$`` at its ends dropped), as one lexeme with the end
        that follows it: where the pattern ends is then the regex engine's to find, as
        xgrammar's parser finds it."""
        self.tail_only(path, "a regex element")
        source = _str(fmt, "pattern", path)
        pattern = _xgrammar_regex(source, f"{path}.pattern")
        self.count += 1
        name = f"REGEX_{self.count}"
        if not isinstance(follow, tuple):
            self.lines.append(f"{name}: /{pattern}/")
            return f"{name}?" if _matches_empty(source) else name
        lits = [self.text(e) for e in follow]
        if not all(lit.startswith('"') for lit in lits):
            raise FormatError(f"{path}: a regex element before a tag end that holds a token")
        self.lines.append(f"{name}: " + " | ".join(f"/{pattern}/ {lit}" for lit in lits))
        return name

    def tail_only(self, path: str, what: str) -> None:
        """Refuses ``what`` where its end is not known: in an alternative of ``or``, or with
        more of the format after it (see the module's docstring)."""
        if self.alternatives:
            raise FormatError(
                f"{path}: {what} is not supported in an alternative of 'or' (llguidance's "
                "lexer would commit to one alternative's text where xgrammar keeps both)"
            )
        if self.follow == _INNER:
            raise FormatError(
                f"{path}: {what} is supported only at the end of the whole format or of a "
                "tag's content, where what ends it is known"
            )

    # ---- free text
    def free_text(
        self,
        path: str,
        triggers: list[str],
        excludes: list[str],
        follow: Any,
        most: int | None = None,
    ) -> str:
        """Text without ``triggers`` and ``excludes`` (nor the ends that follow), of ``most``
        characters at most, then what follows (the lexemes that end at a trigger:
        ``text_then``)."""
        self.follow = follow
        self.tail_only(path, "free text")
        banned = [*triggers, *excludes, *(follow or ())]
        if any(not b for b in banned):
            raise FormatError(f"{path}: an empty trigger, exclude or end cannot end free text")
        self.count += 1
        name = f"TEXT_{self.count}"
        self.banned = "|".join(_regex_literal(b) for b in banned)
        text = "/(.|\\n)*/" if most is None else f"/(.|\\n){{0,{most}}}/"
        if banned:
            self.lines.append(f"{name}: {text} & ~/(.|\\n)*({self.banned})(.|\\n)*/")
        else:
            self.lines.append(f"{name}: {text}")
        self.free = name
        if isinstance(follow, tuple):
            ends = " | ".join(self.text_then(name, e, trigger=False) for e in follow)
            return self.rule("text_end", ends)
        return f"{name}?"

    def text_then(self, text: str, value: str, *, trigger: bool = True) -> str:
        """Free text ``text``, then ``value``: one lexeme where ``value`` is text (a greedy
        text lexeme would otherwise take the start of ``value`` too), else the text and the
        token that ends it. xgrammar's ``TagDispatch`` scans its text and acts on the first
        trigger or exclude (the ends among them) it completes, and may stop before any: a
        trigger is taken where nothing banned is complete before its last character; an end
        follows text that holds nothing banned."""
        lit = self.text(value)
        if lit.startswith('"') and json.loads(lit) == value:
            self.count += 1
            name = f"UNTIL_{self.count}"
            if trigger and self.banned:
                early = f"/(.|\\n)*({self.banned})(.|\\n)*(.|\\n)/"
                self.lines.append(f"{name}: (/(.|\\n)*/ {lit}) & ~{early}")
            else:
                self.lines.append(f"{name}: {text} {lit}")
            return name
        return f"{text}? {lit}"

    # ---- combinations
    def _sequence(self, fmt: dict, path: str, follow: Any) -> str:
        elements = _list(fmt, "elements", path)
        if not elements:
            return self.with_follow('""', follow)
        parts, i, last = [], 0, len(elements) - 1
        while i <= last:
            here, where = elements[i], f"{path}.elements[{i}]"
            if i < last and _kind(here) == "regex" and _kind(elements[i + 1]) == "const_string":
                after = follow if i + 1 == last else _INNER
                parts.append(self.regex_then(here, elements[i + 1], where, after))
                i += 2
                continue
            parts.append(self.node(here, where, follow if i == last else _INNER))
            i += 1
        return self.rule("seq", " ".join(parts))

    def regex_then(self, fmt: dict, const: dict, path: str, follow: Any) -> str:
        """A ``regex`` element and the ``const_string`` after it: one lexeme (or the pattern's
        lexeme and the token the string begins with), so the pattern ends where the string
        begins, wherever that is, as xgrammar's parser finds it."""
        for item, where in ((fmt, path), (const, path)):
            extra = sorted(set(item) - _FIELDS[item["type"]] - {"type"})
            if extra:
                raise FormatError(f"{where}.{extra[0]}: extra field not permitted")
        source = _str(fmt, "pattern", path)
        pattern = _xgrammar_regex(source, f"{path}.pattern")
        value = _str(const, "value", path)
        lit = self.text(value)
        self.count += 1
        name = f"REGEX_{self.count}"
        if _is_text(lit, value):  # all text: one lexeme
            ends = [self.text(e) for e in follow] if isinstance(follow, tuple) else []
            if ends and all(_is_text(t, e) for t, e in zip(ends, follow, strict=True)):
                # at the end of a tag's content: the tag's end in the lexeme too
                self.lines.append(f"{name}: " + " | ".join(f"/{pattern}/ {lit} {e}" for e in ends))
                return name
            self.lines.append(f"{name}: /{pattern}/ {lit}")
            return self.with_follow(name, follow)
        if lit.startswith('"'):  # text before a token: the pattern could take its start
            raise FormatError(f"{path}: a regex element before text and a token is not supported")
        self.lines.append(f"{name}: /{pattern}/")
        head = f"{name}?" if _matches_empty(source) else name
        return self.with_follow(f"{head} {lit}", follow)

    def _or(self, fmt: dict, path: str, follow: Any) -> str:
        elements = _list(fmt, "elements", path)
        if not elements:
            raise FormatError(f"{path}.elements: at least one element is required")
        self.alternatives += len(elements) > 1
        try:
            alts = [self.node(e, f"{path}.elements[{i}]", follow) for i, e in enumerate(elements)]
        finally:
            self.alternatives -= len(elements) > 1
        return self.rule("or", " | ".join(alts))

    def _optional(self, fmt: dict, path: str, follow: Any) -> str:
        inner = self.node(fmt.get("content"), f"{path}.content", _INNER)
        return self.with_follow(self.rule("opt", f"({inner})?"), follow)

    def _star(self, fmt: dict, path: str, follow: Any) -> str:
        inner = self.node(fmt.get("content"), f"{path}.content", _INNER)
        return self.with_follow(self.rule("star", f"({inner})*"), follow)

    def _plus(self, fmt: dict, path: str, follow: Any) -> str:
        inner = self.node(fmt.get("content"), f"{path}.content", _INNER)
        return self.with_follow(self.rule("plus", f"({inner})+"), follow)

    def _repeat(self, fmt: dict, path: str, follow: Any) -> str:
        low, high = _int(fmt, "min", path), _int(fmt, "max", path)
        if low < 0 or high < -1 or (high != -1 and high < low):
            raise FormatError(f"{path}: min {low} and max {high} are not a range")
        if max(low, high) > _MAX_REPEAT:
            raise FormatError(f"{path}: at most {_MAX_REPEAT} repetitions are supported")
        inner = self.node(fmt.get("content"), f"{path}.content", _INNER)
        parts = [inner] * low
        if high == -1:
            parts.append(f"({inner})*")
        else:
            tail = ""
            for _ in range(high - low):
                tail = f"({inner} {tail})?" if tail else f"({inner})?"
            if tail:
                parts.append(tail)
        return self.with_follow(self.rule("repeat", " ".join(parts) or '""'), follow)

    # ---- tags
    def tag_parts(self, fmt: dict, path: str) -> tuple[str, tuple[str, ...]]:
        """(begin, ends) of a ``tag``, both strings here."""
        if not isinstance(fmt, dict) or fmt.get("type", "tag") != "tag":
            raise FormatError(f"{path}: a tag format is required")
        begin, end = fmt.get("begin"), fmt.get("end")
        if isinstance(begin, dict) or isinstance(end, dict):
            raise FormatError(f"{path}: a token as a tag's begin or end is not supported")
        if not isinstance(begin, str):
            raise FormatError(f"{path}.begin: a string is required")
        ends = (end,) if isinstance(end, str) else end
        if (
            not isinstance(ends, list | tuple)
            or not ends
            or not all(isinstance(e, str) for e in ends)
        ):
            raise FormatError(f"{path}.end: a string or a non-empty list of strings is required")
        extra = sorted(set(fmt) - {"type", "begin", "content", "end"})
        if extra:
            raise FormatError(f"{path}.{extra[0]}: extra field not permitted")
        return begin, tuple(ends)

    def tag_body(self, fmt: dict, path: str) -> str:
        """A tag's content and end (the expression after its begin)."""
        _, ends = self.tag_parts(fmt, path)
        return self.node(fmt.get("content"), f"{path}.content", ends)

    def whole_tag(self, fmt: dict, path: str) -> str:
        begin, _ = self.tag_parts(fmt, path)
        return self.rule("tag", f"{self.text(begin)} {self.tag_body(fmt, path)}")

    def _tag(self, fmt: dict, path: str, follow: Any) -> str:
        return self.with_follow(self.whole_tag(fmt, path), follow)

    def _tags_with_separator(self, fmt: dict, path: str, follow: Any) -> str:
        tags = _list(fmt, "tags", path)
        if not tags:
            raise FormatError(f"{path}.tags: at least one tag is required")
        sep = _str(fmt, "separator", path)
        one = self.rule(
            "tags", " | ".join(self.whole_tag(t, f"{path}.tags[{i}]") for i, t in enumerate(tags))
        )
        at_least_one, first_only = (
            _flag(fmt, "at_least_one", path),
            _flag(fmt, "stop_after_first", path),
        )
        if first_only:
            body = one if at_least_one else f"({one})?"
        else:
            many = f"{one} ({self.text(sep)} {one})*"
            body = many if at_least_one else f"({many})?"
        return self.with_follow(self.rule("sep", body), follow)

    def _triggered_tags(self, fmt: dict, path: str, follow: Any) -> str:
        triggers = _strs(fmt, "triggers", path)
        if not triggers:
            raise FormatError(f"{path}.triggers: at least one trigger is required")
        tags = _list(fmt, "tags", path)
        if not tags:
            raise FormatError(f"{path}.tags: at least one tag is required")
        excludes = _strs(fmt, "excludes", path)
        at_least_one, first_only = (
            _flag(fmt, "at_least_one", path),
            _flag(fmt, "stop_after_first", path),
        )
        groups: dict[str, list[str]] = {t: [] for t in triggers}
        wholes = []
        for i, t in enumerate(tags):
            where = f"{path}.tags[{i}]"
            begin, _ = self.tag_parts(t, where)
            matched = [trig for trig in triggers if begin.startswith(trig)]
            if len(matched) != 1:
                raise FormatError(
                    f"{where}.begin: {begin!r} must begin with exactly one trigger, "
                    f"it begins with {len(matched)}"
                )
            body = self.tag_body(t, where)
            rest = begin[len(matched[0]) :]
            groups[matched[0]].append(f"{self.text(rest)} {body}" if rest else body)
            if at_least_one:
                wholes.append(self.rule("tag", f"{self.text(begin)} {body}"))
        after = self.ends(follow)
        if at_least_one and first_only:
            first = self.rule("first", " | ".join(wholes))
            return self.rule("trig", f"{first} {after}".strip())
        tail = self.free_text(path, triggers, excludes, follow)
        text = self.free
        dispatches = []
        for trig, alts in groups.items():
            if not alts:
                continue
            group = self.rule("group", " | ".join(alts))
            dispatches.append(f"{self.text_then(text, trig)} {group}")
        if not dispatches:  # no tag: only the free text
            return tail
        step = self.rule("step", " | ".join(dispatches))
        if first_only:
            body = f"{step} {after}".strip() + f" | {tail}"
        elif at_least_one:
            body = f"({' | '.join(wholes)}) {step}* {tail}"
        else:
            body = f"{step}* {tail}"
        return self.rule("trig", body)


_FIELDS = {
    "const_string": {"value"},
    "json_schema": {"json_schema", "style", "any_order", "max_whitespace_cnt"},
    "any_text": {"excludes", "max_tokens", "max_chars"},
    "regex": {"pattern"},
    "sequence": {"elements"},
    "or": {"elements"},
    "optional": {"content"},
    "star": {"content"},
    "plus": {"content"},
    "repeat": {"min", "max", "content"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
}


def strict_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that does not say, as
    xgrammar compiles a schema (its ``strict_mode``, on for structural tags), where llguidance
    follows JSON Schema and lets other properties in."""
    if isinstance(schema, list):
        return [strict_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_objects(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}  # fmt: skip
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: strict_objects(v) for k, v in schema["properties"].items()}
    objectish = schema.get("type") == "object" or "properties" in schema
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if objectish and not any(k in schema for k in open_keys):
        out["additionalProperties"] = False
    return out


def _is_text(lit: str, value: str) -> bool:
    """Whether ``lit`` (``literal(value)``) is all text, no token in it."""
    return lit.startswith('"') and json.loads(lit) == value


def _kind(fmt: Any) -> Any:
    return fmt.get("type") if isinstance(fmt, dict) else None


def _str(fmt: dict, key: str, path: str) -> str:
    value = fmt.get(key)
    if not isinstance(value, str):
        raise FormatError(f"{path}.{key}: a string is required")
    return value


def _strs(fmt: dict, key: str, path: str) -> list[str]:
    value = fmt.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(f"{path}.{key}: a list of strings is required")
    return value


def _list(fmt: dict, key: str, path: str) -> list[Any]:
    value = fmt.get(key)
    if not isinstance(value, list):
        raise FormatError(f"{path}.{key}: a list is required")
    return value


def _int(fmt: dict, key: str, path: str) -> int:
    value = fmt.get(key)
    if type(value) is not int:
        raise FormatError(f"{path}.{key}: an integer is required")
    return value


def _flag(fmt: dict, key: str, path: str) -> bool:
    value = fmt.get(key, False)
    if not isinstance(value, bool):
        raise FormatError(f"{path}.{key}: a boolean is required")
    return value


_ASCII = {"d": "0-9", "w": "a-zA-Z0-9_", "s": "\\f\\n\\r\\t\\v \\xa0"}


def _xgrammar_regex(pattern: str, where: str) -> str:
    """``pattern`` for llguidance's ``/.../`` as xgrammar 0.2.7 reads it: ``.`` matches any
    character, a newline too; ``\\d``, ``\\w``, ``\\s`` and their negations are its ASCII
    classes; a leading ``^`` and a trailing ``$`` are dropped."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    out, i, in_class = ["(?s)"], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt.lower() in _ASCII:
                chars = _ASCII[nxt.lower()]
                if not in_class:
                    out.append(f"[{'^' if nxt.isupper() else ''}{chars}]")
                elif nxt.islower():
                    out.append(chars)
                else:
                    raise FormatError(f"{where}: \\{nxt} inside a character class is not supported")
            else:
                out.append(ch + nxt)
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class and out[-1] not in ("[", "[^"):
            in_class = False
        if ch in "^$" and not in_class:
            raise FormatError(f"{where}: anchors inside a pattern are not supported")
        out.append("\\/" if ch == "/" else ch)
        i += 1
    return "".join(out)


def _matches_empty(pattern: str) -> bool:
    """Whether ``pattern`` (xgrammar's, Python's syntax) matches the empty text: its lexeme
    is then optional (a lexeme cannot be empty)."""
    import re

    try:
        return re.fullmatch(pattern, "", re.S) is not None
    except re.error:
        return False


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a llguidance ``/.../`` regex."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch.isalnum() or ch == " ":
            out.append(ch)
        elif ch == "/":
            out.append("\\/")
        else:
            out.append("\\" + ch if ch in r".^$*+?()[]{}|\-" else ch)
    return "".join(out)
