"""``stages.engine.template_detection`` against SGLang 0.5.23's own
(``srt/parser/template_detection.py``: ``detect_reasoning_pattern``, ``build_detection_context``
and ``match_rules`` over ``REASONING_PARSER_RULES`` and ``TOOL_CALL_PARSER_RULES``): the families'
templates of ``test_engine_template_detection.py`` and thousands of random templates and
vocabularies made of the markers SGLang's predicates look for.

Skipped unless SGLang imports (its environment, or its wheel's source on ``PYTHONPATH``:
``test_engine_sglang_shapes.py``'s docstring says how). SGLang's module imports its server
arguments' hooks, which pull in its multimodal configs; where those cannot import, the module is
loaded with the two hooks stubbed (the rules use neither).
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

sglang: Any = pytest.importorskip("sglang")

from stages.engine.template_detection import (  # noqa: E402
    REASONING_RULES,
    TOOL_CALL_RULES,
    detect,
    detection,
)
from tests.stages.test_engine_template_detection import (  # noqa: E402
    BAR,
    FAMILIES,
    LOW,
    UNSERVED,
    Vocab,
)


def _theirs() -> Any:
    try:
        from sglang.srt.parser import template_detection

        return template_detection
    except ImportError:
        pass
    stubs = {}
    for name, attrs in (
        ("sglang.srt.arg_groups.muse_spark_hook", ["muse_spark_chat_template_default"]),
        ("sglang.srt.arg_groups.overrides", ["declare_resolution", "resolving_view"]),
    ):
        stub = types.ModuleType(name)
        for attr in attrs:
            setattr(stub, attr, lambda *a, **k: None)
        stubs[name] = stub
    path = Path(sglang.__file__).parent / "srt/parser/template_detection.py"
    spec = importlib.util.spec_from_file_location("sglang_template_detection", path)
    if spec is None or spec.loader is None:
        pytest.skip("SGLang's template_detection.py is not readable")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, stubs):
        spec.loader.exec_module(module)
    return module


theirs = _theirs()

# the text the predicates look for, toggles and reasoning-mode snippets among them
MARKERS = [
    "<ifm|think>", "<ifm|think_fast>", "reasoning_effort", "<|channel|>", "<|channel>",
    "{{ '<|im_start|>assistant\\n<think>\\n' }}", "enable_thinking", "thinking",
    "[gMASK]<sop>", "Reasoning Effort:", "<tool_call>", "<arg_key>", "<arg_value>", "[THINK]",
    "reasoning_mode_token", "no_think", "/nothink", "/think", "</nothink",
    "{% if not enable_thinking is defined %}{% set enable_thinking = false %}{% endif %}",
    "{% if not enable_thinking is defined %}{% set enable_thinking = True %}{% endif %}",
    "{%- set enable_thinking = enable_thinking | default(false) -%}",
    "{%- set enable_thinking = enable_thinking | d(true) -%}",
    "{% set enable_thinking = enable_thinking if enable_thinking is defined else true %}",
    "enable_thinking is defined and not enable_thinking",
    "enable_thinking is not defined or enable_thinking",
    "{% set ns = namespace(enable_thinking=true) %}",
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}",
    "{% if not thinking is defined %}{% set thinking = true %}{% endif %}",
    "{%- set thinking = thinking | default(true, true) -%}", "thinking is not defined or thinking",
    "low_effort", "truncate_history_thinking", "defer_loading", "◁think▷", "default_thinking_sys",
    "<rfl:parameter", "<ifm|tool_calls>", "<ifm|tool_call>", "{{- '<tool_call>' + tc.name",
    "{{ \"<tool_call>\" ~ tc.name", f"<{BAR}tool{LOW}calls{LOW}begin{BAR}>",
    f"<{BAR}tool{LOW}sep{BAR}>", f"<{BAR}DSML{BAR}function_calls>", f"<{BAR}DSML{BAR}tool_calls>",
    f"<{BAR}DSML{BAR} calls>", "<tool_calls>", "<tool_sep>", "interleaved_thinking",
    "unescaped XML-like object", "All available function signatures are listed below",
    "<minimax:tool_call>", "<mm:think>", "]<]minimax[>[", "<function name=", "<param name=",
    "<|tool_call_start|>", "<|tool_call_end|>", "Step-3.5", "step3p7", "Reasoning: ",
    "<steptml:invoke", f"<{BAR}tool_calls_begin{BAR}>", f"<{BAR}tool_sep{BAR}>", "<function=",
    "<parameter=", "<role>SYSTEM</role>", "<role>ASSISTANT</role>", "<|role_end|>", "<think>",
    "</think>", f"<{BAR}GCML{BAR}tool_calls>", "<|iquest_assistant|>", "{{ messages }}", "\n",
    "{% generation %}x{% endgeneration %}", "{% if %}",
]  # fmt: skip
TOKENS = ["<|inner_prefix|>", "<|tool_calls_section_begin|>", "<tool_call>", "<|user|>",
          "<|endoftext|>", "<arg_key>", "<arg_value>", "<tool_calls>", "<tool_calls:opensource>",
          "<tool_sep:x>", "<arg_key:x>", "<arg_value:x>", "<function", "<param",
          "<|tool_call_start|>", "<|tool_call_end|>", "a", "b"]  # fmt: skip


def _same(template: str, vocab: set[str]) -> None:
    force, config = theirs.detect_reasoning_pattern(template)
    want_ctx = theirs.build_detection_context(template, Vocab(vocab), config, force)
    ours = detection(template, Vocab(vocab))
    assert ours is not None and ours.always == force, template
    toggle = ours.toggle
    mine = (
        None
        if toggle is None
        else (toggle.param, toggle.default, toggle.special, toggle.effort_kwarg)
    )
    want = (
        None
        if config is None
        else (config.toggle_param, config.default_enabled, config.special_case, config.effort_kwarg)
    )
    assert mine == want, template
    for rules, their_rules in (
        (REASONING_RULES, theirs.REASONING_PARSER_RULES),
        (TOOL_CALL_RULES, theirs.TOOL_CALL_PARSER_RULES),
    ):
        rule = detect(ours, rules)
        got = None if rule is None else rule.value
        assert got == theirs.match_rules(want_ctx, their_rules, "parser"), (template, vocab)


def test_the_rules_are_sglangs_in_its_order() -> None:
    for ours, their_rules in (
        (REASONING_RULES, theirs.REASONING_PARSER_RULES),
        (TOOL_CALL_RULES, theirs.TOOL_CALL_PARSER_RULES),
    ):
        assert [(r.name, r.value) for r in ours] == [(r.name, r.value) for r in their_rules]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_families_template_gets_what_sglang_detects(family: str) -> None:
    template, vocab, _, _ = FAMILIES[family]
    _same(template, vocab)


def test_the_unserved_templates_are_what_sglang_detects() -> None:
    for template, _, _ in UNSERVED.values():
        _same(template, set())


@pytest.mark.timeout(300)
def test_random_templates_of_the_predicates_markers_get_what_sglang_detects() -> None:
    r = random.Random(23)
    for _ in range(3000):
        template = "".join(r.choice(MARKERS) for _ in range(r.randint(0, 6)))
        vocab = set(r.sample(TOKENS, r.randint(0, 4)))
        _same(template, vocab)
