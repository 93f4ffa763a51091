"""The stage protocol: what a stage class provides and what the runtime hands it.

A stage is a class with a typed ``Config`` dataclass, declared input and output ports, and three
coroutines: ``setup`` (open resources), ``run`` (do the work; returning ends the replica) and
``close`` (always called, even after a failure or a shutdown request). The runtime builds it as
``StageClass(config, ctx)`` inside its own actor process; ``ctx`` gives it its ports, its logger
(with ``stage``, ``replica`` and ``version`` bound), the control bus and the run directory.

Nothing here starts processes or sockets: see ``pipeline.actor`` (one replica) and
``pipeline.supervisor`` (the whole run).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from transport.message import Schema

__all__ = ["NoConfig", "Port", "Stage", "StageContext", "stage_config_class", "stage_ports"]


@dataclass(frozen=True)
class Port:
    """A named stream of messages into or out of a stage.

    ``schemas`` are the kinds (with versions) that travel on it. An output port may feed exactly
    one input port; an input port may be fed by several output ports (fan-in). ``optional``
    input ports may be left unwired; unwired optional output ports drop what is sent and count it.

    ``if_accepted`` (output ports): kinds the port sends only to a consumer whose input port
    accepts them (a faster form of what it sends anyway); the wiring check does not require
    them, and the stage asks ``ctx.outputs[port].sends(kind)`` before sending one. They are
    part of ``schemas``.

    ``ack`` (input ports): when a message counts as processed, so that its producer stops
    keeping it for redelivery (``transport.credit``, "Delivery"). ``"on_take"``: when the stage
    takes it from the port. ``"manual"``: when the stage calls ``ctx.inputs[port].ack(msg)``,
    for a stage that holds messages while it works on them (ack once the result has gone on,
    or once it was dropped and counted): if the replica dies first, the message comes again.
    """

    schemas: tuple[Schema, ...]
    doc: str = ""
    optional: bool = False
    ack: str = "on_take"
    if_accepted: frozenset[str] = frozenset()

    def __init__(
        self,
        *schemas: Schema,
        doc: str = "",
        optional: bool = False,
        ack: str = "on_take",
        if_accepted: tuple[Schema, ...] = (),
    ) -> None:
        if not schemas:
            raise ValueError("a Port needs at least one Schema")
        if ack not in ("on_take", "manual"):
            raise ValueError(f"Port ack must be 'on_take' or 'manual', got {ack!r}")
        object.__setattr__(self, "schemas", tuple(schemas) + tuple(if_accepted))
        object.__setattr__(self, "if_accepted", frozenset(s.kind for s in if_accepted))
        object.__setattr__(self, "doc", doc)
        object.__setattr__(self, "optional", optional)
        object.__setattr__(self, "ack", ack)

    @property
    def kinds(self) -> dict[str, int]:
        return {s.kind: s.version for s in self.schemas}

    def sent_to(self, target: Port) -> list[str]:
        """The kinds this output port sends to ``target``'s input: all but the ``if_accepted``
        ones ``target`` does not accept (at the same version)."""
        accepted = target.kinds
        return [
            s.kind
            for s in self.schemas
            if s.kind not in self.if_accepted or accepted.get(s.kind) == s.version
        ]

    def schema(self, kind: str) -> Schema | None:
        for s in self.schemas:
            if s.kind == kind:
                return s
        return None


@dataclass
class NoConfig:
    """Config of a stage that takes no options."""


class StageContext(Protocol):
    """What the runtime gives a stage replica (see ``pipeline.actor.ActorContext``)."""

    stage: str  # stage name in the pipeline YAML
    replica: int  # 0-based replica index
    replicas: int  # number of replicas of this stage
    seed: int  # run.seed + replica
    mode: str  # run.mode: "async" or "sync"
    restarts: int  # how many times this replica was restarted before (0 on the first start)
    run_dir: Path
    inputs: Mapping[str, Any]  # port name -> transport.receiver.Receiver
    outputs: Mapping[str, Any]  # port name -> transport.sender.Sender
    log: Any  # structlog logger, stage/replica/version bound
    stop_requested: asyncio.Event  # set when the run is shutting down (run() is then cancelled)
    stages: Mapping[str, int]  # every stage of the pipeline -> its number of replicas
    engines: Mapping[str, Any]  # generator replica -> its `engines` announcement (urls, epoch)
    engine_versions: Mapping[str, int]  # engine URL -> newest version announced loaded there
    ledger: Any  # pipeline.ledger.LedgerReporter: where this stage's samples ended

    @property
    def version(self) -> int: ...  # latest policy version announced on the control bus

    @property
    def engine_api_key(self) -> str | None: ...  # the run's engine API key (stages.engine.auth)

    async def wait_for_version(self, at_least: int) -> int: ...

    def metrics(self, **values: Any) -> None: ...  # emits a `metrics` log event

    async def summary(self, **values: Any) -> None: ...  # adds values to RUN_DIR/summary.json

    async def wait_for_engines(self, changed_since: Mapping[str, Any] | None = None) -> dict: ...

    async def publish(self, topic: str, payload: Mapping[str, Any]) -> None: ...

    # call back after each version announcement and learner pace report taken in
    def on_control(self, callback: Callable[[], None]) -> None: ...

    # until learner rank `rank`'s pace report at `version` (or later) has been taken in
    async def wait_for_pace(self, rank: int, version: int) -> None: ...

    # ask the supervisor to end the run: succeeded, or with failed=True as failed
    def request_stop(self, reason: str, *, failed: bool = False) -> None: ...


@runtime_checkable
class Stage(Protocol):
    """A pipeline stage. Build it as ``cls(config, ctx)``; the runtime calls the coroutines.

    A stage that reports to the run's ledger where the samples it takes end (``ctx.ledger``,
    ``pipeline.ledger``) sets ``keeps_ledger = True``; for any other stage, each message it
    processes ends its prompt in the ledger (``consumed``). At the end a replica reports the uids
    it still holds (its channels', and ``held_uids()`` if the stage defines it); a stage that
    keeps its custody on disk may define the classmethod ``held_after_exit(run_dir, stage,
    replica)`` to say what a replica that did not end cleanly held (the feeder does).

    A stage that never blocks its event loop for long (its heavy work in threads or worker
    processes) sets ``shares_process = True``: with ``run.share_process: auto`` (the default)
    the local launcher may then run it with other such stages in one process
    (``pipeline.host``); a stage without it gets a process of its own.

    A stage that reads the learners' pace (``ctx.learner_pace``: their batch, lag and version,
    as the generator's queue gate does; ``ctx.on_control`` calls back as each is taken in) sets
    ``reads_pace = True``; the reports, one a learner step, go to those stages only (and to the
    learner, which hears its own back before it acknowledges a step: ``ctx.wait_for_pace``).
    """

    Config: ClassVar[type]
    inputs: ClassVar[Mapping[str, Port]]
    outputs: ClassVar[Mapping[str, Port]]

    async def setup(self) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...


def stage_config_class(cls: type) -> type:
    """The Config dataclass of a stage class (``NoConfig`` when it declares none)."""
    config = getattr(cls, "Config", NoConfig)
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}.Config must be a dataclass")
    return config


def stage_ports(cls: type) -> tuple[Mapping[str, Port], Mapping[str, Port]]:
    """The (inputs, outputs) port maps a stage class declares; a stage may declare neither."""
    declared = {}
    for attr in ("inputs", "outputs"):
        ports = next((c.__dict__[attr] for c in cls.__mro__ if attr in c.__dict__), {})
        if not isinstance(ports, Mapping) or not all(isinstance(p, Port) for p in ports.values()):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{attr} must map names to Port")
        declared[attr] = ports
    return declared["inputs"], declared["outputs"]
