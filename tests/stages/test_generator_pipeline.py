"""The generator in a real pipeline: prompts -> generator (+ a launched built-in engine) -> sink."""

from __future__ import annotations

import json

import pytest

from tests.pipeline.runs import events, run_inflight
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _config(
    tmp_path, model_dir, *, count, delay_s, inbox=8, new_tokens=12, outbox=2, in_process=False
):
    path = tmp_path / "gen.yaml"
    path.write_text(
        f"""
run: {{name: gen, metrics_every_s: 0.5}}
transport: {{inbox: {inbox}}}
stages:
  prompts: {{use: "tests.stages_for_tests:Prompts", count: {count}, vocab: 60}}
  generator:
    use: generator
    inputs: {{prompts: prompts.out}}
    launch: {{model: "{model_dir}", count: 1, in_process: {str(in_process).lower()}}}
    group_size: 2
    outbox: {outbox}
    sampling: {{temperature: 1.0, max_new_tokens: {new_tokens}, ignore_eos: true}}
    controller: {{start: 8, interval_s: 0.5}}
  sink:
    use: "tests.stages_for_tests:RolloutSink"
    inputs: {{rollouts: generator.rollouts}}
    delay_s: {delay_s}
"""
    )
    return path


def _gen_metrics(run_dir):
    return [
        e for e in events(run_dir, "generator.0") if e["event"] == "metrics" and "in_flight" in e
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_process", [False, True], ids=["engine_process", "in_process"])
def test_rollouts_carry_per_token_logprobs_and_versions(tmp_path, model_dir, in_process):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        str(_config(tmp_path, model_dir, count=6, delay_s=0, in_process=in_process)),
        "--run-dir",
        str(run_dir),
        timeout=170,
        env={"OMP_NUM_THREADS": "1"},  # engine and stages share 2 cores
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    rollouts = json.loads((run_dir / "rollouts.json").read_text())
    assert len(rollouts) == 12
    groups = {}
    for r in rollouts:
        assert len(r["completion_ids"]) == len(r["logprobs"]) == len(r["versions"]) == 12
        assert all(lp <= 0 for lp in r["logprobs"]) and r["finish_reason"] == "length"
        assert set(r["versions"]) == {0}
        groups.setdefault(r["group_id"], set()).add(r["sample_index"])
    assert len(groups) == 6 and all(v == {0, 1} for v in groups.values())
    assert sorted(r["meta"]["i"] for r in rollouts) == sorted(list(range(6)) * 2)
    # each group names its generator session (the learner counts the generators feeding it)
    assert len({r["origin"] for r in rollouts}) == 1
    assert rollouts[0]["origin"].startswith("generator.0:")
    done = [e for e in events(run_dir, "generator.0") if e["event"] == "generator_done"]
    assert done and done[0]["emitted"] == 12 and done[0]["dropped"] == 0
    # one /generate per group (group_requests is on by default), and the engine served them;
    # an engine in the generator's process takes the groups waiting together in one request
    if in_process:
        assert 1 <= done[0]["requests"] < 6
    else:
        assert done[0]["requests"] == 6
    assert done[0]["engines_without_group_requests"] == 0
    if in_process:  # no engine process: its events are the generator's, no HTTP /generate
        started = [e for e in events(run_dir, "generator.0") if e["event"] == "engine_started"]
        assert started and started[0]["in_process"] is True
        assert not (run_dir / "logs" / "generator-0-engine.0.jsonl").exists()
        return
    # the launched engine's own events are part of the run's logs
    engine_events = events(run_dir, "generator-0-engine.0")
    assert any(e["event"] == "engine_started" for e in engine_events)
    assert {e["stage"] for e in engine_events} == {"generator-0-engine"}


@pytest.mark.timeout(180)
def test_slow_downstream_lowers_requests_in_flight(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        # short samples, a slow sink: the sink, not the engine, is the bottleneck
        str(_config(tmp_path, model_dir, count=12, delay_s=0.25, inbox=4, new_tokens=3, outbox=1)),
        "run.log_level=debug",  # the credit gate's decisions are debug events
        "--run-dir",
        str(run_dir),
        timeout=170,
        env={"OMP_NUM_THREADS": "1"},  # engine and stages share 2 cores
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    gen = events(run_dir, "generator.0")
    closed = [
        e
        for e in gen
        if e["event"] == "inflight_decision" and e["reason"] == "credit_gate" and not e["value"]
    ]
    assert closed, "the credit gate never closed under a slow consumer"
    # once the sink's inbox is full, only the outbox's free slot (one group of 2) is left
    in_flight = [m["in_flight"] for m in _gen_metrics(run_dir)]
    assert in_flight and max(in_flight[len(in_flight) // 2 :]) <= 2
