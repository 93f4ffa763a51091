"""Three small stages that show the runtime end to end (``configs/example.yaml``).

``numbers`` emits ``count`` items, each a float32 array of ``dim`` random values; ``power``
raises each array to ``exponent`` (as many replicas as you like, each may take ``delay_s`` per
item to play a slow worker); ``summary`` collects everything, writes ``RUN_DIR/summary.json`` and
finishes when every upstream replica has finished. Arrays travel as zero-copy frames (torch
tensors would too: numpy keeps these stages light to start).

They are also the smallest template for a stage of your own: a ``Config`` dataclass, declared
ports, and ``setup``/``run``/``close`` coroutines.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.stage import NoConfig, Port, StageContext
from transport.message import Schema

ITEM = Schema("item", 1, {"id": "int", "values": "array"}, doc="one array to work on")


class Numbers:
    """Source: ``count`` items of ``dim`` random float32 values, seeded per replica."""

    @dataclass
    class Config:
        count: int = field(default=1000, metadata={"min": 0, "doc": "items to emit"})
        dim: int = field(default=16, metadata={"min": 1, "doc": "values per item"})

    inputs: dict[str, Port] = {}
    outputs = {"out": Port(ITEM, doc="the items")}

    def __init__(self, config: Config, ctx: StageContext) -> None:
        self.config, self.ctx = config, ctx

    async def setup(self) -> None:
        self.rng = np.random.default_rng(self.ctx.seed)

    async def run(self) -> None:
        out = self.ctx.outputs["out"]
        # replicas share the id space: replica r emits r, r + R, r + 2R, ...
        for i in range(self.ctx.replica, self.config.count, self.ctx.replicas):
            values = self.rng.random(self.config.dim, dtype=np.float32)
            await out.send("item", {"id": i, "values": values})
        self.ctx.log.info(
            "source_exhausted",
            emitted=len(range(self.ctx.replica, self.config.count, self.ctx.replicas)),
        )

    async def close(self) -> None:
        pass


class Power:
    """Worker: raises each item's values to ``exponent``."""

    @dataclass
    class Config:
        exponent: float = field(default=2.0, metadata={"doc": "power to raise values to"})
        delay_s: float = field(default=0.0, metadata={"min": 0.0, "doc": "work time per item"})

    inputs = {"items": Port(ITEM)}
    outputs = {"out": Port(ITEM)}

    def __init__(self, config: Config, ctx: StageContext) -> None:
        self.config, self.ctx = config, ctx
        self.done = 0

    async def setup(self) -> None:
        pass

    async def run(self) -> None:
        out = self.ctx.outputs["out"]
        async for msg in self.ctx.inputs["items"]:
            if self.config.delay_s:
                await asyncio.sleep(self.config.delay_s)  # stands in for real work
            values = np.power(msg.data["values"], np.float32(self.config.exponent))
            await out.send("item", {"id": msg.data["id"], "values": values})
            self.done += 1

    async def close(self) -> None:
        self.ctx.log.info("worker_closed", processed=self.done)


class Summary:
    """Sink: counts and sums what arrives, then writes ``RUN_DIR/summary.json``."""

    Config = NoConfig
    inputs = {"items": Port(ITEM)}
    outputs: dict[str, Port] = {}

    def __init__(self, config: NoConfig, ctx: StageContext) -> None:
        self.ctx = ctx
        self.ids: set[int] = set()
        self.duplicates = 0
        self.total = 0.0

    async def setup(self) -> None:
        self.started = time.monotonic()

    async def run(self) -> None:
        async for msg in self.ctx.inputs["items"]:
            item_id = msg.data["id"]
            if item_id in self.ids:
                self.duplicates += 1
            self.ids.add(item_id)
            self.total += float(msg.data["values"].sum())
        summary: dict[str, Any] = {
            "items": len(self.ids),
            "duplicates": self.duplicates,
            "max_id": max(self.ids, default=-1),
            "sum": self.total,
            "wall_s": round(time.monotonic() - self.started, 3),
        }
        (self.ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.ctx.log.info("summary_written", **summary)

    async def close(self) -> None:
        pass
