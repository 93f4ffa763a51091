"""The RL loop survives its parts being killed or stalled: ``inflight run`` with everything real.

A SIGKILLed scorer comes back and gets again what it held unacknowledged (its inbox, the groups
it was scoring): the generator keeps every group it sent until the scorer has sent it on.

A SIGKILLed generator replica (the supervisor restarts it, and it launches a fresh engine) or a
SIGKILLed engine server (the generator's launcher restarts it on the same port) comes back serving
the model's initial weights. The learner must send it the current ones without waiting for its
next step: the generator holds samples back from an engine that lags more than ``max_lag``, so
with one engine no samples would come and no step would ever be taken (the run used to stop
there, for good).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.pipeline.runs import (
    REPO,
    events,
    kill_tree,
    spawned_pids,
    start_inflight,
    wait_for,
)
from tests.stages.rl_config import rl_config
from tests.stages.tiny_model import make_arith_model

pytestmark = pytest.mark.slow

_ENV = {"OMP_NUM_THREADS": "1"}
# The tests that kill or stop one stage's process give each stage a process of its own; the
# chaos test runs as users do, feeder, generator and scorer sharing one (run.share_process).
_OWN = "run.share_process=none"
# The generator is killed 7 steps before the end: the learner's pace bounds the samples it is
# not done with to (max_lag + 1) x batch_size, 3 steps here, so the run cannot finish on what the
# killed generator had sent already (with 3 steps left it could, and its fresh engine's weights
# went unchecked when it did); the rest is room for the steps taken between a look and the kill.
STEPS, KILL_AT = 18, 3
KILLS = {"scorer": 3, "engine": 5, "learner": 8, "generator": 11}  # victim: at step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_arith_model(tmp_path_factory.mktemp("model") / "arith", seed=0)


def _steps(run_dir) -> int:
    steps = [e["step"] for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    return max(steps, default=0)


def _balanced(ledger: dict) -> None:
    """Every prompt fed was trained, dropped for a reason or still in flight at the end."""
    assert ledger["unaccounted"] == 0 and "incomplete" not in ledger, ledger
    in_steps = ledger["samples"]["trained"] + ledger["samples"]["no_signal"]
    assert ledger["prompts_fed"] > 0 and in_steps >= STEPS * 4, ledger


def _victim_pid(run_dir, victim: str) -> int:
    if victim in ("generator", "scorer", "learner"):
        spawned = [
            e
            for e in events(run_dir, "supervisor")
            if e["event"] == "replica_spawned" and e["replica_name"] == f"{victim}.0"
        ]
        return spawned[-1]["pid"]
    launched = [e for e in events(run_dir, "generator.0") if e["event"] == "engine_launched"]
    return launched[-1]["pid"]


@pytest.mark.timeout(300)
def test_each_stage_killed_in_turn_comes_back_and_the_run_completes(tmp_path, model_dir):
    """SIGKILLs of the scorer, the engine server, the learner and the generator, one after
    another in one run (one run, not one each: a run's start is most of its time here)."""
    config = rl_config(tmp_path, model_dir, steps=STEPS)
    run_dir = tmp_path / "run"
    # debug: per-update events (weights_published, weight_version_set) are looked at
    proc = start_inflight(
        "run", str(config), "run.log_level=debug", _OWN, "--run-dir", str(run_dir), "-q", env=_ENV
    )
    killed_at: dict[str, int] = {}
    try:
        for victim, at in KILLS.items():
            wait_for(lambda at=at: _steps(run_dir) >= at, 120, f"{at} train steps")
            assert proc.poll() is None, f"the run ended before the {victim} was killed"
            killed_at[victim] = _steps(run_dir)
            os.kill(_victim_pid(run_dir, victim), signal.SIGKILL)
        output, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, output[-4000:]
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    _balanced(summary["ledger"])
    assert killed_at["generator"] < STEPS  # the last kill landed mid-run
    restarting = [e for e in events(run_dir, "supervisor") if e["event"] == "replica_restarting"]
    assert [e["replica_name"] for e in restarting] == ["scorer.0", "learner.0", "generator.0"]
    # the learner resumed from its checkpoint; the resumed weights went out as a version newer
    # than any before (versions only grow)
    learner = events(run_dir, "learner.0")
    (resumed,) = [e for e in learner if e["event"] == "learner_resumed"]
    assert resumed["step"] <= killed_at["learner"] and resumed["step"] % 2 == 0  # every 2
    published = [e["policy_version"] for e in learner if e["event"] == "weights_published"]
    before = published[: published.index(resumed["policy_version"])]
    assert before and resumed["policy_version"] > max(before)
    assert published == sorted(published)
    final = STEPS + resumed["version_offset"]
    assert summary["policy_version"] == final
    # the scorer got again what it had not sent on: the generator redelivered it
    generator = events(run_dir, "generator.0")
    redelivering = [e for e in generator if e["event"] == "redelivering"]
    counted = {e["out.rollouts.redelivered"] for e in generator if "out.rollouts.redelivered" in e}
    assert redelivering and redelivering[0]["count"] >= 1 and redelivering[0]["count"] in counted
    # each engine started again (by the generator's launcher after the engine's kill, fresh
    # with the new generator after its kill) was sent the current weights first, and then every
    # version. Between steps (a catch-up) when the learner had run out of samples, or with its
    # next step's publish when it still had some: which one is a race here (the catch-up alone:
    # tests/stages/test_learner_stage.py)
    caught_up = [e for e in learner if e["event"] == "weights_catch_up"]
    assert all(e["reason"] for e in caught_up)
    engine_log = events(run_dir, "generator-0-engine.0")
    starts = [i for i, e in enumerate(engine_log) if e["event"] == "engine_started"]
    assert len(starts) == 3, "the engine was started twice more"
    for victim, start, end in (
        ("engine", starts[1], starts[2]),
        ("generator", starts[2], len(engine_log)),
    ):
        versions = [
            int(e["weight_version"])
            for e in engine_log[start:end]
            if e["event"] == "weight_version_set"
        ]
        # the first weights the new engine got were the learner's current ones, not the model's
        assert versions and versions[0] >= killed_at[victim], (victim, versions)
    assert versions[-1] == final
    assert [e["exit_code"] for e in generator if e["event"] == "engine_exited"] == [-9]
    reset = [e for e in generator if e["event"] == "engine_version_reset"]
    assert reset and reset[0]["now"] == 0
    # the last evaluation went to the engines of the day, not to one that was killed
    assert summary["evals"][-1]["failed"] == 0, summary["evals"][-1]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.timeout(300)
def test_a_stalled_scorer_holds_everyone_flat_and_the_run_goes_on(tmp_path, model_dir):
    """SIGSTOP the scorer for 12 s mid-run: producers block on credit, nobody's memory grows,
    and the run completes once it continues."""
    config = rl_config(tmp_path, model_dir, steps=STEPS)
    run_dir = tmp_path / "run"
    proc = start_inflight("run", str(config), _OWN, "--run-dir", str(run_dir), "-q", env=_ENV)
    scorer = None
    try:
        wait_for(lambda: _steps(run_dir) >= KILL_AT, 120, f"{KILL_AT} train steps")
        spawned = {
            e["replica_name"]: e["pid"]
            for e in events(run_dir, "supervisor")
            if e["event"] == "replica_spawned"
        }
        scorer = spawned.pop("scorer.0")
        watched = {**spawned, "engine": _victim_pid(run_dir, "engine")}
        os.kill(scorer, signal.SIGSTOP)
        stalled_at = _steps(run_dir)
        time.sleep(3)  # what was in flight settles: queues fill up to their bounds
        early = {name: _rss_kb(pid) for name, pid in watched.items()}
        time.sleep(9)
        late = {name: _rss_kb(pid) for name, pid in watched.items()}
        # nothing reached the learner meanwhile: it finished the step it was taking, the one
        # whose groups it read during that step (a batch at most), and the one its inbox held
        # (4 groups, one batch), no more
        assert _steps(run_dir) <= stalled_at + 3
        os.kill(scorer, signal.SIGCONT)
        scorer = None
        output, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, output[-4000:]
    finally:
        if scorer is not None:
            os.kill(scorer, signal.SIGCONT)
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    for name in early:  # flat: within 5% or 4 MB, whichever is larger
        assert late[name] - early[name] <= max(0.05 * early[name], 4096), (name, early, late)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    _balanced(summary["ledger"])
    # the generator was held back while the scorer was stopped: by the scorer's credit, or
    # first by its queue gate (the samples the learner is not done with reached its bound)
    gen = events(run_dir, "generator.0")
    waits = [
        e["out.rollouts.credit_wait_s"]
        for e in gen
        if e["event"] == "metrics" and "out.rollouts.credit_wait_s" in e
    ]
    held = [e for e in gen if e.get("reason") == "queue_gate" and e["value"] is False]
    assert waits[-1] >= 5 or held, waits
    assert not [e for e in events(run_dir, "supervisor") if e["event"] == "replica_failed"]


@pytest.mark.timeout(240)
def test_a_sync_learner_killed_before_its_first_publish_comes_back_and_the_run_completes(
    tmp_path, model_dir
):
    """Sync mode: the learner trains version 0's batch and acknowledges it, then dies while it
    publishes version 1 (its engine is stopped, so the publish hangs there). The generator made
    its batch for version 0 and waits for version 1; the restarted learner has no checkpoint
    and no live version. It sends its weights as version 1 first, or the run waits for ever."""
    config = rl_config(tmp_path, model_dir, steps=3, mode="sync")
    run_dir = tmp_path / "run"
    # debug: the learner's weights_published events are looked at
    proc = start_inflight(
        "run", str(config), "run.log_level=debug", _OWN, "--run-dir", str(run_dir), "-q", env=_ENV
    )
    engine = None
    try:
        generator = lambda: events(run_dir, "generator.0")  # noqa: E731
        wait_for(
            lambda: any(e["event"] == "sync_batch_done" for e in generator()),
            120,
            "version 0's batch",
            proc=proc,
            run_dir=run_dir,
        )
        engine = _victim_pid(run_dir, "engine")
        os.kill(engine, signal.SIGSTOP)
        wait_for(lambda: _steps(run_dir) >= 1, 60, "the first step", proc=proc, run_dir=run_dir)
        time.sleep(1)  # its samples acknowledged, its publish hanging on the stopped engine
        assert not any(e["event"] == "weights_published" for e in events(run_dir, "learner.0"))
        os.kill(_victim_pid(run_dir, "learner"), signal.SIGKILL)
        os.kill(engine, signal.SIGCONT)
        engine = None
        output, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0, output[-4000:]
    finally:
        if engine is not None:
            os.kill(engine, signal.SIGCONT)
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 3
    ledger = summary["ledger"]
    assert ledger["unaccounted"] == 0 and "incomplete" not in ledger, ledger
    # the killed step's samples were acknowledged: gone with it, not sent again
    assert ledger["samples"]["dropped"] == {"rolled_back": 16}, ledger
    learner = events(run_dir, "learner.0")
    (resumed,) = [e for e in learner if e["event"] == "learner_resumed"]
    assert (resumed["step"], resumed["policy_version"]) == (0, 1)
    published = [e["policy_version"] for e in learner if e["event"] == "weights_published"]
    assert published == [1, 2, 3, 4] and summary["policy_version"] == 4
    assert summary["mean_lag"] == 0 and summary["stale_dropped"] == 0  # still sync


@pytest.mark.timeout(400)
def test_chaos_seeded_kills_of_every_kind_the_run_completes_and_the_ledger_balances(
    tmp_path, model_dir
):
    """bench/chaos.py, shortened: seeded SIGKILLs of random victims while the RL loop trains
    (each stage's own kill and restart: the kills-in-turn test)."""
    STEPS, KILLS = 28, 4
    config = rl_config(tmp_path, model_dir, steps=STEPS)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "bench/chaos.py",
            "--config",
            str(config),
            "--steps",
            str(STEPS),
            "--kills",
            str(KILLS),
            "--by-step",
            "--seed",
            "4",
            "--checkpoint-every",
            "4",
            "--timeout",
            "300",
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO,
        env={**os.environ, **_ENV},
        capture_output=True,
        text=True,
        timeout=380,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout[-2000:] + result.stderr[-2000:]
    out = json.loads(lines[-1])
    assert out["status"] == "succeeded" and out["steps"] == STEPS, out
    assert out["kills"] == KILLS and len(out["kills_by_victim"]) >= 3, out
    assert out["unaccounted"] == 0 and out["ledger_incomplete"] is None, out
    # each sample of the final model's steps trained once (a copy or a part-trained group
    # after a learner restart is not trained again)
    in_steps = out["samples"]["trained"] + out["samples"]["no_signal"]  # no_signal: no passes
    assert in_steps == STEPS * 16 and not out["duplicate_fates"], out


@pytest.mark.timeout(300)
def test_a_feeder_down_at_the_end_is_accounted_for_by_its_state_file(tmp_path, model_dir):
    """The feeder is SIGKILLed and still waiting out its restart backoff when the learner
    finishes: it sends no final report, but its state file says what its next process would feed
    again (every unacknowledged position up to ``reserved``), so the ledger still balances."""
    steps = 6
    config = rl_config(tmp_path, model_dir, steps=steps)
    run_dir = tmp_path / "run"
    # The generator's inbox must carry the run to its end without the feeder: the learner keeps
    # what the generator's own lag gate lets through (no stale drops eating prompts), and the
    # feeder's restart waits longer than the rest of the run can take.
    proc = start_inflight(
        "run", str(config), "stages.feeder.restart.backoff_s=120", "stages.learner.max_lag=8",
        _OWN, "--run-dir", str(run_dir), "-q", env=_ENV,
    )  # fmt: skip
    try:
        wait_for(lambda: _steps(run_dir) >= 2, 120, "2 train steps")
        (spawned,) = [
            e
            for e in events(run_dir, "supervisor")
            if e["event"] == "replica_spawned" and e["replica_name"] == "feeder.0"
        ]
        os.kill(spawned["pid"], signal.SIGKILL)  # what the generator holds finishes the run
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-4000:]
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    ledger = summary["ledger"]
    # the feeder never reported; every other replica ended cleanly, the learner too, which
    # gets the supervisor's SIGTERM as it ends (test_actor_context: no death by it)
    assert ledger["not_ended_cleanly"] == ["feeder.0"], ledger
    assert ledger["unaccounted"] == 0 and "incomplete" not in ledger, ledger
    # what the feeder had fed but nobody finished is in flight at the end, not lost
    state = json.loads((run_dir / "state" / "feeder.0.json").read_text())
    assert ledger["prompts_fed"] > ledger["prompts_complete"] and state["reserved"] > 0, ledger


