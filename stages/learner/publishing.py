"""The weight publisher as the learner's rank 0 runs it: engines, reconnects, version announces.

The publisher lives with the learner's rank 0 (it needs the gathered weights) but has its own
config section (``publish:``), its own log events (``component: publisher``, so
``inflight logs RUN_DIR --stage publisher`` shows them) and metrics. It finds
the engines from the generators' ``engines`` announcements on the control bus (or uses the URLs
given in ``publish.engines``), forms the weight group with all of them, and sends each new weight
set with ``stages.weights.WeightPublisher``. When the last bucket has landed on every engine it
announces the new version on the control bus (``version``), which is what the generators' lag
bound reads.

Every engine request carries the run's API key (``stages.engine.auth``); an engine that refuses
it fails the learner at once (``EngineAuthError``): retrying with the same key cannot succeed.
So does an engine that serves no LoRA adapters when a LoRA learner sends them as files
(``adapter_files.LoraNotServed``: started without ``--enable-lora``).

When the engine set changes (a generator restarted an engine, which then serves its initial
weights again) or a publish fails, the group is closed and formed anew before the next publish,
which then goes to every engine. A failed publish is logged and counted; training goes on and
the next publish tries again. The learner does not wait for its next step to do so: while it
waits for samples it asks ``behind()`` and, when engines lack the current weights (one was
restarted, came back, or the last publish failed: retried after 1, 2, 4 ... 30 s), sends them
again. Otherwise a run whose only engine restarted would wait forever: the engine serves stale
weights, the generator's lag bound holds its samples back, and no samples means no next step.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch

from pipeline import topics
from stages.engine.auth import engine_api_key
from stages.learner.config import PublishConfig
from stages.weights.adapter_files import AdapterFilePublisher
from stages.weights.delta import DeltaEncoder
from stages.weights.publisher import WeightPublisher, WeightPublishError

__all__ = ["Publishing"]

# what a failed publish (or group formation) raises; training goes on and the next one retries
_PUBLISH_ERRORS = (WeightPublishError, OSError, aiohttp.ClientError, TimeoutError, RuntimeError)
_RETRY_FIRST_S, _RETRY_CAP_S = 1.0, 30.0  # a failed publish is tried again after 1, 2, 4 ... s


class Publishing:
    def __init__(
        self,
        config: PublishConfig,
        ctx: Any,
        *,
        device: torch.device,
        lora: bool = False,
        model: str = "",
    ) -> None:
        self.config = config
        # LoRA adapters as peft folders loaded by name (stages.weights.adapter_files)
        self.files = lora and config.lora_transport == "files"
        self.model = model
        self._files_state: dict[str, Any] = {}  # adapters loaded and folders written so far
        self.ctx = ctx
        self.log = ctx.log.bind(component="publisher")
        self.backend = config.backend
        if self.backend == "auto":
            self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.publisher: WeightPublisher | AdapterFilePublisher | None = None
        self._connected_to: dict[str, Any] | None = None
        self.counts = {
            "published": 0,
            "failed": 0,
            "reconnects": 0,
            "group_failed": 0,
            "catch_ups": 0,  # current weights sent again between steps (see `behind`)
            "full_updates": 0,  # with publish.delta: updates sent whole
            "delta_updates": 0,  # with publish.delta: updates of the changed values only
        }
        self.seconds = 0.0
        self.version = 0
        self._connecting = asyncio.Lock()  # one group at a time, however many callers
        self._missing: set[str] = set()  # engines wanted but not answering when the group formed
        self._failed_at: float | None = None  # the last publish (or group) failed then,
        self._failed_with: dict[str, Any] = {}  # with these engines announced
        self._retry_s = _RETRY_FIRST_S
        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        self.dtype = dtype
        # delta updates: what every engine of the group holds, and when the last full went out
        self.encoder = DeltaEncoder(dtype) if config.delta else None
        self._full_at = 0

    # ---------------------------------------------------------------- engines
    def _expected(self) -> list[str]:
        names = self.config.generators
        return [f"{s}.{r}" for s in names for r in range(self.ctx.stages.get(s, 0))]

    def _announced(self) -> dict[str, Any]:
        chosen = self._expected()
        engines = self.ctx.engines
        if chosen:
            return {k: engines[k] for k in chosen if k in engines}
        return dict(engines)

    async def wait_for_engines(self, timeout_s: float) -> list[str]:
        """Engine URLs to publish to, once every expected generator has announced its own."""
        if self.config.engines:
            return list(self.config.engines)
        deadline = time.monotonic() + timeout_s
        expected = set(self._expected())
        while True:
            seen = self._announced()
            if seen and (not expected or expected <= set(seen)):
                return _urls(seen)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no engines announced within {timeout_s} s (waiting for "
                    f"{sorted(expected) or 'any generator'}; got {sorted(seen)})"
                )
            try:
                await asyncio.wait_for(self.ctx.wait_for_engines(dict(self.ctx.engines)), left)
            except asyncio.TimeoutError:
                continue

    async def connect(self) -> bool:
        """Form the weight group now (before the first publish needs it); False on failure.

        A failure is logged and counted like a failed publish; the next publish tries again.
        """
        try:
            await self._ensure_connected()
        except _PUBLISH_ERRORS as exc:
            self.counts["group_failed"] += 1
            self._failed()
            self.log.warning("weight_group_failed", error=str(exc), retry="at the next publish")
            return False
        return True

    async def behind(self) -> str | None:
        """Why the engines should get the current weights again now; None when they have them.

        ``publish_failed``: the last publish or group failed (asked again after a backoff);
        ``engines_changed``: an engine was restarted or a generator announced other engines;
        ``engine_back``: an engine that did not answer when the group formed answers now.
        """
        wanted = self._wanted()
        if self._failed_at is not None:
            if wanted != self._failed_with:  # new engines announced since: no need to wait
                return "engines_changed"
            due = time.monotonic() - self._failed_at >= self._retry_s
            return "publish_failed" if due else None
        if self.publisher is None:
            return None  # never connected: the first publish forms the group
        if wanted != self._connected_to:
            return "engines_changed"
        for url in sorted(self._missing):
            if await _healthy(url):
                return "engine_back"
        return None

    def _failed(self) -> None:
        if self._failed_at is not None:
            self._retry_s = min(self._retry_s * 2, _RETRY_CAP_S)
        self._failed_at, self._failed_with = time.monotonic(), self._wanted()

    def urls(self) -> list[str]:
        """The engines as announced now (or as configured)."""
        return list(self.config.engines) or _urls(self._announced())

    def _wanted(self) -> dict[str, Any]:
        return {"urls": self.config.engines} if self.config.engines else self._announced()

    async def _ensure_connected(self) -> WeightPublisher | AdapterFilePublisher:
        async with self._connecting:
            return await self._connect()

    async def _connect(self) -> WeightPublisher | AdapterFilePublisher:
        wanted = self._wanted()
        if self.publisher is not None and wanted == self._connected_to and not self._missing:
            return self.publisher
        if self.encoder is not None:  # engines that may hold anything: full next
            self.encoder.reset()
        if self.publisher is not None:
            self.counts["reconnects"] += 1
            self.log.info("weight_group_reconnect", reason="engines changed")
            await self.publisher.close()
            self.publisher = None
        everyone = list(self.config.engines) or _urls(wanted)
        urls = [u for u in everyone if await _healthy(u)]
        if not urls:
            raise WeightPublishError("no engine answers /health")
        missing = set(everyone) - set(urls)
        if missing:
            self.log.warning(
                "weight_group_partial", missing=sorted(missing), retry="when they answer"
            )
        publisher = (
            self._adapter_files(urls)
            if self.files
            else WeightPublisher(
                urls,
                backend=self.backend,
                # engines on other nodes reach rank 0 at its node's IP (the Ray launcher's)
                master_address=os.environ.get("INFLIGHT_NODE_IP", "127.0.0.1"),
                bucket_mb=self.config.bucket_mb,
                group_name=f"inflight_{int(time.time() * 1000) % 10**9}",
                log=self.log,
                timeout_s=self.config.timeout_s,
                api_key=engine_api_key(self.ctx),
            )
        )
        try:
            await publisher.connect()
        except BaseException:
            await publisher.close()
            raise
        self.publisher, self._connected_to, self._missing = publisher, wanted, missing
        return publisher

    # ---------------------------------------------------------------- publish
    async def publish(self, weights: Any, version: int) -> bool:
        """Send ``weights`` as ``version`` to every engine, then announce it; False on failure."""
        started = time.perf_counter()
        try:
            publisher = await self._ensure_connected()
            weights, base = self._encoded(weights, version)
            stats = await publisher.publish(weights, version, base_version=base)
        except _PUBLISH_ERRORS as exc:
            self.counts["failed"] += 1
            self._failed()
            if self.encoder is not None:  # engines may hold part of it: full next
                self.encoder.reset()
            self.log.error(
                "publish_failed",
                policy_version=version,
                error=str(exc),
                retry_in_s=self._retry_s,
            )
            if self.publisher is not None:
                await self.publisher.close()
                self.publisher = None
            return False
        self.version = version
        self._failed_at, self._retry_s = None, _RETRY_FIRST_S
        self.counts["published"] += 1
        self.seconds += time.perf_counter() - started
        # every engine named has loaded it: publish() returns once they all have
        announce = getattr(publisher, "announce", {})  # adapter files: the adapter's name
        await self.ctx.publish(
            topics.VERSION,
            {"version": version, "engines": list(publisher.engine_urls), **announce},
        )
        self.log.debug(  # every publish: the totals are in learner_done and summary.json
            "metrics",
            policy_version=version,
            publish_s=round(stats.seconds, 4),
            gb_per_s=round(stats.gb_per_s, 3),
            **self.counts,
        )
        return True

    def _encoded(self, weights: Any, version: int) -> tuple[Any, int | None]:
        """``weights`` as they travel (cast to ``dtype``; with ``delta``, only what changed
        since the version the engines hold), and that version (None: a full update)."""
        encoder = self.encoder
        if encoder is None:
            if self.dtype is None:
                return weights, None
            return _mapped(weights, lambda group: _cast(group, self.dtype)), None
        full = (
            not encoder.ready
            or version <= self.version  # the same version again: someone lacks it
            or version - self._full_at >= self.config.full_every
        )
        if full:
            self._full_at = version
            self.counts["full_updates"] += 1
        else:
            self.counts["delta_updates"] += 1
        encoded = _mapped(weights, lambda group: encoder.encode(group, full=full))
        return encoded, None if full else self.version

    def _adapter_files(self, urls: list[str]) -> AdapterFilePublisher:
        folder = self.config.adapter_dir or str(self.ctx.run_dir / "adapters")
        return AdapterFilePublisher(
            urls,
            Path(folder),
            base=self.model,
            timeout_s=self.config.timeout_s,
            api_key=engine_api_key(self.ctx),
            log=self.log,
            state=self._files_state,
        )

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None


def _mapped(weights: Any, fn: Any) -> Any:
    """``fn`` over each group of a weight source (named tensors, or a callable of groups)."""
    if callable(weights):
        return lambda: (fn(group) for group in weights())
    return fn(weights)


def _cast(named: Any, dtype: torch.dtype) -> Any:
    return ((name, t.to(dtype) if t.is_floating_point() else t) for name, t in named)


def _urls(announced: Mapping[str, Any]) -> list[str]:
    urls: list[str] = []
    for key in sorted(announced):
        for url in announced[key].get("urls", []):
            if url not in urls:
                urls.append(url)
    return urls


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(url.rstrip("/") + "/health") as resp:
                return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
