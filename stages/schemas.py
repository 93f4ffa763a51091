"""Message schemas shared by the RL stages (DESIGN.md, "Messages").

``prompt`` (feeder -> generator): one prompt, already tokenized, with whatever the reward needs
in ``meta`` (the reference answer, the task name...).

``uid`` (optional in every kind here): which feed of which prompt this is (the feeder's stage,
replica and position), carried on by every message made of it; the run's ledger follows it
(``pipeline.ledger``). Producers of your own may leave it out: their messages are then not in the
ledger.

Version 2 of ``rollout``, ``rollout_group`` and ``scored_group`` carries trajectories (issue 13,
``stages.rollouts``): a sample's ``completion_ids`` are every token after the prompt, some sampled
by the model and some inserted by a tool or an environment. Per sample, optional:
``loss_mask`` (uint8, one per completion token: 1 sampled and trained, 0 inserted; absent means
all sampled), where it is 0 ``sampler_logprobs`` is 0.0 and ``versions`` is -1 (meaningless);
``prompt_ids`` (int32) when the sample started from a context other than the group's
``prompt_ids`` (a chat template with tool descriptions); ``rollout`` (map: ``turns``,
``tool_calls``, ``env_reward``... what the rollout reported). A reader of version 1 refuses
version 2 (``bad_version``): it would train on inserted tokens.

``rollout_group`` (generator -> scorer): the samples of one prompt that the generator got, in one
message (one ZeroMQ message per group, not per sample, is most of what scoring a group costs
downstream). Group-level fields as in ``rollout`` below; ``samples`` is a list of maps, one per
sample, each with ``sample_index``, ``completion_ids``, ``sampler_logprobs``, ``versions``,
``finish_reason``, ``engine`` and ``timings``. It holds fewer than ``group_size`` samples when some
were dropped by the generator (counted there). ``rollouts_of`` turns it into ``rollout`` maps.

``rollout`` (a producer of your own -> scorer, one sample at a time): one sampled completion.
Per-token arrays travel as zero-copy frames: ``completion_ids`` (int32), ``sampler_logprobs``
(float32: the log-prob of each token under the distribution the engine sampled it from) and
``versions`` (int32: the policy version that produced each token; one sequence may span several
versions with in-flight updates).
``group_id`` ties the ``group_size`` samples of one prompt together; ``sample_index`` is
0..group_size-1. ``timings`` holds seconds (``queued_s``, ``generate_s``) and ``meta`` is the
prompt's meta, passed through.

``rollout_batch`` (generator -> scorer, where the scorer accepts it): the single-turn groups of
several prompts in one message, as columns (``stages.rollout_batch`` packs and checks them).
Per group: ``prompt_id``, ``group_id``, ``uid`` and ``meta`` (lists), the prompts' tokens end to
end in ``prompt_ids`` (int32) cut at ``prompt_offsets`` (int64, groups + 1). Per sample, a
group's samples next to each other and the groups in order: ``group`` (int32, its group's
index), ``sample_index`` (int32), ``finish_reason`` and ``engine`` (lists), ``queued_s`` and
``generate_s`` (float64), and the completions' tokens end to end in ``completion_ids`` (int32),
``sampler_logprobs`` (float32) and ``versions`` (int32), cut at ``completion_offsets`` (int64,
samples + 1). ``group_size``, ``run_id`` and ``origin`` are the batch's. A message weighs its
number of groups (``transport.credit``, "Weight"): an inbox of 64 still holds 64 groups.
Trajectories (``loss_mask``, a sample's own ``prompt_ids``, ``rollout``) travel as
``rollout_group``.

``scored_batch`` (scorer -> learner, where the learner accepts it): the single-turn groups of one
scoring call as ``rollout_batch`` columns, plus per sample ``reward`` (float32), ``reward_info``
(a list of maps) and ``score_s`` (float64, the scoring call's seconds). It weighs its number of
groups; the learner trains each group as the ``scored_group`` it stands for.

``scored_group`` (scorer -> learner): the ``group_size`` rollouts of one prompt, scored, in one
message so that a group is never split between learner ranks. ``samples`` is a list of maps, one
per rollout, in ``sample_index`` order, each with the rollout's per-sample fields
(``sample_index``, ``completion_ids``, ``sampler_logprobs``, ``versions``, ``finish_reason``,
``engine``, ``timings``) plus ``reward`` (float) and ``reward_info`` (map: which function, its
details, ``error`` when it failed or timed out and the reward was set to 0). A group may be
smaller than ``group_size`` when samples were dropped upstream (counted where they were dropped).
Optional per sample (on-policy distillation, a scorer with a ``teacher``): ``teacher_logprobs``
(float32, one per completion token: the teacher model's log-prob of each token given everything
before it; meaningless where ``loss_mask`` is 0), absent where the teacher failed. Added within
version 2: a reader that ignores it trains as it did, and a learner that distills counts the
samples that lack it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transport.message import Schema

# a sample's own fields in ``rollout_group`` and ``scored_group`` (the rest are the group's);
# OPTIONAL_SAMPLE_FIELDS may be absent (a single completion has none of them)
SAMPLE_FIELDS = (
    "sample_index",
    "completion_ids",
    "sampler_logprobs",
    "versions",
    "finish_reason",
    "engine",
    "timings",
)
OPTIONAL_SAMPLE_FIELDS = ("loss_mask", "prompt_ids", "rollout", "teacher_logprobs")

__all__ = [
    "OPTIONAL_SAMPLE_FIELDS",
    "PROMPT",
    "ROLLOUT",
    "ROLLOUT_BATCH",
    "ROLLOUT_GROUP",
    "SAMPLE_FIELDS",
    "SCORED_BATCH",
    "SCORED_GROUP",
    "rollouts_of",
]

PROMPT = Schema(
    "prompt",
    1,
    {"prompt_id": "str", "input_ids": "list|array", "meta": "map|None", "uid": "str|None"},
    doc="one tokenized prompt",
)

ROLLOUT = Schema(
    "rollout",
    2,
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
        "uid": "str|None",
        "loss_mask": "array|None",
    },
    doc="one trajectory (a completion, or turns with inserted tokens) with per-token sampler "
    "log-probs and policy versions",
)

ROLLOUT_GROUP = Schema(
    "rollout_group",
    2,
    {
        "run_id": "str",
        "prompt_id": "str",
        "group_id": "str",
        "group_size": "int",
        "prompt_ids": "array",
        "samples": "list",
        "meta": "map|None",
        "uid": "str|None",
        "origin": "str|None",  # the generator session that made it ("stage.replica:session")
    },
    doc="the sampled completions of one prompt (one group), unscored",
)

ROLLOUT_BATCH = Schema(
    "rollout_batch",
    1,
    {
        "run_id": "str",
        "group_size": "int",
        "origin": "str|None",
        "prompt_id": "list",
        "group_id": "list",
        "uid": "list",
        "meta": "list",
        "prompt_ids": "array",
        "prompt_offsets": "array",
        "group": "array",
        "sample_index": "array",
        "completion_offsets": "array",
        "completion_ids": "array",
        "sampler_logprobs": "array",
        "versions": "array",
        "finish_reason": "list",
        "engine": "list",
        "queued_s": "array",
        "generate_s": "array",
    },
    doc="the sampled completions of several prompts' groups, as columns, unscored",
    weight=lambda data: len(data["group_id"]),
)

SCORED_BATCH = Schema(
    "scored_batch",
    1,
    {
        **ROLLOUT_BATCH.fields,
        "reward": "array",
        "reward_info": "list",
        "score_s": "array",
    },
    doc="the scored completions of several prompts' groups, as columns, for the learner",
    weight=lambda data: len(data["group_id"]),
)

SCORED_GROUP = Schema(
    "scored_group",
    2,
    {
        "run_id": "str",
        "prompt_id": "str",
        "group_id": "str",
        "group_size": "int",
        "prompt_ids": "array",
        "samples": "list",
        "meta": "map|None",
        "uid": "str|None",
        "origin": "str|None",  # the generator session that made it ("stage.replica:session")
    },
    doc="the scored rollouts of one prompt (one group), for the learner",
)


def rollouts_of(group: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The samples of a ``rollout_group`` (or ``scored_group``) as ``rollout`` maps: each
    sample's own fields next to its group's."""
    head = {k: v for k, v in group.items() if k != "samples"}
    return [{**head, **sample} for sample in group["samples"]]
