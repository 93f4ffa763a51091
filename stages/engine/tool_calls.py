"""Tool calls in generated text, whole or as it streams, in the format SGLang's
``--tool-call-parser`` names: ``qwen25`` (also ``qwen``), ``hermes``, ``llama3``, ``mistral``
(``stages.engine.tool_formats``), ``pythonic`` (``stages.engine.pythonic_calls``),
``qwen3_coder`` (also ``step3p5`` and ``nanbeige``, which SGLang reads with the same detector),
``deepseekv3`` and ``deepseekv31`` (``stages.engine.deepseek_calls``), ``deepseekv32``
(``stages.engine.dsml_calls``), ``kimi_k2`` (``stages.engine.kimi_calls``), ``glm45`` (also
``glm``) and ``ling3`` (``stages.engine.glm_calls``),
``glm47`` (``stages.engine.glm47_calls``; its calls held by a grammar of the whole answer,
``stages.engine.glm_grammar``, rather than a structural tag),
``gpt-oss`` (OpenAI's Harmony messages: ``stages.engine.harmony``), ``trinity`` (Qwen 2.5's
calls, ``<think>`` tags taken out first), ``minimax-m2`` (``stages.engine.minimax_calls``),
``mimo`` (``stages.engine.mimo_calls``), ``interns1`` (``stages.engine.internlm_calls``),
``gemma4`` (``stages.engine.gemma4_calls``), ``iquest_q1`` (``stages.engine.iquest_calls``),
``cohere_command4`` (``stages.engine.cohere_calls``), ``gigachat35`` and ``gigachat3``
(``stages.engine.gigachat_calls``), ``apertus2509`` (``stages.engine.apertus_calls``),
``spark25`` (``stages.engine.spark_calls``: forced calls not constrained, as SGLang's),
``step3`` (``stages.engine.step3_calls``), ``poolside_v1`` (``stages.engine.poolside_calls``),
``dots`` (``stages.engine.dots_calls``), ``minicpm5`` (``stages.engine.minicpm_calls``),
``minimax-m3`` (``stages.engine.minimax_m3_calls``: read in a request without tools too,
``PARSES_WITHOUT_TOOLS``), ``lfm2`` (``stages.engine.lfm2_calls``), ``hunyuan``
(``stages.engine.hunyuan_calls``: its tokens as the served tokenizer spells them, forced calls
not constrained, as SGLang's), ``muse`` (``stages.engine.muse_calls``: forced calls not
constrained, as SGLang's), ``k2_horizon`` (``stages.engine.k2_horizon_calls``), ``inkling``
(``stages.engine.inkling_calls``: its own legacy tag, a trigger a tool; its ``auto`` tag of
token ids not served), ``kimi_k3`` (``stages.engine.kimi_k3_calls``: no answer constrained,
where SGLang's are, ``UNCONSTRAINED``); and how a forced
``tool_choice`` constrains an answer to calls in that format (``forced_calls``), or a strict
tool the calls of an ``auto`` one (``strict_calls``).

``qwen3_coder`` (``stages.engine.qwen3_coder_calls``) is read with the request's tools, whose
parameters type its values; a forced ``tool_choice`` constrains it as ``pythonic`` (SGLang's
xgrammar has a structural tag of its own for it, which llguidance has not).

``ToolCallParser`` reads a request's answer in one format (``--tool-call-parser``'s; ``auto``:
the one SGLang detects from the chat template, ``stages.engine.template_detection``; without
the flag, none: tool calls stay in content, as SGLang's): ``parse`` the whole answer, as the chat
route's ``_process_tool_calls`` does (its calls numbered in order there), ``indexed`` with each
call's ``tool_index`` as ``/parse_function_call`` answers it, ``stream`` the answer as it comes
(``StreamingToolCalls``: content to send now and the pieces of the calls, which add up to what
the whole answer holds; each format's module says where SGLang's stream differs).

Forced (``tool_choice`` ``required`` or a named function), as SGLang's
``FunctionCallParser.get_structure_constraint``: a format with a structure (all but
``pythonic``) gets the structural tag of its calls (``call_tag``) and its answer is read in that
format; ``pythonic`` has none, so the answer is constrained by JSON schema to
``[{"name", "parameters"}, ...]`` (``utils.get_json_schema_constraint``: one item at most with
``parallel_tool_calls`` false) and read as that array (``answer_format``: ``json_array``).
With ``tool_choice`` ``auto`` and a ``strict`` tool (``should_constrain_auto``), a format with a
structure gets the same tag without ``at_least_one``: free text, each call held to its tool's
schema once its trigger begins it.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import structlog

from stages.engine.apertus_calls import FRAMES as APERTUS_FRAMES
from stages.engine.apertus_calls import ApertusCalls
from stages.engine.cohere_calls import CohereCalls
from stages.engine.deepseek_calls import FRAMES as DEEPSEEK_FRAMES
from stages.engine.deepseek_calls import DeepSeekV3Calls, DeepSeekV31Calls
from stages.engine.dots_calls import DotsCalls
from stages.engine.dsml_calls import FRAMES as DSML_FRAMES
from stages.engine.dsml_calls import DeepSeekV32Calls
from stages.engine.gemma4_calls import Gemma4Calls
from stages.engine.gigachat_calls import GigaChat3Calls, GigaChat35Calls
from stages.engine.glm47_calls import Glm47Calls
from stages.engine.glm_calls import GlmCalls, Ling3Calls
from stages.engine.harmony import FRAMES as HARMONY_FRAMES
from stages.engine.harmony import GptOssCalls
from stages.engine.hunyuan_calls import HunyuanCalls
from stages.engine.hunyuan_calls import tokens as hunyuan_tokens
from stages.engine.inkling_calls import InklingCalls
from stages.engine.inkling_calls import call_tag as inkling_tag
from stages.engine.internlm_calls import FRAMES as INTERNLM_FRAMES
from stages.engine.internlm_calls import InternlmCalls
from stages.engine.iquest_calls import IQuestQ1Calls, NamedArguments
from stages.engine.k2_horizon_calls import K2HorizonCalls
from stages.engine.kimi_calls import FRAMES as KIMI_FRAMES
from stages.engine.kimi_calls import KimiK2Calls
from stages.engine.kimi_k3_calls import KimiK3Calls
from stages.engine.lfm2_calls import Lfm2Calls
from stages.engine.mimo_calls import MiMoCalls
from stages.engine.minicpm_calls import MiniCPM5Calls
from stages.engine.minimax_calls import MiniMaxM2Calls
from stages.engine.minimax_m3_calls import PARSES_WITHOUT_TOOLS, MiniMaxM3Calls
from stages.engine.muse_calls import MuseCalls
from stages.engine.native_tags import NATIVE_TAGS, served_tag
from stages.engine.partial_json import ListedCalls
from stages.engine.poolside_calls import PoolsideCalls
from stages.engine.pythonic_calls import PythonicCalls
from stages.engine.qwen3_coder_calls import Qwen3CoderCalls
from stages.engine.spark_calls import Spark25Calls
from stages.engine.step3_calls import Step3Calls
from stages.engine.tool_formats import (
    HermesCalls,
    JsonArrayCalls,
    Llama3Calls,
    MistralCalls,
    Qwen25Calls,
    TrinityCalls,
)

__all__ = [
    "NATIVE_FORCED",
    "PARSERS",
    "PARSES_WITHOUT_TOOLS",
    "UNCONSTRAINED",
    "StreamingToolCalls",
    "ToolCallParser",
    "answer_format",
    "call_tag",
    "forced_calls",
    "strict_calls",
    "unconstrained",
]

log = structlog.get_logger("stages.engine.tool_calls")

BEGIN = "<tool_call>"
# the formats, by the name the engine reads them by
_FORMATS: dict[str, Any] = {
    "qwen25": Qwen25Calls,
    "qwen": Qwen25Calls,
    "hermes": HermesCalls,
    "llama3": Llama3Calls,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
    "deepseekv3": DeepSeekV3Calls,
    "deepseekv31": DeepSeekV31Calls,
    "deepseekv32": DeepSeekV32Calls,
    "gpt-oss": GptOssCalls,
    "trinity": TrinityCalls,
    "interns1": InternlmCalls,
    "cohere_command4": CohereCalls,
    "gigachat35": GigaChat35Calls,
    "gigachat3": GigaChat3Calls,
    "apertus2509": ApertusCalls,
    "json_array": JsonArrayCalls,  # a forced answer where the format has no structural tag
    "json_arguments": NamedArguments,  # iquest_q1's forced answer to a named tool
}
# SGLang's --tool-call-parser names the engine reads
PARSERS = (
    "qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic", "qwen3_coder", "step3p5",
    "nanbeige", "deepseekv3", "deepseekv31", "kimi_k2", "glm45", "glm", "glm47", "ling3", "gpt-oss",
    "trinity", "minimax-m2", "deepseekv32", "mimo", "interns1", "gemma4", "iquest_q1",
    "cohere_command4", "gigachat35", "apertus2509", "spark25", "step3", "poolside_v1",
    "gigachat3", "dots", "minicpm5", "minimax-m3", "lfm2", "hunyuan", "muse",
    "k2_horizon", "inkling", "kimi_k3",
)  # fmt: skip
# the formats whose forced calls SGLang leaves unconstrained, reading the answer in the format
# (their detectors' parses_required_natively)
NATIVE_FORCED = frozenset({"spark25", "hunyuan", "muse"})
# the formats whose answers SGLang constrains with a model-native tag this engine cannot compile
# (Kimi K3's xgrammar tags are built of token formats): none of their answers is constrained, a
# forced one read in the format (its JSON array would not be), which ``unconstrained`` warns of
UNCONSTRAINED = frozenset({"kimi_k3"})
# the formats whose reader needs the tools' parameters (their values are typed by them, or a call
# the model left unnamed is named by them); SGLang reads step3p5's and nanbeige's calls with its
# Qwen3CoderDetector too
_TYPED = {
    "qwen3_coder": Qwen3CoderCalls, "step3p5": Qwen3CoderCalls, "nanbeige": Qwen3CoderCalls,
    "kimi_k2": KimiK2Calls, "glm45": GlmCalls, "glm": GlmCalls, "minimax-m2": MiniMaxM2Calls,
    "glm47": Glm47Calls, "ling3": Ling3Calls, "mimo": MiMoCalls, "gemma4": Gemma4Calls,
    "iquest_q1": IQuestQ1Calls, "spark25": Spark25Calls, "step3": Step3Calls,
    "poolside_v1": PoolsideCalls, "dots": DotsCalls, "minicpm5": MiniCPM5Calls,
    "minimax-m3": MiniMaxM3Calls, "lfm2": Lfm2Calls, "muse": MuseCalls,
    "k2_horizon": K2HorizonCalls, "inkling": InklingCalls, "kimi_k3": KimiK3Calls,
}  # fmt: skip
# each format's call as SGLang's detectors frame it (structure_info): (begin before the name, the
# name as JSON or as it is, begin after it, end, trigger); a format not here has no structural tag
_JSON_ARGS = ', "arguments":'
_FRAMES = {
    "qwen25": ('<tool_call>\n{"name":', True, _JSON_ARGS, "}\n</tool_call>", BEGIN),
    "qwen": ('<tool_call>\n{"name":', True, _JSON_ARGS, "}\n</tool_call>", BEGIN),
    "trinity": ('<tool_call>\n{"name":', True, _JSON_ARGS, "}\n</tool_call>", BEGIN),
    "hermes": ('<tool_call>{"name":', True, _JSON_ARGS, "}</tool_call>", BEGIN),
    "llama3": ('<|python_tag|>{"name":', True, _JSON_ARGS, "}", "<|python_tag|>"),
    "mistral": ('[TOOL_CALLS] [{"name":', True, _JSON_ARGS, "}]", "[TOOL_CALLS]"),
    **DEEPSEEK_FRAMES,
    **DSML_FRAMES,
    **INTERNLM_FRAMES,
    **KIMI_FRAMES,
    **HARMONY_FRAMES,
    **APERTUS_FRAMES,
}
# what a tool that is not strict holds its calls' arguments to (any JSON but for these: Kimi's
# reader takes only an object, and SGLang's tag for it says so)
_LOOSE = {"kimi_k2": {"type": "object"}}


class CallStream(Protocol):
    """A sample's text deltas in, content to send now and pieces of tool calls out."""

    calls: int  # calls named so far

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]: ...

    def flush(self) -> str: ...

    def unsent(self) -> list[dict[str, Any]]: ...


