"""One stage replica: the process the supervisor starts as ``python -m pipeline.actor SPEC``.

The replica reads its spec (a JSON file the supervisor wrote: which stage, which replica, its
options and the addresses of its ports), opens its input inboxes and output channels, joins the
control bus, and runs the stage's ``setup``/``run``/``close`` on one asyncio loop (uvloop when
installed). Around the stage it keeps a heartbeat, periodic ``metrics`` events with every
channel's statistics, and the current policy version from ``version`` announcements.

When ``run`` returns, the replica sends end-of-stream on its outputs and waits until downstream
has acknowledged everything it sent (``Sender.finish``: a consumer that dies meanwhile gets it
again), then closes them.

Exit codes: 0 when ``run`` returned or a shutdown was requested; 1 when the stage raised (the
traceback is in the replica's log as ``stage_failed``); 2 when the spec itself is unusable.
This module does not decide about restarts: the supervisor does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from pipeline import heap, topics
from pipeline.config.errors import ConfigError
from pipeline.config.typed import build
from pipeline.ledger import LedgerReporter
from pipeline.processes import exit_now
from pipeline.registry import resolve
from pipeline.stage import stage_config_class, stage_ports
from pipeline.structured_log import (
    adopt_library_loggers,
    close_process_logging,
    configure_process_logging,
)
from transport import ControlClient, Receiver, Sender
from transport.message import uids_of
from transport.security import CurveKeys

__all__ = ["ActorContext", "build_stage_config", "control_topics", "main"]

_FINAL_LINGER_MS = 2000


def build_stage_config(cls: type, options: Mapping[str, Any], stage: str) -> Any:
    """The stage's typed Config from its (already validated) options; raises ConfigError."""
    issues: list = []
    config = build(stage_config_class(cls), dict(options), f"stages.{stage}", {}, issues)
    if issues:
        raise ConfigError(issues)
    return config


