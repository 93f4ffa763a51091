"""SGLang's LoRA routes on the built-in engine: ``POST /load_lora_adapter`` (``lora_name``,
``lora_path``: a ``peft`` adapter folder on the engine's machine; ``pinned`` accepted) and
``POST /unload_lora_adapter`` (``lora_name``), and ``POST /load_lora_adapter_from_tensors``
(SGLang 0.5.23's, for a trainer that holds the adapter in memory: ``lora_name``,
``config_dict``, the ``peft`` config, and ``serialized_named_tensors``, a payload per
tensor-parallel rank of its state dict, or with ``load_format: flattened_bucket`` a bucket of
it, read as ``/update_weights_from_tensor``'s are (``tensor_payloads``); ``expected_checksums``,
name -> sha256 of a tensor's bytes, checked first, as SGLang's ``tp_worker`` checks them;
``loaded_adapters`` shows it at ``__tensor__``). All answer as SGLang does: ``success``,
``error_message`` and ``loaded_adapters`` (name -> path), status 400 on failure; a body its
struct cannot read is SGLang's validation answer (``control_fields``). A request then
names an adapter with ``lora_path`` (``/generate``); rows already running with an unloaded
adapter finish with it.

The server's ``--lora-paths`` (``lora_refs``, read as SGLang's ``LoRAPathAction`` and
``check_lora_server_args`` read it: ``PATH``, ``NAME=PATH`` or a JSON object with
``lora_name`` and ``lora_path``) loads adapters before the engine serves. Without it or
``--enable-lora`` the three routes answer SGLang's refusal (``LoRA is not enabled...``), and a
request naming an adapter its 400 (``protocol``).

Not here: reading and applying adapters (``lora_adapters``), which rows take which
(``scheduler``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import torch
from aiohttp import web

from stages.engine.control_fields import LOAD_LORA, LOAD_LORA_TENSORS, UNLOAD_LORA, typed_body
from stages.engine.lora_adapters import AdapterError
from stages.engine.protocol import RequestError
from stages.engine.tensor_payloads import LOAD_FORMATS, PayloadError, tensor_dict

__all__ = ["LoraRoutes", "lora_refs"]


def lora_refs(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-paths``' adapters as (name, path), as SGLang names them: ``NAME=PATH`` (split
    at the first ``=``), a JSON object's ``lora_name`` and ``lora_path`` (``pinned`` taken), a
    bare path its own name. Raises ValueError in SGLang's words for an object without them."""
    refs = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{") and value.endswith("}"):
            try:
                obj = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{value!r}: not JSON: {exc}") from None
            if not isinstance(obj, dict) or "lora_path" not in obj or "lora_name" not in obj:
                raise ValueError(
                    f"{value!r} looks like a JSON str, but it does not contain 'lora_name' and "
                    "'lora_path' keys."
                )
            refs.append((str(obj["lora_name"]), str(obj["lora_path"])))
        elif "=" in value:
            name, path = value.split("=", 1)
            refs.append((name, path))
        else:
            refs.append((value, value))
    return refs


class LoraRoutes:
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)
        app.router.add_post("/load_lora_adapter_from_tensors", self.load_from_tensors)

    async def load(self, request: web.Request) -> web.Response:
        body = await typed_body(request, LOAD_LORA)
        if isinstance(body, web.Response):
            return body
        if not self.scheduler.lora:
            return _not_enabled()
        try:
            name = _name(body, "lora_name")
            path = _name(body, "lora_path")
            # reading the folder takes the caller's thread: not the event loop's
            future = await asyncio.to_thread(self.scheduler.load_adapter, name, path)
            await asyncio.wrap_future(future)
        except (RequestError, AdapterError) as exc:
            return self._answer(False, str(exc))
        return self._answer(True, None)

    async def load_from_tensors(self, request: web.Request) -> web.Response:
        body = await typed_body(request, LOAD_LORA_TENSORS)
        if isinstance(body, web.Response):
            return body
        if not self.scheduler.lora:
            return _not_enabled()
        try:
            name = _name(body, "lora_name")
            config = body["config_dict"]
            payloads = body["serialized_named_tensors"]  # bytes: the struct decodes the base64
            if not payloads:
                raise RequestError("serialized_named_tensors", "expected a payload per rank")
            load_format = body.get("load_format")
            if load_format not in LOAD_FORMATS:
                raise RequestError("load_format", f"Unknown load_format={load_format}")
            if body.get("added_tokens_config"):
                raise RequestError("added_tokens_config", "added tokens are not supported here")
            expected = body.get("expected_checksums")
            data = payloads[0]

            def read() -> dict[str, Any]:
                tensors = tensor_dict(data, load_format)
                if expected is not None:
                    _check_sums(tensors, expected)
                return tensors

            future = await asyncio.to_thread(self.scheduler.load_adapter_from, name, config, read)
            await asyncio.wrap_future(future)
        except (RequestError, AdapterError, PayloadError) as exc:
            return self._answer(False, str(exc))
        return self._answer(True, None)

    async def unload(self, request: web.Request) -> web.Response:
        body = await typed_body(request, UNLOAD_LORA)
        if isinstance(body, web.Response):
            return body
        if not self.scheduler.lora:
            return _not_enabled()
        try:
            name = _name(body, "lora_name")
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


def _not_enabled() -> web.Response:
    """SGLang's answer on an engine started without ``--enable-lora`` (nor ``--lora-paths``)."""
    error = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    body = {"success": False, "error_message": error, "loaded_adapters": None}
    return web.json_response(body, status=400)


def _name(body: dict[str, Any], key: str) -> str:
    value = body[key]  # a string: the struct says so
    if not value:
        raise RequestError(key, "expected a non-empty string")
    return value


def _check_sums(tensors: dict[str, Any], expected: dict[str, str]) -> None:
    """SGLang 0.5.23's ``[LORA-CHECK]`` (``tp_worker.load_lora_adapter_from_tensors``): each
    tensor's sha256 over its bytes against ``expected``, none missing and none extra."""
    mismatch, missing = [], []
    for name, want in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            missing.append(name)
            continue
        raw = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        if hashlib.sha256(raw).hexdigest() != want:
            mismatch.append(name)
    extra = [n for n in tensors if n not in expected]
    if mismatch or missing or extra:
        raise RequestError(
            "expected_checksums",
            f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: "
            f"{len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, "
            f"{len(extra)} extra {extra[:5]}",
        )
