"""A Gymnasium environment on text, for the tests: registered as ``InflightFindWord-v0``.

The tiny test models' words are ``w0``..``w127``: ``reset`` shows a word picked by the seed,
each of two steps rewards an action that repeats it, then the episode terminates.
"""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium import spaces

__all__ = ["FindWord"]


class FindWord(gymnasium.Env):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.observation_space = spaces.Text(max_length=64, charset="w0123456789 ")
        self.action_space = spaces.Text(max_length=512)
        self.word = ""
        self.n = 0
        self.prompt_id: str | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.word = f"w{int(self.np_random.integers(3, 9))}"
        self.n = 0
        self.prompt_id = (options or {}).get("prompt", {}).get("prompt_id")
        return self.word, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.n += 1
        reward = float(self.word in action.split())
        info = {"word": int(self.word[1:]), "prompt_id": self.prompt_id}
        return "w9 w10", reward, self.n >= self.steps, False, info


gymnasium.register(id="InflightFindWord-v0", entry_point=f"{__name__}:FindWord")
