"""A generative judge (``rewards: [{judge: ...}]``) served by the built-in engine, started as a
user starts it. The tiny model is random, so what is checked is the plumbing: each sample's
prompt is the template filled with its values, the engine's answer (compared with a direct call
per prompt) is read by the rule, and an answer the rule cannot read is a counted failure."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from stages.scorer.runner import RewardRunner
from stages.scorer.spec import JudgeSpec, RewardSpec
from tests.stages.engine_setup import builtin_engine, post_json
from tests.stages.tiny_model import make_tiny_model

# word-level, as the tiny tokenizer is: a user turn is w7 ... w10, the answer follows w8
CHAT_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'user' %}w7 {% else %}w9 {% endif %}"
    "{{ m.content }} w10 {% endfor %}{%- if add_generation_prompt %}w8 {% endif %}"
)
TEMPLATE = "w3 w4 {completion} w5 {answer}"
COMPLETIONS = ["w11 w12", "w13", "w14 w15 w16", "w17"]
ANSWERS = ["w20", "w21", "w20", "w22"]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("judge")
    model = make_tiny_model(root / "model", vocab=64, seed=3)
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    with builtin_engine(model, "--chat-template", str(root / "chat.jinja")) as url:
        yield url


def _kwargs() -> dict[str, list]:
    n = len(COMPLETIONS)
    return {"prompts": ["w6"] * n, "completions": COMPLETIONS, "answer": ANSWERS}


def _judge(url: str, name: str, parse: str, *, weight: float = 1.0, batch_size: int | None = None,
           **options: Any) -> RewardSpec:  # fmt: skip
    judge = JudgeSpec(url=url, parse=parse, max_new_tokens=NEW_TOKENS, **options)
    return RewardSpec(judge=judge, name=name, weight=weight, batch_size=batch_size, backoff_s=0.0)


def _read(text: str, rule: str, table: dict[str, float] | None = None) -> float | None:
    found = re.search(rule, text)
    if found is None:
        return None
    return table.get(found.group(1)) if table is not None else float(found.group(1))


@pytest.mark.timeout(90)
async def test_a_judge_scores_what_its_rule_reads_in_the_engines_answers(engine):
    # what the engine answers each prompt on its own, greedily, on each route
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    prompts = [
        TEMPLATE.format(completion=c, answer=a) for c, a in zip(COMPLETIONS, ANSWERS, strict=True)
    ]
    generated = [post_json(f"{engine}/generate", {"text": p, "sampling_params": params})["text"]
                 for p in prompts]  # fmt: skip
    chat_body = {"model": "default", "max_tokens": NEW_TOKENS, "temperature": 0.0}
    chatted = [
        post_json(
            f"{engine}/v1/chat/completions",
            {**chat_body, "messages": [{"role": "user", "content": c}]},
        )["choices"][0]["message"]["content"]
        for c in COMPLETIONS
    ]
    firsts = [re.search(r"(w\d+)", t) for t in generated]
    table = {m.group(1): float(k + 1) for k, m in enumerate(firsts[:2]) if m is not None}
    expected = {
        "words": [_read(t, r"(w\d+)", table) for t in generated],  # a text's score by map
        "numbers": [_read(t, r"w(\d+)") for t in generated],  # the group is a number
        "chat": [_read(t, r"w(\d+)") for t in chatted],
    }
    assert all(v is not None for v in expected["numbers"]), generated  # the model writes words

    specs = [
        _judge(engine, "words", r"(w\d+)", template=TEMPLATE, map=table, weight=1.0),
        _judge(engine, "numbers", r"w(\d+)", template=TEMPLATE, weight=0.01, batch_size=3),
        _judge(engine, "chat", r"w(\d+)", template="{completion}", route="chat", weight=0.001),
    ]
    async with RewardRunner(specs) as runner:
        scored = await runner.score(_kwargs())
        stats = runner.stats()
    weights = {"words": 1.0, "numbers": 0.01, "chat": 0.001}
    answers = {"words": generated, "numbers": generated, "chat": chatted}
    for i, (reward, info) in enumerate(scored):
        assert {k: info[k] for k in expected} == {k: v[i] for k, v in expected.items()}, i
        unread = [k for k in expected if expected[k][i] is None]  # e.g. a first word not in map
        if unread:
            why = [
                f"{k}: judge_unparsed: parse found no score in {answers[k][i]!r}" for k in unread
            ]
            assert reward == 0.0 and info["error"] == "; ".join(why)
        else:
            assert reward == pytest.approx(sum(w * expected[k][i] for k, w in weights.items()))
    unread = sum(v is None for values in expected.values() for v in values)
    assert 0 < unread < 3 * len(COMPLETIONS)  # both outcomes are exercised
    assert stats.get("failed_judge_unparsed", 0) == unread and stats["timeouts"] == 0
    # numbers: 4 samples in calls of 3; chat: one a request
    assert stats["calls"] == 1 + 2 + len(COMPLETIONS)


@pytest.mark.timeout(60)
async def test_an_answer_the_rule_cannot_read_is_a_counted_failure(engine):
    specs = [
        _judge(engine, "never", r"(no such word)", template=TEMPLATE),
        _judge(engine, "lacking", r"(w\d+)", template="{completion} {grade}"),
    ]
    with capture_logs() as logs:
        async with RewardRunner(specs) as runner:
            first = await runner.score(_kwargs(), group_id="g1")
            await runner.score(_kwargs(), group_id="g2")
            stats = runner.stats()
    n = len(COMPLETIONS)
    for reward, info in first:
        assert reward == 0.0 and info["never"] is None and info["lacking"] is None
        assert info["error"].startswith("never: judge_unparsed: parse found no score in")
        assert "lacking: judge_template: the template names 'grade', which the" in info["error"]
    assert stats["failed_judge_unparsed"] == 2 * n and stats["failed_judge_template"] == 2 * n
    assert stats["calls"] == 2  # the template's failure makes no call
    failed = [(e["fn"], e["kind"], e["group_id"]) for e in logs if e["event"] == "reward_failed"]
    assert sorted(failed) == [
        ("lacking", "judge_template", "g1"),
        ("never", "judge_unparsed", "g1"),
    ]
