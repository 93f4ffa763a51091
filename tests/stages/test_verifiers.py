"""verifiers environments through the real package (``tests/stages/vf_tiny_env.py``, loaded by
module name): their datasets as a prompt source (``kind: verifiers``), their rubric as a reward
(``rewards: [{fn: verifiers}]``) and their own rollout as an agent (``agent: verifiers``), against
a scripted engine and, end to end, the generator with a real built-in engine."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from pipeline.config import ConfigError, load_pipeline
from pipeline.registry import resolve
from stages.feeder.sources import SourceConfig, SourceError, load_prompts
from stages.rollouts.api import RolloutConfig, RolloutContext
from stages.rollouts.openai_agent import AgentFailed, openai_agent
from stages.rollouts.trajectory import Generation
from stages.scorer.runner import RewardRunner
from tests.stages.test_generator_groups import NEW_TOKENS, G, Proxy, engine, generate
from tests.stages.tiny_model import EOS_ID, _tokenizer, make_tiny_model
from tests.stages.vf_tiny_env import HINT, SYSTEM, TEMPLATE

__all__ = ["engine"]  # the groups tests' module-scoped engine fixture

ENV = "tests.stages.vf_tiny_env"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    """The tiny model's word tokenizer with a chat template of words."""
    path = tmp_path_factory.mktemp("vf_tok")
    tok = _tokenizer(128)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tok_dir) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _source(tok_dir: str, **kw: Any) -> SourceConfig:
    env_args = kw.pop("env_args", {})
    return SourceConfig(kind="verifiers", env=ENV, env_args=env_args, tokenizer=tok_dir, **kw)


def _keys(prompts: list[dict]) -> set[str]:
    return {json.dumps(p["meta"]["messages"], sort_keys=True) for p in prompts}


# ------------------------------------------------------------------------------ the source
def test_rows_are_the_environment_prompts_with_their_fields_in_meta(tok_dir, tokenizer) -> None:
    config = _source(tok_dir)
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    assert len(train) == 40 and len(held) == 10 and not train.bad and not held.bad
    first = train.prompts[0]
    meta = first["meta"]
    # the environment formatted it: its system prompt, then the question as a user message
    assert meta["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "w10 w11"},
    ]
    text = tokenizer.apply_chat_template(
        meta["messages"], tokenize=False, add_generation_prompt=True
    )
    assert meta["text"] == text
    assert first["input_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert meta["answer"] == "w21" and meta["info"] == {"n": 0} and meta["example_id"] == 0
    assert meta["task"] == ENV  # no task column: the environment's name
    assert meta["verifiers"] == {
        "env": ENV,
        "env_args": {},
        "fields": ["answer", "info", "example_id"],
        "extra": {"question": "w10 w11"},
    }
    assert first["prompt_id"] == f"{ENV}:0"
    assert held.prompts[0]["prompt_id"] == f"{ENV}/eval:0"
    assert not _keys(train.prompts) & _keys(held.prompts)


def test_training_leaves_out_the_prompts_the_eval_dataset_has(tok_dir) -> None:
    config = _source(tok_dir, env_args={"shared": 3})
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    assert len(held) == 10 and len(train) == 37  # three questions are in both datasets
    assert not _keys(train.prompts) & _keys(held.prompts)


def test_eval_fraction_holds_out_a_share_of_the_trained_dataset(tok_dir) -> None:
    # no eval dataset of its own: verifiers would serve the training prompts as eval
    bare = _source(tok_dir, env_args={"eval_size": 0})
    with pytest.raises(SourceError, match=r"no eval dataset.*set `eval_fraction`"):
        load_prompts(bare, "eval")
    for config in (
        _source(tok_dir, env_args={"eval_size": 0}, eval_fraction=0.3),
        _source(tok_dir, split="eval", eval_fraction=0.3),  # training on its eval dataset
    ):
        train, held = load_prompts(config, "train"), load_prompts(config, "eval")
        size = 40 if config.split == "train" else 10
        assert len(train) + len(held) == size and len(held) > 0
        assert not _keys(train.prompts) & _keys(held.prompts)
    with pytest.raises(SourceError, match="no eval dataset apart from the one trained on"):
        load_prompts(_source(tok_dir, split="eval"), "eval")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"env": ""}, "needs `env`"),
        ({"env": "no-such-env"}, "`env` 'no-such-env': there is no module 'no_such_env'"),
        ({"env": "tests.stages.nope"}, "no module 'tests.stages.nope'"),
        ({"env": "tests.stages.test_verifiers"}, "has no load_environment function"),
        ({"env_args": {"nope": 1}}, "`env_args` of .*unexpected keyword argument 'nope'"),
        ({"env_args": {"sise": 3}}, "did you mean 'size'"),
        ({"env_args": {"kind": "bogus"}}, "load_environment raised ValueError: no kind 'bogus'"),
        ({"env_args": {"kind": "no_prompt"}}, "building its dataset failed: KeyError: 'question'"),
        ({"split": "test"}, "`split` is the environment's dataset to train on"),
        ({"path": "x.jsonl"}, "drop path/eval_path"),
    ],
)
def test_bad_environments_and_arguments_are_config_errors(tok_dir, change, message) -> None:
    config = {"kind": "verifiers", "env": ENV, "tokenizer": tok_dir, **change}
    with pytest.raises(ValueError, match=message):
        SourceConfig(**config)


