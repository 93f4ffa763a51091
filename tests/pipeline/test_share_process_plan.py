"""Which stages share a process (``run.share_process``) and how their channels are wired: read
from the supervisor's plan and the replica specs it writes, without starting anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.cli import _resolve_stage
from pipeline.config import load_pipeline
from pipeline.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "configs" / "default.yaml"
EXAMPLE = REPO / "configs" / "example.yaml"


def _plan(config: Path, tmp_path: Path, *overrides: str) -> Supervisor:
    loaded = load_pipeline(config, list(overrides), resolve=_resolve_stage)
    sup = Supervisor(loaded, tmp_path, console=None)
    inboxes, control = sup._addresses()
    sup._write_specs(inboxes, control)
    if sup._sock_dir is not None:
        shutil.rmtree(sup._sock_dir)  # the socket folder it made: nothing was bound
    return sup


def _local(sup: Supervisor, replica: str) -> dict[str, list[bool]]:
    outputs = sup.replicas[replica].spec["outputs"]
    return {port: out.get("local", []) for port, out in outputs.items()}


def test_the_default_run_shares_feeder_generator_and_scorer_linked_in_process(tmp_path):
    sup = _plan(DEFAULT, tmp_path)
    assert sup.shared == {"feeder", "generator", "scorer"}  # the learner is a gang
    assert sup._shared_env == {"OMP_NUM_THREADS": "1"}  # the generator's, for all three
    assert _local(sup, "feeder.0") == {"prompts": [True]}
    assert _local(sup, "generator.0") == {"rollouts": [True]}
    assert _local(sup, "scorer.0") == {"groups": []}  # the learner is in another process


@pytest.mark.parametrize(
    ("overrides", "shared"),
    [
        (["run.share_process=none"], set()),
        # resources of its own: a process of its own (the other two still share)
        (["stages.scorer.resources={cpus: 1}"], {"feeder", "generator"}),
        # a variable the generator sets otherwise
        (["stages.scorer.env={OMP_NUM_THREADS: '2'}"], {"feeder", "generator"}),
        # alone, nothing to share with
        (
            ["stages.scorer.resources={cpus: 1}", "stages.feeder.resources={cpus: 1}"],
            set(),
        ),
    ],
)
def test_what_keeps_a_stage_in_a_process_of_its_own(tmp_path, overrides, shared):
    sup = _plan(DEFAULT, tmp_path, *overrides)
    assert sup.shared == shared
    linked = sup.shared >= {"generator", "scorer"}
    assert _local(sup, "generator.0") == {"rollouts": [True] if linked else []}


def test_stages_share_only_when_they_say_they_may_unless_all(tmp_path):
    assert _plan(EXAMPLE, tmp_path / "a").shared == set()  # the example's stages do not say so
    sup = _plan(EXAMPLE, tmp_path / "b", "run.share_process=all")
    assert sup.shared == {"numbers", "power", "summary"}
    assert _local(sup, "numbers.0") == {"out": [True, True]}  # both power replicas


def test_the_ray_launcher_shares_nothing(tmp_path):
    loaded = load_pipeline(DEFAULT, ["run.launcher=ray"], resolve=_resolve_stage)
    assert Supervisor(loaded, tmp_path, console=None).shared == set()
