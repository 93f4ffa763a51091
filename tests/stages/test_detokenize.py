"""Fast decoding gives exactly what ``tokenizer.decode`` gives, and is taken where it can be."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from stages.detokenize import _backend, batch_decoder, decoder, token_lists

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def _sequences(tokenizer, count: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    size = len(tokenizer)
    out = []
    for _ in range(count):
        seq = [rng.randrange(size) for _ in range(rng.randrange(0, 12))]
        if special and rng.random() < 0.5:
            seq.insert(rng.randrange(len(seq) + 1), rng.choice(special))
        out.append(seq)
    return out


@pytest.mark.parametrize("name", ["arith-tiny", "calc-tiny", "longtail-tiny"])
def test_shipped_tokenizers_decode_as_transformers_does_through_their_backend(name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODELS / name, local_files_only=True)
    assert _backend(tokenizer) is not None  # the fast path is taken for them
    seqs = _sequences(tokenizer)
    for skip in (True, False):
        one, many = decoder(tokenizer), batch_decoder(tokenizer)
        expected = [tokenizer.decode(s, skip_special_tokens=skip) for s in seqs]
        assert [one(s, skip) for s in seqs] == expected
        assert many(seqs, skip) == expected
        assert many([], skip) == []


def test_a_tokenizer_that_cleans_up_spaces_goes_through_transformers() -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        MODELS / "arith-tiny", local_files_only=True, clean_up_tokenization_spaces=True
    )
    assert _backend(tokenizer) is None
    seqs = _sequences(tokenizer, 50)
    expected = tokenizer.batch_decode(seqs, skip_special_tokens=True)
    assert batch_decoder(tokenizer)(seqs, True) == expected


def test_token_lists_makes_python_ints_of_arrays_and_lists() -> None:
    lists = token_lists([np.array([3, 4], dtype=np.int32), (5, np.int64(6)), []])
    assert lists == [[3, 4], [5, 6], []]
    assert all(type(t) is int for seq in lists for t in seq)


def test_token_texts_decodes_each_token_once_per_decoder() -> None:
    from stages.engine.protocol import token_texts

    tokenizer = AutoTokenizer.from_pretrained(MODELS / "arith-tiny", local_files_only=True)
    calls: list[list[int]] = []
    one = decoder(tokenizer)

    def counted(ids: list[int], skip: bool) -> str:
        calls.append(ids)
        return one(ids, skip)

    asked = {"return_text_in_logprobs": True}
    assert token_texts(counted, {}) is None  # not asked for
    text = token_texts(counted, asked)
    assert text is token_texts(counted, asked)  # one cache for the decoder's life
    ids = list(range(len(tokenizer))) * 2
    assert [text(t) for t in ids] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert len(calls) == len(tokenizer)  # the second round came from the cache
    # the engine's own decoder is the backend's bound decode, which takes no attribute
    assert token_texts(one, asked) is token_texts(one, asked)
