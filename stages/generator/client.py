"""An HTTP client for inference engines that speak SGLang's API (SGLang or ``inflight engine``).

One client per engine URL, sharing an aiohttp session. It turns a ``/generate`` response into a
:class:`Completion` (token ids, sampler log-probs, per-token policy versions, finish reason) and
sorts failures into retryable ones (connection lost, timeouts, 5xx: the generator re-routes the
request to another engine) and final ones (4xx: the request itself is bad).

Per-token versions: the built-in engine reports ``meta_info.output_token_weight_versions``; an
engine that reports only ``meta_info.weight_version`` (the version when the request finished) gets
that version for every token, which overstates freshness only for sequences that spanned an
update. Not here: launching engines (``launcher``) and choosing one (``stage``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

__all__ = ["Completion", "EngineClient", "EngineError"]


class EngineError(Exception):
    """A failed engine call; ``retryable`` says whether another try (or engine) may succeed."""

    def __init__(self, url: str, message: str, *, retryable: bool, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.retryable, self.status = url, retryable, status


@dataclass
class Completion:
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per output token
    versions: np.ndarray  # int32, one per output token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    meta: dict[str, Any]


def _as_version(value: Any) -> int:
    """SGLang carries weight versions as strings; Inflight's are integers."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_completion(body: Mapping[str, Any], url: str = "") -> Completion:
    """A ``/generate`` response (one prompt) as a Completion; EngineError if malformed."""
    try:
        output_ids = np.asarray(body["output_ids"], dtype=np.int32)
        meta = dict(body["meta_info"])
        pairs = meta.get("output_token_logprobs") or []
        logprobs = np.asarray([p[0] for p in pairs], dtype=np.float32)
        reason = meta.get("finish_reason") or {}
        finish = reason.get("type", "unknown") if isinstance(reason, Mapping) else str(reason)
        version = _as_version(meta.get("weight_version"))
        per_token = meta.get("output_token_weight_versions")
        if per_token is not None:
            versions = np.asarray([_as_version(v) for v in per_token], dtype=np.int32)
        else:
            versions = np.full(len(output_ids), version, dtype=np.int32)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineError(url, f"malformed /generate response: {exc!r}", retryable=False) from exc
    if not (len(logprobs) == len(output_ids) == len(versions)):
        raise EngineError(
            url,
            f"/generate returned {len(output_ids)} tokens, {len(logprobs)} log-probs and "
            f"{len(versions)} versions (asked with return_logprob=true?)",
            retryable=False,
        )
    return Completion(output_ids, logprobs, versions, finish, version, meta)


class EngineClient:
    """Calls one engine. ``timeout_s`` bounds every call; generation calls may take long."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(
        self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> Any:
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.request(
                method, self.url + path, json=payload, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(
                        self.url,
                        f"{method} {path} answered {resp.status}: {text[:500]}",
                        retryable=resp.status >= 500,
                        status=resp.status,
                    )
                try:
                    return await resp.json(content_type=None) if text else None
                except ValueError as exc:
                    raise EngineError(
                        self.url, f"{path} returned non-JSON: {text[:200]!r}", retryable=False
                    ) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise EngineError(self.url, f"{method} {path} failed: {exc!r}", retryable=True) from exc

    async def generate(
        self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *, rid: str
    ) -> Completion:
        body = await self._call(
            "POST",
            "/generate",
            {
                "input_ids": list(input_ids),
                "sampling_params": dict(sampling_params),
                "return_logprob": True,
                "rid": rid,
            },
        )
        if not isinstance(body, Mapping):
            raise EngineError(
                self.url, f"/generate returned {type(body).__name__}", retryable=False
            )
        return parse_completion(body, self.url)

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s`` (not the generation timeout)."""
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/model_info")

    async def pause(self, mode: str = "in_place") -> None:
        """Pause generation; in-flight updates must never use ``abort`` (SGLang's default)."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})
