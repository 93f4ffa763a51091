"""The console of ``inflight run``: the status block, the permanent lines, the plain lines off a
terminal, the ETA; and once end to end, a short real run with stdout not a terminal."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console as RichConsole

from pipeline.console import Console, StepRate, total_steps
from tests.pipeline.runs import events, run_inflight

T0 = 1_800_000_000.0  # an epoch second; events carry ISO timestamps of it


def _ts(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds")[:-6] + "Z"


def _event(t: float, name: str, stage: str = "learner", level: str = "info", **fields) -> dict:
    return {
        "ts": _ts(t),
        "level": level,
        "event": name,
        "stage": stage,
        "replica": 0,
        "version": 0,
        **fields,
    }


def _step(t: float, step: int, **fields) -> dict:
    base = {"reward": 0.5, "solved": 0.5, "lag": 1.25, "samples": 256, "samples_per_s": 1.0}
    return _event(t, "train_step", step=step, **{**base, **fields})


def _run(total: int = 100) -> list[dict]:
    """A run: start, eval before training, 100 steps of 0.5 s (from t=10 s), an eval at step
    50, a checkpoint, a warning, the learner's summary and the end; plus noise."""
    evs = [
        _event(
            T0,
            "run_started",
            stage="supervisor",
            run_dir="/r",
            config="c.yaml",
            stages={"feeder": 1, "generator": 2, "learner": 1},
        ),
        _event(T0 + 1, "replica_started", stage="generator"),
        _event(T0 + 9, "eval", step=0, accuracy=0.25, prompts=300, failed=0, seconds=0.5),
    ]
    for k in range(1, total + 1):
        t = T0 + 10 + 0.5 * k
        evs.append(_step(t, k, reward=k / total))
        evs.append(_event(t, "weights_published", level="debug", policy_version=k))
        evs.append(_event(t, "inflight_decision", stage="generator", scope="all", in_flight=48))
        if k % 20 == 0:
            evs.append(_event(t, "metrics", stage="generator", in_flight=64, tokens=1000 * k))
        if k == 50:
            evs.append(_event(t, "eval", step=50, accuracy=0.5, prompts=300, failed=0, seconds=1))
            evs.append(_event(t, "checkpoint_saved", step=50, path="/r/checkpoints/step-000050"))
            evs.append(
                _event(t, "rollout_dropped", stage="scorer", level="warning", reason="duplicate")
            )
    end = T0 + 10 + 0.5 * total
    evs += [
        _event(end + 1, "eval", step=total, accuracy=0.75, prompts=300, failed=0, seconds=1),
        _event(
            end + 1,
            "learner_done",
            steps=total,
            samples=256 * total,
            train_s=55.0,
            mean_lag=1.25,
            eval_after=0.75,
            stale_dropped=3,
        ),
        _event(
            end + 2,
            "run_finished",
            stage="supervisor",
            status="succeeded",
            exit_code=0,
            reason="learner.0 asked to stop",
            restarts={},
        ),
    ]
    return evs


class _Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _replay(console: Console, clock: _Clock, evs: list[dict], until: float | None = None) -> None:
    """Feed events as they would arrive: the clock at each event's time, a tick after each."""
    from pipeline.log_view import event_wall

    for e in evs:
        at = event_wall(e)
        if until is not None and at > until:
            return
        clock.t = max(clock.t, at)
        console.feed(e)
        console.tick()


def _text(renderable, width: int = 160) -> str:
    out = RichConsole(file=io.StringIO(), width=width, color_system=None)
    out.print(renderable)
    return out.file.getvalue()


# --------------------------------------------------------------------------- the picture


def test_the_block_shows_step_eta_figures_and_last_eval():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=False, clock=clock)
    _replay(console, clock, _run(), until=T0 + 10 + 0.5 * 60)
    block = _text(console.block())
    assert "step 60/100" in block and "60%" in block
    assert "elapsed 0:40" in block
    assert "ETA 0:20" in block  # 40 steps left at 0.5 s
    # the last step's figures, samples/s from the smoothed rate (256 per 0.5 s), generated
    # tokens/s from the generator's cumulative count (20,000 tokens per 10 s)
    for shown in (
        "reward 0.600",
        "solved 0.500",
        "lag 1.25",
        "samples/s 512",
        "tokens/s 2.0k",
        "in flight 64",
        "eval 0.500 @50",
    ):
        assert shown in block, (shown, block)
    assert "step 60/100 60%" in console.status_line()


