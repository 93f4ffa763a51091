"""In-flight weight updates end to end: the publisher drives two real `inflight engine` servers
exactly as it drives SGLang (HTTP + a gloo weight group, flattened buckets), and one update lands
while a long request is being generated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.weights.publisher import WeightPublisher
from tests.stages import engine_setup
from tests.stages.engine_setup import EngineProcess
from tests.stages.tiny_model import make_tiny_model

pytestmark = [pytest.mark.numerics, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    old = make_tiny_model(root / "old", vocab=128, seed=1)
    new = make_tiny_model(root / "new", vocab=128, seed=2)
    return old, new


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    old, _ = models
    logs = tmp_path_factory.mktemp("engine-logs")
    procs = [EngineProcess(old, output=logs / f"engine{i}.out") for i in range(2)]  # both load
    try:
        yield [proc.wait_up(90) for proc in procs]
    finally:
        for proc in procs:
            proc.stop(15)


async def _generate(session, url, prompt, n, rid):
    body = {
        "input_ids": prompt,
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {**GREEDY, "max_new_tokens": n},
    }
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def _new_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(name, p.detach()) for name, p in model.state_dict().items()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "pause", [None, True], ids=["built-in-engines-go-on", "paused-in-place-as-sglang-is"]
)
def test_update_lands_mid_request_and_engines_then_serve_the_new_policy(engines, models, pause):
    """Not paused (the publisher finds built-in engines), and paused in place around the update
    as the publisher frames it for SGLang (``stages.weights.update_frame``): either way the long
    request goes on across the update, its KV kept, and ends whole."""
    _, new = models
    prompt = [5, 17, 33, 8, 90]

    async def steps(session) -> int:
        async with session.get(engines[0] + "/get_server_info") as r:
            return (await r.json()).get("decode_steps", 0)

    async def scenario():
        publisher = WeightPublisher(
            engines, backend="gloo", bucket_mb=0.05, pause=pause, group_name=f"p{pause}"
        )
        await publisher.connect()
        assert publisher._frame is not None and len(publisher._frame.pausing) == (2 if pause else 0)
        async with aiohttp.ClientSession() as session:
            # On a loaded machine the request may end before the update lands: then again,
            # as the next version (the same new weights), at most three times.
            async with session.get(engines[0] + "/get_weight_version") as r:
                held = int((await r.json())["weight_version"])  # the other case's, if it ran
            for version in (held + 1, held + 2, held + 3):
                before = await steps(session)
                long = asyncio.create_task(
                    _generate(session, engines[0], prompt, 480, f"long-{version}")
                )
                for _ in range(2000):  # until it is decoding: publish then
                    if await steps(session) >= before + 5:
                        break
                    await asyncio.sleep(0.005)
                stats = await publisher.publish(_new_weights(new), version=version)
                long_out = await long
                versions = [int(v) for v in long_out["meta_info"]["output_token_weight_versions"]]
                if versions[-1] == version:
                    break
            after = [
                await _generate(session, url, prompt, 24, f"after-{i}")
                for i, url in enumerate(engines)
            ]
        await publisher.close()
        return stats, long_out, after, version

    stats, long_out, after, version = asyncio.run(scenario())
    assert stats.buckets > 1  # several buckets, each applied between two decode steps
    # the long request finished whole, its tokens old-version first, then new-version
    meta = long_out["meta_info"]
    assert len(long_out["output_ids"]) == 480 and meta["finish_reason"]["type"] == "length"
    versions = [int(v) for v in meta["output_token_weight_versions"]]
    switch = versions.index(version)
    assert 0 < switch < 480 and versions == [version - 1] * switch + [version] * (480 - switch)
    assert int(meta["weight_version"]) == version
    # afterwards both engines produce exactly what the new model produces
    expected = _hf_greedy(new, prompt, 24)
    for out in after:
        assert out["output_ids"] == expected
        assert set(out["meta_info"]["output_token_weight_versions"]) == {str(version)}


@pytest.mark.timeout(120)
def test_a_delta_update_gives_what_a_full_one_does_and_only_on_its_base(engines, models):
    """Full weights as version 10, then only the changed values as 11 (against 10): the engines
    then compute what the full new weights compute; a delta against a version they do not hold
    is refused (received, not applied) and leaves them as they were."""
    from stages.weights.delta import DeltaEncoder
    from stages.weights.publisher import WeightPublishError

    _, new = models
    prompt = [5, 17, 33, 8, 90]
    first = _new_weights(new)
    g = torch.Generator().manual_seed(0)
    second = []
    for name, t in first:  # about 2% of each tensor moves
        moved = t.clone()
        where = torch.rand(t.shape, generator=g) < 0.02
        moved[where] += 0.5
        second.append((name, moved))
    reference = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    reference.load_state_dict({n: t.to(torch.bfloat16).float() for n, t in second})
    ids = torch.tensor([prompt])
    expected = reference.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()
    assert expected != _hf_greedy(new, prompt, 24)

    async def scenario():
        encoder = DeltaEncoder(torch.bfloat16)  # float32 engines, sent bfloat16 values
        publisher = WeightPublisher(engines, backend="gloo", bucket_mb=0.05, group_name="delta")
        await publisher.connect()
        full = await publisher.publish(list(encoder.encode(first, full=True)), version=10)
        delta = await publisher.publish(
            list(encoder.encode(second, full=False)), version=11, base_version=10
        )
        async with aiohttp.ClientSession() as session:
            after = [
                await _generate(session, url, prompt, 24, f"d-{i}") for i, url in enumerate(engines)
            ]
            with pytest.raises(WeightPublishError, match="holds version 11"):
                await publisher.publish(
                    list(encoder.encode(first, full=False)), version=12, base_version=7
                )
            await publisher.close()
            kept = await _generate(session, engines[0], prompt, 24, "d-kept")
        return full, delta, after, kept

    full, delta, after, kept = asyncio.run(scenario())
    assert delta.bytes < 0.2 * full.bytes  # positions and values of about 2% of the weights
    for out in after:
        assert out["output_ids"] == expected
        assert out["meta_info"]["weight_version"] == "11"
    assert kept["output_ids"] == expected and kept["meta_info"]["weight_version"] == "11"


@pytest.mark.timeout(120)
def test_the_publisher_brings_every_weight_back_bit_for_bit(engines, models):
    """slime's check of an update path, through ``/weights_checker``: the engines' weights are
    snapshot, overwritten with random values, then published again by the publisher as training
    publishes them; every tensor must then be bitwise what the snapshot held, and each engine's
    digests those the trainer computes of what it sent."""
    from stages.engine.weight_checker import checksums

    _, new = models
    weights = _new_weights(new)

    async def check(session, url, body):
        async with session.post(url + "/weights_checker", json=body) as r:
            return r.status, await r.json()

    async def scenario():
        publisher = WeightPublisher(engines, backend="gloo", bucket_mb=0.05, group_name="check")
        await publisher.connect()
        await publisher.publish(weights, version=20)
        async with aiohttp.ClientSession() as session:
            for url in engines:
                assert await check(session, url, {"action": "snapshot"}) == (
                    200, {"success": True, "message": "Success."},
                )  # fmt: skip
                assert (await check(session, url, {"action": "reset_tensors"}))[0] == 200
            garbled = [await check(session, url, {"action": "compare"}) for url in engines]
            await publisher.publish(weights, version=21)
            compared = [await check(session, url, {"action": "compare"}) for url in engines]
            digests = [await check(session, url, {}) for url in engines]
        await publisher.close()
        return garbled, compared, digests

    garbled, compared, digests = asyncio.run(scenario())
    for status, answer in garbled:
        assert status == 400 and answer["message"].startswith("check tensor equality failed")
    assert compared == [(200, {"success": True, "message": "Success."})] * 2
    # the trainer's digests of what it sent, on the engines' kind of device (bytes on a CPU,
    # 32-bit words on a GPU)
    trainer = checksums({name: t.to(engine_setup.ENGINE_DEVICE) for name, t in weights})
    for status, answer in digests:
        assert status == 200 and answer["ranks"][0]["checksums"] == trainer
