"""Address helpers: what is accepted, what is refused and why."""

from __future__ import annotations

import socket
from pathlib import Path
from unittest import mock

import pytest

from transport import address
from transport.address import (
    IPC_PATH_MAX,
    check_address,
    ipc_address,
    rendezvous_port,
    tcp_address,
)


@pytest.mark.parametrize(
    "addr",
    [
        "ipc:///tmp/run/stage.sock",
        "inproc://bus",
        "tcp://127.0.0.1:5555",
        "tcp://[::1]:80",
        "tcp://gpu-node-3:6000",
    ],
)
def test_accepted(addr: str) -> None:
    assert check_address(addr) == addr


@pytest.mark.parametrize(
    ("addr", "problem"),
    [
        ("127.0.0.1:5555", "no scheme"),
        ("udp://127.0.0.1:5555", "unsupported scheme"),
        ("ipc://", "needs a path"),
        ("inproc://", "needs a name"),
        ("tcp://127.0.0.1", "HOST:PORT"),
        ("tcp://127.0.0.1:0", "port"),
        ("tcp://127.0.0.1:70000", "port"),
        ("tcp://127.0.0.1:*", "port"),
        ("tcp://*:5555", "every interface"),
        ("tcp://0.0.0.0:5555", "every interface"),
        ("tcp://::1:5555", "brackets"),
        ("ipc://" + "x" * (IPC_PATH_MAX + 1), "limit"),
    ],
)
def test_refused(addr: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_address(addr)


def test_any_host_on_request() -> None:
    assert check_address("tcp://0.0.0.0:5555", allow_any_host=True)


def test_ipc_address(tmp_path) -> None:
    assert ipc_address(tmp_path, "gen.0") == f"ipc://{tmp_path}/gen.0"
    with pytest.raises(ValueError, match="107-byte limit"):
        ipc_address(tmp_path / ("d" * 120), "gen.0")
    with pytest.raises(ValueError, match="file name"):
        ipc_address(tmp_path, "a/b")


def test_tcp_address_picks_a_port() -> None:
    addr = tcp_address()
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert tcp_address("127.0.0.1", 5000) == "tcp://127.0.0.1:5000"


def test_a_rendezvous_port_is_free_and_never_one_the_kernel_hands_out() -> None:
    """Below the ephemeral range: a busy host's bind-to-0 and outgoing sockets cannot take it
    between the draw and rank 0's bind; a taken one is not drawn."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {rendezvous_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in ports) and len(ports) > 10
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # every port it may draw taken: an ephemeral one, still free
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        with (
            mock.patch.object(address, "_RENDEZVOUS_LOW", taken),
            mock.patch.object(address, "_ephemeral_low", lambda: taken + 1),
        ):
            port = rendezvous_port()
    assert port != taken and port >= low
