"""The number-guessing game of ``configs/guess.yaml`` as a Gymnasium environment on text,
registered as ``InflightGuessNumber-v0``: what a user who has a ``gymnasium.Env`` writes, and how
it trains unchanged (``rollout: {use: environment, environment:
stages.rollouts.guess_gymnasium:InflightGuessNumber-v0}``).

``reset(seed=..., options={"prompt": prompt})`` reads the secret from the prompt's
``meta["answer"]`` (the environment rollout passes the prompt there); each action is one guess
and the observation ``H`` or ``L`` says where the secret lies; ``terminated`` when a guess is
right, after ``max_guesses`` or at a turn that is not a number. The rules and rewards are
``GuessNumber``'s (``stages.rollouts.examples``), which this class plays.
"""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium import spaces

from stages.rollouts.examples import GuessNumber

__all__ = ["GuessNumberEnv"]

ID = "InflightGuessNumber-v0"


class GuessNumberEnv(gymnasium.Env):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, high: int = 100, max_guesses: int = 7, turn_penalty: float = 0.05) -> None:
        self.game = GuessNumber(high, max_guesses, turn_penalty)
        self.observation_space = spaces.Text(max_length=8, min_length=0, charset="HL")
        self.action_space = spaces.Text(max_length=64)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        prompt = (options or {}).get("prompt") or {}
        return self.game.reset(prompt), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        observation, reward, done, info = self.game.step(action)
        return observation, reward, done, False, info


if ID not in gymnasium.registry:
    gymnasium.register(id=ID, entry_point=f"{__name__}:GuessNumberEnv")
