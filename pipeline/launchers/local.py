"""The local launcher: every replica a child process of ``inflight run`` on this host.

A replica the supervisor marks ``shared`` runs in the one shared process instead
(``pipeline.launchers.shared``, ``run.share_process``). Any other replica runs ``python -m
pipeline.actor SPEC`` in its own process group (so a Ctrl-C reaches only the supervisor), dies
with the supervisor (``PR_SET_PDEATHSIG``), and is pinned to the cores the placement plan gives
it before it runs anything (``pipeline.processes``).

Not here: which cores (``pipeline.placement``), restarts (``pipeline.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pipeline.launchers.base import ReplicaStart
from pipeline.launchers.shared import HostedReplica, SharedHost
from pipeline.processes import child_preexec

__all__ = ["LocalLauncher", "LocalProcess", "kill_group", "write_private"]


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (spec files hold the run's keys)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


class LocalProcess:
    """A replica started by ``LocalLauncher``: an ``asyncio`` subprocess, signalled as a group."""

    node = "local"

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def signal(self, sig: int) -> None:
        kill_group(self.pid, sig)

    async def release(self) -> None:
        kill_group(self.pid, signal.SIGKILL)  # anything the replica left behind


class LocalLauncher:
    remote = False

    def __init__(self, config: Any, log: Any) -> None:
        self.config, self.log = config, log
        self._shared: SharedHost | None = None

    async def start(self) -> None:
        pass

    def control_host(self) -> str:
        return self.config.transport.host

    async def spawn(self, start: ReplicaStart) -> LocalProcess | HostedReplica:
        import json

        write_private(start.spec_path, json.dumps(start.spec, indent=1))
        assert start.out_path is not None
        if start.shared:
            if self._shared is None:
                self._shared = SharedHost(start.out_path.parent)
            return await self._shared.spawn(start)
        env = {**os.environ, **start.env}
        for var in start.unset:
            env.pop(var, None)
        out = open(start.out_path, "ab")  # noqa: ASYNC230 (a local file)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pipeline.actor",
                str(start.spec_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                # no replica outlives a killed supervisor; pinned before it runs anything
                preexec_fn=child_preexec(cores=start.cores),
                env=env,
            )
        finally:
            out.close()
        return LocalProcess(proc)

    async def forward_logs(self, logs: Path) -> None:
        pass  # replicas write into the run directory themselves

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()
