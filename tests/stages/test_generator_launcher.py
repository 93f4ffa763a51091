"""The engine launcher's restart path and engine placement, with a stand-in engine (a tiny HTTP
server, quick to start).

The launcher is told its engine is SGLang whose interpreter is ``fake_engine.py``: the script
ignores ``-m sglang.launch_server`` and the model, and answers ``GET /health`` on ``--port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

import stages.generator.launcher as launcher_module
from pipeline.config.schema import Resources, StageSection
from pipeline.placement import ENGINE_PLACEMENT_ENV, Inventory, engine_placement, plan
from stages.generator.launcher import EngineLauncher, LaunchConfig
from tests.pipeline.runs import REPO, alive, wait_for

FAKE_ENGINE = f"""#!{sys.executable}
import argparse, http.server, os

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--host")
args, _ = parser.parse_known_args()


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        if "INFLIGHT_ENGINE_ID" in os.environ:  # as the built-in engine names itself
            self.send_header("X-Inflight-Engine-Id", os.environ["INFLIGHT_ENGINE_ID"])
        self.end_headers()

    def log_message(self, *a):
        pass


http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""


class _Log:
    def __init__(self):
        self.events = []

    def _add(self, event, **kw):
        self.events.append({"event": event, **kw})

    info = warning = error = _add


@pytest.fixture
def fake_engine(tmp_path):
    path = tmp_path / "fake_engine.py"
    path.write_text(FAKE_ENGINE)
    path.chmod(0o755)
    model = tmp_path / "model"  # a stand-in folder: the launcher resolves the model first
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return path


def _config(fake_engine, **more) -> LaunchConfig:
    return LaunchConfig(
        kind="sglang",
        python=str(fake_engine),
        model=str(fake_engine.parent / "model"),
        startup_timeout_s=20,
        **more,
    )


def _killpg(pids) -> None:
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
async def test_a_dead_engine_is_restarted_on_its_port_until_given_up(tmp_path, fake_engine):
    log = _Log()
    launcher = EngineLauncher(
        _config(fake_engine, max_restarts=1), name="gen.0", log_dir=tmp_path, log=log
    )

    def seen(event):
        return [e for e in log.events if e["event"] == event]

    async def until(what, predicate):
        for _ in range(400):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {log.events}")

    try:
        [url] = await launcher.start()
        first = seen("engine_launched")[0]
        os.kill(first["pid"], signal.SIGKILL)
        await until("the restart", lambda: len(seen("engine_ready")) == 2)
        second = seen("engine_launched")[1]
        assert second["port"] == first["port"] and second["pid"] != first["pid"]
        assert seen("engine_exited")[0]["exit_code"] == -signal.SIGKILL
        assert not launcher.all_given_up
        # past max_restarts: given up, and the generator can tell
        os.kill(second["pid"], signal.SIGKILL)
        await until("giving up", lambda: seen("engine_given_up"))
        assert launcher.all_given_up and len(seen("engine_launched")) == 2
        assert url.endswith(f":{first['port']}")
    finally:
        await launcher.close()
        _killpg(e["pid"] for e in seen("engine_launched"))


@pytest.fixture
def foreign_engine(fake_engine):
    """Someone else's engine (it names another id), listening; yields its port."""
    proc = subprocess.Popen(
        [str(fake_engine), "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, "INFLIGHT_ENGINE_ID": "someone-else"},
    )
    try:
        yield wait_for(lambda: _listening_port(proc.pid), 10, "the other engine to listen")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
async def test_an_engine_whose_port_another_engine_took_starts_on_another(
    tmp_path, fake_engine, foreign_engine, monkeypatch
):
    """The port the launcher picked is bound by someone else's engine (which answers /health
    200) before ours binds it: that answer is not taken for ours, and ours moves."""
    taken = foreign_engine
    picks = iter([taken, taken])  # the first pick, and the first move; fresh ones from then on
    real = launcher_module.rendezvous_port
    monkeypatch.setattr(
        launcher_module, "rendezvous_port", lambda host: next(picks, None) or real(host)
    )
    log = _Log()
    launcher = EngineLauncher(_config(fake_engine), name="gen.0", log_dir=tmp_path, log=log)
    try:
        [url] = await launcher.start()
        events = [e["event"] for e in log.events]
        assert events.count("engine_port_taken") == 2, log.events
        launched = [e for e in log.events if e["event"] == "engine_launched"]
        assert [e["port"] for e in launched][:2] == [taken, taken] and len(launched) == 3
        assert not url.endswith(f":{taken}") and events[-1] == "engine_ready"
    finally:
        await launcher.close()
        _killpg(e["pid"] for e in log.events if e["event"] == "engine_launched")


def _listening_port(pid: int) -> int | None:
    """The TCP port process ``pid`` listens on (from /proc), or None before it listens."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            return int(fields[1].split(":")[1], 16)
    return None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # stage replicas run on uvloop
def test_engines_die_with_the_generator_process(tmp_path, fake_engine, loop):
    """A generator killed outright (SIGKILL, a segfault) must not leave its engines running:
    they are in their own process group, out of reach of the supervisor's group kill."""
    pytest.importorskip(loop)
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys, {loop}
        from pathlib import Path
        from stages.generator.launcher import EngineLauncher, LaunchConfig

        class Log:
            def info(self, event, **kw):
                if event == "engine_launched":
                    print(json.dumps(kw), flush=True)
            warning = error = info

        async def main():
            config = LaunchConfig(kind="sglang", python={str(fake_engine)!r},
                                  model={str(tmp_path / "model")!r},
                                  count=2, startup_timeout_s=20)
            launcher = EngineLauncher(config, name="gen.0", log_dir=Path({str(tmp_path)!r}),
                                      log=Log())
            await launcher.start()
            print("ready", flush=True)
            await asyncio.sleep(3600)

        {loop}.run(main())
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    pids = []
    try:
        for line in proc.stdout:
            if line.strip() == "ready":
                break
            pids.append(json.loads(line)["pid"])
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(alive(p) for p in pids), 5, "the engines to die with it")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _killpg(pids)


