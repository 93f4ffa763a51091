"""Channels: bounded, credit-based message streams between stages over ZeroMQ.

Why credit: a producer that runs ahead of its consumer would otherwise fill socket buffers with
tensors until memory runs out, and the lag between generation and training (the staleness the
whole pipeline is built to bound) would grow without limit. So every input port has a bounded
inbox, and a producer may send only what the consumer has granted it room for. ZeroMQ's
high-water marks stay in place only as a safety net.

Shape: the consumer side (:class:`Receiver`) binds a ROUTER at its inbox address; each producer
side (:class:`Sender`) connects one DEALER per consumer replica, with routing id
``IDENTITY/SESSION`` (``IDENTITY`` is ``stage.replica``, ``SESSION`` random per Sender).

Protocol. Every message on that socket pair is ``[tag, msgpack map, *codec frames]``:

=========  ========  ==========================================================================
tag        way       map
=========  ========  ==========================================================================
``H``      p -> c    HELLO/PING ``{identity, session, to, epoch, sent}``: at start, then every
                     ``heartbeat_s``. ``to``/``epoch`` name the credit stream the producer holds
                     (None before any), ``sent`` how many DATA it sent in it.
``D``      p -> c    DATA ``{to, epoch}``, then the codec frames of one message.
``E``      p -> c    EOS ``{identity, session, to, epoch, sent}``: no more messages from it.
``C``      c -> p    CREDIT ``{session, epoch, grant, granted, consumed, eos}``: ``grant`` new
                     slots; ``granted`` the total granted in this stream; ``consumed`` DATA
                     received in it; ``eos`` true when acknowledging an EOS.
``X``      c -> p    CLOSE ``{session}``: the consumer is going away.
=========  ========  ==========================================================================

A credit stream is one (consumer ``session``, ``epoch``) pair; the consumer opens a new epoch
each time it (re)admits a producer. The producer's credit on a stream is ``granted - sent``, so
a lost or duplicated CREDIT heals with the next one (the consumer answers every PING with one).
When the stream changes (consumer restarted, or it reclaimed our credit) the producer's credit
resets to the new grant. DATA sent on a stale stream (it was queued while the consumer
restarted) is still accepted and counted ``uncredited``: data sent in good faith is never
dropped. A PING tells the consumer how many DATA were sent on the current stream; ZeroMQ keeps
order on a connection, so any shortfall was lost and its credit is written off.

Consumer: invariant ``depth + credit outstanding <= capacity`` (uncredited arrivals aside).
Free slots go round-robin to producers, each capped at ``max(1, capacity // n)`` where ``n``
counts live producers and expected ones not yet heard from (credit is never revoked, so the
first producer to arrive must not take the whole inbox; a producer that hoards its share while
idle still keeps it until it sends or is reclaimed). Grants are coalesced (one pass per
event-loop turn, and a producer that still holds credit is topped up only once a quarter of its
share is missing), but a producer with no credit left gets a slot as soon as one is free.
A producer silent for ``peer_timeout_s`` is dropped and its credit reclaimed. Rejected messages
(see ``codec.decode``) are counted per reason, logged, and their slot granted again.

Producer: ``send`` waits until some live consumer has granted credit, then sends to the one
with the most credit (ties round-robin). A consumer is live while it has answered within
``peer_timeout_s`` (it answers every PING, so a live one answers every ``heartbeat_s``).
``aclose()`` stops the PINGs, sends EOS to every consumer and waits (at most ``timeout_s``) for
each to acknowledge it, except those that said CLOSE; the acknowledgement also proves every
DATA before it arrived, so the sockets can then close with linger 0.

Not here: delivery guarantees across crashes (a message in flight to a consumer that dies is
lost; a consumer that restarts receives what was queued for it), encryption or authentication
(bind to loopback or ipc), and the wiring of ports to addresses (``pipeline.actor``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from transport.address import check_address
from transport.codec import decode, encode
from transport.errors import ChannelClosed, DecodeError, EndOfStream, TransportError
from transport.message import Message, Schema

__all__ = ["Receiver", "Sender"]

HELLO, DATA, EOS, CREDIT, CLOSE = b"H", b"D", b"E", b"C", b"X"

# The ROUTER gets this long to flush CLOSE frames when it closes; everything else lingers 0.
_CLOSE_LINGER_MS = 100
# Messages the receiver takes from its socket before it yields to the event loop.
_DRAIN_BATCH = 256
# Producer-side high-water marks: it sends only with credit, so these are never reached by DATA.
_SENDER_HWM = 10_000


def _schema_map(schemas: Sequence[Schema], where: str) -> dict[str, Schema]:
    by_kind: dict[str, Schema] = {}
    for schema in schemas:
        if schema.kind in by_kind:
            raise ValueError(f"{where}: kind {schema.kind!r} is declared twice")
        by_kind[schema.kind] = schema
    return by_kind


def _unpack_map(frame: Any) -> dict[str, Any] | None:
    """The msgpack map in a control frame, or None if it is not one."""
    try:
        value = msgpack.unpackb(frame, raw=False)
    except Exception:  # any msgpack failure means "malformed"; the caller counts and logs it
        return None
    return value if isinstance(value, dict) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _settled(fut: asyncio.Future) -> asyncio.Future:
    """Wait for a pyzmq future without letting a socket close pass for our own cancellation.

    Closing a socket cancels its pending futures, which would surface in the awaiting task as a
    CancelledError it never asked for. Here a cancel of the *task* still propagates (and the
    operation is cancelled with it), while a future cancelled by the close is returned as is.
    """
    if not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            fut.cancel()
            raise
    return fut


def _log_failed_send(log: Any, port: str) -> Any:
    def callback(fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("control_send_failed", port=port, error=repr(fut.exception()))

    return callback


# ---------------------------------------------------------------------------------------------
# consumer side


@dataclass(eq=False)
class _Producer:
    """The consumer's view of one producer session (one credit stream, ``epoch``)."""

    rid: bytes
    identity: str
    session: str
    epoch: int
    last_seen: float
    granted: int = 0  # total granted on this stream
    received: int = 0  # credited DATA received (or written off) on this stream
    reply: bool = False  # owes the producer a CREDIT even if the grant is 0

    @property
    def outstanding(self) -> int:
        return self.granted - self.received


