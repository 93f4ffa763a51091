"""``--tool-call-parser auto`` and ``--reasoning-parser auto``
(``stages.engine.template_detection``): the parsers SGLang 0.5.23 detects from a chat template
and the tokenizer's vocabulary, its architecture fallback, a real engine started with them
(resolved, logged, reported; a parser the engine does not read refused), and no tool calls read
without ``--tool-call-parser``.
``tests/stages/test_engine_sglang_template_detection.py`` holds the rules to SGLang's own."""

from __future__ import annotations

import json
import string
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from structlog.testing import capture_logs

from stages.engine.openai_chat import ChatSettings, chat_request, chat_response
from stages.engine.reasoning import Toggle
from stages.engine.template_detection import (
    ParserRefused,
    architecture_parsers,
    reasoning_mode,
    resolve_auto,
    template_parsers,
)
from tests.stages.engine_setup import ROOT, builtin_engine, engine_command, free_port
from tests.stages.tiny_model import make_tiny_model
from tests.stages.tool_tokenizers import QWEN_LIKE, char_tokenizer

BAR, LOW = "\uff5c", "\u2581"  # DeepSeek's full-width bar and its word mark
QWEN3 = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    '{%- if tools %}<tool_call>\n{"name": ...}\n</tool_call>{% endif %}'
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "{%- endif %}{%- endif %}"
)
DEEPSEEK_CALLS = f"<{BAR}tool{LOW}calls{LOW}begin{BAR}><{BAR}tool{LOW}sep{BAR}>"
THINKING_OFF = "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
GLM_TOGGLE = "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}"
GLM_VOCAB = {"<tool_call>", "<|user|>", "<arg_key>", "<arg_value>"}

# a family's markers as its template (and tokenizer) has them: (template, vocabulary,
# reasoning parser, tool-call parser)
FAMILIES: dict[str, tuple[str, set[str], str | None, str | None]] = {
    "qwen3": (QWEN3, set(), "qwen3", "qwen"),
    "qwen25 (hermes)": (QWEN_LIKE, set(), None, None),
    "qwen3-coder": ("<tool_call>\n<function={{ n }}>\n<parameter={{ k }}>", set(), None,
                    "qwen3_coder"),
    "deepseek-r1": ("{{ '<" + BAR + "Assistant" + BAR + "><think>\\n' }}" + DEEPSEEK_CALLS,
                    set(), "deepseek-r1", "deepseekv31"),
    "deepseek-v3.1": (THINKING_OFF + DEEPSEEK_CALLS + "</think>", set(), "deepseek-v3",
                      "deepseekv31"),
    "deepseek-v3.2": (THINKING_OFF + f"<{BAR}DSML{BAR}function_calls>", set(), "deepseek-v3",
                      "deepseekv32"),
    "kimi-k2": ("{{ m.content }}", {"<|tool_calls_section_begin|>"}, "kimi_k2", "kimi_k2"),
    "kimi-vl thinking": ("◁think▷{{ m.content }}◁/think▷", set(), "kimi", None),
    "glm-4.5": ("[gMASK]<sop>" + GLM_TOGGLE + "<tool_call>{{ tc.name }}\n<arg_key>", GLM_VOCAB,
                "glm45", "glm45"),
    "glm-4.7": ("[gMASK]<sop>" + GLM_TOGGLE + "{{- '<tool_call>' + tc.name }}<arg_key>",
                GLM_VOCAB, "glm45", "glm47"),
    "mistral": ("{{ reasoning_effort }}[THINK]{{ t }}[/THINK][TOOL_CALLS]", set(), "mistral",
                "mistral"),
    "llama3": ("<|python_tag|>{{ call | tojson }}<|eom_id|>", set(), None, None),
    "gpt-oss": ("<|start|>assistant<|channel|>final<|message|>", set(), "gpt-oss", "gpt-oss"),
    "gemma4": ("<|turn>model\n{% if enable_thinking %}<|channel>thought{% endif %}", set(),
               "gemma4", "gemma4"),
    "minimax-m2": ("<think>{{ r }}</think><minimax:tool_call>", set(), "minimax", "minimax-m2"),
    "minimax-m3": ("]<]minimax[>[<tool_call>", set(), "minimax-m3", "minimax-m3"),
    "lfm2": ("<|tool_call_start|>{{ c }}<|tool_call_end|>", set(), None, "lfm2"),
    "gigachat3.5": (f"<{BAR}GCML{BAR}tool_calls>", set(), "gigachat35", "gigachat35"),
    "apertus": ("<|tools_prefix|>", {"<|inner_prefix|>"}, "apertus2509", "apertus2509"),
    "interns1": ("{{ default_thinking_sys }}{% if enable_thinking is not defined or "
                 "enable_thinking %}{% endif %}", set(), "interns1", "interns1"),
    "mimo": ("{%- set enable_thinking = enable_thinking | default(false) -%}", set(), "mimo",
             "mimo"),
    "iquest-q1": ("<|iquest_assistant|>", set(), "iquest_q1", "iquest_q1"),
    "nemotron-3": ("{{ low_effort }}{{ truncate_history_thinking }}", set(), "nemotron_3", None),
    # the templates of the suite's own tests
    "the suite's qwen-like": (QWEN_LIKE, {"<tool_call>", "</tool_call>"}, None, None),
    "the suite's glm-4.7": (
        "{# <tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
        "</arg_value></tool_call> #}{% for m in messages %}{{ m.content }}:{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|><think>{% endif %}",
        {"<arg_key>", "<arg_value>"}, "deepseek-r1", "glm45",
    ),
    "the suite's tool template": ("{# tool calls: <tool_call> {json} </tool_call> #}", set(),
                                  None, None),
}  # fmt: skip
# what SGLang detects that this engine does not read
UNSERVED = {
    "beam": ("<|channel|>{{ x }}<rfl:parameter", "beam", "beam"),
    "deepseek-v4": (f"<{BAR}DSML{BAR}tool_calls>", "deepseek_v4", "deepseekv4"),
}


