"""pipeline.tracking: events to metric names, the three trackers read back, failures, config.

The feed tests write a synthetic run's log files and feed real backends (TensorBoard event
files, a W&B offline run, an MLflow file store), then read back what they wrote with each
tool's own reader. ``test_tracking_run.py`` does it once through a real ``inflight run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.tracking import MetricMapper, TrackerFeed, config_issues, event_wall

# The trackers' libraries are imported at collection, on one thread (test_tracking_run.py
# imports this module too): imported inside a test, wandb's pydantic models run ast.parse while
# threads an earlier test of the same worker left may run it too, and CPython 3.11.7's AST
# constructor then fails ("SystemError: AST constructor recursion depth mismatch"; seen with
# the suite on two workers).
for _library in (
    "tensorboard.backend.event_processing.event_accumulator",
    "wandb",
    "mlflow.tracking",
):
    with contextlib.suppress(ImportError):
        importlib.import_module(_library)

T0 = 1_795_000_000.0  # the synthetic run's first second (Unix time)


def ev(second: float, who: str, event: str, **kv) -> dict:
    from datetime import datetime, timezone

    stage, _, replica = who.partition(".")
    ts = datetime.fromtimestamp(T0 + second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "ts": ts,
        "level": "info",
        "event": event,
        "stage": stage,
        "replica": int(replica or 0),
        "version": kv.pop("version", 0),
        **kv,
    }


def append(path: Path, *events: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")


def learner_events(steps: range, start: float = 0.0) -> list[dict]:
    out = []
    for step in steps:
        t = start + step
        out.append(
            ev(
                t,
                "learner.0",
                "train_step",
                step=step,
                reward=step / 10,
                lag=0.5,
                lag_max=1,
                samples_per_s=100.0 + step,
                skipped=0,
                version=step,
            )
        )
    return out


# --------------------------------------------------------------------------- mapping


def test_mapper_names_steps_and_rates():
    m = MetricMapper({"generator": 1})
    first = m.map(ev(0.5, "generator.0", "metrics", in_flight=8, emitted=100, tokens=1000))
    assert first.step == 0 and "generator/samples_per_s" not in first.metrics  # no rate yet
    r = m.map(ev(1, "learner.0", "train_step", step=3, reward=0.25, lag=1.5, ok=True, note="x"))
    assert (r.step, r.wall) == (3, T0 + 1)
    assert r.metrics == {"train/reward": 0.25, "train/lag": 1.5}  # no bools, strings, `step`
    assert m.map(ev(1.2, "learner.1", "train_step", step=3, reward=0.1)) is None  # rank 1
    # a generator's running counters become rates between two of its events
    r = m.map(
        ev(
            2.5,
            "generator.0",
            "metrics",
            in_flight=6,
            emitted=300,
            tokens=3000,
            engine_version=2,
            version=3,
            targets={"http://x": 64},
        )
    )
    assert r.step == 3  # no step of its own: the learner's latest
    assert r.metrics["generator/samples_per_s"] == pytest.approx(100.0)
    assert r.metrics["generator/tokens_per_s"] == pytest.approx(1000.0)
    assert r.metrics["generator/engine_lag"] == 1.0
    assert r.metrics["generator/in_flight"] == 6.0 and "generator/targets" not in r.metrics
    # a restarted replica counts from 0 again: no negative rate
    r = m.map(ev(3.5, "generator.0", "metrics", emitted=10, tokens=90))
    assert "generator/samples_per_s" not in r.metrics
    r = m.map(ev(4, "learner.0", "eval", step=0, accuracy=0.6, policy_version=0, versions=[0]))
    assert (r.step, r.metrics) == (0, {"eval/accuracy": 0.6})
    chan = m.map(ev(5, "scorer.0", "metrics", uptime_s=15.0, **{"in.rollouts.depth": 4}))
    assert chan.metrics == {"channels/scorer/in.rollouts.depth": 4.0}
    pub = m.map(ev(5, "learner.0", "metrics", component="publisher", publish_s=0.02))
    assert pub.metrics == {"publisher/publish_s": 0.02}
    led = m.map(ev(6, "supervisor", "ledger", prompts_fed=64, trained=0))
    assert led.metrics == {"ledger/prompts_fed": 64.0, "ledger/trained": 0.0}
    assert m.map(ev(7, "generator.0", "inflight_decision", in_flight=3)) is None
    assert m.map({"event": "train_step", "step": 1, "reward": 1.0}) is None  # no ts: no time
    assert event_wall({"ts": "garbage"}) is None


def test_mapper_sums_rates_over_replicas():
    m = MetricMapper({"generator": 2})
    for r in (0, 1):
        m.map(ev(0, f"generator.{r}", "metrics", emitted=0, in_flight=4))
    a = m.map(ev(1, "generator.0", "metrics", emitted=50, in_flight=5))
    b = m.map(ev(1, "generator.1", "metrics", emitted=30, in_flight=7))
    assert a.metrics["generator.0/samples_per_s"] == 50.0
    assert b.metrics["generator.1/samples_per_s"] == 30.0
    assert b.metrics["generator/samples_per_s"] == 80.0
    assert b.metrics["generator/in_flight"] == 12.0


# --------------------------------------------------------------------------- the feed


class Captured:
    """Stands in for the supervisor's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def warning(self, event: str, **kv) -> None:
        self.events.append(("warning", event, kv))

    def exception(self, event: str, **kv) -> None:
        self.events.append(("exception", event, kv))

    def named(self, event: str) -> list[dict]:
        return [kv for _, name, kv in self.events if name == event]


