"""Placement: the plan on fake hosts, its errors, the host inventory, and a real pinned run.

The plan tests load pipeline files through ``load_pipeline`` with a fake ``Inventory``, so they
check what a user sees (key paths, ``file:line``). The run test starts ``inflight run`` on this
2-core machine; each replica, and an engine one of them launches, reports the cores it runs on
(``sched_getaffinity`` of the live process) and its thread settings.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_pipeline
from pipeline.placement import (
    ENGINE_PLACEMENT_ENV,
    Inventory,
    affinity,
    engine_placement,
    host_inventory,
    process_env,
    read_engine_placement,
    span,
)
from pipeline.stage import Port
from stages.generator.launcher import EngineLauncher, LaunchConfig
from tests.pipeline.runs import events, run_inflight
from tests.stages.test_generator_launcher import FAKE_ENGINE
from transport.message import Schema

ITEM = Schema("item", 1, {"id": "int"})
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class Source:
    outputs = {"out": Port(ITEM)}


class Sink:
    inputs = {"items": Port(ITEM)}


class Launches:
    """Like the generator: its `launch` option starts engines, per replica."""

    @dataclass
    class Config:
        launch: LaunchConfig | None = None


class Probe:
    """Logs where it runs (and where the engines it launches run), then ends."""

    @dataclass
    class Config:
        torch: bool = False
        launch: LaunchConfig | None = None

    inputs: dict = {}
    outputs: dict = {}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        pass

    async def run(self):
        info = {
            "cores": sorted(os.sched_getaffinity(0)),
            "env": {k: os.environ.get(k) for k in THREADS},
        }
        if self.config.torch:
            import torch

            info["torch_threads"] = torch.get_num_threads()
        if self.config.launch is not None:
            launcher = EngineLauncher(
                self.config.launch,
                name=f"{self.ctx.stage}.{self.ctx.replica}",
                log_dir=self.ctx.run_dir / "logs",
                log=self.ctx.log,
            )
            try:
                await launcher.start()
                info["engines"] = [
                    {"cores": sorted(os.sched_getaffinity(e.pid)), "env": environ_of(e.pid)}
                    for e in launcher.engines
                ]
            finally:
                await launcher.close()
        self.ctx.log.info("probe", **info)

    async def close(self):
        pass


def environ_of(pid: int) -> dict[str, str | None]:
    """The thread variables in a live process's environment (None: not set)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().partition("=")[::2] for item in raw if item)
    return {k: env.get(k) for k in THREADS}


STAGES = {"source": Source, "sink": Sink, "launches": Launches}
HOST = Inventory(cores=(0, 1, 2, 3), gpus=(0, 1), gpu_source="fake")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    model = tmp_path / "m"  # `launch.model: m`, next to the file: a stand-in folder
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return path


def _load(tmp_path: Path, text: str, inventory: Inventory | None = HOST):
    path = _write(tmp_path, text)
    return load_pipeline(path, resolve=STAGES.__getitem__, inventory=inventory)


def _issues(tmp_path: Path, text: str, inventory: Inventory | None = HOST) -> dict[str, list]:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text, inventory)
    found: dict[str, list] = {}
    for issue in err.value.issues:
        found.setdefault(issue.path, []).append(issue)
    return found


WIRED = """
stages:
  source:
    use: source
    resources: {cpus: [3]}
  sink:
    use: sink
    replicas: 2
    resources: {cpus: 1, gpus: 1}
    inputs: {items: source.out}
  gen:
    use: launches
    launch: {model: m, count: 1, resources: {cpus: 1}}
  attached:
    use: launches
    launch: {model: m, count: 1}
"""


def test_counts_fill_what_explicit_lists_leave_in_config_order(tmp_path):
    placement = _load(tmp_path, WIRED).placement
    assert placement.lines() == [
        "source.0           -> cores [3]",
        "sink.0             -> cores [0], GPUs [0]",
        "sink.1             -> cores [1], GPUs [1]",
        "gen.0              -> floating on cores [0-3] (every core is reserved)",
        "gen.0.engine0      -> cores [2]",
        "attached.0         -> floating on cores [0-3] (every core is reserved)",
        "attached.0.engine0 -> floating on cores [0-3] (every core is reserved)",
    ]
    assert placement.every_core_reserved
    assert _load(tmp_path, WIRED).placement == placement  # deterministic


