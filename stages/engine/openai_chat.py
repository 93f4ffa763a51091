"""SGLang's ``/v1/chat/completions`` on the built-in engine.

Field names, defaults and answers follow SGLang 0.5 (``srt/entrypoints/openai/protocol.py``:
``ChatCompletionRequest``, ``ChatCompletionResponse``, ``ChatCompletionStreamResponse``;
``serving_chat.py``; ``sse_utils.py``):

- the messages go through the tokenizer's chat template (``apply_chat_template`` with
  ``add_generation_prompt``, the request's ``tools`` and ``chat_template_kwargs``; the engine's
  ``--chat-template`` replaces the tokenizer's; the same text, rendered without its per-call
  copying: ``chat_template.TemplateRenderer``); text parts of a content list are joined with a
  space (SGLang's "string" content format), a ``None`` field is left out; an assistant message's
  tool-call ``arguments`` given as a JSON string are parsed for the template; a conversation
  that ends with an assistant message of text sends it as the user's, or with
  ``continue_final_message`` leaves it out of the template (which opens the assistant turn) and
  puts its ids after the rendered ones (``serving_chat._handle_last_assistant_message``);
  ``add_generation_prompt`` in ``chat_template_kwargs``: a 400, as the template's TypeError
  there;
- sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` from the
  request, else the model's ``generation_config.json`` (not with ``--sampling-defaults
  openai``), else 1.0, 1.0, -1, 0.0, 1.0;
  ``max_completion_tokens`` or ``max_tokens`` (none: what the context leaves); ``stop``,
  ``stop_token_ids``, ``n``, ``seed``, ``ignore_eos``, ``no_stop_trim``, ``skip_special_tokens``,
  ``min_tokens`` and the penalties by the native names, so the native checks apply;
- ``logprobs`` (bool) and ``top_logprobs`` (any number, as SGLang's; without ``logprobs``
  nothing): ``logprobs.content`` ``[{token, bytes, logprob, top_logprobs: [{token, bytes,
  logprob}]}]``, ``bytes`` a byte-level tokenizer's own (``stages.engine.token_bytes``: a token
  that is part of a character has its byte, not its display text's U+FFFD);
- ``tools`` with ``tool_choice`` ``auto`` (the default) or ``none``: the answer's text is read
  for tool calls in ``--tool-call-parser``'s format (``auto``: the one SGLang detects from the
  template; without the flag none are read, as SGLang's) (``stages.engine.tool_calls``):
  ``message.tool_calls`` ``[{id: "call_<24 hex>", index, type: "function", function: {name,
  arguments}}]``, the text before them as ``content``,
  and ``finish_reason`` ``tool_calls`` where it was ``stop``;
  ``tool_choice`` ``required`` or a named function constrains the answer to tool calls in that
  format, one or more and nothing else (``tool_calls.forced_calls``: the structural tag SGLang
  sends for that format, ``parallel_tool_calls`` not constraining it, as there; for
  ``pythonic``, which has none, or without a parser, SGLang's JSON schema of a
  ``[{name, parameters}]`` array, read as such by ``pythonic`` and left in the content without
  a parser); a named function's calls only, and
  only it in the template;
- the answer: ``{id, object: "chat.completion", created, model, choices: [{index, message:
  {role: "assistant", content ("" when empty), reasoning_content, tool_calls?},
  logprobs, finish_reason, matched_stop}], usage, metadata: {weight_version}}``;
- token in, token out (SGLang 0.5.23, for RL code that trains on the ids it sampled):
  ``input_ids`` is the prompt as ids (the template skipped; ``messages`` still required);
  ``return_prompt_token_ids`` adds each choice's ``prompt_token_ids``, ``return_token_ids``
  those and its ``response_token_ids``, ``return_meta_info`` its native ``meta_info``; not
  with ``stream`` (a 400 with SGLang's words); ``return_input_ids_in_sglext`` and
  ``return_output_ids_in_sglext`` (or their ``x-sglext-return-*-ids: 1`` headers) the
  response's ``sglext {input_ids, output_ids}``, streamed too: a chunk of its own (no choices)
  after the choices' last (``event: sglext_ids`` with the header ``x-sglext-ids-framed: 1``);
- ``stream``: ``chat.completion.chunk`` events: a choice's first chunk has ``delta {role:
  "assistant", content: ""}``, then content deltas (with their tokens' log-probs), tool calls
  as whole ``tool_calls`` deltas, and after a choice's last tokens a chunk with an empty delta,
  its ``finish_reason`` and ``matched_stop``; ``stream_options.include_usage`` adds a last chunk
  with ``usage`` and no choices (``delta`` always has ``reasoning_content``, null when it adds
  content, as there);
- with ``--reasoning-parser``, the answer's reasoning (``stages.engine.reasoning``) comes as
  ``reasoning_content`` (deltas of it when streamed, each step's log-probs with its first
  chunk), its tool calls read in the text after it; ``separate_reasoning: false`` leaves the
  text whole; ``usage.reasoning_tokens`` counts a thinking request's reasoning tokens, and
  its grammar applies once its reasoning ends (``require_reasoning``).
  ``reasoning_effort`` and ``reasoning`` set the template's ``thinking`` / ``enable_thinking``
  (``reasoning.normalize_effort``) with or without a parser.

- ``response_format``: ``json_schema`` (its schema) and ``json_object`` constrain the answer
  (``stages.engine.grammar``), which is then data, not read for tool calls; ``structural_tag``
  constrains what follows its triggers; ``regex`` and ``ebnf`` as on ``/v1/completions``.

Refused with 400, as SGLang refuses them: a forced tool choice with ``response_format``,
``regex`` or ``ebnf``, or without tools. A model whose tokenizer has no chat template (and no
``--chat-template``) gets 400 on this route. This module knows nothing of
HTTP; ``openai_api.OpenAIRoutes`` serves it.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import structlog

from stages.engine.chat_template import TemplateRenderer
from stages.engine.chunk_stream import mapped
from stages.engine.dsv32_encoding import UnknownRole
from stages.engine.dsv32_encoding import encode as dsv32_encode
from stages.engine.glm_grammar import glm_turn
from stages.engine.hunyuan_reasoning import normalized_effort as hunyuan_effort
from stages.engine.kimi_calls import history_calls, kimi_id
from stages.engine.kimi_k3_calls import TOOLS_CLOSE as K3_TOOLS_CLOSE
from stages.engine.kimi_k3_calls import k3_id
from stages.engine.kimi_k3_encoding import (
    k3_kwargs,
    k3_messages,
    k3_tools,
    reported_prompt_tokens,
    unconstrained_format,
)
from stages.engine.openai_api import (
    _SAMPLING,
    CHAT_PASSED_ON,
    SGLEXT_FLAGS,
    OpenAIError,
    StreamLayout,
    _no_text,
    _usage,
    choice_hidden_states,
    hidden_mode,
    name_adapter,
    response_format,
    response_sglext,
    results_usage,
)
from stages.engine.protocol import REASONING_END_KEY, is_int
from stages.engine.reasoning import (
    EffortError,
    ReasoningSettings,
    Toggle,
    normalize_effort,
    template_toggle,
)
from stages.engine.streaming import Progress
from stages.engine.template_detection import resolve_auto
from stages.engine.template_dump import (
    BOOL_FIELDS,
    DumpError,
    content_format,
    lax_bool,
    template_message,
    template_tool,
)
from stages.engine.token_bytes import TokenBytes, token_bytes
from stages.engine.tool_calls import (
    NATIVE_FORCED,
    PARSERS,
    PARSES_WITHOUT_TOOLS,
    StreamingToolCalls,
    ToolCallParser,
    answer_format,
    forced_calls,
    strict_calls,
    unconstrained,
)
from stages.engine.tool_schemas import schema_error

__all__ = ["ChatSettings", "chat_request", "chat_response", "chat_stream"]

log = structlog.get_logger("stages.engine.openai_chat")
_Settings = TypeVar("_Settings", bound="ChatSettings")

_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
# set above from their own rules, or not fields of a chat request (json_schema comes as
# response_format)
_NOT_SAMPLING = frozenset({*_DEFAULTS, "max_tokens", "json_schema"})
# models whose answers' format is special tokens: their chat answers keep them (serving_chat)
_SPECIAL_FORMATS = frozenset({"gpt_oss", "gemma4", "gemma4_unified"})
# the tool-call parsers whose calls' ids count the conversation's calls (_process_tool_call_id)
_KIMI_IDS = ("kimi_k2", "kimi_k3")
_TOOL_ROLES = ("root", "system", "developer")  # roles whose messages may carry tools


def _config(model_dir: Path) -> dict[str, Any]:
    """The served model's ``config.json`` (empty: none readable)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_type(model_dir: Path) -> str | None:
    """The served model's ``config.json`` ``model_type`` (None: none readable)."""
    return _config(model_dir).get("model_type")


