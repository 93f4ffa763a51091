"""Where replicas run: child processes on this host, or Ray actors on a cluster.

The supervisor decides what runs (specs, restarts, gangs, the ledger); a launcher decides where
and how a replica's process is started, signalled and waited for. Both start the very same
``python -m pipeline.actor SPEC`` process, so a stage never knows where it runs.

- ``local`` (``pipeline.launchers.local``): a child process of ``inflight run`` in its own
  process group, pinned to the cores the placement plan gives it.
- ``ray`` (``pipeline.launchers.ray``): one Ray actor per replica, asking Ray for the replica's
  resources (a learner gang: one placement group); the actor starts the replica as its own child
  on its node and forwards its logs to the driver's run directory.

Not here: the placement plan (``pipeline.placement``, ``pipeline.cluster``), the specs and
restart policies (``pipeline.supervisor``).
"""

from __future__ import annotations

from typing import Any

from pipeline.launchers.base import Launcher, LaunchError, ReplicaProcess, ReplicaStart

__all__ = ["LaunchError", "Launcher", "ReplicaProcess", "ReplicaStart", "make_launcher"]


def make_launcher(config: Any, log: Any) -> Launcher:
    """The launcher ``run.launcher`` names (Ray is imported only when asked for)."""
    if config.run.launcher == "ray":
        from pipeline.launchers.ray import RayLauncher

        return RayLauncher(config, log)
    from pipeline.launchers.local import LocalLauncher

    return LocalLauncher(config, log)
