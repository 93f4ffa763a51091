"""Reasoning in generated text: SGLang's ``--reasoning-parser`` for the formats its base detector
reads.

What SGLang 0.5 reads (``srt/parser/reasoning_parser.py``, ``BaseReasoningFormatDetector``):
an answer's reasoning is the text between a start tag (which the model may open itself, or the
chat template may have opened in the prompt) and an end tag; the rest is its content. The
detectors that are that algorithm with their own tags and defaults, under SGLang's names:

- ``deepseek-r1`` (also ``step3``, ``step3p5``, ``gigachat35``; ``DeepSeekR1Detector``): the
  answer is reasoning until ``</think>``, whether or not it opened with ``<think>``;
- ``qwen3`` (also ``qwen3-thinking``, ``dots``, ``minimax``, ``nanbeige``, ``interns1``;
  ``Qwen3Detector``; ``glm45``, ``nemotron_3``: ``Glm45Detector``, ``Nemotron3Detector``, the
  same arguments): reasoning when the request has thinking on (see ``thinking_on``: by default
  yes, unless ``chat_template_kwargs.enable_thinking`` is false) or the answer opens
  ``<think>``; a ``<tool_call>`` before ``</think>`` ends the reasoning too (Qwen3.5 opens
  calls without closing it). ``qwen3-thinking`` and ``minimax`` always reason;
  ``deepseek-v3`` (``thinking``), ``mimo`` and ``poolside_v1`` (``enable_thinking``) reason
  only when the request sets the switch true;
- ``kimi`` (``KimiDetector``): ``◁think▷`` ... ``◁/think▷``, reasoning only where the answer
  opens it (its detector is never forced);
- ``kimi_k2`` (``KimiK2Detector``): ``<think>`` ... ``</think>``, Kimi K2's tool calls' section
  ending it too, on unless ``chat_template_kwargs.thinking`` is false;
- ``mistral`` (``MistralDetector``): ``[THINK]`` ... ``[/THINK]``, reasoning when the request
  has a ``reasoning_effort`` other than ``none``;
- ``gemma4`` (``Gemma4Detector``): ``<|channel>thought`` and a newline ... ``<channel|>``,
  reasoning when the request sets ``enable_thinking`` true;
- ``iquest_q1`` (``IQuestQ1ReasoningDetector``): ``<think>`` ... ``</think>``, reasoning (and
  forced) unless ``chat_template_kwargs`` sets ``thinking`` / ``enable_thinking`` and neither
  is true, whatever the template says;
- ``ling3`` (``Ling3Detector``): ``glm45``'s split, an answer without content always given its
  reasoning as content (its detector's ``force_nonempty_content`` is on by default);
- ``granite_thinking_parser`` (``GraniteThinkingDetector``): ``qwen3``'s split without its
  excluded tags, the content's leading newlines taken out once there was reasoning; with
  ``enable_thinking`` false, an answer without content gets its reasoning as content;
- ``minimax-append-think`` (``MiniMaxAppendThinkDetector``): no split; the answer is content,
  ``<think>`` put before it;
- ``apertus2509`` (``Apertus2509Detector``): any number of ``<|inner_prefix|>`` ...
  ``<|inner_suffix|>`` blocks, a tool-call block inside one content
  (``stages.engine.apertus_reasoning``; never forced, always on);
- ``cohere_command4`` (``CohereCommand4Detector``): reasoning until ``<|END_THINKING|>`` or a
  text or action block, the content the ``<|START_TEXT|>`` block's inside, or an action block
  (tool calls) whole (``stages.engine.cohere_reasoning``; always on);
- ``minimax-m3`` (``MiniMaxM3Detector``): ``<mm:think>`` ... ``</mm:think>``, reasoning when
  ``chat_template_kwargs.thinking_mode`` is ``enabled``; an answer that does not start in its
  reasoning loses one ``</mm:think>`` leading it (its template writes one before earlier
  turns that did not think; streamed, the first text out of the reasoning, which after a
  forced reasoning the whole answer does not check);
- ``hunyuan`` (``HunyuanDetector``): ``<think>`` ... ``</think>`` as the served tokenizer spells
  them (Hy3's suffixed tokens: ``served_format``), ``<tool_calls>`` ending the reasoning too;
  whether a request reasons, and the ``reasoning_effort`` its template gets, from its effort
  (``stages.engine.hunyuan_reasoning``);
- ``k2_horizon`` (``K2V3Detector``): K2 Horizon's ``<ifm|think>`` ... ``</ifm|think>``, the tags
  its template writes for the request's ``reasoning_effort`` (``chat_template_kwargs``' before
  the request's field): ``medium`` ``<ifm|think_fast>``, ``low`` ``<ifm|think_faster>``, none
  ``high``'s, any other value ``medium``'s (``ThinkFormat.efforts``); always forced; an
  ``<ifm|tool_call`` (a call's or a group's tag) ends it too; a thinking request's reasoning
  tokens counted to its own end tag (``RequestReasoning.end_ids``, SGLang's request-selected
  terminator);
- ``gpt-oss`` (``GptOssDetector``): OpenAI's Harmony messages (``stages.engine.harmony``): the
  ``analysis`` channel is reasoning, always (``HarmonyReasoning`` stands in for ``ThinkParser``:
  ``ThinkFormat.harmony``); its ``<|end|>`` ends the reasoning tokens counted;
- ``muse`` (``MuseGlimmerDetector``): Muse Glimmer's recipient channels
  (``stages.engine.muse_reasoning``): the ``to=self`` channels are reasoning, the others content,
  framed for the tool-call reader where a request's calls are read (``RequestReasoning.tools``);
  always on, its ``<|eom|>`` ending the reasoning tokens counted, its answers decoded with their
  special tokens;
- ``inkling`` (``InklingDetector``): Inkling's typed messages (``stages.engine.inkling_reasoning``):
  ``<|content_thinking|>`` messages are reasoning, ``<|content_text|>`` ones content, a tool
  call's message content whole, framed for the tool-call reader; always on, its answers decoded
  with their special tokens, its reasoning tokens counted to the token id SGLang names for
  ``<|end_message|>`` (``ThinkFormat.end_ids``);
- ``kimi_k3`` (``KimiK3Detector``): Kimi K3's XTML channels, ``<|open|>think<|sep|>`` ...
  ``<|close|>think<|sep|>``, the ``response`` and ``tools`` channels ending it too, the content
  the response channel's inside with the tools channel passed on for the tool-call reader, an
  answer that closes its response before its reasoning ends all content
  (``stages.engine.kimi_k3_reasoning``); on unless ``chat_template_kwargs.thinking`` is false,
  forced where no chat request says (the parse route); its answers decoded with their special
  tokens, which its markers are.

Not here, for parsing more than tags and defaults: ``beam``, ``response_template``,
``deepseek-v4`` / ``deepseek-v41``.

``ThinkParser`` splits a whole answer (``parse``) or a stream of text deltas (``feed``, then
``finish``), as SGLang's detector does, down to the tails it holds back while they could be
the start of a tag. ``thinking_on`` is ``serving_chat._get_reasoning_from_request``:
whether a request reasons, from the chat template's toggle (``template_toggle``:
``template_detection.detect_reasoning_pattern``'s rules for these templates), else the
detector's ``reasoning_default``, and the request; ``reasoning_tokens`` counts an answer's
reasoning tokens as SGLang's scheduler does (``Req.update_reasoning_tokens``).
``normalize_effort`` is the chat request's ``reasoning_effort`` / ``reasoning`` fields as
``ChatCompletionRequest`` reads them.

This module knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stages.engine.apertus_reasoning import ApertusReasoning
from stages.engine.cohere_reasoning import CohereReasoning
from stages.engine.harmony import HarmonyReasoning
from stages.engine.hunyuan_calls import closing
from stages.engine.hunyuan_calls import tokens as hunyuan_tokens
from stages.engine.hunyuan_reasoning import thinks as hunyuan_thinks
from stages.engine.inkling_reasoning import END_ID as INKLING_END_ID
from stages.engine.inkling_reasoning import InklingReasoning
from stages.engine.kimi_k3_calls import THINK_CLOSE as K3_THINK_CLOSE
from stages.engine.kimi_k3_calls import THINK_OPEN as K3_THINK_OPEN
from stages.engine.kimi_k3_calls import TOOLS_OPEN as K3_TOOLS_OPEN
from stages.engine.kimi_k3_reasoning import KimiK3Reasoning
from stages.engine.muse_reasoning import MuseReasoning
from stages.engine.partial_json import partial_tail

__all__ = [
    "PARSERS",
    "EffortError",
    "ReasoningCount",
    "ReasoningSettings",
    "RequestReasoning",
    "ThinkFormat",
    "ThinkParser",
    "Toggle",
    "end_tag_ids",
    "normalize_effort",
    "reasoning_tokens",
    "served_format",
    "template_toggle",
    "think_parser",
    "thinking_on",
]


@dataclass(frozen=True)
class ThinkFormat:
    """One reasoning layout, as its detector's constructor sets it up: its tags, what else ends
    the reasoning, and how a request's reasoning is decided."""

    tool_start: str | None  # a tag that ends the reasoning too (kept in the content)
    default: str  # the detector's reasoning_default (see thinking_on)
    # the detector's own force_reasoning, whatever it is given: True (DeepSeek-R1: reasoning
    # until its end), False (Kimi); None: the request's
    force: bool | None = None
    forced: bool = False  # ReasoningParser forces reasoning for the name (qwen3-thinking)
    start: str = "<think>"
    end: str = "</think>"
    whole: bool = False  # no split: the answer is content, the start tag before it
    # its tags are special tokens, kept in the text of a request with a reasoning_effort
    # (serving_chat._patch_reasoning_skip_special_tokens: mistral)
    special_tags: bool = False
    # tags its detector's think_excluded_tokens name: never drawn while a sample thinks under
    # --enable-strict-thinking (stages.engine.strict_thinking)
    excluded: tuple[str, ...] = ()
    harmony: bool = False  # OpenAI's Harmony messages (gpt-oss), read by harmony.py
    apertus: bool = False  # Apertus's blocks, tool calls inside them (apertus_reasoning.py)
    cohere: bool = False  # Cohere Command's thinking and text blocks (cohere_reasoning.py)
    # Muse Glimmer's recipient channels (muse_reasoning.py), whose markers are special tokens
    # kept in the text of every request (serving_chat._patch_reasoning_skip_special_tokens)
    muse: bool = False
    # Inkling's typed messages (inkling_reasoning.py), whose framing tokens are special tokens
    # kept in the text of every request (serving_chat._patch_reasoning_skip_special_tokens)
    inkling: bool = False
    # the end tag's token ids as its detector names them (get_think_end_token_ids: Inkling's
    # fixed id), where they are not the tokenizer's encoding of the tag (end_tag_ids)
    end_ids: tuple[int, ...] = ()
    # Kimi K3's XTML channels (kimi_k3_reasoning.py), whose markers are special tokens kept in
    # the text of every request (serving_chat._patch_reasoning_skip_special_tokens)
    kimi_k3: bool = False
    # force_reasoning where no chat request sets it (the parse route): its detector's default
    force_unset: bool = False
    # what the model writes after its start tag, taken out with it (its detector's
    # think_start_self_label: Gemma 4's "thought\n"); the start tag alone says it reasons
    label: str = ""
    # Granite's: the content after the end tag loses its leading newlines (the template writes
    # "\n</think>\n"), and a request with enable_thinking false has its content never empty
    granite: bool = False
    # its detector's force_nonempty_content is on whatever the request says (Ling3Detector)
    always_nonempty: bool = False
    # the request's thinking / enable_thinking alone decide whether it reasons, and force it
    # (IQuestQ1ReasoningDetector.thinking_enabled: on unless one is set and neither is true)
    iquest: bool = False
    # an answer that does not start in its reasoning loses one end tag leading it (spaces
    # before it too): MiniMax-M3 writes it before earlier turns that did not think
    stray_close: bool = False
    # the model may open its reasoning itself where the request does not require it: such an
    # answer's reasoning tokens are counted too (get_self_opened_think_start_token_ids)
    self_opens: bool = False
    # Hunyuan's: its tags as the served tokenizer spells them (served_format), and whether a
    # request reasons from its reasoning_effort alone (hunyuan_reasoning.thinks)
    hunyuan: bool = False
    # the request's reasoning effort picks the tags (K2V3Detector): (effort, start, end) each,
    # the first's for a request without one, effort_other's for any other value
    efforts: tuple[tuple[str, str, str], ...] = ()
    effort_other: str = ""

    def pick(self, effort: Any) -> int:
        """The place in ``efforts`` of the tags a request's ``effort`` picks."""
        names = [name for name, _, _ in self.efforts]
        if effort is None:
            return 0
        return names.index(
            effort if isinstance(effort, str) and effort in names else self.effort_other
        )

    def for_effort(self, effort: Any) -> ThinkFormat:
        """The format with the tags ``effort`` picks (itself where its tags are fixed)."""
        if not self.efforts:
            return self
        _, start, end = self.efforts[self.pick(effort)]
        return replace(self, start=start, end=end)

    @property
    def opening(self) -> str:
        """The start tag as the model writes it, label and all."""
        return self.start + self.label


