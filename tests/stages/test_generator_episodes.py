"""Rollout plugins in the generator: episodes of several turns against a real built-in engine.

The generator stage runs in this process with the stand-in context of
``test_generator_groups.py`` (prompts from a list, groups into a list); the engine is a real
``inflight engine`` process behind the recording proxy. The rollouts are defined here and named
by dotted path, as a user names theirs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from stages.rollouts.api import RolloutConfig, RolloutContext, RolloutEngine
from stages.rollouts.trajectory import Trajectory
from tests.stages.test_generator_groups import NEW_TOKENS, G, Proxy, engine, generate, prompts

__all__ = ["engine"]  # the module-scoped engine fixture, shared with the groups tests

pytestmark = pytest.mark.slow

INSERTED = [5, 6, 7]  # what the "tool" inserts between the two turns


async def two_turns(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:
    """Sample, insert three tokens, sample again with a shorter limit."""
    trajectory = Trajectory(prompt["input_ids"])
    trajectory.sampled(await engine.generate(trajectory.context))
    trajectory.inserted(INSERTED)
    ctx.count("tool_calls")
    trajectory.sampled(await engine.generate(trajectory.context, max_new_tokens=2))
    trajectory.info["tag"] = ctx.options.get("tag", "")
    return trajectory


async def fails_for_sample_one(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:
    if ctx.sample_index == 1:
        raise KeyError("a bug in a rollout of one's own")
    return await two_turns(prompt, engine, ctx)


def _rollout(use: str, **options: Any) -> RolloutConfig:
    return RolloutConfig(use=f"tests.stages.test_generator_episodes:{use}", options=options)


@pytest.mark.timeout(90)
async def test_episodes_of_two_turns_carry_their_mask_versions_and_turns(tmp_path, engine):
    count = 4
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count, rollout=_rollout("two_turns", tag="x"))
    assert len(out.groups) == count and len(out.rollouts) == G * count
    assert sorted(out.acked) == sorted(f"p{i}" for i in range(count))
    # two requests per sample, never batched: the second continues the first
    assert len(proxy.forwarded) == 2 * G * count == out.done["requests"]
    bodies = {b["rid"]: b for b in proxy.forwarded}
    by_prompt = {p["prompt_id"]: p for p in prompts(count)}
    for r in out.rollouts:
        n = len(r["completion_ids"])
        assert n == NEW_TOKENS + len(INSERTED) + 2
        assert r["loss_mask"].dtype == np.uint8
        assert r["loss_mask"].tolist() == [1] * NEW_TOKENS + [0, 0, 0] + [1, 1]
        inserted = slice(NEW_TOKENS, NEW_TOKENS + 3)
        assert r["completion_ids"][inserted].tolist() == INSERTED
        assert r["versions"][inserted].tolist() == [-1, -1, -1]
        assert r["sampler_logprobs"][inserted].tolist() == [0.0, 0.0, 0.0]
        assert (r["sampler_logprobs"][r["loss_mask"] == 1] < 0).all()
        assert (r["versions"][r["loss_mask"] == 1] == 0).all()
        assert r["rollout"]["turns"] == 2 and r["rollout"]["tag"] == "x"
        assert r["rollout"]["sampled_tokens"] == NEW_TOKENS + 2
        assert r["rollout"]["inserted_tokens"] == 3 and r["rollout"]["env_reward"] is None
        # the engine saw the first turn's input, then everything so far
        rid = f"{out.run_id}/{r['group_id']}/{r['sample_index']}"
        first, second = bodies[f"{rid}/0"], bodies[f"{rid}/1"]
        prompt_ids = by_prompt[r["prompt_id"]]["input_ids"]
        assert first["input_ids"] == prompt_ids
        assert second["input_ids"] == prompt_ids + r["completion_ids"][: NEW_TOKENS + 3].tolist()
        assert second["sampling_params"]["max_new_tokens"] == 2
        assert first["sampling_params"]["max_new_tokens"] == NEW_TOKENS
    # every episode started from the group's prompt: no sample carries its own
    assert not any("prompt_ids" in s for g in out.groups for s in g["samples"])
    (last,) = out.metrics[-1:]
    assert last["rollout_episodes"] == G * count and last["rollout_turns"] == 2 * G * count
    assert last["rollout_tool_calls"] == G * count
    assert out.done["dropped"] == 0 and out.ledger == []  # nothing dropped: no fates here
    json.dumps(last)  # metrics stay plain


@pytest.mark.timeout(90)
async def test_with_hold_kv_an_episode_is_a_session_closed_at_its_end(tmp_path, engine):
    """``rollout.hold_kv``: every turn of an episode names it as its session (SGLang's
    ``session_id``), and the session is closed on its engine once the episode ends."""
    count = 2
    proxy = Proxy(engine)
    rollout = _rollout("two_turns")
    rollout.hold_kv = True
    async with proxy as url:
        out = await generate(tmp_path, [url], count, rollout=rollout)
    assert len(out.rollouts) == G * count and out.done["session_close_failures"] == 0
    episodes = {b["rid"].rsplit("/", 1)[0] for b in proxy.forwarded}
    assert len(episodes) == G * count
    for body in proxy.forwarded:  # each turn: its episode's session
        assert body["session_id"] == body["rid"].rsplit("/", 1)[0]
    # many episodes' closes to a request (stages.generator.session_closer)
    batches = [json.loads(raw)["session_ids"] for path, raw in proxy.others
               if path == "/close_sessions"]  # fmt: skip
    assert sorted(s for batch in batches for s in batch) == sorted(episodes)
    assert len(batches) < len(episodes)


@pytest.mark.timeout(90)
async def test_a_rollout_that_raises_drops_its_sample_only(tmp_path, engine):
    count = 3
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], count, rollout=_rollout("fails_for_sample_one"))
    assert len(out.groups) == count
    for group in out.groups:
        assert [s["sample_index"] for s in group["samples"]] == [i for i in range(G) if i != 1]
    assert out.done["dropped"] == count
    fates = [(f["fates"], f["reason"]) for f in out.ledger]
    assert sorted(row[0][2] for row, reason in fates if reason == "rollout_error") == [1] * count
    failed = out.named("rollout_failed")
    assert failed and "KeyError" in failed[0]["error"]  # logged (sparsely), with what it was
    assert sorted(out.acked) == sorted(f"p{i}" for i in range(count))


@pytest.mark.timeout(90)
async def test_a_failed_turn_is_sent_again_and_the_episode_goes_on(tmp_path, engine):
    count = 2
    failed: list[str] = []

    def fail_second_turns_once(body: dict[str, Any]) -> tuple[int, str] | None:
        rid = body["rid"]
        if rid.endswith("/1") and len(failed) < 3:
            failed.append(rid)
            return 503, "overloaded"
        return None

    async with Proxy(engine, fail_second_turns_once) as url:
        out = await generate(tmp_path, [url], count, rollout=_rollout("two_turns"))
    assert len(failed) == 3 and out.done["retried"] == 3
    assert len(out.rollouts) == G * count and out.done["dropped"] == 0
    assert all(r["rollout"]["turns"] == 2 for r in out.rollouts)


# ------------------------------------------------------------------------------ environments
class CountDown:
    """A test environment: ``steps`` steps, each observation ``w9 w10``, reward 0.5 a step.

    ``raise_at`` / ``hang_at``: the step (1-based) that raises / never answers.
    """

    def __init__(self, steps: int = 3, raise_at: int = 0, hang_at: int = 0) -> None:
        self.steps, self.raise_at, self.hang_at = steps, raise_at, hang_at
        self.n = 0

    def reset(self, prompt: Mapping[str, Any]) -> str:
        assert prompt["meta"]["i"] >= 0  # the feeder's prompt, meta included
        return "w3 w4"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.n += 1
        # the model's turn, decoded (a special token it may sample decodes to nothing)
        assert isinstance(action, str) and all(w.startswith("w") for w in action.split())
        if self.n == self.raise_at:
            raise ValueError("the environment's own bug")
        if self.n == self.hang_at:
            import time

            time.sleep(600)
        return "w9 w10", 0.5, self.n >= self.steps


def _env_rollout(tmp_path, **env_options: Any) -> RolloutConfig:
    from tests.stages.tiny_model import _tokenizer

    folder = tmp_path / "tokenizer"
    if not folder.exists():
        _tokenizer(128).save_pretrained(folder)
    own = ("max_turns", "env_timeout_s", "max_tokens")
    options = {k: v for k, v in env_options.items() if k not in own}
    return RolloutConfig(
        use="environment",
        environment="tests.stages.test_generator_episodes:CountDown",
        env_options=options,
        tokenizer=str(folder),
        max_turns=env_options.get("max_turns", 8),
        max_tokens=env_options.get("max_tokens", 0),
        env_timeout_s=env_options.get("env_timeout_s", 30.0),
    )


@pytest.mark.timeout(90)
async def test_an_environment_episode_inserts_its_observations_and_sums_its_rewards(
    tmp_path, engine
):
    count = 2
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], count, rollout=_env_rollout(tmp_path))
    assert len(out.rollouts) == G * count and out.done["dropped"] == 0
    n = NEW_TOKENS
    for r in out.rollouts:
        # reset's observation, then three turns with an observation between them
        assert r["loss_mask"].tolist() == [0, 0] + [1] * n + [0, 0] + [1] * n + [0, 0] + [1] * n
        assert r["completion_ids"][:2].tolist() == [3, 4]
        assert r["completion_ids"][2 + n : 4 + n].tolist() == [9, 10]
        assert r["finish_reason"] == "done" and r["rollout"]["env_reward"] == 1.5
        assert r["rollout"]["turns"] == 3 and r["rollout"]["env_steps"] == 3
    last = out.metrics[-1]
    assert last["rollout_env_calls"] >= G * count * 4  # reset, three steps (and the closes)


@pytest.mark.timeout(90)
async def test_max_turns_ends_an_episode_the_environment_would_go_on_with(tmp_path, engine):
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], 1, rollout=_env_rollout(tmp_path, max_turns=2))
    assert {r["finish_reason"] for r in out.rollouts} == {"max_turns"}
    assert {r["rollout"]["turns"] for r in out.rollouts} == {2}
    assert out.metrics[-1]["rollout_episodes_max_turns"] == G


@pytest.mark.timeout(90)
async def test_an_episode_over_its_token_budget_ends_truncated(tmp_path, engine):
    n = NEW_TOKENS
    budget = 2 + n + 2 + 1  # reset's observation, a turn, an observation, one token more
    rollout = _env_rollout(tmp_path, max_tokens=budget)
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], 1, rollout=rollout)
    for r in out.rollouts:
        # the last turn got the one token left; the observation after it did not fit
        assert r["loss_mask"].tolist() == [0, 0] + [1] * n + [0, 0] + [1]
        assert r["finish_reason"] == "max_tokens" and r["rollout"]["truncated"] is True
        assert r["rollout"]["env_reward"] == 1.0  # both steps were taken
    assert out.metrics[-1]["rollout_episodes_truncated"] == G


@pytest.mark.timeout(90)
async def test_an_environment_that_raises_ends_its_episodes_and_the_run_goes_on(tmp_path, engine):
    count = 2
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], count, rollout=_env_rollout(tmp_path, raise_at=2))
    assert len(out.rollouts) == G * count  # kept: they had sampled before the failure
    for r in out.rollouts:
        assert r["finish_reason"] == "env_error" and r["rollout"]["env_error"] == "raised"
        assert r["rollout"]["turns"] == 2 and r["loss_mask"].tolist()[-1] == 1
    assert out.metrics[-1]["rollout_env_errors_raised"] == G * count
    failed = out.named("env_failed")
    assert failed and "the environment's own bug" in failed[0]["error"]


@pytest.mark.timeout(120)
async def test_an_environment_that_hangs_is_killed_and_its_worker_replaced(tmp_path, engine):
    count = 2
    rollout = _env_rollout(tmp_path, hang_at=1, env_timeout_s=1.0)
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], count, rollout=rollout)
    # every episode ended (timed out, or lost with the worker another one hung), none hung on
    assert len(out.rollouts) == G * count
    assert {r["finish_reason"] for r in out.rollouts} == {"env_error"}
    kinds = {r["rollout"]["env_error"] for r in out.rollouts}
    assert "timeout" in kinds and kinds <= {"timeout", "lost"}
    last = out.metrics[-1]
    assert last["rollout_env_workers_replaced"] >= 1
    assert last["rollout_env_errors_timeout"] >= 1


async def two_completions(client: Any, task: Mapping[str, Any]) -> float:
    """An openai agent: a completion, three tokens of its own, another completion."""
    first = await client.completions.create(
        model="policy", prompt=task["prompt_ids"], max_tokens=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids = first.choices[0].model_extra["token_ids"]
    await client.completions.create(model="policy", prompt=task["prompt_ids"] + ids + INSERTED)
    return 0.25


def _agent_rollout(tmp_path, agent: str) -> RolloutConfig:
    """An ``openai_agent`` rollout of ``agent`` (defined here) on the engine's tokenizer."""
    from tests.stages.tiny_model import _tokenizer

    folder = tmp_path / "tokenizer"
    _tokenizer(128).save_pretrained(folder)
    return RolloutConfig(
        use="openai_agent",
        agent=f"tests.stages.test_generator_episodes:{agent}",
        tokenizer=str(folder),
    )