@pytest.mark.timeout(300)
def test_a_learner_killed_while_it_writes_a_checkpoint_never_resumes_from_half_of_one(
    tmp_path, model_dir
):
    """A checkpoint every step; twice the learner is SIGKILLed at a seeded moment while a
    checkpoint folder has no ``COMPLETE`` marker yet (written, or an old one being removed). A
    half checkpoint loaded would fail the restarted learner."""
    import random

    steps, kills = 10, 2
    config = rl_config(tmp_path, model_dir, steps=steps)
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    overrides = [
        "stages.learner.checkpoint.every=1",
        "stages.learner.restart.max_restarts=5",
        "stages.learner.restart.backoff_s=0.2",
    ]
    proc = start_inflight("run", str(config), *overrides, "--run-dir", str(run_dir), "-q", env=_ENV)
    rng, complete_at_kill = random.Random(7), []

    def step_of(folder) -> int:
        return int(folder.name.removeprefix("step-"))

    try:
        for kill in range(kills):
            # the learner process of the day is up and has saved a checkpoint of its own
            def saving(kill=kill) -> bool:
                spawned = [
                    e["ts"]
                    for e in events(run_dir, "supervisor")
                    if e["event"] == "replica_spawned" and e["replica_name"] == "learner.0"
                ]
                return len(spawned) == kill + 1 and any(
                    e["event"] == "checkpoint_saved" and e["ts"] > spawned[-1]
                    for e in events(run_dir, "learner.0")
                )

            wait_for(saving, 120, f"learner process {kill + 1} to save a checkpoint")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # then a checkpoint newer than any complete one
                folders = list(ckpts.glob("step-*"))
                done = max((step_of(f) for f in folders if (f / "COMPLETE").exists()), default=0)
                if any(step_of(f) > done and not (f / "COMPLETE").exists() for f in folders):
                    break
                assert proc.poll() is None, "the run ended before every kill landed"
                time.sleep(0.001)
            else:
                raise AssertionError("no checkpoint write seen in 60 s")
            time.sleep(rng.uniform(0, 0.03))  # somewhere in the write
            (spawned,) = [
                e
                for e in events(run_dir, "supervisor")
                if e["event"] == "replica_spawned" and e["replica_name"] == "learner.0"
            ][kill:]
            os.kill(spawned["pid"], signal.SIGKILL)
            complete_at_kill.append(
                max((step_of(p.parent) for p in ckpts.glob("step-*/COMPLETE")), default=0)
            )
        output, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, output[-4000:]
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    _balanced(summary["ledger"])
    resumed = [e["step"] for e in events(run_dir, "learner.0") if e["event"] == "learner_resumed"]
    assert len(resumed) == kills, resumed
    # each restart resumed from the newest checkpoint that was complete when it was killed
    # (or, when the kill came as the marker was written, the one finished just then)
    for step, at_kill in zip(resumed, complete_at_kill, strict=True):
        assert step == at_kill, (resumed, complete_at_kill)
    # what is left: the newest 2, complete and whole (leftovers of cut writes were removed)
    left = sorted(ckpts.glob("step-*"))
    assert [f.name for f in left] == ["step-000009", "step-000010"]
    assert all((f / "COMPLETE").exists() and (f / "model.safetensors").exists() for f in left)
