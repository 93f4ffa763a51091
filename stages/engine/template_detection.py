"""``--tool-call-parser auto`` and ``--reasoning-parser auto``: the parsers a chat template
needs, found as SGLang 0.5.23 finds them (``srt/parser/template_detection.py``).

A template is read with the tokenizer's vocabulary (``Detection``: its text, its reasoning
toggle and whether its prompt always opens the reasoning, ``reasoning_mode``) and SGLang's
rules are tried in SGLang's order, the first that holds naming the parser
(``REASONING_RULES``, ``TOOL_CALL_RULES``; ``detect``). A model without a readable template is
known by its ``config.json`` architecture or ``model_type`` (``architecture_parsers``); a
GLM-5.3 checkpoint whose template SGLang replaces with its Python template gets that one's
parsers (``python_template``); a tokenizer's ``response_template`` gives SGLang's
``response_template`` parser.

``resolve_auto`` does it once at the engine's start, as SGLang's ``resolve_auto_parsers``, and
logs as it logs (``Auto-detected --tool-call-parser as 'qwen' from chat template``; nothing
found: its warning, the parser disabled). A parser SGLang would pick that the built-in engine
does not read refuses the start (``ParserRefused``): the engine cannot serve the model as
SGLang would, and says which parser, found by which rule, and what to pass instead.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from stages.engine.reasoning import PARSERS as REASONING_PARSERS
from stages.engine.reasoning import Toggle, template_toggle
from stages.engine.tool_calls import PARSERS as TOOL_CALL_PARSERS

__all__ = [
    "REASONING_RULES",
    "TOOL_CALL_RULES",
    "Detected",
    "Detection",
    "ParserRefused",
    "Rule",
    "architecture_parsers",
    "detect",
    "detection",
    "python_template",
    "reasoning_mode",
    "resolve_auto",
    "template_parsers",
]

log = structlog.get_logger("stages.engine.template_detection")

# the flags' names, what SGLang's messages call them, and what the engine serves of them
_FLAGS = {
    "reasoning_parser": ("--reasoning-parser", "reasoning parser", tuple(REASONING_PARSERS)),
    "tool_call_parser": ("--tool-call-parser", "tool-call parser", tuple(TOOL_CALL_PARSERS)),
}


@dataclass(frozen=True)
class Detection:
    """What SGLang's rules read of a chat template (``TemplateDetectionContext``)."""

    text: str
    toggle: Toggle | None  # how the template turns reasoning on (``reasoning_config``)
    always: bool  # its prompt always opens the reasoning (``force_reasoning``)
    vocab: frozenset[str]  # the tokenizer's tokens, added ones too

    def has(self, needle: str) -> bool:
        return needle in self.text

    def token(self, token: str) -> bool:
        return token in self.vocab

    def matches(self, pattern: str, flags: int = 0) -> bool:
        return re.search(pattern, self.text, flags) is not None

    def token_matches(self, pattern: str) -> bool:
        compiled = re.compile(pattern)
        return any(isinstance(tok, str) and compiled.search(tok) for tok in self.vocab)


@dataclass(frozen=True)
class Rule:
    """One of SGLang's ``DetectionRule``: its name, the parser it names, when it holds."""

    name: str
    value: str
    holds: Callable[[Detection], bool]


_ON = Toggle("enable_thinking", True)  # ReasoningToggleConfig("enable_thinking", True)
_OFF = Toggle("enable_thinking", False)


def reasoning_mode(template: str | None) -> tuple[bool, Toggle | None]:
    """``(always reasons, toggle)``: SGLang's ``detect_reasoning_pattern`` (its
    ``REASONING_MODE_RULES``: the engine's ``template_toggle`` with GLM-5.3's always-on rule,
    which comes after the three others that make reasoning always on)."""
    if template is None:
        return False, None
    always, toggle = template_toggle(template)
    if not always and _is_glm53(Detection(template, None, False, frozenset())):
        return True, Toggle(special="always")
    return always, toggle


# -- SGLang's predicates, over a template and a vocabulary ---------------------------------------


