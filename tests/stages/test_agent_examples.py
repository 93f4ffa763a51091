"""``configs/calculator.yaml``, ``configs/calculator_agent.yaml`` and
``configs/calculator_verifiers.yaml``, shortened, end to end: tool calls learned with RL, by the
``tools`` rollout, by an unmodified ``openai`` agent and by a verifiers ``ToolEnv``.

Every part of an agent run as a user starts it: the shipped warm-started model, the ``tools``
rollout (calls parsed, the ``calc`` tool run in a worker, its answer inserted), trajectories with
their ``loss_mask`` through the scorer (scored on the final answer) to the learner, and the
evaluation playing held-out prompts greedily with the same rollout. The full run (150 steps,
about a minute and a half, 0.12 -> 0.995) is in the README; here 20 steps (16 for verifiers')
must already move the model from answering in its head to calling the tool (3 full runs:
0.86-0.96 at step 25).
"""

from __future__ import annotations

import pytest

from tests.pipeline.runs import REPO, events, run_to_summary

pytestmark = pytest.mark.slow


def shortened(config: str, run_dir, steps: int, timeout: float) -> tuple[dict, dict, dict]:
    """``config`` run for ``steps`` steps, evaluated on 30 prompts before and after: the run's
    summary (checked to have succeeded, every sample accounted for) and the two evaluations."""
    summary = run_to_summary(
        config,
        run_dir,
        f"stages.learner.steps={steps}",
        f"stages.learner.eval.every={steps}",
        "stages.learner.eval.max_prompts=30",
        timeout=timeout,
    )
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    assert summary["ledger"]["unaccounted"] == 0
    before, after = [e for e in events(run_dir, "learner.0") if e["event"] == "eval"]
    return summary, before, after


@pytest.mark.timeout(240)
def test_the_calculator_example_learns_to_call_its_tool(tmp_path):
    assert (REPO / "configs/models/calc-tiny/model.safetensors").exists()
    run_dir = tmp_path / "run"
    _, before, after = shortened("configs/calculator.yaml", run_dir, 20, timeout=230)
    # the warm start answers in its head (wrong) for most prompts and rarely calls the tool
    assert before["accuracy"] <= 0.3 and before["tool_use"] <= 0.4
    assert after["tool_use"] >= 0.6 and after["accuracy"] >= before["accuracy"] + 0.3
    assert after["turns_mean"] > before["turns_mean"]
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    # tool answers are in the trajectories, and never trained
    assert sum(s["inserted_tokens"] for s in steps) > 0
    generator = [e for e in events(run_dir, "generator.0") if e["event"] == "metrics"]
    last = next(e for e in reversed(generator) if "rollout_tool_calls" in e)
    assert last["rollout_tool_calls"] > 0 and last["rollout_episodes"] > 0


@pytest.mark.timeout(240)
def test_the_function_calling_agent_example_learns_to_call_its_tool(tmp_path):
    """``calc_agent`` is a plain ``openai`` function-calling loop (chat completions with
    ``tools``, ``tool`` messages back) through the agent proxy; the chat model's template
    renders the agent's history as the tokens the model sampled, so a second call extends the
    trajectory (the full run: 0.11 -> 1.0 by step 25)."""
    assert (REPO / "configs/models/calc-chat-tiny/model.safetensors").exists()
    run_dir = tmp_path / "run"
    summary, before, after = shortened("configs/calculator_agent.yaml", run_dir, 20, timeout=230)
    ledger = summary["ledger"]
    assert not ledger.get("not_ended_cleanly")  # episodes in flight at the end are let go
    # the warm start answers in its head (wrong) for most prompts: one call, no tool
    assert before["accuracy"] <= 0.3 and before["turns_mean"] <= 1.4
    assert after["accuracy"] >= before["accuracy"] + 0.3 and after["turns_mean"] >= 1.6
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    assert sum(s["inserted_tokens"] for s in steps) > 0  # the tool's answers, never trained
    generator = [e for e in events(run_dir, "generator.0") if e["event"] == "metrics"]
    last = next(e for e in reversed(generator) if "rollout_episodes" in e)
    assert last["rollout_turns"] > last["rollout_episodes"] > 0
    assert last.get("rollout_agent_calls_unjoined", 0) == 0
    # the template renders the agent's history as sampled; the few that it does not (a call
    # with text after it, sampled at temperature 1) continue from the model's own tokens
    assert last.get("rollout_agent_calls_rejoined", 0) <= 0.05 * last["rollout_turns"]


@pytest.mark.timeout(200)
def test_the_verifiers_tool_env_example_learns_to_call_its_tool(tmp_path):
    """A ``vf.ToolEnv`` (``stages.rollouts.calc_verifiers``) supplies the prompts, plays the
    episodes (its own tool calls and ``tool`` messages) and scores them with its rubric (the full
    run: 0.12 -> 1.0 by step 25)."""
    pytest.importorskip("verifiers")
    run_dir = tmp_path / "run"
    summary, before, after = shortened("configs/calculator_verifiers.yaml", run_dir, 16, 190)
    assert not summary["ledger"].get("not_ended_cleanly")
    assert before["accuracy"] <= 0.3 and before["turns_mean"] <= 1.4
    assert after["accuracy"] >= before["accuracy"] + 0.3 and after["turns_mean"] >= 1.6
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    assert sum(s["inserted_tokens"] for s in steps) > 0  # the tool messages, never trained
