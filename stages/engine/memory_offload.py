"""Memory given back while a trainer shares the accelerator: SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation``.

Colocated RL (verl's and slime's hybrid engines) runs the trainer on the GPUs the inference engine
holds: between rollouts the engine releases its KV cache and weights, the trainer steps, then the
engine takes them back (weights first, so that the new ones can be loaded into them, then the KV
cache). SGLang 0.5.23 (``scheduler_components/weight_updater.py``) takes the tags ``kv_cache``,
``weights`` and ``cuda_graph`` (none or an empty list: all three), only while the server is idle
(nothing running, nothing waiting unless generation is paused), and resuming a tag that was not
released fails.

Here:

- ``kv_cache``: the slot cache's storage is freed (``BatchKV.release``) and the prefix cache
  flushed; the next admission allocates it afresh.
- ``weights``: on an accelerator, every storage under the model's parameters and buffers is
  copied to pinned host memory and resized to nothing (``WeightOffload``), so that the tensors
  viewing it (the fused q/k/v and gate/up weights of the engine's forward, tied embeddings) keep
  their places, and resuming copies the bytes back into the same storages: the weights come back
  as they were, as SGLang's do with ``--enable-weights-cpu-backup``. A model on the CPU has
  nothing to give back and stays as it is.
- ``cuda_graph``: this engine captures none; the tag is taken and does nothing.

While ``weights`` or ``kv_cache`` is released the scheduler runs nothing (requests wait, as if
paused), and weight updates and ``/get_weights_by_name`` are refused until the weights are
resumed. Other tags are accepted and kept, as SGLang keeps them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

__all__ = ["ALL_TAGS", "KV_CACHE", "WEIGHTS", "MemoryState", "MemoryStateError", "WeightOffload"]

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
IDLE_ONLY = "release_memory_occupation should be called only when server is idle."


class MemoryStateError(ValueError):
    """A release or resume the engine's state does not allow (the route answers 400)."""


class WeightOffload:
    """``model``'s weights moved to host memory and back, every view of them kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        seen: set[int] = set()
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            storage = tensor.untyped_storage()
            if storage.device.type == "cpu" or storage.nbytes() == 0:
                continue
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            self._saved.append((storage, torch.empty(0, dtype=torch.uint8)))
        self.nbytes = sum(storage.nbytes() for storage, _ in self._saved)

    def release(self) -> int:
        """Copy each storage out and free it; returns the bytes given back."""
        kept = []
        for storage, _ in self._saved:
            data = _bytes_of(storage)
            host = torch.empty(
                data.numel(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda"
            )
            host.copy_(data)
            kept.append((storage, host))
        if kept:
            torch.accelerator.synchronize(kept[0][0].device)
        for storage, _ in kept:
            storage.resize_(0)
        self._saved = kept
        if kept and kept[0][0].device.type == "cuda":
            torch.cuda.empty_cache()
        return self.nbytes

    def restore(self) -> None:
        """Give each storage its bytes back, in place."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        if self._saved:
            torch.accelerator.synchronize(self._saved[0][0].device)
        self._saved = [(storage, torch.empty(0, dtype=torch.uint8)) for storage, _ in self._saved]


class MemoryState:
    """The tags released and not resumed yet, with SGLang's rules for changing them."""

    def __init__(self) -> None:
        self.released: list[str] = []
        # readers of the weights outside the scheduler thread (a send to a remote instance):
        # the weights may not be released under them
        self.lent = 0

    @property
    def holds_generation(self) -> bool:
        """Whether the scheduler may not run (its weights or KV cache are gone)."""
        return WEIGHTS in self.released or KV_CACHE in self.released

    @property
    def weights_out(self) -> bool:
        return WEIGHTS in self.released

    def to_release(self, tags: Iterable[str] | None, idle: bool) -> list[str]:
        """The tags a release asks for (none: all), recorded as released; refused unless
        ``idle``. Returns those not released before."""
        if not idle:
            raise MemoryStateError(IDLE_ONLY)
        wanted = _tags(tags)
        new = [t for t in wanted if t not in self.released]
        if WEIGHTS in new and self.lent:
            raise MemoryStateError(
                "release_memory_occupation: the weights are being sent to a remote instance "
                "(/send_weights_to_remote_instance); release them once that ends"
            )
        self.released += new
        return new

    def to_resume(self, tags: Iterable[str] | None) -> list[str]:
        """The tags a resume asks for (none: all), each of which must be released."""
        wanted = _tags(tags)
        missing = [t for t in wanted if t not in self.released]
        if missing:
            raise MemoryStateError(
                f"tags: {missing[0]!r} is not released (released: {self.released or 'none'})"
            )
        self.released = [t for t in self.released if t not in wanted]
        return wanted

    def refuse_weights(self, what: str) -> None:
        """Raise if the weights are released: ``what`` cannot run on them."""
        if self.weights_out:
            raise MemoryStateError(
                f"{what}: the weights are released (/release_memory_occupation); resume them "
                'first (/resume_memory_occupation with tags ["weights"])'
            )


def _tags(tags: Iterable[str] | None) -> list[str]:
    wanted = list(dict.fromkeys(tags or ()))
    return wanted or list(ALL_TAGS)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat byte tensor over all of ``storage``."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),), (1,))