@pytest.mark.timeout(90)
async def test_an_openai_agent_trains_the_tokens_the_engine_sampled(tmp_path, engine):
    rollout = _agent_rollout(tmp_path, "two_completions")
    count = 2
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count, rollout=rollout)
    assert len(out.rollouts) == G * count and out.done["dropped"] == 0
    bodies = {b["rid"]: b for b in proxy.forwarded}
    by_prompt = {p["prompt_id"]: p for p in prompts(count)}
    for r in out.rollouts:
        assert r["loss_mask"].tolist() == [1] * 3 + [0, 0, 0] + [1] * NEW_TOKENS
        assert r["rollout"]["env_reward"] == 0.25 and r["rollout"]["agent_calls"] == 2
        rid = f"{out.run_id}/{r['group_id']}/{r['sample_index']}"
        first, second = bodies[f"{rid}/0"], bodies[f"{rid}/1"]
        prompt_ids = by_prompt[r["prompt_id"]]["input_ids"]
        assert first["input_ids"] == prompt_ids
        # the second call's prompt is the first's, the tokens the engine sampled, the agent's
        assert second["input_ids"] == prompt_ids + r["completion_ids"][:6].tolist()
        assert r["completion_ids"][3:6].tolist() == INSERTED
        assert first["sampling_params"]["max_new_tokens"] == 3  # the agent's, under the run's
        assert second["sampling_params"]["max_new_tokens"] == NEW_TOKENS
    assert out.metrics[-1]["rollout_episodes"] == G * count