class ActorContext:
    """What a stage replica gets from the runtime (the ``StageContext`` protocol)."""

    def __init__(self, spec: Mapping[str, Any], log: Any, control: ControlClient) -> None:
        self.stage: str = spec["stage"]
        self.replica: int = spec["replica"]
        self.replicas: int = spec["replicas"]
        self.run_dir = Path(spec["run_dir"])
        # where it and the processes it starts (engines) write logs: RUN_DIR/logs, or a folder
        # on its node that the Ray launcher forwards to RUN_DIR/logs
        self.log_dir = Path(spec.get("log_dir") or self.run_dir / "logs")
        self.seed: int = spec["seed"]
        self.mode: str = spec.get("mode", "async")
        self.restarts: int = spec["restarts"]
        self.session: str = spec.get("session", "")
        self.log_level: str = spec.get("log_level", "info")  # what helpers it starts log at
        self._engine_api_key: str | None = spec.get("engine_api_key") or None
        self.inputs: dict[str, Receiver] = {}
        self.outputs: dict[str, Sender] = {}
        self.log = log
        self._control = control
        self._version: int = spec.get("version", 0)  # the live version when it was started
        self._version_changed = asyncio.Condition()
        self._stop_publish: asyncio.Task | None = None
        self.stop_requested = asyncio.Event()  # set when the run is being shut down
        self.stages: dict[str, int] = dict(spec.get("stages", {}))  # every stage -> replicas
        # the learner's batch, publish.every, max_lag, version and generators (topics.PACE;
        # received by a stage that says it reads it: ``reads_pace``)
        self.learner_pace: dict[str, int] = {}
        # engine URL -> the newest version announced as loaded there (topics.VERSION `engines`)
        self.engine_versions: dict[str, int] = {}
        # version -> the LoRA adapter requests to its engines name (publish.lora_transport files)
        self.lora_names: dict[int, str] = {}
        # generator replica ("stage.replica") -> its latest `engines` announcement
        self.engines: dict[str, dict[str, Any]] = {}
        self._engines_changed = asyncio.Condition()
        # learner rank -> the version of its latest pace report heard back (wait_for_pace)
        self.pace_heard: dict[int, int] = {}
        self._pace_sessions: dict[int, str] = {}  # learner rank -> the session that reports it
        self._pace_arrived = asyncio.Event()
        self._on_control: list[Callable[[], None]] = []  # (on_control)
        # where prompts and samples went (pipeline.ledger): published at once, in order
        self.ledger = LedgerReporter(
            lambda payload: control.publish_nowait(topics.LEDGER, self._signed(payload))
        )

    def _signed(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return {"stage": self.stage, "replica": self.replica, "session": self.session, **payload}

    @property
    def version(self) -> int:
        return self._version

    @property
    def engine_api_key(self) -> str | None:
        """The run's inference-engine API key (``stages.engine.auth``); None when absent."""
        return self._engine_api_key

    def on_control(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each version announcement and learner ``pace`` report
        taken in (``version``, ``engine_versions`` and ``learner_pace`` may have changed): a
        stage whose gates read them waits for this rather than polling them."""
        self._on_control.append(callback)

    def _control_changed(self) -> None:
        for callback in self._on_control:
            callback()

    async def set_version(self, version: int, engines: Any = (), lora_name: Any = None) -> None:
        """A version announcement; ``engines``: the URLs that hold ``version`` now;
        ``lora_name``: the LoRA adapter it is on them (``publish.lora_transport: files``),
        which requests to engines of this version name."""
        if isinstance(lora_name, str) and lora_name:
            self.lora_names[version] = lora_name
        for url in engines if isinstance(engines, list) else ():
            if isinstance(url, str) and version > self.engine_versions.get(url, -1):
                self.engine_versions[url] = version
        newer = version > self._version
        if newer:
            self._version = version
        self._control_changed()
        if newer:
            async with self._version_changed:
                self._version_changed.notify_all()

    async def wait_for_version(self, at_least: int) -> int:
        """Wait until the policy version is at least ``at_least``; returns the version."""
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self._version >= at_least)
        return self._version

    async def set_engines(self, payload: Mapping[str, Any]) -> None:
        key = f"{payload.get('stage')}.{payload.get('replica')}"
        if self.engines.get(key) != payload:
            self.engines[key] = dict(payload)
            async with self._engines_changed:
                self._engines_changed.notify_all()

    async def wait_for_engines(self, changed_since: Mapping[str, Any] | None = None) -> dict:
        """The engines announced so far, once they differ from ``changed_since``."""
        # a copy: a caller passing ``ctx.engines`` itself would otherwise compare it with itself
        since = dict(changed_since or {})
        async with self._engines_changed:
            await self._engines_changed.wait_for(lambda: self.engines != since)
        return dict(self.engines)

    def set_pace(self, payload: Mapping[str, Any]) -> None:
        """A learner rank's ``pace`` report (integers, and ``hungry``: whether it waits for
        samples; a malformed one is ignored)."""
        pace = {k: payload.get(k) for k in ("batch", "every", "max_lag", "origins", "version")}
        if all(isinstance(v, int) and not isinstance(v, bool) for v in pace.values()):
            rank, session = payload.get("rank"), payload.get("session")
            # A rank that restarted from its last checkpoint reports an older version than it
            # reached before: its reports count from there. (Kept back as stale, the pace of
            # before held the generators' queue gate shut on the batch the restarted learner
            # waited to fill, and neither moved again.)
            restarted = False
            if isinstance(rank, int) and isinstance(session, str):
                restarted = self._pace_sessions.get(rank, session) != session
                self._pace_sessions[rank] = session
            if isinstance(rank, int) and (
                restarted or pace["version"] > self.pace_heard.get(rank, -1)
            ):
                self.pace_heard[rank] = pace["version"]
                self._pace_arrived.set()
            if restarted or pace["version"] >= self.learner_pace.get("version", -1):
                self.learner_pace = {**pace, "hungry": payload.get("hungry") is True}
                self._control_changed()

    async def wait_for_pace(self, rank: int, version: int) -> None:
        """Until a pace report of learner ``rank`` at ``version`` or later has come back over
        the control bus (a learner hears its own: the broker has passed it on to the
        generators by then)."""
        while self.pace_heard.get(rank, -1) < version:
            self._pace_arrived.clear()
            await self._pace_arrived.wait()

    def metrics(self, **values: Any) -> None:
        self.log.info("metrics", **values)

    async def summary(self, **values: Any) -> None:
        """Add ``values`` to the run's ``summary.json`` (the supervisor writes it)."""
        await self.publish(topics.SUMMARY, {"values": values})

    async def publish(self, topic: str, payload: Mapping[str, Any]) -> None:
        await self._control.publish(topic, self._signed(payload))

    def request_stop(self, reason: str, *, failed: bool = False) -> None:
        """Ask the supervisor to end the whole run once this is delivered: as ``succeeded``
        (this stage did what the config asked) or, with ``failed``, as ``failed``."""
        outcome = "failed" if failed else "succeeded"
        self.log.info("stop_requested", reason=reason, outcome=outcome)
        # keep a reference so the task is not garbage-collected before it has run
        self._stop_publish = asyncio.get_running_loop().create_task(
            self.publish(topics.STOP, {"reason": reason, "outcome": outcome})
        )


_TRANSPORT_COUNTERS = {  # what the ledger totals from each port's statistics
    "in": ("duplicates", "uncredited"),
    "out": ("redelivered", "unacked_dropped", "dropped"),
}


def _ledger_report(ctx: ActorContext, *, final: bool, stage: Any = None) -> None:
    """Tell the ledger what this replica holds (at the end: in its ports, and what the stage
    says it holds besides, ``stage.held_uids()``) and its transport counters."""
    counters: dict[str, int] = {}
    held: list[str] = list(stage.held_uids()) if final and hasattr(stage, "held_uids") else []
    for kind, ports in (("in", ctx.inputs), ("out", ctx.outputs)):
        for channel in ports.values():
            stats = channel.stats()
            for key in _TRANSPORT_COUNTERS[kind]:
                counters[key] = counters.get(key, 0) + int(stats.get(key, 0))
            rejected = sum(stats.get("rejected", {}).values())
            counters[f"rejected_{kind}"] = counters.get(f"rejected_{kind}", 0) + rejected
            if final:
                held.extend(channel.held_uids())
    ctx.ledger.report(held, counters, final=final)


def _channel_metrics(ctx: ActorContext) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for kind, ports in (("in", ctx.inputs), ("out", ctx.outputs)):
        for name, channel in ports.items():
            for key, value in channel.stats().items():
                if isinstance(value, Mapping):
                    # per-peer values are keyed by address; the peer's replica index reads better
                    for i, (sub, v) in enumerate(value.items()):
                        by_index = sub is None or "://" in str(sub)  # an address: its index
                        values[f"{kind}.{name}.{key}.{i if by_index else sub}"] = v
                else:
                    values[f"{kind}.{name}.{key}"] = value
    return values


def _consumed(ledger: Any, msg: Any) -> None:
    """A message processed by a stage that keeps no ledger: its prompts end there."""
    for uid in uids_of(msg.data):
        ledger.consumed(uid)


def control_topics(stage_cls: type | None) -> tuple[str, ...]:
    """The control-bus topics a replica of ``stage_cls`` receives (``None``: every replica's):
    the learners' pace reports, one a learner step, only where the stage reads them
    (``reads_pace``)."""
    every = (topics.VERSION, topics.SHUTDOWN, topics.DONE, topics.ENGINES, topics.ADDRESSES)
    return (*every, topics.PACE) if getattr(stage_cls, "reads_pace", False) else every


class _Replica:
    """Owns the sockets and tasks around one stage instance.

    ``hosted``: it shares its process with other replicas (``pipeline.host``), which handles
    the process's signals and tells it ``request_shutdown`` (SIGTERM) or ``kill`` (SIGKILL).
    """

    def __init__(self, spec: Mapping[str, Any], log: Any, *, hosted: bool = False) -> None:
        self.spec = spec
        self.log = log
        self.hosted = hosted
        self.killed = False
        self.zctx = zmq.asyncio.Context()
        # the run's CURVE keys when its sockets bind off loopback (transport.security)
        self.curve = CurveKeys.from_spec(spec["curve"], "spec.curve") if spec.get("curve") else None
        control = spec["control"]
        self.control = ControlClient(
            control["pub"],
            control["sub"],
            self.zctx,
            topics=control_topics(None),  # and what its stage class asks for (``main``)
            log=log.bind(component="control"),
            key=bytes.fromhex(control["key"]) if control.get("key") else None,
            curve=self.curve,
        )
        self.ctx = ActorContext(spec, log, self.control)
        self.shutdown_reason: str | None = None
        self.run_task: asyncio.Task | None = None

    async def open_ports(self) -> None:
        spec, ctx = self.spec, self.ctx
        inputs, outputs = stage_ports(self.stage_cls)
        identity = f"{ctx.stage}.{ctx.replica}"
        for name, port in spec["inputs"].items():
            receiver = Receiver(
                name,
                port["address"],
                inputs[name].schemas,
                capacity=port["capacity"],
                expected_producers=port["producers"],
                ctx=self.zctx,
                log=self.log,
                peer_timeout_s=spec["peer_timeout_s"],
                ack=inputs[name].ack,
                max_message_bytes=spec.get("max_message_bytes", 0),
                curve=self.curve,
                insecure=spec.get("insecure", False),
            )
            await receiver.start()
            if not getattr(self.stage_cls, "keeps_ledger", False):
                receiver.on_processed(functools.partial(_consumed, ctx.ledger))
            for producer in spec["finished_producers"]:
                receiver.producer_finished(producer)
            ctx.inputs[name] = receiver
        for name, port in spec["outputs"].items():
            kinds = port.get("kinds")  # what its consumer accepts (Port.if_accepted)
            sender = Sender(
                name,
                port["peers"],
                [s for s in outputs[name].schemas if kinds is None or s.kind in kinds],
                identity=identity,
                ctx=self.zctx,
                log=self.log,
                heartbeat_s=spec["heartbeat_s"],
                peer_timeout_s=spec["peer_timeout_s"],
                curve=self.curve,
                max_message_bytes=spec.get("max_message_bytes", 0),
                local=port.get("local", ()),  # its consumers that share this process
            )
            await sender.start()
            ctx.outputs[name] = sender

    def kill(self) -> None:
        """What SIGKILL is to a replica of its own process, for one that shares it: it ends
        now, without end-of-stream or a final ledger report (its producers send again what it
        held), and exits as killed (-9). Its stage's ``close`` still runs, to free what it holds
        in the process (threads, engines, workers)."""
        self.killed = True
        self.request_shutdown("killed")

    def request_shutdown(self, reason: str) -> None:
        if self.shutdown_reason is None:
            self.shutdown_reason = reason
            self.ctx.stop_requested.set()
            self.log.info("shutdown_received", reason=reason)
            if self.run_task is not None:
                self.run_task.cancel()

    def connect_peers(self, inboxes: Mapping[str, Any]) -> None:
        """Point each output at the inboxes its consumers announced (``topics.ADDRESSES``)."""
        for name, port in self.spec["outputs"].items():
            feeds, sender = port.get("feeds"), self.ctx.outputs.get(name)
            if not feeds or sender is None:
                continue
            down, down_port = feeds
            for i in range(len(sender.peers)):
                address = inboxes.get(f"{down}.{i}.{down_port}")
                if isinstance(address, str):
                    try:
                        sender.connect_peer(i, address)
                    except ValueError as exc:
                        self.log.warning("bad_peer_address", port=name, peer=i, error=str(exc))

    async def heartbeat(self) -> None:
        while True:
            # `held`: messages waiting in this replica's inboxes (sent again if it dies now)
            held = sum(r.stats()["messages"] for r in self.ctx.inputs.values())
            payload = {"pid": os.getpid(), "session": self.spec["session"], "held": held}
            if self.hosted:
                payload["hosted"] = True
            if self.spec.get("announce_inboxes"):  # bound on this node: say where
                payload["inboxes"] = {n: r.address for n, r in self.ctx.inputs.items()}
            await self.ctx.publish(topics.HEARTBEAT, payload)
            await asyncio.sleep(self.spec["heartbeat_s"])

    async def emit_metrics(self) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(self.spec["metrics_every_s"])
            self.ctx.metrics(
                uptime_s=round(time.monotonic() - started, 3), **_channel_metrics(self.ctx)
            )
            _ledger_report(self.ctx, final=False)

    async def listen(self) -> None:
        while True:
            topic, payload = await self.control.recv()
            if topic == topics.VERSION and isinstance(payload.get("version"), int):
                await self.ctx.set_version(
                    payload["version"], payload.get("engines", ()), payload.get("lora_name")
                )
            elif topic == topics.PACE:
                self.ctx.set_pace(payload)
            elif topic == topics.ENGINES and isinstance(payload.get("urls"), list):
                await self.ctx.set_engines(payload)
            elif topic == topics.SHUTDOWN:
                self.request_shutdown(str(payload.get("reason", "supervisor")))
            elif topic == topics.ADDRESSES and isinstance(payload.get("inboxes"), dict):
                self.connect_peers(payload["inboxes"])
            elif topic == topics.DONE and isinstance(payload.get("replicas"), list):
                for receiver in self.ctx.inputs.values():
                    for producer in payload["replicas"]:
                        receiver.producer_finished(producer)

    async def main(self) -> int:
        spec = self.spec
        loop = asyncio.get_running_loop()
        if not self.hosted:  # a host process handles its own signals
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown, signal.Signals(sig).name)
        self.stage_cls = resolve("stage", spec["use"])
        config = build_stage_config(self.stage_cls, spec["options"], spec["stage"])
        for topic in control_topics(self.stage_cls)[len(control_topics(None)) :]:
            self.control.subscribe(topic)
        await self.control.start()
        background = [
            asyncio.create_task(self.heartbeat(), name="heartbeat"),
            asyncio.create_task(self.listen(), name="control"),
        ]
        stage = None
        code = 0
        try:
            await self.open_ports()
            background.append(asyncio.create_task(self.emit_metrics(), name="metrics"))
            stage = self.stage_cls(config, self.ctx)
            self.run_task = asyncio.create_task(self._setup_and_run(stage), name="stage")
            if self.shutdown_reason is not None:  # a signal arrived while we were starting
                self.run_task.cancel()
            await self.run_task
            for sender in self.ctx.outputs.values():
                await sender.aclose(eos=True)
            self.log.info("replica_finished")
        except asyncio.CancelledError:
            if self.shutdown_reason is None:
                raise
            self.log.info("replica_stopped", reason=self.shutdown_reason)
            if self.killed:
                code = -signal.SIGKILL
        except Exception:
            self.log.exception("stage_failed")
            code = 1
        finally:
            if not self.hosted:
                _ignore_shutdown_signals(loop)
            if stage is not None:
                try:
                    await asyncio.wait_for(stage.close(), timeout=spec["close_timeout_s"])
                except Exception:
                    self.log.exception("stage_close_failed")
                    code = code or 1
            self.ctx.metrics(final=True, **_channel_metrics(self.ctx))
            if code == 0:  # a failed stage's holdings are not known: its producers resend
                _ledger_report(self.ctx, final=True, stage=stage)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self.ctx.ledger.flush()  # prompts fed in this last turn of the loop
            await self._close_channels()
        return code

    async def _setup_and_run(self, stage: Any) -> None:
        heap.hold()  # no full collections while setup loads libraries and models
        try:
            await stage.setup()
        except BaseException:
            heap.release()
            raise
        adopt_library_loggers()  # setup may have imported transformers, which logs on its own
        heap.settle()  # what setup loaded stays: later collections skip it
        self.log.info(
            "replica_started", pid=os.getpid(), restarts=self.ctx.restarts, use=self.spec["use"]
        )
        await stage.run()
        # done: but until downstream has processed what we sent, only we can send it again
        for sender in self.ctx.outputs.values():
            await sender.finish()

    async def _close_channels(self) -> None:
        for channel in [*self.ctx.inputs.values(), *self.ctx.outputs.values()]:
            with contextlib.suppress(Exception):
                if isinstance(channel, Sender):
                    await channel.aclose(eos=False)
                else:
                    await channel.aclose()
        # the last ledger report must reach the supervisor: linger for it (the context's
        # termination waits up to that long for messages still queued)
        await self.control.aclose(linger_ms=_FINAL_LINGER_MS)
        self.zctx.destroy(linger=0)


