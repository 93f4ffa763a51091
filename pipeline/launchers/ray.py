"""The Ray launcher: every replica a Ray actor, placed by Ray with the resources it asks for.

``run.launcher: ray`` joins the cluster at ``run.ray.address`` (``auto``: the one ``ray start``
made on this machine; ``local``: a one-node cluster started for the run). Each replica becomes
one ``ReplicaHost`` actor (``pipeline.launchers.ray_host``) asking for the replica's
``resources`` (plus those of the engines a generator launches, which run beside it); the actor
starts the same ``python -m pipeline.actor`` process a local run starts. The ranks of a gang
(the learner) share one placement group, one bundle per rank, strategy PACK; their
``MASTER_ADDR``/``MASTER_PORT`` come from rank 0's node.

A replica Ray cannot place within ``run.ray.placement_timeout_s`` fails the run with a message
naming what it asked for and what the cluster has (never a silent hang). A replica whose node
dies exits with "node lost" and is restarted like any failed replica: Ray places the new actor
on a node that has the resources. Logs are pulled from the actors into ``RUN_DIR/logs``.

Not here: the plan ``inflight validate`` prints (``pipeline.cluster``), restart policies
(``pipeline.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from pipeline.launchers.base import LaunchError, ReplicaStart

__all__ = ["RayLauncher", "RayProcess"]

_FORWARD_EVERY_S = 0.3
# what a replica whose resources are free gets past run.ray.placement_timeout_s: Ray starts a
# worker process for each actor, seconds on a busy machine, and that is no placement failure
_START_GRACE_S = 60.0
_LOOKS_FREE = "resources look free"


def actor_options(resources: Any, extra: dict[str, float] | None = None) -> dict[str, Any]:
    """Ray actor options for a replica's ``resources`` (plus ``extra`` cpus/gpus)."""
    extra = extra or {}
    if resources is not None and isinstance(resources.cpus, list):
        raise LaunchError("resources.cpus lists core ids: on the Ray launcher give a count")
    if resources is not None and isinstance(resources.gpus, list):
        raise LaunchError("resources.gpus lists GPU ids: on the Ray launcher give a count")
    cpus = (resources.cpus or 0) if resources is not None else 0
    gpus = (resources.gpus or 0) if resources is not None else 0
    options: dict[str, Any] = {
        "num_cpus": cpus + extra.get("cpus", 0),
        "num_gpus": gpus + extra.get("gpus", 0),
    }
    if resources is not None and resources.memory_gb:
        options["memory"] = int(resources.memory_gb * 2**30)
    if resources is not None and resources.custom:
        options["resources"] = dict(resources.custom)
    return options


def _split(asked: dict[str, float]) -> str:
    """Why ``asked``, free on the cluster as a whole, may still fit no one node ("" if one fits
    or Ray cannot say): what the node with the most of it has free now."""
    try:
        from ray._private.state import available_resources_per_node

        per_node = available_resources_per_node()
    except Exception:  # a private API: without it, the cluster's totals are all there is
        return ""
    if not per_node or any(
        all(free.get(k, 0) >= v for k, v in asked.items()) for free in per_node.values()
    ):
        return ""

    def share(free: dict[str, float]) -> float:  # how much of the ask a node has free now
        return sum(min(free.get(k, 0) / v, 1.0) for k, v in asked.items())

    best = max(per_node.values(), key=share)
    have = ", ".join(f"{k} {best.get(k, 0):g}" for k in asked)
    return f"free on no one node (the node with the most of it has {have} free)"