async def json_then_plain(client: Any, task: Mapping[str, Any]) -> float:
    """An openai agent that asks for JSON, which this engine's word-level tokenizer cannot be
    constrained to (a 400 from the engine), then asks without."""
    import openai

    try:
        await client.completions.create(
            model="policy", prompt=task["prompt_ids"], max_tokens=3,
            extra_body={"response_format": {"type": "json_object"}},
        )  # fmt: skip
    except openai.BadRequestError as exc:
        assert "cannot constrain" in exc.body["message"], exc.body
        await client.completions.create(model="policy", prompt=task["prompt_ids"], max_tokens=3)
        return 0.5
    return -1.0


@pytest.mark.timeout(90)
async def test_an_engine_s_400_is_the_agent_s_and_neither_retried_nor_dropped(tmp_path, engine):
    rollout = _agent_rollout(tmp_path, "json_then_plain")
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], 1, rollout=rollout)
    assert len(out.rollouts) == G and out.done["dropped"] == 0 and out.done["retried"] == 0
    assert all(r["rollout"]["env_reward"] == 0.5 for r in out.rollouts)
    refused = [b for b in proxy.forwarded if "json_schema" in b["sampling_params"]]
    assert len(refused) == G  # each asked once, none sent again


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["FindWord", "InflightFindWord-v0"])
async def test_a_gymnasium_env_on_text_plays_as_an_environment(tmp_path, engine, name):
    """A gymnasium.Env, by class or by registered id: seeded by the prompt (a group plays one
    task), five-tuple steps, ``terminated`` ending the episode."""
    from tests.stages.tiny_model import _tokenizer

    folder = tmp_path / "tokenizer"
    _tokenizer(128).save_pretrained(folder)
    rollout = RolloutConfig(
        use="environment", environment=f"tests.stages.gym_text_envs:{name}", tokenizer=str(folder)
    )
    count = 3
    async with Proxy(engine) as url:
        out = await generate(tmp_path, [url], count, rollout=rollout)
    assert len(out.rollouts) == G * count and out.done["dropped"] == 0
    n = NEW_TOKENS
    words: dict[str, set[int]] = {}
    for r in out.rollouts:
        assert r["loss_mask"].tolist() == [0] + [1] * n + [0, 0] + [1] * n
        word = r["rollout"]["word"]
        assert r["completion_ids"][0] == word  # the reset's observation, the seeded word
        assert r["finish_reason"] == "done" and r["rollout"]["env_steps"] == 2
        assert r["rollout"]["prompt_id"] == r["prompt_id"]  # reset's options carry the prompt
        words.setdefault(r["prompt_id"], set()).add(word)
    assert all(len(w) == 1 for w in words.values())  # one task per prompt


def test_an_unknown_gymnasium_id_is_a_config_error():
    from pipeline.registry import PluginError

    with pytest.raises(PluginError, match="not a registered Gymnasium id"):
        RolloutConfig(use="environment", environment="tests.stages.gym_text_envs:NoSuch-v0")
