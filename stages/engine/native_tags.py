"""Model-native structural tags of tool calls: what SGLang 0.5.23 constrains calls with.

For ``tool_choice`` ``required`` or a named function, and for ``auto`` with a ``strict`` tool,
SGLang asks its parser's detector for a tag first (``FunctionCallParser.get_structure_constraint``
→ ``BaseFormatDetector.get_structural_tag``); the detectors that name a model
(``get_structural_tag_name``) get xgrammar 0.2.7's tag of that model's own call syntax
(``xgrammar.get_model_structural_tag``), in the newer structural-tag form, and the others the
legacy tag of their ``structure_info`` (``tool_calls.call_tag``). This module writes the
newer-form tags for the parsers served here whose model xgrammar knows, as that function
builds them for SGLang's arguments: the tools as SGLang dumps them (a tool with ``strict:
false`` takes any JSON: ``_get_function_parameters``), ``required``, a named function
(``forced``: that tool alone) or ``auto``, ``parallel_tool_calls``, and no reasoning prefix
(SGLang passes ``thinking_mode and reasoning_parser is None``, which is false whatever the
request: without a reasoning parser its ``thinking_mode`` is false). The engine compiles them
as SGLang's default backend reads them (``stages.engine.structural_format``).

- ``kimi_k2`` (xgrammar's ``kimi``): a section of calls
  ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``, each
  ``<|tool_call_begin|>functions.NAME:`` an index (``\\d+``) ``<|tool_call_argument_begin|>``
  the arguments as JSON ``<|tool_call_end|>``; ``auto`` free text in which the section begins
  the calls (without ``<think>``, ``</think>`` or a bare call begin in the text), one section
  (and one call) with ``parallel_tool_calls`` false; forced, a tool that is not strict has
  its arguments held to an object (SGLang's ``KimiK2Detector.get_structural_tag``);
- ``qwen3_coder`` (and ``step3p5`` and ``nanbeige``, which SGLang reads with the same detector;
  xgrammar's ``qwen_3_coder``): each call ``<tool_call>\\n<function=NAME>\\n``, its
  parameters in the ``qwen_xml`` style (``stages.engine.qwen_xml``),
  ``\\n</function>\\n</tool_call>``; ``required`` one or more calls with free text around
  them (no ``<think>`` or ``</think>`` in it), a named function its call alone, ``auto`` free
  text in which the call begins; one call with ``parallel_tool_calls`` false;
- ``deepseekv32`` (xgrammar's ``deepseek_v3_2``): a ``<|DSML|function_calls>`` block (its
  bars fullwidth; after a blank line when forced) of ``<|DSML|invoke name="NAME">`` calls
  whose parameters are in the ``deepseek_xml`` style (``stages.engine.qwen_xml``).
"""

from __future__ import annotations

import json
from typing import Any

import structlog

__all__ = ["NATIVE_TAGS", "native_tag", "served_tag"]

_log = structlog.get_logger(__name__)

_KIMI_CALL = "<|tool_call_begin|>"
_KIMI_ARGS = "<|tool_call_argument_begin|>"
_KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_SECTION = "<|tool_calls_section_begin|>"
_KIMI_SECTION_END = "<|tool_calls_section_end|>"
_THINK = ["<think>", "</think>"]


def _parameters(tool: dict[str, Any]) -> Any:
    """A tool's arguments' schema as xgrammar constrains them (``_get_function_parameters``):
    any JSON (``true``) for a tool with ``strict: false`` or without ``parameters``; a tool
    that does not say (SGLang's ``Function.strict`` is None then) is held to its schema."""
    fn = tool["function"]
    if fn.get("strict") is False or fn.get("parameters") is None:
        return True
    return fn["parameters"]


def _json(schema: Any) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "any_order": False,
        "max_whitespace_cnt": None,
    }


