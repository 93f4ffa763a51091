"""In-process links: a Sender and a Receiver of one process, without ZeroMQ or the codec.

Stages that share a process (``pipeline.host``) still talk through channels with every
contract of ``transport.credit``: credit, acknowledgement, redelivery to a restarted consumer,
end-of-stream, the ledger's uids. Only the wire changes. A :class:`LocalDealer` stands where
the Sender's DEALER socket would, for a consumer whose :class:`~transport.receiver.Receiver`
lives in this process: the protocol's frames go straight into that Receiver's handler, and a
DATA carries the :class:`~transport.message.Message` itself instead of its encoded frames, so
nothing is packed, copied into ZeroMQ, or decoded.

What the consumer gets is what a decode would give it: fresh maps and lists (changing them
does not change what the producer holds to send again), the same scalars, and the producer's
numpy arrays, made read-only (decoded arrays are read-only too, and a producer must not change
an array it sent: ``transport.codec``). Torch tensors are passed as they are: do not write them
in place (``transport.codec`` asks the same).

A consumer that is not bound (it is restarting) gets what is sent to it once it binds again,
as a DEALER queues for a ROUTER that is gone, up to ``SENDER_HWM`` messages; beyond that
PINGs are dropped (DATA never gets there: it waits for credit). Which consumers are in-process
is the caller's to say (``Sender(local=...)``; the supervisor knows from the placement): a
Receiver registers its address here when it starts, whatever its producers are.

Not here: the protocol (``transport.credit``), sockets (``transport.sender``,
``transport.receiver``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any

import numpy as np

from transport.credit import SENDER_HWM
from transport.message import Message

__all__ = ["LocalDealer", "bind", "fresh", "unbind"]

# inbox address -> the Receiver bound there in this process
_bound: dict[str, Any] = {}
# inbox address -> the dealers that send to it (flushed when a receiver binds there)
_dealers: dict[str, weakref.WeakSet[LocalDealer]] = {}


def bind(address: str, receiver: Any) -> None:
    """``receiver`` serves ``address`` in this process; dealers queued for it send now."""
    _bound[address] = receiver
    for dealer in list(_dealers.get(address, ())):
        dealer.flush()


def unbind(address: str, receiver: Any) -> None:
    if _bound.get(address) is receiver:
        del _bound[address]


def fresh(value: Any) -> Any:
    """``value`` as a consumer may own it: maps and lists rebuilt, arrays made read-only
    (anything else is immutable, or a tensor, and passed as it is). Every message handed over
    in-process goes through here: the common types are told apart by ``type`` first."""
    kind = type(value)
    if kind is dict:
        out = {}
        for key, item in value.items():
            of = type(item)
            if of in _PLAIN:
                out[key] = item
            elif of is np.ndarray:
                out[key] = _read_only(item)
            else:
                out[key] = fresh(item)
        return out
    if kind is list:
        return [item if type(item) in _PLAIN else fresh(item) for item in value]
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh(v) for v in value]
    if isinstance(value, np.ndarray):
        return _read_only(value)
    return value


def _read_only(array: np.ndarray) -> np.ndarray:
    flags = array.flags
    if flags.writeable:  # the producer may not change it either (transport.codec)
        flags.writeable = False
    return array


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})  # immutable: no copy to make


def delivered(msg: Message) -> Message:
    """The consumer's own copy of a message handed over in-process."""
    return Message(kind=msg.kind, data=fresh(msg.data), version=msg.version, weight=msg.weight)


class LocalDealer:
    """The producer's end of an in-process link, in place of a ZeroMQ DEALER (the API of
    ``transport.evented.EventedSocket`` that ``Sender`` uses). Frames are
    ``[tag, header, *payload]``; the header is a map (or packed bytes), the payload of a DATA
    the Message itself."""

    def __init__(self, routing_id: bytes, address: str) -> None:
        self.rid = routing_id
        self.address = address
        self._pending: deque[list[Any]] = deque()  # sent while nobody was bound there
        self._incoming: deque[list[Any]] = deque()  # from the consumer: CREDIT, ACK, CLOSE
        self._wake: asyncio.Future | None = None
        self.closed = False
        _dealers.setdefault(address, weakref.WeakSet()).add(self)

    def send_nowait(self, frames: list[Any], copy: bool = False) -> None:
        if not self.closed:
            self._pending.append(frames)
            if len(self._pending) > SENDER_HWM:
                self._pending.popleft()  # as a DEALER at its high-water mark: dropped
            self.flush()

    def flush(self) -> None:
        receiver = _bound.get(self.address)
        while receiver is not None and self._pending and not self.closed:
            receiver.local_in(self, self._pending.popleft())

    def push(self, frames: list[Any]) -> None:
        """From the consumer (its ROUTER's send, for this producer)."""
        if self.closed:
            return
        self._incoming.append(frames)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def recv_multipart(self, copy: bool = True) -> list[Any]:
        while not self._incoming:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        return self._incoming.popleft()

    def ready_to_read(self) -> bool:
        return bool(self._incoming)

    def recv_nowait(self, copy: bool = True) -> list[Any]:
        return self._incoming.popleft()

    def close(self, linger: int = 0) -> None:
        self.closed = True
        self._pending.clear()
        dealers = _dealers.get(self.address)
        if dealers is not None:
            dealers.discard(self)
            if not dealers:
                del _dealers[self.address]
        if self._wake is not None and not self._wake.done():
            self._wake.cancel()

    def connect(self, address: str) -> None:  # an in-process peer does not move
        pass

    def disconnect(self, address: str) -> None:
        pass
