"""A publisher that dies while an engine joins its weight group holds up no later join.

The learner hosts the group's TCP store (rank 0). An engine asked to join by a learner that died
before the engine reached its store (the engine was busy, or stopped) retries the dead store for
the join's whole timeout (300 s). The restarted learner must still join and publish at once: its
join runs beside the stuck one, never behind it (``weight_routes``)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from stages.weights.publisher import WeightPublisher
from tests.stages.engine_setup import EngineProcess, free_port
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(120)
GROUP = "weight_update_group"  # SGLang's default name, which a restarted publisher reuses


def _weights(url: str, name: str) -> list[float]:
    resp = requests.post(url + "/get_weights_by_name", json={"name": name}, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_join_whose_publisher_died_does_not_hold_up_the_next(tmp_path: Path) -> None:
    old = make_tiny_model(tmp_path / "old", vocab=128, seed=1)
    new = make_tiny_model(tmp_path / "new", vocab=128, seed=2)
    weights = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict()
    engine = EngineProcess(old, output=tmp_path / "engine.out")
    stuck = None
    try:
        url = engine.wait_up(90)
        body = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),  # its host died before the engine reached it
            "rank_offset": 1,
            "world_size": 2,
            "group_name": GROUP,
            "backend": "gloo",
        }
        stuck = mp.get_context("spawn").Process(
            target=_post, args=(url + "/init_weights_update_group", body), daemon=True
        )
        stuck.start()  # the engine retries the dead store: its answer would take 300 s
        # the publisher's join must come second (a newer join of a group supersedes the older)
        _wait_for(tmp_path / "engine.out", "weights_group_joining", 60)

        async def publish() -> float:
            started = time.monotonic()
            pub = WeightPublisher([url], group_name=GROUP, backend="gloo", timeout_s=30)
            try:
                await pub.connect()
                await pub.publish(list(weights.items()), version=7)
            finally:
                await pub.close()
            return time.monotonic() - started

        took = asyncio.run(publish())
        assert took < 30, took
        name = "model.norm.weight"
        assert _weights(url, name) == weights[name].tolist()
        info = requests.get(url + "/model_info", timeout=10).json()
        assert info["weight_version"] == "7"
        assert stuck.is_alive()  # the first join still waits
        # and its daemon thread does not hold up the engine's exit
        assert engine.stop(15) == 0
    finally:
        if stuck is not None:
            stuck.kill()
        if engine.proc.poll() is None:
            engine.stop(15)


def _wait_for(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the engine never logged {text!r}"
        time.sleep(0.1)


def _post(url: str, body: dict[str, Any]) -> None:
    try:
        requests.post(url, json=body, timeout=400)
    except requests.RequestException:
        pass
