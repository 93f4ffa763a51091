"""Rewards from a reward server (``rewards: [{url: ...}]``) against a real HTTP server on a
loopback port: the request body (native and OpenRLHF's fields), batches, slime's protocol,
time-outs, retries, garbage answers, the bound on calls in flight, config errors with their
lines, and a run of the real scorer stage."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from structlog.testing import capture_logs

from stages.scorer.runner import RewardRunner
from stages.scorer.spec import RewardSpec
from tests.pipeline.runs import events
from tests.stages_for_tests import run_scorer

EM = "stages.scorer.rewards:exact_match"

# (request body, number of the request) -> (HTTP status, answer: JSON-able or bytes, delay in s)
Answer = Callable[[Any, int], tuple[int, Any, float]]


class _RewardServer:
    """A reward server on 127.0.0.1: ``answer`` says what each request gets; it records the
    bodies and the most requests it had at once."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.bodies: list[Any] = []
        self.paths: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.bodies.append(body)
                    server.paths.append(self.path)
                    seq = len(server.bodies)
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    status, out, delay = server.answer(body, seq)
                    time.sleep(delay)
                finally:
                    # done before the answer goes out: once the client has it, it may send the
                    # next call before this thread runs again
                    with server._lock:
                        server.in_flight -= 1
                data = out if isinstance(out, bytes) else json.dumps(out).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timed out)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"


