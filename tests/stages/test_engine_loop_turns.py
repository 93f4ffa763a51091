"""The event loop and the scheduler's steps taking turns (``stages.engine.loop_turns``): one at a
time, neither starved by the other, and a close that frees whoever waits."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stages.engine.loop_turns import Turns, turn_taking_loop
from stages.engine.server import _parser, event_loop_turns
from tests.stages.test_engine_server import serving
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(60)


def _busy(seconds: float) -> None:
    """Work that lets the GIL go now and then, as a scheduler step's torch calls do."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(0)


def test_a_step_that_ends_while_the_loop_waits_hands_the_turn_over() -> None:
    turns = Turns()
    order: list[str] = []
    inside = [0]
    overlaps = [0]

    def turn(name: str) -> None:
        inside[0] += 1
        overlaps[0] += inside[0] > 1
        order.append(name)
        end = time.perf_counter() + 0.0002  # Python that keeps the GIL
        while time.perf_counter() < end:
            pass
        inside[0] -= 1

    together = threading.Barrier(2)

    def scheduler() -> None:
        together.wait(10)
        for _ in range(200):
            turns.step(lambda: turn("s"))

    def loop() -> None:
        together.wait(10)
        for _ in range(200):
            turns.loop_acquire()
            try:
                turn("l")
            finally:
                turns.loop_release()

    threads = [threading.Thread(target=f) for f in (scheduler, loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert overlaps[0] == 0
    assert sorted(order) == ["l"] * 200 + ["s"] * 200
    # while both are at it, a step rarely follows a step: without the handover the stepping
    # thread, which lets the turn go and asks again at once, took runs of about 20 turns (the
    # GIL's 5 ms switch interval), 135-145 repeats in ~300 turns; with it, one such run at most
    # (about 25 turns), before the loop's thread first gets the GIL to say it waits
    first_done = min(max(i for i, x in enumerate(order) if x == name) for name in "ls")
    both_began = max(order.index(name) for name in "ls")
    both = "".join(order[both_began : first_done + 1])
    repeats = sum(1 for a, b in itertools.pairwise(both) if a == b == "s")
    assert repeats <= max(len(both) // 4, 30), both


def test_a_loop_that_is_never_idle_still_lets_the_steps_run() -> None:
    turns = Turns()
    steps = [0]
    stop = threading.Event()

    def loop() -> None:  # a flood of requests: it lets the turn go only to take it back
        while not stop.is_set():
            turns.loop_acquire()
            try:
                end = time.perf_counter() + 0.0005  # callbacks: Python that keeps the GIL
                while time.perf_counter() < end:
                    pass
            finally:
                turns.loop_release()
            time.sleep(0)  # its poll of its sockets, with callbacks ready: at once

    def one_step() -> None:
        _busy(0.001)
        steps[0] += 1

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.05)
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            turns.step(one_step)
    finally:
        stop.set()
        t.join(5)
    # each time the loop lets the turn go a step that waits has it: about 310 steps of 1 ms in
    # 0.5 s beside bursts of 0.5 ms, one each (one step every 5 ms, the GIL's own switch
    # interval, if the loop kept the GIL between its bursts)
    assert steps[0] >= 150, steps[0]


def _step_waiting_for_the_loop() -> tuple[Turns, threading.Event, threading.Thread]:
    """Turns the loop holds, and a step on a thread of its own that waits for them (``ran``
    set once it has run)."""
    turns = Turns()
    turns.loop_acquire()
    ran = threading.Event()
    t = threading.Thread(target=turns.step, args=(ran.set,))
    t.start()
    assert not ran.wait(0.3)  # the loop holds the turn: the step waits
    return turns, ran, t


def test_close_lets_a_waiting_step_run() -> None:
    turns, ran, t = _step_waiting_for_the_loop()
    turns.close()
    assert ran.wait(5)
    t.join(5)
    turns.loop_release()


def test_the_loop_holds_the_turn_while_it_runs_and_lets_it_go_while_it_waits() -> None:
    turns = Turns()
    stepping = [False]
    steps = [0]
    stop = threading.Event()

    def scheduler() -> None:  # steps back to back, as a busy scheduler does
        while not stop.is_set():
            turns.step(one_step)

    def one_step() -> None:
        stepping[0] = True
        _busy(0.001)
        steps[0] += 1
        stepping[0] = False

    async def loop_side() -> tuple[int, int, int]:
        seen_stepping = 0
        callbacks = 0
        for _ in range(200):  # callbacks one after another, each a poll of its selector
            await asyncio.sleep(0)
            seen_stepping += stepping[0]
            callbacks += 1
        before = steps[0]
        await asyncio.sleep(0.2)  # waiting on its selector: the steps go on
        return seen_stepping, callbacks, steps[0] - before

    loop = turn_taking_loop(turns)
    t = threading.Thread(target=scheduler)
    t.start()
    try:
        seen_stepping, callbacks, stepped_while_waiting = loop.run_until_complete(
            asyncio.wait_for(loop_side(), 20)
        )
    finally:
        stop.set()
        turns.close()
        t.join(10)
        loop.close()
    assert seen_stepping == 0  # never a step while the loop's Python ran
    assert callbacks == 200  # and the loop was not starved by back-to-back steps
    assert stepped_while_waiting >= 20


def test_suspended_turns_let_a_step_run_beside_the_loop() -> None:
    turns, ran, t = _step_waiting_for_the_loop()
    with turns.suspended():
        assert ran.wait(5)  # a step waiting for the turn goes once they are lifted
        t.join(5)
        turns.loop_release()
        turns.loop_acquire()  # the loop takes nothing while they are lifted
        assert turns.step(lambda: 7) == 7
        turns.loop_release()
    turns.loop_acquire()  # back in force
    t = threading.Thread(target=turns.step, args=(ran.clear,))
    t.start()
    time.sleep(0.3)
    assert ran.is_set()  # the step waits again
    turns.loop_release()
    t.join(5)
    assert not ran.is_set()


@pytest.mark.parametrize(("flags", "on"), [([], False), (["--event-loop-turns"], True)])
def test_event_loop_turns_flag(flags: list[str], on: bool) -> None:
    args = _parser().parse_args(["--model", "x", *flags])
    assert (event_loop_turns(args) is not None) is on


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_engine_that_takes_turns_serves_plain_and_streamed_requests_at_once(
    tmp_path: Path,
) -> None:
    model_dir = make_tiny_model(tmp_path / "model", vocab=128, seed=3)
    with serving(model_dir, tmp_path / "engine.log", "--event-loop-turns") as engine:
        body = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        plain = engine.generate(body)["output_ids"]

        def streamed() -> list[int]:
            req = urllib.request.Request(
                engine.url + "/generate",
                data=json.dumps({**body, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                events = resp.read().decode().split("\n\n")
            chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
            assert events[-2] == "data: [DONE]"
            return chunks[-1]["output_ids"]

        with ThreadPoolExecutor(8) as pool:  # the loop and the steps busy together
            outs = list(
                pool.map(
                    lambda i: streamed() if i % 2 else engine.generate(body)["output_ids"],
                    range(16),
                )
            )
        assert outs == [plain] * 16
        assert engine.request("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
        assert engine.request("POST", "/continue_generation", {})[0] == 200
        # an update session lifts the turns until it ends (once, however often it is ended)
        assert engine.request("POST", "/begin_weight_update", {})[0] == 200
        assert engine.generate(body)["output_ids"] == plain
        assert engine.request("POST", "/end_weight_update", {})[0] == 200
        assert engine.request("POST", "/end_weight_update", {})[1]["success"] is False
        assert engine.generate(body)["output_ids"] == plain
    # serving() asserts the engine stopped cleanly; it said it took turns when it started
    started = [
        json.loads(line)
        for line in (tmp_path / "engine.log").read_text().splitlines()
        if '"engine_started"' in line
    ]
    assert started and started[0]["event_loop_turns"] is True
