"""Tools: plain Python functions a rollout lets the model call, run in worker processes.

A tool is a function with type hints and a Google-style docstring whose ``Args:`` section
describes every parameter (TRL's convention)::

    def calc(expression: str) -> str:
        \"\"\"Evaluate an integer arithmetic expression.

        Args:
            expression: Integers combined with +, -, *, // and %, e.g. "123*456".
        \"\"\"

``ToolSpec`` is what the model is told about it (name, description, JSON-schema parameters,
made by ``transformers.utils.get_json_schema``); ``load_tool_specs(names)`` resolves the
configured tools (entry points of ``inflight.tools`` or dotted paths) and fails with a
``ToolSpecError`` naming the tool when one has no docstring or hints it needs. ``ToolRunner``
runs calls in the shared worker pool (``stages.workers``), ``tool_timeout_s`` each. ``ToolBox``
(what a rollout gets as ``ctx.tools``) holds the specs, the runner, the format (``tool_format.py``)
and counters; ``await toolbox.call(call)`` returns the text the model sees.

A call never crashes an episode: each of these becomes the tool's answer, counted by kind
(``ERROR_KINDS``)::

    malformed       error: malformed tool call: WHY
    unknown_tool    error: unknown tool 'foo'; tools: calc
    bad_arguments   error: bad arguments for calc: WHY
    exception       error: calc raised ValueError: WHY
    timeout         error: calc timed out after 10.0 s
    worker_lost     error: calc failed: tool worker died (exit code -9)

Arguments are checked against the function's signature and schema before the call (missing,
unexpected, of the wrong JSON type). A value that is not a string is turned into text (JSON for
dicts, lists and tuples, ``""`` for None, ``str()`` otherwise; ``async def`` tools are awaited in
the worker). An answer longer than ``max_tool_output_chars`` keeps that many characters and then
says how many more it had: ``... [cut: 12345 chars]``.

Not here: how calls are written and answers inserted (``tool_format.py``), the episode loop
(``tool_rollout.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from stages.rollouts.api import RolloutConfig
from stages.rollouts.tool_format import ToolCall, ToolFormat, make_tool_format
from stages.workers import FunctionPool, resolve_function

__all__ = [
    "ERROR_KINDS",
    "ToolArgumentError",
    "ToolBox",
    "ToolResult",
    "ToolRunner",
    "ToolSpec",
    "ToolSpecError",
    "cut_text",
    "load_tool_specs",
    "tool_text",
]

ERROR_KINDS = (
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "exception",
    "timeout",
    "worker_lost",
)
_CONVENTION = (
    "a tool is a function with a type hint on every parameter and a Google-style docstring "
    "whose Args: section describes each one (TRL's convention)"
)


class ToolSpecError(ValueError):
    """A configured tool that cannot be offered to the model (the message names it)."""


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool (the message is shown to the model)."""


# ------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it, and how a worker finds it (``ref``)."""

    name: str  # what the model calls: the function's name
    description: str
    parameters: dict[str, Any]  # JSON schema: {"type": "object", "properties", "required"}
    ref: str  # the configured name: an entry point of inflight.tools or a dotted path
    signature: inspect.Signature = field(repr=False, compare=False)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], ref: str = "") -> ToolSpec:
        """The spec of ``fn``; ``ToolSpecError`` when its docstring or hints do not say enough."""
        # transformers takes most of a second to import: not in every tool worker, only here
        from transformers.utils import get_json_schema

        ref = ref or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        try:
            schema = get_json_schema(fn)["function"]
            signature = inspect.signature(fn)
        except Exception as exc:  # transformers' parsing exceptions, or no __name__ (partial)
            raise ToolSpecError(f"tool {ref!r}: {exc}; {_CONVENTION}") from None
        if not schema.get("description"):
            raise ToolSpecError(f"tool {ref!r}: its docstring has no description; {_CONVENTION}")
        return cls(schema["name"], schema["description"], schema["parameters"], ref, signature)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @property
    def param_names(self) -> list[str]:
        return list(self.parameters.get("properties", {}))

    def check(self, arguments: Any) -> dict[str, Any]:
        """``arguments`` if they fit the signature and the schema; ToolArgumentError says why."""
        if not isinstance(arguments, Mapping):
            raise ToolArgumentError(
                f"the arguments must be a JSON object, got {_json_type(arguments)}"
            )
        properties = self.parameters.get("properties", {})
        takes_any = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in self.signature.parameters.values()
        )
        unexpected = [k for k in arguments if k not in properties]
        if unexpected and not takes_any:
            takes = ", ".join(properties) or "none"
            raise ToolArgumentError(f"unexpected argument {unexpected[0]!r} (takes: {takes})")
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError(f"missing argument {missing[0]!r}")
        for key, value in arguments.items():
            if key in properties:
                _check_value(key, value, properties[key])
        return dict(arguments)

    def from_text(self, text: str) -> dict[str, Any]:
        """The arguments of ``NAME(TEXT)`` when TEXT is not a JSON object: the one parameter's
        value, converted to its type (a JSON string literal is unquoted first)."""
        names = self.param_names
        if len(names) != 1:
            if not names:
                raise ToolArgumentError(f"{self.name} takes no arguments: call {self.name}()")
            raise ToolArgumentError(
                f"{self.name} takes {len(names)} arguments ({', '.join(names)}): give them as "
                f'a JSON object, {self.name}({{"{names[0]}": ...}})'
            )
        (key,) = names
        return self.check({key: _convert(key, text, self.parameters["properties"][key])})


