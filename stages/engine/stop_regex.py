"""``sampling_params.stop_regex``: patterns that end a sample once the end of its text matches
one, as SGLang 0.5 has them (``SamplingParams.normalize``, ``Req._check_str_based_finish``,
``DetokenizerManager.trim_matched_stop``).

- A string or a list of at most 32 patterns, each at most 256 bytes of UTF-8 and a valid
  Python regular expression; null or [] means none.
- After every sampled token, once the length limit, stop tokens and stop strings found
  nothing, the sample's last output tokens are decoded (special tokens kept) and each pattern
  in turn is searched for in that text (``re.search``); the first found ends the sample with
  ``finish_reason {"type": "stop", "matched": "<the pattern>"}``, and the token that
  completed the match is the last of ``output_ids``.
- How many tokens are decoded: one more than the longest text the patterns can match
  (``max_match_length``: in characters, a character being at most a token), or the whole
  output for a pattern whose matches have no bound (``+``, ``*``, ``{n,}``) or that holds a
  construct the bound does not measure (``[^...]``, look-arounds, back-references). The stop
  strings of the same sample are looked for in the same text, as SGLang decodes one tail for
  both.
- In ``text``: SGLang's detokenizer looks the matched pattern up as a plain string, so where
  the pattern's own characters occur in the text they are cut with what follows (with
  ``no_stop_trim`` only what follows); a pattern that does not occur literally (``\\d+``)
  leaves the text whole, up to and with the token that completed the match.
- A streamed chunk is not held back for a pattern (SGLang holds chunks for stop strings only).
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11 moved the regular expression parser here
    import re._parser as _sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

__all__ = ["MAX_BYTES", "MAX_COUNT", "UNBOUNDED", "max_match_length", "parse_stop_regex"]

MAX_COUNT = 32  # MAX_STOP_REGEX_COUNT
MAX_BYTES = 256  # MAX_STOP_REGEX_LEN, in bytes of UTF-8
UNBOUNDED = 2**30  # a pattern whose matches have no bound: the whole output is searched

_ONE_CHARACTER = frozenset({_sre.LITERAL, _sre.IN, _sre.ANY})
_REPEATS = frozenset({_sre.MAX_REPEAT, _sre.MIN_REPEAT})


def max_match_length(pattern: str) -> int:
    """The most characters a match of ``pattern`` can span (``UNBOUNDED`` when there is no
    bound or the pattern holds a construct this does not measure); SGLang's
    ``get_max_seq_length``."""
    return min(_span(_sre.parse(pattern)), UNBOUNDED)


def _span(items: Any) -> int:
    total = 0
    for op, value in items:
        if op in _ONE_CHARACTER:
            total += 1
        elif op is _sre.SUBPATTERN:
            total += _span(value[-1])
        elif op is _sre.BRANCH:
            total += max(_span(branch) for branch in value[1])
        elif op in _REPEATS:
            _, most, inner = value
            total += UNBOUNDED if most == _sre.MAXREPEAT else most * _span(inner)
        elif op is _sre.AT:  # ^, $, \b: no width
            continue
        else:  # [^...], look-arounds, back-references, ...: not measured
            total += UNBOUNDED
    return total


def parse_stop_regex(value: Any) -> tuple[tuple[str, ...], int]:
    """``(patterns, longest match in characters)`` of a ``stop_regex`` field (null or []:
    none); ValueError saying what is wrong."""
    if value is None:
        return (), 0
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("expected a string or a list of strings")
    if len(patterns) > MAX_COUNT:
        count = len(patterns)
        raise ValueError(f"at most {MAX_COUNT} stop_regex patterns are allowed, got {count}")
    longest = 0
    for i, pattern in enumerate(patterns):
        where = f"pattern {i} " if len(patterns) > 1 else ""
        size = len(pattern.encode("utf-8"))
        if size > MAX_BYTES:
            raise ValueError(f"{where}is {size} bytes, over the {MAX_BYTES}-byte limit")
        try:
            re.compile(pattern)
            length = max_match_length(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            problem = f"{where}{pattern!r} is not a valid regular expression: {exc}"
            raise ValueError(problem) from None
        longest = max(longest, length)
    return tuple(patterns), longest
