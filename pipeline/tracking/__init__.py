"""Experiment trackers (TensorBoard, W&B, MLflow) fed by the supervisor from the run's logs.

``run.trackers: [tensorboard, wandb, mlflow]`` in a pipeline file turns them on. There is one
writer per run, the supervisor: it tails the structured events every replica writes
(``RUN_DIR/logs/*.jsonl``) and logs one TensorBoard directory, one W&B run and one MLflow run
for the whole experiment, with the run's config as hyperparameters and every stage's metrics
(the learner's ``train_step`` and ``eval`` events, generator throughput, in-flight and lag from
``metrics`` events) against the learner's step and the events' wall time. A tracker per process
would split one experiment into as many runs as there are replicas.

- ``metrics``: which event becomes which metric name (``train/reward``, ``eval/accuracy``,
  ``generator/samples_per_s`` ...); ``pipeline.plot`` reads runs through it too.
- ``backends``: the ``Tracker`` protocol and the three backends; ``config_issues`` (a missing
  package is a config error naming the extra to install).
- ``feed``: ``TrackerFeed``, the supervisor's task; a failing tracker is logged once, counted and
  disabled while the run goes on.

Nothing here imports a tracker's package until a tracker is opened.
"""

from pipeline.tracking.backends import (
    EXTRAS,
    TRACKERS,
    Tracker,
    config_issues,
    missing_packages,
    open_tracker,
)
from pipeline.tracking.feed import TrackerFeed
from pipeline.tracking.metrics import MetricMapper, Record, event_wall

__all__ = [
    "EXTRAS",
    "TRACKERS",
    "MetricMapper",
    "Record",
    "Tracker",
    "TrackerFeed",
    "config_issues",
    "event_wall",
    "missing_packages",
    "open_tracker",
]
