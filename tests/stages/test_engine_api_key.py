"""Engine API keys (SGLang's ``--api-key`` contract): a real built-in engine started with a key
refuses requests without it (401, ``{"error": "Unauthorized"}``) but answers ``/health``; the
generator's client and the weight publisher send it and name a refused key; the server refuses
to listen off loopback without one; the launcher hands the key over off the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pipeline.actor import ActorContext
from stages.engine.auth import (
    API_KEY_ENV,
    EngineAuthError,
    authorized,
    bind_error,
    engine_api_key,
    is_loopback_host,
)
from stages.generator.client import EngineClient, EngineError
from stages.generator.launcher import EngineLauncher, LaunchConfig
from stages.weights.publisher import WeightPublisher
from tests.pipeline.runs import run_inflight
from tests.stages.engine_setup import builtin_engine, engine_command
from tests.stages.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-this-test"
GEN = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def _request(url: str, method: str, body=None, auth: str | None = None) -> tuple[int, object]:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if text else None


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A built-in engine given its key as the launcher does: in its environment."""
    root = tmp_path_factory.mktemp("keyed")
    model = make_tiny_model(root / "model", vocab=64, seed=2)
    # the health check sends no key: /health is exempt
    with builtin_engine(
        model,
        "--max-running",
        "4",
        env={API_KEY_ENV: KEY},
        output=root / "engine.out",
        up_within=30,
        stop_within=10,
    ) as url:
        yield url


@pytest.mark.timeout(40)
def test_requests_without_the_key_are_refused_as_sglang_refuses_them(engine):
    for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer \xe9t\xe9"):
        assert _request(engine + "/generate", "POST", GEN, auth) == (
            401,
            {"error": "Unauthorized"},
        ), auth
    assert _request(engine + "/get_model_info", "GET")[0] == 401
    assert _request(engine + "/nowhere", "GET")[0] == 401  # SGLang: auth before routing
    status, out = _request(engine + "/generate", "POST", GEN, f"Bearer {KEY}")
    assert status == 200 and len(out["output_ids"]) == 2
    assert _request(engine + "/generate", "POST", GEN, f"bearer {KEY}")[0] == 200
    status, info = _request(engine + "/get_server_info", "GET", auth=f"Bearer {KEY}")
    assert status == 200 and info["refused_requests"]["POST /generate 401"] == 6
    assert KEY not in json.dumps(info)


@pytest.mark.timeout(40)
async def test_client_sends_the_key_and_names_a_refused_one(engine):
    async with aiohttp.ClientSession() as session:
        keyed = EngineClient(engine, session, timeout_s=10, api_key=KEY)
        await keyed.check_key()
        done = await keyed.generate([3, 4, 5], {"max_new_tokens": 2}, rid="r1")
        assert len(done.output_ids) == 2
        for key in (None, "wrong"):
            client = EngineClient(engine, session, timeout_s=10, api_key=key)
            assert await client.healthy()  # /health needs no key ...
            with pytest.raises(EngineAuthError) as err:  # ... everything else does
                await client.check_key()
            with pytest.raises(EngineError) as err:  # final: the generator drops, not retries
                await client.generate([3, 4, 5], {"max_new_tokens": 2}, rid="r2")
            assert isinstance(err.value, EngineAuthError) and not err.value.retryable
            assert f"engine at {engine} refused the API key (HTTP 401" in str(err.value)
            assert API_KEY_ENV in str(err.value) and "wrong" not in str(err.value)


@pytest.mark.timeout(40)
async def test_publisher_sends_the_key_and_a_refused_one_is_not_a_publish_error(engine):
    pub = WeightPublisher([engine], group_name="t_keyed", timeout_s=10, api_key=KEY)
    try:
        await pub.connect()  # /init_weights_update_group accepted: the engine joined
    finally:
        await pub.close()
    refused = WeightPublisher([engine], group_name="t_refused", timeout_s=3, api_key="wrong")
    started = time.monotonic()
    try:
        with pytest.raises(EngineAuthError, match="refused the API key"):
            await refused.connect()
    finally:
        await refused.close()
    assert time.monotonic() - started < 2.5  # on the answer, not after the group's timeout


