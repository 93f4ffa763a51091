"""Tools: specs made from plain functions, arguments checked, calls run in worker processes,
every failure answered as text and counted."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from structlog.testing import capture_logs

from pipeline.registry import PluginError
from stages.rollouts.api import RolloutConfig
from stages.rollouts.tool_format import TagsFormat, ToolCall
from stages.rollouts.tools import (
    ToolArgumentError,
    ToolBox,
    ToolSpec,
    ToolSpecError,
    cut_text,
    load_tool_specs,
    tool_text,
)
from tests.stages.tool_tokenizers import calc_tokenizer

HERE = "tests.stages.test_tools"


# tools the workers find by dotted path (as a user's module would provide them)
def calc(expression: str) -> str:
    """Evaluate a product of integers.

    Args:
        expression: Integers joined by *, e.g. "123*456".
    """
    value = 1
    for part in expression.split("*"):
        value *= int(part)
    return str(value)


def add(a: int, b: float = 0.0) -> float:
    """Add two numbers.

    Args:
        a: The first one.
        b: The second one.
    """
    return a + b


def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: What to look up.
    """
    return {"key": key, "values": [1, 2]}


def nothing() -> None:
    """Do nothing."""


async def later(n: int) -> int:
    """Answer after a short wait.

    Args:
        n: The answer.
    """
    await asyncio.sleep(0.01)
    return n


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def crash(code: int) -> str:
    """End the worker process.

    Args:
        code: Its exit code.
    """
    os._exit(code)


def pid() -> int:
    """The worker's process id."""
    return os.getpid()


def long(n: int) -> str:
    """A long answer.

    Args:
        n: Its length.
    """
    return "x" * n


def no_doc(x: int) -> int:
    return x


def no_hint(x) -> int:
    """Doc.

    Args:
        x: The x.
    """
    return x


def undocumented_arg(x: int) -> int:
    """Doc without Args."""
    return x


not_callable = 3


# ------------------------------------------------------------------------------------ specs
def test_a_spec_is_made_from_the_functions_hints_and_docstring():
    spec = ToolSpec.from_function(add, f"{HERE}:add")
    assert spec.name == "add" and spec.description == "Add two numbers."
    assert spec.ref == f"{HERE}:add"
    assert spec.parameters["properties"]["a"] == {
        "type": "integer",
        "description": "The first one.",
    }
    assert spec.parameters["required"] == ["a"]
    assert spec.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": spec.parameters,
        },
    }


@pytest.mark.parametrize(
    ("name", "why"),
    [("no_doc", "no docstring"), ("no_hint", "missing a type hint"), ("undocumented_arg", "'x'")],
)
def test_functions_that_cannot_be_described_are_config_errors_naming_the_tool(name, why):
    with pytest.raises(ToolSpecError, match=f"tool '{HERE}:{name}': .*{why}.*Google-style"):
        load_tool_specs([f"{HERE}:{name}"])


def test_unknown_duplicate_or_uncallable_tools_are_config_errors():
    with pytest.raises(PluginError, match="no tool named 'calculator'"):
        load_tool_specs(["calculator"])
    with pytest.raises(PluginError, match="not callable"):
        load_tool_specs([f"{HERE}:not_callable"])
    with pytest.raises(ToolSpecError, match="both named 'calc'"):
        load_tool_specs([f"{HERE}:calc", "calc"])  # the entry point calc is another `calc`


def test_arguments_are_checked_against_the_signature_and_schema():
    spec = ToolSpec.from_function(add, f"{HERE}:add")
    assert spec.check({"a": 1}) == {"a": 1}
    assert spec.check({"a": 1, "b": 2}) == {"a": 1, "b": 2}  # an integer is a number
    bad = [
        ({}, "missing argument 'a'"),
        ({"a": 1, "c": 2}, "unexpected argument 'c' \\(takes: a, b\\)"),
        ({"a": "1"}, "argument 'a' must be integer, got string '1'"),
        ({"a": True}, "argument 'a' must be integer, got boolean"),
        ({"a": 1.5}, "argument 'a' must be integer, got number"),
        ([1], "must be a JSON object, got array"),
    ]
    for arguments, message in bad:
        with pytest.raises(ToolArgumentError, match=message):
            spec.check(arguments)


def test_raw_text_becomes_the_one_parameter_converted_to_its_type():
    assert ToolSpec.from_function(calc).from_text(" 123*456 ") == {"expression": "123*456"}
    assert ToolSpec.from_function(calc).from_text('"a b"') == {"expression": "a b"}
    assert ToolSpec.from_function(later).from_text("7") == {"n": 7}
    with pytest.raises(ToolArgumentError, match="argument 'n' must be integer, got 'seven'"):
        ToolSpec.from_function(later).from_text("seven")
    with pytest.raises(ToolArgumentError, match=r"add takes 2 arguments \(a, b\): give them as"):
        ToolSpec.from_function(add).from_text("1")
    with pytest.raises(ToolArgumentError, match=r"pid takes no arguments: call pid\(\)"):
        ToolSpec.from_function(pid).from_text("1")


