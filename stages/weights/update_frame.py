"""What frames one weight update on each engine: SGLang's update session, and a pause in place
where the engine would otherwise stop generating for the update.

SGLang 0.5.23 (``srt/managers/scheduler_components/weight_updater.py``) loads
``/update_weights_from_distributed`` only inside a weight-update session: ``POST
/begin_weight_update`` first, ``POST /end_weight_update`` after the last bucket; outside one
every bucket is refused ("must run between begin_weight_update() and end_weight_update()").
Servers from before the session (no such route: 404) take buckets without one.

SGLang also takes its ``model_update_lock`` as a writer for each of those calls unless
generation is paused (``tokenizer_control_mixin.update_weights_from_distributed``): the update
waits until every request in flight has ended, and holds back new ones meanwhile, so the engine
drains at every update. Paused with ``pause_generation`` ``mode: in_place``, it keeps its
running requests and their KV cache where they are, takes the update at once, and
``continue_generation`` resumes them with the new weights: the in-flight update of PipelineRL,
at the cost of no decoding while the buckets arrive. So a SGLang engine is paused in place
around each update (``pause_generation``, ``begin_weight_update``, the buckets,
``end_weight_update``, ``continue_generation``, as slime frames its updates). The built-in
engine (its ``/server_info`` says ``"engine": "inflight-builtin"``) loads each bucket between
two decode steps while its requests go on, and is not paused.

A session left open by a publisher that died mid-update ("already open") is closed and opened
again. After a failed update the frame is still closed (sessions ended, paused engines
resumed) as far as the engines answer: an engine left paused would generate no more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

BUILTIN_ENGINE = "inflight-builtin"  # /server_info "engine" of the built-in engine

# (status, JSON object or None) of an HTTP call: (url, method, route, payload or None)
Call = Callable[
    [str, str, str, dict[str, Any] | None], Awaitable[tuple[int, dict[str, Any] | None]]
]

__all__ = ["BUILTIN_ENGINE", "FrameError", "UpdateFrame"]


class FrameError(RuntimeError):
    """An engine refused to open or close an update (its answer in the message)."""


class UpdateFrame:
    """The calls before and after each update, per engine of ``urls``.

    ``pause``: pause every engine in place around an update (True), none (False), or (None)
    those that are not the built-in engine, found by ``learn()``."""

    def __init__(self, urls: Sequence[str], call: Call, *, pause: bool | None, log: Any) -> None:
        self.urls = list(urls)
        self._call = call
        self._pause = pause
        self._log = log
        self.pausing: list[str] = list(self.urls) if pause else []
        self.sessionless: set[str] = set()  # engines without /begin_weight_update (404)
        self.paused: set[str] = set()  # paused by this frame and not resumed yet
        self.open: set[str] = set()  # sessions this frame opened and has not ended

    async def learn(self) -> None:
        """With ``pause=None``: which engines to pause (those whose ``/server_info``, or the
        older ``/get_server_info``, does not name the built-in engine)."""
        if self._pause is not None:
            return
        kinds = await asyncio.gather(*(self._engine_kind(url) for url in self.urls))
        self.pausing = [
            url for url, kind in zip(self.urls, kinds, strict=True) if kind != BUILTIN_ENGINE
        ]
        if self.pausing:
            self._log.info("weight_updates_pause_engines", engines=self.pausing, mode="in_place")

    async def _engine_kind(self, url: str) -> str | None:
        for route in ("/server_info", "/get_server_info"):
            try:
                status, body = await self._call(url, "GET", route, None)
            except Exception as exc:  # unknown: paused, which is right for either engine
                self._log.warning("engine_kind_unknown", engine=url, error=repr(exc))
                return None
            if status == 200 and body is not None:
                kind = body.get("engine")
                return kind if isinstance(kind, str) else None
            if status != 404:
                break
        return None

    async def begin(self) -> None:
        """Pause the engines that need it, then open a session on every engine that has them.
        Raises FrameError (or the call's own error) at the first engine that refuses."""
        await asyncio.gather(*(self._pause_one(url) for url in self.pausing))
        await asyncio.gather(*(self._begin_one(url) for url in self.urls))

    async def end(self, *, failed: bool = False) -> None:
        """End the sessions, then resume the engines paused. After a ``failed`` update, every
        engine is tried and what goes wrong is logged, not raised (the update's own error is
        the one to report)."""
        ends = await asyncio.gather(
            *(self._end_one(url) for url in list(self.open)), return_exceptions=True
        )
        resumes = await asyncio.gather(
            *(self._resume_one(url) for url in list(self.paused)), return_exceptions=True
        )
        problems = [r for r in (*ends, *resumes) if isinstance(r, BaseException)]
        for problem in problems:
            self._log.error("weight_update_frame_not_closed", error=repr(problem))
        if problems and not failed:
            raise problems[0]

    async def _pause_one(self, url: str) -> None:
        status, body = await self._call(url, "POST", "/pause_generation", {"mode": "in_place"})
        if status == 404:
            self._log.warning("engine_cannot_pause", engine=url)  # drains at each update
            self.pausing.remove(url)
            return
        if status != 200:
            raise FrameError(f"engine {url}: POST /pause_generation answered {status}: {body}")
        self.paused.add(url)

    async def _resume_one(self, url: str) -> None:
        status, body = await self._call(url, "POST", "/continue_generation", {})
        if status != 200:
            raise FrameError(f"engine {url}: POST /continue_generation answered {status}: {body}")
        self.paused.discard(url)

    async def _begin_one(self, url: str) -> None:
        if url in self.sessionless:
            return
        status, body = await self._call(url, "POST", "/begin_weight_update", {})
        if status == 404:  # SGLang before update sessions: buckets load without one
            self.sessionless.add(url)
            return
        if status != 200 and "already open" in _message(body):
            self._log.warning("weight_session_left_open", engine=url)  # a publisher that died
            await self._end_one(url)
            status, body = await self._call(url, "POST", "/begin_weight_update", {})
        if status != 200 or not (body or {}).get("success"):
            raise FrameError(f"engine {url}: POST /begin_weight_update answered {status}: {body}")
        self.open.add(url)

    async def _end_one(self, url: str) -> None:
        status, body = await self._call(url, "POST", "/end_weight_update", {})
        self.open.discard(url)
        if status != 200 or not (body or {}).get("success"):
            raise FrameError(f"engine {url}: POST /end_weight_update answered {status}: {body}")


def _message(body: dict[str, Any] | None) -> str:
    message = (body or {}).get("message")
    return message if isinstance(message, str) else ""