def test_verifiers_keys_on_other_kinds_are_refused(tok_dir) -> None:
    with pytest.raises(ValueError, match="env/env_args are for kind 'verifiers'"):
        SourceConfig(kind="jsonl", path="x.jsonl", tokenizer=tok_dir, env=ENV)


def test_a_bad_environment_is_reported_at_its_key_and_line(tmp_path, tok_dir) -> None:
    model = make_tiny_model(tmp_path / "tiny", vocab=128)
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        "stages:\n"
        "  feeder:\n"
        "    use: feeder\n"
        f"    source: {{kind: verifiers, env: {ENV}, env_args: {{nope: 1}},\n"
        f"             tokenizer: {tok_dir}}}\n"
        "  generator:\n"
        "    use: generator\n"
        "    inputs: {prompts: feeder.prompts}\n"
        f"    launch: {{kind: builtin, model: {model}}}\n"
        "    rollout: {use: openai_agent, agent: verifiers}\n"
        "  scorer:\n"
        "    use: scorer\n"
        "    inputs: {rollouts: generator.rollouts}\n"
        "    rewards: [{fn: env_reward}]\n"
        f"    tokenizer: {tok_dir}\n"
        "  learner:\n"
        "    use: learner\n"
        "    inputs: {groups: scorer.groups}\n"
        f"    model: {model}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_pipeline(path, resolve=lambda name: resolve("stage", name))
    (issue,) = info.value.issues
    assert issue.path == "stages.feeder.source.env_args" and issue.where.startswith(f"{path}:4")
    assert "`env_args`" in issue.message and "'nope'" in issue.message


def test_making_an_environment_takes_no_signal_handlers_on_any_thread() -> None:
    """verifiers' Environment installs SIGINT/SIGTERM handlers (tear down, then exit) when it is
    made, and cannot be made off the main thread; Inflight's stages keep their own handlers and
    read prompts in a thread."""
    import signal
    import threading

    import verifiers as vf

    from stages.verifiers_env import environment

    signals = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in signals}
    try:
        vf.load_environment(ENV, size=5)  # as verifiers itself makes one
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    environment(ENV, {"size": 6})  # on the main thread
    made: list[Any] = []
    thread = threading.Thread(target=lambda: made.append(environment(ENV, {"size": 7})))
    thread.start()
    thread.join(30)
    assert len(made) == 1 and len(made[0].get_dataset()) == 7
    assert {s: signal.getsignal(s) for s in signals} == before


# ------------------------------------------------------------------------------ the reward
def _reward_kwargs(tok_dir: str, completions: list[str], kind: str = "single") -> dict:
    """The scorer's keyword lists for two prompts, each with two of ``completions``."""
    (first, second) = load_prompts(_source(tok_dir, env_args={"kind": kind}), "train").prompts[:2]
    metas = [first["meta"]] * 2 + [second["meta"]] * 2
    kwargs: dict[str, Any] = {
        "completions": completions,
        "prompts": [m["text"] for m in metas],
        "finish_reason": ["stop"] * 4,
    }
    for key in metas[0]:
        kwargs[key] = [m[key] for m in metas]
    return kwargs


def test_the_reward_is_the_environment_rubric_score(tok_dir) -> None:
    from stages.scorer.rewards import verifiers

    # right: 1 (correct); the question's words: 0.5 x their share; another word: 0
    kwargs = _reward_kwargs(tok_dir, ["w21", "w10 w11", "w29", "w11 w99"])
    assert verifiers(**kwargs) == [1.0, 0.5, 1.0, 0.25]
    assert verifiers(["w21"], prompts=["p"], finish_reason=["stop"]) == [None]  # other sources
    # a rubric with a group reward function scores each prompt's completions as one group
    grouped = _reward_kwargs(tok_dir, ["w21", "w21", "w99", "w99"], kind="group")
    assert verifiers(**grouped) == [2.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="scores single completions"):
        verifiers(**kwargs, trajectories=["x"] * 4, env_reward=[None] * 4)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [1, 0])
