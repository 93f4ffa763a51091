"""The Ray launcher on a real multi-node Ray cluster simulated on this machine.

One ``ray.cluster_utils.Cluster`` for the module (nodes told apart by custom resources, never by
IP: they share one); each test runs ``inflight run ... run.launcher=ray`` as a user does and
checks where Ray placed the replicas from Ray's own state (actor -> node), not from our logs.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.pipeline.runs import events, run_inflight, start_inflight, wait_for

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

EXAMPLE = "configs/example.yaml"
DEFAULT = "configs/default.yaml"
MULTINODE = "configs/multinode.yaml"

# node kind -> its custom resources; "b" twice: a spare for the node that is removed
NODES = {
    "a": {"node_a": 1},
    "b": {"node_b": 2},
    "b2": {"node_b": 2},
    "c": {"node_c": 1, "learner_slot": 1},
    "d": {"learner_slot": 1},
}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": NODES["a"], "include_dashboard": False},
    )
    nodes = {"a": c.head_node}
    for kind in ("b", "b2", "c", "d"):
        nodes[kind] = c.add_node(num_cpus=2, resources=NODES[kind])
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    c.kinds = nodes
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(autouse=True)
def idle(cluster):
    """Each test starts on an idle cluster: the last run's actors may take seconds to go on a
    busy machine, and a run placed meanwhile would find its node's CPUs held."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        free, total = ray.available_resources(), ray.cluster_resources()
        if all(free.get(k, 0) >= v for k, v in total.items() if k.startswith(_HELD)):
            return
        time.sleep(0.2)


_HELD = ("CPU", "GPU", "node_", "learner_slot")


def _nodes(run_dir) -> dict[str, list[str]]:
    """Replica -> the ids of the nodes Ray ran its actors on, oldest first (Ray's state)."""
    from ray._private.state import actors

    sessions = {e.get("session") for e in events(run_dir, "supervisor")}
    placed: dict[str, list[tuple[float, str]]] = {}
    for actor in actors().values():
        name = actor.get("Name") or ""
        if actor.get("ActorClassName") != "ReplicaHost" or not name.startswith("inflight:"):
            continue
        replica, session = name.split(":")[1:3]
        if session in sessions:  # not an actor of another test's run
            node = actor["Address"]["NodeID"]
            placed.setdefault(replica, []).append((actor.get("StartTime", 0), node))
    return {r: [node for _, node in sorted(v)] for r, v in placed.items()}


def _kinds(node_id: str) -> list[str]:
    """The custom resources (node kinds) of a live node."""
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return sorted(k for k in node["Resources"] if k.startswith(("node_", "learner_slot")))


def _placed(run_dir) -> dict[str, list[list[str]]]:
    """Replica -> the kinds of the nodes its actors ran on, oldest first."""
    return {r: [_kinds(n) for n in nodes] for r, nodes in _nodes(run_dir).items()}


def _ray_args(cluster, run_dir, *extra):
    return (
        "run.launcher=ray",
        f"run.ray.address={cluster.address}",
        "run.ray.placement_timeout_s=20",
        "--run-dir",
        str(run_dir),
        *extra,
    )


