"""The rollout plugin interface: what a rollout is given, and how it is configured and found.

A rollout turns one prompt into one trajectory::

    async def rollout(prompt: dict, engine: RolloutEngine, ctx: RolloutContext) -> Trajectory

``prompt`` is the feeder's message (``prompt_id``, ``input_ids``, ``meta``); ``engine.generate``
samples from token ids and returns a :class:`~stages.rollouts.trajectory.Generation` (tokens,
sampler log-probs, the policy version of every token); ``ctx`` holds the run's options for
rollouts (``RolloutConfig``), the tokenizer, the tools and environment runners when configured,
and counters that reach the generator's metrics. The generator runs ``group_size`` episodes per
prompt at once and sends them on as one group, exactly as it does single completions: in-flight
updates, per-token versions, TIS, staleness, flow control and restarts are the same for both.

Rollouts are found like stages and rewards: by an entry point of the group ``inflight.rollouts``
(``single_turn``, ``tools``, ``environment``, ``openai_agent`` are built in) or by a dotted path
``package.module:function``. Tools (``inflight.tools``) are plain Python functions with type hints
and a docstring (TRL's convention); environments (``inflight.environments``) are classes with
``reset(prompt) -> observation`` and ``step(action) -> (observation, reward, done)`` (async or
not).

Not here: the engine handle itself (the generator's ``episodes.py``, the evaluator's), tools and
environments (``tools.py``, ``environments.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pipeline.registry import PluginError, resolve
from stages.hub import tokenizer_check
from stages.rollouts.trajectory import Generation, Trajectory

__all__ = [
    "EngineUnavailable",
    "EnvError",
    "RequestRefused",
    "Rollout",
    "RolloutConfig",
    "RolloutContext",
    "RolloutEngine",
    "resolve_rollout",
]


class EngineUnavailable(Exception):
    """No engine could serve a turn (after the generator's retries): the episode is dropped,
    counted as an engine failure, like a single completion that could not be served."""


class RequestRefused(EngineUnavailable, ValueError):
    """An engine refused the turn's request itself (HTTP 400: a grammar it cannot compile,
    a field it does not take): another engine would too. A rollout that does not catch it
    loses its episode as ``EngineUnavailable`` does; the agent proxy answers the agent's call
    with the 400 instead, and the agent goes on."""


class RolloutEngine(Protocol):
    """Samples for a rollout. ``sampling`` overrides the run's sampling parameters for this call
    (``max_new_tokens``, ``stop_token_ids``, ``temperature``... SGLang's names); it may also
    carry ``require_reasoning`` (SGLang's request field: a grammar among the parameters applies
    after the answer's reasoning ends) and ``max_thinking_tokens`` (a thinking budget), which go
    to the request itself."""

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation: ...


class EnvError(Exception):
    """An environment's reset or step failed: ``kind`` is ``raised``, ``timeout``, ``lost`` (its
    worker died or was replaced) or ``bad_step`` (it returned something that is not
    ``(observation, reward, done[, info])``). The episode ends; the generator counts it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Rollout = Callable[[Mapping[str, Any], RolloutEngine, "RolloutContext"], Awaitable[Trajectory]]


@dataclass
class RolloutConfig:
    """How the generator (and the held-out evaluation) turns a prompt into a trajectory."""

    use: str = field(
        default="single_turn",
        metadata={
            "doc": "rollout: single_turn (one completion), tools (tool calls), environment "
            "(a multi-turn environment), openai_agent (an agent written for the openai "
            "client), an entry point of inflight.rollouts, or package.module:function"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "doc": "model folder or Hub id whose tokenizer reads and writes turns (default: "
            "the model the generator launches)",
            "path": "model",
            "check": tokenizer_check,
        },
    )
    hold_kv: bool = field(
        default=False,
        metadata={
            "doc": "each episode is a session of its engine (SGLang's session_id, closed when "
            "the episode ends): an engine started with --enable-session-radix-cache keeps the "
            "episode's KV in its prefix cache between turns (tool calls, environment steps) "
            "whatever else it serves meanwhile; the built-in engines the generator launches get "
            "the flag, SGLang ones need it in launch.extra_args"
        },
    )
    max_turns: int = field(
        default=8, metadata={"min": 1, "doc": "engine calls (model turns) per episode"}
    )
    max_tokens: int = field(
        default=0,
        metadata={
            "min": 0,
            "doc": "tokens after the prompt (sampled and inserted) per episode; 0: no bound "
            "but max_turns x max_new_tokens and the tools' output bound",
        },
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={"doc": "tools: entry points of inflight.tools or package.module:function"},
    )
    tool_format: Literal["auto", "chat_template", "tags"] = field(
        default="auto",
        metadata={
            "doc": "how tools are offered and calls written: the tokenizer's chat template "
            "(auto, when it has one that takes tools) or Inflight's tags "
            "(<tool_call>name(args)</tool_call>)"
        },
    )
    tool_timeout_s: float = field(
        default=10.0, metadata={"min": 0.01, "doc": "limit for one tool call"}
    )
    tool_workers: int = field(default=1, metadata={"min": 1, "doc": "tool worker processes"})
    max_tool_output_chars: int = field(
        default=2000, metadata={"min": 1, "doc": "longer tool answers are cut (and say so)"}
    )
    environment: str = field(
        default="",
        metadata={
            "doc": "rollout environment: an entry point of inflight.environments or "
            "package.module:Class"
        },
    )
    env_options: dict[str, Any] = field(
        default_factory=dict, metadata={"doc": "keyword arguments of the environment's class"}
    )
    env_timeout_s: float = field(
        default=30.0, metadata={"min": 0.01, "doc": "limit for one reset or step"}
    )
    env_workers: int = field(default=1, metadata={"min": 1, "doc": "environment worker processes"})
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"doc": "options for a rollout of your own (ctx.options)"}
    )
    agent: str = field(
        default="",
        metadata={
            "doc": "openai_agent: async def solve(client, task) -> float | None, an entry "
            "point of inflight.agents or package.module:function"
        },
    )
    agent_timeout_s: float = field(
        default=300.0, metadata={"min": 0.01, "doc": "openai_agent: limit for one episode"}
    )
    agent_workers: int = field(
        default=0,
        metadata={
            "min": 0,
            "doc": "openai_agent: worker processes that run the agents (any agent, blocking "
            "code included, over HTTP); 0: async agents on the event loop (faster)",
        },
    )
    reasoning_parser: str = field(
        default="",
        metadata={
            "doc": "openai_agent: answers to chat calls carry their reasoning as "
            "reasoning_content, not in content (the engine's --reasoning-parser names: qwen3, "
            "deepseek-r1, ...); '': the text as it is"
        },
    )
    tool_call_parser: str = field(
        default="",
        metadata={
            "doc": "openai_agent: the format tool calls are read in (the engine's "
            "--tool-call-parser names: qwen25, hermes, llama3, mistral, pythonic, ...); '': "
            "the chat template's own, as the engine's --tool-call-parser auto detects it "
            "(SGLang's detection: none found, no tool calls read; one the engine does not "
            "read, refused)"
        },
    )

    def __post_init__(self) -> None:
        # unknown names are config errors, found before the run (resolving imports the
        # plugin's module only; a tool's description is made when the tool workers start)
        resolve_rollout(self.use)
        if self.use == "environment" and not self.environment:
            raise ValueError("rollout 'environment' needs `environment` (the class to play)")
        if self.use == "openai_agent":
            if not self.agent:
                raise ValueError("rollout 'openai_agent' needs `agent` (the agent function)")
            try:
                import openai  # noqa: F401
            except ImportError:
                raise ValueError(
                    "rollout 'openai_agent' needs the openai package: pip install openai "
                    "(or inflight-rl[agents])"
                ) from None
            from stages.rollouts.openai_agent import resolve_agent

            resolve_agent(self.agent, in_loop=self.agent_workers == 0)
            self._check_parsers()
        elif self.agent:
            raise ValueError("`agent` is for rollout 'openai_agent'")
        elif self.reasoning_parser or self.tool_call_parser:
            raise ValueError("`reasoning_parser` and `tool_call_parser` are for 'openai_agent'")
        if self.use == "tools" and not self.tools:
            raise ValueError("rollout 'tools' needs `tools` (at least one tool function)")
        for name in self.tools:
            if not callable(resolve("tool", name)):
                raise PluginError(f"tool {name!r} is not a function")
        if self.environment:
            from stages.rollouts.environments import resolve_environment

            resolve_environment(self.environment)

    def _check_parsers(self) -> None:
        from stages.engine.reasoning import PARSERS as REASONING
        from stages.engine.tool_calls import PARSERS as TOOL_CALLS

        for key, names in (("reasoning_parser", REASONING), ("tool_call_parser", TOOL_CALLS)):
            value = getattr(self, key)
            if value and value not in names:
                raise ValueError(f"{key} {value!r}: one of {', '.join(names)}")

    @property
    def single_turn(self) -> bool:
        return self.use == "single_turn"