_R1 = ThinkFormat(tool_start=None, default="always", force=True)
_QWEN3 = ThinkFormat(
    tool_start="<tool_call>",
    default="enable_thinking",
    excluded=("<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>"),
)
_QWEN3_FORCED = replace(_QWEN3, forced=True)
_GLM45 = replace(
    _QWEN3, excluded=("<tool_call>", "</tool_call>", "<eop>", "<|user|>", "<|endoftext|>")
)
_K2 = ("<think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
       "<|tool_call_argument_begin|>", "<|tool_call_section_end|>", "<|tool_call_end|>", "[EOS]",
       "<|im_end|>", "<|end_header_id|>", "[EOT]")  # fmt: skip
# SGLang's ReasoningParser.DetectorMap, the names whose detector reads one of these formats
PARSERS: dict[str, ThinkFormat] = {
    "deepseek-r1": _R1,
    "step3": _R1,
    "step3p5": _R1,
    "gigachat35": _R1,
    "qwen3": _QWEN3,
    "dots": _QWEN3,
    "nanbeige": _QWEN3,
    "interns1": _QWEN3,
    # Glm45Detector, Nemotron3Detector: Qwen3's arguments but for their excluded tags and
    # thinks_internally, which nothing reads when the prompt is a Jinja template's
    "glm45": _GLM45,
    "nemotron_3": replace(_QWEN3, excluded=()),
    # Ling3Detector: GLM-4.5's, an answer without content always given its reasoning as content
    "ling3": replace(_GLM45, always_nonempty=True),
    "qwen3-thinking": _QWEN3_FORCED,
    "minimax": _QWEN3_FORCED,
    "deepseek-v3": replace(_QWEN3, default="explicit_thinking"),  # _DeepSeekV3Detector
    "mimo": replace(_QWEN3, default="explicit_enable_thinking"),  # _MimoDetector
    "poolside_v1": replace(_QWEN3, default="explicit_enable_thinking"),  # _PoolsideV1Detector
    "kimi": ThinkFormat(
        tool_start=None, default="always", force=False, start="◁think▷", end="◁/think▷"
    ),
    # KimiK2Detector: its tool calls' section ends the reasoning too
    "kimi_k2": ThinkFormat(
        tool_start="<|tool_calls_section_begin|>", default="thinking", excluded=_K2
    ),
    "mistral": ThinkFormat(
        tool_start=None, default="mistral", start="[THINK]", end="[/THINK]", special_tags=True
    ),
    "minimax-append-think": ThinkFormat(tool_start=None, default="always", whole=True),
    # IQuestQ1ReasoningDetector: <think> tags; thinking (and forced) unless the request's
    # thinking / enable_thinking switches say otherwise
    "iquest_q1": ThinkFormat(tool_start=None, default="enable_thinking", iquest=True),
    # GraniteThinkingDetector: <think> tags, <tool_call> ends them too, the content's leading
    # newlines taken out
    "granite_thinking_parser": ThinkFormat(
        tool_start="<tool_call>", default="enable_thinking", granite=True
    ),
    # Gemma4Detector: its channel tokens, "thought\n" after the opening one; reasoning when the
    # request sets enable_thinking
    "gemma4": ThinkFormat(
        tool_start=None,
        default="explicit_enable_thinking",
        start="<|channel>",
        end="<channel|>",
        label="thought\n",
    ),
    # Apertus2509Detector: any number of blocks, never forced, a tool-call block inside one
    # content
    "apertus2509": ThinkFormat(
        tool_start=None,
        default="always",
        force=False,
        start="<|inner_prefix|>",
        end="<|inner_suffix|>",
        apertus=True,
    ),
    # CohereCommand4Detector: reasoning until its end tag or a text or action block, the
    # content the text block's inside (or the action block)
    "cohere_command4": ThinkFormat(
        tool_start=None,
        default="always",
        start="<|START_THINKING|>",
        end="<|END_THINKING|>",
        cohere=True,
    ),
    # MiniMaxM3Detector: <mm:think> tags, reasoning when chat_template_kwargs.thinking_mode is
    # "enabled" (its template then opens it; an adaptive answer may open it itself), a stray
    # end tag leading an answer that does not reason dropped; its reasoning tokens counted
    # where the model opens it itself
    "minimax-m3": ThinkFormat(
        tool_start=None,
        default="thinking_mode",
        start="<mm:think>",
        end="</mm:think>",
        stray_close=True,
        self_opens=True,
    ),
    # HunyuanDetector: <think> tags (the tokenizer's spelling), <tool_calls> ending them too;
    # reasoning as the request's reasoning_effort says
    "hunyuan": ThinkFormat(tool_start="<tool_calls>", default="always", hunyuan=True),
    # MuseGlimmerDetector: its to=self channels; reasoning_default "always"; <|eom|> its end tag
    "muse": ThinkFormat(
        tool_start=None, default="always", start=" to=self<|message|>", end="<|eom|>", muse=True
    ),
    # InklingDetector: its typed messages; reasoning_default "always"; <|end_message|> its end,
    # the reasoning's tokens counted to Inkling's id for it whatever the tokenizer
    "inkling": ThinkFormat(
        tool_start=None,
        default="always",
        start="<|content_thinking|>",
        end="<|end_message|>",
        inkling=True,
        end_ids=(INKLING_END_ID,),
    ),
    # K2V3Detector: always forced (it refuses to be otherwise), the tags of the request's
    # reasoning effort, a tool call's (or group's) tag ending it too
    "k2_horizon": ThinkFormat(
        tool_start="<ifm|tool_call",
        default="always",
        force=True,
        start="<ifm|think>",
        end="</ifm|think>",
        efforts=(
            ("high", "<ifm|think>", "</ifm|think>"),
            ("medium", "<ifm|think_fast>", "</ifm|think_fast>"),
            ("low", "<ifm|think_faster>", "</ifm|think_faster>"),
        ),
        effort_other="medium",
    ),
    # KimiK3Detector: reasoning_default "thinking", forced by default; the response and tools
    # channels end the reasoning too; its think_excluded_tokens
    "kimi_k3": ThinkFormat(
        tool_start=K3_TOOLS_OPEN,
        default="thinking",
        start=K3_THINK_OPEN,
        end=K3_THINK_CLOSE,
        excluded=("response", "message", "<|end_of_msg|>", "[EOS]", "[EOT]"),
        kimi_k3=True,
        force_unset=True,
    ),
    # GptOssDetector: ReasoningParser forces its reasoning; its tags are Harmony's tokens
    "gpt-oss": ThinkFormat(
        tool_start=None,
        default="always",
        force=True,
        start="<|channel|>analysis<|message|>",
        end="<|end|>",
        harmony=True,
    ),
}


