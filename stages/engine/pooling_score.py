"""SGLang's ``/v1/score`` on a pooling engine: a reward or classification model's outputs (an
embedding model's embedding) after each ``query + item``, as SGLang 0.5.23 scores with a model
that does not generate (``tokenizer_manager_score_mixin.score_request``'s non-generation path:
an ``EmbeddingReqInput`` of the prompts; ``_process_single_item_scoring_results``: each
prompt's pooled outputs are its scores, a softmax of them at ``temperature`` with
``apply_softmax``).

The request is read by ``openai_score.score_request`` (``ScoreEngine(generation=False)``): the
same prompts, embedding overrides and checks, less the labels (not read), with SGLang's refusal
of ``return_token_logprobs``. ``return_pooled_hidden_states`` adds each prompt's hidden state
before the head. The setwise readout (``score_extraction_token``, with ``--disable-radix-cache``)
serves the SequenceClassification models whose head SGLang pools per position (Llama, Qwen2,
Qwen3): one row of outputs after each anchor, an item's rows its matrix (a softmax of each row,
without the temperature, as ``_multi_position_score_rows`` takes it); other models get
SGLang's 400 naming their architectures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from stages.engine.openai_api import _usage
from stages.engine.openai_score import ScoreEngine, label_scores, score_request
from stages.engine.protocol import POSITIONS

__all__ = ["pooled_scores", "score_engine", "score_pooled"]

# the pooler's run of rows: (rows, hidden wanted, anchors, overrides, positions) -> each row's
# native answer
Run = Callable[[list[list[int]], bool, Any, Any, Any], Awaitable[list[dict[str, Any]]]]


def score_engine(
    model: Any, radix_cache_off: bool, mis: bool = False, auto_truncate: bool = False
) -> ScoreEngine:
    """What ``score_request`` reads of a pooling engine serving ``model`` (``PoolingModel``;
    ``mis``: launched with ``--enable-mis``; ``auto_truncate``: with
    ``--allow-auto-truncate``)."""
    loaded = model.loaded
    architectures = getattr(loaded.model.config, "architectures", None) or []
    return ScoreEngine(
        loaded.tokenizer,
        prefix_cache=not radix_cache_off,
        embed_width=loaded.embed_width,
        generation=False,
        architectures=frozenset(architectures),
        mis=mis,
        auto_truncate=auto_truncate,
    )


async def score_pooled(
    body: dict[str, Any],
    engine: ScoreEngine,
    rows_of: Callable[[dict[str, Any]], list[list[int]]],
    run: Run,
) -> dict[str, Any]:
    """The answer to a ``/v1/score`` body (typed by ``request_fields.checked_score``):
    ``rows_of`` reads a native body's prompts as token ids (checked as ``/encode`` checks
    them), ``run`` pools them."""
    native, options = score_request(body, engine)
    if native is None:  # nothing to score: SGLang answers at once
        return pooled_scores([], options)
    rows = rows_of(native)
    answers = await run(
        rows,
        bool(native.get("return_pooled_hidden_states")),
        native.get("token_indices_to_pool"),
        native.get("positional_embed_overrides"),
        native.get(POSITIONS),
    )
    return pooled_scores(answers, options)


def pooled_scores(answers: list[Mapping[str, Any]], options: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``ScoringResponse`` of pooled native answers (``{embedding, meta_info,
    pooled_hidden_state?}`` each)."""
    scores: list[Any] = []
    states: list[Any] = []
    prompt_tokens = 0
    for answer in answers:
        prompt_tokens += answer["meta_info"]["prompt_tokens"]
        values = answer["embedding"]
        if options["setwise"]:  # rows per anchor; the softmax in float32, no temperature
            if options["apply_softmax"]:
                values = torch.softmax(torch.as_tensor(values), dim=-1).tolist()
        elif options["apply_softmax"]:  # (SGLang's in float64, centred on the largest)
            values = label_scores(values, True, options["temperature"])
        scores.append(values)
        states.append(answer.get("pooled_hidden_state"))
    return {
        "scores": scores,
        "pooled_hidden_states": states if any(s is not None for s in states) else None,
        "token_logprobs": None,
        "model": options["model"],
        "usage": _usage(options.get("prompt_tokens", prompt_tokens), 0),
        "object": "scoring",
    }