@dataclass
class _Options:
    launch: LaunchConfig


@pytest.mark.timeout(30)
async def test_each_engine_runs_on_its_cores_with_its_env_and_keeps_them_on_restart(
    tmp_path, fake_engine
):
    """The supervisor's plan reaches the engines through the replica's environment: engine i
    runs pinned to its core, with OMP/MKL threads and CUDA_VISIBLE_DEVICES of its own."""
    config = _config(fake_engine, count=2, resources=Resources(cpus=1, gpus=1))
    stages = {"gen": StageSection(use="generator", options=_Options(config))}
    placement, issues = plan(stages, Inventory(cores=(0, 1), gpus=(0, 1), gpu_source="fake"))
    assert not issues
    handoff = engine_placement(placement, "gen", 0, {}, {})
    environ = {**os.environ, ENGINE_PLACEMENT_ENV: handoff, "CUDA_VISIBLE_DEVICES": "0,1"}
    log = _Log()
    launcher = EngineLauncher(config, name="gen.0", log_dir=tmp_path, log=log, environ=environ)

    def launched():
        return [e for e in log.events if e["event"] == "engine_launched"]

    def env_of(pid):
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        env = dict(item.decode().partition("=")[::2] for item in raw if item)
        keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", ENGINE_PLACEMENT_ENV)
        return {k: env.get(k) for k in keys}

    try:
        await launcher.start()
        for i, engine in enumerate(launcher.engines):
            assert os.sched_getaffinity(engine.pid) == {i}
            assert env_of(engine.pid) == {
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": str(i),
                ENGINE_PLACEMENT_ENV: None,  # the handoff is for the launcher only
            }
        first = launcher.engines[0].pid
        os.kill(first, signal.SIGKILL)
        for _ in range(400):
            if len(launched()) == 3 and launcher.engines[0].pid != first:
                break
            await asyncio.sleep(0.05)
        restarted = launcher.engines[0].pid
        assert restarted != first and os.sched_getaffinity(restarted) == {0}
        assert env_of(restarted)["CUDA_VISIBLE_DEVICES"] == "0"
        assert launched()[-1]["cores"] == [0] and launched()[-1]["threads"] == "1"
    finally:
        await launcher.close()
        _killpg(e["pid"] for e in launched())


@pytest.mark.timeout(30)
async def test_without_a_handoff_engines_inherit_and_resources_are_flagged(tmp_path, fake_engine):
    config = _config(fake_engine, resources=Resources(cpus=1))
    environ = {k: v for k, v in os.environ.items() if k != ENGINE_PLACEMENT_ENV}
    log = _Log()
    launcher = EngineLauncher(config, name="gen.0", log_dir=tmp_path, log=log, environ=environ)
    try:
        await launcher.start()
        [engine] = launcher.engines
        assert os.sched_getaffinity(engine.pid) == os.sched_getaffinity(0)
        assert log.events[0]["event"] == "engine_resources_not_applied"
    finally:
        await launcher.close()
        _killpg(e.pid for e in launcher.engines if e.pid)
    with pytest.raises(ValueError, match="places 1 engines, but this replica launches 2"):
        EngineLauncher(
            _config(fake_engine, count=2),
            name="gen.0",
            log_dir=tmp_path,
            log=_Log(),
            environ={ENGINE_PLACEMENT_ENV: json.dumps([{"cores": [0], "env": {}}])},
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "sglang"}, "built-in engine only"),
        ({"count": 2}, "one engine inside the generator"),
        ({"resources": Resources(cpus=1)}, "give the generator `resources`"),
    ],
)
def test_an_in_process_engine_is_one_builtin_engine_on_the_generators_cores(options, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(model="m", in_process=True, **options)
    LaunchConfig(model="m", in_process=False, **options)  # all fine with engine processes
