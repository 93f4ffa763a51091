"""Garbage in, while a run goes on: every inbox a stage binds and both control-bus sockets get
random bytes, empty and truncated multipart messages, an oversized frame, valid msgpack of an
unknown kind or schema version, and array headers that disagree with their frames. Each is
refused and counted (logged at its 1st, 2nd, 4th ... occurrence); no replica fails or restarts,
and the run goes on. (The engine's HTTP routes: tests/stages/test_engine_server.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from tests.pipeline.runs import events, kill_tree, spawned_pids, start_endless_example, wait_for
from transport import Message, encode

pytestmark = pytest.mark.slow

ROUNDS = 3  # each garbage message is sent this often (so sparse logging shows)


def _array_frames(kind: str, version: int, shape: list[int], payload: bytes) -> list[bytes]:
    """A message whose array header says ``shape`` (float32) but whose frame is ``payload``."""
    frames = encode(Message(kind, {"id": 1, "values": np.zeros(4, np.float32)}, version=version))
    header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
    ref = msgpack.ExtType(1, msgpack.packb([1, "float32", shape]))
    header["data"]["values"] = ref
    return [msgpack.packb(header), payload]


async def _inbox_garbage(zctx: zmq.asyncio.Context, address: str, name: str) -> int:
    """Send garbage to one inbox; returns how many messages it must have rejected."""
    rng = random.Random(name)
    raw = zctx.socket(zmq.DEALER)
    raw.linger = 5000  # what is queued still goes out after close()
    raw.routing_id = f"garbage.0/{name}".encode()
    raw.connect(address)
    sent = 0
    try:
        unframed = [
            [bytes(rng.randrange(256) for _ in range(64))],  # random bytes, one frame
            [b""],  # empty
            [b"D"],  # a tag and nothing else
            [b"D", b"\x81\xa2to"],  # truncated msgpack
            [b"Q", msgpack.packb({})],  # unknown tag
            [b"H", msgpack.packb({"identity": 3})],  # HELLO of the wrong types
        ]
        for _ in range(ROUNDS):
            for frames in unframed:
                await raw.send_multipart(frames)
                sent += 1
        # data that is valid msgpack but not ours (without credit: decoded all the same)
        head = msgpack.packb({"to": "nobody", "epoch": 0})
        framed = [
            encode(Message("nope", {"id": 1})),  # unknown kind
            encode(Message("item", {"id": 1, "values": np.zeros(2)}, version=9)),  # version
            [msgpack.packb([1, 2, 3])],  # a header that is not a map
            _array_frames("item", 1, [1000], b"\0" * 16),  # shape says more than the frame
            _array_frames("item", 1, [-4], b"\0" * 16),  # a negative dimension
            [bytes(rng.randrange(256) for _ in range(128))],  # random header
        ]
        for _ in range(ROUNDS):
            for frames in framed:
                await raw.send_multipart([b"D", head, *frames])
                sent += 1
    finally:
        raw.close()
    return sent


async def _oversized(zctx: zmq.asyncio.Context, address: str) -> None:
    """A frame over transport.max_message_mb: ZeroMQ drops the connection before it is read."""
    raw = zctx.socket(zmq.DEALER)
    raw.linger = 5000
    raw.routing_id = b"garbage.0/big"
    raw.connect(address)
    try:
        await raw.send_multipart([b"D", b"\0" * (3 * 2**20)])
        await asyncio.sleep(0.5)
    finally:
        raw.close()


async def _control_garbage(zctx: zmq.asyncio.Context, control: dict) -> int:
    """Unsigned, wrongly signed and malformed messages on the bus, and junk at its XPUB side."""
    pub = zctx.socket(zmq.PUB)
    pub.linger = 5000
    pub.connect(control["pub"])
    sub = zctx.socket(zmq.XSUB)
    sub.linger = 5000
    sub.connect(control["sub"])
    await asyncio.sleep(0.5)  # the broker's subscription reaches our PUB
    sent = 0
    try:
        stop = {"stage": "power", "replica": 0, "session": "x", "reason": "garbage"}
        for _ in range(ROUNDS):
            for frames in (
                [b"stop", msgpack.packb(stop)],  # unsigned
                [b"stop", msgpack.packb(stop), b"\0" * 16],  # signed with the wrong key
                [b"ledger", b"\xc1", b"\0" * 16],  # not msgpack
                [b"stop"],  # one frame
            ):
                await pub.send_multipart(frames)
                sent += 1
            await sub.send_multipart([b"\x07junk"])  # neither (un)subscribe: counted
            sent += 1
    finally:
        pub.close()
        sub.close()
    return sent


async def _throw(inboxes: dict[str, str], control: dict) -> tuple[dict[str, int], int]:
    zctx = zmq.asyncio.Context()
    try:
        expected = {name: await _inbox_garbage(zctx, a, name) for name, a in inboxes.items()}
        for address in inboxes.values():
            await _oversized(zctx, address)
        return expected, await _control_garbage(zctx, control)
    finally:
        zctx.term()  # waits until every closed socket has sent what it queued


def _last_metrics(run_dir, replica: str) -> dict:
    found = [e for e in events(run_dir, replica) if e["event"] == "metrics"]
    return found[-1] if found else {}


def _rejected(metrics: dict, port: str) -> int:
    prefix = f"in.{port}.rejected."
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def _stop(proc, run_dir) -> None:
    """Ctrl-C the run, as a user would, and leave nothing of it running."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())


