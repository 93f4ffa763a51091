"""At-least-once delivery over a channel: a producer keeps what it sent until the consumer says
it was processed, sends it again to a consumer that restarted, and consumers drop duplicates.

Every test runs twice: over ZeroMQ, and over an in-process link (``transport.local``: producer
and consumer in one process, as stages that share a process talk)."""

from __future__ import annotations

import asyncio

import pytest

from tests.transport.conftest import events, eventually, over_both_wires
from tests.transport.test_channel import receiver, sender
from transport import Receiver, ipc_address

wire = over_both_wires(__name__)


async def _crash(r: Receiver) -> None:
    """What SIGKILL does to a consumer: its tasks and socket vanish, no CLOSE is sent."""
    for task in r._tasks:
        task.cancel()
    await asyncio.gather(*r._tasks, return_exceptions=True)
    await r._peers_watch.aclose()
    r._closed = True
    sock, r._sock = r._sock, None
    sock.close(linger=0)  # (an in-process producer's frames now go nowhere, as to a dead one)


async def _take(r: Receiver, n: int) -> list[int]:
    return [(await asyncio.wait_for(r.recv(), 3)).data["id"] for _ in range(n)]


@pytest.mark.timeout(15)
@pytest.mark.parametrize("how", ["killed", "closed"])
async def test_what_a_consumer_held_is_sent_again_when_it_comes_back(ctx, ipc_dir, log, how):
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=8)
    await first.start()
    out = sender(ctx, [addr], log=log)
    await out.start()
    for i in range(8):
        await out.send("item", {"id": i})
    await eventually(lambda: first.stats()["depth"] == 8)
    assert await _take(first, 3) == [0, 1, 2]  # processed: acknowledged on take
    await eventually(lambda: out.stats()["acked"] == 3)
    assert out.stats()["unacked"] == 5
    if how == "killed":
        await _crash(first)
    else:
        await first.aclose()  # a graceful stop leaves its inbox unprocessed too
    second = receiver(ctx, addr, capacity=8)
    await second.start()
    try:
        assert sorted(await _take(second, 5)) == [3, 4, 5, 6, 7]
        await eventually(lambda: out.stats()["acked"] == 8)
        stats = out.stats()
        assert stats["redelivered"] == 5 and stats["unacked"] == 0 and stats["unacked_bytes"] == 0
        (note,) = events(log, "redelivering")
        assert note["count"] == 5
        # and the channel goes on as before
        await out.send("item", {"id": 8})
        assert await _take(second, 1) == [8]
        await asyncio.sleep(0.1)
        assert second.stats()["depth"] == 0 and second.stats()["duplicates"] == 0
    finally:
        await out.aclose(eos=False)
        await second.aclose()


@pytest.mark.timeout(15)
async def test_manual_ack_keeps_taken_messages_until_processed(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=4, ack="manual")
    await first.start()
    out = sender(ctx, [addr])
    await out.start()
    for i in range(4):
        await out.send("item", {"id": i})
    msgs = [await asyncio.wait_for(first.recv(), 3) for _ in range(4)]
    first.ack(msgs[1])  # only this one was processed when the consumer died
    first.ack(msgs[1])  # twice is once
    assert first.stats()["unacked"] == 3
    await eventually(lambda: out.stats()["acked"] == 1)
    await _crash(first)
    second = receiver(ctx, addr, capacity=4)
    await second.start()
    try:
        assert sorted(await _take(second, 3)) == [0, 2, 3]
        await eventually(lambda: out.stats()["unacked"] == 0)
        assert out.stats()["redelivered"] == 3
    finally:
        await out.aclose(eos=False)
        await second.aclose()


@pytest.mark.timeout(15)
async def test_a_message_sent_twice_is_taken_once_and_acknowledged_again(ctx, ipc_dir, log):
    addr = ipc_address(ipc_dir, "in")
    inbox = receiver(ctx, addr, capacity=4, ack="manual", log=log)
    await inbox.start()
    out = sender(ctx, [addr])
    await out.start()
    try:
        await out.send("item", {"id": 0})
        ((seq, held),) = out._unacked.items()
        # as after an acknowledgement lost on the way: the same DATA once more
        await out._send_data(held.peer, seq, held)
        await out.send("item", {"id": 1})
        assert await _take(inbox, 2) == [0, 1]
        await eventually(lambda: inbox.stats()["duplicates"] == 1)
        assert inbox.stats()["depth"] == 0
        # the duplicate was acknowledged although the original is still being processed
        await eventually(lambda: out.stats()["acked"] == 1)
        assert events(log, "duplicate_dropped")[0]["count"] == 1
    finally:
        await out.aclose(eos=False)
        await inbox.aclose()


