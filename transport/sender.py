"""The producer side of a channel: sends only with credit, to the consumer with the most of it.

The protocol and why it is credit-based: ``transport.credit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from transport import bulk
from transport.address import check_address
from transport.codec import encode, encode_batch
from transport.credit import (
    ACK,
    CLOSE,
    CREDIT,
    DATA,
    DRAIN_BATCH,
    EOS,
    HELLO,
    SENDER_HWM,
    is_int,
    schema_map,
    settled,
    sparse,
    unpack_map,
)
from transport.errors import ChannelClosed, TransportError
from transport.evented import EventedSocket, plain_socket
from transport.local import LocalDealer
from transport.message import Message, Schema, uids_of
from transport.security import CurveKeys

__all__ = ["Sender"]

# ---------------------------------------------------------------------------------------------
# producer side


@dataclass(eq=False)
class _Peer:
    """The producer's view of one consumer replica (one DEALER)."""

    address: str | None  # None: not known yet (Sender.connect_peer)
    sock: EventedSocket | LocalDealer  # a LocalDealer: the consumer is in this process
    session: str | None = None  # consumer session of the current credit stream
    epoch: int = 0
    granted: int = 0  # credit units granted on the current stream
    sent: int = 0  # credit units spent on the current stream (each DATA its messages' weight)
    reach: int | None = None  # credit it is sure to grant in time (None: an older receiver)
    last_heard: float = -1e18
    eos_acked: bool = False
    closed: bool = False  # it said CLOSE (going away) and has not granted credit since
    consumed: int = 0  # DATA the consumer has received on this stream (its last report)
    last_session: str | None = None  # the consumer session last heard (kept through CLOSE)
    bulk: zmq.asyncio.Socket | None = None  # its sealed-bulk port (CURVE only: transport.bulk)
    bulk_address: str | None = None

    @property
    def credit(self) -> int:
        return self.granted - self.sent if self.session is not None else 0

    def covers(self, weight: int) -> bool:
        """Whether its credit lets a message of ``weight`` go: enough for all of it, or, for one
        heavier than this consumer will ever grant at once, all that it will."""
        credit = self.credit
        return credit >= weight or (self.reach is not None and credit >= max(1, self.reach))

    def live(self, now: float, timeout: float) -> bool:
        return self.session is not None and now - self.last_heard <= timeout


