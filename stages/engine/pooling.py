"""Pooling models on the built-in engine: reward (classification) and embedding models, as
SGLang serves them with ``--is-embedding`` (``/encode``, ``/classify``, ``/v1/embeddings``:
``stages.engine.encode_routes``).

What a checkpoint is follows SGLang 0.5.23 (``srt/configs/model_config.py``,
``is_generation_model``; ``srt/models/llama_reward.py``, ``llama.py``):

- ``classify``: an architecture ``*ForSequenceClassification`` (a reward model such as
  Skywork-Reward, or any classifier on a decoder): the backbone's hidden state at each prompt's
  last token through the model's ``score`` head, the head's outputs (one per label) as the
  "embedding", not normalized (``Pooler(LAST, normalize=False)`` then ``self.score``);
- ``embed``: a base model (``*Model``, ``MistralModel``...), or a causal LM served with
  ``--is-embedding``: the last token's hidden state after the final norm, L2-normalized
  (``Pooler(LAST, normalize=True)``), cut to ``dimensions`` first for a Matryoshka model.

``Qwen2ForRewardModel`` and ``Qwen3ForRewardModel`` (checkpoints that ship their own code) are
built by ``stages.engine.reward_models`` as SGLang builds them, a two-layer head on the base
model, served as ``classify`` without ``--trust-remote-code``.

Encoders (``srt/models/bert.py``, ``roberta.py``): ``BertModel``, ``Contriever`` and
``XLMRobertaModel`` embed with their first (``[CLS]``) token's hidden state, L2-normalized
(``Pooler(CLS, normalize=True)``); ``BertForSequenceClassification`` and
``XLMRobertaForSequenceClassification`` are cross-encoders (bge-reranker...): the model's own
classification head over the ``[CLS]`` token, then the activation the config names
(``sbert_ce_default_activation_function``, a ``torch.nn.modules`` class; none: the logits as
they are), one label's output a number rather than a list (``CrossEncodingPooler``'s
``squeeze(-1)``). A query-document pair (``/v1/rerank``, ``is_cross_encoder_request``) is one
prompt of the tokenizer's pair encoding, with its token type ids.

``Pooler`` runs them on a thread of its own, as the scheduler thread runs a generating model:
requests queue, and each pass takes every waiting prompt (sorted by length, cut into batches
of at most ``max_rows`` rows and ``max_batch_tokens`` padded tokens), right-padded with an
attention mask, so a prompt's result does not depend on what it was batched with (causal
attention never looks right). The event loop only parses, waits and answers.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog
import torch
import torch.nn.functional as F

from stages import hf
from stages.engine.load_meter import LoadMeter
from stages.engine.loader import (
    LoadedModel,
    eos_ids,
    fill_weights,
    instantiate,
    load_tokenizer,
    own_code,
)
from stages.engine.memory_offload import MemoryState
from stages.engine.remote_instance import RemoteSeed
from stages.engine.reward_model_names import REWARD_MODEL_NAMES
from stages.hub import resolve_model

__all__ = [
    "POOLING_KINDS",
    "Pooler",
    "PoolingFailed",
    "PoolingModel",
    "load_pooling_model",
    "model_kind",
    "pooling_kind",
]

log = structlog.get_logger("stages.engine.pooling")

T = TypeVar("T")

POOLING_KINDS = ("classify", "embed")
Kind = Literal["classify", "embed"]

# SGLang's embedding architectures that transformers loads as plain base models
_BASE_MODELS = {
    "LlamaEmbeddingModel", "MistralModel", "Qwen3Model", "BertModel", "Contriever",
    "XLMRobertaModel",
}  # fmt: skip
# the encoders among them (bidirectional: pooled at the first token), and the cross-encoders
# (SGLang's CrossEncodingPooler models: is_cross_encoding_pooler_model)
CROSS_ENCODERS = frozenset({"BertForSequenceClassification", "XLMRobertaForSequenceClassification"})
ENCODERS = frozenset({"BertModel", "Contriever", "XLMRobertaModel"}) | CROSS_ENCODERS
_ACTIVATIONS = "torch.nn.modules."  # where a cross-encoder's config may name its activation
_OFFSET_POSITIONS = ("xlm-roberta", "roberta")  # positions from the padding index on


def pooling_kind(config: Any, is_embedding: bool) -> Kind | None:
    """What ``config`` (a transformers config) serves: ``classify``, ``embed`` or None (a
    generating model), as SGLang's ``is_generation_model`` decides with ``--is-embedding``."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classify"
    if REWARD_MODEL_NAMES.intersection(architectures):  # (built here, no remote code)
        return "classify"
    if any(a.endswith("ForRewardModel") for a in architectures):
        raise ValueError(
            f"architecture {architectures[0]} is a remote-code reward model, which the built-in "
            "engine does not run (it builds Qwen2ForRewardModel and Qwen3ForRewardModel): use "
            "a *ForSequenceClassification checkpoint of it"
        )
    if is_embedding or any(a in _BASE_MODELS for a in architectures):
        return "embed"
    return None


