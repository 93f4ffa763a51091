"""The type of each field of a request body, checked as SGLang 0.5.23 checks it before its
route runs: its pydantic request models, field for field in their order, one TypedDict each
(``srt/entrypoints/openai/protocol.py``: ``CompletionRequest``, ``ChatCompletionRequest``,
``TokenizeRequest``, ``DetokenizeRequest``, ``ResponsesRequest``, ``ScoringRequest``,
``V1RerankReqInput``, ``EmbeddingRequest``, ``ClassifyRequest``; ``anthropic/protocol.py``;
``ollama/protocol.py``), with their validators.

pydantic's lax mode is part of the contract: SGLang takes ``"n": "2"``, ``"stream": 1`` or
``"temperature": "0.5"`` and runs with the converted values, so a ``Checker`` writes those back
into the body; it refuses ``"n": null``, ``"user": 1`` or ``"stream_options": false``, which
the routes answer in the shape of SGLang's ``RequestValidationError`` handler
(``type: "Bad Request"``, ``param: null``). Other keys are left as they are, as SGLang's
models ignore them (and noted: ``ignored_fields``). Fields whose check is a route's own
(messages, tools, tool_choice, response_format, reasoning_effort, input items: their contents,
in SGLang's words) are typed loosely here; ranges and meanings stay with the routes.
``/generate``'s dataclass and JSON contract: ``stages.engine.generate_contract``. The models of
``/v1/decisions`` (``DecisionRequest``) and ``/v1/systemone`` (``SystemOneRequest``, answered
with FastAPI's 422 detail list), whose nested questions are checked whole, are pydantic models
in their routes' modules (``openai_decisions``, ``systemone``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError
from typing_extensions import Required, TypedDict

from stages.engine import ignored_fields

__all__ = [
    "Checker",
    "checked_chat",
    "checked_classify",
    "checked_completion",
    "checked_count_tokens",
    "checked_detokenize",
    "checked_embedding",
    "checked_messages",
    "checked_ollama_chat",
    "checked_ollama_generate",
    "checked_ollama_show",
    "checked_rerank",
    "checked_responses",
    "checked_score",
    "checked_tokenize",
    "validation_message",
]

OneOrMany = list[str] | str | None  # rid, extra_key, cache_salt, stop, stop_regex
MaybeStrings = list[str | None] | str | None  # lora_path, lora_id: one, or one per prompt
Ids = list[list[int]] | list[int] | None  # token ids: one prompt's, or a batch's


class StreamOptions(TypedDict, total=False):
    include_usage: bool | None
    continuous_usage_stats: bool | None


Effort = (
    Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]
    | Annotated[float, Field(ge=0.0, le=0.99, allow_inf_nan=False)]
    | None
)


class _Function(TypedDict, total=False):  # extra keys kept: the routes read the tool as sent
    __pydantic_config__ = {"extra": "allow"}
    description: str | None
    name: Required[str]
    parameters: Any
    strict: bool | None
    defer_loading: bool | None
    key_order: list[str]


class Tool(TypedDict, total=False):
    __pydantic_config__ = {"extra": "allow"}
    type: str
    function: Required[_Function]
    defer_loading: bool | None


class _ChoiceName(TypedDict, total=False):
    __pydantic_config__ = {"extra": "allow"}
    name: str | None


class ToolChoice(TypedDict, total=False):
    __pydantic_config__ = {"extra": "allow"}
    function: Required[_ChoiceName]
    type: Literal["function"]


class _Routing(TypedDict, total=False):  # PDRoutingFields: what a router may add
    bootstrap_host: list[str] | str | None
    bootstrap_port: list[int | None] | int | None
    bootstrap_room: list[int] | int | None
    routed_dp_rank: int | None
    disagg_prefill_dp_rank: int | None


def _positive(value: int) -> int:
    """CompletionRequest's ``validate_max_tokens_positive``."""
    if value <= 0:
        raise ValueError("max_tokens must be positive")
    return value