@contextmanager
def reward_server(answer: Answer) -> Iterator[_RewardServer]:
    server = _RewardServer(answer)
    thread = threading.Thread(target=server.httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(5)


def lengths(body: Any, seq: int) -> tuple[int, Any, float]:
    """Each completion's length, as OpenRLHF's servers answer."""
    return 200, {"rewards": [len(c) for c in body["completions"]]}, 0.0


def _kwargs(*completions: str) -> dict[str, list]:
    n = len(completions)
    return {
        "prompts": [f"p{i} " for i in range(n)],
        "completions": list(completions),
        "completion_ids": [[i, 1] for i in range(n)],
        "finish_reason": ["stop"] * n,
        "answer": ["7", None, *["7"] * (n - 2)][:n],
    }


def _url(server: _RewardServer, **options: Any) -> RewardSpec:
    return RewardSpec(url=server.url, backoff_s=0.0, **options)


# ---------------------------------------------------------------------------------- protocol
@pytest.mark.timeout(20)
async def test_batches_carry_the_reward_arguments_and_openrlhf_fields():
    with reward_server(lengths) as server:
        specs = [_url(server, batch_size=2, weight=0.5), RewardSpec(EM)]
        async with RewardRunner(specs, workers=0) as runner:
            scored = await runner.score(_kwargs("7", "88", "999", "7", "x"))
            assert runner.stats()["workers_idle"] == 1  # exact_match runs inline
    name = server.url.removeprefix("http://")
    assert [r for r, _ in scored] == [1.5, 1.0, 1.5, 1.5, 0.5]
    assert scored[1][1] == {name: 2.0, EM: 0.0}
    assert sorted(len(b["completions"]) for b in server.bodies) == [1, 2, 2]  # batch_size
    (first,) = [b for b in server.bodies if b["prompts"][0] == "p0 "]
    assert first["prompts"] == ["p0 ", "p1 "] and first["completions"] == ["7", "88"]
    assert first["completion_ids"] == [[0, 1], [1, 1]] and first["finish_reason"] == ["stop"] * 2
    assert first["answer"] == ["7", None]
    # OpenRLHF's remote reward model: query = prompt + response, labels
    assert first["query"] == ["p0 7", "p1 88"] and first["labels"] == ["7", ""]


@pytest.mark.parametrize(
    "answer",
    [{"rewards": [1.0, None]}, {"scores": [1, None]}, [1.0, None]],
    ids=["rewards", "scores", "bare_list"],
)
@pytest.mark.timeout(20)
async def test_the_answer_may_be_rewards_scores_or_a_list(answer):
    with reward_server(lambda body, seq: (200, answer, 0.0)) as server:
        async with RewardRunner([_url(server, name="rm")]) as runner:
            scored = await runner.score(_kwargs("a", "b"))
            assert runner.stats()["errors"] == 0 and not runner._all  # no worker process
    assert scored == [(1.0, {"rm": 1.0}), (0.0, {"rm": None})]  # null: nothing, not a failure


@pytest.mark.timeout(20)
async def test_slime_protocol_sends_one_sample_a_request():
    def slime(body, seq):
        return 200, float(body["response"] == body["label"]), 0.0

    with reward_server(slime) as server:
        async with RewardRunner([_url(server, name="rm", protocol="slime")]) as runner:
            scored = await runner.score(_kwargs("7", "7", "8"))
    assert [r for r, _ in scored] == [1.0, 0.0, 0.0]
    assert sorted(server.bodies, key=lambda b: b["prompt"]) == [
        {"prompt": "p0 ", "response": "7", "label": "7"},
        {"prompt": "p1 ", "response": "7", "label": None},
        {"prompt": "p2 ", "response": "8", "label": "7"},
    ]


# ---------------------------------------------------------------------------------- failures
@pytest.mark.timeout(20)
async def test_a_server_slower_than_timeout_s_fails_its_samples_once_logged():
    with reward_server(lambda body, seq: (200, {"rewards": [1.0]}, 1.0)) as server:
        spec = _url(server, name="rm", timeout_s=0.15, retries=1)
        with capture_logs() as logs:
            async with RewardRunner([spec, RewardSpec(EM)], workers=0) as runner:
                started = time.monotonic()
                scored = await runner.score(_kwargs("7"), group_id="g1")
                took = time.monotonic() - started
                await runner.score(_kwargs("7"), group_id="g2")
                stats = runner.stats()
    assert took < 0.9  # two tries of 0.15 s, not the server's 1 s
    assert scored == [
        (0.0, {"rm": None, EM: 1.0, "error": "rm: timeout: no answer within 0.15 s (2 tries)"})
    ]
    assert stats["timeouts"] == 2 and stats["errors"] == 0 and stats["http_retries"] == 2
    assert stats["failed_timeout"] == 2 and len(server.bodies) == 4
    (failed,) = [e for e in logs if e["event"] == "reward_failed"]  # the first one only
    assert failed["fn"] == "rm" and failed["kind"] == "timeout" and failed["group_id"] == "g1"


@pytest.mark.timeout(20)
async def test_5xx_and_429_are_retried_a_4xx_is_not():
    def flaky(body, seq):
        return {1: (503, b"busy", 0.0), 2: (429, b"slow down", 0.0)}.get(seq) or lengths(body, seq)

    with reward_server(flaky) as server:
        async with RewardRunner([_url(server, name="rm")]) as runner:
            scored = await runner.score(_kwargs("abc"))
            stats = runner.stats()
    assert scored == [(3.0, {"rm": 3.0})] and len(server.bodies) == 3
    assert stats["http_retries"] == 2 and stats["errors"] == 0
    assert not any(k.startswith("failed_") for k in stats)

    with reward_server(lambda body, seq: (400, {"detail": "bad field"}, 0.0)) as server:
        async with RewardRunner([_url(server, name="rm")]) as runner:
            scored = await runner.score(_kwargs("abc"))
            stats = runner.stats()
    assert len(server.bodies) == 1 and stats["http_retries"] == 0
    assert (
        scored[0][0] == 0.0
        and 'http_error: HTTP 400: {"detail": "bad field"}' in (scored[0][1]["error"])
    )
    assert stats["failed_http_error"] == 1 and stats["errors"] == 1


@pytest.mark.timeout(20)
async def test_garbage_answers_fail_their_samples_by_kind():
    answers = {
        1: (200, b"<html>oops</html>", 0.0),  # not JSON
        2: (200, {"rewards": [1.0]}, 0.0),  # one value for two samples
        3: (200, {"reward": [1.0, 1.0]}, 0.0),  # no rewards
        4: (200, b'{"rewards": [NaN, "high"]}', 0.0),  # values that are not finite numbers
        5: (200, b'{"rewards": [NaN, 2]}', 0.0),  # again: counted, not logged again
    }
    with reward_server(lambda body, seq: answers[seq]) as server:
        with capture_logs() as logs:
            async with RewardRunner([_url(server, name="rm")]) as runner:
                outcomes = [await runner.score(_kwargs("a", "b")) for _ in answers]
                stats = runner.stats()
    errors = [[info.get("error", "") for _, info in scored] for scored in outcomes]
    assert all(e.startswith("rm: bad_response: not JSON: <html>") for e in errors[0])
    assert all("returned 1 values for 2 completions" in e for e in errors[1])
    assert all("no 'rewards' in the answer (keys: ['reward'])" in e for e in errors[2])
    assert errors[3] == [
        "rm: bad_value: value 0 is nan",
        "rm: bad_value: value 1 is not a number: str",
    ]
    assert outcomes[4][1] == (2.0, {"rm": 2.0})  # the good value of a bad answer counts
    assert all(r == 0.0 for scored in outcomes[:4] for r, _ in scored)
    assert stats["errors"] == 5 and stats["failed_bad_response"] == 6
    assert stats["failed_bad_value"] == 3
    failed = [(e["kind"], e["completions"]) for e in logs if e["event"] == "reward_failed"]
    assert failed == [("bad_response", 2), ("bad_value", 2)]  # the first of each kind


@pytest.mark.timeout(20)
async def test_concurrency_bounds_calls_in_flight_across_scoring_calls():
    with reward_server(lambda body, seq: (*lengths(body, seq)[:2], 0.15)) as server:
        spec = _url(server, name="rm", concurrency=2, batch_size=1)
        async with RewardRunner([spec], workers=2) as runner:
            both = await asyncio.gather(
                runner.score(_kwargs("a", "bb", "ccc")), runner.score(_kwargs("dddd", "e", "f"))
            )
    assert [[r for r, _ in scored] for scored in both] == [[1, 2, 3], [4, 1, 1]]
    assert len(server.bodies) == 6 and server.most_in_flight == 2


# ---------------------------------------------------------------------------------- config
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from stages.feeder.arithmetic import make_tokenizer

    path = tmp_path_factory.mktemp("tok") / "arith"
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.timeout(30)
def test_bad_entries_are_config_errors_at_their_lines(tmp_path, tokenizer_dir):
    from pipeline.config import ConfigError, load_pipeline
    from pipeline.registry import resolve

    rewards = [
        {"fn": EM, "url": "http://127.0.0.1:1/score"},  # both
        {"url": "ftp://host/score"},
        {"url": "http://127.0.0.1:1/score", "timeout_s": -1},
        {"fn": EM, "retries": 5},  # an HTTP option on a function
        {"url": "http://h:1/s", "protocol": "slime", "batch_size": 4},
        {"judge": {"url": "http://h:1", "template": "{prompt}", "parse": "yes|no"}},
        {"judge": {"url": "http://h:1", "template": "{0} {completion}", "parse": "(y)"}},
        {"weight": 2.0},  # none
    ]
    lines = "\n".join(f"      - {json.dumps(r)}" for r in rewards)
    path = tmp_path / "bad.yaml"
    path.write_text(
        f"""stages:
  scorer:
    use: scorer
    tokenizer: "{tokenizer_dir}"
    rewards:
{lines}
"""
    )
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path, resolve=lambda name: resolve("stage", name))
    found = {issue.path: (issue.where, issue.message) for issue in caught.value.issues}
    at = "stages.scorer.rewards"
    expected = {
        f"{at}[0].fn": (6, "or reward_model (this one has fn and url)"),
        f"{at}[1].url": (7, "must be an http:// or https:// URL"),
        f"{at}[2].timeout_s": (8, "must be at least 0.001, got -1"),
        f"{at}[3].retries": (9, "retries applies to url, judge and reward_model rewards only"),
        f"{at}[4].batch_size": (10, "protocol slime sends one sample a request"),
        f"{at}[5].judge.parse": (11, "has 0 groups: it needs exactly one"),
        f"{at}[6].judge.template": (12, "template field {0} is not a name"),
        f"{at}[7]": (13, "(this one has none of them)"),
    }
    for key, (line, words) in expected.items():
        where, message = found[key]
        assert where.startswith(f"{path}:{line}") and words in message, (key, found[key])


