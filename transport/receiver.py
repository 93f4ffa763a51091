"""The consumer side of a channel: a bounded inbox that grants credit.

The protocol and why it is credit-based: ``transport.credit``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from transport import bulk, local
from transport.address import check_address
from transport.codec import decode, decode_batch
from transport.credit import (
    ACK,
    CLOSE,
    CLOSE_LINGER_MS,
    CREDIT,
    DATA,
    DRAIN_BATCH,
    EOS,
    HELLO,
    is_int,
    schema_map,
    sparse,
    unpack_map,
)
from transport.errors import ChannelClosed, DecodeError, EndOfStream, TransportError
from transport.evented import EventedSocket, plain_socket
from transport.message import Message, Schema, uids_of
from transport.monitor import PeerWatch
from transport.security import CurveKeys, require_curve_off_loopback

__all__ = ["Receiver"]

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
    granted: int = 0  # total credit units granted on this stream
    received: int = 0  # credit units of the DATA received (or written off) on this stream
    reply: bool = False  # owes the producer a CREDIT even if the grant is 0

    @property
    def outstanding(self) -> int:
        return self.granted - self.received  # >= 0: an overdraft is granted as it arrives


@dataclass(eq=False, slots=True)
class _Parked:
    """A DATA held in its producer's line: it waits for its sealed frames, or behind one that
    does (a producer's messages are taken in the order it sent them)."""

    rid: bytes
    sender: str
    seq: Any
    ack_id: tuple[bytes, int] | None
    credited: bool
    frames: list[Any]
    since: float
    weight: int  # what it weighs in the inbox once delivered (its header's)
    descriptor: Mapping[str, Any] | None = None  # set while its sealed frames are awaited
    failed: tuple[str, str] | None = None  # (reason, detail): to be refused in its turn


@dataclass(eq=False, slots=True)
class _Pieces:
    """Sealed pieces that came in on the bulk port before their DATA."""

    parts: list[Any]
    nbytes: int
    since: float


class Receiver:
    """The consuming end of a channel: a bounded inbox fed by any number of producers.

    ``await recv()`` returns the next message (``msg.sender`` is the producer's identity);
    ``async for msg in receiver`` stops at end-of-stream. End-of-stream comes when every
    identity in ``expected_producers`` has sent EOS and the inbox is drained; with
    ``expected_producers=None`` the stream never ends that way. An identity that sent EOS is
    finished for good on this receiver.

    ``name`` names the port in logs; ``address`` is bound (``ipc://``, ``tcp://`` on a named
    interface, ``inproc://``; ``tcp://HOST:0`` binds a free port, and ``address`` is the bound
    one once started: give that to producers); ``schemas`` are the kinds accepted (anything
    else is rejected and counted); ``capacity`` bounds the inbox in units of weight (messages,
    where each weighs 1: ``Schema.weight``);
    ``peer_timeout_s`` is how long a silent producer keeps its credit. ``log`` is a
    structlog-style logger.

    ``ack``: when a message counts as processed, so that its producer lets go of it (see
    ``transport.credit``, "Delivery"): ``"on_take"`` (default) when ``recv()`` returns it,
    ``"manual"`` when the application calls ``ack(msg)``. ``dedup_window``: how many delivered
    (producer session, seq) pairs are remembered to drop duplicates. ``max_message_bytes``
    (0: none): a peer that sends a larger frame is disconnected by ZeroMQ before the frame is
    allocated, counted in ``stats()["disconnects"]`` (a real producer never sends one:
    ``Sender`` refuses it).

    ``curve``: the run's :class:`~transport.security.CurveKeys`; the inbox then admits only
    producers holding the run's client key, and counts the peers it refused
    (``stats()["refused_peers"]``). An address reachable from other hosts needs ``curve`` or
    ``insecure=True`` (ValueError otherwise). A tcp inbox with CURVE also binds a bulk port
    (``bulk_port``, on the same host) where producers send frames of 1 MiB or more AES-GCM
    sealed (``transport.bulk``); a DATA waits up to ``bulk_timeout_s`` for its pieces, and
    pieces nobody claims are kept that long, within ``bulk_buffer_bytes``.

    What is rejected (not a message of ours, a kind or schema version this port does not take,
    a malformed header or frames) is counted by reason in ``stats()["rejected"]`` and logged at
    its 1st, 2nd, 4th, 8th ... occurrence per reason, so garbage cannot flood the log.

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
        ack: str = "on_take",
        dedup_window: int = 65536,
        max_message_bytes: int = 0,
        curve: CurveKeys | None = None,
        insecure: bool = False,
        bulk_timeout_s: float = 30.0,
        bulk_buffer_bytes: int = 512 * 2**20,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"receiver {name!r}: capacity must be >= 1, got {capacity}")
        if ack not in ("on_take", "manual"):
            raise ValueError(f"receiver {name!r}: ack must be 'on_take' or 'manual', got {ack!r}")
        if peer_timeout_s <= 0:
            raise ValueError(f"receiver {name!r}: peer_timeout_s must be > 0")
        self.name = name
        self.address = check_address(address, bind=True)
        require_curve_off_loopback(f"receiver {name!r}", self.address, curve, insecure)
        self._curve = curve
        self._peers_watch: PeerWatch | None = None
        self.capacity = capacity
        self._schemas = schema_map(schemas, f"receiver {name!r}")
        self._expected = None if expected_producers is None else frozenset(expected_producers)
        self._ctx = ctx
        self._log = log if log is not None else structlog.get_logger()
        self._peer_timeout_s = peer_timeout_s
        self._session = secrets.token_hex(6)

        self._sock: EventedSocket | None = None
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._closed = False
        self._inbox: deque[Message] = deque()
        self._depth = 0  # the inbox's weight
        self._reach = 1  # credit each producer is sure to be granted in time (transport.credit)
        self._readable = asyncio.Event()
        self._producers: dict[bytes, _Producer] = {}
        self._finished: set[str] = set()  # identities that sent EOS
        self._epoch = 0
        self._rr = 0
        self._grant_scheduled = False

        self._peak = 0
        self._received = 0
        self._bytes = 0
        self._uncredited = 0
        self._rejected: Counter[str] = Counter()
        self._blocked_s = 0.0
        self._blocked_since: float | None = None

        self._manual_ack = ack == "manual"
        self._dedup_window = dedup_window
        self._max_message_bytes = max_message_bytes
        self._seen: OrderedDict[tuple[bytes, int], None] = OrderedDict()  # delivered DATA
        self._acks: dict[bytes, list[int]] = {}  # producer rid -> seqs to acknowledge
        self._local: dict[bytes, local.LocalDealer] = {}  # producers in this process, by rid
        self._ack_scheduled = False
        self._acked = 0
        self._duplicates = 0
        # manual mode: handed out, not yet acknowledged: ack_id -> the message's uids
        self._taken_unacked: dict[tuple[bytes, int], str | None] = {}
        self._processed_callbacks: list[Callable[[Message], None]] = []

        self.bulk_port: int | None = None  # the sealed-bulk port (tcp with CURVE only)
        self._bulk_sock: zmq.asyncio.Socket | None = None
        self._bulk_timeout_s = bulk_timeout_s
        self._bulk_buffer_bytes = bulk_buffer_bytes
        self._parked: dict[bytes, _Parked] = {}  # token -> DATA waiting for its pieces
        self._lines: dict[bytes, deque[_Parked]] = {}  # producer rid -> its held DATA, in order
        self._pieces: OrderedDict[bytes, _Pieces] = OrderedDict()  # token -> unclaimed pieces
        self._pieces_bytes = 0
        self._bulk_opened = 0
        self._eos_after_bulk: dict[bytes, tuple[Mapping[str, Any], str]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the inbox address and start receiving."""
        if self._sock is not None or self._closed:
            raise TransportError(f"receiver {self.name!r} was already started")
        sock = plain_socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting producer takes over its id
        hwm = max(1000, 10 * self.capacity)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if self._max_message_bytes > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        if self._curve is not None:
            self._curve.serve(sock)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as e:
            sock.close()
            raise TransportError(f"receiver {self.name!r}: cannot bind {self.address}: {e}") from e
        if self.address.startswith("tcp://"):  # port 0 became a real one
            self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = EventedSocket(sock, name=f"receiver {self.name!r}")
        local.bind(self.address, self)  # producers of this process reach it without ZeroMQ
        self._peers_watch = PeerWatch(sock, f"receiver {self.name}", self._log)  # the plain one
        self._peers_watch.start()
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"receiver:{self.name}"),
            asyncio.create_task(self._reap_loop(), name=f"receiver-reaper:{self.name}"),
        ]
        if self._curve is not None and self.address.startswith("tcp://"):
            self._bind_bulk()
            self._tasks.append(
                asyncio.create_task(self._bulk_loop(), name=f"receiver-bulk:{self.name}")
            )
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        self._log.debug(
            "receiver_started",
            port=self.name,
            address=self.address,
            capacity=self.capacity,
            session=self._session,
        )

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
            if self._peers_watch is not None:
                await self._peers_watch.aclose()
        finally:
            self._release()
        self._log.debug("receiver_closed", port=self.name, **self._counts())

    def _release(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        local.unbind(self.address, self)
        try:
            close = msgpack.packb({"session": self._session})
            for rid in self._producers:
                dealer = self._local.get(rid)
                if dealer is not None:
                    dealer.push([CLOSE, {"session": self._session}])
                    continue
                sock.send_nowait([rid, CLOSE, close])
        except zmq.ZMQError as e:
            self._log.warning("close_notice_failed", port=self.name, error=repr(e))
        finally:
            sock.close(linger=CLOSE_LINGER_MS)  # gives CLOSE frames a moment to leave
            if self._bulk_sock is not None:
                self._bulk_sock.close(linger=0)
                self._bulk_sock = None

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
                return self._pop()
            if self._ended():
                raise EndOfStream(f"receiver {self.name!r}: every producer has finished")
            self._readable.clear()
            self._blocked_since = time.monotonic()
            try:
                await self._readable.wait()
            finally:
                self._blocked_s += time.monotonic() - self._blocked_since
                self._blocked_since = None

    def waiting(self) -> int:
        """How many messages ``take`` would return now, one by one, without waiting."""
        if self._closed or self._failure is not None or self._sock is None:
            return 0
        return len(self._inbox)

    def take(self) -> Message:
        """The next message, which ``waiting`` said is there: what ``recv`` would return, for
        a caller that must not yield to the loop (IndexError when there is none)."""
        if not self.waiting():
            raise IndexError(f"receiver {self.name!r}: no message waiting")
        return self._pop()

    def _pop(self) -> Message:
        msg = self._inbox.popleft()
        self._depth -= msg.weight
        self._schedule_grant()  # a slot is free again
        if self._manual_ack:
            if msg.ack_id is not None:
                self._taken_unacked[msg.ack_id] = uids_of(msg.data)
        else:
            self._queue_ack(msg)
        return msg

    def ack(self, msg: Message) -> None:
        """``ack="manual"``: ``msg`` (from ``recv()``) is processed; its producer may forget it.

        Acknowledging twice, or a message without delivery tracking, does nothing.
        """
        if not self._manual_ack:
            raise TransportError(f"receiver {self.name!r} acknowledges on take (ack='on_take')")
        if msg.ack_id is not None:
            self._taken_unacked.pop(msg.ack_id, None)
            self._queue_ack(msg)

    def on_processed(self, callback: Callable[[Message], None]) -> None:
        """Call ``callback(msg)`` for each message as it counts as processed, just before its
        acknowledgement is queued (so what it publishes goes out first)."""
        self._processed_callbacks.append(callback)

    def _queue_ack(self, msg: Message) -> None:
        if msg.ack_id is None:
            return
        for callback in self._processed_callbacks:
            callback(msg)
        rid, seq = msg.ack_id
        msg.ack_id = None  # once
        self._ack_seq(rid, seq)

    def _ack_seq(self, rid: bytes, seq: int) -> None:
        self._acks.setdefault(rid, []).append(seq)
        self._schedule_acks()

    def _schedule_acks(self) -> None:
        # Coalesce, as grants are: one ACK per producer per event-loop turn.
        if not self._ack_scheduled and not self._closed:
            self._ack_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_acks)

    def _send_acks(self) -> None:
        self._ack_scheduled = False
        if self._closed or self._sock is None:
            return
        acks, self._acks = self._acks, {}
        for rid, seqs in acks.items():
            self._acked += len(seqs)
            self._reply(rid, ACK, {"session": self._session, "acked": seqs})

    def _reply(self, rid: bytes, tag: bytes, body: dict[str, Any]) -> None:
        """A control message to one producer: in-process, or on the socket."""
        dealer = self._local.get(rid)
        if dealer is not None:
            dealer.push([tag, body])
            return
        assert self._sock is not None
        # ROUTER sends never block (without ROUTER_MANDATORY it drops for unknown peers)
        try:
            self._sock.send_nowait([rid, tag, msgpack.packb(body)])
        except zmq.ZMQError as e:
            self._log.warning("control_send_failed", port=self.name, error=repr(e))

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
            "depth": self._depth,  # in units of weight, as capacity
            "messages": len(self._inbox),
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
            "acked": self._acked,
            "duplicates": self._duplicates,
            "unacked": len(self._taken_unacked),
            "refused_peers": 0 if self._peers_watch is None else self._peers_watch.refused,
            "bulk_opened": self._bulk_opened,
            "bulk_waiting": len(self._parked),
            "disconnects": 0 if self._peers_watch is None else self._peers_watch.disconnects,
        }

    def held_uids(self) -> list[str]:
        """The ``uid`` of each message in the inbox or taken and not yet acknowledged (of
        those that carry one): what this consumer holds and its producers would send again."""
        held = [u for uids in self._taken_unacked.values() for u in uids]
        held.extend(u for m in self._inbox for u in uids_of(m.data))
        return held

    # -- internals ---------------------------------------------------------------------------

    def _ended(self) -> bool:
        # (a DATA waiting for its sealed pieces came before the EOS that follows it)
        return self._expected is not None and self._expected <= self._finished and not self._lines

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
        # What is already queued is read at once, with no wait per message; only this task
        # receives from the socket.
        while True:
            self._handle(await sock.recv_multipart(copy=False))
            for _ in range(DRAIN_BATCH):
                if not sock.ready_to_read():
                    break
                self._handle(sock.recv_nowait(copy=False))
            else:
                await asyncio.sleep(0)  # a full batch: let the application run before the next

    async def _reap_loop(self) -> None:
        # A periodic timer, not synchronization: producers that stopped talking lose their credit.
        while True:
            await asyncio.sleep(min(self._peer_timeout_s, self._bulk_timeout_s) / 4)
            self._expire_bulk()
            deadline = time.monotonic() - self._peer_timeout_s
            for p in [p for p in self._producers.values() if p.last_seen < deadline]:
                del self._producers[p.rid]
                self._log.warning(
                    "producer_lost",
                    port=self.name,
                    sender=p.identity,
                    session=p.session,
                    reclaimed=p.outstanding,
                )
                self._schedule_grant()

    def _reject(self, reason: str, detail: str, sender: str) -> None:
        self._rejected[reason] += 1
        count = self._rejected[reason]
        if sparse(count):
            self._log.warning(
                "message_rejected",
                port=self.name,
                reason=reason,
                detail=detail[:300],
                sender=sender[:100],
                count=count,
            )

    def local_in(self, dealer: local.LocalDealer, frames: list[Any]) -> None:
        """Frames from a producer of this process (``transport.local``): ``[tag, header,
        *payload]``, the header a map (or packed), a DATA's payload the Message itself."""
        if self._closed or self._sock is None:
            return  # as a ROUTER that is gone: the producer's PINGs find the next one
        self._local[dealer.rid] = dealer  # as a ROUTER learns (and hands over) a routing id
        header = frames[1]
        as_map = header if isinstance(header, dict) else None
        self._dispatch(dealer.rid, frames[0], as_map, header, frames[2:])

    def _handle(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        if len(frames) < 3 or len(frames[1]) != 1:
            sender = self._sender_of(rid)
            self._reject("bad_control", f"{len(frames) - 1} frames without a valid tag", sender)
            return
        self._dispatch(rid, frames[1].bytes, None, frames[2].buffer, frames[3:])

    def _sender_of(self, rid: bytes) -> str:
        producer = self._producers.get(rid)
        if producer is not None:
            return producer.identity
        # not (or no longer) admitted: the routing id is IDENTITY/SESSION
        return rid.decode("utf-8", "replace").rpartition("/")[0]

    def _dispatch(
        self, rid: bytes, tag: bytes, header: dict | None, packed: Any, payload: list[Any]
    ) -> None:
        """One protocol message from producer ``rid``: its header as a map, or ``packed``."""
        producer = self._producers.get(rid)
        sender = self._sender_of(rid)
        if header is None:
            header = unpack_map(packed)
            if header is None:
                self._reject("bad_control", f"tag {tag!r}: frame 1 is not a msgpack map", sender)
                return
        if producer is not None:
            producer.last_seen = time.monotonic()
        if tag == DATA:
            self._on_data(rid, producer, sender, header, payload)
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

    def _on_data(
        self,
        rid: bytes,
        producer: _Producer | None,
        sender: str,
        header: Mapping[str, Any],
        frames: list[zmq.Frame],
    ) -> None:
        seq = header.get("seq")
        many = header.get("seqs")  # a batch (codec.encode_batch): a seq per message
        if many is not None and not _batch_seqs(many):
            self._reject("bad_control", f"DATA with bad seqs {str(many)[:100]}", sender)
            return
        weights = _weights(header, many)
        if weights is None:
            self._reject("bad_control", f"DATA with bad weights {str(header)[:100]}", sender)
            return
        count = sum(weights)
        credited = self._credited(producer, header) and (
            producer.outstanding >= count or producer.outstanding >= self._reach
        )  # a message heavier than a producer's reach goes once it holds that much
        if credited:
            producer.received += count
            producer.granted = max(producer.granted, producer.received)  # the overdraft
        if many is not None:
            self._on_batch(rid, sender, header, many, credited, frames, count)
            return
        ack_id = None
        if is_int(seq):
            ack_id = (rid, seq)
            if ack_id in self._seen:  # sent again, but we took it already: once is enough
                self._duplicate(rid, seq, sender)
                self._schedule_grant()
                return
        self._deliver_or_park(rid, sender, seq, ack_id, credited, frames, header, [ack_id], count)

    def _deliver_or_park(
        self,
        rid: bytes,
        sender: str,
        seq: Any,
        ack_id: tuple[bytes, int] | None,
        credited: bool,
        frames: list[Any],
        header: Mapping[str, Any],
        ack_ids: list[tuple[bytes, int] | None],
        weight: int,
    ) -> None:
        """A DATA (one message or a batch) delivered now, or parked in its producer's line
        (behind sealed frames, or waiting for its own); ``ack_ids``: what it carries, remembered
        while it waits (a copy sent again meanwhile is a duplicate)."""
        descriptor = header.get("bulk")
        if descriptor is None and rid not in self._lines:
            self._deliver(rid, sender, seq, ack_id, credited, frames)
            return
        for one in ack_ids:
            self._remember(one)
        held = _Parked(rid, sender, seq, ack_id, credited, frames, time.monotonic(), weight)
        self._park(held, descriptor)

    def _park(self, held: _Parked, descriptor: Any) -> None:
        """Into its producer's line: behind one waiting for its sealed frames, or waiting for
        its own (``descriptor``)."""
        rid = held.rid
        self._lines.setdefault(rid, deque()).append(held)
        if descriptor is not None:
            try:
                token = bulk.descriptor_token(descriptor)
            except DecodeError as e:
                held.failed = (e.reason, e.detail)
            else:
                held.descriptor = descriptor
                pieces = self._pieces.pop(token, None)
                if pieces is None:
                    self._parked[token] = held  # its pieces are still on their way
                    return
                self._pieces_bytes -= pieces.nbytes
                self._open(held, pieces.parts)
        self._flush(rid)

    def _on_batch(
        self,
        rid: bytes,
        sender: str,
        header: Mapping[str, Any],
        seqs: list[int],
        credited: bool,
        frames: list[Any],
        weight: int,
    ) -> None:
        """A DATA of several messages: those taken before (sent again) are acknowledged and
        skipped (None in their place), the rest delivered in order, as single ones are."""
        fresh: list[int | None] = [None if (rid, s) in self._seen else s for s in seqs]
        for s in seqs:
            if (rid, s) in self._seen:
                self._duplicate(rid, s, sender)
        if all(s is None for s in fresh):
            self._schedule_grant()
            return
        taken = [None if s is None else (rid, s) for s in fresh]
        self._deliver_or_park(rid, sender, fresh, None, credited, frames, header, taken, weight)

    def _duplicate(self, rid: bytes, seq: int, sender: str) -> None:
        """A DATA taken before, sent again: counted, and acknowledged again (our ack may have
        been lost)."""
        self._duplicates += 1
        if sparse(self._duplicates):
            self._log.info(
                "duplicate_dropped", port=self.name, sender=sender, count=self._duplicates
            )
        self._ack_seq(rid, seq)

    def _refuse(self, reason: str, detail: str, sender: str, rid: bytes, seq: Any) -> None:
        """A DATA that can never be processed: counted (each message of a batch), its slots
        granted again, acknowledged (so it is not sent again)."""
        batch = isinstance(seq, list)
        for one in seq if batch else [seq]:
            if batch and one is None:
                continue  # a batch's message taken before
            self._reject(reason, detail, sender)
            if is_int(one):
                self._ack_seq(rid, one)
        self._schedule_grant()

    def _remember(self, ack_id: tuple[bytes, int] | None) -> None:
        if ack_id is None or ack_id in self._seen:
            return
        self._seen[ack_id] = None
        if len(self._seen) > self._dedup_window:
            self._seen.popitem(last=False)

    def _deliver(
        self,
        rid: bytes,
        sender: str,
        seq: Any,
        ack_id: tuple[bytes, int] | None,
        credited: bool,
        frames: list[Any],
    ) -> None:
        if isinstance(seq, list):
            self._deliver_batch(rid, sender, seq, credited, frames)
            return
        try:
            if frames and isinstance(frames[0], Message):  # in-process: [msg, schema or None]
                msg = self._check_local(frames[0], frames[1])
                frames = []
            else:
                msg = decode(frames, self._schemas)
            self._weigh(msg)
        except DecodeError as e:
            self._refuse(e.reason, e.detail, sender, rid, seq)
            return
        self._take_in(msg, ack_id, sender, credited)
        self._bytes += sum(memoryview(f).nbytes for f in frames)

    def _deliver_batch(
        self, rid: bytes, sender: str, seqs: list[int | None], credited: bool, frames: list[Any]
    ) -> None:
        """A batch's messages into the inbox, one by one (None: a message taken before)."""
        try:
            if frames and isinstance(frames[0], list):  # in-process: [messages, schema]
                items = [self._check_one(msg, frames[1]) for msg in frames[0]]
                frames = []
            else:
                items = decode_batch(frames, self._schemas)
            if len(items) != len(seqs):
                raise DecodeError("bad_header", f"{len(items)} messages for {len(seqs)} seqs")
        except DecodeError as e:
            self._refuse(e.reason, e.detail, sender, rid, seqs)
            return
        for seq, item in zip(seqs, items, strict=True):
            if seq is None:
                continue
            if not isinstance(item, DecodeError):
                try:
                    self._weigh(item)
                except DecodeError as e:
                    item = e
            if isinstance(item, DecodeError):
                self._refuse(item.reason, item.detail, sender, rid, seq)
            else:
                self._take_in(item, (rid, seq), sender, credited)
        self._bytes += sum(memoryview(f).nbytes for f in frames)

    def _take_in(
        self, msg: Message, ack_id: tuple[bytes, int] | None, sender: str, credited: bool
    ) -> None:
        if not credited:
            self._uncredited += 1
        self._remember(ack_id)
        msg.ack_id = ack_id
        msg.sender = sender
        self._inbox.append(msg)
        self._depth += msg.weight
        self._received += 1
        self._peak = max(self._peak, self._depth)
        self._readable.set()
        self._schedule_grant()  # this producer may now be out of credit

    def _weigh(self, msg: Message) -> None:
        """Set ``msg.weight`` from its schema (what the inbox counts it as, whatever its
        producer's header said); DecodeError when the schema cannot weigh its data."""
        schema = self._schemas.get(msg.kind)
        if schema is None or schema.weight is None:
            msg.weight = 1
            return
        try:
            msg.weight = schema.weigh(msg.data)
        except Exception as e:  # a weight function that fails on this data: the message's fault
            raise DecodeError("invalid_fields", f"kind {msg.kind!r}: cannot weigh it: {e}") from e

    def _check_one(self, sent: Message, checked: Schema | None) -> Message | DecodeError:
        try:
            return self._check_local(sent, checked)
        except DecodeError as e:
            return e

    def _check_local(self, sent: Message, checked: Schema | None = None) -> Message:
        """What ``decode`` checks of a message, for one handed over in-process; the
        consumer's own copy of it (``transport.local.delivered``). ``checked``: the schema its
        producer checked it against as it sent it; if that is this port's, it is not checked
        again."""
        kind, schema = sent.kind, self._schemas.get(sent.kind)
        if checked is not None and checked is schema:
            return local.delivered(sent)
        if schema is None:
            known = sorted(self._schemas)
            raise DecodeError("unknown_kind", f"kind {kind!r} is not one of {known}")
        if sent.version != schema.version:
            raise DecodeError(
                "bad_version", f"kind {kind!r}: version {sent.version}, expected {schema.version}"
            )
        problems = schema.check(sent.data)
        if problems:
            raise DecodeError("invalid_fields", f"kind {sent.kind!r}: " + "; ".join(problems))
        return local.delivered(sent)

    # -- sealed bulk frames (transport.bulk) ------------------------------------------------

    def _bind_bulk(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, max(1000, 10 * self.capacity))
        sock.setsockopt(zmq.MAXMSGSIZE, bulk.MAX_PIECE_BYTES)  # no piece is larger
        host = self.address.rpartition(":")[0]
        try:
            sock.bind(f"{host}:0")
        except zmq.ZMQError as e:
            sock.close()
            raise TransportError(f"receiver {self.name!r}: cannot bind a bulk port: {e}") from e
        self._bulk_sock = sock
        self.bulk_port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2])

    async def _bulk_loop(self) -> None:
        assert self._bulk_sock is not None
        sock = self._bulk_sock
        while True:
            parts = await sock.recv_multipart(copy=False)
            token = parts[0].bytes if len(parts[0]) == bulk.TOKEN_BYTES else None
            if token is None or len(parts) < 2:
                self._reject("bulk_forged", "a bulk message without a token and pieces", "?")
                continue
            held = self._parked.pop(token, None)
            if held is not None:
                self._open(held, parts[1:])
                self._flush(held.rid)
                continue
            nbytes = sum(len(p) for p in parts)
            old = self._pieces.pop(token, None)  # the same token twice: the later one stands
            if old is not None:
                self._pieces_bytes -= old.nbytes
            self._pieces[token] = _Pieces(parts[1:], nbytes, time.monotonic())
            self._pieces_bytes += nbytes
            while self._pieces_bytes > self._bulk_buffer_bytes and len(self._pieces) > 1:
                _, dropped = self._pieces.popitem(last=False)
                self._pieces_bytes -= dropped.nbytes
                self._reject("bulk_unclaimed", "dropped to stay within bulk_buffer_bytes", "?")

    def _open(self, held: _Parked, parts: list[Any]) -> None:
        assert held.descriptor is not None
        try:
            held.frames = bulk.open_sealed(held.descriptor, held.frames, parts)
        except DecodeError as e:
            held.failed = (e.reason, e.detail)
        else:
            self._bulk_opened += 1
        held.descriptor = None

    def _flush(self, rid: bytes) -> None:
        """Take a producer's held DATA in order, up to the first still waiting for pieces."""
        line = self._lines.get(rid)
        while line and line[0].descriptor is None:
            h = line.popleft()
            if h.failed is not None:
                self._refuse(*h.failed, h.sender, h.rid, h.seq)
            else:
                self._deliver(h.rid, h.sender, h.seq, h.ack_id, h.credited, h.frames)
        if line:
            return
        self._lines.pop(rid, None)
        if rid in self._eos_after_bulk:  # an EOS held back for this line goes on
            header, sender = self._eos_after_bulk.pop(rid)
            self._on_eos(rid, self._producers.get(rid), header, sender)
        if self._ended():
            self._readable.set()

    def _expire_bulk(self) -> None:
        deadline = time.monotonic() - self._bulk_timeout_s
        for token in [t for t, h in self._parked.items() if h.since < deadline]:
            held = self._parked.pop(token)
            detail = f"its sealed frames did not come within {self._bulk_timeout_s} s"
            held.failed, held.descriptor = ("bulk_missing", detail), None
            self._flush(held.rid)
        while self._pieces and next(iter(self._pieces.values())).since < deadline:
            _, dropped = self._pieces.popitem(last=False)
            self._pieces_bytes -= dropped.nbytes
            self._reject("bulk_unclaimed", "sealed pieces no DATA claimed", "?")

    def _on_hello(
        self, rid: bytes, producer: _Producer | None, header: Mapping[str, Any], sender: str
    ) -> None:
        identity, session = header.get("identity"), header.get("session")
        if not isinstance(identity, str) or not isinstance(session, str):
            self._reject("bad_control", "HELLO without identity/session strings", sender)
            return
        if producer is None:
            if identity in self._finished:
                return  # it said EOS; a late PING must not re-admit it
            for old in [p for p in self._producers.values() if p.identity == identity]:
                del self._producers[old.rid]  # that identity restarted: the old session is gone
                self._log.info(
                    "producer_replaced",
                    port=self.name,
                    sender=identity,
                    session=old.session,
                    reclaimed=old.outstanding,
                )
            self._epoch += 1
            producer = _Producer(rid, identity, session, self._epoch, time.monotonic())
            self._producers[rid] = producer
            self._log.debug("producer_joined", port=self.name, sender=identity, session=session)
        sent = header.get("sent")
        if self._credited(producer, header) and is_int(sent) and sent > producer.received:
            # ZeroMQ keeps order on a connection, so DATA sent before this PING has arrived:
            # what is missing was lost, and its credit must not stay outstanding forever.
            # (an overdraft may be among what was lost: counted as granted, as on arrival)
            lost = sent - producer.received
            self._log.warning("data_lost", port=self.name, sender=identity, count=lost)
            producer.received = sent
            producer.granted = max(producer.granted, sent)
        producer.reply = True
        self._schedule_grant()

    def _on_eos(
        self, rid: bytes, producer: _Producer | None, header: Mapping[str, Any], sender: str
    ) -> None:
        identity = header.get("identity")
        if not isinstance(identity, str):
            self._reject("bad_control", "EOS without an identity string", sender)
            return
        if header.get("to") != self._session and identity not in self._finished:
            # Addressed to an earlier instance of this consumer (we restarted), or sent before
            # the producer heard from us: it may still hold messages for us that it has to send
            # again. Take it as a hello; the producer answers our credit with them, then EOS.
            self._on_hello(rid, producer, header, sender)
            return
        if rid in self._lines:
            # Its last DATA still waits for sealed pieces: confirming the end now would let
            # the producer close (and drop those pieces); confirm once they are in.
            self._eos_after_bulk[rid] = (header, sender)
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
        held = sum(h.weight for line in self._lines.values() for h in line)
        free = self.capacity - self._depth - held - self._outstanding()
        # Count expected producers that have not said hello yet too: the first to arrive
        # must not take the whole inbox (credit is never revoked, only spent or reclaimed).
        waiting_for = len(self._expected - self._finished) if self._expected else 0
        share = max(1, self.capacity // max(len(producers), waiting_for, 1))
        top_up = max(1, share // 4)
        # a producer is topped up once a quarter share is missing: it always gets this much
        self._reach = share - top_up + 1
        if free > 0 and producers:
            if free < top_up and self._depth >= top_up:
                # the inbox still holds work: slots go a quarter share at a time, not one by
                # one as the stage takes messages (a CREDIT each, and the producer's next batch
                # one message)
                free = 0
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
            "reach": self._reach,
        }
        if self.bulk_port is not None:
            credit["bulk_port"] = self.bulk_port
        self._reply(rid, CREDIT, credit)


def _batch_seqs(seqs: Any) -> bool:
    """Whether a batch's ``seqs`` are what a sender makes: distinct ints, at least two."""
    return (
        isinstance(seqs, list)
        and len(seqs) >= 2
        and all(is_int(s) for s in seqs)
        and len(set(seqs)) == len(seqs)
    )


def _weights(header: Mapping[str, Any], seqs: list[int] | None) -> list[int] | None:
    """A DATA's messages' weights (``w``, or a batch's ``ws``; 1 each where absent), or None
    when they are not ints >= 1, one per message."""
    if seqs is None:
        w = header.get("w", 1)
        return [w] if is_int(w) and w >= 1 else None
    ws = header.get("ws")
    if ws is None:
        return [1] * len(seqs)
    ok = isinstance(ws, list) and len(ws) == len(seqs) and all(is_int(w) and w >= 1 for w in ws)
    return ws if ok else None
