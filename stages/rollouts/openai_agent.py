"""The ``openai_agent`` rollout: train an agent written for the ``openai`` client, unmodified.

``rollout: {use: openai_agent, agent: my_pkg.agents:solve}``: the agent is

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float | None

``client``'s base URL is the episode's on the process's agent proxy (``agent_proxy``): whatever
the agent sends to ``/v1/completions`` or ``/v1/chat/completions`` is sampled from the policy by
the run's engines and recorded as exact tokens. ``task`` is the prompt as the feeder made it:
every key of its ``meta`` (``answer``...), ``prompt`` (the text the model sees), ``messages``
(the conversation, when a chat template made the prompt), ``prompt_ids`` and ``prompt_id``.
The agent's return value is the trajectory's reward (``env_reward`` passes it on); ``None``
leaves it to the scorer's other reward functions (``exact_match`` on the final answer...).

An agent that raises, runs past ``agent_timeout_s``, returns something that is not a number or
``None``, or never calls the model loses its sample: the rollout raises ``AgentFailed``, which
the generator drops and counts (``rollout_error``; the kind in ``rollout_agent_*``) and the run
goes on. An agent that raises after its episode's budget (``max_turns`` calls, ``max_tokens``
tokens) was spent keeps what it sampled, with no reward of its own. By default agents run in the
event loop of the process that plays the episode: they must be ``async`` and must not block it
(their calls are answered in the process). With ``agent_workers: N`` they run in N worker
processes (``stages.workers``): any agent, a blocking one included (``def solve(client, task)``
gets an ``openai.OpenAI``), over HTTP to the proxy; one past ``agent_timeout_s`` has its worker
killed and replaced, and an agent that kills its interpreter loses its sample (``lost``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

from stages.rollouts.agent_proxy import AgentProxy, Episode, context_length_of
from stages.rollouts.api import RolloutContext, RolloutEngine
from stages.rollouts.trajectory import Trajectory

__all__ = ["AgentFailed", "openai_agent", "resolve_agent"]


class AgentFailed(Exception):
    """An agent that lost its sample: ``kind`` is ``raised``, ``timeout``, ``no_calls`` or
    ``bad_reward``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@functools.lru_cache(maxsize=64)
def resolve_agent(name: str, *, in_loop: bool = True) -> Any:
    """The agent function ``name`` names (an entry point of ``inflight.agents`` or a dotted
    path); PluginError if there is none, ValueError if it cannot run where asked (on the event
    loop: only an ``async def``)."""
    from pipeline.registry import resolve

    agent = resolve("agent", name)
    if not callable(agent):
        raise ValueError(f"agent {name!r} resolved to {agent!r}, which is not callable")
    if in_loop and not inspect.iscoroutinefunction(agent):
        raise ValueError(
            f"agent {name!r} must be an async function: async def solve(client, task) -> "
            "float | None (or set rollout.agent_workers to run blocking agents in processes)"
        )
    return agent


async def agent_pool(config: Any, log: Any) -> Any:
    """The worker processes of ``rollout.agent_workers`` (started)."""
    from stages.workers import FunctionPool

    pool = FunctionPool(
        "agent",
        [config.agent],
        workers=config.agent_workers,
        timeout_s=config.agent_timeout_s,
        adapter=run_agent,
        label="agent",
        log=log,
    )
    await pool.start()
    return pool


def run_agent(agent: Any, request: Mapping[str, Any]) -> Any:
    """In an agent worker: ``agent(client, task)`` with a client of the episode's base URL
    (``openai.AsyncOpenAI`` for an ``async def``, else ``openai.OpenAI``), over HTTP."""
    import openai

    url, task = request["base_url"], request["task"]
    if inspect.iscoroutinefunction(agent):

        async def play() -> Any:
            async with openai.AsyncOpenAI(base_url=url, api_key="inflight", max_retries=0) as c:
                return await agent(c, task)

        return asyncio.run(play())
    with openai.OpenAI(base_url=url, api_key="inflight", max_retries=0) as client:
        return agent(client, task)


def task_of(prompt: Mapping[str, Any]) -> dict[str, Any]:
    """What the agent is given of the feeder's prompt."""
    meta = dict(prompt.get("meta") or {})
    task = {**meta, "prompt_ids": [int(t) for t in prompt["input_ids"]]}
    task["prompt_id"] = prompt.get("prompt_id")
    task["prompt"] = meta.get("text")
    if "messages" in meta:
        task["messages"] = meta["messages"]
    return task


