"""What running rollouts needs, made once per process: the function, tokenizer, tools, environments.

``RolloutRuntime.start(config, ...)`` resolves the rollout, loads the tokenizer
(``rollout.tokenizer``, else the model the engines serve when the caller knows it; tools and
environments need one, a rollout of your own gets None without either), starts the tool workers
when tools are configured and the environment workers when an environment is; ``context(...)``
makes the
per-episode :class:`~stages.rollouts.api.RolloutContext`; ``aclose()`` stops the workers. The
generator keeps one for its episodes and the learner's evaluation one for its held-out episodes,
so both run the very same rollout.

Not here: engines (the caller hands each episode its ``RolloutEngine``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

from stages.light_tokenizer import LightTokenizer, load_tokenizer
from stages.rollouts.api import Rollout, RolloutConfig, RolloutContext, resolve_rollout

__all__ = ["RolloutRuntime"]


class RolloutRuntime:
    def __init__(self, config: RolloutConfig, rollout: Rollout, log: Any) -> None:
        self.config, self.rollout, self.log = config, rollout, log
        self.tokenizer: Any = None
        self.tools: Any = None  # stages.rollouts.tools.ToolBox
        self.env: Any = None  # stages.rollouts.environments.EnvPool
        self.agents: Any = None  # stages.workers.FunctionPool (openai_agent with agent_workers)
        self.counters: Counter[str] = Counter()

    @classmethod
    async def start(
        cls, config: RolloutConfig, *, log: Any, default_tokenizer: str = ""
    ) -> RolloutRuntime:
        """Everything ``config`` asks for, started; ``default_tokenizer`` is the model the
        engines serve when the caller knows it (``rollout.tokenizer`` wins)."""
        runtime = cls(config, resolve_rollout(config.use), log)
        name = config.tokenizer or default_tokenizer
        try:
            if name or config.tools or config.environment:
                runtime.tokenizer = _load_tokenizer(name)
                if isinstance(runtime.tokenizer, LightTokenizer) and not config.single_turn:
                    # chats and tools are rendered by transformers: loaded now, not at the
                    # first episode (a few seconds the event loop would stand still mid-run)
                    runtime.tokenizer.full  # noqa: B018
            if config.tools:
                from stages.rollouts.tools import ToolBox

                runtime.tools = await ToolBox.start(config, runtime.tokenizer, log)
            if config.environment:
                from stages.rollouts.environments import EnvPool

                runtime.env = await EnvPool.start(config, log)
            if config.use == "openai_agent" and config.agent_workers:
                from stages.rollouts.openai_agent import agent_pool

                runtime.agents = await agent_pool(config, log)
        except BaseException:
            await runtime.aclose()
            raise
        return runtime

    def context(
        self,
        *,
        sampling: Mapping[str, Any],
        sample_index: int = 0,
        group_id: str = "",
        log: Any = None,
    ) -> RolloutContext:
        return RolloutContext(
            self.config,
            tokenizer=self.tokenizer,
            tools=self.tools,
            env=self.env,
            agents=self.agents,
            sampling=sampling,
            counters=self.counters,
            log=log if log is not None else self.log,
            sample_index=sample_index,
            group_id=group_id,
        )

    def stats(self) -> dict[str, int]:
        """Counters for metrics: the rollouts' own (``ctx.count``), the tools' and the
        environments' (``rollout_`` prefixed by the caller)."""
        out = dict(self.counters)
        for part in (self.tools, self.env):
            if part is not None:
                out.update(part.stats())
        return out

    def close_soon(self) -> None:
        """The episodes are about to be cancelled (the stage is closing): what that cuts short
        is not a failure of the tools or environments."""
        for part in (self.tools, self.env):
            if part is not None and hasattr(part, "close_soon"):
                part.close_soon()

    async def aclose(self) -> None:
        for part in (self.tools, self.env, self.agents):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.aclose()


def _load_tokenizer(name: str) -> Any:
    if not name:
        raise ValueError(
            "tools and environments read and write text: set rollout.tokenizer (the model "
            "folder whose tokenizer the engines use)"
        )
    from stages.hub import resolve_model

    path = resolve_model(name, what="tokenizer", needs="tokenizer")
    return load_tokenizer(path)  # transformers for a chat template, when one is rendered
