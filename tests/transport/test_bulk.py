"""Sealed bulk frames (transport.bulk): on a CURVE channel, frames of 1 MiB or more travel
AES-GCM sealed on the consumer's bulk port. They arrive whole and in order, anything altered is
refused, what an outsider sends there is dropped and counted, and nothing waits forever."""

from __future__ import annotations

import asyncio
import os
import random
import socket

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from tests.transport.conftest import eventually
from tests.transport.test_channel import receiver, sender
from tests.transport.test_curve import RUN, outside  # noqa: F401 (a fixture)
from transport import bulk, encode, ipc_address, tcp_address
from transport.codec import decode
from transport.errors import DecodeError, TransportError
from transport.message import Message

MIB = 1 << 20


def _message(i: int, mib: float = 2.5) -> dict:
    big = torch.arange(int(mib * MIB) // 4, dtype=torch.float32) + i
    return {"id": i, "big": big, "small": np.full(3, i, dtype=np.int64), "also": big[:5].clone()}


def _same(got: dict, want: dict) -> bool:
    return (
        got["id"] == want["id"]
        and torch.equal(got["big"], want["big"])
        and np.array_equal(got["small"], want["small"])
        and torch.equal(got["also"], want["also"])
    )


@pytest.mark.timeout(20)
async def test_large_frames_go_sealed_beside_the_curve_socket_and_arrive_whole(ctx) -> None:
    r = receiver(ctx, tcp_address(), capacity=4, expected=["p.0"], curve=RUN)
    await r.start()
    s = sender(ctx, [r.address], curve=RUN)
    await s.start()
    sent = [_message(i) if i % 2 == 0 else {"id": i} for i in range(8)]

    async def produce() -> None:
        for data in sent:
            await s.send("item", data)
        await s.aclose()  # at once: the end waits for the last sealed pieces

    task = asyncio.create_task(produce())
    got = [m.data async for m in r]
    await asyncio.wait_for(task, 10)
    assert [g["id"] for g in got] == list(range(8))
    assert all(_same(g, w) for g, w in zip(got, sent, strict=True) if "big" in w)
    assert r.bulk_port is not None and str(r.bulk_port) not in r.address
    assert s.stats()["sealed"] == 4 and s.stats()["sealed_bytes"] > 4 * 2.5 * MIB
    stats = r.stats()
    assert stats["bulk_opened"] == 4 and stats["bulk_waiting"] == 0 and stats["rejected"] == {}
    await r.aclose()


@pytest.mark.timeout(20)
async def test_a_batch_with_large_frames_goes_sealed_and_what_follows_waits_its_turn(ctx) -> None:
    """``send_many`` to a CURVE consumer: a batch whose frames are large goes sealed like a
    single message; a small batch and a single message sent after it arrive after it."""
    r = receiver(ctx, tcp_address(), capacity=8, expected=["p.0"], curve=RUN)
    await r.start()
    s = sender(ctx, [r.address], curve=RUN)
    await s.start()
    await eventually(lambda: s.credit() == 8)
    large = [_message(0), {"id": 1}, _message(2)]
    await s.send_many("item", large)
    await s.send_many("item", [{"id": 3}, {"id": 4}])
    await s.send("item", {"id": 5})
    await s.aclose()
    got = [m.data async for m in r]
    assert [g["id"] for g in got] == list(range(6))
    assert _same(got[0], large[0]) and _same(got[2], large[2])
    assert s.stats()["batches"] == 2 and s.stats()["sealed"] == 1
    assert r.stats()["bulk_opened"] == 1 and r.stats()["rejected"] == {}
    await r.aclose()


@pytest.mark.timeout(20)
async def test_without_curve_nothing_is_sealed(ctx, ipc_dir) -> None:
    for addr in (tcp_address(), ipc_address(ipc_dir, "in")):
        r = receiver(ctx, addr, expected=["p.0"])
        await r.start()
        s = sender(ctx, [r.address])
        await s.start()
        await s.send("item", _message(1))
        await s.aclose()
        (msg,) = [m async for m in r]
        assert _same(msg.data, _message(1)) and r.bulk_port is None
        assert s.stats()["sealed"] == 0 and r.stats()["bulk_opened"] == 0
        await r.aclose()


@pytest.mark.timeout(20)
async def test_the_bulk_port_takes_nothing_from_an_outsider(ctx, outside) -> None:  # noqa: F811
    r = receiver(ctx, tcp_address(), capacity=4, curve=RUN, bulk_timeout_s=0.4)
    await r.start()
    intruder = outside.socket(zmq.PUSH)
    intruder.linger = 0
    intruder.connect(f"{r.address.rpartition(':')[0]}:{r.bulk_port}")
    s = sender(ctx, [r.address], curve=RUN)
    await s.start()
    try:
        # pieces under a made-up token, a message with no token, and a frame too large
        await intruder.send_multipart([os.urandom(16), os.urandom(MIB + 16)])
        await intruder.send_multipart([b"hello"])
        await intruder.send_multipart([os.urandom(16), os.urandom(2 * MIB)])
        await eventually(
            lambda: (
                r.stats()["rejected"].get("bulk_unclaimed") == 1
                and r.stats()["rejected"].get("bulk_forged") == 1
            ),
            timeout=5,
        )
        assert r.stats()["received"] == 0 and r.stats()["depth"] == 0
        await s.send("item", _message(7))  # and the channel still serves its own
        msg = await asyncio.wait_for(r.recv(), 5)
        assert _same(msg.data, _message(7))
    finally:
        intruder.close()
        await s.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(20)
async def test_a_data_whose_pieces_never_come_is_dropped_counted_and_let_go(ctx) -> None:
    r = receiver(ctx, tcp_address(), capacity=4, expected=["p.0"], curve=RUN, bulk_timeout_s=0.4)
    await r.start()
    s = sender(ctx, [r.address], curve=RUN)
    await s.start()
    await eventually(lambda: s._peers[0].bulk is not None)
    # Its pieces go to a port where nobody listens: they never arrive.
    s._peers[0].bulk.close(linger=0)
    nowhere = ctx.socket(zmq.PUSH)
    nowhere.linger = 0
    nowhere.connect(tcp_address())
    s._peers[0].bulk = nowhere
    await s.send("item", _message(1))
    await s.send("item", {"id": 2})
    await asyncio.sleep(0.2)
    assert r.stats()["depth"] == 0 and r.stats()["bulk_waiting"] == 1  # in order: 2 waits
    msg = await asyncio.wait_for(r.recv(), 5)
    assert msg.data["id"] == 2 and r.stats()["rejected"] == {"bulk_missing": 1}
    await eventually(lambda: s.stats()["unacked"] == 0)  # acknowledged: never sent again
    await s.aclose()
    assert [m async for m in r] == []  # and the stream still ends
    await r.aclose()


def _below_ephemeral_ports() -> str:
    """A free port the kernel never hands out as a connection's own end: a producer retrying
    the consumer's dead port from an ephemeral one must not take the port the consumer rebinds
    (a TCP self-connection), as with ``tcp_address()``'s ports it can."""
    for port in random.Random().sample(range(20000, 32000), 50):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return tcp_address(port=port)
    raise RuntimeError("no free port in 20000-32000")


async def _rebind(ctx, addr: str):
    """A receiver on the address one just closed: libzmq lets go of a tcp port in its own time."""
    for _ in range(40):
        r = receiver(ctx, addr, capacity=4, curve=RUN)
        try:
            await r.start()
            return r
        except TransportError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{addr} stayed bound after its receiver closed")


def _sealed(mib: float = 2.5):
    frames = encode(Message("item", _message(3, mib)))
    kept, descriptor, parts = bulk.seal(frames)
    return frames, kept, descriptor, parts


def test_seal_and_open_round_trip_only_the_large_frames() -> None:
    frames, kept, descriptor, parts = _sealed()
    sizes = [memoryview(f).nbytes for f in frames]
    assert [i for i, f in enumerate(kept) if memoryview(f).nbytes == 0] == [
        i for i, n in enumerate(sizes) if n >= bulk.BULK_MIN_BYTES
    ]
    assert len(parts) == 1 + 3  # the token and 2.5 MiB in 1 MiB pieces
    opened = bulk.open_sealed(descriptor, kept, parts[1:])
    assert _same(decode(opened).data, _message(3))


@pytest.mark.parametrize(
    "harm",
    ["flip a byte", "drop a piece", "extra piece", "swap pieces", "other key", "no placeholder"],
)
def test_anything_altered_is_refused(harm: str) -> None:
    _, kept, descriptor, parts = _sealed()
    pieces = list(parts[1:])
    if harm == "flip a byte":
        bad = bytearray(pieces[1])
        bad[100] ^= 1
        pieces[1] = bytes(bad)
    elif harm == "drop a piece":
        pieces.pop()
    elif harm == "extra piece":
        pieces.append(pieces[0])
    elif harm == "swap pieces":
        pieces[0], pieces[1] = pieces[1], pieces[0]
    elif harm == "other key":
        descriptor = {**descriptor, "key": os.urandom(32)}
    else:
        index = descriptor["frames"][0][0]
        kept[index] = b"x"
    with pytest.raises(DecodeError) as e:
        bulk.open_sealed(descriptor, kept, pieces)
    assert e.value.reason == "bulk_forged"


@pytest.mark.parametrize(
    "descriptor", [None, [], {"token": b"x", "key": b"k" * 32, "frames": [[1, 5]]}, {}]
)
def test_a_malformed_descriptor_is_named(descriptor) -> None:
    with pytest.raises(DecodeError) as e:
        bulk.descriptor_token(descriptor)
    assert e.value.reason == "bulk_forged"


@pytest.mark.timeout(20)
async def test_sealed_messages_are_sent_again_to_a_consumer_that_came_back(ctx) -> None:
    addr = _below_ephemeral_ports()
    first = receiver(ctx, addr, capacity=4, curve=RUN)
    await first.start()
    s = sender(ctx, [addr], curve=RUN)
    await s.start()
    for i in range(3):
        await s.send("item", _message(i))
    await eventually(lambda: first.stats()["depth"] == 3)
    assert (await first.recv()).data["id"] == 0
    await eventually(lambda: s.stats()["acked"] == 1)
    old_port = first.bulk_port
    await first.aclose()  # two taken by nobody: they go again, sealed afresh
    second = await _rebind(ctx, addr)
    try:
        got = [(await asyncio.wait_for(second.recv(), 5)).data for _ in range(2)]
        assert [g["id"] for g in got] == [1, 2] and second.bulk_port != old_port
        assert all(_same(g, _message(g["id"])) for g in got)
        await eventually(lambda: s.stats()["acked"] == 3)
        assert s.stats()["redelivered"] == 2 and s.stats()["sealed"] == 5
    finally:
        await s.aclose(eos=False)
        await second.aclose()