def _encoding(model_dir: Path, tool_call_parser: str | None, template: str | None) -> str | None:
    """The chat encoding SGLang serves the model with (``chat_encoding.resolve_chat_encoding_
    spec``): ``dsv32`` (``--tool-call-parser deepseekv32``, or a DeepSeek V3 architecture without
    a chat template: ``dsv32_encoding``), ``kimi_k3`` (its parser or a ``KimiK3``
    architecture), the others it names; None: the chat template."""
    by_parser = {"deepseekv41": "dsv41", "deepseekv4": "dsv4", "deepseekv32": "dsv32"}
    if tool_call_parser in by_parser:
        return by_parser[tool_call_parser]
    if tool_call_parser == "kimi_k3":
        return "kimi_k3"
    config = _config(model_dir)
    architectures = config.get("architectures")
    arch = str(architectures[0]) if isinstance(architectures, list) and architectures else ""
    if config.get("model_type") == "deepseek_v41" or "DeepseekV41" in arch:
        return "dsv41"
    if "DeepseekV4" in arch:
        return "dsv4"
    if "KimiK3" in arch:
        return "kimi_k3"
    if "InklingForConditionalGeneration" in arch:
        return "inkling"
    if "DeepseekV3" in arch and template is None:
        return "dsv32"
    return None


