"""The learner's DeepSpeed side: the model engine, one optimizer step over a batch, weights out.

``Trainer`` is blocking code meant to run in a worker thread of the learner stage (so the stage's
event loop keeps its heartbeat and its inbox while a step runs). Every rank calls the same
methods in the same order: with ZeRO-3 each forward pass gathers parameters collectively, and
with ZeRO-2 each backward pass reduces gradients collectively, so the ranks first agree on how
many micro-batches they run and pad with empty ones (a zero loss) where they have fewer.

One step (``Trainer.step``): the no-grad passes first, in ``forward_micro_batch`` chunks
(reference log-probs when ``loss.kl_coef > 0``, the learner's own log-probs before the step when
a batch is reused for several epochs); then backward passes in ``train_micro_batch`` chunks, each
micro-batch's loss divided by the step-wide denominator so that the accumulated gradient is the
whole batch's; then one ``engine.step()`` (``managed_gradient_accumulation: false``: the step is
the accumulation boundary). A non-finite loss anywhere skips the step on every rank (counted).

Multi-turn samples (``TrainSample.loss_mask``): forward passes run over the whole sequence, and
micro-batch sizes and token budgets count it whole (inserted tokens are context); the loss, its
statistics, the entropy and the lag read only the sampled tokens. ``normalize: token`` divides by
the step's sampled tokens; ``normalize: sequence`` by its samples, those with no sampled token
included (they add 0, as a sample with a zero advantage does).

DeepSpeed's C++ ops: DeepSpeed JIT-compiles an op (``torch.utils.cpp_extension``, tens of seconds)
the first time something asks for it. Its communication backend asks for the shared-memory
all-reduce ``deepspeed_shm_comm`` in every process group it makes, although that op serves only
``inference_all_reduce`` (tensor-parallel inference) and training collectives go through
``torch.distributed``; ``Trainer.setup`` therefore marks it incompatible before
``deepspeed.init_distributed`` (``skip_unused_deepspeed_ops``), which also spares the probe of
every other op (compiler subprocesses). With the learner's own AdamW nothing else is built on
CPU (ZeRO 0-3; ZeRO-Offload with ``zero_force_ds_cpu_optimizer: false`` in ``deepspeed.extra``
keeps the torch optimizer); an op a configuration does need (NVMe offload's ``async_io``, GPU
kernels) is still built, and a ``deepspeed_op_build`` warning names it, says why and where it is
cached before the compile starts (``announce_deepspeed_op_builds``). Builds land in
``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache/torch_extensions/``: one per user and
machine, shared by every virtual environment, so each op compiles once per machine.

Not here: where samples come from, staleness, publishing, evaluation (``stage.py``).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from stages.hub import resolve_model
from stages.learner.batching import collate, completion_logprobs, micro_batches, no_grad_logprobs
from stages.learner.config import LearnerConfig, OptimConfig
from stages.learner.loss import policy_loss, stat_keys, step_denominator, summarize
from stages.remote_code import remote_code_trusted
from transport.address import rendezvous_port

__all__ = [
    "TrainSample",
    "Trainer",
    "announce_deepspeed_op_builds",
    "extension_dir",
    "import_deepspeed",
    "lr_factor",
    "sample_lags",
    "skip_unused_deepspeed_ops",
    "token_counts",
    "without_passes",
]


@dataclass
class TrainSample:
    """One sample of a step: its context, its trajectory, and which of its tokens are trained.

    ``loss_mask`` (bool, one per completion token; None = every token) marks the tokens the
    model sampled: only they are trained, and only their ``sampler_logprobs`` and ``versions``
    mean anything. The others were inserted by a tool or an environment: context for the
    forward pass (and counted in micro-batch token budgets), nothing else.
    """

    prompt_ids: np.ndarray  # int
    completion_ids: np.ndarray  # int
    sampler_logprobs: np.ndarray  # float32, one per completion token
    versions: np.ndarray  # int, one per completion token (-1 where inserted)
    advantage: float
    reward: float
    origin: int = 0  # which received group it came from (the learner acknowledges groups)
    index: int = 0  # its sample_index in that group
    loss_mask: np.ndarray | None = None  # bool, one per completion token; None: all sampled
    # float32, one per completion token: each token's own advantage (distillation); None: all
    # tokens have ``advantage``
    token_advantages: np.ndarray | None = None

    @property
    def carries_signal(self) -> bool:
        """Whether a trained token of it has a nonzero advantage (else it adds nothing)."""
        if self.token_advantages is None:
            return self.advantage != 0.0
        return bool(np.any(self.token_advantages[self.sampled] != 0.0))

    @property
    def sampled(self) -> np.ndarray:
        """Bool mask of the completion tokens the model sampled (the trained ones)."""
        if self.loss_mask is None:
            return np.ones(len(self.completion_ids), dtype=bool)
        return np.asarray(self.loss_mask, dtype=bool)

    @property
    def sampled_versions(self) -> np.ndarray:
        """The policy versions of the sampled tokens (inserted tokens have none)."""
        versions = np.asarray(self.versions)
        return versions if self.loss_mask is None else versions[self.sampled]


def sample_lags(samples: list[TrainSample], policy_version: int) -> np.ndarray:
    """Lag in versions of every sampled token of ``samples`` (int64; inserted tokens: none)."""
    if not samples:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([policy_version - s.sampled_versions.astype(np.int64) for s in samples])


def token_counts(samples: list[TrainSample]) -> tuple[int, int]:
    """``(sampled, inserted)`` completion tokens of ``samples``."""
    sampled = sum(int(s.sampled.sum()) for s in samples)
    return sampled, sum(len(s.completion_ids) for s in samples) - sampled


def _device(config: LearnerConfig) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def without_passes(config: LearnerConfig, sample: TrainSample) -> bool:
    """True for a sample a step leaves out of its forward and backward passes: its advantage is
    0 (a group whose rewards are all equal), on every trained token when it has per-token ones,
    and no other loss term reads it, so it would add exactly nothing to the gradient
    (``skip_no_signal``). It still counts in the step."""
    return config.skip_no_signal and config.loss.kl_coef == 0 and not sample.carries_signal


class Trainer:
    """A DeepSpeed engine around the policy, driven one optimizer step at a time."""

    def __init__(self, config: LearnerConfig, log: Any) -> None:
        self.config = config
        self.log = log
        self.device = _device(config)
        self.engine: Any = None
        self.ref_model: torch.nn.Module | None = None
        self.pad_id = 0
        self._snapshot: dict[str, torch.Tensor] = {}
        # called with True as a backward pass starts and False when it ends: autograd runs it
        # without the GIL, so other threads' Python then costs this one nothing (the learner
        # reads the next step's groups meanwhile)
        self.on_backward: Callable[[bool], None] | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        deepspeed = import_deepspeed()
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = self.config
        backend = cfg.deepspeed.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if "RANK" not in os.environ:  # a single learner started outside the supervisor
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(rendezvous_port()),
            )
        skip_unused_deepspeed_ops()
        announce_deepspeed_op_builds()
        deepspeed.init_distributed(dist_backend=backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed + self.rank)
        dtype = torch.bfloat16 if cfg.deepspeed.dtype == "bfloat16" else torch.float32
        # a folder, or a Hub id made its cached snapshot folder (downloaded first when online)
        model_dir = resolve_model(cfg.model, what="model")
        # a folder's own code runs where the run trusts it (run.trust_remote_code)
        local = {"local_files_only": True, "trust_remote_code": remote_code_trusted()}
        model_config = AutoConfig.from_pretrained(model_dir, **local)
        pad = getattr(model_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **local)
        model.config.use_cache = False
        if cfg.lora.on:  # only the adapters train (and travel to the engines)
            from stages.learner.lora import wrap

            model = wrap(model, cfg.lora)
        if cfg.loss.kl_coef > 0:
            ref_dir = resolve_model(cfg.ref_model, what="ref_model") if cfg.ref_model else model_dir
            self.ref_model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype, **local).to(
                self.device
            )
            self.ref_model.eval().requires_grad_(False)
        optim = cfg.optim
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            # one kernel over all parameters: 0.8 ms a step for the default task's model on
            # one thread, against 2.6 for the loop over them (torch's default on CPU)
            fused=self.device.type in ("cpu", "cuda"),
        )
        horizon = cfg.steps * cfg.epochs  # optimizer steps in the whole run
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_factor, optim=optim, horizon=horizon)
        )
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # this step is the accumulation boundary, whatever the number of micro-batches
            "managed_gradient_accumulation": False,
            # ZeRO computes the global norm only when clipping: "off" is a bound never reached
            "gradient_clipping": optim.grad_clip or 1e12,
            "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
            "bf16": {"enabled": dtype == torch.bfloat16},
            "steps_per_print": 2**31,
            "wall_clock_breakdown": False,
        }
        ds_config.update(cfg.deepspeed.extra)
        started = time.perf_counter()
        self.engine, _, _, _ = deepspeed.initialize(
            model=model.to(self.device),
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config,
        )
        if cfg.deepspeed.zero_stage == 0 and dtype == torch.float32:
            self._keep_grad_norm()
            if self.world == 1:
                # averaging gradients over one rank is the identity, but DeepSpeed would still
                # copy them all into flat buffers and all-reduce those every step (as it does
                # itself when it has no process group)
                self.engine.enable_backward_allreduce = False
        self.log.info(
            "deepspeed_ready",
            rank=self.rank,
            world=self.world,
            backend=backend,
            zero_stage=cfg.deepspeed.zero_stage,
            device=str(self.device),
            params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
            trained=sum(
                getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad
            ),
            seconds=round(time.perf_counter() - started, 3),
        )

    def _keep_grad_norm(self) -> None:
        """Without ZeRO, DeepSpeed clips fp32 gradients but drops the norm: keep it."""
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self.engine

        def clip() -> None:
            norm = clip_grad_norm_(
                parameters=engine.module.parameters(),
                max_norm=engine.gradient_clipping(),
                mpu=engine.mpu,
            )
            engine._global_grad_norm = float(norm)

        engine.clip_fp32_gradients = clip

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        if self.world == 1:  # sum, min and max over one rank: the values themselves
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        if self.device.type == "cuda":
            t = t.to(self.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def agree(self, have_data: bool) -> bool:
        """True when every rank has samples for another step (else all ranks stop)."""
        return self._all_reduce([float(have_data)], dist.ReduceOp.MIN)[0] > 0

    def _agree_max(self, n: int) -> int:
        return int(self._all_reduce([float(n)], dist.ReduceOp.MAX)[0])

    # ------------------------------------------------------------------- step
    def _backward(self, loss: torch.Tensor) -> None:
        notify = self.on_backward or (lambda on: None)
        notify(True)
        try:
            self.engine.backward(loss, scale_wrt_gas=False)
        finally:
            notify(False)

    def _empty_pass(self, *, grad: bool) -> None:
        """A forward (and backward) over one pad token with zero loss: keeps ranks in step."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        if grad:
            logits = self.engine(input_ids=ids).logits
            self.engine.backward(logits.float().sum() * 0.0, scale_wrt_gas=False)
        else:
            with torch.no_grad():
                self.engine(input_ids=ids)

    def _no_grad(self, model: Any, samples: list[TrainSample]) -> list[torch.Tensor]:
        cfg = self.config
        prompts = [s.prompt_ids for s in samples]
        completions = [s.completion_ids for s in samples]
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
        mine = (
            len(
                micro_batches(
                    lengths, cfg.forward_micro_batch, cfg.max_tokens_per_micro_batch or None
                )
            )
            if samples
            else 0
        )
        agreed = self._agree_max(mine) if model is self.engine else mine
        out = (
            no_grad_logprobs(
                model,
                prompts,
                completions,
                pad_id=self.pad_id,
                micro_batch=cfg.forward_micro_batch,
                max_tokens=cfg.max_tokens_per_micro_batch or None,
                temperature=cfg.temperature,
                share_prompts=cfg.share_prompts,
            )
            if samples
            else []
        )
        for _ in range(agreed - mine):
            self._empty_pass(grad=False)
        return [x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in out]

    def step(self, samples: list[TrainSample], policy_version: int) -> dict[str, Any]:
        """One optimizer step (``epochs`` of them when a batch is reused) over ``samples``.

        ``samples`` are this rank's share. Returns metrics over all ranks: ``samples``, ``tokens``
        (the sampled, trained completion tokens: what ``normalize: token`` divides by) and
        ``inserted_tokens`` (tool/environment tokens: context only); ``lag_mean``/``lag_max``
        over sampled tokens; the loss statistics (``summarize``) and ``entropy`` per sampled
        token, over the samples that had passes; ``no_signal``: the samples without passes
        (``without_passes``), which still count in ``samples``, ``tokens`` and the normalization.
        """
        cfg = self.config
        started = time.perf_counter()
        lr = float(self.engine.optimizer.param_groups[0]["lr"])  # this step's (the schedule's)
        # Shortest first: micro-batches of similar lengths pad less (the loss is a sum over
        # samples, so their order does not change the step).
        samples = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        passes = [s for s in samples if not without_passes(cfg, s)]
        self.engine.train()
        ref_lp = self._no_grad(self.ref_model, passes) if self.ref_model is not None else None
        old_lp = None
        if cfg.epochs > 1:
            self.engine.eval()
            old_lp = self._no_grad(self.engine, passes)
            self.engine.train()
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in passes]
        mbs = micro_batches(lengths, cfg.train_micro_batch, cfg.max_tokens_per_micro_batch or None)
        # at least one (empty) pass: the optimizer step then has its (zero) gradients
        agreed = max(self._agree_max(len(mbs)), 1)
        # Sequence normalization counts every sample, those without a sampled token too (they
        # add 0, like a zero advantage): the step's scale does not depend on what tools wrote.
        n_tokens, n_inserted = token_counts(samples)
        total_seqs, total_tokens, total_inserted = self._all_reduce(
            [len(samples), n_tokens, n_inserted]
        )
        # DeepSpeed averages gradients over ranks: scale so the result is the global sum / total
        denominator = step_denominator(total_seqs, total_tokens, cfg.loss) / self.world
        sums: dict[str, float] = {}
        entropy_sum = 0.0
        skipped = 0
        grad_norm = None
        for _epoch in range(cfg.epochs):
            bad = 0.0
            for i in range(agreed):
                if i >= len(mbs):
                    self._empty_pass(grad=True)
                    continue
                idx = mbs[i]
                loss, stats, entropy = self._micro_step(passes, idx, denominator, ref_lp, old_lp)
                if not torch.isfinite(loss):
                    bad = 1.0
                    loss = torch.zeros((), device=self.device, requires_grad=True)
                    self._empty_pass(grad=True)
                else:
                    self._backward(loss)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                entropy_sum += entropy
            if self._all_reduce([bad], dist.ReduceOp.MAX)[0] > 0:
                skipped += 1
                self._discard_gradients()
                continue
            self.engine.step()
            grad_norm = self.engine.get_global_grad_norm()
        # the same keys on every rank, one without passes (no samples with signal) included
        keys = stat_keys(cfg.loss, with_ref=ref_lp is not None)
        assert set(sums) <= set(keys), sorted(set(sums) - set(keys))
        reduced = dict(zip(keys, self._all_reduce([sums.get(k, 0.0) for k in keys]), strict=True))
        rewards = [s.reward for s in samples]
        lags = sample_lags(samples, policy_version)
        r_sum, r_correct, lag_sum, lag_n, ent, no_signal = self._all_reduce(
            [
                sum(rewards),
                float(sum(r > 0 for r in rewards)),
                float(lags.sum()),
                float(lags.size),
                entropy_sum,
                float(len(samples) - len(passes)),
            ]
        )
        lag_max = self._all_reduce([float(lags.max()) if lags.size else 0.0], dist.ReduceOp.MAX)[0]
        tokens = max(reduced.get("tokens", 0.0), 1.0)
        metrics: dict[str, Any] = {
            "samples": int(total_seqs),
            "tokens": int(total_tokens),
            "inserted_tokens": int(total_inserted),
            "reward": r_sum / max(total_seqs, 1),
            "solved": r_correct / max(total_seqs, 1),
            "lag_mean": lag_sum / max(lag_n, 1),
            "lag_max": int(lag_max),
            "entropy": ent / tokens / max(cfg.epochs, 1),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": skipped,
            "no_signal": int(no_signal),
            "lr": lr,
            "step_s": time.perf_counter() - started,
            **summarize(reduced),
        }
        if metrics["grad_norm"] is not None and not math.isfinite(metrics["grad_norm"]):
            metrics["grad_norm"] = None
        return metrics

    def _micro_step(
        self,
        samples: list[TrainSample],
        idx: list[int],
        denominator: float,
        ref_lp: list[torch.Tensor] | None,
        old_lp: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        cfg = self.config
        part = [samples[i] for i in idx]
        batch = collate(
            [s.prompt_ids for s in part],
            [s.completion_ids for s in part],
            pad_id=self.pad_id,
            share_prompts=cfg.share_prompts,
        ).to(self.device)
        logp, entropy = completion_logprobs(
            self.engine, batch, with_entropy=True, temperature=cfg.temperature
        )
        width = batch.completion_mask.shape[1]
        # trained: real completion tokens that the model sampled (not padding, not inserted)
        mask = batch.completion_mask & _padded_mask([s.sampled for s in part], width).to(
            self.device
        )
        sampler = _padded([np.asarray(s.sampler_logprobs) for s in part], width)
        sampler = sampler.to(self.device, logp.dtype)
        old = logp.detach() if old_lp is None else _padded([old_lp[i] for i in idx], width)
        ref = None if ref_lp is None else _padded([ref_lp[i] for i in idx], width)
        if any(s.token_advantages is not None for s in part):  # per token: [B, T]
            rows = [
                s.token_advantages
                if s.token_advantages is not None
                else np.full(len(s.completion_ids), s.advantage, dtype=np.float32)
                for s in part
            ]
            advantages = _padded(rows, width).to(self.device, logp.dtype)
        else:
            advantages = torch.tensor(
                [s.advantage for s in part], device=self.device, dtype=logp.dtype
            )
        loss, stats = policy_loss(
            logp,
            sampler_logp=sampler,
            old_logp=old.to(self.device, logp.dtype),
            advantages=advantages,
            mask=mask,
            config=cfg.loss,
            denominator=denominator,
            ref_logp=None if ref is None else ref.to(self.device, logp.dtype),
        )
        ent = float(torch.where(mask, entropy, 0.0).sum()) if entropy is not None else 0.0
        return loss, stats, ent

    def _discard_gradients(self) -> None:
        """Drop the gradients accumulated for a step that is skipped."""
        self.engine.zero_grad()
        optimizer = getattr(self.engine, "optimizer", None)
        for attr in ("averaged_gradients",):  # ZeRO-1/2 keep reduced gradients here
            grads = getattr(optimizer, attr, None)
            if isinstance(grads, dict):
                grads.clear()

    # ---------------------------------------------------------------- weights
    def named_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What a weight update carries, in groups of about ``bucket_bytes``; collective under
        ZeRO-3: every parameter, or with LoRA only the adapters (``lora.adapter_name``; B
        scaled), each module's A and B in one group."""
        import deepspeed

        params = self._published()
        group: list[tuple[str, torch.nn.Parameter, float]] = []
        size = 0
        zero3 = self.config.deepspeed.zero_stage == 3
        for i, (name, p, scale) in enumerate(params):
            group.append((name, p, scale))
            size += (p.ds_numel if zero3 else p.numel()) * p.element_size()
            pair_open = name.endswith(".lora_A.weight") and i + 1 < len(params)
            if size >= bucket_bytes and not pair_open:
                yield from self._gathered(group, zero3, deepspeed)
                group, size = [], 0
        if group:
            yield from self._gathered(group, zero3, deepspeed)

    def _published(self) -> list[tuple[str, torch.nn.Parameter, float]]:
        """``(name the engines know, parameter, factor)`` of what an update carries."""
        module = self.engine.module
        if not self.config.lora.on:
            return [(name, p, 1.0) for name, p in module.named_parameters()]
        from stages.learner.lora import published_adapters

        return published_adapters(module)

    def _gathered(self, group: list, zero3: bool, deepspeed: Any) -> Iterator[list]:
        def tensors() -> list[tuple[str, torch.Tensor]]:
            return [(n, p.data if s == 1.0 else p.data * s) for n, p, s in group]

        if zero3:
            with deepspeed.zero.GatheredParameters([p for _, p, _ in group]):
                yield tensors()
        else:
            yield tensors()

    def snapshot(self, bucket_bytes: int) -> dict[str, torch.Tensor] | None:
        """A CPU copy of every parameter on rank 0 (None elsewhere), reusing its buffers."""
        for group in self.named_weights(bucket_bytes):
            if self.rank != 0:
                continue
            for name, tensor in group:
                buf = self._snapshot.get(name)
                if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                    buf = self._snapshot[name] = torch.empty(
                        tensor.shape,
                        dtype=tensor.dtype,
                        device="cpu",
                        pin_memory=tensor.is_cuda,
                    )
                buf.copy_(tensor, non_blocking=tensor.is_cuda)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._snapshot if self.rank == 0 else None

    def last_snapshot(self) -> dict[str, torch.Tensor]:
        """Rank 0: the weights the last ``snapshot`` copied (its buffers, not a new copy)."""
        return self._snapshot

    # ------------------------------------------------------------ checkpoints
    def save(self, path: str, state: dict[str, Any], tokenizer_from: str) -> None:
        """DeepSpeed state (all ranks) and, from rank 0, a Hugging Face model folder."""
        rng = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        self.engine.save_checkpoint(
            os.path.join(path, "deepspeed"), tag="state", client_state={**state, "rng": rng}
        )
        if self.config.deepspeed.zero_stage == 3:
            weights = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            weights = self.engine.module.state_dict() if self.rank == 0 else None
        if self.rank == 0:
            from stages.light_tokenizer import transformers_tokenizer

            module = self.engine.module
            module.config.use_cache = True
            # with LoRA: the adapter in peft's format (adapter_config.json, adapter_model.*)
            module.save_pretrained(path, state_dict=weights, safe_serialization=True)
            folders = [path]
            if self.config.lora.on and self.config.lora.merged_checkpoints:
                from stages.learner.lora import merged_state_dict

                merged = os.path.join(path, "merged")
                module.get_base_model().save_pretrained(
                    merged, state_dict=merged_state_dict(module, weights), safe_serialization=True
                )
                folders.append(merged)
            module.config.use_cache = False
            try:
                folder = resolve_model(tokenizer_from, what="tokenizer", needs="tokenizer")
                tokenizer = transformers_tokenizer(folder)  # saved as the engine reads it
                for where in folders:
                    tokenizer.save_pretrained(where)
            except (OSError, ValueError) as exc:  # HubError: a model without a tokenizer
                self.log.warning("checkpoint_without_tokenizer", model=tokenizer_from, why=str(exc))
        dist.barrier()

    def load(self, path: str) -> dict[str, Any]:
        """Model, optimizer and learning-rate schedule (DeepSpeed's), the random generators as
        they were (rank 0's, on every rank), and the ``state`` given to ``save``."""
        _, state = self.engine.load_checkpoint(os.path.join(path, "deepspeed"), tag="state")
        state = dict(state or {})
        rng = state.pop("rng", None)
        if rng:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
        return state


# ---------------------------------------------------------------- DeepSpeed C++ ops
# Ops DeepSpeed would build although training never calls them, and what they serve.
_UNUSED_OPS = {"deepspeed_shm_comm": "inference_all_reduce (tensor-parallel inference)"}
# Why an op gets built, for the warning before its compile.
_OP_USES = {
    "cpu_adam": "DeepSpeedCPUAdam, the CPU optimizer of ZeRO-Offload",
    "cpu_adagrad": "DeepSpeedCPUAdagrad, a CPU optimizer of ZeRO-Offload",
    "cpu_lion": "DeepSpeedCPULion, a CPU optimizer of ZeRO-Offload",
    "fused_adam": "FusedAdam, DeepSpeed's Adam (an `optimizer` section in deepspeed.extra)",
    "async_io": "NVMe offload (offload_optimizer / offload_param with device: nvme)",
}


class _OpCompatibility(dict):
    """``deepspeed.ops.__compatible_ops__`` that probes an op only when that op is asked about.

    DeepSpeed probes every op on the first look (compiler subprocesses for some); this probes
    with the same function, one op at a time. Iterating it shows only the ops probed so far.
    """

    def __missing__(self, name: str) -> bool:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        builder = ALL_OPS.get(name)
        if builder is None:
            ok = False
        else:
            try:
                from deepspeed.ops.op_builder.builder import probe_is_compatible
            except ImportError:  # DeepSpeed before the probe had its own function
                ok = bool(builder.is_compatible(False))
            else:
                ok = bool(probe_is_compatible(builder))
        self[name] = ok
        return ok

    def get(self, name: str, default: Any = None) -> bool:  # type: ignore[override]
        return self[name]


def import_deepspeed() -> Any:
    """``import deepspeed`` without its autotuner's ``import mlflow``: where mlflow is installed
    (the dev extras, or a user's tracker) that import was 2 of the 4.9 s DeepSpeed took to
    import, in every learner process at start; the autotuner is never used here."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` fails fast
    try:
        import deepspeed
    finally:
        if hidden and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]  # an import of mlflow later works as usual
    return deepspeed


def skip_unused_deepspeed_ops() -> None:
    """Mark the ops in ``_UNUSED_OPS`` incompatible so DeepSpeed never builds them.

    Call before ``deepspeed.init_distributed`` (its backend builds ``deepspeed_shm_comm`` when
    the op is marked compatible, and falls back to ``torch.distributed`` when it is not).
    """
    import_deepspeed()
    import deepspeed.ops

    table = vars(deepspeed.ops).get("__compatible_ops__")
    if table is None:  # not probed yet (DeepSpeed probes on first access): probe on demand
        table = _OpCompatibility()
        deepspeed.ops.__compatible_ops__ = table
    for name in _UNUSED_OPS:
        table[name] = False


def announce_deepspeed_op_builds() -> None:
    """Log a warning before DeepSpeed JIT-compiles any op, and its time after (idempotent)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    compile_op = OpBuilder.jit_load
    if getattr(compile_op, "announced", False):
        return

    def jit_load(builder: Any, verbose: bool = True) -> Any:
        log = structlog.get_logger()
        where = extension_dir(builder.name)
        cached = any(where.glob("*.so"))
        log.warning(
            "deepspeed_op_build",
            op=builder.name,
            why=_OP_USES.get(builder.name, "DeepSpeed asked for it with this configuration"),
            cache=str(where),
            cached=cached,
            note="loads the cached build" if cached else "compiling: can take a minute, once",
        )
        started = time.perf_counter()
        module = compile_op(builder, verbose)
        log.warning(
            "deepspeed_op_built", op=builder.name, seconds=round(time.perf_counter() - started, 1)
        )
        return module

    jit_load.announced = True  # type: ignore[attr-defined]
    OpBuilder.jit_load = jit_load


def extension_dir(name: str) -> Path:
    """Where ``torch.utils.cpp_extension`` builds and caches the extension ``name``.

    ``TORCH_EXTENSIONS_DIR/name`` when set; else under the user's cache directory (one per user
    and machine, shared by virtual environments), in a folder per Python and accelerator.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root) / name
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}" / name


def _padded(rows: list[np.ndarray] | list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-token values ``[B, width]`` float32, right-padded with 0 (filled in numpy: fast)."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        n = min(len(row), width)
        out[i, :n] = row[:n]
    return torch.from_numpy(out)


def _padded_mask(rows: list[np.ndarray], width: int) -> torch.Tensor:
    """Per-token flags ``[B, width]`` bool, right-padded with False."""
    out = np.zeros((len(rows), width), dtype=bool)
    for i, row in enumerate(rows):
        n = min(len(row), width)
        out[i, :n] = row[:n]
    return torch.from_numpy(out)


def lr_factor(step: int, *, optim: OptimConfig, horizon: int) -> float:
    """The learning rate's multiplier before optimizer step ``step + 1`` (0-based ``step``)."""
    warmup = optim.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if optim.schedule == "constant" or horizon <= warmup + 1:
        return 1.0
    done = min(1.0, (step - warmup) / (horizon - warmup - 1))  # 0 after warm-up, 1 at the end
    shape = 1.0 - done if optim.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape
