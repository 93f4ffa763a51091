"""Plugins: a stage from a separate, installed package found through its entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pipeline.registry import PluginError, list_plugins, resolve
from tests.pipeline.runs import REPO, run_inflight

PLUGIN_SRC = REPO / "tests" / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The demo plugin distribution, pip-installed into a folder put on PYTHONPATH."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    source = shutil.copytree(PLUGIN_SRC, build / "src")  # keep build files out of the repo
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        timeout=120,
        cwd=build,
        capture_output=True,
    )
    return target


def _env(site) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.timeout(150)
def test_installed_plugin_is_listed_with_its_distribution(plugin_site):
    result = run_inflight("stages", env=_env(plugin_site), timeout=60)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "demo_negate" in line)
    assert "inflight_plugin_demo.stages:Negate" in line and "inflight-plugin-demo" in line
    # Inflight's own stages are there too, from its own distribution
    assert any("numbers" in x and "inflight-rl" in x for x in result.stdout.splitlines())


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_plugin_stage_runs_in_a_pipeline_by_name(plugin_site, tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        "configs/example.yaml",
        "stages.numbers.count=50",
        "stages.numbers.dim=4",
        "stages.power.use=demo_negate",
        "~stages.power.exponent",
        "stages.power.scale=2.0",
        "--console",
        "events",  # every event on stdout, as `inflight logs` shows them
        "--run-dir",
        str(run_dir),
        env=_env(plugin_site),
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["items"] == 50 and summary["sum"] < 0  # uniform [0,1) values, negated
    assert "plugin_stage_ready" in result.stdout


def test_registered_entry_points_resolve():
    names = {p.name for p in list_plugins("stage")}
    assert {"numbers", "power", "summary"} <= names
    from stages.examples import Numbers

    assert resolve("stage", "numbers") is Numbers
    assert resolve("stage", "stages.examples:Numbers") is Numbers
    assert resolve("stage", "stages.examples.Numbers") is Numbers


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("numbrs", "did you mean 'numbers'"),
        ("nosuchmodule_xyz:Stage", "cannot import module 'nosuchmodule_xyz'"),
        ("stages.examples:Nope", "has no attribute 'Nope'"),
        ("stages/examples:Numbers", "not a dotted path"),
    ],
)
def test_unresolvable_names_explain_themselves(name, message):
    with pytest.raises(PluginError, match=message):
        resolve("stage", name)