def _nothing_failed_or_restarted(run_dir) -> None:
    supervisor = events(run_dir, "supervisor")
    assert not [e for e in supervisor if e["event"] in ("replica_failed", "replica_restarting")]


@pytest.mark.timeout(150)
def test_garbage_on_every_socket_is_refused_and_counted_and_nothing_restarts(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir, "transport.max_message_mb=1", "run.metrics_every_s=0.3")
    try:
        specs = [json.loads(p.read_text()) for p in sorted((run_dir / "specs").glob("*.json"))]
        inboxes = {
            f"{s['stage']}.{s['replica']}/{port}": spec["address"]
            for s in specs
            for port, spec in s["inputs"].items()
        }
        assert len(inboxes) == 3  # power.0, power.1, summary.0
        expected, control_sent = asyncio.run(_throw(inboxes, specs[0]["control"]))

        def counted() -> bool:
            for name, n in expected.items():
                replica, port = name.split("/")
                if _rejected(_last_metrics(run_dir, replica), port) < n:
                    return False
            return True

        wait_for(counted, 30, "every inbox to count what it rejected")
        received = {r: _last_metrics(run_dir, r)["in.items.received"] for r in ("summary.0",)}
        wait_for(
            lambda: (
                _last_metrics(run_dir, "summary.0")["in.items.received"]
                > received["summary.0"] + 10
            ),
            30,
            "the run to go on",
        )
    finally:
        _stop(proc, run_dir)
    _nothing_failed_or_restarted(run_dir)
    assert not [e for e in events(run_dir, "*.[0-9]") if e["event"] == "stage_failed"]
    for name, n in expected.items():
        replica, port = name.split("/")
        metrics = _last_metrics(run_dir, replica)
        # exactly what was sent, each counted once; the oversized frame was never read (read,
        # it would have been rejected too: its header frame is not msgpack); its peer was cut
        # off, counted with the garbage peer that left (the run's own producers stayed)
        assert _rejected(metrics, port) == n, (name, metrics)
        assert metrics[f"in.{port}.disconnects"] >= 2, (name, metrics)
        logged = [e for e in events(run_dir, replica) if e["event"] == "message_rejected"]
        by_reason = {
            k.rsplit(".", 1)[1]: v
            for k, v in metrics.items()
            if k.startswith(f"in.{port}.rejected.")
        }
        for reason, count in by_reason.items():
            assert len([e for e in logged if e["reason"] == reason]) == count.bit_length()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped", summary  # the unsigned `stop`s did not end it
    refused = summary["control_refused"]
    # each counted once, as not signed (no tag, or a wrong one), malformed or not a subscription
    assert refused.get("not signed with this run's key", 0) >= 2 * ROUNDS, refused
    assert refused.get("not a subscription") == ROUNDS, refused
    assert sum(refused.values()) == control_sent, refused


