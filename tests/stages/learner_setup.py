"""Set-up shared by the learner's tests: one torch thread, a tiny in-memory policy, and ranks of a
real gloo process group in spawned processes.

Plain functions: a test module's fixtures and rank functions call them (no conftest, no plugin).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from transport.address import rendezvous_port


def one_torch_thread() -> Iterator[None]:
    """The body of a module's autouse fixture: torch on one thread while the module runs."""
    # Tiny models on a shared machine: extra intra-op threads only spin against other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_policy(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random tiny Qwen2 (vocab 64, hidden 32, 2 layers; seed 0) in eval mode, its matrices
    drawn wide (std 0.3) so that log-probs are far from uniform. Tests of logic (masks,
    padding, micro-batches) take it in float64: see ``tests/numerics.py``."""
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.to(dtype).eval()  # the same weights whatever the dtype


def join_rank(rank: int, world: int, port: int) -> None:
    """In a rank's process: the environment ``torch.distributed`` reads, and one thread."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def _rank_main(target: Callable[..., None], *args: Any) -> None:
    """A rank's process: ``target(*args)``, then out without the interpreter's teardown, as the
    supervisor's stage processes leave (``pipeline.processes.exit_now``): gloo's threads may
    otherwise abort it at exit ("terminate called without an active exception") after its work
    is done. An exception still fails the rank (exit 1, its traceback on stderr)."""
    import traceback

    from pipeline.processes import exit_now

    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    exit_now(0)


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``target(rank, world, port, *args)`` for every rank in a spawned process (a fresh
    interpreter, as the supervisor starts ranks) and wait; every rank must exit 0."""
    port = rendezvous_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, world, port, *args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=200)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
