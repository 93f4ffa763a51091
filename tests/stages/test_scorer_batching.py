"""The scorer shares one reward call among the groups that complete in the same turn of its
event loop (a burst the generator sent together), and adds no wait for a group that comes
alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import structlog

from stages.scorer.runner import RewardRunner
from stages.scorer.stage import RewardSpec, Scorer, ScorerConfig
from tests.stages.test_scorer_shutdown import EM, _group, _Tokenizer


class _Sink:
    def __init__(self) -> None:
        self.groups: list[dict] = []

    async def send(self, kind, data):
        self.groups.append(data)


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_groups_completed_in_one_turn_share_a_call():
    config = ScorerConfig(rewards=[RewardSpec(EM)], tokenizer="unused", workers=1)
    sink = _Sink()
    log = structlog.get_logger("scorer")
    inputs = {"rollouts": SimpleNamespace(ack=lambda msg: None)}
    scorer = Scorer(config, SimpleNamespace(log=log, outputs={"groups": sink}, inputs=inputs))
    scorer.tokenizer = _Tokenizer()
    scorer.failed = asyncio.get_running_loop().create_future()
    scorer.runner = RewardRunner([(EM, 1.0)], workers=1, log=log)
    await scorer.runner.start()
    try:
        for name in ("a", "b", "c", "d", "e"):  # one burst: no await that yields between
            await scorer._launch(_group(name))
        await _until(lambda: len(sink.groups) == 5)
        assert scorer.runner.counts["calls"] == 1
        assert [g["group_id"] for g in sink.groups] == ["a", "b", "c", "d", "e"]
        assert all(s["reward"] == 1.0 for g in sink.groups for s in g["samples"])
        await scorer._launch(_group("alone"))  # the worker is idle: scored at once, alone
        await _until(lambda: len(sink.groups) == 6)
        assert scorer.runner.counts["calls"] == 2
    finally:
        await scorer.close()
