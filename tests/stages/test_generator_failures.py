"""Engine failures, end to end: ``inflight run`` with the generator and built-in engines.

- a launched engine killed mid-run: its requests are re-routed to the live engine, the launcher
  restarts it, the generator takes it back, and no sample is lost;
- a request the engine rejects (HTTP 400) is dropped, counted and logged, and the run goes on;
- an attached engine that is down from the start gets nothing; the live one gets everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from tests.pipeline.runs import (
    alive,
    events,
    run_inflight,
    spawned_pids,
    start_inflight,
    wait_for,
)
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model
from transport.address import rendezvous_port

pytestmark = pytest.mark.slow

VOCAB = 128  # the tiny model's vocabulary
# two engines, the supervisor and three stages share a small CPU: one torch thread each
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", vocab=VOCAB, seed=0)


def _free_port() -> int:
    return rendezvous_port("127.0.0.1")


@pytest.fixture(scope="module")
def live_engine(model_dir, tmp_path_factory):
    """A built-in engine started by the test (to attach to), stopped after the module."""
    out = tmp_path_factory.mktemp("engine") / "engine.out"
    with builtin_engine(model_dir, output=out, stop_within=10) as url:
        yield url


def _done(run_dir) -> dict:
    done = [e for e in events(run_dir, "generator.0") if e["event"] == "generator_done"]
    assert len(done) == 1, "the generator did not finish"
    # every request was accounted for: retries and drops left no slot taken
    assert done[0]["in_flight"] == 0, done[0]
    return done[0]


def _write(
    tmp_path,
    generator: str,
    *,
    prompts: str,
    sink_delay_s: float = 0.0,
    inbox: int = 8,
    outbox: int = 2,
):
    path = tmp_path / "gen.yaml"
    path.write_text(
        f"""
run: {{name: genfail, metrics_every_s: 0.5}}
transport: {{inbox: {inbox}}}
stages:
  prompts: {prompts}
  generator:
    use: generator
    inputs: {{prompts: prompts.out}}
    group_size: 2
    outbox: {outbox}
    retry_backoff_s: 0.2
    controller: {{start: 4, interval_s: 0.2}}
{generator}
  sink:
    use: "tests.stages_for_tests:EngineRolloutSink"
    inputs: {{rollouts: generator.rollouts}}
    delay_s: {sink_delay_s}