def load_tool_specs(names: Sequence[str]) -> list[ToolSpec]:
    """The specs of the configured tools (resolved in this process): a PluginError for a name
    that is not a tool, a ToolSpecError for a function that cannot be described or two tools
    with the same name."""
    specs: list[ToolSpec] = []
    for ref in names:
        spec = ToolSpec.from_function(resolve_function("tool", ref), ref)
        same = [s.ref for s in specs if s.name == spec.name]
        if same:
            raise ToolSpecError(
                f"tools {same[0]!r} and {ref!r} are both named {spec.name!r}: the model could "
                "not tell them apart"
            )
        specs.append(spec)
    if not specs:
        raise ToolSpecError("no tools configured: list at least one in rollout.tools")
    return specs


def _json_type(value: Any) -> str:
    """The JSON type name of a value parsed from JSON (``bool`` is not a number here)."""
    if isinstance(value, bool):
        return "boolean"
    for name, types in (
        ("integer", int),
        ("number", float),
        ("string", str),
        ("array", (list, tuple)),
        ("object", Mapping),
        ("null", type(None)),
    ):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _allowed_types(prop: Mapping[str, Any]) -> list[str]:
    types = prop.get("type")
    if types is None:
        return []
    out = [types] if isinstance(types, str) else list(types)
    if prop.get("nullable") and "null" not in out:
        out.append("null")
    return out


def _check_value(key: str, value: Any, prop: Mapping[str, Any]) -> None:
    types = _allowed_types(prop)
    if types and _json_type(value) not in types:
        if not ("number" in types and _json_type(value) == "integer"):
            raise ToolArgumentError(
                f"argument {key!r} must be {' or '.join(types)}, got {_json_type(value)} "
                f"{_short(value)}"
            )
    if "enum" in prop and value not in prop["enum"]:
        raise ToolArgumentError(f"argument {key!r} must be one of {prop['enum']}, got {value!r}")


def _convert(key: str, text: str, prop: Mapping[str, Any]) -> Any:
    """Raw call text as the parameter's type: string, integer, number, boolean, else JSON."""
    text = text.strip()
    types = [t for t in _allowed_types(prop) if t != "null"] or ["string"]
    if text.startswith('"'):
        try:
            unquoted = json.loads(text)
        except ValueError:
            unquoted = None
        if isinstance(unquoted, str):
            text = unquoted
    kind = types[0]
    try:
        if kind == "string":
            return text
        if kind == "integer":
            return int(text)
        if kind == "number":
            return float(text)
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        return json.loads(text)
    except ValueError:
        raise ToolArgumentError(f"argument {key!r} must be {kind}, got {_short(text)}") from None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------- worker
def tool_text(value: Any) -> str:
    """What the model reads of a tool's return value."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def cut_text(text: str, limit: int, full_length: int | None = None) -> tuple[str, bool]:
    """``text`` kept to ``limit`` characters, saying how many more it had; and whether it was
    cut. ``full_length``: the length of the text ``text`` was already cut from."""
    full = len(text) if full_length is None else full_length
    if full <= limit:
        return text, False
    return f"{text[:limit]}... [cut: {full - limit} chars]", True


def _run_tool(fn: Callable[..., Any], request: tuple[dict[str, Any], int]) -> tuple[str, int]:
    """The pool's adapter (runs in a worker): the call's text, cut to ``limit``, and its length
    before (only what the model can see crosses the pipe)."""
    arguments, limit = request
    value = fn(**arguments)
    if inspect.iscoroutine(value):
        value = asyncio.run(value)
    text = tool_text(value)
    return text[:limit], len(text)


# ------------------------------------------------------------------------------------- runner
@dataclass(frozen=True)
class ToolResult:
    """A call's answer to the model; ``error`` is its kind (one of ERROR_KINDS) when it failed."""

    text: str
    error: str | None = None
    cut: bool = False