class Vocab:
    """A tokenizer as the rules read it: its vocabulary."""

    def __init__(self, tokens: set[str], template: str | None = None) -> None:
        self.tokens = tokens
        self.chat_template = template

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(sorted(self.tokens))}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_families_template_gets_sglangs_parsers(family: str) -> None:
    template, vocab, reasoning, tool = FAMILIES[family]
    found = template_parsers(template, Vocab(vocab))
    assert found == {"reasoning_parser": reasoning, "tool_call_parser": tool}


def test_the_reasoning_mode_is_sglangs_including_its_effort_and_glm53() -> None:
    """Nemotron 3's toggle carries its effort switch (so it is not Qwen3's); GLM-5.3's header
    makes reasoning always on; no template, nothing."""
    assert reasoning_mode(FAMILIES["nemotron-3"][0]) == (
        False,
        Toggle("enable_thinking", True, effort_kwarg="low_effort"),
    )
    glm53 = "[gMASK]<sop>Reasoning Effort: {{ e }}<tool_call><arg_key><arg_value>"
    assert reasoning_mode(glm53) == (True, Toggle(special="always"))
    assert template_parsers(glm53) == {"reasoning_parser": "glm45", "tool_call_parser": "glm45"}
    assert reasoning_mode(None) == (False, None)
    assert template_parsers(None) == {"reasoning_parser": None, "tool_call_parser": None}


def test_a_model_without_a_template_is_known_by_its_architecture(tmp_path: Path) -> None:
    """SGLang's _architecture_auto_parsers: the first architecture, or the model_type."""
    assert architecture_parsers({"architectures": ["DeepseekV3ForCausalLM"]}) == (
        "deepseek-v3",
        "deepseekv32",
    )
    assert architecture_parsers({"model_type": "minimax_m2"}) == ("minimax", "minimax-m2")
    v41 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41"}
    assert architecture_parsers(v41) == ("deepseek-v41", "deepseekv41")
    assert architecture_parsers({"architectures": ["LlamaForCausalLM"]}) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MiniMaxM2ForCausalLM"]}))
    with capture_logs() as logs:
        found = resolve_auto(
            ["tool_call_parser", "reasoning_parser"],
            chat_template=None,
            tokenizer=Vocab(set()),
            model_dir=tmp_path,
        )
    assert {k: v.parser for k, v in found.items()} == {
        "reasoning_parser": "minimax",
        "tool_call_parser": "minimax-m2",
    }
    said = [log["message"] for log in logs]
    assert (
        "Auto-detected --tool-call-parser as 'minimax-m2' from model architecture "
        "'MiniMaxM2ForCausalLM'" in said
    )
    # GLM-5.3's checkpoint template: SGLang's Python template's parsers
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"]}))
    glm53 = "[gMASK]<sop>Reasoning Effort: {{ e }}<tool_call><arg_key><arg_value>"
    found = resolve_auto(
        ["tool_call_parser"], chat_template=None, tokenizer=Vocab(set(), glm53), model_dir=tmp_path
    )
    assert found["tool_call_parser"].parser == "glm47"


