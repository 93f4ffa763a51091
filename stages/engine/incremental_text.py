"""A sample's text as SGLang's detokenizer makes it: a window at a time, never its ids alone.

SGLang 0.5 does not decode a sample's output ids on their own. The scheduler starts a window
five prompt tokens back (``schedule_batch.Req.init_incremental_detokenize``,
``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``), and each time it hands tokens over (every streamed
chunk; for a request not streamed, every 50 tokens, ``DEFAULT_FORCE_STREAM_INTERVAL``, and at
the end) the detokenizer (``detokenizer_manager.handle_batch_token_id_out``) decodes two
windows: the tokens already read (``surr_offset:read_offset``) and those plus the new ones
(``surr_offset:``). The new text is the second minus the first. Unless it is empty or ends in
an incomplete character (U+FFFD), it is committed: added to the text and the window moved on
(``surr_offset = read_offset``, ``read_offset`` = the end). A chunk that cannot commit shows
the committed text plus the new text's printable part (``find_printable_text``). At the end the
window is decoded without a matched stop token.

What this changes for a user, against decoding the output alone:

- Tokenizers whose decoding depends on what precedes (SentencePiece's ``▁``, a word-level
  tokenizer that joins with spaces) keep the space before the first output token, as the text
  reads after the prompt.
- A stream decodes a few tokens a chunk, not the whole output so far: its cost per token does
  not grow with the sample's length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

__all__ = ["CONTEXT_TOKENS", "FORCE_INTERVAL", "IncrementalText", "output_text", "printable"]

CONTEXT_TOKENS = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
FORCE_INTERVAL = 50  # DEFAULT_FORCE_STREAM_INTERVAL: a request not streamed, every 50 tokens


class IncrementalText:
    """One sample's text, fed its output ids so far (``update``) and at its end (``final``)."""

    __slots__ = ("_decode", "_ids", "_one", "_pair", "_read", "_skip", "_start", "_surr")
    __slots__ += ("_surr_text",)
    __slots__ += ("text",)

    def __init__(
        self, prompt_ids: Sequence[int], decode: Callable[[list[int], bool], str], skip: bool
    ) -> None:
        self._decode, self._skip = decode, skip
        self._one = _single_tokens(decode, skip)
        self._pair = _token_pairs(decode, skip)
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        self._ids = context  # the window's ids: the context, then the output
        self._surr = 0
        self._start = self._read = len(context)
        # the text of ids[surr:read] (None: not decoded yet); the context's is shared
        self._surr_text: str | None = _text_of(decode, skip, tuple(context))
        self.text = ""  # committed (SGLang's decoded_text)

    @classmethod
    def whole(
        cls,
        prompt_ids: Sequence[int],
        output_ids: list[int],
        decode: Callable[[list[int], bool], str],
        skip: bool,
    ) -> IncrementalText:
        """A sample not streamed, taken through the commits SGLang makes every 50 tokens
        before its end (``final`` gives its text)."""
        state = cls(prompt_ids, decode, skip)
        for end in range(FORCE_INTERVAL, len(output_ids), FORCE_INTERVAL):
            state.update(output_ids[:end])
        return state

    def update(self, output_ids: list[int]) -> str:
        """The text of an unfinished sample whose output so far is ``output_ids``."""
        ids, read = self._ids, self._read
        if read - self._surr == 1 and read == len(ids) == len(output_ids) + self._start - 1:
            # the usual case: one token after a committed one (the window is the two of them;
            # ``_one_after_commit``, written out: this runs for every streamed token)
            new = self._pair(ids[-1], output_ids[-1])
            ids.append(output_ids[-1])
        else:
            new = self._new(output_ids, False)
        if new and new[-1] != "\ufffd":
            self.text = text = self.text + new
            self._surr, self._read, self._surr_text = self._read, len(self._ids), None
            return text
        return self.text + printable(new)

    def final(self, output_ids: list[int], trim_last: bool) -> str:
        """The finished sample's text; ``trim_last``: without its last token (a matched stop
        token). Stop strings are the caller's to cut."""
        if self._one_after_commit(output_ids):  # the window: the last committed token and it
            return self.text if trim_last else self.text + self._pair(self._ids[-1], output_ids[-1])
        return self.text + self._new(output_ids, trim_last)

    def _one_after_commit(self, output_ids: list[int]) -> bool:
        """Whether ``output_ids`` is one token more than the window has read, right after a
        commit of one token: the window is then that token and the new one."""
        read, fed = self._read, len(output_ids) + self._start - 1
        return read - self._surr == 1 and read == len(self._ids) == fed

    def _new(self, output_ids: list[int], trim_last: bool) -> str:
        """The new text: the window from ``surr`` (with ``output_ids`` taken in, less its last
        token with ``trim_last``) less the text of ``surr:read``."""
        ids = self._ids
        fed = len(ids) - self._start
        if fed == len(output_ids) - 1:  # the usual case: one token more
            ids.append(output_ids[-1])
        elif fed < len(output_ids):
            ids += output_ids[fed:]
        surr = self._surr
        surr_text = self._surr_text
        if surr_text is None:
            read = self._read
            if read - surr == 1:  # the usual case, a token at a time: its text alone
                surr_text = self._one(ids[surr])
            else:
                surr_text = self._decode(ids[surr:read], self._skip)
            self._surr_text = surr_text
        window = ids[surr:-1] if trim_last else ids[surr:]
        if surr == 0 and len(window) == self._start + 1:
            # the first token after the prompt's last ones: the same window comes up again
            # (the samples of an n > 1 request, or of a group, often start alike)
            return _text_of(self._decode, self._skip, tuple(window))[len(surr_text) :]
        return self._decode(window, self._skip)[len(surr_text) :]


