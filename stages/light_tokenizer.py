"""A model folder's tokenizer for the stages that only encode and decode text, without importing
``transformers`` (nor, through it, torch) when the folder allows it.

The feeder encodes prompts and the scorer decodes completions; both call the Rust ``tokenizers``
backend directly on their hot paths (``stages.feeder.sources``, ``stages.detokenize``). Loading
that backend through ``transformers.AutoTokenizer`` first imports transformers and torch: about
3 s of CPU in a process that, with the built-in engine in another process or SGLang, does no
model work at all (``python -c "from transformers import AutoTokenizer"``: 2.9 s of CPU, against
0.05 s for ``tokenizers``). ``load_tokenizer(folder)`` reads ``tokenizer.json`` with
``tokenizers`` alone when ``transformers`` would use it as it is, for the same ids and text:

- ``tokenizer_config.json`` names a generic class (``TokenizersBackend``,
  ``PreTrainedTokenizerFast``), not a model's own one, which may rebuild the backend;
- no padding or truncation is saved in ``tokenizer.json``, no ``add_bos_token`` /
  ``add_eos_token`` (which rewrite the post-processor), no ``split_special_tokens`` and no
  ``clean_up_tokenization_spaces`` (which changes decoded text) in the config, no
  ``added_tokens.json``;
- every special token the config names, and every entry of its ``added_tokens_decoder``, is
  already an added token of ``tokenizer.json`` with the same properties (transformers would add
  it otherwise).

Any other folder loads with ``transformers`` (``transformers_tokenizer``, as the engine loads
it). A ``LightTokenizer`` answers ``encode``, ``decode``, ``batch_decode``, ``get_vocab``,
``convert_ids_to_tokens``, the special tokens and their ids itself; anything else (a chat
template, ``__call__``, ``save_pretrained``...) goes to the transformers tokenizer of the same
folder, loaded the first time it is needed.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stages.remote_code import remote_code_trusted

__all__ = ["LightTokenizer", "light_reason", "load_tokenizer", "transformers_tokenizer"]

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")
_CHANGES_IDS = ("add_bos_token", "add_eos_token", "split_special_tokens")
# what an added token is, as tokenizer.json and tokenizer_config.json both write it
_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


def transformers_tokenizer(path: str | Path, *, trust_remote_code: bool | None = None) -> Any:
    """The folder's tokenizer as ``transformers`` loads it (imports torch), the way every stage
    and the engine read it: a ``tokenizer_config.json`` that names a generic class means
    ``tokenizer.json`` as it is, which ``AutoTokenizer`` would instead rebuild with the model
    type's own class (a ``qwen2`` model's adds a normalizer and ``<|endoftext|>``). The
    folder's own tokenizer code runs only with ``trust_remote_code`` (None: the run's
    ``run.trust_remote_code``, ``stages.remote_code``; else transformers refuses it:
    ValueError)."""
    from stages.hf import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if trust_remote_code is None:
        trust_remote_code = remote_code_trusted()
    trust = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file() and (path / "tokenizer.json").is_file():
        named = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        if named in GENERIC_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(str(path), **trust)
    return AutoTokenizer.from_pretrained(str(path), **trust)


def load_tokenizer(path: str | Path) -> Any:
    """A ``LightTokenizer`` for ``path`` when it gives what transformers would (see above), else
    transformers' tokenizer. Raises ``OSError`` or ``ValueError`` for an unreadable folder."""
    path = Path(path)
    reason, config, saved = _examine(path)
    if reason is None:
        return LightTokenizer(path, config, saved)
    return transformers_tokenizer(path)


def light_reason(path: Path) -> str | None:
    """Why ``path`` needs transformers to load its tokenizer, or None when it does not."""
    return _examine(Path(path))[0]


