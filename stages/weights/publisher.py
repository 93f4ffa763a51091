"""The learner side of weight publishing: announce buckets over HTTP, broadcast them as rank 0.

``WeightPublisher`` speaks SGLang's weight-update API to every engine (a real SGLang server or the
built-in engine). ``connect()`` asks each engine to join the weight group
(``POST /init_weights_update_group``, engine ``i`` at ``rank_offset = 1 + i``) while this process
joins as rank 0 in a thread: rank 0 hosts the rendezvous store and waits for everyone, so neither
side can go first. ``publish()`` then sends the weights bucket by bucket: for each bucket it POSTs
``/update_weights_from_distributed`` to every engine, broadcasts in a thread, and awaits all the
answers (an engine answers once it has loaded the bucket). The version is live when the last
bucket has landed: for weights given as a list (their buckets counted before the first is sent),
the last bucket's request carries it (SGLang's ``weight_version`` field: the engine sets it once
that bucket is loaded), else a ``POST /update_weight_version`` follows the last bucket, one more
round trip on the way of every update (the weights arrive through a callable, a ZeRO-3 gather, whose
buckets are known only as they come).

Blocking collectives run in daemon threads, so a broadcast stuck on a dead engine can neither
block the event loop nor keep the process alive at exit; it ends at the group's ``timeout_s``.
After a failed bucket the group is out of step with the engines and the publisher refuses to
publish again: ``close()`` and ``connect()`` anew.

With ``api_key`` every request carries ``Authorization: Bearer KEY``; an engine that refuses it
(401/403) raises ``stages.engine.auth.EngineAuthError``, which is not a ``WeightPublishError``:
no later try can succeed, so callers that retry failed publishes must not catch it.

Each update is framed as SGLang 0.5.23 wants it (``stages.weights.update_frame``): inside a
weight-update session (``/begin_weight_update`` ... ``/end_weight_update``), and on a SGLang engine
between ``pause_generation`` ``mode: in_place`` and ``continue_generation``, without which SGLang
waits for every request in flight to end before each update (the built-in engine, which loads
buckets between decode steps while its requests go on, is not paused; ``pause`` overrides).
The frame opens while the first bucket is packed, and closes after ``publish`` has returned
(the weights are loaded by then): the next update, ``settled()`` or ``close()`` waits for it.

It does not gather ZeRO-3 shards itself (pass a callable yielding gathered groups), retry, or
flush the engines' caches (``flush_cache`` is always false: in-flight updates keep the cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import structlog
import torch

from stages.engine.auth import EngineAuthError, auth_headers
from stages.weights.buckets import (
    Bucket,
    StagingBuffer,
    dtype_name,
    group_by_size,
    pack_buckets,
)
from stages.weights.daemon_thread import in_daemon_thread
from stages.weights.group import WeightGroup, init_weight_group
from stages.weights.receiver import LOAD_FORMATS
from stages.weights.update_frame import UpdateFrame
from transport.address import rendezvous_port

__all__ = ["PublishStats", "WeightPublishError", "WeightPublisher", "WeightSource"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# Either the named tensors themselves, or a callable returning groups of them: each group is fully
# packed and sent before the next is requested, so a ZeRO-3 learner can gather one group at a time.
WeightSource = NamedTensors | Callable[[], Iterable[NamedTensors]]

T = TypeVar("T")


class WeightPublishError(RuntimeError):
    """An engine refused or failed a weight-group request, or the group itself failed."""


@dataclass(frozen=True)
class PublishStats:
    version: int
    buckets: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightPublisher:
    """Rank 0 of the weight group, announcing and broadcasting weights to ``engine_urls``."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "inflight_weights",
        bucket_mb: float = 64,
        load_format: str | None = "flattened_bucket",
        log: Any = None,
        timeout_s: float = 300,
        api_key: str | None = None,
        pause: bool | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("WeightPublisher needs at least one engine URL")
        if load_format not in LOAD_FORMATS:
            raise ValueError(
                f"unknown load_format {load_format!r}: expected one of {list(LOAD_FORMATS)}"
            )
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.engine_urls = [url.rstrip("/") for url in engine_urls]
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.load_format = load_format
        # Bounds every wait: group rendezvous, each collective, each HTTP request.
        self.timeout_s = timeout_s
        self.log = log if log is not None else structlog.get_logger("weights")
        self._has_key = bool(api_key)
        self._headers = auth_headers(api_key)
        self._session: aiohttp.ClientSession | None = None
        self._group: WeightGroup | None = None
        self._broken: str | None = None
        # Two packing buffers of bucket_mb, reused: one on the wire while the next is packed.
        self._staging = StagingBuffer(slots=2)
        # A collective abandoned after a failure; the group may only be destroyed once it ends.
        self._stray: asyncio.Future[Any] | None = None
        self._base: int | None = None  # the publish in progress is a delta against this
        # the calls around each update: SGLang's session, a pause in place (update_frame.py)
        self._pause = pause
        self._frame: UpdateFrame | None = None
        # the frame's opening, awaited before the first bucket goes out (packing goes on
        # meanwhile), and the last update's closing, awaited before the next update opens
        self._opening: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    @property
    def world_size(self) -> int:
        # Tensor parallelism 1 per engine: one rank each after the publisher's rank 0.
        return 1 + len(self.engine_urls)

    async def connect(self) -> None:
        """Form the weight group with every engine; raises naming the engine that failed."""
        if self._group is not None:
            raise RuntimeError(f"already connected to weight group {self.group_name!r}")
        port = self.master_port or rendezvous_port(self.master_address)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self._headers
        )
        self._broken = None
        started = time.perf_counter()
        rank0 = in_daemon_thread(
            lambda: init_weight_group(
                backend=self.backend,
                master_address=self.master_address,
                master_port=port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            ),
            name="weight-group-rank0",
            discard=WeightGroup.destroy,
        )
        posts = [
            self._post(
                url,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": self.world_size,
                    "group_name": self.group_name,
                    "backend": self.backend,
                },
            )
            for i, url in enumerate(self.engine_urls)
        ]
        try:
            await self._all_or_first_error(posts, rank0, what="joining the weight group")
        except BaseException:
            # Should rank 0's group still form after all, it is of no use: release it then.
            rank0.add_done_callback(_destroy_group_result)
            raise
        self._group = rank0.result()
        self._frame = UpdateFrame(self.engine_urls, self._exchange, pause=self._pause, log=self.log)
        await self._frame.learn()
        self.log.info(
            "weight_group_connected",
            group_name=self.group_name,
            master_port=port,
            world_size=self.world_size,
            engines=len(self.engine_urls),
            paused_for_updates=len(self._frame.pausing),
            seconds=round(time.perf_counter() - started, 3),
        )

    async def publish(
        self, weights: WeightSource, version: int, *, base_version: int | None = None
    ) -> PublishStats:
        """Send all ``weights`` to every engine as ``version``; returns once all have loaded it.

        ``base_version``: the weights are a delta (``stages.weights.delta``) against that
        version, which an engine then refuses unless it holds it (built-in engines only)."""
        group = self._usable_group()
        frame = self._frame
        assert frame is not None
        await self._closed()
        self._base = base_version
        started = time.perf_counter()
        self._opening = asyncio.ensure_future(frame.begin())
        try:
            buckets, nbytes = await self._send_all(group, weights, version)
            await self._opened()
        except BaseException:
            with contextlib.suppress(Exception):
                await self._opened()
            await frame.end(failed=True)
            raise
        # sessions ended and engines resumed while the caller goes on: the version is live
        self._closing = asyncio.ensure_future(frame.end())
        stats = PublishStats(
            version=version, buckets=buckets, bytes=nbytes, seconds=time.perf_counter() - started
        )
        self.log.debug(  # every publish: the learner's train_step has publish_s
            "weights_published",
            policy_version=version,
            buckets=buckets,
            bytes=nbytes,
            seconds=round(stats.seconds, 4),
            gb_per_s=round(stats.gb_per_s, 3),
            engines=len(self.engine_urls),
        )
        return stats

    async def _opened(self) -> None:
        """The frame of the update in progress is open (its error raised here)."""
        opening, self._opening = self._opening, None
        if opening is not None:
            await opening

    async def settled(self) -> None:
        """Wait until the last update's frame is closed: its sessions ended, the engines it
        paused resumed (``publish`` returns once the weights are loaded, before that)."""
        await self._closed()

    async def _closed(self) -> None:
        """The last update's frame is closed; what went wrong there is logged (the next
        frame recovers from it: a session left open is closed and opened again)."""
        closing, self._closing = self._closing, None
        if closing is None:
            return
        try:
            await closing
        except Exception as exc:
            self.log.error("weight_update_frame_not_closed", error=repr(exc))

    async def _send_all(
        self, group: WeightGroup, weights: WeightSource, version: int
    ) -> tuple[int, int]:
        """Every bucket, then the version where no bucket carried it: (buckets, bytes)."""
        groups: Iterable[NamedTensors] = weights() if callable(weights) else [weights]
        # The version goes live once every bucket has landed: tokens decoded while buckets were
        # still arriving keep the old version, which only overstates their lag. Known buckets:
        # the last one carries it.
        total = (
            sum(1 for _ in group_by_size(weights, self.bucket_bytes))
            if isinstance(weights, Sequence)
            else None
        )
        buckets = nbytes = 0
        if self.load_format == "flattened_bucket":
            buckets, nbytes = await self._publish_flattened(group, groups, version, total)
        else:
            for named_tensors in groups:
                for chunk in group_by_size(self._on_wire_device(named_tensors), self.bucket_bytes):
                    tensors = [t.detach().contiguous() for _, t in chunk]
                    buckets += 1
                    await self._send(
                        group,
                        [name for name, _ in chunk],
                        [dtype_name(t.dtype) for t in tensors],
                        [list(t.shape) for t in tensors],
                        tensors,
                        version,
                        live=buckets == total,
                    )
                    nbytes += sum(t.numel() * t.element_size() for t in tensors)
        if not buckets or buckets != total:
            await self._opened()
            await asyncio.gather(
                *(
                    self._post(
                        url,
                        "/update_weight_version",
                        # SGLang's default aborts every request: in-flight updates must not
                        {"new_version": str(version), "abort_all_requests": False},
                    )
                    for url in self.engine_urls
                )
            )
        return buckets, nbytes

    async def _publish_flattened(
        self,
        group: WeightGroup,
        groups: Iterable[NamedTensors],
        version: int,
        total: int | None,
    ) -> tuple[int, int]:
        def all_buckets() -> Iterator[Bucket]:
            for named_tensors in groups:
                yield from pack_buckets(
                    self._on_wire_device(named_tensors), self.bucket_bytes, staging=self._staging
                )

        packer = all_buckets()
        # The source is advanced (and packed) in a worker thread, one bucket ahead of the wire.
        ahead = in_daemon_thread(lambda: next(packer, None), name="weight-pack")
        buckets = nbytes = 0
        try:
            while (bucket := await ahead) is not None:
                ahead = in_daemon_thread(lambda: next(packer, None), name="weight-pack")
                buckets += 1
                await self._send(
                    group,
                    bucket.names,
                    bucket.dtypes,
                    bucket.shapes,
                    [bucket.flat],
                    version,
                    live=buckets == total,
                )
                nbytes += bucket.nbytes
        except BaseException:
            # Leave the source at rest before handing the failure on (the packer may be inside
            # the learner's gather); bounded, and its own error is secondary to this one.
            await asyncio.wait([ahead], timeout=self.timeout_s)
            if ahead.done() and not ahead.cancelled():
                ahead.exception()
            raise
        return buckets, nbytes

    def _on_wire_device(self, named_tensors: NamedTensors) -> NamedTensors:
        """gloo sends CPU memory: GPU weights are staged through CPU (one GPU shared by the
        learner and an engine, where NCCL cannot be used, falls back to gloo this way)."""
        if self.backend != "gloo":
            return named_tensors
        return ((name, t.cpu() if t.is_cuda else t) for name, t in named_tensors)

    async def close(self) -> None:
        """Leave the weight group and close HTTP; always releases both (idempotent)."""
        group, self._group = self._group, None
        frame, self._frame = self._frame, None
        try:
            await self._closed()
            if frame is not None and (frame.open or frame.paused) and self._session is not None:
                await frame.end(failed=True)  # an update cut short: no engine left paused
        finally:
            session, self._session = self._session, None
        try:
            self._staging = StagingBuffer(slots=2)
            if group is not None:
                if self._stray is not None and not self._stray.done():
                    # Destroying a group under a running collective can crash the process.
                    self._stray.add_done_callback(lambda _: group.destroy())
                else:
                    group.destroy()
        finally:
            if session is not None:
                await session.close()

    async def _send(
        self,
        group: WeightGroup,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        tensors: list[torch.Tensor],
        version: int,
        *,
        live: bool = False,
    ) -> None:
        """One bucket to every engine; ``live``: the last, which makes ``version`` current."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.group_name,
            "flush_cache": False,
            "load_format": self.load_format,
        }
        if live:
            payload["weight_version"] = str(version)
        if self._base is not None:
            payload["base_version"] = str(self._base)
        await self._opened()
        # The POSTs go out first; each engine then blocks in its side of the broadcast.
        route = "/update_weights_from_distributed"
        posts = [self._post(url, route, payload) for url in self.engine_urls]

        def broadcast() -> None:
            for tensor in tensors:
                group.broadcast(tensor, src=0)

        bcast = in_daemon_thread(broadcast, name="weight-broadcast")
        try:
            await self._all_or_first_error(
                posts, bcast, what=f"publishing version {version} ({len(names)} tensors)"
            )
        except BaseException as exc:
            self._broken = f"publishing version {version} failed: {exc!r}"
            if not bcast.done():
                self._stray = bcast
                # Its eventual timeout error has no one left to read it.
                bcast.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    async def _all_or_first_error(
        self, posts: list[Any], thread: asyncio.Future[T], *, what: str
    ) -> None:
        """Await the engines' answers and rank 0's collective; raise at the first failure."""
        tasks = [asyncio.ensure_future(p) for p in posts]
        pending: set[asyncio.Future[Any]] = {*tasks, thread}
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=self.timeout_s, return_when=asyncio.FIRST_EXCEPTION
                )
                if not done:
                    raise WeightPublishError(
                        f"{what}: no progress within timeout_s={self.timeout_s}s "
                        f"({len(pending)} of {len(tasks) + 1} parties still pending)"
                    )
                # Engine answers name the culprit; report them before rank 0's own error.
                for fut in sorted(done, key=lambda f: f is thread):
                    if fut.exception() is not None:
                        exc = fut.exception()
                        if fut is thread:
                            raise WeightPublishError(f"{what}: rank 0 failed: {exc}") from exc
                        raise exc
        finally:
            for task in tasks:
                task.cancel()

    async def _exchange(
        self, url: str, method: str, route: str, payload: dict[str, Any] | None
    ) -> tuple[int, dict[str, Any] | None]:
        """One HTTP call: (status, the answer as a JSON object, or None)."""
        status, body, _ = await self._request(url, method, route, payload)
        return status, body

    async def _request(
        self, url: str, method: str, route: str, payload: dict[str, Any] | None
    ) -> tuple[int, dict[str, Any] | None, str]:
        assert self._session is not None
        try:
            async with self._session.request(method, url + route, json=payload) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WeightPublishError(f"engine {url}: {method} {route} failed: {exc!r}") from exc
        if status in (401, 403):
            raise EngineAuthError(url, status, sent=self._has_key, what=f"{method} {route}")
        try:
            return status, _json_object(text), text
        except ValueError:
            return status, None, text

    async def _post(self, url: str, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        status, body, text = await self._request(url, "POST", route, payload)
        if status != 200 or body is None or body.get("success") is not True:
            message = body.get("message") if body else text[:500]
            raise WeightPublishError(
                f"engine {url}: POST {route} answered HTTP {status}, success="
                f"{body.get('success') if body else None}: {message}"
            )
        return body

    def _usable_group(self) -> WeightGroup:
        if self._group is None:
            raise RuntimeError("not connected: await WeightPublisher.connect() first")
        if self._broken is not None:
            raise WeightPublishError(
                f"weight group {self.group_name!r} is out of step with the engines "
                f"({self._broken}); close() and connect() again"
            )
        return self._group


def _json_object(text: str) -> dict[str, Any]:
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body


def _destroy_group_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), WeightGroup):
        fut.result().destroy()
