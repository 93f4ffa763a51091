"""The example tool and environment, the trajectory's layout, and how the scorer reads one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from stages.rollouts.examples import GuessNumber, calc
from stages.rollouts.trajectory import Generation, Trajectory, final_turn


def test_calc_evaluates_integer_arithmetic_and_refuses_the_rest():
    assert calc("123*456") == "56088"
    assert calc(" (7 + 5) * 3 - 4 // 2 ") == "34"
    assert calc("-3*-3") == "9"
    for bad in ("2**10", "__import__('os')", "1.5*2", "x+1", "1/0", "7//0", ""):
        with pytest.raises((ValueError, ZeroDivisionError)):
            calc(bad)
    with pytest.raises(ValueError, match="digits"):
        calc("*".join(["99999999999"] * 20))


def test_guess_number_plays_by_its_rules():
    game = GuessNumber(high=100, max_guesses=3, turn_penalty=0.1)
    assert game.reset({"prompt_id": "g", "meta": {"answer": "37"}}) == ""
    assert game.step("50") == ("L", 0.0, False, {})
    assert game.step(" 25\n") == ("H", 0.0, False, {})
    observation, reward, done, info = game.step("37")
    assert (observation, done, info) == ("", True, {"solved": True, "guesses": 3})
    assert reward == pytest.approx(0.8)
    game.reset({"meta": {"answer": 5}})
    assert game.step("1")[:3] == ("H", 0.0, False)
    assert game.step("2")[:3] == ("H", 0.0, False)
    assert game.step("3") == ("", 0.0, True, {"solved": False, "guesses": 3})
    game.reset({"meta": {"answer": 5}})
    assert game.step("five") == ("", 0.0, True, {"solved": False, "guesses": 1, "malformed": True})
    with pytest.raises(ValueError, match="no integer answer"):
        game.reset({"prompt_id": "x", "meta": {}})


def _generation(ids, version=3):
    n = len(ids)
    return Generation(ids, np.full(n, -0.5), np.full(n, version), "stop")


def test_a_trajectory_lays_out_sampled_and_inserted_tokens():
    t = Trajectory([9, 8])
    t.inserted([1])
    t.sampled(_generation([4, 5], version=2))
    t.inserted([6, 7])
    t.sampled(_generation([3], version=4))
    assert t.context == [9, 8, 1, 4, 5, 6, 7, 3] and t.length == 6 and t.turns == 2
    assert t.completion_ids.tolist() == [1, 4, 5, 6, 7, 3]
    assert t.loss_mask.tolist() == [0, 1, 1, 0, 0, 1]
    assert t.logprobs.tolist() == [0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert t.versions.tolist() == [-1, 2, 2, -1, -1, 4]
    assert (t.sampled_tokens, t.inserted_tokens) == (3, 3)
    assert t.last_sampled().tolist() == [3]
    assert final_turn(t.completion_ids, t.loss_mask) == [3]
    assert final_turn([4, 5], None) == [4, 5] and final_turn([4, 5], [1, 1]) == [4, 5]
    with pytest.raises(ValueError, match="at least one token"):
        Trajectory([])
    with pytest.raises(ValueError, match="log-probs"):
        Generation([1, 2], [0.0], [0, 0], "stop")


def test_the_scorer_rewards_a_trajectory_by_its_final_answer():
    from stages.feeder.arithmetic import make_tokenizer
    from stages.scorer.stage import Scorer

    tok = make_tokenizer()
    scorer = Scorer.__new__(Scorer)  # its reward arguments need only the tokenizer
    scorer.tokenizer = tok

    def ids(text):
        return np.asarray(tok(text)["input_ids"], dtype=np.int32)

    call, answer = ids("12*3"), ids("36")
    trajectory = np.concatenate([call, ids("36"), answer])
    mask = np.asarray([1] * len(call) + [0, 0] + [1, 1], dtype=np.uint8)
    meta = {"answer": "36"}  # each sample is a rollout: its group's fields and its own
    samples = [
        {"completion_ids": trajectory, "loss_mask": mask, "finish_reason": "stop", "meta": meta,
         "rollout": {"env_reward": 0.5, "turns": 2}},
        {"completion_ids": ids("35"), "finish_reason": "stop", "meta": meta},
    ]  # fmt: skip
    head = {"prompt_ids": ids("12*3="), "meta": meta}
    kwargs = scorer._reward_kwargs([head], [samples])
    assert kwargs["completions"] == ["36", "35"]  # the final answers
    assert kwargs["trajectories"] == ["12*33636", "35"]
    assert kwargs["env_reward"] == [0.5, None]
    assert kwargs["rollout"][0]["turns"] == 2 and kwargs["answer"] == ["36", "36"]
    # a scoring call's groups go in one call: each sample as it would be in one group
    assert scorer._reward_kwargs([head, head], [samples[:1], samples[1:]]) == kwargs
    plain = scorer._reward_kwargs([head], [samples[1:]])  # single completions: as before
    assert "trajectories" not in plain and plain["completions"] == ["35"]
    assert SimpleNamespace(**plain).prompts == ["12*3="]


def test_a_reader_of_version_1_refuses_trajectories_clearly():
    """Trajectories are version 2 of rollout_group / scored_group: a stage built against
    version 1 (it would train on inserted tokens) refuses them, saying which versions."""
    from stages.schemas import ROLLOUT_GROUP
    from transport.codec import DecodeError, decode, encode
    from transport.message import Message, Schema

    group = {
        "run_id": "r", "prompt_id": "p", "group_id": "p/1", "group_size": 1,
        "prompt_ids": np.arange(3, dtype=np.int32), "meta": None, "uid": None,
        "samples": [{"sample_index": 0, "completion_ids": np.arange(4, dtype=np.int32),
                     "loss_mask": np.array([1, 0, 0, 1], dtype=np.uint8)}],
    }  # fmt: skip
    frames = encode(Message("rollout_group", group, version=ROLLOUT_GROUP.version))
    assert ROLLOUT_GROUP.version == 2
    old = Schema("rollout_group", 1, dict(ROLLOUT_GROUP.fields))
    with pytest.raises(DecodeError, match="version 2, expected 1") as refused:
        decode(frames, {"rollout_group": old})
    assert refused.value.reason == "bad_version"
    got = decode(frames, {"rollout_group": ROLLOUT_GROUP})
    assert got.data["samples"][0]["loss_mask"].tolist() == [1, 0, 0, 1]