def _is_apertus2509(t: Detection) -> bool:
    return t.token("<|inner_prefix|>")


def _is_gemma4(t: Detection) -> bool:
    return t.has("<|channel>")


def _is_kimi(t: Detection) -> bool:
    return t.has("◁think▷")


def _is_interns1(t: Detection) -> bool:
    return t.has("default_thinking_sys") and t.toggle == _ON


def _is_mistral(t: Detection) -> bool:
    return t.toggle is not None and t.toggle.special == "mistral"


def _is_beam(t: Detection) -> bool:
    return t.has("<|channel|>") and t.has("<rfl:parameter")


def _is_gpt_oss(t: Detection) -> bool:
    return t.has("<|channel|>")


def _is_kimi_k2(t: Detection) -> bool:
    return t.token("<|tool_calls_section_begin|>")


def _is_k2_v3(t: Detection) -> bool:
    return t.has("<ifm|think>") and t.has("<ifm|tool_calls>") and t.has("<ifm|tool_call>")


def _thinks_by_default(t: Detection) -> bool:
    return t.toggle is not None and t.toggle.param == "enable_thinking" and t.toggle.default is True


def _is_granite_thinking(t: Detection) -> bool:
    # Nemotron 3's templates have the same <parameter= calls; defer_loading is Granite's
    return t.has("truncate_history_thinking") and t.has("defer_loading") and _thinks_by_default(t)


def _is_nemotron_3(t: Detection) -> bool:
    return t.has("truncate_history_thinking") and _thinks_by_default(t)


def _is_glm45(t: Detection) -> bool:
    return (
        (t.has("[gMASK]<sop>") or t.matches(r"(?<!<)/nothink") or t.matches(r"(?<!<)/think"))
        and t.token("<tool_call>")
        and t.toggle == _ON
        and (t.token("<|user|>") or t.token("<|endoftext|>"))
    )


def _is_glm53(t: Detection) -> bool:
    # GLM-4.5's prompt and calls, an always-on "Reasoning Effort:" header for the toggle
    return (
        t.has("[gMASK]<sop>")
        and t.has("Reasoning Effort:")
        and not t.has("enable_thinking")
        and t.has("<tool_call>")
        and t.has("<arg_key>")
        and t.has("<arg_value>")
    )


def _is_glm_family(t: Detection) -> bool:
    return _is_glm45(t) or _is_glm53(t)


def _is_glm47(t: Detection) -> bool:
    return _is_glm_family(t) and t.matches(r"\{\{[-\s]*['\"]<tool_call>['\"]\s*[+~]\s*tc\.name")


def _is_xml_kv(t: Detection) -> bool:
    # GLM-4.5's call format by its added tokens (Ring-2.6 borrows it)
    return t.token("<arg_key>") and t.token("<arg_value>")


def _is_deepseek_v31(t: Detection) -> bool:
    return t.has("<\uff5ctool\u2581calls\u2581begin\uff5c>") and t.has(
        "<\uff5ctool\u2581sep\uff5c>"
    )


def _is_deepseek_v32(t: Detection) -> bool:
    return t.has("<\uff5cDSML\uff5cfunction_calls>")


def _is_deepseek_v4(t: Detection) -> bool:
    return t.has("<\uff5cDSML\uff5ctool_calls>")


def _is_deepseek_v41(t: Detection) -> bool:
    return t.has("<\uff5cDSML\uff5c calls>")


def _is_hunyuan(t: Detection) -> bool:
    # Hy3's special tokens may carry a suffix (<tool_calls:opensource>)
    calls = t.has("<tool_calls>") or t.token_matches(r"^<tool_calls(?::[^>]+)?>$")
    sep = t.has("<tool_sep>") or t.token_matches(r"^<tool_sep(?::[^>]+)?>$")
    return (
        (calls and sep)
        or (
            calls
            and t.toggle == Toggle(special="hunyuan_effort")
            and t.token_matches(r"^<arg_key(?::[^>]+)?>$")
            and t.token_matches(r"^<arg_value(?::[^>]+)?>$")
        )
        or (t.has("reasoning_effort") and t.has("interleaved_thinking"))
    )


