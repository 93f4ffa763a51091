"""The worker-process pieces a pool of one's own is built from: spawn, ready, exchange, kill.
(``FunctionPool`` itself is exercised by the reward and tool tests.)"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from pipeline.registry import PluginError
from stages.workers import (
    FunctionPool,
    WorkerLost,
    exchange,
    kill,
    prepare_worker,
    reap,
    serve,
    spawn_worker,
    wait_ready,
)

pytestmark = pytest.mark.timeout(60)  # worker processes


def _counter_worker(conn, start: int) -> None:
    """A stateful worker: adds each request to its total (what an environment pool keeps)."""
    prepare_worker()
    conn.send(("ready", os.getpid()))
    total = start

    def handle(request):
        nonlocal total
        if request == "lock":
            return threading.Lock()  # cannot be pickled
        if request == "sleep":
            time.sleep(3600)
        total += int(request)  # "x" raises
        return total

    serve(conn, handle)


def _refusing_worker(conn) -> None:
    conn.send(("failed", "no such environment"))


async def test_a_worker_answers_in_order_keeps_its_state_and_reports_what_it_cannot_do():
    worker = await asyncio.to_thread(spawn_worker, _counter_worker, (10,), label="env")
    try:
        assert await wait_ready(worker, 30) == worker.pid
        assert await exchange(worker, 1, 5) == ("ok", 11)
        assert await exchange(worker, 2, 5) == ("ok", 13)
        status, error = await exchange(worker, "x", 5)
        assert status == "error" and error.startswith("ValueError: invalid literal")
        status, error = await exchange(worker, "lock", 5)
        assert status == "error" and error.startswith("its value cannot be sent back")
        assert await exchange(worker, 1, 5) == ("ok", 14)  # still alive, state kept
        with pytest.raises(asyncio.TimeoutError):
            await exchange(worker, "sleep", 0.2)
    finally:
        kill(worker)
        await reap([worker])
    assert worker.proc.exitcode is not None
    with pytest.raises(WorkerLost, match="env worker"):
        await exchange(worker, 1, 5)


async def test_a_worker_that_reports_failure_is_a_plugin_error():
    worker = await asyncio.to_thread(spawn_worker, _refusing_worker, (), label="env")
    with pytest.raises(PluginError, match=r"env worker cannot load .*: no such environment"):
        await wait_ready(worker, 30)
    await reap([worker])


async def test_a_pool_that_cannot_restart_its_workers_says_so():
    crash = "tests.stages.test_tools:crash"
    pool = FunctionPool("tool", [crash], timeout_s=5, label="tool")
    await pool.start()
    try:
        pool.names = ["tests.stages.test_tools:gone"]  # what a replacement will fail to load
        reply = await pool.call(crash, {"code": 0})
        assert reply.status == "lost" and "tool worker died (exit code 0)" in reply.error
        with pytest.raises(RuntimeError, match=r"tool workers cannot be restarted: .*'gone'"):
            await pool.call(crash, {"code": 0})
    finally:
        await pool.aclose()