@pytest.mark.timeout(30)
def test_engine_refuses_to_listen_off_loopback_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.run(
        engine_command(tmp_path / "no-model", "--port", "0", "--host", "0.0.0.0"),
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "0.0.0.0 is reachable from other machines" in lines[0]
    assert API_KEY_ENV in lines[0] and "--insecure" in lines[0]


def test_rules_of_the_contract():
    assert authorized("POST", "/generate", None, None)  # no key: everyone
    assert authorized("GET", "/health", None, KEY) and authorized(
        "GET", "/health_generate", None, KEY
    )
    assert authorized("OPTIONS", "/generate", None, KEY)
    assert not authorized("POST", "/generate", f"Bearer  {KEY}", KEY)
    assert authorized("POST", "/generate", f"BEARER {KEY}", KEY)
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "", "10.0.0.7", "node-3"))
    assert bind_error("127.0.0.1", None) is None and bind_error("10.0.0.7", KEY) is None
    assert bind_error("10.0.0.7", None, insecure=True) is None
    assert bind_error("10.0.0.7", None) is not None


def test_the_key_comes_from_the_run_else_the_environment():
    spec = {"stage": "g", "replica": 0, "replicas": 1, "run_dir": "/r", "seed": 0, "restarts": 0}
    assert ActorContext(spec, None, None).engine_api_key is None
    ctx = ActorContext({**spec, "engine_api_key": KEY}, None, None)
    assert ctx.engine_api_key == KEY
    assert engine_api_key(ctx, environ={API_KEY_ENV: "other"}) == KEY
    assert engine_api_key(object(), environ={API_KEY_ENV: "other"}) == "other"
    assert engine_api_key(object(), environ={}) is None


def _launcher(tmp_path: Path, kind: str, **more) -> EngineLauncher:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)

    class Log:
        def __getattr__(self, _name):
            return lambda *a, **k: None

    return EngineLauncher(
        LaunchConfig(kind=kind, model=str(model)),
        name="generator.0",
        log_dir=tmp_path,
        log=Log(),
        environ={"PATH": os.environ.get("PATH", ""), API_KEY_ENV: "the-user's"},
        **more,
    )


def test_launcher_gives_built_in_engines_the_session_flag_for_hold_kv(tmp_path):
    """``rollout.hold_kv``: the built-in engines the generator starts keep sessions' KV."""
    flag = "--enable-session-radix-cache"
    holding = _launcher(tmp_path, "builtin", session_kv=True)
    assert holding._command(holding.engines[0]).count(flag) == 1
    plain = _launcher(tmp_path, "builtin")
    assert flag not in plain._command(plain.engines[0])
    sglang = _launcher(tmp_path, "sglang", session_kv=True)  # SGLang's: launch.extra_args
    assert flag not in sglang._command(sglang.engines[0])


def test_launcher_hands_the_key_over_off_the_command_line(tmp_path):
    builtin = _launcher(tmp_path, "builtin", api_key=KEY)
    engine = builtin.engines[0]
    assert builtin._env(engine)[API_KEY_ENV] == KEY and KEY not in builtin._command(engine)
    sglang = _launcher(tmp_path, "sglang", api_key=KEY)
    cmd = sglang._command(sglang.engines[0])
    assert KEY not in " ".join(cmd) and API_KEY_ENV not in sglang._env(sglang.engines[0])
    config = Path(cmd[cmd.index("--config") + 1])
    assert json.loads(config.read_text()) == {"api-key": KEY}  # YAML: JSON is YAML
    assert config.stat().st_mode & 0o077 == 0 and config.suffix == ".yaml"
    asyncio.run(sglang.close())
    assert not config.exists()
    keyless = _launcher(tmp_path, "builtin")
    assert API_KEY_ENV not in keyless._env(keyless.engines[0])  # it serves without one


def test_launcher_will_not_put_keyless_engines_off_loopback(tmp_path):
    with pytest.raises(ValueError, match="without an API key"):
        EngineLauncher(
            LaunchConfig(model=str(tmp_path), host="10.0.0.7"),
            name="generator.0",
            log_dir=tmp_path,
            log=None,
            environ={},
        )


@pytest.mark.timeout(40)
def test_every_replica_gets_the_runs_key_privately(tmp_path):
    def keys(run_dir: Path, env: dict[str, str]) -> set[str]:
        done = run_inflight(
            "run",
            "configs/example.yaml",
            "stages.numbers.count=20",
            "--run-dir",
            str(run_dir),
            "-q",
            timeout=30,
            env=env,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        specs = sorted((run_dir / "specs").glob("*.json"))
        assert specs and all(p.stat().st_mode & 0o077 == 0 for p in specs)
        logs = " ".join(p.read_text() for p in (run_dir / "logs").iterdir() if p.is_file())
        found = {json.loads(p.read_text())["engine_api_key"] for p in specs}
        assert not any(key in logs for key in found)
        return found

    made = keys(tmp_path / "a", {API_KEY_ENV: ""})  # one key per run, made for it
    assert len(made) == 1 and len(next(iter(made))) >= 40
    assert keys(tmp_path / "b", {API_KEY_ENV: "user-key"}) == {"user-key"}  # the user's
