"""Continuous batching over one model, with weight updates between two decode steps.

One scheduler thread owns the model and its batched KV cache (``kv_batch.BatchKV``) and loops:
apply queued control commands (new requests, aborts, pause/continue, weight updates), admit
waiting requests up to ``max_running`` (prefilled together, left-padded, then copied into free
slots of the running batch), run one decode step over every running row, retire the rows that
finished. Callers on other threads talk to it only through the thread-safe methods below, which
return ``concurrent.futures.Future`` objects (``asyncio.wrap_future`` turns them into
awaitables); ``submit_many`` takes a whole group (a batch or ``n`` samples of a prompt) in one
command and resolves one future when all of it is done.

The step is built to cost little more than the model's forward: inputs, positions and the mask
are views of preallocated tensors; sampling, log-probs and finish tests are batched tensor
operations (``sampling.SlotSampler``); tokens and log-probs stay in per-row tensor tracks until a
row finishes; Python touches a row only when it joins or leaves. Identical prompts admitted
together (a group's samples) are prefilled once and their KV copied into every row.

Prefix reuse (``prefix_cache``, on unless ``prefix_cache_tokens`` is 0): a row that finishes
(stop, length or abort) leaves its prompt and output (all but the last sampled token, whose KV
was never computed) with their KV in a bounded radix tree; an admitted context prefills only
what follows its longest usable cached prefix, and reports it as ``cached_tokens``. The
admitted contexts of one step are prefilled in as few passes as keep padding under half of
each pass (sorted by the number of new tokens: a row with a long new part does not pad a batch
of short turns to its width); a pass on top of cached prefixes takes them as past keys and
values and its result is closed up into right-aligned rows (``BatchKV.admit(columns=...)``).
Retracted rows and rows of a failed step are not kept (a retraction means "recompute"). A
context longer than ``IN_BATCH_PREFIX`` tokens is held from its prefill on (SGLang's
``cache_unfinished_req``), and contexts admitted together that share their first
``IN_BATCH_PREFIX`` tokens, with no more of them cached, are prefilled in two waves: one first,
the rest on top of its KV (SGLang's in-batch prefix caching).
A prompt scored for its log-probs (``logprob_start_len``, prefill-only scoring) takes its
prefix up to its start from the live weights' KV alone and leaves its own KV as a prefix (not
a served sequence); prompts of one admission that share one are scored in two waves, one
first (``_score_prompts``).

In-flight weight updates: ``apply_weights`` queues named tensors; the scheduler copies them
into the model at the next step boundary. Running rows keep their KV cache (computed by the
old weights) and go on; every token records the weight version live when it was sampled
(kept as spans over the step clock: a version change is one entry, not one per token).
Cached prefixes follow the same rule (``prefix_cache`` says it in full): KV of older weights is
reused only by a request that continues a whole sequence served before (the next turn of an
episode, as if it had kept running), never older than ``prefix_cache_max_age`` versions, and
the response names the version it came from (``cached_weight_version``).

Pause modes follow SGLang: ``abort`` (the default there) aborts everything in flight,
``retract`` drops the running rows' KV cache and puts them back in the queue (recomputed on
continue), ``in_place`` just stops stepping and keeps the cache. Weight updates and aborts
still run while paused; a running request aborted (or whose client went away) while paused in
place ends, as SGLang's does, at its first pass after ``/continue_generation``, with that
pass's token. Not here: chunked prefill, preemption on memory pressure, speculative
decoding.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

import structlog
import torch

from pipeline.processes import name_thread
from stages.engine.aborts import (
    ABORTED_COMPILING,
    ABORTED_RUNNING,
    ABORTED_WAITING,
    PRIORITY_DISABLED,
    PRIORITY_EVICTED,
    QUEUE_FULL,
)
from stages.engine.batch_invariant import DEFAULT_SEED
from stages.engine.batch_invariant import holds as invariant_holds
from stages.engine.custom_logits import LogitProcessors, RequestView
from stages.engine.engine_metrics import EngineMetrics, scheduler_stats
from stages.engine.expert_distribution import ExpertDistributionRecorder
from stages.engine.grammar import Constraint, GrammarError, GrammarSet
from stages.engine.images import is_vision_model
from stages.engine.incremental_text import FORCE_INTERVAL
from stages.engine.kv_batch import (
    CACHELESS_LAYER_TYPES,
    STATE_LAYER_TYPES,
    BatchKV,
    pass_cache,
)
from stages.engine.llama_forward import LlamaForward
from stages.engine.lm_head import fp32_wanted, use_fp32
from stages.engine.load_meter import LoadMeter
from stages.engine.loop_turns import Turns
from stages.engine.lora_adapters import (
    Adapter,
    AdapterError,
    RowAdapters,
    build_adapter,
    load_adapter,
)
from stages.engine.memory_offload import KV_CACHE, WEIGHTS, MemoryState, WeightOffload
from stages.engine.model_weights import load_named_tensors, parameter_rows
from stages.engine.prefix_cache import Match, PrefixCache, Stamp
from stages.engine.priority import PREEMPTED, Priorities
from stages.engine.prompt_logprobs import next_token_logprobs, prompt_logprobs, scoring_passes
from stages.engine.protocol import (
    SAMPLING_MASK_MAX_TOKENS,
    GenerateInput,
    RequestError,
    SequenceResult,
    add_hidden,
    hidden_answer,
)
from stages.engine.radix_sessions import RadixSessions
from stages.engine.reasoning import reasoning_tokens
from stages.engine.routed_experts import ExpertsCapture, encode_routes
from stages.engine.sampling import SlotSampler, Support
from stages.engine.ssm_dtype import resolve as resolve_ssm_dtype
from stages.engine.step_profiler import ProfileRequest, StepProfiler
from stages.engine.strict_thinking import StrictThinking
from stages.hf import DynamicCache, cache_argument, output_cache
from transport.credit import sparse

__all__ = [
    "MAMBA_FULL_MEMORY_RATIO",
    "PAUSE_MODES",
    "PREFIX_CACHE_MAX_AGE",
    "PREFIX_CACHE_TOKENS",
    "Scheduler",
]

PAUSE_MODES = ("abort", "retract", "in_place")
# Defaults of the prefix cache's bound (tokens held; a token costs 2 x layers x kv_heads x
# head_dim x dtype bytes) and of the age of reusable KV (weight versions; see prefix_cache).
PREFIX_CACHE_TOKENS = 32768
PREFIX_CACHE_MAX_AGE = 2
# a linear-attention model's states in the prefix cache: at most this share of the bytes its KV
# may take (SGLang's --mamba-full-memory-ratio, whose default this is)
MAMBA_FULL_MEMORY_RATIO = 0.9
_STATE_OR_CACHELESS = STATE_LAYER_TYPES | CACHELESS_LAYER_TYPES

T = TypeVar("T")

# SGLang's abort of a sample whose drawn token is outside its captured support
_OUTSIDE_SUPPORT = {
    "type": "abort",
    "message": "The sampling backend selected a token outside its captured sampling support.",
    "status_code": 500,
    "err_type": "InternalServerError",
}

log = structlog.get_logger("stages.engine.scheduler")


_CALL = object()  # an _Outbox item that is a call, not a result


# A scored prompt is the same request whatever seqs ask for it: (ids, logprob_start,
# top_logprobs_num, adapter, token_ids_logprob, the distribution after it, cache namespace).
# (prompt ids, logprob start, top k, adapter, token_ids_logprob, next wanted, namespace, the id
# of its input_embeds or embedding overrides, or None: _embedded)
_ScoreKey = tuple[
    tuple[int, ...], int, int, "str | None", "tuple[int, ...] | None", bool, Any, "int | None"
]
# SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and _DEPRIORITIZE_THRESHOLD (32 both,
# ``schedule_policy.py``): a prompt with at most this many tokens cached that shares this
# many with one admitted before it waits for that one's KV
IN_BATCH_PREFIX = 32


def _reuse_limit(tokens: Sequence[int], start: int) -> int:
    """How much of a scored prompt the prefix cache may give (SGLang's
    ``Req._compute_max_prefix_len``): all but the last token, and nothing from its log-probs'
    start on."""
    limit = len(tokens) - 1
    return max(0, limit if start < 0 else min(limit, start))


def _in_batch_waves(
    items: list[T],
    opening: Callable[[T], Any],
    lookup: Callable[[T, bool], Match | None],
) -> tuple[list[tuple[T, Any]], list[T]]:
    """SGLang's in-batch prefix caching (``schedule_policy._compute_prefix_matches``) over one
    admission's prompts: ``(first, later)``, the first wave with each one's match, and the
    prompts that wait for it. A prompt waits when its ``opening`` (its first
    ``IN_BATCH_PREFIX`` tokens and namespace; None: too short to share) is an earlier
    first-wave prompt's and no more than ``IN_BATCH_PREFIX`` of it is cached (``lookup(item,
    record)``; None: it takes nothing from the cache). Waiting prompts are looked up again
    after the first wave left its KV."""
    first: list[tuple[T, Any]] = []
    later: list[T] = []
    openings: set[Any] = set()
    for item in items:
        key = opening(item)
        if key is not None and key in openings:
            look = lookup(item, False)
            if look is not None and look.length <= IN_BATCH_PREFIX:
                later.append(item)
                continue
        match = lookup(item, True)
        if key is not None and match is not None and match.length <= IN_BATCH_PREFIX:
            openings.add(key)
        first.append((item, match))
    return first, later


def _routed_answer(seq: Any, outputs: int) -> str:
    """``meta_info.routed_experts`` of a finished ``seq`` with ``outputs`` output tokens: the
    rows of every token the model ran (its prompt's and its output's but the last), from
    its ``routed_experts_start_len`` on, as SGLang's ``get_topk`` slices them."""
    seqlen = len(seq.inp.input_ids) + outputs
    start = min(seq.inp.routed_experts, max(0, seqlen - 1))
    rows = torch.cat(seq.routes)
    return encode_routes(rows[start : max(start, seqlen - 1)])


def _prefix_routes(match: Match) -> list[torch.Tensor]:
    """The routed experts of a matched prefix, ``[length, layers, k]`` (none: no prefix):
    the last part of each node's pieces (``ExpertsCapture.piece``), as the prefix cache keeps
    them beside the KV with ``--enable-return-routed-experts``."""
    if not match.length:
        return []
    return [torch.cat([piece[-1] for piece in match.pieces], -2)[0].permute(1, 0, 2)]


def _embedded(seq: Any) -> int | None:
    """The id of the embeddings ``seq``'s prompt runs with (its ``input_embeds``, or the
    embedding overrides of ``/v1/score``) or of its own position ids (``/v1/score`` under
    ``--enable-mis``), None for a prompt of plain ids at 0, 1, 2... (or with images, whose
    pads the cache keys by their content: ``_keyed``): two such prompts are the same prompt
    only when they are the same request's."""
    inp = seq.inp
    if inp.input_embeds is not None:
        return id(inp.input_embeds)
    if inp.embed_overrides is not None:
        return id(inp.embed_overrides)
    return None if inp.position_ids is None else id(inp.position_ids)


def _images_at(image: Any, cached: int) -> torch.Tensor | None:
    """Which of ``image``'s pads (a mask over ``ImagePrompt.positions``) a pass after a cached
    prefix of ``cached`` tokens computes; None: none."""
    if cached <= 0:
        return torch.ones(image.positions.numel(), dtype=torch.bool)
    keep = image.positions >= cached
    return keep if bool(keep.any()) else None


def _unready_images(seqs: list[Any]) -> list[Any]:
    """The images of ``seqs`` whose pixels are still being made (each once)."""
    found: dict[int, Any] = {}
    for seq in seqs:
        image = seq.inp.images
        if image is not None and not image.pixels.done():
            found[id(image)] = image
    return list(found.values())


def _same_as(seq: Any) -> Any:
    """What two requests with the same ids must also share to be the same prompt (computed
    once): their prefix-cache namespace (``cache_namespace``) and their images' content
    (``images.ImagePrompt.key``)."""
    image = seq.inp.images
    return seq.inp.cache_namespace if image is None else (seq.inp.cache_namespace, image.key)


def _keyed(seq: Any, tokens: list[int]) -> list[int]:
    """``tokens`` (``seq``'s prompt and any after it) as the prefix cache keys them: a prompt
    with images has its pads keyed by their image's content (``images.ImagePrompt.keyed``)."""
    image = seq.inp.images
    return tokens if image is None else image.keyed(tokens)


def _own_kv(seq: Any) -> bool:
    """Whether ``seq``'s KV is its own, neither taken from the prefix cache nor left in it: an
    adapter's row (no base prefix is a prefix of it), or a prompt with embeddings, whose ids do
    not determine its KV (SGLang's ``skip_radix_cache_insert`` and empty match)."""
    return seq.adapter is not None or _embedded(seq) is not None


def _next_wanted(seq: Any) -> bool:
    """A prefill-only request (``max_new_tokens: 0``) that asks for the log-probs of the
    token after its prompt: its top ones or those of ``token_ids_logprob`` (SGLang 0.5.23's
    ``compute_logprobs_only``)."""
    inp = seq.inp
    return (
        inp.params.max_new_tokens == 0
        and inp.return_logprob
        and (inp.top_logprobs_num > 0 or inp.token_ids_logprob is not None)
    )


def _priority_key(seq: _Seq) -> tuple[int, float]:
    """What priority scheduling orders a seq by: its priority, then when it began to wait."""
    assert seq.priority is not None
    return seq.priority, seq.queued


def _told(seq: _Seq) -> int:
    """How many of a queued seq's tokens (a retracted one's so far) SGLang's tokenizer had
    been sent, which is what it answers an abort in the waiting queue with
    (``TokenizerManager._handle_abort_req``: its ``state.output_ids``): a stream's, those its
    chunks carried; another's, those up to the last multiple of 50 it reached, as SGLang's
    scheduler hands a request not streamed over every ``DEFAULT_FORCE_STREAM_INTERVAL`` tokens
    (``OutputStreamer.accept``)."""
    if seq.group.stream is not None:
        return seq.sent
    return len(seq.done_ids) // FORCE_INTERVAL * FORCE_INTERVAL


def _hidden_news(seq: _Seq) -> list[Any]:
    """A streamed seq's hidden states since its last event ("last": the newest alone)."""
    hidden = seq.hidden or []
    if seq.inp.hidden_states == "last":
        return hidden[-1:]
    news = hidden[seq.hidden_sent :]
    seq.hidden_sent = len(hidden)
    return news


def _hidden_block(states: torch.Tensor, new: int, mode: str) -> list[Any]:
    """A prefill's hidden states for a sample (``states``: its row, left-padded, of which the
    last ``new`` positions were computed): all of those ("full"), the last ("last": a vector)
    or a block of the last alone ("tail")."""
    if mode == "full":
        return states[states.shape[0] - new :].float().tolist()
    return (states[-1] if mode == "last" else states[-1:]).float().tolist()


class _Outbox:
    """Results bound for one asyncio loop, handed over with one wake-up per batch of them.

    ``concurrent.futures`` + ``asyncio.wrap_future`` cost a lock, a chain of callbacks and a
    ``call_soon_threadsafe`` per future; here a step that finishes several requests wakes the
    loop once, and the loop resolves their futures in its own thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        # the events of each call of this pass waiting in ``items``, by the function they go to
        self.calls: dict[Callable[[list[Any]], None], list[Any]] = {}
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
        with self.lock:
            self.items.append((future, value, exc))
            if self.scheduled:
                return
            self.scheduled = True
        self._schedule()

    def call(self, fn: Callable[[list[Any]], None], events: list[Any]) -> None:
        """Call ``fn(events)`` on the loop, after the results put before. Events for ``fn``
        after the same model pass (``end_pass``) join its call while it waits, in order: the
        samples of a streamed request that finish in one step and the tokens of those that go
        on reach it in one call, and go out in one write (``events``: the caller's list,
        extended there)."""
        with self.lock:
            waiting = self.calls.get(fn)
            if waiting is not None:
                waiting += events
                return
            self.calls[fn] = events
            self.items.append((fn, events, _CALL))
            if self.scheduled:
                return
            self.scheduled = True
        self._schedule()

    def end_pass(self) -> None:
        """A model pass's hand-overs are all made: later calls start calls of their own."""
        with self.lock:
            self.calls = {}

    def _schedule(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _flush(self) -> None:
        with self.lock:
            items, self.items = self.items, []
            self.calls = {}
            self.scheduled = False
        for future, value, exc in items:
            if exc is _CALL:
                future(value)
                continue
            if future.done():  # cancelled: the client went away
                continue
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)