def _is_poolside_v1(t: Detection) -> bool:
    tool_format = (
        t.has("<arg_key>")
        and t.has("<arg_value>")
        and (
            t.has("unescaped XML-like object")
            or t.has("All available function signatures are listed below")
        )
    )
    return tool_format or (
        t.toggle == _OFF
        and not _is_hunyuan(t)
        and (t.has("<arg_key>") or t.token("<arg_key>"))
        and (t.has("<arg_value>") or t.token("<arg_value>"))
    )


def _is_mimo(t: Detection) -> bool:
    return t.toggle == _OFF


def _is_minimax(t: Detection) -> bool:
    return t.has("<minimax:tool_call>")


def _is_minimax_m3(t: Detection) -> bool:
    return t.has("<mm:think>") or t.has("]<]minimax[>[")


def _is_minicpm5(t: Detection) -> bool:
    if t.token("<function") and t.token("<param"):
        return True
    return t.matches(r"<function\s+name=") and t.matches(r"<param\s+name=")


def _is_lfm2(t: Detection) -> bool:
    return (t.has("<|tool_call_start|>") or t.token("<|tool_call_start|>")) and (
        t.has("<|tool_call_end|>") or t.token("<|tool_call_end|>")
    )


def _is_step3p5(t: Detection) -> bool:
    return t.matches(r"Step-?3(?:\.|p)?[57]", re.IGNORECASE) or (
        t.has("reasoning_effort") and t.has("Reasoning: ") and _is_qwen3_coder(t)
    )


def _is_step3(t: Detection) -> bool:
    return t.has("<steptml:invoke") or (
        t.has("<\uff5ctool_calls_begin\uff5c>") and t.has("<\uff5ctool_sep\uff5c>")
    )


def _is_qwen3_coder(t: Detection) -> bool:
    return t.has("<function=") and t.has("<parameter=")


def _is_qwen3(t: Detection) -> bool:
    return t.toggle == _ON


def _is_ling3(t: Detection) -> bool:
    return (
        t.has("<role>SYSTEM</role>")
        and t.has("<role>ASSISTANT</role>")
        and t.has("<|role_end|>")
        and t.has("<arg_key>")
        and t.has("<arg_value>")
    )


def _is_deepseek_v3(t: Detection) -> bool:
    return t.toggle == Toggle("thinking", False)


def _is_deepseek_r1(t: Detection) -> bool:
    return t.always


def _is_deepseek_r1_think_tags(t: Detection) -> bool:
    return not _is_lfm2(t) and (t.has("<think>") or t.has("</think>"))


def _is_gigachat35(t: Detection) -> bool:
    return t.has("<\uff5cGCML\uff5ctool_calls>")


def _is_iquest_q1(t: Detection) -> bool:
    return t.has("<|iquest_assistant|>")


# SGLang's REASONING_PARSER_RULES, in its order
REASONING_RULES = (
    Rule("iquest_q1", "iquest_q1", _is_iquest_q1),
    Rule("k2_horizon", "k2_horizon", _is_k2_v3),
    Rule("apertus2509", "apertus2509", _is_apertus2509),
    Rule("gemma4", "gemma4", _is_gemma4),
    Rule("kimi", "kimi", _is_kimi),
    Rule("interns1", "interns1", _is_interns1),
    Rule("mistral", "mistral", _is_mistral),
    Rule("beam", "beam", _is_beam),
    Rule("gpt_oss", "gpt-oss", _is_gpt_oss),
    Rule("kimi_k2", "kimi_k2", _is_kimi_k2),
    Rule("granite_thinking_parser", "granite_thinking_parser", _is_granite_thinking),
    Rule("nemotron_3", "nemotron_3", _is_nemotron_3),
    Rule("glm45", "glm45", _is_glm_family),
    Rule("hunyuan", "hunyuan", _is_hunyuan),
    Rule("poolside_v1", "poolside_v1", _is_poolside_v1),
    Rule("mimo", "mimo", _is_mimo),
    Rule("minimax_m3", "minimax-m3", _is_minimax_m3),
    Rule("minimax", "minimax", _is_minimax),
    Rule("step3p5", "step3p5", _is_step3p5),
    Rule("step3", "step3", _is_step3),
    Rule("ling3", "ling3", _is_ling3),
    Rule("qwen3", "qwen3", _is_qwen3),
    Rule("deepseek_v41", "deepseek-v41", _is_deepseek_v41),
    Rule("deepseek_v4", "deepseek-v4", _is_deepseek_v4),
    Rule("deepseek_v3", "deepseek-v3", _is_deepseek_v3),
    Rule("gigachat35", "gigachat35", _is_gigachat35),
    Rule("deepseek_r1_force", "deepseek-r1", _is_deepseek_r1),
    Rule("deepseek_r1_think_tags", "deepseek-r1", _is_deepseek_r1_think_tags),
)

