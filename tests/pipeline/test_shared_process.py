"""Stages that share one process (``run.share_process``, ``pipeline.host``), run as a user runs
them: each keeps its own failures, restarts and shutdown, and a process that dies or hangs
takes only its own stages down, which come back."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.pipeline.runs import (
    alive,
    events,
    kill_tree,
    run_inflight,
    spawned_pids,
    start_endless_example,
    start_inflight,
    wait_for_four,
)
from tests.pipeline.test_supervisor import EXAMPLE, _crashy_overrides, _finished

pytestmark = pytest.mark.slow

SHARED = "run.share_process=all"  # the example's stages do not say they share (auto)


def _spawned(run_dir) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for e in events(run_dir, "supervisor"):
        if e["event"] == "replica_spawned":
            by_name.setdefault(e["replica_name"], []).append(e)
    return by_name


@pytest.mark.timeout(90)
def test_a_stage_that_raises_restarts_alone_and_its_neighbours_go_on(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run", EXAMPLE, *_crashy_overrides("raise"), SHARED, "--run-dir", str(run_dir), timeout=80
    )
    assert result.returncode == 0, result.stdout + result.stderr
    spawned = _spawned(run_dir)
    assert {e["pid"] for starts in spawned.values() for e in starts} == {
        spawned["numbers.0"][0]["pid"]
    }  # one process ran them all, the restarted one too
    assert all(e.get("shared_process") for starts in spawned.values() for e in starts)
    failures = [e for e in events(run_dir, "power.0") if e["event"] == "stage_failed"]
    assert len(failures) == 1 and "crashing on purpose" in failures[0]["exception"]
    assert _finished(run_dir)["restarts"] == {"power.0": 1}  # nobody else was touched
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 200 - 64 <= summary["items"] < 200  # the crashing item and its inbox are lost


@pytest.mark.timeout(120)
def test_a_killed_shared_process_brings_back_every_stage_it_ran(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_inflight(
        "run",
        EXAMPLE,
        "stages.numbers.count=400",
        "stages.numbers.dim=8",
        "stages.power.delay_s=0.01",
        "stages.power.restart.backoff_s=0.1",
        "stages.numbers.restart.backoff_s=0.1",
        "stages.summary.restart.backoff_s=0.1",
        SHARED,
        "--run-dir",
        str(run_dir),
    )
    try:
        wait_for_four(run_dir)
        time.sleep(0.5)
        (host,) = set(spawned_pids(run_dir))
        os.kill(host, signal.SIGKILL)
        out, _ = proc.communicate(timeout=100)
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert proc.returncode == 0, out
    failed = [e for e in events(run_dir, "supervisor") if e["event"] == "replica_failed"]
    assert sorted(e["replica_name"] for e in failed) == [
        "numbers.0",
        "power.0",
        "power.1",
        "summary.0",
    ]
    assert all("SIGKILL" in e["reason"] for e in failed)
    spawned = _spawned(run_dir)
    assert len({e["pid"] for starts in spawned.values() for e in starts}) == 2  # a new host


@pytest.mark.timeout(120)
def test_a_stage_that_blocks_the_shared_loop_is_ended_with_its_process(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        EXAMPLE,
        *_crashy_overrides("hang", **{"run.heartbeat_timeout_s": "2", "run.heartbeat_s": "0.5"}),
        SHARED,
        "--run-dir",
        str(run_dir),
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sup = events(run_dir, "supervisor")
    unresponsive = {e["replica_name"] for e in sup if e["event"] == "replica_unresponsive"}
    assert "power.0" in unresponsive  # and the others whose heartbeats stopped with it
    restarts = _finished(run_dir)["restarts"]
    assert restarts.get("power.0") == 1 and set(restarts) <= {
        "numbers.0",
        "power.0",
        "power.1",
        "summary.0",
    }


@pytest.mark.timeout(60)
def test_a_signal_shuts_every_shared_stage_down_gracefully(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir, SHARED)
    try:
        (host,) = set(spawned_pids(run_dir))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert took < 10, f"shutdown took {took:.1f} s"
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert not alive(host), "the shared process was left behind"
    stopped = [e for e in events(run_dir, "*.[0-9]") if e["event"] == "replica_stopped"]
    assert len(stopped) == 4  # every replica stopped gracefully, none needed SIGKILL
    assert _finished(run_dir)["status"] == "stopped"
