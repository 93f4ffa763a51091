"""Each sample's own ``sampling_seed`` (``sampling.seed``): engines started with
``--enable-deterministic-inference`` draw every sample without one with seed 42, as SGLang's do,
so a group's samples would all be the same and carry no advantage. The generator then gives each
sample a seed made of the run's and its rid, in every request it makes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stages.generator.client import SEED_EACH_SAMPLE, _generate_body, sample_seed
from stages.generator.launcher import LaunchConfig
from stages.generator.stage import GeneratorConfig, SamplingConfig


def test_each_sample_of_a_request_gets_a_seed_of_its_own() -> None:
    params = {"temperature": 1.0, "max_thinking_tokens": 8, SEED_EACH_SAMPLE: 3}
    body = _generate_body([[1, 2], [1, 2]], params, ["g/0", "g/1"])
    assert body["max_thinking_tokens"] == 8  # (a request field, lifted as before)
    first, second = body["sampling_params"]
    assert first == {"temperature": 1.0, "sampling_seed": sample_seed(3, "g/0")}
    assert second["sampling_seed"] == sample_seed(3, "g/1") != first["sampling_seed"]
    one = _generate_body([1, 2], params, "g/2")
    assert one["sampling_params"] == {"temperature": 1.0, "sampling_seed": sample_seed(3, "g/2")}
    assert sample_seed(3, "g/2") != sample_seed(4, "g/2")
    assert all(0 <= sample_seed(b, r) < 2**63 for b in (0, -1, 2**70) for r in ("a", ""))
    assert "sampling_seed" not in _generate_body([1], {"temperature": 1.0}, "x")["sampling_params"]


def test_launched_deterministic_engines_turn_seeds_on() -> None:
    flag = "--enable-deterministic-inference"
    on = GeneratorConfig(launch=LaunchConfig(model="m", extra_args=[flag]))
    assert on.sampling.seed == 0 and on.sampling.as_params()[SEED_EACH_SAMPLE] == 0
    kept = GeneratorConfig(launch=LaunchConfig(model="m", extra_args=[flag]),
                           sampling=SamplingConfig(seed=7))  # fmt: skip
    assert kept.sampling.seed == 7
    off = GeneratorConfig(launch=LaunchConfig(model="m"))
    assert off.sampling.seed is None and SEED_EACH_SAMPLE not in off.sampling.as_params()


@pytest.mark.timeout(90)
def test_an_attached_engine_says_it_is_deterministic(tmp_path: Path) -> None:
    """A generator attached to engines (not launching them) asks each's ``/server_info``: one
    started with the flag turns the samples' own seeds on (``GeneratorStage.setup``)."""
    from stages.generator.client import EngineClient, make_session
    from tests.stages.test_engine_server import serving
    from tests.stages.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", vocab=64)

    async def ask(urls: list[str]) -> list[bool]:
        async with make_session(8) as session:
            return [await EngineClient(url, session).deterministic() for url in urls]

    log = tmp_path / "engine.log"
    with serving(model, log, "--enable-deterministic-inference") as on:
        assert asyncio.run(ask([on.url, "http://127.0.0.1:9"])) == [True, False]  # 9: no one
    with serving(model, tmp_path / "plain.log") as off:
        assert asyncio.run(ask([off.url])) == [False]


@pytest.mark.timeout(90)
def test_a_generator_attached_to_a_deterministic_engine_seeds_each_sample(tmp_path: Path) -> None:
    import structlog

    from stages.generator.stage import Generator
    from tests.stages.test_engine_server import serving
    from tests.stages.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", vocab=64)
    published: list[Any] = []

    async def publish(topic: str, payload: Any) -> None:
        published.append((topic, payload))

    async def setup_params(url: str) -> dict[str, Any]:
        ctx = SimpleNamespace(
            stage="generator", replica=0, run_dir=tmp_path / "run", mode="async", version=0,
            log=structlog.get_logger(), outputs={"rollouts": SimpleNamespace()},
            inputs={}, publish=publish, engine_versions={},
        )  # fmt: skip
        stage = Generator(GeneratorConfig(engines=[url]), ctx)
        await stage.setup()
        try:
            return dict(stage.params)
        finally:
            await stage.close()

    with serving(model, tmp_path / "on.log", "--enable-deterministic-inference") as on:
        assert asyncio.run(setup_params(on.url))[SEED_EACH_SAMPLE] == 0
    with serving(model, tmp_path / "off.log") as off:
        assert SEED_EACH_SAMPLE not in asyncio.run(setup_params(off.url))
