"""Control bus: a client's message reaches the broker's callback and other clients; malformed
messages are counted, not fatal; with a run key, unsigned or wrongly signed ones are refused."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from tests.transport.conftest import events
from transport import ChannelClosed, ControlBroker, ControlClient, ipc_address


async def until_received(publish, receive, timeout: float = 3.0):
    """Publish every 20 ms until ``receive()`` returns: PUB/SUB drops messages sent before a
    subscription has arrived (the slow-joiner), so the first ones may be lost."""

    async def keep_publishing() -> None:
        while True:
            await publish()
            await asyncio.sleep(0.02)

    publisher = asyncio.create_task(keep_publishing())
    try:
        return await asyncio.wait_for(receive(), timeout)
    finally:
        publisher.cancel()
        await asyncio.gather(publisher, return_exceptions=True)


@pytest.mark.timeout(10)
async def test_publish_reaches_broker_callback_and_subscribers(ctx, ipc_dir) -> None:
    pub, sub = ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub")
    seen: asyncio.Queue = asyncio.Queue()
    broker = ControlBroker(pub, sub, ctx, on_message=lambda t, p: seen.put_nowait((t, p)))
    await broker.start()
    stage = ControlClient(pub, sub, ctx)
    watcher = ControlClient(pub, sub, ctx, topics=["version"])
    for c in (stage, watcher):
        await c.start()
    try:
        # To the broker's callback.
        topic, payload = await until_received(
            lambda: stage.publish("heartbeat", {"stage": "gen", "replica": 0}), seen.get
        )
        assert (topic, payload) == ("heartbeat", {"stage": "gen", "replica": 0})
        # Through the broker to another client, on the topic it subscribed to.
        topic, payload = await until_received(
            lambda: stage.publish("version", {"version": 3}), watcher.recv
        )
        assert (topic, payload) == ("version", {"version": 3})
        # From the broker itself.
        topic, payload = await until_received(
            lambda: broker.publish("version", {"version": 4}), watcher.recv
        )
        assert payload == {"version": 4}
        # A topic the watcher did not subscribe to never reaches it.
        await stage.publish("heartbeat", {"x": 1})
        await broker.publish("stop", {"reason": "test"})
        with pytest.raises(asyncio.TimeoutError):
            while True:
                topic, _ = await asyncio.wait_for(watcher.recv(), 0.2)
                assert topic == "version"
        assert broker.stats()["forwarded"] >= 2
    finally:
        for c in (stage, watcher):
            await c.aclose()
        await broker.aclose()


@pytest.mark.timeout(10)
async def test_malformed_messages_and_callback_errors_are_not_fatal(ctx, ipc_dir, log) -> None:
    pub, sub = ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub")
    seen: asyncio.Queue = asyncio.Queue()

    def on_message(topic: str, payload: dict) -> None:
        if topic == "boom":
            raise RuntimeError("callback bug")
        seen.put_nowait((topic, payload))

    broker = ControlBroker(pub, sub, ctx, on_message=on_message, log=log)
    await broker.start()
    raw = ctx.socket(zmq.PUB)
    raw.linger = 0
    raw.connect(pub)
    client = ControlClient(pub, sub, ctx)
    await client.start()
    try:

        async def junk_then_good() -> None:
            await raw.send_multipart([b"t", b"\xc1"])  # payload not msgpack
            await raw.send_multipart([b"t"])  # no payload
            await raw.send_multipart([b"\xff", b"\x80"])  # topic not UTF-8
            await client.publish("boom", {})
            await client.publish("ok", {"n": 1})

        assert await until_received(junk_then_good, seen.get) == ("ok", {"n": 1})
        stats = broker.stats()
        assert stats["malformed"] >= 3 and stats["malformed"] % 3 == 0
        assert stats["callback_errors"] >= 1
        assert events(log, "control_message_rejected")
        assert events(log, "control_callback_failed")[0]["topic"] == "boom"

        # At the subscriber side only (un)subscriptions count; anything else is dropped and
        # counted, and subscribing still works.
        junk = ctx.socket(zmq.XSUB)
        junk.linger = 0
        junk.connect(sub)
        sent = [[b"\x07junk"], [b""], [b"\x01a", b"more"]]
        for frames in sent:
            await junk.send_multipart(frames)
        await junk.send(b"\x01version")  # a real subscription: not counted

        for _ in range(300):  # up to 3 s for the broker to read them
            if broker.stats()["not_subscription"] >= len(sent):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and nothing more comes: the subscription is not counted
        assert broker.stats()["not_subscription"] == len(sent)
        kinds = {e["kind"] for e in events(log, "control_message_rejected")}
        assert "not_subscription" in kinds
        junk.close()
    finally:
        raw.close()
        await client.aclose()
        await broker.aclose()


@pytest.mark.timeout(10)
async def test_bad_publish_arguments_fail_at_the_call(ctx, ipc_dir) -> None:
    pub, sub = ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub")
    client = ControlClient(pub, sub, ctx)
    await client.start(ready_timeout_s=0.05)  # no broker here
    try:
        with pytest.raises(ValueError, match="topic"):
            await client.publish("", {})
        with pytest.raises(TypeError, match="map"):
            await client.publish("t", [1, 2])  # type: ignore[arg-type]
    finally:
        await client.aclose()


@pytest.mark.timeout(10)
async def test_close_while_receiving_raises_channel_closed(ctx, ipc_dir) -> None:
    client = ControlClient(
        ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub"), ctx, topics=["x"]
    )
    await client.start(ready_timeout_s=0.05)  # no broker here
    receiving = asyncio.create_task(client.recv())
    await asyncio.sleep(0.02)
    await client.aclose()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(receiving, 1)


@pytest.mark.timeout(10)
async def test_first_message_after_start_reaches_the_broker(ctx, ipc_dir) -> None:
    # No retry here: start() waits for the broker's subscription, so nothing is dropped.
    pub, sub = ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub")
    seen: asyncio.Queue = asyncio.Queue()
    broker = ControlBroker(pub, sub, ctx, on_message=lambda t, p: seen.put_nowait((t, p)))
    await broker.start()
    clients = [ControlClient(pub, sub, ctx) for _ in range(5)]
    try:
        for i, client in enumerate(clients):
            await client.start()
            await client.publish("heartbeat", {"i": i})
        got = [await asyncio.wait_for(seen.get(), 3) for _ in clients]
        assert sorted(p["i"] for _, p in got) == list(range(5))
    finally:
        for client in clients:
            await client.aclose()
        await broker.aclose()


@pytest.mark.timeout(10)
async def test_start_without_a_broker_is_bounded(ctx, ipc_dir, log) -> None:
    client = ControlClient(ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub"), ctx, log=log)
    await client.start(ready_timeout_s=0.1)
    assert events(log, "control_bus_not_ready")
    await client.publish("heartbeat", {})  # dropped, but never blocks
    await client.aclose()


@pytest.mark.timeout(10)
async def test_with_a_key_only_signed_messages_are_taken(ctx, ipc_dir, log) -> None:
    pub, sub = ipc_address(ipc_dir, "pub"), ipc_address(ipc_dir, "sub")
    key = b"k" * 32
    seen: asyncio.Queue = asyncio.Queue()
    broker = ControlBroker(
        pub, sub, ctx, on_message=lambda t, p: seen.put_nowait((t, p)), log=log, key=key
    )
    await broker.start()
    member = ControlClient(pub, sub, ctx, topics=["version"], key=key, log=log)
    stranger = ControlClient(pub, sub, ctx, key=b"x" * 32)  # another run's key
    unkeyed = ControlClient(pub, sub, ctx)  # knows the addresses, not the key
    for c in (member, stranger, unkeyed):
        await c.start(ready_timeout_s=1)
    raw = ctx.socket(zmq.PUB)
    raw.linger = 0
    raw.connect(pub)
    try:

        async def forged_then_signed() -> None:
            await stranger.publish("stop", {"reason": "forged"})
            await unkeyed.publish("stop", {"reason": "no tag"})
            await raw.send_multipart([b"stop", b"\x80", b"0" * 16])  # a guessed tag
            await member.publish("heartbeat", {"n": 1})

        assert await until_received(forged_then_signed, seen.get) == ("heartbeat", {"n": 1})
        assert seen.empty()  # nothing unsigned reached the callback
        # the raw socket does not wait for the broker (slow joiner): resend until it arrives
        for _ in range(100):
            if broker.stats()["refused"] >= 3 * 2:
                break
            await forged_then_signed()
            await asyncio.sleep(0.02)
        stats = broker.stats()
        assert stats["refused"] >= 6 and stats["forwarded"] >= 1
        rejected = events(log, "control_message_rejected")
        assert {e["kind"] for e in rejected} == {"refused"}
        # logged at the 1st, 2nd, 4th ... refusal, not at each one
        assert len(rejected) < stats["refused"] or stats["refused"] <= 4
        # the broker signs what it sends: the member takes it, a client with another key does not
        topic, payload = await until_received(
            lambda: broker.publish("version", {"version": 7}), member.recv
        )
        assert (topic, payload) == ("version", {"version": 7})
        stranger.subscribe("version")
        await asyncio.sleep(0.1)
        for _ in range(5):
            await broker.publish("version", {"version": 8})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stranger.recv(), 0.3)
        assert stranger.stats()["refused"] >= 1
    finally:
        raw.close()
        for c in (member, stranger, unkeyed):
            await c.aclose()
        await broker.aclose()
