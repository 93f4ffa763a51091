"""``InflightGuessNumber-v0``: the guessing game as a Gymnasium environment on text plays by
``GuessNumber``'s rules through ``gymnasium.make``, as the environment rollout makes it."""

from __future__ import annotations

import pytest

gymnasium = pytest.importorskip("gymnasium")

import stages.rollouts.guess_gymnasium as guess  # noqa: E402  (registers the id)


def test_it_is_made_by_id_and_plays_by_the_games_rules():
    env = gymnasium.make(guess.ID, high=100, max_guesses=3, turn_penalty=0.1)
    observation, info = env.reset(seed=7, options={"prompt": {"meta": {"answer": "42"}}})
    assert observation == "" and info == {}
    assert env.step("50")[:4] == ("L", 0.0, False, False)
    assert env.step("30")[:4] == ("H", 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step("42")
    assert terminated and not truncated and reward == pytest.approx(0.8) and info["solved"]
    env.reset(seed=7, options={"prompt": {"meta": {"answer": "42"}}})
    _, reward, terminated, _, info = env.step("forty")
    assert terminated and reward == 0.0 and info["malformed"]


def test_a_prompt_without_an_answer_is_refused():
    env = gymnasium.make(guess.ID)
    with pytest.raises(ValueError, match="no integer answer"):
        env.reset(options={"prompt": {"prompt_id": "p1", "meta": {}}})