# ---------------------------------------------------------------------------------- a run
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_scorer_stage_scores_with_a_reward_server(tmp_path, tokenizer_dir):
    def by_group(body, seq):  # batch_size 2: a call is one group's samples
        if body["group"] == ["broken"] * 2:
            return 500, b"down", 0.0
        pairs = zip(body["completions"], body["answer"], strict=True)
        return 200, {"rewards": [float(c == a) for c, a in pairs]}, 0.0

    rollouts = [
        {"group": g, "index": i, "completion": c, "meta": {"answer": "7", "group": g}}
        for g, completions in (("ok", "78"), ("broken", "77"), ("ok2", "87"))
        for i, c in enumerate(completions)
    ]
    with reward_server(by_group) as server:
        reward = f'{{url: "{server.url}", name: rm, retries: 1, backoff_s: 0.0, batch_size: 2}}'
        run_dir, groups = run_scorer(tmp_path, rollouts, [reward], tokenizer_dir, timeout=50)
    assert [s["reward"] for s in groups["ok"]["samples"]] == [1.0, 0.0]
    assert [s["reward"] for s in groups["ok2"]["samples"]] == [0.0, 1.0]
    broken = groups["broken"]["samples"]
    assert [s["reward"] for s in broken] == [0.0, 0.0]
    assert broken[0]["reward_info"] == {
        "rm": None,
        "error": "rm: http_error: HTTP 500: down (2 tries)",
    }
    (done,) = [e for e in events(run_dir, "scorer.0") if e["event"] == "scorer_done"]
    assert done["samples"] == 6 and done["errors"] == 1 and done["failed_http_error"] == 2
    assert done["http_retries"] == 1 and done["worker_restarts"] == 0
    assert sum(1 for b in server.bodies if b["group"] == ["broken"] * 2) == 2
