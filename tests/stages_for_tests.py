"""Stages that misbehave on purpose, for the supervisor tests (used by dotted path)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

from pipeline.stage import Port
from stages.examples import ITEM
from stages.schemas import PROMPT, ROLLOUT, ROLLOUT_GROUP, SAMPLE_FIELDS, rollouts_of


class Crashy:
    """Forwards items; on its first start it raises at item ``crash_at`` (or hangs, or dies)."""

    @dataclass
    class Config:
        crash_at: int = 10
        how: str = "raise"  # raise | hang | segv

    inputs = {"items": Port(ITEM)}
    outputs = {"out": Port(ITEM)}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        pass

    async def run(self):
        out = self.ctx.outputs["out"]
        seen = 0
        async for msg in self.ctx.inputs["items"]:
            seen += 1
            if self.ctx.restarts == 0 and seen == self.config.crash_at:
                if self.config.how == "raise":
                    raise RuntimeError("crashing on purpose")
                if self.config.how == "hang":
                    time.sleep(3600)  # noqa: ASYNC251 -- blocks the loop on purpose: heartbeats stop
                os.kill(os.getpid(), signal.SIGSEGV)
            await out.send("item", msg.data)

    async def close(self):
        pass


class StopAfter:
    """Sink that asks the supervisor to end the run after ``items`` items."""

    @dataclass
    class Config:
        items: int = 20

    inputs = {"items": Port(ITEM)}
    outputs: dict = {}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        pass

    async def run(self):
        seen = 0
        async for _ in self.ctx.inputs["items"]:
            seen += 1
            if seen == self.config.items:
                self.ctx.request_stop(f"saw {seen} items")
                await self.ctx.stop_requested.wait()  # the supervisor ends the run

    async def close(self):
        self.ctx.log.info("stop_after_closed")


class Prompts:
    """Source of ``count`` prompts of ``length`` random token ids below ``vocab``."""

    @dataclass
    class Config:
        count: int = 8
        length: int = 6
        vocab: int = 64

    inputs: dict = {}
    outputs = {"out": Port(PROMPT)}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        pass

    async def run(self):
        import random

        rng = random.Random(self.ctx.seed)
        for i in range(self.config.count):
            ids = [rng.randrange(1, self.config.vocab) for _ in range(self.config.length)]
            await self.ctx.outputs["out"].send(
                "prompt", {"prompt_id": f"p{i}", "input_ids": ids, "meta": {"i": i}}
            )

    async def close(self):
        pass


class RolloutSink:
    """Takes rollouts (``delay_s`` each, to play a slow scorer) and writes what it saw."""

    @dataclass
    class Config:
        delay_s: float = 0.0

    inputs = {"rollouts": Port(ROLLOUT_GROUP, ROLLOUT)}
    outputs: dict = {}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx
        self.seen = []

    async def setup(self):
        pass

    async def run(self):
        import asyncio
        import json

        async for msg in self.ctx.inputs["rollouts"]:
            for d in rollouts_of(msg.data) if msg.kind == "rollout_group" else [msg.data]:
                self.seen.append(
                    {
                        "group_id": d["group_id"],
                        "sample_index": d["sample_index"],
                        "prompt_ids": d["prompt_ids"].tolist(),
                        "completion_ids": d["completion_ids"].tolist(),
                        "logprobs": d["sampler_logprobs"].tolist(),
                        "versions": d["versions"].tolist(),
                        "finish_reason": d["finish_reason"],
                        "meta": d["meta"],
                        "origin": d.get("origin"),
                    }
                )
            if self.config.delay_s:
                await asyncio.sleep(self.config.delay_s)
        (self.ctx.run_dir / "rollouts.json").write_text(json.dumps(self.seen))

    async def close(self):
        pass


class PromptsWithBad(Prompts):
    """``Prompts``, except that prompt number ``bad_index`` carries token id ``bad_id`` (pick one
    outside the engine's vocabulary to get a request the engine rejects with HTTP 400)."""

    @dataclass
    class Config:
        count: int = 8
        length: int = 6
        vocab: int = 64
        bad_index: int = 1
        bad_id: int = 100_000

    async def run(self):
        import random

        rng = random.Random(self.ctx.seed)
        for i in range(self.config.count):
            ids = [rng.randrange(1, self.config.vocab) for _ in range(self.config.length)]
            if i == self.config.bad_index:
                ids[-1] = self.config.bad_id
            await self.ctx.outputs["out"].send(
                "prompt", {"prompt_id": f"p{i}", "input_ids": ids, "meta": {"i": i}}
            )


class EngineRolloutSink(RolloutSink):
    """``RolloutSink`` that also records which engine served each rollout (``engine``)."""

    async def run(self):
        import asyncio
        import json

        async for msg in self.ctx.inputs["rollouts"]:
            for d in rollouts_of(msg.data) if msg.kind == "rollout_group" else [msg.data]:
                self.seen.append(
                    {
                        "group_id": d["group_id"],
                        "sample_index": d["sample_index"],
                        "completion_ids": d["completion_ids"].tolist(),
                        "finish_reason": d["finish_reason"],
                        "engine": d["engine"],
                        "meta": d["meta"],
                    }
                )
            if self.config.delay_s:
                await asyncio.sleep(self.config.delay_s)
        (self.ctx.run_dir / "rollouts.json").write_text(json.dumps(self.seen))


class GatedPrompts(Prompts):
    """``Prompts`` that sends the first ``hold_at`` prompts, then waits for the file
    ``RUN_DIR/<gate>`` to exist before sending the rest (a test opens the gate)."""

    @dataclass
    class Config:
        count: int = 8
        length: int = 6
        vocab: int = 64
        hold_at: int = 4
        gate: str = "go"

    async def run(self):
        import asyncio
        import random

        rng = random.Random(self.ctx.seed)
        gate = self.ctx.run_dir / self.config.gate
        for i in range(self.config.count):
            if i == self.config.hold_at:
                self.ctx.log.info("prompts_held", at=i)
                while not gate.exists():  # noqa: ASYNC110 -- a file the test creates
                    await asyncio.sleep(0.05)
            ids = [rng.randrange(1, self.config.vocab) for _ in range(self.config.length)]
            await self.ctx.outputs["out"].send(
                "prompt", {"prompt_id": f"p{i}", "input_ids": ids, "meta": {"i": i}}
            )


class PromptSink:
    """Takes prompts and writes ``RUN_DIR/prompts_seen.json``: one entry per prompt, in arrival
    order, with the replica that sent it (``sender``)."""

    @dataclass
    class Config:
        delay_s: float = 0.0  # per prompt: a slow consumer

    inputs = {"prompts": Port(PROMPT)}
    outputs: dict = {}

    def __init__(self, config, ctx):
        self.ctx = ctx
        self.delay_s = config.delay_s
        self.seen = []

    async def setup(self):
        pass

    async def run(self):
        import json

        async for msg in self.ctx.inputs["prompts"]:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            d = msg.data
            self.seen.append(
                {
                    "sender": msg.sender,
                    "prompt_id": d["prompt_id"],
                    "input_ids": list(d["input_ids"]),
                    "meta": d["meta"],
                }
            )
        (self.ctx.run_dir / "prompts_seen.json").write_text(json.dumps(self.seen))

    async def close(self):
        pass


from dataclasses import field  # noqa: E402 -- for the scorer's test stages below

from stages.schemas import SCORED_GROUP  # noqa: E402


class RolloutSource:
    """Emits the rollouts listed in its config, for the scorer tests.

    Each item: ``group``, ``index``, ``completion`` (text over the arithmetic task's characters,
    encoded one id a character, ``<eos>`` appended), and optionally ``size`` (group_size, 2),
    ``prompt`` (encoded into prompt_ids), ``meta`` (the prompt's meta) and ``short_versions``
    (a malformed rollout: ``versions`` one token short). An item with ``samples`` (a list of
    such items, or anything else to send as a malformed sample) goes as one ``rollout_group``
    of ``group`` and ``size``. With ``wait_for`` (``STAGE.REPLICA``)
    it starts once that replica has logged ``replica_started``; after ``hold_after`` items it
    waits ``hold_s`` seconds (so group timeouts can fire) before sending the rest.
    """

    @dataclass
    class Config:
        rollouts: list[dict] = field(default_factory=list)
        wait_for: str = ""
        hold_after: int = -1
        hold_s: float = 0.0

    inputs: dict = {}
    outputs = {"out": Port(ROLLOUT, ROLLOUT_GROUP)}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        pass

    async def run(self):
        import asyncio

        import numpy as np

        from stages.feeder.arithmetic import CHARS, EOS_ID

        def encode(text):
            return [CHARS.index(c) + 2 for c in text]

        def rollout(item):
            ids = np.asarray([*encode(item["completion"]), EOS_ID], dtype=np.int32)
            n = len(ids) - 1 if item.get("short_versions") else len(ids)
            return {
                "run_id": self.ctx.run_dir.name,
                "prompt_id": f"prompt-{item['group']}",
                "group_id": item["group"],
                "sample_index": item["index"],
                "group_size": item.get("size", 2),
                "prompt_ids": np.asarray(encode(item.get("prompt", "3+4=")), dtype=np.int32),
                "completion_ids": ids,
                "sampler_logprobs": np.full(len(ids), -0.5, dtype=np.float32),
                "versions": np.zeros(n, dtype=np.int32),
                "finish_reason": "stop",
                "engine": "fake",
                "timings": {"queued_s": 0.0, "generate_s": 0.01},
                "meta": item.get("meta"),
            }

        if self.config.wait_for:
            log = self.ctx.run_dir / "logs" / f"{self.config.wait_for}.jsonl"
            while not (log.exists() and '"replica_started"' in log.read_text()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        for i, item in enumerate(self.config.rollouts):
            if i == self.config.hold_after:
                await asyncio.sleep(self.config.hold_s)
            out = self.ctx.outputs["out"]
            if "samples" in item:
                group = rollout({**item, "index": 0, "completion": ""})
                group["samples"] = [
                    {k: v for k, v in rollout(x).items() if k in SAMPLE_FIELDS}
                    if isinstance(x, dict)
                    else x
                    for x in item["samples"]
                ]
                for k in SAMPLE_FIELDS:
                    del group[k]
                await out.send("rollout_group", group)
            else:
                await out.send("rollout", rollout(item))

    async def close(self):
        pass


class GroupSink:
    """Takes scored groups and writes ``RUN_DIR/groups.json`` (one entry per group)."""

    @dataclass
    class Config:
        pass

    inputs = {"groups": Port(SCORED_GROUP)}
    outputs: dict = {}

    def __init__(self, config, ctx):
        self.ctx = ctx
        self.seen = []

    async def setup(self):
        pass

    async def run(self):
        import json

        async for msg in self.ctx.inputs["groups"]:
            d = msg.data
            samples = [
                {
                    "sample_index": s["sample_index"],
                    "completion_ids": s["completion_ids"].tolist(),
                    "tokens": len(s["sampler_logprobs"]),
                    "timings": s["timings"],
                    "reward": s["reward"],
                    "reward_info": s["reward_info"],
                }
                for s in d["samples"]
            ]
            self.seen.append(
                {
                    "group_id": d["group_id"],
                    "prompt_id": d["prompt_id"],
                    "group_size": d["group_size"],
                    "prompt_ids": d["prompt_ids"].tolist(),
                    "meta": d["meta"],
                    "samples": samples,
                }
            )
        (self.ctx.run_dir / "groups.json").write_text(json.dumps(self.seen))

    async def close(self):
        pass


class GangMember:
    """A ``distributed`` stage: rank 1 fails on its first start, then the gang all-reduces.

    Each start appends ``{rank, world, port, restarts}`` to ``RUN_DIR/gang.jsonl``; on the
    restart every rank joins a real gloo group from the supervisor's environment and checks an
    all-reduce, then finishes.
    """

    Config = None  # replaced below (a dataclass)
    inputs: dict = {}
    outputs: dict = {}
    distributed = True

    def __init__(self, config, ctx):
        self.ctx = ctx

    async def setup(self):
        pass

    async def run(self):
        import asyncio

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        record = {"rank": rank, "world": world, "port": os.environ["MASTER_PORT"]}
        _append_line(self.ctx.run_dir / "gang.jsonl", {**record, "restarts": self.ctx.restarts})
        if self.ctx.restarts == 0:
            if rank == 1:
                await asyncio.sleep(0.5)
                raise RuntimeError("rank 1 fails on its first start")
            await asyncio.sleep(3600)  # rank 0 would wait in a collective: killed with the gang
        total = await asyncio.to_thread(_gang_all_reduce, rank, world)
        _append_line(self.ctx.run_dir / "gang.jsonl", {"rank": rank, "sum": total})

    async def close(self):
        pass


def _append_line(path, record: dict) -> None:
    import json

    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _gang_all_reduce(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t.item())
    finally:
        dist.destroy_process_group()


@dataclass
class _NoOptions:
    pass


GangMember.Config = _NoOptions


def scorer_pipeline(rollouts: list[dict], rewards: list[str], tokenizer_dir: object) -> str:
    """The YAML of a run in which ``RolloutSource`` sends ``rollouts`` to a scorer with
    ``rewards`` (each a YAML flow mapping) and the scored groups go to ``GroupSink``."""
    import json

    source = {"use": "tests.stages_for_tests:RolloutSource", "rollouts": rollouts}
    listed = "".join(f"\n      - {reward}" for reward in rewards)
    return f"""
run: {{name: rm}}
stages:
  source: {json.dumps(source)}
  scorer:
    use: scorer
    inputs: {{rollouts: source.out}}
    rewards:{listed}
    tokenizer: "{tokenizer_dir}"
    workers: 1
  sink:
    use: "tests.stages_for_tests:GroupSink"
    inputs: {{groups: scorer.groups}}
"""


def run_scorer(
    tmp_path: object,
    rollouts: list[dict],
    rewards: list[str],
    tokenizer_dir: object,
    timeout: float,
) -> tuple[object, dict[str, dict]]:
    """``inflight run`` of ``scorer_pipeline(rollouts, rewards, tokenizer_dir)`` under
    ``tmp_path``, which must succeed: its run folder and the scored groups by id."""
    import json
    from pathlib import Path

    from tests.pipeline.runs import run_inflight

    path, run_dir = Path(tmp_path) / "scorer.yaml", Path(tmp_path) / "run"
    path.write_text(scorer_pipeline(rollouts, rewards, tokenizer_dir))
    result = run_inflight("run", str(path), "--run-dir", str(run_dir), timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    groups = json.loads((run_dir / "groups.json").read_text())
    return run_dir, {g["group_id"]: g for g in groups}
