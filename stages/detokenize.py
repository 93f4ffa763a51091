"""Token ids to text exactly as ``tokenizer.decode`` gives it, without its per-call overhead.

transformers' ``decode`` converts its input item by item (``to_py_obj``) and goes through
several layers per sequence. A ``LightTokenizer`` (``stages.light_tokenizer``), and a fast
tokenizer whose ``_decode`` is transformers' own and that does not clean up spaces, decode
exactly as their Rust backend does, so ``decoder`` and ``batch_decoder`` call the backend
directly then (2 us instead of 9 us a sequence), and transformers otherwise. The engine renders
every answer's text with ``decoder``; the scorer and the evaluation decode completions with
``batch_decoder``.

``batch_decoder`` decodes one sequence after another, not with the backend's ``decode_batch``:
that spreads a batch over a thread pool whose hand-over costs more CPU than it saves (4
sequences of 5 tokens: 33 us of CPU against 3 us; 256 of 100 tokens: 3.2 ms against 2.0 ms),
and the cores it would borrow are the ones the other stages run on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["batch_decoder", "decoder", "token_lists"]


def _backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer that decodes exactly as ``tokenizer`` does, if there is one."""
    from stages.light_tokenizer import LightTokenizer

    if type(tokenizer) is LightTokenizer:  # its decode is the backend's (no clean-up)
        return tokenizer.backend_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        and hasattr(backend, "decode")
    ):
        return backend
    return None


def decoder(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """``decode(ids, skip_special_tokens)``; None for no tokenizer."""
    if tokenizer is None:
        return None
    backend = _backend(tokenizer)
    if backend is not None:  # its decode(ids, skip_special_tokens) itself: no frame in between
        return backend.decode
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def batch_decoder(tokenizer: Any) -> Callable[[list[list[int]], bool], list[str]]:
    """``decode(sequences, skip_special_tokens)``: one text per sequence."""
    backend = _backend(tokenizer)
    if backend is not None:
        decode = backend.decode
        return lambda seqs, skip: [decode(ids, skip) for ids in seqs]
    return lambda seqs, skip: tokenizer.batch_decode(seqs, skip_special_tokens=skip) if seqs else []


def token_lists(sequences: Sequence[Any]) -> list[list[int]]:
    """Each sequence (numpy array, list, tuple) as a list of Python ints."""
    return [s.tolist() if hasattr(s, "tolist") else [int(t) for t in s] for s in sequences]
