"""A reward model (``rewards: [{reward_model: ...}]``) served by the built-in engine, started as
a user starts it (``inflight engine --model RM``, a ``*ForSequenceClassification``): each
sample's conversation is rendered by the reward model's own chat template (``/v1/tokenize``)
and scored by ``/classify``; the reward is the head's output, compared with transformers' own
forward of the same ids."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerFast

from stages.generator.launcher import LaunchConfig
from stages.scorer.runner import RewardRunner
from stages.scorer.spec import RewardModelSpec, RewardSpec
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import builtin_engine, classifier_reference, post_json
from tests.stages.tiny_encoders import make_bert
from tests.stages.tiny_model import make_tiny_classifier

COMPLETIONS = ["w11 w12", "w13", "w14 w15 w16", "w17"]
PROMPTS = ["w6 w7", "w6 w7", "w8", "w8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_classifier(tmp_path_factory.mktemp("rm") / "model", seed=7)


@pytest.fixture(scope="module")
def engine(model_dir) -> Iterator[str]:
    with builtin_engine(model_dir) as url:
        yield url


def _reference(model_dir, texts_or_ids: list) -> list[tuple[float, float, int]]:
    """transformers' reward of each text or ids alone, its rounding's scale and its length."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    out = []
    for item in texts_or_ids:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        values, scale = classifier_reference(model_dir, ids)
        out.append((values[0], scale, len(ids)))
    return out


def _kwargs() -> dict[str, list]:
    # the first two come with their conversation (a chat-templated prompt's meta messages)
    messages = [
        [{"role": "system", "content": "w3"}, {"role": "user", "content": p}] for p in PROMPTS
    ]
    return {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "messages": [messages[0], messages[1], None, None],
        "answer": ["w20"] * 4,
    }


