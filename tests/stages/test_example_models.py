"""The agentic examples' shipped models (configs/models/calc-tiny, guess-tiny): their tokenizers
give the ids the rollouts are written against, their configs fit those tokenizers, and a few
greedy episodes have the exact formats (a tool call answered by the calculator; a guessing game)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from stages.feeder.arithmetic import EOS_ID, PAD_ID, ArithmeticConfig, problems

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
CALC, GUESS = MODELS / "calc-tiny", MODELS / "guess-tiny"
TOOL_TAGS = {"<tool_call>": 21, "</tool_call>": 22, "<tool_response>": 23, "</tool_response>": 24}


@pytest.fixture(scope="module")
def scripts() -> tuple[ModuleType, ModuleType]:
    sys.path.insert(0, str(MODELS))
    try:
        import make_calc_model
        import make_guess_model
    finally:
        sys.path.pop(0)
    return make_calc_model, make_guess_model


def load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).float().eval()
    return tok, model


def check_common(tok, model, chars: str, vocab_size: int) -> None:
    # transformers 5 loads these folders as a Qwen2Tokenizer, which appends an unused
    # '<|endoftext|>' after the vocabulary (as for arith-tiny): every other id is as written
    vocab = tok.get_vocab()
    assert vocab["<pad>"] == tok.pad_token_id == PAD_ID
    assert vocab["<eos>"] == tok.eos_token_id == EOS_ID
    assert [vocab[c] for c in chars] == list(range(2, 2 + len(chars)))
    assert max(i for t, i in vocab.items() if t != "<|endoftext|>") == vocab_size - 1
    config = model.config
    assert config.vocab_size == vocab_size
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (EOS_ID, PAD_ID, None)
    assert config.max_position_embeddings == 64 and config.tie_word_embeddings
    assert model.generation_config.eos_token_id == EOS_ID
    assert model.generation_config.pad_token_id == PAD_ID
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


# ---------------------------------------------------------------------------------- calc-tiny
def test_calc_tokenizer_keeps_the_tool_tags_whole(scripts):
    calc, _ = scripts
    tok, model = load(CALC)
    check_common(tok, model, "0123456789+-*=()acl", 25)
    assert {t: tok.convert_tokens_to_ids(t) for t in TOOL_TAGS} == TOOL_TAGS
    assert not set(TOOL_TAGS.values()) & set(tok.all_special_ids)  # added, not special
    ids = tok("<tool_call>calc(123*456)</tool_call>")["input_ids"]
    assert len(ids) == 1 + 4 + 1 + 7 + 1 + 1
    assert ids[0] == 21 and ids[-1] == 22 and ids[1:-1] == tok("calc(123*456)")["input_ids"]
    text = "123*456=<tool_call>calc(123*456)</tool_call><tool_response>56088</tool_response>56088"
    ids = tok(text + "<eos>")["input_ids"]
    assert ids == calc.encode(text + "<eos>") and ids[-1] == EOS_ID
    assert tok.decode(ids, skip_special_tokens=True) == text
    # the script's own tokenizer is the one shipped
    assert calc.make_calc_tokenizer().get_vocab() == {
        t: i for t, i in tok.get_vocab().items() if t != "<|endoftext|>"
    }


def test_calc_greedy_episodes_call_the_tool_in_the_exact_format(scripts):
    calc, _ = scripts
    tok, model = load(CALC)
    # held-out problems of the calc task (the split hashes the text alone), 9xx*9xx: the
    # warm start calls the tool for a first operand 9xx
    held = [*problems(ArithmeticConfig(ops="*", min_operand=900, max_operand=999), "eval")][:8]
    episodes = calc.run_episodes(model, held)
    used = [(ep, p) for ep, p in zip(episodes, held, strict=True) if ep.first_call]
    assert len(used) >= 6
    for ep, p in used:
        a, b = p.text[:-1].split("*")
        call = f"<tool_call>calc({a}*{b})</tool_call>"
        inserted = f"<tool_response>{p.answer}</tool_response>"
        assert ep.ids == tok(f"{p.text}{call}{inserted}{p.answer}<eos>")["input_ids"]
        assert ep.calls == 1 and ep.answer == p.answer
        # plain generate() stopping at </tool_call> gives the same first turn
        prompt = torch.tensor([tok(p.text)["input_ids"]])
        out = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=[1, 22])
        assert tok.decode(out[0, prompt.shape[1] :]) == call
    # ...and answers at once (wrongly) for most other operands: RL has room
    others = [*problems(ArithmeticConfig(ops="*", min_operand=100, max_operand=130), "eval")]
    firsts = [ep.first_call for ep in calc.run_episodes(model, others[:16])]
    assert sum(firsts) <= 2


# --------------------------------------------------------------------------------- guess-tiny
def test_guess_tokenizer_and_config():
    tok, model = load(GUESS)
    check_common(tok, model, "0123456789HL?", 15)
    ids = tok("?50L25H37")["input_ids"]
    assert ids == [14, 7, 2, 13, 4, 7, 12, 5, 9]
    assert tok.decode([*ids[:3], EOS_ID], skip_special_tokens=True) == "?50"


def test_guess_greedy_games_follow_the_format_and_are_partly_right(scripts):
    _, guess = scripts
    _, model = load(GUESS)
    games = guess.play_games(model, list(range(1, 101)))
    for game in games:
        text = guess.decode_game(game)
        assert re.fullmatch(r"\?(\d+<eos>[HL])*\d+<eos>", text), text
        answers = re.findall(r"<eos>([HL])", text)
        assert answers == ["H" if game.secret > g else "L" for g in game.guesses[: len(answers)]]
        assert game.success == (game.guesses[-1] == game.secret)
        assert len(game.guesses) <= 7 and (game.success or len(game.guesses) == 7)
    stats = guess.game_stats(games)
    assert 0.3 <= stats["success"] <= 0.7
    assert stats["reward"] < 0.6  # binary search: 0.76
