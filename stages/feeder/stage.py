"""The feeder stage: the head of the RL pipeline, it sends the task's prompts to the generators.

At setup it loads the ``train`` split of its source (``sources.py``: the arithmetic task, a
JSON-lines or Parquet file, a ``datasets`` folder), off the event loop so heartbeats go on. Then it
sends its prompts, epoch after epoch, each send waiting for downstream credit, so a slow
generator slows the feeder rather than filling queues. It returns (which ends its output with
end-of-stream) after ``epochs`` epochs or ``max_prompts`` prompts.

Order is a pure function of the options: with ``replicas: R`` replica ``r`` owns the prompts at
positions ``i % R == r`` (disjoint shards), and with ``shuffle`` it sends its shard in a
permutation seeded by ``seed`` and the epoch (not by the run seed), so every replica, rerun and
restart agrees on it (``feed_order``). ``max_prompts`` is split evenly between replicas.

Position. A replica's prompts form one sequence over all epochs (position ``k`` is epoch
``k // shard`` at index ``k % shard`` of that epoch's order). The feeder notes which positions the
generator has acknowledged as processed (once its group was processed downstream) and
keeps ``RUN_DIR/state/STAGE.R.json`` up to date (written whole and renamed into place at the end
of every event-loop turn that brought acknowledgements, so a kill loses none that arrived): every
position below ``next`` is processed, and ``acked_above`` lists those beyond. A
restarted replica (a crash, or ``inflight run --resume``) continues from there: it feeds again
only what was not acknowledged, so within an epoch every prompt is fed once. (Prompts already
in a generator's inbox when the feeder died are among those: the generator processes them and
acknowledges them to the feeder that is gone, so they may be fed once more.) A state file
written for other options (seed, shuffle, shard, replicas) is not used: the replica starts
afresh and says so. The same file tells the ledger what a replica that did not end cleanly still
held (``held_after_exit``): every position from ``next`` to ``reserved`` not acknowledged.

Not here: repeating a prompt within a group (the generator samples ``group_size`` completions
per prompt), and curricula or re-weighting of prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.stage import Port, StageContext
from stages.feeder.sources import SourceConfig, load_prompts
from stages.schemas import PROMPT

__all__ = ["Feeder", "FeederConfig", "feed_order"]

_RESERVE = 256  # positions claimed in the state file at a time (see ``held_uids``)


def _state_file(run_dir: Path, stage: str, replica: int) -> Path:
    return run_dir / "state" / f"{stage}.{replica}.json"


def _uid(stage: str, replica: int, position: int) -> str:
    return f"{stage}.{replica}:{position}"


@dataclass
class FeederConfig:
    source: SourceConfig = field(
        default_factory=SourceConfig, metadata={"doc": "where the prompts come from"}
    )
    epochs: int = field(
        default=1, metadata={"min": 0, "doc": "passes over the prompts (0 = until stopped)"}
    )
    shuffle: bool = field(default=True, metadata={"doc": "a new seeded order every epoch"})
    seed: int = field(
        default=0, metadata={"doc": "seeds the order (with the epoch); not the run seed"}
    )
    max_prompts: int = field(
        default=0, metadata={"min": 0, "doc": "stop after this many prompts in all (0 = no cap)"}
    )
    metrics_every_s: float = field(
        default=5.0, metadata={"min": 0.1, "doc": "how often to log the feeder's metrics"}
    )


def feed_order(
    count: int, epoch: int, *, seed: int, shuffle: bool, replica: int = 0, replicas: int = 1
) -> list[int]:
    """Positions (into the loaded prompts) that ``replica`` sends in ``epoch``, in order."""
    shard = list(range(replica, count, replicas))
    if shuffle:
        # a str seed is hashed the same way by every Python version and on every machine
        random.Random(f"feeder:{seed}:{epoch}").shuffle(shard)
    return shard


def _write_replacing(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, written beside it and renamed into place (a reader
    never sees half of it), its folder made if needed. The feeder writes its state at every
    loop turn that brought acknowledgements, a few thousand times in a default run: plain
    ``os`` calls take 67 us of CPU where ``pathlib``'s and a folder check every time took 173."""
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _share(total: int, replica: int, replicas: int) -> int:
    """Replica ``replica``'s part of ``total`` prompts (parts differ by at most one)."""
    return total // replicas + (1 if replica < total % replicas else 0)