# SGLang's TOOL_CALL_PARSER_RULES, in its order (the same predicates, other names)
TOOL_CALL_RULES = (
    Rule("iquest_q1", "iquest_q1", _is_iquest_q1),
    Rule("gigachat35", "gigachat35", _is_gigachat35),
    Rule("k2_horizon", "k2_horizon", _is_k2_v3),
    Rule("apertus2509", "apertus2509", _is_apertus2509),
    Rule("gemma4", "gemma4", _is_gemma4),
    Rule("beam", "beam", _is_beam),
    Rule("gpt_oss", "gpt-oss", _is_gpt_oss),
    Rule("kimi_k2", "kimi_k2", _is_kimi_k2),
    Rule("minimax_m3", "minimax-m3", _is_minimax_m3),
    Rule("minimax", "minimax-m2", _is_minimax),
    Rule("interns1", "interns1", _is_interns1),
    Rule("mistral", "mistral", _is_mistral),
    Rule("deepseek_v41", "deepseekv41", _is_deepseek_v41),
    Rule("deepseek_v4", "deepseekv4", _is_deepseek_v4),
    Rule("deepseek_v32", "deepseekv32", _is_deepseek_v32),
    Rule("deepseek_v31", "deepseekv31", _is_deepseek_v31),
    Rule("lfm2", "lfm2", _is_lfm2),
    Rule("glm47", "glm47", _is_glm47),
    Rule("glm45", "glm45", _is_glm_family),
    Rule("minicpm5", "minicpm5", _is_minicpm5),
    Rule("hunyuan", "hunyuan", _is_hunyuan),
    Rule("poolside_v1", "poolside_v1", _is_poolside_v1),
    Rule("step3p5", "step3p5", _is_step3p5),
    Rule("step3", "step3", _is_step3),
    Rule("ling3", "ling3", _is_ling3),
    Rule("xml_kv_tool_call", "glm45", _is_xml_kv),
    Rule("mimo", "mimo", _is_mimo),
    Rule("qwen3_coder", "qwen3_coder", _is_qwen3_coder),
    Rule("qwen", "qwen", _is_qwen3),
    Rule("deepseek_v3", "deepseekv3", _is_deepseek_v3),
    Rule("deepseek_r1", "deepseekv3", _is_deepseek_r1),
)

_RULES = {"reasoning_parser": REASONING_RULES, "tool_call_parser": TOOL_CALL_RULES}


def _vocab(tokenizer: Any) -> frozenset[str]:
    if tokenizer is None:
        return frozenset()
    try:
        return frozenset(tokenizer.get_vocab())
    except Exception as exc:  # SGLang goes on without the vocabulary's rules too
        log.warning("template_detection_vocab_unreadable", error=str(exc))
        return frozenset()


def detection(template: str | None, tokenizer: Any = None) -> Detection | None:
    """What the rules read of ``template`` with ``tokenizer``'s vocabulary (None: no
    template; ``build_detection_context`` with ``detect_reasoning_pattern``'s inputs)."""
    if template is None:
        return None
    always, toggle = reasoning_mode(template)
    return Detection(template, toggle, always, _vocab(tokenizer))