def test_auto_logs_as_sglang_and_refuses_what_the_engine_does_not_read(tmp_path: Path) -> None:
    with capture_logs() as logs:
        found = resolve_auto(
            ["reasoning_parser", "tool_call_parser"],
            chat_template=QWEN3,
            tokenizer=Vocab(set()),
            model_dir=tmp_path,
        )
    assert (found["reasoning_parser"].parser, found["tool_call_parser"].parser) == ("qwen3", "qwen")
    assert [log["message"] for log in logs] == [
        "Auto-detected --reasoning-parser as 'qwen3' from chat template",
        "Auto-detected --tool-call-parser as 'qwen' from chat template",
    ]
    with capture_logs() as logs:
        found = resolve_auto(
            ["tool_call_parser"], chat_template=QWEN_LIKE, tokenizer=None, model_dir=None
        )
    assert found["tool_call_parser"].parser is None
    assert [log["message"] for log in logs] == [
        "--tool-call-parser=auto specified but could not detect tool-call parser from chat "
        "template. Disabling tool-call parser."
    ]
    for template, rule, parser in UNSERVED.values():
        with pytest.raises(ParserRefused) as refused:
            resolve_auto(
                ["tool_call_parser"], chat_template=template, tokenizer=None, model_dir=None
            )
        words = str(refused.value)
        assert f"{parser!r}" in words and f"rule {rule!r}" in words, words
        assert "pass --tool-call-parser with one it reads" in words
    # a .jinja file is read as SGLang reads it: its \n escapes made newlines
    file = tmp_path / "t.jinja"
    file.write_text("{{ '<|im_start|>assistant\\n<think>\\n' }}")
    assert resolve_auto(["reasoning_parser"], chat_template=str(file), tokenizer=None,
                        model_dir=None)["reasoning_parser"].parser == "deepseek-r1"  # fmt: skip


def test_without_a_parser_tool_calls_stay_in_the_content() -> None:
    """SGLang without --tool-call-parser (_tool_call_parsing_active): a request with tools is
    rendered with them, its answer's calls left in the content, finish_reason the
    generation's; the same template with auto reads them as Qwen's."""
    tokenizer = char_tokenizer(
        string.printable, special=["<|im_start|>", "<|im_end|>"], template=QWEN3
    )
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 1}, "prompt_tokens": 5,
            "completion_tokens": 4, "weight_version": "7"}  # fmt: skip
    native = {"text": "ok " + call, "output_ids": [3] * 4, "meta_info": meta}
    answers = {}
    for parser in (None, "auto"):
        settings = ChatSettings.of(tokenizer, Path("."), tool_call_parser=parser)
        assert settings is not None
        _, options = chat_request(body, settings, 512)
        answers[parser] = chat_response([native], options)["choices"][0]
    plain = answers[None]
    assert plain["finish_reason"] == "stop" and plain["message"].get("tool_calls") is None
    assert plain["message"]["content"] == "ok " + call
    read = answers["auto"]
    assert read["finish_reason"] == "tool_calls" and read["message"]["content"] == "ok"
    assert read["message"]["tool_calls"][0]["function"]["name"] == "add"


# ---- a real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("auto-engine")
    model = make_tiny_model(root / "model", vocab=128, seed=2)
    (root / "qwen3.jinja").write_text(QWEN3)
    (root / "beam.jinja").write_text(UNSERVED["beam"][0])
    return model


@pytest.fixture(scope="module")
def auto_engine(model_dir: Path) -> Iterator[tuple[str, Path]]:
    output = model_dir.parent / "engine.log"
    flags = ("--chat-template", str(model_dir.parent / "qwen3.jinja"),
             "--tool-call-parser", "auto", "--reasoning-parser", "auto")  # fmt: skip
    with builtin_engine(model_dir, *flags, output=output) as url:
        yield url, output


@pytest.mark.timeout(120)
def test_an_engine_started_with_auto_serves_the_parsers_sglang_detects(
    auto_engine: tuple[str, Path],
) -> None:
    url, output = auto_engine
    said = output.read_text()
    assert "Auto-detected --tool-call-parser as 'qwen' from chat template" in said
    assert "Auto-detected --reasoning-parser as 'qwen3' from chat template" in said
    for route in ("/server_info", "/model_info"):
        info = requests.get(url + route, timeout=30).json()
        assert (info["tool_call_parser"], info["reasoning_parser"]) == ("qwen", "qwen3"), route


@pytest.mark.timeout(120)
def test_an_engine_refuses_to_start_on_a_parser_it_does_not_read(model_dir: Path) -> None:
    flags = ("--chat-template", str(model_dir.parent / "beam.jinja"), "--tool-call-parser", "auto")
    done = subprocess.run(
        [*engine_command(model_dir, *flags), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        env=_env(),
    )
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "--tool-call-parser auto: SGLang detects 'beam'" in said and "rule 'beam'" in said
    assert "Traceback" not in said


def _env() -> dict[str, Any]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
