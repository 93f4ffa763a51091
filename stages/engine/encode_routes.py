"""SGLang's routes of pooling models on the built-in engine: ``POST|PUT /encode`` and
``/classify`` (native), ``POST /v1/embeddings`` and ``/v1/classify`` (OpenAI-style); the model
runs on ``stages.engine.pooling.Pooler``'s thread.

Field names, defaults and answers follow SGLang 0.5.23 (``srt/managers/io_struct.py``
``EmbeddingReqInput``; ``tokenizer_manager.py`` ``_handle_batch_output``;
``srt/entrypoints/openai/serving_embedding.py``, ``serving_classify.py``, ``protocol.py``):

- ``/encode`` and ``/classify`` (the same request; a reward model's scores come from
  ``/classify``): ``text`` or ``input_ids``, one or a batch; ``rid`` (a string, or a list for a
  batch); ``dimensions`` (a Matryoshka model's output length);
  ``return_pooled_hidden_states`` (the hidden state the head read, as ``pooled_hidden_state``);
  ``sampling_params`` is taken and unused, as SGLang's "dummy" one. The answer: ``{embedding,
  meta_info}`` (a list of them for a batch), ``meta_info`` with ``id``, ``finish_reason``
  (``{type: length, length: 0}``), ``prompt_tokens``, ``weight_version``, ``num_retractions``
  and ``e2e_latency``. A reward model's ``embedding`` is its head's outputs (one per label: the
  reward is ``embedding[0]``);
- ``/v1/embeddings``: ``input`` a string, strings, token ids or lists of ids;
  ``encoding_format`` ``float`` or ``base64`` (little-endian float32, what the ``openai``
  client asks for by default); ``dimensions``; ``embed_override_token_id`` with
  ``embed_overrides`` (an input's rows, or null, each in place of an occurrence of that
  token's embedding: ``_embedding_overrides``); the answer ``{data: [{embedding, index,
  object: "embedding"}], model, object: "list", usage}``;
- ``/v1/classify``: ``input`` a string, strings or token ids; each answer's ``label`` (the
  config's ``id2label`` at the largest output), ``probs`` (softmax of the outputs) and
  ``num_classes``;
- ``/v1/score`` (on a pooling engine only): ``stages.engine.pooling_score``;
- ``/v1/rerank`` (on a pooling engine): SGLang's cross-encoder path
  (``openai_rerank.cross_encoder_pairs``), each ``[query, document]`` pair one prompt; the
  native routes take such pairs as ``text`` with ``is_cross_encoder_request``. A pair is
  encoded as the tokenizer encodes a text pair (``tokenizer(pairs,
  return_token_type_ids=True)``, SGLang's ``_tokenize_texts``), its token type ids going to
  the model with it.

Refused with 400, SGLang's words where it has them: ``text`` and ``input_ids`` both or neither,
a prompt as long as the context, an empty or blank ``input``, ``dimensions`` on a model that is
not a Matryoshka model, duplicate ``rid``s; and what this engine does not run (images, audio,
video, LoRA: a 400 naming the field; embedding overrides on an encoder, BERT or XLM-R, whose
SGLang model has no input-embedding hook), and the native routes' embedding
overrides (SGLang's ``EmbeddingReqInput`` takes them as tensors, which JSON cannot carry). On a
generating model all four answer SGLang's "does not appear to be an embedding model" 400, and
the pooling server answers ``/generate`` and the ``/v1`` generation routes with a 400 that says
so.
"""

from __future__ import annotations

import base64
import math
import os
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stages.engine.context_fit import truncated
from stages.engine.control_fields import ENCODE, typed_body
from stages.engine.openai_api import (
    OpenAIError,
    checked_body,
    error_response,
    read_json,
    refusal,
    results_usage,
)
from stages.engine.openai_rerank import cross_encoder_pairs, cross_encoder_response
from stages.engine.pooling import Pooler, PoolingFailed
from stages.engine.pooling_score import score_engine, score_pooled
from stages.engine.prompt_embeds import PositionalEmbeds, embeds_rows
from stages.engine.protocol import RequestError, is_int, read_prompts
from stages.engine.request_body import bad_request, dumps
from stages.engine.request_fields import (
    checked_classify,
    checked_embedding,
    checked_rerank,
    checked_score,
)
from stages.engine.request_log import entry

