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
"""

from __future__ import annotations

from transport.message import Schema

__all__ = ["PROMPT", "ROLLOUT"]

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