def call_tag(
    tools: list[dict[str, Any]], parser: str, *, at_least_one: bool = True
) -> dict[str, Any]:
    """The structural tag of tool calls to ``tools`` in the format of ``parser``, as SGLang
    builds it (``FunctionCallParser.get_legacy_structural_tag``): a structure per tool framed
    as the detector of ``parser`` frames a call (``structure_info``:
    ``<tool_call>\\n{"name":"NAME", "arguments":`` ... ``}\\n</tool_call>``, Hermes without
    the newlines, Llama 3 ``<|python_tag|>{"name":"NAME", "arguments":`` ... ``}``, Mistral
    ``[TOOL_CALLS] [{"name":"NAME", "arguments":`` ... ``}]``, DeepSeek's between its special
    tokens), whose body follows the tool's ``parameters`` when it is ``strict``, else is any
    JSON. ``at_least_one`` (``tool_choice`` ``required`` or a named function): calls only, one
    or more; else free text in which each trigger starts a call (``auto`` with a strict
    tool)."""
    before, quoted, after, end, trigger = _FRAMES[parser]
    structures = []
    for tool in tools:
        fn = tool["function"]
        name = json.dumps(fn["name"]) if quoted else fn["name"]
        loose = _LOOSE.get(parser, {})
        structures.append(
            {
                "begin": f"{before}{name}{after}",
                "schema": (fn.get("parameters") or {}) if fn.get("strict") else loose,
                "end": end,
            }
        )
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [trigger],
        "at_least_one": at_least_one,
    }


