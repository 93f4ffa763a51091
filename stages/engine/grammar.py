"""Constrained decoding: ``sampling_params.json_schema``, ``regex``, ``ebnf`` and
``structural_tag``.

As SGLang 0.5 constrains a sample with its llguidance backend (``--grammar-backend llguidance``,
``srt/constrained/llguidance_backend.py``): the request's grammar is compiled (a JSON schema
with flexible whitespace, SGLang's default; a regular expression; an EBNF or Lark grammar; a
structural tag in the ``structures``/``triggers`` form, the one that backend takes: free text in
which each trigger starts a structure that follows its schema, or in the newer ``format`` form
as SGLang's default backend, xgrammar, takes it: ``stages.engine.structural_format``), each
sample gets its own matcher, and before every sampled token the tokens the grammar does not
allow next get ``-inf`` logits. The log-probs reported are those of the distribution so
constrained, as SGLang's. Once the grammar is complete only an EOS token is allowed; with
``ignore_eos`` the sample ends there anyway, with ``finish_reason {type: stop, matched: <the EOS
id>}`` (SGLang's ``is_terminated``). A grammar that fails to compile is a 400 naming the field
(``Failed to compile json grammar: ...``, SGLang's words). Compiled grammars are kept (the last
64), so a schema sent again costs a copy. A new one is compiled on a worker thread of the set's
(``compile_later``; llguidance compiles without holding the GIL) while the request waits, as
SGLang's scheduler holds a request in its grammar queue until its grammar is ready: the engine's
event loop does not stop serving for it (1-9 ms a schema here, more for a large one).

The tokenizer: llguidance reads byte-level BPE and SentencePiece tokenizers itself. For one it
does not read (a character or word tokenizer whose decoder just joins tokens, like the shipped
arithmetic models'), each token's text is taken as its bytes, which is right when the
tokenizer's text is the concatenation of its tokens' texts; a tokenizer whose text is not (one
that puts spaces between words) cannot be constrained, and a grammar sent to it is a 400.
A grammar whose text spells a special token's (``<|im_end|>`` written out in a regex or a
schema's ``const``) is held by a view of the tokenizer whose text is tokenized as text
(``_PlainText``): llguidance would force the special token for that text and then refuse it,
aborting the sample; xgrammar, SGLang's default, has the ordinary tokens that spell it.

A step's masks are computed together (llguidance's executor, in its threads without the GIL),
then applied to the logits in one tensor operation (``GrammarSet.constrain``).
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog
import torch

from stages.engine.structural_format import format_grammar, is_new_form

__all__ = ["Constraint", "GrammarError", "GrammarSet"]

log = structlog.get_logger("inflight.engine.grammar")

# a sampling_params field (protocol.GRAMMAR_FIELDS) -> SGLang's grammar key where they differ
# (GrammarManager.process_req_with_grammar)
_KEYS = {"json_schema": "json"}
_CACHED = 64  # compiled grammars kept
# from this many constrained rows a step, masks are computed in llguidance's threads (fewer:
# one after another, which costs less CPU; bench/grammar.py: 8 rows of a 32K vocabulary
# 188-256 us a row against 269-433, 32 rows 166-178 against 124-159)
_PARALLEL_ROWS = 16
_ROW_BY_ROW = 4  # up to this many rows, each row's logits are masked in place


class GrammarError(ValueError):
    """A grammar that cannot be used: the message says why (the caller names the field)."""


class Constraint:
    """One sample's grammar state: which tokens may come next, and the tokens it took."""

    __slots__ = ("eos", "matcher", "stuck", "terminated")

    def __init__(self, matcher: Any, eos: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos = eos
        self.terminated = False  # complete, and an EOS token taken after it
        self.stuck = False  # its grammar allowed no token of the vocabulary at the last step

    def accept(self, token: int) -> str | None:
        """Take the sampled ``token``; an error message if the grammar cannot (then the
        sample is aborted, as SGLang aborts it)."""
        if self.terminated:
            return None
        matcher = self.matcher
        if matcher.is_stopped() and token in self.eos:
            self.terminated = True
            return None
        if not matcher.consume_token(token):
            return matcher.get_error() or f"the grammar does not allow token {token}"
        return None


class GrammarSet:
    """The grammars of one engine: compiled for its tokenizer (cached), a matcher per sample."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        json_whitespace: dict[str, Any] | None = None,
    ) -> None:
        # a JSON schema's whitespace, as SGLang's llguidance backend compiles it: flexible
        # (its default), or none (--constrained-json-disable-any-whitespace), or what
        # --constrained-json-whitespace-pattern matches
        self._json_defaults = {"whitespace_flexible": True, **(json_whitespace or {})}
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._ll: Any = None  # llguidance's tokenizer, or why there is none
        # the same, its text tokenized as text (_PlainText), for the grammars that spell a
        # special token's text, and those texts (built when first needed)
        self._plain: Any = None
        self._special_texts: tuple[str, ...] | None = None
        self._added: frozenset[str] | None = None  # _added_tokens, once read
        self._llexecutor: Any = None  # computes the masks of a step together
        self._worker: ThreadPoolExecutor | None = None  # compile_later's thread
        # the tokens that end a reasoning (--reasoning-parser's end tag): a sample that
        # require_reasoning has its grammar from the token after them (none: from the start)
        self.think_end: tuple[int, ...] = ()
        # the tokens of a start tag the model may write itself (ThinkFormat.self_opens): an
        # answer that opens with them has reasoning tokens counted without require_reasoning
        self.think_start: tuple[int, ...] = ()
        # the end tags a request may pick as its own (GenerateInput.think_end: K2 Horizon's
        # efforts'; SGLang's request_selectable_think_end_id_sequences)
        self.think_ends: tuple[tuple[int, ...], ...] = ()

    def start(self, field: str, text: str) -> Constraint:
        """A fresh constraint of the grammar ``text`` given as ``field`` (one of
        ``protocol.GRAMMAR_FIELDS``); GrammarError if it does not compile."""
        template = self._template(field, text)
        return Constraint(template.deep_copy(), frozenset(self._ll_tokenizer().eos_tokens))

    def compiled(self, field: str, text: str) -> bool:
        """Whether the grammar ``text`` given as ``field`` is compiled and kept."""
        with self._lock:
            return (_KEYS.get(field, field), text) in self._compiled

    def compile_later(
        self,
        grammars: Iterable[tuple[str, str]],
        done: Callable[[tuple[str, GrammarError] | None], None],
    ) -> None:
        """Compile ``grammars`` (``(field, text)`` pairs) on this set's worker thread and keep
        them, then call ``done`` there: with None, or with the field of the first that does not
        compile and its GrammarError."""
        grammars = list(grammars)

        def work() -> None:
            for field, text in grammars:
                try:
                    self._template(field, text)
                except GrammarError as exc:
                    done((field, exc))
                    return
                except Exception as exc:  # not llguidance's refusal: said, never left hanging
                    log.exception("grammar_compile_failed", error=repr(exc))
                    done((field, GrammarError(f"Failed to compile grammar: {exc!r}")))
                    return
            done(None)

        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            worker = self._worker
        worker.submit(work)

    def _template(self, field: str, text: str) -> Any:
        """The compiled grammar (kept: the last ``_CACHED``), compiled now if it is not."""
        kind = _KEYS.get(field, field)
        key = (kind, text)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template
        template = self._compile(kind, text)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > _CACHED:
                self._compiled.popitem(last=False)
        return template

    def _compile(self, kind: str, text: str) -> Any:
        import llguidance

        tokenizer = self._ll_tokenizer()
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults=self._json_defaults
                )
            elif kind == "structural_tag":
                grammar = _structural_tag(text, self._added_tokens())
            elif kind == "regex":
                grammar = llguidance.grammar_from("regex", text)
            else:
                plain = llguidance.grammar_from("ebnf", text)
                grammar = _token_literals(plain, self._added_tokens())
        except Exception as exc:  # malformed JSON, unknown format: llguidance's words
            raise GrammarError(f"Failed to compile {kind} grammar: {exc}") from None
        if self._spells_special(text):
            tokenizer = self._plain_text()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if kind in ("structural_tag", "ebnf") and "unknown special token" in matcher.get_error():
            # an added token llguidance does not take as one: all of it as text
            plain = _structural_tag(text) if kind == "structural_tag" else plain
            matcher = llguidance.LLMatcher(tokenizer, plain, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"Failed to compile {kind} grammar: {matcher.get_error()}")
        return matcher

    def _spells_special(self, text: str) -> bool:
        """Whether a grammar's source may spell a special token's text (its escapes taken
        out): llguidance would force that token for the text (``_PlainText``)."""
        with self._lock:
            if self._special_texts is None:
                read = self._ll
                texts = special_texts(read) if hasattr(read, "is_special_token") else ()
                self._special_texts = tuple(t.decode("utf-8", "replace") for t in texts)
        bare = text.replace("\\", "")
        return any(t in bare for t in self._special_texts)

    def _plain_text(self) -> Any:
        """llguidance's tokenizer with its text tokenized as text, built once."""
        with self._lock:
            if self._plain is None:
                self._plain = _plain_text_tokenizer(self._ll)
            return self._plain

    def _added_tokens(self) -> frozenset[str]:
        """The tokenizer's added tokens written ``<...>``, which a structural tag takes as
        tokens (``_structural_tag``)."""
        if self._added is None:
            added = getattr(self._tokenizer, "added_tokens_decoder", None) or {}
            texts = (getattr(t, "content", t) for t in added.values())
            self._added = frozenset(
                t for t in texts if isinstance(t, str) and len(t) > 2 and t[0] + t[-1] == "<>"
            )
        return self._added

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now (SGLang sets its grammar backend up
        at start), so that the first request with a grammar does not wait for it; the server
        calls it on a thread of its own."""
        try:
            self._ll_tokenizer()
        except GrammarError:
            pass  # said to each request with a grammar

    def _ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (about a second for a large
        vocabulary); a tokenizer it cannot take fails every time with the same error."""
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
                except GrammarError as exc:
                    self._ll = exc
                except Exception as exc:  # llguidance's own refusal of the tokenizer
                    self._ll = GrammarError(f"llguidance cannot read this tokenizer: {exc}")
            if isinstance(self._ll, GrammarError):
                raise GrammarError(str(self._ll))
            return self._ll

    def _executor(self) -> Any:
        if self._llexecutor is None:
            import llguidance

            self._llexecutor = llguidance.LLExecutor()
        return self._llexecutor

    # -- the scheduler's side ------------------------------------------------------------------
    def constrain(
        self, logits: torch.Tensor, rows: list[int], constraints: list[Constraint]
    ) -> None:
        """Set to ``-inf`` the logits of ``rows`` that each row's constraint does not allow
        next; a constraint whose grammar allows no token at all is marked ``stuck`` (its
        sample is aborted once the step's tokens are in)."""
        count, words = len(rows), (self.vocab_size + 31) // 32
        bits = np.empty((count, words), dtype="<i4")  # bit k of word w: token 32 * w + k
        if count >= _PARALLEL_ROWS:  # in llguidance's threads, without the GIL
            self._executor().unsafe_compute_mask_ptr(
                [(c.matcher, i) for i, c in enumerate(constraints)],
                bits.ctypes.data,
                words * 4,
                count,
            )
        else:
            for i, constraint in enumerate(constraints):
                constraint.matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, words * 4)
        width = logits.shape[1]
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        blocked = torch.from_numpy(allowed[:, :width] == 0)
        if blocked.shape[1] < width:  # logits past the tokenizer's vocabulary: never allowed
            more = torch.ones((count, width - blocked.shape[1]), dtype=torch.bool)
            blocked = torch.cat([blocked, more], dim=1)
        blocked = blocked.to(logits.device, non_blocking=True)
        if count <= _ROW_BY_ROW:
            for i, row in enumerate(rows):
                logits[row].masked_fill_(blocked[i], float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            masked = logits.index_select(0, index).masked_fill_(blocked, float("-inf"))
            logits.index_copy_(0, index, masked)
        for i in np.flatnonzero(~bits.any(axis=1)).tolist():
            constraints[i].stuck = True


# a string literal or a regular expression of a Lark grammar (llguidance's conversion of EBNF)
_LARK_LEXEME = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/')
_LARK_DEFINITION = re.compile(r"^(?=\S)", re.MULTILINE)  # where a rule or a terminal begins


def _token_literals(lark: str, tokens: Collection[str]) -> str:
    """A Lark grammar whose rules' string literals holding one of ``tokens`` (the tokenizer's
    added tokens written ``<...>``) take that token there, as xgrammar, SGLang's default
    backend, matches a token by its text (GLM's ``"<tool_call>"``, ``"</think>"``): llguidance
    reads such a token as special, which a literal's characters never match, so a grammar that
    writes one could not be followed. Terminals (their names in capitals) are text, and stay."""
    known = sorted((t for t in tokens if t), key=len, reverse=True)
    if not known or not any(t in lark for t in known):
        return lark
    split = re.compile("(" + "|".join(map(re.escape, known)) + ")")

    def literal(match: re.Match[str]) -> str:
        lexeme = match.group()
        if lexeme[0] != '"' or not split.search(lexeme):
            return lexeme
        try:
            parts = split.split(json.loads(lexeme))
        except ValueError:  # an escape JSON does not write: left as it is
            return lexeme
        return "(" + " ".join(p if p in tokens else json.dumps(p) for p in parts if p) + ")"

    return "".join(
        part if part[:1].isupper() else _LARK_LEXEME.sub(literal, part)
        for part in _LARK_DEFINITION.split(lark)
    )


def _structural_tag(text: str, tokens: Collection[str] = ()) -> str:
    """The grammar of a structural tag in SGLang's legacy form (``{structures: [{begin,
    schema, end}], triggers, at_least_one}``; the form its llguidance backend takes): free
    text, in which each trigger starts a structure whose body follows its schema (each
    structure's trigger is the first one its ``begin`` starts with); with ``at_least_one``,
    as xgrammar has it and SGLang asks for a forced tool call, structures only, one or more
    (a newline between two allowed), and no free text.

    ``tokens``: the tokenizer's added tokens written ``<...>`` (Qwen's ``<tool_call>``,
    Llama's ``<|python_tag|>``, DeepSeek's and Kimi's markers): where a trigger, a begin or an
    end holds one, the grammar takes that token there, what the model writes (as xgrammar
    matches a token by its text), not its characters spelled out one by one, which llguidance
    would otherwise ask of the model; the rest is text."""
    import json

    tag = json.loads(text)
    known = sorted((t for t in tokens if t), key=len, reverse=True)
    split = re.compile("(" + "|".join(map(re.escape, known)) + ")") if known else None

    def literal(value: str) -> str:
        """``value`` as the grammar's sequence: its tokens as tokens, the rest as text."""
        parts = split.split(value) if split is not None else [value]
        return " ".join(p if p in tokens else json.dumps(p) for p in parts if p)

    if is_new_form(tag):  # {type: structural_tag, format: {...}}: xgrammar's form
        return format_grammar(tag, literal)
    if not isinstance(tag, dict) or tag.get("structures") is None:
        raise ValueError(
            "a structural tag needs {structures: [{begin, schema, end}], triggers: [...]} or "
            "{type: structural_tag, format: {...}}"
        )
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise ValueError("triggers: a non-empty list of strings is required")
    structures = tag["structures"]
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures: a non-empty list is required")
    for s in structures:
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError("each structure needs begin and end strings")
    lines = ["%llguidance {}"]
    names = [f"s_{i}" for i in range(len(structures))]
    if tag.get("at_least_one"):
        lines += ['start: one ("\\n"? one)*', f"one: {' | '.join(names)}"]
    else:
        lines += [f"start: ({' | '.join(names)})* TAG_TEXT", "TAG_TEXT: /(.|\\n)*/"]
    for name, s in zip(names, structures, strict=True):
        schema = {} if s.get("schema") is None else s["schema"]
        head = literal(s["begin"])
        if not tag.get("at_least_one"):
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structure {s['begin']!r} does not begin with a trigger")
            rest = literal(s["begin"][len(trigger) :])
            if trigger in tokens:  # the token itself starts it
                head = f"TAG_TEXT {trigger} {rest}"
            else:  # its text, matched lazily: the free text ends where it first appears
                lines.append(f"{name}_trigger[lazy]: TAG_TEXT {json.dumps(trigger)}")
                head = f"{name}_trigger {rest}"
        lines.append(f"{name}: {head} %json {json.dumps(schema)} {literal(s['end'])}")
    return "\n".join(lines) + "\n"


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    """The llguidance tokenizer of ``tokenizer``: its own reading when it has one, else each
    token's text as its bytes (when the tokenizer's text is the tokens' texts joined)."""
    import llguidance
    import llguidance.hf

    eos_token: int | list[int] | None = eos or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            read = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token)
        except (ValueError, TypeError) as exc:
            log.info("grammar_tokenizer_by_token_texts", reason=str(exc))
        else:
            return read
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_TokenTexts(tokenizer, vocab_size, eos)), n_vocab=vocab_size
    )


