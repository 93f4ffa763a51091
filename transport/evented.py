"""A ZeroMQ socket on the event loop through one reader kept on its descriptor for its life.

pyzmq's asyncio sockets add a reader to the loop for each operation that has to wait, remove it
once done, make a future for every operation and test poll flags through Python enums. On the
hot sockets of a run (a sender's socket to its consumer, a replica's control subscription, the
broker's inbound socket) that machinery took 11% of the main thread of the process the light
stages share (py-spy ``--gil``, a default run). ``EventedSocket`` wraps a plain (synchronous)
socket instead: one reader on ``zmq.FD`` for as long as the socket is open, operations tried at
once without blocking, and a waiter (a bare future) only when one has to wait.

ZeroMQ's descriptor is edge-triggered: it becomes readable when the socket *may* have changed,
and any operation on the socket (a send, a receive, reading ``EVENTS``) can consume that signal.
So the reader reads ``EVENTS`` (which also clears the descriptor: the loop never spins on it)
and wakes a waiter of the direction that is ready, and every completed operation looks once
more for the other direction when someone waits there, as pyzmq's own sockets do.

Only this class may touch the socket while it is open (a pyzmq asyncio socket on the same
descriptor would replace this reader); ``sock`` is the plain socket for options and connects.
Single event loop, single thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from transport.errors import ChannelClosed

__all__ = ["EventedSocket", "plain_socket"]

# plain ints: pyzmq's constants are enums, and an operator on one runs Python code
_EVENTS, _RCVMORE = int(zmq.EVENTS), int(zmq.RCVMORE)
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)


def plain_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A plain (synchronous) ``kind`` socket of ``ctx``, a plain or an asyncio context."""
    if not isinstance(ctx, zmq.asyncio.Context):
        return ctx.socket(kind)
    return zmq.Socket(zmq.Context.shadow(ctx.underlying), kind)


class EventedSocket:
    """A plain socket (``plain_socket``) with awaitable ``recv_multipart`` and
    ``send_multipart``. Create it inside the running loop; ``close()`` releases the reader and
    the socket, and whatever waits on it raises ``ChannelClosed``."""

    def __init__(self, sock: zmq.Socket, *, name: str = "socket") -> None:
        if isinstance(sock, zmq.asyncio.Socket):
            raise TypeError("EventedSocket takes a plain socket (plain_socket), not an asyncio one")
        self.sock = sock
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._readers: deque[asyncio.Future] = deque()
        self._writers: deque[asyncio.Future] = deque()
        self.closed = False
        self._loop.add_reader(self._fd, self._on_fd)

    # -- the descriptor -------------------------------------------------------------------

    def _on_fd(self) -> None:
        if self.closed:
            return
        try:  # reading EVENTS also clears the descriptor: the loop never spins on it
            events = self.sock.getsockopt(_EVENTS)
        except zmq.ZMQError:  # the context is terminating: nothing more comes
            self.close()
            return
        if self._readers or self._writers:
            self._wake(events)

    def _wake(self, events: int) -> None:
        if events & _POLLIN:
            _wake_first(self._readers)
        if events & _POLLOUT:
            _wake_first(self._writers)

    def _look_again(self) -> None:
        """After an operation: it may have taken the descriptor's signal meant for a waiter."""
        if self._readers or self._writers:
            self._wake(self.sock.getsockopt(_EVENTS))

    async def _wait(self, waiters: deque[asyncio.Future]) -> None:
        if self.closed:
            raise ChannelClosed(f"{self.name} is closed")
        waiter = self._loop.create_future()
        waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter in waiters:  # it never woke
                waiters.remove(waiter)
            elif not self.closed:  # woken, then cancelled before it ran: pass the wake on
                self._look_again()
            raise

    # -- operations -----------------------------------------------------------------------

    def ready_to_read(self) -> bool:
        """A message is waiting (without blocking: ``recv_nowait`` returns it)."""
        return not self.closed and bool(self.sock.getsockopt(_EVENTS) & _POLLIN)

    def recv_nowait(self, copy: bool = True) -> list[Any]:
        """The next message; ``zmq.Again`` if there is none (``ready_to_read`` first avoids the
        exception, which costs more than the check)."""
        sock = self.sock
        frames = [sock.recv(_NOBLOCK, copy=copy)]
        while sock.getsockopt(_RCVMORE):  # the rest of a message is there with its first frame
            frames.append(sock.recv(_NOBLOCK, copy=copy))
        if self._writers:
            self._look_again()
        return frames

    async def recv_multipart(self, copy: bool = True) -> list[Any]:
        """The next message, waiting for one; ``ChannelClosed`` once closed."""
        sock = self.sock
        while True:
            if self.closed:
                raise ChannelClosed(f"{self.name} is closed")
            if sock.getsockopt(_EVENTS) & _POLLIN:
                return self.recv_nowait(copy)
            await self._wait(self._readers)

    def send_nowait(self, frames: list[Any], copy: bool = True) -> None:
        """Queue ``frames`` now; ``zmq.Again`` at the high-water mark."""
        if self.closed:
            raise ChannelClosed(f"{self.name} is closed")
        send, last = self.sock.send, len(frames) - 1
        for frame in frames[:last]:  # past the first frame, a message's frames never wait
            send(frame, _MORE, copy=copy)
        send(frames[last], _NOBLOCK, copy=copy)
        if self._readers:
            self._look_again()

    async def send_multipart(self, frames: list[Any], copy: bool = True) -> None:
        """Queue ``frames``, waiting while the high-water mark is reached."""
        while True:
            try:
                self.send_nowait(frames, copy=copy)
                return
            except zmq.Again:
                await self._wait(self._writers)

    def connect(self, address: str) -> None:
        self.sock.connect(address)

    def disconnect(self, address: str) -> None:
        self.sock.disconnect(address)

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        for waiters in (self._readers, self._writers):
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(ChannelClosed(f"{self.name} was closed"))
        self.sock.close(linger=linger)


def _wake_first(waiters: deque[asyncio.Future]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return