class Receiver:
    """The consuming end of a channel: a bounded inbox fed by any number of producers.

    ``await recv()`` returns the next message (``msg.sender`` is the producer's identity);
    ``async for msg in receiver`` stops at end-of-stream. End-of-stream comes when every
    identity in ``expected_producers`` has sent EOS and the inbox is drained; with
    ``expected_producers=None`` the stream never ends that way. An identity that sent EOS is
    finished for good on this receiver.

    ``name`` names the port in logs; ``address`` is bound (``ipc://``, ``tcp://`` on a named
    interface, ``inproc://``); ``schemas`` are the kinds accepted (anything else is rejected and
    counted); ``capacity`` bounds the inbox in messages; ``peer_timeout_s`` is how long a
    silent producer keeps its credit. ``log`` is a structlog-style logger.

    Decoded arrays share the received frames' memory: see ``transport.codec``.
    """

    def __init__(
        self,
        name: str,
        address: str,
        schemas: Sequence[Schema],
        *,
        capacity: int,
        expected_producers: Collection[str] | None,
        ctx: zmq.asyncio.Context,
        log: Any = None,
        peer_timeout_s: float = 10.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"receiver {name!r}: capacity must be >= 1, got {capacity}")
        if peer_timeout_s <= 0:
            raise ValueError(f"receiver {name!r}: peer_timeout_s must be > 0")
        self.name = name
        self.address = check_address(address)
        self.capacity = capacity
        self._schemas = _schema_map(schemas, f"receiver {name!r}")
        self._expected = None if expected_producers is None else frozenset(expected_producers)
        self._ctx = ctx
        self._log = log if log is not None else structlog.get_logger()
        self._peer_timeout_s = peer_timeout_s
        self._session = secrets.token_hex(6)

        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._closed = False
        self._inbox: deque[Message] = deque()
        self._readable = asyncio.Event()
        self._producers: dict[bytes, _Producer] = {}
        self._finished: set[str] = set()  # identities that sent EOS
        self._epoch = 0
        self._rr = 0
        self._grant_scheduled = False
        self._on_sent = _log_failed_send(self._log, name)

        self._peak = 0
        self._received = 0
        self._bytes = 0
        self._uncredited = 0
        self._rejected: Counter[str] = Counter()
        self._blocked_s = 0.0
        self._blocked_since: float | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the inbox address and start receiving."""
        if self._sock is not None or self._closed:
            raise TransportError(f"receiver {self.name!r} was already started")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting producer takes over its id
        hwm = max(1000, 10 * self.capacity)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as e:
            sock.close()
            raise TransportError(f"receiver {self.name!r}: cannot bind {self.address}: {e}") from e
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"receiver:{self.name}"),
            asyncio.create_task(self._reap_loop(), name=f"receiver-reaper:{self.name}"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        self._log.debug("receiver_started", port=self.name, address=self.address,
                        capacity=self.capacity, session=self._session)

    async def aclose(self) -> None:
        """Tell producers we are going and release the socket (always, even if telling fails)."""
        if self._closed:
            return
        self._closed = True
        self._readable.set()  # wake recv() waiters: they raise ChannelClosed
        try:
            for task in self._tasks:
                task.cancel()
            # return_exceptions: the tasks' own CancelledError is expected (a loop that failed
            # already reported through recv()); a cancel of aclose() itself still propagates.
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._release()
        self._log.debug("receiver_closed", port=self.name, **self._counts())

    def _release(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            close = msgpack.packb({"session": self._session})
            for rid in self._producers:
                sock.send_multipart([rid, CLOSE, close]).add_done_callback(self._on_sent)
        except zmq.ZMQError as e:
            self._log.warning("close_notice_failed", port=self.name, error=repr(e))
        finally:
            sock.close(linger=_CLOSE_LINGER_MS)  # gives CLOSE frames a moment to leave

    async def __aenter__(self) -> Receiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the application side --------------------------------------------------------------

    async def recv(self) -> Message:
        """The next message; waits while the inbox is empty.

        Raises EndOfStream at the end, ChannelClosed after ``aclose()``.
        """
        while True:
            if self._closed:
                raise ChannelClosed(f"receiver {self.name!r} is closed")
            if self._failure is not None:
                raise TransportError(f"receiver {self.name!r} failed") from self._failure
            if self._sock is None:
                raise TransportError(f"receiver {self.name!r}: call start() first")
            if self._inbox:
                msg = self._inbox.popleft()
                self._schedule_grant()  # a slot is free again
                return msg
            if self._ended():
                raise EndOfStream(f"receiver {self.name!r}: every producer has finished")
            self._readable.clear()
            self._blocked_since = time.monotonic()
            try:
                await self._readable.wait()
            finally:
                self._blocked_s += time.monotonic() - self._blocked_since
                self._blocked_since = None

    def producer_finished(self, identity: str) -> None:
        """Count ``identity`` as finished, as if its EOS had arrived.

        For a receiver that restarts after some producers already finished: their EOS went to
        the previous instance, and whoever knows (the supervisor) tells this one.
        """
        self._finished.add(identity)
        for p in [p for p in self._producers.values() if p.identity == identity]:
            del self._producers[p.rid]  # its credit returns to the pool
            if not self._closed and self._sock is not None:
                self._schedule_grant()
        if self._ended():
            self._readable.set()

    def __aiter__(self) -> Receiver:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.recv()
        except EndOfStream:
            raise StopAsyncIteration from None

    def stats(self) -> dict[str, Any]:
        """Inbox bound and use, traffic, and credit state (for metrics)."""
        blocked = self._blocked_s
        if self._blocked_since is not None:
            blocked += time.monotonic() - self._blocked_since
        return {
            "capacity": self.capacity,
            "depth": len(self._inbox),
            "peak": self._peak,
            "credit_outstanding": self._outstanding(),
            "producers": len(self._producers),
            "finished": sorted(self._finished),
            "blocked_s": blocked,
            **self._counts(),
        }

    def _counts(self) -> dict[str, Any]:
        return {
            "received": self._received,
            "bytes": self._bytes,
            "rejected": dict(self._rejected),
            "uncredited": self._uncredited,
        }

    # -- internals ---------------------------------------------------------------------------

    def _ended(self) -> bool:
        return self._expected is not None and self._expected <= self._finished

    def _outstanding(self) -> int:
        return sum(p.outstanding for p in self._producers.values())

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._closed:
            return
        # A loop died of a bug: make recv() raise it instead of waiting forever.
        self._failure = task.exception() or TransportError("receiver loop ended")
        self._log.error("receiver_failed", port=self.name, error=repr(self._failure))
        self._readable.set()

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        # What is already queued is drained through a plain (non-async) view of the same socket:
        # that skips pyzmq's per-message future machinery, which dominates the cost of small
        # messages. Only this task receives, and the awaited recv re-checks the socket's events
        # before it waits, so no wake-up is lost.
        queued = zmq.Socket.shadow(sock.underlying)
        while True:
            self._handle(await sock.recv_multipart(copy=False))
            for _ in range(_DRAIN_BATCH):
                try:
                    frames = queued.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
            else:
                await asyncio.sleep(0)  # a full batch: let the application run before the next

    async def _reap_loop(self) -> None:
        # A periodic timer, not synchronization: producers that stopped talking lose their credit.
        while True:
            await asyncio.sleep(self._peer_timeout_s / 4)
            deadline = time.monotonic() - self._peer_timeout_s
            for p in [p for p in self._producers.values() if p.last_seen < deadline]:
                del self._producers[p.rid]
                self._log.warning("producer_lost", port=self.name, sender=p.identity,
                                  session=p.session, reclaimed=p.outstanding)
                self._schedule_grant()

    def _reject(self, reason: str, detail: str, sender: str) -> None:
        self._rejected[reason] += 1
        self._log.warning("message_rejected", port=self.name, reason=reason, detail=detail,
                          sender=sender)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        producer = self._producers.get(rid)
        if producer is not None:
            sender = producer.identity
        else:  # not (or no longer) admitted: the routing id is IDENTITY/SESSION
            sender = rid.decode("utf-8", "replace").rpartition("/")[0]
        if len(frames) < 3 or len(frames[1]) != 1:
            self._reject("bad_control", f"{len(frames) - 1} frames without a valid tag", sender)
            return
        tag = frames[1].bytes
        header = _unpack_map(frames[2].buffer)
        if header is None:
            self._reject("bad_control", f"tag {tag!r}: frame 1 is not a msgpack map", sender)
            return
        if producer is not None:
            producer.last_seen = time.monotonic()
        if tag == DATA:
            self._on_data(producer, sender, header, frames[3:])
        elif tag == HELLO:
            self._on_hello(rid, producer, header, sender)
        elif tag == EOS:
            self._on_eos(rid, producer, header, sender)
        else:
            self._reject("bad_control", f"unknown tag {tag!r}", sender)

    def _credited(self, producer: _Producer | None, header: Mapping[str, Any]) -> bool:
        return (
            producer is not None
            and header.get("to") == self._session
            and header.get("epoch") == producer.epoch
        )

    def _on_data(self, producer: _Producer | None, sender: str, header: Mapping[str, Any],
                 frames: list[zmq.Frame]) -> None:
        credited = self._credited(producer, header) and producer.outstanding > 0
        if credited:
            producer.received += 1
        try:
            msg = decode(frames, self._schemas)
        except DecodeError as e:
            self._reject(e.reason, e.detail, sender)
            self._schedule_grant()  # its slot was never taken: grant it again
            return
        if not credited:
            self._uncredited += 1
        msg.sender = sender
        self._inbox.append(msg)
        self._received += 1
        self._bytes += sum(f.buffer.nbytes for f in frames)
        self._peak = max(self._peak, len(self._inbox))
        self._readable.set()
        self._schedule_grant()  # this producer may now be out of credit

    def _on_hello(self, rid: bytes, producer: _Producer | None, header: Mapping[str, Any],
                  sender: str) -> None:
        identity, session = header.get("identity"), header.get("session")
        if not isinstance(identity, str) or not isinstance(session, str):
            self._reject("bad_control", "HELLO without identity/session strings", sender)
            return
        if producer is None:
            if identity in self._finished:
                return  # it said EOS; a late PING must not re-admit it
            for old in [p for p in self._producers.values() if p.identity == identity]:
                del self._producers[old.rid]  # that identity restarted: the old session is gone
                self._log.info("producer_replaced", port=self.name, sender=identity,
                               session=old.session, reclaimed=old.outstanding)
            self._epoch += 1
            producer = _Producer(rid, identity, session, self._epoch, time.monotonic())
            self._producers[rid] = producer
            self._log.debug("producer_joined", port=self.name, sender=identity, session=session)
        sent = header.get("sent")
        if self._credited(producer, header) and _is_int(sent) and sent > producer.received:
            # ZeroMQ keeps order on a connection, so DATA sent before this PING has arrived:
            # what is missing was lost, and its credit must not stay outstanding forever.
            lost = min(sent, producer.granted) - producer.received
            self._log.warning("data_lost", port=self.name, sender=identity, count=lost)
            producer.received += lost
        producer.reply = True
        self._schedule_grant()

    def _on_eos(self, rid: bytes, producer: _Producer | None, header: Mapping[str, Any],
                sender: str) -> None:
        identity = header.get("identity")
        if not isinstance(identity, str):
            self._reject("bad_control", "EOS without an identity string", sender)
            return
        self._producers.pop(rid, None)  # its outstanding credit returns to the pool
        self._finished.add(identity)
        self._log.debug("producer_finished", port=self.name, sender=identity)
        self._send_credit(rid, producer, 0, eos=True)
        if self._ended():
            self._readable.set()
        self._schedule_grant()

    def _schedule_grant(self) -> None:
        # Coalesce: however many events happen in one loop turn, grant once after them.
        if not self._grant_scheduled and not self._closed:
            self._grant_scheduled = True
            asyncio.get_running_loop().call_soon(self._grant)

    def _grant(self) -> None:
        self._grant_scheduled = False
        if self._closed or self._sock is None:
            return
        producers = list(self._producers.values())
        grants: Counter[bytes] = Counter()
        free = self.capacity - len(self._inbox) - self._outstanding()
        if free > 0 and producers:
            # Count expected producers that have not said hello yet too: the first to arrive
            # must not take the whole inbox (credit is never revoked, only spent or reclaimed).
            waiting_for = len(self._expected - self._finished) if self._expected else 0
            share = max(1, self.capacity // max(len(producers), waiting_for))
            top_up = max(1, share // 4)
            want = {
                p.rid: share - p.outstanding
                for p in producers
                if p.outstanding < share and (p.outstanding == 0 or share - p.outstanding >= top_up)
            }
            order = [p.rid for p in producers if p.rid in want]
            if order:
                start = self._rr % len(order)
                order = order[start:] + order[:start]
                self._rr += 1
            # One slot at a time, round-robin: when slots are scarce, everyone gets turns.
            while free > 0 and any(want[rid] > 0 for rid in order):
                for rid in order:
                    if free > 0 and want[rid] > 0:
                        want[rid] -= 1
                        grants[rid] += 1
                        free -= 1
        for p in producers:
            if grants[p.rid] or p.reply:
                p.granted += grants[p.rid]
                p.reply = False
                self._send_credit(p.rid, p, grants[p.rid])

    def _send_credit(self, rid: bytes, p: _Producer | None, grant: int, eos: bool = False) -> None:
        assert self._sock is not None
        credit = {
            "session": self._session,
            "epoch": p.epoch if p else 0,
            "grant": grant,
            "granted": p.granted if p else 0,
            "consumed": p.received if p else 0,
            "eos": eos,
        }
        # ROUTER sends never block (without ROUTER_MANDATORY it drops for unknown peers),
        # so this future is already done; the callback only surfaces errors.
        self._sock.send_multipart([rid, CREDIT, msgpack.packb(credit)]).add_done_callback(
            self._on_sent
        )


# ---------------------------------------------------------------------------------------------
# producer side


@dataclass(eq=False)
class _Peer:
    """The producer's view of one consumer replica (one DEALER)."""

    address: str
    sock: zmq.asyncio.Socket
    session: str | None = None  # consumer session of the current credit stream
    epoch: int = 0
    granted: int = 0
    sent: int = 0  # DATA sent on the current stream
    last_heard: float = -1e18
    eos_acked: bool = False
    closed: bool = False  # it said CLOSE (going away) and has not granted credit since
    consumed: int = 0  # DATA the consumer has received on this stream (its last report)

    @property
    def credit(self) -> int:
        return self.granted - self.sent if self.session is not None else 0

    def live(self, now: float, timeout: float) -> bool:
        return self.session is not None and now - self.last_heard <= timeout