def test_a_pipeline_that_does_not_train_shows_its_replicas():
    clock = _Clock()
    console = Console(total=None, out=io.StringIO(), live=False, clock=clock)
    console.feed(_event(T0, "replica_started", stage="power"))
    console.feed(_event(T0, "replica_started", stage="numbers"))
    console.feed(_event(T0, "replica_restarting", stage="supervisor", level="warning"))
    clock.t = T0 + 5
    assert console.status_line() == "elapsed 0:05, 2 replicas up, 1 restart"
    assert "step" not in _text(console.block())


def test_total_steps_comes_from_the_learner_stage():
    def section(use, **options):
        return SimpleNamespace(use=use, options=SimpleNamespace(**options))

    assert (
        total_steps({"learner": section("learner", steps=350), "feeder": section("feeder")}) == 350
    )
    assert total_steps({"numbers": section("numbers", count=5)}) is None
    two = {"a": section("x:Trainer", steps=5), "learner": section("learner", steps=7)}
    assert total_steps(two) == 7
    assert total_steps({"l": section("learner", steps=True)}) is None  # a bool is no count


# --------------------------------------------------------------------------- lines


def test_only_the_events_that_matter_become_lines():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=False, every_s=1e9, clock=clock)
    _replay(console, clock, _run())
    lines = out.getvalue().splitlines()
    assert len(lines) == 8, lines  # of 400-odd events
    assert lines[0].endswith("run started: c.yaml (feeder, generator x2, learner), 100 steps in /r")
    evals = [line for line in lines if " eval " in line]
    assert [e.split(": held-out accuracy ")[1][:5] for e in evals] == ["0.250", "0.500", "0.750"]
    assert "eval before training" in evals[0] and "eval at step 50" in evals[1]
    assert any("checkpoint at step 50: /r/checkpoints/step-000050" in line for line in lines)
    (warning,) = [line for line in lines if "WARN" in line]
    assert "scorer.0" in warning and "rollout_dropped" in warning and "reason=duplicate" in warning
    assert "held-out accuracy 0.250 -> 0.750" in lines[-2] and "25,600 samples" in lines[-2]
    assert lines[-1].endswith(
        "run succeeded (exit 0) after 1:02: learner.0 asked to stop; 1 warning above; "
        "summary in /r/summary.json"
    )
    assert not any("train_step" in line or "weights_published" in line for line in lines)


def test_console_level_hides_info_lines_but_not_warnings():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=False, every_s=1e9, level="warning", clock=clock)
    _replay(console, clock, _run())
    (line,) = out.getvalue().splitlines()
    assert "rollout_dropped" in line
    assert console.evaluation is not None and console.step == 100  # the picture still follows


def test_errors_show_as_inflight_logs_shows_them():
    out = io.StringIO()
    console = Console(total=10, out=out, live=False)
    console.feed(
        _event(
            T0,
            "replica_failed",
            stage="supervisor",
            level="error",
            replica_name="scorer.0",
            reason="killed by signal SIGKILL",
        )
    )
    line = out.getvalue()
    assert "ERROR supervisor v0 replica_failed" in line and 'reason="killed by signal' in line


# --------------------------------------------------------------------------- not a terminal


def test_off_a_terminal_one_status_line_every_every_s():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=False, every_s=10, clock=clock)
    _replay(console, clock, _run())  # 62 s of events
    status = [line for line in out.getvalue().splitlines() if " step " in line[:14]]
    # a line when 10 s have passed since the previous one: at 10.5, 20.5, ... 60.5 s
    assert len(status) == 6, status
    assert status[0].startswith(_ts(T0 + 10)[11:19]) and "step 1/100" in status[0]
    assert "step 41/100 41%" in status[2] and "ETA 0:30" in status[2]  # 59 steps of 0.5 s
    assert "\x1b" not in out.getvalue()  # no control sequences in a log file


def test_the_end_line_is_the_last_even_when_a_status_line_falls_due_after_it():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=False, every_s=10, clock=clock)
    _replay(console, clock, _run())
    assert "run succeeded" in out.getvalue().splitlines()[-1]
    clock.t += 60  # the supervisor's loop ticks once more after the run's last event
    console.tick()
    assert "run succeeded" in out.getvalue().splitlines()[-1]


def test_on_a_terminal_a_live_block_and_lines_above_it():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=True, width=140, clock=clock)
    with console:
        _replay(console, clock, _run(), until=T0 + 40)
        drawn = out.getvalue()
        assert "step 60/100" in drawn and "\x1b[2K" in drawn  # redrawn in place
        assert "eval at step 50" in drawn and "checkpoint at step 50" in drawn
        assert "train_step" not in drawn
    assert console.lines == 5  # start, two evals, checkpoint, the warning


