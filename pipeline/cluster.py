"""Where a Ray cluster would put each replica, found before anything starts (``inflight validate``).

Each replica asks Ray for what the Ray launcher will ask (``launchers.ray.actor_options``: its
``resources`` plus the engines it launches, which run beside it): CPU, GPU, memory and custom
resources. ``plan`` fits every ask into the alive nodes' totals, largest asks first, each node's
capacity shrinking as replicas land on it (the ranks of a gang are one bundle each, as in their
placement group). What can never be placed is an error naming the replica, what it asks and the
most any node offers: a custom resource no node has, more GPUs than the largest node, a
cluster too small for all replicas at once. The plan is Ray's view at validation time: Ray's
scheduler may pick other nodes, but a replica the plan cannot place, Ray cannot place either.

The Ray launcher checks the same plan when it joins, before it starts anything.
``nodes_of`` joins the cluster at ``run.ray.address`` to read it: ``local`` plans on this
machine (the one-node cluster a run would start); ``auto`` with no cluster running is not an
error (the run checks again when it starts); an explicit ``HOST:PORT`` that does not answer
is, within seconds.

Not here: starting replicas (``pipeline.launchers.ray``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from pipeline.launchers.base import LaunchError, engine_resources

__all__ = ["Ask", "ClusterUnreachable", "Node", "alive_nodes", "asks", "nodes_of", "plan", "probe"]

_GIB = 2**30
_PROBE_S = 5.0
_KNOWN = ("CPU", "GPU", "memory")
_RAY_OWN = ("node:", "accelerator_type:", "object_store_memory")  # not asked by users


class ClusterUnreachable(RuntimeError):
    """``run.ray.address`` names a cluster that does not answer."""


@dataclass(frozen=True)
class Node:
    id: str
    ip: str
    resources: dict[str, float]  # Ray's totals: CPU, GPU, memory (bytes), custom names

    def label(self) -> str:
        return f"node {self.id[:8]} ({self.ip})"


@dataclass
class Ask:
    replica: str  # stage.index
    path: str  # where it is asked: stages.NAME.resources
    needs: dict[str, float] = field(default_factory=dict)  # Ray resource -> amount (non-zero)


def asks(config: Any) -> tuple[list[Ask], list[str]]:
    """Every replica's ask, in config order, and the problems that stop it being asked."""
    from pipeline.launchers.ray import actor_options

    found: list[Ask] = []
    problems: list[str] = []
    for name, section in config.stages.items():
        path = f"stages.{name}.resources"
        try:
            options = actor_options(section.resources, engine_resources(section))
        except LaunchError as exc:
            problems.append(f"{path}: {exc}")
            continue
        needs = {
            "CPU": float(options["num_cpus"]),
            "GPU": float(options["num_gpus"]),
            "memory": float(options.get("memory", 0)),
            **{k: float(v) for k, v in options.get("resources", {}).items()},
        }
        needs = {k: v for k, v in needs.items() if v}
        found += [Ask(f"{name}.{i}", path, dict(needs)) for i in range(section.replicas)]
    return found, problems


def _amount(resource: str, value: float) -> str:
    if resource == "memory":
        return f"memory {value / _GIB:g} GiB"
    return f"{resource} {value:g}"


def _describe(needs: dict[str, float]) -> str:
    return ", ".join(_amount(k, v) for k, v in needs.items()) or "nothing"


