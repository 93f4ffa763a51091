"""reasoning-gym through its real package: its datasets as a prompt source, its scoring as a
reward (``kind: reasoning_gym``, ``rewards: [{fn: reasoning_gym}]``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.feeder.reasoning_gym_source import dataset
from stages.feeder.sources import SourceConfig, SourceError, load_prompts
from stages.scorer.rewards import reasoning_gym
from stages.scorer.runner import RewardRunner

TOKENIZER = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "arith-tiny")


def _config(**kw) -> SourceConfig:
    base = dict(kind="reasoning_gym", dataset="basic_arithmetic", size=300, seed=5,
                eval_fraction=0.2, tokenizer=TOKENIZER)  # fmt: skip
    return SourceConfig(**{**base, **kw})


def test_items_split_into_train_and_eval_that_never_share_a_question() -> None:
    config = _config()
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    assert len(train) + len(held) == 300 and not train.bad and not held.bad
    assert 0.1 < len(held) / 300 < 0.3
    questions = {p["meta"]["text"] for p in train.prompts}
    assert not questions & {p["meta"]["text"] for p in held.prompts}
    ids = [p["prompt_id"] for p in train.prompts + held.prompts]
    assert len(set(ids)) == 300
    made = dataset("basic_arithmetic", {}, 300, 5)
    for prompt in train.prompts[:20] + held.prompts[:20]:
        meta = prompt["meta"]
        spec = meta["reasoning_gym"]
        assert spec == {"dataset": "basic_arithmetic", "options": {}, "size": 300, "seed": 5,
                        "index": spec["index"]}  # fmt: skip
        item = made[spec["index"]]
        assert prompt["prompt_id"] == f"basic_arithmetic:{spec['index']}"
        assert meta["text"] == item["question"] and meta["answer"] == item["answer"]
    # the same config makes the same items (the package's seeded generator)
    again = load_prompts(_config(), "train")
    assert [p["meta"]["text"] for p in again.prompts] == [p["meta"]["text"] for p in train.prompts]


def test_options_reach_the_dataset() -> None:
    config = _config(dataset="chain_sum", options={"min_terms": 2, "max_terms": 2}, size=50)
    for prompt in load_prompts(config, "train").prompts:
        spec = prompt["meta"]["reasoning_gym"]
        assert spec["options"] == {"min_terms": 2, "max_terms": 2}
        assert prompt["meta"]["text"].count("+") + prompt["meta"]["text"].count(" - ") == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset": "basic_arithmetc"}, "did you mean 'basic_arithmetic'"),
        ({"options": {"nope": 1}}, "unexpected keyword argument 'nope'"),
        ({"dataset": ""}, "needs `dataset`"),
        ({"path": "x.jsonl"}, "drop path/eval_path"),
    ],
)
def test_bad_datasets_and_options_are_config_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**change)


def test_reasoning_gym_keys_on_other_kinds_and_a_missing_eval_split_are_refused() -> None:
    with pytest.raises(ValueError, match="options are for kind 'reasoning_gym'"):
        SourceConfig(kind="jsonl", path="x.jsonl", tokenizer=TOKENIZER, options={"a": 1})
    with pytest.raises(SourceError, match="set `eval_fraction`"):
        load_prompts(_config(eval_fraction=0.0), "eval")


def _scored_kwargs() -> dict:
    made = dataset("basic_arithmetic", {}, 300, 5)
    spec = {"dataset": "basic_arithmetic", "options": {}, "size": 300, "seed": 5}
    right, other = made[3]["answer"], made[4]["answer"]
    completions = [f"So: <answer>{right}</answer>", f" {right} ", f"<answer>{other}</answer>", "x"]
    specs = [{**spec, "index": 3}] * 3 + [None]
    return {"completions": completions, "reasoning_gym": specs, "prompts": ["p"] * 4}


def test_the_reward_is_the_dataset_own_score_of_the_answer() -> None:
    assert reasoning_gym(**_scored_kwargs()) == [1.0, 1.0, 0.0, None]
    assert reasoning_gym(["a"], prompts=["p"]) == [None]  # a source without items


@pytest.mark.timeout(60)
async def test_the_reward_runs_by_its_entry_point_in_a_worker() -> None:
    async with RewardRunner([("reasoning_gym", 1.0)], workers=1, timeout_s=30) as runner:
        scored = await runner.score(_scored_kwargs())
    assert [r for r, _ in scored] == [1.0, 1.0, 0.0, 0.0]  # nothing from it: 0 in the sum