def output_text(
    prompt_ids: Sequence[int],
    output_ids: list[int],
    decode: Callable[[list[int], bool], str],
    skip: bool,
    trim_last: bool,
) -> str:
    """The text of a finished sample that was not streamed (``IncrementalText.whole``'s
    ``final``): for one of up to 50 tokens, where SGLang commits nothing on the way, one
    decode of the context and the output, less the context's text."""
    if len(output_ids) > FORCE_INTERVAL:
        return IncrementalText.whole(prompt_ids, output_ids, decode, skip).final(
            output_ids, trim_last
        )
    context = prompt_ids[-CONTEXT_TOKENS:]
    before = _text_of(decode, skip, tuple(context))
    window = [*context, *(output_ids[:-1] if trim_last else output_ids)]
    return decode(window, skip)[len(before) :]


@functools.lru_cache(maxsize=64)
def _single_tokens(decode: Callable[[list[int], bool], str], skip: bool) -> Callable[[int], str]:
    """Each token's text alone, decoded once (per ``decode`` and ``skip``)."""
    return functools.lru_cache(maxsize=1 << 17)(lambda token: decode([token], skip))


@functools.lru_cache(maxsize=64)
def _token_pairs(decode: Callable[[list[int], bool], str], skip: bool) -> Callable[[int, int], str]:
    """The text a token adds after another (the window of a stream's usual step: the token
    last committed and the new one), decoded once per pair (per ``decode`` and ``skip``)."""
    one = _single_tokens(decode, skip)
    return functools.lru_cache(maxsize=1 << 16)(
        lambda first, token: decode([first, token], skip)[len(one(first)) :]
    )


@functools.lru_cache(maxsize=1 << 15)
def _text_of(decode: Callable[[list[int], bool], str], skip: bool, ids: tuple[int, ...]) -> str:
    """``decode(ids, skip)`` of a few ids that come up again: a prompt's context (a request's
    ``n`` samples, a group's prompts) and single tokens."""
    return decode(list(ids), skip)


def printable(text: str) -> str:
    """The part of new text that can be shown while it may still change (SGLang's
    ``find_printable_text``, after transformers' ``TextStreamer``): all of it after a newline or
    ending in a CJK character, all but the last character after a CJK one, else up to its last
    space."""
    if not text or text.endswith("\n"):
        return text
    if _cjk(text[-1]):
        return text
    if len(text) > 1 and _cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def _cjk(char: str) -> bool:
    """Whether ``char`` is in one of the CJK Unified Ideographs blocks."""
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in _CJK_BLOCKS)


_CJK_BLOCKS = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