def _object_args(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {**tool["function"], "strict": True, "parameters": {"type": "object"}}
    return {**tool, "function": fn}


def _kimi_call(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f"{_KIMI_CALL}functions.{tool['function']['name']}:",
        "content": {
            "type": "sequence",
            "elements": [
                {"type": "regex", "pattern": r"\d+"},
                {"type": "const_string", "value": _KIMI_ARGS},
                _json(_parameters(tool)),
            ],
        },
        "end": _KIMI_CALL_END,
    }


def _kimi(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    if choice != "auto":  # KimiK2Detector.get_structural_tag: a tool that is not strict holds
        # its arguments to an object (Kimi's reader takes no other), strict in xgrammar's eyes
        tools = [t if t["function"].get("strict") else _object_args(t) for t in tools]
    return _block(
        [_kimi_call(t) for t in tools], choice, parallel,
        begin=_KIMI_SECTION, opening=_KIMI_SECTION, end=_KIMI_SECTION_END,
        excludes=[*_THINK, _KIMI_CALL],
    )  # fmt: skip


def _block(
    calls: list[dict[str, Any]],
    choice: str,
    parallel: bool,
    *,
    begin: str,
    opening: str,
    end: str,
    excludes: list[str],
) -> dict[str, Any]:
    """A block of calls (``calls``: a tag a tool), as xgrammar frames Kimi's section and
    DeepSeek V3.2's function calls: ``auto``, free text (without ``excludes``) in which
    ``begin`` (its trigger: without a trailing newline) starts a block that ``end`` closes;
    else ``opening``, one call or more (``required``) or the one tool's call (``forced``),
    then ``end``."""
    many = {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if choice == "auto":
        block = {"type": "tag", "begin": begin, "content": many, "end": end}
        return {
            "type": "triggered_tags",
            "triggers": [begin.rstrip("\n")],
            "tags": [block],
            "at_least_one": False,
            "stop_after_first": not parallel,
            "excludes": excludes,
        }
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": opening},
            calls[0] if choice == "forced" else many,
            {"type": "const_string", "value": end},
        ],
    }


_QWEN_CALL = "<tool_call>\n<function="
_QWEN_END = "\n</function>\n</tool_call>"


def _qwen_call(tool: dict[str, Any]) -> dict[str, Any]:
    content = {**_json(_parameters(tool)), "style": "qwen_xml"}
    begin = f"{_QWEN_CALL}{tool['function']['name']}>\n"
    return {"type": "tag", "begin": begin, "content": content, "end": _QWEN_END}


def _qwen_coder(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    if choice == "forced":
        return _qwen_call(tools[0])
    return {
        "type": "triggered_tags",
        "triggers": [_QWEN_CALL],
        "tags": [_qwen_call(t) for t in tools],
        "at_least_one": choice == "required",
        "stop_after_first": not parallel,
        "excludes": list(_THINK),
    }


_DSML = "\uff5cDSML\uff5c"
_DS_INVOKE = f'<{_DSML}invoke name="'
_DS_CALLS = f"<{_DSML}function_calls>"


def _deepseek_call(tool: dict[str, Any]) -> dict[str, Any]:
    content = {**_json(_parameters(tool)), "style": "deepseek_xml"}
    begin = f'{_DS_INVOKE}{tool["function"]["name"]}">\n'
    return {"type": "tag", "begin": begin, "content": content, "end": f"</{_DSML}invoke>\n"}


def _deepseek_v32(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    return _block(
        [_deepseek_call(t) for t in tools], choice, parallel,
        begin=f"{_DS_CALLS}\n", opening=f"\n\n{_DS_CALLS}\n", end=f"</{_DSML}function_calls>",
        excludes=list(_THINK),
    )  # fmt: skip


# SGLang reads step3p5's and nanbeige's calls with its Qwen3CoderDetector, which names the model
_BUILDERS = {"kimi_k2": _kimi, "qwen3_coder": _qwen_coder, "step3p5": _qwen_coder,
             "nanbeige": _qwen_coder, "deepseekv32": _deepseek_v32}  # fmt: skip
NATIVE_TAGS = frozenset(_BUILDERS)  # the parsers whose calls get a model-native tag here


def served_tag(
    parser: str, tools: list[dict[str, Any]], choice: Any, *, parallel: bool = True
) -> dict[str, Any] | None:
    """``native_tag``, or None where the engine's grammars cannot mean it as xgrammar does
    (a tool schema ``structural_format`` refuses, such as a union of a string and an object in
    an XML style): the caller then constrains the calls as it did before these tags, and the
    difference is logged."""
    from stages.engine.structural_format import FormatError, format_grammar

    tag = native_tag(parser, tools, choice, parallel=parallel)
    try:
        format_grammar(tag, json.dumps)
    except FormatError as exc:
        _log.warning("native_tool_tag_not_served", parser=parser, reason=str(exc)[:300])
        return None
    return tag


def native_tag(
    parser: str, tools: list[dict[str, Any]], choice: Any, *, parallel: bool = True
) -> dict[str, Any]:
    """The structural tag SGLang 0.5.23 sends for ``parser``'s calls to ``tools`` under
    ``tool_choice`` ``choice`` (``required``, ``auto`` or a named function)."""
    if isinstance(choice, dict):  # a named function: that tool alone
        name = choice["function"]["name"]
        tools, simple = [t for t in tools if t["function"]["name"] == name], "forced"
    else:
        simple = choice
    return {"type": "structural_tag", "format": _BUILDERS[parser](tools, simple, parallel)}
