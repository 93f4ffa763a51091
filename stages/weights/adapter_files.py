"""LoRA adapters to engines as files: how SGLang takes a trainer's adapters in flight.

A LoRA learner's update is its adapters (``stages.learner.lora.published_adapters``: each
module's ``lora_A`` and ``lora_B``, ``B`` already scaled by ``alpha / r``). Over the weight group
the built-in engine merges them into its weights; SGLang instead serves adapters by name, loaded
from a ``peft`` folder (``POST /load_lora_adapter``, ``lora_name`` and ``lora_path``) and named by
each request (``lora_path`` in ``/generate``). ``AdapterFilePublisher`` speaks that: each version
is written as ``FOLDER/PREFIX-vN`` (``adapter_model.safetensors`` with peft's names, and an
``adapter_config.json`` whose ``lora_alpha`` equals ``r``: the scale is in ``B`` already), loaded
on every engine as ``PREFIX-vN``, and the engine's weight version set to N
(``/update_weight_version``, nothing aborted), so that engines report the version their newest
adapter is. The adapters of older versions are then unloaded (requests already running with
one finish with it: SGLang and the built-in engine both hold an adapter until its requests
end) and their folders removed, but for the last ``keep``.

The same version published again (a failed publish retried) is loaded anew where an engine
holds it already. An engine that serves no adapters (started without ``--enable-lora``, SGLang's
and the built-in engine's flag) raises ``LoraNotServed``: no retry can succeed, so the learner
fails at once, saying which engine and what to start it with. The folder must be
readable by the engines: on one host the run directory; across machines a shared file system.

Not here: which engines and when (``stages.learner.publishing``), the weight group
(``stages.weights.publisher``), what a generator names in its requests (``stages.generator``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from stages.engine.auth import EngineAuthError, auth_headers
from stages.weights.adapter_names import ADAPTER_PREFIX, adapter_name
from stages.weights.publisher import PublishStats, WeightPublishError

if TYPE_CHECKING:
    import torch

__all__ = ["AdapterFilePublisher", "LoraNotServed", "write_adapter"]

# how SGLang (and the built-in engine) answers /load_lora_adapter without --enable-lora
_NOT_ENABLED = "LoRA is not enabled."


class LoraNotServed(Exception):
    """An engine that serves no LoRA adapters (started without ``--enable-lora``): no retry of
    the publish can succeed."""

    def __init__(self, url: str, said: str) -> None:
        super().__init__(
            f"engine at {url} serves no LoRA adapters ({said}): start it with --enable-lora "
            "(SGLang: --enable-lora --max-lora-rank R --lora-target-modules ..., in "
            "launch.extra_args), or publish over the weight group to built-in engines "
            "(publish.lora_transport: group)"
        )
        self.url = url


_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def write_adapter(folder: Path, named: Sequence[tuple[str, torch.Tensor]], base: str) -> int:
    """Write published adapters ``named`` as a peft adapter folder (atomically: a folder
    that exists is whole); returns its bytes. Raises ValueError for a tensor that is not an
    adapter's."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    rank = 0
    for name, tensor in named:
        if not name.endswith(_SUFFIXES):
            raise ValueError(f"{name}: not a LoRA adapter's tensor (MODULE.lora_A/B.weight)")
        tensors[f"base_model.model.{name}"] = tensor.detach().to("cpu").contiguous().clone()
        modules.add(name[: -len(".lora_A.weight")].rsplit(".", 1)[-1])
        if name.endswith(".lora_A.weight"):
            rank = int(tensor.shape[0])
    if not tensors or not rank:
        raise ValueError("no LoRA adapters to write")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": rank,  # B carries alpha / r already: the engine's scale must be 1
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
    }
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterFilePublisher:
    """``WeightPublisher``'s interface (connect, publish, close, engine_urls) over adapter files."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        folder: Path,
        *,
        prefix: str = ADAPTER_PREFIX,
        base: str = "",
        keep: int = 2,
        timeout_s: float = 300.0,
        api_key: str | None = None,
        log: Any = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """``state``: a dict kept by the caller across publishers (the group formed anew when
        engines change), so that adapters loaded and folders written earlier are still let
        go of."""
        if not engine_urls:
            raise ValueError("no engine URLs")
        self.engine_urls = [url.rstrip("/") for url in engine_urls]
        self.folder, self.prefix, self.base = Path(folder), prefix, base
        self.keep = max(1, keep)
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)
        self.log = log
        self.announce: dict[str, Any] = {}  # what the version announcement carries
        state = {} if state is None else state
        self._loaded: dict[str, list[str]] = state.setdefault("loaded", {})
        for url in self.engine_urls:
            self._loaded.setdefault(url, [])
        self._written: list[Path] = state.setdefault("written", [])
        self._session: aiohttp.ClientSession | None = None

    async def connect(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers
        )

    async def publish(
        self, weights: Any, version: int, *, base_version: int | None = None
    ) -> PublishStats:
        if base_version is not None:
            raise WeightPublishError("adapter files carry whole adapters: no delta updates")
        started = time.perf_counter()
        named = [pair for group in weights() for pair in group] if callable(weights) else weights
        name = adapter_name(self.prefix, version)
        path = self.folder / name
        size = await asyncio.to_thread(write_adapter, path, list(named), self.base)
        if path not in self._written:
            self._written.append(path)
        await asyncio.gather(*(self._load(url, name, path, version) for url in self.engine_urls))
        self.announce = {"lora_name": name}
        await asyncio.gather(*(self._unload_old(url, name) for url in self.engine_urls))
        while len(self._written) > self.keep:
            await asyncio.to_thread(shutil.rmtree, self._written.pop(0), True)
        return PublishStats(version, 1, size, time.perf_counter() - started)

    async def _load(self, url: str, name: str, path: Path, version: int) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        answer = await self._post(url, "/load_lora_adapter", body)
        if not answer.get("success") and name in (answer.get("loaded_adapters") or {}):
            # this version again (a publish retried): what the engine holds may be part of an
            # earlier attempt's, so it is loaded anew
            await self._post(url, "/unload_lora_adapter", {"lora_name": name})
            answer = await self._post(url, "/load_lora_adapter", body)
        error = answer.get("error_message")
        if not answer.get("success") and str(error).startswith(_NOT_ENABLED):
            raise LoraNotServed(url, str(error))
        if not answer.get("success"):
            raise WeightPublishError(f"engine {url}: POST /load_lora_adapter {name}: {error}")
        if name not in self._loaded[url]:
            self._loaded[url].append(name)
        set_version = {"new_version": str(version), "abort_all_requests": False}
        answer = await self._post(url, "/update_weight_version", set_version)
        if answer.get("success") is False:
            raise WeightPublishError(
                f"engine {url}: POST /update_weight_version: {answer.get('message')}"
            )

    async def _unload_old(self, url: str, current: str) -> None:
        for old in [n for n in self._loaded[url] if n != current]:
            try:
                answer = await self._post(url, "/unload_lora_adapter", {"lora_name": old})
            except WeightPublishError as exc:
                answer = {"success": False, "error_message": str(exc)}
            self._loaded[url].remove(old)  # unloaded, or no longer there to unload
            if not answer.get("success") and self.log is not None:
                self.log.warning(
                    "lora_unload_failed", url=url, lora_name=old, error=answer.get("error_message")
                )

    async def _post(self, url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None, "connect() first"
        try:
            async with self._session.post(url + route, json=body) as resp:
                if resp.status in (401, 403):
                    raise EngineAuthError(f"engine {url}: {route} refused the run's API key")
                try:
                    answer = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    answer = None
                if not isinstance(answer, dict):
                    text = (await resp.text())[:200]
                    raise WeightPublishError(f"engine {url}: {route}: HTTP {resp.status}: {text}")
                return answer
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise WeightPublishError(f"engine {url}: {route}: {exc!r}") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
