"""A new engine's weights from a running one: SGLang 0.5.23's remote-instance weight loading.

An engine started with ``--load-format remote_instance`` (and the seed's address: SGLang's
``--remote-instance-weight-loader-seed-instance-ip``, ``...-service-port`` and
``...-send-weights-group-ports``) takes its weights from a running engine, the seed, instead of
its checkpoint: in RL, an engine added to a running job (or restarted) starts on the policy the
others serve, not on the checkpoint's. The exchange is SGLang's
(``model_loader/loader.py: load_model_from_remote_instance_by_nccl``,
``remote_instance_weight_loader_utils.py``, ``connector/remote_instance.py``,
``model_runner_components/weight_exporter.py``):

1. the new engine asks the seed to ``POST /init_weights_send_group_for_remote_instance``
   (``master_address`` the seed's address, ``ports`` a port per tensor-parallel rank,
   ``group_rank`` 0, ``world_size`` 2, ``group_name`` ``send_weights_<its own address>``) and
   joins that group as rank 1 itself; the group's name is ``<group_name>_<port>_<tp_rank>`` on
   both sides, and both meet at a barrier;
2. it asks the seed to ``POST /send_weights_to_remote_instance``; the seed broadcasts every
   parameter (``named_parameters``, in order) from rank 0 and destroys its side of the group;
   the new engine receives them into its own parameters and destroys its side.

Between built-in engines only: SGLang's model classes fuse and order their parameters
differently (``qkv_proj``, ``gate_up_proj``), so a SGLang instance and a built-in one cannot
load from each other. Both must serve the same model (config) in the same dtype, as SGLang
requires: a parameter of another size breaks the collective (gloo aborts the receiving
process), one of the same size in another dtype would be read as garbage.

Where this engine differs: the group's backend follows the device (``gloo`` on CPU, where
``nccl`` cannot run; SGLang's loader always asks for ``nccl``; ``--remote-instance-weight-loader-
backend gloo`` asks for gloo on a GPU too, for two engines on one GPU), the seed sends from a worker
thread while it goes on decoding (SGLang's scheduler stops for it), refuses a ``group_rank``
other than 0 (the sender broadcasts from rank 0: another rank would have its own weights
overwritten), and answers the send with its ``weight_version`` as well, which the new engine
takes as its own (SGLang's starts at its ``--weight-version``).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from stages.weights.group import WeightGroup, init_weight_group

__all__ = ["RemoteLoadError", "RemoteSeed", "SendGroups", "load_from_seed"]

log = structlog.get_logger("stages.engine.remote_instance")

TP_RANK = 0  # this engine runs its model on one device: tensor-parallel rank 0 of 1
TP_SIZE = 1
GROUP_PREFIX = "send_weights_"  # SGLang's group name: send_weights_<the new instance's address>


class RemoteLoadError(RuntimeError):
    """The weights could not be taken from the seed instance (what went wrong, and where)."""


def _host_port(host: str, port: int | str) -> str:
    """``host:port``, an IPv6 literal in brackets (SGLang's ``NetworkAddress.to_host_port_str``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _port_of(ports: str) -> int:
    """This rank's port of ``ports`` (a port per tensor-parallel rank, comma-separated);
    ValueError in SGLang's words when they are not one per rank."""
    found = ports.split(",")
    if len(found) != TP_SIZE:
        raise ValueError(f"Expected {TP_SIZE} ports, but got {len(found)} ports.")
    try:
        port = int(found[TP_RANK])
    except ValueError:
        raise ValueError(f"ports: {found[TP_RANK]!r} is not a port number") from None
    if not 0 < port < 65536:
        raise ValueError(f"ports: {port} is not a port number")
    return port


def _full_name(group_name: str, ports: str) -> tuple[str, int]:
    """The name both ranks give the group (``<group_name>_<port>_<tp_rank>``, SGLang's) and
    this rank's port; ValueError in SGLang's words for an empty name or ports not one a rank."""
    if not group_name:
        raise ValueError("Group name cannot be empty")
    port = _port_of(ports)
    return f"{group_name}_{port}_{TP_RANK}", port


def _staged(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """What goes into the collective for ``tensor``: itself where the backend moves it as it
    is, else a contiguous (and, for gloo, host) copy."""
    if backend == "gloo" and tensor.device.type != "cpu":
        return tensor.detach().to("cpu", copy=True).contiguous()
    return tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()


class SendGroups:
    """The seed's side: the groups it sends its weights to new instances through, by name.

    ``init`` and ``send`` block (on a collective with the other rank): call them from a worker
    thread. Each answers SGLang's ``(success, message)``."""

    def __init__(self, device: torch.device, timeout_s: float = 300) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.groups: dict[str, tuple[WeightGroup, str]] = {}  # name -> (group, backend)
        self._lock = threading.Lock()

    def init(
        self,
        master_address: str,
        ports: str,
        group_rank: int,
        world_size: int,
        group_name: str = "weight_send_group",
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        try:
            name, port = _full_name(group_name, ports)
        except ValueError as exc:
            return False, str(exc)
        if group_rank != 0:
            return False, (
                f"group_rank: the instance that sends its weights is rank 0 of the group, got "
                f"{group_rank}"
            )
        if backend not in ("nccl", "gloo"):
            return False, f"Failed to init group: backend {backend!r}: expected nccl or gloo."
        if backend == "nccl" and self.device.type != "cuda":
            return False, (
                f"Failed to init group: backend nccl needs an engine on a CUDA device; this one "
                f"runs on {self.device.type} (ask for gloo)."
            )
        with self._lock:
            if name in self.groups:
                return False, f"Failed to init group: group {name} is already initialized."
        where = _host_port(master_address, port)
        try:
            group = init_weight_group(
                backend=backend,
                master_address=master_address,
                master_port=port,
                rank=group_rank,
                world_size=world_size,
                group_name=name,
                timeout_s=self.timeout_s,
            )
            group.barrier(self.device if backend == "nccl" else None)
        except Exception as exc:
            log.error("remote_instance_group_failed", group=name, error=repr(exc))
            return False, f"Failed to init group: {exc}."
        with self._lock:
            self.groups[name] = (group, backend)
        log.info("remote_instance_group_ready", group=name, master=where, backend=backend)
        return True, f"Succeeded to init group through {where} group."

    def known(self, ports: str, group_name: str) -> tuple[str | None, str]:
        """The full name of the group ``send`` would use and, when there is none, why."""
        try:
            name, _ = _full_name(group_name, ports)
        except ValueError as exc:
            return None, str(exc)
        with self._lock:
            if name not in self.groups:
                return None, (
                    f"Group {name} not in _weights_send_group list. Please call "
                    "`init_weights_send_group_for_remote_instance` first."
                )
        return name, ""

    def send(
        self, name: str, master_address: str, tensors: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[bool, str]:
        """Broadcast ``tensors`` (the model's ``named_parameters``) through group ``name`` (from
        ``known``), then destroy it, whatever happened."""
        with self._lock:
            group, backend = self.groups.pop(name)
        port = name.rsplit("_", 2)[-2]
        started = time.monotonic()
        sent = 0
        try:
            for _, tensor in tensors:
                group.broadcast(_staged(tensor, backend), src=0)
                sent += tensor.numel() * tensor.element_size()
            ok = True
            where = _host_port(master_address, port)
            message = f"Succeeded to send weights through {where} {name}."
        except Exception as exc:
            log.error("remote_instance_send_failed", group=name, error=repr(exc))
            ok, message = False, f"Failed to send weights: {exc}."
        finally:
            group.destroy()
        if ok:
            log.info(
                "remote_instance_weights_sent",
                group=name,
                tensors=len(tensors),
                bytes=sent,
                seconds=round(time.monotonic() - started, 3),
            )
        return ok, message

    def drop(self, name: str) -> None:
        """Destroy group ``name`` without sending (the other rank's receive then fails)."""
        with self._lock:
            found = self.groups.pop(name, None)
        if found is not None:
            found[0].destroy()

    def close(self) -> None:
        with self._lock:
            groups, self.groups = list(self.groups.values()), {}
        for group, _ in groups:
            group.destroy()


# ------------------------------------------------------------------------------ the new engine
@dataclass(frozen=True)
class RemoteSeed:
    """The running engine a new one takes its weights from (SGLang's
    ``--remote-instance-weight-loader-*`` flags)."""

    ip: str
    service_port: int
    group_ports: tuple[int, ...]
    api_key: str | None = None  # the seed's, if it requires one
    backend: str = "nccl"  # the group's: nccl on a GPU (gloo on CPU), or gloo

    @property
    def url(self) -> str:
        return f"http://{_host_port(self.ip, self.service_port)}"


def _own_address() -> str:
    """This host's address, as SGLang names the new instance's group (the host name resolved)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Call:
    """``POST seed/route`` on a thread of its own: the seed answers once the collective it
    joins has run, which this process must run meanwhile."""

    def __init__(self, seed: RemoteSeed, route: str, body: dict[str, Any], timeout_s: float):
        self.route = route
        self.answer: dict[str, Any] | None = None
        self.error: str | None = None
        headers = {"Content-Type": "application/json"}
        if seed.api_key:
            headers["Authorization"] = f"Bearer {seed.api_key}"
        self._request = urllib.request.Request(
            seed.url + route, json.dumps(body).encode(), headers, method="POST"
        )
        self._timeout = timeout_s
        self.thread = threading.Thread(target=self._run, name="engine-remote-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=self._timeout) as response:
                self.answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                self.answer = json.loads(exc.read())
            except ValueError:
                self.error = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            self.error = repr(exc)

    def failed(self) -> str | None:
        """Why the seed refused (None: it has not answered, or it succeeded)."""
        if self.thread.is_alive():
            return None
        if self.error is not None:
            return f"{self.route} could not be called: {self.error}"
        answer = self.answer or {}
        if answer.get("success") is True:
            return None
        message = answer.get("message") or answer.get("error") or answer
        return f"{self.route} answered: {message}"

    def result(self, timeout: float) -> dict[str, Any]:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RemoteLoadError(f"the seed did not answer {self.route} in {timeout:.0f} s")
        refused = self.failed()
        if refused is not None:
            raise RemoteLoadError(refused)
        return self.answer or {}


def _join(
    seed: RemoteSeed, backend: str, name: str, device: torch.device, init: _Call, timeout_s: float
) -> WeightGroup:
    """Join the seed's group as rank 1 while ``init`` asks the seed to host it; raises as soon
    as the seed refuses (its answer comes before any rank would join)."""
    out: dict[str, Any] = {}

    def join() -> None:
        try:
            group = init_weight_group(
                backend=backend,
                master_address=seed.ip,
                master_port=seed.group_ports[TP_RANK],
                rank=1,
                world_size=2,
                group_name=name,
                timeout_s=timeout_s,
            )
            group.barrier(device if backend == "nccl" else None)
            out["group"] = group
        except Exception as exc:
            out["error"] = exc

    joiner = threading.Thread(target=join, name="engine-remote-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.05)
        refused = init.failed()
        if refused is not None and joiner.is_alive():
            raise RemoteLoadError(f"no weight group with the seed instance {seed.url}: {refused}")
    if "error" in out:
        refused = init.failed()
        raise RemoteLoadError(
            f"joining the seed's group at {_host_port(seed.ip, seed.group_ports[TP_RANK])} "
            f"failed: {out['error']}" + (f" ({refused})" if refused else "")
        )
    return out["group"]


def load_from_seed(
    model: torch.nn.Module, seed: RemoteSeed, device: torch.device, timeout_s: float = 300
) -> str | None:
    """Receive ``model``'s parameters from ``seed`` (``named_parameters``, in order, into their
    storage); returns the seed's weight version (None: it named none). Raises RemoteLoadError."""
    if len(seed.group_ports) != TP_SIZE:
        raise RemoteLoadError(
            f"--remote-instance-weight-loader-send-weights-group-ports: expected {TP_SIZE} port "
            f"(one per tensor-parallel rank), got {len(seed.group_ports)}"
        )
    backend = "nccl" if device.type == "cuda" and seed.backend == "nccl" else "gloo"
    client = _own_address()
    group_name = f"{GROUP_PREFIX}{client}"
    ports = ",".join(str(p) for p in seed.group_ports)
    name, _ = _full_name(group_name, ports)
    started = time.monotonic()
    init = _Call(
        seed,
        "/init_weights_send_group_for_remote_instance",
        {
            "master_address": seed.ip,
            "ports": ports,
            "group_rank": 0,
            "world_size": 2,
            "group_name": group_name,
            "backend": backend,
        },
        timeout_s,
    )
    group = _join(seed, backend, name, device, init, timeout_s)
    try:
        init.result(timeout_s)
        log.info("remote_instance_group_joined", seed=seed.url, group=name, backend=backend)
        send = _Call(
            seed,
            "/send_weights_to_remote_instance",
            {"master_address": seed.ip, "ports": ports, "group_name": group_name},
            timeout_s,
        )
        received = 0
        with torch.no_grad():
            for pname, param in model.named_parameters():
                staged = param.data
                copy = backend == "gloo" and staged.device.type != "cpu"
                if copy or not staged.is_contiguous():
                    staged = torch.empty(
                        param.shape,
                        dtype=param.dtype,
                        device=("cpu" if backend == "gloo" else staged.device),
                    )
                try:
                    group.broadcast(staged, src=0)
                except Exception as exc:
                    send.thread.join(5)  # the seed's answer says why, when it refused
                    refused = send.failed()
                    raise RemoteLoadError(
                        f"receiving {pname} from the seed failed: {exc}"
                        + (f" ({refused})" if refused else "")
                    ) from None
                if staged is not param.data:
                    param.data.copy_(staged)
                received += param.numel() * param.element_size()
        answer = send.result(timeout_s)
    finally:
        group.destroy()
    version = answer.get("weight_version")
    log.info(
        "weights_from_remote_instance",
        seed=seed.url,
        group=name,
        backend=backend,
        bytes=received,
        seconds=round(time.monotonic() - started, 3),
        weight_version=version,
    )
    return None if version is None else str(version)
