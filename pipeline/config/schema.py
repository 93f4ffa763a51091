"""The pipeline YAML's typed sections, with every default in one place.

A pipeline file has three top-level sections::

    run:        # the run as a whole: name, where run directories go, timeouts, logging
    transport:  # how stages are wired: address scheme, default inbox bound, heartbeats
    stages:     # one entry per stage: which plugin (`use`), replicas, restart policy, wiring,
                # and the stage's own options, checked against the plugin's Config dataclass

Field metadata understood by the validator (``pipeline.config.typed``): ``min``/``max`` bounds,
``doc`` (shown by error messages and ``inflight stages``), ``path`` (the value names a file:
``True``, ``"model"`` for a folder or Hub id, ``"command"``; a relative one is resolved against
the config file's folder, ``pipeline.config.paths``), ``check`` (a function run on the value at
validation), ``device`` (a torch device the process must have, ``pipeline.config.checks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "STAGE_KEYS",
    "PipelineConfig",
    "RaySection",
    "Resources",
    "RestartPolicy",
    "RunSection",
    "StageSection",
    "TransportSection",
]


def _f(default: Any, doc: str, **meta: Any) -> Any:
    return field(default=default, metadata={"doc": doc, **meta})


@dataclass
class RaySection:
    address: str = _f(
        "auto",
        "the cluster to join: 'auto' (the one `ray start` made on this machine), "
        "ray://HOST:PORT, or 'local' (start a one-node cluster for this run)",
    )
    namespace: str | None = _f(None, "Ray namespace of the run's actors (default: the run's)")
    placement_timeout_s: float = _f(
        60.0,
        "how long to wait for the cluster to place a replica or gang before the run fails "
        "naming what could not be placed (a replica whose resources are free by then gets 60 s "
        "more: Ray is still starting its worker)",
        min=1.0,
    )


@dataclass
class RunSection:
    name: str = _f("inflight", "run name; run directories are RUNS_ROOT/NAME-TIMESTAMP")
    runs_root: str = _f(
        "runs", "where run directories are made when --run-dir is not given", path=True
    )
    mode: Literal["async", "sync"] = _f(
        "async",
        "async: generation never waits for training; sync: generate a batch with the current "
        "weights, score, train, publish, repeat (for A/B comparisons)",
    )
    seed: int = _f(0, "base seed; replica r of a stage gets seed + r")
    log_level: Literal["debug", "info", "warning", "error"] = _f(
        "info", "lowest level written to the log files"
    )
    console_level: Literal["debug", "info", "warning", "error"] = _f(
        "info", "lowest level shown on the console"
    )
    console_every_s: float = _f(
        10.0, "not on a terminal (CI, | tee): seconds between two status lines", min=0.1
    )
    metrics_every_s: float = _f(
        10.0, "how often each replica logs channel and stage metrics", min=0.1
    )
    heartbeat_s: float = _f(1.0, "how often each replica sends a heartbeat", min=0.05)
    heartbeat_timeout_s: float = _f(
        60.0, "a replica silent this long is killed and handled as failed", min=0.5
    )
    startup_timeout_s: float = _f(
        120.0, "time a replica may take to send its first heartbeat", min=1.0
    )
    shutdown_timeout_s: float = _f(
        8.0, "on shutdown, time replicas get to exit before they are killed", min=0.1
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(
        default_factory=list,
        metadata={
            "doc": "experiment trackers the supervisor feeds from the run's logs: one "
            "TensorBoard dir (RUN_DIR/tensorboard), W&B run (offline unless WANDB_MODE says "
            "otherwise) and MLflow run (RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set) for "
            "the whole run; each needs its extra: pip install 'inflight-rl[tensorboard]'"
        },
    )
    plot: bool = _f(
        False,
        "at the end of the run, draw reward, held-out accuracy, lag and samples/s into "
        "RUN_DIR/plot.png (needs pip install 'inflight-rl[plot]')",
    )
    trust_remote_code: bool = _f(
        False,
        "run the code a model folder ships (its auto_map: its own config, model or tokenizer "
        "classes) in every stage that loads it and in the engines the generators launch "
        "(SGLang's --trust-remote-code); without it such a folder fails at once, saying so",
    )
    share_process: Literal["auto", "all", "none"] = _f(
        "auto",
        "local launcher: stages that reserve no cores or GPUs and are not gangs run as "
        "coroutines of one process, linked in-process, each with its own restart policy. auto: "
        "those whose class allows it (shares_process: the feeder, generator and scorer); all: "
        "every such stage (one that blocks its event loop stalls the others); none: a process each",
    )
    launcher: Literal["local", "ray"] = _f(
        "local",
        "local: every replica a child process on this host; ray: every replica and engine a "
        "Ray actor placed with its resources on a Ray cluster (pip install 'inflight-rl[ray]')",
    )
    ray: RaySection = field(
        default_factory=lambda: RaySection(), metadata={"doc": "the Ray launcher's settings"}
    )


# run.trust_remote_code's carrier: set to "1" for every process of a run that trusts model
# folders' own code (stages.remote_code reads it)
TRUST_REMOTE_CODE_ENV = "INFLIGHT_TRUST_REMOTE_CODE"


@dataclass
class TransportSection:
    scheme: Literal["ipc", "tcp"] = _f("ipc", "address scheme for stage inboxes")
    host: str = _f("127.0.0.1", "host for tcp addresses (loopback by default)")
    inbox: int = _f(64, "default bound of every input port's inbox, in messages", min=1)
    peer_timeout_s: float = _f(
        10.0, "a peer silent this long is taken as gone and its credit reclaimed", min=0.1
    )
    max_message_mb: float = _f(
        512.0,
        "largest frame an inbox takes, in MiB: a peer that sends a larger one is disconnected "
        "before it is allocated (0 = no limit)",
        min=0.0,
    )
    curve: bool | None = _f(
        None,
        "encrypt and authenticate every ZeroMQ socket with CURVE keys made for the run; "
        "null: on exactly when sockets bind off loopback (the Ray launcher, a non-loopback host)",
    )
    insecure: bool = _f(
        False,
        "allow sockets off loopback without CURVE (anyone who reaches the port can send): "
        "only on a network you trust",
    )


@dataclass
class RestartPolicy:
    policy: Literal["never", "on-failure"] = _f(
        "on-failure", "what to do when a replica exits non-zero or stops answering"
    )
    max_restarts: int = _f(3, "restarts allowed per replica before the run fails", min=0)
    backoff_s: float = _f(
        0.5, "first restart delay; doubles with failures in a row, capped at 30 s", min=0.0
    )


@dataclass
class Resources:
    """What one replica (or one engine a stage launches) needs from the host.

    A count is filled by the launcher from what nobody else reserved; an explicit list of ids is
    for the stage (or launch) as a whole and is split evenly, in order, among its replicas (or
    engines). Asking for nothing (the default) leaves a process where it would be without
    placement. Placement (``pipeline.placement``) reads these fields by name, so more kinds of
    resource (memory, custom) are more fields here, not a new shape of plan.
    """

    cpus: int | list[int] | None = field(
        default=None,
        metadata={
            "doc": "CPU cores per replica: a count, or a list of core ids shared out among the "
            "replicas; null: float on the cores nobody reserved",
            "min": 1,
        },
    )
    gpus: int | list[int] = field(
        default=0,
        metadata={
            "doc": "GPUs per replica: a count, or a list of GPU ids shared out among the replicas",
            "min": 0,
        },
    )
    memory_gb: float | None = field(
        default=None,
        metadata={
            "doc": "memory per replica in GiB: the Ray launcher reserves it on a node; the local "
            "launcher checks that the host has it",
            "min": 0.0,
        },
    )
    custom: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "doc": "custom resources per replica ({node_gpu_a100: 1}): Ray places the replica "
            "on a node that has them; the local launcher refuses any (one host has none)",
        },
    )


# Keys of a stage entry that belong to the runtime; every other key is a stage option.
STAGE_KEYS = ("use", "replicas", "restart", "inbox", "inputs", "env", "resources")


@dataclass
class StageSection:
    use: str = field(
        metadata={"doc": "registered plugin name, or a dotted path package.module:Class"}
    )
    replicas: int = _f(1, "number of replica processes", min=1)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    inbox: int | None = _f(
        None, "bound of this stage's input inboxes (default transport.inbox)", min=1
    )
    inputs: dict[str, str | list[str]] = field(
        default_factory=dict,
        metadata={"doc": "input port -> upstream 'stage.port' (or a list of them)"},
    )
    env: dict[str, str] = field(
        default_factory=dict, metadata={"doc": "extra environment variables for the replicas"}
    )
    resources: Resources = field(
        default_factory=Resources,
        metadata={
            "doc": "cores and GPUs each replica gets to itself (`{cpus: 2, gpus: 1}`); none "
            "asked for: the replica floats on the cores nobody reserved"
        },
    )
    # The stage's own options, built into the plugin's Config dataclass by the loader.
    options: Any = None


@dataclass
class PipelineConfig:
    run: RunSection = field(default_factory=RunSection)
    transport: TransportSection = field(default_factory=TransportSection)
    stages: dict[str, StageSection] = field(default_factory=dict)