@pytest.mark.numerics
@pytest.mark.timeout(90)
async def test_a_reward_model_scores_each_conversation_with_its_own_template(engine, model_dir):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    kwargs = _kwargs()
    conversations = []
    for i, completion in enumerate(COMPLETIONS):
        before = kwargs["messages"][i] or [{"role": "user", "content": PROMPTS[i]}]
        turn = {"role": "assistant", "content": completion}
        conversations.append(
            tokenizer.apply_chat_template(
                [*before, turn], tokenize=True, add_generation_prompt=False, return_dict=False
            )
        )
    chat = _reference(model_dir, conversations)
    texts = [f"w4 {p} w5 {c}" for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    plain = _reference(model_dir, texts)
    specs = [
        RewardSpec(reward_model=RewardModelSpec(url=engine), name="chat"),
        RewardSpec(
            reward_model=RewardModelSpec(
                url=engine, input="text", template="w4 {prompt} w5 {completion}"
            ),
            name="text",
            weight=0.5,
            batch_size=3,
        ),
    ]
    async with RewardRunner(specs) as runner:
        scored = await runner.score(kwargs)
        stats = runner.stats()
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    for i, (reward, info) in enumerate(scored):
        for name, (want, scale, length) in (("chat", chat[i]), ("text", plain[i])):
            assert_close(info[name], want, terms=forward_terms(config, length), scale=scale)
        assert reward == pytest.approx(info["chat"] + 0.5 * info["text"], abs=1e-6)
    # chat: a /v1/tokenize call a sample, then one /classify; text: 4 samples in calls of 3
    assert stats["calls"] == 4 + 1 + 2 and stats["errors"] == 0


@pytest.mark.timeout(90)
async def test_a_missing_output_or_template_key_fails_its_samples_with_a_counted_kind(engine):
    specs = [
        RewardSpec(reward_model=RewardModelSpec(url=engine, label=3), name="label", backoff_s=0),
        RewardSpec(
            reward_model=RewardModelSpec(url=engine, input="text", template="{nope}"),
            name="template",
        ),
    ]
    async with RewardRunner(specs) as runner:
        scored = await runner.score(_kwargs())
        stats = runner.stats()
    for reward, info in scored:
        assert reward == 0.0
        assert "label: bad_response: no output 3" in info["error"]
        assert "template: rm_template: the template names 'nope'" in info["error"]
    assert stats["failed_bad_response"] == 4 and stats["failed_rm_template"] == 4


def test_bad_reward_model_entries_are_config_errors() -> None:
    with pytest.raises(ValueError, match="template applies to input: text"):
        RewardModelSpec(url="http://127.0.0.1:1", template="{completion}")
    with pytest.raises(ValueError, match="must be an http"):
        RewardModelSpec(url="ftp://x")
    with pytest.raises(ValueError, match="protocol applies to url rewards only"):
        RewardSpec(reward_model=RewardModelSpec(url="http://127.0.0.1:1"), protocol="slime")
    spec = RewardSpec(reward_model=RewardModelSpec(url="http://127.0.0.1:9/"))
    assert spec.name == "rm:127.0.0.1:9"
    with pytest.raises(ValueError, match=r"exactly one of url .* or launch"):
        RewardModelSpec(url="http://127.0.0.1:1", launch=LaunchConfig(model="rm"))
    with pytest.raises(ValueError, match="count 1, in_process false"):
        RewardModelSpec(launch=LaunchConfig(model="rm", count=2))
    launched = RewardSpec(reward_model=RewardModelSpec(launch=LaunchConfig(model="models/rm/")))
    assert launched.name == "rm:models/rm"
    with pytest.raises(ValueError, match=r"eval\.rewards take a url"):  # no site: not the scorer
        RewardRunner([launched])


@pytest.mark.numerics
@pytest.mark.timeout(90)
async def test_a_sample_past_the_models_context_fails_alone(engine, model_dir) -> None:
    kwargs = _kwargs()
    kwargs["completions"] = list(COMPLETIONS)
    kwargs["completions"][1] = " ".join(["w30"] * 600)  # the tiny model's context is 512
    specs = [RewardSpec(reward_model=RewardModelSpec(url=engine), name="rm", backoff_s=0)]
    async with RewardRunner(specs) as runner:
        scored = await runner.score(kwargs)
        alone = await runner.score({k: v[:1] for k, v in kwargs.items()})
        stats = runner.stats()
    assert scored[1][0] == 0.0 and "longer than the model's context length" in scored[1][1]["error"]
    assert all("error" not in info for i, (_, info) in enumerate(scored) if i != 1)
    # the others' calls run concurrently (the engine may batch them): the same reward within
    # the float rule
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    turns = [*kwargs["messages"][0], {"role": "assistant", "content": COMPLETIONS[0]}]
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=False, return_dict=False)
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    scale = classifier_reference(model_dir, ids)[1]
    terms = forward_terms(config, len(ids))
    assert_close(scored[0][1]["rm"], alone[0][1]["rm"], terms=terms, scale=scale)
    assert stats["http_split_calls"] == 1 and stats["failed_http_error"] == 1


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_the_scorer_stage_scores_with_a_reward_model(tmp_path, engine, model_dir) -> None:
    from stages.feeder.arithmetic import make_tokenizer
    from tests.pipeline.runs import events
    from tests.stages_for_tests import run_scorer

    tokenizer_dir = tmp_path / "arith"
    make_tokenizer().save_pretrained(tokenizer_dir)
    rollouts = [
        {"group": g, "index": i, "completion": c, "prompt": prompt, "meta": {"answer": "7"}}
        for g, prompt, completions in (("a", "3+4=", "78"), ("b", "2+5=", "77"))
        for i, c in enumerate(completions)
    ]
    rewards = ["{fn: exact_match}", f'{{reward_model: {{url: "{engine}"}}, name: rm, weight: 0.5}}']
    run_dir, groups = run_scorer(tmp_path, rollouts, rewards, tokenizer_dir, timeout=80)
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    for item in rollouts:
        sample = groups[item["group"]]["samples"][item["index"]]
        turns = [{"role": "user", "content": item["prompt"]},
                 {"role": "assistant", "content": item["completion"]}]  # fmt: skip
        body = {"messages": turns, "add_generation_prompt": False}
        ids = post_json(f"{engine}/v1/tokenize", body)
        (answer,) = post_json(f"{engine}/classify", {"input_ids": [ids["tokens"]]})
        (want,) = answer["embedding"][:1]
        info = sample["reward_info"]
        scale = classifier_reference(model_dir, ids["tokens"])[1]
        terms = forward_terms(config, len(ids["tokens"]))
        assert_close(info["rm"], want, terms=terms, scale=scale)  # batched there, alone here
        exact = float(item["completion"] == "7")
        assert sample["reward"] == pytest.approx(exact + 0.5 * info["rm"], abs=1e-6)
    (done,) = [e for e in events(run_dir, "scorer.0") if e["event"] == "scorer_done"]
    assert done["samples"] == 4 and done["errors"] == 0 and done["http_split_calls"] == 0


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_the_scorer_starts_its_reward_models_engine_with_launch(tmp_path, model_dir) -> None:
    from stages.feeder.arithmetic import make_tokenizer
    from tests.pipeline.runs import events
    from tests.stages_for_tests import run_scorer

    tokenizer_dir = tmp_path / "arith"
    make_tokenizer().save_pretrained(tokenizer_dir)
    rollouts = [
        {"group": "a", "index": i, "completion": c, "prompt": "3+4=", "meta": {"answer": "7"}}
        for i, c in enumerate("78")
    ]
    reward = f'{{reward_model: {{launch: {{model: "{model_dir}"}}}}, name: rm}}'
    run_dir, groups = run_scorer(tmp_path, rollouts, [reward], tokenizer_dir, timeout=110)
    group = groups["a"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    for item, sample in zip(rollouts, group["samples"], strict=True):
        turns = [{"role": "user", "content": item["prompt"]},
                 {"role": "assistant", "content": item["completion"]}]  # fmt: skip
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=False, return_dict=False)
        (want,), scale = classifier_reference(model_dir, ids)
        terms = forward_terms(config, len(ids))
        assert_close(sample["reward_info"]["rm"], want, terms=terms, scale=scale)
    (ready,) = [e for e in events(run_dir, "scorer.0") if e["event"] == "reward_engine_ready"]
    assert ready["fn"] == "rm" and ready["url"].startswith("http://127.0.0.1:")