class RayProcess:
    """A replica hosted by a ``ReplicaHost`` actor: waited for, signalled and released."""

    def __init__(self, launcher: RayLauncher, actor: Any, pid: int, node: dict) -> None:
        self._launcher, self.actor, self.pid = launcher, actor, pid
        self.node = node["node_id"]
        self.ip = node["ip"]
        self.lost: str | None = None  # why the actor is gone, when its node died
        self._code: int | None = None
        self._waiter: asyncio.Future | None = None
        self.pulling = asyncio.Lock()  # log pulls in order: the forwarder's and the last one

    @property
    def returncode(self) -> int | None:
        return self._code

    async def _wait(self) -> int:
        import ray

        try:
            code = await self.actor.wait.remote()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            self.lost = f"its Ray actor died (node lost?): {str(exc).splitlines()[0][:200]}"
            code = -signal.SIGKILL
        await self._launcher.pull_logs(self)
        self._code = code
        return code

    async def wait(self) -> int:
        if self._waiter is None:
            self._waiter = asyncio.ensure_future(self._wait())
        return await asyncio.shield(self._waiter)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(Exception):  # a dead actor has nothing left to signal
            self.actor.signal.remote(int(sig))

    async def release(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.cleanup.remote(), 5.0)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        self._launcher.forget(self)


