"""SGLang's ``/v1/decisions`` on the built-in engine: typed questions about an input (a choice
among options, a score on levels, yes or no) answered by the probabilities of single-token
answer labels at the answer position, read from one prefill a question, nothing generated. A
judge's verdict as a number: what a reward function asks a judge model.

As SGLang 0.5.23 serves it (``entrypoints/openai/serving_decisions.py``, its request models in
``protocol.py``: ``DecisionRequest`` and its questions):

- the body: ``input`` (text, or an object or list written as compact JSON), ``questions`` (one
  or more, distinct ``id``s; ``choice``: 2-26 ``options`` of distinct ``name``s, labels ``A``,
  ``B``...; ``score``: 2-10 ``levels``, labels ``0``, ``1``...; ``yes_no``: labels ``yes`` and
  ``no``, ``yes`` and ``no`` describing them), ``temperature`` (> 0: scales the labels'
  probabilities, not ``label_mass``), ``chat_template_kwargs``, ``prompt_format_version``
  (1, the only one), ``return_prompt_token_ids``, ``images``, ``model``; unknown keys refused;
- each question's prompt is version 1's wording (``render_question``) as the user's message of
  the chat template, generation prompt added, its reasoning toggle off; each label must add
  exactly one distinct token after that prompt (``label_token_id``), else the model is refused;
- the answer: per question ``probabilities`` (softmax of the labels' log-probs at
  ``temperature``), ``label_mass`` (their whole-vocabulary probability), ``choice`` (the most
  likely option) or ``score`` (the expected level), and with ``return_prompt_token_ids`` the
  ids scored (``prompt_token_ids``, ``label_token_ids``); ``usage`` counts the prompts.

Refused in SGLang's words: images (text-only models here), a LoRA adapter named in ``model``, a
``prompt_format_version`` other than 1, a chat template that always reasons, a reasoning toggle
set other than false, a reasoning block the template leaves open at the answer position, a
prompt that does not fit the context. Different: SGLang checks the reasoning blocks with the
parser its template detection suggests when ``--reasoning-parser`` is not given; here only a
given parser's are checked (the template's own toggle is turned off either way).
"""

from __future__ import annotations

import json
import math
import string
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from stages.engine.openai_api import BAD_REQUEST, OpenAIError
from stages.engine.openai_score import label_scores
from stages.engine.reasoning import template_toggle
from stages.engine.request_fields import validation_message

__all__ = [
    "PROMPT_FORMAT_VERSION",
    "answer_of",
    "decisions_request",
    "decisions_response",
    "label_context",
    "label_token_id",
    "render_question",
    "request_error",
    "values_of",
]

PROMPT_FORMAT_VERSION = 1  # the prompt wording and labels below
ROUTE = "/v1/decisions"
# a reasoning parser's default modes that name the chat template kwarg turning reasoning on
_PARSER_TOGGLES = ("thinking", "enable_thinking", "explicit_thinking", "explicit_enable_thinking")
_SENTINEL = "DECISION_ANSWER"  # a finished reply's text, rendered to see what opens an answer


# ---- the request, as SGLang's pydantic models read it ---------------------------------------


def is_blank(value: Any) -> bool:
    return not (value.strip() if isinstance(value, str) else value)


def _nonblank(value: Any) -> Any:
    if is_blank(value):
        raise ValueError("must not be blank")
    return value


Text = str | dict[str, Any] | list[Any]  # objects and arrays go into the prompt as JSON
NonBlankText = Annotated[Text, AfterValidator(_nonblank)]
QuestionId = Annotated[str, AfterValidator(_nonblank)]


def _distinct_names(names: list[str]) -> None:
    """Option names that keep the rendered option lines unambiguous."""
    seen = set()
    for name in names:
        key = name.strip().casefold()
        if not key:
            raise ValueError("option names must be nonempty")
        if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in name):
            raise ValueError(
                f"option name {name!r} must not contain control or line break characters"
            )
        if key in seen:
            raise ValueError(f"option name {name!r} repeats another option")
        seen.add(key)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Option(_Strict):
    name: str
    description: Text | None = None


