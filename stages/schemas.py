"""Message schemas shared by the RL stages (DESIGN.md, "Messages").

``prompt`` (feeder -> generator): one prompt, already tokenized, with whatever the reward needs
in ``meta`` (the reference answer, the task name...).

``rollout`` (generator -> scorer): one sampled completion. Per-token arrays travel as zero-copy
frames: ``completion_ids`` (int32), ``sampler_logprobs`` (float32: the log-prob of each token
under the distribution the engine sampled it from) and ``versions`` (int32: the policy version
that produced each token; one sequence may span several versions with in-flight updates).
``group_id`` ties the ``group_size`` samples of one prompt together; ``sample_index`` is
0..group_size-1. ``timings`` holds seconds (``queued_s``, ``generate_s``) and ``meta`` is the
prompt's meta, passed through.

``scored_group`` (scorer -> learner): the ``group_size`` rollouts of one prompt, scored, in one
message so that a group is never split between learner ranks. ``samples`` is a list of maps, one
per rollout, in ``sample_index`` order, each with the rollout's per-sample fields
(``sample_index``, ``completion_ids``, ``sampler_logprobs``, ``versions``, ``finish_reason``,
``engine``, ``timings``) plus ``reward`` (float) and ``reward_info`` (map: which function, its
details, ``error`` when it failed or timed out and the reward was set to 0). A group may be
smaller than ``group_size`` when samples were dropped upstream (counted where they were dropped).
"""

from __future__ import annotations

from transport.message import Schema

__all__ = ["PROMPT", "ROLLOUT", "SCORED_GROUP"]

PROMPT = Schema(
    "prompt",
    1,
    {"prompt_id": "str", "input_ids": "list|array", "meta": "map|None"},
    doc="one tokenized prompt",
)

ROLLOUT = Schema(
    "rollout",
    1,
    {
        "run_id": "str",
        "prompt_id": "str",
        "group_id": "str",
        "sample_index": "int",
        "group_size": "int",
        "prompt_ids": "array",
        "completion_ids": "array",
        "sampler_logprobs": "array",
        "versions": "array",
        "finish_reason": "str",
        "engine": "str",
        "timings": "map",
        "meta": "map|None",
    },
    doc="one sampled completion with per-token sampler log-probs and policy versions",
)

SCORED_GROUP = Schema(
    "scored_group",
    1,
    {
        "run_id": "str",
        "prompt_id": "str",
        "group_id": "str",
        "group_size": "int",
        "prompt_ids": "array",
        "samples": "list",
        "meta": "map|None",
    },
    doc="the scored rollouts of one prompt (one group), for the learner",
)