class RayLauncher:
    remote = True

    def __init__(self, config: Any, log: Any) -> None:
        self.config, self.log = config, log
        self.settings = config.run.ray
        self._host_cls: Any = None
        self._groups: dict[str, Any] = {}  # gang stage -> placement group
        self._masters: dict[str, tuple[str, int]] = {}  # gang stage -> rank 0's address
        self._live: list[RayProcess] = []
        self._logs: Path | None = None
        self.ip = "127.0.0.1"

    async def start(self) -> None:
        import ray

        from pipeline import cluster
        from pipeline.launchers.ray_host import ReplicaHost, node_ip

        kwargs: dict[str, Any] = {"log_to_driver": False, "namespace": self.settings.namespace}
        address = self.settings.address
        try:
            if address not in ("auto", "local"):
                cluster.probe(address)  # a dead address fails in seconds, not Ray's minute
            if address == "local":
                await asyncio.to_thread(ray.init, include_dashboard=False, **kwargs)
            else:
                await asyncio.to_thread(ray.init, address=address, **kwargs)
        except cluster.ClusterUnreachable as exc:
            raise LaunchError(str(exc)) from None
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise LaunchError(
                f"cannot join the Ray cluster at run.ray.address={address!r}: {exc} "
                "(start one with `ray start --head`, or set run.ray.address: local)"
            ) from exc
        self.ip = node_ip()  # the control bus binds here: the interface torch would use, too
        self._host_cls = ray.remote(max_restarts=0, max_task_retries=0)(ReplicaHost)
        nodes = cluster.alive_nodes()
        self.log.info(
            "ray_joined",
            address=address,
            driver_ip=self.ip,
            nodes=len(nodes),
            resources=ray.cluster_resources(),
        )
        # what no node can ever hold fails here, before anything starts (never a silent wait)
        asks, problems = cluster.asks(self.config)
        plan, unplaceable = cluster.plan(asks, nodes)
        if problems or unplaceable:
            raise LaunchError("; ".join(problems + unplaceable))
        self.log.info("ray_plan", plan=plan)

    def control_host(self) -> str:
        return self.ip

    def _missing(self, options: dict[str, Any]) -> str:
        import ray

        have = ray.available_resources()
        total = ray.cluster_resources()
        asked = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0)}
        if options.get("memory"):
            asked["memory"] = options["memory"]
        asked.update(options.get("resources", {}))
        asked = {k: v for k, v in asked.items() if v}
        short = {
            k: f"asked {v:g}, free {have.get(k, 0):g} of {total.get(k, 0):g}"
            for k, v in asked.items()
            if have.get(k, 0) < v
        }
        if short:
            return "; ".join(f"{k}: {v}" for k, v in short.items())
        return _split(asked) or _LOOKS_FREE

    async def _group(self, stage: str, world: int, options: dict[str, Any]) -> Any:
        """The placement group of a gang (made once, PACK, one bundle per rank)."""
        from ray.util.placement_group import placement_group

        if stage in self._groups:
            return self._groups[stage]
        bundle = {"CPU": options["num_cpus"], "GPU": options["num_gpus"]}
        if options.get("memory"):
            bundle["memory"] = options["memory"]
        bundle.update(options.get("resources", {}))
        bundle = {k: v for k, v in bundle.items() if v}
        group = placement_group([bundle or {"CPU": 0.001}] * world, strategy="PACK")
        try:
            await asyncio.wait_for(group.ready(), self.settings.placement_timeout_s)
        except asyncio.TimeoutError:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)
            raise LaunchError(
                f"Ray could not place the {world} ranks of {stage} (one bundle each: {bundle}) "
                f"within {self.settings.placement_timeout_s} s: {self._missing(options)}"
            ) from None
        self._groups[stage] = group
        return group

    async def _placed(self, actor: Any, name: str, options: dict[str, Any]) -> dict:
        """The node ``actor`` runs on, once Ray has placed it and its worker answers.

        Past ``placement_timeout_s`` the run fails if what the actor asks for is short on the
        cluster. If it all looks free, Ray is still starting the worker (seconds on a busy
        machine): that gets ``_START_GRACE_S`` more before the run fails.
        """
        limit = self.settings.placement_timeout_s
        answer = asyncio.wrap_future(actor.node.remote().future())
        # given up (or the launch cancelled): what it ends with later is nobody's to read
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({answer}, timeout=limit)
        missing, waited = self._missing(options), limit
        if not done and missing == _LOOKS_FREE:
            self.log.info("ray_worker_slow", replica=name, waited_s=limit)
            done, _ = await asyncio.wait({answer}, timeout=_START_GRACE_S)
            missing, waited = self._missing(options), limit + _START_GRACE_S
        if done:
            return answer.result()
        import ray

        answer.cancel()
        ray.kill(actor)
        raise LaunchError(
            f"Ray could not place {name} within {waited} s "
            f"(run.ray.placement_timeout_s): it asks {options}; {missing}"
        )

    async def spawn(self, start: ReplicaStart) -> RayProcess:
        options = actor_options(start.resources, start.extra)
        if start.gang is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = await self._group(start.gang[0], start.gang[1], options)
            options = {
                k: v for k, v in options.items() if k in ("num_cpus", "num_gpus", "memory")
            } | {"resources": options.get("resources", {})}
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=start.index
            )
        # named for Ray's state API and `ray list actors`: replica and session
        name = f"inflight:{start.name}:{start.spec.get('session', '')}"
        actor = self._host_cls.options(name=name, **options).remote(start.name)
        node = await self._placed(actor, start.name, options)
        env = dict(start.env)
        if start.gang is not None:
            if start.index == 0 or start.gang[0] not in self._masters:
                self._masters[start.gang[0]] = (node["ip"], await actor.free_port.remote())
            addr, port = self._masters[start.gang[0]]
            env.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        pid = await actor.start.remote(start.spec, env, start.unset, os.getcwd())
        proc = RayProcess(self, actor, pid, node)
        self._live.append(proc)
        return proc

    def forget(self, proc: RayProcess) -> None:
        with contextlib.suppress(ValueError):
            self._live.remove(proc)

    async def pull_logs(self, proc: RayProcess) -> None:
        """Append the new log lines of ``proc``'s replica to the run's logs folder."""
        if self._logs is None:
            return
        async with proc.pulling:
            try:
                chunks = await asyncio.wait_for(proc.actor.read_logs.remote(), 10.0)
            except Exception:  # its node is gone: what it wrote there is lost with it
                return
            for name, data in chunks.items():
                with open(self._logs / name, "ab") as f:  # noqa: ASYNC230 (local appends)
                    f.write(data)

    async def forward_logs(self, logs: Path) -> None:
        self._logs = logs
        while True:
            started = time.monotonic()
            for proc in list(self._live):
                if proc.returncode is None:
                    await self.pull_logs(proc)
            await asyncio.sleep(max(0.05, _FORWARD_EVERY_S - (time.monotonic() - started)))

    async def aclose(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for proc in list(self._live):
            await proc.release()
        for group in self._groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self._groups.clear()
        await asyncio.to_thread(ray.shutdown)
