"""In-process links (``transport.local``): what is particular to a producer and a consumer of
one process. The protocol's contracts over them (redelivery, manual acks, duplicates,
end-of-stream) are the tests of ``test_delivery.py``, which run over both wires."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.transport.conftest import eventually
from tests.transport.test_channel import receiver, sender
from transport import EndOfStream, Receiver, Schema, Sender, ipc_address

ARRAYS = Schema("item", 1, {"id": "int", "a": "array", "rows": "list"})


def local_sender(ctx, peers, **kw):
    return sender(ctx, peers, local=[True] * len(peers), **kw)


@pytest.mark.timeout(10)
async def test_the_consumer_owns_what_it_gets_and_arrays_are_not_copied(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    r = Receiver("in", addr, [ARRAYS], capacity=4, expected_producers=None, ctx=ctx, ack="manual")
    await r.start()
    s = Sender("out", [addr], [ARRAYS], identity="p.0", ctx=ctx, local=[True])
    await s.start()
    try:
        a = np.arange(6, dtype=np.int32)
        await s.send("item", {"id": 1, "a": a, "rows": [{"x": [1, 2]}]})
        msg = await asyncio.wait_for(r.recv(), 3)
        assert msg.sender == "p.0" and msg.data["id"] == 1
        got = msg.data["a"]
        assert np.shares_memory(got, a) and not got.flags.writeable  # read-only, as decoded
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 5  # a sent array stays as sent: what is sent again is what was sent
        msg.data["rows"][0]["x"].append(3)  # the consumer's maps and lists are its own
        ((_, held),) = s._unacked.items()  # held until acknowledged, to be sent again
        assert held.msg.data["rows"] == [{"x": [1, 2]}]
        assert r.stats()["bytes"] == 0 and s.stats()["bytes"] == 0  # nothing was encoded
    finally:
        await s.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(10)
async def test_a_consumer_that_binds_later_gets_credit_and_the_stream(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    s = local_sender(ctx, [addr])
    await s.start()
    sending = asyncio.create_task(s.send("item", {"id": 7}))
    await asyncio.sleep(0.2)
    assert not sending.done()  # no consumer yet: no credit
    r = receiver(ctx, addr, capacity=2, expected=["p.0"])
    await r.start()
    try:
        await asyncio.wait_for(sending, 3)
        await asyncio.wait_for(s.send("item", {"id": 8}), 3)
        blocked = asyncio.create_task(s.send("item", {"id": 9}))
        await asyncio.sleep(0.2)
        assert not blocked.done()  # the inbox (2) is full: the capacity bounds this link too
        assert (await r.recv()).data["id"] == 7
        await asyncio.wait_for(blocked, 3)
        await eventually(lambda: r.stats()["depth"] == 2)
        assert r.stats()["peak"] <= 2
        closing = asyncio.create_task(s.aclose())
        got = [m.data["id"] async for m in r]
        assert got == [8, 9]
        await asyncio.wait_for(closing, 3)
        with pytest.raises(EndOfStream):
            await r.recv()
    finally:
        await s.aclose(eos=False)
        await r.aclose()


@pytest.mark.timeout(10)
async def test_in_process_and_zeromq_consumers_share_one_producer(ctx, ipc_dir):
    near, far = ipc_address(ipc_dir, "near"), ipc_address(ipc_dir, "far")
    a, b = receiver(ctx, near, capacity=4), receiver(ctx, far, capacity=4)
    await a.start()
    await b.start()
    s = sender(ctx, [near, far], local=[True, False])
    await s.start()
    try:
        await eventually(lambda: s.credit() == 8)
        for i in range(8):
            await s.send("item", {"id": i})
        await eventually(lambda: a.stats()["depth"] + b.stats()["depth"] == 8)
        assert a.stats()["depth"] == 4 and b.stats()["depth"] == 4  # most credit first
        assert a.stats()["bytes"] == 0 and b.stats()["bytes"] > 0
        # with a consumer in another process, a message that cannot travel fails at its send
        with pytest.raises(TypeError, match="cannot encode"):
            await s.send("item", {"id": 9, "x": object()})
    finally:
        await s.aclose(eos=False)
        await a.aclose()
        await b.aclose()


@pytest.mark.timeout(10)
async def test_a_kind_the_consumer_does_not_take_is_refused_and_counted(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    newer = Schema("item", 2, {"id": "int"})
    r = Receiver("in", addr, [newer], capacity=4, expected_producers=None, ctx=ctx)
    await r.start()
    s = local_sender(ctx, [addr])
    await s.start()
    try:
        await s.send("item", {"id": 1})
        await eventually(lambda: r.stats()["rejected"].get("bad_version") == 1)
        await eventually(lambda: s.stats()["acked"] == 1)  # refused for good: not sent again
        assert r.stats()["depth"] == 0
    finally:
        await s.aclose(eos=False)
        await r.aclose()


def test_an_in_process_peer_needs_its_address(ctx):
    with pytest.raises(ValueError, match="in-process peer needs its address"):
        sender(ctx, [None], local=[True])


def test_fresh_rebuilds_maps_and_lists_at_any_depth_and_makes_arrays_read_only():
    from collections import OrderedDict

    from transport.local import fresh

    a, b = np.arange(3), np.zeros(2)
    inner = OrderedDict(x=[{"y": b}])  # a subclass of dict: rebuilt as a plain map
    shared = (1, [2])  # tuples are passed as they are
    value = {"a": a, "s": "t", "n": None, "m": inner, "rows": [[a], {"k": 1}], "t": shared}
    got = fresh(value)
    assert (
        got is not value
        and sorted(got) == sorted(value)
        and type(got["m"]) is dict
        and got["m"] is not inner
    )
    assert got["m"]["x"] is not inner["x"] and got["m"]["x"][0] is not inner["x"][0]
    assert got["rows"] is not value["rows"] and got["rows"][0] is not value["rows"][0]
    assert got["rows"][1] is not value["rows"][1] and got["rows"][1] == {"k": 1}
    assert got["a"] is a and got["m"]["x"][0]["y"] is b and got["rows"][0][0] is a
    assert not a.flags.writeable and not b.flags.writeable
    assert got["t"] is shared and got["s"] == "t" and got["n"] is None
    assert fresh([a])[0] is a and fresh(5) == 5