@pytest.mark.numerics
@pytest.mark.timeout(90)
async def test_a_cross_encoder_scores_each_samples_pair(tmp_path) -> None:
    # input: pair: [query, document] per sample, sent as SGLang's is_cross_encoder_request
    # pairs; a one-label cross-encoder answers a number, the reward (label 0)
    model_dir = make_bert(tmp_path / "ce", "BertForSequenceClassification", seed=5)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"prompts": ["w6 w7", "w8", "w9 w10"], "completions": ["w11", "w12 w13", "w14"],
              "answer": ["w20", "w21 w22", "w23"]}  # fmt: skip
    with builtin_engine(model_dir) as url:
        by_answer = RewardModelSpec(url=url, input="pair", pair=["{answer}", "{completion}"])
        specs = [
            RewardSpec(reward_model=RewardModelSpec(url=url, input="pair"), name="prompt"),
            RewardSpec(reward_model=by_answer, name="answer"),
        ]
        async with RewardRunner(specs) as runner:
            scored = await runner.score(kwargs)
    for i, (_, info) in enumerate(scored):
        for name, query in (("prompt", kwargs["prompts"][i]), ("answer", kwargs["answer"][i])):
            encoded = tokenizer(query, kwargs["completions"][i], return_tensors="pt")
            with torch.no_grad():
                want = float(model(**encoded).logits[0, 0])
            assert abs(info[name] - want) <= 1e-4 * max(1.0, abs(want)), (name, info, want)
    assert scored[0][1]["prompt"] != scored[0][1]["answer"]


def test_pair_entries_are_checked() -> None:
    with pytest.raises(ValueError, match="pair applies to input: pair"):
        RewardModelSpec(url="http://127.0.0.1:1", pair=["{prompt}", "{answer}"])
    with pytest.raises(ValueError, match="two format strings"):
        RewardModelSpec(url="http://127.0.0.1:1", input="pair", pair=["{prompt}"])
    with pytest.raises(ValueError, match="template applies to input: text"):
        RewardModelSpec(url="http://127.0.0.1:1", input="pair", template="{completion}")