def test_processes_without_cores_float_on_the_unreserved_ones(tmp_path):
    six = Inventory(cores=tuple(range(6)), gpus=(0, 1))
    placement = _load(tmp_path, WIRED, six).placement
    assert placement.floating == (4, 5) and not placement.every_core_reserved
    gen = placement.replica("gen", 0)
    assert not gen.pinned and gen.cores == (4, 5)
    assert affinity(gen, placement) == (4, 5)  # pinned to the floating cores, away from the rest
    assert "gen.0              -> floating on cores [4-5]" in placement.lines()


def test_explicit_lists_are_shared_out_among_replicas_and_engines(tmp_path):
    eight = Inventory(cores=tuple(range(8)), gpus=(0, 1, 2, 3))
    placement = _load(
        tmp_path,
        """
        stages:
          source: {use: source, replicas: 2, resources: {cpus: [7, 6, 5, 4]}}
          sink: {use: sink, inputs: {items: source.out}}
          gen:
            use: launches
            replicas: 2
            launch: {model: m, count: 2, resources: {cpus: [0, 1, 2, 3], gpus: [3, 2, 1, 0]}}
        """,
        eight,
    ).placement
    got = {a.name: (a.cores, a.gpus) for a in placement.assignments if a.pinned}
    assert got == {
        "source.0": ((7, 6), ()),
        "source.1": ((5, 4), ()),
        "gen.0.engine0": ((0,), (3,)),
        "gen.0.engine1": ((1,), (2,)),
        "gen.1.engine0": ((2,), (1,)),
        "gen.1.engine1": ((3,), (0,)),
    }
    assert [a.name for a in placement.engines("gen", 1)] == ["gen.1.engine0", "gen.1.engine1"]


def test_without_resources_nothing_changes(tmp_path):
    text = """
    stages:
      source: {use: source}
      sink: {use: sink, replicas: 2, inputs: {items: source.out}, env: {OMP_NUM_THREADS: "3"}}
      gen: {use: launches, launch: {model: m}}
    """
    placement = _load(tmp_path, text).placement
    assert not placement.pins_cores and not placement.reserves_anything
    base = {"OMP_NUM_THREADS": "3", "CUDA_VISIBLE_DEVICES": "1", "OTHER": "x"}
    for a in placement.assignments:
        assert not a.pinned and a.cores == HOST.cores and a.gpus == ()
        assert affinity(a, placement) is None  # the child is not pinned at all
        # applied over the environment it would have had, nothing changes
        assert process_env(a, placement, base, {}) == {
            "OMP_NUM_THREADS": "3",
            "MKL_NUM_THREADS": None,
            "CUDA_VISIBLE_DEVICES": "1",
        }
    assert engine_placement(placement, "gen", 0, base, {}) is None
    assert _load(tmp_path, text, inventory=None).placement is None


def test_every_impossible_request_is_reported_at_once_with_its_line(tmp_path):
    found = _issues(
        tmp_path,
        """
        stages:
          source:
            use: source
            replicas: 2
            resources: {cpus: 2}
          sink:
            use: sink
            resources: {cpus: [0], gpus: 3}
            inputs: {items: source.out}
          gen:
            use: launches
            launch:
              model: m
              resources: {cpus: [0, 9], gpus: [5]}
        """,
    )
    [total] = found["stages.source.resources.cpus"]
    assert total.where.endswith("pipeline.yaml:5")
    assert total.message.startswith("7 cores requested in all (")
    assert "source: 2 replicas x 2 = 4" in total.message
    assert "sink: [0] = 1" in total.message and "gen.launch: [0,9] = 2" in total.message
    assert "this host has 4 (cores [0-3])" in total.message
    [gpus] = found["stages.sink.resources.gpus"]
    assert "4 GPUs requested in all (sink: 1 replica x 3 = 3; gen.launch: [5] = 1)" in gpus.message
    assert "this host has 2" in gpus.message and gpus.where.endswith(":8")
    overlap, missing = found["stages.gen.launch.resources.cpus"]
    assert "core 0 is also requested by sink" in overlap.message
    assert "stages.sink.resources.cpus" in overlap.message and ":8" in overlap.message
    assert overlap.where.endswith("pipeline.yaml:14")
    assert "core 9 does not exist here" in missing.message and "[0-3]" in missing.message
    [gpu] = found["stages.gen.launch.resources.gpus"]
    assert "GPU 5 does not exist here: the GPUs here are [0-1] (fake)" in gpu.message