@pytest.mark.timeout(60)
def test_validate_prints_the_node_each_replica_would_go_to(cluster):
    """configs/multinode.yaml, its custom resources renamed to this cluster's nodes."""
    on_this_cluster = (
        "stages.generator.resources.custom={node_b: 1}",
        "stages.generator.launch.resources={cpus: 1}",
        "stages.learner.resources={cpus: 1, custom: {learner_slot: 1}}",
        f"run.ray.address={cluster.address}",
    )
    result = run_inflight("validate", MULTINODE, *on_this_cluster, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Ray plan on the Ray cluster at" in result.stdout
    where = {
        line.split()[0]: line.split("(")[0].split()[-1]
        for line in result.stdout.splitlines()
        if " -> node " in line
    }
    ids = {kind: node.node_id[:8] for kind, node in cluster.kinds.items()}
    # two CPUs a node: one generator (and its engine) on each node_b node
    assert {where["generator.0"], where["generator.1"]} == {ids["b"], ids["b2"]}
    assert {where["learner.0"], where["learner.1"]} == {ids["c"], ids["d"]}
    too_big = run_inflight(
        "validate", MULTINODE, *on_this_cluster, "stages.learner.resources.gpus=1", timeout=50
    )
    assert too_big.returncode == 2
    assert (
        "stages.learner.resources: a replica of learner asks for CPU 1, GPU 1, learner_slot 1, "
        "but no node has that much (the most one node has: CPU 2, GPU 0, learner_slot 1)"
    ) in too_big.stderr


@pytest.mark.timeout(240)
def test_two_learner_ranks_on_two_nodes_train_with_zero2_and_publish(cluster, tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        DEFAULT,
        "stages.learner.replicas=2",
        "stages.learner.deepspeed.zero_stage=2",
        "stages.learner.steps=6",
        "stages.learner.eval.max_prompts=20",
        "stages.learner.checkpoint.every=0",
        "stages.learner.resources.custom.learner_slot=1",
        *_ray_args(cluster, run_dir),
        timeout=220,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    placed = _placed(run_dir)
    # one slot per node: the PACK placement group had to spread the ranks over c and d, each
    # time the gang was placed (a gang restarts whole, as when another process took the
    # rendezvous port between its choice and rank 0's bind: seen with the suite on two workers)
    attempts = list(zip(placed["learner.0"], placed["learner.1"], strict=True))
    assert attempts and all(
        sorted(pair) == [["learner_slot"], ["learner_slot", "node_c"]] for pair in attempts
    ), attempts
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    assert len(steps) == 6
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["publishes"]["published"] == 6 and summary["publishes"]["failed"] == 0
    # and the generator sampled with them: rollouts of versions > 0 reached the learner
    assert max(e.get("mean_lag", 0) for e in steps) >= 0 and summary["policy_version"] == 6


@pytest.mark.timeout(360)
def test_rl_run_on_the_nodes_asked_for_learns_and_survives_losing_a_node(cluster, tmp_path):
    """Every stage on the node asked for (Ray's own state says so); the scorer's node is
    removed mid-run: its replicas restart on the spare and the run learns to its end."""
    run_dir = tmp_path / "run"
    proc = start_inflight(
        "run",
        DEFAULT,
        "stages.learner.steps=50",
        "stages.learner.eval.every=50",
        "stages.learner.eval.max_prompts=300",
        "stages.learner.checkpoint.every=0",
        "stages.generator.resources.custom.node_a=1",
        "stages.generator.launch.in_process=false",  # an engine process, its logs forwarded
        "stages.feeder.resources.custom.node_b=1",
        "stages.scorer.resources.custom.node_b=1",
        "stages.learner.resources.custom.node_c=1",
        "run.heartbeat_timeout_s=10",
        "-q",
        *_ray_args(cluster, run_dir),
    )
    try:
        wait_for(
            lambda: sum(e["event"] == "train_step" for e in events(run_dir, "learner.0")) >= 5,
            150,  # a cluster's start and four processes' imports: ~60 s alone, twice that busy
            "5 train steps",
            proc=proc,
            run_dir=run_dir,
        )
        placed = _placed(run_dir)
        assert placed["generator.0"] == [["node_a"]]
        assert placed["feeder.0"] == [["node_b"]] and placed["scorer.0"] == [["node_b"]]
        assert placed["learner.0"] == [["learner_slot", "node_c"]]
        (scorer_node,) = _nodes(run_dir)["scorer.0"]
        victim = next(n for n in cluster.kinds.values() if n.node_id == scorer_node)
        cluster.remove_node(victim, allow_graceful=False)
        cluster.kinds = {k: n for k, n in cluster.kinds.items() if n is not victim}
        proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    started = [e for e in events(run_dir, "supervisor") if e["event"] == "run_started"]
    assert started[0]["curve"] is True  # off loopback: every socket on CURVE, by default
    failed = [e for e in events(run_dir, "supervisor") if e["event"] == "replica_failed"]
    assert {e["replica_name"] for e in failed} >= {"scorer.0", "feeder.0"}
    first, again = _nodes(run_dir)["scorer.0"]
    assert first == scorer_node and again != scorer_node
    assert _kinds(again) == ["node_b"]  # again a node with node_b: the spare
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger"]["unaccounted"] == 0
    evals = [e for e in events(run_dir, "learner.0") if e["event"] == "eval"]
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] + 0.03, evals
    # the replicas' logs (engines' included) reached the driver's run directory
    shown = run_inflight("logs", str(run_dir), timeout=30).stdout
    for name in ("feeder.0", "generator.0", "scorer.0", "learner.0", "generator-0-engine.0"):
        assert f" {name} " in shown, name


@pytest.mark.timeout(60)
def test_a_replica_no_node_can_hold_fails_the_run_naming_what_is_missing(cluster, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_inflight(
        "run",
        EXAMPLE,
        "stages.summary.resources.custom.node_z=1",
        *_ray_args(cluster, run_dir),
        "run.ray.placement_timeout_s=3",
        timeout=50,
    )
    assert result.returncode == 1
    assert time.monotonic() - started < 40
    finished = [e for e in events(run_dir, "supervisor") if e["event"] == "run_finished"][-1]
    # refused when the launcher joined the cluster, before anything started
    assert (
        "stages.summary.resources.custom: summary asks for node_z, which no node"
        in (finished["reason"])
    )
    assert not [e for e in events(run_dir, "supervisor") if e["event"] == "replica_spawned"]


@pytest.mark.timeout(60)
def test_a_replica_whose_node_is_busy_fails_the_run_after_the_placement_timeout(cluster, tmp_path):
    """The cluster has node_a, but something else holds it: Ray cannot place the replica, and
    the run fails after run.ray.placement_timeout_s naming it (never a silent wait)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    other = placement_group([{"node_a": 1}])  # another job's hold on node A
    ray.get(other.ready(), timeout=20)
    run_dir = tmp_path / "run"
    try:
        result = run_inflight(
            "run",
            EXAMPLE,
            "stages.summary.resources.custom.node_a=1",
            *_ray_args(cluster, run_dir),
            "run.ray.placement_timeout_s=3",
            timeout=50,
        )
    finally:
        remove_placement_group(other)
    assert result.returncode == 1
    finished = [e for e in events(run_dir, "supervisor") if e["event"] == "run_finished"][-1]
    assert "Ray could not place summary.0 within 3.0 s" in finished["reason"]
    assert "node_a: asked 1, free 0 of 1" in finished["reason"]


@pytest.mark.timeout(60)
def test_a_worker_slow_to_start_is_no_placement_failure_but_a_short_resource_is(cluster):
    """Ray starts a worker process per actor, seconds on a busy machine: an actor whose
    resources are free gets a grace past run.ray.placement_timeout_s; one asking for what the
    cluster lacks fails at the timeout, naming it."""
    import asyncio
    import types

    from pipeline.launchers import ray as ray_launcher

    @ray.remote(num_cpus=0)
    class SlowToAnswer:
        def node(self):
            time.sleep(2.5)  # the worker's start, drawn out
            return {"ip": "127.0.0.1"}

    said = []
    log = types.SimpleNamespace(info=lambda event, **kw: said.append(event))
    config = types.SimpleNamespace(
        run=types.SimpleNamespace(ray=types.SimpleNamespace(placement_timeout_s=1.0))
    )
    launcher = ray_launcher.RayLauncher(config, log)
    node = asyncio.run(launcher._placed(SlowToAnswer.remote(), "slow.0", {"num_cpus": 0}))
    assert node == {"ip": "127.0.0.1"} and said == ["ray_worker_slow"]

    short = {"num_cpus": 0, "resources": {"node_q": 1}}
    started = time.monotonic()
    with pytest.raises(ray_launcher.LaunchError) as error:
        asyncio.run(
            launcher._placed(SlowToAnswer.options(resources={"node_q": 1}).remote(), "q.0", short)
        )
    assert time.monotonic() - started < 10
    assert "Ray could not place q.0 within 1.0 s" in str(error.value)
    assert "node_q: asked 1, free 0 of 0" in str(error.value)


def test_the_node_ip_honours_the_interface_torch_and_nccl_are_told_to_use() -> None:
    from pipeline.launchers.ray_host import node_ip

    assert node_ip({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert node_ip({"NCCL_SOCKET_IFNAME": "l"}) == "127.0.0.1"  # NCCL's prefix match
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME='nope0': no IPv4 interface"):
        node_ip({"GLOO_SOCKET_IFNAME": "nope0"})


@pytest.mark.timeout(60)
def test_what_is_free_on_the_cluster_but_on_no_one_node_is_named(cluster):
    """Half of node A held: the cluster has 2 CPUs and node_a free, node A alone 1 CPU."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from pipeline.launchers.ray import _split

    other = placement_group([{"CPU": 1, "node_a": 0.5}])
    ray.get(other.ready(), timeout=20)
    try:
        assert _split({"CPU": 1, "node_a": 0.5}) == ""  # fits node A still
        assert _split({"CPU": 2, "node_a": 0.5}) == (
            "free on no one node (the node with the most of it has CPU 1, node_a 0.5 free)"
        )
    finally:
        remove_placement_group(other)