async def test_the_reward_runs_by_its_entry_point_in_a_worker_and_inline(tok_dir, workers):
    kwargs = _reward_kwargs(tok_dir, ["w21", "w10 w11", "w29", "w11 w99"])
    async with RewardRunner([("verifiers", 1.0)], workers=workers, timeout_s=60) as runner:
        scored = await runner.score(kwargs)
    assert [r for r, _ in scored] == [1.0, 0.5, 1.0, 0.25]
    broken = _reward_kwargs(tok_dir, ["w21"] * 4, kind="rubric_raises")
    async with RewardRunner([("verifiers", 1.0)], workers=workers, timeout_s=60) as runner:
        scored = await runner.score(broken)
        assert runner.counts["errors"] == 1
    # not the 0 verifiers would have scored silently: a failure, counted, with what it was
    assert all("broken: ZeroDivisionError: the rubric's own bug" in i["error"] for _, i in scored)


# ------------------------------------------------------------------ the agent, scripted model
class ScriptedEngine:
    """Answers each call with the next scripted text and <eos>, at version 3."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.inputs: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, input_ids: list[int], **sampling: Any) -> Generation:
        self.inputs.append(list(input_ids))
        ids = [*self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False), EOS_ID]
        self.outputs.append(ids)
        n = len(ids)
        return Generation(ids, np.linspace(-0.1, -2, n), [3] * n, "stop")


def _play(tok_dir, tokenizer, texts, kind="single", turns=2, meta=None, agents=None, **config):
    prompt = load_prompts(_source(tok_dir, env_args={"kind": kind, "turns": turns}), "train")
    message = prompt.prompts[0]
    if meta is not None:
        message = {**message, "meta": meta}
    scripted = ScriptedEngine(tokenizer, texts)
    ctx = RolloutContext(
        RolloutConfig(use="openai_agent", agent="verifiers", tokenizer=tok_dir, **config),
        tokenizer=tokenizer,
        sampling={"temperature": 1.0, "max_new_tokens": 16},
        group_id="g",
        agents=agents,
    )
    return scripted, ctx, message, openai_agent(message, scripted, ctx)


def _sampled(trajectory: Any) -> list[int]:
    return trajectory.completion_ids[trajectory.loss_mask == 1].tolist()


@pytest.mark.timeout(60)
async def test_a_single_turn_episode_gets_the_rubric_reward(tok_dir, tokenizer) -> None:
    scripted, _, message, episode = _play(tok_dir, tokenizer, ["w10 w21"])
    trajectory = await episode
    assert trajectory.reward == 1.0 * 0 + 0.5 * 0.5  # not right; one word of two is the question's
    assert trajectory.prompt_ids.tolist() == message["input_ids"]  # the feeder's own prompt
    assert _sampled(trajectory) == scripted.outputs[0]


@pytest.mark.timeout(60)
async def test_a_multi_turn_episode_trains_exactly_the_sampled_tokens(tok_dir, tokenizer) -> None:
    scripted, _, message, episode = _play(tok_dir, tokenizer, ["w5 w9", "w21"], kind="multi")
    trajectory = await episode
    assert trajectory.turns == 2 and trajectory.reward == 1.0  # the last answer is right
    assert _sampled(trajectory) == scripted.outputs[0] + scripted.outputs[1]
    # the second turn continued from the model's own tokens, then the environment's hint
    first = message["input_ids"] + scripted.outputs[0]
    second = scripted.inputs[1]
    assert second[: len(first)] == first
    assert tokenizer.decode(second[len(first) :]).split() == ["w5", *HINT.split(), "w3", "w6"]
    assert trajectory.context == second + scripted.outputs[1]
    assert trajectory.info == {"agent_calls": 2, "agent_calls_unjoined": 0}


@pytest.mark.timeout(60)
async def test_an_empty_answer_is_trained_with_the_rubric_score(tok_dir, tokenizer) -> None:
    # verifiers stops on it (EmptyModelResponseError): the model's doing, scored 0, trained
    _, _, _, episode = _play(tok_dir, tokenizer, [""])
    trajectory = await episode
    assert trajectory.reward == 0.0 and _sampled(trajectory) == [EOS_ID]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("env_raises", "the environment's own bug"),
        ("rubric_raises", "rubric failed: broken: ZeroDivisionError"),
        ("group", "group reward functions"),
    ],
)
async def test_a_failing_environment_loses_its_sample_counted(tok_dir, tokenizer, kind, message):
    _, ctx, _, episode = _play(tok_dir, tokenizer, ["w11", "w12", "w13"], kind=kind)
    with pytest.raises(AgentFailed, match=message) as failed:
        await episode
    assert failed.value.kind == "raised" and ctx.counters["agent_raised"] == 1


@pytest.mark.timeout(60)
async def test_a_prompt_of_another_source_is_refused(tok_dir, tokenizer) -> None:
    meta = {"text": "w10", "answer": "w21"}
    _, ctx, _, episode = _play(tok_dir, tokenizer, ["w21"], meta=meta)
    with pytest.raises(AgentFailed, match="names no verifiers environment"):
        await episode
    assert ctx.counters["agent_raised"] == 1


@pytest.mark.timeout(60)
async def test_an_episode_past_its_budget_keeps_what_it_sampled(tok_dir, tokenizer) -> None:
    # the environment wants three turns, the rollout allows two: the third call is refused
    texts = ["w5", "w6", "w7"]
    scripted, ctx, _, episode = _play(tok_dir, tokenizer, texts, kind="multi", turns=3, max_turns=2)
    trajectory = await episode
    assert trajectory.finish_reason == "max_turns" and trajectory.reward is None
    assert len(scripted.inputs) == 2 and ctx.counters["agent_max_turns"] == 1
    assert _sampled(trajectory) == scripted.outputs[0] + scripted.outputs[1]


@pytest.mark.timeout(120)
async def test_the_agent_plays_in_a_worker_process_too(tok_dir, tokenizer) -> None:
    """With agent_workers the environment is made in the worker, from the prompt's meta."""
    from stages.rollouts.openai_agent import agent_pool

    options = {"agent_workers": 1, "agent_timeout_s": 90.0}
    config = RolloutConfig(use="openai_agent", agent="verifiers", tokenizer=tok_dir, **options)
    pool = await agent_pool(config, log=None)
    try:
        texts = ["w5 w9", "w21"]
        scripted, _, _, episode = _play(
            tok_dir, tokenizer, texts, kind="multi", agents=pool, **options
        )
        trajectory = await episode
    finally:
        await pool.aclose()
    assert trajectory.reward == 1.0 and trajectory.turns == 2
    assert _sampled(trajectory) == scripted.outputs[0] + scripted.outputs[1]


