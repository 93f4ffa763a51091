"""SGLang's LoRA routes on the built-in engine: ``POST /load_lora_adapter`` (``lora_name``,
``lora_path``: a ``peft`` adapter folder on the engine's machine; ``pinned`` accepted) and
``POST /unload_lora_adapter`` (``lora_name``). Both answer as SGLang does: ``success``,
``error_message`` and ``loaded_adapters`` (name -> path), status 400 on failure. A request then
names an adapter with ``lora_path`` (``/generate``); rows already running with an unloaded
adapter finish with it.

Not here: reading and applying adapters (``lora_adapters``), which rows take which
(``scheduler``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from stages.engine.lora_adapters import AdapterError
from stages.engine.protocol import RequestError

__all__ = ["LoraRoutes"]


class LoraRoutes:
    def __init__(self, scheduler: Any, read_body: Any) -> None:
        self.scheduler = scheduler
        self.read_body = read_body  # the server's JSON body reader (RequestError when bad)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await self.read_body(request)
            name = _name(body, "lora_name")
            path = _name(body, "lora_path")
            if not isinstance(body.get("pinned", False), bool):
                raise RequestError("pinned", f"expected true or false, got {body['pinned']!r}")
            _known(body, {"lora_name", "lora_path", "pinned", "lora_id"})
            # reading the folder takes the caller's thread: not the event loop's
            future = await asyncio.to_thread(self.scheduler.load_adapter, name, path)
            await asyncio.wrap_future(future)
        except (RequestError, AdapterError) as exc:
            return self._answer(False, str(exc))
        return self._answer(True, None)

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await self.read_body(request)
            name = _name(body, "lora_name")
            _known(body, {"lora_name", "lora_id"})
            if not await asyncio.wrap_future(self.scheduler.unload_adapter(name)):
                raise RequestError("lora_name", f"no adapter {name!r} is loaded")
        except RequestError as exc:
            return self._answer(False, str(exc))
        return self._answer(True, None)

    def _answer(self, success: bool, error: str | None) -> web.Response:
        loaded = {a["lora_name"]: a["lora_path"] for a in self.scheduler.adapters()}
        return web.json_response(
            {"success": success, "error_message": error, "loaded_adapters": loaded},
            status=200 if success else 400,
        )


def _name(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(key, f"expected a non-empty string, got {value!r}")
    return value


def _known(body: dict[str, Any], fields: set[str]) -> None:
    for key in body:
        if key not in fields:
            raise RequestError(key, f"unknown field (expected {sorted(fields)})")