def _ignore_shutdown_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Ending anyway: a late SIGTERM (the whole process group gets one at shutdown) must not
    turn a clean end into a death by signal. The loop's handlers are replaced by ones that do
    nothing, not removed: removing one puts the default action (death) back in force until
    the next call ignores the signal, and the supervisor's SIGTERM comes just as a stage that
    asked to stop gets here. ``_run_loop`` ignores both once the loop has closed."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _ignored, sig)


def _ignored(sig: int) -> None:
    pass


def _run_loop(coro: Any) -> int:
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(coro)
        return uvloop.run(coro)
    finally:  # closing the loop put the default action back (see _ignore_shutdown_signals)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeline.actor SPEC.json", file=sys.stderr)
        return 2
    try:
        spec = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read replica spec {argv[0]}: {exc}", file=sys.stderr)
        return 2
    replica = None
    log = configure_process_logging(
        Path(spec["log_file"]),
        stage=spec["stage"],
        replica=spec["replica"],
        level=spec["log_level"],
        version=lambda: replica.ctx.version if replica is not None else 0,
    )
    try:
        replica = _Replica(spec, log)
        return _run_loop(replica.main())
    except Exception:
        log.exception("replica_crashed")
        return 1
    finally:
        close_process_logging()


if __name__ == "__main__":
    exit_now(main())  # everything is closed and flushed: no 0.5 s of interpreter teardown