# ------------------------------------------------------- end to end: the generator, a real engine
class RecordingProxy(Proxy):
    """The groups tests' engine proxy, keeping each /generate answer by its rid."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.answers: dict[str, dict[str, Any]] = {}

    async def _handle(self, request: web.Request) -> web.Response:
        response = await super()._handle(request)
        if request.path == "/generate" and response.status == 200:
            body = json.loads(response.body)
            for answer in body if isinstance(body, list) else [body]:
                self.answers[answer["meta_info"]["id"]] = answer
        return response


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_generator_episodes_train_the_tokens_the_engine_sampled(
    tmp_path, tok_dir, tokenizer, engine
) -> None:
    prompts = load_prompts(_source(tok_dir, env_args={"kind": "multi"}), "train").prompts[:2]
    for i, prompt in enumerate(prompts):
        prompt["uid"] = f"feeder.0:{i}"
    rollout = RolloutConfig(use="openai_agent", agent="verifiers", tokenizer=tok_dir)
    proxy = RecordingProxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], len(prompts), rollout=rollout, prompt_list=prompts)
    assert len(out.rollouts) == G * len(prompts) and out.done["dropped"] == 0
    by_id = {p["prompt_id"]: p for p in prompts}
    for r in out.rollouts:
        rid = f"{out.run_id}/{r['group_id']}/{r['sample_index']}"
        calls = [proxy.answers[f"{rid}/{n}"] for n in range(2)]
        assert r["rollout"]["agent_calls"] == 2 and f"{rid}/2" not in proxy.answers
        # bit for bit: the tokens trained are those the engine sampled, with its log-probs
        trained = r["loss_mask"] == 1
        assert r["completion_ids"][trained].tolist() == [t for c in calls for t in c["output_ids"]]
        logprobs = [e[0] for c in calls for e in c["meta_info"]["output_token_logprobs"]]
        assert np.allclose(r["sampler_logprobs"][trained], logprobs)
        assert len(calls[1]["output_ids"]) == NEW_TOKENS
        prompt = by_id[r["prompt_id"]]
        assert r["prompt_ids"].tolist() == prompt["input_ids"]
        hint = tokenizer.decode(r["completion_ids"][~trained].tolist())
        assert HINT in hint  # the environment's answer, inserted, not trained
        # the reward is the rubric's, of the model's last answer
        last = tokenizer.decode(calls[1]["output_ids"], skip_special_tokens=True).split()
        question = prompt["meta"]["verifiers"]["extra"]["question"].split()
        right = float(" ".join(last) == prompt["meta"]["answer"])
        overlap = sum(w in question for w in last) / len(last) if last else 0.0
        assert r["rollout"]["env_reward"] == pytest.approx(right + 0.5 * overlap)