def test_gpus_on_a_host_without_gpus(tmp_path):
    cpu_only = Inventory(cores=(0, 1), gpu_source="no CUDA_VISIBLE_DEVICES, no nvidia-smi")
    found = _issues(
        tmp_path,
        """
        stages:
          source: {use: source, resources: {gpus: 1}}
          sink: {use: sink, resources: {gpus: [0]}, inputs: {items: source.out}}
          gen: {use: launches, launch: {model: m, resources: {gpus: 0}}}
        """,
        cpu_only,
    )
    assert set(found) == {"stages.source.resources.gpus", "stages.sink.resources.gpus"}
    for [issue] in found.values():
        assert "gpus requested, but this host has no GPUs (no CUDA_VISIBLE_DEVICES" in (
            issue.message
        )


def test_memory_and_custom_resources_on_one_host(tmp_path):
    small = Inventory(cores=(0, 1, 2, 3), gpu_source="fake", memory_gb=8.0)
    found = _issues(
        tmp_path,
        """
        stages:
          source: {use: source, resources: {memory_gb: 6}}
          sink:
            use: sink
            replicas: 2
            resources: {memory_gb: 2, custom: {learner_node: 1}}
            inputs: {items: source.out}
        """,
        small,
    )
    [memory] = found["stages.source.resources.memory_gb"]
    assert "10 GiB of memory asked in all (source.0 6, sink.0 2, sink.1 2)" in memory.message
    assert "this host has 8.0 GiB" in memory.message
    [custom] = found["stages.sink.resources.custom"]
    assert "custom resources (learner_node)" in custom.message
    assert "set run.launcher: ray" in custom.message
    # what fits is accepted
    fits = """
        stages:
          source: {use: source, resources: {memory_gb: 6}}
          sink: {use: sink, resources: {memory_gb: 1}, inputs: {items: source.out}}
        """
    assert _load(tmp_path, fits, small).placement is not None


def test_host_independent_problems_are_found_without_a_host(tmp_path):
    found = _issues(
        tmp_path,
        """
        stages:
          source:
            use: source
            replicas: 2
            resources: {cpus: [0, 1, 2], gpus: [1, 1]}
          sink:
            use: sink
            resources: {cpus: [], gpus: 1}
            env: {CUDA_VISIBLE_DEVICES: "0"}
            inputs: {items: source.out}
          gen:
            use: launches
            launch: {model: m, resources: {cpus: [-1]}}
          other:
            use: launches
            resources: {cpus: [4]}
            launch: {model: m, resources: {cpus: [4], gpus: 0}}
        """,
        inventory=None,
    )
    assert "3 core ids cannot be shared out evenly among 2 replicas" in (
        found["stages.source.resources.cpus"][0].message
    )
    assert found["stages.source.resources.gpus[1]"][0].message == "GPU 1 is listed twice"
    assert "empty list" in found["stages.sink.resources.cpus"][0].message
    assert "remove one" in found["stages.sink.env.CUDA_VISIBLE_DEVICES"][0].message
    assert "0 or more, got -1" in found["stages.gen.launch.resources.cpus[0]"][0].message
    assert "core 4 is also requested by other (stages.other.resources.cpus" in (
        found["stages.other.launch.resources.cpus"][0].message
    )
    zero = _issues(tmp_path, "stages:\n  source: {use: source, resources: {cpus: 0}}\n", None)
    assert "must be at least 1, got 0" in zero["stages.source.resources.cpus"][0].message


