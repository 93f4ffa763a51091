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

Not here: resuming where a crashed replica stopped (a restarted feeder starts again at epoch 0;
what it had sent was already delivered), repeating a prompt within a group (the generator samples
``group_size`` completions per prompt), and curricula or re-weighting of prompts.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from pipeline.stage import Port, StageContext
from stages.feeder.sources import SourceConfig, load_prompts
from stages.schemas import PROMPT

__all__ = ["Feeder", "FeederConfig", "feed_order"]


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


def _share(total: int, replica: int, replicas: int) -> int:
    """Replica ``replica``'s part of ``total`` prompts (parts differ by at most one)."""
    return total // replicas + (1 if replica < total % replicas else 0)


class Feeder:
    Config = FeederConfig
    inputs: dict[str, Port] = {}
    outputs = {"prompts": Port(PROMPT, doc="tokenized prompts, meta carries the answer")}

    def __init__(self, config: FeederConfig, ctx: StageContext) -> None:
        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.sent = 0
        self.epoch = 0
        self.bad = 0

    async def setup(self) -> None:
        # reading and tokenizing a big file takes a while: keep the loop (heartbeats) free
        loaded = await asyncio.to_thread(load_prompts, self.config.source, "train", log=self.log)
        self.prompts = loaded.prompts
        self.bad = sum(loaded.bad.values())
        ctx = self.ctx
        self.budget = (
            _share(self.config.max_prompts, ctx.replica, ctx.replicas)
            if self.config.max_prompts
            else None
        )
        self.shard_size = len(range(ctx.replica, len(self.prompts), ctx.replicas))
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
        out = self.ctx.outputs["prompts"]
        epochs = self.config.epochs
        next_metrics = time.monotonic() + self.config.metrics_every_s
        reason = "epochs"
        while epochs == 0 or self.epoch < epochs:
            order = feed_order(
                len(self.prompts),
                self.epoch,
                seed=self.config.seed,
                shuffle=self.config.shuffle,
                replica=self.ctx.replica,
                replicas=self.ctx.replicas,
            )
            left = None if self.budget is None else self.budget - self.sent
            for position in order[:left]:
                await out.send("prompt", self.prompts[position])
                self.sent += 1
                if time.monotonic() >= next_metrics:
                    self._metrics()
                    next_metrics = time.monotonic() + self.config.metrics_every_s
            if left is not None and left < len(order):
                reason = "max_prompts"
                break
            self.log.info("epoch_done", epoch=self.epoch, prompts=len(order), sent=self.sent)
            self.epoch += 1
        self._metrics()
        self.log.info("feeder_done", reason=reason, sent=self.sent, epochs_done=self.epoch)

    def _metrics(self) -> None:
        self.ctx.metrics(sent=self.sent, epoch=self.epoch, bad=self.bad, prompts=self.shard_size)

    async def close(self) -> None:
        pass