class _Group:
    """Requests submitted together; one future resolves with all their results, in order."""

    __slots__ = ("future", "outbox", "remaining", "results", "single", "stream")

    def __init__(
        self,
        size: int,
        single: bool,
        outbox: _Outbox | None = None,
        stream: Callable[[list[tuple[int, Any]]], None] | None = None,
    ) -> None:
        self.outbox = outbox
        # streamed (with an outbox): called on its loop with [(index, token event or result or
        # exception), ...] as the samples progress, before the future resolves
        self.stream = stream if outbox is not None else None
        self.future: Any = Future() if outbox is None else outbox.loop.create_future()
        self.results: list[SequenceResult | None] = [None] * size
        self.remaining = size
        self.single = single

    def done(self, index: int, result: SequenceResult) -> None:
        if self.stream is not None:
            assert self.outbox is not None
            self.outbox.call(self.stream, [(index, result)])
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0:
            self._resolve(self.results[0] if self.single else self.results, None)

    def fail(self, exc: BaseException) -> None:
        if self.remaining > 0:
            if self.stream is not None:
                assert self.outbox is not None
                self.outbox.call(self.stream, [(-1, exc)])
            self.remaining = 0
            self._resolve(None, exc)

    def _resolve(self, value: Any, exc: BaseException | None) -> None:
        if self.outbox is not None:
            self.outbox.put(self.future, value, exc)
            return
        try:
            if exc is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(value)
        except InvalidStateError:  # cancelled by the caller meanwhile: nobody waits
            pass


class _Seq:
    """One sequence: its request, where its result goes, and where it lives in the batch."""

    __slots__ = (
        "adapter",
        "admitted",
        "budget",
        "cached",
        "cached_version",
        "constraint",
        "custom",
        "done_ids",
        "done_logprobs",
        "done_versions",
        "first",
        "first_token",
        "generator",
        "group",
        "held",
        "hidden",
        "hidden_sent",
        "index",
        "inp",
        "input_lps",
        "input_picked",
        "input_tops",
        "kv_start",
        "masks",
        "picked",
        "priority",
        "queue_time",
        "queued",
        "retractions",
        "routes",
        "sent",
        "session",
        "slot",
        "stamp",
        "started",
        "tail",
        "tail_text",
        "thinking",
        "thought",
        "top",
    )

    def __init__(self, inp: GenerateInput, group: _Group, index: int, started: float) -> None:
        self.inp = inp
        # (its session, the session's generation when it was queued) where the server holds
        # sessions' KV (--enable-session-radix-cache); None: it holds none for a session
        self.session: tuple[str, int] | None = None
        self.adapter: Adapter | None = None  # its LoRA adapter, set when queued (inp.lora)
        self.constraint: Constraint | None = None  # its grammar's state, set when submitted
        # while its grammar waits for the end of its reasoning, or strict thinking filters
        # it: how many of the end's tokens its last tokens match (None: not thinking)
        self.thinking: int | None = None
        # under strict thinking: its budget (-1: none; None: not filtered), and how many
        # tokens it has thought
        self.budget: int | None = None
        self.thought = 0
        # its last sampled tokens, decoded after each step to look for its stop strings and
        # patterns, and their text after the last step
        watch = inp.params.stop or inp.params.stop_regex
        self.tail: list[int] | None = [] if watch else None
        self.tail_text = ""
        # its top log-probs, one list per sampled token, when it asked for them
        self.top: list[list[tuple[float, int]]] | None = [] if inp.top_logprobs_num else None
        # the log-probs of its token_ids_logprob tokens, one list per sampled token
        wanted = inp.token_ids_logprob
        self.picked: list[list[tuple[float, int]]] | None = None if wanted is None else []
        # its sampling support after each sampled token (return_sampling_mask: SlotSampler's)
        self.masks: list[Support] | None = [] if inp.sampling_mask is not None else None
        # its final hidden states (return_hidden_states): each prefill's block (every position
        # it computed, or "last": its last) and one a decode step ("last": the newest only),
        # and how many of them a stream has sent
        self.hidden: list[Any] | None = [] if inp.hidden_states else None
        self.hidden_sent = 0
        # the experts its tokens were routed to, [tokens, layers, k] blocks: its context's at
        # its last prefill (a cached prefix's, then the pass's), then a row a decode step
        # (routed_experts.ExpertsCapture). [] until then when it asks (return_routed_experts);
        # with the server's flag every prefill gives every row its own, for the prefix cache
        self.routes: list[torch.Tensor] | None = None if inp.routed_experts is None else []
        # with a custom logit processor: its custom_params as the processor gets them (with
        # "__req__", the view of this seq, where they are a dictionary), set when it is queued
        self.custom: tuple[Any, RequestView | None] | None = None
        self.group = group
        self.index = index  # in the group
        # streamed: how many of its tokens were sent, and the events of those not sent yet
        # (a chunk every stream_interval tokens, not while its text could end in a stop string)
        self.sent = 0
        self.held: list[tuple[Any, ...]] = []
        seed = inp.params.sampling_seed
        # its own generator when sampling_seed is set
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.started = started
        # when its first prefill began and ended (perf_counter; 0: not yet), when it last began
        # to wait and how long it waited in all, and how many times a pause retracted it
        # (SGLang's num_retractions)
        self.admitted = self.first_token = 0.0
        self.queued, self.queue_time = started, 0.0
        self.retractions = 0
        # its priority as the scheduler holds it (Priorities.value), set when it is queued
        self.priority: int | None = None
        # Outputs of earlier stints (before a retraction), already materialized.
        self.done_ids: list[int] = []
        self.done_logprobs: list[float] = []
        self.done_versions: list[str] = []
        self.slot = -1  # row in the running batch, -1 while waiting
        self.first = 0  # logical column of this stint's first output token
        self.kv_start = 0  # logical column of this stint's first context token
        self.cached = 0  # prompt tokens taken from the prefix cache (last admission)
        self.cached_version: str | None = None  # the version that computed them
        self.stamp: Stamp | None = None  # the oldest weights in this row's KV
        # its prompt's log-probs (logprob_start_len), once computed (kept over a retraction)
        self.input_lps: list[tuple[float | None, int]] | None = None
        self.input_tops: list[list[tuple[float, int]] | None] | None = None
        self.input_picked: list[list[tuple[float, int]] | None] | None = None

    @property
    def context(self) -> list[int]:
        """What a prefill must process: the prompt and every token generated so far."""
        return self.inp.input_ids + self.done_ids if self.done_ids else self.inp.input_ids


