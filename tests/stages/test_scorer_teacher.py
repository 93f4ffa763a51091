"""The teacher of on-policy distillation (``stages.scorer.teacher: {url: ...}``) on a built-in
engine started as a user starts it: the scorer puts in each sample the teacher's log-probs of its
completion tokens, equal to what a direct prefill-only ``/generate`` call answers (a trajectory's
inserted tokens and own context included); a teacher whose tokenizer is not the student's is
refused at set-up, by its vocabulary and by the texts the engine gives token ids; and a teacher that
times out or answers garbage leaves its samples without values, counted by kind, each kind
logged once."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from stages.feeder.arithmetic import make_tokenizer
from stages.scorer.spec import RewardSpec
from stages.scorer.stage import Scorer, ScorerConfig, _Group, _load_tokenizer
from stages.scorer.teacher import Teacher, TeacherSpec
from tests.stages.engine_setup import builtin_engine
from tests.stages.test_scorer_reward_server import reward_server
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab=64, seed=3)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[str]:
    with builtin_engine(model) as url:
        yield url


def _direct(url: str, context: list[int], completion: list[int]) -> list[float]:
    """The teacher's log-probs of ``completion`` after ``context``: one prefill-only call."""
    body = {
        "input_ids": context + completion,
        "return_logprob": True,
        "logprob_start_len": len(context) - 1,
        "sampling_params": {"max_new_tokens": 0},
    }
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        entries = json.loads(response.read())["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [e[1] for e in entries[1:]] == completion
    return [e[0] for e in entries[1:]]


class _Out:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        self.sent.append((kind, data))


class _Ctx:
    def __init__(self, run_dir: Path) -> None:
        self.log = structlog.get_logger()
        self.stage, self.replica, self.run_dir = "scorer", 0, run_dir
        self.inputs: dict[str, Any] = {"rollouts": None}
        self.outputs = {"groups": _Out()}


def _rollout(index: int, completion: list[int], **extra: Any) -> dict[str, Any]:
    n = len(completion)
    return {
        "run_id": "r", "prompt_id": "p", "group_id": "g", "group_size": 2, "uid": "f.0:g",
        "prompt_ids": np.array(PROMPT, dtype=np.int32), "meta": {"answer": "w9"},
        "sample_index": index, "completion_ids": np.array(completion, dtype=np.int32),
        "sampler_logprobs": np.full(n, -1.0, dtype=np.float32),
        "versions": np.zeros(n, dtype=np.int32), "finish_reason": "stop", "engine": "e",
        "timings": {}, **extra,
    }  # fmt: skip


@pytest.mark.timeout(60)
async def test_the_scorer_attaches_the_teachers_logprobs_of_each_completion(
    engine, model, tmp_path
):
    config = ScorerConfig(
        rewards=[RewardSpec(fn="exact_match")],
        tokenizer=str(model),
        workers=0,
        teacher=TeacherSpec(url=engine),
    )
    scorer = Scorer(config, _Ctx(tmp_path))
    with capture_logs() as logs:
        await scorer.setup()  # the tokenizer check passes: the student's is the teacher's
    try:
        plain = _rollout(0, [9, 40, 41])
        # a trajectory: its own context, a tool's two tokens between sampled ones
        tool = _rollout(1, [12, 50, 51, 13, 1], prompt_ids=np.array([6, 7], dtype=np.int32),
                        loss_mask=np.array([1, 0, 0, 1, 1], dtype=np.uint8))  # fmt: skip
        head = {k: v for k, v in plain.items() if k != "sample_index"}
        await scorer._score([_Group(head, time.monotonic(), {0: plain, 1: tool})])
    finally:
        await scorer.close()
    [(kind, group)] = scorer.ctx.outputs["groups"].sent
    assert kind == "scored_group" and [s["sample_index"] for s in group["samples"]] == [0, 1]
    for sample, context in zip(group["samples"], (PROMPT, [6, 7]), strict=True):
        got = sample["teacher_logprobs"]
        want = _direct(engine, context, sample["completion_ids"].tolist())
        assert got.dtype == np.float32 and got.shape == (len(want),)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        assert "reward" in sample and "reward_info" in sample
    stats = scorer.teacher.stats()
    assert stats["teacher_samples"] == 2 and stats["teacher_calls"] == 2  # the probe, one call
    assert [e["probe_tokens"] for e in logs if e["event"] == "teacher_ready"] != []


@pytest.mark.timeout(60)
async def test_a_teacher_with_another_tokenizer_is_refused_before_scoring(
    engine, tmp_path, monkeypatch
):
    student = make_tokenizer()  # the arithmetic task's characters: other tokens, other ids
    spec = TeacherSpec(url=engine, check_tokenizer=False)
    teacher = Teacher(spec, structlog.get_logger(), api_key=None, name="s.0", log_dir=tmp_path)
    await teacher.start(student, _load_tokenizer)
    try:
        # the folder its /model_info names is on this machine: the vocabularies are compared
        # (only <pad> and <eos> have the student's ids)
        with pytest.raises(ValueError, match=r"tokenizer gives 14 of the student's 16 tokens"):
            await teacher._check_engine(student, _load_tokenizer)

        async def elsewhere() -> None:  # a teacher on another machine: the texts the engine
            return None  # gives the probed ids tell

        monkeypatch.setattr(teacher, "_tokenizer_path", elsewhere)
        with pytest.raises(ValueError, match=r"14 of 16 token ids probed are other text"):
            await teacher._check_engine(student, _load_tokenizer)
    finally:
        await teacher.aclose()


def _entries(ids: list[int], start: int) -> list[list[Any]]:
    return [[None, ids[start], None], *([-0.5, t, None] for t in ids[start + 1 :])]


def _garbage(body: Any, seq: int) -> tuple[int, Any, float]:
    """Call 1: not a list; call 2: the wrong tokens for sample 0, NaN for sample 1, right for
    sample 2; later calls (3, 4: one retried): slower than the time limit."""
    if seq == 1:
        return 200, {"text": "hello"}, 0.0
    if seq == 2:
        results = [
            {"meta_info": {"input_token_logprobs": _entries(ids, start)}}
            for ids, start in zip(body["input_ids"], body["logprob_start_len"], strict=True)
        ]
        results[0]["meta_info"]["input_token_logprobs"][1][1] = 63
        results[1]["meta_info"]["input_token_logprobs"][1][0] = math.nan
        return 200, results, 0.0
    return 200, [], 1.0


@pytest.mark.timeout(30)
async def test_a_teacher_that_answers_garbage_or_times_out_fails_its_samples_counted():
    samples = [_rollout(i, [9, 40 + i]) for i in range(3)]
    spec = TeacherSpec(url="http://127.0.0.1:1", timeout_s=0.3, retries=1, backoff_s=0.0,
                       check_tokenizer=False)  # fmt: skip
    with reward_server(_garbage) as server, capture_logs() as logs:
        spec.url = server.url
        teacher = Teacher(spec, structlog.get_logger(), api_key=None, name="s.0", log_dir=Path())
        await teacher.start(None, _load_tokenizer)
        try:
            out = [await teacher.logprobs(samples, {"group_id": f"g{k}"}) for k in range(3)]
        finally:
            await teacher.aclose()
    assert out[0] == [None] * 3 and out[2] == [None] * 3
    assert out[1][:2] == [None, None]
    np.testing.assert_array_equal(out[1][2], np.array([-0.5, -0.5], dtype=np.float32))
    stats = teacher.stats()
    assert stats["teacher_failed_bad_response"] == 3 + 1 and stats["teacher_failed_bad_value"] == 1
    assert stats["teacher_failed_timeout"] == 3 and stats["teacher_timeouts"] == 1
    assert stats["teacher_samples"] == 1 and stats["teacher_retries"] == 1
    failed = [(e["kind"], e["group_id"]) for e in logs if e["event"] == "teacher_failed"]
    assert failed == [("bad_response", "g0"), ("bad_value", "g1"), ("timeout", "g2")]
