"""The learner's configuration: one typed dataclass per concern, defaults in one place.

``LearnerConfig`` is the ``stages.<learner>`` section of a pipeline YAML. Batch semantics
(DESIGN.md "The three ideas"): ``batch_size`` samples per optimizer step over all ranks,
``train_micro_batch`` samples per backward pass, ``forward_micro_batch`` samples per no-grad pass
(reference and old log-probs), optional ``max_tokens_per_micro_batch`` for both: no pass ever
runs over a whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from stages.feeder.sources import SourceConfig
from stages.hub import model_check
from stages.learner.distill import DistillConfig
from stages.learner.lora import LoraSection, config_issue
from stages.learner.loss_config import LossConfig
from stages.learner.overlong import OverlongConfig
from stages.rollouts.api import RolloutConfig
from stages.scorer.stage import RewardSpec

__all__ = [
    "AdvantageConfig",
    "CheckpointConfig",
    "DeepSpeedSection",
    "EvalConfig",
    "LearnerConfig",
    "OptimConfig",
    "PublishConfig",
]


def _f(default: Any, doc: str, **meta: Any) -> Any:
    return field(default=default, metadata={"doc": doc, **meta})


@dataclass
class AdvantageConfig:
    baseline: Literal["mean", "leave_one_out"] = _f("mean", "group baseline subtracted from r")
    std_normalize: bool = _f(False, "divide by the group's reward std")


@dataclass
class OptimConfig:
    lr: float = _f(1e-5, "AdamW learning rate", min=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.999, "AdamW beta2", min=0.0, max=1.0)
    eps: float = _f(1e-8, "AdamW epsilon", min=0.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    warmup_steps: int = _f(0, "linear learning-rate warm-up over this many steps", min=0)
    schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", "after the warm-up: keep lr, or decay it to lr * min_lr_ratio at the last step"
    )
    min_lr_ratio: float = _f(0.0, "the decayed learning rate's share of lr", min=0.0, max=1.0)


@dataclass
class DeepSpeedSection:
    zero_stage: int = _f(0, "ZeRO stage 0-3", min=0, max=3)
    backend: Literal["auto", "gloo", "nccl"] = _f(
        "auto", "torch.distributed backend (auto: nccl on GPU, gloo on CPU)"
    )
    dtype: Literal["float32", "bfloat16"] = _f("float32", "training dtype (bf16 mixed precision)")
    extra: dict[str, Any] = field(
        default_factory=dict, metadata={"doc": "merged into the DeepSpeed config as is"}
    )


@dataclass
class PublishConfig:
    every: int = _f(1, "publish the weights after every N optimizer steps", min=1)
    bucket_mb: float = _f(64.0, "size of each flat weight bucket", min=0.01)
    backend: Literal["auto", "gloo", "nccl"] = _f(
        "auto",
        "weight-group backend (auto: nccl when the learner is on a GPU, else gloo); set gloo "
        "when an engine shares the learner's GPU: NCCL cannot join two ranks on one device, "
        "gloo stages the weights through CPU memory",
    )
    snapshot: bool = _f(
        True,
        "copy the weights to CPU memory and publish from the copy while training goes on; "
        "false: training waits for each publish",
    )
    generators: list[str] = field(
        default_factory=list,
        metadata={"doc": "stages whose engines get the weights (default: all that announce)"},
    )
    engines: list[str] = field(
        default_factory=list,
        metadata={"doc": "engine URLs to publish to, instead of announced ones"},
    )
    timeout_s: float = _f(300.0, "bound on every weight-group operation", min=1.0)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = _f(
        "auto",
        "the dtype weights travel in (auto: the training dtype); e.g. bfloat16 for engines "
        "serving bfloat16 while the learner trains in float32",
    )
    delta: bool = _f(
        False,
        "send only the values that changed (in the published dtype) since the version the "
        "engines hold; built-in engines only",
    )
    full_every: int = _f(
        10, "delta: a full update every N versions (and after any failure or engine change)", min=1
    )
    lora_transport: Literal["group", "files"] = _f(
        "group",
        "with lora: how the adapters reach the engines; group: over the weight group, merged "
        "into the built-in engine's weights; files: as a peft folder each version, loaded by "
        "name (POST /load_lora_adapter) and named by every request (lora_path), which is how "
        "SGLang takes them (start it with --enable-lora --max-lora-rank R --lora-target-modules "
        "...); the built-in engine speaks both",
    )
    adapter_dir: str = _f(
        "",
        "files: where the adapters are written (default RUN_DIR/adapters); the engines read "
        "them there: across machines, a shared file system",
    )


@dataclass
class EvalConfig:
    source: SourceConfig | None = field(
        default=None,
        metadata={"doc": "held-out prompts (the feeder's source options; its eval split is used)"},
    )
    rewards: list[RewardSpec] = field(
        default_factory=list, metadata={"doc": "reward functions scoring eval answers"}
    )
    every: int = _f(0, "evaluate after every N steps (0: only at the start and the end)", min=0)
    max_prompts: int = _f(
        200,
        "evaluate on N held-out prompts, spread evenly over the eval split (every len/N-th: "
        "an eval split in a meaningful order, an enumerated task's, is sampled across it)",
        min=1,
    )
    max_new_tokens: int = _f(64, "greedy decoding length", min=1)
    correct_at: float = _f(1.0, "a reward at least this counts as correct (accuracy)")
    workers: int = _f(
        1,
        "reward worker processes scoring the answers (bounded by 30 s a call); 0: the functions "
        "run in the learner's event loop (cheap functions you trust, such as the built-in ones: "
        "no process to start, which the learner otherwise waits for before its first step)",
        min=0,
    )
    concurrency: int = _f(64, "eval requests in flight", min=1)
    rollout: RolloutConfig | None = field(
        default=None,
        metadata={
            "doc": "play held-out prompts with this rollout, greedily (the generator's: share "
            "it with a YAML anchor); default: one greedy completion each"
        },
    )

    def __post_init__(self) -> None:
        for reward in self.rewards:
            if reward.reward_model is not None and reward.reward_model.launch is not None:
                raise ValueError(
                    f"rewards: {reward.name}'s reward_model.launch starts an engine with the "
                    "scorer only; eval rewards take the url of one already running"
                )


@dataclass
class CheckpointConfig:
    every: int = _f(0, "save after every N steps (0: only at the end)", min=0)
    keep: int = _f(2, "checkpoints kept (older ones are deleted)", min=1)
    at_end: bool = _f(True, "save after the last step")


@dataclass
class LearnerConfig:
    model: str = _f(
        "",
        "model folder or Hub id (org/name[@revision]) to train (the engines serve the same)",
        path="model",
        check=model_check,
    )
    steps: int = _f(100, "optimizer steps; the run ends after the last one", min=1)
    batch_size: int = _f(64, "samples per optimizer step, over all ranks", min=1)
    train_micro_batch: int = _f(8, "samples per backward pass", min=1)
    forward_micro_batch: int = _f(16, "samples per no-grad pass", min=1)
    max_tokens_per_micro_batch: int = _f(
        0,
        "padded tokens per micro-batch, prompt and every completion token (tool-inserted ones "
        "too) counted (0: no limit)",
        min=0,
    )
    share_prompts: bool = _f(
        True,
        "a prompt several samples of a micro-batch share (a group's) runs once, its keys and "
        "values given to each of them (models whose cache is plain keys and values; others run "
        "every row whole)",
    )
    epochs: int = _f(
        1, "optimizer steps per batch (>1 reuses it: set loss.objective ppo, gspo or cispo)", min=1
    )
    max_lag: int = _f(4, "drop samples whose oldest sampled token is more versions old", min=0)
    skip_no_signal: bool = _f(
        True,
        "samples whose advantage is 0 (a group whose rewards are all equal) skip the forward and "
        "backward passes: they add nothing to the gradient (unless loss.kl_coef > 0); they still "
        "count in the step's normalization, and in the ledger as no_signal",
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO's dynamic sampling: a group whose rewards are all equal is left out of the step "
        "(in the ledger as no_signal) and the batch is filled with groups that carry signal "
        "(run.mode async only)",
    )
    max_oversample: float = _f(
        4.0,
        "dynamic_sampling: a step that has taken this many times its share of samples trains "
        "with what comes next, signal or not (a task nothing is learned from yet still trains)",
        min=1.0,
    )
    temperature: float = _f(
        1.0, "the sampler's temperature (log-probs are taken under it)", min=1e-6
    )
    ref_model: str = _f(
        "",
        "reference model for loss.kl_coef (default: the initial model)",
        path="model",
        check=model_check,
    )
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto", "auto: cuda:LOCAL_RANK when available", device="auto"
    )
    seed: int = _f(0, "model-independent randomness (dropout)")
    loss: LossConfig = field(default_factory=LossConfig, metadata={"doc": "policy loss options"})
    advantage: AdvantageConfig = field(
        default_factory=AdvantageConfig, metadata={"doc": "group advantage options"}
    )
    lora: LoraSection = field(
        default_factory=LoraSection,
        metadata={"doc": "train LoRA adapters only (peft), and publish only them"},
    )
    overlong: OverlongConfig = field(
        default_factory=OverlongConfig,
        metadata={"doc": "truncated samples: filtered out, or their reward shaped (DAPO)"},
    )
    distill: DistillConfig = field(
        default_factory=DistillConfig,
        metadata={"doc": "on-policy distillation: per-token advantages from a teacher's log-probs"},
    )
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "optimizer"})
    deepspeed: DeepSpeedSection = field(
        default_factory=DeepSpeedSection, metadata={"doc": "DeepSpeed engine"}
    )
    publish: PublishConfig = field(
        default_factory=PublishConfig, metadata={"doc": "weight publishing to the engines"}
    )
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": "held-out evaluation"})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"doc": "checkpoints"}
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: the Hugging Face model directory to train")
        if self.publish.delta and self.lora.on:
            raise ValueError(
                "publish.delta with lora: a LoRA update carries only the adapters already "
                "(under 1% of the weights); set publish.delta: false"
            )
        if self.publish.lora_transport == "files" and not self.lora.on:
            raise ValueError(
                "publish.lora_transport: files sends LoRA adapters; lora.rank is 0 (every "
                "parameter trains): set lora.rank, or publish.lora_transport: group"
            )
        lora_issue = config_issue(self.model, self.lora)
        if lora_issue:
            raise ValueError(lora_issue)
        if self.epochs > 1 and not self.loss.clipped_objective:
            raise ValueError(
                "epochs > 1 reuses each batch: set loss.objective to ppo, gspo or cispo (or "
                "loss.ppo_clip, e.g. 0.2)"
            )
        if self.eval.source is not None and not self.eval.rewards:
            raise ValueError("eval.source is set but eval.rewards is empty")