def test_host_inventory_reads_cuda_visible_devices_or_nvidia_smi(tmp_path, monkeypatch):
    cores = tuple(sorted(os.sched_getaffinity(0)))
    inventory = host_inventory({"CUDA_VISIBLE_DEVICES": "2,3"})
    assert inventory.memory_gb is not None and inventory.memory_gb > 0.1
    assert replace(inventory, memory_gb=None) == Inventory(
        cores, (2, 3), (), "CUDA_VISIBLE_DEVICES='2,3'"
    )
    assert host_inventory({"CUDA_VISIBLE_DEVICES": ""}).gpus == ()
    assert host_inventory({"CUDA_VISIBLE_DEVICES": "1,-1,0"}).gpus == (1,)  # CUDA stops at -1
    uuids = host_inventory({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"})
    assert uuids.gpus == (0, 1) and uuids.device(1) == "GPU-bb"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: H100 (UUID: GPU-x)'\necho 'GPU 1: H100 (UUID: GPU-y)'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    assert host_inventory({}).gpus == (0, 1)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no GPUs, and says why
    none = host_inventory({})
    assert none.gpus == () and "no nvidia-smi" in none.gpu_source


def test_process_env_threads_gpus_and_the_engines_handoff(tmp_path):
    uuids = Inventory(cores=(0, 1, 2, 3), gpus=(0, 1), gpu_devices=("GPU-aa", "GPU-bb"))
    text = """
    stages:
      source: {use: source, resources: {cpus: 1, gpus: [1]}, env: {MKL_NUM_THREADS: "8"}}
      sink: {use: sink, inputs: {items: source.out}}
      gen:
        use: launches
        resources: {cpus: 1, gpus: 1}
        launch: {model: m, count: 2, resources: {cpus: 1}}
    """
    placement = _load(tmp_path, text, uuids).placement
    source = placement.replica("source", 0)
    base = {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "8"}
    # the stage's own env decides the thread counts (torch takes MKL over OMP: both are its)
    assert process_env(source, placement, base, {"MKL_NUM_THREADS": "8"}) == {
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "8",
        "CUDA_VISIBLE_DEVICES": "GPU-bb",
    }
    gen = placement.replica("gen", 0)
    assert process_env(gen, placement, {}, {})["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    handoff = engine_placement(placement, "gen", 0, {"CUDA_VISIBLE_DEVICES": "x"}, {})
    engines = read_engine_placement({ENGINE_PLACEMENT_ENV: handoff}, 2)
    assert [e.cores for e in engines] == [(2,), (3,)]  # after source.0 [0] and gen.0 [1]
    # engines without GPUs get the supervisor's CUDA_VISIBLE_DEVICES back, not the generator's
    assert [e.env for e in engines] == [
        {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "x"}
    ] * 2
    with pytest.raises(ValueError, match="places 2 engines, but this replica launches 3"):
        read_engine_placement({ENGINE_PLACEMENT_ENV: handoff}, 3)
    with pytest.raises(ValueError, match="malformed"):
        read_engine_placement({ENGINE_PLACEMENT_ENV: "[{}]"}, 1)
    assert read_engine_placement({}, 2) is None


def test_span_writes_ids_as_cpus_allowed_list_does():
    assert span([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert span([]) == "" and span([5]) == "5"


@pytest.mark.timeout(90)
def test_a_run_puts_replicas_and_engines_on_their_cores(tmp_path):
    """On 2 cores: a replica on core 0 with its own OMP_NUM_THREADS (the user's env wins, and
    torch follows it), an engine on core 1, and the replica that launches it floating on both
    (every core is reserved)."""
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)
    fake.chmod(0o755)
    model = tmp_path / "model"  # a stand-in folder: the fake engine loads nothing
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    probe = "tests.pipeline.test_placement:Probe"
    config = tmp_path / "placed.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            run: {{name: placed, heartbeat_s: 0.2, heartbeat_timeout_s: 10}}
            stages:
              pinned:
                use: {probe}
                torch: true
                resources: {{cpus: [0]}}
                env: {{OMP_NUM_THREADS: "2"}}
              launching:
                use: {probe}
                launch:
                  kind: sglang
                  python: {fake}
                  model: {model}
                  startup_timeout_s: 20
                  resources: {{cpus: 1}}
            """
        )
    )
    run_dir = tmp_path / "run"
    result = run_inflight("run", str(config), "--run-dir", str(run_dir), "--quiet", timeout=80)
    assert result.returncode == 0, result.stdout + result.stderr
    probes = {f"{e['stage']}.{e['replica']}": e for e in events(run_dir) if e["event"] == "probe"}
    pinned, launching = probes["pinned.0"], probes["launching.0"]
    assert pinned["cores"] == [0]
    # its env sets OMP_NUM_THREADS: the plan leaves both thread variables to it
    assert pinned["env"] == {
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
    }
    assert pinned["torch_threads"] == 2  # torch follows OMP_NUM_THREADS, not the core count
    assert launching["cores"] == [0, 1]  # floats: every core is reserved
    assert launching["env"] == {k: os.environ.get(k) for k in THREADS}  # as it was
    assert launching["engines"] == [
        {"cores": [1], "env": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}}
    ]
    spawned = {
        e["replica_name"]: e["cores"]
        for e in events(run_dir, "supervisor")
        if e["event"] == "replica_spawned"
    }
    assert spawned == {"pinned.0": [0], "launching.0": [0, 1]}
    [placed] = [e for e in events(run_dir, "supervisor") if e["event"] == "placement"]
    assert "launching.0.engine0 -> cores [1]" in placed["plan"]
    launched = [e for e in events(run_dir, "launching.0") if e["event"] == "engine_launched"]
    assert launched[0]["cores"] == [1] and launched[0]["threads"] == "1"
    assert json.loads(json.dumps(placed))  # plain data in the log