async def _intrude(inboxes: dict[str, str], control: dict) -> None:
    """Valid-looking data and stops from sockets without CURVE keys. Their handshake fails, so
    a DEALER never has a peer to send to (it would block): send without blocking, and give up."""
    zctx = zmq.asyncio.Context()
    sockets = []
    try:
        for name, address in inboxes.items():
            raw = zctx.socket(zmq.DEALER)
            raw.routing_id = f"garbage.0/{name}".encode()
            raw.connect(address)
            sockets.append(raw)
        pub = zctx.socket(zmq.PUB)
        pub.connect(control["pub"])
        sub = zctx.socket(zmq.SUB)
        sub.connect(control["sub"])
        sockets += [pub, sub]
        stop = {"stage": "power", "replica": 0, "session": "x", "reason": "intruder"}
        item = encode(Message("item", {"id": 1, "values": np.zeros(4, np.float32)}))
        head = msgpack.packb({"to": "nobody", "epoch": 0})
        for _ in range(10):
            for raw in sockets[:-2]:
                with contextlib.suppress(zmq.Again):
                    raw.send_multipart([b"D", head, *item], flags=zmq.NOBLOCK)
            pub.send_multipart([b"stop", msgpack.packb(stop)])
            await asyncio.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        zctx.term()


@pytest.mark.timeout(120)
def test_with_curve_a_peer_without_the_keys_gets_nothing_in_and_is_counted(tmp_path):
    """The same garbage, and valid-looking stops, from a process that lacks the run's CURVE
    keys: not one message reaches a stage or the supervisor (nothing is even rejected, it
    never gets that far), each inbox and the bus count the refused peers, the run goes on."""
    run_dir = tmp_path / "run"
    proc = start_endless_example(
        run_dir, "transport.scheme=tcp", "transport.curve=true", "run.metrics_every_s=0.3"
    )
    try:
        specs = [json.loads(p.read_text()) for p in sorted((run_dir / "specs").glob("*.json"))]
        assert all(len(s["curve"]["server_secret"]) == 40 for s in specs)
        inboxes = {
            f"{s['stage']}.{s['replica']}/{port}": spec["address"]
            for s in specs
            for port, spec in s["inputs"].items()
        }
        assert all(a.startswith("tcp://127.0.0.1:") for a in inboxes.values())
        before = _last_metrics(run_dir, "summary.0").get("in.items.received", 0)
        asyncio.run(_intrude(inboxes, specs[0]["control"]))

        def refused_everywhere() -> bool:
            ports = [name.split("/") for name in inboxes]
            metrics = {replica: _last_metrics(run_dir, replica) for replica, _ in ports}
            return all(metrics[r].get(f"in.{port}.refused_peers", 0) > 0 for r, port in ports)

        wait_for(refused_everywhere, 30, "every inbox to count the refused peer")
        wait_for(
            lambda: _last_metrics(run_dir, "summary.0")["in.items.received"] > before + 10,
            30,
            "the run to go on",
        )
    finally:
        _stop(proc, run_dir)
    _nothing_failed_or_restarted(run_dir)
    for name in inboxes:
        replica, port = name.split("/")
        assert _rejected(_last_metrics(run_dir, replica), port) == 0  # nothing got that far
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped", summary
    refused = summary["control_refused"]  # peers turned away; no message of theirs counted
    assert list(refused) == ["peers without the run's CURVE keys"], refused
    assert refused["peers without the run's CURVE keys"] >= 2, refused