class CompletionFields(_Routing, total=False):
    model: str
    prompt: Required[list[int] | list[list[int]] | str | list[str]]
    best_of: int | None
    echo: bool
    frequency_penalty: float
    logit_bias: dict[str, float] | None
    logprobs: int | None
    max_tokens: Annotated[int, AfterValidator(_positive)]
    n: int
    presence_penalty: float
    seed: int | None
    stop: OneOrMany
    stream: bool
    stream_options: StreamOptions | None
    suffix: str | None
    temperature: float
    top_p: float
    user: str | None
    return_hidden_states: bool | Literal["last"]
    return_routed_experts: bool
    routed_experts_start_len: int
    return_cached_tokens_details: bool
    return_spec_tokens_details: bool
    return_token_ids: bool
    top_k: int
    min_p: float
    min_tokens: int
    json_schema: str | None
    regex: str | None
    ebnf: str | None
    repetition_penalty: float
    stop_token_ids: list[int] | None
    stop_regex: OneOrMany
    no_stop_trim: bool
    ignore_eos: bool
    skip_special_tokens: bool
    lora_path: list[str | None] | str | None
    session_id: str | None
    session_params: dict[Any, Any] | None
    response_format: Any  # its own check: openai_api.response_format
    custom_params: dict[Any, Any] | None
    custom_logit_processor: str | None
    watermark: dict[str, Any] | None
    images_config: dict[Any, Any] | None
    mm_processor_kwargs: dict[Any, Any] | None
    data_parallel_rank: int | None
    rid: OneOrMany
    extra_key: OneOrMany
    cache_salt: OneOrMany
    priority: int | None
    custom_labels: dict[str, str] | None


class ChatFields(_Routing, total=False):
    messages: Required[list[Any]]  # each its own check: openai_chat._message
    model: str
    frequency_penalty: float
    logit_bias: dict[str, float] | None
    logprobs: bool
    top_logprobs: int | None
    max_tokens: int | None
    max_completion_tokens: int | None
    n: int
    presence_penalty: float
    response_format: Any  # its own check: openai_api.response_format
    seed: int | None
    stop: OneOrMany
    stream: bool
    stream_options: StreamOptions | None
    temperature: float | None
    top_p: float | None
    user: str | None
    tools: list[Any] | None  # each its own check: openai_chat._tools
    tool_choice: Any  # its own check: openai_chat._tool_choice
    parallel_tool_calls: bool
    return_hidden_states: bool | Literal["last"]
    return_routed_experts: bool
    routed_experts_start_len: int
    return_cached_tokens_details: bool
    return_spec_tokens_details: bool
    return_prompt_token_ids: bool
    return_token_ids: bool
    return_meta_info: bool
    return_input_ids_in_sglext: bool
    return_output_ids_in_sglext: bool
    return_sampling_mask: bool
    sampling_logprobs_mode: Literal["selected", "support"] | None
    return_flat_raw_output_top_logprobs: bool
    return_flat_raw_top_logprobs_b64: bool
    reasoning_effort: Any  # its own check, with ``reasoning``: reasoning.normalize_effort
    thinking: Any
    task: Literal["action", "query", "authority", "domain", "title", "read_url"] | None
    top_k: int | None
    min_p: float | None
    min_tokens: int
    regex: str | None
    ebnf: str | None
    repetition_penalty: float | None
    stop_token_ids: list[int] | None
    stop_regex: OneOrMany
    no_stop_trim: bool
    ignore_eos: bool
    continue_final_message: bool
    skip_special_tokens: bool
    lora_path: list[str | None] | str | None
    session_id: str | None
    session_params: dict[Any, Any] | None
    separate_reasoning: bool
    stream_reasoning: bool
    chat_template_kwargs: dict[Any, Any] | None
    max_dynamic_patch: int | None
    min_dynamic_patch: int | None
    use_audio_in_video: bool
    images_config: dict[Any, Any] | None
    video_config: dict[Any, Any] | None
    mm_processor_kwargs: dict[Any, Any] | None
    custom_logit_processor: list[str | None] | str | None
    custom_params: dict[Any, Any] | None
    watermark: dict[str, Any] | None
    input_ids: list[int] | None
    rid: OneOrMany
    extra_key: OneOrMany
    cache_salt: OneOrMany
    priority: int | None
    data_parallel_rank: int | None


class TokenizeFields(TypedDict, total=False):  # TokenizeRequest (other keys: the chat's)
    model: str
    prompt: list[str] | str | None
    messages: list[Any] | None
    tools: list[Tool] | None
    tool_choice: ToolChoice | Literal["auto", "required", "none"] | None
    reasoning_effort: Effort  # false is 0.0 here (the chat request's own check refuses it)
    continue_final_message: bool
    chat_template_kwargs: dict[Any, Any] | None
    add_special_tokens: bool
    add_generation_prompt: bool | None


class DetokenizeFields(TypedDict, total=False):
    model: str
    tokens: Required[list[int] | list[list[int]]]
    skip_special_tokens: bool


class ReasoningParam(TypedDict, total=False):  # ResponseReasoningParam
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"] | None
    summary: Literal["auto", "concise", "detailed"] | None


