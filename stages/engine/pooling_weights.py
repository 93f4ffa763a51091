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
step-boundary turns. Sending weights to a new engine (``remote_instance``) is the generating
engine's alone; so is releasing memory.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog
import torch
from aiohttp import web

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
        return self.pooler.between_passes(lambda: fn(self.model))

    def parameter_rows(self, name: str, rows: int) -> Future[torch.Tensor | None]:
        return self.with_weights("get_weights_by_name", lambda m: parameter_rows(m, name, rows))


def add_weight_routes(app: web.Application, pooler: Pooler, model_path: str) -> WeightRoutes:
    """SGLang's weight-update routes, ``/get_weights_by_name``, ``/weights_checker`` and
    ``/update_weight_version`` on a pooling engine's ``app``."""
    weights = WeightRoutes(PoolingWeights(pooler), model_path)  # type: ignore[arg-type]
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
    }
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/get_weights_by_name", weights.weights_by_name)
        app.router.add_route(method, "/weights_checker", weights.check)
    app.on_cleanup.append(weights.close)
    return weights
