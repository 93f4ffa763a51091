"""SGLang's ``/v1/rerank`` with a decoder-only reranker (Qwen3-Reranker's way): how relevant
each document is to the query, from one prefill each, no token generated.

As SGLang 0.5.23 serves it (``serving_rerank.py``, its ``text_decoder`` path): when the
engine's chat template is a reranker's (it says the answer can only be "yes" or "no"), each
document makes a prompt, the template rendered with ``messages`` ``[query, document]`` as two
user turns (and ``instruct`` when given) in a plain sandboxed Jinja environment (not a chat
request's: no special tokens among its variables); the prompts are scored as ``/v1/score``
scores them (``max_new_tokens: 0``, the log-probs of the tokens ``yes`` and ``no`` after the
prompt), and a document's score is ``p(yes) / (p(yes) + p(no))``. The answer is a list of
``{score, document, index, meta_info: null}`` (``document`` unless ``return_documents`` is
false), the most
relevant first (ties in the documents' order), the first ``top_n`` when given.

Otherwise SGLang reranks with a cross-encoder, which a generating model is not: its 400 says
so, as the pooling routes do. Content parts (images or video: SGLang's Qwen3-VL reranker) are
refused, this engine serving text models only.

On a pooling engine (``--is-embedding``, or a classifier) the same route is SGLang's
cross-encoder path (``cross_encoder_pairs``, ``cross_encoder_response``): each document and
the query make one ``[query, document]`` pair, encoded as the tokenizer encodes a text pair
(with its token type ids), pooled, and the document's score is its pooled result (a
cross-encoder's one number, or the first of a model's outputs), the answers' ``meta_info``
the native ``/encode`` one; content parts are read for their text (joined with a space, the
rest left out, as SGLang's ``_extract_text_from_content``). A reranker template (or a Qwen3-VL
model) gets SGLang's 400 asking for a generating engine instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import structlog

from stages.engine.openai_api import OpenAIError
from stages.engine.openai_score import ScoreEngine, score_request

__all__ = [
    "cross_encoder_pairs",
    "cross_encoder_response",
    "is_reranker_template",
    "rerank_request",
    "rerank_response",
    "yes_no_ids",
]

# SGLang's refusal of an EmbeddingReqInput on a generating model (the cross-encoder path)
NOT_A_RERANKER = (
    "This model does not appear to be an embedding model by default. Please add "
    "`--is-embedding` when launching the server or try another model."
)
_FALLBACK_IDS = (9693, 2152)  # SGLang's, Qwen3's yes and no
log = structlog.get_logger("stages.engine.openai_rerank")


def is_reranker_template(template: str | None) -> bool:
    """Whether ``template`` is a decoder reranker's (``_is_qwen3_reranker_template``)."""
    if not template:
        return False
    t = template.lower()
    return ('answer can only be "yes" or "no"' in t) or (
        "answer can only be" in t and '"yes"' in t and '"no"' in t
    )


def yes_no_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of ``yes`` and ``no`` (``_get_yes_no_token_ids``: each word's one token, else
    the vocabulary's entries, else Qwen3's ids)."""
    try:
        yes = tokenizer.encode("yes", add_special_tokens=False)
        no = tokenizer.encode("no", add_special_tokens=False)
        if len(yes) == 1 and len(no) == 1:
            return yes[0], no[0]
        yes_id = tokenizer.convert_tokens_to_ids("yes")
        no_id = tokenizer.convert_tokens_to_ids("no")
        if yes_id is not None and no_id is not None:
            return yes_id, no_id
    except Exception as exc:  # SGLang falls back on any failure, as here
        log.warning("rerank_yes_no_ids_failed", error=str(exc))
    log.warning("rerank_yes_no_ids_fallback", ids=list(_FALLBACK_IDS))
    return _FALLBACK_IDS


def rerank_request(
    body: Any, template: str | None, tokenizer: Any, mis: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(native /generate body, options)`` of a ``/v1/rerank`` body; OpenAIError with
    SGLang's words for what it refuses. Its fields' types are ``request_fields.checked_rerank``'
    (the route checks them first). ``mis``: under ``--enable-mis``, where SGLang's
    ``score_prompts`` scores the rendered prompts as a ``/v1/score`` of an empty query would,
    fused (``openai_score``)."""
    query, documents = body["query"], body["documents"]
    instruct, top_n = body.get("instruct"), body.get("top_n")
    shown = body.get("return_documents", True)
    _check_content(query, documents)
    if not is_reranker_template(template):
        raise OpenAIError(NOT_A_RERANKER)
    if any(isinstance(part, list) for part in (query, *documents)):
        raise OpenAIError("content parts (images, video): the built-in engine takes text only")
    prompts = [_render(template, query, doc, instruct) for doc in documents]
    yes, no = yes_no_ids(tokenizer)
    options = {"stream": False, "documents": documents, "top_n": top_n, "shown": shown}
    if mis:  # (score_prompts: query "", the prompts as the items)
        engine = ScoreEngine(tokenizer, prefix_cache=False, embed_width=None, mis=True)
        scored = {"query": "", "items": prompts, "label_token_ids": [yes, no]}
        native, _ = score_request(scored, engine)
        assert native is not None  # (documents are never empty here)
        return native, {**options, "labels": (yes, no)}
    native = {
        "text": prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": [[yes, no]] * len(prompts),
        "logprob_start_len": -1,
    }
    return native, {**options, "labels": (yes, no)}


