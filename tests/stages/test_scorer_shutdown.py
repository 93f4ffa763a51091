"""The scorer's shutdown: closing it while a batch waits for the learner's credit and more are
queued starts no scoring call on its dying workers, so a normal end logs no ``reward_failed``
(a real failure still does: ``test_scorer_rewards.py``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import structlog
from structlog.testing import capture_logs

from stages.scorer.runner import RewardRunner
from stages.scorer.stage import RewardSpec, Scorer, ScorerConfig, _Group

EM = "stages.scorer.rewards:exact_match"


class _NoCredit:
    """An output whose consumer never grants credit: a send waits until it is cancelled."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()

    async def send(self, kind, data):
        self.waiting.set()
        await asyncio.Event().wait()


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["7" for _ in ids]


def _group(name: str) -> _Group:
    head = {"run_id": "r", "prompt_id": name, "group_id": name, "group_size": 2,
            "prompt_ids": [1, 2], "meta": {"text": "3+4=", "answer": "7"}, "uid": None}  # fmt: skip
    group = _Group(head, time.monotonic())
    for i in range(2):
        group.samples[i] = {**head, "sample_index": i, "completion_ids": [9], "versions": [0],
                            "sampler_logprobs": [-0.1], "finish_reason": "stop",
                            "engine": "e", "timings": {}}  # fmt: skip
    return group


@pytest.mark.timeout(60)
async def test_close_starts_no_scoring_on_workers_it_is_killing():
    config = ScorerConfig(rewards=[RewardSpec(EM)], tokenizer="unused", workers=1, batch_groups=1)
    out = _NoCredit()
    log = structlog.get_logger("scorer")
    scorer = Scorer(config, SimpleNamespace(log=log, outputs={"groups": out}))
    scorer.tokenizer = _Tokenizer()
    scorer.runner = RewardRunner([(EM, 1.0)], workers=1, log=log)
    await scorer.runner.start()
    with capture_logs() as logs:
        scorer.ready = [_group("g1")]
        scorer._kick()  # scores g1, then waits for credit that never comes
        await asyncio.wait_for(out.waiting.wait(), 30)
        scorer.ready += [_group("g2"), _group("g3")]  # queued behind it
        await scorer.close()
        await asyncio.sleep(0.2)  # anything started by close() would have run by now
    assert scorer.runner.counts["calls"] == 1, scorer.runner.counts  # g1's only
    assert not scorer._tasks and not scorer.ready
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
