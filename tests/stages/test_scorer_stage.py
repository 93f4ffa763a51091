"""The scorer in a real pipeline: synthetic rollouts -> scorer -> a sink that records groups."""

from __future__ import annotations

import json
import time

import pytest

from tests.pipeline.runs import events, run_inflight

pytestmark = pytest.mark.slow

HERE = "tests.stages.test_scorer_stage"


def misbehave(completions, prompts, fail=None, **kwargs):
    """Raises or hangs when the prompt's meta says so; else -1 when the prompt text is not an
    arithmetic prompt (it came from meta["text"]), 0 when it is (decoded from prompt ids)."""
    if fail == ["raise"] * len(completions):
        raise RuntimeError("misbehaving on purpose")
    if fail == ["hang"] * len(completions):
        time.sleep(3600)
    return [0.0 if p.endswith("=") else -1.0 for p in prompts]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from stages.feeder.arithmetic import make_tokenizer  # not at import: reward workers import us

    path = tmp_path_factory.mktemp("tok") / "arith"
    make_tokenizer().save_pretrained(path)
    return path


def _item(group, index, completion, answer="7", size=2, **extra):
    meta = {"answer": answer, **extra.pop("meta", {})}
    return {"group": group, "index": index, "completion": completion, "size": size,
            "meta": meta, **extra}  # fmt: skip


# Before the hold (longer than group_timeout_s): two incomplete groups that time out.
BEFORE = [
    _item("t_small", 0, "7"),  # 1 of 2: dropped at the timeout
    _item("t_part", 0, "7", size=3),  # 2 of 3: sent at the timeout
    _item("t_part", 2, "1", size=3),
]
AFTER = [
    _item("ok", 1, "8"),  # arrives first, sent second: samples go in sample_index order
    _item("ok", 1, "9"),  # duplicate
    _item("ok", 2, "7"),  # sample_index out of range
    _item("ok", 0, "7", short_versions=True),  # per-token arrays of different lengths
    _item("ok", 0, "7", size=3),  # group_size differs from the group's
    _item("ok", 0, "7"),
    _item("ok", 0, "7"),  # late: its group was complete and sent
    _item("text", 0, "12", answer="12", meta={"text": "What is 7+5?"}),
    _item("text", 1, "21", answer="12", meta={"text": "What is 7+5?"}),
    _item("raise", 0, "7", meta={"fail": "raise"}),
    _item("raise", 1, "7", meta={"fail": "raise"}),
    _item("hang", 0, "7", meta={"fail": "hang"}),
    _item("hang", 1, "7", meta={"fail": "hang"}),
    # whole groups in one message (what the generator sends)
    {
        "group": "g_full",
        "meta": {"answer": "7"},
        "size": 2,
        "samples": [_item("g_full", 0, "7"), _item("g_full", 1, "3")],
    },
    # 2 of 3 (one was dropped by the generator): sent as it is, partial
    {
        "group": "g_part",
        "meta": {"answer": "7"},
        "size": 3,
        "samples": [_item("g_part", 0, "7", size=3), _item("g_part", 2, "7", size=3)],
    },
    {
        "group": "g_small",
        "meta": {"answer": "7"},
        "size": 3,
        "samples": [_item("g_small", 1, "7", size=3)],
    },  # dropped
    # one good sample, two malformed ones: 1 < min_group, the group is dropped
    {
        "group": "g_bad",
        "size": 2,
        "samples": [
            _item("g_bad", 0, "7"),
            _item("g_bad", 1, "7", short_versions=True),
            "not a sample",
        ],
    },
    _item("end_part", 0, "7", size=4),  # 2 of 4 at the end of input: sent
    _item("end_part", 3, "7", size=4),
    _item("end_small", 1, "7", size=4),  # 1 of 4 at the end of input: dropped
]