__all__ = ["NOT_EMBEDDING", "EncodeRoutes"]

# SGLang's answer to an embedding request on a generating model (TokenizerManager)
NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. Please add "
    "`--is-embedding` when launching the server or try another model."
)
# EmbeddingReqInput's fields this engine takes only at their defaults
_NEUTRAL = {
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "embed_override_token_id": None,
    "embed_overrides": None,
    "positional_embed_overrides": None,
    "modalities": None,
    "lora_path": None,
    "lora_id": None,
    "background": False,
    "return_prompt_token_ids": False,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
    "decision_layout": None,
}
# its other fields: read, or left as SGLang leaves them (each of its fields is in one of the two)
_TAKEN = {
    "text",
    "input_ids",
    "is_cross_encoder_request",
    "rid",
    "sampling_params",
    "dimensions",
    "return_pooled_hidden_states",
    "log_metrics",
    "priority",
    "routing_key",
    "http_worker_ipc",
    "external_trace_header",
    "received_time",
}
_EMBEDDINGS_NEUTRAL = {"lora_path": None}
_FINISHED = {"type": "length", "length": 0}  # FINISH_LENGTH(0): max_new_tokens is 0


class EncodeRoutes:
    """The pooling routes of one engine: ``pooler`` runs the model (None: a generating
    model, and every request gets SGLang's refusal); ``served_model_name`` is ``model`` in the
    ``/v1`` answers."""

    def __init__(
        self,
        pooler: Pooler | None,
        served_model_name: str,
        request_log: Any = None,
        *,
        radix_cache_off: bool = False,
        mis: bool = False,
        auto_truncate: bool = False,
    ) -> None:
        self.pooler = pooler
        self.auto_truncate = auto_truncate  # --allow-auto-truncate (_fit_rows)
        self.served_model_name = served_model_name
        # stages.engine.request_log.RequestLog (--log-requests, /configure_logging), or None
        self.request_log = request_log
        if pooler is not None:
            loaded = pooler.model.loaded
            self.vocab_size, self.context_length = loaded.vocab_size, loaded.context_length
            tokenizer = loaded.tokenizer
            self.encode_text = tokenizer.encode if tokenizer is not None else None
            # /v1/score's reading of this engine (--disable-radix-cache: its setwise readout)
            self.score_engine = score_engine(pooler.model, radix_cache_off, mis, auto_truncate)

    def add_to(self, app: web.Application) -> None:
        """The pooling routes (``/v1/score`` only on a pooling engine: the generating engine's
        is ``openai_score``'s)."""
        for path in ("/encode", "/classify"):
            app.router.add_post(path, self.native)
            app.router.add_put(path, self.native)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/classify", self.classify)
        if self.pooler is not None:
            app.router.add_post("/v1/score", self.score)
            app.router.add_post("/v1/rerank", self.rerank)
            app.router.add_put("/v1/rerank", self.rerank)

    # ---- native ------------------------------------------------------------------------------

    async def native(self, request: web.Request) -> web.Response:
        body = await typed_body(request, ENCODE, dataclass="EmbeddingReqInput")
        if isinstance(body, web.Response):
            return body
        if self.pooler is None:
            return bad_request(NOT_EMBEDDING)
        started = time.perf_counter()
        try:
            rows, batch, rids, dims, hidden, types = self._native_request(body)
        except (RequestError, ValueError) as exc:
            return bad_request(str(exc))
        try:
            answers = await self._answers(
                body, rows, batch, rids, dims, hidden, request.headers, started, types=types
            )
        except PoolingFailed as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=500)
        return web.Response(
            body=dumps(answers if batch else answers[0]), content_type="application/json"
        )

    async def _answers(
        self,
        body: dict[str, Any],
        rows: list[list[int]],
        batch: bool,
        rids: list[str],
        dims: list[int | None],
        hidden: bool = False,
        headers: Any = None,
        started: float | None = None,
        anchors: Any = None,
        overrides: Any = None,
        positions: Any = None,
        types: Any = None,
    ) -> list[dict[str, Any]]:
        """``rows`` run: the native answer of each (``{embedding, meta_info}``; ``e2e_latency``
        from ``started``, else from now), logged in the request log where it is active
        (``body`` as the request it was given as; ``anchors``, ``overrides``, ``positions``:
        ``/v1/score``'s, ``Pooler.encode``'s; ``types``: each pair's token type ids)."""
        if overrides is not None and self.pooler.model.encoder:
            raise OpenAIError(
                "embedding overrides are not supported on an encoder model (BERT, XLM-R): "
                "the built-in engine places them in decoder models only",
                "embed_overrides",
            )
        requests = self.request_log
        logged = entry(requests, body, rids, batch, headers)
        if started is None:
            started = time.perf_counter()
        try:
            values, states = await self.pooler.encode(
                rows, dims, hidden=hidden, anchors=anchors, overrides=overrides,
                positions=positions, types=types,
            )  # fmt: skip
            latency = time.perf_counter() - started
            answers = []
            for i, row in enumerate(rows):
                meta = {
                    "id": rids[i],
                    "finish_reason": _FINISHED,
                    "prompt_tokens": len(row),
                    "weight_version": self.pooler.weight_version,
                    "num_retractions": 0,
                    "e2e_latency": latency,
                }
                answer: dict[str, Any] = {"embedding": values[i], "meta_info": meta}
                if states is not None and states[i] is not None:  # (a cross-encoder's: none)
                    answer["pooled_hidden_state"] = states[i]
                answers.append(answer)
            if logged is not None:
                requests.finished_all(logged, answers)
        finally:
            if logged is not None:
                requests.ended(logged)
        return answers

    def _native_request(
        self, body: dict[str, Any]
    ) -> tuple[list[list[int]], bool, list[str], list[int | None], bool, Any]:
        for key, value in body.items():  # SGLang's other keys: ignored there (ignored_fields)
            if key in _NEUTRAL and value != _NEUTRAL[key]:
                raise RequestError(key, f"{key}={value!r} is not supported by the built-in engine")
        text, types = body.get("text"), None
        pairs = (
            body.get("is_cross_encoder_request")
            and isinstance(text, list)
            and text
            and isinstance(text[0], list)
        )
        if pairs:  # query-document pairs (SGLang's CROSS_ENCODER_PAIRS input)
            if body.get("input_ids") is not None:
                raise RequestError(
                    "input_ids", "text and input_ids cannot be provided at the same time"
                )
            rows, types = self._pair_rows(text)
            batch = True
        else:
            rows, batch = read_prompts(body, vocab_size=self.vocab_size, encode=self.encode_text)
        rows, types = self._fit_rows(rows, types)
        rids = _rids(body.get("rid"), len(rows), batch)
        dims = self._dimensions(body.get("dimensions"))
        hidden = bool(body.get("return_pooled_hidden_states"))
        return rows, batch, rids, [dims] * len(rows), hidden, types

    def _pair_rows(self, pairs: list[Any]) -> tuple[list[list[int]], list[list[int]] | None]:
        """Each ``[query, document]`` pair's ids and token type ids, encoded as a text pair
        (``tokenizer(pairs, return_token_type_ids=True)``: SGLang's ``_tokenize_texts``)."""
        tokenizer = self.pooler.model.loaded.tokenizer
        if tokenizer is None:
            raise RequestError("text", "this model has no tokenizer: send input_ids")
        for i, pair in enumerate(pairs):
            if not (
                isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)
            ):
                raise RequestError(f"text[{i}]", "expected a [query, document] pair of strings")
        encoded = tokenizer(pairs, return_token_type_ids=True)
        rows = [list(ids) for ids in encoded["input_ids"]]
        for i, row in enumerate(rows):
            if not row:
                raise RequestError(f"text[{i}]", "encodes to no tokens")
        kinds = encoded.get("token_type_ids")
        return rows, None if kinds is None else [list(k) for k in kinds]

    def _fit_rows(self, rows: list[list[int]], types: Any = None) -> tuple[list[list[int]], Any]:
        """``rows`` (and each pair's token ``types``) fitted to the context: one as long as
        the context is refused, as SGLang refuses it; with ``--allow-auto-truncate``, one of
        the context less 6 or more keeps that many tokens (``context_fit``)."""
        if self.auto_truncate:
            cut = [truncated(row, self.context_length, "input_ids") for row in rows]
            if types is not None:
                types = [kinds[: len(row)] for kinds, row in zip(types, cut, strict=True)]
            return cut, types
        for row in rows:
            if len(row) >= self.context_length:
                raise ValueError(
                    f"The input ({len(row)} tokens) is longer than the model's context length "
                    f"({self.context_length} tokens)."
                )
        return rows, types

    def _dimensions(self, value: Any) -> int | None:
        """``dimensions`` checked as SGLang's ``_validate_for_matryoshka_dim``."""
        if value is None:
            return None
        model = self.pooler.model
        if model.kind != "embed" or model.matryoshka == frozenset():
            raise ValueError(
                f"Model '{model.loaded.path}' does not support matryoshka representation, "
                "changing output dimensions will lead to poor results."
            )
        if value < 1:
            raise ValueError("Requested dimensions must be greater than 0")
        if model.matryoshka and value not in model.matryoshka:
            raise ValueError(
                f"Model '{model.loaded.path}' only supports {sorted(model.matryoshka)} "
                "matryoshka dimensions, using other output dimensions will lead to poor results."
            )
        if value > model.hidden_size:
            raise ValueError(
                f"Provided dimensions are greater than max embedding dimension: {model.hidden_size}"
            )
        return value

    # ---- /v1 ---------------------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self._openai(request, checked_embedding, self._embeddings)

    async def classify(self, request: web.Request) -> web.Response:
        return await self._openai(request, checked_classify, self._classify)

    async def _openai(
        self,
        request: web.Request,
        check: Callable[[Any], dict[str, Any]],
        answer: Callable[[Any], Awaitable[dict[str, Any]]],
    ) -> web.Response:
        """A ``/v1`` pooling request: its fields typed as SGLang's model types them
        (``check``, ``stages.engine.request_fields``; other keys ignored, as there), answered."""
        if self.pooler is None:
            return error_response(NOT_EMBEDDING)
        try:
            body = checked_body(check, await read_json(request))
            if self.request_log is not None:  # (level 2 or more: the body as it came)
                self.request_log.received_openai(body, request.headers)
            return web.Response(body=dumps(await answer(body)), content_type="application/json")
        except (OpenAIError, RequestError) as exc:
            return web.json_response(refusal(exc), status=400)
        except ValueError as exc:  # SGLang's ValueError: create_error_response(str(e))
            return error_response(str(exc))
        except PoolingFailed as exc:
            return error_response(str(exc), status=500)

    async def score(self, request: web.Request) -> web.Response:
        return await self._openai(request, checked_score, self._score)

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._openai(request, checked_rerank, self._rerank)

    async def _rerank(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """SGLang's cross-encoder rerank (``serving_rerank``): the pairs pooled as one batch."""
        loaded = self.pooler.model.loaded
        template = getattr(loaded.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        pairs = cross_encoder_pairs(body, template, str(loaded.path))
        try:
            rows, types = self._pair_rows(pairs)
        except RequestError as exc:
            raise OpenAIError(str(exc), "documents") from None
        rows, types = self._fit_rows(rows, types)
        rids = _rids(None, len(rows), True)
        answers = await self._answers(body, rows, True, rids, [None] * len(rows), types=types)
        return cross_encoder_response(answers, body)

    async def _score(self, body: dict[str, Any]) -> dict[str, Any]:
        def rows_of(native: dict[str, Any]) -> list[list[int]]:
            rows, _ = read_prompts(native, vocab_size=self.vocab_size, encode=self.encode_text)
            return self._fit_rows(rows)[0]

        async def run(
            rows: list[list[int]], hidden: bool, anchors: Any, overrides: Any, positions: Any
        ) -> Any:
            model = self.pooler.model
            if hidden and model.cross_encoder:  # (tokenizer_manager_score_mixin's words)
                name = model.loaded.model.config.architectures[0]
                raise OpenAIError(
                    f"return_pooled_hidden_states is not supported for {name}. This model uses "
                    "CrossEncodingPooler which does not expose pre-head hidden states."
                )
            rids = _rids(None, len(rows), True)
            listed = overrides if isinstance(overrides, list) else None
            answers = await self._answers(
                {"input_ids": rows}, rows, True, rids, [None] * len(rows), hidden,
                anchors=anchors, overrides=listed, positions=positions,
            )  # fmt: skip
            if any(not isinstance(a["embedding"], list) for a in answers):
                # (SGLang's ScoringResponse, lists of scores, refuses the numbers: its 400)
                raise OpenAIError(
                    "scores: a cross-encoder with one label scores a prompt as one number, "
                    "where /v1/score answers a list of scores per prompt: use /v1/rerank"
                )
            return answers

        return await score_pooled(body, self.score_engine, rows_of, run)

    async def _embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        _check_neutral(body, _EMBEDDINGS_NEUTRAL)
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise OpenAIError(
                f"encoding_format must be either 'float' or 'base64', got {encoding!r}",
                "encoding_format",
            )
        rows, results = await self._run_input(body, lists=True, overrides=True)
        data = [
            {"embedding": _encoded(values, encoding), "index": i, "object": "embedding"}
            for i, values in enumerate(results)
        ]
        return {
            "data": data,
            "model": self.served_model_name,
            "object": "list",
            "usage": results_usage(_metas(rows), 1),
        }

    async def _classify(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self.pooler.model
        if model.kind != "classify":
            raise OpenAIError(
                "this model is an embedding model: /v1/classify needs a classification model "
                "(*ForSequenceClassification)"
            )
        rows, results = await self._run_input(body, lists=False)
        data = []
        for i, values in enumerate(results):
            top = max(values)
            exps = [math.exp(v - top) for v in values]
            total = sum(exps)
            best = values.index(top)
            data.append(
                {
                    "index": i,
                    "label": model.labels.get(best, "Default"),
                    "probs": [e / total for e in exps],
                    "num_classes": len(values),
                }
            )
        return {
            "id": f"classify-{os.urandom(16).hex()}",
            "object": "list",
            "created": int(time.time()),
            "model": self.served_model_name,
            "data": data,
            "usage": results_usage(_metas(rows), 1),
        }

    async def _run_input(
        self, body: dict[str, Any], *, lists: bool, overrides: bool = False
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The ``input`` of a ``/v1`` body checked as SGLang's ``_validate_request`` checks it
        (``lists``: lists of ids allowed too; ``overrides``: its ``embed_overrides`` read), run;
        its rows and their results."""
        prompt = _input_prompt(body.get("input"), lists)
        rows, batch = read_prompts(prompt, vocab_size=self.vocab_size, encode=self.encode_text)
        rows, _ = self._fit_rows(rows)
        rids = _rids(body.get("rid"), len(rows), batch)  # checked as the native routes check it
        dims = self._dimensions(body.get("dimensions"))
        placed = self._embedding_overrides(body, rows) if overrides else None
        answers = await self._answers(
            prompt, rows, batch, rids, [dims] * len(rows), overrides=placed
        )
        if any(not isinstance(answer["embedding"], list) for answer in answers):
            # a one-label cross-encoder's numbers (SGLang: its response models refuse them,
            # /v1/classify with a 500)
            raise OpenAIError(
                "this model is a cross-encoder that scores a prompt as one number, not a list "
                "of outputs: rank query-document pairs with /v1/rerank, or read the numbers "
                "from /encode"
            )
        return rows, [answer["embedding"] for answer in answers]

    def _embedding_overrides(
        self, body: dict[str, Any], rows: list[list[int]]
    ) -> list[PositionalEmbeds | None] | None:
        """``/v1/embeddings``' ``embed_overrides`` (``[inputs][rows][hidden]``, an input's null:
        none) at each input's ``embed_override_token_id`` occurrences, as SGLang's
        ``serving_embedding`` pairs them and ``TokenizerManager._resolve_embed_overrides``
        places them (None: the body has none)."""
        token, given = body.get("embed_override_token_id"), body.get("embed_overrides")
        if given is not None and token is None:
            raise OpenAIError(
                "embed_override_token_id is required when embed_overrides is provided",
                "embed_override_token_id",
            )
        if token is not None and given is None:
            raise OpenAIError(
                "embed_override_token_id requires embed_overrides to be provided",
                "embed_overrides",
            )
        if given is None:
            return None
        if len(given) < len(rows):  # (SGLang's batch indexes past the list: a 500)
            raise OpenAIError(
                f"embed_overrides: expected an entry (or null) for each of the {len(rows)} "
                f"inputs, got {len(given)}",
                "embed_overrides",
            )
        width = self.pooler.model.loaded.embed_width
        placed: list[PositionalEmbeds | None] = []
        for i, row in enumerate(rows):
            if given[i] is None:
                placed.append(None)
                continue
            try:
                tensor = embeds_rows(given[i], f"embed_overrides[{i}]", width)
            except RequestError as exc:
                raise OpenAIError(str(exc), exc.field) from None
            positions = tuple(p for p, t in enumerate(row) if t == token)
            if len(positions) != tensor.shape[0]:
                raise OpenAIError(
                    f"input contains {len(positions)} occurrences of embed_override_token_id="
                    f"{token}, but embed_overrides has {tensor.shape[0]} entries.",
                    "embed_overrides",
                )
            placed.append(PositionalEmbeds(positions, tensor) if positions else None)
        return placed


def _input_prompt(prompt: Any, lists: bool) -> dict[str, Any]:
    """The native prompt field of an ``input``: ``text`` for strings, ``input_ids`` for ids."""
    if not prompt:
        raise OpenAIError("Input cannot be empty", "input")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise OpenAIError("Input cannot be empty or whitespace only", "input")
        return {"text": prompt}
    if not isinstance(prompt, list):
        raise OpenAIError("input: Input should be a valid string or list", "input")
    first = prompt[0]
    if isinstance(first, str):
        for i, item in enumerate(prompt):
            if not isinstance(item, str):
                raise OpenAIError("All items in input list must be strings", "input")
            if not item.strip():
                raise OpenAIError(f"Input at index {i} cannot be empty or whitespace only", "input")
        return {"text": prompt}
    if is_int(first):
        for i, item in enumerate(prompt):
            if not is_int(item):
                raise OpenAIError("All items in input list must be integers", "input")
            if item < 0:
                raise OpenAIError(f"Token ID at index {i} must be non-negative", "input")
        return {"input_ids": prompt}
    if lists and isinstance(first, list):
        return {"input_ids": prompt}
    raise OpenAIError(
        "input: Input should be a string, a list of strings or a list of token ids"
        + (", or a list of lists of token ids" if lists else ""),
        "input",
    )


def _check_neutral(body: dict[str, Any], neutral: dict[str, Any]) -> None:
    """A 400 naming a field SGLang honours and this engine cannot, unless at its neutral
    value."""
    for key, value in neutral.items():
        if body.get(key, value) != value:
            raise OpenAIError(f"{key} is not supported by the built-in engine", key)


def _rids(rid: Any, count: int, batch: bool) -> list[str]:
    """Each prompt's request id (``EmbeddingReqInput.normalize_batch_and_arguments``: a batch
    takes a list, without duplicates)."""
    if rid is None:
        return [os.urandom(16).hex() for _ in range(count)]
    if isinstance(rid, str) and not batch:
        return [rid]
    if batch and not isinstance(rid, list):  # EmbeddingReqInput's assert, as a 400
        raise ValueError("The rid should be a list.")
    if not batch or not all(isinstance(r, str) for r in rid):
        raise RequestError(
            "rid", f"expected a string or (in a batch) a list of strings, got {rid!r}"
        )
    if len(rid) != count:
        raise RequestError("rid", f"has {len(rid)} entries for a batch of {count}")
    if len(set(rid)) != len(rid):
        duplicates = sorted({r for r in rid if rid.count(r) > 1})
        raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(rid)


def _metas(rows: list[list[int]]) -> list[dict[str, Any]]:
    return [{"meta_info": {"prompt_tokens": len(r), "completion_tokens": 0}} for r in rows]


def _encoded(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