"""
    )
    return path


@pytest.mark.timeout(90)
def test_killed_engine_is_restarted_and_its_requests_rerouted(tmp_path, model_dir):
    prompts, hold_at = 16, 8
    config = _write(
        tmp_path,
        f"""    launch: {{model: "{model_dir}", count: 2, max_restarts: 2, restart_from_peer: true}}
    sampling: {{temperature: 1.0, max_new_tokens: 16, ignore_eos: true}}""",
        # the first `hold_at` prompts, then the rest once the test opens the gate
        prompts=(
            f'{{use: "tests.stages_for_tests:GatedPrompts", count: {prompts}, vocab: 60, '
            f"hold_at: {hold_at}}}"
        ),
        # a slow sink paces the run, so that requests are in flight on both engines at the kill
        # (0.2 s per group of 2; at most 2 groups queued at the sink and 1 in the outbox)
        sink_delay_s=0.2,
        inbox=2,
        outbox=1,
    )
    run_dir = tmp_path / "run"
    proc = start_inflight("run", str(config), "--run-dir", str(run_dir), env=ENV)
    launched: list[dict] = []
    try:

        def both_launched_and_busy():
            gen = events(run_dir, "generator.0")
            launched[:] = [e for e in gen if e["event"] == "engine_launched"]
            emitted = [e.get("emitted", 0) for e in gen if e["event"] == "metrics"]
            return len(launched) >= 2 and emitted and emitted[-1] >= 2

        wait_for(both_launched_and_busy, 60, "both engines to serve the first rollouts")
        assert proc.poll() is None, "the run ended before the engine could be killed"
        victim = next(e for e in launched if e["engine"].endswith(".engine0"))
        url = f"http://127.0.0.1:{victim['port']}"
        os.kill(victim["pid"], signal.SIGKILL)
        # the launcher restarts it and the generator takes it back; then the rest of the prompts
        wait_for(
            lambda: any(e["event"] == "engine_up" for e in events(run_dir, "generator.0")),
            60,
            "the generator to take the restarted engine back",
        )
        (run_dir / "go").touch()
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-4000:]

        # every rollout was delivered, once
        rollouts = json.loads((run_dir / "rollouts.json").read_text())
        assert len(rollouts) == 2 * prompts
        assert sorted(r["meta"]["i"] for r in rollouts) == sorted(list(range(prompts)) * 2)
        assert len({(r["group_id"], r["sample_index"]) for r in rollouts}) == 2 * prompts
        assert all(len(r["completion_ids"]) == 16 for r in rollouts)
        # the restarted engine served prompts sent after it came back
        assert [r for r in rollouts if r["meta"]["i"] >= hold_at and r["engine"] == url]

        gen = events(run_dir, "generator.0")
        name = victim["engine"]
        # requests that failed on the dead engine were re-routed
        retries = [e for e in gen if e["event"] == "sample_retry"]
        assert retries and {e["engine"] for e in retries} == {url}
        # the launcher saw it die and started it again, on the same port
        mine = [
            e
            for e in gen
            if e.get("engine") == name and e["event"] in ("engine_launched", "engine_exited")
        ]
        assert [e["event"] for e in mine] == [
            "engine_launched",
            "engine_exited",
            "engine_launched",
        ], mine
        assert mine[1]["exit_code"] == -signal.SIGKILL
        assert mine[2]["pid"] != victim["pid"] and mine[2]["port"] == victim["port"]
        # on its sibling's weights (launch.restart_from_peer), not its checkpoint's
        peer = next(e for e in launched if e["engine"] != name)
        assert "--load-format remote_instance" in mine[2]["command"]
        assert f"service-port {peer['port']} " in mine[2]["command"]
        assert [e["peer"] for e in gen if e["event"] == "engine_restart_from_peer"] == [
            peer["engine"]
        ]
        restarted = (run_dir / "logs" / f"{name}.out").read_text()
        assert "weights_from_remote_instance" in restarted, restarted[-3000:]
        ready = [e for e in gen if e["event"] == "engine_ready" and e["engine"] == name]
        assert len(ready) == 2
        # the generator stopped sending to it while it was down, and took it back once
        ups_and_downs = [e["event"] for e in gen if e["event"] in ("engine_down", "engine_up")]
        assert ups_and_downs == ["engine_down", "engine_up"]
        # it came back serving its sibling's weights (no publisher in this run: version 0)
        assert [e["weight_version"] for e in gen if e["event"] == "engine_up"] == [0]
        done = _done(run_dir)
        assert done["dropped"] == 0 and done["emitted"] == 2 * prompts
        assert done["retried"] == len(retries)
        # every engine the run started (the restarted one included) is gone
        pids = [e["pid"] for e in gen if e["event"] == "engine_launched"]
        wait_for(lambda: not any(alive(p) for p in pids), 10, "the engines to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            for pid in spawned_pids(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for e in events(run_dir, "generator.0"):
            if e["event"] == "engine_launched" and alive(e["pid"]):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(e["pid"], signal.SIGKILL)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["attached", "in_process"])
def test_rejected_request_is_dropped_counted_and_logged(tmp_path, live_engine, model_dir, engine):
    """In process, the groups waiting together go in one request: the bad prompt fails it
    for all of them, and each is asked for again on its own (the good ones served)."""
    prompts, bad = 6, 2
    where = (
        f'engines: ["{live_engine}"]'
        if engine == "attached"
        else f'launch: {{model: "{model_dir}", count: 1, in_process: true}}'
    )
    config = _write(
        tmp_path,
        f"""    {where}
    sampling: {{temperature: 1.0, max_new_tokens: 8, ignore_eos: true}}""",
        prompts=(
            f'{{use: "tests.stages_for_tests:PromptsWithBad", count: {prompts}, vocab: 60, '
            f"bad_index: {bad}, bad_id: {VOCAB + 5}}}"
        ),
    )
    run_dir = tmp_path / "run"
    result = run_inflight("run", str(config), "--run-dir", str(run_dir), timeout=80, env=ENV)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr

    rollouts = json.loads((run_dir / "rollouts.json").read_text())
    good = [i for i in range(prompts) if i != bad]
    assert sorted(r["meta"]["i"] for r in rollouts) == sorted(good * 2)
    gen = events(run_dir, "generator.0")
    dropped = [e for e in gen if e["event"] == "sample_dropped"]
    assert len(dropped) == 2  # both samples of the bad prompt
    for e in dropped:
        assert f"/p{bad}/" in e["rid"] and e["attempts"] == 1
        assert "400" in e["error"] and "outside the vocabulary" in e["error"]
    # a bad request is not an engine failure: no retries, the engine stays in use
    assert not [e for e in gen if e["event"] in ("sample_retry", "engine_down")]
    done = _done(run_dir)
    assert done["dropped"] == 2 and done["emitted"] == 2 * len(good) and done["retried"] == 0
    if engine == "in_process":  # the batch with the bad prompt, then each of its groups alone
        assert done["requests"] > prompts


@pytest.mark.timeout(90)
def test_engine_that_is_down_gets_nothing(tmp_path, live_engine):
    prompts = 8
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    config = _write(
        tmp_path,
        f"""    engines: ["{dead}", "{live_engine}"]
    sampling: {{temperature: 1.0, max_new_tokens: 8, ignore_eos: true}}""",
        prompts=f'{{use: "tests.stages_for_tests:Prompts", count: {prompts}, vocab: 60}}',
    )
    run_dir = tmp_path / "run"
    result = run_inflight("run", str(config), "--run-dir", str(run_dir), timeout=80, env=ENV)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr

    rollouts = json.loads((run_dir / "rollouts.json").read_text())
    assert len(rollouts) == 2 * prompts
    assert {r["engine"] for r in rollouts} == {live_engine}
    gen = events(run_dir, "generator.0")
    # found down at start: taken out of use before any request went there
    down = [e for e in gen if e["event"] == "engine_down"]
    assert [e["url"] for e in down] == [dead]
    assert not [e for e in gen if e["event"] in ("sample_retry", "sample_dropped")]
    done = _done(run_dir)
    assert done["dropped"] == 0 and done["emitted"] == 2 * prompts