def served_format(fmt: ThinkFormat, tokenizer: Any) -> ThinkFormat:
    """``fmt`` with its tags as ``tokenizer`` spells them: Hunyuan's from its vocabulary
    (``hunyuan_calls.tokens``: Hy3's suffixed ``<think:...>``, ``<tool_calls:...>``); the
    others' as they are."""
    if not fmt.hunyuan:
        return fmt
    spelled = hunyuan_tokens(tokenizer)
    think = spelled["think"]
    return replace(fmt, start=think, end=closing(think), tool_start=spelled["tool_calls"])


def end_tag_ids(fmt: ThinkFormat, tokenizer: Any) -> tuple[int, ...]:
    """The token ids of ``fmt``'s end tag, as its detector's ``get_think_end_token_ids`` gives
    them: its own (Inkling's 200010, which SGLang uses whatever the served tokenizer: on one
    without that id the reasoning never ends by the count, every token of a thinking answer is
    its reasoning and a grammar waiting for its end is never applied, as there), else the
    tokenizer's encoding of the tag."""
    return fmt.end_ids or tuple(tokenizer.encode(fmt.end, add_special_tokens=False))


def think_parser(
    fmt: ThinkFormat, *, force: bool, nonempty: bool = False, tools: bool = False, **options: Any
) -> AnswerReasoning:
    """A parser of one answer in ``fmt`` (``ThinkParser``'s options; Harmony's takes
    ``nonempty`` alone: its detector reads the rest of nothing; Apertus's is never forced;
    Cohere's always starts in its reasoning; Muse's reads ``tools``: a tool-call parser reads
    its content; Inkling's takes ``stream_reasoning`` alone; Kimi K3's takes them all but
    ``tools``)."""
    if fmt.inkling:
        return InklingReasoning(stream_reasoning=options.get("stream_reasoning", True))
    if fmt.kimi_k3:
        return KimiK3Reasoning(force=force, nonempty=nonempty, **options)
    if fmt.muse:
        stream = options.get("stream_reasoning", True)
        return MuseReasoning(stream_reasoning=stream, nonempty=nonempty, tools=tools)
    if fmt.harmony:
        return HarmonyReasoning(nonempty=nonempty)
    if fmt.apertus:
        return ApertusReasoning(nonempty=nonempty, **options)
    if fmt.cohere:
        return CohereReasoning(
            nonempty=nonempty, stream_reasoning=options.get("stream_reasoning", True)
        )
    return ThinkParser(fmt, force=force, nonempty=nonempty, **options)


