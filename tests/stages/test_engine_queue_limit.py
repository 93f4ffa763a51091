"""``--max-queued-requests`` on the built-in engine as a real server: a new request while the
waiting queue holds that many is refused as SGLang 0.5.23 refuses it (its scheduler's
``_abort_on_queued_limit``: an abort with status 503 and ``The request queue is full.``, which
its tokenizer turns into an ``HTTPException``: FastAPI's error body with that status; a
stream's last chunk with that reason; the ``openai`` client's ``APIStatusError``), counted in
``/server_info``'s ``num_queue_full_refused``, while the queued ones are served. Requests a
pause holds are out of the queue (SGLang's tokenizer holds them) and meet the limit when
generation continues."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch

from stages.engine.aborts import QUEUE_FULL
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.stages.test_engine_llama_forward import CONFIGS, _model
from tests.stages.test_engine_server import serving
from tests.stages.tiny_model import make_tiny_model

FULL = "The request queue is full."


def _send(url: str, path: str, body: dict[str, Any], out: dict[str, Any], key: str) -> None:
    """POST ``body`` on a thread of its own; its (status, text) lands in ``out[key]``."""

    def post() -> None:
        answer = requests.post(url + path, json=body, timeout=60)
        out[key] = (answer.status_code, answer.text)

    thread = threading.Thread(target=post)
    thread.start()
    out.setdefault("threads", []).append(thread)


def _state(url: str) -> dict[str, Any]:
    return requests.get(url + "/server_info", timeout=10).json()["internal_states"][0]


def _until_held(url: str, count: int) -> None:
    """Wait until a pause holds ``count`` requests (each sent after the one before is held)."""
    deadline = time.monotonic() + 20
    while _state(url)["num_held_reqs"] < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(url)["num_held_reqs"] == count


@pytest.mark.timeout(60)
@torch.inference_mode()
def test_a_sample_past_the_limit_ends_at_once_and_the_queued_ones_are_served() -> None:
    """The scheduler's side: with one row running and one sample waiting, a new sample ends
    with SGLang's 503 reason, counted, while the others generate."""
    scheduler = Scheduler(_model(CONFIGS["llama"]()), max_running=1, max_queued=1)
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    running = scheduler.submit(GenerateInput("a", [5, 6, 7], params, False))
    scheduler.step()  # a runs
    queued = scheduler.submit(GenerateInput("b", [5, 6, 8], params, False))
    refused = scheduler.submit(GenerateInput("c", [5, 6, 9], params, False))
    scheduler.run_until_idle()
    assert [len(f.result(timeout=5).output_ids) for f in (running, queued)] == [5, 5]
    result = refused.result(timeout=5)
    assert result.finish_reason == QUEUE_FULL and result.output_ids == []
    assert scheduler.queue_full == 1
    with pytest.raises(ValueError, match="--max-queued-requests must be >= 1"):
        Scheduler(_model(CONFIGS["llama"]()), max_queued=0)


@pytest.mark.timeout(120)
def test_requests_past_the_limit_are_answered_as_sglang_answers_them(tmp_path: Path) -> None:
    """Over HTTP, requests a pause held meet the limit when generation continues: the first
    is queued and served; a plain ``/generate`` gets FastAPI's 503 error body, a stream its
    last chunk with the reason (the fewer fields of SGLang's tokenizer answer), the
    ``openai`` client an ``APIStatusError`` 503."""
    model = make_tiny_model(tmp_path / "model", vocab=128, seed=1)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with serving(model, tmp_path / "engine.log", "--max-queued-requests", "1") as eng:
        url = eng.url
        assert requests.get(url + "/server_info", timeout=10).json()["max_queued_requests"] == 1
        assert requests.post(url + "/pause_generation", json={"mode": "in_place"}).ok
        out: dict[str, Any] = {}
        bodies = {  # in this order: the first is queued, the rest refused
            "first": {"input_ids": [5, 6, 7], "sampling_params": params},
            "plain": {"input_ids": [5, 6, 8], "sampling_params": params},
            "stream": {"input_ids": [5, 6, 9], "sampling_params": params, "stream": True},
        }
        for held, (key, body) in enumerate(bodies.items(), 1):
            _send(url, "/generate", body, out, key)
            _until_held(url, held)
        completion: dict[str, Any] = {}

        def complete() -> None:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            try:  # (no retries: the client retries a 503)
                client.completions.create(model="m", prompt=[5, 6], max_tokens=2)
            except openai.APIStatusError as exc:
                completion["error"] = exc

        thread = threading.Thread(target=complete)
        thread.start()
        _until_held(url, 4)
        assert requests.post(url + "/continue_generation", json={}).ok
        for waiting in [*out.pop("threads"), thread]:
            waiting.join(30)
        status, text = out["first"]
        assert status == 200 and len(json.loads(text)["output_ids"]) == 4
        status, text = out["plain"]  # SGLang's HTTPException handler
        assert status == 503
        assert json.loads(text) == {
            "object": "error", "message": FULL, "type": "503", "param": None, "code": 503,
        }  # fmt: skip
        status, text = out["stream"]
        events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["meta_info"]["finish_reason"] == QUEUE_FULL
        assert last["output_ids"] == [] and "prompt_tokens" not in last["meta_info"]
        error = completion["error"]
        assert error.status_code == 503 and error.body["message"] == FULL
        assert _state(url)["num_queue_full_refused"] == 3