def special_texts(read: Any) -> tuple[bytes, ...]:
    """The texts of ``read``'s special tokens (llguidance's tokenizer), longest first."""
    special = (read.decode_bytes([i]) for i in range(read.vocab_size) if read.is_special_token(i))
    return tuple(sorted({t for t in special if t}, key=len, reverse=True))


def _plain_text_tokenizer(read: Any) -> Any:
    """``read`` (llguidance's tokenizer) with its text tokenized as text (``_PlainText``)."""
    import llguidance

    wrapped = llguidance.TokenizerWrapper(_PlainText(read))
    return llguidance.LLTokenizer(wrapped, n_vocab=read.vocab_size, eos_token=read.eos_tokens)


class _PlainText:
    """llguidance's own reading of a tokenizer, whose text is tokenized as text: a special
    token's text in it (``<|im_end|>`` written out) as the ordinary tokens that spell it.

    llguidance forces the tokens its tokenizer gives the bytes a grammar forces, and the
    Hugging Face tokenizer gives a special token for its text; the matcher then refuses that
    token, which its trie keeps apart from text, and the sample is aborted (llguidance 1.9:
    ``token "<|open|>" doesn't satisfy the grammar; forced bytes: got '<'``). The tokens and
    special ids are ``read``'s; a text's tokens are ``read``'s unless they hold a special
    token, whose text is then spelled by the longest ordinary tokens (``greedy_tokenize``)."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self.tokens = [read.decode_bytes([i]) for i in range(read.vocab_size)]
        self.special_token_ids = [i for i in range(read.vocab_size) if read.is_special_token(i)]
        self._special = frozenset(self.special_token_ids)
        texts = special_texts(read)
        self._split = re.compile(b"(" + b"|".join(re.escape(t) for t in texts) + b")")
        self.eos_token_id = read.eos_token
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        ids = self._read.tokenize_bytes(text)
        if self._special.isdisjoint(ids):
            return ids
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # a special token's text: its characters, as ordinary tokens
                out += self._read.greedy_tokenize(piece.decode("utf-8"))
            elif piece:
                out += self._read.tokenize_bytes(piece)
        return out


class _TokenTexts:
    """A tokenizer seen as llguidance's generic one: every token's text as its bytes."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        size = min(vocab_size, len(tokenizer))
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(size)]
        self._check_joins(tokenizer, texts, special)
        self.tokens = [t.encode("utf-8") for t in texts] + [b""] * (vocab_size - size)
        self.special_token_ids = sorted(t for t in special if t < size)
        self.eos_token_id = eos[0] if eos else getattr(tokenizer, "eos_token_id", None)
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    @staticmethod
    def _check_joins(tokenizer: Any, texts: list[str], special: set[int]) -> None:
        plain = [i for i in range(len(texts)) if i not in special and texts[i]]
        pairs = random.Random(0).choices(plain, k=min(64, 4 * len(plain))) if plain else []
        for a, b in zip(pairs[::2], pairs[1::2], strict=False):
            if tokenizer.decode([a, b], skip_special_tokens=False) != texts[a] + texts[b]:
                raise GrammarError(
                    "this model's tokenizer does not write its text as its tokens' texts "
                    f"joined (tokens {a} and {b} read {texts[a]!r} and {texts[b]!r} alone, "
                    f"{tokenizer.decode([a, b], skip_special_tokens=False)!r} together), so "
                    "grammars cannot constrain it"
                )

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))
