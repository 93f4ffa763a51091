"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small protocol.

A ``Tracker`` takes the run's config once (``log_params``), metric records
(``log_metrics(values, step, wall)``), ``flush()`` (make what was logged visible; a backend
that failed in the background raises here) and ``close(status)``. Where each one writes:

- ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (``tensorboard --logdir runs/``
  compares runs); scalars at the learner's step with the event's wall time, the config as
  hyperparameters (HParams tab) and as text. Written with the ``tensorboard`` package's own
  event writer: no TensorFlow, and no torch import in the supervisor.
- ``wandb``: one W&B run, offline unless ``WANDB_MODE`` says otherwise (``wandb sync
  RUN_DIR/wandb/offline-run-*`` uploads it later), in ``RUN_DIR/wandb/`` (``WANDB_DIR`` wins);
  project ``run.name`` (``WANDB_PROJECT`` wins), run name the run directory's name. Metrics use
  ``learner_step`` as their x-axis, so events that arrive late still land at their step.
- ``mlflow``: one MLflow run in experiment ``run.name``; the store is ``MLFLOW_TRACKING_URI``
  when set, else a file store in ``RUN_DIR/mlruns`` (MLflow 3 keeps that store behind
  ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for it;
  ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`` shows it).
  Params are the flattened config (``stages.learner.steps``); the run ends FINISHED, FAILED or
  KILLED with the run's status.

A resumed run continues the same W&B and MLflow runs: their ids are kept in
``RUN_DIR/trackers.json``. The packages are optional extras, imported only when a tracker is
opened; ``missing_packages`` and ``config_issues`` say, before anything starts, which extra to
install. This module knows nothing about log events (``pipeline.tracking.metrics``) or when
to write (``pipeline.tracking.feed``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipeline.config.errors import ConfigIssue

__all__ = [
    "EXTRAS",
    "TRACKERS",
    "Tracker",
    "config_issues",
    "flatten",
    "missing_packages",
    "open_tracker",
]

TRACKERS = ("tensorboard", "wandb", "mlflow")
# what each optional feature imports, and the extra of inflight-rl that installs it
EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "plot": ("matplotlib", "plot"),
}
_IDS_FILE = "trackers.json"
_MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class Tracker(Protocol):
    """One experiment tracker of one run; every method may raise (the feed disables it)."""

    name: str

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int, wall: float) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str = "succeeded") -> None: ...


def missing_packages(names: Sequence[str]) -> dict[str, str]:
    """``{feature: "pip install 'inflight-rl[EXTRA]'"}`` for each of ``names`` (a tracker or
    ``plot``) whose package cannot be imported here. Finds modules without importing them."""
    missing = {}
    for name in names:
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            missing[name] = f"pip install 'inflight-rl[{extra}]'"
    return missing


