"""CURVE on channels and the control bus: the run's peers talk; a peer without the run's keys
(no CURVE, another server key, or a client key of its own) gets nothing in, the socket keeps
serving, and the refusal is counted."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tests.transport.conftest import eventually
from tests.transport.test_channel import receiver, sender
from tests.transport.test_control import until_received
from transport import ControlBroker, ControlClient, tcp_address
from transport.address import is_loopback
from transport.security import CurveKeys

RUN = CurveKeys.generate()


def _stranger(how: str) -> CurveKeys | None:
    """The keys an outsider might hold: none, all its own, or the server's public key (which
    is not a secret in CURVE) with a client key of its own."""
    own = CurveKeys.generate()
    if how == "plain":
        return None
    if how == "own keys":
        return own
    return CurveKeys(RUN.server_public, own.server_secret, own.client_public, own.client_secret)


@pytest.fixture
async def outside() -> zmq.asyncio.Context:
    """The outsider's own process, as far as ZeroMQ is concerned: another context."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("how", ["plain", "own keys", "server key only"])
async def test_a_channel_takes_nothing_from_a_peer_without_the_run_keys(ctx, outside, how):
    addr = tcp_address()
    r = receiver(ctx, addr, capacity=8, curve=RUN)
    await r.start()
    friend = sender(ctx, [r.address], identity="p.0", curve=RUN)
    intruder = sender(outside, [r.address], identity="p.0", curve=_stranger(how))
    await friend.start()
    await intruder.start()
    try:
        # The intruder "sends" valid messages of the right schema: they never leave its side,
        # because no credit can come back through a handshake that failed.
        sends = [asyncio.create_task(intruder.send("item", {"id": 100 + i})) for i in range(3)]
        await eventually(lambda: r.stats()["refused_peers"] >= 1, timeout=5)
        await friend.send("item", {"id": 1})
        msg = await asyncio.wait_for(r.recv(), 5)
        assert (msg.sender, msg.data["id"]) == ("p.0", 1)
        await asyncio.sleep(0.3)
        stats = r.stats()
        assert stats["received"] == 1 and stats["depth"] == 0 and stats["rejected"] == {}
        assert not any(t.done() for t in sends)
        for t in sends:
            t.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
    finally:
        await intruder.aclose(eos=False)
        await friend.aclose()
        await r.aclose()


@pytest.mark.timeout(15)
async def test_the_control_bus_hears_nothing_from_a_peer_without_the_run_keys(ctx, outside):
    pub, sub = tcp_address(), tcp_address()
    seen: asyncio.Queue = asyncio.Queue()
    broker = ControlBroker(
        pub, sub, ctx, on_message=lambda t, p: seen.put_nowait((t, p)), curve=RUN
    )
    await broker.start()
    stage = ControlClient(pub, sub, ctx, topics=["version"], curve=RUN)
    intruder = ControlClient(pub, sub, outside, topics=["version"])
    await stage.start()
    await intruder.start(ready_timeout_s=0.5)  # the broker never subscribes to it
    try:
        for _ in range(5):
            await intruder.publish("stop", {"stage": "learner", "reason": "hostile"})
            await asyncio.sleep(0.05)
        await eventually(lambda: broker.stats()["refused_peers"] >= 1, timeout=5)
        topic, _ = await until_received(lambda: stage.publish("heartbeat", {"n": 1}), seen.get)
        assert topic == "heartbeat"
        # What the broker publishes reaches the run's client, not the intruder.
        await until_received(lambda: broker.publish("version", {"version": 2}), stage.recv)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(intruder.recv(), 0.5)
        while not seen.empty():
            assert seen.get_nowait()[0] != "stop"
        assert broker.stats()["forwarded"] >= 1
    finally:
        await intruder.aclose()
        await stage.aclose()
        await broker.aclose()


def test_off_loopback_needs_curve_or_insecure(ctx) -> None:
    with pytest.raises(ValueError, match=r"reachable from other hosts.*transport\.insecure"):
        receiver(ctx, "tcp://10.1.2.3:0")
    with pytest.raises(ValueError, match=r"control broker: tcp://10\.1\.2\.3:5555"):
        ControlBroker("tcp://10.1.2.3:5555", "tcp://10.1.2.3:5556", ctx, curve=None)
    receiver(ctx, "tcp://10.1.2.3:0", insecure=True)  # said explicitly: allowed
    receiver(ctx, "tcp://10.1.2.3:0", curve=RUN)
    receiver(ctx, "tcp://127.0.0.1:0")  # loopback needs neither
    assert (
        is_loopback("ipc:///tmp/x")
        and is_loopback("tcp://[::1]:5")
        and is_loopback("tcp://localhost:5")
    )
    assert not is_loopback("tcp://node-7:5555")


def test_keys_round_trip_and_bad_keys_are_named() -> None:
    assert CurveKeys.from_spec(RUN.to_spec()) == RUN
    assert RUN.to_spec()["server_secret"] not in repr(RUN)
    bad = {**RUN.to_spec(), "client_secret": "short"}
    with pytest.raises(ValueError, match=r"spec\.curve\.client_secret: expected a 40-character"):
        CurveKeys.from_spec(bad, "spec.curve")
    swapped = {**RUN.to_spec(), "client_secret": CurveKeys.generate().to_spec()["client_secret"]}
    with pytest.raises(ValueError, match="client public key does not match its secret key"):
        CurveKeys.from_spec(swapped)
