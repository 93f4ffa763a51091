"""Channels over real sockets: order, credit bounds, fairness, end-of-stream, rejection,
restarts and reclaimed credit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from tests.transport.conftest import RAW_HELLO, events, eventually, raw_hello, raw_producer
from transport import (
    ChannelClosed,
    EndOfStream,
    Message,
    Receiver,
    Schema,
    Sender,
    encode,
    ipc_address,
    tcp_address,
)
from transport.credit import sparse

ITEM = Schema("item", 1, {"id": "int"})
FAST = {"heartbeat_s": 0.05, "peer_timeout_s": 1.0}


def address(scheme: str, ipc_dir: Path, name: str = "in") -> str:
    return ipc_address(ipc_dir, name) if scheme == "ipc" else tcp_address()


def receiver(ctx, addr, *, capacity=4, expected=None, log=None, **kw) -> Receiver:
    return Receiver(
        "in", addr, [ITEM], capacity=capacity, expected_producers=expected, ctx=ctx, log=log, **kw
    )


def sender(ctx, peers, identity="p.0", log=None, **kw) -> Sender:
    return Sender("out", peers, [ITEM], identity=identity, ctx=ctx, log=log, **{**FAST, **kw})


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_messages_arrive_in_order_with_tensors(ctx, ipc_dir, scheme) -> None:
    addr = address(scheme, ipc_dir)
    r, s = receiver(ctx, addr, expected=["p.0"]), sender(ctx, [addr])
    await r.start()
    await s.start()

    async def produce() -> None:
        for i in range(50):
            await s.send("item", {"id": i, "t": torch.full((3,), float(i), dtype=torch.bfloat16)})
        await s.aclose()

    task = asyncio.create_task(produce())
    got = [msg async for msg in r]
    await asyncio.wait_for(task, 5)
    assert [m.data["id"] for m in got] == list(range(50))
    assert all(m.sender == "p.0" and m.data["t"][0].item() == m.data["id"] for m in got)
    stats = r.stats()
    assert stats["received"] == 50 and stats["uncredited"] == 0 and stats["rejected"] == {}
    assert s.stats()["sent"] == 50
    with pytest.raises(EndOfStream):
        await r.recv()
    await r.aclose()
    with pytest.raises(ChannelClosed):
        await r.recv()
    with pytest.raises(ChannelClosed):
        await s.send("item", {"id": 0})


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_slow_consumer_bounds_the_producer(ctx, ipc_dir, scheme) -> None:
    capacity, count = 3, 40
    addr = address(scheme, ipc_dir)
    r, s = receiver(ctx, addr, capacity=capacity), sender(ctx, [addr])
    await r.start()
    await s.start()
    taken = 0
    ahead: list[int] = []  # sent - taken, seen by the producer after every send
    inbox: list[int] = []  # depth + credit outstanding, seen by the consumer

    async def produce() -> None:
        for i in range(count):
            await s.send("item", {"id": i})
            ahead.append(s.stats()["sent"] - taken)

    async def consume() -> None:
        nonlocal taken
        for _ in range(count):
            await r.recv()
            taken += 1
            st = r.stats()
            inbox.append(st["depth"] + st["credit_outstanding"])
            await asyncio.sleep(0.005)  # a slow consumer

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 8)
    assert max(ahead) <= capacity, ahead
    assert max(inbox) <= capacity, inbox
    assert r.stats()["peak"] <= capacity
    assert s.stats()["credit_wait_s"] > 0.05  # the producer really was held back
    await s.aclose(eos=False)
    await r.aclose()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("expected", [["a.0", "b.0"], None], ids=["expected", "open"])
async def test_fan_in_two_producers_both_progress(ctx, ipc_dir, expected) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=4, expected=expected)
    a, b = sender(ctx, [addr], "a.0"), sender(ctx, [addr], "b.0")
    await r.start()
    for s in (a, b):
        await s.start()

    async def produce(s: Sender) -> None:
        for i in range(100):
            await s.send("item", {"id": i})

    tasks = [asyncio.create_task(produce(s)) for s in (a, b)]
    senders = []
    for _ in range(60):
        senders.append((await asyncio.wait_for(r.recv(), 5)).sender)
        await asyncio.sleep(0.001)
    assert senders.count("a.0") >= 20 and senders.count("b.0") >= 20, senders
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in (a, b):
        await s.aclose(eos=False)
    await r.aclose()


@pytest.mark.timeout(10)
async def test_fan_out_balances_by_credit(ctx, ipc_dir) -> None:
    addrs = [ipc_address(ipc_dir, "in0"), ipc_address(ipc_dir, "in1")]
    rs = [receiver(ctx, a, capacity=4, expected=["p.0"]) for a in addrs]
    s = sender(ctx, addrs)
    for r in rs:
        await r.start()
    await s.start()
    await eventually(lambda: s.stats()["peers_live"] == 2)

    async def produce() -> None:
        for i in range(60):
            await s.send("item", {"id": i})
        await s.aclose()

    async def consume(r: Receiver) -> list[int]:
        ids = []
        async for msg in r:
            ids.append(msg.data["id"])
            await asyncio.sleep(0.002)
        return ids

    _, got0, got1 = await asyncio.wait_for(
        asyncio.gather(produce(), consume(rs[0]), consume(rs[1])), 8
    )
    assert sorted(got0 + got1) == list(range(60))
    assert got0 == sorted(got0) and got1 == sorted(got1)  # order kept per consumer
    assert len(got0) >= 20 and len(got1) >= 20, (len(got0), len(got1))
    for r in rs:
        await r.aclose()


@pytest.mark.timeout(10)
async def test_end_of_stream_waits_for_every_expected_producer(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=8, expected=["a.0", "b.0"])  # 4 slots each
    a, b = sender(ctx, [addr], "a.0"), sender(ctx, [addr], "b.0")
    await r.start()
    for s in (a, b):
        await s.start()
    for i in range(3):
        await asyncio.wait_for(a.send("item", {"id": i}), 3)
    await a.aclose()
    await asyncio.wait_for(b.send("item", {"id": 10}), 3)
    got = [(await asyncio.wait_for(r.recv(), 3)).sender for _ in range(4)]
    assert sorted(got) == ["a.0", "a.0", "a.0", "b.0"]
    # b has not finished: the stream is still open.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(r.recv(), 0.2)
    await b.aclose()
    with pytest.raises(EndOfStream):
        await asyncio.wait_for(r.recv(), 3)
    assert r.stats()["finished"] == ["a.0", "b.0"]
    await r.aclose()


@pytest.mark.timeout(10)
async def test_bad_messages_are_rejected_counted_and_the_next_one_arrives(
    ctx, ipc_dir, log
) -> None:
    capacity = 6  # exactly the messages below that carry credit; small enough to top up by 1
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=capacity, log=log)
    await r.start()
    raw = raw_producer(ctx, addr)
    try:
        tag, credit = await raw_hello(raw)
        assert tag == b"C" and credit["grant"] == capacity
        data = msgpack.packb({"to": credit["session"], "epoch": credit["epoch"]})

        bad = {
            "not_msgpack": [b"\xc1"],
            "unknown_kind": encode(Message("nope", {"id": 1})),
            "bad_version": encode(Message("item", {"id": 1}, version=9)),
            "invalid_fields": encode(Message("item", {"id": "one"})),
            "frame_count": [],
        }
        for frames in bad.values():
            await raw.send_multipart([b"D", data, *frames])
        for frames in ([b"Z", msgpack.packb({})], [b"D"], [b"H", b"\xc1"], [b"H", b"{}"]):
            await raw.send_multipart(frames)
        await raw.send_multipart([b"D", data, *encode(Message("item", {"id": 7}))])

        msg = await asyncio.wait_for(r.recv(), 3)
        assert msg.data == {"id": 7} and msg.sender == "raw.0"
        rejected = r.stats()["rejected"]
        assert rejected == {**{reason: 1 for reason in bad}, "bad_control": 4}, rejected
        logged = events(log, "message_rejected")
        # each reason's 1st, 2nd, 4th ... rejection is logged, with its count
        assert sorted((e["reason"], e["count"]) for e in logged) == sorted(
            (reason, k) for reason, n in rejected.items() for k in range(1, n + 1) if sparse(k)
        )
        assert all(e["port"] == "in" and e["detail"] for e in logged)
        assert {e["sender"] for e in logged if e["reason"] != "bad_control"} == {"raw.0"}
        # Every slot came back: the rejected ones and the one the app took out.
        await eventually(lambda: r.stats()["credit_outstanding"] == capacity)
        assert r.stats()["uncredited"] == 0
    finally:
        raw.close()
        await r.aclose()


@pytest.mark.timeout(10)
async def test_ping_writes_off_lost_data(ctx, ipc_dir, log) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=4, log=log)
    await r.start()
    raw = raw_producer(ctx, addr)
    try:
        _, credit = await raw_hello(raw)
        assert credit["granted"] == 4
        # Claim 4 DATA were sent that never arrived: their credit must not stay outstanding.
        ping = {**RAW_HELLO, "to": credit["session"], "epoch": credit["epoch"], "sent": 4}
        await raw.send_multipart([b"H", msgpack.packb(ping)])
        credit = msgpack.unpackb((await asyncio.wait_for(raw.recv_multipart(), 3))[1])
        assert credit["granted"] == 8 and credit["grant"] == 4
        assert events(log, "data_lost")[0]["count"] == 4
    finally:
        raw.close()
        await r.aclose()


@pytest.mark.timeout(10)
async def test_producer_validates_what_it_sends(ctx, ipc_dir) -> None:
    s = sender(ctx, [ipc_address(ipc_dir, "in")])
    await s.start()
    with pytest.raises(ValueError, match="not declared"):
        await s.send("nope", {"id": 1})
    with pytest.raises(ValueError, match="missing field 'id'"):
        await s.send("item", {})
    await s.aclose(eos=False)


@pytest.mark.timeout(10)
async def test_sender_without_peers_drops_and_counts(ctx, log) -> None:
    s = sender(ctx, [], log=log)
    await s.start()
    for i in range(3):
        await s.send("item", {"id": i})
    assert s.stats()["dropped"] == 3 and s.stats()["sent"] == 0
    assert len(events(log, "message_dropped")) == 1
    await s.aclose()


@pytest.mark.timeout(10)
async def test_consumer_restart_producer_continues(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=2)
    s = sender(ctx, [addr])
    await first.start()
    await s.start()
    for i in range(3):
        await asyncio.wait_for(s.send("item", {"id": i}), 3)
        assert (await asyncio.wait_for(first.recv(), 3)).data["id"] == i
    await first.aclose()
    # The CLOSE notice takes the producer's credit away: it now waits.
    await eventually(lambda: s.stats()["credit"][addr] == 0 and s.stats()["peers_live"] == 0)
    sending = asyncio.create_task(s.send("item", {"id": 3}))
    await asyncio.sleep(0.05)
    assert not sending.done() and s.stats()["blocked"]

    second = receiver(ctx, addr, capacity=2, expected=["p.0"])
    await second.start()
    collecting = asyncio.create_task(collect(second))
    await asyncio.wait_for(sending, 3)
    for i in range(4, 8):
        await asyncio.wait_for(s.send("item", {"id": i}), 3)
    await s.aclose()
    assert await asyncio.wait_for(collecting, 3) == [3, 4, 5, 6, 7]
    await second.aclose()


async def collect(r: Receiver) -> list[int]:
    return [m.data["id"] async for m in r]


@pytest.mark.timeout(10)
async def test_credit_of_a_vanished_producer_is_reclaimed(ctx, ipc_dir, log) -> None:
    capacity = 4
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=capacity, log=log, peer_timeout_s=0.4)
    a = sender(ctx, [addr], "a.0", peer_timeout_s=0.4)
    await r.start()
    await a.start()
    await eventually(lambda: a.stats()["credit"][addr] == capacity)  # alone: all of it
    b = sender(ctx, [addr], "b.0", peer_timeout_s=0.4)
    await b.start()
    await eventually(lambda: r.stats()["producers"] == 2)
    assert b.stats()["credit"][addr] == 0  # a holds every slot and is not sending
    await a.aclose(eos=False)  # gone without a word
    await eventually(lambda: b.stats()["credit"][addr] == capacity)
    assert r.stats()["producers"] == 1
    assert events(log, "producer_lost")[0]["sender"] == "a.0"
    await b.aclose(eos=False)
    await r.aclose()


@pytest.mark.timeout(10)
async def test_uncredited_data_is_accepted_and_counted(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=2)
    await r.start()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.routing_id = b"old.0/s0"
    raw.connect(addr)
    try:
        # DATA for a stream this consumer never opened (it restarted since).
        stale = msgpack.packb({"to": "previous-session", "epoch": 3})
        await raw.send_multipart([b"D", stale, *encode(Message("item", {"id": 1}))])
        msg = await asyncio.wait_for(r.recv(), 3)
        assert msg.data == {"id": 1} and msg.sender == "old.0"
        assert r.stats()["uncredited"] == 1
    finally:
        raw.close()
        await r.aclose()


@pytest.mark.timeout(10)
async def test_close_wakes_waiters_with_channel_closed(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr)
    s = sender(ctx, [ipc_address(ipc_dir, "nobody")])  # no consumer: never any credit
    await r.start()
    await s.start()
    receiving = asyncio.create_task(r.recv())
    sending = asyncio.create_task(s.send("item", {"id": 1}))
    await asyncio.sleep(0.05)
    assert not receiving.done() and not sending.done() and s.stats()["blocked"]
    await r.aclose()
    await s.aclose(timeout_s=0.1)  # EOS to a consumer that is not there: bounded wait
    for task in (receiving, sending):
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(task, 1)


@pytest.mark.timeout(10)
async def test_eos_reaches_a_consumer_that_starts_late(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    s = sender(ctx, [addr])
    await s.start()
    closing = asyncio.create_task(s.aclose(timeout_s=5))  # waits for the acknowledgement
    await asyncio.sleep(0.1)
    r = receiver(ctx, addr, expected=["p.0"])
    await r.start()
    with pytest.raises(EndOfStream):
        await asyncio.wait_for(r.recv(), 3)
    await asyncio.wait_for(closing, 3)
    await r.aclose()


@pytest.mark.timeout(10)
async def test_producer_finished_counts_like_eos(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, expected=["a.0", "b.0"])
    await r.start()
    r.producer_finished("a.0")  # its EOS went to a previous instance of this receiver
    b = sender(ctx, [addr], "b.0")
    await b.start()
    await asyncio.wait_for(b.send("item", {"id": 1}), 3)
    await b.aclose()
    assert [m.sender async for m in r] == ["b.0"]
    assert r.stats()["finished"] == ["a.0", "b.0"]
    await r.aclose()


@pytest.mark.timeout(10)
async def test_credit_reports_room_downstream(ctx, ipc_dir) -> None:
    addr = address("ipc", ipc_dir)
    r, s = receiver(ctx, addr, capacity=6, expected=["p.0"]), sender(ctx, [addr])
    await r.start()
    await s.start()
    try:
        await eventually(lambda: s.credit() == 6)
        for i in range(4):
            await s.send("item", {"id": i})
        assert s.credit() == 2  # the consumer has not taken anything out yet
        await r.recv()
        await eventually(lambda: s.credit() >= 3)  # a slot freed, credit came back
    finally:
        await s.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(10)
async def test_a_message_over_the_consumers_frame_limit_is_refused_at_the_sender(
    ctx, ipc_dir, log
) -> None:
    """Sent, it would be cut off by the consumer's ZeroMQ, sent again on reconnect, and cut off
    again, for ever: the sender refuses it, counts and logs it, and the channel goes on."""
    import numpy as np

    blob = Schema("blob", 1, {"id": "int", "values": "array"})
    addr = ipc_address(ipc_dir, "in")
    r = Receiver(
        "in", addr, [blob], capacity=4, expected_producers=None, ctx=ctx, max_message_bytes=4096
    )
    s = Sender(
        "out", [addr], [blob], identity="p.0", ctx=ctx, log=log, max_message_bytes=4096, **FAST
    )
    await r.start()
    await s.start()
    try:
        with pytest.raises(ValueError, match=r"frame of 0\.0 MiB, over its consumers' limit"):
            await s.send("blob", {"id": 1, "values": np.zeros(2048, np.float32)})
        assert s.stats()["oversized"] == 1 and s.stats()["sent"] == 0
        assert events(log, "message_oversized")[0]["frame_bytes"] == 8192
        await s.send("blob", {"id": 2, "values": np.zeros(16, np.float32)})
        assert (await asyncio.wait_for(r.recv(), 3)).data["id"] == 2
    finally:
        await s.aclose()
        await r.aclose()


@pytest.mark.timeout(10)
async def test_a_frame_over_the_limit_cuts_its_peer_off_and_is_counted(ctx, ipc_dir) -> None:
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, max_message_bytes=4096)
    await r.start()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(addr)
    try:
        await raw.send_multipart([b"D", b"\0" * 8192])  # the peer stays; ZeroMQ cuts it off
        await eventually(lambda: r.stats()["disconnects"] == 1)
        assert r.stats()["received"] == 0 and r.stats()["rejected"] == {}
    finally:
        raw.close()
        await r.aclose()
