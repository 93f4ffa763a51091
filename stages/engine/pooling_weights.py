"""Weight updates of a pooling engine (a reward, classification or embedding model).

SGLang 0.5.23 serves its weight routes on any model: one ``ModelRunner`` loads a reward
model's new weights as it loads a generating model's. A trainer that updates a reward model (an
online or iteratively retrained one) or an embedding model therefore calls the same routes on
either. ``PoolingWeights`` is what ``stages.engine.weight_routes.WeightRoutes`` asks of the
generating engine's scheduler, over the pooling thread (``stages.engine.pooling.Pooler``):
every read or write of the weights runs on that thread between two passes, so a pass never
sees half an update, and queued prompts are scored by the weights live when their pass starts.

What a pooling engine lacks it has nothing to do for: no prefix cache to flush, no running
request to abort (its passes are not interrupted: an abort waits for the one under way), no
step-boundary turns. ``/release_memory_occupation`` and ``/resume_memory_occupation`` give the
weights back to a colocated trainer and take them back, as the generating engine does
(``stages.engine.memory_offload``): the prompts that come meanwhile wait. A new pooling engine
started with ``--load-format remote_instance`` takes this one's live weights and version
(``stages.engine.remote_instance``), read between two passes and sent while passes go on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog
import torch
from aiohttp import web

from stages.engine.memory_offload import WEIGHTS, WeightOffload
from stages.engine.memory_routes import MemoryRoutes
from stages.engine.model_weights import load_named_tensors, parameter_rows
from stages.engine.pooling import Pooler
from stages.engine.weight_routes import WeightRoutes

__all__ = ["PoolingWeights", "add_weight_routes"]

log = structlog.get_logger("stages.engine.pooling_weights")

T = TypeVar("T")


class PoolingWeights:
    """The scheduler's weight surface (``apply_weights``, ``with_weights``...) for ``pooler``."""

    turns = None  # no decode steps to lift turns around

    def __init__(self, pooler: Pooler) -> None:
        self.pooler = pooler
        self._offload: WeightOffload | None = None  # the weights while released

    @property
    def model(self) -> torch.nn.Module:
        return self.pooler.model.loaded.model

    @property
    def weight_version(self) -> str:
        return self.pooler.weight_version

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Future[int]:
        """Nothing runs that an abort could end: resolves after the pass under way."""
        return self.pooler.between_passes(lambda: 0)

    def apply_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], version: str | int | None
    ) -> Future[None]:
        """Load tensors between two passes, and (when given) the new weight version."""

        def load() -> None:
            self.pooler.memory.refuse_weights("a weight update")
            count = load_named_tensors(self.model, named_tensors)
            if version is not None:
                self.pooler.weight_version = str(version)
            log.debug("weights_applied", version=self.pooler.weight_version, tensors=count)

        return self.pooler.between_passes(load)

    def set_weight_version(self, version: str | int) -> Future[None]:
        def set_version() -> None:
            self.pooler.weight_version = str(version)

        return self.pooler.between_passes(set_version)

    def flush_prefix_cache(self) -> Future[int]:
        """No prefix cache: nothing dropped."""
        return self.pooler.between_passes(lambda: 0)

    def with_weights(self, what: str, fn: Callable[[torch.nn.Module], T]) -> Future[T]:
        """``fn(model)`` between two passes; refused while the weights are released."""

        def run() -> T:
            self.pooler.memory.refuse_weights(what)
            return fn(self.model)

        return self.pooler.between_passes(run)

    def release_memory(self, tags: Sequence[str] | None) -> Future[list[str]]:
        """SGLang's ``/release_memory_occupation`` (``stages.engine.memory_offload``), only while
        nothing waits: ``weights`` moved to host memory (a model on the CPU keeps them), the
        prompts that come meanwhile held until they are back; ``kv_cache`` and ``cuda_graph``
        taken and kept (a pooling engine has neither), ``kv_cache`` holding prompts as well."""

        def release() -> list[str]:
            new = self.pooler.memory.to_release(tags, self.pooler.idle)
            freed = 0
            if WEIGHTS in new:
                self._offload = WeightOffload(self.model)
                freed = self._offload.release()
            log.info("memory_released", tags=new, bytes=freed, released=self.released_memory())
            return new

        return self.pooler.between_passes(release)

    def resume_memory(self, tags: Sequence[str] | None) -> Future[list[str]]:
        def resume() -> list[str]:
            resumed = self.pooler.memory.to_resume(tags)
            if WEIGHTS in resumed and self._offload is not None:
                self._offload.restore()
                self._offload = None
            log.info("memory_resumed", tags=resumed, released=self.released_memory())
            return resumed

        return self.pooler.between_passes(resume)

    def released_memory(self) -> list[str]:
        return list(self.pooler.memory.released)

    def lend_weights(self, what: str) -> Future[list[tuple[str, torch.Tensor]]]:
        """The model's parameters (``named_parameters``, in order) between two passes, for a
        new engine's weights (``remote_instance``), read on another thread while passes go
        on; the weights may not be released until ``return_weights`` (the weight routes keep
        updates out meanwhile). Refused while they are released."""

        def lend() -> list[tuple[str, torch.Tensor]]:
            self.pooler.memory.refuse_weights(what)
            self.pooler.memory.lent += 1
            return list(self.model.named_parameters())

        return self.pooler.between_passes(lend)

    def return_weights(self) -> Future[None]:
        """End a ``lend_weights``."""

        def back() -> None:
            self.pooler.memory.lent -= 1

        return self.pooler.between_passes(back)

    def parameter_rows(self, name: str, rows: int) -> Future[torch.Tensor | None]:
        return self.with_weights("get_weights_by_name", lambda m: parameter_rows(m, name, rows))


def add_weight_routes(app: web.Application, pooler: Pooler, model_path: str) -> WeightRoutes:
    """SGLang's weight-update routes, ``/get_weights_by_name``, ``/weights_checker``,
    ``/update_weight_version`` and the memory routes on a pooling engine's ``app``."""
    control = PoolingWeights(pooler)
    weights = WeightRoutes(control, model_path)  # type: ignore[arg-type]
    MemoryRoutes(control).add_to(app)
    routes: dict[str, Any] = {
        "/init_weights_update_group": weights.init_group,
        "/update_weights_from_distributed": weights.update,
        "/destroy_weights_update_group": weights.destroy_group,
        "/begin_weight_update": weights.begin,
        "/end_weight_update": weights.end,
        "/update_weights_from_disk": weights.update_from_disk,
        "/update_weights_from_tensor": weights.update_from_tensor,
        "/update_weights_from_ipc": weights.update_from_ipc,
        "/update_weight_version": weights.update_version,
        # a new engine's weights from this one (stages.engine.remote_instance)
        "/init_weights_send_group_for_remote_instance": weights.init_send_group,
        "/send_weights_to_remote_instance": weights.send_weights,
    }
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/get_weights_by_name", weights.weights_by_name)
        app.router.add_route(method, "/weights_checker", weights.check)
    app.on_shutdown.append(weights.stop_joining)
    app.on_cleanup.append(weights.close)
    return weights