async def openai_agent(
    prompt: Mapping[str, Any], engine: RolloutEngine, ctx: RolloutContext
) -> Trajectory:

    config = ctx.config
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise RuntimeError("openai_agent needs a tokenizer: set rollout.tokenizer")
    chat, context_length = _served(tokenizer, config.reasoning_parser, config.tool_call_parser)
    episode = Episode(
        engine,
        tokenizer,
        sampling=ctx.sampling,
        max_calls=config.max_turns,
        max_tokens=config.max_tokens,
        context_length=context_length,
        chat=chat,
        counters=ctx.counters,
        name=f"{ctx.group_id}/{ctx.sample_index}",
    )
    proxy = await AgentProxy.shared()
    url = proxy.open(episode)
    try:
        if ctx.agents is not None:
            reward = await _in_worker(ctx, episode, url, task_of(prompt))
        else:
            reward = await _in_loop(ctx, episode, proxy, url, task_of(prompt))
    finally:
        proxy.close(url)  # the client's connections are the proxy's, kept for other episodes
    trajectory = episode.trajectory
    if trajectory is None:
        _failed(ctx, "no_calls", "the agent never called the model")
    if reward is not None and (
        isinstance(reward, bool)
        or not isinstance(reward, int | float)
        or not math.isfinite(float(reward))
    ):
        _failed(ctx, "bad_reward", f"the agent returned {reward!r}, not a number or None")
    trajectory.reward = None if reward is None else float(reward)
    trajectory.finish_reason = episode.finish_reason
    trajectory.info = {"agent_calls": episode.calls, "agent_calls_unjoined": episode.unjoined}
    return trajectory


async def _in_loop(
    ctx: RolloutContext, episode: Episode, proxy: AgentProxy, url: str, task: dict[str, Any]
) -> Any:
    import openai

    config = ctx.config
    agent = resolve_agent(config.agent)
    client = openai.AsyncOpenAI(
        base_url=url,
        api_key="inflight",
        max_retries=0,
        timeout=config.agent_timeout_s,
        http_client=proxy.http_client(),
    )
    try:
        return await asyncio.wait_for(agent(client, task), config.agent_timeout_s)
    except TimeoutError:
        _failed(ctx, "timeout", f"the agent ran past agent_timeout_s ({config.agent_timeout_s} s)")
    except Exception as exc:
        if not (episode.budget_spent and episode.trajectory is not None):
            _failed(ctx, "raised", f"the agent raised {type(exc).__name__}: {exc}", exc)
        return None  # cut short by its budget: what it sampled is trained


async def _in_worker(ctx: RolloutContext, episode: Episode, url: str, task: dict[str, Any]) -> Any:
    """The agent in a worker process, over HTTP; killed past ``agent_timeout_s``."""
    reply = await ctx.agents.call(ctx.config.agent, {"base_url": url, "task": task})
    if reply.ok:
        return reply.value
    if reply.status == "timeout":
        _failed(ctx, "timeout", f"the agent ran past agent_timeout_s ({reply.error})")
    if reply.status == "lost":
        _failed(ctx, "lost", f"the agent's worker died: {reply.error}")
    if not (episode.budget_spent and episode.trajectory is not None):
        _failed(ctx, "raised", f"the agent raised {reply.error}")
    return None


def _failed(ctx: RolloutContext, kind: str, message: str, cause: Any = None) -> None:
    ctx.count(f"agent_{kind}")
    raise AgentFailed(kind, message) from cause


_SERVED: dict[tuple[int, str, str], tuple[Any, Any, int]] = {}


def _served(
    tokenizer: Any, reasoning_parser: str = "", tool_call_parser: str = ""
) -> tuple[Any, int]:
    """The chat settings (with the rollout's parsers) and context length of the model
    ``tokenizer`` is of (read once)."""
    key = (id(tokenizer), reasoning_parser, tool_call_parser)
    known = _SERVED.get(key)
    if known is None or known[0] is not tokenizer:
        from pathlib import Path

        from stages.engine.openai_chat import ChatSettings

        folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
        known = _SERVED[key] = (
            tokenizer,
            ChatSettings.of(
                tokenizer,
                folder,
                # '': the one the chat template needs, found as --tool-call-parser auto finds it
                tool_call_parser=tool_call_parser or "auto",
                reasoning_parser=reasoning_parser or None,
            ),
            context_length_of(tokenizer),
        )
    return known[1], known[2]
