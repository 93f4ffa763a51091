"""Continuous batching over one model, with weight updates between two decode steps.

One scheduler thread owns the model and its batched KV cache (``kv_batch.BatchKV``) and loops:
apply queued control commands (new requests, aborts, pause/continue, weight updates), admit
waiting requests up to ``max_running`` (prefilled together, left-padded, then merged into the
running batch), run one decode step over every running row, retire the rows that finished.
Callers on other threads talk to it only through the thread-safe methods below, which return
``concurrent.futures.Future`` objects (``asyncio.wrap_future`` turns them into awaitables).

In-flight weight updates: ``apply_weights`` queues named tensors; the scheduler copies them
into the model at the next step boundary. Running rows keep their KV cache (computed by the
old weights) and go on; every token records the weight version live when it was sampled.

Pause modes follow SGLang: ``abort`` (the default there) aborts everything in flight,
``retract`` drops the running rows' KV cache and puts them back in the queue (recomputed on
continue), ``in_place`` just stops stepping and keeps the cache. Weight updates and aborts
still run while paused. Not here: prefix caching, chunked prefill, preemption on memory
pressure, speculative decoding.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from stages.engine.kv_batch import BatchKV
from stages.engine.model_weights import load_named_tensors
from stages.engine.protocol import GenerateInput, SequenceResult
from stages.engine.sampling import sample_next

__all__ = ["PAUSE_MODES", "Scheduler"]

PAUSE_MODES = ("abort", "retract", "in_place")

log = structlog.get_logger("stages.engine.scheduler")


@dataclass
class _Seq:
    inp: GenerateInput
    future: Future[SequenceResult]
    generator: torch.Generator
    tokens: list[int]  # prompt + output; the KV cache holds all but the last one
    started: float
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.inp.input_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


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
    ) -> None:
        # share of max_running that must be free before waiting requests join a running batch
        self.admit_fraction = admit_fraction
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.model = model.eval()
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
        self._running: list[_Seq] = []
        self._kv: BatchKV | None = None
        self._paused = False
        self._rids: set[str] = set()
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
        future: Future[SequenceResult] = Future()
        seq = _Seq(
            inp=inp,
            future=future,
            generator=(
                torch.Generator().manual_seed(inp.params.sampling_seed)
                if inp.params.sampling_seed is not None
                else self._rng
            ),
            tokens=list(inp.input_ids),
            started=time.perf_counter(),
        )
        self._post(lambda: self._enqueue(seq))
        return future

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Future[int]:
        """Abort one request by id (or all); resolves to how many were aborted."""
        return self._call(lambda: self._abort(rid, abort_all, "aborted by /abort_request"))

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
        self._abort(None, True, "engine shutting down")
        log.info("scheduler_stopped", steps=self.steps, tokens=self.tokens_generated)

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

    def _enqueue(self, seq: _Seq) -> None:
        if seq.inp.rid in self._rids:
            seq.future.set_exception(ValueError(f"rid: request id {seq.inp.rid!r} is in flight"))
            return
        self._rids.add(seq.inp.rid)
        self._waiting.append(seq)

    def _abort(self, rid: str | None, abort_all: bool, message: str) -> int:
        def hit(seq: _Seq) -> bool:
            return abort_all or seq.inp.rid == rid

        reason = {"type": "abort", "message": message}
        waiting = [s for s in self._waiting if hit(s)]
        self._waiting = collections.deque(s for s in self._waiting if not hit(s))
        for seq in waiting:
            self._finish(seq, reason)
        rows = [i for i, s in enumerate(self._running) if hit(s)]
        if rows:
            self._retire(rows, [reason] * len(rows))
        if waiting or rows:
            count = len(waiting) + len(rows)
            log.info("requests_aborted", rid=rid, abort_all=abort_all, count=count)
        return len(waiting) + len(rows)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, True, "aborted by /pause_generation")
        elif mode == "retract" and self._running:
            # Back to the head of the queue, in order; the KV cache is recomputed on continue.
            self._waiting.extendleft(reversed(self._running))
            self._running = []
            self._kv = None
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
            self._version = str(version)
        log.info(
            "weights_applied",
            version=self._version,
            tensors=count,
            seconds=round(time.perf_counter() - start, 4),
            running=len(self._running),
        )

    def _set_version(self, version: str) -> None:
        self._version = version
        log.info("weight_version_set", weight_version=version)

    def _fail_all(self, exc: Exception) -> None:
        seqs = list(self._waiting) + self._running
        self._waiting.clear()
        self._running = []
        self._kv = None
        for seq in seqs:
            self._rids.discard(seq.inp.rid)
            if not seq.future.done():
                seq.future.set_exception(exc)

    # ---- model passes (scheduler thread) ---------------------------------------------------

    def _admit(self) -> None:
        free = self.max_running - len(self._running)
        # Admit in batches: one prefill of many prompts costs far less than many prefills of
        # one, and every admission re-pads the running cache. So while rows are decoding, wait
        # until a share of the slots is free (unless everything waiting fits already).
        if (
            self._running
            and free < self.admit_fraction * self.max_running
            and len(self._waiting) > free
        ):
            return
        group: list[_Seq] = []
        while self._waiting and len(group) < free:
            seq = self._waiting.popleft()
            if seq.inp.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
            else:
                group.append(seq)
        if group:
            self._prefill(group)

    @torch.inference_mode()
    def _prefill(self, group: list[_Seq]) -> None:
        width = max(len(s.tokens) for s in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, seq in enumerate(group):
            ids[row, width - len(seq.tokens) :] = torch.tensor(seq.tokens)
            mask[row, width - len(seq.tokens) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        kv = BatchKV(out.past_key_values, mask)
        if self._kv is None or not self._running:
            self._kv = kv
        else:
            self._kv.merge(kv)
        self._running.extend(group)
        self._sample_and_retire(out.logits[:, -1, :], first_row=len(self._running) - len(group))

    @torch.inference_mode()
    def _decode(self) -> None:
        assert self._kv is not None
        ids = torch.tensor([[s.tokens[-1]] for s in self._running], device=self.device)
        positions = torch.tensor([[len(s.tokens) - 1] for s in self._running], device=self.device)
        mask = self._kv.step_mask()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self._kv.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.steps += 1
        self._sample_and_retire(out.logits[:, -1, :], first_row=0)

    def _sample_and_retire(self, logits: torch.Tensor, *, first_row: int) -> None:
        """Sample a token for running rows ``first_row..`` and retire those that finished."""
        seqs = self._running[first_row:]
        tokens, logprobs = sample_next(
            logits.float().cpu(), [s.inp.params for s in seqs], [s.generator for s in seqs]
        )
        done_rows: list[int] = []
        reasons: list[dict[str, Any]] = []
        for offset, (seq, tok, lp) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self._version)
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                done_rows.append(first_row + offset)
                reasons.append(reason)
        self.tokens_generated += len(seqs)
        if done_rows:
            self._retire(done_rows, reasons)

    def _finish_reason(self, seq: _Seq, tok: int) -> dict[str, Any] | None:
        # SGLang's order: the length limit first, then token stops (all off with ignore_eos).
        params = seq.inp.params
        if len(seq.tokens) - seq.prompt_len >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if not params.ignore_eos and (tok in params.stop_token_ids or tok in self.eos_token_ids):
            return {"type": "stop", "matched": tok}
        return None

    def _retire(self, rows: list[int], reasons: list[dict[str, Any]]) -> None:
        gone = set(rows)
        for row, reason in zip(rows, reasons, strict=True):
            self._finish(self._running[row], reason)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        if not self._running:
            self._kv = None
        elif self._kv is not None:
            self._kv.keep(keep)

    def _finish(self, seq: _Seq, reason: dict[str, Any]) -> None:
        self._rids.discard(seq.inp.rid)
        if seq.future.done():
            return
        seq.future.set_result(
            SequenceResult(
                rid=seq.inp.rid,
                prompt_tokens=seq.prompt_len,
                output_ids=seq.output_ids,
                finish_reason=reason,
                weight_version=self._version,
                output_token_weight_versions=list(seq.versions),
                output_token_logprobs=list(seq.logprobs),
                e2e_latency=round(time.perf_counter() - seq.started, 6),
            )
        )
