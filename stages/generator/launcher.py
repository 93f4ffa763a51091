"""Starts the inference engines a generator uses, watches them, and restarts the ones that die.

Two kinds, one command line shape each:

- ``builtin``: ``python -m pipeline.cli engine --model M --port P --device D`` (this environment).
  With ``in_process: true`` the same engine runs inside the generator's process instead
  (``stages.engine.in_process``): its scheduler on a thread, its HTTP API on another (for the
  weight publisher and outside clients), and the generator's own requests without HTTP.
- ``sglang``: ``PYTHON -m sglang.launch_server --model-path M --port P --host H`` with ``PYTHON``
  the interpreter of the environment SGLang is installed in (it pins its own torch, so it usually
  lives in a separate virtual environment).

``M`` is always a local folder: a Hub id in ``launch.model`` is resolved (``stages.hub``: the
cached snapshot, downloaded first unless ``HF_HUB_OFFLINE`` is set) once, before the first engine
starts, so every engine and every restart serves the same files.

Each engine runs in its own process group with its output in ``RUN_DIR/logs/<name>.out``, and
(on Linux) is killed by the kernel if the generator process dies without closing it, as the
supervisor's group kill does not reach it. An engine that exits is started again on the same port
(the generator re-routes its requests in the meantime), up to ``max_restarts`` times. A port
another process took between the pick and the bind is told apart from the engine's own answer
(``stages.engine.identity``); at the first start the engine then moves to another port.

API key (``api_key``: the run's, ``stages.engine.auth``): the built-in engine gets it in its
environment (``INFLIGHT_ENGINE_API_KEY``); SGLang takes it only as ``--api-key``, so it gets it in
a YAML file readable by this user only (``--config``, SGLang 0.5.3 or later) to keep it off
command lines (``ps``) and out of ``engine_launched``. SGLang itself still writes its arguments,
key included, to its startup log (``RUN_DIR/logs/<name>.out``; upstream issue #37457): the key is
made per run and dies with its engines. Without a key engines may only listen on loopback.

Placement: ``launch.resources`` asks for cores/GPUs per engine; the supervisor plans them with
everything else and hands this replica the result in ``INFLIGHT_ENGINE_PLACEMENT``. Each engine
(and each restart of it) is started pinned to its cores with its ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` and ``CUDA_VISIBLE_DEVICES``. Without that variable (no ``resources``
anywhere, or a launcher used outside ``inflight run``) engines inherit this process's placement.
Not here: talking to engines (``client``), deciding the placement (``pipeline.placement``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.config.schema import Resources
from pipeline.launchers.local import write_private
from pipeline.placement import ENGINE_PLACEMENT_ENV, ProcessPlacement, read_engine_placement
from pipeline.processes import child_preexec, name_thread
from stages.engine.auth import API_KEY_ENV, is_loopback_host
from stages.engine.identity import ENGINE_ID_ENV, answered_by_another, new_engine_id
from stages.hub import model_check, resolve_model
from stages.remote_code import remote_code_trusted
from transport.address import rendezvous_port

if TYPE_CHECKING:
    from stages.engine.in_process import InProcessEngine

__all__ = ["EngineLauncher", "LaunchConfig"]

SESSION_FLAG = "--enable-session-radix-cache"  # the built-in engine's, as SGLang's
LORA_FLAG = "--enable-lora"  # SGLang's: /load_lora_adapter and lora_path served


@dataclass
class LaunchConfig:
    kind: Literal["builtin", "sglang"] = field(
        default="builtin", metadata={"doc": "which engine server to start"}
    )
    count: int = field(default=1, metadata={"min": 1, "doc": "engines to start"})
    model: str = field(
        default="",
        metadata={
            "doc": "model folder or Hub id (org/name[@revision]) the engines serve",
            "path": "model",
            "check": model_check,
        },
    )
    device: str = field(
        default="cpu", metadata={"doc": "builtin engine: cpu, cuda, cuda:N", "device": True}
    )
    dtype: str = field(default="auto", metadata={"doc": "builtin engine: auto|float32|bfloat16"})
    python: str = field(
        default="",
        metadata={
            "doc": "interpreter for sglang (its own venv); default: this one",
            "path": "command",
        },
    )
    host: str | None = field(
        default=None,
        metadata={
            "doc": "host the engines listen on; null: loopback, or the node's IP when the "
            "Ray launcher runs the generator (the learner reaches them from another node)"
        },
    )
    extra_args: list[str] = field(default_factory=list, metadata={"doc": "appended as is"})
    startup_timeout_s: float = field(default=600.0, metadata={"min": 1.0})
    max_restarts: int = field(default=3, metadata={"min": 0})
    resources: Resources = field(
        default_factory=Resources,
        metadata={
            "doc": "cores and GPUs each engine gets to itself (`{cpus: 1, gpus: 1}`); none "
            "asked for: engines float on the cores nobody reserved"
        },
    )
    restart_from_peer: bool = field(
        default=False,
        metadata={
            "doc": "builtin: an engine that died starts again on the weights a live sibling "
            "serves, with its weight version (--load-format remote_instance), instead of "
            "reading the checkpoint and waiting for the learner's catch-up publish; the "
            "checkpoint when no sibling answers, or when taking them failed. For checkpoints "
            "slow to read (large, on network storage) with fast links between engines"
        },
    )
    in_process: bool = field(
        default=False,
        metadata={
            "doc": "builtin: run the engine inside the generator's process (its scheduler on a "
            "thread, its HTTP API still served for the publisher and outside clients) and "
            "generate without HTTP; one engine, on the generator's cores"
        },
    )

    def __post_init__(self) -> None:
        if not self.in_process:
            return
        if self.kind != "builtin":
            raise ValueError("in_process: true runs the built-in engine only (kind: builtin)")
        if self.count != 1:
            raise ValueError(
                f"in_process: true runs one engine inside the generator (count is {self.count}); "
                "more engines need processes of their own (in_process: false)"
            )
        if self.resources.cpus is not None or self.resources.gpus:
            raise ValueError(
                "in_process: true runs the engine on the generator's own cores and GPUs: give "
                "the generator `resources` instead of launch.resources"
            )


class _PortTaken(RuntimeError):
    """An engine exited while starting, and another engine had been answering on its port."""


@dataclass
class _Engine:
    name: str
    port: int
    out: Path
    placement: ProcessPlacement | None = None
    proc: asyncio.subprocess.Process | None = None
    local: InProcessEngine | None = None  # launch.in_process: the engine in this process
    restarts: int = 0
    given_up: bool = False
    # this start takes the weights of the sibling on this port (restart_from_peer), and
    # whether such a start failed (the next ones read the checkpoint)
    peer: int | None = None
    peer_failed: bool = False
    engine_id: str = field(default_factory=new_engine_id)  # its /health names it (identity.py)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class EngineLauncher:
    """Starts ``config.count`` engines for the replica ``name`` (``STAGE.REPLICA``).

    ``environ`` (default: this process's) is where the supervisor's engine placement is read
    from, and what the engines' environment starts from. ``api_key``: the key every engine
    requires (see the module docstring); None: none, and then engines must stay on loopback.
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        name: str,
        log_dir: Path,
        log: Any,
        environ: Mapping[str, str] | None = None,
        log_level: str = "info",
        api_key: str | None = None,
        session_kv: bool = False,
        lora: bool = False,
    ) -> None:
        if not config.model:
            raise ValueError("launch.model is required to start engines")
        self.api_key = api_key or None
        self._key_dir: Path | None = None  # SGLang's private --config file with the key
        self.config, self.log, self.name = config, log, name
        self.log_level = log_level  # the built-in engine's (its per-update events are debug)
        # built-in engines keep episodes' KV as sessions' (rollout.hold_kv)
        self.session_kv = session_kv
        # built-in engines serve LoRA adapters by name (a generator's: a LoRA learner's come
        # that way); not a scorer's reward model or teacher
        self.lora = lora
        self.model_dir: Path | None = None  # launch.model as a local folder, once resolved
        self.environ = dict(os.environ if environ is None else environ)
        # where engines listen: a node's IP under the Ray launcher (pipeline.launchers.ray_host)
        self.host = config.host or self.environ.get("INFLIGHT_NODE_IP") or "127.0.0.1"
        if self.api_key is None and not is_loopback_host(self.host):
            raise ValueError(
                f"engines would listen on {self.host} (reachable from other machines) without "
                f"an API key: set {API_KEY_ENV}, or launch.host: 127.0.0.1"
            )
        if self.api_key and config.kind == "sglang" and "--config" in config.extra_args:
            raise ValueError(
                "launch.extra_args has --config: the launcher hands SGLang the run's API key in "
                "a --config file of its own; put those options in extra_args instead"
            )
        placements = read_engine_placement(self.environ, config.count)
        if placements is None and (config.resources.cpus is not None or config.resources.gpus):
            log.warning(
                "engine_resources_not_applied",
                reason=f"launch.resources is set but no {ENGINE_PLACEMENT_ENV} was handed to "
                "this process (not started by `inflight run`?): engines inherit its placement",
            )
        self.engines = []
        for i in range(config.count):
            # below the ephemeral range: the engine binds it seconds later (and again when it
            # is restarted), and a port found by binding 0 is soon another socket's
            port = rendezvous_port(self.host)
            self.engines.append(
                _Engine(
                    f"{name}.engine{i}",
                    port,
                    log_dir / f"{name}.engine{i}.out",
                    placements[i] if placements else None,
                )
            )
        self._watchers: list[asyncio.Task] = []
        self._closing = False

    @property
    def all_given_up(self) -> bool:
        """Every engine died more than ``max_restarts`` times (or could not be started again)."""
        return all(e.given_up for e in self.engines)

    @property
    def restarts(self) -> int:
        """Restarts of all engines so far (a restarted engine has lost the published weights)."""
        return sum(e.restarts for e in self.engines)

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{e.port}" for e in self.engines]

    def restarts_by_url(self) -> dict[str, int]:
        """Restarts so far of the engine at each URL."""
        return {url: e.restarts for url, e in zip(self.urls, self.engines, strict=True)}

    def _builtin_argv(self, engine: _Engine) -> list[str]:
        """``inflight engine``'s options for ``engine`` (its log options apart)."""
        cfg = self.config
        argv = ["--model", self._model(), "--host", self.host, "--port", str(engine.port)]
        argv += ["--device", cfg.device, "--dtype", cfg.dtype, *_trusting(cfg.extra_args)]
        if self.session_kv and SESSION_FLAG not in cfg.extra_args:
            argv.append(SESSION_FLAG)
        if self.lora and LORA_FLAG not in cfg.extra_args:
            argv.append(LORA_FLAG)
        if engine.peer is not None:  # stages/engine/remote_instance.py
            argv += [
                "--load-format",
                "remote_instance",
                "--remote-instance-weight-loader-seed-instance-ip",
                self.host,
                "--remote-instance-weight-loader-seed-instance-service-port",
                str(engine.peer),
                "--remote-instance-weight-loader-send-weights-group-ports",
                f"[{rendezvous_port(self.host)}]",
            ]
        return argv

    def _command(self, engine: _Engine) -> list[str]:
        cfg = self.config
        if cfg.kind == "builtin":
            cmd = [sys.executable, "-m", "pipeline.cli", "engine", *self._builtin_argv(engine)]
            # its events join the run's logs: `inflight logs RUN_DIR --stage generator-0-engine`
            log_as = f"{self.name.replace('.', '-')}-engine.{self.engines.index(engine)}"
            log_file = engine.out.parent / f"{log_as}.jsonl"
            cmd += ["--log-file", str(log_file), "--log-as", log_as, "--log-level", self.log_level]
        else:
            cmd = [cfg.python or sys.executable, "-m", "sglang.launch_server"]
            cmd += ["--model-path", self._model(), "--host", self.host]
            cmd += ["--port", str(engine.port), *_trusting(cfg.extra_args)]
            if self.api_key:
                cmd += ["--config", str(self._sglang_key_file())]
        return cmd + list(cfg.extra_args)

    def _sglang_key_file(self) -> Path:
        """A YAML file (JSON is YAML) giving SGLang ``api-key``: SGLang reads no variable for
        it, and a command-line value would show in ``ps`` and in ``engine_launched``."""
        if self._key_dir is None:
            self._key_dir = Path(tempfile.mkdtemp(prefix="inflight-engine-key-"))  # mode 0700
        path = self._key_dir / "sglang.yaml"
        if not path.exists():
            write_private(path, json.dumps({"api-key": self.api_key}) + "\n")
        return path

    def _env(self, engine: _Engine) -> dict[str, str]:
        skip = (ENGINE_PLACEMENT_ENV, API_KEY_ENV)
        env = {k: v for k, v in self.environ.items() if k not in skip}
        if self.api_key and self.config.kind == "builtin":
            env[API_KEY_ENV] = self.api_key
        env[ENGINE_ID_ENV] = engine.engine_id  # SGLang ignores it
        for var, value in engine.placement.env.items() if engine.placement else ():
            if value is None:
                env.pop(var, None)
            else:
                env[var] = value
        return env

    async def _spawn(self, engine: _Engine) -> None:
        cmd = self._command(engine)
        cores = engine.placement.cores if engine.placement else None
        env = self._env(engine)
        out = open(engine.out, "ab")  # noqa: ASYNC230 (a local file, opened once per start)
        try:
            engine.proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=child_preexec(cores=cores),  # dies with us; pinned from the start
                env=env,
            )
        finally:
            out.close()
        self.log.info(
            "engine_launched",
            engine=engine.name,
            pid=engine.pid,
            port=engine.port,
            command=" ".join(cmd),
            cores=None if cores is None else list(cores),
            threads=env.get("OMP_NUM_THREADS"),
            gpus=env.get("CUDA_VISIBLE_DEVICES"),
        )

    def _model(self) -> str:
        return str(self.model_dir if self.model_dir is not None else self.config.model)

    async def start(self) -> list[str]:
        """Find the model's folder (a Hub id: its cached snapshot, downloaded first unless
        HF_HUB_OFFLINE is set; raises ``stages.hub.HubError``), start every engine on it and
        wait until each answers /health; returns their URLs."""
        if self.model_dir is None:  # once: every engine, and every restart, serves this folder
            self.model_dir = await asyncio.to_thread(
                resolve_model, self.config.model, what="launch.model"
            )
            if str(self.model_dir) != self.config.model:
                self.log.info("engine_model", model=self.config.model, folder=str(self.model_dir))
        if self.config.in_process:
            for engine in self.engines:
                await self._start_in_process(engine)
            self._watchers = [asyncio.create_task(self._watch_in_process(e)) for e in self.engines]
            return self.urls
        await asyncio.gather(*(self._first_start(e) for e in self.engines))
        self._watchers = [asyncio.create_task(self._watch(e)) for e in self.engines]
        return self.urls

    def in_process_engines(self) -> dict[str, InProcessEngine]:
        """URL -> engine, for the engines running inside this process."""
        return {url: e.local for url, e in zip(self.urls, self.engines, strict=True) if e.local}

    async def _start_in_process(self, engine: _Engine) -> None:
        # torch and transformers' model code, imported when used, on the thread that loads the
        # model (``engine-load``): start-up work of the engine's, as in a process of its own
        with ThreadPoolExecutor(1, initializer=name_thread, initargs=("engine-load",)) as pool:
            module = await asyncio.get_running_loop().run_in_executor(
                pool, importlib.import_module, "stages.engine.in_process"
            )
            argv = self._builtin_argv(engine) + list(self.config.extra_args)
            engine.local = module.InProcessEngine(
                argv, log=self.log, api_key=self.api_key, loader=pool
            )
            self.log.info("engine_launched", engine=engine.name, in_process=True, options=argv)
            await engine.local.start()
        engine.port = engine.local.port
        self.log.info("engine_ready", engine=engine.name, port=engine.port, in_process=True)

    async def _watch_in_process(self, engine: _Engine) -> None:
        """An engine in this process is not restarted on its own: if its scheduler thread
        dies, the generator gives it up (and fails; the supervisor restarts both)."""
        assert engine.local is not None
        while engine.local.alive:  # noqa: ASYNC110 (a thread that dies tells no event)
            await asyncio.sleep(1.0)
        if not self._closing:
            engine.given_up = True
            self.log.error("engine_given_up", engine=engine.name, reason="scheduler stopped")

    async def _first_start(self, engine: _Engine, tries: int = 3) -> None:
        """Start ``engine`` and wait for it; on another port if another engine took its port
        before it could bind it (a restart keeps the port: the generator's URLs are fixed)."""
        for attempt in range(tries):
            await self._spawn(engine)
            try:
                return await self._wait_healthy(engine)
            except _PortTaken:
                if attempt == tries - 1:
                    raise
                engine.port = rendezvous_port(self.host)

    async def _wait_healthy(self, engine: _Engine) -> None:
        import aiohttp  # here: the supervisor loads this module for its config without it

        url = f"http://{self.host}:{engine.port}/health"
        deadline = time.monotonic() + self.config.startup_timeout_s
        warned = False
        async with aiohttp.ClientSession() as session:
            while True:
                if engine.proc is not None and engine.proc.returncode is not None:
                    raise (_PortTaken if warned else RuntimeError)(
                        f"engine {engine.name} exited with code {engine.proc.returncode} while "
                        f"starting{' (another engine answers on its port)' if warned else ''}; "
                        f"its output is in {engine.out}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if answered_by_another(resp.headers, engine.engine_id):
                            if not warned:  # ours will meet the taken port and exit
                                self.log.warning(
                                    "engine_port_taken", engine=engine.name, port=engine.port
                                )
                                warned = True
                        elif resp.status == 200:
                            self.log.info("engine_ready", engine=engine.name, port=engine.port)
                            return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"engine {engine.name} did not answer {url} within "
                        f"{self.config.startup_timeout_s} s; its output is in {engine.out}"
                    )
                await asyncio.sleep(0.25)  # polling a server that is still loading its model

    async def _watch(self, engine: _Engine) -> None:
        while True:
            assert engine.proc is not None
            code = await engine.proc.wait()
            if self._closing:
                return
            self.log.error("engine_exited", engine=engine.name, exit_code=code)
            if engine.restarts >= self.config.max_restarts:
                engine.given_up = True
                self.log.error("engine_given_up", engine=engine.name, restarts=engine.restarts)
                return
            engine.restarts += 1
            engine.peer = await self._live_peer(engine)
            try:
                await self._spawn(engine)
            except OSError as exc:  # the command itself cannot start: retrying will not help
                engine.given_up = True
                self.log.error("engine_given_up", engine=engine.name, error=str(exc))
                return
            try:
                await self._wait_healthy(engine)
            except (RuntimeError, TimeoutError) as exc:
                self.log.error("engine_restart_failed", engine=engine.name, error=str(exc))
                if engine.peer is not None:  # its next start reads the checkpoint
                    engine.peer_failed = True
                # one that hangs while starting is killed, so that the loop starts it again
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(engine.proc.pid, signal.SIGKILL)

    async def _live_peer(self, engine: _Engine) -> int | None:
        """The port of a sibling of ``engine`` that is running and answers ``/health``, for
        ``engine``'s restart to take its weights from (``restart_from_peer``); None: none, or
        not to be asked."""
        if not self.config.restart_from_peer or self.config.kind != "builtin":
            return None
        if engine.peer_failed:
            return None
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for other in self.engines:
                alive = other.proc is not None and other.proc.returncode is None
                if other is engine or other.given_up or not alive:
                    continue
                url = f"http://{self.host}:{other.port}/health"
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200 and not answered_by_another(
                            resp.headers, other.engine_id
                        ):
                            self.log.info(
                                "engine_restart_from_peer", engine=engine.name, peer=other.name
                            )
                            return other.port
        return None

    async def close(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for e in self.engines:
            if e.local is not None:
                await e.local.close()
        live = [e for e in self.engines if e.proc is not None and e.proc.returncode is None]
        for e in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGTERM)
        if live:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(e.proc.wait()) for e in live], timeout=timeout_s
            )
            for e in live:
                if e.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(e.proc.pid, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None


def _trusting(extra_args: list[str]) -> list[str]:
    """SGLang's ``--trust-remote-code`` (the built-in engine's too) where the run trusts model
    folders' own code (``run.trust_remote_code``) and ``extra_args`` do not say it already."""
    flag = "--trust-remote-code"
    return [flag] if remote_code_trusted() and flag not in extra_args else []
