"""Messages that carry several groups. Weighted credit (``transport.credit``, "Weight"): a
message weighs what its schema says, and credit, capacity and depth count weight, so an inbox
bounded at N holds N groups however they are packed into messages. Every uid such a message
carries is held until it is acknowledged (``uids_of``: what the run's ledger follows). Each test
of a Sender runs over ZeroMQ and over an in-process link."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from tests.transport.conftest import eventually, raw_hello, raw_producer
from tests.transport.test_channel import FAST
from tests.transport.test_delivery import _crash
from transport import Message, Receiver, Schema, Sender, ipc_address
from transport.codec import encode


@pytest.fixture(params=["zmq", "in_process"])
def wire(request) -> str:
    return request.param


# a message of several groups: it weighs its number of groups
BATCH = Schema("batch", 1, {"id": "int", "groups": "list"}, weight=lambda d: len(d["groups"]))


def receiver(ctx, addr, *, capacity: int, **kw) -> Receiver:
    return Receiver("in", addr, [BATCH], capacity=capacity, expected_producers=None, ctx=ctx, **kw)


def sender(ctx, peers, wire: str) -> Sender:
    local = [wire == "in_process"] * len(peers)
    return Sender("out", peers, [BATCH], identity="p.0", ctx=ctx, local=local, **FAST)


def _batch(i: int, groups: int) -> dict:
    return {"id": i, "groups": [f"g{i}.{k}" for k in range(groups)]}


async def _take(r: Receiver, n: int) -> list[Message]:
    return [await asyncio.wait_for(r.recv(), 3) for _ in range(n)]


def test_a_schema_weighs_its_messages_and_refuses_a_weight_below_one():
    assert BATCH.weigh(_batch(0, 5)) == 5
    assert Schema("item", 1, {"id": "int"}).weigh({"id": 1}) == 1  # no weight: 1 each
    with pytest.raises(ValueError, match="'batch': a message weighs 0, expected an int >= 1"):
        BATCH.weigh(_batch(0, 0))


@pytest.mark.timeout(15)
async def test_credit_and_depth_count_weight_not_messages(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=8)
    await r.start()
    out = sender(ctx, [addr], wire)
    await out.start()
    try:
        await eventually(lambda: out.credit() == 8)
        await out.send("batch", _batch(0, 3))
        await out.send("batch", _batch(1, 3))
        assert out.credit() == 2 and out.room() == 2
        third = asyncio.ensure_future(out.send("batch", _batch(2, 3)))  # 3 > the 2 left
        await eventually(lambda: r.stats()["depth"] == 6)
        await asyncio.sleep(0.1)
        assert not third.done() and r.stats()["messages"] == 2
        got = await _take(r, 3)  # taking the first frees room for the third
        await asyncio.wait_for(third, 3)
        assert [m.data["id"] for m in got] == [0, 1, 2] and [m.weight for m in got] == [3, 3, 3]
        stats = r.stats()
        assert stats["peak"] <= 8 and stats["uncredited"] == 0 and stats["depth"] == 0
        await eventually(lambda: out.credit() == 8)  # every unit comes back
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_a_message_heavier_than_the_inbox_goes_alone_and_costs_nothing_after(
    ctx, ipc_dir, wire
):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=4)
    await r.start()
    out = sender(ctx, [addr], wire)
    await out.start()
    try:
        await eventually(lambda: out.credit() == 4)
        await asyncio.wait_for(out.send("batch", _batch(0, 10)), 3)  # goes on the whole reach
        await eventually(lambda: r.stats()["depth"] == 10)
        after = asyncio.ensure_future(out.send("batch", _batch(1, 1)))
        await asyncio.sleep(0.1)
        assert not after.done()  # nothing more while the inbox is over its capacity
        got = await _take(r, 2)
        await asyncio.wait_for(after, 3)
        assert [m.weight for m in got] == [10, 1]
        assert r.stats()["uncredited"] == 0 and r.stats()["rejected"] == {}
        await eventually(lambda: out.credit() == 4 and r.stats()["credit_outstanding"] == 4)
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(15)
async def test_send_many_packs_no_more_weight_than_its_credit(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=5)
    await r.start()
    out = sender(ctx, [addr], wire)
    await out.start()
    try:
        await eventually(lambda: out.credit() == 5)
        sending = asyncio.ensure_future(out.send_many("batch", [_batch(i, 2) for i in range(6)]))
        await eventually(lambda: r.stats()["depth"] == 4)
        await asyncio.sleep(0.1)
        assert r.stats()["depth"] == 4 and not sending.done()  # a third of 2 would make 6
        got = await _take(r, 6)
        await asyncio.wait_for(sending, 3)
        assert [m.data["id"] for m in got] == list(range(6))
        assert r.stats()["peak"] <= 5 and r.stats()["uncredited"] == 0
    finally:
        await out.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(20)
async def test_weighted_messages_a_consumer_held_come_again_with_their_weight(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=6)
    await first.start()
    out = sender(ctx, [addr], wire)
    await out.start()
    try:
        await out.send("batch", _batch(0, 4))
        await out.send("batch", _batch(1, 2))
        await eventually(lambda: first.stats()["depth"] == 6)
        await _crash(first)
        second = receiver(ctx, addr, capacity=6)
        await second.start()
        try:
            got = await _take(second, 2)
            assert [(m.data["id"], m.weight) for m in got] == [(0, 4), (1, 2)]
            await eventually(lambda: out.stats()["unacked"] == 0 and out.credit() == 6)
            assert second.stats()["uncredited"] == 0
        finally:
            await second.aclose()
    finally:
        await out.aclose(eos=False)


@pytest.mark.timeout(15)
async def test_the_inbox_weighs_what_it_takes_in_and_refuses_bad_weights(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=8)
    await r.start()
    raw = raw_producer(ctx, addr)
    try:
        _, credit = await raw_hello(raw)

        def header(seq, **extra):
            return msgpack.packb(
                {"to": credit["session"], "epoch": credit["epoch"], "seq": seq, **extra}
            )

        await raw.send_multipart([b"D", header(1, w=0), *encode(Message("batch", _batch(1, 1)))])
        await raw.send_multipart([b"D", header(2, w="x"), *encode(Message("batch", _batch(2, 1)))])
        await raw.send_multipart([b"D", header(3), *encode(Message("batch", _batch(3, 0)))])
        # the header says 1, the schema 5: the inbox counts 5
        await raw.send_multipart([b"D", header(4), *encode(Message("batch", _batch(4, 5)))])
        (got,) = await _take(r, 1)
        assert got.data["id"] == 4 and got.weight == 5
        stats = r.stats()
        assert stats["rejected"] == {"bad_control": 2, "invalid_fields": 1}
        assert stats["peak"] == 5
        assert credit["reach"] == 7  # its share of 8 less the quarter it tops up by, plus one
    finally:
        raw.close()
        await r.aclose()


@pytest.mark.timeout(15)
async def test_every_uid_a_message_carries_is_held_until_it_is_acknowledged(ctx, ipc_dir, wire):
    addr = ipc_address(ipc_dir, "in")
    r = receiver(ctx, addr, capacity=8, ack="manual")
    await r.start()
    out = sender(ctx, [addr], wire)
    await out.start()
    try:
        await out.send("batch", {**_batch(0, 2), "uid": ["u0", "u1"]})
        await out.send("batch", {**_batch(1, 1), "uid": "u2"})
        assert sorted(out.held_uids()) == ["u0", "u1", "u2"]
        await eventually(lambda: r.stats()["depth"] == 3)
        assert sorted(r.held_uids()) == ["u0", "u1", "u2"]  # in the inbox
        first, _ = await _take(r, 2)
        assert sorted(r.held_uids()) == ["u0", "u1", "u2"]  # taken, not yet acknowledged
        r.ack(first)
        await eventually(lambda: out.held_uids() == ["u2"])
        assert r.held_uids() == ["u2"]
    finally:
        await out.aclose(eos=False)
        await r.aclose()
