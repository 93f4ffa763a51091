"""What stages must agree on, checked by `inflight validate` before anything starts.

Each check runs on the shipped default pipeline (real feeder, generator, scorer and learner
options) with overrides that break one thing; every problem names its key, where it was written
and what would be valid.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, ConfigIssue, load_pipeline
from pipeline.placement import Inventory
from pipeline.registry import resolve

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
MODEL = DEFAULT.parent / "models" / "arith-tiny"


def load(*overrides: str, inventory: Inventory | None = None):
    return load_pipeline(
        DEFAULT, overrides, resolve=lambda name: resolve("stage", name), inventory=inventory
    )


def only_issue(*overrides: str, inventory: Inventory | None = None) -> ConfigIssue:
    with pytest.raises(ConfigError) as exc:
        load(*overrides, inventory=inventory)
    assert len(exc.value.issues) == 1, exc.value.issues
    return exc.value.issues[0]


def line_of(key: str) -> str:
    """``default.yaml:N`` of the first line that sets ``key:``."""
    for number, text in enumerate(DEFAULT.read_text().splitlines(), start=1):
        if text.strip().startswith(f"{key}:"):
            return f"{DEFAULT}:{number}"
    raise AssertionError(key)


# --- the learner's batch over its ranks ---------------------------------------------------------


def test_batch_size_must_split_evenly_over_the_ranks() -> None:
    issue = only_issue("stages.learner.replicas=3")
    assert issue.path == "stages.learner.batch_size"
    assert issue.where == line_of("batch_size")
    assert "batch_size 256 over 3 ranks" in issue.message
    assert "override 'stages.learner.replicas=3'" in issue.message  # where the ranks were set
    assert "85.33 samples per rank" in issue.message
    assert "use 255 or 258" in issue.message


def test_micro_batches_need_not_divide_the_batch() -> None:
    # the learner's last micro-batch may be short and ranks pad with empty ones: no constraint
    loaded = load(
        "stages.learner.replicas=2",
        "stages.learner.batch_size=250",
        "stages.learner.train_micro_batch=8",
        "stages.learner.forward_micro_batch=300",
    )
    assert loaded.config.stages["learner"].options.batch_size == 250
    issue = only_issue("stages.learner.replicas=4", "stages.learner.batch_size=2")
    assert "use 4" in issue.message  # nothing lower is a positive multiple


# --- sampling -----------------------------------------------------------------------------------


def test_sampling_penalties_are_sent_when_set_and_bounded() -> None:
    loaded = load(
        "stages.generator.sampling.repetition_penalty=1.1", "stages.generator.sampling.min_p=0.05"
    )
    params = loaded.config.stages["generator"].options.sampling.as_params()
    assert params["repetition_penalty"] == 1.1 and params["min_p"] == 0.05
    assert "frequency_penalty" not in params  # unset: the requests stay as they were
    assert (
        "repetition_penalty" not in load().config.stages["generator"].options.sampling.as_params()
    )
    issue = only_issue("stages.generator.sampling.frequency_penalty=3")
    assert issue.path == "stages.generator.sampling.frequency_penalty"
    assert "at most 2.0" in issue.message
    issue = only_issue("stages.generator.sampling.repetition_penalty=0")
    assert issue.path == "stages.generator.sampling.repetition_penalty"
    assert "(0, 2]" in issue.message
    issue = only_issue("stages.generator.sampling.min_new_tokens=6")  # max_new_tokens is 5
    assert issue.path == "stages.generator.sampling.min_new_tokens"


def test_a_thinking_budget_makes_thinking_requests() -> None:
    # SGLang's max_thinking_tokens and require_reasoning, request fields the client lifts
    loaded = load("stages.generator.sampling.max_thinking_tokens=64")
    params = loaded.config.stages["generator"].options.sampling.as_params()
    assert params["max_thinking_tokens"] == 64 and params["require_reasoning"] is True
    plain = load().config.stages["generator"].options.sampling.as_params()
    assert "max_thinking_tokens" not in plain and "require_reasoning" not in plain
    issue = only_issue("stages.generator.sampling.max_thinking_tokens=lots")
    assert issue.path == "stages.generator.sampling.max_thinking_tokens"


def test_a_custom_logit_processor_by_name_is_sglangs_string() -> None:
    from stages.engine.custom_logits import sglang_string

    flags = '["--max-running", "256", "--enable-custom-logit-processor"]'
    loaded = load(
        "stages.generator.sampling.custom_logit_processor=Qwen3ThinkingBudgetLogitProcessor",
        "stages.generator.sampling.custom_params={thinking_budget: 32}",
        f"stages.generator.launch.extra_args={flags}",
    )
    params = loaded.config.stages["generator"].options.sampling.as_params()
    assert params["custom_logit_processor"] == sglang_string("Qwen3ThinkingBudgetLogitProcessor")
    assert params["custom_params"] == {"thinking_budget": 32}
    assert (
        "custom_logit_processor"
        not in load().config.stages["generator"].options.sampling.as_params()
    )
    unflagged = only_issue(
        "stages.generator.sampling.custom_logit_processor=DisallowedTokensLogitsProcessor"
    )
    assert "add it to launch.extra_args" in unflagged.message
    issue = only_issue("stages.generator.sampling.custom_logit_processor=Qwen4Budget")
    assert issue.path == "stages.generator.sampling.custom_logit_processor"
    assert "one of SGLang's shipped processors" in issue.message


# --- group size ---------------------------------------------------------------------------------


def test_a_group_of_one_teaches_nothing() -> None:
    issue = only_issue("stages.generator.group_size=1", "stages.generator.sync_batch=0")
    assert issue.path == "stages.generator.group_size"
    assert issue.where == "override 'stages.generator.group_size=1'"
    assert "always 0" in issue.message and "use 2 or more" in issue.message


def test_async_batches_need_not_be_whole_groups() -> None:
    # the learner carries a group's extra samples into its next step
    assert load("stages.learner.batch_size=250").config.stages["learner"].options.batch_size == 250


# --- sync mode: what the generators start per version is what the learner trains ----------------


def test_sync_mode_as_shipped_is_valid() -> None:
    assert load("run.mode=sync").config.run.mode == "sync"


def test_sync_mode_needs_sync_batch() -> None:
    issue = only_issue("run.mode=sync", "stages.generator.sync_batch=0")
    assert issue.path == "stages.generator.sync_batch"
    assert "needs 256 samples (learner.batch_size 256)" in issue.message
    assert "set it to 256" in issue.message


def test_lora_to_sglang_goes_as_files_and_targets_modules_the_model_has() -> None:
    sglang = ("stages.generator.launch.kind=sglang", "stages.generator.launch.in_process=false")
    issue = only_issue("stages.learner.lora.rank=8", *sglang)
    assert issue.path == "stages.learner.publish.lora_transport"
    assert "SGLang" in issue.message and "lora_transport: files" in issue.message
    assert "--max-lora-rank 8" in issue.message
    files = "stages.learner.publish.lora_transport=files"
    assert load("stages.learner.lora.rank=8", files, *sglang).config.stages["learner"]
    issue = only_issue(files)
    assert issue.path.startswith("stages.learner") and "lora.rank is 0" in issue.message
    issue = only_issue("stages.learner.lora.rank=8", "stages.learner.lora.target_modules=[qproj]")
    assert "'qproj' matches no linear module" in issue.message and "q_proj" in issue.message
    issue = only_issue("stages.learner.lora.rank=80")
    assert "lora.rank 80 is larger than" in issue.message and "at most 64" in issue.message
    assert load("stages.learner.lora.rank=8").config.stages["learner"].options.lora.rank == 8


def test_dynamic_sampling_needs_async_mode() -> None:
    issue = only_issue("run.mode=sync", "stages.learner.dynamic_sampling=true")
    assert issue.path == "stages.learner.dynamic_sampling"
    assert "run.mode is sync" in issue.message and "run.mode: async" in issue.message
    assert load("stages.learner.dynamic_sampling=true").config.run.mode == "async"


def test_sync_batch_too_small_would_deadlock() -> None:
    issue = only_issue("run.mode=sync", "stages.generator.sync_batch=128")
    assert issue.path == "stages.generator.sync_batch"
    assert issue.where == "override 'stages.generator.sync_batch=128'"
    assert "start 128 samples per policy version" in issue.message
    where = line_of("batch_size")
    assert f"learner trains 256 per version (learner.batch_size 256, at {where})" in issue.message
    assert "wait for ever" in issue.message
    assert "set generator.sync_batch to 256" in issue.message


def test_sync_batch_counts_replicas_and_publish_every() -> None:
    issue = only_issue("run.mode=sync", "stages.generator.replicas=2")
    assert "start 512 samples" in issue.message and "not sync" in issue.message
    assert "set generator.sync_batch to 128" in issue.message
    issue = only_issue("run.mode=sync", "stages.learner.publish.every=2")
    assert "learner.batch_size 256 x publish.every 2" in issue.message
    assert "set generator.sync_batch to 512" in issue.message
    load("run.mode=sync", "stages.learner.publish.every=2", "stages.generator.sync_batch=512")


def test_sync_batch_of_whole_groups_or_change_the_batch() -> None:
    issue = only_issue(
        "run.mode=sync", "stages.learner.batch_size=250", "stages.generator.sync_batch=252"
    )
    assert "250 per replica is not a multiple of group_size 4" in issue.message


# --- engine devices -----------------------------------------------------------------------------

GPUS = Inventory(cores=(0, 1), gpus=(0, 1), gpu_source="CUDA_VISIBLE_DEVICES='0,1'")
NO_GPUS = Inventory(cores=(0, 1), gpu_source="no CUDA_VISIBLE_DEVICES, no nvidia-smi")


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ("gpu", "did you mean 'cuda'?"),
        ("cuda1", "did you mean 'cuda:1'?"),
        ("CUDA:0", "did you mean 'cuda:0'?"),
        ("cuda:-1", "expected a device: cpu, cuda or cuda:N"),
        ("cuda:01", "expected a device"),
        ("tpu", "expected a device"),
    ],
)
def test_malformed_devices_are_refused(device: str, words: str) -> None:
    text = f"stages.generator.launch.device={device}"
    issue = only_issue(text)
    assert issue.path == "stages.generator.launch.device"
    assert issue.where == f"override {text!r}"
    assert words in issue.message


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:7"])
def test_well_formed_devices_pass_without_an_inventory(device: str) -> None:
    loaded = load(f"stages.generator.launch.device={device}")
    assert loaded.config.stages["generator"].options.launch.device == device


def test_a_gpu_index_must_exist_on_the_host() -> None:
    assert load("stages.generator.launch.device=cuda:1", inventory=GPUS)
    issue = only_issue("stages.generator.launch.device=cuda:2", inventory=GPUS)
    assert "the process sees 2 GPUs (this host: CUDA_VISIBLE_DEVICES='0,1'" in issue.message
    assert "use cuda:0 to cuda:1" in issue.message
    issue = only_issue("stages.generator.launch.device=cuda", inventory=NO_GPUS)
    assert "needs a GPU, but the process sees none" in issue.message
    assert "use cpu" in issue.message


def test_an_engine_given_its_own_gpus_sees_only_those() -> None:
    issue = only_issue(
        "stages.generator.launch.device=cuda:1",
        "stages.generator.launch.resources={gpus: 1}",
        "stages.generator.launch.in_process=false",  # an engine process of its own
        inventory=GPUS,
    )
    assert "sees 1 GPU (stages.generator.launch.resources.gpus: 1 per process" in issue.message
    assert "use cuda:0" in issue.message
    # two listed GPUs shared by two engines: one each
    issue = only_issue(
        f"stages.generator.launch={{kind: builtin, model: '{MODEL}', count: 2, "
        "device: 'cuda:1', resources: {gpus: [0, 1]}}",
        inventory=GPUS,
    )
    assert "launch.resources.gpus lists 2 for 2 processes" in issue.message
    # the stage's own CUDA_VISIBLE_DEVICES counts when no GPUs are requested
    issue = only_issue(
        "stages.generator.launch.device=cuda:1", "stages.generator.env.CUDA_VISIBLE_DEVICES='3'"
    )
    assert "env CUDA_VISIBLE_DEVICES='3'" in issue.message


def test_every_problem_at_once_in_file_order() -> None:
    with pytest.raises(ConfigError) as exc:
        load(
            "stages.learner.replicas=3",
            "stages.generator.launch.device=gpu",
            "stages.generator.group_size=1",
            "stages.generator.sync_batch=0",
        )
    paths = [i.path for i in exc.value.issues]
    assert paths == [
        "stages.learner.batch_size",
        "stages.generator.launch.device",
        "stages.generator.group_size",
    ]


def test_a_launched_engine_sees_its_replicas_gpus_and_a_learner_its_own() -> None:
    issue = only_issue(
        "stages.generator.launch.device=cuda:1",
        "stages.generator.resources={gpus: 1}",
        inventory=GPUS,
    )
    assert "sees 1 GPU (stages.generator.resources.gpus: 1 per process" in issue.message
    # the learner's device is checked too ("auto" is its own business)
    assert load("stages.learner.device=auto", inventory=NO_GPUS)
    issue = only_issue("stages.learner.device=cuda", inventory=NO_GPUS)
    assert issue.path == "stages.learner.device"
    assert "needs a GPU, but the process sees none" in issue.message
    assert load("stages.learner.device=cuda", "stages.learner.resources={gpus: 1}", inventory=GPUS)
