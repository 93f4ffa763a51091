"""SGLang's priority scheduling on the built-in engine (``stages.engine.priority``), as SGLang
0.5.23's scheduler applies it: the waiting queue served by priority then arrival
(``SchedulePolicy._sort_by_priority_and_fcfs``), running rows preempted for a request whose
priority is higher by more than the threshold (``PrefillAdder.preempt_to_schedule``: the
lowest first, back in the queue with what they generated, ``num_retractions`` counted), a
full queue dropping its least preferred request for a preferred one, and priorities refused
with ``--abort-on-priority-when-disabled`` (``Scheduler._abort_on_queued_limit``,
``_set_or_validate_priority``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.aborts import PRIORITY_DISABLED, PRIORITY_EVICTED, QUEUE_FULL
from stages.engine.priority import Priorities
from stages.engine.priority import from_flags as priority_flags
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.server import parse_args
from tests.stages.test_engine_llama_forward import CONFIGS, _model
from tests.stages.test_engine_server import serving
from tests.stages.tiny_model import make_byte_model, make_tiny_model

ON = Priorities(enabled=True)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _finish_order(scheduler: Scheduler, futures: dict[str, Any]) -> list[str]:
    order: list[str] = []
    for _ in range(500):
        busy = scheduler.step()
        order += [rid for rid, f in futures.items() if f.done() and rid not in order]
        if not busy:
            return order
    raise AssertionError("still busy")


@pytest.mark.timeout(60)
@torch.inference_mode()
@pytest.mark.parametrize("low_first", [False, True], ids=["high-first", "low-first"])
def test_the_queue_is_served_by_priority_then_arrival(low_first: bool) -> None:
    """One row: behind the running one, the waiting requests run by priority (high values
    first, or low ones with --schedule-low-priority-values-first), equals by arrival, and
    one without a priority last; with preemption off, the running one is never preempted."""
    priorities = Priorities(enabled=True, low_first=low_first, preempt=False)
    scheduler = Scheduler(_model(CONFIGS["llama"]()), max_running=1, priorities=priorities)
    futures = {"run": scheduler.submit(GenerateInput("run", [5, 6], _params(3), False, priority=0))}
    scheduler.step()
    for rid, priority in (("none", None), ("p1", 1), ("p50", 50), ("p1-later", 1)):
        inp = GenerateInput(rid, [5, 7], _params(2), False, priority=priority)
        futures[rid] = scheduler.submit(inp)
    order = _finish_order(scheduler, futures)
    expected = ["p1", "p1-later", "p50"] if low_first else ["p50", "p1", "p1-later"]
    assert order == ["run", *expected, "none"]
    assert scheduler.preempted == 0
    assert all(f.result().retractions == 0 for f in futures.values())


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_a_preferred_request_preempts_the_lowest_running_row_which_then_goes_on() -> None:
    """Two rows run priorities 0 and 5. A request of 12 is higher than 0 by more than the
    threshold (10) and takes its row; one of 14 then finds only 5 and 12 running (lower by 9
    and 2): it waits. The preempted row comes back with what it generated (none of its tokens
    made again): its tokens and log-probs are those it makes alone."""
    model = _model(CONFIGS["llama"]())
    prompt = [5, 6, 7, 8]
    alone = Scheduler(model, max_running=4)
    ref = alone.submit(GenerateInput("ref", prompt, _params(12), True))
    alone.run_until_idle()
    reference = ref.result()

    scheduler = Scheduler(model, max_running=2, priorities=ON)
    futures = {
        "low": scheduler.submit(GenerateInput("low", prompt, _params(12), True, priority=0)),
        "mid": scheduler.submit(GenerateInput("mid", [9, 10], _params(12), True, priority=5)),
    }
    for _ in range(4):
        scheduler.step()
    futures["high"] = scheduler.submit(GenerateInput("high", [11], _params(6), True, priority=12))
    scheduler.step()
    futures["near"] = scheduler.submit(GenerateInput("near", [12], _params(3), True, priority=14))
    scheduler.step()  # it waits beside the preempted row
    assert scheduler.counts() == {"num_running_reqs": 2, "num_waiting_reqs": 2}
    order = _finish_order(scheduler, futures)
    assert order.index("high") < order.index("mid") < order.index("low")
    assert scheduler.preempted == 1
    low = futures["low"].result()
    assert low.retractions == 1 and futures["mid"].result().retractions == 0
    assert low.output_ids == reference.output_ids
    assert scheduler.tokens_generated == 12 + 12 + 6 + 3  # none of them made twice
    assert low.output_token_logprobs == pytest.approx(reference.output_token_logprobs, abs=1e-5)


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_a_full_queue_drops_its_least_preferred_request_for_a_preferred_one() -> None:
    """One row running, one request waiting (--max-queued-requests 1): a new request of a
    higher priority takes its place (the dropped one ends with SGLang's 503 reason), one of
    the same priority is refused as the queue is full."""
    scheduler = Scheduler(
        _model(CONFIGS["llama"]()), max_running=1, max_queued=1,
        priorities=Priorities(enabled=True, preempt=False),
    )  # fmt: skip
    running = scheduler.submit(GenerateInput("a", [5, 6], _params(4), False, priority=0))
    scheduler.step()
    dropped = scheduler.submit(GenerateInput("b", [5, 7], _params(4), False, priority=1))
    preferred = scheduler.submit(GenerateInput("c", [5, 8], _params(4), False, priority=5))
    refused = scheduler.submit(GenerateInput("d", [5, 9], _params(4), False, priority=5))
    scheduler.run_until_idle()
    assert [len(f.result().output_ids) for f in (running, preferred)] == [4, 4]
    assert dropped.result().finish_reason == PRIORITY_EVICTED
    assert refused.result().finish_reason == QUEUE_FULL
    assert (scheduler.priority_aborted, scheduler.queue_full) == (1, 1)


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_without_priority_scheduling_priorities_are_ignored_or_refused() -> None:
    """Off, a priority changes nothing (arrival order); with --abort-on-priority-when-disabled
    a request naming one ends with SGLang's 503 reason, and one naming none is served."""
    model = _model(CONFIGS["llama"]())
    scheduler = Scheduler(model, max_running=1)
    futures = {"a": scheduler.submit(GenerateInput("a", [5], _params(2), False, priority=0))}
    scheduler.step()
    futures["b"] = scheduler.submit(GenerateInput("b", [6], _params(2), False, priority=1))
    futures["c"] = scheduler.submit(GenerateInput("c", [7], _params(2), False, priority=99))
    assert _finish_order(scheduler, futures) == ["a", "b", "c"]

    refusing = Scheduler(model, max_running=1, priorities=Priorities(abort_when_disabled=True))
    named = refusing.submit(GenerateInput("n", [5], _params(2), False, priority=3))
    plain = refusing.submit(GenerateInput("p", [5], _params(2), False))
    refusing.run_until_idle()
    assert named.result().finish_reason == PRIORITY_DISABLED and named.result().output_ids == []
    assert len(plain.result().output_ids) == 2


def _generate(url: str, body: dict[str, Any], out: dict[str, Any], key: str) -> threading.Thread:
    """POST ``body`` on a thread: (status, the answer or a stream's last chunk, when it
    ended) lands in ``out[key]``."""

    def post() -> None:
        answer = requests.post(url + "/generate", json=body, timeout=60)
        if body.get("stream"):
            events = [e[6:] for e in answer.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            out[key] = (answer.status_code, json.loads(events[-2]), time.monotonic())
        else:
            out[key] = (answer.status_code, answer.json(), time.monotonic())

    thread = threading.Thread(target=post)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def one_row(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of one row with priority scheduling (a byte-level model: grammars apply)."""
    root = tmp_path_factory.mktemp("one-row")
    model = make_byte_model(root / "model")
    flags = ("--max-running", "1", "--enable-priority-scheduling", "--default-priority-value", "0")
    with serving(model, root / "engine.log", *flags) as eng:
        yield eng.url


@pytest.mark.timeout(120)
def test_a_server_preempts_for_a_preferred_request_and_answers_as_sglang(one_row: str) -> None:
    """Over HTTP, with one row: a long streamed request of priority 0 runs (steps slowed), one
    of 50 preempts it and ends first, and the long one's stream ends later with
    ``num_retractions`` 1 and the tokens it makes alone; ``/server_info`` reports the settings
    and the preemption."""
    greedy = {"temperature": 0, "ignore_eos": True}
    long = {"input_ids": [5, 6, 7], "sampling_params": {**greedy, "max_new_tokens": 40}}
    url = one_row
    preempted = _state(url)["num_priority_preempted"]
    reference = requests.post(url + "/generate", json=long, timeout=60).json()
    info = requests.get(url + "/server_info", timeout=10).json()
    assert info["enable_priority_scheduling"] is True
    assert info["priority_scheduling_preemption_threshold"] == 10
    assert info["default_priority_value"] == 0
    assert requests.post(url + "/slow_down", json={"forward_sleep_time": 0.02}).ok
    out: dict[str, Any] = {}
    threads = [_generate(url, {**long, "stream": True}, out, "long")]  # priority 0: default
    _until_running(url)
    short = {
        "input_ids": [9],
        "priority": 50,
        "sampling_params": {**greedy, "max_new_tokens": 2},
    }
    threads.append(_generate(url, short, out, "short"))
    for thread in threads:
        thread.join(60)
    requests.post(url + "/slow_down", json={"forward_sleep_time": None})
    (status, answer, ended), (short_status, _, short_ended) = out["long"], out["short"]
    assert status == short_status == 200 and short_ended < ended
    assert answer["meta_info"]["num_retractions"] == 1
    assert answer["output_ids"] == reference["output_ids"]
    assert _state(url)["num_priority_preempted"] == preempted + 1


@pytest.mark.timeout(120)
def test_a_server_refusing_priorities_answers_sglangs_503(tmp_path: Path) -> None:
    """``--abort-on-priority-when-disabled``: a ``/generate`` naming a priority gets FastAPI's
    503 error body with SGLang's words; the engine serves on."""
    model = make_tiny_model(tmp_path / "model", vocab=128, seed=1)
    params = {"max_new_tokens": 2, "temperature": 0}
    with serving(model, tmp_path / "engine.log", "--abort-on-priority-when-disabled") as eng:
        body = {"input_ids": [5, 6], "priority": 1, "sampling_params": params}
        refused = requests.post(eng.url + "/generate", json=body, timeout=30)
        assert refused.status_code == 503
        assert json.loads(refused.text) == {
            "object": "error", "message": PRIORITY_DISABLED["message"], "type": "503",
            "param": None, "code": 503,
        }  # fmt: skip
        del body["priority"]
        assert requests.post(eng.url + "/generate", json=body, timeout=30).status_code == 200
        state = requests.get(eng.url + "/server_info", timeout=10).json()["internal_states"][0]
        assert state["num_priority_aborted"] == 1


@pytest.mark.timeout(60)
def test_priority_flags_sglang_refuses_are_refused_at_start() -> None:
    """SGLang's validation: priority scheduling orders by ``fcfs`` or ``lof`` only, and the
    priority retraction policy needs it (the engine's start then stops, as any setting
    ``build_scheduler`` refuses)."""
    given = ["--model", "m", "--enable-priority-scheduling", "--schedule-policy", "lpm"]
    with pytest.raises(ValueError, match=r"must be 'fcfs' or 'lof'\. 'lpm' is not supported\."):
        priority_flags(parse_args(given))
    given = ["--model", "m", "--retraction-policy", "priority"]
    with pytest.raises(ValueError, match="--retraction-policy priority requires"):
        priority_flags(parse_args(given))
    assert priority_flags(parse_args([*given, "--enable-priority-scheduling"])).enabled


@pytest.mark.timeout(120)
def test_a_preempted_request_keeps_its_grammar_penalties_stop_strings_and_top_logprobs(
    one_row: str,
) -> None:
    """A streamed request with a regex, a frequency penalty, a stop string its late tokens
    make and top log-probs, preempted a few tokens in, ends as it does alone: the same text,
    ids, reason and log-probs (each watched again after its re-prefill)."""
    params = {
        "temperature": 0, "max_new_tokens": 40, "frequency_penalty": 0.5,
        "regex": "[a-f]{8}x[0-9]{6}y[a-z]{10}", "stop": ["np"],
    }  # fmt: skip
    long = {"text": "abc", "return_logprob": True, "top_logprobs_num": 3, "sampling_params": params}
    url = one_row
    reference = requests.post(url + "/generate", json=long, timeout=60).json()
    assert reference["meta_info"]["finish_reason"] == {"type": "stop", "matched": "np"}
    assert len(reference["output_ids"]) > 12, reference["text"]
    assert requests.post(url + "/slow_down", json={"forward_sleep_time": 0.05}).ok
    out: dict[str, Any] = {}
    threads = [_generate(url, {**long, "stream": True}, out, "long")]
    _until_running(url)
    time.sleep(0.3)  # a few of its tokens made
    short = {"text": "ab", "priority": 50, "sampling_params": {"max_new_tokens": 2}}
    threads.append(_generate(url, short, out, "short"))
    for thread in threads:
        thread.join(60)
    requests.post(url + "/slow_down", json={"forward_sleep_time": None})
    (_, last, _), (short_status, _, _) = out["long"], out["short"]
    assert short_status == 200 and last["meta_info"]["num_retractions"] == 1
    for key in ("text", "output_ids"):
        assert last[key] == reference[key], key
    meta, want = last["meta_info"], reference["meta_info"]
    assert meta["finish_reason"] == want["finish_reason"]
    got_lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    want_lps = [lp for lp, _, _ in want["output_token_logprobs"]]
    assert got_lps == pytest.approx(want_lps, abs=1e-5)
    tops = [[tok for _, tok, _ in step] for step in meta["output_top_logprobs"]]
    assert tops == [[tok for _, tok, _ in step] for step in want["output_top_logprobs"]]


def _state(url: str) -> dict[str, Any]:
    return requests.get(url + "/server_info", timeout=10).json()["internal_states"][0]


def _until_running(url: str) -> None:
    deadline = time.monotonic() + 20
    while _state(url)["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