CONFIG = {"run": {"name": "trk", "trackers": ["tensorboard"]}, "stages": {"learner": {"steps": 5}}}


async def feed_run(run_dir: Path, names, events, *, log=None, status="succeeded", **kw) -> dict:
    """A feed over ``run_dir`` while ``events`` are written, as the supervisor runs one."""
    log = log or Captured()
    feed = TrackerFeed(
        names,
        run_dir,
        params=CONFIG,
        project="trk",
        run_name=run_dir.name,
        log=log,
        interval_s=0.05,
        **kw,
    )
    feed.start()
    for e in events:
        append(run_dir / "logs" / f"{e['stage']}.{e['replica']}.jsonl", e)
    return await feed.aclose(status)


def read_wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    """History rows and the config of the offline W&B run in ``run_dir/wandb``.

    The ``.wandb`` file is W&B's transaction log: a 7-byte header, then LevelDB-log records
    (32 KiB blocks; each record: crc32, length, type FULL/FIRST/MIDDLE/LAST) holding protobuf
    ``Record`` messages (``wandb.proto.wandb_internal_pb2``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    rows, config = [], {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif record.WhichOneof("record_type") in ("run", "config"):
            updates = record.run.config if record.HasField("run") else record.config
            for item in updates.update:
                config[item.key] = json.loads(item.value_json)
    return rows, config


@pytest.mark.timeout(90)
async def test_feed_writes_tensorboard_wandb_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker sets it
    run_dir = tmp_path / "trk-1"
    events = [
        ev(0, "supervisor", "run_started"),
        ev(0.5, "learner.0", "eval", step=0, accuracy=0.5, reward=0.5, policy_version=0),
        *learner_events(range(1, 6)),
        ev(5.5, "generator.0", "metrics", emitted=0, in_flight=4),
        ev(6.0, "learner.0", "eval", step=5, accuracy=0.75, reward=0.75, policy_version=5),
        ev(6.5, "generator.0", "metrics", emitted=200, in_flight=6),
    ]
    counters = await feed_run(run_dir, ["tensorboard", "wandb", "mlflow"], events)
    assert counters == {n: {"written": 9, "dropped": 0} for n in ("tensorboard", "wandb", "mlflow")}

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    rewards = tb.Scalars("train/reward")
    assert [(s.step, round(s.value, 3)) for s in rewards] == [(i, i / 10) for i in range(1, 6)]
    assert [s.wall_time for s in rewards] == pytest.approx([T0 + i for i in range(1, 6)])
    assert [(s.step, s.value) for s in tb.Scalars("eval/accuracy")] == [(0, 0.5), (5, 0.75)]
    rate = tb.Scalars("generator/samples_per_s")
    assert [(s.step, s.value) for s in rate] == [(5, 200.0)]
    assert "config" in tb.Tags()["tensors"]
    assert tb.SummaryMetadata("_hparams_/session_start_info").plugin_data.plugin_name == "hparams"

    rows, config = read_wandb_history(run_dir)
    by_step = {r["learner_step"]: r for r in rows if "train/reward" in r}
    assert sorted(by_step) == [1, 2, 3, 4, 5] and by_step[3]["train/reward"] == 0.3
    assert [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == [0.5, 0.75]
    assert config["stages"] == {"learner": {"steps": 5}}

    ids = json.loads((run_dir / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    history = client.get_metric_history(ids["mlflow"], "train/reward")
    assert [(m.step, m.value) for m in history] == [(i, i / 10) for i in range(1, 6)]
    assert [m.timestamp for m in history] == [int((T0 + i) * 1000) for i in range(1, 6)]
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "trk-1"
    assert run.data.params["stages.learner.steps"] == "5"
    assert client.get_experiment(run.info.experiment_id).name == "trk"


@pytest.mark.timeout(60)
async def test_resumed_run_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    await feed_run(tmp_path, ["mlflow"], learner_events(range(1, 4)), status="stopped")
    first = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    await feed_run(tmp_path, ["mlflow"], learner_events(range(4, 6), start=10))
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == first
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert [m.step for m in client.get_metric_history(first, "train/reward")] == [1, 2, 3, 4, 5]
    assert client.get_run(first).info.status == "FINISHED"


class FakeTracker:
    """A tracker that keeps what it gets, and raises ENOSPC from its ``fail_at``-th record on."""

    def __init__(self, name: str, fail_at: int | None = None) -> None:
        self.name, self.fail_at = name, fail_at
        self.records: list[tuple[int, dict]] = []
        self.closed: str | None = None

    def log_params(self, params) -> None:
        self.params = params

    def log_metrics(self, metrics, step, wall) -> None:
        if self.fail_at is not None and len(self.records) + 1 >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.records.append((step, dict(metrics)))

    def flush(self) -> None:
        pass

    def close(self, status="succeeded") -> None:
        self.closed = status


@pytest.mark.timeout(30)
async def test_failing_tracker_is_logged_once_counted_and_the_others_go_on(tmp_path):
    made = {"good": FakeTracker("good"), "full": FakeTracker("full", fail_at=3)}
    log = Captured()
    log_dir = tmp_path / "logs"
    feed = TrackerFeed(
        ["good", "full"],
        tmp_path,
        params=CONFIG,
        project="p",
        run_name="r",
        log=log,
        interval_s=0.05,
        opener=lambda name, *a, **k: made[name],
    )
    feed.start()
    for batch in (range(1, 3), range(3, 6), range(6, 9)):  # three reads of the logs
        append(log_dir / "learner.0.jsonl", *learner_events(batch))
        await asyncio.sleep(0.3)
    counters = await feed.aclose("failed")

    assert [step for step, _ in made["good"].records] == list(range(1, 9))
    assert made["good"].closed == "failed"
    assert [step for step, _ in made["full"].records] == [1, 2]
    assert made["full"].closed == "failed"  # released when it failed
    failed = log.named("tracker_failed")
    assert len(failed) == 1
    assert failed[0]["tracker"] == "full" and failed[0]["phase"] == "log"
    assert "No space left on device" in failed[0]["error"] and failed[0]["written"] == 2
    assert counters["good"] == {"written": 8, "dropped": 0}
    assert counters["full"]["written"] == 2 and counters["full"]["dropped"] == 6
    assert feed.failed


@pytest.mark.timeout(60)
async def test_unwritable_tensorboard_dir_and_a_vanished_mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "tensorboard").write_text("a file where the log directory should be")
    log = Captured()
    feed = TrackerFeed(
        ["tensorboard", "mlflow"],
        tmp_path,
        params=CONFIG,
        project="p",
        run_name="r",
        log=log,
        interval_s=0.05,
    )
    feed.start()
    append(tmp_path / "logs" / "learner.0.jsonl", *learner_events(range(1, 3)))
    deadline = asyncio.get_running_loop().time() + 30
    while feed.counters()["mlflow"]["written"] < 2:  # the MLflow run is open and written
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    shutil.rmtree(tmp_path / "mlruns")  # the store is gone mid-run (a disk unmounted)
    append(tmp_path / "logs" / "learner.0.jsonl", *learner_events(range(3, 5)))
    await asyncio.sleep(0.3)
    append(tmp_path / "logs" / "learner.0.jsonl", *learner_events(range(5, 7)))
    counters = await feed.aclose()

    failed = {kv["tracker"]: kv for kv in log.named("tracker_failed")}
    assert len(log.named("tracker_failed")) == 2  # once each
    assert failed["tensorboard"]["phase"] == "open"
    assert failed["mlflow"]["phase"] == "log"
    assert counters["tensorboard"]["dropped"] == 6 and counters["tensorboard"]["written"] == 0
    assert counters["mlflow"]["written"] == 2 and counters["mlflow"]["dropped"] == 4


# --------------------------------------------------------------------------- config


def test_config_issues_name_the_extra_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    absent = {"wandb", "matplotlib"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a)
    )
    run = SimpleNamespace(trackers=["tensorboard", "wandb", "tensorboard"], plot=True)
    issues = config_issues(run, lambda path: f"f.yaml:{len(path)}")
    assert [i.path for i in issues] == ["run.trackers[1]", "run.trackers[2]", "run.plot"]
    assert "pip install 'inflight-rl[wandb]'" in issues[0].message
    assert issues[0].where == "f.yaml:15"
    assert "listed twice" in issues[1].message
    assert "pip install 'inflight-rl[plot]'" in issues[2].message
    assert config_issues(SimpleNamespace(trackers=["tensorboard"], plot=False), str) == []


def test_validate_rejects_an_unknown_tracker_and_a_missing_package(tmp_path, monkeypatch):
    import importlib.util

    from pipeline.config import ConfigError, load_pipeline
    from pipeline.registry import resolve

    config = tmp_path / "p.yaml"
    config.write_text(
        "run:\n  trackers: [tensorboard, nosuch]\n"
        "stages:\n  numbers: {use: numbers}\n"
        '  summary: {use: "stages.examples:Summary", inputs: {items: numbers.out}}\n'
    )
    with pytest.raises(ConfigError) as bad:
        load_pipeline(config, resolve=lambda name: resolve("stage", name))
    assert "run.trackers[1]" in str(bad.value)
    assert "'tensorboard', 'wandb', 'mlflow'" in str(bad.value)

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    config.write_text(
        "run:\n  trackers: [wandb]\n"
        "stages:\n  numbers: {use: numbers}\n"
        '  summary: {use: "stages.examples:Summary", inputs: {items: numbers.out}}\n'
    )
    with pytest.raises(ConfigError) as missing:
        load_pipeline(config, resolve=lambda name: resolve("stage", name))
    assert f"{config}:2" in str(missing.value) and "run.trackers[0]" in str(missing.value)
    assert "pip install 'inflight-rl[wandb]'" in str(missing.value)
