"""ZeroMQ endpoint addresses: check them before use, and make ipc and tcp ones.

Three schemes are accepted: ``ipc://PATH`` (a Unix socket file, the default between stages on
one machine), ``inproc://NAME`` (inside one process, for tests) and ``tcp://HOST:PORT``.
Binding to every interface (``*``, ``0.0.0.0``, ``::``) is refused unless asked for explicitly:
the channels carry no authentication, so exposing them must be a deliberate choice.

Nothing here opens a ZeroMQ socket; ``tcp_address`` briefly binds a plain socket to find a free
port (which another process could still take before it is used). ``rendezvous_port`` finds one
for a port that must be known before its owner starts (torch.distributed's ``MASTER_PORT``).
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from pathlib import Path

__all__ = [
    "IPC_PATH_MAX",
    "check_address",
    "ipc_address",
    "is_loopback",
    "rendezvous_port",
    "tcp_address",
]

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
IPC_PATH_MAX = 107

_ANY_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}


def check_address(addr: str, *, allow_any_host: bool = False, bind: bool = False) -> str:
    """Return ``addr`` if it is a usable ipc, inproc or tcp endpoint; raise ValueError if not.

    ``bind``: the address is one to bind, where tcp port 0 means "any free port" (the bound
    socket then tells which: ``Receiver.address`` after ``start``).
    """
    if not isinstance(addr, str):
        raise ValueError(f"address {addr!r} is a {type(addr).__name__}, expected a string")
    scheme, sep, rest = addr.partition("://")
    if not sep:
        raise ValueError(
            f"address {addr!r} has no scheme; use ipc://PATH, inproc://NAME or tcp://HOST:PORT"
        )
    if scheme == "ipc":
        _check_ipc_path(addr, rest)
    elif scheme == "inproc":
        if not rest:
            raise ValueError(f"address {addr!r}: inproc needs a name (inproc://NAME)")
    elif scheme == "tcp":
        _check_tcp(addr, rest, allow_any_host, bind)
    else:
        raise ValueError(f"address {addr!r}: unsupported scheme {scheme!r}; use ipc, inproc or tcp")
    return addr


def _check_ipc_path(addr: str, path: str) -> None:
    if not path:
        raise ValueError(f"address {addr!r}: ipc needs a path (ipc:///tmp/run/stage.sock)")
    if "*" in path:
        raise ValueError(f"address {addr!r}: wildcard ipc paths are not supported; name the file")
    size = len(os.fsencode(path))
    if size > IPC_PATH_MAX:
        raise ValueError(
            f"address {addr!r}: the socket path is {size} bytes, over the {IPC_PATH_MAX}-byte "
            "limit of Unix sockets; use a shorter run directory or tcp"
        )


def _check_tcp(addr: str, rest: str, allow_any_host: bool, bind: bool = False) -> None:
    host, sep, port_text = rest.rpartition(":")
    if not sep:
        raise ValueError(f"address {addr!r}: tcp needs HOST:PORT (tcp://127.0.0.1:5555)")
    if host in _ANY_HOSTS:
        if not allow_any_host:
            raise ValueError(
                f"address {addr!r} listens on every interface; name one (tcp://127.0.0.1:PORT) "
                "or pass allow_any_host=True if exposing the channel is intended"
            )
    elif host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"address {addr!r}: malformed IPv6 host {host!r} (use [::1])")
    elif ":" in host:
        raise ValueError(f"address {addr!r}: put an IPv6 host in brackets (tcp://[::1]:PORT)")
    if bind and port_text == "0":
        return  # bind to a free port: no pick-then-bind race
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(
            f"address {addr!r}: port {port_text!r} is not a number in 1..65535 "
            "(use tcp_address() to pick a free one)"
        )


def ipc_address(directory: str | os.PathLike[str], name: str) -> str:
    """``ipc://DIRECTORY/NAME`` as an absolute path; ValueError if it is too long for AF_UNIX."""
    if not name or "/" in name:
        raise ValueError(f"ipc socket name {name!r} must be a non-empty file name without '/'")
    path = Path(directory).absolute() / name
    return check_address(f"ipc://{path}")


def tcp_address(host: str = "127.0.0.1", port: int | None = None) -> str:
    """``tcp://HOST:PORT``; with ``port=None``, a port that was free a moment ago.

    The free port is found by binding port 0 and closing the socket again, so another process
    could take it in between: bind it soon.
    """
    if port is None:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
            port = s.getsockname()[1]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return check_address(f"tcp://{host}:{port}", allow_any_host=True)


def is_loopback(address: str) -> bool:
    """Whether an endpoint stays on this host: ipc, inproc, or tcp on a loopback address."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or an interface name: assume it leaves the host
        return False


_RENDEZVOUS_LOW = 10_000  # the ports below the kernel's ephemeral range from here are drawn from
_draw = random.SystemRandom()  # not the seeded global one: runs seeded alike draw alike


def rendezvous_port(host: str = "127.0.0.1", *, tries: int = 64) -> int:
    """A port free on ``host`` a moment ago, for a server that starts seconds later (rank 0
    of a torch.distributed group binds ``MASTER_PORT``; the number goes to every rank first).

    It is drawn at random below the kernel's ephemeral range, never from it: every socket
    that binds port 0 or connects out gets an ephemeral port, so one found by binding port 0
    is soon taken again on a busy host, while these are taken only by another explicit
    choice of the same number. Falls back to an ephemeral one if none of ``tries`` is free.
    """
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = _ephemeral_low()
    for _ in range(tries if high > _RENDEZVOUS_LOW else 0):
        port = _draw.randrange(_RENDEZVOUS_LOW, high)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