class ThinkParser:
    """One answer's reasoning and content (``BaseReasoningFormatDetector``;
    ``MiniMaxAppendThinkDetector`` for a ``whole`` format).

    ``force``: the answer starts in its reasoning (``force_reasoning``; a format's own
    ``force`` wins); ``stream_reasoning`` False holds a streamed reasoning back until it ends;
    ``previous``: the assistant message a ``continue_final_message`` request continues (its
    tags count); ``nonempty`` (``chat_template_kwargs.force_nonempty_content``): an answer
    with no content gets its reasoning as content."""

    def __init__(
        self,
        fmt: ThinkFormat,
        *,
        force: bool,
        stream_reasoning: bool = True,
        previous: str = "",
        nonempty: bool = False,
    ) -> None:
        self.fmt = fmt
        self.in_reasoning = (force or fmt.forced) if fmt.force is None else fmt.force
        self.stream_reasoning = stream_reasoning
        self.previous = previous
        self.nonempty = nonempty
        if fmt.start in previous:
            self.in_reasoning = True
        if fmt.end in previous:
            self.in_reasoning = False
        # what a stream waits on while it is the start of one (its tool start too)
        self._tags = (
            (fmt.opening, fmt.end, fmt.tool_start) if fmt.tool_start else (fmt.opening, fmt.end)
        )
        self._buffer = ""  # streamed text held back (the start of a tag, or the reasoning)
        self._stripped_start = False
        self._reasoning_sent = ""  # with nonempty: the reasoning streamed so far
        self._fed = False  # a whole format: its start tag went out
        self._thought = False  # Granite's: reasoning was seen (its content's newlines go)
        self._said = False  # Granite's: content went out
        # stray_close: the spaces a stream began with, held until it shows whether a stray end
        # tag leads it (None: shown, or not a stray_close format)
        self._lead: str | None = "" if fmt.stray_close else None

    # -- whole answers -------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole answer (``detect_and_parse``)."""
        reasoning, content = self._parse(text)
        if self.fmt.granite:  # GraniteThinkingDetector.detect_and_parse
            ended = self.fmt.end in text
            absent = ended and not content  # newline-only content: stripped, not swapped
            if ended and content:
                content = content.lstrip("\n")
            if self.nonempty and not content and (absent or not ended):
                return content, reasoning
            return reasoning, content
        if self.nonempty and not content:
            return content, reasoning
        return reasoning, content

    def _parse(self, text: str) -> tuple[str, str]:
        start, end = self.fmt.start, self.fmt.end
        if self.fmt.whole:
            return "", start + text
        if self.fmt.stray_close and not self.in_reasoning and text.lstrip().startswith(end):
            text = text.lstrip()[len(end) :]
        if not (self.in_reasoning or start in text):
            return "", text
        opening = self.fmt.opening
        while text.startswith(opening):
            text = text[len(opening) :]
        if end not in text and end not in self.previous:
            cut = text.find(self.fmt.tool_start) if self.fmt.tool_start else -1
            if cut != -1:  # a tool call ends it; the call stays in the content
                return text[:cut], text[cut:]
            return text, ""  # cut short before its end
        if end in text:
            reasoning, content = text.split(end, 1)
            return reasoning, content
        return "", text  # the continued message had closed it

    # -- streams -------------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the text added to a stream (``parse_streaming_increment``):
        what may still be (part of) a tag is held back for the next delta."""
        if self._lead is not None and not self.in_reasoning:
            # MiniMaxM3Detector.parse_streaming_increment: the first text out of the reasoning
            # (the end tag is one token: it comes whole)
            lead = self._lead = self._lead + delta
            stripped = lead.lstrip()
            if not stripped:
                return "", ""
            self._lead = None
            delta = stripped[len(self.fmt.end) :] if stripped.startswith(self.fmt.end) else lead
            if not delta:
                return "", ""
        was = self.in_reasoning
        reasoning, content = self._feed(delta)
        if self.nonempty:
            self._reasoning_sent = self._reasoning_sent + reasoning if self.in_reasoning else ""
        if self.fmt.granite:  # GraniteThinkingDetector.parse_streaming_increment
            if was or self.in_reasoning or self._stripped_start or reasoning:
                self._thought = True
            if self._thought and not self._said and content:
                content = content.lstrip("\n")
                self._said = bool(content)
        return reasoning, content

    def _feed(self, delta: str) -> tuple[str, str]:
        fmt = self.fmt
        if fmt.whole:  # the start tag before the first delta, and nothing held back
            first, self._fed = not self._fed, True
            return "", fmt.start + delta if first else delta
        text = self._buffer = self._buffer + delta
        if any(tag != text and tag.startswith(text) for tag in self._tags):
            return "", ""
        if not self._stripped_start and fmt.opening in text:
            text = self._buffer = text.replace(fmt.opening, "", 1)
            self._stripped_start = True
            self.in_reasoning = True
        if not self.in_reasoning:
            self._buffer = ""
            return "", text
        cut = text.find(fmt.end)
        if cut != -1:
            self._buffer = ""
            self.in_reasoning = False
            return text[:cut], text[cut + len(fmt.end) :]
        cut = text.find(fmt.tool_start) if fmt.tool_start else -1
        if cut != -1:
            self._buffer = ""
            self.in_reasoning = False
            return text[:cut], text[cut:]
        if not self.stream_reasoning:
            return "", ""
        held = [fmt.end] if fmt.tool_start is None else [fmt.end, fmt.tool_start]
        if not self._stripped_start:
            held.append(fmt.opening)
        keep = max(partial_tail(text, tag) for tag in held)
        self._buffer = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What a stream still holds when its answer ends (``finish``): the reasoning of an
        answer cut short, or the start of a tag that never came."""
        left, self._buffer = self._buffer, ""
        if self._lead:  # spaces alone (SGLang's stream drops them; its whole answer has them)
            left, self._lead = self._lead, None
        if not self.in_reasoning:
            return "", left
        if left.startswith(self.fmt.opening):
            left = left[len(self.fmt.opening) :]
        if self.nonempty:
            content, self._reasoning_sent = self._reasoning_sent + left, ""
            return "", content
        return left, ""