class Scheduler:
    """Owns the model; every public method is safe to call from any thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_running: int = 64,
        seed: int = 0,
        weight_version: str = "0",
        eos_token_ids: Iterable[int] = (),
        admit_fraction: float = 0.25,
        fast_forward: bool = True,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        prefix_cache_max_age: int = PREFIX_CACHE_MAX_AGE,
        decode_tail: Callable[[list[int]], str] | None = None,
        stream_interval: int = 1,
        grammars: GrammarSet | None = None,
        sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS,
        hidden_states_mode: str | None = None,
        strict_thinking: StrictThinking | None = None,
        custom_logit_processors: bool = False,
        routed_experts: bool = False,
        expert_distribution: ExpertDistributionRecorder | None = None,
        turns: Turns | None = None,
        session_radix_cache: bool = False,
        mamba_cache_size: int | None = None,
        mamba_memory_ratio: float | None = None,
        mamba_ssm_dtype: str | None = None,
        fp32_lm_head: bool = False,
        deterministic: bool = False,
        auto_truncate: bool = False,
        preferred_sampling_params: Mapping[str, Any] | None = None,
        lora: bool = True,
        max_queued: int | None = None,
        priorities: Priorities | None = None,
    ) -> None:
        # the turns its thread's steps take with the server's event loop (``loop_turns``):
        # None, a step runs whenever it is due
        self.turns = turns
        # share of max_running that must be free before waiting requests join a running batch
        self.admit_fraction = admit_fraction
        # SGLang's --max-queued-requests: a new sample that would make the queue longer is
        # refused (QUEUE_FULL); None: no limit
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.queue_full = 0  # how many new samples the full queue refused
        # SGLang's priority scheduling (stages.engine.priority); and how many rows it preempted
        # and how many requests it refused or dropped
        self.priorities = priorities if priorities is not None else Priorities()
        self.preempted = self.priority_aborted = 0
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.model = model.eval()
        # the sliding window of a model with sliding-window layers (gpt-oss, Gemma, Mistral's
        # first models): on transformers' passes their decode mask keeps its last columns
        # only; None: none; and whether every layer slides (the model then takes one mask, not
        # one a layer type)
        self._window, self._all_slide = _sliding_window(model)
        # the layer types of a model with linear-attention layers (a state a row, not a KV a
        # token: Qwen3.5's, Qwen3-Next's, LFM2's), for the caches of its passes; None: none
        self._state_types = _state_layer_types(model)
        # the name the model's forward takes its cache by (transformers renamed it)
        self._cache_arg = cache_argument(model.forward) or "past_key_values"
        self.device = next(model.parameters()).device
        # SGLang's --max-mamba-cache-size: the most linear-attention states, of the rows
        # running and in the prefix cache together, which caps the rows (None: the cache's
        # are bounded by bytes, --mamba-full-memory-ratio); a model without such layers
        # ignores both flags, as SGLang's does
        self._mamba_cache_size = mamba_cache_size if self._state_types is not None else None
        self.mamba_cache_size = mamba_cache_size  # (as given, for /server_info)
        self.mamba_memory_ratio = (
            MAMBA_FULL_MEMORY_RATIO if mamba_memory_ratio is None else mamba_memory_ratio
        )
        if self._state_types is None and (mamba_cache_size, mamba_memory_ratio) != (None, None):
            log.info("mamba_flags_unused", why="the model has no linear-attention layers")
        if self._mamba_cache_size is not None:
            max_running = _capped_by_states(max_running, self._mamba_cache_size)
        if self._state_types is not None and not self.mamba_memory_ratio > 0:
            raise ValueError(
                f"--mamba-full-memory-ratio {mamba_memory_ratio}: the linear-attention states "
                "would have no memory; give a ratio > 0"
            )
        # SGLang's --mamba-ssm-dtype (as given, for /server_info), and the dtype the
        # linear-attention layers' recurrent states are kept in between passes
        self.mamba_ssm_dtype = mamba_ssm_dtype
        state_dtype = None
        if self._state_types is not None:
            state_dtype, source = resolve_ssm_dtype(mamba_ssm_dtype, model.config, log)
            dtype = str(state_dtype).removeprefix("torch.")
            log.info("mamba_ssm_dtype", dtype=dtype, source=source)
        self.max_running = max_running
        # a streamed request's tokens go out in a chunk every this many (SGLang's
        # --stream-interval), unless its sampling_params.stream_interval says otherwise
        self.stream_interval = stream_interval
        # the largest sampling support a request's return_sampling_mask may ask for (SGLang's
        # --sampling-mask-max-tokens: its top_k must be 1 or at most this)
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        # how requests are read (stages.engine.context_fit, preferred_params): SGLang's
        # --allow-auto-truncate and --preferred-sampling-params
        self.auto_truncate = auto_truncate
        self.preferred_sampling_params = preferred_sampling_params
        # SGLang's --enable-lora: whether the routes load adapters and requests name them
        # (the engine's command line resolves it; a scheduler built directly serves them)
        self.lora = lora
        # the most return_hidden_states may ask for (SGLang's --return-hidden-states-mode:
        # "last", "full"; None: no hidden states)
        if hidden_states_mode not in (None, "last", "full"):
            raise ValueError(f"hidden_states_mode: 'last', 'full' or None: {hidden_states_mode!r}")
        self.hidden_states_mode = hidden_states_mode
        self.eos_token_ids = frozenset(eos_token_ids)
        self._version = str(weight_version)
        self._rng = torch.Generator().manual_seed(seed)
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()
        # Owned by the scheduler thread (or by the caller of step() when no thread runs).
        self._waiting: collections.deque[_Seq] = collections.deque()
        # what came while generation was paused, queued at /continue_generation: as SGLang's
        # tokenizer holds a request before its scheduler during a pause, out of the reach of
        # /abort_request and abort_all (a request abandoned here, by a client gone or the
        # in-process generator, is dropped all the same)
        self._held: list[_Seq] = []
        self._running: list[_Seq] = []  # index = slot
        # aborted while an in_place pause held them: each ends at the next pass that runs it,
        # with that pass's token (SGLang's Req.to_finish, kept through a retraction too)
        self._to_finish: set[_Seq] = set()
        self._admitting: list[_Seq] = []  # taken from _waiting by the admission under way
        # of the admission under way, each scored seq's (cached tokens, their version)
        self._scored: dict[_Seq, tuple[int, str | None]] = {}
        self._kv = BatchKV(
            max_running, _mask_kind(model), device=self.device, state_dtype=state_dtype
        )
        # SGLang's --enable-fp32-lm-head (or the config's enable_lm_head_fp32): logits in
        # float32, on either path (stages.engine.lm_head)
        self.fp32_lm_head = fp32_wanted(fp32_lm_head, model.config)
        head = model.get_output_embeddings()
        if self.fp32_lm_head and isinstance(head, torch.nn.Linear):
            use_fp32(head)
        # forward passes without transformers' module machinery where the model allows it
        self._fast, why = LlamaForward.build(model) if fast_forward else (None, "turned off")
        # a vision-language model (images.is_vision_model): its multimodal rotary positions
        self._vision = is_vision_model(getattr(model, "config", None))
        # --enable-return-routed-experts: the experts each pass routed its tokens to, kept for
        # the rows that ask (hooks on the experts modules, which either path calls)
        self._experts = ExpertsCapture(model) if routed_experts else None
        # --expert-distribution-recorder-mode: what the passes route to each expert, counted
        # while /start_expert_distribution_record has it record (None: no flag): hooks on the
        # experts modules, and on the model's forward, or around the engine's own passes
        # (_recorded), for where a pass begins and ends
        self.expert_distribution = expert_distribution
        self.forward_path = "fast" if self._fast is not None else "transformers"
        self.forward_path_why = why
        self.routed_experts = self._experts is not None  # (read by the routes' checks)
        self._sampler = SlotSampler(max_running, self.eos_token_ids, self._rng)
        self._paused = False
        # what /release_memory_occupation gave back, and the weights it copied out
        self._memory = MemoryState()
        self._offload: WeightOffload | None = None
        self._rids: dict[str, _Seq] = {}
        # token ids -> text, to look for stop strings; the running seqs that have some
        self._decode_tail = decode_tail
        self._stop_seqs: set[_Seq] = set()
        # running seqs that want top log-probs or those of given tokens (token_ids_logprob)
        self._top_seqs: set[_Seq] = set()
        self._mask_seqs: set[_Seq] = set()  # running seqs that want their sampling support
        self._hidden_seqs: set[_Seq] = set()  # running seqs that want their hidden states
        self._route_seqs: set[_Seq] = set()  # running seqs that want their routed experts
        self._stream_seqs: set[_Seq] = set()  # running seqs whose tokens are streamed
        # json_schema, regex, ebnf, structural_tag (stages.engine.grammar); the seqs that
        # follow one
        self._grammars = grammars
        self._constrained: set[_Seq] = set()
        # --enable-strict-thinking (stages.engine.strict_thinking): a thinking seq's excluded
        # tags and budget; its seqs are among _constrained while they think
        self.strict_thinking = strict_thinking
        # --enable-custom-logit-processor (stages.engine.custom_logits): the processors'
        # instances, and the running seqs that have one
        self.logit_processors = LogitProcessors() if custom_logit_processors else None
        self._custom_seqs: set[_Seq] = set()
        # groups held while the grammar worker compiles their grammars (under _lock), and
        # their seqs an abort named meanwhile (scheduler thread)
        self._compiling: dict[_Group, list[_Seq]] = {}
        self._cut: set[_Seq] = set()
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        # Weight versions as spans over the step clock (BatchKV.end): version _vvals[i] is live
        # from clock _vkeys[i] on.
        self._vkeys: list[int] = [-1]
        self._vvals: list[str] = [self._version]
        # Which weights computed a KV (prefix_cache.Stamp): the number of version changes.
        self._version_index = 0
        # LoRA adapters by name (lora_adapters), and their names for other threads to read
        self._adapters: dict[str, Adapter] = {}
        self._adapter_names: frozenset[str] = frozenset()
        self._lora_seen = False  # an adapter was ever loaded: passes look for adapted rows
        if self._window is not None and self._fast is None and prefix_cache_tokens > 0:
            # a prefill on a cached prefix leaves padding between it and the new tokens, which
            # transformers' sliding masks (a row's last columns) would count in the window:
            # such models prefill whole prompts there (the engine's passes count positions)
            log.info("prefix_cache_off", reason="sliding-window layers", window=self._window)
            prefix_cache_tokens = 0
        # a linear-attention layer's state sums up its whole row, so a prefix can be reused
        # only where its states were kept: at the end of a context or a finished sequence (as
        # SGLang's Mamba radix cache keeps them), as many states as rows run
        kind = model.config.get_text_config(decoder=True).model_type
        if self._state_types is not None and kind not in _CONTINUES_STATES:
            if prefix_cache_tokens > 0:
                log.info("prefix_cache_off", reason="its layers cannot go on from a kept state")
            prefix_cache_tokens = 0
        # SGLang's --enable-deterministic-inference: a request's floats are what they are
        # alone, whatever runs beside it (stages.engine.batch_invariant)
        self.deterministic = deterministic
        if deterministic:
            if self._fast is None:
                raise ValueError(
                    "--enable-deterministic-inference: the engine's batch-invariant passes are "
                    f"its own, and this model runs on transformers' ({self.forward_path_why})"
                )
            try:
                self._fast.batch_invariant()
            except ValueError as exc:
                raise ValueError(f"--enable-deterministic-inference: {exc}") from None
            log.info("batch_invariant", rows=self._fast.invariant_rows)
            if prefix_cache_tokens > 0:  # (SGLang's words, for its backends without one)
                log.warning(
                    "prefix_cache_off",
                    reason="Currently radix cache is not compatible with the built-in engine's "
                    "attention for deterministic inference.",
                )
            prefix_cache_tokens = 0
        self._prefix = (
            PrefixCache(
                prefix_cache_tokens,
                prefix_cache_max_age,
                **_state_bounds(
                    self._state_types, self._mamba_cache_size, mamba_memory_ratio, max_running
                ),
            )
            if prefix_cache_tokens > 0
            else None
        )
        # SGLang's --enable-session-radix-cache: a session's finished sequences are held in the
        # prefix cache until it closes (radix_sessions; None: session ids change nothing)
        if session_radix_cache and self._prefix is None:  # SGLang's disabled radix cache
            log.warning(  # takes the flag too, and holds nothing
                "session_radix_cache_idle",
                why="the prefix cache is off (--disable-radix-cache, --prefix-cache-tokens 0, "
                "or sliding-window layers): sessions hold no KV",
            )
        self._radix_sessions = RadixSessions() if session_radix_cache else None
        self.steps = 0
        self._profiler = StepProfiler(self.device)  # /start_profile's (step_profiler)
        self._forward_sleep: float | None = None  # /slow_down's seconds before each step
        self.tokens_generated = 0
        self.prefill_tokens = 0  # context tokens run through prefill passes (not from cache)
        self.load = LoadMeter()  # /v1/loads' counters (load_meter)
        # --enable-metrics: each finished request recorded there (engine_metrics), set by the
        # server before it starts
        self.metrics: EngineMetrics | None = None
        # the server's request log (stages.engine.request_log), read by the routes that serve
        # generating requests; called on the scheduler thread when a step fails (with the
        # error), before what was in flight is failed
        self.request_log: Any = None
        self.on_step_failed: Callable[[BaseException], None] | None = None

    # ---- thread-safe API -------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def counts(self) -> dict[str, int]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

    def held(self) -> int:
        """How many requests a pause holds (SGLang's tokenizer holds those, out of its
        scheduler's counts)."""
        return len(self._held)

    def occupancy(self) -> dict[str, int]:
        """What the scheduler holds now, read from any thread without waiting for a step
        (each figure is as of one step; together they may straddle two): requests running
        and waiting, the tokens the running ones hold in the KV cache and those the waiting
        ones bring, requests waiting for their grammar, held by an in-place pause, or
        retracted by a pause and waiting to resume, LoRA adapters loaded and used by running
        rows, and the bytes the batch's KV storage takes."""
        # (a seq whose answer went out has slot -1 before its row is taken out)
        running = [s for s in list(self._running) if s.slot >= 0]
        waiting, end = list(self._waiting), self._kv.end
        with self._lock:
            grammar = sum(len(seqs) for seqs in self._compiling.values())
        return {
            "running": len(running),
            "waiting": len(waiting),
            # (a row re-admitted between the reads could count below 0 alone)
            "used_tokens": max(sum(end - s.kv_start for s in running), 0),
            "waiting_tokens": sum(len(s.inp.input_ids) + len(s.done_ids) for s in waiting),
            "grammar": grammar,
            "paused": len(running) if self._paused else 0,
            "retracted": sum(1 for s in waiting if s.done_ids),
            "adapters": len(self._adapter_names),
            "adapters_in_use": len({s.adapter for s in running if s.adapter is not None}),
            "kv_bytes": self._kv.nbytes(),
        }

    @property
    def prefix_cache_on(self) -> bool:
        """Whether prefixes are cached (SGLang's radix cache: off with --disable-radix-cache)."""
        return self._prefix is not None

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters (``enabled`` false: there is none) and the prefill
        tokens computed; ``token_hit_rate``: the share of admitted context tokens that came
        from the cache."""
        stats: dict[str, Any] = {"enabled": self._prefix is not None}
        if self._prefix is not None:
            stats.update(self._prefix.stats())
        hit = stats.get("hit_tokens", 0)
        total = hit + self.prefill_tokens
        stats["prefill_tokens"] = self.prefill_tokens
        stats["token_hit_rate"] = round(hit / total, 4) if total else 0.0
        return stats

    def submit(self, inp: GenerateInput) -> Future[SequenceResult]:
        """Queue one sequence; the future resolves when it finishes or is aborted."""
        return self._submit([inp], single=True)

    def submit_many(self, inputs: Sequence[GenerateInput]) -> Future[list[SequenceResult]]:
        """Queue sequences together (one command); resolves with all results, in order.

        If any request id is already in flight, none is queued (the future fails with
        ``ValueError``). Each sequence stays abortable by its own ``rid`` (and by its
        ``group_rid``); an aborted one resolves with finish reason ``abort``.
        """
        return self._submit(list(inputs), single=False)

    def submit_async(
        self,
        inputs: Sequence[GenerateInput],
        stream: Callable[[list[tuple[int, Any]]], None] | None = None,
    ) -> asyncio.Future[Any]:
        """``submit_many`` for a caller on an asyncio loop: returns a future of that loop
        (call it from the loop's thread); results are handed over in batches.

        ``stream`` (called on the loop, in order): after every step that sampled tokens of
        these sequences whose chunk is due (every token, or every ``stream_interval``: see
        ``_streamed``), ``[(index in inputs, (token, logprob, version, top log-probs or
        None, cached prompt tokens, the prompt's log-probs and top log-probs or None, the
        token_ids_logprob log-probs of this step and of the prompt or None, its sampling
        support or None, how many times a pause retracted it, its time stats with
        --enable-metrics or None, its hidden states added since its last event or None)),
        ...]``, a sequence's tokens since its last chunk in order; as each finishes,
        ``[(index, SequenceResult)]``; if they fail, ``[(-1, exception)]``. The future
        resolves after the last of them. A grammar not compiled yet is compiled on the grammar
        worker first (``_queue``): one that does not compile fails the future (RequestError
        naming the field) rather than raising here.
        """
        return self._submit(list(inputs), single=False, outbox=self._outbox(), stream=stream)

    def submit_groups_async(
        self, groups: Sequence[Sequence[GenerateInput]]
    ) -> list[asyncio.Future[Any]]:
        """``submit_async`` for each of ``groups`` (no ``stream``), handed to the scheduler
        thread at once: a future each, resolving with that group's results in order."""
        outbox = self._outbox()
        now = time.perf_counter()
        futures, seqs = [], []
        for inputs in groups:
            group = _Group(len(inputs), False, outbox)
            seqs.append([_Seq(inp, group, i, now) for i, inp in enumerate(inputs)])
            futures.append(group.future)
        self._queue(seqs, on_loop=True)
        return futures

    def _outbox(self) -> _Outbox:
        """Where results for the running loop's callers are handed over (one per loop)."""
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = _Outbox(loop)
        return outbox

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Future[int]:
        """Abort one request by id (or all); resolves to how many were aborted.

        ``rid`` matches a sequence's own id or its ``group_rid`` (all samples of an ``n`` > 1
        request).
        """
        return self._call(lambda: self._abort({rid} if rid else set(), abort_all, "/abort_request"))

    def abort_many(self, rids: Iterable[str], message: str = "client went away") -> Future[int]:
        """Abort these request ids (one command): requests abandoned by this process, ended
        wherever they are (held by a pause too)."""
        wanted = set(rids)
        return self._call(lambda: self._abort(wanted, False, message, held=True))

    def pause(self, mode: str = "abort") -> Future[None]:
        """Stop stepping after the current step; resolves once paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        """Continue after a pause; resolves once the scheduler steps again."""
        return self._call(self._resume)

    def slow_down(self, seconds: float | None) -> Future[None]:
        """Sleep ``seconds`` before each step that has work (None: no more); SGLang's
        ``/slow_down``."""

        def set_sleep() -> None:
            self._forward_sleep = seconds

        return self._call(set_sleep)

    def start_profile(self, request: ProfileRequest) -> Future[None]:
        """Start a torch profile of the steps (``step_profiler``) between two of them;
        resolves once started (or armed for its ``start_step``), or with ProfileError."""
        return self._call(lambda: self._profiler.start(request, self.steps))

    def stop_profile(self) -> Future[str]:
        """End the profile and write its trace; resolves with the trace's path."""
        return self._call(self._profiler.stop)

    def apply_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int | None
    ) -> Future[None]:
        """Load tensors at the next step boundary; resolves once loaded (or with the error)."""
        return self._call(lambda: self._load(named_tensors, version))

    def set_weight_version(self, version: str | int) -> Future[None]:
        return self._call(lambda: self._set_version(str(version)))

    @property
    def think_end(self) -> tuple[int, ...]:
        """The tokens that end a reasoning (``--reasoning-parser``'s end tag; none without)."""
        strict = self.strict_thinking
        if strict is not None and strict.end:
            return strict.end
        return self._grammars.think_end if self._grammars is not None else ()

    @property
    def think_ends(self) -> tuple[tuple[int, ...], ...]:
        """The end tags a request may pick as its own (``GenerateInput.think_end``)."""
        return self._grammars.think_ends if self._grammars is not None else ()

    def _think_end(self, seq: _Seq) -> tuple[int, ...]:
        """The tokens that end ``seq``'s reasoning: its request's own, else the server's."""
        return seq.inp.think_end or self.think_end

    @property
    def think_start(self) -> tuple[int, ...]:
        """The tokens of a start tag the model may write itself (``ThinkFormat.self_opens``):
        an answer that opens with them counts reasoning tokens without ``require_reasoning``."""
        return self._grammars.think_start if self._grammars is not None else ()

    def adapter_names(self) -> frozenset[str]:
        """The names of the LoRA adapters loaded (a request's ``lora_path`` names one)."""
        return self._adapter_names

    def adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters, as ``/load_lora_adapter`` describes them."""
        return [a.describe() for a in list(self._adapters.values())]

    def load_adapter(self, name: str, path: str) -> Future[None]:
        """Read the peft adapter folder ``path`` (in the caller's thread) and make it
        ``name`` at the next step boundary. Raises ``AdapterError`` for a folder that does not
        fit the model, or when this model's passes cannot take adapters."""
        self._check_adapter(name)
        adapter = self._invariant_adapter(load_adapter(path, self.model, name))
        return self._call(lambda: self._add_adapter(adapter))

    def load_adapter_from(
        self, name: str, config: dict[str, Any], tensors: Callable[[], dict[str, torch.Tensor]]
    ) -> Future[None]:
        """``load_adapter`` of a ``peft`` config and its weights (``tensors``, read in the
        caller's thread: SGLang's ``/load_lora_adapter_from_tensors``)."""
        self._check_adapter(name)
        adapter = build_adapter(
            config, tensors, self.model, name, "__tensor__",
            config_at="config_dict", at="serialized_named_tensors",
        )  # fmt: skip
        adapter = self._invariant_adapter(adapter)
        return self._call(lambda: self._add_adapter(adapter))

    def _invariant_adapter(self, adapter: Adapter) -> Adapter:
        """``adapter``, whose products in deterministic passes must give each row what it is
        alone at the rows the model's were found to (``batch_invariant.holds``): else
        AdapterError, rather than answers that depend on the batch."""
        if self.deterministic:
            rows = self._fast.invariant_rows
            products = [(m, None) for slots in adapter.layers for ab in slots.values() for m in ab]
            if not invariant_holds(products, rows):
                raise AdapterError(
                    f"--enable-deterministic-inference: adapter {adapter.name!r}'s products "
                    f"(rank {adapter.rank}) do not give each row what it is alone at the "
                    f"{rows} rows at a time this model's are computed at here"
                )
        return adapter

    def _check_adapter(self, name: str) -> None:
        if self._fast is None:
            raise AdapterError(
                f"LoRA adapters need the engine's Llama-family forward path; this model takes "
                f"transformers' ({self.forward_path_why})"
            )
        if name in self._adapter_names:
            raise AdapterError(f"an adapter named {name!r} is already loaded: unload it first")

    def unload_adapter(self, name: str) -> Future[bool]:
        """Forget adapter ``name`` (rows already running with it finish with it); resolves to
        whether it was loaded."""
        return self._call(lambda: self._drop_adapter(name))

    @property
    def session_radix_cache(self) -> bool:
        """Whether sessions hold their KV (SGLang's ``--enable-session-radix-cache``)."""
        return self._radix_sessions is not None

    def open_radix_session(self, session: str) -> Future[int]:
        """A new generation of ``session`` (``/open_session`` with the flag): requests still
        running from before hold nothing for it when they finish; resolves to the generation."""
        return self._call(lambda: self._sessions_or_raise().open(session))

    def release_radix_session(self, session: str) -> Future[int]:
        """Close ``session`` (``/close_session`` with the flag): its KV may be evicted as any
        other; resolves to the number of sequence ends it held (0: closed already, or none)."""
        return self.release_radix_sessions([session])

    def release_radix_sessions(self, sessions: Sequence[str]) -> Future[int]:
        """``release_radix_session`` of each of ``sessions``, at one step boundary: the
        sequence ends they held in all."""

        def release() -> int:
            held, radix = 0, self._sessions_or_raise()
            for session in sessions:
                if radix.close(session) and self._prefix is not None:
                    held += self._prefix.release(session)
            return held

        return self._call(release)

    def _sessions_or_raise(self) -> RadixSessions:
        if self._radix_sessions is None:
            raise RuntimeError("the engine runs without --enable-session-radix-cache")
        return self._radix_sessions

    def flush_prefix_cache(self) -> Future[int]:
        """Drop every cached prefix (running rows keep their own KV); resolves to the number
        of tokens dropped."""
        return self._call(self._flush_prefixes)

    def release_memory(self, tags: Sequence[str] | None) -> Future[list[str]]:
        """SGLang's ``release_memory_occupation`` (``stages.engine.memory_offload``): give back
        the memory of ``tags`` (None or empty: all) at a step boundary, once nothing runs;
        resolves to the tags newly released (MemoryStateError: not idle)."""
        return self._call(lambda: self._release_memory(tags))

    def resume_memory(self, tags: Sequence[str] | None) -> Future[list[str]]:
        """Take back the memory of ``tags`` (None or empty: all, each of which must have been
        released); generation goes on once neither the weights nor the KV cache is out."""
        return self._call(lambda: self._resume_memory(tags))

    @property
    def released_memory(self) -> list[str]:
        """The tags released and not resumed."""
        return list(self._memory.released)

    def parameter_rows(self, name: str, rows: int) -> Future[torch.Tensor | None]:
        """Parameter ``name``'s first ``rows`` rows (a Python slice: a negative count leaves
        that many out), copied to the CPU in float32 at a step boundary, so that no weight
        update is half written in it; None when the model has no parameter of that name."""
        return self.with_weights("get_weights_by_name", lambda m: parameter_rows(m, name, rows))

    def with_weights(self, what: str, fn: Callable[[torch.nn.Module], T]) -> Future[T]:
        """``fn(model)`` at a step boundary, so that no weight update is half done when it reads
        or writes the weights; refused (MemoryStateError naming ``what``) while they are
        released."""

        def run() -> T:
            self._memory.refuse_weights(what)
            return fn(self.model)

        return self._call(run)

    def lend_weights(self, what: str) -> Future[list[tuple[str, torch.Tensor]]]:
        """The model's parameters (``named_parameters``, in its order) at a step boundary, for
        ``what`` to read on another thread while decoding goes on; the weights may not be
        released until ``return_weights``. The caller keeps weight updates out meanwhile (the
        weight routes' lock). Refused (MemoryStateError) while they are released."""

        def lend(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
            self._memory.lent += 1
            return list(model.named_parameters())

        return self.with_weights(what, lend)

    def return_weights(self) -> Future[None]:
        """End a ``lend_weights``."""

        def back() -> None:
            self._memory.lent -= 1

        return self._call(back)

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """``fn()`` on the scheduler thread between two steps (also while paused); resolves
        with its result or its exception."""
        return self._call(fn)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and end the scheduler thread."""
        self._stop.set()
        self._wake.set()
        if self.turns is not None:  # its caller may hold the turn a step would wait for
            self.turns.close()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- stepping --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: commands, admission, one decode step. True while work remains."""
        self._drain()
        if self._paused or self._memory.holds_generation:
            return False
        if self._forward_sleep is not None and (self._running or self._waiting):
            time.sleep(self._forward_sleep)  # /slow_down (SGLang's, for tests)
        self._admit()
        if self._running:
            rows, began = self._kv.rows, time.perf_counter()
            self._decode()
            now = time.perf_counter()
            self.load.decoded(rows, now - began, rows, now)
            if self._profiler.armed:
                self._profiler.tick(self.steps)
        return bool(self._running) or bool(self._waiting)

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Step until nothing is running or waiting (for callers that drive ``step`` directly)."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError(f"still busy after {max_steps} steps")

    def _loop(self) -> None:
        # The intra-op thread count is per thread under OpenMP: without this, a fresh thread
        # runs the model ~3x slower on CPU than the thread that loaded it.
        torch.set_num_threads(self._threads)
        name_thread("engine")  # for top -H and bench/stage_cpu.py
        log.info("scheduler_started", max_running=self.max_running, device=str(self.device))
        turns = self.turns
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    busy = self.step() if turns is None else turns.step(self.step)
                except Exception as exc:
                    # A failing forward pass must not kill the engine: fail what was in flight.
                    log.exception("scheduler_step_failed", error=repr(exc))
                    if self.on_step_failed is not None:
                        self.on_step_failed(exc)
                    self._fail_all(exc)
                    continue
                if not busy:
                    self.load.idle(time.perf_counter())
                    self._wake.wait()
                    self._wake.clear()
            self._drain()
            self._abort(set(), True, "engine shutting down", held=True, at_once=True)
            with self._lock:  # nothing will queue those whose grammar is compiling
                held, self._compiling = list(self._compiling), {}
            for group in held:
                group.fail(RuntimeError("the engine is shutting down"))
        log.info(
            "scheduler_stopped",
            steps=self.steps,
            tokens=self.tokens_generated,
            prefix_cache=self.prefix_cache_stats(),
        )

    def _submit(
        self,
        inputs: list[GenerateInput],
        *,
        single: bool,
        outbox: _Outbox | None = None,
        stream: Callable[[list[tuple[int, Any]]], None] | None = None,
    ) -> Any:
        group = _Group(len(inputs), single, outbox, stream)
        now = time.perf_counter()
        seqs = [_Seq(inp, group, i, now) for i, inp in enumerate(inputs)]
        self._queue([seqs], on_loop=outbox is not None)
        return group.future

    def _queue(self, groups: list[list[_Seq]], *, on_loop: bool) -> None:
        """Queue each group's seqs on the scheduler thread (one command), their grammars'
        constraints given first. For a caller on an event loop, a group with a grammar not
        compiled yet is queued once a worker has compiled it (``_compile_later``), so that the
        loop serves on meanwhile; else the grammar is compiled here (RequestError naming the
        field if it cannot be)."""
        now = []
        for seqs in groups:
            if self.deterministic:  # a row without a seed draws with SGLang's, 42
                for seq in seqs:
                    if seq.generator is None:
                        seq.generator = torch.Generator().manual_seed(DEFAULT_SEED)
            images = _unready_images(seqs)
            if images and on_loop:
                self._prepare_later(seqs, images)
                continue
            for seq in seqs:  # (a caller off the loop waits for them) one that could not
                if seq.inp.images is not None:  # be read: its RequestError, raised here
                    seq.inp.images.pixels.result()
            if on_loop and self._compiling_needed(seqs):
                self._compile_later(seqs)
            else:
                now.append(self._constrain_seqs(seqs))
        if len(now) == 1:
            self._post(lambda: self._enqueue(now[0]))
        elif now:
            self._post(lambda: [self._enqueue(seqs) for seqs in now])

    def _prepare_later(self, seqs: list[_Seq], images: list[Any]) -> None:
        """Hold the group while workers make its images' pixels (``images.Vision``), then
        queue it as ``_queue`` does (its grammars compiled first) or fail it with the
        RequestError of an image that cannot be read, on the scheduler thread. An abort
        meanwhile marks its seqs, as while a grammar compiles (``_compiling``)."""
        group = seqs[0].group
        with self._lock:
            self._compiling[group] = seqs
        left = [len(images)]
        count = threading.Lock()

        def made(_: Any) -> None:  # on a worker (or here, for pixels already made)
            with count:
                left[0] -= 1
                if left[0]:
                    return
            self._post(lambda: self._prepared(seqs, images))

        for image in images:
            image.pixels.add_done_callback(made)

    def _prepared(self, seqs: list[_Seq], images: list[Any]) -> None:
        """(scheduler thread) The images of a group held by ``_prepare_later`` are made."""
        group = seqs[0].group
        failed = next((i.pixels.exception() for i in images if i.pixels.exception()), None)
        if failed is not None or not self._compiling_needed(seqs):
            self._compiled(seqs, None, failed)
            return
        with self._lock:
            self._compiling.pop(group, None)
        self._compile_later(seqs)  # (an abort meanwhile stays marked in _cut)

    def _compiling_needed(self, seqs: list[_Seq]) -> bool:
        grammars = self._grammars
        if grammars is None:
            return False
        for seq in seqs:  # (every request passes here: a loop, not a generator)
            grammar = seq.inp.params.grammar
            if grammar is not None and not grammars.compiled(*grammar):
                return True
        return False

    def _compile_later(self, seqs: list[_Seq]) -> None:
        """Compile the group's grammars on the grammar worker, then queue it (or fail it
        with the RequestError) on the scheduler thread. Until then an abort that names its
        seqs marks them (``_abort``): they end as aborted as soon as they are queued."""
        assert self._grammars is not None
        group = seqs[0].group
        with self._lock:
            self._compiling[group] = seqs

        def compiled(failed: tuple[str, GrammarError] | None) -> None:  # on the worker
            self._post(lambda: self._compiled(seqs, failed))

        grammars = [s.inp.params.grammar for s in seqs if s.inp.params.grammar is not None]
        self._grammars.compile_later(grammars, compiled)  # type: ignore[arg-type]

    def _compiled(
        self,
        seqs: list[_Seq],
        failed: tuple[str, GrammarError] | None,
        unread: BaseException | None = None,
    ) -> None:
        """(scheduler thread) The grammars of a group held by ``_compile_later`` are ready
        (``failed``: the field of one that did not compile, and why), or the images of one
        held by ``_prepare_later`` (``unread``: why one could not be read)."""
        group = seqs[0].group
        with self._lock:
            self._compiling.pop(group, None)
        cut = self._cut.intersection(seqs)
        self._cut -= cut
        try:
            if unread is not None:
                if isinstance(unread, RequestError):
                    raise unread
                raise RequestError("image_data", f"the image could not be read: {unread}")
            if failed is not None:
                raise RequestError(f"sampling_params.{failed[0]}", str(failed[1]))
            self._constrain_seqs(seqs)  # each seq's copy of its grammar, kept compiled
        except RequestError as error:
            group.fail(error)
            return
        self._enqueue(seqs)
        if cut and all(self._rids.get(s.inp.rid) is s for s in cut):
            self._drop(lambda s: s in cut, waiting=ABORTED_COMPILING, held=True)

    def _constrain_seqs(self, seqs: list[_Seq]) -> list[_Seq]:
        """Give each seq with a grammar its constraint (compiled here unless it is kept
        compiled); RequestError naming the field if one cannot be."""
        strict = self.strict_thinking
        for seq in seqs:
            grammar = seq.inp.params.grammar
            # a grammar of the whole answer (ebnf_full_assistant) holds its reasoning too:
            # neither deferred nor budgeted (SGLang's ReasonerGrammarBackend returns it as is)
            thinks = seq.inp.require_reasoning and not (
                grammar is not None and grammar[0] == "ebnf" and seq.inp.params.ebnf_full_assistant
            )
            if strict is not None and strict.end and thinks:
                seq.thinking = 0
                seq.budget = strict.limit(seq.inp.max_thinking_tokens)
            if grammar is None:
                continue
            field, text = grammar
            if self._grammars is None:
                raise RequestError(
                    f"sampling_params.{field}", "grammars need the model's tokenizer"
                )
            try:
                seq.constraint = self._grammars.start(field, text)
            except GrammarError as exc:
                raise RequestError(f"sampling_params.{field}", str(exc)) from None
            if thinks and self._grammars.think_end:
                seq.thinking = 0  # SGLang's ReasonerGrammarObject: after the reasoning
        return seqs

    def _post(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._post(run)
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            command()

    # ---- commands (scheduler thread) -------------------------------------------------------

    def _enqueue(self, seqs: list[_Seq]) -> None:
        busy = [s.inp.rid for s in seqs if s.inp.rid in self._rids]
        if busy:
            # SGLang's words (TokenizerManager: its rid_to_state holds the rid)
            seqs[0].group.fail(ValueError(f"Duplicate request ID detected: {busy[0]}"))
            return
        for seq in seqs:
            if seq.inp.lora is not None:
                seq.adapter = self._adapters.get(seq.inp.lora)
                if seq.adapter is None:
                    seqs[0].group.fail(
                        ValueError(f"lora_path: the adapter {seq.inp.lora!r} was unloaded")
                    )
                    return
        sessions = self._radix_sessions
        for seq in seqs:
            self._rids[seq.inp.rid] = seq
            if sessions is not None and seq.inp.session_id is not None:
                seq.session = (seq.inp.session_id, sessions.ensure(seq.inp.session_id))
        if self._paused:  # (held as SGLang's tokenizer holds them: out of its queue)
            self._held.extend(seqs)
        else:
            self._join_queue(seqs)

    def _join_queue(self, seqs: list[_Seq]) -> None:
        """Queue ``seqs`` as SGLang's scheduler takes an incoming request: its priority set,
        or the request refused for having one (``_set_or_validate_priority``); then, under
        ``--max-queued-requests``, refused with SGLang's 503 reason when the queue is full,
        unless priority scheduling drops a waiting request it is preferred to
        (``_abort_on_queued_limit``)."""
        priorities, limit, waiting = self.priorities, self.max_queued, self._waiting
        if limit is None and not priorities.enabled and not priorities.abort_when_disabled:
            waiting.extend(seqs)  # (the default: nothing to check)
            return
        for seq in seqs:
            if priorities.refuses(seq.inp.priority):
                self._refuse(seq, PRIORITY_DISABLED)
                continue
            seq.priority = priorities.value(seq.inp.priority)
            if limit is not None and len(waiting) >= limit:
                dropped = priorities.evicted(seq, waiting, _priority_key)
                if dropped is None:
                    self.queue_full += 1
                    if sparse(self.queue_full):  # (1st, 2nd, 4th...: an overload cannot flood)
                        log.warning("request_queue_full", refused=self.queue_full, rid=seq.inp.rid)
                    self._finish(seq, dict(QUEUE_FULL), [], [], [])
                    continue
                waiting.remove(dropped)
                self._refuse(dropped, PRIORITY_EVICTED)
            waiting.append(seq)

    def _refuse(self, seq: _Seq, reason: dict[str, Any]) -> None:
        """End a queued (or arriving) seq for its priority, as the tokenizer answers it."""
        self.priority_aborted += 1
        if sparse(self.priority_aborted):
            log.warning("request_priority_aborted", message=reason["message"], rid=seq.inp.rid)
        told = _told(seq)
        self._finish(seq, dict(reason), seq.done_ids[:told], seq.done_logprobs[:told],
                     seq.done_versions[:told])  # fmt: skip

    def _add_adapter(self, adapter: Adapter) -> None:
        if adapter.name in self._adapters:
            raise AdapterError(f"an adapter named {adapter.name!r} is already loaded")
        self._adapters[adapter.name] = adapter
        self._adapter_names = frozenset(self._adapters)
        self._lora_seen = True
        log.info("lora_adapter_loaded", **adapter.describe(), modules=adapter.modules)

    def _drop_adapter(self, name: str) -> bool:
        adapter = self._adapters.pop(name, None)
        self._adapter_names = frozenset(self._adapters)
        if adapter is not None:
            log.info("lora_adapter_unloaded", lora_name=name)
        return adapter is not None

    def _row_adapters(self, seqs: Sequence[_Seq | None]) -> RowAdapters | None:
        if not self._lora_seen:
            return None
        return RowAdapters.of([s.adapter if s is not None else None for s in seqs], self.device)

    def _abort(
        self,
        rids: set[str],
        abort_all: bool,
        message: str,
        *,
        held: bool = False,
        at_once: bool = False,
    ) -> int:
        """End the requests named (or all) as aborted; ``held``: those a pause holds too.
        Running ones held by an ``in_place`` pause end at their next pass (``_drop``) unless
        ``at_once``."""

        def hit(seq: _Seq) -> bool:
            return abort_all or seq.inp.rid in rids or seq.inp.group_rid in rids

        with self._lock:  # those whose grammar is compiling: aborted once queued
            compiling = [s for seqs in self._compiling.values() for s in seqs if hit(s)]
        self._cut.update(compiling)
        count = self._drop(hit, held=held, at_once=at_once) + len(compiling)
        if count:
            log.info(
                "requests_aborted",
                rids=sorted(rids)[:8],
                abort_all=abort_all,
                count=count,
                by=message,
            )
        return count

    def _drop(
        self,
        hit: Callable[[_Seq], bool],
        *,
        waiting: dict[str, Any] = ABORTED_WAITING,
        held: bool = False,
        at_once: bool = False,
    ) -> int:
        """End the queued and running seqs that ``hit`` as aborted, with SGLang's reasons:
        ``waiting``'s for those queued (a retracted one too; ``held``: those a pause holds
        too), ``ABORTED_RUNNING``'s for the rest. Running seqs held by an ``in_place`` pause
        are marked instead, unless ``at_once``: SGLang's paused scheduler sets their
        ``to_finish`` (``Scheduler.abort_request``, "Abort method 3") and ends them at their
        first decode pass after ``/continue_generation``, whose token they keep
        (``process_batch_result_decode``, ``Req.update_finish_state``)."""
        queued = [s for s in self._waiting if hit(s)]
        if queued:
            self._waiting = collections.deque(s for s in self._waiting if not hit(s))
        if held and self._held:
            queued += [s for s in self._held if hit(s)]
            self._held = [s for s in self._held if not hit(s)]
        for seq in queued:  # SGLang's tokenizer answers with the tokens it had been sent
            told, versions = _told(seq), seq.done_versions
            self._finish(
                seq,
                dict(waiting),
                seq.done_ids[:told],
                seq.done_logprobs[:told],
                versions[:told],
                # none told: the version of its first span, which it keeps (SGLang's
                # add_weight_versions_to_meta_info), else the live one
                live=versions[0] if versions and not told else None,
            )
        rows = [s.slot for s in self._running if hit(s)]
        if rows and self._paused and not at_once:  # (only an in_place pause keeps rows)
            self._to_finish.update(self._running[row] for row in rows)
        elif rows:
            self._retire(rows, [dict(ABORTED_RUNNING) for _ in rows])
        return len(queued) + len(rows)

    def _pause(self, mode: str) -> None:
        if mode == "abort":  # (SGLang's would wait for rows an in_place pause holds: forever)
            self._abort(set(), True, "/pause_generation", at_once=True)
        elif mode == "retract" and self._running:
            # Back to the head of the queue, in order; the KV cache is recomputed on continue.
            self._materialize(self._running)
            now = time.perf_counter()
            for seq in self._running:
                seq.retractions += 1
                seq.queued = now  # its wait starts again
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._kv.clear()
            self._sampler.clear()
            self._clear_rows()  # a re-admitted seq joins them again
        self._paused = True
        self.load.paused(time.perf_counter())
        log.info("generation_paused", mode=mode, **self.counts())

    def _resume(self) -> None:
        self._paused = False
        held, self._held = self._held, []
        # after those queued before the pause, as they reach SGLang's scheduler then
        self._join_queue(held)
        log.info("generation_continued", **self.counts(), came_while_paused=len(held))

    def _release_memory(self, tags: Sequence[str] | None) -> list[str]:
        idle = not self._running and (self._paused or not self._waiting)
        new = self._memory.to_release(tags, idle)
        freed = 0
        if KV_CACHE in new:
            self._flush_prefixes()
            self._sampler.clear()
            freed += self._kv.release()
        if WEIGHTS in new:
            self._offload = WeightOffload(self.model)
            freed += self._offload.release()
        log.info("memory_released", tags=new, bytes=freed, released=self._memory.released)
        return new

    def _resume_memory(self, tags: Sequence[str] | None) -> list[str]:
        resumed = self._memory.to_resume(tags)
        if WEIGHTS in resumed and self._offload is not None:
            self._offload.restore()
            self._offload = None
        log.info("memory_resumed", tags=resumed, released=self._memory.released)
        return resumed

    def _load(
        self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int | None
    ) -> None:
        self._memory.refuse_weights("a weight update")
        start = time.perf_counter()
        count = load_named_tensors(self.model, named_tensors)
        if version is not None:  # the update's weight_version (its last bucket's): live now
            self._set_version(str(version))
        log.debug(  # every update: `--log-level debug` (or the run's log_level) to see them
            "weights_applied",
            version=self._version,
            tensors=count,
            seconds=round(time.perf_counter() - start, 4),
            running=len(self._running),
        )

    def _set_version(self, version: str) -> None:
        if version != self._version:
            clock = self._kv.end
            if self._vkeys[-1] == clock:
                self._vvals[-1] = version
            else:
                self._vkeys.append(clock)
                self._vvals.append(version)
            self._version = version
            self._prune_versions()
            self._version_index += 1
            if self._prefix is not None:
                # Cached prefixes too old to be reused by anyone (prefix_cache: the policy).
                dropped = self._prefix.age_out(self._version_index)
                if dropped:
                    log.debug("prefix_cache_aged_out", tokens=dropped, weight_version=version)
        log.debug("weight_version_set", weight_version=version)

    def _flush_prefixes(self) -> int:
        dropped = self._prefix.flush() if self._prefix is not None else 0
        log.info("prefix_cache_flushed", tokens=dropped)
        return dropped

    def _stamp(self) -> Stamp:
        return Stamp(self._version_index, self._version)

    def _fail_all(self, exc: Exception) -> None:
        seqs = list(self._waiting) + self._held + self._running + self._admitting
        self._admitting, self._held = [], []
        self._scored.clear()
        self._waiting.clear()
        self._running = []
        self._kv.clear()
        self._sampler.clear()
        self._rids.clear()
        self._clear_rows()
        self._to_finish.clear()
        for seq in seqs:
            seq.slot = -1
            seq.group.fail(exc)

    def _watching(self) -> tuple[set[_Seq], ...]:
        """The sets of the running seqs that watch something (joined at their prefill)."""
        return (self._stop_seqs, self._top_seqs, self._mask_seqs, self._hidden_seqs,
                self._route_seqs, self._stream_seqs, self._constrained,
                self._custom_seqs)  # fmt: skip

    def _clear_rows(self) -> None:
        """No row runs any more: the sets of the rows that watch something are empty."""
        for rows in self._watching():
            rows.clear()

    # ---- model passes (scheduler thread) ---------------------------------------------------

    def _admit(self) -> None:
        preempted = self.priorities.enabled and self._by_priority()
        free = self.max_running - len(self._running)
        # Admit in batches: one prefill of many prompts costs far less than many prefills of
        # one. So while rows are decoding, wait until a share of the slots is free (unless
        # everything waiting fits already, or rows were preempted for those waiting).
        if (
            not preempted
            and self._running
            and free < self.admit_fraction * self.max_running
            and len(self._waiting) > free
        ):
            return
        group: list[_Seq] = []
        done: list[_Seq] = []  # nothing (more) to generate: prefill-only scoring, or length
        while self._waiting and len(group) < free:
            seq = self._waiting.popleft()
            if seq.inp.params.max_new_tokens - len(seq.done_ids) <= 0:
                done.append(seq)
            else:
                group.append(seq)
        # out of the queue and not running yet: a pass that raises fails them (_fail_all)
        self._admitting = done + group
        scoring = [
            s
            for s in done + group
            if s.input_lps is None and (s.inp.logprob_start >= 0 or _next_wanted(s))
        ]
        # a prefill-only request's hidden states: its prompt's, from a pass of its own
        scoring += [s for s in done if (s.hidden == [] or s.routes == []) and s not in scoring]
        now = time.perf_counter()
        for seq in self._admitting:
            seq.queue_time += now - seq.queued  # every wait, after a retraction too
            if not seq.admitted:
                seq.admitted = now
        if scoring:
            self._score_prompts(scoring)
        for seq in done:
            reason = {"type": "length", "length": seq.inp.params.max_new_tokens}
            self._finish(seq, reason, seq.done_ids, seq.done_logprobs, seq.done_versions)
        if group:
            self._prefill(group)
        self._admitting = []
        self._scored.clear()

    def _by_priority(self) -> bool:
        """Order the queue by priority, and preempt the running rows that those it leaves
        without a slot may take (``priority``); whether any was."""
        waiting = self.priorities.ordered(self._waiting, _priority_key)
        self._waiting = collections.deque(waiting)
        free = self.max_running - len(self._running)
        unplaced = waiting[free : free + len(self._running)] if free >= 0 else []
        victims = self.priorities.victims(unplaced, self._running, _priority_key)
        if victims:
            self._preempt(victims)
        return bool(victims)

    def _preempt(self, seqs: list[_Seq]) -> None:
        """Put running ``seqs`` back in the queue with what they generated, as a retracting
        pause does, their KV left to the prefix cache (SGLang's ``release_req``: their
        ``num_retractions`` counted)."""
        outputs = self._outputs(seqs)
        if self._prefix is not None:
            self._keep_prefixes(seqs, outputs, [PREEMPTED] * len(seqs))
        rows, now = [seq.slot for seq in seqs], time.perf_counter()
        for seq, (ids, lps, versions) in zip(seqs, outputs, strict=True):
            seq.done_ids, seq.done_logprobs, seq.done_versions = ids, lps, versions
            seq.retractions += 1
            seq.queued = now  # its wait starts again
            for watching in self._watching():  # (joined again at its next prefill)
                watching.discard(seq)
        self._take_out(rows)
        for seq in seqs:
            seq.slot = -1
        self._waiting.extend(seqs)  # (ordered at the next admission)
        self.preempted += len(seqs)
        if sparse(self.preempted):
            log.info("requests_preempted", count=len(seqs), preempted=self.preempted,
                     rids=[seq.inp.rid for seq in seqs[:8]])  # fmt: skip

    def _score_prompts(self, seqs: list[_Seq]) -> None:
        """Prompt log-probs from each seq's ``logprob_start`` on (``prompt_logprobs``), and a
        prefill-only seq's hidden states: forward passes of their own, identical requests
        computed once, each on top of its prompt's longest prefix in the prefix cache up to
        that start (SGLang's ``Req._compute_max_prefix_len``), whose KV then goes into the
        cache. Prompts that share a prefix the cache lacks are scored in two waves, one of
        them first and the rest on top of what it left (SGLang's in-batch prefix caching)."""
        unique: dict[_ScoreKey, list[_Seq]] = {}
        for seq in seqs:
            key = (
                tuple(seq.inp.input_ids),
                seq.inp.logprob_start,
                seq.inp.top_logprobs_num,
                seq.inp.lora,
                seq.inp.token_ids_logprob,
                _next_wanted(seq),
                _same_as(seq),
                _embedded(seq),
            )
            unique.setdefault(key, []).append(seq)
        first, later = _in_batch_waves(
            list(unique),
            lambda k: (
                (
                    unique[k][0].inp.cache_namespace,
                    tuple(_keyed(unique[k][0], list(k[0][:IN_BATCH_PREFIX]))),
                )
                if _reuse_limit(k[0], k[1]) >= IN_BATCH_PREFIX and k[7] is None
                else None
            ),
            lambda k, record: self._score_lookup(k, unique[k][0], record),
        )
        self._score_wave(first, unique)
        if later:
            self._score_wave([(k, self._score_lookup(k, unique[k][0])) for k in later], unique)

    def _score_lookup(self, key: _ScoreKey, seq: _Seq, record: bool = True) -> Match | None:
        """What a scored prompt takes from the prefix cache: its longest prefix of the live
        weights' KV up to its start; None where it neither takes nor leaves any (no cache, or
        an adapter's row). ``record`` false: a look only (``PrefixCache.match``)."""
        if self._prefix is None or _own_kv(seq) or self._state_types is not None:
            return None  # (a scoring pass pads its prompts: a linear-attention state cannot)
        limit = _reuse_limit(key[0], key[1])
        if limit <= 0:
            return Match()
        stamp = self._stamp()
        tokens = _keyed(seq, list(key[0]))
        space = seq.inp.cache_namespace
        return self._prefix.match(tokens, limit, stamp, space, live_only=True, record=record)

    def _score_wave(
        self, wave: list[tuple[_ScoreKey, Match | None]], unique: dict[_ScoreKey, list[_Seq]]
    ) -> None:
        """Scoring passes over ``wave``'s prompts, each after what it matched."""
        live = self._stamp()
        lengths = [len(k[0]) - (m.length if m is not None else 0) for k, m in wave]
        self.prefill_tokens += sum(lengths)
        for part in scoring_passes(lengths):
            keys = [wave[u][0] for u in part]
            kept = [wave[u][1] for u in part]
            matches = [m if m is not None else Match() for m in kept]
            prompts = [list(k[0]) for k in keys]
            cached = [m.length for m in matches]
            ids, mask, positions = _new_tokens(prompts, cached)
            for row, key in enumerate(keys):  # (own position ids: nothing cached before them)
                given = unique[key][0].inp.position_ids
                if given is not None:
                    positions[row, positions.shape[1] - len(given.ids) :] = torch.tensor(given.ids)
            if self.expert_distribution is not None:  # the pass's real tokens, if it records
                self.expert_distribution.extend(mask)
            past = None
            if max(cached):  # on top of cached prefixes, as a generating prefill
                past = self._kv.past([m.pieces for m in matches], max(cached))
                mask = _on_prefixes(prompts, cached, mask)[0]
            ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
            lora = self._row_adapters([unique[k][0] for k in keys])
            owners = [unique[k][0] for k in keys]
            embeds = self._pass_embeds(ids, owners, prompts, cached)
            deep = None
            if self._vision:
                positions = self._rotary(positions, owners)
                deep = self._deepstack(ids.shape[1], owners, prompts, cached)
            routed = self._arm_experts()
            kv, _, hidden = self._forward_prefill(
                ids, mask, positions, past, lora, True, embeds, deep
            )
            assert hidden is not None
            routes = self._routes_of(ids) if routed else None
            head: Callable[[torch.Tensor], torch.Tensor] = (
                self._fast.logits if self._fast is not None else self.model.get_output_embeddings()
            )
            width = ids.shape[1]
            for row, (key, match) in enumerate(zip(keys, matches, strict=True)):
                tokens, start, top, _, wanted, after, _, _ = key
                new = len(tokens) - match.length
                # every position's routed experts (the cached prefix's, then this pass's)
                rows = (
                    None
                    if routes is None
                    else [*_prefix_routes(match), routes[row, width - new :].clone()]
                )
                version = match.stamp.version if match.stamp is not None else None
                for seq in unique[key]:
                    # its cached_tokens, also once it is prefilled to generate (on top of this)
                    seq.cached, seq.cached_version = match.length, version
                    self._scored[seq] = (match.length, version)
                    mode = seq.inp.hidden_states
                    done = seq.inp.params.max_new_tokens <= len(seq.done_ids)
                    if seq.hidden == [] and mode is not None and done:  # its uncached rest's
                        seq.hidden.append(_hidden_block(hidden[row], new, mode))
                    if rows is not None and seq.routes is not None and done:
                        seq.routes[:] = rows
                if start >= 0:
                    lps, tops, picked = prompt_logprobs(
                        hidden[row, width - new :], list(tokens), start, top, head, wanted,
                        offset=match.length,
                    )  # fmt: skip
                    pairs = list(zip(lps, tokens[start:], strict=True))
                    for seq in unique[key]:
                        seq.input_lps, seq.input_tops, seq.input_picked = pairs, tops, picked
                if after:  # prefill-only: the distribution after the prompt, no token drawn
                    next_top, next_picked = next_token_logprobs(hidden[row, -1], top, head, wanted)
                    for seq in unique[key]:
                        if seq.top is not None and next_top is not None:
                            seq.top.append(next_top)
                        if seq.picked is not None and next_picked is not None:
                            seq.picked.append(next_picked)
                if kept[row] is not None:
                    owner = unique[key][0]
                    self._keep_scored(
                        kv,
                        row,
                        _keyed(owner, list(tokens)),
                        match.length,
                        width,
                        owner.inp.cache_namespace,
                        live,
                        rows,
                    )
            del kv, hidden, past

    def _keep_scored(
        self,
        kv: DynamicCache,
        row: int,
        tokens: list[int],
        cached: int,
        width: int,
        namespace: Any,
        live: Stamp,
        routes: list[torch.Tensor] | None = None,
    ) -> None:
        """A scored prompt's KV (row ``row`` of a scoring pass: its cached prefix right-aligned
        in the past's columns, its ``width``-wide new tokens after them) to the prefix cache,
        as a prefix only (``served`` false): a later request that shares it, or generates
        after it, computes only the rest. ``routes``: each position's routed experts (with
        ``--enable-return-routed-experts``), kept beside the KV."""
        routed = None if routes is None else torch.cat(routes)
        assert self._prefix is not None
        before = kv.get_seq_length() - width
        new_at = before + width - (len(tokens) - cached)  # the first new token's column

        def kv_of(a: int, b: int) -> list[torch.Tensor]:
            spans = []
            if a < cached:  # (in the tree already, unless evicted meanwhile)
                spans.append((before - cached + a, before - cached + min(b, cached)))
            if b > cached:
                spans.append((new_at + max(a, cached) - cached, new_at + b - cached))
            pieces = [self._kv.pass_kv(kv, row, lo, hi) for lo, hi in spans]
            whole = (
                pieces[0]
                if len(pieces) == 1
                else [torch.cat(parts, -2) for parts in zip(*pieces, strict=True)]
            )
            return whole if routed is None else [*whole, ExpertsCapture.piece(routed[a:b])]

        self._prefix.insert(tokens, kv_of, live, namespace, served=False)

    def _prefill(self, group: list[_Seq]) -> None:
        # Identical contexts (the samples of one prompt) are prefilled once.
        unique: dict[tuple[Adapter | None, Any, tuple[int, ...], Any], int] = {}
        contexts: list[list[int]] = []
        owners: list[_Seq] = []  # a seq of each context: whose adapter it takes
        source: list[int] = []
        for seq in group:
            ctx = seq.context
            # a namespace shares none; a prompt as embeddings only its own samples
            key = (seq.adapter, _same_as(seq), tuple(ctx), _embedded(seq))
            idx = unique.get(key)
            if idx is None:
                idx = unique[key] = len(contexts)
                contexts.append(ctx)
                owners.append(seq)
            source.append(idx)
        # Contexts that share their opening with an earlier one and find little of it cached
        # wait for that one's KV: a second wave of passes in this admission

        def opening(u: int) -> tuple[Any, tuple[int, ...]] | None:
            ctx, owner = contexts[u], owners[u]
            if self._prefix is None or _own_kv(owner) or len(ctx) <= IN_BATCH_PREFIX:
                return None
            if self._state_types is not None:  # no state is kept where openings end
                return None
            return owner.inp.cache_namespace, tuple(_keyed(owner, ctx[:IN_BATCH_PREFIX]))

        def lookup(u: int, record: bool) -> Match:
            if _own_kv(owners[u]):  # a base prefix is no prefix of an adapter's row
                return Match()
            owner = owners[u]
            return self._lookup(_keyed(owner, contexts[u]), owner.inp.cache_namespace, record)

        first, later = _in_batch_waves(list(range(len(contexts))), opening, lookup)
        began = time.perf_counter()
        computed = hit = 0

        def run(wave: list[tuple[int, Match]]) -> None:
            nonlocal computed, hit
            news = [len(contexts[u]) - m.length for u, m in wave]
            computed += sum(news)
            hit += sum(m.length for _, m in wave)
            parts = _passes(news)
            if self._state_types is not None:  # a row on a kept state: no padding after it
                parts = _unpadded_after_states(parts, news, [m.length for _, m in wave])
            for part in parts:
                units = [wave[k][0] for k in part]
                where = {u: i for i, u in enumerate(units)}
                members = [(s, where[u]) for s, u in zip(group, source, strict=True) if u in where]
                self._prefill_pass(
                    [s for s, _ in members],
                    [contexts[u] for u in units],
                    [wave[k][1] for k in part],
                    [i for _, i in members],
                    self._row_adapters([owners[u] for u in units]),
                    [owners[u] for u in units],
                )

        run(first)
        if later:  # on top of what the first wave left in the cache
            run([(u, lookup(u, True)) for u in later])
        self.prefill_tokens += computed
        self.load.prefilled(time.perf_counter() - began, computed, hit)

    def _lookup(self, ctx: list[int], namespace: Any, record: bool = True) -> Match:
        if self._prefix is None:
            return Match()
        # The last token is always computed: its logits give the first sampled token.
        return self._prefix.match(
            ctx,
            len(ctx) - 1,
            self._stamp(),
            namespace,
            record=record,
            states=self._state_types is not None,
        )

    def _prefill_pass(
        self,
        group: list[_Seq],
        contexts: list[list[int]],
        matches: list[Match],
        source: list[int],
        lora: RowAdapters | None = None,
        owners: list[_Seq] | None = None,
    ) -> None:
        """One forward pass over ``contexts``, each after its cached prefix ``matches[u]``;
        ``group[j]`` takes context ``source[j]``; ``lora``: the contexts' adapters;
        ``owners``: a seq of each context (whose prompt may be embeddings)."""
        cached = [m.length for m in matches]
        ids, mask, positions = _new_tokens(contexts, cached)
        if self.expert_distribution is not None:  # the pass's real tokens, if it records
            self.expert_distribution.extend(mask)
        past, full, columns = None, ids, None
        if max(cached):  # on top of cached prefixes: they come in as past keys and values
            states = [m.state for m in matches] if self._state_types is not None else None
            past = self._kv.past([m.pieces for m in matches], max(cached), states)
            mask, full, columns = _on_prefixes(contexts, cached, mask)
            columns = columns.to(self.device)
        ids, mask, positions, full = (t.to(self.device) for t in (ids, mask, positions, full))
        keep = any(seq.hidden is not None for seq in group)
        embeds = None if owners is None else self._pass_embeds(ids, owners, contexts, cached)
        deep = None
        if owners is not None and self._vision:
            positions = self._rotary(positions, owners)
            deep = self._deepstack(ids.shape[1], owners, contexts, cached)
        routed = self._arm_experts()
        cache, logits, hidden = self._forward_prefill(
            ids, mask, positions, past, lora, keep, embeds, deep
        )
        if hidden is not None:
            new = [len(c) - n for c, n in zip(contexts, cached, strict=True)]
            self._keep_prefill_hidden(group, source, new, hidden)
        if routed:  # every row's context: its cached prefix's (kept with it), then this pass's
            routes, width = self._routes_of(ids), ids.shape[1]
            blocks = [
                [*_prefix_routes(m), routes[u, width - len(c) + m.length :].clone()]
                for u, (c, m) in enumerate(zip(contexts, matches, strict=True))
            ]
            for seq, u in zip(group, source, strict=True):
                seq.routes = list(blocks[u])
        mapped = source != list(range(len(contexts)))  # shared contexts, or another order
        src = torch.tensor(source, device=self.device) if mapped else None
        lengths = torch.tensor([len(contexts[i]) for i in source])
        lo, hi = self._kv.admit(cache, full, lengths, src, columns)
        self._room_for_states(self._kv.rows)
        end = self._kv.end
        live = self._stamp()
        for offset, (seq, u) in enumerate(zip(group, source, strict=True)):
            seq.slot = lo + offset
            seq.first = end
            seq.kv_start = end - len(contexts[u])
            match = matches[u]
            seq.cached = min(match.length, len(seq.inp.input_ids))
            seq.cached_version = match.stamp.version if match.stamp is not None else None
            if seq in self._scored:  # its prompt scored first: what that pass took
                seq.cached, seq.cached_version = self._scored[seq]
            # the row's KV is as old as the oldest KV in it: a reused prefix's, or this pass's
            seq.stamp = match.stamp if match.stamp is not None else live
        if self._prefix is not None:
            self._keep_contexts(group, source, contexts)
        self._running.extend(group)
        self._stop_seqs.update(s for s in group if s.tail is not None)
        self._top_seqs.update(s for s in group if s.top is not None or s.picked is not None)
        self._mask_seqs.update(s for s in group if s.masks is not None)
        self._hidden_seqs.update(s for s in group if s.hidden is not None)
        self._route_seqs.update(s for s in group if s.routes is not None)
        self._stream_seqs.update(s for s in group if s.group.stream is not None)
        self._constrained.update(
            s for s in group if s.constraint is not None or s.thinking is not None
        )
        if self.logit_processors is not None:
            self._custom_seqs.update(self._with_processors(group))
        self._sampler.add(
            [s.inp.params for s in group],
            [end + s.inp.params.max_new_tokens - len(s.done_ids) - 1 for s in group],
            [s.generator for s in group],
            [s.done_ids for s in group],
            [s.masks is not None for s in group],
        )
        if src is not None:
            logits = logits.index_select(0, src)
        if self._constrained:
            self._constrain(logits, lo, hi)
        self._sampler.penalize(logits, lo, hi)
        failed = self._run_processors(logits, lo, hi, True) if self._custom_seqs else None
        if self._top_seqs:
            self._take_top_logprobs(logits, lo, hi)
        tokens, logprobs = self._sampler.sample(logits, lo, hi)
        self._kv.set_pending(lo, hi, tokens, logprobs)
        self.tokens_generated += hi - lo
        now = time.perf_counter()
        for seq in group:  # its first token (once: a retracted seq's comes back prefilled)
            if not seq.first_token:
                seq.first_token = now
        aborted = self._take_masks(lo, hi) if self._mask_seqs else None
        self._finish_checks(tokens, logprobs, lo, hi, end, _either(failed, aborted))

    def _room_for_states(self, rows: int) -> None:
        """Under ``--max-mamba-cache-size``, what ``rows`` running rows leave of it to the
        prefix cache's states (SGLang's pool lends the cache the slots no request holds)."""
        if self._mamba_cache_size is not None and self._prefix is not None:
            self._prefix.room_for_states(self._mamba_cache_size - rows)

    def _keep_contexts(
        self, group: list[_Seq], source: list[int], contexts: list[list[int]]
    ) -> None:
        """Each context a prefill pass just admitted (from the first row that took it), held in
        the prefix cache as a prefix, as SGLang's ``cache_unfinished_req`` holds a prefilled
        request's: a request that shares it and comes before this one finishes (a prompt of
        the same system prompt or few-shot examples, a group's samples sent apart, the first
        requests after a weight update) computes only the rest. Its row inserts its whole
        sequence when it finishes (``_keep_prefixes``). Adapter rows hold none, nor do
        contexts of ``IN_BATCH_PREFIX`` tokens or fewer: reusing one saves less than holding
        it costs (``bench/engine_profile.py compare --against``: 2-3% more CPU a sample on
        arith-tiny's short prompts when they were held too); they are held when they finish."""
        assert self._prefix is not None
        held: set[int] = set()
        for seq, u in zip(group, source, strict=True):
            if u in held or _own_kv(seq) or len(contexts[u]) <= IN_BATCH_PREFIX:
                continue
            held.add(u)

            def kv_of(
                a: int, b: int, seq: _Seq = seq, slot: int = seq.slot, at: int = seq.kv_start
            ) -> list[Any]:
                return self._row_pieces(seq, slot, at, a, b)

            stamp = seq.stamp or self._stamp()
            tokens = _keyed(seq, contexts[u])
            self._prefix.insert(
                tokens,
                kv_of,
                stamp,
                seq.inp.cache_namespace,
                served=False,
                state=self._row_states(seq.slot),
            )

    def _forward_prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        past: DynamicCache | None,
        lora: RowAdapters | None = None,
        keep_hidden: bool = False,
        embeds: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor | None]:
        """(keys and values of past + new tokens, last-position logits, with ``keep_hidden``
        the final hidden state of every new position ``[rows, width, hidden]``, else None)
        of one prefill pass; ``embeds``: the pass's input embeddings in place of the ids'
        (``_pass_embeds``); ``deepstack``: Qwen3-VL's (``_deepstack``), which only its text
        model's own call takes."""
        if self._fast is not None:
            with self._recorded(ids if embeds is None else None, positions):
                if keep_hidden:
                    return self._fast.prefill(
                        ids, mask, positions, past, keep_hidden=True, lora=lora, embeds=embeds,
                        deepstack=deepstack,
                    )  # fmt: skip
                out = self._fast.prefill(
                    ids, mask, positions, past, lora=lora, embeds=embeds, deepstack=deepstack
                )
            return (*out, None)
        if deepstack is not None:
            return self._forward_deepstack(mask, positions, past, keep_hidden, embeds, deepstack)
        out = self.model(
            **({"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=keep_hidden,
            **{self._cache_arg: past if past is not None else pass_cache(self._state_types)},
        )
        hidden = out.hidden_states[-1] if keep_hidden else None
        return output_cache(out), out.logits[:, -1, :], hidden

    def _recorded(
        self, ids: torch.Tensor | None, positions: torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        """Around a pass of the engine's own: the expert-distribution recorder's pass (with
        transformers' passes its hooks on the model's forward mark them)."""
        recorder = self.expert_distribution
        return contextlib.nullcontext() if recorder is None else recorder.pass_of(ids, positions)

    def _forward_deepstack(
        self,
        mask: torch.Tensor,
        positions: torch.Tensor,
        past: DynamicCache | None,
        keep_hidden: bool,
        embeds: torch.Tensor | None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]],
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor | None]:
        """``_forward_prefill`` of a Qwen3-VL pass with image pads: its text model called
        itself with the deepstack's rows (the whole model's forward takes them only from
        pixels), then its head on the last position."""
        text = self.model.model.language_model
        where, layers = deepstack
        out = text(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            visual_pos_masks=where,
            deepstack_visual_embeds=layers,
            **{cache_argument(text.forward) or "past_key_values": past or DynamicCache()},
        )
        hidden = out.last_hidden_state
        logits = self.model.get_output_embeddings()(hidden[:, -1, :])
        return output_cache(out), logits, hidden if keep_hidden else None

    def _pass_embeds(
        self,
        ids: torch.Tensor,
        owners: list[_Seq],
        contexts: list[list[int]],
        cached: list[int],
    ) -> torch.Tensor | None:
        """The input embeddings of a pass over the left-padded ``ids`` of ``contexts`` where
        the prompt of one or more is embeddings (``owners[u].inp.input_embeds``), else None:
        the model's embeddings of the ids, with each such row's prompt positions holding its
        own rows. Such a context is computed whole (no prefix cache serves embeddings), its
        prompt then the tokens it generated before a retraction, which SGLang 0.5.23 throws
        away instead (``Req.reset_for_retract``: it cannot mix the two), so that the sample
        goes on where it was, as any other does. A prompt with images (``_images_at``) has the
        vision tower's rows at those of its pads the pass computes (after ``cached[u]``, what
        the prefix cache gave it)."""
        if all(_embedded(seq) is None and seq.inp.images is None for seq in owners):
            return None
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(ids)
        width = ids.shape[1]
        for u, (seq, ctx) in enumerate(zip(owners, contexts, strict=True)):
            prompt, over = seq.inp.input_embeds, seq.inp.embed_overrides
            at = width - len(ctx)
            if prompt is not None:
                embeds[u, at : at + prompt.shape[0]] = prompt.to(embeds.device, embeds.dtype)
            if over is not None:  # /v1/score's embedding overrides, at their prompt positions
                where = torch.tensor(over.positions, dtype=torch.long, device=embeds.device)
                embeds[u, at + where] = over.rows.to(embeds.device, embeds.dtype)
            image = seq.inp.images
            if image is not None:  # the vision tower's rows at the pads this pass computes
                keep = _images_at(image, cached[u])
                if keep is not None:
                    where = image.positions[keep].to(embeds.device)
                    rows = image.features()[keep]
                    embeds[u, at + where] = rows.to(embeds.device, embeds.dtype)
        return embeds

    def _deepstack(
        self, width: int, owners: list[_Seq], contexts: list[list[int]], cached: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Qwen3-VL's deepstack for a pass over ``contexts`` (left-padded to ``width``, each
        after its ``cached`` prefix): where the image pads it computes are ``[rows, width]``
        and, for each of the first text layers, the rows it adds there in that order
        (``images.ImagePrompt.deep``); None where the pass computes none (run after
        ``_pass_embeds``, which runs the tower)."""
        found = []
        for u, seq in enumerate(owners):
            image = seq.inp.images
            keep = None if image is None else _images_at(image, cached[u])
            if keep is not None and image.deep is not None:
                found.append((u, image, keep))
        if not found:
            return None
        where = torch.zeros(len(owners), width, dtype=torch.bool)
        for u, image, keep in found:
            where[u, width - len(contexts[u]) + image.positions[keep]] = True
        depth = len(found[0][1].deep)
        layers = [
            torch.cat([image.deep[i][keep] for _, image, keep in found]) for i in range(depth)
        ]
        return where.to(self.device), layers

    def _rotary(self, positions: torch.Tensor, owners: list[_Seq]) -> torch.Tensor:
        """A pass's position ids as the model takes them: a vision model's ``[3, rows,
        width]`` (its multimodal rotary positions) where a row's prompt has images
        (``images.ImagePrompt.rope``), else ``positions``."""
        if not self._vision or all(seq.inp.images is None for seq in owners):
            return positions
        out = positions.unsqueeze(0).repeat(3, 1, 1)
        for u, seq in enumerate(owners):
            if seq.inp.images is not None:
                out[:, u] = seq.inp.images.rope(positions[u])
        return out

    def _decode_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """A decode step's position ids ``[rows, 1]``, each row whose prompt has images
        moved on by its rotary delta (the same on the three axes)."""
        rows = positions.shape[0]
        deltas = [
            (seq.slot, seq.inp.images.delta)
            for seq in self._running
            if seq.inp.images is not None and seq.inp.images.delta and 0 <= seq.slot < rows
        ]
        if not deltas:
            return positions
        shift = torch.zeros_like(positions)
        for slot, delta in deltas:
            shift[slot] = delta
        return positions + shift

    def _keep_prefill_hidden(
        self, group: list[_Seq], source: list[int], new: list[int], hidden: torch.Tensor
    ) -> None:
        """Each of ``group`` that asked, its block of a prefill pass's final hidden states:
        those of the ``new[u]`` positions its context ``source[j]`` computed (the last ones
        of a left-padded row), or of the last ("last"), as SGLang's scheduler appends them
        (``_append_prefill_hidden_states``). A sample of ``n`` > 1 gets its last position's
        alone at its first prefill: SGLang caches such a prompt in a warm-up request, and
        each sample computes only that. A context's are read once for its samples."""
        blocks: dict[tuple[int, str], list[Any]] = {}
        warmed = self._prefix is not None  # SGLang's warm-up caches a prompt only with a cache
        for seq, u in zip(group, source, strict=True):
            mode = seq.inp.hidden_states
            if seq.hidden is None or mode is None:
                continue
            if mode == "full" and seq.inp.parallel and warmed and not seq.hidden:
                mode = "tail"
            block = blocks.get((u, mode))
            if block is None:
                block = blocks[(u, mode)] = _hidden_block(hidden[u], new[u], mode)
            seq.hidden.append(block)

    def _decode(self) -> None:
        kv = self._kv
        ids, positions, mask = kv.decode_inputs()
        if self._vision:
            positions = self._decode_positions(positions)
        keep = bool(self._hidden_seqs)
        hidden = None
        routed = bool(self._route_seqs) and self._arm_experts()
        if self._fast is not None:
            lora = self._row_adapters(self._running)
            with self._recorded(ids, positions):
                if keep:
                    logits, hidden = self._fast.decode(
                        ids, positions, mask, kv, lora, keep_hidden=True
                    )
                else:
                    logits = self._fast.decode(ids, positions, mask, kv, lora)
        else:
            out = self.model(
                input_ids=ids,
                attention_mask=_layer_masks(mask, self._window, self._all_slide, self._state_types),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                output_hidden_states=keep,
                **{self._cache_arg: kv.cache},
            )
            logits = out.logits[:, -1, :]
            if keep:
                hidden = out.hidden_states[-1][:, -1]
        if hidden is not None:
            self._keep_decode_hidden(hidden)
        if routed:  # the row of the token each watching row just ran
            routes = self._routes_of(ids)
            for seq in self._route_seqs:
                if seq.routes is not None and 0 <= seq.slot < ids.shape[0]:
                    seq.routes.append(routes[seq.slot].clone())  # [1, layers, k]
        self.steps += 1
        rows = kv.rows
        if self._constrained:
            self._constrain(logits, 0, rows)
        self._sampler.penalize(logits, 0, rows)
        failed = self._run_processors(logits, 0, rows, False) if self._custom_seqs else None
        if self._top_seqs:
            self._take_top_logprobs(logits, 0, rows)
        tokens, logprobs = self._sampler.sample(logits, 0, rows)
        kv.push(tokens, logprobs)
        self.tokens_generated += rows
        aborted = self._take_masks(0, rows) if self._mask_seqs else None
        self._finish_checks(tokens, logprobs, 0, rows, kv.end, _either(failed, aborted))

    def _arm_experts(self) -> bool:
        """Whether the next pass keeps its routed experts (``ExpertsCapture.arm``): with the
        server's flag every pass does, for every row, whether it asks or not, so that the
        prefix cache keeps them beside the KV it holds (SGLang's buffer has every token's)."""
        if self._experts is None:
            return False
        self._experts.arm()
        return True

    def _routes_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The armed pass's routed experts over ``ids`` ([rows, width]): ``[rows, width,
        layers, k]`` int32."""
        assert self._experts is not None
        rows, width = ids.shape
        return self._experts.take(rows * width).view(rows, width, self._experts.layers, -1)

    def _row_states(self, slot: int) -> list[torch.Tensor] | None:
        """The linear-attention states of the row in ``slot`` after every token it ran (the
        prefix cache copies them); None: the model has none."""
        return None if self._state_types is None else self._kv.row_states(slot)

    def _row_pieces(self, seq: _Seq, slot: int, at: int, a: int, b: int) -> list[torch.Tensor]:
        """What the prefix cache keeps of positions ``a..b-1`` of the sequence in ``slot``
        (whose first position is column ``at``): its KV, then, with the server's
        ``--enable-return-routed-experts``, its routed experts (``ExpertsCapture.piece``)."""
        pieces = self._kv.row_kv(slot, at + a, at + b)
        if self._experts is None:
            return pieces
        assert seq.routes is not None  # (every prefill with the flag gives a row its routes)
        return [*pieces, ExpertsCapture.piece(torch.cat(seq.routes)[a:b])]

    def _keep_decode_hidden(self, hidden: torch.Tensor) -> None:
        """The final hidden state each watching row's decode step just computed (``[rows,
        hidden]``): added to its list, or in place of it ("last": SGLang's
        ``_append_decode_hidden_states``)."""
        rows = hidden.shape[0]
        seqs = [s for s in self._hidden_seqs if 0 <= s.slot < rows and s.hidden is not None]
        if not seqs:
            return
        index = torch.tensor([s.slot for s in seqs], device=hidden.device)
        for seq, row in zip(seqs, hidden.index_select(0, index).float().tolist(), strict=True):
            assert seq.hidden is not None
            add_hidden(seq.hidden, [row], seq.inp.hidden_states)

    def _take_masks(self, lo: int, hi: int) -> dict[int, dict[str, Any]] | None:
        """Each watched row's sampling support from the draw just made, kept with its seq;
        the rows whose drawn token is outside it (which the sampler's draw rules out) are
        aborted as SGLang aborts them."""
        captured = self._sampler.captured
        aborted = None
        for seq in self._mask_seqs:
            if lo <= seq.slot < hi and seq.masks is not None:
                support = captured[seq.slot]
                seq.masks.append(support)
                if support[2] is None:
                    aborted = aborted or {}
                    aborted[seq.slot] = dict(_OUTSIDE_SUPPORT)
        return aborted

    def _with_processors(self, group: list[_Seq]) -> list[_Seq]:
        """The seqs of ``group`` with a custom logit processor, each given its parameters
        (once: a retracted seq keeps them)."""
        found = []
        for seq in group:
            if seq.inp.logit_processor is None:
                continue
            if seq.custom is None:
                params, view = seq.inp.custom_params, None
                if isinstance(params, dict):  # SGLang's Req adds itself to a dictionary only

                    def outputs(seq: _Seq = seq) -> list[int]:
                        return self._outputs([seq])[0][0]

                    view = RequestView(seq.inp.rid, seq.inp.input_ids, outputs)
                    params = {**params, "__req__": view}
                seq.custom = (params, view)
            found.append(seq)
        return found

    def _run_processors(
        self, logits: torch.Tensor, lo: int, hi: int, prefill: bool
    ) -> dict[int, Any] | None:
        """Before the top log-probs are read and a token drawn: each running row among
        ``lo..hi`` with a custom logit processor has its logits processed, the rows of one
        processor string at once (SGLang's ``apply_custom_logit_processor``); the rows of a
        processor that failed are to be aborted, with why. ``prefill``: the rows were just
        admitted (their output is what earlier stints made)."""
        by_text: dict[str, list[_Seq]] = {}
        for seq in self._custom_seqs:
            if lo <= seq.slot < hi:
                by_text.setdefault(seq.inp.logit_processor, []).append(seq)  # type: ignore[arg-type]
        failed: dict[int, Any] = {}
        assert self.logit_processors is not None
        for text, seqs in by_text.items():
            seqs.sort(key=lambda s: s.slot)
            params = []
            for seq in seqs:
                assert seq.custom is not None
                if seq.custom[1] is not None:
                    seq.custom[1].fresh(seq.done_ids if prefill else None)
                params.append(seq.custom[0])
            rows = [s.slot - lo for s in seqs]
            why = self.logit_processors.apply(logits, text, rows, params)
            if why is not None:
                log.warning(
                    "custom_logit_processor_failed", rids=[s.inp.rid for s in seqs], why=why
                )
                failed.update({s.slot: {"type": "abort", "message": why} for s in seqs})
        return failed or None

    def _take_top_logprobs(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Before sampling (which overwrites ``logits``): each watched row's most likely
        tokens, and the tokens it named (``token_ids_logprob``), under the distribution its
        sampled token's log-prob comes from."""
        seqs = [s for s in self._top_seqs if lo <= s.slot < hi]
        if not seqs:
            return
        rows = torch.tensor([s.slot - lo for s in seqs], device=logits.device)
        temperature = torch.tensor(
            [1.0 if s.inp.params.greedy else s.inp.params.temperature for s in seqs],
            device=logits.device,
        )
        x = logits.index_select(0, rows).float() / temperature[:, None]
        lps = torch.log_softmax(x, dim=-1)
        k = min(max(s.inp.top_logprobs_num for s in seqs), x.shape[1])
        if k:
            values, ids = lps.topk(k, dim=-1)
            for seq, vals, toks in zip(seqs, values.tolist(), ids.tolist(), strict=True):
                n = seq.inp.top_logprobs_num
                if seq.top is not None:
                    seq.top.append(list(zip(vals[:n], toks[:n], strict=True)))
        for i, seq in enumerate(seqs):
            wanted = seq.inp.token_ids_logprob
            if seq.picked is not None and wanted is not None:
                vals = lps[i, list(wanted)].tolist()
                seq.picked.append(list(zip(vals, wanted, strict=True)))

    def _finish_checks(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lo: int,
        hi: int,
        column: int,
        aborted: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """Stream the tokens just sampled for rows ``lo..hi`` to those who asked, then retire
        the rows they finish. A row's reason, in SGLang 0.5's order
        (``Req.update_finish_state``): a stop string or pattern, else a stop token, else the
        length limit; ``aborted`` (rows and reasons) before any."""
        finished = self._finished_rows(tokens, lo, hi, column)
        if self._constrained:  # a grammar ends a sample after the length (SGLang's order)
            for row, reason in self._advance_grammars(tokens, lo, hi).items():
                if reason["type"] == "abort" or row not in finished:
                    finished[row] = reason
        if self._stop_seqs and self._decode_tail is not None:
            new = tokens.tolist()
            watched = [(s, new[s.slot - lo]) for s in self._stop_seqs if lo <= s.slot < hi]
            if watched:
                finished.update(self._stop_string_rows(watched))
        if self._to_finish:  # aborted while paused in place: over a stop or the length
            finished.update(self._marked_rows(lo, hi))
        if aborted:
            finished.update(aborted)
        # read before the rows move; sent after, to rows that go on (a finished row's result
        # carries its last token: one chunk, as SGLang sends it)
        streamed = self._streamed(tokens, logprobs, lo, hi, finished) if self._stream_seqs else None
        if finished:
            self._retire(list(finished), list(finished.values()))
        if streamed:  # joining the call of the request's finished samples, if any
            for group, batch in streamed.items():
                group.outbox.call(group.stream, batch)  # type: ignore[union-attr]
        for outbox in list(self._outboxes.values()):  # what comes later: calls of their own
            outbox.end_pass()

    def _marked_rows(self, lo: int, hi: int) -> dict[int, dict[str, Any]]:
        """The rows among ``lo..hi`` of seqs aborted while an ``in_place`` pause held them
        (``_to_finish``), with the reason they end with now."""
        return {s.slot: dict(ABORTED_RUNNING) for s in self._to_finish if lo <= s.slot < hi}

    @staticmethod
    def _may_stop(seq: _Seq) -> bool:
        """SGLang's ``Req.check_match_stop_str_prefix``: a running sequence's chunk waits while
        the text of its last tokens ends in the start of one of its stop strings (it may be
        cut there yet)."""
        text = seq.tail_text  # "" without stop strings
        if not text:
            return False
        for stop in seq.inp.params.stop:
            if stop and (
                stop in text
                or any(text.endswith(stop[:i]) for i in range(1, min(len(text), len(stop)) + 1))
            ):
                return True
        return False

    def _streamed(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lo: int,
        hi: int,
        finished: dict[int, dict[str, Any]],
    ) -> dict[_Group, list[tuple[int, Any]]]:
        """The events due to each streamed request after this step: the tokens just sampled
        for its rows among ``lo..hi`` that go on (``finished``: the rows that end here, whose
        result carries the token). As SGLang 0.5 decides (``OutputStreamer.accept``): with an
        interval ``k`` of 1 after every token, else after the first and whenever ``k`` or more
        are unsent (meanwhile a row's tokens wait in its ``held``); a row whose text may be
        ending in one of its stop strings waits too (``_may_stop``)."""
        seqs = [s for s in self._stream_seqs if lo <= s.slot < hi]
        if not seqs:
            return {}
        new, lps, version = tokens.tolist(), logprobs.tolist(), self._version
        default_every = self.stream_interval
        offset = None if self.metrics is None else self.metrics.offset
        events: dict[_Group, list[tuple[int, Any]]] = {}
        for seq in seqs:
            if seq.slot in finished:
                continue
            k = seq.slot - lo
            event = (new[k], lps[k], version, seq.top[-1] if seq.top else None, seq.cached,
                     seq.input_lps, seq.input_tops, seq.picked[-1] if seq.picked else None,
                     seq.input_picked, seq.masks[-1] if seq.masks else None, seq.retractions,
                     None if offset is None
                     else scheduler_stats(seq.admitted, seq.first_token, seq.queue_time, offset),
                     None if seq.hidden is None else _hidden_news(seq))  # fmt: skip
            every = seq.inp.params.stream_interval or default_every
            held = seq.held
            if every == 1 and not held and not seq.tail_text:  # the usual case: this token
                batch = [(seq.index, event)]
                seq.sent += 1
            else:
                held.append(event)
                if not (every == 1 or len(held) >= every or seq.sent == 0) or (
                    seq.tail_text and self._may_stop(seq)
                ):
                    continue
                batch = [(seq.index, held_event) for held_event in held]
                seq.sent += len(held)
                seq.held = []
            out = events.get(seq.group)
            if out is None:
                events[seq.group] = batch
            else:
                out += batch
        return events

    def _stop_string_rows(self, watched: list[tuple[_Seq, int]]) -> dict[int, dict[str, Any]]:
        """The rows among ``watched`` (each with the token it just drew) whose text now ends
        in one of their stop strings, else patterns, with their finish reasons."""
        assert self._decode_tail is not None
        found: dict[int, dict[str, Any]] = {}
        for seq, token in watched:
            if seq.tail is None:
                continue
            params = seq.inp.params
            seq.tail.append(token)
            if len(seq.tail) > params.stop_window:
                del seq.tail[: -params.stop_window]
            text = seq.tail_text = self._decode_tail(seq.tail)
            matched = next((stop for stop in params.stop if stop in text), None)
            if matched is None:  # then the patterns (stages.engine.stop_regex)
                matched = next((p for p in params.stop_regex if re.search(p, text)), None)
            if matched is not None:
                found[seq.slot] = {"type": "stop", "matched": matched}
        return found

    def _constrain(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """Before sampling rows ``lo..hi``: what each constrained row's grammar does not allow
        next gets ``-inf`` (stages.engine.grammar), and so do a thinking row's excluded tags,
        or all but its end tag's next token once it has thought its budget, under strict
        thinking. A row whose grammar allows nothing is marked to be aborted once this step's
        tokens are in."""
        seqs, constraints, free, forced, ends = [], [], [], [], []
        for seq in self._constrained:
            if not lo <= seq.slot < hi:
                continue
            if seq.thinking is None:
                seqs.append(seq.slot - lo)
                constraints.append(seq.constraint)
            elif seq.budget is not None:
                if seq.budget < 0 or seq.thought < seq.budget:
                    free.append(seq.slot - lo)
                else:
                    forced.append(seq.slot - lo)
                    ends.append(self._think_end(seq)[seq.thinking])
        if free or forced:
            self.strict_thinking.mask(logits, free, forced, ends)  # type: ignore[union-attr]
        if seqs:
            assert self._grammars is not None
            self._grammars.constrain(logits, seqs, constraints)  # type: ignore[arg-type]

    def _advance_grammars(
        self, tokens: torch.Tensor, lo: int, hi: int
    ) -> dict[int, dict[str, Any]]:
        """Each constrained row among ``lo..hi`` takes the token it drew; the rows its grammar
        ends (an EOS token after it is complete, as with ``ignore_eos``) or cannot take it,
        with their finish reasons."""
        found: dict[int, dict[str, Any]] = {}
        new = None
        thought: list[_Seq] = []  # seqs that end their thinking and follow no grammar
        for seq in self._constrained:
            if not lo <= seq.slot < hi:
                continue
            if new is None:
                new = tokens.tolist()
            token = new[seq.slot - lo]
            constraint = seq.constraint
            if seq.thinking is not None:  # reasoning: free until its end's tokens are drawn
                end = self._think_end(seq)
                seq.thought += 1
                seq.thinking = _matched(end, seq.thinking, token)
                if seq.thinking == len(end):
                    seq.thinking = None
                    if constraint is None:
                        thought.append(seq)
                continue
            assert constraint is not None
            if constraint.stuck:
                error: str | None = "the grammar allows no token of this model's vocabulary here"
            else:
                error = constraint.accept(token)
            if error is not None:
                found[seq.slot] = {"type": "abort", "message": f"grammar: {error}"}
            elif constraint.terminated:
                found[seq.slot] = {"type": "stop", "matched": token}
        self._constrained.difference_update(thought)
        return found

    def _finished_rows(
        self, tokens: torch.Tensor, lo: int, hi: int, column: int
    ) -> dict[int, dict[str, Any]]:
        """The rows among ``lo..hi`` that drew a stop token or reached their length limit,
        with their finish reasons (a stop token first, as SGLang 0.5 orders them)."""
        done, by_token = self._sampler.finished(tokens, lo, hi, column)
        if not bool(done.any()):
            return {}
        offsets = done.nonzero()[:, 0]
        rows = (offsets + lo).tolist()
        stopped = by_token.index_select(0, offsets).tolist()
        matched = tokens.index_select(0, offsets).tolist()
        found: dict[int, dict[str, Any]] = {}
        for row, stop, tok in zip(rows, stopped, matched, strict=True):
            if stop:
                found[row] = {"type": "stop", "matched": tok}
            else:
                length = self._running[row].inp.params.max_new_tokens
                found[row] = {"type": "length", "length": length}
        return found

    # ---- leaving (scheduler thread) --------------------------------------------------------

    def _outputs(self, seqs: Sequence[_Seq]) -> list[tuple[list[int], list[float], list[str]]]:
        """Each running seq's whole output so far: token ids, log-probs, versions."""
        first = min(s.first for s in seqs)
        ids, lps = self._kv.row_track([s.slot for s in seqs], first)
        last = self._kv.end
        out = []
        for seq, row_ids, row_lps in zip(seqs, ids, lps, strict=True):
            cut = seq.first - first
            new_ids, new_lps = row_ids[cut:], row_lps[cut:]
            versions = self._versions(seq.first, last)
            if seq.done_ids:
                new_ids = seq.done_ids + new_ids
                new_lps = seq.done_logprobs + new_lps
                versions = seq.done_versions + versions
            out.append((new_ids, new_lps, versions))
        return out

    def _materialize(self, seqs: Sequence[_Seq]) -> None:
        """Before a retraction: move each running seq's output into its Python lists."""
        for seq, (ids, lps, versions) in zip(seqs, self._outputs(seqs), strict=True):
            seq.done_ids, seq.done_logprobs, seq.done_versions = ids, lps, versions
            seq.slot = -1

    def outputs_so_far(self) -> dict[str, list[int]]:
        """Each running request's output ids so far, by rid: what a crash dump lists for the
        requests in flight (scheduler thread, after a failed step; {} where the rows cannot be
        read, a step having failed half-way)."""
        seqs = [seq for seq in self._running if seq.slot >= 0]
        if not seqs:
            return {}
        try:
            outputs = self._outputs(seqs)
        except Exception:  # a dump of what can be read: the engine goes on
            return {}
        return {seq.inp.rid: out[0] for seq, out in zip(seqs, outputs, strict=True)}

    def _retire(self, rows: list[int], reasons: list[dict[str, Any]]) -> None:
        seqs = [self._running[r] for r in rows]
        outputs = self._outputs(seqs)
        if self._prefix is not None:
            self._keep_prefixes(seqs, outputs, reasons)
        for seq, reason, (ids, lps, versions) in zip(seqs, reasons, outputs, strict=True):
            self._finish(seq, reason, ids, lps, versions)
        self._take_out(rows)

    def _take_out(self, rows: list[int]) -> None:
        """Take ``rows`` out of the batch, the last rows moving into their places."""
        holes, movers = self._kv.remove(rows)
        self._sampler.remove(holes, movers, rows)
        running = self._running
        for hole, mover in zip(holes, movers, strict=True):
            running[hole] = running[mover]
            running[hole].slot = hole
        del running[self._kv.rows :]

    def _keep_prefixes(
        self,
        seqs: Sequence[_Seq],
        outputs: list[tuple[list[int], list[float], list[str]]],
        reasons: Sequence[dict[str, Any]],
    ) -> None:
        """Leave the KV of finishing rows (still in their slots) to the prefix cache; a row of
        a session that holds its KV (``radix_sessions``), unless aborted, for that session."""
        assert self._prefix is not None
        sessions = self._radix_sessions
        self._room_for_states(self._kv.rows - len(seqs))  # their states go to the cache
        for seq, (ids, _, _), reason in zip(seqs, outputs, reasons, strict=True):
            if _own_kv(seq):
                continue  # an adapter's KV is no prefix of anyone else's
            # Every token but the last sampled one has its KV in columns kv_start..end-1.
            tokens = seq.inp.input_ids + ids[:-1]
            slot, start = seq.slot, seq.kv_start

            def kv_of(
                a: int, b: int, seq: _Seq = seq, slot: int = slot, start: int = start
            ) -> list[torch.Tensor]:
                return self._row_pieces(seq, slot, start, a, b)

            session = None
            if seq.session is not None and reason.get("type") != "abort":
                assert sessions is not None
                name, generation = seq.session
                if sessions.current(name) == generation:  # not closed since it was queued
                    session = name
            self._prefix.insert(
                _keyed(seq, tokens),
                kv_of,
                seq.stamp or self._stamp(),
                seq.inp.cache_namespace,
                session=session,
                # (its states are after every column it ran: they end its sequence only when
                # its tokens are those columns')
                state=self._row_states(slot) if self._kv.end - start == len(tokens) else None,
            )

    def _finish(
        self,
        seq: _Seq,
        reason: dict[str, Any],
        ids: list[int],
        logprobs: list[float],
        versions: list[str],
        *,
        live: str | None = None,
    ) -> None:
        """Hand ``seq``'s result over (``live``: the version an answer without tokens
        reports; default the live one)."""
        # one list per output token (an abort may come before a sampled token counts); a
        # prefill-only request's one: the distribution after its prompt (_score_prompts)
        kept = len(ids) or (1 if _next_wanted(seq) else 0)
        self._rids.pop(seq.inp.rid, None)
        for rows in self._watching():
            rows.discard(seq)
        self._to_finish.discard(seq)
        had_grammar = seq.constraint is not None
        seq.constraint = None
        seq.slot = -1
        extra = {} if seq.masks is None else mask_fields(seq.masks[:kept], seq.inp)
        hidden = hidden_answer(seq.hidden, seq.inp.hidden_states)
        if hidden is not None:  # a copy: the seq's list is not handed over
            extra["hidden_states"] = list(hidden)
        asked = seq.inp.routed_experts is not None  # (every row keeps them, with the flag)
        if asked and seq.routes and reason != ABORTED_WAITING:  # SGLang's tokenizer answers
            extra["routed_experts"] = _routed_answer(seq, len(ids))  # such an abort without
        now = time.perf_counter()
        if self.metrics is not None:  # --enable-metrics: recorded, and its time stats
            extra.update(
                self.metrics.finished(
                    prompt_tokens=len(seq.inp.input_ids),
                    completion_tokens=len(ids),
                    cached_tokens=seq.cached,
                    created=seq.started,
                    admitted=seq.admitted,
                    queue_time=seq.queue_time,
                    first_token=seq.first_token,
                    now=now,
                    streamed=seq.group.stream is not None,
                    grammar=had_grammar,
                    finish=reason["type"],
                )
            )
        seq.group.done(
            seq.index,
            SequenceResult(
                rid=seq.inp.rid,
                prompt_tokens=len(seq.inp.input_ids),
                output_ids=ids,
                finish_reason=reason,
                weight_version=self._version if live is None else live,
                output_token_weight_versions=versions,
                output_token_logprobs=logprobs,
                cached_tokens=seq.cached,
                cached_weight_version=seq.cached_version,
                e2e_latency=round(now - seq.started, 6),
                output_top_logprobs=None if seq.top is None else seq.top[:kept],
                input_token_logprobs=seq.input_lps,
                input_top_logprobs=seq.input_tops,
                output_token_ids_logprobs=None if seq.picked is None else seq.picked[:kept],
                input_token_ids_logprobs=seq.input_picked,
                # as SGLang's scheduler counts them (Req.update_reasoning_tokens)
                reasoning_tokens=reasoning_tokens(ids, self._think_end(seq))
                if seq.inp.require_reasoning
                else reasoning_tokens(ids, self.think_end, self.think_start)
                if self.think_start
                else 0,
                retractions=seq.retractions,
                extra=extra,
            ),
        )

    def _versions(self, first: int, last: int) -> list[str]:
        """Per-token versions of output columns ``first..last`` of one stint.

        The token in column ``c`` was sampled by the decode step run at clock ``c - 1`` (the
        first one, by the prefill at clock ``first``), under the version live at that clock.
        """
        keys, vals = self._vkeys, self._vvals
        i = bisect.bisect_right(keys, first) - 1
        current, done = vals[i], 0
        out: list[str] = []
        for j in range(i + 1, len(keys)):
            if keys[j] > last - 1:
                break
            index = keys[j] + 1 - first  # the first token sampled under vals[j]
            out += [current] * (index - done)
            current, done = vals[j], index
        out += [current] * (last - first + 1 - done)
        return out

    def _prune_versions(self) -> None:
        # Spans older than every running row are never looked up again.
        if len(self._vkeys) < 64:
            return
        oldest = min((s.first for s in self._running), default=self._kv.end)
        keep = max(0, bisect.bisect_right(self._vkeys, oldest) - 1)
        del self._vkeys[:keep], self._vvals[:keep]


def _either(
    a: dict[int, dict[str, Any]] | None, b: dict[int, dict[str, Any]] | None
) -> dict[int, dict[str, Any]] | None:
    """Rows to abort from two sources (``a``'s reason first)."""
    if a is None or b is None:
        return a if b is None else b
    return {**b, **a}


def _matched(end: tuple[int, ...], matched: int, token: int) -> int:
    """How many of ``end``'s tokens the last tokens match, after ``token`` (``matched``
    before it): the longest start of ``end`` they finish with (SGLang's
    ``TokenSequenceMatcher.advance``)."""
    while True:
        if token == end[matched]:
            return matched + 1
        if matched == 0:
            return 0
        # the longest shorter start of end that its first `matched` tokens also end with
        matched = next(
            k for k in range(matched - 1, -1, -1) if end[:k] == end[matched - k : matched]
        )


def _passes(news: list[int]) -> list[list[int]]:
    """Contexts (by index) grouped into prefill passes: sorted by new tokens, a pass is cut
    where taking the next context would make padding more than half of it. Each pass lists
    its contexts in their first order."""
    parts: list[list[int]] = []
    part: list[int] = []
    total = 0
    for i in sorted(range(len(news)), key=news.__getitem__):
        if part and (len(part) + 1) * news[i] > 2 * (total + news[i]):
            parts.append(sorted(part))
            part, total = [], 0
        part.append(i)
        total += news[i]
    parts.append(sorted(part))
    return parts


# The hybrid families whose linear-attention layers go on from a kept state over several new
# tokens in transformers (a prefill on a cached prefix: held to whole forwards in
# tests/stages/test_engine_linear_attention.py). Jamba's Mamba scan starts from zeros whatever
# the cache holds (transformers' own note in ``modeling_jamba``), so its prefix cache stays off.
_CONTINUES_STATES = frozenset(
    {
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_next",
        "lfm2",
        "lfm2_moe",
        "granitemoehybrid",
        "nemotron_h",
        "bamba",
        "olmo_hybrid",
        "falcon_h1",
        "kimi_linear",
    }
)


def _unpadded_after_states(
    parts: list[list[int]], news: list[int], cached: list[int]
) -> list[list[int]]:
    """``parts`` (``_passes``) split so that a context on a cached prefix (``cached`` > 0: a
    linear-attention model's kept states) is padded nowhere: it shares a pass only with
    contexts of as many new tokens as it has. Left padding before the first token of a row
    without a prefix runs through zero states and leaves them zero; after a kept state it
    would run through that state."""
    out: list[list[int]] = []
    for part in parts:
        fresh = [i for i in part if not cached[i]]
        by_length: dict[int, list[int]] = {}
        for i in part:
            if cached[i]:
                by_length.setdefault(news[i], []).append(i)
        out += ([fresh] if fresh else []) + list(by_length.values())
    return out


def _new_tokens(
    contexts: list[list[int]], cached: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, positions) of what each context has after its cached prefix, left-padded."""
    news = [len(c) - p for c, p in zip(contexts, cached, strict=True)]
    width = max(news)
    ids = torch.zeros((len(contexts), width), dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, (ctx, p, n) in enumerate(zip(contexts, cached, news, strict=True)):
        ids[row, width - n :] = torch.tensor(ctx[p:])
        mask[row, width - n :] = 1
    positions = (torch.tensor(cached)[:, None] + mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _on_prefixes(
    contexts: list[list[int]], cached: list[int], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a pass on top of cached prefixes (``BatchKV.past``: right-aligned, ``max(cached)``
    columns): the mask over past and new tokens, the whole contexts right-aligned (what the
    rows hold once admitted), and ``_closing_columns``."""
    before = max(cached)
    offsets = torch.tensor(cached)
    known = torch.arange(before)[None, :] >= (before - offsets)[:, None]
    width = max(len(c) for c in contexts)
    full = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, ctx in enumerate(contexts):
        full[row, width - len(ctx) :] = torch.tensor(ctx)
    news = torch.tensor([len(c) for c in contexts]) - offsets
    columns = _closing_columns(offsets, news, before, mask.shape[1], width)
    return torch.cat((known.long(), mask), 1), full, columns


def _closing_columns(
    cached: torch.Tensor, new: torch.Tensor, before: int, width: int, total_width: int
) -> torch.Tensor:
    """For each row of a pass on top of cached prefixes (past ``[rows, before]``, right-aligned
    cached prefixes; new tokens ``[rows, width]``, left-padded), the column of past+new that
    column ``c`` of the right-aligned whole context comes from (padding: some past
    column, finite and masked)."""
    total = cached + new
    index = torch.arange(total_width)[None, :] - (total_width - total)[:, None]  # in the context
    column = torch.where(
        index < cached[:, None],
        before - cached[:, None] + index,  # the cached prefix: right-aligned in the past
        before + width - total[:, None] + index,  # the new tokens: right-aligned after it
    )
    return column.clamp(min=0)


def _mask_kind(model: torch.nn.Module) -> str:
    attn = getattr(model.config, "_attn_implementation", None)
    return {"sdpa": "bool4d", "eager": "additive4d"}.get(attn or "", "2d")


def _sliding_window(model: torch.nn.Module) -> tuple[int | None, bool]:
    """``(window, every layer slides)`` of the model's sliding-window layers (None: none):
    from its ``layer_types``, or without them (Mistral's) a ``sliding_window`` that is not
    turned off; ValueError for layers the engine cannot serve (linear attention...)."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:  # transformers then slides every layer on a window it is given
        on = isinstance(window, int) and getattr(config, "use_sliding_window", True) is not False
        return (window, True) if on else (None, False)
    kinds = set(types)
    other = kinds - {"full_attention", "sliding_attention", *STATE_LAYER_TYPES}
    if kinds & STATE_LAYER_TYPES:  # a hybrid's layers without attention: nothing to cache
        other -= CACHELESS_LAYER_TYPES
    if other:
        raise ValueError(
            f"layer types {sorted(other)} are not supported: the built-in engine serves "
            "full-attention, sliding-window and linear-attention layers"
        )
    if "sliding_attention" not in kinds:
        return None, False
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding-window layers without a window (sliding_window={window!r})")
    return window, kinds == {"sliding_attention"}


def _layer_masks(
    mask: torch.Tensor,
    window: int | None,
    all_slide: bool = False,
    state_types: list[str] | None = None,
) -> Any:
    """A decode step's attention mask as the model takes it: as it is for full attention;
    with sliding-window layers, a mask a layer type (transformers' mapping; ``all_slide``:
    the one mask), the sliding one keeping the last ``window`` columns (the query's and the
    ``window - 1`` before it: every row's tokens end at the same column, without gaps); in a
    mapping, linear-attention layers' (``state_types``) None, as transformers gives a decode
    step's (no padding among one token a row). A 2D mask goes as it is: transformers builds
    them all from it."""
    if window is None or mask.dim() != 4:
        return mask
    sliding, cut = mask, mask.shape[-1] - window
    if cut > 0:
        sliding = mask.clone()
        sliding[..., :cut] = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    if all_slide:
        return sliding
    masks: dict[str, Any] = {"full_attention": mask, "sliding_attention": sliding}
    masks.update(dict.fromkeys(set(state_types or ()) & STATE_LAYER_TYPES))
    return masks


def _capped_by_states(max_running: int, size: int) -> int:
    """The rows that ``--max-mamba-cache-size`` ``size`` lets run at once (a state each), in
    SGLang's words where it caps them (``kv_cache_configurator``) or leaves none."""
    if size < 1:
        raise ValueError(
            "Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
            f"max_mamba_cache_size={size}: give --max-mamba-cache-size >= 1"
        )
    if size < max_running:
        log.warning(
            "max_running_capped",
            max_running=size,
            why=f"max_running_requests is capped to {size} by the mamba state cache "
            f"(max_mamba_cache_size={size}, 1 state slot per request). To raise it: increase "
            "--max-mamba-cache-size.",
        )
    return min(max_running, size)


def _state_bounds(
    state_types: list[str] | None, size: int | None, ratio: float | None, max_running: int
) -> dict[str, Any]:
    """``PrefixCache``'s bounds on a linear-attention model's states (none for another
    model): ``--max-mamba-cache-size`` by count (less the rows running, as they run), else
    ``--mamba-full-memory-ratio`` (SGLang's default 0.9) of the cache's KV bytes; a model
    whose every layer keeps a state (no KV to measure them against) keeps as many as rows
    run."""
    if state_types is None:
        return {}
    if size is not None:
        return {"states": True, "max_states": size}
    if not any(t == "hybrid" or t not in _STATE_OR_CACHELESS for t in state_types):
        return {"states": True, "max_states": max_running}
    return {"states": True, "state_ratio": MAMBA_FULL_MEMORY_RATIO if ratio is None else ratio}


def _state_layer_types(model: torch.nn.Module) -> list[str] | None:
    """The ``layer_types`` of a model some of whose layers are linear attention
    (``STATE_LAYER_TYPES``); None: none are."""
    config = model.config.get_text_config(decoder=True)
    types = list(getattr(config, "layer_types", None) or ())
    return types if STATE_LAYER_TYPES.intersection(types) else None


def mask_fields(masks: Sequence[Support], inp: GenerateInput) -> dict[str, Any]:
    """SGLang's ``meta_info`` fields of a sample's sampling supports (``return_sampling_mask``):
    ``output_token_sampling_mask`` (each token's support), ``output_token_sampling_logprobs``
    (the drawn token's log-prob, or with ``sampling_logprobs_mode: support`` the support's)
    and ``output_token_sampling_mask_length``."""
    support = inp.sampling_mask == "support"
    return {
        "output_token_sampling_mask": [ids for ids, _, _ in masks],
        "output_token_sampling_logprobs": [lps if support else sel for _, lps, sel in masks],
        "output_token_sampling_mask_length": len(masks),
    }