class ResponsesFields(_Routing, total=False):  # ResponsesRequest
    background: bool | None
    include: (
        list[
            Literal[
                "code_interpreter_call.outputs",
                "computer_call_output.output.image_url",
                "file_search_call.results",
                "message.input_image.image_url",
                "message.output_text.logprobs",
                "reasoning.encrypted_content",
            ]
        ]
        | None
    )
    input: Required[str | list[Any]]  # each item its own check: openai_responses._items
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, Any] | None
    model: str | None
    parallel_tool_calls: bool | None
    previous_response_id: str | None
    reasoning: ReasoningParam | None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"]
    store: bool | None
    stream: bool | None
    temperature: float | None
    text: dict[str, Any] | None  # openai's ResponseTextConfig: openai_responses._text_format
    tool_choice: Literal["auto", "required", "none"] | dict[str, Any]
    tools: list[Any]  # each its own check: openai_responses._tools
    top_logprobs: int | None
    top_p: float | None
    truncation: Literal["auto", "disabled"] | None
    user: str | None
    chat_template_kwargs: dict[str, Any] | None
    request_id: str
    session_id: str | None
    priority: int
    extra_key: str | None
    cache_salt: str | None
    data_parallel_rank: int | None
    frequency_penalty: float
    presence_penalty: float
    stop: str | list[str] | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None


class ScoreFields(TypedDict, total=False):  # ScoringRequest
    query: str | list[int] | None
    items: str | list[str] | list[list[int]] | None
    embed_override_token_id: int | None
    query_embed_overrides: list[list[float]] | None
    item_embed_overrides: list[list[list[float]] | None] | None
    label_token_ids: list[int] | list[list[int]] | None
    apply_softmax: bool
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    return_token_logprobs: bool
    item_first: bool
    return_pooled_hidden_states: bool
    score_extraction_token: str | None
    model: str


def _top_n(value: int | None) -> int | None:
    """V1RerankReqInput's ``validate_top_n`` (its words, which pydantic prefixes again)."""
    if value is not None and value < 1:
        raise ValueError("Value error, parameter top_n should be larger than 0.")
    return value


class RerankFields(TypedDict, total=False):  # V1RerankReqInput
    query: Required[str | list[Any]]  # content parts: openai_rerank._check_content
    documents: Required[list[str | list[Any]]]
    instruct: str | None
    top_n: Annotated[int | None, AfterValidator(_top_n)]
    return_documents: bool


class EmbeddingFields(TypedDict, total=False):  # EmbeddingRequest
    input: Required[str | list[Any]]  # its own check: encode_routes._input_prompt
    model: str
    encoding_format: str
    dimensions: int | None
    user: str | None
    rid: OneOrMany
    priority: int | None
    lora_path: list[str | None] | str | None
    embed_override_token_id: int | None
    embed_overrides: list[list[list[float]] | None] | None


class ClassifyFields(TypedDict, total=False):  # ClassifyRequest
    model: str
    input: Required[str | list[str] | list[int]]
    user: str | None
    rid: OneOrMany
    priority: int | None


def _model_named(value: str) -> str:
    """AnthropicMessagesRequest's ``_validate_model``."""
    if not value:
        raise ValueError("Model is required")
    return value


class CountTokensFields(TypedDict, total=False):  # AnthropicCountTokensRequest
    model: Required[str]
    messages: Required[list[Any]]  # each its own check: anthropic_messages._check
    system: Any  # str or blocks: anthropic_messages._check_content
    thinking: Any  # its own check: anthropic_messages._thinking
    tool_choice: Any  # its own check: anthropic_messages._tools
    tools: Any
    output_config: Any  # its own check: anthropic_messages._output_config
    betas: list[str] | None


class MessagesFields(_Routing, total=False):  # AnthropicMessagesRequest
    model: Required[Annotated[str, AfterValidator(_model_named)]]
    messages: Required[list[Any]]
    max_tokens: Required[Annotated[int, AfterValidator(_positive)]]
    metadata: dict[str, Any] | None
    stop_sequences: list[str] | None
    stream: bool | None
    system: Any
    temperature: float | None
    thinking: Any
    tool_choice: Any
    tools: Any
    top_k: int | None
    top_p: float | None
    output_config: Any
    betas: list[str] | None


class OllamaMessage(TypedDict, total=False):  # extra keys kept: tool_calls, tool_name
    __pydantic_config__ = {"extra": "allow"}
    role: Required[str]
    # required by SGLang 0.5.23's OllamaMessage, which then refuses every tool-call history
    # the ollama Python client sends (it leaves out an empty content): missing is empty here
    content: str
    images: list[str] | None