class ChoiceQuestion(_Strict):
    id: QuestionId
    type: Literal["choice"]
    question: NonBlankText
    options: list[Option] = Field(min_length=2, max_length=26)  # labelled A to Z

    @model_validator(mode="after")
    def _names(self) -> ChoiceQuestion:
        try:
            _distinct_names([option.name for option in self.options])
        except ValueError as exc:
            raise ValueError(f"question {self.id!r}: {exc}") from None
        return self


class ScoreQuestion(_Strict):
    id: QuestionId
    type: Literal["score"]
    question: NonBlankText
    levels: list[NonBlankText] = Field(min_length=2, max_length=10)  # labelled 0 to 9


class YesNoQuestion(_Strict):
    id: QuestionId
    type: Literal["yes_no"]
    question: NonBlankText
    yes: Text | None = None
    no: Text | None = None


class ChatCompletionMessageContentImageURL(BaseModel):  # named as SGLang's: errors name it
    """The chat route's image part, as SGLang's ``protocol.py`` reads it: ``detail``
    ``"default"`` taken as ``"auto"``, ``content_hash`` a ``sha256:`` digest
    (``multimodal/cache/identity.parse_content_hash``), lower-cased."""

    url: str
    detail: Literal["auto", "low", "high"] | None = "auto"
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    max_long_side_pixel: int | None = None
    content_hash: str | None = None

    @field_validator("detail", mode="before")
    @classmethod
    def _default_detail_is_auto(cls, value: Any) -> Any:
        return "auto" if value == "default" else value

    @field_validator("content_hash")
    @classmethod
    def _content_hash(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("sha256:"):
            raise ValueError("content_hash must use the form 'sha256:<64 hex digits>'")
        digest = value[len("sha256:") :]
        if len(digest) != 64:
            raise ValueError("content_hash must contain exactly 64 SHA-256 hex digits")
        try:
            bytes.fromhex(digest)
        except ValueError:
            raise ValueError("content_hash contains non-hexadecimal characters") from None
        return "sha256:" + digest.lower()


def _to_image_url(image: Any) -> ChatCompletionMessageContentImageURL:
    return ChatCompletionMessageContentImageURL(url=image) if isinstance(image, str) else image


# an image: the chat route's image part, or its url alone (SGLang's DecisionImage)
DecisionImage = Annotated[ChatCompletionMessageContentImageURL | str, AfterValidator(_to_image_url)]


Question = Annotated[ChoiceQuestion | ScoreQuestion | YesNoQuestion, Field(discriminator="type")]


class DecisionRequest(_Strict):
    input: NonBlankText
    images: list[DecisionImage] = Field(default_factory=list)
    questions: list[Question] = Field(min_length=1)
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool = False
    model: str = "default"

    @field_validator("questions")
    @classmethod
    def _ids(cls, questions: list[Any]) -> list[Any]:
        seen = set()
        for question in questions:
            if question.id in seen:
                raise ValueError(f"question id {question.id!r} repeats another question")
            seen.add(question.id)
        return questions


def request_error(body: Any) -> str | None:
    """Why ``DecisionRequest`` refuses ``body`` (validation's words), or None."""
    try:
        DecisionRequest.model_validate(body)
    except ValidationError as exc:
        return validation_message(exc)
    return None


def values_of(question: Mapping[str, Any], given: Mapping[str, float]) -> dict[str, float]:
    """The value of each candidate of ``question`` (a valid one, as the body holds it): yes 1
    and no 0, a level its number, an option none; ``given`` (by candidate name) overrides.
    ValueError naming a candidate without a value, or a name that is none."""
    body = {"input": "x", "questions": [{**question, "id": "q"}]}
    (parsed,) = DecisionRequest.model_validate(body).questions
    view = View.of(parsed)
    values = {"yes": 1.0, "no": 0.0} if view.kind == "yes_no" else {}
    if view.kind == "score":
        values = {name: float(name) for name in view.names}
    strangers = sorted(set(given) - set(view.names))
    if strangers:
        raise ValueError(f"map names {strangers}, which are not candidates of {view.names}")
    values.update(given)
    missing = [name for name in view.names if name not in values]
    if missing:
        raise ValueError(f"map needs a value for each option: {missing} have none")
    return values


# ---- the prompt ----------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """A question as it is rendered and answered: its kind, text, candidates' names (option
    names, level numbers, yes and no) and their details."""

    kind: str
    question: Any
    names: list[str]
    details: list[Any]

    @classmethod
    def of(cls, question: Any) -> View:
        if isinstance(question, ChoiceQuestion):
            names = [option.name for option in question.options]
            return cls(
                "choice", question.question, names, [o.description for o in question.options]
            )
        if isinstance(question, ScoreQuestion):
            names = [str(level) for level in range(len(question.levels))]
            return cls("score", question.question, names, list(question.levels))
        return cls("yes_no", question.question, ["yes", "no"], [question.yes, question.no])

    @property
    def labels(self) -> list[str]:
        """One token each, in candidate order: A to Z, the level numbers, yes and no."""
        if self.kind == "choice":
            return list(string.ascii_uppercase[: len(self.names)])
        return list(self.names)


def as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_question(text: str, view: View) -> str:
    """The user's message of one question, in prompt format version 1's words."""
    asked = "" if is_blank(view.question) else as_text(view.question)
    labels = view.labels
    if view.kind == "choice":
        lines = [f"Question: {asked}"] if asked else []
        for label, name, detail in zip(labels, view.names, view.details, strict=True):
            said = as_text(detail)
            lines.append(f"{label}: {name} - {said}" if said else f"{label}: {name}")
        lines.append("Answer with the letter of one option only.")
    elif view.kind == "score":
        lines = [f"Question: {asked}"] if asked else []
        levels = zip(labels, view.details, strict=True)
        lines += [f"{label}: {as_text(level)}" for label, level in levels]
        lines.append("Answer with the number of one level only.")
    else:
        lines = [f"Is the following true? {asked}" if asked else "Is the following true?"]
        for label, detail in zip(labels, view.details, strict=True):
            if said := as_text(detail):
                lines.append(f"{label}: {said}")
        lines.append("Answer with yes or no only.")
    return "\n".join([text, "", *lines])


# ---- the route -----------------------------------------------------------------------------


def decisions_request(
    body: Any, settings: Any, context_length: int, served_model_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, options)`` of a ``/v1/decisions`` body: every question's
    prompt and label ids, scored as ``/v1/score`` scores; OpenAIError with SGLang's words for
    what it refuses (``settings``: the chat route's ``ChatSettings``)."""
    try:
        request = DecisionRequest.model_validate(body)
    except ValidationError as exc:
        raise OpenAIError(validation_message(exc), kind=BAD_REQUEST) from None
    always, toggle = _template_reasoning(settings)  # the template read once a request
    if getattr(settings, "mis", False):  # (SGLang's _validate_server, before the adapter)
        raise OpenAIError(f"{ROUTE} does not support --enable-mis")
    _check_request(request, served_model_name, always, toggle)
    kwargs = template_kwargs(settings, toggle, request.chat_template_kwargs)
    text = as_text(request.input)
    prompts, labels = [], []
    for question in request.questions:
        view = View.of(question)
        try:
            prompt, ids = _encode(view, render_question(text, view), settings, kwargs,
                                  context_length)  # fmt: skip
        except ValueError as exc:
            # a ValueError after _validate_request: serving_base.handle_request's "BadRequest"
            raise OpenAIError(f"question {question.id!r}: {exc}", kind="BadRequest") from None
        prompts.append(prompt)
        labels.append(ids)
    native = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": labels,
        "logprob_start_len": -1,
    }
    return native, {"request": request, "prompts": prompts, "labels": labels, "stream": False}