def _examine(path: Path) -> tuple[str | None, dict[str, Any], str]:
    """(why transformers is needed or None, the config with its special tokens map, the text of
    ``tokenizer.json``): the folder is read once, for the check and for the tokenizer."""
    config_file, json_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config_file.is_file() and json_file.is_file()):
        return "no tokenizer.json with a tokenizer_config.json", {}, ""
    if (path / "added_tokens.json").is_file():
        return "added_tokens.json", {}, ""
    special_map = path / "special_tokens_map.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        text = json_file.read_text(encoding="utf-8")
        saved = json.loads(text)
        special = (
            json.loads(special_map.read_text(encoding="utf-8")) if special_map.is_file() else {}
        )
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}", {}, ""
    if not all(isinstance(x, dict) for x in (config, saved, special)):
        return "not JSON objects", {}, ""
    config = {**special, **config}
    return _reason(config, saved), config, text


def _reason(config: dict[str, Any], saved: dict[str, Any]) -> str | None:
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r}"
    if saved.get("padding") is not None or saved.get("truncation") is not None:
        return "padding or truncation in tokenizer.json"
    for key in _CHANGES_IDS:
        if key in config:
            return key
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    added = {t.get("content"): t for t in saved.get("added_tokens") or [] if isinstance(t, dict)}
    by_id = {t.get("id"): t for t in added.values()}
    for key, token in _named_tokens(config):
        entry = added.get(token["content"] if isinstance(token, dict) else token)
        if entry is None or not entry.get("special"):
            return f"{key} is not a special token of tokenizer.json"
        if isinstance(token, dict) and not _same_token(token, entry):
            return f"{key} differs from tokenizer.json's"
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return "added_tokens_decoder is not a map"
    for index, token in decoder.items():
        entry = by_id.get(int(index)) if str(index).isdigit() else None
        if entry is None or not isinstance(token, dict) or not _same_token(token, entry):
            return f"added_tokens_decoder[{index}] differs from tokenizer.json's"
    return None


def _named_tokens(config: dict[str, Any]) -> list[tuple[str, Any]]:
    named = [(key, config[key]) for key in _SPECIAL_KEYS if config.get(key) is not None]
    for key in _LIST_KEYS:
        value = config.get(key) or []
        tokens = value.values() if isinstance(value, dict) else value
        named += [(key, token) for token in tokens]
    return named


def _same_token(token: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(token.get(f, entry.get(f)) == entry.get(f) for f in _TOKEN_FIELDS)


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class LightTokenizer:
    """A generic fast tokenizer read with ``tokenizers`` alone (``load_tokenizer`` decides)."""

    is_fast = True

    def __init__(self, path: Path, config: dict[str, Any], saved: str) -> None:
        """``config``: the tokenizer config with its special tokens map; ``saved``: the text of
        ``tokenizer.json`` (``load_tokenizer`` has read both)."""
        self.name_or_path = str(path)
        self._path = path
        self._tokenizer = Tokenizer.from_str(saved)
        self._full: Any = None
        self._lock = threading.Lock()
        for key in _SPECIAL_KEYS:
            setattr(self, key, _content(config.get(key)))
        self.model_max_length = config.get("model_max_length")

    def __repr__(self) -> str:
        return f"LightTokenizer({self.name_or_path!r})"

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, added tokens left out (as transformers' ``vocab_size``)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    # With any other argument (a text pair, truncation, clean-up...), transformers answers.
    def encode(self, text: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(text, str):
            return self.full.encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.full.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(ids, int):
            ids = [ids]
        elif hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if kwargs:
            return self.full.batch_decode(
                sequences, skip_special_tokens=skip_special_tokens, **kwargs
            )
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    @property
    def full(self) -> Any:
        """The same folder's transformers tokenizer, loaded once, on first use."""
        with self._lock:
            if self._full is None:
                self._full = transformers_tokenizer(self._path)
            return self._full

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a reward worker, a deep copy): without the lock and the transformers
        tokenizer, which the copy loads again when it needs it."""
        state = dict(self.__dict__)
        state["_full"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_full", "_lock", "_path", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.full, name)
