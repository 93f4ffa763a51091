"""A token's bytes in the ``/v1`` routes' log-probs (``stages/engine/token_bytes.py``), as
SGLang 0.5.23 gives them (``srt/entrypoints/openai/utils.py``: ``token_id_to_bytes``,
``_lossless_token_text``, ``_is_byte_level_tokenizer``; ``serving_chat.py``
``_build_token_logprobs_from_raw``; ``serving_responses.py`` ``_build_output_text_logprobs``).

The model's byte-level tokenizer has a token for each byte of 𠮷 (U+20BB7, four bytes) and of é
(two), é whole as well, U+FFFD whole (its three bytes: a character, not a fragment) and a few
letters: a token that holds part of a character decodes alone to U+FFFD."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from stages.engine.token_bytes import _BYTE_DECODER, TokenBytes, token_bytes
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import make_tiny_model

SPELL = {b: c for c, b in _BYTE_DECODER.items()}  # GPT-2's character for each byte
FRAGMENTS = [*"𠮷".encode(), *"é".encode()]  # one token a byte: none of them is a character
WHOLE = ["é", "\ufffd", "a", "b", "c"]


def _piece(text: bytes) -> str:
    return "".join(SPELL[b] for b in text)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1}
    for b in FRAGMENTS:
        vocab.setdefault(_piece(bytes([b])), len(vocab))
    for text in WHOLE:
        vocab.setdefault(_piece(text.encode()), len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Not byte-level: SentencePiece's pieces, the characters themselves after ``▁``."""
    core = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "▁é": 2, "▁a": 3}))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _id(tokenizer: PreTrainedTokenizerFast, raw: bytes) -> int:
    return tokenizer.convert_tokens_to_ids(_piece(raw))


def test_a_byte_level_token_has_its_own_bytes_and_a_fragment_its_latin1_text() -> None:
    tok = byte_tokenizer()
    tokens = TokenBytes(tok)
    assert tokens.byte_level
    first = _id(tok, b"\xf0")
    assert tok.decode([first]) == "\ufffd"  # alone, part of a character shows as U+FFFD
    # the chat route's bytes: the token's own, not U+FFFD's
    assert tokens.bytes_of(first, "\ufffd") == [0xF0]
    assert tokens.bytes_of(_id(tok, b"\xa9"), "\ufffd") == [0xA9]
    assert tokens.bytes_of(_id(tok, "é".encode()), "é") == [0xC3, 0xA9]
    assert tokens.bytes_of(_id(tok, b"a"), "a") == [97]
    assert tokens.bytes_of(1, "<eos>") == list(b"<eos>")  # its piece's letters spell bytes
    # the completions route's text: a fragment as latin-1, so the bytes come back from it
    assert tokens.text_of(first, "\ufffd") == "\xf0"
    assert tokens.text_of(first, "\ufffd").encode("latin-1") == b"\xf0"
    # U+FFFD whole (EF BF BD: valid UTF-8) is a character: its display text stays
    assert tokens.text_of(_id(tok, "\ufffd".encode()), "\ufffd") == "\ufffd"
    assert tokens.text_of(_id(tok, b"a"), "a") == "a"  # no U+FFFD: as it is
    assert tokens.text_of(None, None) == ""  # nothing known: SGLang's empty text
    assert tokens.raw(10_000) is None  # an id the tokenizer does not have
    assert tokens.bytes_of(10_000, "x") == [120]


def test_a_tokenizer_that_is_not_byte_level_keeps_its_texts_utf8() -> None:
    tok = word_tokenizer()
    tokens = TokenBytes(tok)
    assert not tokens.byte_level  # ▁ spells no byte in GPT-2's alphabet
    assert tokens.raw(2) is None
    assert tokens.bytes_of(2, " é") == [32, 0xC3, 0xA9]  # the text's (é is not the byte E9)
    assert tokens.text_of(2, "\ufffd") == "\ufffd"


def test_one_token_bytes_per_tokenizer() -> None:
    tok = byte_tokenizer()
    assert token_bytes(tok) is token_bytes(tok)
    assert token_bytes(tok) is not token_bytes(byte_tokenizer())


# ---- through the routes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("token-bytes")
    tok = byte_tokenizer()
    model_dir = make_tiny_model(root / "model", seed=3, with_tokenizer=False, vocab=len(tok))
    tok.save_pretrained(model_dir)
    template = root / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with serving(model_dir, root / "engine.log", "--chat-template", str(template)) as eng:
        yield eng


