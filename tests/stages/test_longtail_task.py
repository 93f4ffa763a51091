"""The long-tail chain task: exact problems, answers and worked steps, a long tail of lengths, its
own tokenizer (the default one unchanged), the shipped warm start and configs/longtail.yaml."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
import yaml

from stages.feeder.arithmetic import (
    CHAIN_CHARS,
    EOS_ID,
    ChainConfig,
    chain_problems,
    make_chain_tokenizer,
    make_tokenizer,
)
from stages.scorer.rewards import chain_answer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "longtail-tiny"
CONFIG = ROOT / "configs" / "longtail.yaml"
STEP = re.compile(r"(\d+)([+-])(\d+)=(\d+)")


@pytest.fixture(scope="module")
def task() -> tuple[list, list]:
    config = ChainConfig()  # the shipped config's task
    return list(chain_problems(config, "train")), list(chain_problems(config, "eval"))


def test_answers_and_worked_steps_are_exact(task):
    config = ChainConfig()
    for p in task[0][:2000] + task[1]:
        terms = re.findall(r"[+-]?\d+", p.text[:-1])
        assert p.text.endswith("=") and str(sum(int(t) for t in terms)) == p.answer
        assert 1 <= len(p.steps) == len(terms) - 1 <= config.max_steps
        total = int(terms[0])
        for step, term in zip(p.steps, terms[1:], strict=True):
            a, op, b, c = STEP.fullmatch(step).groups()
            assert int(a) == total and f"{op}{b}" == term
            total = total + int(b) if op == "+" else total - int(b)
            assert int(c) == total and 0 <= total <= config.max_operand
            assert int(b) <= config.max_term
        assert p.solution == "".join(f"{s};" for s in p.steps) + f"#{p.answer}"
        assert p.prompt_id == f"chain:{p.text}"


def test_splits_are_disjoint_seeded_and_stable(task):
    train, held = task
    assert len(train) + len(held) == ChainConfig().size
    assert not {p.text for p in train} & {p.text for p in held}
    assert len({p.text for p in train}) == len(train)  # distinct problems
    assert 0.08 < len(held) / (len(train) + len(held)) < 0.12
    small = ChainConfig(size=300)
    assert list(chain_problems(small, "eval")) == list(chain_problems(small, "eval"))
    other = list(chain_problems(ChainConfig(size=300, seed=1), "train"))
    assert [p.text for p in other] != [p.text for p in chain_problems(small, "train")]
    # the held-out side of a prompt depends on the prompt, not on which problems were drawn
    held_small = {p.text for p in chain_problems(small, "eval")}
    assert held_small <= {p.text for p in held}
    with pytest.raises(ValueError, match="split"):
        next(chain_problems(small, "test"))


def test_lengths_have_a_long_tail(task):
    lengths = [len(p.solution) + 1 for p in task[0]]  # tokens, <eos> included
    assert min(lengths) <= 10 and max(lengths) >= 100
    assert statistics.median(lengths) <= 30
    assert sum(n >= 69 for n in lengths) / len(lengths) <= 0.12  # a few are long
    first = [len(p.solution) + 1 for p in task[1][:300]]  # what evaluation sees
    assert max(first) >= 90 and statistics.median(first) <= 30


def test_a_task_too_small_for_its_size_says_so():
    with pytest.raises(ValueError, match="distinct problems"):
        list(chain_problems(ChainConfig(size=500, max_steps=1, max_operand=3, max_term=3), "train"))


def test_tokenizers_round_trip_and_the_default_one_is_unchanged(task):
    chain = make_chain_tokenizer()
    assert chain.get_vocab() == {"<pad>": 0, "<eos>": 1} | {
        c: i + 2 for i, c in enumerate(CHAIN_CHARS)
    }
    for p in task[1][:50]:
        text = p.text + p.solution
        ids = chain(text)["input_ids"]
        assert len(ids) == len(text) and chain.decode(ids) == text
        assert chain.decode([*ids, EOS_ID], skip_special_tokens=True) == text
    assert make_tokenizer().get_vocab() == {"<pad>": 0, "<eos>": 1} | {
        c: i + 2 for i, c in enumerate("0123456789+-*=")
    }


def test_shipped_model_fits_the_config_and_is_partly_right(task):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    # transformers 5 loads it as a Qwen2Tokenizer, which appends an unused '<|endoftext|>':
    # every token the task uses keeps its id
    vocab = tok.get_vocab()
    assert {
        t: vocab[t] for t in make_chain_tokenizer().get_vocab()
    } == make_chain_tokenizer().get_vocab()
    config = yaml.safe_load(CONFIG.read_text())
    max_new = config["stages"]["generator"]["sampling"]["max_new_tokens"]
    assert config["stages"]["learner"]["eval"]["max_new_tokens"] == max_new
    every = task[0] + task[1]
    assert max_new >= max(len(p.solution) + 1 for p in every)
    model = AutoModelForCausalLM.from_pretrained(MODEL).float().eval()
    assert model.config.vocab_size == len(CHAIN_CHARS) + 2
    assert model.config.max_position_embeddings >= max(len(p.text) for p in every) + max_new
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 2_000_000

    sys.path.insert(0, str(ROOT / "configs" / "models"))
    try:
        import make_longtail_model as script
    finally:
        sys.path.pop(0)
    items = task[1][:60]  # held out: never trained on
    torch.manual_seed(0)
    outs = script.greedy(model, [p.text for p in items])
    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in outs]
    scores = chain_answer(
        texts,
        answer=[p.answer for p in items],
        finish_reason=["stop" if ended else "length" for _, ended in outs],
    )
    assert 0.2 <= sum(scores) / len(scores) <= 0.7
    # the warm start writes worked steps in the task's format
    formatted = [re.fullmatch(r"(\d+[+-]\d+=\d+;)+#\d+", t) is not None for t in texts]
    assert sum(formatted) >= 0.8 * len(outs)
