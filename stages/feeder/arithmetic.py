"""The built-in arithmetic task: ``a+b=`` / ``a-b=`` prompts, answers as digits, a char tokenizer.

Every problem of the task is enumerable, so the split into train and held-out problems is exact
and stable: a problem is held out when a hash of its text (and the task's ``split_seed``) falls
under ``eval_fraction``. Held-out problems are never fed for training and never used by the
warm-start script (``configs/models/make_arith_model.py``), so evaluation measures problems the
model has never been trained on.

The tokenizer is one token per character of ``0123456789+-*=`` plus ``<pad>`` and ``<eos>``:
a completion is the answer's digits followed by ``<eos>``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHARS",
    "EOS_ID",
    "PAD_ID",
    "ArithmeticConfig",
    "Problem",
    "make_tokenizer",
    "problems",
]

PAD_ID, EOS_ID = 0, 1
CHARS = "0123456789+-*="


@dataclass(frozen=True)
class Problem:
    text: str  # the prompt, e.g. "12+7="
    answer: str  # e.g. "19"

    @property
    def prompt_id(self) -> str:
        return f"arith:{self.text}"


@dataclass
class ArithmeticConfig:
    ops: str = field(default="+-", metadata={"doc": "operators to use, from '+-*'"})
    max_operand: int = field(default=99, metadata={"min": 1, "doc": "operands are 0..max_operand"})
    eval_fraction: float = field(
        default=0.1, metadata={"min": 0.0, "max": 0.9, "doc": "share of problems held out"}
    )
    split_seed: int = field(default=0, metadata={"doc": "which problems are held out"})

    def __post_init__(self) -> None:
        bad = sorted(set(self.ops) - set("+-*"))
        if bad or not self.ops:
            raise ValueError(f"ops must be made of '+', '-', '*' (got {self.ops!r})")


def _held_out(text: str, config: ArithmeticConfig) -> bool:
    digest = hashlib.blake2b(f"{config.split_seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < config.eval_fraction


def problems(config: ArithmeticConfig, split: str) -> Iterator[Problem]:
    """Every problem of ``split`` (``"train"`` or ``"eval"``) in a fixed order.

    Subtraction keeps results non-negative (``a - b`` with ``a >= b``).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    want_eval = split == "eval"
    n = config.max_operand
    for op in config.ops:
        for a in range(n + 1):
            for b in range(n + 1):
                if op == "-" and b > a:
                    continue
                text = f"{a}{op}{b}="
                if _held_out(text, config) != want_eval:
                    continue
                value = a + b if op == "+" else a - b if op == "-" else a * b
                yield Problem(text, str(value))


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The task's character tokenizer (ids: ``<pad>`` 0, ``<eos>`` 1, then ``CHARS``)."""
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    vocab.update({c: i + 2 for i, c in enumerate(CHARS)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
