"""The supervisor: runs a validated pipeline as one process per stage replica.

``inflight run CONFIG`` lands here after the whole config was validated. The supervisor makes the
run directory (resolved ``config.yaml``, ``logs/``, ``specs/``), gives every input port of every
replica an address, starts the control bus broker, then starts each replica as
``python -m pipeline.actor SPEC`` in its own process group (so Ctrl-C reaches only the
supervisor, which then shuts the run down in order).

While the run goes on it watches exits and heartbeats: a replica that exits non-zero, dies from a
signal, or stops sending heartbeats is failed; under ``restart: {policy: on-failure}`` it is
started again after a capped exponential backoff (doubling with failures in a row; a replica that
had run a minute starts again from the first delay), up to ``max_restarts`` times; otherwise the run
fails. SIGINT/SIGTERM: ``shutdown`` on the control bus plus SIGTERM to every replica's process
group, then SIGKILL after ``run.shutdown_timeout_s``; a second Ctrl-C kills at once.

An honest end: a run is ``succeeded`` (exit 0) only when it did what its config asked: every
replica finished, or a stage that owns the run's goal (the learner, after its steps) asked for
the end. A user's Ctrl-C or SIGTERM is ``stopped`` (exit 130 or 143); any other end is ``failed``
(exit 1), a stage's own ``stop`` with ``outcome: failed`` included.

The control bus is signed with a key made for this run (``transport.control``): it is in the
replicas' spec files, which only the user can read, and nowhere else. When anything binds off
loopback (the Ray launcher, a tcp host that is not loopback; or ``transport.curve: true``), the
run also makes CURVE keys (``transport.security``) and every channel and the control bus
encrypt and admit only this run's replicas; they travel the same private way. A ``stop`` must
also come from a live replica (its stage, index and current session) with a reason: anything
else is refused, counted in ``summary.json`` (``control_refused``) and logged.

A stage whose class sets ``distributed = True`` (the learner) is a gang: its replicas are the
ranks of one ``torch.distributed`` group, started with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` in their environment. When one rank fails, the others cannot go
on (they would wait in a collective forever), so the supervisor kills every rank and restarts the
whole gang, with a fresh rendezvous port, under the failed rank's restart policy.

Placement (``pipeline.placement``): each replica starts pinned to the cores the plan gives it
(``sched_setaffinity`` in the child before exec), with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set
to its core count unless the stage's ``env`` sets them, and ``CUDA_VISIBLE_DEVICES`` set to its
GPUs when it has any. Replicas that reserve no cores float on the cores nobody reserved. A
replica that launches engines gets their placements in ``INFLIGHT_ENGINE_PLACEMENT`` and applies
them itself. Without any ``resources`` in the config nothing of this happens.

The ledger (``pipeline.ledger``): replicas report on the control bus where each prompt and sample
went; the supervisor logs a ``ledger`` event every ``_LEDGER_EVERY_S`` and, at the end, balances
it into ``summary.json`` (``ledger``). A ledger that does not balance (``unaccounted`` > 0) is a
bug somewhere: the run is ``failed`` and the log names the prompts that went missing.

Trackers (``run.trackers``; ``pipeline.tracking``): one ``TrackerFeed`` task reads the replicas'
events from the logs as they are written and feeds one TensorBoard directory, W&B run and MLflow
run for the whole run; at the end it takes the last events before ``summary.json`` is written
(``trackers`` there when one failed). ``run.plot`` then draws ``RUN_DIR/plot.png``.
``run_started`` names the supervisor's pid, its start time and host: ``inflight logs -f`` ends
when that process is gone.

The console (``pipeline.console``) follows every replica's events as they are written: by
default one live status block (step k/N, ETA, reward, lag, throughput, last evaluation; off a
terminal a plain line every ``run.console_every_s``) with the events that matter printed above
it; ``console="events"`` prints every event (the view of ``inflight logs -f``), None nothing.
The last event of a run is ``run_finished`` with its status and exit code; stages may add
values to ``RUN_DIR/summary.json`` (``summary`` on the control bus), written when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq.asyncio

from pipeline import topics
from pipeline.config import ConfigError, LoadedPipeline, dump_yaml
from pipeline.config.schema import STAGE_KEYS, TRUST_REMOTE_CODE_ENV
from pipeline.console import Console, total_steps
from pipeline.launchers import Launcher, LaunchError, ReplicaProcess, ReplicaStart, make_launcher
from pipeline.launchers.base import engine_resources
from pipeline.launchers.ray_host import NODE_IP
from pipeline.launchers.shared import shared_stages
from pipeline.ledger import LedgerBook
from pipeline.log_view import LogFilter, LogTail, process_identity, render
from pipeline.placement import (
    ENGINE_PLACEMENT_ENV,
    Plan,
    affinity,
    engine_placement,
    host_inventory,
    plan,
    process_env,
)
from pipeline.stage import stage_ports
from pipeline.structured_log import close_process_logging, configure_process_logging
from pipeline.tracking import TrackerFeed
from transport import ControlBroker
from transport.address import ipc_address, is_loopback, rendezvous_port, tcp_address
from transport.credit import sparse
from transport.security import CurveKeys

__all__ = ["EXIT_FAILED", "EXIT_OK", "Supervisor", "make_run_dir"]

EXIT_OK, EXIT_FAILED = 0, 1
_BACKOFF_CAP_S = 30.0
_STABLE_S = 60.0  # a replica up this long before it fails restarts after the first backoff
_LEDGER_EVERY_S = 10.0  # how often the running ledger is logged
_FINAL_REPORT_WAIT_S = 5.0  # at the end, how long to wait for replicas' final ledger reports


def make_run_dir(
    loaded: LoadedPipeline, run_dir: str | Path | None, *, resume: bool = False
) -> Path:
    """Create the run directory (``runs_root/NAME-TIMESTAMP`` unless given) and return it.

    ``resume``: ``run_dir`` must hold an earlier run, which goes on there (logs are appended,
    stages that keep checkpoints continue from them).
    """
    if resume:
        path = Path(run_dir or "")
        if not (path / "config.yaml").exists():
            raise FileNotFoundError(f"cannot resume {path}: it holds no run (no config.yaml)")
    elif run_dir is None:
        run = loaded.config.run
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(run.runs_root) / f"{run.name}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(run.runs_root) / f"{run.name}-{stamp}-{suffix}"
    else:
        path = Path(run_dir)
        if (path / "config.yaml").exists():
            raise FileExistsError(
                f"run directory {path} already holds a run (it has config.yaml); "
                "give another --run-dir"
            )
    (path / "logs").mkdir(parents=True, exist_ok=True)
    (path / "specs").mkdir(exist_ok=True)
    return path


@dataclass
class _Replica:
    stage: str
    index: int
    spec_path: Path
    log_file: Path
    restart_policy: Any
    spec: dict[str, Any] = field(default_factory=dict)
    proc: ReplicaProcess | None = None
    session: str = ""
    restarts: int = 0
    started_at: float = 0.0
    last_heartbeat: float | None = None
    held: int = 0  # messages in its inboxes at the last heartbeat
    done: bool = False  # exited 0
    watcher: asyncio.Task | None = None
    failure: str | None = None  # why the supervisor killed it, when it did
    gang_exit: bool = False  # killed because another rank of its gang failed
    streak: int = 0  # failures in a row, each within _STABLE_S of its start (sets the backoff)

    @property
    def name(self) -> str:
        return f"{self.stage}.{self.index}"


@dataclass
class _Outcome:
    status: str = "succeeded"
    exit_code: int = EXIT_OK
    reason: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Supervisor:
    """Runs one pipeline to its end. ``await Supervisor(...).run()`` returns the exit code."""

    def __init__(
        self,
        loaded: LoadedPipeline,
        run_dir: Path,
        *,
        console: str | None = "status",
    ) -> None:
        self.loaded = loaded
        self.config = loaded.config
        # the plan on this host (the local launcher); Ray places replicas itself
        remote = self.config.run.launcher == "ray"
        self.placement = None if remote else loaded.placement or _place_here(loaded)
        self.run_dir = run_dir
        self.console = console  # "status", "events" (every event a line) or None (silent)
        self.replicas: dict[str, _Replica] = {}
        self.version = 0
        self._outcome = _Outcome()
        self._ending = False
        self._interrupts = 0
        self._sock_dir: Path | None = None
        self.engines: dict[str, dict[str, Any]] = {}  # latest `engines` announcement per replica
        self.summary: dict[str, Any] = {}
        self._version_lora: str | None = None  # the live version's LoRA adapter, if any
        self._gang_ports: dict[str, int] = {}  # distributed stage -> its rendezvous port
        self._gang_restarting: set[str] = set()
        self._started = time.monotonic()
        self._key = secrets.token_bytes(32)  # signs the control bus (see the module docstring)
        self._curve: CurveKeys | None = None  # made in _addresses when sockets need CURVE
        self.refused: Counter[str] = Counter()  # control messages refused, by reason
        self.ledger = LedgerBook()
        self._ledger_logged = 0.0
        self._ledger_reported = asyncio.Event()  # a final ledger report arrived
        # "stage.replica.port" -> the address its inbox bound (announced on a remote launcher)
        self.inboxes: dict[str, str] = {}
        self._inboxes_sent: dict[str, str] = {}
        self.launcher: Launcher = make_launcher(self.config, None)
        # stages whose replicas share one process, and the variables that process gets
        self.shared, self._shared_env = shared_stages(loaded)

    # ----------------------------------------------------------------- wiring
    def _addresses(self) -> tuple[dict[tuple[str, int, str], str], dict[str, str]]:
        """An address for every (stage, replica, input port), and the control bus pair."""
        transport = self.config.transport
        if self.launcher.remote:  # bound on its node at port 0, announced in heartbeats

            def addr(name: str) -> str:
                return f"tcp://{NODE_IP}:0"

            host = self.launcher.control_host()
            control = {"pub": tcp_address(host), "sub": tcp_address(host)}
        elif transport.scheme == "ipc":
            self._sock_dir = Path(tempfile.mkdtemp(prefix="inflight-"))

            def addr(name: str) -> str:
                return ipc_address(self._sock_dir, name)
        else:

            def addr(name: str) -> str:  # bound by its replica later: not an ephemeral port
                return tcp_address(transport.host, rendezvous_port(transport.host))

        inboxes = {}
        for name, section in self.config.stages.items():
            for r in range(section.replicas):
                for port in section.inputs:
                    inboxes[(name, r, port)] = addr(f"{name}.{r}.{port}")
        if not self.launcher.remote:
            control = {"pub": addr("control.pub"), "sub": addr("control.sub")}
        control["key"] = self._key.hex()
        curve = transport.curve
        if curve is None:  # on exactly when something binds off loopback
            curve = self.launcher.remote or not all(
                is_loopback(a) for a in (*inboxes.values(), control["pub"], control["sub"])
            )
        self._curve = CurveKeys.generate() if curve else None
        return inboxes, control

    def _write_specs(self, inboxes: dict, control: dict[str, str]) -> None:
        stages = self.config.stages
        resolved = self.loaded.resolved()["stages"]
        run, transport = self.config.run, self.config.transport
        # who feeds each input port, and which input port each output port feeds
        feeds: dict[tuple[str, str], tuple[str, str]] = {}
        producers: dict[tuple[str, str], list[str]] = {}
        for name, section in stages.items():
            for port, sources in section.inputs.items():
                for source in [sources] if isinstance(sources, str) else sources:
                    up_stage, _, up_port = source.partition(".")
                    feeds[(up_stage, up_port)] = (name, port)
                    producers.setdefault((name, port), []).extend(
                        f"{up_stage}.{r}" for r in range(stages[up_stage].replicas)
                    )
        # the engines' API key (stages.engine.auth): the user's, for engines they started with
        # it, else one made for this run; private like the control key
        engine_key = os.environ.get("INFLIGHT_ENGINE_API_KEY") or secrets.token_urlsafe(32)
        for name, section in stages.items():
            cls = self.loaded.stage_classes[name]
            options = {k: v for k, v in resolved[name].items() if k not in STAGE_KEYS}
            for r in range(section.replicas):
                outputs = {}
                for port in stage_ports(cls)[1]:
                    target = feeds.get((name, port))
                    peers: list[str | None] = []
                    if target is not None:
                        down, down_port = target
                        peers = [
                            None if self.launcher.remote else inboxes[(down, i, down_port)]
                            for i in range(stages[down].replicas)
                        ]
                    outputs[port] = {"peers": peers}
                    if target is not None:  # whose announced inboxes its peers are
                        outputs[port]["feeds"] = list(target)
                        down_cls = self.loaded.stage_classes[target[0]]
                        into = stage_ports(down_cls)[0][target[1]]
                        outputs[port]["kinds"] = stage_ports(cls)[1][port].sent_to(into)
                        if name in self.shared and target[0] in self.shared:
                            outputs[port]["local"] = [True] * len(peers)  # transport.local
                spec = {
                    "run_dir": str(self.run_dir.resolve()),
                    "stage": name,
                    "replica": r,
                    "replicas": section.replicas,
                    "stages": {n: st.replicas for n, st in stages.items()},
                    "use": section.use,
                    "options": options,
                    "seed": run.seed + r,
                    "mode": run.mode,
                    "inputs": {
                        port: {
                            "address": inboxes[(name, r, port)],
                            "capacity": section.inbox or transport.inbox,
                            "producers": producers.get((name, port), []),
                        }
                        for port in section.inputs
                    },
                    "outputs": outputs,
                    "control": control,
                    "log_file": str((self.run_dir / "logs" / f"{name}.{r}.jsonl").resolve()),
                    "log_level": run.log_level,
                    "heartbeat_s": run.heartbeat_s,
                    "metrics_every_s": run.metrics_every_s,
                    "peer_timeout_s": transport.peer_timeout_s,
                    "max_message_bytes": int(transport.max_message_mb * 2**20),
                    "close_timeout_s": run.shutdown_timeout_s,
                    "announce_inboxes": self.launcher.remote,
                    "engine_api_key": engine_key,
                    "insecure": transport.insecure,
                }
                if self._curve is not None:
                    spec["curve"] = self._curve.to_spec()
                path = self.run_dir / "specs" / f"{name}.{r}.json"
                self.replicas[f"{name}.{r}"] = _Replica(
                    name, r, path, Path(spec["log_file"]), section.restart, spec=spec
                )

    # ------------------------------------------------------------- processes
    async def _spawn(self, rep: _Replica) -> None:
        spec = dict(rep.spec)
        rep.session = secrets.token_hex(4)
        spec["session"] = rep.session
        spec["restarts"] = rep.restarts
        spec["finished_producers"] = [r.name for r in self.replicas.values() if r.done]
        # a restarted replica knows the live policy version from its first moment (a generator
        # that learned it only from the bus would start samples on stale weights meanwhile)
        spec["version"] = self.version
        section = self.config.stages[rep.stage]
        shared = rep.stage in self.shared
        user_env = self._shared_env if shared else section.env
        env = {**user_env, "PYTHONUNBUFFERED": "1", **self._rank_env(rep)}
        if self.config.run.trust_remote_code:  # every loader of the run reads it
            env[TRUST_REMOTE_CODE_ENV] = "1"
        unset: list[str] = []
        cores = gpus = None
        if self.placement is not None:  # the local plan: cores, threads, GPUs on this host
            placed = self.placement.replica(rep.stage, rep.index)
            base = {**os.environ, **env}
            for var, value in process_env(placed, self.placement, base, user_env).items():
                if value is None:
                    unset.append(var)
                    env.pop(var, None)
                else:
                    env[var] = value
            engines = engine_placement(self.placement, rep.stage, rep.index, base, user_env)
            if engines is not None:
                env[ENGINE_PLACEMENT_ENV] = engines
            cores = affinity(placed, self.placement)
            gpus = list(placed.gpus) or None
        elif isinstance(section.resources.cpus, int):  # Ray: threads as many as its CPUs
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.setdefault(var, str(section.resources.cpus))
        start = ReplicaStart(
            name=rep.name,
            stage=rep.stage,
            index=rep.index,
            spec=spec,
            spec_path=rep.spec_path,
            env=env,
            unset=unset,
            cores=None if cores is None else list(cores),
            resources=section.resources,
            extra=engine_resources(section),
            out_path=self.run_dir / "logs" / f"{rep.name}.out",
            gang=(rep.stage, section.replicas) if self._is_gang(rep.stage) else None,
            shared=shared,
        )
        rep.proc = await self.launcher.spawn(start)
        rep.started_at = time.monotonic()
        rep.last_heartbeat = None
        rep.held = 0
        rep.failure = None
        self.log.info(
            "replica_spawned",
            replica_name=rep.name,
            session=rep.session,
            pid=rep.proc.pid,
            restarts=rep.restarts,
            cores=None if cores is None else list(cores),
            gpus=gpus,
            node=rep.proc.node if self.launcher.remote else None,
            shared_process=shared or None,
        )
        rep.watcher = asyncio.create_task(self._watch(rep), name=f"watch-{rep.name}")

    def _is_gang(self, stage: str) -> bool:
        return bool(getattr(self.loaded.stage_classes[stage], "distributed", False))

    def _rank_env(self, rep: _Replica) -> dict[str, str]:
        """torch.distributed's environment for a rank of a distributed stage (else nothing)."""
        if not self._is_gang(rep.stage):
            return {}
        if rep.stage not in self._gang_ports:
            self._gang_ports[rep.stage] = rendezvous_port("127.0.0.1")
        world = str(self.config.stages[rep.stage].replicas)
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self._gang_ports[rep.stage]),
            "RANK": str(rep.index),
            "LOCAL_RANK": str(rep.index),
            "WORLD_SIZE": world,
            "LOCAL_WORLD_SIZE": world,
        }

    async def _stop_gang(self, rep: _Replica) -> list[_Replica]:
        """Kill the other ranks of ``rep``'s gang and wait for them; returns the whole gang."""
        gang = [r for r in self.replicas.values() if r.stage == rep.stage]
        others = [r for r in gang if r is not rep and r.proc and r.proc.returncode is None]
        for other in others:
            other.gang_exit = True
            other.proc.signal(signal.SIGKILL)
        for other in others:
            await other.proc.wait()
        if others:
            self.log.warning(
                "gang_stopped", stage=rep.stage, failed=rep.name, killed=[r.name for r in others]
            )
        return gang

    async def _watch(self, rep: _Replica) -> None:
        assert rep.proc is not None
        code = await rep.proc.wait()
        await rep.proc.release()  # anything the replica left behind
        if self._ending:
            self.log.info("replica_exited", replica_name=rep.name, exit_code=code)
            return
        if rep.gang_exit or (code != 0 and rep.stage in self._gang_restarting):
            rep.gang_exit = False  # its gang is being restarted by the rank that failed first
            self.log.info("replica_exited_with_gang", replica_name=rep.name, exit_code=code)
            return
        if code == 0 and rep.failure is None:
            rep.done = True
            self.log.info("replica_done", replica_name=rep.name)
            if all(r.done for r in self.replicas.values()):
                self._finish("succeeded", EXIT_OK, "every replica finished")
            return
        why = rep.failure or getattr(rep.proc, "lost", None) or _exit_reason(code)
        # what sat in its inboxes (as of its last heartbeat) its producers send again
        self.log.error(
            "replica_failed",
            replica_name=rep.name,
            reason=why,
            inbox_to_redeliver_about=rep.held,
            output_tail=_tail(rep),
        )
        policy = rep.restart_policy
        gang = [rep]
        if self._is_gang(rep.stage):
            self._gang_restarting.add(rep.stage)
            gang = await self._stop_gang(rep)
        if policy.policy == "on-failure" and rep.restarts < policy.max_restarts:
            # the backoff doubles with failures in a row; a replica that ran a while before it
            # failed starts again from the first delay (a crash an hour ago says little now)
            rep.streak = 0 if time.monotonic() - rep.started_at > _STABLE_S else rep.streak
            delay = min(policy.backoff_s * 2**rep.streak, _BACKOFF_CAP_S)
            rep.streak += 1
            restarts = rep.restarts + 1
            for member in gang:
                member.restarts = restarts
            self.log.warning(
                "replica_restarting",
                replica_name=rep.name,
                attempt=restarts,
                max_restarts=policy.max_restarts,
                delay_s=delay,
                gang=[m.name for m in gang] if len(gang) > 1 else None,
            )
            await asyncio.sleep(delay)  # backoff before the restart, not synchronization
            if len(gang) > 1 or self._is_gang(rep.stage):
                self._gang_ports.pop(rep.stage, None)  # a fresh rendezvous for the new group
            if not self._ending:
                try:
                    for member in gang:
                        member.done = False
                        await self._spawn(member)
                except LaunchError as exc:
                    self.log.error("replica_not_placed", replica_name=rep.name, reason=str(exc))
                    self._finish("failed", EXIT_FAILED, f"cannot restart {rep.name}: {exc}")
            self._gang_restarting.discard(rep.stage)
            return
        limit = (
            "restart policy is 'never'"
            if policy.policy == "never"
            else (f"it already restarted {rep.restarts} times (max_restarts)")
        )
        self._finish("failed", EXIT_FAILED, f"replica {rep.name} failed ({why}) and {limit}")

    def _on_control(self, topic: str, payload: dict[str, Any]) -> None:
        if topic == topics.HEARTBEAT:
            rep = self.replicas.get(f"{payload.get('stage')}.{payload.get('replica')}")
            if rep is not None and payload.get("session") == rep.session:
                rep.last_heartbeat = time.monotonic()
                held = payload.get("held")
                rep.held = held if isinstance(held, int) else 0
                if isinstance(payload.get("inboxes"), dict):
                    self._take_inboxes(rep, payload["inboxes"])
        elif topic == topics.VERSION:
            version = payload.get("version")
            if isinstance(version, int) and version > self.version:
                self.version = version
                lora = payload.get("lora_name")
                self._version_lora = lora if isinstance(lora, str) else None
        elif topic == topics.ENGINES:
            self.engines[f"{payload.get('stage')}.{payload.get('replica')}"] = payload
        elif topic == topics.SUMMARY and isinstance(payload.get("values"), dict):
            self.summary.update(payload["values"])
            self._write_summary()
        elif topic == topics.STOP:
            self._on_stop(payload)
        elif topic == topics.LEDGER:
            problem = self.ledger.take(payload)
            if problem is not None:
                self._refuse(topic, problem, payload)
            elif payload.get("final"):
                self._ledger_reported.set()

    def _take_inboxes(self, rep: _Replica, inboxes: dict[str, Any]) -> None:
        """A replica's announced inbox addresses; a change is passed on to producers at once."""
        changed = False
        for port, address in inboxes.items():
            key = f"{rep.name}.{port}"
            if port in rep.spec.get("inputs", {}) and isinstance(address, str):
                changed |= self.inboxes.get(key) != address
                self.inboxes[key] = address
        if changed:
            self.log.info("inboxes_bound", replica_name=rep.name, inboxes=inboxes)
            asyncio.get_running_loop().create_task(self._publish_inboxes())

    async def _publish_inboxes(self) -> None:
        if self.inboxes:
            await self.broker.publish(topics.ADDRESSES, {"inboxes": dict(self.inboxes)})

    def _on_stop(self, payload: dict[str, Any]) -> None:
        """A stage asks to end the run: taken only from a live replica, with a reason."""
        who = f"{payload.get('stage')}.{payload.get('replica')}"
        rep = self.replicas.get(who)
        reason, outcome = payload.get("reason"), payload.get("outcome", "succeeded")
        problem = None
        if rep is None:
            problem = f"no replica {who!r} in this run"
        elif payload.get("session") != rep.session or rep.proc is None:
            problem = f"not from the live session of {who}"
        elif not isinstance(reason, str) or not reason:
            problem = "no reason (a non-empty string)"
        elif outcome not in ("succeeded", "failed"):
            problem = f"outcome {outcome!r} is neither 'succeeded' nor 'failed'"
        if problem is not None:
            self._refuse("stop", problem, payload)
            return
        self.log.info("stop_requested", by=who, reason=reason, outcome=outcome)
        code = EXIT_OK if outcome == "succeeded" else EXIT_FAILED
        self._finish(outcome, code, f"{who} asked to stop: {reason}")

    def _refuse(self, topic: str, problem: str, payload: dict[str, Any]) -> None:
        """Count a control message that is not acted on; log its 1st, 2nd, 4th ... of a kind."""
        kind = f"{topic}: {problem}"
        self.refused[kind] += 1
        n = self.refused[kind]
        if sparse(n):
            shown = {k: payload[k] for k in list(payload)[:8]}  # bounded: it may be anything
            self.log.warning(
                "control_refused", topic=topic, problem=problem, count=n, payload=repr(shown)[:300]
            )

    async def _check_heartbeats(self) -> None:
        run = self.config.run
        while True:
            await asyncio.sleep(min(run.heartbeat_s, 0.5))
            if self.version:  # late joiners (restarted replicas) learn the live version
                lora = {"lora_name": self._version_lora} if self._version_lora else {}
                await self.broker.publish(topics.VERSION, {"version": self.version, **lora})
            done = [r.name for r in self.replicas.values() if r.done]
            if done:
                await self.broker.publish(topics.DONE, {"replicas": done})
            for announcement in list(self.engines.values()):
                await self.broker.publish(topics.ENGINES, announcement)
            await self._publish_inboxes()  # late joiners learn where their consumers are
            now = time.monotonic()
            if self.ledger and now - self._ledger_logged >= _LEDGER_EVERY_S:
                self._ledger_logged = now
                self.log.info("ledger", **self.ledger.running())
            for rep in self.replicas.values():
                if rep.proc is None or rep.proc.returncode is not None or rep.failure:
                    continue
                if rep.last_heartbeat is None:
                    if now - rep.started_at > run.startup_timeout_s:
                        rep.failure = f"no heartbeat within {run.startup_timeout_s} s of start"
                elif now - rep.last_heartbeat > run.heartbeat_timeout_s:
                    rep.failure = f"no heartbeat for {run.heartbeat_timeout_s} s"
                if rep.failure:
                    self.log.error(
                        "replica_unresponsive", replica_name=rep.name, reason=rep.failure
                    )
                    rep.proc.signal(signal.SIGKILL)

    # --------------------------------------------------------------- ending
    def _write_summary(self, **final: Any) -> None:
        values = {**self.summary, "wall_s": round(time.monotonic() - self._started, 3), **final}
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(values, indent=1, default=str))
        tmp.replace(self.run_dir / "summary.json")

    async def _balance_ledger(self) -> dict[str, Any] | None:
        """The ledger at the end (None when no stage keeps one). Waits briefly for the final
        reports of replicas that ended cleanly; fails the run when it does not balance."""
        if not self.ledger:
            return None
        clean = [r for r in self.replicas.values() if r.proc and r.proc.returncode == 0]
        sessions = [r.session for r in clean]
        deadline = time.monotonic() + _FINAL_REPORT_WAIT_S
        while self.ledger.missing_finals(sessions) and time.monotonic() < deadline:
            self._ledger_reported.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ledger_reported.wait(), deadline - time.monotonic())
        unclean, unknown = [], []  # replicas that did not end cleanly; those holding who knows
        for rep in self.replicas.values():
            if rep in clean:
                continue
            unclean.append(rep.name)
            held = self._held_after_exit(rep)
            if held is None:
                unknown.append(rep.name)
            else:
                sessions.append(self.ledger.custody_after_exit(rep.name, held))
        died = unclean + [r.name for r in clean if r.restarts]  # fed reports may be lost
        ledger = self.ledger.balance(sessions, died)
        missing = [r.name for r in clean if r.session in self.ledger.missing_finals(sessions)]
        if unclean:
            ledger["not_ended_cleanly"] = unclean
        if ledger["unaccounted"] and (unknown or missing):
            # what such a replica held is not known: the balance cannot be vouched for
            ledger["incomplete"] = {"held_unknown": unknown, "no_final_report": missing}
            self.log.warning("ledger_incomplete", **ledger["incomplete"], **_brief(ledger))
        elif ledger["unaccounted"]:
            self.log.error("ledger_unbalanced", **ledger.get("unaccounted_detail", {}))
            self._outcome.status, self._outcome.exit_code = "failed", EXIT_FAILED
            self._outcome.reason = (
                f"the ledger does not balance: {ledger['unaccounted']} prompts unaccounted for"
            )
        else:
            self.log.info("ledger_balanced", **_brief(ledger))
        return ledger

    def _held_after_exit(self, rep: _Replica) -> list[str] | None:
        """What ``rep``, not ended cleanly, still holds by its stage's own account
        (``held_after_exit``: the feeder's state file); None when the stage cannot say."""
        held_after_exit = getattr(self.loaded.stage_classes[rep.stage], "held_after_exit", None)
        if held_after_exit is None:
            return None
        try:
            return held_after_exit(self.run_dir, rep.stage, rep.index)
        except Exception as exc:  # a plugin's: its failure leaves the balance unvouched, no more
            self.log.warning("held_after_exit_failed", replica=rep.name, error=repr(exc)[:300])
            return None

    def _refused_counts(self) -> dict[str, int]:
        """Control messages not acted on: unsigned/malformed (the broker's) and by reason."""
        counts = dict(self.refused)
        stats = self.broker.stats() if hasattr(self, "broker") else {}
        if stats.get("refused"):
            counts["not signed with this run's key"] = stats["refused"]
        if stats.get("malformed"):
            counts["malformed"] = stats["malformed"]
        if stats.get("not_subscription"):  # sent to the bus's subscriber side
            counts["not a subscription"] = stats["not_subscription"]
        if stats.get("refused_peers"):  # connections, not messages: nothing of theirs got in
            counts["peers without the run's CURVE keys"] = stats["refused_peers"]
        return counts

    def _finish(self, status: str, code: int, reason: str) -> None:
        if self._outcome.done.is_set():
            return
        self._outcome.status, self._outcome.exit_code, self._outcome.reason = status, code, reason
        self._outcome.done.set()

    def _on_signal(self, signum: int) -> None:
        self._interrupts += 1
        name = signal.Signals(signum).name
        if self._interrupts == 1:
            self.log.warning("interrupted", signal=name, action="graceful shutdown")
            # 128 + signal number, as shells report it: 130 for SIGINT, 143 for SIGTERM
            self._finish("stopped", 128 + signum, f"stopped by the user ({name})")
        else:
            self.log.warning("interrupted_again", signal=name, action="killing every replica")
            for rep in self.replicas.values():
                if rep.proc is not None and rep.proc.returncode is None:
                    rep.proc.signal(signal.SIGKILL)

    async def _shutdown(self, reason: str) -> None:
        self._ending = True
        live = [r for r in self.replicas.values() if r.proc and r.proc.returncode is None]
        self.log.info("shutting_down", reason=reason, live_replicas=len(live))
        if hasattr(self, "broker"):
            await self.broker.publish(topics.SHUTDOWN, {"reason": reason})
        for rep in live:
            rep.proc.signal(signal.SIGTERM)
        deadline = self.config.run.shutdown_timeout_s
        waits = [asyncio.ensure_future(r.proc.wait()) for r in live]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=deadline)
            for rep in live:
                if rep.proc.returncode is None:
                    self.log.warning("replica_killed", replica_name=rep.name, after_s=deadline)
                    rep.proc.signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        for rep in self.replicas.values():
            if rep.watcher is not None:
                rep.watcher.cancel()
        await asyncio.gather(
            *(r.watcher for r in self.replicas.values() if r.watcher), return_exceptions=True
        )

    # --------------------------------------------------------- trackers, plot
    def _tracker_feed(self) -> TrackerFeed | None:
        """The task feeding ``run.trackers`` from the logs (``pipeline.tracking``), or None."""
        run = self.config.run
        if not run.trackers:
            return None
        return TrackerFeed(
            run.trackers,
            self.run_dir,
            params=self.loaded.resolved(),
            project=run.name,
            run_name=self.run_dir.resolve().name,
            log=self.log.bind(component="trackers"),
            replicas={name: s.replicas for name, s in self.config.stages.items()},
        )

    async def _write_plot(self) -> Path | None:
        """``RUN_DIR/plot.png`` when ``run.plot`` asks for it; a run with nothing to draw (or a
        plot that fails) gets a warning, never a failed run."""
        if not self.config.run.plot:
            return None
        from pipeline.plot import PlotError, write_plot  # matplotlib: only when asked for

        out = self.run_dir / "plot.png"
        try:
            await asyncio.to_thread(write_plot, self.run_dir, out)
        except PlotError as exc:
            self.log.warning("plot_skipped", reason=str(exc))
            return None
        except Exception:
            self.log.exception("plot_failed")
            return None
        self.log.info("plot_written", path=str(out))
        return out

    # ---------------------------------------------------------------- console
    async def _console(self, stop: asyncio.Event) -> None:
        run, view = self.config.run, None
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        if self.console == "events":
            tail = LogTail(self.run_dir, filt=LogFilter(level=run.console_level))
        else:  # the status block reads every event; console_level picks the printed ones
            tail = LogTail(self.run_dir)
            view = Console(
                total=total_steps(self.config.stages),
                every_s=run.console_every_s,
                level=run.console_level,
            )
            view.start()
        try:
            while True:
                for event in tail.poll():
                    if view is None:
                        print(render(event, color=color), flush=True)
                    else:
                        view.feed(event)
                if view is not None:
                    view.tick()
                if stop.is_set():
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.2)
        finally:
            if view is not None:
                view.stop()

    # ------------------------------------------------------------------- run
    async def run(self) -> int:
        run_dir = self.run_dir
        (run_dir / "config.yaml").write_text(dump_yaml(self.loaded.resolved()))
        self.log = configure_process_logging(
            run_dir / "logs" / "supervisor.jsonl",
            stage="supervisor",
            replica=0,
            level=self.config.run.log_level,
            version=lambda: self.version,
        )
        console_stop = asyncio.Event()
        console = asyncio.create_task(self._console(console_stop)) if self.console else None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        zctx = zmq.asyncio.Context()
        checker = feed = forwarder = None
        self.launcher.log = self.log.bind(component="launcher")
        self._started = time.monotonic()
        with contextlib.suppress(OSError, ValueError):  # a resumed run keeps what it had
            earlier = json.loads((run_dir / "summary.json").read_text())
            for key in ("status", "exit_code", "wall_s"):
                earlier.pop(key, None)
            if "ledger" in earlier:  # the ledgers of earlier processes of this run
                earlier["ledger_earlier"] = [*earlier.get("ledger_earlier", []), earlier["ledger"]]
                del earlier["ledger"]
            self.summary.update(earlier)
        try:
            await self.launcher.start()
            forwarder = asyncio.create_task(
                self.launcher.forward_logs(run_dir / "logs"), name="log-forwarder"
            )
            inboxes, control = self._addresses()
            self._write_specs(inboxes, control)
            self.broker = ControlBroker(
                control["pub"],
                control["sub"],
                zctx,
                self._on_control,
                log=self.log.bind(component="control"),
                key=self._key,
                curve=self._curve,
                insecure=self.config.transport.insecure,
            )
            await self.broker.start()
            self.log.info(
                "run_started",
                run_dir=str(run_dir),
                config=str(self.loaded.source),
                stages={n: s.replicas for n, s in self.config.stages.items()},
                curve=self._curve is not None,  # channels and bus encrypted, peers authenticated
                **process_identity(),  # `inflight logs -f` knows the run ended if this is gone
            )
            if self.placement is not None:
                self.log.info(
                    "placement",
                    host=self.placement.inventory.describe(),
                    plan=self.placement.lines(),
                    pinned=self.placement.pins_cores,
                )
            feed = self._tracker_feed()  # it reads the logs from here on
            for rep in self.replicas.values():
                await self._spawn(rep)
            if feed is not None:
                feed.start()
            checker = asyncio.create_task(self._check_heartbeats(), name="heartbeats")
            await self._outcome.done.wait()
            await self._shutdown(self._outcome.reason)
        except LaunchError as exc:
            self.log.error("replica_not_placed", reason=str(exc))
            self._finish("failed", EXIT_FAILED, str(exc))
            await self._shutdown(self._outcome.reason)
        except Exception as exc:
            self.log.exception("supervisor_failed")
            self._finish("failed", EXIT_FAILED, f"supervisor error: {exc!r}")
            await self._shutdown(self._outcome.reason)
        finally:
            for task in (checker, forwarder):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.launcher.aclose()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            ledger = await self._balance_ledger() if hasattr(self, "broker") else None
            outcome = self._outcome
            # the trackers get the run's last events (the replicas are gone), then the plot
            trackers = None if feed is None else await feed.aclose(outcome.status)
            trackers = trackers if feed is not None and feed.failed else None
            plot = await self._write_plot()
            refused = self._refused_counts()
            if self.summary or refused or ledger or trackers:
                self._write_summary(
                    status=outcome.status,
                    exit_code=outcome.exit_code,
                    **({"control_refused": refused} if refused else {}),
                    **({"ledger": ledger} if ledger else {}),
                    **({"trackers": trackers} if trackers else {}),
                )
            self.log.info(
                "run_finished",
                status=outcome.status,
                exit_code=outcome.exit_code,
                reason=outcome.reason,
                restarts={r.name: r.restarts for r in self.replicas.values() if r.restarts},
            )
            if hasattr(self, "broker"):
                await self.broker.aclose()
            zctx.destroy(linger=0)
            if self._sock_dir is not None:
                shutil.rmtree(self._sock_dir, ignore_errors=True)
            close_process_logging()
            if console is not None:
                console_stop.set()
                await console
            if plot is not None:
                print(f"plot: {plot}", flush=True)
        return self._outcome.exit_code


def _brief(ledger: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a balanced ledger, for one log line."""
    keys = ("prompts_fed", "prompts_complete", "copies_dropped", "unaccounted")
    return {**{k: ledger[k] for k in keys}, **ledger["samples"]}


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _place_here(loaded: LoadedPipeline) -> Plan:
    """The plan on this host, for a pipeline loaded without an inventory."""
    placement, issues = plan(loaded.config.stages, host_inventory())
    if issues:
        raise ConfigError(issues, str(loaded.source))
    assert placement is not None
    return placement


def _tail(rep: _Replica, lines: int = 20) -> str:
    """Last lines of a replica's raw output: where a hard crash (import error...) shows."""
    path = rep.log_file.with_suffix(".out")
    if not path.exists():  # it ran in the shared process (pipeline.host)
        path = rep.log_file.parent / "host.out"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
