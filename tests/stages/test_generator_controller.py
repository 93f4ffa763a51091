"""The in-flight controller's decisions: gates from credit and lag, targets from throughput."""

from stages.generator.controller import ControllerConfig, InFlightController

CFG = ControllerConfig(start=8, step=4, interval_s=1.0, gain=0.05, hold_intervals=2)


def _run_interval(ctl, now, tokens, blocked=True):
    ctl.record_tokens("e", tokens)
    if blocked:
        ctl.record_blocked("e")
    return ctl.decide(now)


def test_credit_gate_closes_when_in_flight_fills_the_room_and_reopens():
    ctl = InFlightController(["e"], CFG)
    ok, changes = ctl.gates(in_flight=3, room=4, version=0, newest=0, max_lag=2)
    assert ok and changes == []
    ok, changes = ctl.gates(in_flight=4, room=4, version=0, newest=0, max_lag=2)
    assert not ok
    assert [(c.reason, c.value) for c in changes] == [("credit_gate", False)]
    assert changes[0].detail == {"in_flight": 4, "room": 4, "size": 1}
    ok, changes = ctl.gates(in_flight=4, room=4, version=0, newest=0, max_lag=2)
    assert not ok and changes == []  # logged once, when it changes
    ok, changes = ctl.gates(in_flight=2, room=4, version=0, newest=0, max_lag=2)
    assert ok and [(c.reason, c.value) for c in changes] == [("credit_gate", True)]


def test_lag_gate_blocks_starts_beyond_max_lag():
    ctl = InFlightController(["e"], CFG)
    assert ctl.gates(in_flight=0, room=10, version=3, newest=5, max_lag=2)[0]
    ok, changes = ctl.gates(in_flight=0, room=10, version=3, newest=6, max_lag=2)
    assert not ok and changes[0].reason == "lag_gate"


def test_target_climbs_while_throughput_rises_then_backs_off_and_holds():
    ctl = InFlightController(["e"], CFG)
    ctl.decide(0.0)  # starts the first interval
    up = _run_interval(ctl, 1.0, 100)
    assert [(d.value, d.reason) for d in up] == [(12, "probe_up")]
    up = _run_interval(ctl, 2.0, 150)  # +50%: keep climbing
    assert [(d.value, d.reason) for d in up] == [(16, "probe_up")]
    down = _run_interval(ctl, 3.0, 151)  # flat: undo the raise
    assert [(d.value, d.reason) for d in down] == [(12, "throughput_flat")]
    assert down[0].detail["tokens_per_s"] == 151.0
    assert _run_interval(ctl, 4.0, 151) == []  # holding
    assert _run_interval(ctl, 5.0, 151) == []
    assert [d.value for d in _run_interval(ctl, 6.0, 151)] == [16]  # probes again


def test_target_does_not_grow_when_the_engine_is_not_saturated():
    ctl = InFlightController(["e"], CFG)
    ctl.decide(0.0)
    assert _run_interval(ctl, 1.0, 100, blocked=False) == []
    assert ctl.target("e") == 8


def test_target_stays_within_bounds():
    cfg = ControllerConfig(start=500, min_in_flight=2, max_in_flight=10, step=4, interval_s=1.0)
    ctl = InFlightController(["e"], cfg)
    assert ctl.target("e") == 10
    ctl.decide(0.0)
    assert _run_interval(ctl, 1.0, 100) == []  # at the ceiling already


def test_a_group_starts_only_when_all_its_samples_fit_the_credit():
    ctl = InFlightController(["e"], CFG)
    assert ctl.gates(in_flight=4, room=8, version=0, newest=0, max_lag=2, size=4)[0]
    ok, changes = ctl.gates(in_flight=5, room=8, version=0, newest=0, max_lag=2, size=4)
    assert not ok and changes[0].detail == {"in_flight": 5, "room": 8, "size": 4}
    # room for fewer than a group, nothing in flight: it goes alone rather than never
    assert ctl.gates(in_flight=0, room=2, version=0, newest=0, max_lag=2, size=4)[0]
    assert not ctl.gates(in_flight=0, room=0, version=0, newest=0, max_lag=2, size=4)[0]


def test_a_group_fits_an_engine_under_its_target_or_alone():
    ctl = InFlightController(["e"], CFG)  # target 8
    assert ctl.fits("e", 4, 4) and not ctl.fits("e", 5, 4)
    assert ctl.fits("e", 7, 1) and not ctl.fits("e", 8, 1)
    small = InFlightController(["e"], ControllerConfig(start=2))
    # a group larger than the target: alone on an idle engine, never next to another
    assert small.fits("e", 0, 4) and not small.fits("e", 1, 4)


def test_queue_gate_holds_what_the_learner_will_not_take_within_max_lag():
    ctl = InFlightController(["e"], CFG)
    common = {"in_flight": 4, "room": 100, "version": 0, "newest": 0, "max_lag": 2, "size": 4}
    assert ctl.gates(**common)[0]  # no report from the learner yet: no such gate
    assert ctl.gates(**common, ahead=60, budget=64)[0]  # 60 + 4 fit
    ok, changes = ctl.gates(**common, ahead=61, budget=64)
    assert not ok and [(c.reason, c.value) for c in changes] == [("queue_gate", False)]
    assert changes[0].detail == {"ahead": 61, "budget": 64, "size": 4}
    # nothing of ours ahead of the learner: one group goes, however small the budget
    ok, changes = ctl.gates(**common, ahead=0, budget=0)
    assert ok and [(c.reason, c.value) for c in changes] == [("queue_gate", True)]
