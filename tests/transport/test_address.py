"""Address helpers: what is accepted, what is refused and why."""

from __future__ import annotations

import pytest

from transport.address import IPC_PATH_MAX, check_address, ipc_address, tcp_address


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