def plan(all_asks: list[Ask], nodes: list[Node]) -> tuple[list[str], list[str]]:
    """Lines ``replica -> node``, in config order, and what cannot be placed (empty: all fit)."""
    problems: list[str] = []
    if not nodes:
        return [], ["the Ray cluster has no alive nodes"]
    offered = {k for n in nodes for k, v in n.resources.items() if v}
    custom = sorted(k for k in offered if k not in _KNOWN and not k.startswith(_RAY_OWN))
    for ask in all_asks:
        stage = ask.replica.rpartition(".")[0]
        unknown = sorted(k for k in ask.needs if k not in _KNOWN and k not in offered)
        if unknown:
            problems.append(
                f"{ask.path}.custom: {stage} asks for {', '.join(unknown)}, which no node of "
                f"the cluster has (custom resources of its nodes: {', '.join(custom) or 'none'}); "
                f"start a node with `ray start --resources '{{\"{unknown[0]}\": 1}}'`"
            )
        elif not any(_fits(ask.needs, n.resources) for n in nodes):
            most = {k: max(n.resources.get(k, 0.0) for n in nodes) for k in ask.needs}
            problems.append(
                f"{ask.path}: a replica of {stage} asks for {_describe(ask.needs)}, but no node "
                f"has that much (the most one node has: {_describe(most)})"
            )
    if problems:
        return [], _unique(problems)
    free = {n.id: dict(n.resources) for n in nodes}
    where: dict[str, Node] = {}
    # largest first (GPUs, then custom, then CPUs): first-fit then rarely strands a big ask
    order = sorted(
        all_asks,
        key=lambda a: (
            -a.needs.get("GPU", 0),
            -sum(v for k, v in a.needs.items() if k not in _KNOWN),
            -a.needs.get("CPU", 0),
            -a.needs.get("memory", 0),
        ),
    )
    for ask in order:
        node = next((n for n in nodes if _fits(ask.needs, free[n.id])), None)
        if node is None:
            left = {k: sum(free[n.id].get(k, 0.0) for n in nodes) for k in ask.needs}
            problems.append(
                f"{ask.path}: {ask.replica} asks for {_describe(ask.needs)}, but with the other "
                f"replicas placed no node has that left (free in the whole cluster: "
                f"{_describe(left)}); add nodes or ask for less"
            )
            continue
        for k, v in ask.needs.items():
            free[node.id][k] -= v
        where[ask.replica] = node
    if problems:
        return [], problems
    width = max(len(a.replica) for a in all_asks) if all_asks else 0
    lines = [
        f"{a.replica.ljust(width)} -> {where[a.replica].label()}: {_describe(a.needs)}"
        for a in all_asks
    ]
    return lines, []


def _fits(needs: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in needs.items())


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def probe(address: str) -> None:
    """Raise ClusterUnreachable unless something listens at ``[ray://]HOST:PORT``."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnreachable(
            f"run.ray.address={address!r} is not 'auto', 'local' or [ray://]HOST:PORT"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S):
            pass
    except OSError as exc:
        raise ClusterUnreachable(
            f"no Ray cluster answers at run.ray.address={address!r} ({exc}); start its head "
            "with `ray start --head`, or fix the address"
        ) from None


def alive_nodes() -> list[Node]:
    """The alive nodes of the cluster this process has joined (``ray.init``)."""
    import ray

    return [
        Node(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _local_node() -> Node:
    from pipeline.placement import host_inventory

    inventory = host_inventory()
    resources = {"CPU": float(len(inventory.cores)), "GPU": float(len(inventory.gpus))}
    if inventory.memory_gb:
        resources["memory"] = inventory.memory_gb * _GIB
    return Node("local", "this machine", resources)


def nodes_of(address: str) -> tuple[list[Node] | None, str]:
    """The alive nodes of the cluster at ``address`` and a line saying which cluster; None
    (with the reason) when ``auto`` finds no cluster. Raises ClusterUnreachable."""
    if address == "local":
        return [_local_node()], "a one-node Ray cluster on this machine (run.ray.address: local)"
    if address != "auto":
        probe(address)
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as exc:
        if address == "auto":
            return None, (
                "no Ray cluster is running on this machine (run.ray.address: auto), so the plan "
                "is checked when the run starts; `ray start --head` makes one"
            )
        raise ClusterUnreachable(f"cannot join run.ray.address={address!r}: {exc}") from None
    try:
        nodes = alive_nodes()
    finally:
        ray.shutdown()
    return nodes, f"the Ray cluster at {address} ({len(nodes)} alive nodes)"
