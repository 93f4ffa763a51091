"""The pipeline config: typed sections, YAML loading with line numbers, validation.

``load_pipeline(path, overrides, resolve=...)`` validates a whole pipeline file before anything
runs and raises one ConfigError listing every problem; see ``pipeline.config.loader``.

The names below are imported when first used: a stage process builds its section from its spec
(``pipeline.config.typed``) and never loads a pipeline file, so it does not import the loader,
its checks, the trackers and the log viewer they bring.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.config.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from pipeline.config.loader import LoadedPipeline, load_pipeline
    from pipeline.config.schema import (
        STAGE_KEYS,
        PipelineConfig,
        RestartPolicy,
        RunSection,
        StageSection,
        TransportSection,
    )
    from pipeline.config.yaml_source import dump_yaml

_WHERE = {
    "LoadedPipeline": "loader",
    "load_pipeline": "loader",
    "STAGE_KEYS": "schema",
    "PipelineConfig": "schema",
    "RestartPolicy": "schema",
    "RunSection": "schema",
    "StageSection": "schema",
    "TransportSection": "schema",
    "dump_yaml": "yaml_source",
}

__all__ = [
    "STAGE_KEYS",
    "ConfigError",
    "ConfigIssue",
    "LoadedPipeline",
    "PipelineConfig",
    "RestartPolicy",
    "RunSection",
    "StageSection",
    "TransportSection",
    "dump_yaml",
    "load_pipeline",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