@dataclass
class ChatSettings:
    """What the chat route needs of the served model."""

    tokenizer: Any
    template: str | None  # --chat-template (None: the tokenizer's own)
    defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    tool_parser: str | None = None  # --tool-call-parser (None: no tool calls read)
    reasoning: ReasoningSettings | None = None  # --reasoning-parser
    # the served model's config.json model_type: gpt-oss and Gemma 4 answers keep their special
    # tokens, which are their formats (serving_chat's is_gpt_oss, is_gemma4)
    model_type: str | None = None
    # --default-chat-template-kwargs: every request's where its own leave them unset
    default_kwargs: dict[str, Any] = field(default_factory=dict)
    # SGLang's chat_encoding_spec (_encoding): dsv32 renders prompts with dsv32_encoding;
    # kimi_k3 keeps every answer's special tokens, Kimi K3's markers
    # (_patch_reasoning_skip_special_tokens)
    encoding: str | None = None
    # --trust-request-chat-template: a request's chat_template_kwargs.chat_template renders it
    trust_request_template: bool = False
    # --allow-auto-truncate: a max_completion_tokens past the context is cut, not refused
    auto_truncate: bool = False
    # --enable-mis: /v1/decisions and /v1/systemone refuse (SGLang's _validate_server)
    mis: bool = False
    # a vision model's engine: image parts go to its image_data (images.Vision), else refused
    vision: bool = False
    renderer: TemplateRenderer = field(init=False, repr=False)
    token_bytes: TokenBytes = field(init=False, repr=False)  # log-prob entries' ``bytes``

    def __post_init__(self) -> None:
        self.renderer = TemplateRenderer(self.tokenizer)
        self.token_bytes = token_bytes(self.tokenizer)

    def shared_as(self, cls: type[_Settings]) -> _Settings:
        """These settings as ``cls``, a subclass that changes how prompts are rendered: every
        field, and what was worked out from them (the renderer, the token bytes, the
        template's reasoning toggle and content format, each parsed from the template's
        source), shared rather than made again. The agent proxy makes one per episode."""
        _ = (self.toggle, self.content_format)  # worked out here once, for every copy
        settings = cls.__new__(cls)
        settings.__dict__.update(vars(self))
        return settings

    @functools.cached_property
    def toggle(self) -> Toggle | None:
        """How the chat template turns reasoning on (``reasoning.template_toggle``), whatever
        the reasoning parser: SGLang's template manager reads it from every template."""
        template = self.template or getattr(self.tokenizer, "chat_template", None)
        return template_toggle(template if isinstance(template, str) else None)[1]

    @property
    def kimi_k3(self) -> bool:
        return self.encoding == "kimi_k3"

    @functools.cached_property
    def content_format(self) -> str:
        """Whether the template takes a message's content as a list of parts (``"openai"``)
        or as text (``"string"``), as SGLang's template manager detects it
        (``template_dump.content_format``)."""
        template = self.template or getattr(self.tokenizer, "chat_template", None)
        return content_format(template if isinstance(template, str) else None)

    @classmethod
    def of(
        cls,
        tokenizer: Any,
        model_dir: Path,
        *,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        default_kwargs: dict[str, Any] | None = None,
        sampling_defaults: str = "model",
    ) -> ChatSettings | None:
        """From the loaded model (None without a tokenizer). ``chat_template``: a Jinja
        template, or a file holding one; ``tool_call_parser``: one of ``PARSERS``, ``auto``
        (SGLang's detection: ``template_detection.resolve_auto``, ``ParserRefused`` for a
        format the engine does not read) or None: no tool calls read, as SGLang without
        ``--tool-call-parser``. ``sampling_defaults`` (SGLang's ``--sampling-defaults``):
        ``model``, a request's unset sampling fields from ``generation_config.json``;
        ``openai``, OpenAI's defaults alone (``ModelConfig.get_default_sampling_params``)."""
        if tokenizer is None:
            return None
        given = chat_template
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        if tool_call_parser == "auto":
            tool_call_parser = resolve_auto(
                ["tool_call_parser"], chat_template=given, tokenizer=tokenizer, model_dir=model_dir
            )["tool_call_parser"].parser
        elif tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool_call_parser!r}: the built-in engine reads "
                f"{', '.join(PARSERS)} (SGLang's names of those formats)"
            )
        unconstrained(tool_call_parser)  # (Kimi K3's: said once, at the start)
        template = chat_template or getattr(tokenizer, "chat_template", None)
        defaults: dict[str, Any] = {}
        config = model_dir / "generation_config.json"
        if sampling_defaults == "model" and config.is_file():
            try:
                raw = json.loads(config.read_text())
            except ValueError:
                raw = {}
            defaults = {k: raw[k] for k in _DEFAULTS if raw.get(k) is not None}
        if not isinstance(template, str):
            template = None
        return cls(
            tokenizer,
            chat_template,
            defaults,
            tool_call_parser,
            None
            if reasoning_parser is None
            else ReasoningSettings.of(reasoning_parser, template, tokenizer),
            _model_type(model_dir),
            dict(default_kwargs or {}),
            _encoding(model_dir, tool_call_parser, template),
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict,
        *,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The prompt ids of ``messages`` (``kwargs``: the template's, ``add_generation_prompt``
        true unless they say otherwise). ``add_special_tokens``: the rendered text encoded with
        the tokenizer's special tokens (a BOS...), as ``/v1/tokenize`` may ask; a chat request's
        never are, the template writing its own (SGLang, as ``apply_chat_template``)."""
        given = kwargs.pop("chat_template", None)  # the request's own (a trusted one)
        template = given or self.template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise OpenAIError(
                "this model's tokenizer has no chat template: start the engine with "
                "--chat-template, or use /v1/completions",
                "messages",
            )
        try:
            add_generation_prompt = kwargs.pop("add_generation_prompt", True)
            text = self.renderer.render(
                messages, tools, given or self.template, add_generation_prompt, kwargs
            )
        except Exception as exc:  # the template's own error (jinja raise_exception, ...)
            raise OpenAIError(f"the chat template refused the messages: {exc}", "messages") from exc
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if add_special_tokens or backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        # what apply_chat_template's own tokenizing does (no special tokens added), straight
        # through the Rust tokenizer: transformers' call around it cost 17 us of the 42 us a
        # request took to render (one sample a request on /v1/responses)
        return backend.encode(text, add_special_tokens=False).ids

    def prefix_ids(self, text: str) -> list[int]:
        """The ids of a continued assistant message's text, to follow its rendered turn
        (``_append_assistant_prefix_to_prompt_ids``: encoded as a prompt, less a leading BOS)."""
        ids = list(self.tokenizer.encode(text))
        if ids and ids[0] == getattr(self.tokenizer, "bos_token_id", None):
            ids = ids[1:]
        return ids


def chat_request(
    body: Any,
    settings: ChatSettings,
    context_length: int,
    *,
    add_generation_prompt: bool | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, what the answer needs)`` for a ``/v1/chat/completions``
    body; OpenAIError when SGLang would refuse it (or the engine cannot do what it asks).
    ``add_generation_prompt``: ``/v1/tokenize``'s field (SGLang's
    ``_format_add_generation_prompt``; a chat request has none)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("Messages cannot be empty.", "messages")  # SGLang's words
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise OpenAIError("model: Input should be a valid string", "model")
    for flag in (
        "stream",
        "logprobs",
        "continue_final_message",
        "separate_reasoning",
        "stream_reasoning",
        *_NOT_STREAMED,
        *_SGLEXT,
        *SGLEXT_FLAGS,
        *_FLAT,
    ):
        if not isinstance(body.get(flag, False), bool | None):
            raise OpenAIError(f"{flag}: Input should be a valid boolean", flag)
    if body.get("return_sampling_mask") and not body.get("return_meta_info"):
        raise OpenAIError("return_sampling_mask requires return_meta_info=true.")  # SGLang's
    flat = bool(body.get("return_flat_raw_output_top_logprobs"))
    if flat and not body.get("return_meta_info"):
        raise OpenAIError("return_flat_raw_output_top_logprobs requires return_meta_info=true.")
    given_kwargs = body.get("chat_template_kwargs")
    if (
        isinstance(given_kwargs, dict)
        and "chat_template" in given_kwargs
        and not settings.trust_request_template
    ):  # serving_chat._validate_request
        raise OpenAIError(
            "Request-supplied chat_template is not allowed. Start the server with "
            "--trust-request-chat-template to permit it.",
            "chat_template_kwargs",
        )
    if (
        settings.model_type == "gpt_oss"
        and isinstance(given_kwargs, dict)
        and given_kwargs.get("reasoning_effort") == "none"
    ):  # serving_chat._convert_to_internal_request, for gpt-oss
        raise OpenAIError("Harmony does not support reasoning effort none")
    if body.get("stream"):  # SGLang's refusals (serving_chat._convert_to_internal_request)
        for flag, refusal in _NOT_STREAMED.items():
            if body.get(flag):
                raise OpenAIError(refusal)
    given = body.get("input_ids")  # the prompt's ids: no template
    if given is not None and not (isinstance(given, list) and all(is_int(t) for t in given)):
        raise OpenAIError("input_ids: Input should be a valid list of integers", "input_ids")
    top = body.get("top_logprobs")
    if top is not None and not is_int(top):
        raise OpenAIError("top_logprobs: Input should be a valid integer", "top_logprobs")
    grammar = response_format(body.get("response_format"))
    if settings.kimi_k3 and unconstrained_format(body.get("response_format")):
        grammar = {}  # K3's encoding hands the format to the model (SGLang: no grammar)
    tools = _tools(body.get("tools"))
    _check_schemas(tools, messages)
    # GLM-4.7's calls are held by a grammar of the whole answer (SGLang: --tool-call-parser
    # glm47, given or found by auto)
    glm = settings.tool_parser == "glm47"
    choice, tools, forced = _tool_choice(body, tools, grammar, settings.tool_parser, glm)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise OpenAIError("stream_options: Input should be a valid dictionary", "stream_options")
    try:  # reasoning_effort and reasoning: the template's thinking switches
        effort, request_kwargs = normalize_effort(body)
    except EffortError as exc:
        raise OpenAIError(str(exc), exc.field) from None
    if request_kwargs is not None and not isinstance(request_kwargs, dict):
        raise OpenAIError("chat_template_kwargs: Input should be a valid dictionary")
    hunyuan = settings.reasoning is not None and settings.reasoning.effort_levels
    if not hunyuan and isinstance(request_kwargs, dict) and "reasoning_effort" in request_kwargs:
        # serving_chat.py:1291-1307: the kwarg moves into reasoning_effort, over the field
        request_kwargs = dict(request_kwargs)
        moved = request_kwargs.pop("reasoning_effort")
        if moved is not None:
            effort = moved
    if settings.default_kwargs:  # --default-chat-template-kwargs (serving_chat.py:1805):
        # under the request's own; a default reasoning_effort where the request has none
        request_kwargs = {**settings.default_kwargs, **(request_kwargs or {})}
        if effort is None and request_kwargs.get("reasoning_effort") is not None:
            effort = request_kwargs["reasoning_effort"]
    if hunyuan:
        # Hunyuan's effort template (serving_chat.py:1817): the effort as it takes it, the kwarg
        # taken out; SGLang's 400 for one it does not take (serving_base.py:123, its ValueError)
        try:
            effort, request_kwargs = hunyuan_effort(effort, request_kwargs)
        except ValueError as exc:
            raise OpenAIError(str(exc), kind="BadRequest") from None
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    kwargs.update(request_kwargs or {})
    toggle = settings.toggle
    if toggle is not None and toggle.effort_kwarg is not None and effort == "low":
        # serving_chat._apply_jinja_template: a "low" effort sets the template's effort kwarg
        kwargs.setdefault(toggle.effort_kwarg, True)
    if "add_generation_prompt" in kwargs:  # SGLang passes it too: the template's TypeError
        raise OpenAIError(
            "the chat template refused the messages: apply_chat_template() got multiple "
            "values for keyword argument 'add_generation_prompt'",
            "chat_template_kwargs",
        )
    # as SGLang hands them to the template (protocol.Tool.model_dump(): template_tools)
    kept = {t["function"]["name"] for t in tools} if choice != "none" else set()
    template_tools = [
        template_tool(raw) for raw in body.get("tools") or () if raw["function"]["name"] in kept
    ] or None
    dsv32 = settings.encoding == "dsv32"  # DeepSeek V3.2's encoder, not a template
    render_tools = template_tools
    images: list[Any] | None = None  # a vision model's: the image parts' URLs, in order
    try:  # as SGLang's pydantic models dump them for the template (template_dump)
        if settings.kimi_k3:  # Kimi K3's encoding: its own dump, tools and kwargs
            rendered = k3_messages(messages)
            kwargs = k3_kwargs(body, request_kwargs, effort)
            render_tools = k3_tools(body.get("tools"))  # every one, whatever the choice
        else:
            fmt = "string" if dsv32 else settings.content_format
            images = [] if settings.vision and not dsv32 else None
            rendered = [template_message(m, i, fmt, images=images) for i, m in enumerate(messages)]
    except DumpError as exc:
        raise OpenAIError(str(exc), exc.field) from None
    prefix = None
    continued = bool(body.get("continue_final_message"))
    if settings.kimi_k3:  # always the generation prompt; the last message only continued
        if continued:
            rendered, prefix = _last_assistant(rendered, continued)
    elif add_generation_prompt is None or continued or dsv32:
        rendered, prefix = _last_assistant(rendered, continued)
    kwargs["add_generation_prompt"] = settings.kimi_k3 or add_generation_prompt is not False
    if given is not None:  # SGLang: the ids as they are, the template skipped
        prompt = list(given)
    else:
        if dsv32:  # all the request's tools, a named choice's too (serving_chat.py:2106)
            every = [template_tool(raw) for raw in body.get("tools") or ()]
            thinking = (request_kwargs or {}).get("thinking", False)
            prompt = _dsv32_prompt(rendered, every if template_tools else None, thinking, settings)
        else:
            prompt = settings.render(rendered, render_tools, kwargs)
        if prefix:  # the assistant turn opened, its start as the model continues it
            prompt += settings.prefix_ids(prefix)

    sampling: dict[str, Any] = {}
    for name, default in _DEFAULTS.items():
        value = body.get(name)
        sampling[name] = value if value is not None else settings.defaults.get(name, default)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    too_many = is_int(limit) and context_length and limit > context_length
    if too_many and not settings.auto_truncate:  # _validate_request's
        raise OpenAIError(
            f"max_completion_tokens is too large: {limit}.This model supports at most "
            f"{context_length} completion tokens."
        )
    unset = max(0, context_length - len(prompt))  # all the context leaves (SGLang: None)
    sampling["max_new_tokens"] = limit if limit is not None else unset
    for name, native in _SAMPLING.items():  # the rest by /v1/completions' names
        if name not in _NOT_SAMPLING and body.get(name) is not None:
            sampling[native] = body[name]
    sampling.update(grammar)
    if template_tools:  # the format's markers may be special tokens (SGLang: serving_chat)
        sampling["skip_special_tokens"] = False
    if (
        settings.tool_parser == "kimi_k3"
        and choice != "none"
        and (template_tools or _told(messages))
    ):
        # serving_chat's tool_call_stop (chat_encoding_spec kimi_k3; its effective tools, a
        # system message's too): the tools channel's close ends the answer
        stop = sampling.get("stop")
        if stop is None or isinstance(stop, str | list):  # (another: the native route's 400)
            stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
            sampling["stop"] = stop if K3_TOOLS_CLOSE in stop else [*stop, K3_TOOLS_CLOSE]
    grammar_from = "tool_choice" if forced else ("response_format" if grammar else None)
    whole = None
    if glm and template_tools and not (grammar or _constrained(body)):
        whole = _glm_turn(tools, forced is not None, body, request_kwargs, settings.tokenizer)
    if whole is not None:  # the whole answer, its reasoning too (SGLang's full_assistant_ebnf)
        sampling.update(ebnf=whole, ebnf_full_assistant=True)
        grammar_from = "tool_choice" if forced is not None else "tools"
    elif forced is not None:  # only tool calls (tool_choice required or named)
        sampling.update(forced)
    elif settings.tool_parser is not None and choice == "auto" and template_tools:
        # a strict tool holds the calls of an auto answer to its schema, where the server was
        # told the format (serving_chat: only with --tool-call-parser; with another constraint,
        # that one alone: SGLang logs that they cannot go together)
        alone = grammar or _constrained(body)
        parallel = body.get("parallel_tool_calls", True)
        strict = None if alone else strict_calls(tools, settings.tool_parser, parallel=parallel)
        if strict is not None:
            sampling.update(strict)
            grammar_from = "tools"
    native_body: dict[str, Any] = {
        "input_ids": prompt,
        "sampling_params": sampling,
        "return_logprob": bool(body.get("logprobs")),
        # SGLang 0.5.23 takes any number (none below 1; OpenAI's bound of 20 is not there),
        # and without logprobs: true, none at all
        "top_logprobs_num": max(top or 0, 0) if body.get("logprobs") else 0,
        "return_text_in_logprobs": True,
    }
    for name in CHAT_PASSED_ON:  # checked by the native route, as SGLang passes them on
        if body.get(name) is not None:
            native_body[name] = body[name]
    if images:  # the prompt's images, in order (one prompt: n > 1 makes it a batch of one)
        many = is_int(body.get("n")) and body["n"] > 1
        native_body["image_data"] = [images] if many else images
    if flat:  # the output's top log-probs as flat arrays in meta_info, base64 by default
        native_body["return_flat_raw_output_top_logprobs"] = True
        native_body["return_flat_raw_top_logprobs_b64"] = body.get(_FLAT[1]) is not False
    if (
        body.get("return_prompt_token_ids")
        or body.get("return_token_ids")
        or body.get("return_input_ids_in_sglext")
    ):
        native_body["return_prompt_token_ids"] = True
    reasoning = _reasoning(body, settings, request_kwargs, effort)
    if reasoning is not None and reasoning.keep_special:  # Mistral's [THINK] tags are special
        sampling["skip_special_tokens"] = False  # tokens (serving_chat: SGLang keeps them)
    if settings.model_type in _SPECIAL_FORMATS:  # so are Harmony's and Gemma 4's, whatever the
        sampling["skip_special_tokens"] = False  # request says (is_gpt_oss, is_gemma4)
    if settings.kimi_k3:  # Kimi K3's markers, whatever the request says
        sampling["skip_special_tokens"] = False
    if reasoning is not None and reasoning.counted:  # a thinking request: any grammar waits
        native_body["require_reasoning"] = True  # for the end of its reasoning (as SGLang's)
    if reasoning is not None and reasoning.end_ids:  # K2's effort's end tag (serving_chat's
        custom = dict(sampling.get("custom_params") or {})  # set_request_reasoning_end_token_ids)
        sampling["custom_params"] = {**custom, REASONING_END_KEY: list(reasoning.end_ids)}
    adapter_in_model = name_adapter(native_body, model, body.get("lora_path"))
    if body.get("stream"):
        native_body["stream"] = True
    n = body.get("n", 1)
    options = {
        "model": model,
        "adapter_in_model": adapter_in_model,
        # the field a grammar was made of, to name in its errors
        "grammar_from": grammar_from,
        "n": n if is_int(n) and n > 0 else 1,
        "logprobs": bool(body.get("logprobs")),
        # a JSON answer is data, not tool calls (SGLang: _response_parser_json_response_format)
        # (without --tool-call-parser nothing is read, a forced call's JSON array left in the
        # content: _tool_call_parsing_active)
        # (MiniMax-M3's calls are read in a request without tools too: parses_without_tools)
        "parse_tools": (
            (bool(template_tools) and settings.tool_parser is not None)
            or (not tools and settings.tool_parser in PARSES_WITHOUT_TOOLS)
        )
        and "json_schema" not in grammar,
        "tools": tools or [],
        # the format calls are in
        "tool_parser": answer_format(
            settings.tool_parser, forced, isinstance(body.get("tool_choice"), dict)
        ),
        # Kimi K2's call ids count the conversation's calls (serving_chat: kimi_k2's alone)
        # (and Kimi K3's: NAME:K)
        "kimi_ids_from": history_calls(messages) if settings.tool_parser in _KIMI_IDS else None,
        "kimi_ids": settings.tool_parser,
        # the served tokenizer: its vocabulary spells hunyuan's tokens (FunctionCallParser's)
        "tokenizer": settings.tokenizer,
        "stream": bool(body.get("stream")),
        "include_usage": bool(stream_options.get("include_usage")),
        "continuous_usage_stats": bool(stream_options.get("continuous_usage_stats")),
        "prompt_tokens": len(prompt),
        # usage's prompt tokens: Kimi K3's less its generation stub (_reported_prompt_tokens)
        "stub_tokens": settings.kimi_k3,
        "reasoning": reasoning,
        "token_bytes": settings.token_bytes,
        # each choice's prompt ids, its answer's ids, its native meta_info (SGLang 0.5.23)
        "return_prompt_token_ids": bool(
            body.get("return_prompt_token_ids") or body.get("return_token_ids")
        ),
        "return_token_ids": bool(body.get("return_token_ids")),
        "return_meta_info": bool(body.get("return_meta_info")),
        # the response's sglext: the prompt's ids, each choice's ids
        "sglext_input_ids": bool(body.get("return_input_ids_in_sglext")),
        "sglext_output_ids": bool(body.get("return_output_ids_in_sglext")),
        "return_cached_tokens_details": bool(body.get("return_cached_tokens_details")),
        "routed_experts": body.get("return_routed_experts") is True,
        "hidden_states": hidden_mode(body),
        # the server reads reasoning or tool calls (SGLang: a step's log-probs that went with
        # no chunk then go alone)
        "server_parsers": settings.reasoning is not None or settings.tool_parser is not None,
    }
    if reasoning is not None and options["parse_tools"] and settings.tool_parser is not None:
        # a tool-call parser reads the content (serving_chat._tool_call_parsing_active): Muse's
        # reasoning parser keeps the channels' framing for it
        options["reasoning"] = replace(reasoning, tools=True)
    return native_body, options


def _dsv32_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    thinking: Any,
    settings: ChatSettings,
) -> list[int]:
    """The prompt ids of DeepSeek V3.2's encoding (``serving_chat._apply_jinja_template``'s
    ``dsv32`` branch): an empty system message first unless there is one, the request's tools
    on it, ``dsv32_encoding.encode`` in thinking mode where the request's ``thinking`` kwarg is
    true (``_thinking_requested``), encoded as SGLang encodes it (the tokenizer's special
    tokens added). What the encoder refuses: SGLang's 400, a role it does not know its 500."""
    messages = [dict(m) for m in messages]
    for message in messages:
        if message.get("content") is None:
            message["content"] = ""
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})
    if tools:
        messages[0]["tools"] = tools
    try:
        text = dsv32_encode(messages, bool(thinking))
    except ValueError as exc:  # DS32EncodingError, or a call's arguments
        raise OpenAIError(str(exc), "messages", kind="BadRequest") from None
    except UnknownRole as exc:  # serving_base: any other error is its 500
        raise OpenAIError(
            f"Internal server error: {exc}", status=500, kind="InternalServerError"
        ) from None
    return list(settings.tokenizer.encode(text))