# -- whether a request reasons ---------------------------------------------------------------


# a parser of one answer's reasoning: the base detector's, or a format's own (think_parser)
AnswerReasoning = (
    ThinkParser
    | HarmonyReasoning
    | ApertusReasoning
    | CohereReasoning
    | MuseReasoning
    | InklingReasoning
    | KimiK3Reasoning
)


@dataclass(frozen=True)
class Toggle:
    """How a chat template turns reasoning on (``ReasoningToggleConfig``)."""

    param: str | None = None  # the chat_template_kwargs key
    default: bool | None = None  # its value when the request leaves it out
    special: str | None = None  # "always", "mistral" or "hunyuan_effort"
    # the kwarg a "low" reasoning_effort sets true (Nemotron 3's low_effort)
    effort_kwarg: str | None = None


def _default_assigned(template: str, param: str, default: bool) -> bool:
    """The template gives ``param`` a working default with Jinja's ``default`` filter
    (``_has_toggle_default_assignment``)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    try:
        env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
        env.add_extension(_generation_tag())
        tree = env.parse(template)
    except Exception:  # a template jinja cannot read: no toggle found (SGLang's too)
        return False
    for node in tree.find_all(jinja2.nodes.Filter):
        if node.name not in ("default", "d") or node.dyn_args or node.dyn_kwargs:
            continue
        if not isinstance(node.node, jinja2.nodes.Name) or node.node.name != param:
            continue
        args = list(node.args)
        if not args or not isinstance(args[0], jinja2.nodes.Const):
            continue
        value = args[0].value
        if not isinstance(value, bool):
            continue
        boolean = args[1] if len(args) > 1 else {k.key: k.value for k in node.kwargs}.get("boolean")
        if boolean is not None and not isinstance(boolean, jinja2.nodes.Const):
            continue
        if boolean is not None and bool(boolean.value) and value:
            continue  # default(true, true): false is replaced too, not a toggle
        if value is default:
            return True
    return False


def _generation_tag() -> type:
    """Jinja's parser extension for ``{% generation %}`` blocks (Hugging Face templates' own
    tag), so that templates with it parse."""
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return Generation


def _set_default(param: str, value: str) -> str:
    return (
        rf"{{%\s*if\s+not\s+{param}\s+is\s+defined\s*%}}.*?"
        rf"{{%\s*set\s+{param}\s*=\s*(?:{value}|{value.capitalize()})\s*%}}"
    )


def _on_by_default(t: str, param: str) -> bool:
    return (
        re.search(_set_default(param, "true"), t, re.DOTALL) is not None
        or re.search(
            rf"set\s+{param}\s*=\s*{param}\s+if\s+{param}\s+is\s+defined\s+else\s+(?:true|True)",
            t,
        )
        is not None
        or re.search(rf"{param}\s+is\s+defined\s+and\s+(?:{param}\s+is\s+false|not\s+{param})", t)
        is not None
        or re.search(rf"{param}\s+is\s+not\s+defined\s+or\s+{param}", t) is not None
        or re.search(rf"namespace\([^)]*{param}\s*=\s*true", t) is not None
        or _default_assigned(t, param, True)
    )


def _off_by_default(t: str, param: str) -> bool:
    return re.search(_set_default(param, "false"), t, re.DOTALL) is not None or (
        _default_assigned(t, param, False)
    )


def template_toggle(template: str | None) -> tuple[bool, Toggle | None]:
    """``(always reasons, toggle)`` of a chat template, by SGLang's ``REASONING_MODE_RULES`` in
    their order (``template_detection.detect_reasoning_pattern``); GLM-5.3's rule, which needs
    the model family, is not among them."""
    if not template:
        return False, None
    toggle = _toggle(template)
    return (toggle is not None and toggle.special == "always"), toggle


def _toggle(t: str) -> Toggle | None:
    if "<ifm|think>" in t and "<ifm|think_fast>" in t and "reasoning_effort" in t:
        return Toggle(special="always")  # K2-v3
    if "<|channel|>" in t:  # gpt-oss
        return Toggle(special="always")
    if (
        re.search(r"<\|im_start\|>assistant\\n<think>\\n", t)
        and "enable_thinking" not in t
        and "thinking" not in t
    ):  # the generation prompt opens the reasoning
        return Toggle(special="always")
    if "reasoning_effort" in t and "[THINK]" in t:
        return Toggle(special="mistral")
    if "reasoning_effort" in t and "reasoning_mode_token" in t and "no_think" in t:
        return Toggle(special="hunyuan_effort")
    if _off_by_default(t, "enable_thinking"):
        return Toggle("enable_thinking", False)
    if "low_effort" in t and "truncate_history_thinking" in t:  # Nemotron 3
        return Toggle("enable_thinking", True, effort_kwarg="low_effort")
    if _on_by_default(t, "enable_thinking"):
        return Toggle("enable_thinking", True)
    if _off_by_default(t, "thinking"):
        return Toggle("thinking", False)
    if _on_by_default(t, "thinking"):
        return Toggle("thinking", True)
    return None


def thinking_on(
    fmt: ThinkFormat, toggle: Toggle | None, kwargs: dict[str, Any] | None, effort: Any
) -> bool:
    """Whether a chat request reasons (``serving_chat._get_reasoning_from_request``): from
    the template's ``toggle`` when it has one, else the detector's ``reasoning_default``;
    ``kwargs``: the request's ``chat_template_kwargs``, ``effort`` its ``reasoning_effort``."""
    if fmt.default == "thinking_mode":  # minimax-m3's, before any toggle
        return (kwargs or {}).get("thinking_mode") == "enabled"
    if fmt.hunyuan:  # its reasoning_effort, before any toggle (_get_reasoning_from_request)
        return hunyuan_thinks(_effort_template(toggle), kwargs, effort)
    if fmt.iquest:  # IQuestQ1ReasoningDetector.thinking_enabled, before any toggle
        kwargs = kwargs or {}
        thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
        return True if thinking is None and enable is None else bool(thinking or enable)
    toggle = toggle or _default_toggle(fmt.default)
    if toggle.special == "always":
        return True
    if toggle.special == "mistral":
        return effort is not None and effort != "none"
    if toggle.param is None or toggle.default is None:
        return False
    if toggle.default:
        return not kwargs or kwargs.get(toggle.param) is not False
    return kwargs is not None and kwargs.get(toggle.param) is True


