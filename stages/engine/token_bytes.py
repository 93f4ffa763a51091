"""What a token is as bytes, for the log-probs of the ``/v1`` routes (SGLang 0.5.23's
``srt/entrypoints/openai/utils.py``: ``token_id_to_bytes``, ``_lossless_token_text``,
``_is_byte_level_tokenizer``).

A log-prob entry's text is its token decoded alone: a byte-level BPE token (GPT-2's alphabet, as
Qwen's and Llama 3's tokenizers spell bytes) that holds part of a UTF-8 character decodes to
U+FFFD, and its bytes are lost. SGLang recovers them from the token's vocabulary piece through
GPT-2's byte table: ``/v1/chat/completions`` gives those raw bytes as each token's ``bytes`` (and
its alternatives'), and ``/v1/completions`` writes a token whose bytes are not UTF-8 (a fragment)
as latin-1, one character a byte, in ``tokens`` and as its key in ``top_logprobs``, so that the
string still gives the bytes back. A tokenizer that is not byte-level (SentencePiece: Mistral,
Gemma), or a token whose piece the table does not spell (an added token in other characters,
such as DeepSeek's full-width end of sentence), keeps its display text's UTF-8.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["TokenBytes", "token_bytes"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` turned around: the character that spells each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = 256 + shifted  # the bytes that print badly, moved past 255
            shifted += 1
    return {chr(c): b for b, c in spelled.items()}


_BYTE_DECODER = _byte_decoder()
_UNSEEN: Any = object()  # a token whose bytes were not looked up yet


class TokenBytes:
    """One tokenizer's tokens as raw bytes (``raw``), as the chat route's ``bytes``
    (``bytes_of``) and as the completions route's text (``text_of``). Whether the tokenizer is
    byte-level is found at the first use, as SGLang finds it; each token's bytes are kept."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level: bool | None = None
        self._raw: dict[int, tuple[int, ...] | None] = {}

    @property
    def byte_level(self) -> bool:
        """SGLang's ``_is_byte_level_tokenizer``: the tokenizer's ``is_byte_level`` where it
        says, else whether the pieces of a few ids (0-3, the middle, the one before last) are
        all spelled in GPT-2's byte alphabet."""
        if self._byte_level is None:
            self._byte_level = _probe(self.tokenizer)
        return self._byte_level

    def raw(self, token: int) -> tuple[int, ...] | None:
        """The token's bytes from its vocabulary piece (``token_id_to_bytes``); None where
        the tokenizer is not byte-level or the piece is not spelled in its alphabet."""
        if token in self._raw:
            return self._raw[token]
        found = None
        if self.byte_level:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token)
            except Exception:  # an id the tokenizer does not know: SGLang's None
                piece = None
            if piece:
                spelled = [_BYTE_DECODER.get(ch) for ch in piece]
                if None not in spelled:
                    found = tuple(spelled)  # type: ignore[arg-type]
        self._raw[token] = found
        return found

    def bytes_of(self, token: int | None, text: str | None) -> list[int]:
        """A chat log-prob entry's ``bytes``: the token's own, else its text's UTF-8
        (``_build_token_logprobs_from_raw``)."""
        raw = self._raw.get(token, _UNSEEN)  # type: ignore[arg-type]  # (None: not a token)
        if raw is _UNSEEN:
            raw = None if token is None else self.raw(token)
        if raw is None:
            return list((text or "").encode())
        return list(raw)

    def text_of(self, token: int | None, text: str | None) -> str:
        """A completions log-prob entry's text (``_lossless_token_text``): its display text,
        but a fragment (bytes that are not UTF-8) as latin-1."""
        if text is not None and "\ufffd" not in text:
            return text
        raw = None if token is None else self.raw(token)
        if raw is None:
            return text if text is not None else ""
        spelled = bytes(raw)
        try:
            spelled.decode("utf-8")
        except UnicodeDecodeError:  # a fragment
            return spelled.decode("latin-1")
        return text if text is not None else ""  # a whole character that is U+FFFD itself


def _probe(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "is_byte_level", None)
    if isinstance(flag, bool):
        return flag
    try:
        size = len(tokenizer.get_vocab())
        for token in (0, 1, 2, 3, size // 2, size - 2):
            if not 0 <= token < size:
                continue
            piece = tokenizer.convert_ids_to_tokens(token)
            if piece and any(ch not in _BYTE_DECODER for ch in piece):
                return False
    except Exception:  # SGLang's answer to a tokenizer it cannot probe
        return False
    return True


_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The ``TokenBytes`` of ``tokenizer``, one per tokenizer (the agent proxy makes chat
    settings per episode; the probe and the tokens' bytes are kept across them)."""
    try:
        found = _BY_TOKENIZER.get(tokenizer)
    except TypeError:  # not weakly referable: one of its own
        return TokenBytes(tokenizer)
    if found is None:
        found = _BY_TOKENIZER[tokenizer] = TokenBytes(tokenizer)
    return found
