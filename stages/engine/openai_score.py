"""SGLang's ``/v1/score`` on the built-in engine: the probability of label tokens after each
``query + item``, read from one prefill each, no token generated.

As SGLang 0.5.23 scores with a causal LM (``tokenizer_manager_score_mixin.score_request``,
pointwise, ``_process_single_item_scoring_results``, ``_convert_logprobs_to_scores``): each
item makes a prompt, ``query + item`` (``item + query`` with ``item_first``), as text or as
token ids; the prompts go to ``/generate`` as one batch with ``max_new_tokens: 0``,
``return_logprob`` and the labels as ``token_ids_logprob``, and each label's log-prob of the
token after the prompt (``output_token_ids_logprobs``: ``prompt_logprobs.next_token_logprobs``)
becomes its score: ``exp`` of it, or with ``apply_softmax`` a softmax over the item's labels
at ``temperature``. ``label_token_ids`` is one list for every item or one per item;
``return_token_logprobs`` adds the raw log-probs. The answer: ``{scores, pooled_hidden_states,
token_logprobs, model, usage, object: "scoring"}``.

What this engine does not do is refused with a 400 naming the field: SGLang's embedding
overrides (``embed_override_token_id``, ``query_embed_overrides``, ``item_embed_overrides``),
setwise readout (``score_extraction_token``) and its fused multi-item mode (a server flag
there); ``return_pooled_hidden_states`` is refused as SGLang refuses it for a causal LM. A text
query with token-id items (SGLang formats the id list into the text) is refused too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from stages.engine.openai_api import OpenAIError, _usage
from stages.engine.protocol import is_int

__all__ = ["label_scores", "score_request", "score_response"]

_NOT_HERE = {  # SGLang's fields this engine has no counterpart of: refused when set
    "embed_override_token_id": "embedding overrides",
    "query_embed_overrides": "embedding overrides",
    "item_embed_overrides": "embedding overrides",
    "score_extraction_token": "setwise readout",
}


def score_request(body: Any, vocab_size: int) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(native /generate body or None when there is nothing to score, options)`` of a
    ``/v1/score`` body; OpenAIError with SGLang's words for what it refuses. Its fields' types
    are ``request_fields.checked_score``' (the route checks them first)."""
    model = body.get("model", "default")
    for name, what in _NOT_HERE.items():
        if body.get(name) is not None:
            raise OpenAIError(f"{name}: {what} are not supported by the built-in engine", name)
    flags = {}
    for name in ("apply_softmax", "item_first", "return_token_logprobs"):
        flags[name] = body.get(name, False)
    if body.get("return_pooled_hidden_states"):
        raise OpenAIError(
            "return_pooled_hidden_states is not supported for CausalLM models. It requires a "
            "model with a task-specific head (e.g. SequenceClassification or RewardModel).",
            "return_pooled_hidden_states",
        )
    temperature = body.get("temperature", 1.0)
    if temperature != 1.0 and not flags["apply_softmax"]:
        raise OpenAIError("temperature requires apply_softmax=True", "temperature")
    labels = body.get("label_token_ids")
    if labels is None:
        raise OpenAIError(
            "label_token_ids is required for generation (CausalLM) models.", "label_token_ids"
        )
    items = body.get("items")
    if items is None:
        raise OpenAIError("items must be provided", "items")
    options = {"model": model, "temperature": float(temperature), "stream": False, **flags}
    if isinstance(items, list) and not items:  # nothing to score: SGLang answers at once
        return None, {**options, "labels": []}
    prompts, as_ids = _prompts(body.get("query"), items, flags["item_first"])
    per_item = _labels(labels, len(prompts), vocab_size)
    native: dict[str, Any] = {
        "input_ids" if as_ids else "text": prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": per_item,
        "logprob_start_len": -1,
    }
    return native, {**options, "labels": per_item}


def _prompts(query: Any, items: Any, item_first: bool) -> tuple[list[Any], bool]:
    """Each item's prompt, and whether they are token ids (else text)."""
    texts = isinstance(items, str) or (
        isinstance(items, list) and all(isinstance(i, str) for i in items)
    )
    ids = isinstance(items, list) and all(
        isinstance(i, list) and all(is_int(t) and t >= 0 for t in i) for i in items
    )
    if query is None:
        query = [] if ids else ""
    if texts and isinstance(query, str):
        listed = [items] if isinstance(items, str) else items
        return [f"{i}{query}" if item_first else f"{query}{i}" for i in listed], False
    if ids and isinstance(query, list) and all(is_int(t) and t >= 0 for t in query):
        return [[*i, *query] if item_first else [*query, *i] for i in items], True
    raise OpenAIError(
        "Invalid combination of query/items types for score_request: text with text items "
        "(a string or a list of them), or token ids with lists of token ids",
        "items",
    )


def _labels(labels: Any, count: int, vocab_size: int) -> list[list[int]]:
    """The labels of each of ``count`` items, checked as SGLang checks them."""
    if not isinstance(labels, list) or not labels:
        raise OpenAIError("label_token_ids must be a nonempty list", "label_token_ids")
    if isinstance(labels[0], list):
        if len(labels) != count:
            raise OpenAIError("label_token_ids must have one list per item", "label_token_ids")
        per_item = labels
    else:
        per_item = [labels] * count
    for item in per_item:
        if not isinstance(item, list) or not item:
            raise OpenAIError("each item must have a nonempty candidate list", "label_token_ids")
        if any(type(token) is not int or token < 0 for token in item):
            raise OpenAIError(
                "label_token_ids must contain nonnegative integers", "label_token_ids"
            )
        if len(set(item)) != len(item):
            raise OpenAIError(
                "label_token_ids must not contain duplicate tokens", "label_token_ids"
            )
        for token in item:
            if token >= vocab_size:
                raise OpenAIError(
                    f"Token ID {token} is out of vocabulary (vocab size: {vocab_size})",
                    "label_token_ids",
                )
    return per_item


def score_response(results: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``ScoringResponse`` of the native results of ``score_request``'s body."""
    scores, raw, prompt_tokens = [], [], 0
    for result, labels in zip(results, options["labels"], strict=True):
        meta = result["meta_info"]
        prompt_tokens += meta["prompt_tokens"]
        (step,) = meta["output_token_ids_logprobs"]  # the distribution after the prompt
        found = {token: logprob for logprob, token, _ in step}
        logprobs = [found.get(token, -math.inf) for token in labels]
        scores.append(label_scores(logprobs, options["apply_softmax"], options["temperature"]))
        raw.append(logprobs)
    return {
        "scores": scores,
        "pooled_hidden_states": None,
        "token_logprobs": raw if options["return_token_logprobs"] else None,
        "model": options["model"],
        "usage": _usage(prompt_tokens, 0),
        "object": "scoring",
    }


def label_scores(logprobs: list[float], softmax: bool, temperature: float) -> list[float]:
    """``_convert_logprobs_to_scores``: probabilities, or a softmax over the labels centred
    on their largest (so that a small temperature does not overflow)."""
    if not softmax:
        return [math.exp(x) if x != -math.inf else 0.0 for x in logprobs]
    top = max(logprobs)
    weights = [math.exp((x - top) / temperature) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