def test_the_block_is_redrawn_at_most_four_times_a_second():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=100, out=out, live=True, width=140, clock=clock)
    with console:
        drawn = []
        for i in range(100):  # 100 ticks over 5 s
            clock.t = T0 + i * 0.05
            before = len(out.getvalue())
            console.tick()
            drawn.append(len(out.getvalue()) > before)
    assert 19 <= sum(drawn) <= 21, sum(drawn)


# --------------------------------------------------------------------------- ETA


def test_eta_from_the_recent_step_rate_not_the_startup():
    rate = StepRate(half_life_steps=10)
    assert rate.eta(100, T0) is None
    rate.add(1, T0 + 30.0)  # 30 s of start-up before the first step: not part of the rate
    assert rate.eta(100, T0 + 30.0) is None
    for k in range(2, 21):
        rate.add(k, T0 + 30.0 + (k - 1) * 1.0)
    assert rate.seconds_per_step == pytest.approx(1.0)
    assert rate.eta(100, T0 + 49.0) == pytest.approx(80.0)
    # within a step it counts down, but never below the steps after the one under way
    assert rate.eta(100, T0 + 49.5) == pytest.approx(79.5)
    assert rate.eta(100, T0 + 60.0) == pytest.approx(79.0)
    # the machine slows down to 2 s a step: after one half-life (10 steps) the new steps
    # weigh more than the 19 before, after four half-lives the old ones hardly count
    t = T0 + 49.0
    for k in range(21, 31):
        t += 2.0
        rate.add(k, t)
    assert 1.5 < rate.seconds_per_step < 1.65
    for k in range(31, 61):
        t += 2.0
        rate.add(k, t)
    assert 1.9 < rate.seconds_per_step < 2.0
    assert rate.eta(60, t) == 0.0


def test_eta_handles_skipped_steps_and_a_resumed_learner():
    rate = StepRate(half_life_steps=10)
    rate.add(10, T0)
    rate.add(14, T0 + 2.0)  # four steps in one report
    assert rate.seconds_per_step == pytest.approx(0.5)
    rate.add(8, T0 + 30.0)  # resumed from the checkpoint of step 8: a fresh estimate
    assert rate.seconds_per_step is None
    rate.add(9, T0 + 31.0)
    assert rate.eta(10, T0 + 31.0) == pytest.approx(1.0)


# --------------------------------------------------------------------------- end to end


@pytest.mark.timeout(120)
def test_a_real_run_off_a_terminal_prints_few_lines_every_eval_and_no_warning(tmp_path):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        "configs/default.yaml",
        "stages.learner.steps=12",
        "stages.learner.eval.every=5",
        "stages.learner.eval.max_prompts=40",
        "stages.learner.checkpoint.every=0",
        "run.console_every_s=2",
        "--run-dir",
        str(run_dir),
        timeout=110,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    logged = [e for e in events(run_dir) if e.get("level") in ("warning", "error", "critical")]
    assert not logged, json.dumps(logged)[:3000]  # a normal end warns of nothing
    assert not [line for line in lines if " WARN " in line or " ERROR " in line], lines
    evals = [e for e in events(run_dir, "learner.0") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 5, 10, 12]
    shown = [line for line in lines if ": held-out accuracy " in line and " eval " in line]
    assert len(shown) == len(evals), lines
    for line, e in zip(shown, evals, strict=True):
        assert f"{e['accuracy']:.3f}" in line
    status = [line for line in lines if " step " in line[:14] or " elapsed " in line[:20]]
    assert status, lines
    # a line every 2 s plus a dozen others, against hundreds of events
    assert len(lines) <= 12 + 2 + len(status) and len(status) <= 30, lines
    assert "run succeeded (exit 0)" in lines[-1]
    assert "\x1b" not in result.stdout


def test_an_evaluation_that_played_episodes_says_how_they_went():
    clock, out = _Clock(), io.StringIO()
    console = Console(total=10, out=out, live=False, every_s=1e9, clock=clock)
    episodes = {"turns_mean": 1.92, "tool_use": 0.92, "solved": None, "failed": 0, "seconds": 1}
    game = {"turns_mean": 5.5, "tool_use": 0.0, "solved": 0.81, "failed": 0, "seconds": 1}
    _replay(
        console,
        clock,
        [
            _event(T0, "eval", step=5, accuracy=0.8, prompts=100, **episodes),
            _event(T0 + 1, "eval", step=10, accuracy=0.81, prompts=100, **game),
        ],
    )
    tools, guess = out.getvalue().splitlines()
    assert "held-out accuracy 0.800, 1.92 turns, tool use 0.92 (100 prompts" in tools
    assert "held-out accuracy 0.810, 5.50 turns, solved 0.81 (100 prompts" in guess
