"""Built-in reward functions and the runner that calls them in worker processes."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from structlog.testing import capture_logs

from pipeline.registry import PluginError
from stages.scorer.rewards import chain_answer, exact_match, last_boxed, math_verify
from stages.scorer.runner import RewardRunner

HERE = "tests.stages.test_scorer_rewards"
EM = "stages.scorer.rewards:exact_match"  # the entry point `exact_match` once installed


# reward functions the workers find by dotted path (as a user's module would provide them)
def reward_len(completions, **kwargs):
    """Straight from TRL's documentation."""
    return [-abs(20 - len(completion)) for completion in completions]


def answer_seen(completions, answer, prompts, completion_ids, **kwargs):
    return [float(a == "7" and p == "3+4=" and ids == [9]) for a, p, ids in
            zip(answer, prompts, completion_ids, strict=True)]  # fmt: skip


def raising(completions, **kwargs):
    raise ValueError("boom")


def hanging(completions, **kwargs):
    time.sleep(3600)


def clears(completions, **kwargs):
    """Empties the lists it was given (a function that mutates its arguments)."""
    completions.clear()
    return []


def too_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def odd_values(completions, **kwargs):
    return [float("nan"), "1", None, 2][: len(completions)]


def dies(completions, **kwargs):
    os._exit(3)


not_callable = 42


# ------------------------------------------------------------------------------ built-ins
@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("19", "19", 1.0), (" 19\n", 19, 1.0), ("19", " 19 ", 1.0), ("18", "19", 0.0),
     ("", "0", 0.0), ("190", "19", 0.0), ("19", None, 0.0)],
)  # fmt: skip
def test_exact_match(completion, answer, expected):
    assert exact_match([completion], answer=[answer], prompts=["x"]) == [expected]


def test_last_boxed():
    assert last_boxed(r"so \boxed{1} no, \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{3} then \boxed{4") == "3"  # the cut-off one is skipped
    assert last_boxed("42") is None


def test_math_verify():
    completions = [r"Half of one is \boxed{1/2}.", r"\boxed{\frac{1}{2}}", r"\boxed{2}", "0.5",
                   "no idea"]  # fmt: skip
    scores = math_verify(completions, answer=["0.5"] * 5, prompts=[""] * 5)
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert math_verify([r"\boxed{19}", "18"], answer=[19, 19]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "answer", "reason", "expected"),
    [
        ("3+4=7;7-5=2;#2", "2", "stop", 1.0),  # right
        (" 3+4=7;7-5=2;#2\n", 2, None, 1.0),  # whitespace around it, no finish reason
        ("#2", "2", "stop", 1.0),  # steps are not checked, only the final answer
        ("3+4=7;7-5=1;#2", "2", "stop", 1.0),  # a wrong step, a right answer
        ("3+4=7;7-5=2;#3", "2", "stop", 0.0),  # wrong
        ("3+4=7;7-5=2;#22", "2", "stop", 0.0),
        ("3+4=7;7-5=2;#02", "2", "stop", 0.0),  # exactly the answer's digits
        ("3+4=7;7-5=2;2", "2", "stop", 0.0),  # malformed: no '#'
        ("3+4=7;#7;7-5=2;#2", "2", "stop", 0.0),  # malformed: two
        ("3+4=7;7-5=2;#", "2", "stop", 0.0),  # malformed: nothing after it
        ("3+4=7;7-5=2;#2;", "2", "stop", 0.0),  # malformed: something after the answer
        ("3+4=7;7-5=2;#two", "2", "stop", 0.0),
        ("", "2", "stop", 0.0),
        ("3+4=7;7-5=2;#2", "2", "length", 0.0),  # truncated: cut at the token limit
        ("3+4=7;7-5", "2", "length", 0.0),  # truncated mid-step
        ("3+4=7;7-5=2;#2", None, "stop", 0.0),  # no answer to compare with
    ],
)
def test_chain_answer(completion, answer, reason, expected):
    kwargs = {} if reason is None else {"finish_reason": [reason]}
    scores = chain_answer([completion], answer=[answer], prompts=["3+4-5="], **kwargs)
    assert scores == [expected]


