"""CPU microseconds per group of 4 samples in each piece of the rollout path, outside a run.

``bench/stage_cpu.py`` says what each stage costs per 256 samples in a whole run; this says
what that cost is made of, piece by piece, each driven alone on this process's CPU clock (the
run's pieces share one process and one GIL, so a profiler of the run cannot tell them apart
well: cProfile's wall times include GIL waits, and py-spy seems to put uvloop's own C time on
the last Python frame):

- ``hop``: a channel's cost per group for rollout-group-shaped messages (4 samples of 5 tokens
  with their token ids, log-probs and versions), producer and consumer together (send_many,
  delivery, the consumer's ``ack``, the producer's acknowledgement), in this process
  (``local``: what stages that share a process use) and over ZeroMQ ipc (``zmq``); each with one
  message per group and with ``--per-message`` groups in one message (the same groups, fewer
  sequence numbers, acknowledgements and frames). The difference is what several groups per
  message could save on that hop.
- ``scorer``: ``stages.scorer.stage.Scorer``'s own work per group (reading a ``rollout_group``
  message, checking and filing its samples, the reward call with ``exact_match`` in its event
  loop on the shipped model's tokenizer, building and encoding the ``scored_group`` messages as
  its Sender to a learner in another process does), its output port a stand-in that encodes
  what it is given and sends nothing.
- ``scorer_columns``: the same groups as ``rollout_batch`` messages of 16 groups (what the
  generator sends a scorer that takes them), packed outside the timing; each scoring call's
  groups go out as one encoded ``scored_batch``.
- ``generator``: ``stages.generator.stage.Generator`` driving its in-process engine on the
  shipped model (``launch.in_process``, 256 rows, as ``configs/default.yaml``): the CPU of the
  thread that runs the stage (gates, requests, results, groups), the engine's scheduler thread
  left out; its output port a stand-in that takes ``rollout_group`` messages as they are
  (``generator``), or ``rollout_batch`` ones (``generator_columns``: the packing counted).
- ``feeder``: ``stages.feeder.stage.Feeder`` sending the default task's prompts (each read and
  tokenized as it goes, its uid in the ledger, its position saved) to a stand-in consumer that
  acknowledges each on the next turn of the loop; the task's loading left out.
- ``learner``: what the learner's event loop does with a scored group, training left out: decode
  it from the frames the scorer sends (schema checked), ``Learner._samples_of`` (advantages,
  arrays, dedup), then its samples accounted as trained (ledger fates, the acknowledgement);
  ``learner_intake_columns``: the same groups as ``scored_batch`` messages of 16 groups.

    python bench/group_cost.py [--rounds 4] [--groups 2048] [--per-message 8]
        [--parts hop,feeder,scorer,generator,learner]

Prints one JSON line: per piece the median microseconds per group over the rounds, with min
and max, and per wire what several groups a message saved, paired within each round. Not
here: the supervisor, the engine's own threads, training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # run as a script: bench/transport.py would shadow the package

import numpy as np  # noqa: E402
import structlog  # noqa: E402
import zmq.asyncio  # noqa: E402

from bench.generator import _Quiet, _stats  # noqa: E402  (the generator bench's stand-ins)
from pipeline.ledger import LedgerReporter  # noqa: E402
from transport import Receiver, Schema, Sender, ipc_address  # noqa: E402
from transport.message import Message  # noqa: E402

MODEL = ROOT / "configs" / "models" / "arith-tiny"
GROUP = 4


def _group(i: int) -> dict[str, Any]:
    """A rollout group as the generator sends it (arrays as its engine results give them)."""
    return {
        "run_id": "bench",
        "prompt_id": f"p{i}",
        "group_id": f"p{i}/0a1b2c",
        "group_size": GROUP,
        "prompt_ids": np.arange(1, 7, dtype=np.int32),
        "samples": [
            {
                "sample_index": j,
                "completion_ids": np.array([5, 6, 7, 8, 2], dtype=np.int32),
                "sampler_logprobs": np.full(5, -0.5, dtype=np.float32),
                "versions": np.zeros(5, dtype=np.int32),
                "finish_reason": "stop",
                "engine": "http://127.0.0.1:1",
                "timings": {"queued_s": 0.001, "generate_s": 0.01},
            }
            for j in range(GROUP)
        ],
        "meta": {"answer": "12", "text": "5+7="},
        "uid": f"u{i}",
        "origin": "generator.0:bench",
    }


# ------------------------------------------------------------------------------------ hop
_ITEM = Schema("item", 1, {"groups": "list"})


async def _hop(groups: int, per_message: int, local: bool) -> float:
    """Process CPU seconds to hand ``groups`` groups over one channel, ``per_message`` a
    message, in batches of 16 groups (as the generator's ``send_many`` does)."""
    with tempfile.TemporaryDirectory(prefix="group_cost-") as scratch:
        return await _hop_in(scratch, groups, per_message, local)


async def _hop_in(scratch: str, groups: int, per_message: int, local: bool) -> float:
    ctx = zmq.asyncio.Context()
    address = ipc_address(scratch, "in")
    receiver = Receiver(
        "in", address, [_ITEM], capacity=64, expected_producers=["p.0"], ctx=ctx, ack="manual"
    )
    sender = Sender("out", [address], [_ITEM], identity="p.0", ctx=ctx, local=[local])
    await receiver.start()
    await sender.start()

    async def consume() -> None:
        async for msg in receiver:
            receiver.ack(msg)

    consumer = asyncio.create_task(consume())
    batches = [
        [
            {"groups": [_group(b * 16 + k + j) for j in range(per_message)]}
            for k in range(0, 16, per_message)
        ]
        for b in range(4)
    ]
    began = time.process_time()
    for b in range(groups // 16):
        await sender.send_many("item", batches[b % 4])
    await sender.aclose()
    await asyncio.wait_for(consumer, 120)
    spent = time.process_time() - began
    await receiver.aclose()
    ctx.destroy(0)
    return spent


# --------------------------------------------------------------------------------- scorer
class _Inbox:
    """The scorer's input port: ``groups`` rollout-group messages, 16 at a time, or (``columns``)
    one rollout_batch of 16 groups at a time."""

    def __init__(self, groups: int, columns: bool = False) -> None:
        from stages import rollout_batch

        self.messages = []
        if columns:
            for i in range(0, groups, 16):
                heads = [_group(k) for k in range(i, i + 16)]
                data = rollout_batch.pack(heads, "bench", GROUP, "generator.0:bench")
                self.messages.append(Message(kind="rollout_batch", data=data, version=1))
        else:
            for i in range(groups):
                self.messages.append(Message(kind="rollout_group", data=_group(i), version=2))
        for msg in self.messages:
            msg.sender = "generator.0"
        self.per_turn = 1 if columns else 16
        self.i = 0

    def __aiter__(self) -> _Inbox:
        return self

    async def __anext__(self) -> Message:
        if self.i >= len(self.messages):
            raise StopAsyncIteration
        if self.i % self.per_turn == 0:
            await asyncio.sleep(0)  # a burst ends: the scorer's loop turns
        self.i += 1
        return self.messages[self.i - 1]

    def ack(self, msg: Message) -> None:
        pass


class _Port:
    """An output port with unlimited credit (``rollout_batch`` and ``scored_batch`` messages
    only where ``columns``). ``encode``: it encodes what it sends, as a Sender to a consumer in
    another process does (the scorer's, to the learner); else it takes messages as they are."""

    def __init__(self, columns: bool = False, encode: bool = False) -> None:
        self.seq = self.samples = 0
        self.columns, self.encode = columns, encode

    def credit(self) -> int:
        return 1 << 30

    def room(self) -> int:
        return 1 << 30

    def sends(self, kind: str) -> bool:
        return self.columns or kind not in ("rollout_batch", "scored_batch")

    async def send(self, kind: str, data: dict[str, Any]) -> int:
        if self.encode:
            from transport.codec import encode

            encode(Message(kind=kind, data=data))
        self.seq += 1
        self.samples += (
            len(data["sample_index"]) if "sample_index" in data else len(data["samples"])
        )
        return self.seq

    async def send_many(self, kind: str, items: list[dict[str, Any]]) -> list[int]:
        if self.encode:
            from transport.codec import encode_batch

            encode_batch(kind, 2, items)
        seqs = []
        for item in items:
            self.seq += 1
            self.samples += len(item["samples"])
            seqs.append(self.seq)
        return seqs


class _PromptPort:
    """The feeder's output port: a consumer with 16 slots of credit that acknowledges every
    prompt on the next turn of the loop (as a generator does once its group went on)."""

    def __init__(self) -> None:
        self.seq = self.prompts = 0
        self.callbacks: list[Any] = []

    def room(self) -> int:
        return 16

    def on_ack(self, callback: Any) -> None:
        self.callbacks.append(callback)

    async def send(self, kind: str, data: dict[str, Any]) -> int:
        return (await self.send_many(kind, [data]))[0]

    async def send_many(self, kind: str, items: list[dict[str, Any]]) -> list[int]:
        seqs = list(range(self.seq + 1, self.seq + 1 + len(items)))
        self.seq += len(items)
        self.prompts += len(items)
        loop = asyncio.get_running_loop()
        for callback in self.callbacks:
            for seq in seqs:
                loop.call_soon(callback, seq)
        await asyncio.sleep(0)  # the consumer takes them
        return seqs


async def _feeder(groups: int) -> float:
    """The feeder's CPU seconds to send ``groups`` prompts of the default task (read, tokenized
    and put in the ledger as they go), its task loaded before."""
    from stages.feeder.arithmetic import ArithmeticConfig
    from stages.feeder.sources import SourceConfig
    from stages.feeder.stage import Feeder, FeederConfig

    source = SourceConfig(
        kind="arithmetic",
        tokenizer=str(MODEL),
        arithmetic=ArithmeticConfig(ops="+-", max_operand=99, eval_fraction=0.1),
    )
    port = _PromptPort()
    with tempfile.TemporaryDirectory(prefix="group_cost-") as scratch:
        ctx = SimpleNamespace(
            stage="feeder",
            replica=0,
            replicas=1,
            run_dir=Path(scratch),
            log=_Quiet(),
            outputs={"prompts": port},
            ledger=LedgerReporter(lambda payload: None),
            metrics=lambda **values: None,
        )
        feeder = Feeder(FeederConfig(source=source, epochs=0, max_prompts=groups), ctx)
        await feeder.setup()
        began = time.process_time()
        await feeder.run()
        spent = time.process_time() - began
    if port.prompts != groups:
        raise SystemExit(f"the feeder sent {port.prompts} prompts of {groups}")
    return spent


async def _learner_intake(groups: int, columns: bool = False) -> float:
    """The learner's CPU seconds to take ``groups`` scored groups as its event loop does: each
    decoded from the frames the scorer sends (schema checked), made into its samples
    (``Learner._samples_of``: advantages, arrays, the staleness and dedup bookkeeping), then
    accounted as trained (ledger fates, the group acknowledged). No training, no receiver.
    ``columns``: the groups come as ``scored_batch`` messages of 16."""
    from stages import rollout_batch
    from stages.learner.stage import Learner, LearnerConfig
    from stages.schemas import SCORED_BATCH, SCORED_GROUP
    from transport.codec import decode, encode

    scored = []
    for i in range(groups):
        data = _group(i)
        for sample in data["samples"]:
            sample["reward"] = float(sample["sample_index"] % 2)
            sample["reward_info"] = {"exact_match": sample["reward"]}
            sample["timings"] = {**sample["timings"], "score_s": 0.001}
        scored.append(data)
    if columns:
        messages = [
            Message(
                kind=SCORED_BATCH.kind,
                data=rollout_batch.pack(scored[i : i + 16], "bench", GROUP, None, scored=True),
            )
            for i in range(0, groups, 16)
        ]
    else:
        messages = [Message(kind=SCORED_GROUP.kind, data=d, version=2) for d in scored]
    frames = [[bytes(f) for f in encode(message)] for message in messages]
    acked = []
    ctx = SimpleNamespace(
        stage="learner",
        replica=0,
        replicas=1,
        log=_Quiet(),
        inputs={"groups": SimpleNamespace(ack=acked.append)},
        ledger=LedgerReporter(lambda payload: None),
    )
    learner = Learner(LearnerConfig(model=str(MODEL)), ctx)
    schemas = {SCORED_GROUP.kind: SCORED_GROUP, SCORED_BATCH.kind: SCORED_BATCH}
    began = time.process_time()
    for message_frames in frames:
        msg = decode(message_frames, schemas)
        for group in learner._parts_of(msg) if columns else [msg]:
            samples = learner._samples_of(group)
            learner._fates(samples, "trained", step=1)
            for sample in samples:
                learner._done_with(sample)
    spent = time.process_time() - began
    if len(acked) != len(messages):
        raise SystemExit(f"the learner acknowledged {len(acked)} messages of {len(messages)}")
    return spent


async def _scorer(groups: int, tokenizer: Any, columns: bool = False) -> float:
    from stages.scorer.runner import RewardRunner
    from stages.scorer.stage import RewardSpec, Scorer, ScorerConfig

    config = ScorerConfig(
        rewards=[RewardSpec("stages.scorer.rewards:exact_match")], tokenizer="", workers=0
    )
    port = _Port(columns, encode=True)
    ctx = SimpleNamespace(
        log=_Quiet(),
        inputs={"rollouts": _Inbox(groups, columns)},
        outputs={"groups": port},
        ledger=LedgerReporter(lambda payload: None),
        metrics=lambda **values: None,
    )
    scorer = Scorer(config, ctx)
    scorer.tokenizer = tokenizer
    scorer.failed = asyncio.get_running_loop().create_future()
    scorer.runner = RewardRunner(config.rewards, workers=0, log=_Quiet())
    await scorer.runner.start()
    began = time.process_time()
    await scorer._read()
    await asyncio.sleep(0)  # the last groups' scoring call starts on the next turn (_launch)
    while scorer._tasks:
        await asyncio.gather(*list(scorer._tasks))
    spent = time.process_time() - began
    if port.samples != groups * GROUP:
        raise SystemExit(f"the scorer sent {port.samples} samples of {groups * GROUP}")
    return spent


# ------------------------------------------------------------------------------ generator
class _Prompts:
    """The generator's input port, every prompt waiting (as in a run's full inbox)."""

    def __init__(self, prompts: list[dict[str, Any]]) -> None:
        self.prompts, self.i = prompts, 0

    def __aiter__(self) -> _Prompts:
        return self

    async def __anext__(self) -> SimpleNamespace:
        if self.i >= len(self.prompts):
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.take()

    def waiting(self) -> int:
        return len(self.prompts) - self.i

    def take(self) -> SimpleNamespace:
        self.i += 1
        return SimpleNamespace(data=self.prompts[self.i - 1], kind="prompt")

    def ack(self, msg: Any) -> None:
        pass


async def _generator(prompts: list[dict[str, Any]], columns: bool = False) -> float:
    with tempfile.TemporaryDirectory(prefix="group_cost-") as scratch:
        return await _generator_in(Path(scratch), prompts, columns)


async def _generator_in(scratch: Path, prompts: list[dict[str, Any]], columns: bool) -> float:
    """The generator's own thread's CPU seconds to turn ``prompts`` into rollout groups."""
    from stages.generator.controller import ControllerConfig
    from stages.generator.launcher import LaunchConfig
    from stages.generator.stage import Generator, GeneratorConfig, SamplingConfig

    config = GeneratorConfig(
        launch=LaunchConfig(
            kind="builtin",
            model=str(MODEL),
            in_process=True,
            extra_args=["--max-running", "256"],
        ),
        group_size=GROUP,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=5),
        max_lag=4,
        outbox=16,
        controller=ControllerConfig(start=256, max_in_flight=256),
    )
    port = _Port(columns)

    async def publish(topic: str, payload: dict[str, Any]) -> None:
        pass

    ctx = SimpleNamespace(
        stage="generator",
        replica=0,
        run_dir=scratch,
        log_dir=scratch,
        log_level="warning",
        mode="async",
        version=0,
        log=_Quiet(),
        inputs={"prompts": _Prompts(prompts)},
        outputs={"rollouts": port},
        metrics=lambda **values: None,
        ledger=LedgerReporter(lambda payload: None),
        publish=publish,
    )
    stage = Generator(config, ctx)
    await stage.setup()
    try:
        began = time.thread_time()  # this thread: the stage, not the engine's scheduler
        await stage.run()
        spent = time.thread_time() - began
    finally:
        await stage.close()
    if port.samples != len(prompts) * GROUP:
        raise SystemExit(f"the generator sent {port.samples} samples of {len(prompts) * GROUP}")
    return spent


def _prompts(tokenizer: Any, groups: int) -> list[dict[str, Any]]:
    from stages.feeder.arithmetic import ArithmeticConfig, problems

    rows = list(problems(ArithmeticConfig(ops="+-", max_operand=99), "train"))[:groups]
    return [
        {
            "prompt_id": f"p{i}",
            "input_ids": tokenizer(row.text)["input_ids"],
            "meta": {"answer": row.answer},
            "uid": f"u{i}",
        }
        for i, row in enumerate(rows)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2048, help="groups per round and piece")
    parser.add_argument("--per-message", type=int, default=8, help="groups a message (hop)")
    parser.add_argument("--parts", default="hop,feeder,scorer,generator,learner")
    args = parser.parse_args()
    if args.groups % 16 or 16 % args.per_message:
        raise SystemExit("--groups must be a multiple of 16, --per-message a divisor of 16")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    import uvloop
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    parts = args.parts.split(",")
    pieces: dict[str, Any] = {}
    if "hop" in parts:
        for wire in ("local", "zmq"):
            for per in (1, args.per_message):
                name = f"hop_{wire}_{per}_per_message"
                pieces[name] = lambda w=wire, p=per: asyncio.run(_hop(args.groups, p, w == "local"))
    if "feeder" in parts:
        pieces["feeder"] = lambda: uvloop.run(_feeder(args.groups))
    if "scorer" in parts:
        pieces["scorer"] = lambda: uvloop.run(_scorer(args.groups, tokenizer))
        pieces["scorer_columns"] = lambda: uvloop.run(_scorer(args.groups, tokenizer, True))
    if "learner" in parts:
        pieces["learner_intake"] = lambda: uvloop.run(_learner_intake(args.groups))
        pieces["learner_intake_columns"] = lambda: uvloop.run(_learner_intake(args.groups, True))
    if "generator" in parts:
        prompts = _prompts(tokenizer, args.groups)
        pieces["generator"] = lambda: uvloop.run(_generator(prompts))
        pieces["generator_columns"] = lambda: uvloop.run(_generator(prompts, True))
    for run in pieces.values():  # warm up: imports, the engine's first load
        run()
    per_group: dict[str, list[float]] = {name: [] for name in pieces}
    for r in range(args.rounds):  # pieces alternated, the order reversed every other round
        order = list(pieces) if r % 2 == 0 else list(reversed(pieces))
        for name in order:
            per_group[name].append(pieces[name]() / args.groups * 1e6)
    report = {
        "bench": "group_cost",
        "rounds": args.rounds,
        "groups": args.groups,
        "group_size": GROUP,
        "us_per_group": {name: _stats(values, 1) for name, values in per_group.items()},
    }
    if "hop" in parts:  # what batching saves, paired within each round (the machine drifts)
        report["us_saved_per_group"] = {
            wire: _stats(
                [
                    one - many
                    for one, many in zip(
                        per_group[f"hop_{wire}_1_per_message"],
                        per_group[f"hop_{wire}_{args.per_message}_per_message"],
                        strict=True,
                    )
                ],
                1,
            )
            for wire in ("local", "zmq")
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
