"""The supervisor running real multi-process pipelines, started as ``inflight run`` is."""

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
    wait_for,
)

pytestmark = pytest.mark.slow

EXAMPLE = "configs/example.yaml"


def _crashy_overrides(how: str, **extra: str) -> list[str]:
    return [
        "stages.numbers.count=200",
        "stages.numbers.dim=8",
        "stages.power={use: 'tests.stages_for_tests:Crashy', replicas: 1, "
        f"inputs: {{items: numbers.out}}, how: {how}, crash_at: 20, "
        "restart: {policy: on-failure, max_restarts: 2, backoff_s: 0.1}}",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def _finished(run_dir) -> dict:
    (last,) = [e for e in events(run_dir, "supervisor") if e["event"] == "run_finished"]
    return last


@pytest.mark.timeout(90)
def test_example_pipeline_runs_to_completion(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        EXAMPLE,
        "stages.numbers.count=300",
        "stages.numbers.dim=64",
        "stages.power.delay_s=0.005",
        "--run-dir",
        str(run_dir),
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["items"] == 300 and summary["duplicates"] == 0
    assert summary["max_id"] == 299
    finished = _finished(run_dir)
    assert finished["status"] == "succeeded" and finished["exit_code"] == 0
    for name in ("numbers.0", "power.0", "power.1", "summary.0"):
        names = [e["event"] for e in events(run_dir, name)]
        assert "replica_started" in names and "replica_finished" in names, name
        assert all(e["stage"] == name.split(".")[0] for e in events(run_dir, name))
    # both workers took part: credit flow spreads the items over the two replicas
    processed = [
        e["processed"] for e in events(run_dir, "power.*") if e["event"] == "worker_closed"
    ]
    assert len(processed) == 2 and sum(processed) == 300 and min(processed) > 0
    # the resolved config is in the run directory and the console showed the run
    assert "count: 300" in (run_dir / "config.yaml").read_text()
    assert "run succeeded (exit 0)" in result.stdout


@pytest.mark.timeout(120)
def test_replica_killed_with_sigkill_is_restarted_and_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_inflight(
        "run",
        EXAMPLE,
        "stages.numbers.count=400",
        "stages.numbers.dim=8",
        "stages.power.delay_s=0.01",
        "transport.inbox=8",
        "stages.power.restart.backoff_s=0.1",
        "--run-dir",
        str(run_dir),
    )
    try:
        started = wait_for(
            lambda: [e for e in events(run_dir, "power.0") if e["event"] == "replica_started"],
            timeout=60,
            what="power.0 to start",
        )
        # let it work a little, then kill it the hard way
        wait_for(lambda: (run_dir / "logs" / "power.0.jsonl").stat().st_size > 0, 10, "logs")
        time.sleep(0.5)
        victim = started[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert proc.returncode == 0, out
    sup = events(run_dir, "supervisor")
    failed = [e for e in sup if e["event"] == "replica_failed"]
    assert [e["replica_name"] for e in failed] == ["power.0"]
    assert "SIGKILL" in failed[0]["reason"]
    assert 0 <= failed[0]["inbox_to_redeliver_about"] <= 8  # its inbox, at its last heartbeat
    assert any(e["event"] == "replica_restarting" and e["attempt"] == 1 for e in sup)
    restarts = [
        e["restarts"] for e in events(run_dir, "power.0") if e["event"] == "replica_started"
    ]
    assert restarts == [0, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    # its inbox is sent again by the producer (at-least-once delivery): only the item in its
    # hand (taken, so acknowledged) can be lost, and nothing arrives twice
    assert 400 - 2 <= summary["items"] <= 400 and summary["duplicates"] == 0
    assert _finished(run_dir)["restarts"] == {"power.0": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_shuts_down_within_10s_leaving_no_process(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir)
    try:
        pids = spawned_pids(run_dir)
        assert len(pids) == 4 and all(alive(p) for p in pids)
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=15)
        took = time.monotonic() - t0
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert took < 10, f"shutdown took {took:.1f} s"
    assert proc.returncode == 128 + sig, out
    assert not [p for p in pids if alive(p)], "replicas left behind"
    finished = _finished(run_dir)
    assert finished["status"] == "stopped"
    stopped = [e for e in events(run_dir, "*.[0-9]") if e["event"] == "replica_stopped"]
    assert len(stopped) == 4  # every replica stopped gracefully, none needed SIGKILL


@pytest.mark.timeout(90)
def test_stage_exception_is_logged_and_replica_restarted(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run", EXAMPLE, *_crashy_overrides("raise"), "--run-dir", str(run_dir), timeout=80
    )
    assert result.returncode == 0, result.stdout + result.stderr
    failures = [e for e in events(run_dir, "power.0") if e["event"] == "stage_failed"]
    assert len(failures) == 1 and "crashing on purpose" in failures[0]["exception"]
    sup = events(run_dir, "supervisor")
    assert [e["reason"] for e in sup if e["event"] == "replica_failed"] == ["exit code 1"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 200 - 64 <= summary["items"] < 200  # the crashing item and its inbox are lost


@pytest.mark.timeout(90)
def test_restart_policy_never_fails_the_run(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        EXAMPLE,
        *_crashy_overrides("raise"),
        "stages.power.restart.policy=never",
        "--run-dir",
        str(run_dir),
        timeout=80,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    finished = _finished(run_dir)
    assert finished["status"] == "failed"
    assert "power.0" in finished["reason"] and "never" in finished["reason"]
    assert not [p for p in spawned_pids(run_dir) if alive(p)]


@pytest.mark.timeout(90)
def test_unresponsive_replica_is_killed_and_restarted(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        EXAMPLE,
        *_crashy_overrides("hang", **{"run.heartbeat_timeout_s": "2", "run.heartbeat_s": "0.5"}),
        "--run-dir",
        str(run_dir),
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sup = events(run_dir, "supervisor")
    assert any(e["event"] == "replica_unresponsive" and e["replica_name"] == "power.0" for e in sup)
    assert _finished(run_dir)["restarts"] == {"power.0": 1}


@pytest.mark.timeout(90)
def test_a_stage_can_end_the_run(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        EXAMPLE,
        "stages.numbers.count=100000000",
        "stages.numbers.dim=4",
        "stages.summary.use=tests.stages_for_tests:StopAfter",
        "stages.summary.items=25",
        "--run-dir",
        str(run_dir),
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    finished = _finished(run_dir)
    assert finished["status"] == "succeeded" and "saw 25 items" in finished["reason"]
    assert any(e["event"] == "stop_after_closed" for e in events(run_dir, "summary.0"))


@pytest.mark.timeout(60)
def test_replicas_die_with_a_supervisor_killed_by_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir)
    try:
        pids = spawned_pids(run_dir)
        proc.kill()  # SIGKILL: the supervisor gets no chance to clean up
        proc.wait(timeout=10)
        wait_for(lambda: not [p for p in pids if alive(p)], 10, "the replicas to die")
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())


async def _send_control(address: str, messages: list[tuple[str, dict, bytes | None]]) -> None:
    """Publish each (topic, payload, key) on the run's control bus, as an outsider would."""
    import zmq.asyncio

    from transport import ControlClient

    ctx = zmq.asyncio.Context()
    try:
        for topic, payload, key in messages:
            client = ControlClient(
                address, address.replace("control.pub", "control.sub"), ctx, key=key
            )
            await client.start(ready_timeout_s=5)
            for _ in range(3):  # the same message thrice: counted thrice, acted on never
                await client.publish(topic, payload)
            await client.aclose()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(90)
def test_only_a_live_replica_can_end_the_run_and_a_failed_stop_fails_it(tmp_path):
    import asyncio

    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir)
    try:
        spec = json.loads((run_dir / "specs" / "numbers.0.json").read_text())
        assert (run_dir / "specs" / "numbers.0.json").stat().st_mode & 0o077 == 0  # private
        address, key = spec["control"]["pub"], bytes.fromhex(spec["control"]["key"])
        me = {"stage": "numbers", "replica": 0}
        asyncio.run(
            _send_control(
                address,
                [
                    # no key at all, then another run's key: refused by the bus itself
                    ("stop", {**me, "session": spec["session"], "reason": "x"}, None),
                    ("stop", {**me, "session": spec["session"], "reason": "x"}, b"k" * 32),
                    # signed, but not a valid stop request: refused by the supervisor
                    ("stop", {"not": "a stop request"}, key),
                    ("stop", {**me, "session": "feedbeef", "reason": "an old session"}, key),
                    ("stop", {**me, "session": spec["session"], "reason": 7}, key),
                    (
                        "stop",
                        {**me, "session": spec["session"], "reason": "x", "outcome": "?"},
                        key,
                    ),
                ],
            )
        )
        time.sleep(1.5)  # several heartbeats: the run would have begun to end by now
        assert proc.poll() is None, "a refused stop message ended the run"
        assert not [e for e in events(run_dir, "supervisor") if e["event"] == "shutting_down"]
        # a live replica asking to end the run as failed: the run fails
        asyncio.run(
            _send_control(
                address,
                [
                    (
                        "stop",
                        {
                            **me,
                            "session": spec["session"],
                            "reason": "gave up",
                            "outcome": "failed",
                        },
                        key,
                    )
                ],
            )
        )
        output, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert proc.returncode == 1, output[-3000:]
    finished = _finished(run_dir)
    assert finished["status"] == "failed" and "gave up" in finished["reason"]
    refused = json.loads((run_dir / "summary.json").read_text())["control_refused"]
    assert refused["not signed with this run's key"] == 6
    by_problem = {k.split(": ", 1)[1]: v for k, v in refused.items() if k.startswith("stop: ")}
    assert by_problem == {
        "no replica 'None.None' in this run": 3,
        "not from the live session of numbers.0": 3,
        "no reason (a non-empty string)": 3,
        "outcome '?' is neither 'succeeded' nor 'failed'": 3,
    }
    logged = [e for e in events(run_dir, "supervisor") if e["event"] == "control_refused"]
    assert 4 <= len(logged) < 12  # once or twice per kind, not once per message