async def test_chain_answer_runs_in_the_runner_by_dotted_path():
    fn = "stages.scorer.rewards:chain_answer"
    async with RewardRunner([(fn, 1.0)], workers=1, timeout_s=5) as runner:
        scored = await runner.score(
            _kwargs(
                ["1+1=2;#2", "1+1=2;#3", "1+1=2;#2"],
                answer=["2"] * 3,
                finish_reason=["stop", "stop", "length"],
                completion_ids=[[1], [1], [1]],
            )
        )
    assert [r for r, _ in scored] == [1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------ runner
def _kwargs(completions, **extra):
    n = len(completions)
    return {"completions": completions, "prompts": ["p"] * n, **extra}


@pytest.mark.parametrize("workers", [2, 0], ids=["processes", "in_process"])
async def test_weights_combine_and_info_names_each_function(workers):
    specs = [(EM, 2.0), (f"{HERE}:reward_len", 0.5)]
    async with RewardRunner(specs, workers=workers, timeout_s=5) as runner:
        scored = await runner.score(_kwargs(["19", "18"], answer=["19", "19"]))
        probe = await runner.score(
            _kwargs(["x"], answer=["7"], prompts=["3+4="], completion_ids=[[9]])
        )
    assert scored[0] == (2.0 + 0.5 * -18, {EM: 1.0, f"{HERE}:reward_len": -18.0})
    assert scored[1] == (0.5 * -18, {EM: 0.0, f"{HERE}:reward_len": -18.0})
    assert probe[0][0] == 0.5 * -19
    async with RewardRunner([(f"{HERE}:answer_seen", 1.0)], workers=workers, timeout_s=5) as runner:
        seen = await runner.score(
            _kwargs(["x"], answer=["7"], prompts=["3+4="], completion_ids=[[9]])
        )
    assert seen == [(1.0, {f"{HERE}:answer_seen": 1.0})]


@pytest.mark.parametrize("workers", [1, 0], ids=["processes", "in_process"])
async def test_failures_give_zero_are_counted_and_the_runner_goes_on(workers):
    specs = [(EM, 1.0), (f"{HERE}:raising", 1.0)]
    with capture_logs() as logs:
        async with RewardRunner(specs, workers=workers, timeout_s=5) as runner:
            scored = await runner.score(_kwargs(["1", "2"], answer=["1", "1"]), group_id="g7")
            again = await runner.score(_kwargs(["1"], answer=["1"]), group_id="g8")
            stats = runner.stats()
    assert [r for r, _ in scored] == [0.0, 0.0]
    assert scored[0][1][EM] == 1.0 and scored[0][1][f"{HERE}:raising"] is None
    assert scored[0][1]["error"] == f"{HERE}:raising: ValueError: boom"
    assert again[0][0] == 0.0
    assert stats["errors"] == 2 and stats["timeouts"] == 0 and stats["restarts"] == 0
    failed = [e for e in logs if e["event"] == "reward_failed"]
    assert [e["group_id"] for e in failed] == ["g7", "g8"]
    assert failed[0]["fn"] == f"{HERE}:raising" and "boom" in failed[0]["error"]


async def test_a_hanging_function_times_out_and_its_worker_is_replaced():
    specs = [(f"{HERE}:hanging", 1.0)]
    async with RewardRunner(specs, workers=1, timeout_s=0.5) as runner:
        (first_pid,) = [w.proc.pid for w in runner._all]
        started = time.monotonic()
        scored = await runner.score(_kwargs(["a", "b"]), group_id="g1")
        assert time.monotonic() - started < 3
        assert [r for r, _ in scored] == [0.0, 0.0]
        assert "timed out after 0.5 s" in scored[0][1]["error"]
        # the replacement serves the next call (and times out the same way)
        await runner.score(_kwargs(["c"]))
        stats = runner.stats()
        pids = [w.proc.pid for w in runner._all]
    assert stats["timeouts"] == 2 and stats["restarts"] == 2 and stats["errors"] == 0
    assert first_pid not in pids
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)


async def test_hang_does_not_block_other_functions_or_the_event_loop():
    specs = [(f"{HERE}:hanging", 1.0), (EM, 1.0)]
    async with RewardRunner(specs, workers=2, timeout_s=0.5) as runner:
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        scored = await runner.score(_kwargs(["1"], answer=["1"]))
        ticker.cancel()
    assert ticks >= 5  # the loop kept running while the function hung
    assert scored[0][1][EM] == 1.0 and "timed out" in scored[0][1]["error"]


@pytest.mark.parametrize("workers", [1, 0], ids=["processes", "in_process"])
async def test_bad_return_values_are_errors(workers):
    specs = [(f"{HERE}:too_short", 1.0), (f"{HERE}:odd_values", 1.0)]
    async with RewardRunner(specs, workers=workers, timeout_s=5) as runner:
        short = await runner.score(_kwargs(["a", "b", "c"]))
    assert all(r == 0.0 for r, _ in short)
    assert "returned 2 values for 3 completions" in short[0][1]["error"]
    async with RewardRunner([specs[1]], workers=workers, timeout_s=5) as runner:
        odd = await runner.score(_kwargs(["a", "b", "c", "d"]))
        assert runner.stats()["errors"] == 1
    assert "is nan" in odd[0][1]["error"] and "not a number" in odd[1][1]["error"]
    assert odd[2] == (0.0, {f"{HERE}:odd_values": None})  # None: does not apply (TRL)
    assert odd[3] == (2.0, {f"{HERE}:odd_values": 2.0})


async def test_a_worker_that_dies_is_replaced():
    async with RewardRunner([(f"{HERE}:dies", 1.0)], workers=1, timeout_s=5) as runner:
        scored = await runner.score(_kwargs(["a"]))
        assert "exit code 3" in scored[0][1]["error"]
        await runner.score(_kwargs(["a"]))
        assert runner.stats()["restarts"] == 2


def test_unknown_or_uncallable_names_fail_at_construction():
    with pytest.raises(PluginError, match="no reward named 'exact_mach'"):
        RewardRunner([("exact_mach", 1.0)])
    with pytest.raises(PluginError, match="not callable"):
        RewardRunner([(f"{HERE}:not_callable", 1.0)])
    with pytest.raises(PluginError, match="has no attribute"):
        RewardRunner([(f"{HERE}:missing", 1.0)])


@pytest.mark.parametrize("workers", [1, 0], ids=["processes", "in_process"])
async def test_functions_get_lists_of_their_own(workers):
    specs = [(f"{HERE}:clears", 1.0), (EM, 1.0)]
    async with RewardRunner(specs, workers=workers) as runner:
        assert bool(runner._all) == (workers > 0)  # workers: 0 starts no process
        kwargs = _kwargs(["1", "2"], answer=["1", "1"])
        scored = await runner.score(kwargs)
    assert kwargs["completions"] == ["1", "2"]  # the caller's lists are left alone
    assert [info[EM] for _, info in scored] == [1.0, 0.0]  # and so are the next function's
    assert "returned 0 values for 2 completions" in scored[0][1]["error"]
