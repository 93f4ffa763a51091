"""The pipeline config: typed sections, YAML loading with line numbers, validation.

``load_pipeline(path, overrides, resolve=...)`` validates a whole pipeline file before anything
runs and raises one ConfigError listing every problem; see ``pipeline.config.loader``.
"""

from pipeline.config.errors import ConfigError, ConfigIssue
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