@dataclass(eq=False, slots=True)
class _Held:
    """A message sent and not yet acknowledged: kept to be sent again if its consumer dies."""

    msg: Message
    frames: list[Any] | None  # encoded once a consumer in another process needs them
    nbytes: int  # of the frames (0 while only in-process consumers had it)
    peer: _Peer | None  # where it went last (None: waiting to be sent again)
    session: str | None  # that consumer's session then
    uids: tuple[str, ...] = ()  # what the run's ledger follows (``uids_of``)


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
    array in place after sending it: it is also what is sent again if its consumer restarts
    before acknowledging it (``transport.credit``, "Delivery"). ``max_unacked`` and
    ``max_unacked_bytes`` bound what is kept for that.

    ``curve``: the run's :class:`~transport.security.CurveKeys`, for consumers that serve CURVE.
    Frames of 1 MiB or more then go AES-GCM sealed on the consumer's bulk port, beside the
    CURVE socket (``transport.bulk``: CurveZMQ alone runs at about a third of plain for them).
    ``max_message_bytes`` (0: none): the consumers' bound on one frame. A message with a larger
    frame is refused here (ValueError, counted as ``oversized``): sent, the consumer's ZeroMQ
    would cut the connection, and the message, sent again on reconnect, would be cut again.
    """

    def __init__(
        self,
        name: str,
        peers: Sequence[str | None],
        schemas: Sequence[Schema],
        *,
        identity: str,
        ctx: zmq.asyncio.Context,
        log: Any = None,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 10.0,
        max_unacked: int = 100_000,
        max_unacked_bytes: int = 2 * 2**30,
        curve: CurveKeys | None = None,
        max_message_bytes: int = 0,
        local: Sequence[bool] = (),
    ) -> None:
        if not identity:
            raise ValueError(f"sender {name!r}: identity must be non-empty")
        if heartbeat_s <= 0 or peer_timeout_s <= heartbeat_s:
            raise ValueError(
                f"sender {name!r}: need 0 < heartbeat_s < peer_timeout_s, "
                f"got {heartbeat_s} and {peer_timeout_s}"
            )
        known = [a for a in peers if a is not None]
        if len(set(known)) != len(known):
            raise ValueError(f"sender {name!r}: duplicate peer addresses in {list(peers)}")
        self.name = name
        self.identity = identity
        # None: that consumer's address is not known yet (``connect_peer`` gives it later)
        self.peers: list[str | None] = [None if a is None else check_address(a) for a in peers]
        # which consumers are in this process (transport.local): reached without ZeroMQ
        if len(local) > len(self.peers):
            raise ValueError(f"sender {name!r}: {len(local)} local flags for {len(peers)} peers")
        self._local = [bool(x) for x in local] + [False] * (len(self.peers) - len(local))
        if any(is_local and a is None for is_local, a in zip(self._local, self.peers, strict=True)):
            raise ValueError(f"sender {name!r}: an in-process peer needs its address")
        self._remote = not all(self._local) if self.peers else False
        self._schemas = schema_map(schemas, f"sender {name!r}")
        self._ctx = ctx
        self._curve = curve
        self._max_message_bytes = max_message_bytes
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
        self._oversized = 0
        self._waiting = 0
        self._credit_wait_s = 0.0
        self._blocked_since: float | None = None
        self._rejected: Counter[str] = Counter()

        self._max_unacked, self._max_unacked_bytes = max_unacked, max_unacked_bytes
        self._seq = 0
        self._unacked: OrderedDict[int, _Held] = OrderedDict()  # oldest first
        self._unacked_bytes = 0
        self._resend: deque[int] = deque()  # seqs to send again, in order
        self._resend_ready = asyncio.Event()
        self._acks_arrived = asyncio.Event()
        self._finishing = False  # finish() sent EOS: redeliveries are followed by EOS again
        self._ack_callbacks: list[Callable[[int], None]] = []
        self._credit_callbacks: list[Callable[[], None]] = []
        self._acked = 0
        self._redelivered = 0
        self._unacked_dropped = 0
        self._sealed = 0
        self._batches = 0
        self._replies: Counter[bytes] = Counter()
        self._sealed_bytes = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to every consumer and start announcing ourselves."""
        if self._started or self._closed:
            raise TransportError(f"sender {self.name!r} was already started")
        self._started = True
        for address, is_local in zip(self.peers, self._local, strict=True):
            if is_local:
                assert address is not None
                self._peers.append(_Peer(address, LocalDealer(self._routing_id, address)))
                continue
            sock = plain_socket(self._ctx, zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            sock.setsockopt(zmq.SNDHWM, SENDER_HWM)
            sock.setsockopt(zmq.RCVHWM, SENDER_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            if self._curve is not None:
                self._curve.connect(sock)
            if address is not None:
                sock.connect(address)
            self._peers.append(_Peer(address, EventedSocket(sock, name=f"sender {self.name!r}")))
        for peer in self._peers:
            self._tasks.append(
                asyncio.create_task(
                    self._peer_loop(peer), name=f"sender:{self.name}:{peer.address}"
                )
            )
        if self._peers:
            self._heartbeat = asyncio.create_task(
                self._heartbeat_loop(), name=f"sender-heartbeat:{self.name}"
            )
            self._tasks.append(self._heartbeat)
            self._tasks.append(
                asyncio.create_task(self._redeliver_loop(), name=f"sender-redeliver:{self.name}")
            )
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        self._log.debug("sender_started", port=self.name, peers=self.peers, session=self._session)

    def connect_peer(self, index: int, address: str) -> bool:
        """Point peer ``index`` (a consumer replica, in ``peers`` order) at ``address``: the
        consumer bound it, or moved there after a restart elsewhere. Returns whether it changed.

        What was sent to the consumer's old address and not acknowledged is sent again once
        the consumer at the new one grants credit (a new session, as after any restart).
        """
        if not 0 <= index < len(self.peers):
            raise ValueError(f"sender {self.name!r}: no peer {index} (it has {len(self.peers)})")
        address = check_address(address)
        if self.peers[index] == address:
            return False
        self.peers[index] = address
        if not self._started or self._closed:
            return True
        peer = self._peers[index]
        if isinstance(peer.sock, LocalDealer):
            raise ValueError(f"sender {self.name!r}: peer {index} is in this process: it stays")
        if peer.address is not None:
            with contextlib.suppress(zmq.ZMQError):  # never connected: nothing to undo
                peer.sock.disconnect(peer.address)
        peer.address = address
        peer.sock.connect(address)
        self._log.info("sender_peer_moved", port=self.name, peer=index, address=address)
        return True

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
                self._finishing = True
                await self._send_eos(timeout_s)
        finally:
            for task in self._tasks:
                task.cancel()
            try:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                for peer in self._peers:
                    peer.sock.close(linger=0)
                    if peer.bulk is not None:
                        peer.bulk.close(linger=0)
        if self._unacked:
            self._log.info(
                "sender_closed_unacked",
                port=self.name,
                unacked=len(self._unacked),
                detail="sent, not acknowledged as processed when this sender closed",
            )
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
            await self._eos_to(peer)
        if all(p.eos_acked for p in self._peers):
            return
        try:
            await asyncio.wait_for(self._eos_acked.wait(), timeout_s)
        except asyncio.TimeoutError:
            missing = [p.address for p in self._peers if not p.eos_acked]
            self._log.warning(
                "eos_unacknowledged", port=self.name, peers=missing, timeout_s=timeout_s
            )

    # -- the application side --------------------------------------------------------------

    async def send(self, kind: str, data: Mapping[str, Any]) -> int | None:
        """Send one message; waits while no live consumer has credit for it.

        Returns its sequence number (what ``on_ack`` callbacks get once the consumer has
        processed it), or None when it was dropped (no consumers).

        ValueError if ``kind`` is not one of this port's schemas or ``data`` does not match it
        (a producer bug fails here, not in the consumer); ChannelClosed after ``aclose()``.
        """
        schema = self._checked(kind, [data])
        if not self._peers:
            self._drop(1)
            return None
        return await self._send_checked(schema, data)

    async def _send_checked(self, schema: Schema, data: Mapping[str, Any]) -> int:
        """``send`` of a message already checked against ``schema``."""
        msg = Message(
            kind=schema.kind, data=dict(data), version=schema.version, weight=schema.weigh(data)
        )
        held = _Held(msg, None, 0, None, None, uids_of(data))
        if self._remote:  # encode now: a message that cannot travel fails in its producer
            self._frames(held)
        peer = self._pick(msg.weight)
        if peer is None:
            peer = await self._wait_for_credit(msg.weight)
        self._seq += 1
        held.peer, held.session = peer, peer.session
        self._hold(self._seq, held)
        self._sent += 1
        seq = self._seq
        await self._send_data(peer, seq, held, schema)
        return seq

    async def send_many(self, kind: str, items: Sequence[Mapping[str, Any]]) -> list[int | None]:
        """Send several messages of one kind, as ``send`` does each, in order; those that go to
        the same consumer in another process together travel as one batch (``encode_batch``:
        one header, one pack, one send), and those for a consumer in this process as one
        hand-over; the consumer takes them one by one. Each message keeps its own credit,
        sequence number, acknowledgement and redelivery. Returns their sequence numbers."""
        schema = self._checked(kind, items)
        if not self._peers:
            self._drop(len(items))
            return [None] * len(items)
        seqs: list[int | None] = []
        left = list(items)
        weights = [schema.weigh(data) for data in left]
        while left:
            peer = self._pick(weights[0]) or await self._wait_for_credit(weights[0])
            n, spent = 1, weights[0]  # the first goes (covered), then those the rest pays for
            while n < len(left) and spent + weights[n] <= peer.credit:
                spent += weights[n]
                n += 1
            take, left, weights = left[:n], left[n:], weights[n:]
            if isinstance(peer.sock, LocalDealer) and len(take) > 1:
                seqs.extend(self._hand_over(peer, schema, take))
            elif len(take) == 1:
                seqs.append(await self._send_checked(schema, take[0]))
            else:
                seqs.extend(await self._send_batch(peer, schema, take))
        return seqs

    async def _send_batch(
        self, peer: _Peer, schema: Schema, items: list[Mapping[str, Any]]
    ) -> list[int]:
        """``items`` to ``peer`` (which has credit for all) in one DATA; each held on its own,
        encoded again alone if it has to be sent again."""
        frames = encode_batch(schema.kind, schema.version, items)
        if self._max_message_bytes > 0:
            self._check_size(schema.kind, frames)
        nbytes = sum(len(f) for f in frames)
        self._bytes += nbytes
        seqs, msgs = self._hold_batch(peer, schema, items, nbytes // len(items))
        await self._send_frames(peer, _batch_header(peer, seqs, msgs), frames)
        return seqs

    def _hand_over(self, peer: _Peer, schema: Schema, items: list[Mapping[str, Any]]) -> list[int]:
        """``items`` to a consumer in this process (with credit for all) in one DATA: the
        messages themselves, and the schema they were checked against (``Receiver`` checks
        them only if its own is another)."""
        seqs, msgs = self._hold_batch(peer, schema, items, 0)
        peer.sock.send_nowait([DATA, _batch_header(peer, seqs, msgs), msgs, schema])
        return seqs

    def _hold_batch(
        self, peer: _Peer, schema: Schema, items: list[Mapping[str, Any]], nbytes: int
    ) -> tuple[list[int], list[Message]]:
        """A sequence number for each of ``items``, each held on its own (``nbytes`` each), the
        credit spent; their seqs and Messages."""
        seqs, msgs = [], []
        for data in items:
            msg = Message(
                kind=schema.kind, data=dict(data), version=schema.version, weight=schema.weigh(data)
            )
            held = _Held(msg, None, nbytes, peer, peer.session, uids_of(data))
            self._seq += 1
            self._hold(self._seq, held)
            seqs.append(self._seq)
            msgs.append(msg)
        self._sent += len(items)
        self._batches += 1
        peer.sent += sum(m.weight for m in msgs)  # spent before yielding, as in _send_data
        return seqs, msgs

    def _checked(self, kind: str, items: Sequence[Mapping[str, Any]]) -> Schema:
        """The schema of ``kind``, every item checked against it, the sender ready to send."""
        schema = self._schemas.get(kind)
        if schema is None:
            raise ValueError(
                f"sender {self.name!r}: kind {kind!r} is not declared on this port; "
                f"declared: {sorted(self._schemas)}"
            )
        for data in items:
            problems = schema.check(data)
            if problems:
                raise ValueError(
                    f"sender {self.name!r}: {kind!r} message does not match its "
                    f"schema (version {schema.version}): " + "; ".join(problems)
                )
        if self._closed:
            raise ChannelClosed(f"sender {self.name!r} is closed")
        if not self._started:
            raise TransportError(f"sender {self.name!r}: call start() first")
        return schema

    def _drop(self, count: int) -> None:
        """Messages with no consumer to go to (an optional output nobody listens to)."""
        for _ in range(count):
            self._dropped += 1
            if self._dropped % 1000 == 1:
                self._log.info(
                    "message_dropped", port=self.name, reason="no_peers", dropped=self._dropped
                )

    def _frames(self, held: _Held) -> list[Any]:
        """The message's frames, encoded the first time a consumer in another process needs
        them (raises what ``encode`` raises, or ValueError when a frame is too large)."""
        if held.frames is None:
            frames = encode(held.msg)
            if self._max_message_bytes > 0:
                self._check_size(held.msg.kind, frames)
            held.frames = frames
            before, held.nbytes = held.nbytes, sum(len(f) for f in frames)
            # held already (sent in-process, or its share of a batch): its bytes as encoded now
            self._unacked_bytes += held.nbytes - before if held.peer is not None else 0
            self._bytes += held.nbytes
        return held.frames

    def _check_size(self, kind: str, frames: list[Any]) -> None:
        largest = max(memoryview(f).nbytes for f in frames)
        if largest <= self._max_message_bytes:
            return
        self._oversized += 1
        self._log.error(
            "message_oversized",
            port=self.name,
            kind=kind,
            frame_bytes=largest,
            limit_bytes=self._max_message_bytes,
            count=self._oversized,
        )
        raise ValueError(
            f"sender {self.name!r}: a {kind!r} message has a frame of {largest / 2**20:.1f} MiB, "
            f"over its consumers' limit of {self._max_message_bytes / 2**20:.1f} MiB "
            "(transport.max_message_mb): raise the limit, or send smaller messages"
        )

    def on_ack(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(seq)`` for each message (``send``'s return value) once processed."""
        self._ack_callbacks.append(callback)

    def on_credit(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever a consumer's credit or liveness may have changed (what
        ``credit()`` and ``room()`` say): a producer that decides how much to start waits for
        this rather than polling them."""
        self._credit_callbacks.append(callback)

    async def _send_data(
        self, peer: _Peer, seq: int, held: _Held, schema: Schema | None = None
    ) -> None:
        """``schema``: the one ``held`` was checked against just now (None when sent again)."""
        header: dict[str, Any] = {"to": peer.session, "epoch": peer.epoch, "seq": seq}
        if held.msg.weight != 1:
            header["w"] = held.msg.weight
        # spend the credit before yielding: concurrent senders must not reuse it
        peer.sent += held.msg.weight
        if isinstance(peer.sock, LocalDealer):  # the message itself, for a consumer here
            peer.sock.send_nowait([DATA, header, held.msg, schema])
            return
        await self._send_frames(peer, header, self._frames(held))

    async def _send_frames(self, peer: _Peer, header: dict[str, Any], frames: list[Any]) -> None:
        """A DATA (one message or a batch) to a consumer in another process; on CURVE its large
        frames sealed on the bulk port first."""
        if peer.bulk is not None and bulk.worth_sealing(frames):
            # The pieces go first, so they are usually there when their DATA arrives.
            frames, header["bulk"], parts = bulk.seal(frames)
            self._sealed += 1
            self._sealed_bytes += sum(len(p) for p in parts)
            self._sent_or_raise(await settled(peer.bulk.send_multipart(parts, copy=False)))
        data = [DATA, msgpack.packb(header), *frames]
        await peer.sock.send_multipart(data, copy=False)  # ChannelClosed once closed

    def _sent_or_raise(self, sending: asyncio.Future) -> None:
        if sending.cancelled() or (self._closed and sending.exception() is not None):
            raise ChannelClosed(f"sender {self.name!r} was closed while sending")
        sending.result()  # raises what the send raised

    def _hold(self, seq: int, held: _Held) -> None:
        """Keep a sent message until it is acknowledged, within the bounds."""
        self._unacked[seq] = held
        self._unacked_bytes += held.nbytes
        while len(self._unacked) > 1 and (
            len(self._unacked) > self._max_unacked or self._unacked_bytes > self._max_unacked_bytes
        ):
            _, oldest = self._unacked.popitem(last=False)
            self._unacked_bytes -= oldest.nbytes
            self._unacked_dropped += 1
            if sparse(self._unacked_dropped):
                self._log.warning(
                    "unacked_dropped",
                    port=self.name,
                    count=self._unacked_dropped,
                    max_unacked=self._max_unacked,
                    max_unacked_bytes=self._max_unacked_bytes,
                    detail="oldest message sent and never acknowledged: no longer kept for "
                    "redelivery",
                )

    def _on_ack(self, peer: _Peer, header: Mapping[str, Any]) -> None:
        acked = header.get("acked")
        if not isinstance(acked, list):
            self._reject(peer, f"ACK with bad fields {header!r}")
            return
        for seq in acked:
            held = self._unacked.pop(seq, None) if is_int(seq) else None
            if held is not None:
                self._unacked_bytes -= held.nbytes
                self._acked += 1
                for callback in self._ack_callbacks:
                    callback(seq)
        self._acks_arrived.set()

    async def finish(self, log_every_s: float = 30.0) -> None:
        """No more messages: send EOS, then wait until everything sent was acknowledged.

        A producer that has finished calls this before ``aclose()``: until its consumers have
        processed everything it is the one that can send it again if one of them dies (and a
        consumer may need the EOS to finish its work: a partial batch, an incomplete group).
        A consumer that restarts meanwhile gets what it had not acknowledged, then EOS again.
        """
        self._finishing = True
        self._resend_ready.set()  # the redelivery task sends EOS, after anything to send again
        await self.wait_acked(log_every_s)

    async def _eos_to(self, peer: _Peer) -> None:
        try:
            peer.sock.send_nowait([EOS, self._hello_map(peer)])
        except (zmq.ZMQError, ChannelClosed) as e:
            self._log.warning("eos_not_sent", port=self.name, peer=peer.address, error=repr(e))

    async def wait_acked(self, log_every_s: float = 30.0) -> None:
        """Wait until every message sent has been acknowledged (or let go by the bounds)."""
        waited = time.monotonic()
        while self._unacked:
            self._acks_arrived.clear()
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow a racing cancellation
            arrived = asyncio.ensure_future(self._acks_arrived.wait())
            try:
                done, _ = await asyncio.wait({arrived}, timeout=log_every_s)
            finally:
                arrived.cancel()
            if not done:
                self._log.info(
                    "waiting_for_acks",
                    port=self.name,
                    unacked=len(self._unacked),
                    waited_s=round(time.monotonic() - waited, 1),
                )

    def _redeliver_to_others(self, peer: _Peer, old_session: str) -> None:
        """``peer`` came back as a new session: what it held unacknowledged is gone with it."""
        again = [
            seq
            for seq, held in self._unacked.items()
            if held.peer is peer and held.session == old_session
        ]
        if not again:
            return
        for seq in again:
            self._unacked[seq].peer = None
        self._resend.extend(again)
        self._redelivered += len(again)
        self._log.warning(
            "redelivering",
            port=self.name,
            peer=peer.address,
            count=len(again),
            detail="consumer restarted before acknowledging these; sending them again",
        )
        self._resend_ready.set()

    async def _redeliver_loop(self) -> None:
        # The one place EOS goes out once finishing, and only when nothing waits to be sent
        # again: a consumer that took EOS ends its input, so an EOS ahead of a redelivered
        # message (a consumer restarted just as the producer finished) would strand it.
        while True:
            await self._resend_ready.wait()
            self._resend_ready.clear()  # first: a redelivery queued while we await runs again
            while self._resend:
                held = self._unacked.get(self._resend[0])
                if held is None or held.peer is not None:  # acked or dropped meanwhile
                    self._resend.popleft()
                    continue
                weight = held.msg.weight
                peer = self._pick(weight) or await self._wait_for_credit(weight)
                seq = self._resend.popleft()
                held = self._unacked.get(seq)
                if held is None:
                    continue
                held.peer, held.session = peer, peer.session
                await self._send_data(peer, seq, held)
            if self._finishing and not self._resend:  # our end, to whoever has not taken it
                for peer in list(self._peers):
                    if not peer.eos_acked and peer.session is not None and not self._resend:
                        await self._eos_to(peer)

    async def _wait_for_credit(self, weight: int = 1) -> _Peer:
        self._waiting += 1
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        try:
            while True:
                self._credit_changed.clear()
                await self._credit_changed.wait()
                if self._closed:
                    raise ChannelClosed(f"sender {self.name!r} is closed")
                peer = self._pick(weight)
                if peer is not None:
                    return peer
        finally:
            self._waiting -= 1
            if self._waiting == 0 and self._blocked_since is not None:
                self._credit_wait_s += time.monotonic() - self._blocked_since
                self._blocked_since = None

    def _ready(self, weight: int = 1) -> list[_Peer]:
        now = time.monotonic()
        return [
            p
            for p in self._peers
            if p.covers(weight) and p.live(now, self._peer_timeout_s) and not p.eos_acked
        ]  # (a consumer that took our EOS has ended its input: it would not process more)

    def _pick(self, weight: int = 1) -> _Peer | None:
        ready = self._ready(weight)
        if len(ready) < 2:
            return ready[0] if ready else None
        most = max(p.credit for p in ready)
        ties = [p for p in ready if p.credit == most]
        self._rr += 1
        return ties[self._rr % len(ties)]

    def sends(self, kind: str) -> bool:
        """Whether this port sends messages of ``kind`` (its consumers accept them)."""
        return kind in self._schemas

    def credit(self) -> int:
        """Units of weight that can be sent now without waiting (messages, where each weighs
        1): credit held from live consumers.

        A producer that decides how much work to start (the generator) reads this as the room
        downstream has for its output.
        """
        now = time.monotonic()
        return sum(max(0, p.credit) for p in self._peers if p.live(now, self._peer_timeout_s))

    def room(self) -> int:
        """How much weight (how many messages of weight 1) one ``send_many`` sends now without
        waiting for credit, in one batch: the credit of the consumer with the most."""
        return max((p.credit for p in self._ready()), default=0)

    async def wait_for_room(self) -> int:
        """``room()``, once it is more than 0: a producer that batches what it has waits here
        rather than sending one message as soon as one unit of credit comes back (a consumer
        that takes its inbox as fast as it fills grants a quarter of its share at a time, and
        the rest would then go one unit behind the first). ChannelClosed after ``aclose()``."""
        room = self.room()
        if room <= 0:
            await self._wait_for_credit(1)
            room = self.room()
        return room

    def held_uids(self) -> list[str]:
        """The ``uid`` of each message sent and not yet acknowledged (that carries one)."""
        return [u for h in self._unacked.values() for u in h.uids]

    def stats(self) -> dict[str, Any]:
        """Traffic, credit per consumer, and time spent waiting for credit (for metrics)."""
        now = time.monotonic()
        blocked_for = now - self._blocked_since if self._blocked_since is not None else 0.0
        return {
            "sent": self._sent,
            "bytes": self._bytes,
            "dropped": self._dropped,
            "oversized": self._oversized,
            "credit_wait_s": self._credit_wait_s + blocked_for,
            "blocked": self._waiting > 0,
            "blocked_for_s": blocked_for,
            "credit": {p.address: p.credit for p in self._peers},
            "peers_live": sum(p.live(now, self._peer_timeout_s) for p in self._peers),
            "rejected": dict(self._rejected),
            "unacked": len(self._unacked),
            "unacked_bytes": self._unacked_bytes,
            "acked": self._acked,
            "redelivered": self._redelivered,
            "unacked_dropped": self._unacked_dropped,
            "sealed": self._sealed,
            "sealed_bytes": self._sealed_bytes,
            "credits_in": self._replies[CREDIT],  # CREDIT and ACK messages from consumers
            "acks_in": self._replies[ACK],
            "batches": self._batches,  # DATA that carried several messages (send_many)
        }

    # -- internals ---------------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._closed:
            return
        # A loop died of a bug; say so loudly (send() keeps failing to find credit otherwise).
        self._log.error(
            "sender_failed", port=self.name, task=task.get_name(), error=repr(task.exception())
        )

    def _hello_map(self, peer: _Peer) -> bytes:
        return msgpack.packb(
            {
                "identity": self.identity,
                "session": self._session,
                "to": peer.session,
                "epoch": peer.epoch,
                "sent": peer.sent,
            }
        )

    async def _hello(self, peer: _Peer) -> None:
        try:
            # NOBLOCK: while a consumer is down, PINGs queue up to the high-water mark; beyond
            # that one more PING is useless, and it must never hold up the other peers.
            peer.sock.send_nowait([HELLO, self._hello_map(peer)])
        except (zmq.Again, ChannelClosed):
            pass

    async def _heartbeat_loop(self) -> None:
        # A periodic timer: the first HELLO goes out at once, then one every heartbeat_s.
        while True:
            for peer in self._peers:
                await self._hello(peer)
            await asyncio.sleep(self._heartbeat_s)

    async def _peer_loop(self, peer: _Peer) -> None:
        sock = peer.sock
        # What is already queued (an ACK and a CREDIT of the same turn) is read at once, with
        # no wait per message; only this task receives from the socket.
        while True:
            await self._handle(peer, await sock.recv_multipart())
            for _ in range(DRAIN_BATCH):
                if not sock.ready_to_read():
                    break
                await self._handle(peer, sock.recv_nowait())
            else:
                await asyncio.sleep(0)  # a full batch: let the application run before the next

    def _reject(self, peer: _Peer, detail: str) -> None:
        self._rejected["bad_control"] += 1
        self._log.warning(
            "message_rejected",
            port=self.name,
            reason="bad_control",
            detail=detail,
            sender=peer.address,
        )

    async def _handle(self, peer: _Peer, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._reject(peer, f"{len(frames)} frames, expected 2")
            return
        tag, body = frames
        header = body if isinstance(body, dict) else unpack_map(body)  # a dict: in-process
        if header is None:
            self._reject(peer, f"tag {tag!r}: frame 1 is not a msgpack map")
            return
        self._replies[tag] += 1
        if tag == CREDIT:
            self._on_credit(peer, header)
        elif tag == ACK:
            self._on_ack(peer, header)
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
        if not (
            isinstance(session, str) and is_int(epoch) and is_int(granted) and is_int(consumed)
        ):
            self._reject(peer, f"CREDIT with bad fields {header!r}")
            return
        peer.last_heard = time.monotonic()
        peer.closed = False
        reach = header.get("reach")
        peer.reach = reach if is_int(reach) and reach >= 1 else None
        self._use_bulk_port(peer, header.get("bulk_port"))
        if header.get("eos") is True:
            peer.eos_acked = True
            if all(p.eos_acked for p in self._peers):
                self._eos_acked.set()
            return
        if (session, epoch) != (peer.session, peer.epoch):
            if peer.session is not None:
                self._log.info(
                    "credit_reset", port=self.name, peer=peer.address, unused=peer.credit
                )
            # A new stream (consumer restarted, or it reclaimed our credit): start over.
            old = peer.last_session
            peer.session, peer.epoch, peer.sent, peer.granted = session, epoch, 0, granted
            peer.last_session = session
            if old is not None and old != session:
                peer.eos_acked = False  # a new instance: it has not had our EOS
                self._redeliver_to_others(peer, old)
            if self._finishing:  # it needs our EOS, addressed to it (after any redelivery)
                self._resend_ready.set()
        else:
            peer.granted = max(peer.granted, granted)
        peer.consumed = consumed
        self._credit_changed.set()  # also when only liveness changed: a waiter may now proceed
        for callback in self._credit_callbacks:
            callback()

    def _use_bulk_port(self, peer: _Peer, port: Any) -> None:
        """Connect to the bulk port a CURVE consumer announced (its host is the inbox's)."""
        if self._curve is None or not is_int(port) or not 0 < port < 65536:
            return
        if peer.address is None or not peer.address.startswith("tcp://"):
            return
        address = f"{peer.address.rpartition(':')[0]}:{port}"
        if address == peer.bulk_address:
            return
        if peer.bulk is not None:  # the consumer restarted on another port
            peer.bulk.close(linger=0)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SENDER_HWM)
        sock.connect(address)
        peer.bulk, peer.bulk_address = sock, address
        self._log.debug("bulk_connected", port=self.name, peer=peer.address, bulk=address)


def _batch_header(peer: _Peer, seqs: list[int], msgs: list[Message]) -> dict[str, Any]:
    """A batch DATA's header; ``ws``: its messages' weights, where one is not 1."""
    header: dict[str, Any] = {"to": peer.session, "epoch": peer.epoch, "seqs": seqs}
    if any(m.weight != 1 for m in msgs):
        header["ws"] = [m.weight for m in msgs]
    return header