def _effort_template(toggle: Toggle | None) -> bool:
    """The template sets reasoning by effort (Hunyuan's ``hunyuan_effort`` rule)."""
    return toggle is not None and toggle.special == "hunyuan_effort"


def _default_toggle(mode: str) -> Toggle:
    """A ``reasoning_default`` as the toggle it stands for: ``always`` and ``mistral`` as the
    templates' special cases; ``thinking`` / ``enable_thinking`` that switch, on unless the
    request sets it false; ``explicit_thinking`` / ``explicit_enable_thinking`` it, off unless
    set true. Another mode (SGLang warns): never."""
    if mode in ("always", "mistral"):
        return Toggle(special=mode)
    if mode in ("thinking", "enable_thinking"):
        return Toggle(mode, True)
    if mode in ("explicit_thinking", "explicit_enable_thinking"):
        return Toggle(mode.removeprefix("explicit_"), False)
    return Toggle()


class ReasoningCount:
    """An answer's reasoning tokens as it grows, as SGLang's scheduler counts them
    (``Req.update_reasoning_tokens``): its tokens up to and with the first ``end_ids`` (the
    tokens of ``</think>``), all of them while it has not ended. No ``end_ids``: none.
    ``start_ids``: the answer of a request that does not require reasoning, which has some
    only where it opens with them, the tokens of a start tag the model writes itself
    (``Req.update_self_opened_reasoning_tokens``: MiniMax-M3's ``<mm:think>``)."""

    def __init__(self, end_ids: Sequence[int], start_ids: Sequence[int] = ()) -> None:
        self.end = list(end_ids)
        self.start = list(start_ids)
        self.count = 0
        self.ended = not self.end

    def update(self, output_ids: Sequence[int]) -> int:
        """The count for the answer so far (``output_ids``: all of its tokens)."""
        if self.ended:
            return self.count
        if self.start:  # none until the start tag is whole; none at all without it
            head = list(output_ids[: len(self.start)])
            if head != self.start[: len(head)]:
                self.ended = True
                return self.count
            if len(head) < len(self.start):
                return self.count
        end, n = self.end, len(self.end)
        # an end that starts in what was searched before (after the start tag)
        at = max(self.count - n + 1, len(self.start))
        while True:
            try:
                at = output_ids.index(end[0], at)  # type: ignore[attr-defined]
            except ValueError:
                self.count = len(output_ids)
                return self.count
            if list(output_ids[at : at + n]) == end:
                self.count, self.ended = at + n, True
                return self.count
            at += 1