def test_values_become_text_and_long_text_is_cut():
    assert tool_text({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    assert tool_text([1, 2]) == "[1, 2]"
    assert tool_text(None) == "" and tool_text(3.5) == "3.5" and tool_text(b"hi") == "hi"
    assert cut_text("abcdef", 4) == ("abcd... [cut: 2 chars]", True)
    assert cut_text("abcd", 4) == ("abcd", False)
    assert cut_text("ab", 2, full_length=12347) == ("ab... [cut: 12345 chars]", True)


# ------------------------------------------------------------------------------------ calls
def _config(**overrides) -> RolloutConfig:
    names = ["calc", "add", "lookup", "nothing", "later", "hang", "crash", "pid", "long"]
    fields = {"use": "tools", "tools": [f"{HERE}:{n}" for n in names], "tool_format": "tags"}
    return RolloutConfig(**{**fields, **overrides})


@pytest.mark.timeout(60)
async def test_calls_answer_with_text_and_every_failure_is_answered_and_counted():
    config = _config(tool_timeout_s=0.5, max_tool_output_chars=100)
    with capture_logs() as logs:
        box = await ToolBox.start(config, calc_tokenizer())
        try:
            assert isinstance(box.format, TagsFormat)
            ok = await box.call_all(
                [
                    ToolCall("calc", raw="123*456"),
                    ToolCall("add", arguments={"a": 1, "b": 0.5}),
                    ToolCall("lookup", arguments={"key": "k"}),
                    ToolCall("nothing", arguments={}),
                    ToolCall("later", raw="5"),
                ]
            )
            cut = await box.call(ToolCall("long", raw="105"))
            bad = [
                await box.call(ToolCall("", error="cannot read 'x'")),
                await box.call(ToolCall("foo", arguments={})),
                await box.call(ToolCall("add", arguments={"b": 1})),
                await box.call(ToolCall("calc", raw="12*x")),
            ]
            first_pid = int((await box.call(ToolCall("pid", arguments={}))).text)
            started = time.monotonic()
            timed_out = await box.call(ToolCall("hang", raw="30"))
            assert time.monotonic() - started < 3
            after_timeout = int((await box.call(ToolCall("pid", arguments={}))).text)
            lost = await box.call(ToolCall("crash", raw="3"))
            again = await box.call(ToolCall("calc", raw="2*3"))
            stats = box.stats()
        finally:
            await box.aclose()
    assert [r.text for r in ok] == ["56088", "1.5", '{"key": "k", "values": [1, 2]}', "", "5"]
    assert all(r.error is None and not r.cut for r in ok)
    assert cut.text == "x" * 100 + "... [cut: 5 chars]" and cut.cut and cut.error is None
    assert [(r.error, r.text) for r in bad] == [
        ("malformed", "error: malformed tool call: cannot read 'x'"),
        ("unknown_tool", "error: unknown tool 'foo'; tools: calc, add, lookup, nothing, "
         "later, hang, crash, pid, long"),
        ("bad_arguments", "error: bad arguments for add: missing argument 'a'"),
        ("exception", "error: calc raised ValueError: invalid literal for int() with base "
         "10: 'x'"),
    ]  # fmt: skip
    assert (timed_out.error, timed_out.text) == ("timeout", "error: hang timed out after 0.5 s")
    assert after_timeout != first_pid  # the hung worker was replaced
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)
    assert lost.error == "worker_lost"
    assert lost.text == "error: crash failed: tool worker died (exit code 3)"
    assert again.text == "6" and again.error is None  # and the replacement serves the next call
    assert box.calls == 15 and box.cut == 1
    assert dict(box.errors) == {
        "malformed": 1,
        "unknown_tool": 1,
        "bad_arguments": 1,
        "exception": 1,
        "timeout": 1,
        "worker_lost": 1,
    }
    assert stats["toolbox_calls"] == 15 and stats["toolbox_errors_timeout"] == 1
    assert stats["toolbox_worker_restarts"] == 2 and stats["toolbox_outputs_cut"] == 1
    failed = [e for e in logs if e["event"] == "tool_failed"]
    assert [(e["tool"], e["kind"]) for e in failed] == [
        ("hang", "timeout"),
        ("crash", "worker_lost"),
    ]


@pytest.mark.timeout(60)
async def test_error_texts_are_cut_too_and_calls_run_at_once():
    config = _config(tool_timeout_s=5, max_tool_output_chars=30, tool_workers=2)
    box = await ToolBox.start(config, calc_tokenizer())
    try:
        started = time.monotonic()
        both = await box.call_all([ToolCall("hang", raw="0.4"), ToolCall("hang", raw="0.4")])
        elapsed = time.monotonic() - started
        error = await box.call(ToolCall("calc", raw="1*" + "y" * 50))
    finally:
        await box.aclose()
    assert [r.text for r in both] == ["woke", "woke"]
    assert elapsed < 0.75  # two workers: side by side, not one after the other
    assert error.error == "exception" and error.cut
    assert error.text.startswith("error: calc raised ValueError") and "... [cut: " in error.text