def _last_assistant(
    messages: list[dict[str, Any]], continued: bool
) -> tuple[list[dict[str, Any]], str | None]:
    """SGLang's ``serving_chat._handle_last_assistant_message``: a conversation that ends with
    an assistant message of text is either continued (``continue_final_message``: the message
    left out of the template, which opens a new assistant turn, and its text returned, to
    follow the rendered ids) or, without it, sent as the user's (the last message is always
    the user's then)."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        return messages, None
    if continued:
        return messages[:-1], last["content"]
    return [*messages[:-1], {"role": "user", "content": last["content"]}], None


def _reasoning(
    body: dict[str, Any], settings: ChatSettings, kwargs: dict[str, Any] | None, effort: Any
) -> Any:
    """The request's ``reasoning.RequestReasoning`` (None: no ``--reasoning-parser``)."""
    if settings.reasoning is None:
        return None
    previous = ""
    last = body["messages"][-1]
    if body.get("continue_final_message") and isinstance(last, dict):
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            previous = last["content"]  # the message continued: its tags count
    return settings.reasoning.request(
        kwargs,
        effort,
        separate=body.get("separate_reasoning") is not False,
        stream=body.get("stream_reasoning") is not False,
        previous=previous,
    )


def chat_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``ChatCompletionResponse`` for the native results of ``chat_request``."""
    if options.get("stub_tokens"):  # Kimi K3's prompt tokens less its stub, its meta_info's too
        results = [_stubbed(item) for item in results]
    n = options["n"]
    choices = []
    reasoning = options.get("reasoning")
    for index, item in enumerate(results):
        meta = item["meta_info"]
        text = item.get("text", "")
        reason = dict(meta["finish_reason"]) if meta.get("finish_reason") else None
        thought = None
        if reasoning is not None and reasoning.separate:  # tool calls: read in what follows
            thought, text = reasoning.parser().parse(text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": thought or None,
        }
        if options["parse_tools"]:
            parser = ToolCallParser(
                options["tools"], options.get("tool_parser"), options.get("tokenizer")
            )
            if parser.has_tool_call(text):
                # the content is the format's text around the calls, also when none parses (an
                # incomplete call dropped: _process_tool_calls' "no complete call parsed")
                message["content"], calls = parser.parse(text)
                if calls:
                    first = options.get("kimi_ids_from")
                    style = options.get("kimi_ids")
                    message["tool_calls"] = [
                        _tool_call(c, i, first, style) for i, c in enumerate(calls)
                    ]
                    if reason and reason["type"] == "stop":
                        reason = {"type": "tool_calls", "matched": None}
        message["content"] = message["content"] or ""
        choice = {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(meta, options["token_bytes"])
            if options["logprobs"]
            else None,
            "finish_reason": reason["type"] if reason else None,
            "matched_stop": reason.get("matched") if reason else None,
        }
        hidden = choice_hidden_states(meta.get("hidden_states"), options.get("hidden_states"))
        if hidden is not None:
            choice["hidden_states"] = hidden
        if options.get("return_prompt_token_ids") and item.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = item["prompt_token_ids"]
        if options.get("return_token_ids"):
            choice["response_token_ids"] = item["output_ids"]
        if options.get("return_meta_info"):
            choice["meta_info"] = meta
        choices.append(choice)
    first = results[0]["meta_info"]
    answer = {
        "id": first["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": options["model"],
        "choices": choices,
        "usage": results_usage(results, n, options.get("cache_report", False)),
        "metadata": {"weight_version": first["weight_version"]},
    }
    sglext = _sglext(
        response_sglext(first, options),
        results[0].get("prompt_token_ids") if options.get("sglext_input_ids") else None,
        [r["output_ids"] for r in results] if options.get("sglext_output_ids") else None,
    )
    if sglext:
        answer["sglext"] = sglext
    return answer


def _stubbed(item: Mapping[str, Any]) -> dict[str, Any]:
    """A native result whose ``meta_info.prompt_tokens`` is as Kimi K3's usage counts it
    (``_build_chat_response``' ``_reported_prompt_tokens``)."""
    meta = item["meta_info"]
    return {**item, "meta_info": {**meta, "prompt_tokens": reported_prompt_tokens(
        meta.get("prompt_tokens", 0))}}  # fmt: skip


def _sglext(
    out: dict[str, Any], input_ids: list[int] | None, output_ids: list[list[int]] | None
) -> dict[str, Any]:
    """SGLang's ``SglExt``: ``out`` (its fields before the ids) with the ids (its fields that
    are null left out)."""
    if input_ids is not None:
        out["input_ids"] = list(input_ids)
    if output_ids is not None:
        out["output_ids"] = [list(ids) for ids in output_ids]
    return out


def chat_stream(
    batches: AsyncIterator[list[Mapping[str, Any]]], options: Mapping[str, Any]
) -> AsyncIterator[list[dict[str, Any]]]:
    """SGLang's ``chat.completion.chunk`` events for the native chunks of a streamed
    ``chat_request``: ``ChatChunks`` of each batch, the choices' finish chunks last."""
    return mapped(batches, ChatChunks(options, finish_last=True, error_events=True))


class ChatChunks(StreamLayout):
    """``serving_chat._generate_chat_stream``'s chunks, batch by batch (a
    ``chunk_stream.Transform``): a sample's role first, then its content deltas (tool calls
    parsed out of them with ``tools``), its finish; with ``stream_options.include_usage`` a
    last chunk with the whole ``usage``.

    ``finish_last``: the choices' finish chunks wait for the end of the stream and come first
    among its last chunks, in the order the choices finished, as SGLang 0.5.23's route sends
    them (after its generation loop); else each follows its choice's last content (for a
    layout built on these chunks, which reads the finish there). With
    ``continuous_usage_stats`` every chunk but the role's and the finish's has the choice's
    ``usage`` (its ``prompt_tokens_details`` with ``--enable-cache-report``)."""

    OBJECT = "chat.completion.chunk"

    def __init__(
        self, options: Mapping[str, Any], *, finish_last: bool = False, error_events: bool = False
    ) -> None:
        super().__init__(options, error_events=error_events)
        self.finish_last = finish_last
        self.finished: list[dict[str, Any]] = []  # finish chunks held for the end
        self.model = options["model"]
        self.tools: dict[int, StreamingToolCalls] = {}
        self.reasoning = options.get("reasoning")  # reasoning.RequestReasoning or None
        self.thinking: dict[int, Any] = {}  # each choice's reasoning.ThinkParser
        # with the sglext ids asked for: the prompt's ids, and each choice's ids so far
        self.input_ids: list[int] | None = None
        self.output_ids: dict[int, list[int]] = {}
        self.ids_wanted = bool(options.get("sglext_input_ids") or options.get("sglext_output_ids"))

    def _chunk(
        self,
        rid: str,
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        matched_stop: Any = None,
        usage: bool = True,
    ) -> dict[str, Any]:
        """A chunk of one choice (``delta``: its fields after ``reasoning_content``;
        ``usage``: with the choice's usage, when ``continuous_usage_stats`` asks)."""
        out = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "delta": {"reasoning_content": None, **delta},
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "matched_stop": matched_stop,
                }
            ],
        }
        if usage and self.options["continuous_usage_stats"]:
            out["usage"] = self._usage(index)
        return out

    def __call__(self, batch: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        options, offsets, tools, chunk = self.options, self.offsets, self.tools, self._chunk
        out: list[dict[str, Any]] = []
        for content in batch:
            if type(content) is Progress:  # a sample's progress (the engine's own stream)
                index, rid, text = content.index, content.rid, content.text
                self.prompt_tokens[index] = self._prompt_tokens(content.prompt_tokens)
                self.cached_tokens[index] = content.cached
                self.completion_tokens[index] = total = len(content.ids)
                counter = content.reasoning
                self.reasoning_tokens[index] = 0 if counter is None else counter.update(content.ids)
                reason = content.finish
                meta: Any = content
                if self.hidden is not None:
                    self.hidden[index] = content.hidden_states()
                if self.routed is not None:
                    self.routed[index] = content.routed
            else:  # a native chunk
                index = content.get("index", 0)
                meta = content["meta_info"]
                rid = meta["id"]
                self.prompt_tokens[index] = self._prompt_tokens(meta.get("prompt_tokens", 0))
                self.cached_tokens[index] = meta.get("cached_tokens", 0)
                self.completion_tokens[index] = meta.get("completion_tokens", 0)
                self.reasoning_tokens[index] = meta.get("reasoning_tokens", 0)
                text = content.get("text", "")
                reason = meta.get("finish_reason")
                total = meta.get("output_token_logprobs_length", 0)
                if self.hidden is not None:
                    self.hidden[index] = meta.get("hidden_states")
                if self.routed is not None:
                    self.routed[index] = meta.get("routed_experts")
            if self.ids_wanted:
                self._keep_ids(content, index)
            self.last_id = rid
            if self.error_ends(reason, out):  # before its role (SGLang's order)
                break
            if index not in offsets:  # its first chunk: the role
                out.append(chunk(rid, index, {"role": "assistant", "content": ""}, usage=False))
            delta = text[offsets.get(index, 0) :]
            offsets[index] = len(text)
            logprobs = None
            if options["logprobs"]:
                sent = self.logprobs_sent.get(index, 0)
                if sent < total:
                    logprobs = (
                        _progress_logprobs(meta, options["token_bytes"], sent, total)
                        if meta is content
                        else _chat_logprobs(meta, options["token_bytes"], sent, total)
                    )
                self.logprobs_sent[index] = total
            if self.reasoning is not None:  # the reasoning split out of the content
                thought, delta = self._think(index, delta, reason)
                if thought:  # the step's log-probs go with its first chunk
                    out.append(chunk(rid, index, {"reasoning_content": thought}, logprobs=logprobs))
                    logprobs = None
            if options["parse_tools"]:  # _process_tool_call_stream's chunks (pydantic's)
                parser = tools.get(index) or StreamingToolCalls(
                    ToolCallParser(
                        options["tools"], options.get("tool_parser"), options.get("tokenizer")
                    )
                )
                tools[index] = parser
                delta, pieces = parser.feed(delta)
                if reason is not None:  # what it held back; the rest of a call cut short
                    if reason["type"] != "abort":
                        delta += parser.flush()
                    pieces += parser.unsent()
                if delta:
                    out.append(self._model_chunk(rid, index, {"content": delta}))
                for piece in pieces:
                    first, style = options.get("kimi_ids_from"), options.get("kimi_ids")
                    call = {"tool_calls": [_tool_call_piece(piece, first, style)]}
                    out.append(self._model_chunk(rid, index, call))
            elif delta or (logprobs is not None and not options.get("server_parsers")):
                # (SGLang drops the log-probs of a step whose text is held back when the
                # server has no parsers: here they go out with empty content)
                out.append(chunk(rid, index, {"content": delta}, logprobs=logprobs))
                logprobs = None
            if logprobs is not None:  # the step's log-probs that went with no chunk: alone
                out.append(chunk(rid, index, {}, logprobs=logprobs))
            if reason is not None:
                kind = reason["type"]
                if kind == "stop" and tools.get(index) is not None and tools[index].calls:
                    kind, reason = "tool_calls", {"type": "tool_calls", "matched": None}
                finish = chunk(
                    rid, index, {}, finish_reason=kind, matched_stop=reason.get("matched"),
                    usage=False,
                )  # fmt: skip
                (self.finished if self.finish_last else out).append(finish)
        return out

    def _model_chunk(self, rid: str, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        """A chunk of one choice as SGLang's pydantic ``ChatCompletionStreamResponse`` writes
        it (its tool-call stream's: the delta's null fields and a null ``usage`` written out,
        no log-probs)."""
        choice = {"index": index, "delta": {"role": None, "content": None,
                  "reasoning_content": None, **delta}, "logprobs": None,
                  "finish_reason": None, "matched_stop": None}  # fmt: skip
        usage = None
        if self.options["continuous_usage_stats"]:
            usage = self._usage(index)
        return {"id": rid, "object": self.OBJECT, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}  # fmt: skip

    def _prompt_tokens(self, tokens: int) -> int:
        """The prompt tokens usage counts (Kimi K3's less its stub: _reported_prompt_tokens)."""
        return reported_prompt_tokens(tokens) if self.options.get("stub_tokens") else tokens

    def _usage(self, index: int) -> dict[str, Any]:
        """A choice's usage so far (``continuous_usage_stats``), its cached tokens with the
        cache report (``_continuous_usage_cached_details``)."""
        return _usage(
            self.prompt_tokens[index],
            self.completion_tokens[index],
            self.reasoning_tokens.get(index, 0),
            self.cached_tokens[index] if self.options.get("cache_report") else None,
        )

    def _keep_ids(self, content: Any, index: int) -> None:
        """The prompt's ids (once: every choice has the same prompt) and the choice's ids so
        far, for the sglext chunk at the end."""
        progress = type(content) is Progress
        if self.input_ids is None:
            prompt = content.prompt_ids if progress else content.get("prompt_token_ids")
            if prompt is not None:
                self.input_ids = list(prompt)
        self.output_ids[index] = content.ids if progress else content["output_ids"]

    def end(self) -> list[dict[str, Any]]:
        """After the choices' last chunks: their finish chunks (``finish_last``), a chunk of
        each choice's hidden states when asked for, the ``sglext`` chunk when it has something
        (the cached tokens' details, the ids; no choices, ``usage`` null:
        ``ChatCompletionStreamResponse``), then the usage chunk
        (``stream_options.include_usage``)."""
        out = self.finished + self.hidden_chunks(self.hidden_chunk)
        self.finished = []
        options = self.options
        ids = not self.ended  # none after an error event (SGLang: ``error_aborted``)
        sglext = _sglext(
            self.sglext_fields(),
            self.input_ids if options.get("sglext_input_ids") and ids else None,
            [self.output_ids.get(i, []) for i in range(options["n"])]
            if options.get("sglext_output_ids") and self.output_ids and ids
            else None,
        )
        if sglext:
            out.append(
                {"id": self.last_id, "object": self.OBJECT, "created": self.created,
                 "model": self.model, "choices": [], "usage": None, "sglext": sglext}
            )  # fmt: skip
        return out + self.usage_chunks()

    def hidden_chunk(self, index: int, hidden: Any) -> dict[str, Any]:
        """A ``chat.completion.chunk`` of a choice's hidden states alone."""
        # SGLang's pydantic ChatCompletionStreamResponse, not its content chunks' struct: the
        # delta's null fields and the null usage written out
        delta = {"role": None, "content": None, "reasoning_content": None, "hidden_states": hidden}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice["matched_stop"] = None
        return {"id": self.last_id, "object": self.OBJECT, "created": self.created,
                "model": self.model, "choices": [choice], "usage": None}  # fmt: skip

    def _think(self, index: int, delta: str, reason: Any) -> tuple[str, str]:
        """``(reasoning, content)`` of a choice's new text (``_process_reasoning_stream``)."""
        reasoning = self.reasoning
        if not reasoning.separate:
            return "", delta
        parser = self.thinking.get(index) or self.thinking.setdefault(index, reasoning.parser())
        thought, delta = parser.feed(delta)
        if reason is not None and reason["type"] != "abort":  # what it held back
            more, rest = parser.finish()
            thought, delta = thought + more, delta + rest
        return thought, delta


_CHOICES = "tool_choice: 'auto', 'none', 'required' or {type: function, function: {name}}"
# what a streamed request cannot ask for, with SGLang 0.5.23's refusal of each
_NOT_STREAMED = {
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming. "
    "Please set stream=false when using return_prompt_token_ids=true.",
    "return_token_ids": "return_token_ids is not supported with streaming on "
    "/v1/chat/completions. Please set stream=false when using return_token_ids=true.",
    "return_meta_info": "return_meta_info is not supported with streaming. "
    "Please set stream=false when using return_meta_info=true.",
}
# the output's top log-probs as flat arrays in each choice's meta_info (its logprobs' top
# lists then empty), in base64 unless told not to (SGLang's chat default, unlike /generate's)
_FLAT = ("return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64")
# the response-level ``sglext`` ids (SGLang 0.5.23's SglExt), streamed or not
_SGLEXT = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")


def _tool_choice(
    body: dict[str, Any],
    tools: list[dict[str, Any]],
    grammar: dict[str, str],
    parser: str | None,
    glm: bool = False,
) -> tuple[str, list[dict[str, Any]], dict[str, str] | None]:
    """``(tool_choice as "auto", "none" or "required", the tools the template and the answer
    may use, the sampling params that force tool calls or None)``, checked as SGLang checks
    them (``OpenAIServingChat._validate_request``, ``to_sampling_params``). ``required``: one
    call or more to any tool; a named function: calls to that one only (SGLang's template sees
    only it too)."""
    choice = body.get("tool_choice", "auto")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", tools, None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise OpenAIError(_CHOICES, "tool_choice")
        if not tools:
            raise OpenAIError(
                "Tools cannot be empty if tool choice is set to a specific tool.", "tool_choice"
            )
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise OpenAIError(f"Tool '{name}' not found in tools list.", "tool_choice")
    elif choice != "required":
        raise OpenAIError(_CHOICES, "tool_choice")
    elif not tools:
        raise OpenAIError("Tools cannot be empty if tool choice is set to required.", "tool_choice")
    # with GLM-4.7's grammar of the whole answer, or a format whose forced calls SGLang does not
    # constrain, SGLang takes the other constraint instead
    loose = parser in NATIVE_FORCED or (glm and not any(t["function"].get("strict") for t in tools))
    if (grammar or _constrained(body)) and not loose:
        raise OpenAIError(
            "tool_choice 'required' or a named tool cannot be combined with response_format, "
            "regex, or ebnf: the tool-call constraint and the output constraint cannot both be "
            "honored.",
            "tool_choice",
        )
    if not isinstance(body.get("parallel_tool_calls", True), bool | None):
        raise OpenAIError(
            "parallel_tool_calls: Input should be a valid boolean", "parallel_tool_calls"
        )
    if glm:  # the answer's grammar forces the calls, read in GLM-4.7's format
        return "required", tools, {}
    try:
        forced = forced_calls(
            tools,
            parser,
            named=isinstance(choice, dict),
            parallel=body.get("parallel_tool_calls", True),
        )
    except ValueError as exc:  # tools whose $defs disagree
        raise OpenAIError(str(exc), "tools") from None
    return "required", tools, forced


def _glm_turn(
    tools: list[dict[str, Any]],
    required: bool,
    body: dict[str, Any],
    template_kwargs: dict[str, Any] | None,
    tokenizer: Any,
) -> str | None:
    """The EBNF grammar of a whole GLM-4.7 answer offered ``tools`` (``glm_grammar``), as
    SGLang's chat route puts it on every request with tools but none ``strict``, and here on
    those with a strict tool too (SGLang constrains those by xgrammar's own GLM-4.7 tag, which
    holds a strict tool's values to its whole schema; llguidance has no such tag): reasoning
    unless the template's ``enable_thinking`` is false, at least one call when ``required``;
    written in Lark for llguidance where the tags are tokens (``glm_turn``). None (logged)
    where SGLang's grammar builder fails: then nothing is constrained, as there."""
    thinking = (template_kwargs or {}).get("enable_thinking")
    try:
        return glm_turn(
            [t["function"] for t in tools],
            thinking=True if thinking is None else bool(thinking),
            tokenizer=tokenizer,
            required=required,
            parallel=body.get("parallel_tool_calls") is not False,
        )
    except (ValueError, TypeError, AttributeError, NotImplementedError) as exc:
        log.warning("glm_grammar_failed", error=str(exc)[:200])
        return None


def _constrained(body: dict[str, Any]) -> bool:
    """Whether ``body`` constrains its answer by ``regex`` or ``ebnf``."""
    return any(body.get(k) for k in ("regex", "ebnf"))


def _check_schemas(tools: list[dict[str, Any]], messages: list[Any]) -> None:
    """The tools' ``parameters``, the request's then its system and developer messages', their
    type names rewritten in place and checked as JSON Schemas (``tool_schemas``; SGLang's
    ``_validate_request``)."""
    offered = [t["function"] for t in [*tools, *_message_tools(messages)]]
    for i, fn in enumerate(offered):
        error = schema_error(i, fn.get("parameters"))
        if error is not None:
            raise OpenAIError(error, "tools")


def _message_tools(messages: list[Any]) -> list[dict[str, Any]]:
    """The tools root, system and developer messages carry (``_effective_tools``), those with
    a function."""
    found = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role.lower() in _TOOL_ROLES:
            listed = message.get("tools")
            if isinstance(listed, list):
                found += [t for t in listed if isinstance(t, dict) and _is_fn(t)]
    return found


def _told(messages: list[Any]) -> bool:
    """A root, system or developer message has tools of its own (``_effective_tools``)."""
    return any(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and m["role"].lower() in _TOOL_ROLES
        and m.get("tools")
        for m in messages
    )


def _is_fn(tool: dict[str, Any]) -> bool:
    return isinstance(tool.get("function"), dict)


def _tools(raw: Any) -> list[dict[str, Any]]:
    """The request's ``tools``, checked (a malformed schema is a 400 naming it)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise OpenAIError("tools: Input should be a valid list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIError(f"{where}: expected {{type: function, function: {{...}}}}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(f"{where}.function.name: a non-empty string is required", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise OpenAIError(f"{where}.function.parameters: expected a JSON schema", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise OpenAIError(f"{where}.function.description: expected a string", "tools")
        bools = [(f"function.{key}", fn.get(key)) for key in BOOL_FIELDS]
        for name, value in [*bools, ("defer_loading", tool.get("defer_loading"))]:
            try:  # pydantic's reading of an optional bool (SGLang's Function and Tool)
                lax_bool(value)
            except ValueError as exc:
                raise OpenAIError(f"{where}.{name}: {exc}", "tools") from None
        fn = {k: v for k, v in fn.items() if v is not None}
        if "strict" in fn:
            fn["strict"] = lax_bool(fn["strict"])
        tools.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError("Tool names must be unique across request and message tools.", "tools")
    return tools


def _tool_call(
    call: Mapping[str, str], index: int, kimi_from: int | None = None, style: str | None = None
) -> dict[str, Any]:
    """A call of the answer (``index``: its place among them), its id a fresh one, or with
    ``kimi_from`` (the calls of the conversation before it) Kimi's, by ``style``, the
    ``--tool-call-parser``: K2's ``functions.NAME:K``, K3's ``NAME:K``
    (``serving_chat._process_tool_call_id``)."""
    if kimi_from is None:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
    elif style == "kimi_k3":
        call_id = k3_id(call["name"], kimi_from + index)
    else:
        call_id = kimi_id(call["name"], kimi_from + index)
    return {
        "id": call_id,
        "index": index,
        "type": "function",
        "function": {"name": call["name"], "arguments": call["arguments"]},
    }


def _tool_call_piece(
    piece: Mapping[str, Any], kimi_from: int | None = None, style: str | None = None
) -> dict[str, Any]:
    """A streamed call's delta (``serving_chat._process_tool_call_stream``): its first names
    it and has its id; the next ones have null id and name and add to its arguments."""
    if piece["name"] is not None:
        call = {"name": piece["name"], "arguments": piece["arguments"]}
        return _tool_call(call, piece["index"], kimi_from, style)
    return {
        "id": None,
        "index": piece["index"],
        "type": "function",
        "function": {"name": None, "arguments": piece["arguments"]},
    }


def _progress_logprobs(p: Progress, tokens: TokenBytes, lo: int, hi: int) -> dict[str, Any]:
    """``_chat_logprobs`` of a streamed sample's tokens ``lo..hi``, read from its progress
    (what its native chunk's entries would hold, without building them)."""
    text = p.token_text or _no_text
    tops = p.tops or []
    content = []
    for k in range(lo, hi):
        top = tops[k] if k < len(tops) and tops[k] is not None else []
        token = p.ids[k]
        entry = _token_entry(token, text(token), p.logprobs[k], tokens)
        entry["top_logprobs"] = [_token_entry(t, text(t), lp, tokens) for lp, t in top]
        content.append(entry)
    return {"content": content}


def _chat_logprobs(
    meta: Mapping[str, Any], tokens: TokenBytes, lo: int = 0, hi: int | None = None
) -> dict[str, Any]:
    """``ChoiceLogprobs`` of output tokens ``lo..hi`` (``_build_token_logprobs_from_raw``)."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    hi = len(entries) if hi is None else hi
    content = []
    for k in range(lo, hi):
        logprob, token, text = entries[k]
        top = tops[k] if k < len(tops) and tops[k] is not None else []
        entry = _token_entry(token, text, logprob, tokens)
        entry["top_logprobs"] = [_token_entry(t, s, lp, tokens) for lp, t, s in top]
        content.append(entry)
    return {"content": content}


def _token_entry(
    token: int, text: str | None, logprob: float, tokens: TokenBytes
) -> dict[str, Any]:
    """A token's ``{token, bytes, logprob}``: its text (none: ``""``), and its own bytes
    where the tokenizer spells them (``token_bytes``), else its text's."""
    return {"token": text or "", "bytes": tokens.bytes_of(token, text), "logprob": logprob}
