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

In-flight weight updates: ``apply_weights`` queues named tensors; the scheduler copies them
into the model at the next step boundary. Running rows keep their KV cache (computed by the
old weights) and go on; every token records the weight version live when it was sampled
(kept as spans over the step clock: a version change is one entry, not one per token).

Pause modes follow SGLang: ``abort`` (the default there) aborts everything in flight,
``retract`` drops the running rows' KV cache and puts them back in the queue (recomputed on
continue), ``in_place`` just stops stepping and keeps the cache. Weight updates and aborts
still run while paused. Not here: a prefix cache across requests, chunked prefill, preemption
on memory pressure, speculative decoding.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import structlog
import torch
from transformers import DynamicCache

from stages.engine.kv_batch import BatchKV
from stages.engine.llama_forward import LlamaForward
from stages.engine.model_weights import load_named_tensors
from stages.engine.protocol import GenerateInput, SequenceResult
from stages.engine.sampling import SlotSampler

__all__ = ["PAUSE_MODES", "Scheduler"]

PAUSE_MODES = ("abort", "retract", "in_place")

log = structlog.get_logger("stages.engine.scheduler")


class _Outbox:
    """Results bound for one asyncio loop, handed over with one wake-up per batch of them.

    ``concurrent.futures`` + ``asyncio.wrap_future`` cost a lock, a chain of callbacks and a
    ``call_soon_threadsafe`` per future; here a step that finishes several requests wakes the
    loop once, and the loop resolves their futures in its own thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
        with self.lock:
            self.items.append((future, value, exc))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _flush(self) -> None:
        with self.lock:
            items, self.items = self.items, []
            self.scheduled = False
        for future, value, exc in items:
            if future.done():  # cancelled: the client went away
                continue
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)


class _Group:
    """Requests submitted together; one future resolves with all their results, in order."""

    __slots__ = ("future", "outbox", "remaining", "results", "single")

    def __init__(self, size: int, single: bool, outbox: _Outbox | None = None) -> None:
        self.outbox = outbox
        self.future: Any = Future() if outbox is None else outbox.loop.create_future()
        self.results: list[SequenceResult | None] = [None] * size
        self.remaining = size
        self.single = single

    def done(self, index: int, result: SequenceResult) -> None:
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0:
            self._resolve(self.results[0] if self.single else self.results, None)

    def fail(self, exc: BaseException) -> None:
        if self.remaining > 0:
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
        "done_ids",
        "done_logprobs",
        "done_versions",
        "first",
        "generator",
        "group",
        "index",
        "inp",
        "slot",
        "started",
    )

    def __init__(self, inp: GenerateInput, group: _Group, index: int, started: float) -> None:
        self.inp = inp
        self.group = group
        self.index = index  # in the group
        seed = inp.params.sampling_seed
        # its own generator when sampling_seed is set
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.started = started
        # Outputs of earlier stints (before a retraction), already materialized.
        self.done_ids: list[int] = []
        self.done_logprobs: list[float] = []
        self.done_versions: list[str] = []
        self.slot = -1  # row in the running batch, -1 while waiting
        self.first = 0  # logical column of this stint's first output token

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
    ) -> None:
        # share of max_running that must be free before waiting requests join a running batch
        self.admit_fraction = admit_fraction
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.model = model.eval()
        _check_full_attention(model)
        self.device = next(model.parameters()).device
        self.max_running = max_running
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
        self._running: list[_Seq] = []  # index = slot
        self._kv = BatchKV(max_running, _mask_kind(model), device=self.device)
        # forward passes without transformers' module machinery where the model allows it
        self._fast, why = LlamaForward.build(model) if fast_forward else (None, "turned off")
        self.forward_path = "fast" if self._fast is not None else "transformers"
        self.forward_path_why = why
        self._sampler = SlotSampler(max_running, self.eos_token_ids, self._rng)
        self._paused = False
        self._rids: dict[str, _Seq] = {}
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        # Weight versions as spans over the step clock (BatchKV.end): version _vvals[i] is live
        # from clock _vkeys[i] on.
        self._vkeys: list[int] = [-1]
        self._vvals: list[str] = [self._version]
        self.steps = 0
        self.tokens_generated = 0

    # ---- thread-safe API -------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def counts(self) -> dict[str, int]:
        return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

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

    def submit_async(self, inputs: Sequence[GenerateInput]) -> asyncio.Future[Any]:
        """``submit_many`` for a caller on an asyncio loop: returns a future of that loop
        (call it from the loop's thread); results are handed over in batches."""
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = _Outbox(loop)
        return self._submit(list(inputs), single=False, outbox=outbox)

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Future[int]:
        """Abort one request by id (or all); resolves to how many were aborted.

        ``rid`` matches a sequence's own id or its ``group_rid`` (all samples of an ``n`` > 1
        request).
        """
        return self._call(lambda: self._abort({rid} if rid else set(), abort_all, "/abort_request"))

    def abort_many(self, rids: Iterable[str], message: str = "client went away") -> Future[int]:
        """Abort these request ids (one command)."""
        wanted = set(rids)
        return self._call(lambda: self._abort(wanted, False, message))

    def pause(self, mode: str = "abort") -> Future[None]:
        """Stop stepping after the current step; resolves once paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        """Continue after a pause; resolves once the scheduler steps again."""
        return self._call(self._resume)

    def apply_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int | None
    ) -> Future[None]:
        """Load tensors at the next step boundary; resolves once loaded (or with the error)."""
        return self._call(lambda: self._load(named_tensors, version))

    def set_weight_version(self, version: str | int) -> Future[None]:
        return self._call(lambda: self._set_version(str(version)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and end the scheduler thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- stepping --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: commands, admission, one decode step. True while work remains."""
        self._drain()
        if self._paused:
            return False
        self._admit()
        if self._running:
            self._decode()
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
        log.info("scheduler_started", max_running=self.max_running, device=str(self.device))
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    busy = self.step()
                except Exception as exc:
                    # A failing forward pass must not kill the engine: fail what was in flight.
                    log.exception("scheduler_step_failed", error=repr(exc))
                    self._fail_all(exc)
                    continue
                if not busy:
                    self._wake.wait()
                    self._wake.clear()
            self._drain()
            self._abort(set(), True, "engine shutting down")
        log.info("scheduler_stopped", steps=self.steps, tokens=self.tokens_generated)

    def _submit(
        self, inputs: list[GenerateInput], *, single: bool, outbox: _Outbox | None = None
    ) -> Any:
        group = _Group(len(inputs), single, outbox)
        now = time.perf_counter()
        seqs = [_Seq(inp, group, i, now) for i, inp in enumerate(inputs)]
        self._post(lambda: self._enqueue(seqs))
        return group.future

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
            seqs[0].group.fail(ValueError(f"rid: request id {busy[0]!r} is in flight"))
            return
        for seq in seqs:
            self._rids[seq.inp.rid] = seq
        self._waiting.extend(seqs)

    def _abort(self, rids: set[str], abort_all: bool, message: str) -> int:
        def hit(seq: _Seq) -> bool:
            return abort_all or seq.inp.rid in rids or seq.inp.group_rid in rids

        reason = {"type": "abort", "message": f"aborted by {message}"}
        waiting = [s for s in self._waiting if hit(s)]
        if waiting:
            self._waiting = collections.deque(s for s in self._waiting if not hit(s))
            for seq in waiting:
                self._finish(seq, reason, seq.done_ids, seq.done_logprobs, seq.done_versions)
        rows = [s.slot for s in self._running if hit(s)]
        if rows:
            self._retire(rows, [reason] * len(rows))
        count = len(waiting) + len(rows)
        if count:
            log.info("requests_aborted", rids=sorted(rids)[:8], abort_all=abort_all, count=count)
        return count

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(set(), True, "/pause_generation")
        elif mode == "retract" and self._running:
            # Back to the head of the queue, in order; the KV cache is recomputed on continue.
            self._materialize(self._running)
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._kv.clear()
            self._sampler.clear()
        self._paused = True
        log.info("generation_paused", mode=mode, **self.counts())

    def _resume(self) -> None:
        self._paused = False
        log.info("generation_continued", **self.counts())

    def _load(
        self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int | None
    ) -> None:
        start = time.perf_counter()
        count = load_named_tensors(self.model, named_tensors)
        if version is not None:
            self._set_version(str(version), quiet=True)
        log.debug(  # every update: `--log-level debug` (or the run's log_level) to see them
            "weights_applied",
            version=self._version,
            tensors=count,
            seconds=round(time.perf_counter() - start, 4),
            running=len(self._running),
        )

    def _set_version(self, version: str, *, quiet: bool = False) -> None:
        if version != self._version:
            clock = self._kv.end
            if self._vkeys[-1] == clock:
                self._vvals[-1] = version
            else:
                self._vkeys.append(clock)
                self._vvals.append(version)
            self._version = version
            self._prune_versions()
        if not quiet:
            log.debug("weight_version_set", weight_version=version)

    def _fail_all(self, exc: Exception) -> None:
        seqs = list(self._waiting) + self._running
        self._waiting.clear()
        self._running = []
        self._kv.clear()
        self._sampler.clear()
        self._rids.clear()
        for seq in seqs:
            seq.group.fail(exc)

    # ---- model passes (scheduler thread) ---------------------------------------------------

    def _admit(self) -> None:
        free = self.max_running - len(self._running)
        # Admit in batches: one prefill of many prompts costs far less than many prefills of
        # one. So while rows are decoding, wait until a share of the slots is free (unless
        # everything waiting fits already).
        if (
            self._running
            and free < self.admit_fraction * self.max_running
            and len(self._waiting) > free
        ):
            return
        group: list[_Seq] = []
        while self._waiting and len(group) < free:
            seq = self._waiting.popleft()
            if seq.inp.params.max_new_tokens - len(seq.done_ids) <= 0:
                reason = {"type": "length", "length": seq.inp.params.max_new_tokens}
                self._finish(seq, reason, seq.done_ids, seq.done_logprobs, seq.done_versions)
            else:
                group.append(seq)
        if group:
            self._prefill(group)

    def _prefill(self, group: list[_Seq]) -> None:
        # Identical contexts (the samples of one prompt) are prefilled once.
        unique: dict[tuple[int, ...], int] = {}
        contexts: list[list[int]] = []
        source: list[int] = []
        for seq in group:
            ctx = seq.context
            key = tuple(ctx)
            idx = unique.get(key)
            if idx is None:
                idx = unique[key] = len(contexts)
                contexts.append(ctx)
            source.append(idx)
        width = max(len(c) for c in contexts)
        ids = torch.zeros((len(contexts), width), dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):
            ids[row, width - len(ctx) :] = torch.tensor(ctx)
            mask[row, width - len(ctx) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        if self._fast is not None:
            cache, logits = self._fast.prefill(ids, mask, positions)
        else:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=DynamicCache(),
                use_cache=True,
                logits_to_keep=1,
            )
            cache, logits = out.past_key_values, out.logits[:, -1, :]
        dup = len(contexts) < len(group)
        src = torch.tensor(source, device=self.device) if dup else None
        lengths = torch.tensor([len(contexts[i]) for i in source])
        lo, hi = self._kv.admit(cache, ids, lengths, src)
        end = self._kv.end
        for offset, seq in enumerate(group):
            seq.slot = lo + offset
            seq.first = end
        self._running.extend(group)
        self._sampler.add(
            [s.inp.params for s in group],
            [end + s.inp.params.max_new_tokens - len(s.done_ids) - 1 for s in group],
            [s.generator for s in group],
        )
        if src is not None:
            logits = logits.index_select(0, src)
        tokens, logprobs = self._sampler.sample(logits, lo, hi)
        self._kv.set_pending(lo, hi, tokens, logprobs)
        self.tokens_generated += hi - lo
        self._check_finished(tokens, lo, hi, end)

    def _decode(self) -> None:
        kv = self._kv
        ids, positions, mask = kv.decode_inputs()
        if self._fast is not None:
            logits = self._fast.decode(ids, positions, mask, kv)
        else:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=kv.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :]
        self.steps += 1
        rows = kv.rows
        tokens, logprobs = self._sampler.sample(logits, 0, rows)
        kv.push(tokens, logprobs)
        self.tokens_generated += rows
        self._check_finished(tokens, 0, rows, kv.end)

    def _check_finished(self, tokens: torch.Tensor, lo: int, hi: int, column: int) -> None:
        done = self._sampler.finished(tokens, lo, hi, column)
        if not bool(done.any()):
            return
        offsets = done.nonzero()[:, 0]
        rows = (offsets + lo).tolist()
        at_limit = (self._sampler.limit[lo:hi].index_select(0, offsets) <= column).tolist()
        matched = tokens.index_select(0, offsets).tolist()
        reasons: list[dict[str, Any]] = []
        for row, limit, tok in zip(rows, at_limit, matched, strict=True):
            # SGLang's order: the length limit first, then token stops.
            if limit:
                length = self._running[row].inp.params.max_new_tokens
                reasons.append({"type": "length", "length": length})
            else:
                reasons.append({"type": "stop", "matched": tok})
        self._retire(rows, reasons)

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

    def _retire(self, rows: list[int], reasons: list[dict[str, Any]]) -> None:
        seqs = [self._running[r] for r in rows]
        for seq, reason, (ids, lps, versions) in zip(
            seqs, reasons, self._outputs(seqs), strict=True
        ):
            self._finish(seq, reason, ids, lps, versions)
        holes, movers = self._kv.remove(rows)
        self._sampler.remove(holes, movers, rows)
        running = self._running
        for hole, mover in zip(holes, movers, strict=True):
            running[hole] = running[mover]
            running[hole].slot = hole
        del running[self._kv.rows :]

    def _finish(
        self,
        seq: _Seq,
        reason: dict[str, Any],
        ids: list[int],
        logprobs: list[float],
        versions: list[str],
    ) -> None:
        self._rids.pop(seq.inp.rid, None)
        seq.slot = -1
        seq.group.done(
            seq.index,
            SequenceResult(
                rid=seq.inp.rid,
                prompt_tokens=len(seq.inp.input_ids),
                output_ids=ids,
                finish_reason=reason,
                weight_version=self._version,
                output_token_weight_versions=versions,
                output_token_logprobs=logprobs,
                e2e_latency=round(time.perf_counter() - seq.started, 6),
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


def _mask_kind(model: torch.nn.Module) -> str:
    attn = getattr(model.config, "_attn_implementation", None)
    return {"sdpa": "bool4d", "eager": "additive4d"}.get(attn or "", "2d")


def _check_full_attention(model: torch.nn.Module) -> None:
    config = model.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"}:
        raise ValueError(
            f"layer types {sorted(kinds - {'full_attention'})} are not supported: the built-in "
            "engine serves full-attention models only"
        )