def _check_request(request: DecisionRequest, served: str, always: bool, toggle: str | None) -> None:
    """``OpenAIServingDecisions._validate_request`` where it applies to this engine."""
    adapter = _adapter(request.model, served)
    if adapter is not None:
        raise OpenAIError(
            f"model names the LoRA adapter {adapter!r}, which {ROUTE} does not support"
        )
    if request.images:  # the built-in engine serves text-only models
        raise OpenAIError(
            f"{ROUTE} images require a model served with multimodal input, and some vision "
            "models need --enable-multimodal"
        )
    version = request.prompt_format_version
    if version is not None and version != PROMPT_FORMAT_VERSION:
        raise OpenAIError(
            f"prompt_format_version {version} is not served, this server uses version "
            f"{PROMPT_FORMAT_VERSION}"
        )
    refusal = reasoning_refusal(always, toggle, request.chat_template_kwargs, ROUTE)
    if refusal is not None:
        raise OpenAIError(refusal)


def template_kwargs(settings: Any, toggle: str | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """The template's kwargs (``_chat_template_kwargs``): reasoning off, then the server's
    ``--default-chat-template-kwargs``, then the request's."""
    kwargs: dict[str, Any] = {toggle: False} if toggle is not None else {}
    for key, value in (getattr(settings, "default_kwargs", None) or {}).items():
        kwargs.setdefault(key, value)
    return {**kwargs, **given}


def reasoning_refusal(
    always: bool, toggle: str | None, wanted: Mapping[str, Any], route: str
) -> str | None:
    """``_validate_request``'s reasoning refusal on ``route`` (None: none): a template that
    always reasons, or its toggle set on in ``wanted`` (the request's template kwargs)."""
    if always:
        return f"{route} does not support chat templates that always reason before answering"
    if toggle in wanted and wanted[toggle] is not False:
        return (
            f"chat_template_kwargs sets {toggle!r} to {wanted[toggle]!r}, but decisions need it "
            "false or unset"
        )
    return None


def _adapter(model: str, served: str) -> str | None:
    """The LoRA adapter ``model`` names (``MODEL:ADAPTER``; a served name with colons whole)."""
    if ":" not in model or model == served:
        return None
    if model.startswith(f"{served}:"):
        return model[len(served) + 1 :].strip() or None
    return model.split(":", 1)[1].strip() or None


def _template_reasoning(settings: Any) -> tuple[bool, str | None]:
    """(the template always reasons, the kwarg that turns reasoning on): the template's own
    toggle, else the one ``--reasoning-parser``'s default mode names."""
    template = settings.template or getattr(settings.tokenizer, "chat_template", None)
    always, toggle = template_toggle(template if isinstance(template, str) else None)
    if toggle is not None:
        return always, toggle.param
    parser = settings.reasoning
    mode = parser.fmt.default if parser is not None else None
    return always, mode.removeprefix("explicit_") if mode in _PARSER_TOGGLES else None


def _render(settings: Any, messages: list[dict[str, Any]], kwargs: dict, prompt: bool) -> str:
    template = settings.template or getattr(settings.tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the chat template failed: this model's tokenizer has no chat template")
    try:
        return settings.renderer.render(messages, None, settings.template, prompt, dict(kwargs))
    except Exception as exc:  # the template's own error
        raise ValueError(f"the chat template failed: {exc}") from None


def _encode(
    view: View, content: str, settings: Any, kwargs: dict[str, Any], context_length: int
) -> tuple[list[int], list[int]]:
    """The question's prompt ids and its labels' token ids (ValueError: not servable)."""
    prompt = _render(settings, [{"role": "user", "content": content}], kwargs, True)
    reasoning = settings.reasoning
    if reasoning is not None:
        _check_reasoning_blocks(content, prompt, reasoning.fmt, settings, kwargs)
    encode = settings.tokenizer.encode
    ids = list(encode(prompt, add_special_tokens=False))
    if len(ids) >= context_length:
        raise ValueError(
            f"the prompt has {len(ids)} tokens, which does not fit the context length of "
            f"{context_length} tokens"
        )
    return ids, _label_ids(settings.tokenizer, prompt, ids, view.labels)


def _check_reasoning_blocks(
    content: str, prompt: str, fmt: Any, settings: Any, kwargs: dict[str, Any]
) -> None:
    """The answer position must follow the reasoning block, not sit inside it."""
    closing = content.rsplit("\n", 1)[-1]  # the message's last line: fixed words
    cut = prompt.rfind(closing)
    generation = prompt if cut < 0 else prompt[cut + len(closing) :]
    start, end = fmt.start, fmt.end
    opened, closed = generation.rfind(start), generation.rfind(end)
    if opened > closed:
        raise ValueError(
            "the chat template leaves a reasoning block open at the answer position, so this "
            "model is not supported with these chat_template_kwargs"
        )
    if fmt.default == "always" and closed < 0:
        raise ValueError(
            "the reasoning parser for this model expects answers to start with a reasoning "
            "block, and the chat template does not close one. Send chat_template_kwargs that "
            "turn thinking off, if the template supports it"
        )
    try:  # the template's own finished reply: does an answer open a block it leaves out?
        messages = [{"role": "user", "content": closing},
                    {"role": "assistant", "content": _SENTINEL}]  # fmt: skip
        reply = _render(settings, messages, kwargs, False)
    except ValueError:
        return
    begin = reply.rfind(closing)
    answer = reply.find(_SENTINEL, begin) if begin >= 0 else -1
    if answer >= 0 and reply[begin:answer].count(start) > generation.count(start):
        raise ValueError(
            "the chat template starts every answer with a reasoning block, so this model is not "
            "supported"
        )


def label_context(
    tokenizer: Any, prompt: str, ids: list[int], added: Mapping[int, str]
) -> tuple[str, list[int], bool]:
    """The text and ids after which labels are checked, and whether that is a shortcut: the text
    after the prompt's last added token (``added``: id -> token) when it encodes alone to the
    same ids, so that the check does not grow with the input; else the whole prompt."""
    last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in added), None)
    if last is not None:
        token = added[ids[last]]
        start = prompt.rfind(token)
        suffix = prompt[start + len(token) :]
        if (
            start >= 0
            and list(tokenizer.encode(suffix, add_special_tokens=False)) == ids[last + 1 :]
        ):
            return suffix, ids[last + 1 :], True
    return prompt, ids, False


