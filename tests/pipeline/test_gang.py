"""A distributed stage is restarted as a gang: one failed rank brings every rank back, together."""

from __future__ import annotations

import json

import pytest

from tests.pipeline.runs import run_inflight

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_failed_rank_restarts_the_whole_gang_with_a_fresh_rendezvous(tmp_path):
    config = tmp_path / "gang.yaml"
    config.write_text(
        """
run: {name: gang}
stages:
  gang:
    use: "tests.stages_for_tests:GangMember"
    replicas: 2
    restart: {policy: on-failure, max_restarts: 2, backoff_s: 0.1}
"""
    )
    run_dir = tmp_path / "run"
    result = run_inflight("run", str(config), "--run-dir", str(run_dir), "-q", timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(x) for x in (run_dir / "gang.jsonl").read_text().splitlines()]
    starts = [x for x in lines if "restarts" in x]
    first = [x for x in starts if x["restarts"] == 0]
    second = [x for x in starts if x["restarts"] == 1]
    assert sorted(x["rank"] for x in first) == [0, 1]
    assert sorted(x["rank"] for x in second) == [0, 1]  # rank 0 was restarted with rank 1
    assert all(x["world"] == 2 for x in starts)
    assert len({x["port"] for x in second}) == 1
    assert {x["port"] for x in first}.isdisjoint({x["port"] for x in second})
    sums = [x["sum"] for x in lines if "sum" in x]
    assert sums == [3.0, 3.0]  # 1 + 2 over a real gloo group from the supervisor's env
    events = [
        json.loads(x) for x in (run_dir / "logs" / "supervisor.jsonl").read_text().split("\n") if x
    ]
    assert any(e["event"] == "gang_stopped" for e in events)
