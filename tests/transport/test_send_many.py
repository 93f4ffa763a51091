"""``Sender.send_many``: several messages to one consumer in another process travel as one batch
(one header, one pack, one send), yet each keeps its own credit, sequence number,
acknowledgement and redelivery, and a consumer takes them one by one. Every test runs over
ZeroMQ and over an in-process link (where a batch is one hand-over of the messages themselves)."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from tests.transport.conftest import eventually, over_both_wires, raw_hello, raw_producer
from tests.transport.test_channel import receiver, sender
from tests.transport.test_delivery import _crash
from transport import ChannelClosed, Message, Receiver, Schema, ipc_address
from transport.codec import decode_batch, encode, encode_batch

wire = over_both_wires(__name__)


def _items(first: int, n: int) -> list[dict]:
    return [{"id": i, "ids": np.arange(i, i + 3, dtype=np.int32)} for i in range(first, first + n)]


async def _take(r: Receiver, n: int) -> list[dict]:
    return [(await asyncio.wait_for(r.recv(), 3)).data for _ in range(n)]


@pytest.mark.timeout(15)
async def test_a_batch_arrives_as_its_messages_in_order_each_acknowledged(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=16)
    await r.start()
    out = sender(ctx, [addr])
    acked: list[int] = []
    out.on_ack(acked.append)
    await out.start()
    try:
        await eventually(lambda: out.credit() == 16)
        seqs = await out.send_many("item", _items(0, 10))
        got = await _take(r, 10)
        assert [d["id"] for d in got] == list(range(10))
        assert all(d["ids"].tolist() == [i, i + 1, i + 2] for i, d in enumerate(got))
        await eventually(lambda: sorted(acked) == seqs)
        stats = out.stats()
        assert seqs == list(range(1, 11)) and stats["sent"] == 10 and stats["unacked"] == 0
        assert stats["unacked_bytes"] == 0
        assert stats["batches"] == 1
        assert r.stats()["received"] == 10 and r.stats()["rejected"] == {}
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_a_batch_never_exceeds_the_credit_it_goes_with(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=3)
    await r.start()
    out = sender(ctx, [addr])
    await out.start()
    try:
        sending = asyncio.ensure_future(out.send_many("item", _items(0, 8)))
        await eventually(lambda: r.stats()["depth"] == 3)
        await asyncio.sleep(0.1)
        assert r.stats()["depth"] == 3 and not sending.done()  # waits for credit, as send does
        got = await _take(r, 8)
        assert [d["id"] for d in got] == list(range(8))
        await asyncio.wait_for(sending, 3)
        assert r.stats()["uncredited"] == 0 and r.stats()["peak"] <= 3
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_what_a_consumer_held_of_a_batch_comes_again_one_by_one(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=8)
    await first.start()
    out = sender(ctx, [addr])
    await out.start()
    try:
        await eventually(lambda: out.credit() == 8)
        await out.send_many("item", _items(0, 8))
        assert [d["id"] for d in await _take(first, 3)] == [0, 1, 2]  # acknowledged on take
        await eventually(lambda: out.stats()["acked"] == 3)
        await _crash(first)
        second = receiver(ctx, addr, capacity=8)
        await second.start()
        try:
            got = await _take(second, 5)
            assert sorted(d["id"] for d in got) == [3, 4, 5, 6, 7]
            assert all(d["ids"][0] == d["id"] for d in got)
            await eventually(lambda: out.stats()["acked"] == 8)
            stats = out.stats()
            assert stats["redelivered"] == 5 and stats["unacked"] == 0
            assert stats["unacked_bytes"] == 0  # a batch's share replaced by the copy's own
        finally:
            await second.aclose()
    finally:
        await out.aclose(eos=False)


@pytest.mark.timeout(15)
async def test_a_bad_message_of_a_batch_is_refused_alone_and_a_copy_is_a_duplicate(
    ctx, ipc_dir, wire
):
    """A hand-made producer sends what a Sender never would: a batch with a malformed item,
    the same batch again, a batch whose frames are broken, and bad ``seqs``."""
    if wire != "zmq":
        pytest.skip("a hand-made producer speaks ZeroMQ")
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=12)
    await r.start()
    raw = raw_producer(ctx, addr)
    try:
        _, credit = await raw_hello(raw)

        def header(seqs):
            return msgpack.packb({"to": credit["session"], "epoch": credit["epoch"], "seqs": seqs})

        batch = encode_batch("item", 1, [{"id": 1}, {"id": "two"}, {"id": 3}])
        await raw.send_multipart([b"D", header([1, 2, 3]), *batch])
        await raw.send_multipart([b"D", header([1, 2, 3]), *batch])  # sent again
        broken = encode_batch("item", 1, [{"id": 4, "a": np.zeros(3)}, {"id": 5}])[:-1]
        await raw.send_multipart([b"D", header([4, 5]), *broken])  # its pack is missing
        await raw.send_multipart([b"D", header([6, 6]), *encode_batch("item", 1, [{}, {}])])
        single = encode(Message("item", {"id": 7}))
        await raw.send_multipart([b"D", msgpack.packb({"seq": 7}), *single])
        got = await _take(r, 3)
        assert [d["id"] for d in got] == [1, 3, 7]
        stats = r.stats()
        # the copy: its good messages are duplicates, its bad one refused again (as a single
        # message refused is: never taken, so never a duplicate)
        assert stats["rejected"] == {"invalid_fields": 2, "frame_count": 2, "bad_control": 1}
        assert stats["duplicates"] == 2
    finally:
        raw.close()
        await r.aclose()


@pytest.mark.timeout(15)
async def test_in_process_a_consumer_checks_again_only_against_a_schema_of_its_own(
    ctx, ipc_dir, wire
):
    """In process, what the producer checked against the consumer's own schema object is not
    checked again; a consumer that declares the kind differently checks every message, batched
    or not, and refuses the ones that do not fit it, alone."""
    if wire != "in_process":
        pytest.skip("a decode always checks")
    addr = ipc_address(ipc_dir, "in")
    strict = Schema("item", 1, {"id": "int", "ids": "array"})
    r = Receiver("in", addr, [strict], capacity=8, expected_producers=None, ctx=ctx)
    await r.start()
    out = sender(ctx, [addr])  # its schema: {"id": "int"}
    await out.start()
    try:
        await eventually(lambda: out.credit() == 8)
        items = _items(0, 4)
        del items[1]["ids"]
        await out.send_many("item", items)
        await out.send("item", {"id": 9})
        await out.send("item", {"id": 10, "ids": np.zeros(2)})
        got = await _take(r, 4)
        assert [d["id"] for d in got] == [0, 2, 3, 10]
        assert r.stats()["rejected"] == {"invalid_fields": 2}
    finally:
        await out.aclose(eos=False)
        await r.aclose()


def test_a_batch_decodes_to_what_each_message_alone_would(wire):
    if wire != "zmq":
        pytest.skip("no channel: once is enough")
    items = [{"id": i, "a": np.full(i + 1, i, dtype=np.float32), "m": {"k": [i]}} for i in range(4)]
    frames = encode_batch("item", 2, items)
    assert len(frames) == 2  # one header and one pack for all the small arrays
    out = decode_batch(frames)
    assert [m.data["id"] for m in out] == [0, 1, 2, 3] and {m.version for m in out} == {2}
    assert all(m.data["a"].tolist() == [i] * (i + 1) for i, m in enumerate(out))
    with pytest.raises(Exception, match="'batch' where a 'data' belongs"):
        from transport import decode

        decode(frames)


@pytest.mark.timeout(15)
async def test_a_consumer_taking_one_at_a_time_grants_a_quarter_share_at_once(ctx, ipc_dir, wire):
    """While its inbox holds work, a consumer that frees one slot per turn does not answer each
    with a CREDIT: its producer gets slots a quarter of its share at a time, and sends them
    together. Nothing waits for ever: everything arrives, in order."""
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=16)
    await r.start()
    out = sender(ctx, [addr])
    await out.start()
    try:
        await eventually(lambda: out.credit() == 16)
        before = out.stats()["credits_in"]

        async def produce() -> None:
            for first in range(0, 96, 8):
                await out.send_many("item", _items(first, 8))

        task = asyncio.ensure_future(produce())
        got = []
        for _ in range(96):
            got.append((await asyncio.wait_for(r.recv(), 3)).data["id"])
            await asyncio.sleep(0.002)  # a turn of work per message
        await asyncio.wait_for(task, 3)
        assert got == list(range(96))
        credits = out.stats()["credits_in"] - before
        assert credits <= 96 // 4 + 8, credits  # (pings are answered too)
        if wire == "zmq":
            assert out.stats()["batches"] >= 12
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_a_producer_out_of_credit_waits_for_room_then_learns_how_much(ctx, ipc_dir, wire):
    """``wait_for_room``: at once while a consumer has room; with none, it waits until credit
    comes back and says how much there is (a producer that batches then sends that much as one
    batch, not one message ahead of the rest); a close ends the wait."""
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=8)
    await r.start()
    out = sender(ctx, [addr])
    await out.start()
    try:
        await eventually(lambda: out.credit() == 8)
        assert await asyncio.wait_for(out.wait_for_room(), 1) == 8
        await out.send_many("item", _items(0, 8))
        assert out.room() == 0
        waiting = asyncio.ensure_future(out.wait_for_room())
        await asyncio.sleep(0.1)
        assert not waiting.done()  # the inbox is full
        assert [d["id"] for d in await _take(r, 8)] == list(range(8))
        room = await asyncio.wait_for(waiting, 3)
        assert room >= 2  # a quarter share at least, at once
        await out.send_many("item", _items(8, room))
        assert [d["id"] for d in await _take(r, room)] == list(range(8, 8 + room))
        await eventually(lambda: out.room() >= 6)  # (topped up once a quarter share is out)
        await out.send_many("item", _items(100, out.room()))
        assert out.room() == 0
        closing = asyncio.ensure_future(out.wait_for_room())
        await asyncio.sleep(0.05)
        await out.aclose(eos=False)
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(closing, 3)
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_a_producer_hears_when_credit_comes_back(ctx, ipc_dir, wire):
    """``on_credit``: called as a consumer's credit arrives, so that a producer deciding how
    much to start (the generator) need not poll ``credit()``."""
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=4)
    await r.start()
    out = sender(ctx, [addr])
    heard: list[int] = []
    out.on_credit(lambda: heard.append(out.credit()))
    await out.start()
    try:
        await eventually(lambda: 4 in heard)
        await out.send_many("item", _items(0, 4))
        assert out.credit() == 0
        heard.clear()
        await _take(r, 4)
        await eventually(lambda: bool(heard) and heard[-1] == 4)
    finally:
        await out.aclose(eos=False)
        await r.aclose()
