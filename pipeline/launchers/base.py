"""What the supervisor asks of a launcher, and what a started replica looks like to it.

Not here: any way of starting processes (``local``, ``ray``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["LaunchError", "Launcher", "ReplicaProcess", "ReplicaStart", "engine_resources"]


class LaunchError(RuntimeError):
    """A replica could not be started where its resources ask (the message says what and
    why): the run fails with it rather than waiting forever."""


@dataclass
class ReplicaStart:
    """Everything a launcher needs to start one replica process."""

    name: str  # stage.replica
    stage: str
    index: int
    spec: dict[str, Any]  # the replica's spec (pipeline.actor), written where it runs
    spec_path: Path  # where the local launcher writes it (private to the user)
    env: dict[str, str]  # variables to set on top of the environment where it runs
    unset: list[str] = field(default_factory=list)  # variables to remove there
    cores: list[int] | None = None  # local: pin to these cores
    resources: Any = None  # pipeline.config.schema.Resources of the replica (Ray asks for them)
    extra: dict[str, float] = field(default_factory=dict)  # more cpus/gpus: engines it launches
    out_path: Path | None = None  # its raw stdout/stderr in the run directory
    gang: tuple[str, int] | None = None  # (stage, world size) when a rank of a gang
    shared: bool = False  # local: runs in the shared process (pipeline.host), not one of its own


class ReplicaProcess(Protocol):
    """A started replica: like ``asyncio.subprocess.Process`` (``pid``, ``returncode``,
    ``wait()``) plus ``signal``, which reaches its whole process group, and ``release``."""

    pid: int
    node: str  # where it runs ("local", or the Ray node id)

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def signal(self, sig: int) -> None: ...

    async def release(self) -> None:
        """After it exited: kill whatever it left behind and free what held it."""


class Launcher(Protocol):
    remote: bool  # replicas may run on other hosts (tcp inboxes bound at port 0, announced)

    async def start(self) -> None: ...

    def control_host(self) -> str:
        """The host the supervisor's control bus binds, reachable by every replica."""

    async def spawn(self, start: ReplicaStart) -> ReplicaProcess: ...

    async def forward_logs(self, logs: Path) -> None:
        """Copy new log lines of replicas that run elsewhere into ``logs`` (a no-op locally)."""

    async def aclose(self) -> None: ...


def engine_resources(section: Any) -> dict[str, float]:
    """CPUs and GPUs of the engines a replica launches (they run beside it, on its node)."""
    launch = getattr(section.options, "launch", None)
    res = getattr(launch, "resources", None)
    if launch is None or res is None:
        return {}
    count = getattr(launch, "count", 1)
    cpus = res.cpus if isinstance(res.cpus, int) else 0
    gpus = res.gpus if isinstance(res.gpus, int) else 0
    return {"cpus": cpus * count, "gpus": gpus * count}
