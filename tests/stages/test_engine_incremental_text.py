"""A sample's text decoded as SGLang 0.5's detokenizer decodes it
(``stages.engine.incremental_text``): ``DetokenizerManager.handle_batch_token_id_out`` over the
window that
``Req.init_incremental_detokenize`` starts five prompt tokens back, ``find_printable_text`` for
new text that cannot settle. Real ``tokenizers`` tokenizers, built here: a SentencePiece-style one
(``▁`` for a space, dropped at the start of a decode) and a byte-level one (a character split
over several tokens)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stages.engine.incremental_text import IncrementalText, printable
from tests.stages.engine_setup import sglang_text


def _metaspace() -> Tokenizer:
    words = ["<unk>", "▁Say", "▁Hello", "▁world", "!", "▁it", "▁again"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok


def _byte_level() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, as GPT-2's alphabet spells bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class _Counted:
    """A tokenizer's decode that counts the ids it was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids = tok, 0

    def __call__(self, ids: list[int], skip: bool) -> str:
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip)


def test_the_first_token_keeps_the_space_the_prompt_gives_it() -> None:
    tok = _metaspace()
    prompt, out = [1], [2, 3, 4]  # "Say" and "Hello world!"
    assert tok.decode(out) == "Hello world!"  # alone, the first ▁ is dropped
    state = IncrementalText(prompt, _Counted(tok), True)
    assert [state.update(out[: k + 1]) for k in range(len(out) - 1)] == [" Hello", " Hello world"]
    assert state.final(out, False) == " Hello world!" == sglang_text(tok, prompt, out)
    whole = IncrementalText.whole(prompt, out, _Counted(tok), True)
    assert whole.final(out, False) == " Hello world!"
    assert whole.final(out, True) == " Hello world"  # without a matched stop token


def test_an_incomplete_character_shows_only_its_printable_part_until_it_completes() -> None:
    tok = _byte_level()
    prompt, out = tok.encode("Q:").ids, tok.encode(" ab 你好 c").ids
    assert len(out) == len(" ab 你好 c".encode())  # a token per byte: 你 and 好 are 3 each
    state = IncrementalText(prompt, tok.decode, True)
    texts = [state.update(out[: k + 1]) for k in range(len(out))]
    assert not any("\ufffd" in t for t in texts)
    assert texts[:6] == [" ", " a", " ab", " ab ", " ab ", " ab "]  # 你's first two bytes held
    assert texts[6] == " ab 你" and texts[7:9] == [" ab 你"] * 2 and texts[9] == " ab 你好"
    assert texts[-1] == " ab 你好 c" == state.text  # all committed, in order
    assert state.final(out, False) == " ab 你好 c" == sglang_text(tok, prompt, out)


@pytest.mark.parametrize(
    ("new", "shown"),
    [
        ("", ""),
        ("abc", ""),  # a word that may go on
        ("ab cd", "ab "),  # up to its last space
        ("ab\n", "ab\n"),  # a newline flushes
        ("ab 你", "ab 你"),  # ending in a CJK character
        ("ab 你\ufffd", "ab 你"),  # a CJK character then an incomplete one
        ("ab \ufffd", "ab "),
    ],
)
def test_printable_follows_find_printable_text(new: str, shown: str) -> None:
    assert printable(new) == shown


def test_a_long_stream_decodes_a_few_tokens_a_chunk_not_the_whole_output() -> None:
    tok = _byte_level()
    prompt = tok.encode("Write:").ids
    text = " ".join(f"word{k}" for k in range(80))  # 470 tokens
    out = tok.encode(text).ids
    decode = _Counted(tok)
    state = IncrementalText(prompt, decode, True)
    for k in range(len(out)):
        state.update(out[: k + 1])
    assert state.final(out, False) == text == sglang_text(tok, prompt, out)
    # two windows of a token or two a chunk (the first with the prompt's 5), where decoding the
    # output so far each time would be len(out) ** 2 / 2 = 110,000 ids
    assert decode.ids <= 4 * len(out) + 10, decode.ids


def test_a_request_not_streamed_commits_every_50_tokens_as_sglang_forces_a_flush() -> None:
    tok = _byte_level()
    prompt, text = tok.encode("Go").ids, "x" * 120
    out = tok.encode(text).ids
    decode = _Counted(tok)
    assert IncrementalText.whole(prompt, out, decode, True).final(out, False) == text
    # commits after 50 and 100 tokens: windows of 2+50, 50, 50+50, 50, 50+20 (and the context)
    assert decode.ids == 2 + (2 + 50) + 50 + (50 + 50) + 50 + (50 + 20)


def _sglang_chunks(
    decode, prompt: list[int], out: list[int], trim_last: bool | None = None
) -> list[str]:
    """Each chunk's text as SGLang's detokenizer computes it, from scratch (no caches): the
    window from ``surr`` decoded less the text of ``surr:read``, committed unless it is empty
    or ends in an incomplete character, else its printable part shown. With ``trim_last``
    (True or False) the last is the finished sample's text instead (its last token left out
    with True, as a matched stop token is)."""
    ids, text, shown = list(prompt[-5:]), "", []
    surr, read = 0, len(ids)
    for k, token in enumerate(out):
        ids.append(token)
        if trim_last is not None and k == len(out) - 1:
            window = ids[surr:-1] if trim_last else ids[surr:]
            shown.append(text + decode(window, True)[len(decode(ids[surr:read], True)) :])
            break
        new = decode(ids[surr:], True)[len(decode(ids[surr:read], True)) :]
        if new and new[-1] != "\ufffd":
            text += new
            surr, read = read, len(ids)
            shown.append(text)
        else:
            shown.append(text + printable(new))
    return shown


@pytest.mark.parametrize("make", [_byte_level, _metaspace])
def test_every_chunk_s_text_is_sglang_s_whatever_the_tokens_before_it(make) -> None:
    """The usual step (a token after a committed one) reads a cache of token pairs; the text
    must be what decoding the window gives, for tokens seen before after other tokens too."""
    import random

    tok = make()
    decode = lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)  # noqa: E731
    rng = random.Random(7)
    if make is _byte_level:
        pieces = ["a", " b", "你", "é", " 好", "\n", "ü!"]
        texts = ["".join(rng.choice(pieces) for _ in range(12)) for _ in range(20)]
        outs = [tok.encode(t).ids for t in texts]
    else:
        outs = [[rng.randrange(1, 7) for _ in range(10)] for _ in range(20)]
    prompt = [1, 2]
    for out in outs:  # the same pairs come up again across samples: later ones read the cache
        state = IncrementalText(prompt, decode, True)
        assert [state.update(out[: k + 1]) for k in range(len(out))] == _sglang_chunks(
            decode, prompt, out
        )
        for trim in (False, True):  # a streamed sample's last chunk: its whole text
            state = IncrementalText(prompt, decode, True)
            shown = [state.update(out[: k + 1]) for k in range(len(out) - 1)]
            shown.append(state.final(out, trim))
            assert shown == _sglang_chunks(decode, prompt, out, trim)