def label_token_id(tokenizer: Any, text: str, ids: list[int], label: str) -> int | None:
    """The one token ``label`` adds after ``text`` (``ids``), or None when it adds more, or
    changes the tokens before it."""
    after = list(tokenizer.encode(text + label, add_special_tokens=False))
    return after[-1] if len(after) == len(ids) + 1 and after[:-1] == ids else None


def _label_ids(tokenizer: Any, prompt: str, ids: list[int], labels: list[str]) -> list[int]:
    """Each label's one token after the prompt, distinct (ValueError otherwise), checked after
    ``label_context``."""
    added = {i: token for token, i in tokenizer.get_added_vocab().items()}
    text, text_ids, _ = label_context(tokenizer, prompt, ids, added)
    found: list[int] = []
    for label in labels:
        token = label_token_id(tokenizer, text, text_ids, label)
        if token is None or token in found:
            raise ValueError(
                f"the answer label {label!r} is not one distinct token after the chat prompt "
                "for this tokenizer, so this model is not supported"
            )
        found.append(token)
    return found


def decisions_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict:
    """SGLang's ``DecisionResponse`` (``model_dump(exclude_none=True)``) of the native results."""
    request: DecisionRequest = options["request"]
    answers, prompt_tokens = {}, 0
    for i, (question, result) in enumerate(zip(request.questions, results, strict=True)):
        meta = result["meta_info"]
        prompt_tokens += meta["prompt_tokens"]
        (step,) = meta["output_token_ids_logprobs"]  # the distribution after the prompt
        found = {token: logprob for logprob, token, _ in step}
        logprobs = [found.get(token, -math.inf) for token in options["labels"][i]]
        answer = answer_of(question, label_scores(logprobs, True, request.temperature), logprobs)
        if request.return_prompt_token_ids:
            answer["prompt_token_ids"] = options["prompts"][i]
            answer["label_token_ids"] = options["labels"][i]
        answers[question.id] = answer
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
             "completion_tokens": 0, "reasoning_tokens": 0}  # fmt: skip
    return {
        "object": "decisions",
        "model": request.model,
        "prompt_format_version": PROMPT_FORMAT_VERSION,
        "answers": answers,
        "usage": usage,
    }


def answer_of(question: Any, probabilities: list[float], logprobs: list[float]) -> dict[str, Any]:
    """One question's answer: its labels' ``probabilities`` by candidate name, ``label_mass``
    (the labels' whole-vocabulary probability, of ``logprobs``), ``choice`` (the most likely
    option, the first of equals) or ``score`` (the expected level)."""
    view = View.of(question)
    answer: dict[str, Any] = {
        "type": question.type,
        "probabilities": dict(zip(view.names, probabilities, strict=True)),
        "label_mass": math.fsum(math.exp(lp) for lp in logprobs),
    }
    if view.kind == "choice":
        answer["choice"] = view.names[probabilities.index(max(probabilities))]
    elif view.kind == "score":
        answer["score"] = math.fsum(level * p for level, p in enumerate(probabilities))
    return answer
