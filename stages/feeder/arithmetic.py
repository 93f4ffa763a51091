"""The built-in arithmetic tasks: ``a+b=`` / ``a-b=`` / ``a*b=`` prompts with digit answers, and
chains of additions and subtractions solved step by step (the long-tail task), each with a char
tokenizer. Operands run over ``min_operand..max_operand`` (``0..99`` by default);
``ArithmeticConfig(ops="*", min_operand=100, max_operand=999)`` is the three-digit multiplication
that the calculator example's model (``configs/models/make_calc_model.py``) solves with a tool.

Every problem of the task is enumerable, so the split into train and held-out problems is exact
and stable: a problem is held out when a hash of its text (and the task's ``split_seed``) falls
under ``eval_fraction``. Held-out problems are never fed for training and never used by the
warm-start script (``configs/models/make_arith_model.py``), so evaluation measures problems the
model has never been trained on.

The tokenizer is one token per character of ``0123456789+-*=`` plus ``<pad>`` and ``<eos>``:
a completion is the answer's digits followed by ``<eos>``.

The chain task (``ChainConfig``, ``chain_problems``, ``make_chain_tokenizer``) asks for the value
of ``k`` additions and subtractions, ``3+4-5+7=``, and its completion works them out one by one,
each step restating the running total, the operation and its result, then gives the answer after
``#``: ``3+4=7;7-5=2;2+7=9;#9`` (``<eos>`` after it). Draws of ``k`` are proportional to
``k ** -length_skew`` (1 to ``max_steps``), so most completions are short and a few are long:
the long tail that keeps a synchronous batch waiting for its longest samples. The first operand
and every running total stay within ``0..max_operand``, the other operands within
``0..max_term``. The problems are too many to enumerate, so the task is the first ``size``
distinct problems of a stream seeded by ``seed``, in a seeded order. With the defaults (one-digit
numbers, 1 to 18 operations, 10,000 problems) completions are 9 to 111 tokens with ``<eos>``:
median 27, 90th percentile 69, mean 37; a third of the problems have 3 operations or fewer
(there are only 110 one-step problems). The split into train and held-out problems is the same
hash of the prompt text as above, so a prompt is always on the same side and the warm start
(``configs/models/make_longtail_model.py``) never sees a held-out one. Its tokenizer is a
separate one (``0123456789+-=;#``): the default task's tokenizer and ids are unchanged.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers imports torch: only when a tokenizer is made
    from stages.hf import PreTrainedTokenizerFast

__all__ = [
    "CHAIN_CHARS",
    "CHARS",
    "EOS_ID",
    "PAD_ID",
    "ArithmeticConfig",
    "ChainConfig",
    "ChainProblem",
    "Problem",
    "chain_problems",
    "is_held_out",
    "make_chain_tokenizer",
    "make_tokenizer",
    "problem_rows",
    "problems",
]

PAD_ID, EOS_ID = 0, 1
CHARS = "0123456789+-*="
CHAIN_CHARS = "0123456789+-=;#"


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
    min_operand: int = field(
        default=0, metadata={"min": 0, "doc": "operands are min_operand..max_operand"}
    )
    max_operand: int = field(
        default=99, metadata={"min": 1, "doc": "operands are min_operand..max_operand"}
    )
    eval_fraction: float = field(
        default=0.1, metadata={"min": 0.0, "max": 0.9, "doc": "share of problems held out"}
    )
    split_seed: int = field(default=0, metadata={"doc": "which problems are held out"})

    def __post_init__(self) -> None:
        bad = sorted(set(self.ops) - set("+-*"))
        if bad or not self.ops:
            raise ValueError(f"ops must be made of '+', '-', '*' (got {self.ops!r})")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"operands are min_operand..max_operand: need 0 <= min_operand <= max_operand "
                f"(got {self.min_operand}..{self.max_operand})"
            )


def is_held_out(text: str, config: ArithmeticConfig | ChainConfig) -> bool:
    """Whether ``text`` is in the held-out split of its task (a hash of it and ``split_seed``)."""
    return _held_out_test(config)(text)


def _held_out_test(config: ArithmeticConfig | ChainConfig) -> Callable[[str], bool]:
    """``is_held_out`` for many texts of one task: the hash's state after the seed is made once
    and copied for each text (the same digest as hashing ``f"{seed}:{text}"`` whole)."""
    seeded = hashlib.blake2b(f"{config.split_seed}:".encode(), digest_size=8)
    fraction, from_bytes = config.eval_fraction, int.from_bytes

    def held_out(text: str) -> bool:
        digest = seeded.copy()
        digest.update(text.encode())
        return from_bytes(digest.digest(), "big") / 2**64 < fraction

    return held_out


def problems(config: ArithmeticConfig, split: str) -> Iterator[Problem]:
    """Every problem of ``split`` (``"train"`` or ``"eval"``) in a fixed order.

    Subtraction keeps results non-negative (``a - b`` with ``a >= b``).
    """
    for text, answer, _ in problem_rows(config, split):
        yield Problem(text, answer)


def problem_rows(config: ArithmeticConfig, split: str) -> Iterator[tuple[str, str, str]]:
    """``problems`` as ``(text, answer, prompt id)`` rows, without a ``Problem`` each: the
    feeder's 802,025 calculator problems in 0.9 s instead of 2.4."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    want_eval = split == "eval"
    held_out = _held_out_test(config)
    operands = range(config.min_operand, config.max_operand + 1)
    for op in config.ops:
        for a in operands:
            for b in operands:
                if op == "-" and b > a:
                    continue
                text = f"{a}{op}{b}="
                if held_out(text) != want_eval:
                    continue
                value = a + b if op == "+" else a - b if op == "-" else a * b
                yield text, str(value), "arith:" + text


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The task's character tokenizer (ids: ``<pad>`` 0, ``<eos>`` 1, then ``CHARS``)."""
    return _char_tokenizer(CHARS)


