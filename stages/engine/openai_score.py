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

Embedding overrides (``embed_override_token_id``, ``query_embed_overrides``,
``item_embed_overrides``: ``_build_token_id_inputs``, ``_resolve_overrides_for_sequence``): the
query's and each item's occurrences of the placeholder token take the given rows, in order, in
place of its embedding; text is tokenized first (the query with special tokens, the items
without). Such a prompt takes nothing from the prefix cache and leaves nothing in it.

Setwise readout (``score_extraction_token``, with ``--disable-radix-cache``: ``_validate_score_
extraction``, ``compute_logprobs_at_positions``): the labels' log-probs are read after every
occurrence of that token in each ``query + item`` (the distribution of the token that follows it),
and ``scores`` holds one ``[occurrences x labels]`` matrix per item. This engine always prefills
a prompt whole (SGLang also wants ``--chunked-prefill-size -1``) and never truncates one.

Multi-item scoring (``--enable-mis``): each item scored alone as SGLang's fused sequence reads
it (``_fused``). ``return_pooled_hidden_states`` is refused as SGLang refuses it for a causal LM;
a text query with token-id items and neither overrides, readout nor ``--enable-mis`` likewise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stages.engine.openai_api import OpenAIError, _usage
from stages.engine.prompt_embeds import PositionalEmbeds, PromptPositions, embeds_rows
from stages.engine.protocol import POSITIONS, is_int
from stages.engine.request_error import RequestError

__all__ = ["ScoreEngine", "label_scores", "mis_refusal", "score_request", "score_response"]


# SGLang's SequenceClassification architectures that pool their head per position, the only
# pooling models its setwise readout serves (model_config.py's _score_and_pool_archs)
_SCORE_AND_POOL = frozenset(
    {"LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
     "Qwen3ForSequenceClassification"}
)  # fmt: skip


@dataclass(frozen=True)
class ScoreEngine:
    """What the route reads of its engine: the tokenizer (None: the model has none), whether
    the prefix cache is on, and the model's embedding width (None: no embeddings taken)."""

    tokenizer: Any
    prefix_cache: bool
    embed_width: int | None
    # a pooling engine's (SGLang's non-generation path: its model's outputs are the scores,
    # an EmbeddingReqInput runs them): whether the model generates, and its architectures
    generation: bool = True
    architectures: frozenset[str] = frozenset()
    # --enable-mis: the items scored as one fused sequence's (``_fused``)
    mis: bool = False
    # --allow-auto-truncate: a prompt could lose the positions a readout reads
    auto_truncate: bool = False

    @property
    def vocab_size(self) -> int:  # SGLang's: the tokenizer's (0 without one)
        return self.tokenizer.vocab_size if self.tokenizer is not None else 0

    def encode(self, text: str, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer: send token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=special))