def _check_content(query: Any, documents: list[Any]) -> None:
    """``OpenAIServingRerank._validate_request``'s checks, in its words."""
    if not query:
        raise OpenAIError("Query cannot be empty", "query")
    if isinstance(query, str) and not query.strip():
        raise OpenAIError("Query cannot be empty or whitespace only", "query")
    if not documents:
        raise OpenAIError("Documents cannot be empty", "documents")
    for doc in documents:
        if not doc:
            raise OpenAIError("Each document must be a non-empty string", "documents")
        if isinstance(doc, str) and not doc.strip():
            raise OpenAIError("Each document cannot be empty or whitespace only", "documents")
        if not isinstance(doc, str | list):
            raise OpenAIError("documents: each should be a string or a list of content parts")


def _render(template: str | None, query: str, document: str, instruct: str | None) -> str:
    """``_render_jinja_chat_template``: the two texts as user turns (``instruct`` only when
    given: templates default it when undefined)."""
    kwargs: dict[str, Any] = {
        "messages": [{"role": "user", "content": query}, {"role": "user", "content": document}]
    }
    if instruct:
        kwargs["instruct"] = instruct
    try:
        return _compiled(template or "").render(**kwargs)
    except Exception as exc:  # the template's own error, SGLang's 400 with its message
        raise OpenAIError(str(exc)) from exc


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    """The template in a sandboxed Jinja environment as SGLang's ``_get_jinja_env`` makes it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(), autoescape=False, undefined=jinja2.Undefined
    )
    return env.from_string(template)


def rerank_response(
    results: list[Mapping[str, Any]], options: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """SGLang's list of ``RerankResponse`` (``_build_rerank_response``), the best first."""
    yes, no = options["labels"]
    answers = []
    for index, result in enumerate(results):
        (step,) = result["meta_info"]["output_token_ids_logprobs"]
        found = {token: logprob for logprob, token, _ in step}
        p_yes, p_no = math.exp(found.get(yes, -math.inf)), math.exp(found.get(no, -math.inf))
        total = p_yes + p_no
        answer: dict[str, Any] = {"score": p_yes / total if total > 0 else 0.0}
        if options["shown"]:
            answer["document"] = options["documents"][index]
        answer["index"] = index
        answer["meta_info"] = None  # RerankResponse's, written out (a cross-encoder's only)
        answers.append(answer)
    answers.sort(key=lambda a: a["score"], reverse=True)  # stable: ties keep their order
    top_n = options["top_n"]
    return answers if top_n is None else answers[:top_n]


def cross_encoder_pairs(
    body: Mapping[str, Any], template: str | None, path: str
) -> list[list[str]]:
    """The ``[query, document]`` text pairs of a ``/v1/rerank`` body (typed by
    ``request_fields.checked_rerank``) on a pooling engine, as SGLang's ``serving_rerank``
    makes them (``_convert_to_internal_request``); OpenAIError with its words where it
    refuses: the content checks, then a decoder reranker's template or a Qwen3-VL model
    (``path``: the model's, as SGLang's ``_is_qwen3_vl_model`` reads it), which a pooling
    engine does not score."""
    query, documents = body["query"], body["documents"]
    _check_content(query, documents)
    for field, part in [("query", query), *(("documents", d) for d in documents)]:
        if isinstance(part, list):
            _check_parts(part, field)
    multimodal = any(isinstance(part, list) for part in (query, *documents))
    text_template = is_reranker_template(template)
    lowered = (template or "").lower()
    vl_template = text_template and ("<|vision_start|>" in lowered or "<|image_pad|>" in lowered)
    vl_model = "qwen3-vl" in path.lower() or "qwen3vl" in path.lower()
    if vl_template or vl_model or (multimodal and text_template):
        raise OpenAIError(
            "Detected Qwen3-VL reranker, but the server is not in generation mode. "
            "Please relaunch without --is-embedding for Qwen3-VL-Reranker models."
        )
    if text_template:
        raise OpenAIError(
            "Detected Qwen3 reranker chat template, but the server is not in generation mode. "
            "Please relaunch without --is-embedding for Qwen3-Reranker models."
        )
    if body.get("return_documents", True) and any(isinstance(d, list) for d in documents):
        # (SGLang's RerankResponse takes a document as a string: its answer fails, a 500)
        raise OpenAIError(
            "documents given as content parts cannot be returned as a document's text: "
            "set return_documents to false",
            "return_documents",
        )
    first = _text_of(query)
    return [[first, _text_of(doc)] for doc in documents]


def _check_parts(parts: list[Any], field: str) -> None:
    """Content parts as SGLang's ``RerankContentPart`` types them: text, image or video."""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image_url", "video_url"):
            raise OpenAIError(
                f"{field}: each content part should be an object whose type is text, "
                "image_url or video_url",
                field,
            )
        if kind == "text" and not isinstance(part.get("text"), str):
            raise OpenAIError(f"{field}: a text part's text should be a valid string", field)


def _text_of(content: str | list[Any]) -> str:
    """``_extract_text_from_content``: a string as it is, content parts' texts joined."""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content if part.get("type") == "text")


def cross_encoder_response(
    answers: list[Mapping[str, Any]], body: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """SGLang's ``_build_rerank_response`` of the pooled pairs' native answers (``{embedding,
    meta_info}``): a list's first value or the number as the score, the best first (ties in
    the documents' order), ``top_n`` of them."""
    shown = body.get("return_documents", True)
    out = []
    for index, answer in enumerate(answers):
        score = answer["embedding"]
        if isinstance(score, list):
            score = score[0]
        entry: dict[str, Any] = {"score": float(score)}
        if shown:
            entry["document"] = body["documents"][index]
        entry["index"] = index
        entry["meta_info"] = answer.get("meta_info")
        out.append(entry)
    out.sort(key=lambda a: a["score"], reverse=True)  # stable: ties keep their order
    top_n = body.get("top_n")
    return out if top_n is None else out[:top_n]