def _char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    vocab.update({c: i + 2 for i, c in enumerate(chars)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    from stages.hf import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


# ------------------------------------------------------------------------ the chain (long-tail)
@dataclass(frozen=True)
class ChainProblem:
    text: str  # the prompt, e.g. "12+34-5="
    answer: str  # e.g. "41"
    steps: tuple[str, ...]  # the worked steps, e.g. ("12+34=46", "46-5=41")

    @property
    def prompt_id(self) -> str:
        return f"chain:{self.text}"

    @property
    def solution(self) -> str:
        """The completion that solves it (without ``<eos>``): ``12+34=46;46-5=41;#41``."""
        return "".join(f"{step};" for step in self.steps) + f"#{self.answer}"


@dataclass
class ChainConfig:
    max_steps: int = field(
        default=18, metadata={"min": 1, "max": 40, "doc": "most operations in one problem"}
    )
    length_skew: float = field(
        default=2.0,
        metadata={"min": 0.0, "doc": "draws of k operations are proportional to k ** -length_skew"},
    )
    max_operand: int = field(
        default=9,
        metadata={"min": 1, "doc": "the first operand and every running total are 0..max_operand"},
    )
    max_term: int = field(
        default=9, metadata={"min": 1, "doc": "the operands after the first are 0..max_term"}
    )
    size: int = field(
        default=10_000, metadata={"min": 1, "doc": "distinct problems in the task (both splits)"}
    )
    seed: int = field(default=0, metadata={"doc": "which problems the task draws"})
    eval_fraction: float = field(
        default=0.1, metadata={"min": 0.0, "max": 0.9, "doc": "share of problems held out"}
    )
    split_seed: int = field(default=0, metadata={"doc": "which problems are held out"})


def _draw_chain(rng: random.Random, config: ChainConfig, weights: list[float]) -> ChainProblem:
    steps = rng.choices(range(1, config.max_steps + 1), weights)[0]
    top = config.max_operand
    total = rng.randint(0, top)
    text, worked = str(total), []
    for _ in range(steps):
        op = rng.choice("+-")
        room = top - total if op == "+" else total
        x = rng.randint(0, min(room, config.max_term))
        after = total + x if op == "+" else total - x
        text += f"{op}{x}"
        worked.append(f"{total}{op}{x}={after}")
        total = after
    return ChainProblem(f"{text}=", str(total), tuple(worked))


def chain_problems(config: ChainConfig, split: str) -> Iterator[ChainProblem]:
    """The problems of ``split`` (``"train"`` or ``"eval"``) of the chain task, in a fixed order.

    The task is the first ``size`` distinct prompts drawn from a stream seeded by ``seed`` (a
    prompt drawn again is skipped), in a seeded random order: the same config gives the same
    problems in the same order on every machine, and any prefix of a split (the first held-out
    prompts an evaluation takes) has the length distribution of the whole task. Short chains
    have few distinct prompts (about 10,000 with one operation), so the longer ``size``, the
    fewer one-step problems it holds: ``length_skew`` is the skew of the draws, not of the task.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    want_eval = split == "eval"
    rng = random.Random(f"chain:{config.seed}")
    weights = [k**-config.length_skew for k in range(1, config.max_steps + 1)]
    drawn: dict[str, ChainProblem] = {}
    misses = 0
    while len(drawn) < config.size:
        problem = _draw_chain(rng, config, weights)
        if problem.text not in drawn:
            drawn[problem.text] = problem
            continue
        misses += 1
        if misses > 100 * config.size:  # only a tiny task can run out of distinct prompts
            raise ValueError(
                f"chain task: cannot draw {config.size} distinct problems "
                f"(max_steps={config.max_steps}, max_operand={config.max_operand}); lower `size`"
            )
    order = list(drawn.values())
    rng.shuffle(order)
    held_out = _held_out_test(config)
    for problem in order:
        if held_out(problem.text) == want_eval:
            yield problem


def make_chain_tokenizer() -> PreTrainedTokenizerFast:
    """The chain task's character tokenizer (``<pad>`` 0, ``<eos>`` 1, then ``CHAIN_CHARS``)."""
    return _char_tokenizer(CHAIN_CHARS)