def model_kind(
    path: str | Path, is_embedding: bool, *, trust_remote_code: bool = False
) -> Kind | None:
    """``pooling_kind`` of the model at ``path`` (a folder or a Hub id), from its config."""
    folder = resolve_model(str(path), what="--model")
    return pooling_kind(_config(folder, trust_remote_code), is_embedding)


def _config(folder: Path, trust_remote_code: bool) -> Any:
    """The folder's transformers config (its own config code run only when trusted)."""
    with own_code(folder):
        return hf.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )


@dataclass
class PoolingModel:
    """A loaded pooling model: ``loaded`` (path, tokenizer, vocabulary, context; ``model`` the
    whole transformers model), ``kind``, the ``backbone`` that gives hidden states and the
    ``head`` after it (None for ``embed``); ``labels``: the head's label names by index;
    ``matryoshka``: the ``dimensions`` a request may ask for (None: any up to ``hidden_size``;
    empty: none, the model is not a Matryoshka model)."""

    loaded: LoadedModel
    kind: Kind
    backbone: torch.nn.Module
    head: torch.nn.Module | None
    labels: dict[int, str]
    hidden_size: int
    matryoshka: frozenset[int] | None
    # an encoder (BERT, XLM-R): pooled at its first token, its padding ``pad_id``; a
    # cross-encoder's results are its whole model's logits through ``activation``
    encoder: bool = False
    cross_encoder: bool = False
    activation: torch.nn.Module | None = None
    pad_id: int = 0

    @property
    def width(self) -> int:
        """The length of a result: the head's labels, or the hidden size."""
        return len(self.labels) if self.head is not None else self.hidden_size

    @torch.inference_mode()
    def pool(
        self,
        rows: Sequence[Sequence[int]],
        dimensions: Sequence[int | None] | None = None,
        anchors: Sequence[Sequence[int] | None] | None = None,
        overrides: Sequence[Any] | None = None,
        positions: Sequence[Any] | None = None,
        types: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[list[Any], Any]:
        """One batched pass over ``rows`` (token ids): each row's result (the head's outputs, or
        its normalized hidden state cut to its ``dimensions``) and the pooled hidden states
        before the head, float32 on the CPU. ``anchors``: a row's positions to read the head at
        (``/v1/score``'s setwise readout: a row of outputs each, and as many hidden states)
        instead of its last; ``overrides``: a row's ``PositionalEmbeds`` (``/v1/score``'s
        embedding overrides: its rows in place of those positions' token embeddings);
        ``positions``: a row's ``PromptPositions`` (``--enable-mis``: its position ids);
        ``types``: a row's token type ids (a cross-encoder's query-document pair).
        A cross-encoder's results are its scores, with no hidden states (None)."""
        device = next(self.backbone.parameters()).device
        lengths = torch.tensor([len(r) for r in rows])
        ids = torch.full((len(rows), int(lengths.max())), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        ids, mask = ids.to(device), mask.to(device)
        where: dict[str, torch.Tensor] = {}
        if self.encoder and types is not None and any(t is not None for t in types):
            # (a decoder's pairs are its ids alone: SGLang's decoders take no token types)
            kinds = torch.zeros_like(ids)
            for i, given in enumerate(types):
                if given is not None:
                    kinds[i, : len(given)] = torch.tensor(list(given))
            where["token_type_ids"] = kinds.to(device)
        if self.cross_encoder:
            return self._cross_scores(ids, mask, where), [None] * len(rows)
        if positions is not None and any(p is not None for p in positions):
            at = torch.arange(ids.shape[1]).repeat(len(rows), 1)
            for i, given in enumerate(positions):
                if given is not None:
                    at[i, : len(given.ids)] = torch.tensor(given.ids)
            where["position_ids"] = at.to(device)
        if overrides is not None and any(o is not None for o in overrides):
            embeds = self.backbone.get_input_embeddings()(ids)
            for i, over in enumerate(overrides):
                if over is not None:  # (right-padded: a prompt's positions are the row's)
                    at = torch.tensor(over.positions, dtype=torch.long, device=device)
                    embeds[i, at] = over.rows.to(device, embeds.dtype)
            out = self.backbone(inputs_embeds=embeds, attention_mask=mask, **where)
        else:
            out = self.backbone(input_ids=ids, attention_mask=mask, **where)
        read = torch.zeros_like(lengths) if self.encoder else lengths - 1  # [CLS], or the last
        last = out.last_hidden_state[torch.arange(len(rows), device=device), read.to(device)]
        if anchors is not None and any(a is not None for a in anchors):
            assert self.head is not None  # (setwise: classification heads only)
            results: list[Any] = []
            states: list[torch.Tensor] = []
            for i, where in enumerate(anchors):
                picked = last[i : i + 1] if where is None else out.last_hidden_state[i, list(where)]
                head = self.head(picked).float().cpu().tolist()
                results.append(head[0] if where is None else head)
                states.append(picked[0] if where is None else picked)
            return results, [s.float().cpu() for s in states]
        if self.head is not None:
            return self.head(last).float().cpu().tolist(), last.float().cpu()
        hidden = last.float().cpu()
        values = []
        for i, dims in enumerate(dimensions or [None] * len(rows)):
            values.append(F.normalize(hidden[i, :dims], p=2, dim=-1).tolist())
        return values, hidden

    def _cross_scores(
        self, ids: torch.Tensor, mask: torch.Tensor, where: dict[str, torch.Tensor]
    ) -> list[Any]:
        """A cross-encoder's scores (``CrossEncodingPooler``): its classification head's
        logits through ``activation``, squeezed (one label: a number a row)."""
        logits = self.loaded.model(input_ids=ids, attention_mask=mask, **where).logits
        if self.activation is not None:
            logits = self.activation(logits)
        return logits.float().squeeze(-1).cpu().tolist()


def load_pooling_model(
    path: str | Path,
    kind: Kind,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    load_format: str = "auto",
    remote: RemoteSeed | None = None,
    overrides: dict[str, Any] | None = None,
) -> PoolingModel:
    """Load ``path`` as a ``kind`` model onto ``device``, its weights as ``load_format`` says
    (SGLang's ``--load-format``, ``loader.LOAD_FORMATS``: ``remote_instance`` receives those of
    the running engine ``remote``, whose weight version ``loaded.weight_version`` then names);
    ValueError or OSError when it cannot be (a ``classify`` architecture without a ``score``
    head among them; ``RemoteLoadError`` when the seed's weights do not come)."""
    path = resolve_model(str(path), what="--model")
    how = {
        "device": device, "dtype": dtype, "load_format": load_format,
        "trust_remote_code": trust_remote_code, "remote": remote, "overrides": overrides,
    }  # fmt: skip
    architectures = set(getattr(_config(path, trust_remote_code), "architectures", None) or [])
    cross = bool(architectures & CROSS_ENCODERS)
    mlp_reward = None
    if REWARD_MODEL_NAMES & architectures:  # (its module imports transformers' Qwen models)
        from stages.engine.reward_models import reward_model_class

        mlp_reward = reward_model_class(architectures)
    if kind == "classify" and mlp_reward is not None:  # its own head: model.score
        model = instantiate(mlp_reward, path, **how)
        head, backbone = model.score, model.model
    elif kind == "classify":
        try:
            model = instantiate(hf.AutoModelForSequenceClassification, path, **how)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path} does not load as a classification model: {exc}") from None
        head = model.classifier if cross else getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(
                f"{type(model).__name__} has no `score` head: the built-in engine serves "
                "decoder classifiers (Llama, Qwen, Mistral, Gemma... *ForSequenceClassification) "
                "and the cross-encoders BertForSequenceClassification and "
                "XLMRobertaForSequenceClassification"
            )
        backbone = model.base_model
    elif _causal(path, trust_remote_code):  # loaded whole, as SGLang loads it: its head is
        model = instantiate(hf.AutoModelForCausalLM, path, **how)  # there, and unused
        head, backbone = None, model.base_model
    else:
        model = instantiate(hf.AutoModel, path, **how)
        head, backbone = None, model
    version = fill_weights(model, load_format, remote)
    config = model.config
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    labels = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    labels = labels or {i: f"LABEL_{i}" for i in range(num_labels)}
    if mlp_reward is not None:  # one output, whatever num_labels the config keeps
        labels = {0: labels.get(0, "LABEL_0")}
    dims = getattr(config, "matryoshka_dimensions", None)
    matryoshka = (
        frozenset(int(d) for d in dims)
        if dims
        else (None if getattr(config, "is_matryoshka", False) else frozenset())
    )
    activation = _activation(config) if cross else None
    context = config.max_position_embeddings
    if getattr(config, "model_type", "") in _OFFSET_POSITIONS and config.pad_token_id is not None:
        # (RoBERTa's positions count from past its padding index: a prompt of as many tokens
        # as the table has rows would index past it, where SGLang's pass fails)
        context -= config.pad_token_id
    embeddings = backbone.get_input_embeddings()
    loaded = LoadedModel(
        path=path,
        model=model,
        tokenizer=load_tokenizer(path, trust_remote_code=trust_remote_code),
        vocab_size=embeddings.num_embeddings,
        context_length=context,
        eos_token_ids=eos_ids(model, None),
        weight_version=version,
        load_format=load_format,
    )
    return PoolingModel(
        loaded=loaded,
        kind=kind,
        backbone=backbone,
        head=head,
        labels=labels,
        hidden_size=config.hidden_size,
        matryoshka=matryoshka,
        encoder=bool(architectures & ENCODERS),
        cross_encoder=cross,
        activation=activation,
        pad_id=int(getattr(config, "pad_token_id", None) or 0) if architectures & ENCODERS else 0,
    )


def _activation(config: Any) -> torch.nn.Module | None:
    """A cross-encoder's activation (``get_cross_encoder_activation_function``): the
    ``torch.nn.modules`` class its config names (``sbert_ce_default_activation_function``), or
    none (bge-reranker's logits); another module path is refused, as SGLang refuses it."""
    name = getattr(config, "sbert_ce_default_activation_function", None)
    if name is None:
        return None
    module, _, attr = str(name).rpartition(".")
    found = None
    if str(name).startswith(_ACTIVATIONS):
        import importlib

        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise ValueError(
            f"sbert_ce_default_activation_function {name!r}: loading of activation functions is "
            "restricted to torch.nn.modules (a torch.nn.modules class, such as "
            "torch.nn.modules.activation.Sigmoid)"
        )
    return found()


class PoolingFailed(RuntimeError):
    """The model's pass over a request's prompts raised (a server error, not a bad request)."""


def _causal(path: Path, trust_remote_code: bool) -> bool:
    """Whether the checkpoint at ``path`` is a causal LM (its head's weights in the files)."""
    config = _config(path, trust_remote_code)
    return any(a.endswith("ForCausalLM") for a in getattr(config, "architectures", None) or [])


@dataclass
class _Job:
    rows: list[list[int]]
    dimensions: list[int | None]
    hidden: bool  # the pooled hidden states wanted too
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    anchors: list[list[int] | None] | None = None  # PoolingModel.pool's, per row
    overrides: list[Any] | None = None
    positions: list[Any] | None = None
    types: list[Any] | None = None  # token type ids (a cross-encoder's pairs)


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except Exception as exc:
            self.future.set_exception(exc)


class Pooler:
    """The thread that runs ``model`` on queued prompts. ``encode`` from the event loop;
    ``start``/``stop`` around serving. Counters: ``requests``, ``sequences``, ``tokens``,
    ``passes`` (batched forwards) and ``failed`` (requests whose pass raised)."""

    def __init__(
        self, model: PoolingModel, *, max_rows: int = 64, max_batch_tokens: int = 16384
    ) -> None:
        self.model = model
        self.max_rows, self.max_batch_tokens = max_rows, max_batch_tokens
        self.weight_version = "default"
        self.requests = self.sequences = self.tokens = self.passes = self.failed = 0
        self.load = LoadMeter()  # /v1/loads' counters: each pass a prefill
        # rows and their tokens queued (the loop's counts) and taken into passes (the
        # thread's): what waits is the difference; those of the pass under way
        self._queued = [0, 0]
        self._taken = [0, 0]
        self._running = (0, 0)
        self._jobs: queue.SimpleQueue[_Job | _Call | None] = queue.SimpleQueue()
        # what /release_memory_occupation released; the prompts that came meanwhile, held
        self.memory = MemoryState()
        self._held: list[_Job] = []
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pooler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)

    def counts(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "sequences": self.sequences,
            "prompt_tokens": self.tokens,
            "passes": self.passes,
            "failed_requests": self.failed,
        }

    async def encode(
        self,
        rows: list[list[int]],
        dimensions: list[int | None] | None = None,
        *,
        hidden: bool = False,
        anchors: list[list[int] | None] | None = None,
        overrides: list[Any] | None = None,
        positions: list[Any] | None = None,
        types: list[Any] | None = None,
    ) -> tuple[list[Any], list[Any] | None]:
        """Each row's result (and, with ``hidden``, its pooled hidden state before the head,
        None for a cross-encoder's) once the thread has run it (``anchors``, ``overrides``,
        ``positions``, ``types``: ``PoolingModel.pool``'s, per row); ``PoolingFailed`` when
        the pass raised or the thread is not running."""
        if not self.alive:
            raise PoolingFailed("the pooling thread is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        dims = list(dimensions) if dimensions is not None else [None] * len(rows)
        self._queued = [self._queued[0] + len(rows), self._queued[1] + sum(map(len, rows))]
        self._jobs.put(_Job(rows, dims, hidden, loop, future, anchors, overrides, positions, types))
        return await future

    @property
    def max_running(self) -> int:
        return self.max_rows

    @property
    def device(self) -> torch.device:
        return next(self.model.loaded.model.parameters()).device

    def occupancy(self) -> dict[str, int]:
        """What the pooling thread holds now, as ``Scheduler.occupancy`` says it (for
        ``/v1/loads``): the rows of the pass under way and their tokens, and those queued."""
        queued, taken = self._queued, self._taken
        running, tokens = self._running
        return {
            "running": running,
            "waiting": max(queued[0] - taken[0], 0),
            "used_tokens": tokens,
            "waiting_tokens": max(queued[1] - taken[1], 0),
            "grammar": 0,
            "paused": 0,
            "retracted": 0,
            "adapters": 0,
            "adapters_in_use": 0,
            "kv_bytes": 0,
        }

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread, between two passes (what reads or writes the weights):
        its result, or what it raised."""
        return await asyncio.wrap_future(self.between_passes(fn))

    def between_passes(self, fn: Callable[[], T]) -> Future[T]:
        """``call`` from any thread: a future of ``fn()``'s result, run after the passes of
        the prompts queued before it (PoolingFailed when the thread is not running)."""
        future: Future[T] = Future()
        if not self.alive:
            future.set_exception(PoolingFailed("the pooling thread is not running"))
            return future
        self._jobs.put(_Call(fn, future))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Call):
                job.run()
                self._serve_held()
                continue
            if self.memory.holds_generation:  # released (a colocated trainer's turn): it waits
                self._held.append(job)
                continue
            jobs, after = [job], None
            while len(jobs) < self.max_rows:  # every job already waiting joins this pass
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)  # stop after this pass
                    break
                if isinstance(more, _Call):  # after the pass of the jobs before it
                    after = more
                    break
                jobs.append(more)
            self._serve(jobs)
            if after is not None:
                after.run()
                self._serve_held()

    def _serve_held(self) -> None:
        """The prompts that came while the memory was released, once it is back."""
        if not self._held or self.memory.holds_generation:
            return
        held, self._held = self._held, []
        for at in range(0, len(held), self.max_rows):
            self._serve(held[at : at + self.max_rows])

    @property
    def idle(self) -> bool:
        """Nothing runs or waits (on the thread, between two passes: nothing runs)."""
        return self._queued[0] == self._taken[0]

    def _serve(self, jobs: list[_Job]) -> None:
        rows, tokens = sum(len(j.rows) for j in jobs), sum(len(r) for j in jobs for r in j.rows)
        self._taken = [self._taken[0] + rows, self._taken[1] + tokens]
        self._running = (rows, tokens)
        began = time.perf_counter()
        try:
            values, hidden, failed = self._pass(jobs)
        finally:  # over before any answer goes out: a client answered sees it idle
            self._running = (0, 0)
            self.load.prefilled(time.perf_counter() - began, tokens, 0)
        self._answer(jobs, values, hidden, failed)

    def _pass(
        self, jobs: list[_Job]
    ) -> tuple[
        dict[tuple[int, int], list[float]],
        dict[tuple[int, int], list[float]],
        dict[int, Exception],
    ]:
        """Each row's result (and pooled hidden state where asked) by (job, row), and the
        jobs whose pass failed."""
        flat = [(j, i) for j, job in enumerate(jobs) for i in range(len(job.rows))]
        flat.sort(key=lambda ji: len(jobs[ji[0]].rows[ji[1]]))
        values: dict[tuple[int, int], list[float]] = {}
        hidden: dict[tuple[int, int], list[float]] = {}
        failed: dict[int, Exception] = {}
        for batch in self._batches(flat, jobs):
            rows = [jobs[j].rows[i] for j, i in batch]
            dims = [jobs[j].dimensions[i] for j, i in batch]
            anchors = _per_row(jobs, batch, "anchors")
            overrides = _per_row(jobs, batch, "overrides")
            positions = _per_row(jobs, batch, "positions")
            types = _per_row(jobs, batch, "types")
            try:
                results, states = self.model.pool(rows, dims, anchors, overrides, positions, types)
            except Exception as exc:  # a failed pass fails its requests, never the thread
                log.exception("pooling_pass_failed", rows=len(rows))
                error = PoolingFailed(f"the model's pass failed: {type(exc).__name__}: {exc}")
                failed.update({j: error for j, _ in batch})
                continue
            self.passes += 1
            for k, (j, i) in enumerate(batch):
                values[j, i] = results[k]
                if jobs[j].hidden:
                    hidden[j, i] = None if states[k] is None else states[k].tolist()
        return values, hidden, failed

    def _answer(
        self,
        jobs: list[_Job],
        values: dict[tuple[int, int], list[float]],
        hidden: dict[tuple[int, int], list[float]],
        failed: dict[int, Exception],
    ) -> None:
        for j, job in enumerate(jobs):
            self.requests += 1
            if j in failed:
                self.failed += 1
                job.loop.call_soon_threadsafe(_settle, job.future, None, failed[j])
                continue
            self.sequences += len(job.rows)
            self.tokens += sum(len(r) for r in job.rows)
            keys = [(j, i) for i in range(len(job.rows))]
            answer = (
                [values[k] for k in keys],
                [hidden[k] for k in keys] if job.hidden else None,
            )
            job.loop.call_soon_threadsafe(_settle, job.future, answer, None)

    def _batches(
        self, flat: list[tuple[int, int]], jobs: list[_Job]
    ) -> list[list[tuple[int, int]]]:
        """``flat`` (sorted by length) cut into passes of at most ``max_rows`` rows and
        ``max_batch_tokens`` padded tokens (a longer prompt alone in its pass)."""
        batches: list[list[tuple[int, int]]] = [[]]
        for j, i in flat:
            width = len(jobs[j].rows[i])  # the longest so far: the list is sorted
            current = batches[-1]
            fits = (len(current) + 1) * width <= self.max_batch_tokens
            if current and (len(current) >= self.max_rows or not fits):
                batches.append([])
            batches[-1].append((j, i))
        return [b for b in batches if b]


def _per_row(jobs: list[_Job], batch: list[tuple[int, int]], name: str) -> list[Any] | None:
    """A pass's rows' ``anchors``, ``overrides``, ``positions`` or ``types`` (None: no row has
    any)."""
    if all(getattr(jobs[j], name) is None for j, _ in batch):
        return None
    return [None if (v := getattr(jobs[j], name)) is None else v[i] for j, i in batch]


def _settle(future: asyncio.Future, answer: Any, error: Exception | None) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(answer)