class Feeder:
    Config = FeederConfig
    shares_process = True  # its work is on its event loop or threads: it may share a process
    inputs: dict[str, Port] = {}
    outputs = {"prompts": Port(PROMPT, doc="tokenized prompts, meta carries the answer")}

    def __init__(self, config: FeederConfig, ctx: StageContext) -> None:
        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.sent = 0  # prompts sent by this process
        self.epoch = 0
        self.bad = 0
        # position bookkeeping (see the module docstring)
        self.next = 0  # every position below it is processed
        self.acked_above: set[int] = set()  # processed positions >= next
        self._position_of: dict[int, int] = {}  # send sequence number -> position
        self._acked_early: set[int] = set()  # acknowledged before their send returned
        self._dirty = False
        self._save_pending = False  # a save is scheduled for the end of this loop turn
        self.position = 0  # the next position to send (or skip) in this process
        # positions below `reserved` may have been fed by an earlier process of this replica
        # (saved before any is sent, so a crash cannot outrun it)
        self.reserved = 0
        run_dir = getattr(ctx, "run_dir", None)
        self._state_path = _state_file(Path(run_dir), ctx.stage, ctx.replica) if run_dir else None

    async def setup(self) -> None:
        # reading and tokenizing a big file takes a while: keep the loop (heartbeats) free
        loaded = await asyncio.to_thread(
            load_prompts, self.config.source, "train", log=self.log, lazy=True
        )
        self.prompts = loaded.prompts
        self.bad = sum(loaded.bad.values())
        ctx = self.ctx
        self.budget = (
            _share(self.config.max_prompts, ctx.replica, ctx.replicas)
            if self.config.max_prompts
            else None
        )
        self.shard_size = len(range(ctx.replica, len(self.prompts), ctx.replicas))
        self._resume()
        out = ctx.outputs["prompts"]
        if hasattr(out, "on_ack"):
            out.on_ack(self._acked)
        self.log.info(
            "feeder_ready",
            prompts=len(self.prompts),
            shard=self.shard_size,
            epochs=self.config.epochs,
            shuffle=self.config.shuffle,
            max_prompts=self.budget,
            bad=self.bad,
        )

    async def run(self) -> None:
        if self.shard_size == 0:
            # more replicas than prompts: nothing is ours (never spin through empty epochs)
            self.log.warning("feeder_empty_shard", prompts=len(self.prompts))
            return
        try:
            reason = await self._feed()
        finally:
            self._save()
        self._metrics()
        self.log.info("feeder_done", reason=reason, sent=self.sent, epochs_done=self.epoch)

    async def _feed(self) -> str:
        """Send from position ``next`` on (skipping what was processed); returns why it ended."""
        out = self.ctx.outputs["prompts"]
        shard = self.shard_size
        next_metrics = time.monotonic() + self.config.metrics_every_s
        position, order, order_epoch = self.next, [], -1
        start, skipped = position, 0
        # prompts ready to go together: as many as one consumer has credit for (one batch)
        batch: list[tuple[int, dict[str, Any]]] = []
        room = 1
        while True:
            if batch and (len(batch) >= room or not self._batching(out)):
                await self._send(out, batch)
                batch = []
            self.epoch, index = divmod(position, shard)
            if index == 0 and position > start and self.epoch != order_epoch:
                self.log.info("epoch_done", epoch=self.epoch - 1, prompts=shard, sent=self.sent)
                order_epoch = -1  # logged once, whatever ends the feed here
            reason = self._end(position)
            if reason is not None:
                if batch:
                    await self._send(out, batch)
                return reason
            if self.epoch != order_epoch:
                order_epoch = self.epoch
                order = feed_order(
                    len(self.prompts),
                    self.epoch,
                    seed=self.config.seed,
                    shuffle=self.config.shuffle,
                    replica=self.ctx.replica,
                    replicas=self.ctx.replicas,
                )
            self.position = batch[0][0] if batch else position
            if position >= self.reserved:
                self.reserved = position + _RESERVE
                self._dirty = True
                self._save()  # before the send: a later process knows what may be out
            prompt = None
            if position not in self.acked_above:  # processed before a restart: not again
                prompt = self.prompts[order[index]]  # rendered now when the source is lazy
                if prompt is None:  # unusable after all: counted (and logged) by the source
                    self.bad += 1
                    self._processed(position)
                    skipped += 1
                    if skipped >= shard:  # a whole pass without one usable prompt
                        if batch:
                            await self._send(out, batch)
                        return "no_usable_prompts"
                    if batch:  # sent before the loop yields to others
                        await self._send(out, batch)
                        batch = []
                    await asyncio.sleep(0)  # the loop stays free through a run of bad ones
            if prompt is not None:
                skipped = 0
                if not batch:
                    room = max(1, out.room()) if self._batching(out) else 1
                batch.append((position, {**prompt, "uid": self._uid(position)}))
            position += 1
            if time.monotonic() >= next_metrics:
                self._metrics()
                next_metrics = time.monotonic() + self.config.metrics_every_s

    def _end(self, position: int) -> str | None:
        """Why the feed ends before ``position`` (None: it goes on)."""
        if self.budget is not None and position >= self.budget:
            return "max_prompts"
        if self.config.epochs and position // self.shard_size >= self.config.epochs:
            return "epochs"
        return None

    @staticmethod
    def _batching(out: Any) -> bool:
        return hasattr(out, "send_many")

    async def _send(self, out: Any, batch: list[tuple[int, dict[str, Any]]]) -> None:
        """``batch`` ([(position, prompt)], no more than one consumer has credit for) in one
        ``send_many``; each sent prompt goes in the ledger with nothing awaited between."""
        self.position = batch[0][0]
        prompts = [prompt for _, prompt in batch]
        if len(prompts) > 1:
            seqs = await out.send_many("prompt", prompts)
        else:
            seqs = [await out.send("prompt", prompts[0])]
        for (position, prompt), seq in zip(batch, seqs, strict=True):
            if isinstance(seq, int):
                if seq in self._acked_early:  # acknowledged before send_many returned
                    self._acked_early.discard(seq)
                    self._processed(position)
                else:
                    self._position_of[seq] = position
                self.ctx.ledger.fed(prompt["uid"])  # sent: in the ledger
            self.sent += 1
        self.position = batch[-1][0] + 1

    # ------------------------------------------------------------------ position
    def _acked(self, seq: int) -> None:
        position = self._position_of.pop(seq, None)
        if position is not None:
            self._processed(position)
        else:
            self._acked_early.add(seq)

    def _processed(self, position: int) -> None:
        """``position`` is done with: acknowledged, or skipped as unusable (never sent)."""
        if position < self.next:
            return
        self.acked_above.add(position)
        while self.next in self.acked_above:
            self.acked_above.discard(self.next)
            self.next += 1
        self._dirty = True
        if not self._save_pending:
            # one write for all the acknowledgements this loop turn brings (one credit grant
            # carries many): what was acknowledged is on disk before anything else runs here
            self._save_pending = True
            asyncio.get_running_loop().call_soon(self._save)

    def held_uids(self) -> list[str]:
        """For the ledger at the end: prompts an earlier process of this replica may have fed
        that this one has not sent again yet (it would, were the run to go on)."""
        return [
            self._uid(p)
            for p in range(max(self.position, self.next), self.reserved)
            if p not in self.acked_above
        ]

    @classmethod
    def held_after_exit(cls, run_dir: Path, stage: str, replica: int) -> list[str] | None:
        """For the ledger, when replica ``replica`` did not end cleanly: the prompts its next
        process would feed again (its saved state: positions from ``next`` up to ``reserved``
        not acknowledged; acknowledgements of the loop turn the process died in may be missing,
        so this errs on the side of too many). None when there is no usable state file."""
        try:
            state = json.loads(_state_file(run_dir, stage, replica).read_text())
            start, reserved = int(state["next"]), int(state.get("reserved", state["next"]))
            above = {int(k) for k in state["acked_above"]}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [_uid(stage, replica, p) for p in range(start, reserved) if p not in above]

    def _uid(self, position: int) -> str:
        return _uid(self.ctx.stage, self.ctx.replica, position)

    def _state_key(self) -> dict[str, Any]:
        return {
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "shard": self.shard_size,
            "replicas": self.ctx.replicas,
        }

    def _resume(self) -> None:
        """Continue from the position a previous process of this replica saved, if any."""
        if self._state_path is None or not self._state_path.exists():
            return
        try:
            state = json.loads(self._state_path.read_text())
            key, start = state["for"], int(state["next"])
            above = {int(k) for k in state["acked_above"]}
            reserved = int(state.get("reserved", start))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.log.warning("feeder_state_unusable", path=str(self._state_path), error=str(exc))
            return
        if key != self._state_key():
            self.log.warning(
                "feeder_state_ignored",
                path=str(self._state_path),
                reason=f"written for {key}, not {self._state_key()}: starting afresh",
            )
            return
        self.next, self.acked_above = start, {k for k in above if k > start}
        self.position, self.reserved = start, reserved
        self.log.info(
            "feeder_resumed",
            next=self.next,
            epoch=self.next // max(self.shard_size, 1),
            processed_beyond=len(self.acked_above),
        )

    def _save(self) -> None:
        self._save_pending = False
        if self._state_path is None or not self._dirty:
            return
        self._dirty = False
        state = {
            "for": self._state_key(),
            "next": self.next,
            "acked_above": sorted(self.acked_above),
            "reserved": self.reserved,
        }
        _write_replacing(self._state_path, json.dumps(state).encode())

    def _metrics(self) -> None:
        self.ctx.metrics(
            sent=self.sent,
            epoch=self.epoch,
            bad=self.bad,
            prompts=self.shard_size,
            processed_below=self.next,
        )

    async def close(self) -> None:
        self._save()  # acknowledgements that came after run() (while the outputs finished)