class RolloutContext:
    """What a rollout gets besides its prompt and engine (one per episode).

    ``config`` and ``options`` (its free-form ``options``), ``tokenizer`` (None when the
    rollout has none configured), ``tools`` and ``env`` (runners, when configured),
    ``sample_index`` / ``group_id``, ``sampling`` (the run's sampling parameters, read-only),
    ``log`` (bound to the episode) and ``count(name, n)`` for the generator's metrics.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        tokenizer: Any = None,
        tools: Any = None,
        env: Any = None,
        agents: Any = None,
        sampling: Mapping[str, Any] | None = None,
        counters: Counter[str] | None = None,
        log: Any = None,
        sample_index: int = 0,
        group_id: str = "",
    ) -> None:
        self.config, self.options = config, config.options
        self.tokenizer, self.tools, self.env = tokenizer, tools, env
        self.agents = agents  # stages.workers.FunctionPool of the agent workers, when any
        self.sampling = dict(sampling or {})
        self.counters = counters if counters is not None else Counter()
        self.log = log
        self.sample_index, self.group_id = sample_index, group_id

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``rollout_NAME`` of the generator's metrics."""
        self.counters[name] += n

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added): what a rollout inserts."""
        if self.tokenizer is None:
            raise RuntimeError("this rollout needs a tokenizer: set rollout.tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise RuntimeError("this rollout needs a tokenizer: set rollout.tokenizer")
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def resolve_rollout(name: str) -> Rollout:
    """The rollout function ``name`` names (entry point or dotted path); PluginError otherwise."""
    fn = resolve("rollout", name)
    if not callable(fn):
        raise PluginError(f"rollout {name!r} resolved to {fn!r}, which is not callable")
    return fn