def strict_calls(
    tools: list[dict[str, Any]], parser: str | None, *, parallel: Any = True
) -> dict[str, str] | None:
    """The ``sampling_params`` that hold the calls of a ``tool_choice`` ``auto`` answer to
    their tools' schemas when a tool is ``strict`` (SGLang's ``should_constrain_auto``): the
    structural tag of ``parser``'s calls, free text around them (the model's own tag where
    SGLang's detector names one: ``native_tags``); None where no tool is strict or the format
    has no structural tag (``pythonic``: SGLang constrains nothing then)."""
    if not any(t["function"].get("strict") for t in tools):
        return None
    if parser in NATIVE_TAGS:
        tag = served_tag(parser, tools, "auto", parallel=parallel is not False)
        if tag is not None:
            return {"structural_tag": json.dumps(tag)}
    if parser == "inkling":  # a trigger a tool (its header names it)
        return {"structural_tag": json.dumps(inkling_tag(tools, at_least_one=False))}
    if parser not in _FRAMES or parser in HARMONY_FRAMES:  # Harmony: see harmony.FRAMES
        return None
    return {"structural_tag": json.dumps(call_tag(tools, parser, at_least_one=False))}


def forced_calls(
    tools: list[dict[str, Any]], parser: str | None, *, named: bool, parallel: Any
) -> dict[str, str]:
    """The ``sampling_params`` that constrain an answer to calls to ``tools`` (``named``: the
    one tool ``tool_choice`` names; ``parallel``: ``parallel_tool_calls``): the structural tag
    of ``parser``'s calls, or for a format without one (``pythonic``, or no tool-call format
    at all) SGLang's JSON schema of an array of ``{name, parameters}``
    (``get_json_schema_constraint``). ValueError, in
    SGLang's words, for tools whose ``$defs`` disagree."""
    if parser in NATIVE_FORCED or parser in UNCONSTRAINED:
        return {}
    if parser in NATIVE_TAGS:  # the model's own tag (SGLang's detector names its model)
        name = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        choice: Any = name if named else "required"
        tag = served_tag(parser, tools, choice, parallel=parallel is not False)
        if tag is not None:
            return {"structural_tag": json.dumps(tag)}
    if parser in _FRAMES:
        return {"structural_tag": json.dumps(call_tag(tools, parser))}
    if parser == "inkling":
        return {"structural_tag": json.dumps(inkling_tag(tools))}
    if parser == "iquest_q1" and named:  # IQuestQ1JsonToolParser: the tool's arguments alone
        return {"json_schema": json.dumps(tools[0]["function"].get("parameters") or {})}
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters")
                or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if named else {"type": "object", "anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    if not named:
        defs: dict[str, Any] = {}
        for tool in tools:
            parameters = tool["function"].get("parameters") or {}
            for name, value in (parameters.get("$defs") or {}).items():
                if defs.setdefault(name, value) != value:
                    raise ValueError(
                        f"Tool definition '{name}' has multiple schemas, which is not supported."
                    )
        if defs:
            schema["$defs"] = defs
    return {"json_schema": json.dumps(schema)}


def unconstrained(parser: str | None) -> None:
    """Logs, once for a server, that ``parser``'s answers go unconstrained where SGLang
    constrains them (``UNCONSTRAINED``; nothing for another parser)."""
    if parser in UNCONSTRAINED:
        log.warning(
            "native_tool_tag_not_served",
            parser=parser,
            reason="SGLang 0.5.23 constrains every request with tools by xgrammar structural "
            "tags of token formats, which the engine's structural-tag compiler does not read: "
            "answers (a forced tool_choice's, a strict tool's) are not constrained, and are "
            "read in the format",
        )


def answer_format(
    parser: str | None, forced: Mapping[str, str] | None, named: bool = False
) -> str | None:
    """The format an answer is read in: ``parser``'s, or where a forced call was constrained
    by JSON schema, that array (``json_array``), or for ``iquest_q1`` and a named tool, that
    tool's arguments (``json_arguments``)."""
    if not forced or "json_schema" not in forced:
        return parser
    return "json_arguments" if parser == "iquest_q1" and named else "json_array"


class ToolCallParser:
    """Tool calls of one request (``tools``: the request's ``tools``, validated) in the format
    ``parser`` names (one of ``PARSERS``, or ``json_array``; None: Qwen 2.5's); ``tokenizer``:
    the served one, whose vocabulary spells ``hunyuan``'s tokens (none: the bare tags)."""

    def __init__(
        self, tools: Iterable[dict[str, Any]], parser: str | None = None, tokenizer: Any = None
    ) -> None:
        tools = list(tools)
        self.names = {t["function"]["name"] for t in tools}
        typed = _TYPED.get(parser or "")
        if parser == "hunyuan":
            self.format = HunyuanCalls(tools, hunyuan_tokens(tokenizer))
        else:
            self.format = typed(tools) if typed else _FORMATS[parser or "qwen25"](self.names)

    def has_tool_call(self, text: str) -> bool:
        return self.format.has_tool_call(text)

    def stream(self) -> CallStream:
        """A stream of this request's answer."""
        return self.format.stream()

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """``(content, calls)`` of a whole generated text."""
        return self.format.parse(text)

    def indexed(
        self, text: str, places: Mapping[str, int]
    ) -> tuple[str, list[tuple[int, dict[str, str]]]]:
        """``(content, [(tool_index, call)])`` of a whole generated text, as
        ``FunctionCallParser.parse_non_stream`` numbers its calls: the named tool's place
        (``places``, by name; ``parse_base_json``), or for ``pythonic`` the call's place in its
        list, the calls dropped counted (``pythonic_detector.py:118``); for ``qwen3_coder``,
        ``kimi_k2`` and ``gpt-oss`` the call's place among the calls (their detectors)."""
        if isinstance(self.format, ListedCalls):
            return self.format.listed(text)
        content, calls = self.format.parse(text)
        return content, [(places[call["name"]], call) for call in calls]


class StreamingToolCalls:
    """Feeds a sample's text deltas; hands back content to send now and pieces of tool calls.

    A piece is ``{"index", "name", "arguments"}``: a call's first piece names it (``name``, with
    ``arguments`` "", or for ``pythonic`` all of them) as soon as its name is whole; the next
    ones (``name`` None) add to its arguments, the JSON text ``json.dumps`` gives of them
    (``ensure_ascii=False``), so the pieces of a call add up to what the non-streamed answer
    holds (each format's module says where SGLang's stream differs). ``calls``: how many calls
    were named.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._stream = parser.stream()

    @property
    def calls(self) -> int:
        return self._stream.calls

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        return self._stream.feed(delta)

    def flush(self) -> str:
        """At the end: content held back (a call never finished is dropped and logged, but
        for Hermes', which is read as it stands, its rest going out with ``unsent``)."""
        return self._stream.flush()

    def unsent(self) -> list[dict[str, Any]]:
        """At the end, after ``flush``: the piece that closes the arguments of a call cut
        short, as SGLang sends it (``partial_json.CallPieces.unsent``), or the rest of a last
        Hermes call read without its end tag."""
        return self._stream.unsent()
