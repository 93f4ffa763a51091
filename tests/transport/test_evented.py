"""``EventedSocket``: a plain ZeroMQ socket awaited through one reader on its descriptor.

The descriptor is edge-triggered: any operation on the socket may consume the signal that a
message arrived. These tests pin the cases where a waiter would otherwise never wake."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from transport import ipc_address
from transport.errors import ChannelClosed
from transport.evented import EventedSocket, plain_socket

pytestmark = pytest.mark.timeout(15)


def _pair(ctx, ipc_dir, name="e"):
    addr = ipc_address(ipc_dir, name)
    router = plain_socket(ctx, zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(addr)
    dealer = plain_socket(ctx, zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"d")
    dealer.connect(addr)
    return router, EventedSocket(dealer, name="dealer")


def _arrive() -> None:
    """Let what was sent arrive and signal the descriptor while the loop does not run (so
    its reader cannot see the signal before the test's next step)."""
    time.sleep(0.1)


@pytest.fixture
async def routed(ctx, ipc_dir):
    """A ROUTER and an ``EventedSocket`` DEALER the router already knows (a first message from
    it), both closed after the test."""
    router, dealer = _pair(ctx, ipc_dir)
    try:
        await dealer.send_multipart([b"hi"])
        deadline = time.monotonic() + 3
        while not router.poll(0):
            assert time.monotonic() < deadline, "the router never heard the dealer"
            await asyncio.sleep(0.01)
        assert router.recv_multipart() == [b"d", b"hi"]
        yield router, dealer
    finally:
        dealer.close()
        router.close(linger=0)


async def test_a_waiting_reader_gets_a_message_whose_signal_a_send_took(routed):
    router, dealer = routed
    reading = asyncio.create_task(dealer.recv_multipart())
    await asyncio.sleep(0.05)  # waiting on the descriptor
    router.send_multipart([b"d", b"one"])
    _arrive()
    dealer.send_nowait([b"two"])  # processes the socket's commands: the signal is gone
    assert await asyncio.wait_for(reading, 2) == [b"one"]


async def test_messages_queued_before_a_read_are_returned_without_waiting(routed):
    router, dealer = routed
    for i in range(3):
        router.send_multipart([b"d", str(i).encode()])
    _arrive()
    assert dealer.ready_to_read()
    got = [await asyncio.wait_for(dealer.recv_multipart(), 2)]
    while dealer.ready_to_read():
        got.append(dealer.recv_nowait())
    assert got == [[b"0"], [b"1"], [b"2"]]
    with pytest.raises(zmq.Again):
        dealer.recv_nowait()


async def test_a_cancelled_read_takes_no_message_and_passes_its_wake_on(routed):
    router, dealer = routed
    first = asyncio.create_task(dealer.recv_multipart())
    second = asyncio.create_task(dealer.recv_multipart())
    await asyncio.sleep(0.05)
    router.send_multipart([b"d", b"only"])
    _arrive()
    # what the descriptor's reader does (reading EVENTS takes the signal): the first wakes
    dealer._wake(dealer.sock.getsockopt(zmq.EVENTS))
    first.cancel()  # ... and is cancelled before it runs
    assert await asyncio.wait_for(second, 2) == [b"only"]
    assert first.cancelled()


async def test_a_send_waits_while_nobody_can_take_it_then_goes(ctx, ipc_dir):
    addr = ipc_address(ipc_dir, "later")
    dealer = EventedSocket(plain_socket(ctx, zmq.DEALER), name="dealer")
    dealer.sock.setsockopt(zmq.LINGER, 0)
    dealer.sock.setsockopt(zmq.IMMEDIATE, 1)  # no pipe to queue into before a connection
    dealer.connect(addr)  # nobody bound
    router = None
    try:
        with pytest.raises(zmq.Again):
            dealer.send_nowait([b"now"])
        sending = asyncio.create_task(dealer.send_multipart([b"when-bound"]))
        await asyncio.sleep(0.1)
        assert not sending.done()
        router = plain_socket(ctx, zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(addr)
        await asyncio.wait_for(sending, 3)
        assert router.poll(2000)
        assert router.recv_multipart()[1:] == [b"when-bound"]
    finally:
        dealer.close()
        if router is not None:
            router.close(linger=0)


async def test_close_wakes_whoever_waits_with_channel_closed(ctx, ipc_dir):
    router, dealer = _pair(ctx, ipc_dir)
    reading = asyncio.create_task(dealer.recv_multipart())
    await asyncio.sleep(0.05)
    dealer.close()
    router.close(linger=0)
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(reading, 2)
    with pytest.raises(ChannelClosed):
        await dealer.recv_multipart()
    with pytest.raises(ChannelClosed):
        dealer.send_nowait([b"late"])
    dealer.close()  # twice: nothing happens


async def test_an_asyncio_socket_is_refused(ctx):
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(TypeError, match="plain socket"):
            EventedSocket(sock)
    finally:
        sock.close(linger=0)