class Sender:
    """The producing end of a channel: feeds every replica of one downstream stage.

    ``await send(kind, data)`` waits for credit, then sends to the live consumer with the most
    credit; it waits as long as it takes (put a timeout around it if the caller needs one).
    With ``peers=[]`` (an optional output nobody listens to) messages are checked and then
    dropped and counted.

    ``peers`` are the inbox addresses of the consumer replicas; ``schemas`` the kinds this port
    may send (each message is checked against its schema before it leaves); ``identity`` is
    this replica's name (``stage.replica``), which consumers report as ``msg.sender`` and count
    for end-of-stream. A PING goes to each consumer every ``heartbeat_s``; a consumer that has
    not answered for ``peer_timeout_s`` gets nothing until it does.

    Zero-copy: arrays are sent from their own memory, after ``send`` returns. Do not modify an
    array in place after sending it.
    """

    def __init__(
        self,
        name: str,
        peers: Sequence[str],
        schemas: Sequence[Schema],
        *,
        identity: str,
        ctx: zmq.asyncio.Context,
        log: Any = None,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 10.0,
    ) -> None:
        if not identity:
            raise ValueError(f"sender {name!r}: identity must be non-empty")
        if heartbeat_s <= 0 or peer_timeout_s <= heartbeat_s:
            raise ValueError(
                f"sender {name!r}: need 0 < heartbeat_s < peer_timeout_s, "
                f"got {heartbeat_s} and {peer_timeout_s}"
            )
        if len(set(peers)) != len(peers):
            raise ValueError(f"sender {name!r}: duplicate peer addresses in {list(peers)}")
        self.name = name
        self.identity = identity
        self.peers = [check_address(a) for a in peers]
        self._schemas = _schema_map(schemas, f"sender {name!r}")
        self._ctx = ctx
        self._log = log if log is not None else structlog.get_logger()
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._session = secrets.token_hex(6)
        self._routing_id = f"{identity}/{self._session}".encode()
        if len(self._routing_id) > 255:
            raise ValueError(f"sender {name!r}: identity {identity!r} is too long")

        self._peers: list[_Peer] = []
        self._tasks: list[asyncio.Task] = []
        self._heartbeat: asyncio.Task | None = None
        self._started = False
        self._closed = False
        self._credit_changed = asyncio.Event()
        self._eos_acked = asyncio.Event()
        self._rr = 0

        self._sent = 0
        self._bytes = 0
        self._dropped = 0
        self._waiting = 0
        self._credit_wait_s = 0.0
        self._blocked_since: float | None = None
        self._rejected: Counter[str] = Counter()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to every consumer and start announcing ourselves."""
        if self._started or self._closed:
            raise TransportError(f"sender {self.name!r} was already started")
        self._started = True
        for address in self.peers:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            sock.setsockopt(zmq.SNDHWM, _SENDER_HWM)
            sock.setsockopt(zmq.RCVHWM, _SENDER_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(address)
            self._peers.append(_Peer(address, sock))
        for peer in self._peers:
            self._tasks.append(asyncio.create_task(self._peer_loop(peer),
                                                   name=f"sender:{self.name}:{peer.address}"))
        if self._peers:
            self._heartbeat = asyncio.create_task(self._heartbeat_loop(),
                                                  name=f"sender-heartbeat:{self.name}")
            self._tasks.append(self._heartbeat)
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        self._log.debug("sender_started", port=self.name, peers=self.peers,
                        session=self._session)

    async def aclose(self, eos: bool = True, timeout_s: float = 2.0) -> None:
        """Send EOS to every consumer (best effort, waiting at most ``timeout_s`` for their
        acknowledgements) and release the sockets."""
        if self._closed:
            return
        self._closed = True
        self._credit_changed.set()  # wake send() waiters: they raise ChannelClosed
        try:
            if self._heartbeat is not None:
                self._heartbeat.cancel()  # no PING may follow our EOS
                await asyncio.gather(self._heartbeat, return_exceptions=True)
            if eos and self._peers and self._started:
                await self._send_eos(timeout_s)
        finally:
            for task in self._tasks:
                task.cancel()
            try:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                for peer in self._peers:
                    peer.sock.close(linger=0)
        self._log.debug("sender_closed", port=self.name, sent=self._sent, dropped=self._dropped)

    async def __aenter__(self) -> Sender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send_eos(self, timeout_s: float) -> None:
        # A consumer that said CLOSE is shutting down (or restarting): EOS is queued for it, but
        # not waited for. Any other may just be starting, so it gets up to timeout_s to answer.
        for peer in self._peers:
            peer.eos_acked = peer.closed
            try:
                await peer.sock.send_multipart([EOS, self._hello_map(peer)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._log.warning("eos_not_sent", port=self.name, peer=peer.address,
                                  error=repr(e))
        if all(p.eos_acked for p in self._peers):
            return
        try:
            await asyncio.wait_for(self._eos_acked.wait(), timeout_s)
        except asyncio.TimeoutError:
            missing = [p.address for p in self._peers if not p.eos_acked]
            self._log.warning("eos_unacknowledged", port=self.name, peers=missing,
                              timeout_s=timeout_s)

    # -- the application side --------------------------------------------------------------

    async def send(self, kind: str, data: Mapping[str, Any]) -> None:
        """Send one message; waits while no live consumer has credit for it.

        ValueError if ``kind`` is not one of this port's schemas or ``data`` does not match it
        (a producer bug fails here, not in the consumer); ChannelClosed after ``aclose()``.
        """
        schema = self._schemas.get(kind)
        if schema is None:
            raise ValueError(
                f"sender {self.name!r}: kind {kind!r} is not declared on this port; "
                f"declared: {sorted(self._schemas)}"
            )
        problems = schema.check(data)
        if problems:
            raise ValueError(f"sender {self.name!r}: {kind!r} message does not match its "
                             f"schema (version {schema.version}): " + "; ".join(problems))
        if self._closed:
            raise ChannelClosed(f"sender {self.name!r} is closed")
        if not self._started:
            raise TransportError(f"sender {self.name!r}: call start() first")
        if not self._peers:
            self._dropped += 1
            if self._dropped % 1000 == 1:
                self._log.info("message_dropped", port=self.name, reason="no_peers",
                               dropped=self._dropped)
            return
        frames = encode(Message(kind=kind, data=dict(data), version=schema.version))
        peer = self._pick()
        if peer is None:
            peer = await self._wait_for_credit()
        header = msgpack.packb({"to": peer.session, "epoch": peer.epoch})
        peer.sent += 1  # spend the credit before yielding: concurrent senders must not reuse it
        self._sent += 1
        self._bytes += sum(len(f) for f in frames)
        sending = await _settled(peer.sock.send_multipart([DATA, header, *frames], copy=False))
        if sending.cancelled() or (self._closed and sending.exception() is not None):
            raise ChannelClosed(f"sender {self.name!r} was closed while sending")
        sending.result()  # raises what the send raised

    async def _wait_for_credit(self) -> _Peer:
        self._waiting += 1
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        try:
            while True:
                self._credit_changed.clear()
                await self._credit_changed.wait()
                if self._closed:
                    raise ChannelClosed(f"sender {self.name!r} is closed")
                peer = self._pick()
                if peer is not None:
                    return peer
        finally:
            self._waiting -= 1
            if self._waiting == 0 and self._blocked_since is not None:
                self._credit_wait_s += time.monotonic() - self._blocked_since
                self._blocked_since = None

    def _pick(self) -> _Peer | None:
        now = time.monotonic()
        ready = [p for p in self._peers if p.credit > 0 and p.live(now, self._peer_timeout_s)]
        if not ready:
            return None
        most = max(p.credit for p in ready)
        ties = [p for p in ready if p.credit == most]
        self._rr += 1
        return ties[self._rr % len(ties)]

    def stats(self) -> dict[str, Any]:
        """Traffic, credit per consumer, and time spent waiting for credit (for metrics)."""
        now = time.monotonic()
        blocked_for = now - self._blocked_since if self._blocked_since is not None else 0.0
        return {
            "sent": self._sent,
            "bytes": self._bytes,
            "dropped": self._dropped,
            "credit_wait_s": self._credit_wait_s + blocked_for,
            "blocked": self._waiting > 0,
            "blocked_for_s": blocked_for,
            "credit": {p.address: p.credit for p in self._peers},
            "peers_live": sum(p.live(now, self._peer_timeout_s) for p in self._peers),
            "rejected": dict(self._rejected),
        }

    # -- internals ---------------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._closed:
            return
        # A loop died of a bug; say so loudly (send() keeps failing to find credit otherwise).
        self._log.error("sender_failed", port=self.name, task=task.get_name(),
                        error=repr(task.exception()))

    def _hello_map(self, peer: _Peer) -> bytes:
        return msgpack.packb({
            "identity": self.identity,
            "session": self._session,
            "to": peer.session,
            "epoch": peer.epoch,
            "sent": peer.sent,
        })

    async def _hello(self, peer: _Peer) -> None:
        try:
            # NOBLOCK: while a consumer is down, PINGs queue up to the high-water mark; beyond
            # that one more PING is useless, and it must never hold up the other peers.
            await peer.sock.send_multipart([HELLO, self._hello_map(peer)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    async def _heartbeat_loop(self) -> None:
        # A periodic timer: the first HELLO goes out at once, then one every heartbeat_s.
        while True:
            for peer in self._peers:
                await self._hello(peer)
            await asyncio.sleep(self._heartbeat_s)

    async def _peer_loop(self, peer: _Peer) -> None:
        while True:
            frames = await peer.sock.recv_multipart()
            await self._handle(peer, frames)

    def _reject(self, peer: _Peer, detail: str) -> None:
        self._rejected["bad_control"] += 1
        self._log.warning("message_rejected", port=self.name, reason="bad_control",
                          detail=detail, sender=peer.address)

    async def _handle(self, peer: _Peer, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._reject(peer, f"{len(frames)} frames, expected 2")
            return
        tag, body = frames
        header = _unpack_map(body)
        if header is None:
            self._reject(peer, f"tag {tag!r}: frame 1 is not a msgpack map")
            return
        if tag == CREDIT:
            self._on_credit(peer, header)
        elif tag == CLOSE:
            if header.get("session") == peer.session or peer.session is None:
                self._log.info("consumer_closed", port=self.name, peer=peer.address)
                peer.session, peer.granted, peer.sent, peer.closed = None, 0, 0, True
                await self._hello(peer)  # queued until a restarted consumer binds again
        else:
            self._reject(peer, f"unknown tag {tag!r}")

    def _on_credit(self, peer: _Peer, header: Mapping[str, Any]) -> None:
        session, epoch = header.get("session"), header.get("epoch")
        granted, consumed = header.get("granted"), header.get("consumed")
        if not (isinstance(session, str) and _is_int(epoch) and _is_int(granted)
                and _is_int(consumed)):
            self._reject(peer, f"CREDIT with bad fields {header!r}")
            return
        peer.last_heard = time.monotonic()
        peer.closed = False
        if header.get("eos") is True:
            peer.eos_acked = True
            if all(p.eos_acked for p in self._peers):
                self._eos_acked.set()
            return
        if (session, epoch) != (peer.session, peer.epoch):
            if peer.session is not None:
                self._log.info("credit_reset", port=self.name, peer=peer.address,
                               unused=peer.credit)
            # A new stream (consumer restarted, or it reclaimed our credit): start over.
            peer.session, peer.epoch, peer.sent, peer.granted = session, epoch, 0, granted
        else:
            peer.granted = max(peer.granted, granted)
        peer.consumed = consumed
        self._credit_changed.set()  # also when only liveness changed: a waiter may now proceed
