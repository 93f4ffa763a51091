"""The ``inflight`` command as a user runs it: validate, logs, and their exit codes."""

from __future__ import annotations

import json

import pytest

from tests.pipeline.runs import events, run_inflight, start_inflight, wait_for

BAD_CASES = {
    "tabs.yaml": ("run:\n\tname: x\n", "tab"),
    "empty.yaml": ("# nothing here\n", "empty"),
    "list.yaml": ("- run\n- stages\n", "mapping"),
    "dupes.yaml": ("stages:\n  a: {use: numbers}\n  a: {use: numbers}\n", "duplicate"),
    "malformed.yaml": ("stages: [\n  a: {use: numbers\n", "line"),
    "unknown.yaml": ("stages:\n  a: {use: numbers, cont: 3}\n", "count"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_validate_rejects_bad_files_without_traceback(tmp_path, name):
    text, needle = BAD_CASES[name]
    path = tmp_path / name
    path.write_text(text)
    result = run_inflight("validate", str(path), timeout=50)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    assert needle in result.stderr.lower() and name in result.stderr


@pytest.mark.timeout(60)
def test_validate_accepts_the_example_and_overrides(tmp_path):
    ok = run_inflight("validate", "configs/example.yaml", "stages.power.replicas=3", timeout=50)
    assert ok.returncode == 0, ok.stderr
    assert "valid" in ok.stdout and "power(3)" in ok.stdout
    bad = run_inflight(
        "validate",
        "configs/example.yaml",
        "stages.power.replicas=two",
        "stages.nope.use=x",
        "transport.inbx=3",
        timeout=50,
    )
    assert bad.returncode == 2
    err = bad.stderr
    assert "stages.power.replicas" in err and "stages.nope" in err and "inbox" in err
    missing = run_inflight("validate", str(tmp_path / "absent.yaml"), timeout=50)
    assert missing.returncode == 2 and "absent.yaml" in missing.stderr
    assert "Traceback" not in err + missing.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("logs") / "run"
    result = run_inflight(
        "run",
        "configs/example.yaml",
        "stages.numbers.count=100",
        "stages.numbers.dim=4",
        "run.metrics_every_s=0.2",
        "stages.power.delay_s=0.005",
        "--run-dir",
        str(run_dir),
        "--quiet",
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_logs_filters_a_finished_run(finished_run):
    run_dir = str(finished_run)
    by_stage = run_inflight("logs", run_dir, "--stage", "power", "--json", timeout=30)
    assert by_stage.returncode == 0, by_stage.stderr
    lines = [json.loads(x) for x in by_stage.stdout.splitlines()]
    assert lines and {e["stage"] for e in lines} == {"power"}
    assert {e["replica"] for e in lines} == {0, 1}
    one = run_inflight("logs", run_dir, "--stage", "power.1", "--json", timeout=30)
    assert {json.loads(x)["replica"] for x in one.stdout.splitlines()} == {1}
    started = run_inflight("logs", run_dir, "--event", "replica_*", "--json", timeout=30)
    names = {json.loads(x)["event"] for x in started.stdout.splitlines()}
    assert "replica_started" in names and all(n.startswith("replica_") for n in names)
    metrics = run_inflight("logs", run_dir, "--event", "metrics", "--stage", "summary", timeout=30)
    assert "metrics" in metrics.stdout and "in.items.depth" in metrics.stdout
    warn = run_inflight("logs", run_dir, "--level", "warning", "--json", timeout=30)
    levels = {json.loads(x)["level"] for x in warn.stdout.splitlines()}
    assert levels <= {"warning", "error", "critical"}
    human = run_inflight("logs", run_dir, timeout=30)
    assert "run_finished" in human.stdout.splitlines()[-1]
    assert len(human.stdout.splitlines()) == len([e for e in events(finished_run) if e])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_logs_follow_tracks_a_live_run_until_it_ends(tmp_path):
    run_dir = tmp_path / "run"
    run = start_inflight(
        "run",
        "configs/example.yaml",
        "stages.numbers.count=150",
        "stages.numbers.dim=4",
        "stages.power.delay_s=0.02",
        "--run-dir",
        str(run_dir),
        "--quiet",
    )
    try:
        wait_for(lambda: (run_dir / "logs" / "supervisor.jsonl").exists(), 30, "the run to start")
        follow = start_inflight(
            "logs", str(run_dir), "-f", "--event", "replica_*", "--event", "summary_*"
        )
        live_when_followed = run.poll() is None
        out, _ = follow.communicate(timeout=90)
        run.wait(timeout=30)
    finally:
        run.kill()
    assert follow.returncode == 0, out
    assert run.returncode == 0
    assert "summary_written" in out and "replica_finished" in out
    # it was following, not reading after the fact: it started before the run ended
    assert live_when_followed


@pytest.mark.timeout(30)
def test_logs_on_a_missing_run_dir_is_a_clear_error(tmp_path):
    result = run_inflight("logs", str(tmp_path / "nope"), timeout=20)
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_validate_prints_the_placement(tmp_path):
    ok = run_inflight(
        "validate",
        "configs/example.yaml",
        "stages.numbers.resources={cpus: [0]}",
        "stages.summary.resources.cpus=[1]",
        timeout=50,
    )
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0] == "configs/example.yaml: valid (3 stages: numbers(1), power(2), summary(1))"
    assert lines[1].startswith("placement on this host: cores [0-1], ")
    assert lines[2:] == [
        "  numbers.0 -> cores [0]",
        "  power.0   -> floating on cores [0-1] (every core is reserved)",
        "  power.1   -> floating on cores [0-1] (every core is reserved)",
        "  summary.0 -> cores [1]",
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_impossible_resources_fail_before_anything_starts(tmp_path, command):
    run_dir = tmp_path / "run"
    extra = ["--run-dir", str(run_dir), "--quiet"] if command == "run" else []
    bad = run_inflight(
        command,
        "configs/example.yaml",
        "stages.power.resources.cpus=2",  # 2 replicas x 2 cores on a 2-core machine
        "stages.numbers.resources.cpus=[0]",
        "stages.summary.resources={cpus: [0, 64], gpus: 1}",
        *extra,
        timeout=50,
        env={"CUDA_VISIBLE_DEVICES": ""},  # no GPUs, whatever the machine has
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    err = bad.stderr
    assert "Traceback" not in err and "4 problems in configs/example.yaml" in err
    assert "override 'stages.power.resources.cpus=2': stages.power.resources.cpus: 7 cores " in err
    assert "power: 2 replicas x 2 = 4" in err
    assert "core 0 is also requested by numbers" in err and "core 64 does not exist" in err
    assert "gpus requested, but this host has no GPUs (CUDA_VISIBLE_DEVICES='')" in err
    assert not run_dir.exists()  # nothing was started, not even the run directory
