"""The Ray plan ``inflight validate`` prints: every replica's ask fitted into the nodes' totals.

Nodes here are what ``ray.nodes()`` reports (the real cluster is exercised by
``test_ray_launcher``); the configs are the shipped ``configs/multinode.yaml``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline import cluster
from pipeline.cli import _resolve_stage
from pipeline.config import load_pipeline

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "configs" / "multinode.yaml"
GIB = 2**30


def _node(name: str, cpus: float, gpus: float = 0, memory_gb: float = 64, **custom) -> cluster.Node:
    resources = {"CPU": cpus, "GPU": gpus, "memory": memory_gb * GIB, **custom}
    resources[f"node:10.0.0.{len(name)}"] = 1.0  # Ray's own per-node resource
    return cluster.Node(f"{name}-{'0' * 20}", f"10.0.0.{len(name)}", resources)


def _asks(*overrides: str) -> list[cluster.Ask]:
    loaded = load_pipeline(MULTINODE, list(overrides), resolve=_resolve_stage)
    found, problems = cluster.asks(loaded.config)
    assert problems == []
    return found


FOUR_NODES = [
    _node("head", cpus=8),
    _node("learn", cpus=16, gpus=2, memory_gb=128, learner_node=2),
    _node("engA", cpus=8, gpus=1, engine_node=1),
    _node("engB1", cpus=8, gpus=1, engine_node=1),
]


def test_each_replica_goes_to_a_node_that_has_what_it_asks():
    asks = _asks()
    by_name = {a.replica: a.needs for a in asks}
    # the generator's ask includes its engine (cpus 2, gpus 1) beside its own cpu
    assert by_name["generator.0"] == {"CPU": 3.0, "GPU": 1.0, "engine_node": 1.0}
    assert by_name["learner.1"] == {"CPU": 4.0, "GPU": 1.0, "memory": 16 * GIB, "learner_node": 1}
    lines, problems = cluster.plan(asks, FOUR_NODES)
    assert problems == []
    where = {line.split()[0]: line.split("->")[1].split(":")[0].strip() for line in lines}
    head, learn, eng_a, eng_b = (n.label() for n in FOUR_NODES)
    assert where["learner.0"] == where["learner.1"] == learn == "node learn-00 (10.0.0.5)"
    assert {where["generator.0"], where["generator.1"]} == {eng_a, eng_b}
    assert where["feeder.0"] == where["scorer.0"] == head  # they ask for nothing
    assert [line.split()[0] for line in lines] == [a.replica for a in asks]  # config order
    assert "generator.0 -> node" in lines[1] and "GPU 1, engine_node 1" in lines[1]
    assert "memory 16 GiB" in next(line for line in lines if line.startswith("learner.0"))


def test_what_can_never_be_placed_is_named_with_what_the_nodes_offer():
    no_engine_nodes = FOUR_NODES[:2]
    _, problems = cluster.plan(_asks(), no_engine_nodes)
    assert problems == [
        "stages.generator.resources.custom: generator asks for engine_node, which no node of "
        "the cluster has (custom resources of its nodes: learner_node); start a node with "
        "`ray start --resources '{\"engine_node\": 1}'`"
    ]
    _, problems = cluster.plan(_asks("stages.learner.resources.gpus=4"), FOUR_NODES)
    assert problems == [
        "stages.learner.resources: a replica of learner asks for CPU 4, GPU 4, memory 16 GiB, "
        "learner_node 1, but no node has that much (the most one node has: CPU 16, GPU 2, "
        "memory 128 GiB, learner_node 2)"
    ]


def test_a_cluster_too_small_for_all_replicas_at_once_is_an_error():
    one_engine_node = [n for n in FOUR_NODES if not n.id.startswith("engB")]
    _, problems = cluster.plan(_asks(), one_engine_node)
    [problem] = problems
    assert problem.startswith("stages.generator.resources: generator.")
    assert "with the other replicas placed no node has that left" in problem
    assert "free in the whole cluster: CPU" in problem and "engine_node 0" in problem
    assert cluster.plan(_asks(), [])[1] == ["the Ray cluster has no alive nodes"]


def test_core_ids_cannot_be_asked_of_a_cluster():
    loaded = load_pipeline(
        MULTINODE, ["stages.scorer.resources.cpus=[0, 1]"], resolve=_resolve_stage
    )
    _, problems = cluster.asks(loaded.config)
    assert problems == [
        "stages.scorer.resources: resources.cpus lists core ids: on the Ray launcher give a count"
    ]


@pytest.mark.timeout(30)
def test_an_address_nothing_answers_fails_within_seconds():
    started = time.monotonic()
    with pytest.raises(cluster.ClusterUnreachable, match="no Ray cluster answers at"):
        cluster.nodes_of("127.0.0.1:1")
    with pytest.raises(cluster.ClusterUnreachable, match="is not 'auto', 'local' or"):
        cluster.nodes_of("my-head-node")
    assert time.monotonic() - started < 10
    [local], which = cluster.nodes_of("local")  # this machine, as `ray.init()` would see it
    assert local.resources["CPU"] >= 1 and local.resources["memory"] > 0.1 * GIB
    assert "one-node Ray cluster on this machine" in which