def _config(tmp_path, tokenizer_dir, rewards):
    source = {"use": "tests.stages_for_tests:RolloutSource", "rollouts": [*BEFORE, *AFTER],
              "wait_for": "scorer.0", "hold_after": len(BEFORE), "hold_s": 2.0}  # fmt: skip
    path = tmp_path / "scorer.yaml"
    path.write_text(
        f"""
run: {{name: scorer, metrics_every_s: 0.5}}
stages:
  source: {json.dumps(source)}
  scorer:
    use: "stages.scorer.stage:Scorer"
    inputs: {{rollouts: source.out}}
    rewards: {json.dumps(rewards)}
    tokenizer: "{tokenizer_dir}"
    workers: 2
    batch_groups: 1   # the misbehaving rewards look at their call's first prompt
    timeout_s: 1.0
    group_timeout_s: 1.0
    min_group: 2
    metrics_every_s: 0.3
  sink:
    use: "tests.stages_for_tests:GroupSink"
    inputs: {{groups: scorer.groups}}
"""
    )
    return path


@pytest.mark.timeout(120)
def test_groups_are_scored_and_failures_do_not_stop_the_run(tmp_path, tokenizer_dir):
    run_dir = tmp_path / "run"
    rewards = [{"fn": "stages.scorer.rewards:exact_match", "weight": 2.0},
               {"fn": f"{HERE}:misbehave"}]  # fmt: skip
    result = run_inflight(
        "run", str(_config(tmp_path, tokenizer_dir, rewards)), "--run-dir", str(run_dir),
        timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    groups = {g["group_id"]: g for g in json.loads((run_dir / "groups.json").read_text())}
    assert set(groups) == {"t_part", "ok", "text", "raise", "hang", "end_part", "g_full", "g_part"}

    def rewards_of(group_id):
        return [s["reward"] for s in groups[group_id]["samples"]]

    def indices(group_id):
        return [s["sample_index"] for s in groups[group_id]["samples"]]

    em = "stages.scorer.rewards:exact_match"
    ok = groups["ok"]
    assert indices("ok") == [0, 1] and rewards_of("ok") == [2.0, 0.0]
    assert ok["samples"][0]["reward_info"] == {em: 1.0, f"{HERE}:misbehave": 0.0}
    assert ok["samples"][0]["completion_ids"] == [9, 1]  # "7" + <eos>, passed through
    assert ok["group_size"] == 2 and ok["meta"] == {"answer": "7"}
    assert ok["prompt_id"] == "prompt-ok" and ok["prompt_ids"] == [5, 12, 6, 15]
    assert ok["samples"][0]["tokens"] == 2 and "score_s" in ok["samples"][0]["timings"]
    # the prompt given to rewards is meta["text"] when there is one
    assert rewards_of("text") == [2.0 - 1.0, -1.0]
    for failing, words in (("raise", "RuntimeError: misbehaving on purpose"), ("hang", "timed")):
        assert rewards_of(failing) == [0.0, 0.0]
        info = groups[failing]["samples"][0]["reward_info"]
        assert info[em] == 1.0 and info[f"{HERE}:misbehave"] is None and words in info["error"]
    assert indices("t_part") == [0, 2] and rewards_of("t_part") == [2.0, 0.0]
    assert indices("end_part") == [0, 3] and groups["end_part"]["group_size"] == 4
    assert indices("g_full") == [0, 1] and rewards_of("g_full") == [2.0, 0.0]
    assert groups["g_full"]["meta"] == {"answer": "7"}
    assert groups["g_full"]["samples"][1]["completion_ids"] == [5, 1]  # "3" + <eos>
    assert indices("g_part") == [0, 2] and groups["g_part"]["group_size"] == 3

    log = events(run_dir, "scorer.0")
    (done,) = [e for e in log if e["event"] == "scorer_done"]
    assert done["groups_out"] == 8 and done["samples"] == 16 and done["groups_in"] == 4
    assert done["groups_partial"] == 3 and done["groups_dropped"] == 4
    # malformed rollouts (5, and 2 in g_bad) + samples of dropped groups (2, g_small, g_bad)
    assert done["dropped"] == 5 + 2 + 2 + 1 + 1
    assert done["errors"] == 1 and done["timeouts"] == 1 and done["worker_restarts"] == 1
    assert done["groups_pending"] == 0
    failed = {e["group_id"]: e for e in log if e["event"] == "reward_failed"}
    assert set(failed) == {"raise", "hang"} and failed["hang"]["fn"] == f"{HERE}:misbehave"
    reasons = [e["reason"] for e in log if e["event"] == "rollout_dropped"]
    assert len(reasons) == 7
    for words in ("duplicate", "late", "outside 0..1", "group_size 3", "not a map"):
        assert sum(words in r for r in reasons) == 1, (words, reasons)
    assert sum("differ in length" in r for r in reasons) == 2, reasons
    incomplete = {e["group_id"]: e["reason"] for e in log if e["event"] == "group_incomplete"}
    upstream = "samples_dropped_upstream"
    assert incomplete == {"t_part": "timeout", "end_part": "end_of_input", "g_part": upstream}
    dropped = {e["group_id"]: e["reason"] for e in log if e["event"] == "group_dropped"}
    assert dropped == {
        "t_small": "timeout",
        "end_small": "end_of_input",
        "g_small": upstream,
        "g_bad": upstream,
    }
    metrics = [e for e in log if e["event"] == "metrics" and "reward_mean" in e]
    scored = [m for m in metrics if m["window_samples"]]
    assert scored and all(0 <= m["accuracy"] <= 1 for m in scored)
    assert sum(m["window_samples"] for m in metrics) == 16


def test_unknown_rewards_are_config_errors_reported_together(tokenizer_dir):
    from pipeline.actor import build_stage_config
    from pipeline.config import ConfigError
    from stages.scorer.stage import Scorer

    options = {
        "rewards": [{"fn": "stages.scorer.rewards:exact_mach"}, {"fn": f"{HERE}:nothing_here"}],
        "tokenizer": str(tokenizer_dir),
    }
    with pytest.raises(ConfigError) as caught:
        build_stage_config(Scorer, options, "scorer")
    text = str(caught.value)
    assert "stages.scorer.rewards[0]" in text and "no attribute 'exact_mach'" in text
    assert "stages.scorer.rewards[1]" in text and "no attribute 'nothing_here'" in text
    with pytest.raises(ConfigError, match="at least one reward function"):
        build_stage_config(Scorer, {**options, "rewards": []}, "scorer")


def test_a_group_s_sample_is_checked_as_the_rollout_it_makes_with_its_group():
    """The scorer checks a ``rollout_group``'s sample for its own fields only when it repeats
    none of the group's (which were checked as the message was): the same verdict as checking
    the rollout the two make together."""
    import numpy as np

    from stages.schemas import ROLLOUT, ROLLOUT_GROUP
    from stages.scorer.stage import _HEAD_FIELDS, _SAMPLE

    head = {"run_id": "r", "prompt_id": "p", "group_id": "g", "group_size": 2, "uid": None,
            "prompt_ids": np.arange(3), "meta": None, "origin": None}  # fmt: skip
    assert not ROLLOUT_GROUP.check({**head, "samples": []})
    good = {"sample_index": 0, "completion_ids": np.arange(2), "sampler_logprobs": np.zeros(2),
            "versions": np.zeros(2), "finish_reason": "stop", "engine": "e",
            "timings": {}}  # fmt: skip
    samples = [
        good,
        {**good, "loss_mask": np.ones(2)},
        {**good, "loss_mask": None},
        {k: v for k, v in good.items() if k != "completion_ids"},
        {**good, "finish_reason": 3},
        {**good, "timings": []},
        {**good, "loss_mask": [1, 1]},
    ]
    verdicts = []
    for sample in samples:
        assert _HEAD_FIELDS.isdisjoint(sample)
        alone, together = _SAMPLE.check(sample), ROLLOUT.check({**head, **sample})
        assert bool(alone) == bool(together), (sample, alone, together)
        verdicts.append(not alone)
    assert verdicts == [True, True, True, False, False, False, False]