def score_request(body: Any, engine: ScoreEngine) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(native body or None when there is nothing to score, options)`` of a ``/v1/score``
    body: a ``/generate`` body, or for a model that does not generate (``engine.generation``
    false) the ``/encode`` body SGLang builds (an ``EmbeddingReqInput``'s prompts, overrides,
    ``token_indices_to_pool`` and ``return_pooled_hidden_states``: ``stages.engine
    .pooling_score``); OpenAIError with SGLang's words for what it refuses. Its fields' types
    are ``request_fields.checked_score``' (the route checks them first). SGLang's order of
    checks: ``score_request`` in ``tokenizer_manager_score_mixin.py``."""
    model = body.get("model", "default")
    flags = {}
    for name in ("apply_softmax", "item_first", "return_token_logprobs"):
        flags[name] = body.get(name, False)
    anchor = _extraction_token(body.get("score_extraction_token"), engine)
    temperature = body.get("temperature", 1.0)
    if temperature != 1.0 and not flags["apply_softmax"]:
        raise OpenAIError("temperature requires apply_softmax=True", "temperature")
    if flags["return_token_logprobs"] and not engine.generation:
        raise OpenAIError(
            "return_token_logprobs is only supported for CausalLM models", "return_token_logprobs"
        )
    labels = body.get("label_token_ids")
    if labels is None and engine.generation:
        raise OpenAIError(
            "label_token_ids is required for generation (CausalLM) models.", "label_token_ids"
        )
    items = body.get("items")
    if items is None:
        raise OpenAIError("items must be provided", "items")
    options = {
        "model": model, "temperature": float(temperature), "stream": False, "setwise": False,
        **flags,
    }  # fmt: skip
    if isinstance(items, list) and not items:  # nothing to score: SGLang answers at once
        return None, {**options, "labels": []}
    count = 1 if isinstance(items, str) else len(items)
    per_item = _labels(labels, count, engine.vocab_size) if engine.generation else [None] * count
    query = body.get("query")
    if query is None:  # an omitted query: none of the items' kind
        query = [] if isinstance(items, list) and isinstance(items[0], list) else ""
    overrides = _Overrides.of(body, items, flags["item_first"], engine)
    if anchor is not None:
        if not engine.generation and not engine.architectures & _SCORE_AND_POOL:
            raise OpenAIError(
                "score_extraction_token_id is only supported for SequenceClassification models "
                "that pool the head per position (score_and_pool); model architecture(s) "
                f"{list(engine.architectures)} do not (cross-encoder, reward, and embedding "
                "models pool a single vector and ignore the readout positions).",
                "score_extraction_token",
            )
        if flags["item_first"]:
            raise OpenAIError(
                "item_first is not supported with score_extraction_token_id.", "item_first"
            )
        if engine.prefix_cache:
            raise OpenAIError(
                "score_extraction_token_id requires --disable-radix-cache because pooling "
                "positions are relative to the full prompt.",
                "score_extraction_token",
            )
        if engine.auto_truncate:
            raise OpenAIError(
                "score_extraction_token_id is not supported with --allow-auto-truncate: "
                "pooling positions are computed from the full prompt, and truncating the "
                "sequence would leave them pointing past the truncated length.",
                "score_extraction_token",
            )
    if engine.mis and not engine.generation and not engine.architectures & _SCORE_AND_POOL:
        raise OpenAIError(  # (SGLang's standard pooler reads one row: its answer fails)
            "--enable-mis scores with a generating model or a SequenceClassification model that "
            f"pools its head per position; model architecture(s) {list(engine.architectures)} "
            "pool a single vector",
            "items",
        )
    if engine.mis:  # SGLang's fused sequence, scored an item at a time here
        fused = _fused(query, items, anchor, overrides, engine)
        prompts, as_ids, placed = fused.prompts, True, fused.placed
        options = {**options, "prompt_tokens": fused.length}
    else:
        prompts, as_ids, placed = _prompts(
            query, items, flags["item_first"], anchor, overrides, engine
        )
    native: dict[str, Any] = {"input_ids" if as_ids else "text": prompts}
    if engine.mis:
        native[POSITIONS] = fused.positions
    if engine.generation:
        native["sampling_params"] = {"max_new_tokens": 0}
        native["return_logprob"] = True
        native["token_ids_logprob"] = per_item
        # the setwise readout reads the prompt's positions (input log-probs from the start)
        native["logprob_start_len"] = 0 if anchor is not None else -1
    if placed is not None:
        native["positional_embed_overrides"] = placed
    if anchor is not None and engine.mis:
        anchors = fused.anchors  # (SGLang's MIS+setwise answer has no token_logprobs)
        options = {**options, "setwise": True, "anchors": anchors, "no_token_logprobs": True}
        if not engine.generation:
            native["token_indices_to_pool"] = anchors
    elif anchor is not None:
        anchors = [[i for i, t in enumerate(p) if t == anchor] for p in prompts]
        if any(not found for found in anchors):
            raise OpenAIError(
                f"No score-extraction token (id={anchor}) found in one or more input(s); the "
                "client must render one per candidate.",
                "score_extraction_token",
            )
        options = {**options, "setwise": True, "anchors": anchors}
        if not engine.generation:  # the pooler reads its head at them
            native["token_indices_to_pool"] = anchors
    if body.get("return_pooled_hidden_states") and not engine.generation:
        native["return_pooled_hidden_states"] = True
    elif body.get("return_pooled_hidden_states"):
        raise OpenAIError(
            "return_pooled_hidden_states is not supported for CausalLM models. It requires a "
            "model with a task-specific head (e.g. SequenceClassification or RewardModel).",
            "return_pooled_hidden_states",
        )
    return native, {**options, "labels": per_item}


def _extraction_token(token: Any, engine: ScoreEngine) -> int | None:
    """The id of ``score_extraction_token`` (``_resolve_score_extraction_token_id``: the
    tokenizer's id of that token, which must be one of its own)."""
    if token is None:
        return None
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise OpenAIError(
            "A tokenizer is required to resolve score_extraction_token.", "score_extraction_token"
        )
    found = tokenizer.convert_tokens_to_ids(token)
    unknown = tokenizer.unk_token_id
    if found is None or (unknown is not None and found == unknown):
        raise OpenAIError(
            f"score_extraction_token {token!r} did not resolve to a dedicated token id.",
            "score_extraction_token",
        )
    return int(found)


@dataclass(frozen=True)
class _Overrides:
    """A request's embedding overrides: the placeholder id, the query's rows and each item's
    (None: that item has none)."""

    token: int
    query: Any  # torch.Tensor [k, width] or None
    items: list[Any] | None

    @staticmethod
    def of(body: Mapping[str, Any], items: Any, item_first: bool, engine: ScoreEngine) -> Any:
        """The body's overrides, checked as SGLang checks them (None: it has none)."""
        query_rows, item_rows = body.get("query_embed_overrides"), body.get("item_embed_overrides")
        if query_rows is None and item_rows is None:
            return None
        token = body.get("embed_override_token_id")
        if token is None:
            raise OpenAIError(
                "embed_override_token_id is required when query_embed_overrides, "
                "item_embed_overrides, or stacked_query_item_embed_overrides are supplied.",
                "embed_override_token_id",
            )
        if item_first:
            raise OpenAIError(
                "item_first is not supported when embeddings are supplied", "item_first"
            )
        # (SGLang compares with len(items), a single text item's characters included)
        if item_rows is not None and len(item_rows) != len(items):
            raise OpenAIError(
                f"item_embed_overrides length ({len(item_rows)}) must match items length "
                f"({len(items)}).",
                "item_embed_overrides",
            )
        width = engine.embed_width
        if width is None:
            raise OpenAIError("this engine takes no embeddings", "query_embed_overrides")
        try:
            query = None if query_rows is None else embeds_rows(
                query_rows, "query_embed_overrides", width
            )  # fmt: skip
            each = None
            if item_rows is not None:
                each = [
                    None if rows is None else embeds_rows(rows, f"item_embed_overrides[{i}]", width)
                    for i, rows in enumerate(item_rows)
                ]
        except RequestError as exc:
            raise OpenAIError(str(exc), exc.field) from None
        return _Overrides(token, query, each)

    def place(
        self, query: list[int], items: list[list[int]], gap: int = 0
    ) -> list[PositionalEmbeds | None]:
        """Each ``query + item`` prompt's overrides (``_resolve_overrides_for_sequence``: as
        many rows as the placeholder's occurrences, query's then item's; ``gap``: tokens
        between the two, a delimiter's under ``--enable-mis``)."""
        head = self._at(query, self.query, 0, "query")
        placed: list[PositionalEmbeds | None] = []
        for i, item in enumerate(items):
            rows = self.items[i] if self.items is not None else None
            tail = self._at(item, rows, len(query) + gap, f"items[{i}]")
            positions = head[0] + tail[0]
            if not positions:
                placed.append(None)
                continue
            parts = [r for r in (head[1], tail[1]) if r is not None]
            placed.append(PositionalEmbeds(tuple(positions), torch.cat(parts)))
        return placed

    def _at(self, ids: list[int], rows: Any, offset: int, label: str) -> tuple[list[int], Any]:
        if rows is None:
            return [], None
        positions = [offset + i for i, t in enumerate(ids) if t == self.token]
        if len(positions) != rows.shape[0]:
            field = "query_embed_overrides" if label == "query" else "item_embed_overrides"
            raise OpenAIError(
                f"{label} contains {len(positions)} occurrences of embed_override_token_id="
                f"{self.token}, but {rows.shape[0]} override embeddings were provided.",
                field,
            )
        return positions, rows


def _ids_of(value: Any) -> bool:
    """Whether ``value`` is a list of token ids."""
    return isinstance(value, list) and all(is_int(t) and t >= 0 for t in value)


def _prompts(
    query: Any,
    items: Any,
    item_first: bool,
    anchor: int | None,
    overrides: _Overrides | None,
    engine: ScoreEngine,
) -> tuple[list[Any], bool, list[PositionalEmbeds | None] | None]:
    """Each item's prompt, whether they are token ids (else text), and their embedding
    overrides (None: none), by SGLang's paths: text alike, ids alike, setwise text, then
    text tokenized for overrides or the readout."""

    listed = [items] if isinstance(items, str) else items
    if isinstance(query, str) and overrides is None and anchor is None:
        if all(isinstance(i, str) for i in listed):
            return [f"{i}{query}" if item_first else f"{query}{i}" for i in listed], False, None
    elif isinstance(query, list) and isinstance(items, list) and isinstance(items[0], list):
        if _ids_of(query) and all(_ids_of(i) for i in items):
            if anchor is not None and anchor in query:
                raise _anchor_in_query()
            return _with_overrides(query, items, item_first, overrides)
    elif anchor is not None and overrides is None and isinstance(query, str):
        if not all(isinstance(i, str) for i in listed):
            raise OpenAIError(
                "query and items must both be text or both be token IDs when "
                "score_extraction_token_id is set.",
                "items",
            )
        if query and anchor in engine.encode(query):
            raise _anchor_in_query()
        return [engine.encode(f"{query}{i}") for i in listed], True, None
    elif overrides is not None or anchor is not None:
        head = engine.encode(query) if isinstance(query, str) else query
        tails = [engine.encode(i, False) if isinstance(i, str) else i for i in listed]
        if _ids_of(head) and all(_ids_of(i) for i in tails):
            if anchor is not None and anchor in head:
                raise _anchor_in_query()
            return _with_overrides(head, tails, item_first, overrides)
    raise OpenAIError(
        "Invalid combination of query/items types for score_request: text with text items "
        "(a string or a list of them), or token ids with lists of token ids",
        "items",
    )


MIS_DELIMITER = 9999  # SGLang's MIS_DELIMITER_TOKEN_ID (constants.py), a real token's id


def mis_refusal(vocab_size: int) -> str | None:
    """Why a model of ``vocab_size`` tokens cannot run ``--enable-mis`` (None: it can): its
    delimiter is token 9999, whose embedding it reads."""
    if vocab_size > MIS_DELIMITER:
        return None
    return (
        f"--enable-mis fuses a /v1/score request's items with the delimiter token {MIS_DELIMITER} "
        f"(SGLang's MIS_DELIMITER_TOKEN_ID), which this model's {vocab_size}-token vocabulary "
        "does not have"
    )


@dataclass(frozen=True)
class _Fused:
    """A request's items as SGLang's ``--enable-mis`` scores them, one prompt each here."""

    prompts: list[list[int]]  # each item's: the query, the delimiter, the item
    positions: list[PromptPositions]  # their position ids
    placed: list[PositionalEmbeds | None] | None  # their embedding overrides
    anchors: list[list[int]] | None  # the readout's anchors in each item's prompt
    length: int  # the fused sequence's tokens (SGLang's prompt_tokens)


def _fused(
    query: Any, items: Any, anchor: int | None, overrides: _Overrides | None, engine: ScoreEngine
) -> _Fused:
    """``--enable-mis`` (``_build_multi_item_token_sequence``): the items fused as ``query
    <delim> item0 <delim> item1 ... <delim>``, each item attending to the query and to itself
    (FlashInfer's multi-item mask), its position ids going on from the query's last, the
    delimiter's shared with it (``_process_multi_item_scoring``: ``prefix_len +
    pos_within_item - 1``), each read before the delimiter that ends it. The same numbers come
    from each item scored alone as ``query <delim> item`` at those positions, which is how this
    engine scores them. Text is tokenized as SGLang's ``_batch_tokenize_query_and_items`` does
    (the query with special tokens, the items without); ``item_first`` is ignored there."""

    listed = [items] if isinstance(items, str) else items
    plain = isinstance(query, str) and overrides is None and anchor is None
    ids_alike = isinstance(query, list) and isinstance(items, list) and isinstance(items[0], list)
    if not (plain or ids_alike or overrides is not None or anchor is not None):
        raise OpenAIError("Invalid combination of query/items types for score_request.", "items")
    head = engine.encode(query) if isinstance(query, str) else query
    tails = [engine.encode(i, False) if isinstance(i, str) else i for i in listed]
    if not (_ids_of(head) and all(_ids_of(t) for t in tails)):
        raise OpenAIError("Invalid combination of query/items types for score_request.", "items")
    if not head:  # (its delimiter would sit at position -1)
        raise OpenAIError(
            "--enable-mis needs a query: the first delimiter takes the query's last position",
            "query",
        )
    size, delim = len(head), MIS_DELIMITER  # (the engine refuses to start where it has no 9999)
    prompts = [[*head, delim, *tail] for tail in tails]
    positions = [
        PromptPositions((*range(size), size - 1, *range(size, size + len(tail)))) for tail in tails
    ]
    placed = None
    if overrides is not None:
        found = overrides.place(head, tails, gap=1)
        placed = found if any(p is not None for p in found) else None
    anchors = None
    if anchor is not None:
        fused = [*head]
        starts = []  # each item's delimiter's index in the fused sequence
        for tail in tails:
            starts.append(len(fused))
            fused += [delim, *tail]
        ends = [*starts[1:], len(fused)]  # (the last delimiter closes the last item)
        found_at = [i for i, t in enumerate([*fused, delim]) if t == anchor]
        if not found_at:
            raise OpenAIError(
                f"No score-extraction token (id={anchor}) found in one or more input(s); the "
                "client must render one per candidate.",
                "score_extraction_token",
            )
        anchors = [
            [f - lo + size for f in found_at if lo < f < hi]
            for lo, hi in zip(starts, ends, strict=True)
        ]
        if sum(map(len, anchors)) != len(found_at):
            raise OpenAIError(
                "score-extraction token found outside the candidate items (e.g. in the shared "
                "query prefix) under --enable-mis multi-item scoring; it must appear only "
                "within items, one per candidate.",
                "score_extraction_token",
            )
        if any(not a for a in anchors):
            raise OpenAIError(
                "Each item (candidate set) must contain at least one score-extraction token "
                "under --enable-mis multi-item scoring.",
                "score_extraction_token",
            )
    length = size + sum(len(t) + 1 for t in tails) + 1
    return _Fused(prompts, positions, placed, anchors, length)


def _with_overrides(
    query: list[int], items: list[list[int]], item_first: bool, overrides: _Overrides | None
) -> tuple[list[Any], bool, list[PositionalEmbeds | None] | None]:
    prompts = [[*i, *query] if item_first else [*query, *i] for i in items]
    if overrides is None:
        return prompts, True, None
    placed = overrides.place(query, items)
    return prompts, True, placed if any(p is not None for p in placed) else None


def _anchor_in_query() -> OpenAIError:
    return OpenAIError(
        "score-extraction token found in the shared query prefix; it must appear only within "
        "items, one per candidate.",
        "query",
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
    scores: list[Any] = []
    raw: list[list[float]] = []
    prompt_tokens = 0
    softmax, temperature = options["apply_softmax"], options["temperature"]
    for i, (result, labels) in enumerate(zip(results, options["labels"], strict=True)):
        meta = result["meta_info"]
        prompt_tokens += meta["prompt_tokens"]
        if options["setwise"]:  # one row per anchor; no raw log-probs (SGLang's `continue`)
            scores.append(
                [
                    label_scores(_found(step, labels), softmax, temperature)
                    for step in _after_anchors(meta, options["anchors"][i])
                ]
            )
            continue
        (step,) = meta["output_token_ids_logprobs"]  # the distribution after the prompt
        logprobs = _found(step, labels)
        scores.append(label_scores(logprobs, softmax, temperature))
        raw.append(logprobs)
    wanted = options["return_token_logprobs"] and not options.get("no_token_logprobs")
    return {
        "scores": scores,
        "pooled_hidden_states": None,
        "token_logprobs": raw if wanted else None,
        "model": options["model"],
        "usage": _usage(options.get("prompt_tokens", prompt_tokens), 0),
        "object": "scoring",
    }


def _after_anchors(meta: Mapping[str, Any], anchors: list[int]) -> list[Any]:
    """The labels' log-probs of the token after each anchor (``compute_logprobs_at_positions``:
    the model's output at the anchor): the next prompt position's input log-probs, or, after
    the prompt's last token, the output's."""
    inputs, after = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"][0]
    return [inputs[p + 1] if p + 1 < len(inputs) else after for p in anchors]


def _found(step: Any, labels: list[int]) -> list[float]:
    """``labels``' log-probs in one step's ``(logprob, id, text)`` entries (-inf: absent)."""
    found = {token: logprob for logprob, token, _ in step or ()}
    return [found.get(token, -math.inf) for token in labels]


def label_scores(logprobs: list[float], softmax: bool, temperature: float) -> list[float]:
    """``_convert_logprobs_to_scores``: probabilities, or a softmax over the labels centred
    on their largest (so that a small temperature does not overflow)."""
    if not softmax:
        return [math.exp(x) if x != -math.inf else 0.0 for x in logprobs]
    top = max(logprobs)
    weights = [math.exp((x - top) / temperature) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
