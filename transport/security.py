"""CURVE for channels and the control bus: the run's keys, who may connect, and who was refused.

Off one host, anyone who reaches a port could send a stage messages. So a run that binds off
loopback encrypts and authenticates every ZeroMQ socket with CURVE (ZeroMQ's CurveZMQ: Curve25519
key exchange, then every frame encrypted and authenticated):

- :class:`CurveKeys` are the run's two key pairs, made by the supervisor: one that every bound
  socket (inboxes, the control broker) serves with, one that every connecting socket (senders,
  control clients) presents. They travel to replicas in their private spec files (or, on Ray, in
  the actor's arguments), never on a command line or in a file others can read.
- A bound socket accepts a connection only when the client knows the server's public key *and*
  presents the run's client key: ZeroMQ asks the context's ZAP handler (:class:`_ZapHandler`, one
  per context, a thread answering on ``inproc://zeromq.zap.01``), which allows exactly the client
  keys it was given.
- A peer that fails the handshake (no CURVE, the wrong server key, a client key not allowed)
  gets nothing in: ZeroMQ drops the connection before a single frame reaches the application.
  :class:`~transport.monitor.PeerWatch` counts these refusals per bound socket from its
  monitor events (``refused_peers`` in the socket's stats), logged at the 1st, 2nd, 4th ...

Frames of 1 MiB or more on a CURVE tcp channel do not go through CurveZMQ: they go AES-GCM
sealed, under a fresh key per message that only the CURVE socket carries, on a bulk port beside
it (``transport.bulk``; CurveZMQ alone runs at a third of plain for 64 MB tensors). That port is
the one socket off loopback without CURVE of its own: what reaches it without a key from the
CURVE channel is never opened, and is dropped and counted.

ipc and inproc sockets can use CURVE too (``transport.curve: true``), though file permissions
already keep other users off an ipc socket.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from transport.address import is_loopback

__all__ = ["CurveKeys", "require_curve_off_loopback"]

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"inflight"
_KEY_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


@dataclass(frozen=True)
class CurveKeys:
    """The run's CURVE key pairs, Z85-encoded (40 characters each). ``repr`` shows no secret."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh key pairs (needs libzmq built with CURVE, as pyzmq's wheels are)."""
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; install pyzmq from its wheels")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def to_spec(self) -> dict[str, str]:
        """The keys as plain strings (for a private spec file)."""
        return {name: getattr(self, name).decode("ascii") for name in _KEY_FIELDS}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], where: str = "curve") -> CurveKeys:
        """Keys from :meth:`to_spec`'s map; ValueError naming the field that is missing or bad."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: expected a map of CURVE keys, got {type(spec).__name__}")
        values = []
        for name in _KEY_FIELDS:
            value = spec.get(name)
            if not isinstance(value, str) or len(value) != 40:
                raise ValueError(f"{where}.{name}: expected a 40-character Z85 CURVE key")
            values.append(value.encode("ascii"))
        keys = cls(*values)
        for public, secret in ((0, 1), (2, 3)):
            if zmq.curve_public(values[secret]) != values[public]:
                pair = _KEY_FIELDS[public].split("_")[0]
                raise ValueError(f"{where}: the {pair} public key does not match its secret key")
        return keys

    def serve(self, sock: zmq.Socket) -> None:
        """Make a socket about to bind a CURVE server that admits only this run's client key."""
        _ZapHandler.allow(sock.context, self.client_public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)

    def connect(self, sock: zmq.Socket) -> None:
        """Make a socket about to connect a CURVE client of this run's servers."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def require_curve_off_loopback(
    what: str, address: str, curve: CurveKeys | None, insecure: bool
) -> None:
    """ValueError when ``address`` leaves this host with neither CURVE nor ``insecure``."""
    if curve is None and not insecure and not is_loopback(address):
        raise ValueError(
            f"{what}: {address} is reachable from other hosts and has no CURVE keys: anyone who "
            "reaches it could send; give it the run's keys (transport.curve) or set "
            "transport.insecure: true on a network you trust"
        )


class _ZapHandler:
    """A context's ZAP handler: admits CURVE clients whose public key was allowed.

    ZeroMQ asks ``inproc://zeromq.zap.01`` in the socket's own context, so there is one handler
    per context, on a daemon thread (it answers even while the event loop is busy). It ends
    when the context terminates.
    """

    _lock = threading.Lock()
    _handlers: dict[int, _ZapHandler] = {}

    def __init__(self, ctx: zmq.Context) -> None:
        self._allowed: set[bytes] = set()
        self._sync_ctx = zmq.Context.shadow(ctx.underlying)
        self._sock = self._sync_ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="inflight-zap", daemon=True)
        self._thread.start()

    @classmethod
    def allow(cls, ctx: zmq.Context, client_public: bytes) -> None:
        with cls._lock:
            handler = cls._handlers.get(ctx.underlying)
            if handler is None or not handler._thread.is_alive():
                handler = cls._handlers[ctx.underlying] = cls(ctx)
            handler._allowed.add(z85.decode(client_public))

    def _serve(self) -> None:
        try:
            while True:
                request = self._sock.recv_multipart()
                self._sock.send_multipart(self._answer(request))
        except zmq.ZMQError:  # the context is terminating
            pass
        finally:
            self._sock.close(linger=0)
            with self._lock:
                for key, handler in list(self._handlers.items()):
                    if handler is self:
                        del self._handlers[key]

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 6 or request[0] != b"1.0":
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"500", b"bad request", b"", b""]
        request_id, mechanism, credentials = request[1], request[5], request[6:]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] in self._allowed
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        return [b"1.0", request_id, b"400", b"not a client of this run", b"", b""]