@pytest.mark.timeout(15)
async def test_nothing_is_held_forever_drops_are_counted(ctx, ipc_dir, log):
    addr = ipc_address(ipc_dir, "in")
    inbox = receiver(ctx, addr, capacity=8, ack="manual")  # never acknowledges
    await inbox.start()
    out = sender(ctx, [addr], log=log, max_unacked=3)
    await out.start()
    try:
        for i in range(6):
            await out.send("item", {"id": i})
        stats = out.stats()
        assert stats["unacked"] == 3 and stats["unacked_dropped"] == 3
        assert [e["count"] for e in events(log, "unacked_dropped")] == [1, 2]  # 1st, 2nd, (4th)
        assert sorted(out._unacked) == [4, 5, 6]  # the newest are kept
        assert await _take(inbox, 6) == list(range(6))  # dropping from memory lost no delivery
    finally:
        await out.aclose(eos=False)
        await inbox.aclose()


async def test_ack_rejects_a_receiver_that_acknowledges_on_take(ctx, ipc_dir):
    from transport import TransportError

    r = receiver(ctx, ipc_address(ipc_dir, "in"))
    with pytest.raises(TransportError, match="on take"):
        r.ack(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ack must be"):
        receiver(ctx, ipc_address(ipc_dir, "x"), ack="sometimes")


@pytest.mark.timeout(15)
async def test_a_finished_producer_waits_until_everything_was_processed(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "in")
    first = receiver(ctx, addr, capacity=4)
    await first.start()
    out = sender(ctx, [addr])
    await out.start()
    for i in range(4):
        await out.send("item", {"id": i})
    waiting = asyncio.create_task(out.finish())
    assert await _take(first, 1) == [0]
    await asyncio.sleep(0.1)
    assert not waiting.done()  # three are still unprocessed
    await _crash(first)  # ... and the consumer dies with them
    second = receiver(ctx, addr, capacity=4)
    await second.start()
    try:
        assert sorted(await _take(second, 3)) == [1, 2, 3]
        await asyncio.wait_for(waiting, 3)
        assert out.stats()["unacked"] == 0
    finally:
        waiting.cancel()
        await out.aclose(eos=False)
        await second.aclose()


async def _six_held_by_a_crashed_consumer(ctx, addr: str, **options):
    """A started sender whose consumer (expecting ``p.0``) took ids 0-5 and died unacked."""
    first = receiver(ctx, addr, capacity=8, expected=["p.0"])
    await first.start()
    out = sender(ctx, [addr], **options)
    await out.start()
    for i in range(6):
        await out.send("item", {"id": i})
    await eventually(lambda: first.stats()["depth"] == 6)
    await _crash(first)
    return out


async def _ends_after_all_six(out, second: Receiver, finishing: asyncio.Task) -> None:
    """``second`` gets all six again before its stream ends; then ``out`` has nothing held."""
    try:
        got = [msg.data["id"] async for msg in second]  # ends only at the real end of stream
        assert sorted(got) == list(range(6))
        await asyncio.wait_for(finishing, 5)
        assert out.stats()["unacked"] == 0 and out.stats()["redelivered"] == 6
    finally:
        finishing.cancel()
        await out.aclose(eos=False)
        await second.aclose()


@pytest.mark.timeout(20)
async def test_an_end_of_stream_meant_for_a_dead_consumer_does_not_end_its_restart(ctx, ipc_dir):
    """The producer finishes while its consumer is being restarted: the new consumer must get
    what the old one held, and only then the end of the stream (an EOS addressed to the old
    instance is taken as a hello, not as the end)."""
    addr = ipc_address(ipc_dir, "in")
    # a slow heartbeat: the new consumer hears our EOS before any hello
    out = await _six_held_by_a_crashed_consumer(ctx, addr, heartbeat_s=3.0, peer_timeout_s=10.0)
    second = receiver(ctx, addr, capacity=8, expected=["p.0"])
    await second.start()
    await asyncio.sleep(0.5)  # the producer's socket reconnects
    finishing = asyncio.create_task(out.finish())
    await _ends_after_all_six(out, second, finishing)


@pytest.mark.timeout(20)
async def test_a_producer_finishing_mid_redelivery_ends_the_stream_only_after_it(ctx, ipc_dir):
    """The consumer came back and is being sent again what it held, a few at a time (its
    credit), when the producer finishes: the end of stream must follow the last of them, not
    overtake them (it would end the consumer's input with messages still to come)."""
    addr = ipc_address(ipc_dir, "in")
    out = await _six_held_by_a_crashed_consumer(ctx, addr)
    second = receiver(ctx, addr, capacity=2, expected=["p.0"])  # takes them two at a time
    await second.start()
    await eventually(lambda: second.stats()["depth"] == 2)  # redelivery under way, 4 to go
    finishing = asyncio.create_task(out.finish())
    await asyncio.sleep(0.2)  # what finish() sends goes out now
    await _ends_after_all_six(out, second, finishing)