class ToolRunner:
    """Runs tool calls in ``workers`` processes, ``timeout_s`` each; answers are texts."""

    def __init__(
        self,
        specs: Sequence[ToolSpec],
        *,
        workers: int = 1,
        timeout_s: float = 10.0,
        max_output_chars: int = 2000,
        log: Any = None,
    ) -> None:
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        self.pool = FunctionPool(
            "tool",
            [s.ref for s in specs],
            workers=workers,
            timeout_s=timeout_s,
            adapter=_run_tool,
            label="tool",
            log=log,
        )

    async def start(self) -> None:
        await self.pool.start()

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def run(self, spec: ToolSpec, arguments: Mapping[str, Any]) -> ToolResult:
        """Call ``spec``'s function with (checked) ``arguments``; failures are answers too."""
        reply = await self.pool.call(spec.ref, (dict(arguments), self.max_output_chars))
        if reply.ok:
            text, full = reply.value
            text, cut = cut_text(text, self.max_output_chars, full)
            return ToolResult(text, None, cut)
        if reply.status == "timeout":
            kind, text = "timeout", f"error: {spec.name} {reply.error}"
        elif reply.status == "lost":
            kind, text = "worker_lost", f"error: {spec.name} failed: {reply.error}"
        else:
            kind, text = "exception", f"error: {spec.name} raised {reply.error}"
        text, cut = cut_text(text, self.max_output_chars)
        return ToolResult(text, kind, cut)


# ------------------------------------------------------------------------------------- box
class ToolBox:
    """The tools of a run, as a rollout uses them (``ctx.tools``): ``specs`` by name, the
    ``format`` that writes and reads calls, the ``runner``, and counters (``calls``,
    ``errors`` by kind, ``cut``: answers cut to ``max_tool_output_chars``)."""

    def __init__(
        self, specs: Sequence[ToolSpec], runner: ToolRunner, format: ToolFormat, log: Any = None
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.runner, self.format = runner, format
        self.log = log if log is not None else structlog.get_logger("tools")
        self.calls, self.cut = 0, 0
        self.errors: Counter[str] = Counter()

    @classmethod
    async def start(cls, config: RolloutConfig, tokenizer: Any, log: Any = None) -> ToolBox:
        """Resolve and describe ``config.tools``, pick the format, start the workers."""
        specs = load_tool_specs(config.tools)
        fmt = make_tool_format(config.tool_format, tokenizer, specs)
        runner = ToolRunner(
            specs,
            workers=config.tool_workers,
            timeout_s=config.tool_timeout_s,
            max_output_chars=config.max_tool_output_chars,
            log=log,
        )
        await runner.start()
        return cls(specs, runner, fmt, log)

    async def call(self, call: ToolCall) -> ToolResult:
        """The answer to one parsed call (an error text when it cannot be made)."""
        self.calls += 1
        result = await self._answer(call)
        if result.error is not None:
            self.errors[result.error] += 1
            if result.error in ("timeout", "worker_lost"):
                self.log.warning("tool_failed", tool=call.name, kind=result.error)
        if result.cut:
            self.cut += 1
        return result

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The answers to one turn's calls, run at once (each takes its own worker)."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))

    def stats(self) -> dict[str, int]:
        """Counters for the metrics (``toolbox_`` so they never shadow a rollout's own)."""
        out = {"toolbox_calls": self.calls, "toolbox_outputs_cut": self.cut}
        out.update({f"toolbox_errors_{kind}": n for kind, n in self.errors.items()})
        out["toolbox_worker_restarts"] = self.runner.pool.counts["restarts"]
        return out

    async def aclose(self) -> None:
        await self.runner.aclose()

    async def _answer(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: malformed tool call: {call.error}", "malformed")
        spec = self.specs.get(call.name)
        if spec is None:
            known = ", ".join(self.specs)
            return ToolResult(f"error: unknown tool {call.name!r}; tools: {known}", "unknown_tool")
        try:
            if call.raw is not None:
                arguments = spec.from_text(call.raw)
            else:
                arguments = spec.check(call.arguments if call.arguments is not None else {})
        except ToolArgumentError as exc:
            return ToolResult(f"error: bad arguments for {spec.name}: {exc}", "bad_arguments")
        return await self.runner.run(spec, arguments)