def reasoning_tokens(
    output_ids: Sequence[int], end_ids: Sequence[int], start_ids: Sequence[int] = ()
) -> int:
    """A whole answer's reasoning tokens (``ReasoningCount``)."""
    return ReasoningCount(end_ids, start_ids).update(output_ids)


# -- the request's fields ----------------------------------------------------------------------

_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")


class EffortError(ValueError):
    """A ``reasoning_effort`` or ``reasoning`` field SGLang refuses (its message, the field)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def normalize_effort(body: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """``(reasoning_effort, chat_template_kwargs)`` of a chat request as
    ``ChatCompletionRequest`` normalizes them (``normalize_reasoning_inputs``): ``reasoning``
    ``{effort, enabled}`` fills ``reasoning_effort``; an effort other than ``none`` (or
    ``reasoning.enabled``) defaults ``thinking`` and ``enable_thinking`` to true in the
    template's kwargs, ``none`` to false. EffortError for what SGLang refuses."""
    effort = body.get("reasoning_effort")
    kwargs = body.get("chat_template_kwargs")
    thinking = None
    raw = body.get("reasoning")
    if isinstance(raw, dict):
        value = raw.get("effort")
        if value is None:
            value = raw.get("reasoning_effort")
        if isinstance(value, str) and value in _EFFORTS:
            effort = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            effort = float(value)
        elif isinstance(value, str):
            try:
                effort = float(value)
            except ValueError:
                raise EffortError(f"invalid reasoning effort: {value!r}", "reasoning") from None
        elif value is not None:
            raise EffortError(f"invalid reasoning effort: {value!r}", "reasoning")
        enabled = raw.get("enabled") if raw.get("enabled") is not None else raw.get("enable")
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in {"1", "true", "yes", "y", "on"}
        if enabled:
            thinking = True
    effort = _checked_effort(effort)
    if effort is not None:
        thinking = effort != "none"
    if thinking is not None:
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
    return effort, kwargs


