"""What happens to a bound socket's connections, counted: peers refused, peers cut off.

ZeroMQ handles connections below the application: a peer that fails the CURVE handshake, or
sends a frame over the socket's ``MAXMSGSIZE``, is dropped before a single frame of it is read,
so nothing would ever count it. :class:`PeerWatch` reads the socket's monitor events:

- ``refused_peers``: handshakes that failed (no CURVE, the wrong server key, a client key the
  run does not know: ``transport.security``);
- ``disconnects``: connections that ended. A producer going away ends one, and so does a peer
  that sent a frame over ``transport.max_message_mb``: ZeroMQ cuts it off before allocating the
  frame (the run's own senders refuse such messages before sending: ``Sender``).

Each is logged at its 1st, 2nd, 4th ... occurrence, so a flood cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from transport.credit import sparse
from transport.evented import EventedSocket

__all__ = ["PeerWatch"]

_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "no CURVE or the wrong server key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not allowed",
}


class PeerWatch:
    """Counts a bound socket's refused peers and ended connections, from its monitor.

    ``start()`` after the socket is bound; ``refused`` and ``disconnects`` are the counts so
    far; ``aclose()`` before the socket is closed.
    """

    def __init__(self, sock: zmq.Socket, name: str, log: Any = None) -> None:
        self.name = name
        self.refused = 0
        self.disconnects = 0
        self._sock = sock
        self._log = log if log is not None else structlog.get_logger()
        self._monitor: zmq.asyncio.Socket | EventedSocket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        events = zmq.EVENT_DISCONNECTED
        for event in _REFUSALS:
            events |= event
        monitor = self._sock.get_monitor_socket(events)
        if not isinstance(monitor, zmq.asyncio.Socket):  # the socket watched is a plain one
            monitor = EventedSocket(monitor, name=f"monitor of {self.name}")
        self._monitor = monitor
        self._task = asyncio.create_task(self._watch(), name=f"peers:{self.name}")

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                if sparse(self.disconnects):
                    self._log.info(
                        "peer_disconnected",
                        socket=self.name,
                        endpoint=endpoint,
                        count=self.disconnects,
                        detail="the peer went away, or sent a frame over the size limit",
                    )
                continue
            why = _REFUSALS.get(event["event"])
            if why is None:
                continue
            self.refused += 1
            if sparse(self.refused):
                self._log.warning(
                    "peer_refused",
                    socket=self.name,
                    reason=why,
                    endpoint=endpoint,
                    count=self.refused,
                )

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
