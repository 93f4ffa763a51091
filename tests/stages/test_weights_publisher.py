"""``WeightPublisher`` end to end against two engine processes speaking SGLang's weight routes.

Each engine is a minimal aiohttp server in its own spawned process wrapping a ``WeightReceiver``,
answering ``/init_weights_update_group`` and ``/update_weights_from_distributed`` with SGLang's
request and response shapes (``{success, message}``, HTTP 400 on failure), and
``/update_weight_version``; like SGLang, an update that names a ``weight_version`` makes it
current once its bucket is loaded. ``e0`` is SGLang 0.5.23: ``/server_info``, and updates only
inside a session (``/begin_weight_update`` ... ``/end_weight_update``, refused outside one with
its message); ``e1`` a SGLang from before sessions (no such routes, ``/get_server_info`` only).
Both take ``/pause_generation`` and ``/continue_generation``. A test-only ``GET
/weights_digest`` reports what each engine holds, as sha256 of the raw bytes, the requests it got
that set a version, and the framing calls in order (``calls``). A tensor named
``<engine>.refuse`` or ``<engine>.fail_after_receive`` makes that engine fail its request before
or after taking part in the broadcast.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from stages.weights.buckets import dtype_name
from stages.weights.publisher import WeightPublisher, WeightPublishError
from stages.weights.receiver import WeightReceiver

pytestmark = pytest.mark.timeout(60)

ENGINE_GROUP_TIMEOUT_S = 8


def _digest(t: torch.Tensor) -> list[Any]:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [dtype_name(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]


def _failure(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


async def _engine(name: str, conn: Any) -> None:
    receivers: dict[str, WeightReceiver] = {}
    held: dict[str, Any] = {"weights": {}, "weight_version": None, "version_set_by": []}
    held["calls"] = []  # pause, begin, update (paused or not), end, continue: in order
    state = {"paused": False, "session": False}
    sessions = name == "e0"  # SGLang 0.5.23; e1 is older

    async def pause(request: web.Request) -> web.Response:
        held["calls"].append("pause:" + (await request.json()).get("mode", "abort"))
        state["paused"] = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(_: web.Request) -> web.Response:
        held["calls"].append("continue")
        state["paused"] = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def begin(_: web.Request) -> web.Response:
        if state["session"]:
            return _failure(
                "a weight-update session is already open; call end_weight_update() first"
            )
        held["calls"].append("begin")
        state["session"] = True
        return web.json_response({"success": True, "message": "Success"})

    async def end(_: web.Request) -> web.Response:
        if not state["session"]:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        held["calls"].append("end")
        state["session"] = False
        return web.json_response({"success": True, "message": "Success"})

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23" if sessions else "0.4.10"})

    async def init_group(request: web.Request) -> web.Response:
        body = await request.json()
        receiver = WeightReceiver(timeout_s=ENGINE_GROUP_TIMEOUT_S)
        try:
            await asyncio.to_thread(
                receiver.init_group,
                body["master_address"],
                body["master_port"],
                body["rank_offset"],  # tp size 1: rank = rank_offset + 0
                body["world_size"],
                body.get("group_name", "weight_update_group"),
                body.get("backend", "nccl"),
            )
        except Exception as exc:
            return _failure(f"Failed to initialize custom process group: {exc}.")
        receivers[receiver.group_name or ""] = receiver
        return web.json_response({"success": True, "message": "Succeeded."})

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        names = body["names"]
        held["calls"].append("update" if state["paused"] else "update:not paused")
        if sessions and not state["session"]:
            return _failure(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if f"{name}.refuse" in names:
            return _failure(f"{name} refuses this update")
        receiver = receivers.get(body.get("group_name", "weight_update_group"))
        if receiver is None:
            return _failure(f"group {body.get('group_name')!r} not initialized")
        try:
            got = await asyncio.to_thread(
                receiver.receive, names, body["dtypes"], body["shapes"], body.get("load_format")
            )
        except Exception as exc:
            return _failure(f"Failed to update parameter online: {exc}")
        if f"{name}.fail_after_receive" in names:
            return _failure(f"{name} could not load the bucket")
        held["weights"].update({n: _digest(t) for n, t in got})
        if body.get("weight_version") is not None:  # SGLang: set after this update
            held["weight_version"] = str(body["weight_version"])
            held["version_set_by"].append("update_weights_from_distributed")
        return web.json_response({"success": True, "message": "Succeeded."})

    async def set_version(request: web.Request) -> web.Response:
        held["weight_version"] = (await request.json())["new_version"]
        held["version_set_by"].append("update_weight_version")
        return web.json_response({"success": True, "message": "Succeeded."})

    async def digest(_: web.Request) -> web.Response:
        return web.json_response(held)

    app = web.Application(client_max_size=1 << 26)
    app.add_routes(
        [
            web.post("/init_weights_update_group", init_group),
            web.post("/update_weights_from_distributed", update),
            web.post("/update_weight_version", set_version),
            web.get("/weights_digest", digest),
            web.post("/pause_generation", pause),
            web.post("/continue_generation", resume),
        ]
    )
    if sessions:
        app.add_routes(
            [
                web.get("/server_info", info),
                web.post("/begin_weight_update", begin),
                web.post("/end_weight_update", end),
            ]
        )
    else:
        app.add_routes([web.get("/get_server_info", info)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    conn.send(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await asyncio.Event().wait()  # serve until the test terminates this process


def _engine_main(name: str, conn: Any) -> None:
    asyncio.run(_engine(name, conn))


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    ctx = mp.get_context("spawn")
    procs, urls = [], []
    try:
        for name in ("e0", "e1"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_engine_main, args=(name, child), daemon=True)
            p.start()
            procs.append((p, parent))
        for p, parent in procs:
            if not parent.poll(30):
                pytest.fail(f"test engine process {p.pid} did not start within 30 s")
            urls.append(f"http://127.0.0.1:{parent.recv()}")
        yield urls
    finally:
        for p, _ in procs:
            p.kill()
            p.join(timeout=5)


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = [
        ("model.embed_tokens.weight", torch.randn(128, 32, generator=g).to(torch.bfloat16))
    ]
    for i in range(2):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", torch.randn(32, 32, generator=g).to(torch.bfloat16)),
            (p + "self_attn.q_proj.bias", torch.randn(32, generator=g)),
            (p + "mlp.up_proj.weight", torch.randn(64, 32, generator=g).half()),
            (p + "input_layernorm.weight", torch.randn(32, generator=g)),
        ]
    out.append(("model.step", torch.randint(0, 2**60, (3,), generator=g)))
    return out


async def _held(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/weights_digest") as r:
        return await r.json()


async def _assert_engines_hold(urls: list[str], weights: Any, version: int) -> None:
    want = {n: _digest(t) for n, t in weights}
    for url in urls:
        held = await _held(url)
        assert held["weight_version"] == str(version)
        assert {n: held["weights"][n] for n in want} == want, url


async def test_flattened_buckets_reach_both_engines_bit_exact(engines: list[str]) -> None:
    pub = WeightPublisher(engines, group_name="t_flat", bucket_mb=8 / 1024, timeout_s=20)
    try:
        await pub.connect()
        assert pub.world_size == 3
        for version in (1, 2):
            weights = _model(seed=version)
            stats = await pub.publish(weights, version=version)
            assert stats.version == version
            assert stats.buckets >= 3  # 8 KiB buckets: embed (8 KiB) alone, then the layers
            assert stats.bytes == sum(t.numel() * t.element_size() for _, t in weights)
            assert stats.seconds > 0 and stats.gb_per_s > 0
            await _assert_engines_hold(engines, weights, version)
        # each update framed as SGLang 0.5.23 wants it: paused in place, inside a session
        # (the older SGLang has none), then resumed
        await pub.settled()
        calls = [(await _held(url))["calls"] for url in engines]
        updates = ["update"] * stats.buckets
        assert calls[0][-len(updates) - 4 :] == [
            "pause:in_place",
            "begin",
            *updates,
            "end",
            "continue",
        ]
        assert calls[1][-len(updates) - 2 :] == ["pause:in_place", *updates, "continue"]
    finally:
        await pub.close()


async def test_per_tensor_broadcasts_from_a_bucket_wise_source(engines: list[str]) -> None:
    weights = _model(seed=3)
    gathered: list[int] = []

    def zero3_style():
        # The learner gathers one group at a time; each must be sent before the next is gathered.
        for start in range(0, len(weights), 4):
            gathered.append(start)
            yield weights[start : start + 4]

    pub = WeightPublisher(engines, group_name="t_per_tensor", load_format=None, timeout_s=20)
    try:
        await pub.connect()
        stats = await pub.publish(zero3_style, version=7)
        assert gathered == [0, 4, 8] and stats.buckets == 3
        await _assert_engines_hold(engines, weights, 7)
    finally:
        await pub.close()


async def test_a_listed_sources_last_bucket_carries_the_version(engines: list[str]) -> None:
    """Weights given as a list: their buckets are counted first and the last bucket's request
    makes the version current (no /update_weight_version round trip); a callable source, whose
    buckets come as they are gathered, still ends with one."""
    pub = WeightPublisher(engines, group_name="t_live", bucket_mb=8 / 1024, timeout_s=20)
    try:
        await pub.connect()
        before = [len((await _held(url))["version_set_by"]) for url in engines]
        weights = _model(seed=5)
        stats = await pub.publish(weights, version=11)
        assert stats.buckets >= 3
        await _assert_engines_hold(engines, weights, 11)
        for url, n in zip(engines, before, strict=True):
            assert (await _held(url))["version_set_by"][n:] == ["update_weights_from_distributed"]
        weights = _model(seed=6)
        await pub.publish(lambda: [weights], version=12)
        await _assert_engines_hold(engines, weights, 12)
        for url, n in zip(engines, before, strict=True):
            assert (await _held(url))["version_set_by"][n + 1 :] == ["update_weight_version"]
    finally:
        await pub.close()


async def test_engine_answering_failure_raises_naming_it(engines: list[str]) -> None:
    pub = WeightPublisher(engines, group_name="t_fail", timeout_s=20)
    try:
        await pub.connect()
        weights = [*_model(seed=4), ("e1.fail_after_receive", torch.zeros(2))]
        with pytest.raises(WeightPublishError, match=rf"engine {engines[1]}: .*could not load"):
            await pub.publish(weights, version=1)
        # the failed update still closed its frame (before it raised): no session left open,
        # no engine paused
        assert (await _held(engines[0]))["calls"][-2:] == ["end", "continue"]
        assert (await _held(engines[1]))["calls"][-1] == "continue"
        with pytest.raises(WeightPublishError, match=r"out of step.*close\(\) and connect\(\)"):
            await pub.publish(_model(seed=5), version=2)
    finally:
        await pub.close()


async def test_engine_refusing_does_not_hang_the_publisher(engines: list[str]) -> None:
    pub = WeightPublisher(engines, group_name="t_refuse", timeout_s=20)
    try:
        await pub.connect()
        started = time.monotonic()
        with pytest.raises(WeightPublishError, match=rf"engine {engines[1]}: .*refuses"):
            await pub.publish([("w", torch.zeros(4)), ("e1.refuse", torch.zeros(1))], version=1)
        # Raised on the engine's answer, not after the stuck broadcast's timeout.
        assert time.monotonic() - started < 5
    finally:
        closing = time.monotonic()
        await pub.close()
        assert time.monotonic() - closing < 2


async def test_connect_reports_an_unreachable_engine(engines: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    pub = WeightPublisher([engines[0], dead], group_name="t_dead", timeout_s=5)
    try:
        with pytest.raises(WeightPublishError, match=rf"engine {dead}: POST /init_weights"):
            await pub.connect()
        with pytest.raises(RuntimeError, match="not connected"):
            await pub.publish(_model(seed=6), version=1)
    finally:
        await pub.close()


async def test_a_session_left_open_is_closed_and_the_built_in_engine_is_not_paused(
    engines: list[str],
) -> None:
    """A publisher that died mid-update left e0's session open: the next one closes it and
    opens its own. ``pause=False`` (the built-in engine's case, found from its /server_info)
    frames the update with the session alone."""
    async with aiohttp.ClientSession() as s:
        async with s.post(engines[0] + "/begin_weight_update", json={}) as r:
            assert r.status == 200
    pub = WeightPublisher(engines, group_name="t_left_open", timeout_s=20, pause=False)
    try:
        await pub.connect()
        marks = [len((await _held(url))["calls"]) for url in engines]
        await pub.publish(_model(seed=8), version=3)
        await pub.settled()
        new = [(await _held(url))["calls"][n:] for url, n in zip(engines, marks, strict=True)]
        assert new[0] == ["end", "begin", "update:not paused", "end"]
        assert new[1] == ["update:not paused"]
        await _assert_engines_hold(engines, _model(seed=8), 3)
    finally:
        await pub.close()
