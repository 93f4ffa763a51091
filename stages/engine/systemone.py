"""SGLang's ``/v1/systemone`` on the built-in engine: the System One decision API (a state, and
``noul``, ``choice`` and ``score`` questions about it keyed by the caller's ids), answered with
``/v1/decisions``' rendering, label checks and scoring: the labels' probabilities at the answer
position, one prefill a question, nothing generated.

As SGLang 0.5.23 serves it on a model without a joint schema head, a pointer head or a decision
readout (``entrypoints/systemone/protocol.py`` and ``serving.py``, ``SystemOneServing`` on
``OpenAIServingDecisions``; the route and its validation handler in ``http_server.py``):

- the body (``SystemOneRequest``): ``state`` (text, or an object or list written as compact
  JSON; blank allowed), ``model`` (required), ``questions`` (one or more, by id): ``noul``
  (``instructions`` and/or ``criteria: {true, false}`` describing the two sides; one of them
  not blank), ``choice`` (``criteria``: 1-255 option names, distinct, each with a description
  or null), ``score`` (``criteria``: 1-10 levels, none blank); ``images``,
  ``chat_template_kwargs``; a question's unknown keys refused, the body's ignored;
  ``temperature``, ``prompt_format_version`` and ``return_prompt_token_ids`` (``/v1/decisions``'
  fields) refused by name;
- each question is rendered as ``/v1/decisions`` renders its ``yes_no``, ``choice`` and
  ``score`` question (``render_question``; ``instructions`` as the question, blank: none), as
  the user's message of the chat template, reasoning toggle off; labels ``yes``/``no``, ``0``-
  ``9``, ``A``-``Z``, and beyond 26 options two-letter labels (``AA``, ``AB``... those that are
  one distinct token after the template's last added token before the answer position, the
  same for any message: ``SystemOneServing._pair_labels``);
- the answer (``SystemOneResponse``): ``model`` (the served name), per question id ``noul``
  (P(yes)), ``choice`` (the most likely option) or ``score`` (the expected level, and the
  levels as ``legend``), with ``probabilities`` (the labels' softmax, ``choice`` and ``score``),
  ``confidence`` (``_choice_confidence``: how far the top option stands above a uniform guess;
  ``_score_confidence``: one less the spread around the top level relative to a uniform
  spread), ``x_label_mass`` (the labels' whole-vocabulary probability); ``usage:
  {input_tokens, output_tokens: 0}``.

Refused as SGLang refuses: a body its models refuse, with FastAPI's 422 ``{"detail": [...]}``
(each error's ``type``, ``loc``, ``msg``, ``ctx``; the input echo left out) as SGLang's handler
keeps it for this route, bodies that are not JSON or not sent as ``application/json`` too; then
``{object: "error", ...}`` 400s: images (text-only models here), a LoRA adapter named in
``model``, a template that always reasons, a reasoning toggle set other than false (``type``
``BadRequestError``); per question (``type`` ``BadRequest``): labels that are not one distinct
token, more options than two-letter labels, a level the answer cannot echo, a prompt past the
context, a reasoning block left open at the answer position. The joint schema (Clef) and
pointer (Kev) heads and a decision checkpoint's readout (with its ``_DECIDER_SYSTEM`` prompt and
codes) are Qwen3.5 checkpoints' own heads the engine does not load: it answers as SGLang
answers a model without them.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
import structlog
from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from stages.engine import ignored_fields
from stages.engine.openai_decisions import (
    DecisionImage,
    NonBlankText,
    Text,
    View,
    _adapter,
    _distinct_names,
    _encode,
    _render,
    _template_reasoning,
    as_text,
    is_blank,
    label_context,
    label_token_id,
    reasoning_refusal,
    render_question,
    template_kwargs,
)
from stages.engine.openai_score import label_scores
from stages.engine.request_body import _json_media, dumps, loads
from stages.engine.request_error import AbortedWithError

__all__ = [
    "ROUTE",
    "SystemOneRequest",
    "read_request",
    "serve",
    "systemone_request",
    "systemone_response",
]

ROUTE = "/v1/systemone"
MAX_CHOICE_OPTIONS = 255  # the documented most; beyond 26, two-letter labels
MAX_SCORE_LEVELS = 10  # labelled 0 to 9
# beyond A to Z, every option gets a two-letter label, in this order
PAIR_LABELS = [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
_MEDIA_REFUSED = "Unsupported Media Type: Only 'application/json' is allowed"
log = structlog.get_logger("stages.engine.systemone")


# ---- the request, as SGLang's pydantic models read it (names, order and checks) --------------


class _Question(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key would ask another question

    instructions: Text | None = None


class SystemOneNoulCriteria(BaseModel):
    model_config = ConfigDict(extra="forbid")

    true: Text | None = None
    false: Text | None = None


class SystemOneNoulQuestion(_Question):
    type: Literal["noul"]
    criteria: SystemOneNoulCriteria | None = None

    @model_validator(mode="after")
    def _asks_something(self) -> SystemOneNoulQuestion:
        criteria = self.criteria or SystemOneNoulCriteria()
        if all(is_blank(v) for v in (self.instructions, criteria.true, criteria.false)):
            raise ValueError(
                "a noul question needs instructions or a true or false description to decide on"
            )
        return self


class SystemOneChoiceQuestion(_Question):
    type: Literal["choice"]
    criteria: dict[str, Text | None] = Field(min_length=1, max_length=MAX_CHOICE_OPTIONS)

    @field_validator("criteria")
    @classmethod
    def _option_names_distinct(cls, criteria: dict[str, Any]) -> dict[str, Any]:
        _distinct_names(list(criteria))
        return criteria


class SystemOneScoreQuestion(_Question):
    type: Literal["score"]
    criteria: list[NonBlankText] = Field(min_length=1, max_length=MAX_SCORE_LEVELS)


SystemOneQuestion = Annotated[
    SystemOneNoulQuestion | SystemOneChoiceQuestion | SystemOneScoreQuestion,
    Field(discriminator="type"),
]


class SystemOneRequest(BaseModel):  # unknown keys ignored, as the published schema allows
    state: Text
    images: list[DecisionImage] = Field(default_factory=list)
    model: str
    questions: dict[str, SystemOneQuestion] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # /v1/decisions' fields, which would change the answers if honoured or ignored: refused
    temperature: SkipJsonSchema[Any] = None
    prompt_format_version: SkipJsonSchema[Any] = None
    return_prompt_token_ids: SkipJsonSchema[Any] = None

    @field_validator("temperature", "prompt_format_version", "return_prompt_token_ids")
    @classmethod
    def _refuse_decisions_fields(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not part of this API, use /v1/decisions for it")
        return value


# ---- reading a body as FastAPI reads it for SGLang's route --------------------------------------


def _detail(errors: list[dict[str, Any]]) -> web.Response:
    """SGLang's answer to a ``RequestValidationError`` on this route: FastAPI's detail list,
    each error without its ``input``, JSON-encoded as ``jsonable_encoder`` encodes it."""
    detail = [{k: _jsonable(v) for k, v in error.items() if k != "input"} for error in errors]
    return web.Response(body=dumps({"detail": detail}), status=422, content_type="application/json")


def _jsonable(value: Any) -> Any:
    """``fastapi.encoders.jsonable_encoder`` of what a validation error holds (an exception in
    ``ctx`` is its attributes: ``{}``)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, BaseException):
        return _jsonable(vars(value))
    if value is None or isinstance(value, str | int | float):
        return value
    return str(value)