def _checked_effort(effort: Any) -> Any:
    """``ReasoningEffortType``: one of the tiers, or a number in [0, 0.99] (a string of one
    too, as pydantic reads it)."""
    if effort is None or (isinstance(effort, str) and effort in _EFFORTS):
        return effort
    if isinstance(effort, bool):
        raise EffortError("reasoning_effort must not be a boolean", "reasoning_effort")
    number = effort
    if isinstance(effort, str):
        try:
            number = float(effort)
        except ValueError:
            number = None
    if not isinstance(number, int | float) or not 0.0 <= number <= 0.99:
        raise EffortError(
            f"reasoning_effort: one of {', '.join(_EFFORTS)}, or a number in [0.0, 0.99]",
            "reasoning_effort",
        )
    return float(number)


# -- a served model's and a request's ----------------------------------------------------------


@dataclass(frozen=True)
class ReasoningSettings:
    """The engine's ``--reasoning-parser`` for its chat template and tokenizer."""

    name: str
    fmt: ThinkFormat
    always: bool  # the template always opens the reasoning (TemplateManager.force_reasoning)
    toggle: Toggle | None
    end_ids: tuple[int, ...]  # the tokens of the end tag (none: reasoning tokens not counted)
    # the tokens of each end tag a request's effort may pick (fmt.efforts'; SGLang's
    # request_selectable_think_end_id_sequences)
    selectable: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, name: str, template: str | None, tokenizer: Any) -> ReasoningSettings:
        """ValueError for a parser the built-in engine does not read."""
        fmt = PARSERS.get(name.lower())
        if fmt is None:
            raise ValueError(
                f"--reasoning-parser {name!r}: the built-in engine reads {', '.join(PARSERS)} "
                "(the formats SGLang's base reasoning detector reads)"
            )
        always, toggle = template_toggle(template)
        fmt = served_format(fmt, tokenizer)
        end_ids = end_tag_ids(fmt, tokenizer)
        selectable = tuple(
            tuple(tokenizer.encode(end, add_special_tokens=False)) for _, _, end in fmt.efforts
        )
        return cls(name.lower(), fmt, always, toggle, end_ids, selectable)

    @property
    def effort_levels(self) -> bool:
        """A chat request's ``reasoning_effort`` is normalized for the template
        (``uses_hunyuan_reasoning_effort``: ``hunyuan`` and a template that sets reasoning by
        effort, ``hunyuan_reasoning.normalized_effort``)."""
        return self.fmt.hunyuan and _effort_template(self.toggle)

    def request(
        self,
        kwargs: dict[str, Any] | None,
        effort: Any,
        *,
        separate: bool = True,
        stream: bool = True,
        previous: str = "",
    ) -> RequestReasoning:
        """What one chat request's answers need: whether it reasons (the template's
        ``kwargs``, ``reasoning_effort``), and how its parsers start."""
        thinking = thinking_on(self.fmt, self.toggle, kwargs, effort)
        fmt, end_ids = None, None
        if self.fmt.efforts:  # K2's: the template's reasoning_effort, else the request's
            chosen = (kwargs or {}).get("reasoning_effort")
            chosen = effort if chosen is None else chosen
            fmt = self.fmt.for_effort(chosen)
            if thinking and self.selectable:
                end_ids = self.selectable[self.fmt.pick(chosen)]
        return RequestReasoning(
            self,
            separate=separate,
            stream=stream,
            force=thinking if self.fmt.iquest else self.always or thinking,
            counted=thinking,
            previous=previous,
            nonempty=(kwargs or {}).get("force_nonempty_content") is True
            or (self.fmt.granite and (kwargs or {}).get("enable_thinking") is False)
            or self.fmt.always_nonempty,
            keep_special=(self.fmt.special_tags and effort is not None and effort != "none")
            or self.fmt.muse
            or self.fmt.inkling
            or self.fmt.kimi_k3,
            fmt=fmt,
            end_ids=end_ids,
        )


@dataclass(frozen=True)
class RequestReasoning:
    """One chat request's reasoning: ``separate`` (``separate_reasoning``: split it out of the
    content), ``stream`` (``stream_reasoning``), ``counted``: it reasons (SGLang's
    ``require_reasoning``: its grammar waits for the end of its reasoning, whose tokens the
    engine counts in ``meta_info.reasoning_tokens``); ``keep_special``: its answers are
    decoded with their special tokens (``skip_special_tokens`` false), its format's tags being
    some; ``tools``: a tool-call parser reads their content (``tool_call_parser_active``);
    ``fmt``: its own format, where the request picks its tags (None: the server's);
    ``end_ids``: the tokens of its own end tag, which its reasoning tokens are counted to and
    its grammar waits for (None: the server's)."""

    settings: ReasoningSettings
    separate: bool
    stream: bool
    force: bool
    counted: bool
    previous: str
    nonempty: bool
    keep_special: bool = False
    tools: bool = False
    fmt: ThinkFormat | None = None
    end_ids: tuple[int, ...] | None = None

    def parser(self) -> AnswerReasoning:
        return think_parser(
            self.fmt or self.settings.fmt,
            force=self.force,
            stream_reasoning=self.stream,
            previous=self.previous,
            nonempty=self.nonempty,
            tools=self.tools,
        )
