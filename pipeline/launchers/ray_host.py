"""The Ray actor that hosts one replica on whichever node Ray placed it.

``ReplicaHost`` runs on the node: it writes the replica's spec to a private file there, starts
``python -m pipeline.actor SPEC`` as its own child (its own process group, killed by the kernel
if the actor dies: a removed node or ``ray.kill`` leaves no orphan holding a port or GPU), and
keeps the replica's logs in a folder of its own on that node, from which the driver pulls new
lines (``read_logs``): no shared filesystem is needed for ``inflight logs`` or the console.

The spec's inbox addresses name the host ``{NODE_IP}``: replaced here by the node's IP (the
replica binds port 0 there and announces the port it got). The replica's environment also gets
``INFLIGHT_NODE_IP``, which engines and the weight publisher bind to.

Not here: what to start or when (``pipeline.launchers.ray``, ``pipeline.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.launchers.local import kill_group, write_private
from pipeline.processes import child_preexec
from transport.address import rendezvous_port

__all__ = ["NODE_IP", "NODE_IP_ENV", "ReplicaHost"]

NODE_IP = "{NODE_IP}"  # placeholder in spec addresses, replaced on the node
NODE_IP_ENV = "INFLIGHT_NODE_IP"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_MAX_CHUNK = 4 * 2**20  # at most this much of one log file per read_logs call


def node_ip(environ: Mapping[str, str] | None = None) -> str:
    """The IP this node's replicas bind and announce: the interface named by
    ``GLOO_SOCKET_IFNAME`` (else ``NCCL_SOCKET_IFNAME``) when set, as torch.distributed and
    NCCL would use it (on multi-NIC hosts and Docker bridges Ray's pick may be another);
    otherwise the node's IP as Ray knows it."""
    environ = os.environ if environ is None else environ
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        wanted = environ.get(var, "").split(",")[0].strip()
        if wanted and not wanted.startswith("^"):  # "^docker": an exclusion, left to Ray
            ip = interface_ip(wanted.lstrip("="), exact=wanted.startswith("=") or var[0] == "G")
            if ip is None:
                raise RuntimeError(f"{var}={environ[var]!r}: no IPv4 interface of that name here")
            return ip
    import ray

    return ray.util.get_node_ip_address()


def interface_ip(name: str, exact: bool = True) -> str | None:
    """The IPv4 address of network interface ``name`` (NCCL's rule without ``exact``: the
    first interface whose name starts with it), or None (Linux)."""
    names = [n for _, n in socket.if_nameindex()]
    chosen = [n for n in names if n == name or (not exact and n.startswith(name))]
    for candidate in chosen:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", candidate[:15].encode())
                )
            except OSError:  # no IPv4 address on it
                continue
        return socket.inet_ntoa(packed[20:24])
    return None


class ReplicaHost:
    """One replica's process on a Ray node (used as ``ray.remote(ReplicaHost)``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"inflight-{name}-"))
        (self.dir / "logs").mkdir()
        self.proc: asyncio.subprocess.Process | None = None
        self._offsets: dict[str, int] = {}

    def node(self) -> dict[str, Any]:
        import ray

        return {
            "ip": node_ip(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A port free on this node a moment ago (torch.distributed's rendezvous needs a
        number before rank 0 starts; the replica binds it at once)."""
        return rendezvous_port(node_ip())

    async def start(
        self, spec: dict[str, Any], env: dict[str, str], unset: list[str], cwd: str | None
    ) -> int:
        ip = node_ip()
        workdir = cwd if cwd and os.path.isdir(cwd) else None  # noqa: ASYNC240 (one stat)
        for port in spec["inputs"].values():
            port["address"] = port["address"].replace(NODE_IP, ip)
        logs = self.dir / "logs"
        spec["log_file"] = str(logs / f"{self.name}.jsonl")
        spec["log_dir"] = str(logs)
        spec_path = self.dir / "spec.json"
        write_private(spec_path, json.dumps(spec))
        environ = {**os.environ, **env, NODE_IP_ENV: ip}
        for var in unset:
            environ.pop(var, None)
        out = open(logs / f"{self.name}.out", "ab")  # noqa: ASYNC230 (a local file)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pipeline.actor",
                str(spec_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=child_preexec(),  # dies with this actor
                cwd=workdir,
                env=environ,
            )
        finally:
            out.close()
        return self.proc.pid

    async def wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        kill_group(self.proc.pid, signal.SIGKILL)  # whatever it left behind (engines...)
        return code

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid, sig)

    def read_logs(self) -> dict[str, bytes]:
        """New whole lines of every log file in the replica's folder since the last call."""
        chunks: dict[str, bytes] = {}
        for path in sorted((self.dir / "logs").iterdir()):
            start = self._offsets.get(path.name, 0)
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(start)
                data = f.read(_MAX_CHUNK)
                end = data.rfind(b"\n") + 1
                if end:
                    chunks[path.name] = data[:end]
                    self._offsets[path.name] = start + end
        return chunks

    def cleanup(self) -> None:
        self.signal(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