def _ask(tok: PreTrainedTokenizerFast) -> dict:
    """Greedy, every fragment of 𠮷 favoured: the answer is parts of characters."""
    bias = {str(_id(tok, bytes([b]))): 30.0 for b in "𠮷".encode()}
    return {"max_tokens": 6, "temperature": 0, "logit_bias": bias, "ignore_eos": True}


def _native(engine: Engine, prompt: list[int], ask: dict, top: int) -> dict:
    """The same request through ``/generate``: each token's id and display text."""
    params = {"max_new_tokens": ask["max_tokens"], "temperature": 0, "ignore_eos": True,
              "logit_bias": ask["logit_bias"]}  # fmt: skip
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
            "top_logprobs_num": top, "return_text_in_logprobs": True}  # fmt: skip
    answer = requests.post(engine.url + "/generate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["meta_info"]


@pytest.mark.timeout(90)
def test_chat_bytes_are_the_tokens_own_and_completion_texts_are_lossless(engine: Engine) -> None:
    tok = byte_tokenizer()
    tokens = TokenBytes(tok)
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = [_id(tok, b"a"), _id(tok, b"b")]
    ask = _ask(tok)
    native = _native(engine, prompt, ask, top=3)
    ids = [entry[1] for entry in native["output_token_logprobs"]]
    assert {tok.decode([t]) for t in ids} == {"\ufffd"}  # every token a part of 𠮷
    extra = {"logit_bias": ask["logit_bias"], "ignore_eos": True}

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ab"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3, extra_body=extra,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ids)
    for entry, native_entry, native_top in zip(
        content, native["output_token_logprobs"], native["output_top_logprobs"], strict=True
    ):
        logprob, token, text = native_entry
        assert entry.token == text == "\ufffd"  # the display text, as SGLang's
        assert entry.bytes == list(tokens.raw(token))  # but the token's own byte
        assert abs(entry.logprob - logprob) < 1e-5
        assert [t.bytes for t in entry.top_logprobs] == [
            tokens.bytes_of(t, s) for _, t, s in native_top
        ]
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ab"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3, extra_body=extra, stream=True,
    )  # fmt: skip
    got = [
        e.bytes
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert got == [entry.bytes for entry in content]

    # /v1/completions: the tokens' texts lossless (latin-1), the top ones' keys too
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body=extra
    )
    lp = completion.choices[0].logprobs
    assert lp.tokens == [bytes(tokens.raw(t)).decode("latin-1") for t in ids]
    assert [t.encode("latin-1") for t in lp.tokens] == [bytes(tokens.raw(t)) for t in ids]
    assert [list(step) for step in lp.top_logprobs] == [
        [tokens.text_of(t, s) for _, t, s in step] for step in native["output_top_logprobs"]
    ]
    streamed = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body=extra,
        stream=True,
    )  # fmt: skip
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.timeout(60)
def test_responses_bytes_are_the_display_texts(engine: Engine) -> None:
    """SGLang's Responses route reads its log-probs without the tokenizer: a part of a
    character there is U+FFFD, bytes and all."""
    model = requests.get(engine.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "input": "ab", "max_output_tokens": 8, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 6}  # fmt: skip
    answer = requests.post(engine.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    (item,) = answer.json()["output"]
    logprobs = item["content"][0]["logprobs"]
    assert any(e["token"] == "\ufffd" for e in logprobs)  # parts of 𠮷 (greedy, the first)
    assert all(e["bytes"] == list(e["token"].encode()) for e in logprobs)
    chat = requests.post(engine.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "ab"}], "temperature": 0,
        "max_tokens": 6, "logprobs": True, "top_logprobs": 6,  # 8 less SGLang's 2 of headroom
    }).json()["choices"][0]["logprobs"]["content"]  # fmt: skip
    assert [e["token"] for e in logprobs] == [e["token"] for e in chat]
    tops = [[t["token"] for t in e["top_logprobs"]] for e in chat]
    assert any(len(set(texts)) < len(texts) for texts in tops)  # U+FFFD more than once
    for entry, asked in zip(logprobs, chat, strict=True):
        # the alternatives by distinct text (U+FFFD once), a text's last log-prob kept, as
        # SGLang's dict of them keeps it
        expected: dict[str, float] = {}
        for top in asked["top_logprobs"]:
            expected[top["token"]] = top["logprob"]
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == expected
        assert len(entry["top_logprobs"]) == len(expected)
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])


def test_the_probe_reads_the_vocabulary_once() -> None:
    tok = byte_tokenizer()
    calls = []
    real = tok.get_vocab

    def counted() -> dict:
        calls.append(1)
        return real()

    tok.get_vocab = counted  # type: ignore[method-assign]
    tokens = TokenBytes(tok)
    assert tokens.byte_level and tokens.byte_level
    assert len(calls) == 1