def parse_body(raw: bytes, content_type: str | None) -> SystemOneRequest | web.Response:
    """A request's bytes as SGLang's route reads them (FastAPI 0.132 and later: strict content
    types), or its refusal: JSON that does not parse (``json_invalid`` at the character it
    stopped at), no ``application/json`` content type (``validate_json_request``), no body
    (``body: Field required``), a body ``SystemOneRequest`` refuses (its errors, ``body`` first
    in each ``loc``) are 422s; bytes that are no text at all FastAPI's 400 ``{"detail": "There
    was an error parsing the body"}``."""
    body: Any = raw
    if raw and _json_media(content_type):
        try:
            body = loads(raw)
        except json.JSONDecodeError as exc:  # orjson's too
            errors = [{"type": "json_invalid", "loc": ["body", exc.pos], "msg": "JSON decode error",
                       "ctx": {"error": exc.msg}}]  # fmt: skip
            return _detail(errors)
        except Exception:  # not text (UnicodeDecodeError), nested past the recursion limit
            return web.json_response({"detail": "There was an error parsing the body"}, status=400)
    media = (content_type or "").lower().split(";", 1)[0]
    if media != "application/json":  # validate_json_request, which does not strip
        return _detail([{"loc": ["header", "content-type"], "msg": _MEDIA_REFUSED,
                         "type": "value_error"}])  # fmt: skip
    if not raw:
        return _detail([{"type": "missing", "loc": ["body"], "msg": "Field required"}])
    try:
        request = SystemOneRequest.model_validate(body, from_attributes=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        return _detail([{**e, "loc": ["body", *e["loc"]]} for e in errors])
    ignored_fields.note(k for k in body if k not in SystemOneRequest.model_fields)
    return request


async def read_request(request: web.Request) -> SystemOneRequest | web.Response:
    """``parse_body`` of an HTTP request."""
    return parse_body(await request.read(), request.headers.get("Content-Type"))


# ---- the prompts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Labeled(View):
    """A view whose labels are given (two-letter ones), else its own."""

    given: tuple[str, ...] = ()

    @property
    def labels(self) -> list[str]:
        return list(self.given) if self.given else super().labels


def view_of(question: Any) -> View:
    """A System One question as ``/v1/decisions`` renders and answers its kind: ``noul`` as a
    ``yes_no`` question (``criteria.true`` describing yes), ``instructions`` as the question."""
    if isinstance(question, SystemOneChoiceQuestion):
        criteria = question.criteria
        return View("choice", question.instructions, list(criteria), list(criteria.values()))
    if isinstance(question, SystemOneNoulQuestion):
        sides = question.criteria
        details = [sides.true, sides.false] if sides is not None else [None, None]
        return View("yes_no", question.instructions, ["yes", "no"], details)
    names = [str(level) for level in range(len(question.criteria))]
    return View("score", question.instructions, names, list(question.criteria))


class Refused(ValueError):
    """A request SGLang's ``handle_request`` answers with a 400 ``ErrorResponse`` of ``kind``:
    ``BadRequestError`` (``_validate_request``'s) or ``BadRequest`` (a ValueError after it)."""

    def __init__(self, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.kind = kind


def check_request(request: SystemOneRequest, settings: Any, served: str) -> None:
    """``SystemOneServing._validate_request`` where it applies to this engine (Refused)."""
    if settings is None:  # a model without a tokenizer (SGLang: --skip-tokenizer-init)
        raise Refused(f"{ROUTE} requires the server tokenizer")
    if getattr(settings, "mis", False):  # (SGLang's _validate_server)
        raise Refused(f"{ROUTE} does not support --enable-mis")
    adapter = _adapter(request.model, served)
    if adapter is not None:
        raise Refused(f"model names the LoRA adapter {adapter!r}, which {ROUTE} does not support")
    if request.images:  # the built-in engine serves text-only models
        raise Refused(
            f"{ROUTE} images require a model served with multimodal input, and some vision "
            "models need --enable-multimodal"
        )
    always, toggle = _template_reasoning(settings)
    refusal = reasoning_refusal(always, toggle, request.chat_template_kwargs, ROUTE)
    if refusal is not None:
        raise Refused(refusal)


def systemone_request(
    request: SystemOneRequest, settings: Any, context_length: int, served_model_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, options)`` of a valid request: every question's prompt and
    label ids, scored as ``/v1/decisions`` scores them; Refused with SGLang's words."""
    check_request(request, settings, served_model_name)
    _, toggle = _template_reasoning(settings)
    kwargs = template_kwargs(settings, toggle, request.chat_template_kwargs)
    text = as_text(request.state)
    prompts, labels, views = [], [], []
    pairs: list[str] | None = None  # read once a request, when a question needs them
    for question_id, question in request.questions.items():
        view = view_of(question)
        try:
            if view.kind == "choice" and len(view.names) > len(view.labels):
                if pairs is None:
                    pairs = _pair_labels(settings, kwargs)
                if len(view.names) > len(pairs):
                    raise ValueError(
                        f"it has {len(view.names)} options, but the served tokenizer and chat "
                        "template can label at most "
                        f"{max(len(pairs), len(string.ascii_uppercase))}"
                    )
                view = _Labeled(view.kind, view.question, view.names, view.details,
                                tuple(pairs[: len(view.names)]))  # fmt: skip
            if view.kind == "score":
                _check_legend(question_id, view)
            prompt, ids = _encode(view, render_question(text, view), settings, kwargs,
                                  context_length)  # fmt: skip
        except ValueError as exc:
            raise Refused(f"question {question_id!r}: {exc}", "BadRequest") from None
        prompts.append(prompt)
        labels.append(ids)
        views.append(view)
    native = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": labels,
        "logprob_start_len": -1,
    }
    options = {"ids": list(request.questions), "views": views, "labels": labels,
               "model": served_model_name}  # fmt: skip
    return native, options


def _pair_labels(settings: Any, kwargs: dict[str, Any]) -> list[str]:
    """The two-letter labels that are distinct single tokens at the answer position, checked
    after the template's last added token, which must be past the message (two messages leave
    the same text after it); each prompt is still checked whole (``_encode``)."""
    tokenizer = settings.tokenizer
    added = {i: token for token, i in tokenizer.get_added_vocab().items()}
    if not added:
        raise ValueError(
            "more than 26 options needs added tokens the server can read from the tokenizer, "
            "and the served tokenizer reports none"
        )
    contexts = []
    for message in ("x", "y"):
        prompt = _render(settings, [{"role": "user", "content": message}], kwargs, True)
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        contexts.append(label_context(tokenizer, prompt, ids, added))
    (text, text_ids, shortcut), other = contexts
    if not (shortcut and other[2] and other[0] == text):  # else: the whole input, each label
        raise ValueError(
            "more than 26 options needs an added token between the message and the answer "
            "position, after which the text tokenizes the same on its own, which this "
            "tokenizer and chat template do not provide"
        )
    labels, seen = [], set()
    for label in PAIR_LABELS:
        token = label_token_id(tokenizer, text, text_ids, label)
        if token is not None and token not in seen:
            labels.append(label)
            seen.add(token)
    return labels


def _legend(view: View) -> dict[str, Any]:
    return dict(zip(view.names, view.details, strict=True))


def _check_legend(question_id: str, view: View) -> None:
    """Refuse, before scoring, levels the answer cannot echo in its legend: SGLang writes the
    answer with orjson (``ORJSONResponse``), which refuses an integer past 64 bits or nesting
    past its limit; checked on the answer's own shape, whose depth counts."""
    answer = {"type": "score", "score": 0.0, "confidence": 0.0, "legend": _legend(view),
              "probabilities": {}, "x_label_mass": 0.0}  # fmt: skip
    shape = {"model": "", "answers": {question_id: answer},
             "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
    try:
        orjson.dumps(shape, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"a level cannot be returned in the legend: {exc}") from None


# ---- the answer -------------------------------------------------------------------------------


def systemone_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict:
    """SGLang's ``SystemOneResponse`` (``model_dump``) of the native results; RuntimeError (a
    500 there) for a question scored to values that are not finite."""
    answers, input_tokens = {}, 0
    for i, (question_id, view, result) in enumerate(
        zip(options["ids"], options["views"], results, strict=True)
    ):
        meta = result["meta_info"]
        input_tokens += meta["prompt_tokens"]
        (step,) = meta["output_token_ids_logprobs"]  # the distribution after the prompt
        found = {token: logprob for logprob, token, _ in step}
        logprobs = [found.get(token, -math.inf) for token in options["labels"][i]]
        mass = math.fsum(math.exp(logprob) for logprob in logprobs)
        answers[question_id] = answer_of(view, label_scores(logprobs, True, 1.0), mass, question_id)
    return {
        "model": options["model"],  # the served model answered, whatever the request named
        "answers": answers,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def answer_of(view: View, probabilities: list[float], mass: float, question_id: str) -> dict:
    """One question's answer (``serving._answer``): the probabilities as scored, normalized
    only for the confidence."""
    if not all(math.isfinite(value) for value in [*probabilities, mass]):
        raise RuntimeError(f"question {question_id!r} scored non-finite values")
    if view.kind == "yes_no":
        return {"type": "noul", "noul": probabilities[0], "x_label_mass": mass}
    by_name = dict(zip(view.names, probabilities, strict=True))
    if view.kind == "choice":
        return {
            "type": "choice",
            "choice": view.names[probabilities.index(max(probabilities))],
            "confidence": choice_confidence(normalized(probabilities)),
            "probabilities": by_name,
            "x_label_mass": mass,
        }
    return {
        "type": "score",
        "score": math.fsum(level * p for level, p in enumerate(probabilities)),
        "confidence": score_confidence(normalized(probabilities)),
        "legend": _legend(view),
        "probabilities": by_name,
        "x_label_mass": mass,
    }


def normalized(probabilities: list[float]) -> list[float]:
    """Summing to 1 (uniform when they sum to nothing)."""
    total = math.fsum(probabilities)
    if total <= 0:
        return [1.0 / len(probabilities)] * len(probabilities)
    return [p / total for p in probabilities]


def choice_confidence(q: list[float]) -> float:
    """How far the top option stands above a uniform guess, from 0 to 1."""
    n = len(q)
    if n == 1:
        return 1.0
    return min(1.0, max(0.0, (n * max(q) - 1) / (n - 1)))


def score_confidence(q: list[float]) -> float:
    """One less the spread around the top level relative to a uniform spread, at least 0."""
    n = len(q)
    if n == 1:
        return 1.0
    top = q.index(max(q))
    spread = math.fsum(p * abs(i - top) for i, p in enumerate(q))
    uniform_spread = math.fsum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - spread / uniform_spread)


# ---- the route --------------------------------------------------------------------------------


def _error(message: str, kind: str, status: int = 400) -> web.Response:
    """SGLang's ``ErrorResponse`` (``create_error_response``)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(body=dumps(body), status=status, content_type="application/json")


async def serve(request: web.Request, routes: Any) -> web.Response:
    """One ``POST /v1/systemone`` on the generating engine (``routes``: its ``OpenAIRoutes``:
    the chat settings, the context length, the served name, ``/generate``, the request log)."""
    parsed = await read_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    try:
        check_request(parsed, routes.chat, routes.served_model_name)
    except Refused as exc:
        return _error(str(exc), exc.kind)
    if routes.request_log is not None:  # SGLang logs a request once it is validated
        routes.request_log.received_openai(parsed.model_dump(), request.headers)
    try:
        native, options = systemone_request(
            parsed, routes.chat, routes.context_length, routes.served_model_name
        )
        rendered = await routes.generate(native)
        results = rendered if isinstance(rendered, list) else [rendered]
        return web.Response(
            body=dumps(systemone_response(results, options)), content_type="application/json"
        )
    except Refused as exc:
        return _error(str(exc), exc.kind)
    except AbortedWithError as exc:  # SGLang: its ValueError's 400, or an HTTPException's
        if exc.status == 400:
            return _error(str(exc), "BadRequest")
        return _error(str(exc), str(exc.status), exc.status)
    except ValueError as exc:  # a request the scheduler refused (handle_request's ValueError)
        return _error(str(exc), "BadRequest")
    except Exception as exc:  # handle_request's 500 (a question scored to NaN, ...)
        log.exception("systemone_failed")
        return _error(f"Internal server error: {exc}", "InternalServerError", 500)
