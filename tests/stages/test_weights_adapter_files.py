"""LoRA adapters as files (``publish.lora_transport: files``, SGLang's way) against a built-in
engine: each version loaded by name and the engine's version set, a retried version loaded anew,
older ones unloaded and their folders removed; a request naming the adapter samples what the
engine computes with the same adapter merged into its weights (the weight-group way)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp.test_utils import TestServer

from stages.engine.loader import load_model
from stages.engine.model_weights import load_named_tensors
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.server import build_app
from stages.weights.adapter_files import AdapterFilePublisher, LoraNotServed
from stages.weights.adapter_names import adapter_for
from stages.weights.publisher import WeightPublishError
from tests.stages.tiny_model import make_tiny_model


def _adapters(model, seed: int, rank: int = 2) -> list[tuple[str, torch.Tensor]]:
    """What a LoRA learner publishes: A and (scaled) B of q_proj and down_proj per layer."""
    gen = torch.Generator().manual_seed(seed)
    named = []
    for i, layer in enumerate(model.model.layers):
        for part, proj in (("self_attn", "q_proj"), ("mlp", "down_proj")):
            lin = getattr(getattr(layer, part), proj)
            module = f"model.layers.{i}.{part}.{proj}"
            named.append(
                (f"{module}.lora_A.weight", torch.randn(rank, lin.in_features, generator=gen))
            )
            named.append(
                (
                    f"{module}.lora_B.weight",
                    torch.randn(lin.out_features, rank, generator=gen) * 0.5,
                )
            )
    return named


def _greedy(sched: Scheduler, lora: str | None) -> list[int]:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    future = sched.submit(GenerateInput(f"g-{lora}", [5, 9, 14, 3], params, True, lora=lora))
    return future.result(timeout=30).output_ids


@pytest.mark.timeout(120)
def test_versions_load_by_name_replace_the_last_and_sample_as_merged_weights(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", seed=4)
    loaded = load_model(str(model_dir), device="cpu")
    sched = Scheduler(loaded.model, max_running=4)
    sched.start()
    merged = load_model(str(model_dir), device="cpu").model  # the weight-group way
    merged_sched = Scheduler(merged, max_running=4)
    merged_sched.start()

    async def main():
        server = TestServer(build_app(loaded, sched))
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        folder = tmp_path / "adapters"
        publisher = AdapterFilePublisher([url], folder, keep=2)
        await publisher.connect()
        try:
            stats = await publisher.publish(_adapters(loaded.model, 1), 1)
            assert stats.bytes > 0 and publisher.announce == {"lora_name": "policy-v1"}
            assert sched.adapter_names() == {"policy-v1"} and sched.weight_version == "1"
            # the same version again (a retried publish), other values: loaded anew
            await publisher.publish(_adapters(loaded.model, 2), 1)
            assert sched.adapter_names() == {"policy-v1"}
            load_named_tensors(merged, _adapters(loaded.model, 2))
            base = await asyncio.to_thread(_greedy, sched, None)
            got = await asyncio.to_thread(_greedy, sched, "policy-v1")
            assert got == await asyncio.to_thread(_greedy, merged_sched, None) and got != base
            # whole versions, written and named by version, the last two kept on disk
            await publisher.publish(lambda: iter([_adapters(loaded.model, 3)]), 2)
            await publisher.publish(_adapters(loaded.model, 4), 3)
            assert sched.adapter_names() == {"policy-v3"} and sched.weight_version == "3"
            assert sorted(p.name for p in folder.iterdir()) == ["policy-v2", "policy-v3"]
            with pytest.raises(WeightPublishError, match="no delta updates"):
                await publisher.publish(_adapters(loaded.model, 5), 4, base_version=3)
            with pytest.raises(ValueError, match="not a LoRA adapter's tensor"):
                await publisher.publish([("model.norm.weight", torch.ones(32))], 4)
            # an engine started without --enable-lora: no retry can load it, the publish says
            # so and what to start the engine with (not a WeightPublishError, retried)
            sched.lora = False
            with pytest.raises(LoraNotServed, match=f"engine at {url} serves no LoRA adapters"):
                await publisher.publish(_adapters(loaded.model, 6), 4)
        finally:
            await publisher.close()
            await server.close()

    try:
        asyncio.run(main())
    finally:
        sched.stop()
        merged_sched.stop()


def test_requests_name_the_adapter_of_the_version_their_engine_serves():
    assert adapter_for({}, 3) is None  # no adapter ever announced: the engine holds weights
    names = {2: "policy-v2", 3: "policy-v3"}
    assert adapter_for(names, 3) == ("policy-v3", 3)
    assert adapter_for(names, 0) == (None, 0)  # a restarted engine serves the base model
    assert adapter_for(names, 1) == ("policy-v1", 1)  # an announcement missed: same naming