def config_issues(run: Any, where: Callable[[str], str]) -> list[ConfigIssue]:
    """Problems with ``run.trackers`` and ``run.plot`` (a ``RunSection``) on this machine: a
    tracker listed twice, a package that is not installed. ``where(path)`` locates a key."""
    from pipeline.config.errors import ConfigIssue  # not at import: the loader imports us

    issues = []
    seen: set[str] = set()
    for i, name in enumerate(run.trackers):
        path = f"run.trackers[{i}]"
        if name in seen:
            issues.append(ConfigIssue(path, f"{name!r} is listed twice", where(path)))
            continue
        seen.add(name)
        install = missing_packages([name]).get(name)
        if install:
            module = EXTRAS[name][0]
            issues.append(
                ConfigIssue(
                    path,
                    f"tracker {name!r} needs the {module} package, which is not installed "
                    f"here: {install} (or remove it from run.trackers)",
                    where(path),
                )
            )
    if run.plot and missing_packages(["plot"]):
        issues.append(
            ConfigIssue(
                "run.plot",
                "a plot needs matplotlib, which is not installed here: "
                f"{missing_packages(['plot'])['plot']} (or set run.plot: false)",
                where("run.plot"),
            )
        )
    return issues


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"run": {"name": "x"}}`` -> ``{"run.name": "x"}``; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class _Ids:
    """Tracker run ids of this run directory (``trackers.json``), so a resume continues them."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / _IDS_FILE

    def get(self, name: str) -> str | None:
        try:
            value = json.loads(self.path.read_text()).get(name)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def put(self, name: str, value: str) -> None:
        try:
            ids = json.loads(self.path.read_text())
        except (OSError, ValueError):
            ids = {}
        ids = ids if isinstance(ids, dict) else {}
        ids[name] = value
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(ids, indent=1))
        tmp.replace(self.path)


# --------------------------------------------------------------------------- TensorBoard


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        # flushed by the feed after every batch; the queue bounds what a stuck disk holds
        self._writer = EventFileWriter(str(log_dir), max_queue_size=1000, flush_secs=5)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from google.protobuf import struct_pb2
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.hparams import metadata as hparams_metadata
        from tensorboard.plugins.hparams import plugin_data_pb2
        from tensorboard.plugins.text import metadata as text_metadata

        flat = flatten(params)
        hparams = {}
        for key, value in flat.items():
            if isinstance(value, bool):
                hparams[key] = struct_pb2.Value(bool_value=value)
            elif isinstance(value, (int, float)):
                hparams[key] = struct_pb2.Value(number_value=float(value))
            else:
                hparams[key] = struct_pb2.Value(string_value=_text(value))
        start = plugin_data_pb2.HParamsPluginData(
            session_start_info=plugin_data_pb2.SessionStartInfo(
                hparams=hparams, start_time_secs=time.time()
            )
        )
        table = "\n".join(f"    {key}: {_text(value)}" for key, value in flat.items())
        text = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[table.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        values = [
            summary_pb2.Summary.Value(
                tag=hparams_metadata.SESSION_START_INFO_TAG,
                metadata=hparams_metadata.create_summary_metadata(start),
            ),
            summary_pb2.Summary.Value(
                tag="config",
                metadata=text_metadata.create_summary_metadata("config", "the run's config"),
                tensor=text,
            ),
        ]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=values))
        )

    def log_metrics(self, metrics: Mapping[str, float], step: int, wall: float) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_event(
            self._event(wall_time=wall, step=step, summary=self._summary(value=values))
        )

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str = "succeeded") -> None:
        self._writer.close()


# --------------------------------------------------------------------------- Weights & Biases


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str) -> None:
        import wandb

        ids = _Ids(run_dir)
        run_id = ids.get("wandb") or secrets.token_hex(4)
        settings = wandb.Settings(
            # the supervisor's console and signals stay its own
            console="off",
            silent=True,
            x_disable_stats=True,
            save_code=False,
            disable_git=True,
            **({} if os.environ.get("WANDB_MODE") else {"mode": "offline"}),
        )
        wandb_dir = None if os.environ.get("WANDB_DIR") else run_dir
        if wandb_dir is not None:
            (wandb_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or project,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=None if wandb_dir is None else str(wandb_dir),
            settings=settings,
        )
        ids.put("wandb", run_id)
        self.dir = Path(self._run.dir).parent  # RUN_DIR/wandb/offline-run-.../
        self._run.define_metric("learner_step")
        self._run.define_metric("*", step_metric="learner_step")

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int, wall: float) -> None:
        self._run.log({**metrics, "learner_step": step})

    def flush(self) -> None:
        pass  # wandb's own service process writes as it goes

    def close(self, status: str = "succeeded") -> None:
        self._run.finish(exit_code=0 if status == "succeeded" else 1)


# --------------------------------------------------------------------------- MLflow


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, experiment: str, run_name: str) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self._metric, self._param = Metric, Param
        self._max_value = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        self._per_batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            store = run_dir.resolve() / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
            # MLflow 3 refuses its file store unless asked for it; here it is what was asked
            if not os.environ.get("MLFLOW_ALLOW_FILE_STORE"):
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
        ids = _Ids(run_dir)
        self.run_id = ids.get("mlflow") or ""
        if self.run_id:
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
            ids.put("mlflow", self.run_id)

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [
            self._param(key[:250], _text(value)[: self._max_value])
            for key, value in flatten(params).items()
        ]
        # a resumed run may change a value: MLflow refuses to overwrite params, so log new ones
        have = self._client.get_run(self.run_id).data.params
        items = [p for p in items if p.key not in have]
        for i in range(0, len(items), self._per_batch):
            self._client.log_batch(self.run_id, params=items[i : i + self._per_batch])

    def log_metrics(self, metrics: Mapping[str, float], step: int, wall: float) -> None:
        ms = int(wall * 1000)
        batch = [self._metric(key, value, ms, step) for key, value in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def flush(self) -> None:
        pass  # each log_batch is written when it returns

    def close(self, status: str = "succeeded") -> None:
        self._client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FAILED"))


def open_tracker(name: str, run_dir: Path, *, project: str, run_name: str) -> Tracker:
    """Open tracker ``name`` for the run in ``run_dir``; raises whatever the backend raises
    (ImportError when its package is missing)."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir / "tensorboard")
    if name == "wandb":
        return WandbTracker(run_dir, project, run_name)
    if name == "mlflow":
        return MlflowTracker(run_dir, project, run_name)
    raise ValueError(f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
