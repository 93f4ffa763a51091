"""The control bus: heartbeats, version announcements, stop requests and shutdown.

One :class:`ControlBroker` (in the supervisor) binds an XSUB socket at ``pub_address``, where
every client's PUB connects, and an XPUB socket at ``sub_address``, where every client's SUB
connects; it forwards each message to the subscribers and hands it to ``on_message``. Stage
replicas use a :class:`ControlClient`. A message is two frames: the topic (UTF-8) and a
msgpack map. Malformed messages are counted and logged, never fatal.

With a ``key`` (the supervisor makes one per run and hands it to its replicas in their private
spec files), every message carries a third frame: HMAC-SHA256 of topic and payload under that
key, cut to 16 bytes. The broker forwards only messages whose tag is right, and clients accept
only those; anything else (another process that found the socket, a replica of another run) is
refused and counted (``stats()["refused"]``), never acted on. The key never travels on the bus.
Rejections are logged at their 1st, 2nd, 4th, 8th ... occurrence per kind, so a flood cannot
flood the log.

With ``curve`` (the run's :class:`~transport.security.CurveKeys`; needed when the broker binds
off loopback, unless ``insecure=True``), both broker sockets serve CURVE and admit only this
run's clients: a peer without the keys gets no frame in, and is counted
(``stats()["refused_peers"]``). The tag stays: it also holds on one host, without CURVE.

Topics are ZeroMQ prefixes: subscribing to ``"stop"`` also delivers ``"stop_all"``. Pick topics
that are not prefixes of one another, or filter on the exact topic after ``recv()``.

PUB/SUB drops, by design, and does so silently in cases that matter here:

- Slow joiner: a subscription takes a moment to travel, and messages published before it
  arrives are lost. Towards the broker this is handled: a client publishes through an XPUB
  socket, and ``start()`` waits until the broker's subscription has arrived. Towards the
  clients it is not: a message the broker publishes before a client's SUB has connected and
  subscribed is lost to that client.
- A subscriber that falls behind by more than the high-water mark loses messages.
- A broker that restarts loses what was published while it was down.

So the bus carries state that is safe to repeat: heartbeats are periodic, and the supervisor
re-sends what matters (the current policy version, a pending shutdown) until it sees the effect.
Nothing on this bus is acknowledged or ordered across publishers. Data never travels here:
that is what channels are for.

The broker subscribes to everything and does not forward subscriptions upstream, so every
publisher sends every message to the broker (control traffic is small); the XPUB side filters
per subscriber.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from transport.address import check_address
from transport.credit import DRAIN_BATCH, sparse
from transport.errors import ChannelClosed, TransportError
from transport.evented import EventedSocket, plain_socket
from transport.monitor import PeerWatch
from transport.security import CurveKeys, require_curve_off_loopback

__all__ = ["ControlBroker", "ControlClient", "OnMessage"]

# What the broker calls for each well-formed message: on_message(topic, payload).
OnMessage = Callable[[str, dict[str, Any]], None]

_HWM = 10_000
_TAG_BYTES = 16


def _tag(key: bytes, topic: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, len(topic).to_bytes(4, "big") + topic + payload, hashlib.sha256)
    return mac.digest()[:_TAG_BYTES]


def _pack(topic: str, payload: Mapping[str, Any], key: bytes | None = None) -> list[bytes]:
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"control topic must be a non-empty string, got {topic!r}")
    if not isinstance(payload, Mapping):
        raise TypeError(f"control payload must be a map, got {type(payload).__name__}")
    frames = [topic.encode(), msgpack.packb(dict(payload), use_bin_type=True)]
    if key is not None:
        frames.append(_tag(key, *frames))
    return frames


class _Rejected:
    """Why a message was not taken: ``kind`` is ``malformed``, ``refused`` (bad tag) or
    ``not_subscription`` (sent to the broker's XPUB side, which takes only subscriptions)."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind, self.detail = kind, detail


def _unpack(
    frames: list[bytes], key: bytes | None = None
) -> tuple[str, dict[str, Any]] | _Rejected:
    """(topic, payload), or what is wrong with ``frames``."""
    if key is not None:
        if len(frames) != 3:
            return _Rejected("refused", f"{len(frames)} frames, expected 3 (topic, payload, tag)")
        if not hmac.compare_digest(frames[2], _tag(key, frames[0], frames[1])):
            return _Rejected("refused", "wrong tag (not signed with this run's key)")
        frames = frames[:2]
    elif len(frames) != 2:
        return _Rejected("malformed", f"{len(frames)} frames, expected 2 (topic, payload)")
    problem = _decode(frames)
    return _Rejected("malformed", problem) if isinstance(problem, str) else problem


def _decode(frames: list[bytes]) -> tuple[str, dict[str, Any]] | str:
    try:
        topic = frames[0].decode()
    except UnicodeDecodeError:
        return "topic is not UTF-8"
    try:
        payload = msgpack.unpackb(frames[1], raw=False)
    except Exception as e:  # any msgpack failure means malformed; the caller counts and logs it
        return f"topic {topic!r}: payload is not msgpack ({type(e).__name__})"
    if not isinstance(payload, dict):
        return f"topic {topic!r}: payload is a {type(payload).__name__}, not a map"
    return topic, payload


def _note_rejected(counts: Counter[str], log: Any, rejected: _Rejected) -> None:
    """Count a rejected message; log it at the 1st, 2nd, 4th ... of its kind."""
    counts[rejected.kind] += 1
    n = counts[rejected.kind]
    if sparse(n):
        log.warning("control_message_rejected", kind=rejected.kind, detail=rejected.detail, count=n)


def _socket(ctx: zmq.asyncio.Context, kind: int, *, plain: bool = False) -> Any:
    sock = plain_socket(ctx, kind) if plain else ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    return sock


class ControlBroker:
    """The supervisor's end of the bus: forwards every client's messages to every subscriber.

    ``on_message(topic, payload)`` is called for each well-formed message, after forwarding. It
    runs on the event loop and must not block. If it raises, the error is logged with its
    traceback and counted (``stats()["callback_errors"]``) and the bus keeps running: one bad
    message must not cut every stage off from the supervisor.
    """

    def __init__(
        self,
        pub_address: str,
        sub_address: str,
        ctx: zmq.asyncio.Context,
        on_message: OnMessage | None = None,
        *,
        log: Any = None,
        key: bytes | None = None,
        curve: CurveKeys | None = None,
        insecure: bool = False,
    ) -> None:
        self.pub_address = check_address(pub_address)
        self.sub_address = check_address(sub_address)
        for address in (self.pub_address, self.sub_address):
            require_curve_off_loopback("control broker", address, curve, insecure)
        self._ctx = ctx
        self._key = key
        self._curve = curve
        self._refusals: list[PeerWatch] = []
        self._on_message = on_message
        self._log = log if log is not None else structlog.get_logger()
        self._xsub: EventedSocket | None = None
        self._xpub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._counts: Counter[str] = Counter()

    async def start(self) -> None:
        """Bind both sockets and start forwarding."""
        if self._xsub is not None or self._closed:
            raise TransportError("control broker was already started")
        inbound = _socket(self._ctx, zmq.XSUB, plain=True)
        xsub, xpub = EventedSocket(inbound, name="control broker"), _socket(self._ctx, zmq.XPUB)
        if self._curve is not None:
            self._curve.serve(inbound)
            self._curve.serve(xpub)
        try:
            inbound.bind(self.pub_address)
            xpub.bind(self.sub_address)
        except zmq.ZMQError as e:
            xsub.close()
            xpub.close()
            raise TransportError(
                f"control broker: cannot bind {self.pub_address} / {self.sub_address}: {e}"
            ) from e
        # Subscribe to everything: the supervisor hears every message whoever subscribes.
        xsub.send_nowait([b"\x01"])
        self._xsub, self._xpub = xsub, xpub
        if self._curve is not None:
            self._refusals = [
                PeerWatch(inbound, "control broker (publishers)", self._log),
                PeerWatch(xpub, "control broker (subscribers)", self._log),
            ]
            for watch in self._refusals:
                watch.start()
        self._tasks = [
            asyncio.create_task(self._forward_loop(xsub, xpub), name="control-broker"),
            asyncio.create_task(self._drain_subscriptions(xpub), name="control-broker-subs"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    async def publish(self, topic: str, payload: Mapping[str, Any]) -> None:
        """Send a message to the subscribers (not to ``on_message``)."""
        if self._closed:
            raise ChannelClosed("control broker is closed")
        if self._xpub is None:
            raise TransportError("control broker: call start() first")
        await self._xpub.send_multipart(_pack(topic, payload, self._key))
        self._counts["published"] += 1

    async def aclose(self) -> None:
        """Stop forwarding and release both sockets."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for watch in self._refusals:
                await watch.aclose()
        finally:
            for sock in (self._xsub, self._xpub):
                if sock is not None:
                    sock.close(linger=0)

    def stats(self) -> dict[str, int]:
        """Messages forwarded, published, malformed, refused (bad tag), callback errors, frames
        at the subscriber side that are not (un)subscriptions, and peers refused in the CURVE
        handshake."""
        keys = (
            "forwarded",
            "published",
            "malformed",
            "refused",
            "callback_errors",
            "not_subscription",
        )
        counts = {k: self._counts[k] for k in keys}
        counts["refused_peers"] = sum(watch.refused for watch in self._refusals)
        return counts

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and not self._closed:
            self._log.error(
                "control_broker_failed", task=task.get_name(), error=repr(task.exception())
            )

    async def _forward_loop(self, xsub: EventedSocket, xpub: zmq.asyncio.Socket) -> None:
        # What is already queued is read at once, and everything is sent on through a plain
        # (non-async) view of the XPUB: no future per message. Only this task receives at the
        # XSUB; an XPUB send never blocks (a slow subscriber loses messages at its high-water
        # mark, as with an awaited send).
        out = zmq.Socket.shadow(xpub.underlying)
        while True:
            self._forward(await xsub.recv_multipart(), out)
            for _ in range(DRAIN_BATCH):
                if not xsub.ready_to_read():
                    break
                self._forward(xsub.recv_nowait(), out)
            else:
                await asyncio.sleep(0)  # a full batch: let the rest of the loop run

    def _forward(self, frames: list[bytes], out: zmq.Socket) -> None:
        parsed = _unpack(frames, self._key)
        if isinstance(parsed, _Rejected):
            _note_rejected(self._counts, self._log, parsed)
            return
        out.send_multipart(frames)
        self._counts["forwarded"] += 1
        if self._on_message is not None:
            try:
                self._on_message(*parsed)
            except Exception:
                # Deliberately not fatal (see the class docstring); logged with traceback.
                self._counts["callback_errors"] += 1
                self._log.exception("control_callback_failed", topic=parsed[0])

    async def _drain_subscriptions(self, xpub: zmq.asyncio.Socket) -> None:
        # XPUB reports (un)subscriptions as messages; read them so they never pile up. They are
        # not forwarded: the broker's XSUB already subscribes to everything. Anything else a
        # peer sends here (XPUB passes it on) is dropped and counted as not a subscription.
        while True:
            frames = await xpub.recv_multipart()
            if len(frames) != 1 or frames[0][:1] not in (b"\x00", b"\x01"):
                detail = (
                    f"{len(frames)} frame(s) at the subscriber side, first byte {frames[0][:1]!r}"
                )
                _note_rejected(self._counts, self._log, _Rejected("not_subscription", detail))


class ControlClient:
    """A stage replica's end of the bus: publish to everyone, receive chosen topics.

    ``topics`` are the prefixes to receive (none by default; add more with ``subscribe``).
    Read the slow-joiner note in the module docstring: the first messages after ``start()``
    may be lost in both directions.
    """

    def __init__(
        self,
        pub_address: str,
        sub_address: str,
        ctx: zmq.asyncio.Context,
        topics: Sequence[str] = (),
        *,
        log: Any = None,
        key: bytes | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        if isinstance(topics, str):
            raise TypeError("topics must be a sequence of strings, not one string")
        self.pub_address = check_address(pub_address)
        self.sub_address = check_address(sub_address)
        self._ctx = ctx
        self._key = key
        self._curve = curve
        self._topics = list(topics)
        self._log = log if log is not None else structlog.get_logger()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: EventedSocket | None = None
        self._closed = False
        self._counts: Counter[str] = Counter()

    async def start(self, ready_timeout_s: float = 5.0) -> None:
        """Connect both sockets, subscribe, and wait until the broker listens to us.

        Publishing goes through an XPUB socket (a PUB that reports subscriptions), so the client
        sees the broker's subscribe-to-everything arrive and knows its messages will no longer
        be dropped: the first heartbeat after ``start()`` reaches the supervisor. If the broker
        does not answer within ``ready_timeout_s``, a warning is logged and messages published
        before it connects are lost.
        """
        if self._pub is not None or self._closed:
            raise TransportError("control client was already started")
        self._pub = _socket(self._ctx, zmq.XPUB)
        self._pub_now = zmq.Socket.shadow(self._pub.underlying)  # the same socket, synchronous
        sub = _socket(self._ctx, zmq.SUB, plain=True)
        self._sub = EventedSocket(sub, name="control client")
        if self._curve is not None:
            self._curve.connect(self._pub)
            self._curve.connect(sub)
        self._pub.connect(self.pub_address)
        sub.connect(self.sub_address)
        for topic in self._topics:
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            await asyncio.wait_for(self._broker_subscribed(self._pub), ready_timeout_s)
        except asyncio.TimeoutError:
            self._log.warning(
                "control_bus_not_ready", address=self.pub_address, waited_s=ready_timeout_s
            )

    @staticmethod
    async def _broker_subscribed(pub: zmq.asyncio.Socket) -> None:
        while (await pub.recv())[:1] != b"\x01":  # an XPUB receives b"\x01" + prefix
            pass

    def subscribe(self, topic: str) -> None:
        """Also receive messages whose topic starts with ``topic``."""
        self._topics.append(topic)
        if self._sub is not None:
            self._sub.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())

    async def publish(self, topic: str, payload: Mapping[str, Any]) -> None:
        """Publish a message to the broker and, through it, to every subscriber of ``topic``."""
        if self._closed:
            raise ChannelClosed("control client is closed")
        if self._pub is None:
            raise TransportError("control client: call start() first")
        await self._pub.send_multipart(_pack(topic, payload, self._key))
        self._counts["published"] += 1

    def publish_nowait(self, topic: str, payload: Mapping[str, Any]) -> bool:
        """Publish now, from synchronous code: the message is queued before this returns, so
        it goes out ahead of anything this process sends later on any socket that it must
        precede (a ledger entry before the acknowledgement it accounts for). False, counted as
        ``dropped``, when the queue towards the broker is full (or the client is closed)."""
        if self._closed or self._pub is None:
            self._counts["dropped"] += 1
            return False
        frames = _pack(topic, payload, self._key)
        try:
            self._pub_now.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._counts["dropped"] += 1
            if sparse(self._counts["dropped"]):
                self._log.warning(
                    "control_publish_dropped", topic=topic, count=self._counts["dropped"]
                )
            return False
        self._counts["published"] += 1
        return True

    async def recv(self) -> tuple[str, dict[str, Any]]:
        """The next well-formed message on a subscribed topic; malformed ones are skipped."""
        if self._closed:
            raise ChannelClosed("control client is closed")
        if self._sub is None:
            raise TransportError("control client: call start() first")
        while True:
            try:  # a cancelled wait takes no message with it
                frames = await self._sub.recv_multipart()
            except ChannelClosed:
                raise ChannelClosed("control client was closed while receiving") from None
            parsed = _unpack(frames, self._key)
            if isinstance(parsed, _Rejected):
                _note_rejected(self._counts, self._log, parsed)
                continue
            self._counts["received"] += 1
            return parsed

    async def aclose(self, linger_ms: int = 0) -> None:
        """Release both sockets; what was published in the last ``linger_ms`` may still go out
        while the ZeroMQ context terminates (a replica's last words: its final ledger)."""
        if self._closed:
            return
        self._closed = True
        if self._pub is not None:
            self._pub.close(linger=linger_ms)
        if self._sub is not None:
            self._sub.close(linger=0)

    def stats(self) -> dict[str, int]:
        """Messages published, received, malformed, refused (bad tag) and dropped (a full queue
        under ``publish_nowait``)."""
        keys = ("published", "received", "malformed", "refused", "dropped")
        return {k: self._counts[k] for k in keys}