def detect(t: Detection, rules: Iterable[Rule]) -> Rule | None:
    """The first of ``rules`` that holds (``match_rules``: one that raises is skipped)."""
    for rule in rules:
        try:
            if rule.holds(t):
                return rule
        except Exception as exc:
            log.warning("template_detection_rule_failed", rule=rule.name, error=str(exc))
    return None


def template_parsers(template: str | None, tokenizer: Any = None) -> dict[str, str | None]:
    """The reasoning and tool-call parsers SGLang finds in ``template`` (None: none)."""
    t = detection(template, tokenizer)
    found = {}
    for attr, rules in _RULES.items():
        rule = None if t is None else detect(t, rules)
        found[attr] = None if rule is None else rule.value
    return found


def _config(model_dir: Path | None) -> dict[str, Any]:
    if model_dir is None:
        return {}
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _arch(config: dict[str, Any]) -> tuple[str, str]:
    architectures = config.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else ""
    return str(arch), str(config.get("model_type") or "")


def architecture_parsers(config: dict[str, Any]) -> tuple[str, str] | None:
    """``(reasoning parser, tool-call parser)`` a model's ``config.json`` names by its
    architecture or ``model_type`` (``_architecture_auto_parsers``; None: none)."""
    arch, model_type = _arch(config)
    if "KimiK3" in arch or model_type == "kimi_k3":
        return "kimi_k3", "kimi_k3"
    if arch == "IQuestQ1ForCausalLM":
        return "iquest_q1", "iquest_q1"
    if arch in (
        "BailingMoeV3ForCausalLM",
        "BailingMoeV3VLForConditionalGeneration",
    ) or model_type in ("bailing_hybrid", "bailing_moe_v3_vl"):
        return "ling3", "ling3"
    if model_type == "deepseek_v41" or "DeepseekV41" in arch:
        return "deepseek-v41", "deepseekv41"
    if "DeepseekV4" in arch:
        return "deepseek-v4", "deepseekv4"
    if "DeepseekV3" in arch:
        return "deepseek-v3", "deepseekv32"
    if arch in (
        "MiniMaxM3SparseForCausalLM",
        "MiniMaxM3SparseForConditionalGeneration",
    ) or model_type in ("minimax_m3", "minimax_m3_vl"):
        return "minimax-m3", "minimax-m3"
    if arch == "MiniMaxM2ForCausalLM" or model_type == "minimax_m2":
        return "minimax", "minimax-m2"
    return None


# the Python templates SGLang renders GLM-5.3 checkpoints with, by architecture
_GLM53_TEMPLATES = {
    "GlmMoeDsaForCausalLM": "glm-5.3",
    "Glm5NextForConditionalGeneration": "glm-5.3-flash",
}


def python_template(template: str | None, config: dict[str, Any]) -> str | None:
    """The name of SGLang's Python chat template that replaces a checkpoint's ``template``
    (``resolve_python_chat_template``: GLM-5.3's, text-only or multimodal as its architecture;
    None: none), whose parsers are ``glm45`` and ``glm47``."""
    arch, _ = _arch(config)
    if arch not in _GLM53_TEMPLATES or template is None:
        return None
    if not _is_glm53(Detection(template, None, False, frozenset())):
        return None
    multimodal = "<|begin_of_image|>" in template
    if multimodal != (arch == "Glm5NextForConditionalGeneration"):
        return None
    return _GLM53_TEMPLATES[arch]


_PYTHON_TEMPLATE_PARSERS = {"reasoning_parser": "glm45", "tool_call_parser": "glm47"}


def _response_template(tokenizer: Any) -> dict[str, Any] | None:
    """The tokenizer configuration's ``response_template`` (``resolve_response_template``)."""
    template = getattr(tokenizer, "response_template", None)
    if not isinstance(template, dict):
        template = (getattr(tokenizer, "init_kwargs", None) or {}).get("response_template")
    return template if isinstance(template, dict) else None


@dataclass(frozen=True)
class Detected:
    """An ``auto`` flag's parser (None: disabled), what found it (``chat template``, ``model
    architecture 'X'``...) and the rule."""

    parser: str | None
    source: str = ""
    rule: str = ""