class OllamaChatFields(TypedDict, total=False):  # ollama/protocol.py OllamaChatRequest
    model: Required[str]
    messages: Required[list[OllamaMessage]]
    stream: bool
    format: Literal["json"] | dict[str, Any] | None
    options: dict[str, Any] | None
    keep_alive: float | str | None
    think: bool | Literal["low", "medium", "high"] | None


class OllamaGenerateFields(TypedDict, total=False):  # OllamaGenerateRequest
    model: Required[str]
    prompt: Required[str]
    suffix: str | None
    system: str | None
    template: str | None
    context: list[int] | None
    stream: bool
    raw: bool
    format: Literal["json"] | dict[str, Any] | None
    options: dict[str, Any] | None
    keep_alive: float | str | None
    images: list[str] | None
    think: bool | None


class OllamaShowFields(TypedDict, total=False):  # OllamaShowRequest
    model: Required[str]


class Checker:
    """A body's fields as one SGLang request model reads them (``fields``: its TypedDict
    here): ``checker(body)`` is ``body`` with the converted values written back (other keys
    as they are); ValueError with ``validation_message``'s words when it refuses them.

    The keys the model does not name, which it ignores, are ``ignored_fields.note``d, but for
    ``extensions`` (keys this engine's route reads beyond SGLang's model); ``note=False``: a
    model that reads part of a body another checks too (none noted)."""

    def __init__(self, fields: type, *, extensions: Iterable[str] = (), note: bool = True) -> None:
        self.adapter: TypeAdapter[Any] = TypeAdapter(fields)
        names = fields.__required_keys__ | fields.__optional_keys__  # type: ignore[attr-defined]
        self.names = frozenset(names) | frozenset(extensions) if note else None

    def __call__(self, body: Any) -> dict[str, Any]:
        try:
            typed = self.adapter.validate_python(body)
        except ValidationError as exc:
            raise ValueError(validation_message(exc)) from None
        if self.names is not None and not self.names.issuperset(body):
            ignored_fields.note(k for k in body if k not in self.names)
        body.update(typed)  # the converted values: "2" is 2 from here on, as in SGLang
        return body


checked_completion = Checker(CompletionFields)
# its before-validator reads ``reasoning`` ({effort, enabled}) too (normalize_reasoning_inputs)
checked_chat = Checker(ChatFields, extensions=("reasoning",))
checked_detokenize = Checker(DetokenizeFields)
checked_score = Checker(ScoreFields)
checked_rerank = Checker(RerankFields)
checked_embedding = Checker(EmbeddingFields)
checked_classify = Checker(ClassifyFields)
checked_messages = Checker(MessagesFields)
checked_count_tokens = Checker(CountTokensFields)
# Ollama's own API has these, which SGLang's models leave out and this engine serves
checked_ollama_chat = Checker(OllamaChatFields, extensions=("tools", "logprobs", "top_logprobs"))
checked_ollama_generate = Checker(OllamaGenerateFields, extensions=("logprobs", "top_logprobs"))
checked_ollama_show = Checker(OllamaShowFields)
_tokenize = Checker(  # a conversation's other keys: the chat request's, checked there
    TokenizeFields, extensions=ChatFields.__optional_keys__ | {"reasoning"}
)
_responses = Checker(ResponsesFields)


def checked_tokenize(body: Any) -> dict[str, Any]:
    """``body`` with its fields as SGLang's ``TokenizeRequest`` reads them (a chat request's
    other fields are the chat route's to check)."""
    body = _tokenize(body)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise ValueError("Value error, Exactly one of 'prompt' or 'messages' must be provided.")
    return body


def checked_responses(body: Any) -> dict[str, Any]:
    """``body`` with its fields as SGLang's ``ResponsesRequest`` reads them, after its
    ``normalize_reasoning_to_thinking``: ``reasoning.effort: "none"`` turns the template's
    thinking off unless ``chat_template_kwargs`` says otherwise (one that is not a dictionary
    then counts as none)."""
    if isinstance(body, dict):
        reasoning = body.get("reasoning")
        if isinstance(reasoning, dict):
            effort = reasoning.get("effort") or reasoning.get("reasoning_effort")
            if effort == "none":
                given = body.get("chat_template_kwargs")
                given = given if isinstance(given, dict) else {}
                body["chat_template_kwargs"] = {
                    "thinking": False,
                    "enable_thinking": False,
                    **given,
                }
    return _responses(body)


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors as SGLang digests them (``_anthropic_validation_message``): one
    ``field: message`` each (``stop.list[str]``: one member of a union the value fits none
    of; the message alone for the whole body), joined by ``; ``."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)
