"""The local launcher's shared process: replicas that run in one ``pipeline.host`` process.

``SharedHost`` starts the host process the first time a replica is to run there (again after
it died), tells it to start replicas and passes signals on; each replica it runs looks to the
supervisor like a process of its own (``HostedReplica``: ``pid`` is the host's, ``wait()``
returns the replica's exit code, as the host reports it). When the host process itself dies,
every replica it ran ends with its exit status (-9 after a SIGKILL), and the supervisor
restarts each under its own policy, in a new host.

``shared_stages`` says which stages share it (``run.share_process``).

Not here: the host's side (``pipeline.host``), the specs that mark in-process peers
(``pipeline.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pipeline.launchers.base import ReplicaStart, engine_resources
from pipeline.processes import child_preexec

__all__ = ["HostedReplica", "SharedHost", "shared_stages"]

_CLOSE_WAIT_S = 10.0  # at the end, how long the host gets to exit once its replicas did
# a replica told SIGKILL that has not ended this long after: the host is stuck (a stage blocks
# its event loop), and only killing the host ends it (its other replicas with it)
_KILL_GRACE_S = 5.0


def shared_stages(loaded: Any) -> tuple[set[str], dict[str, str]]:
    """The stages of a loaded pipeline that run in the shared process, and the variables that
    process gets (the union of their ``env``).

    With the local launcher and ``run.share_process`` not ``none``: stages that reserve no cores
    or GPUs (nor do the engines they launch) and are not gangs, whose class allows it
    (``shares_process``) unless ``all`` says any may, as long as the variables their ``env``
    sets agree. Fewer than two: nothing is shared.
    """
    run = loaded.config.run
    if run.launcher != "local" or run.share_process == "none":
        return set(), {}
    shared: set[str] = set()
    env: dict[str, str] = {}
    for name, section in loaded.config.stages.items():
        cls = loaded.stage_classes[name]
        if run.share_process == "auto" and not getattr(cls, "shares_process", False):
            continue
        res = section.resources
        engines = any(engine_resources(section).values())
        gang = getattr(cls, "distributed", False)
        if gang or res.cpus is not None or res.gpus or engines:
            continue
        if any(env.get(var, value) != value for var, value in section.env.items()):
            continue  # a variable a neighbour sets otherwise: a process of its own
        shared.add(name)
        env.update(section.env)
    return (shared, env) if len(shared) > 1 else (set(), {})


class HostedReplica:
    """One replica of the host process, as the supervisor sees a replica process."""

    node = "local"

    def __init__(self, name: str, host: _HostProcess) -> None:
        self.name = name
        self.pid = host.proc.pid
        self._host = host
        self._code: int | None = None
        self._ended = asyncio.Event()

    @property
    def returncode(self) -> int | None:
        return self._code

    def exited(self, code: int) -> None:
        if self._code is None:
            self._code = code
            self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self._code is not None
        return self._code

    def signal(self, sig: int) -> None:
        """SIGTERM/SIGINT: shut the replica down; SIGKILL: end it now (and the whole host if
        it has not ended ``_KILL_GRACE_S`` later: its loop is blocked). The host's other
        replicas go on. Other signals (SIGSTOP, SIGCONT) reach the whole host process."""
        if self._code is not None:
            return
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            self._host.command({"signal": self.name, "sig": int(sig)})
            if sig == signal.SIGKILL:
                asyncio.get_running_loop().call_later(_KILL_GRACE_S, self._host.unstick, self)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def release(self) -> None:
        pass  # what it started ends with its stage's close(); the host is shared


class _HostProcess:
    def __init__(self, proc: asyncio.subprocess.Process, reports: asyncio.StreamReader) -> None:
        self.proc = proc
        self.reports = reports
        self.replicas: dict[str, HostedReplica] = {}
        self.reader = asyncio.create_task(self._read(), name="host-reports")

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self.reader.done()

    def unstick(self, replica: HostedReplica) -> None:
        """``replica`` was told SIGKILL and has not ended: the host's loop is blocked."""
        if replica.returncode is None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def command(self, message: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        if stdin is None or stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            stdin.write((json.dumps(message) + "\n").encode())

    async def _read(self) -> None:
        try:
            while line := await self.reports.readline():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    report = json.loads(line)
                    replica = self.replicas.pop(str(report["exited"]), None)
                    if replica is not None:
                        replica.exited(int(report["code"]))
        finally:
            code = await self.proc.wait()  # the pipe closed: the host is gone
            for replica in self.replicas.values():
                replica.exited(code if code != 0 else 1)
            self.replicas.clear()


class SharedHost:
    """Starts the host process on demand and hands it replicas (``spawn``)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._host: _HostProcess | None = None
        self._lock = asyncio.Lock()
        self._hosts = 0

    async def spawn(self, start: ReplicaStart) -> HostedReplica:
        async with self._lock:
            if self._host is None or not self._host.alive:
                self._host = await self._start_host(start)
            host = self._host
        replica = HostedReplica(start.name, host)
        host.replicas[start.name] = replica
        host.command({"start": start.name, "spec": str(start.spec_path)})
        return replica

    async def _start_host(self, start: ReplicaStart) -> _HostProcess:
        """A new host process, with the environment of the replicas it runs (they share it:
        the supervisor gives a shared process only replicas whose environments agree)."""
        env = {**os.environ, **start.env}
        for var in start.unset:
            env.pop(var, None)
        self._hosts += 1
        name = "host" if self._hosts == 1 else f"host-{self._hosts}"
        out = open(self.log_dir / f"{name}.out", "ab")  # noqa: ASYNC230 (a local file)
        report_r, report_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pipeline.host",
                str(self.log_dir / f"{name}.jsonl"),
                str(report_w),
                stdin=asyncio.subprocess.PIPE,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=child_preexec(cores=None),  # dies with the supervisor
                pass_fds=(report_w,),
                env=env,
            )
        finally:
            out.close()
            os.close(report_w)
        loop = asyncio.get_running_loop()
        reports = asyncio.StreamReader()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reports), os.fdopen(report_r, "rb")
        )
        return _HostProcess(proc, reports)

    async def aclose(self) -> None:
        """Close the host's stdin (it shuts down what still runs), wait, then kill it."""
        host, self._host = self._host, None
        if host is None:
            return
        if host.proc.stdin is not None:
            host.proc.stdin.close()
        try:
            await asyncio.wait_for(host.proc.wait(), _CLOSE_WAIT_S)
        except asyncio.TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(host.proc.pid, signal.SIGKILL)
        await host.proc.wait()
        host.reader.cancel()
        await asyncio.gather(host.reader, return_exceptions=True)