class ParserRefused(ValueError):
    """``auto`` found a parser the built-in engine does not read."""


def resolve_auto(
    needs: Iterable[str],
    *,
    chat_template: str | None,
    tokenizer: Any,
    model_dir: Path | None,
) -> dict[str, Detected]:
    """The parsers of the flags in ``needs`` (``reasoning_parser``, ``tool_call_parser``: those
    given as ``auto``), as SGLang's ``resolve_auto_parsers`` decides them: from the
    ``--chat-template`` given (a ``.jinja`` file read as SGLang reads it; other text as it is
    rendered) or the tokenizer's template; without one, from the model's architecture; then
    from the tokenizer's ``response_template``. Logged as SGLang logs them; ``ParserRefused``
    for one the engine does not read."""
    needs = [attr for attr in _FLAGS if attr in set(needs)]
    if not needs:
        return {}
    template = _explicit_template(chat_template)
    if template is None and tokenizer is not None:
        own = getattr(tokenizer, "chat_template", None)
        template = own if isinstance(own, str) else None
    config = _config(model_dir)
    found: dict[str, Detected] = {}
    python = python_template(template, config) if chat_template is None else None
    if python is not None:
        for attr in needs:
            found[attr] = Detected(
                _PYTHON_TEMPLATE_PARSERS[attr],
                f"Python chat template '{python}'",
                "python_chat_template",
            )
    else:
        t = detection(template, tokenizer)
        if t is not None:
            for attr in needs:
                rule = detect(t, _RULES[attr])
                if rule is not None:
                    found[attr] = Detected(rule.value, "chat template", rule.name)
        elif chat_template is None:
            parsers = architecture_parsers(config)
            if parsers is not None:
                arch = _arch(config)[0]
                for attr, parser in zip(_FLAGS, parsers, strict=True):
                    if attr in needs:
                        found[attr] = Detected(
                            parser, f"model architecture '{arch}'", "architecture"
                        )
        response = _response_template(tokenizer) if chat_template is None else None
        fields = (response or {}).get("fields")
        if isinstance(fields, dict):
            pairs = (("reasoning_parser", "thinking"), ("tool_call_parser", "tool_calls"))
            for attr, field in pairs:
                if attr in needs and attr not in found and field in fields:
                    found[attr] = Detected(
                        "response_template", "tokenizer configuration", "response_template"
                    )
    for attr in needs:  # a parser the engine cannot serve: before anything is said of it
        flag, label, served = _FLAGS[attr]
        got = found.get(attr)
        if got is not None and got.parser not in served:
            raise ParserRefused(
                f"{flag} auto: SGLang detects {got.parser!r} from the {got.source} (its rule "
                f"{got.rule!r}), a {label} the built-in engine does not read; pass {flag} "
                f"with one it reads ({', '.join(served)}), or leave {flag} out"
            )
    for attr in needs:  # as SGLang logs them: what it found, then what it did not
        got = found.get(attr)
        if got is not None:
            flag = _FLAGS[attr][0]
            log.info(
                "engine_parser_auto_detected",
                flag=flag,
                parser=got.parser,
                rule=got.rule,
                message=f"Auto-detected {flag} as '{got.parser}' from {got.source}",
            )
    for attr in needs:
        if attr not in found:
            flag, label, _ = _FLAGS[attr]
            found[attr] = Detected(None)
            log.warning(
                "engine_parser_not_detected",
                flag=flag,
                message=f"{flag}=auto specified but could not detect {label} from chat "
                f"template. Disabling {label}.",
            )
    return found


def _explicit_template(chat_template: str | None) -> str | None:
    """``--chat-template``'s text for detection: a ``.jinja`` file as SGLang reads it (its
    ``\\n`` escapes made newlines, ``_load_explicit_jinja_template``), another file's text,
    or the template given inline."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    try:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            return text.replace("\\n", "\n") if chat_template.endswith(".jinja") else text
    except (OSError, ValueError):
        return None
    return chat_template
