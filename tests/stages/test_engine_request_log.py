"""SGLang's request logging, request and crash dumps, ``/configure_logging``,
``/set_internal_state`` and ``/set_trace_level`` on the built-in engine
(``stages.engine.request_log``, ``logging_routes``, ``maintenance_routes``), as SGLang 0.5.23
has them (``utils/request_logger.py``, ``TokenizerManager.dump_requests`` and
``dump_requests_before_crash``, ``scheduler_components/internal_state.py``).

Each log line is checked against the answer the client got for the same sample: its rid, its
own prompt out of a batch, its output ids; what each level leaves out is left out.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import requests
import structlog
from aiohttp.test_utils import TestClient, TestServer

from stages.engine.in_process import InProcessEngine
from stages.engine.loader import load_model
from stages.engine.request_log import RequestLog, for_json, limits, redacted, truncated
from stages.engine.scheduler import Scheduler
from stages.engine.server import build_app
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import EOS_ID, make_byte_model, make_tiny_classifier

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_byte_model(tmp_path_factory.mktemp("request_log") / "m")


def _lines(folder: Path) -> list[str]:
    """The request log's lines written to ``folder`` so far, without their time stamps."""
    text = (folder / f"{socket.gethostname()}_0.log").read_text()
    return [line.split("] ", 1)[1] for line in text.splitlines() if line]


def _events(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(folder)]


def test_a_launched_engine_logs_each_request_and_sample_as_sglang_does(
    model: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    flags = ("--log-requests", "--log-requests-format", "json", "--log-requests-target", str(logs))
    headers = {"x-smg-routing-key": "route-7", "x-other": "not logged"}
    with builtin_engine(model, *flags) as url:
        info = requests.get(url + "/server_info", timeout=10).json()
        assert (info["log_requests"], info["log_requests_level"]) == (True, 2)
        assert info["log_requests_format"] == "json" and info["log_requests_target"] == [str(logs)]
        params = {"max_new_tokens": 4, "temperature": 0, "n": 2}
        batch = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": params, "rid": "b"}
        answers = requests.post(url + "/generate", json=batch, headers=headers, timeout=30).json()
        single = {"text": "hi", "sampling_params": {"max_new_tokens": 3}, "stream": True}
        streamed = requests.post(url + "/generate", json=single, timeout=30)
        assert streamed.status_code == 200
        completion = {"model": "m", "prompt": "ab", "max_tokens": 2, "logprobs": 1}
        assert requests.post(url + "/v1/completions", json=completion, timeout=30).ok

    events = _events(logs)
    assert [e["event"] for e in events[:5]] == ["request.received"] + ["request.finished"] * 4
    received, finished = events[0], events[1:5]
    rids = [a["meta_info"]["id"] for a in answers]
    assert received["rid"] == rids and received["headers"] == {"x-smg-routing-key": "route-7"}
    assert received["obj"]["input_ids"] == batch["input_ids"]
    assert received["obj"]["sampling_params"] == params
    by_rid = {e["rid"]: e for e in finished}
    assert sorted(by_rid) == sorted(rids)
    for index, answer in enumerate(answers):
        event = by_rid[answer["meta_info"]["id"]]
        prompt = batch["input_ids"][index // 2]  # n=2: each prompt's samples, in order
        assert event["obj"]["input_ids"] == prompt, event
        assert event["obj"]["text"]  # level 2: the prompt's text, decoded (SGLang's FIXME)
        assert event["out"]["output_ids"] == answer["output_ids"]
        assert event["out"]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
        assert event["headers"] == {"x-smg-routing-key": "route-7"}
    rest = events[5:]
    assert [e["event"] for e in rest[:2]] == ["request.received", "request.finished"]
    assert rest[0]["obj"]["text"] == "hi" and rest[0]["obj"]["stream"] is True
    assert len(rest[1]["out"]["output_ids"]) == rest[1]["out"]["meta_info"]["completion_tokens"]
    # a /v1 request: as it came (level 2), then as the generating request it became
    assert rest[2]["event"] == "request.received.openai" and rest[2]["obj"] == completion
    assert [e["event"] for e in rest[3:]] == ["request.received", "request.finished"]
    assert rest[3]["obj"]["return_logprob"] is True


def _app(model: Path, request_log: RequestLog | None = None) -> tuple[Any, Scheduler]:
    loaded = load_model(str(model), device="cpu")
    scheduler = Scheduler(loaded.model, max_running=4, eos_token_ids=[EOS_ID])
    scheduler.start()
    return build_app(loaded, scheduler, request_log=request_log), scheduler


def _run(app: Any, scheduler: Scheduler, test: Any) -> None:
    async def main() -> None:
        async with TestClient(TestServer(app)) as client:
            await test(client)

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()


def test_configure_logging_changes_level_format_and_dumps_while_serving(
    model: Path, tmp_path: Path
) -> None:
    logs, dumps = tmp_path / "logs", tmp_path / "dumps"
    app, scheduler = _app(model, RequestLog(targets=[str(logs)]))
    body = {"input_ids": [5, 6, 7], "rid": "one", "sampling_params": {"max_new_tokens": 2}}

    async def test(client: TestClient) -> None:
        assert (await client.post("/generate", json=body)).status == 200
        assert not (logs / f"{socket.gethostname()}_0.log").exists()  # off: nothing logged
        on = {"log_requests": True, "log_requests_level": "0"}  # lax, as SGLang's struct
        answer = await client.post("/configure_logging", json=on)
        assert answer.status == 200 and await answer.read() == b""
        assert (await client.post("/generate", json={**body, "rid": "two"})).status == 200
        lines = _lines(logs)
        assert lines[0] == "Receive: obj={'rid': 'two'}"  # level 0: metadata only
        assert lines[1].startswith("Finish: obj={'rid': 'two'}, out={'meta_info': {'id': 'two',")
        assert "output_ids" not in lines[1]
        # SGLang's 500 for a level it does not know; nothing changes
        for bad in ({"log_requests_level": 7}, {"log_level": "loud"}):
            answer = await client.post("/configure_logging", json=bad)
            assert (answer.status, await answer.text()) == (500, "Internal Server Error")
        refused = await client.post("/configure_logging", json={"log_requests_level": "x"})
        assert refused.status == 400 and "log_requests_level" in (await refused.json())["message"]
        assert (await client.post("/configure_logging")).status == 400  # the body is required
        dump = {"log_requests_level": 3, "dump_requests_folder": str(dumps),
                "dump_requests_threshold": 3}  # fmt: skip
        assert (await client.post("/configure_logging", json=dump)).status == 200
        batch = {
            "input_ids": [[5, 6], [7, 8], [9, 10]],
            "rid": ["a", "b", "c"],
            "sampling_params": [{"max_new_tokens": n} for n in (1, 2, 3)],
            "watermark_key": "5ec2e7c0ffee",
        }  # fmt: skip  (ignored, and never logged)
        answers = await (await client.post("/generate", json=batch)).json()
        assert [len(a["output_ids"]) for a in answers] == [1, 2, 3]
        received = _lines(logs)[2]
        assert received.startswith("Receive: obj={'rid': ['a', 'b', 'c'], 'input_ids': [[5, 6]")
        assert "'watermark_key': '<redacted>'" in received
        assert "5ec2e7c0ffee" not in "".join(_lines(logs))
        for _ in range(100):  # written on a thread of its own
            files = list(dumps.glob("*.pkl"))
            if files:
                break
            await asyncio.sleep(0.05)
        data = pickle.loads(files[0].read_bytes())
        assert set(data) == {"server_args", "config_updates", "resolved_config", "requests"}
        dumped = {obj["rid"]: (obj, out) for obj, out, created, ended in data["requests"]}
        assert sorted(dumped) == ["a", "b", "c"]
        for rid, answer in zip("abc", answers, strict=True):
            obj, out = dumped[rid]
            assert out["output_ids"] == answer["output_ids"]
            assert obj["sampling_params"] == {"max_new_tokens": len(answer["output_ids"])}
            assert obj["watermark_key"] == "<redacted>"

    _run(app, scheduler, test)


def test_a_failing_step_dumps_recent_and_running_requests(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashes = tmp_path / "crashes"
    app, scheduler = _app(model, RequestLog(crash_dump_folder=str(crashes)))
    real = scheduler._decode
    failing = {"on": False}

    def decode() -> None:
        if failing["on"]:
            failing["on"] = False
            raise RuntimeError("a broken kernel")
        real()

    monkeypatch.setattr(scheduler, "_decode", decode)

    async def test(client: TestClient) -> None:
        done = {"input_ids": [5, 6], "rid": "done", "sampling_params": {"max_new_tokens": 2}}
        assert (await client.post("/generate", json=done)).status == 200
        failing["on"] = True
        params = {"max_new_tokens": 8, "ignore_eos": True}
        broken = await client.post("/generate", json={"input_ids": [7], "rid": "x",
                                                      "sampling_params": params})  # fmt: skip
        assert broken.status >= 400
        assert (await client.post("/generate", json={**done, "rid": "after"})).status == 200

    _run(app, scheduler, test)
    files = list((crashes / socket.gethostname()).glob("crash_dump_*.pkl"))
    assert len(files) == 1
    with open(files[0], "rb") as f:
        data = pickle.load(f)
    assert data["launch_command"] and set(data) >= {"server_args", "requests"}
    entries = [(obj["rid"], out) for obj, out, created, ended in data["requests"]]
    assert [rid for rid, _ in entries] == ["done", "x"]  # the last 5 minutes', then in flight
    assert entries[0][1]["meta_info"]["id"] == "done"
    so_far = entries[1][1]  # the token its prefill drew, and its text (SGLang's last chunk)
    assert len(so_far["output_ids"]) == 1 and isinstance(so_far["text"], str), so_far


def test_set_internal_state_and_set_trace_level_answer_as_sglangs(model: Path) -> None:
    app, scheduler = _app(model)

    async def test(client: TestClient) -> None:
        async def state(body: Any, method: str = "POST") -> Any:
            answer = await client.request(method, "/set_internal_state", json=body)
            return answer.status, await answer.json()

        assert await state({"server_args": {"pp_max_micro_batch_size": 4}}) == (200, [True])
        assert await state({"server_args": {"pp_max_micro_batch_size": 5}}) == (200, [False])
        assert await state({"server_args": {"max_running_requests": 2}}, "PUT") == (200, [False])
        both = {"speculative_accept_threshold_acc": 0.5, "dspark_force_budget_frac": 0.5}
        assert await state({"server_args": both}) == (200, [False])  # nothing applied
        taken = {"speculative_accept_threshold_single": 0.25}
        assert await state({"server_args": taken}) == (200, [True])
        status, body = await state({"server_args": {"x": "many"}})
        assert status == 400 and body["message"].startswith("server_args.x")
        info = await (await client.get("/server_info")).json()
        internal = info["internal_states"][0]
        assert internal["pp_max_micro_batch_size"] == 4
        assert internal["speculative_accept_threshold_single"] == 0.25
        assert "speculative_accept_threshold_acc" not in internal
        answer = await client.get("/set_trace_level", params={"level": "2"})
        assert (answer.status, await answer.text()) == (200, "success")
        for query in ({"level": "-1"}, {"level": "x"}, {}):
            answer = await client.post("/set_trace_level", params=query)
            assert answer.status == 400 and "query.level" in (await answer.json())["message"]

    _run(app, scheduler, test)


def test_rendering_cuts_skips_and_redacts_as_sglang() -> None:
    assert limits(0)[1] >= {"input_ids", "sampling_params"} and limits(2)[0] == 2048
    with pytest.raises(ValueError):
        limits(4)
    data = {"text": "abcdefgh", "ids": list(range(6)), "n": None,
            "sampling_params": {"watermark": {"key": "k", "enabled": True}}}  # fmt: skip
    # what SGLang 0.5.23's functions give for it (a redacted key is cut like any string)
    assert truncated(data, 4, {"n"}) == (
        "{'text': 'ab' ... 'gh', 'ids': [0, 1] ... [4, 5], "
        "'sampling_params': {'watermark': {'key': '<r' ... 'd>', 'enabled': True}}}"
    )
    assert for_json(data, 4) == {
        "text": "ab...gh", "ids": [0, 1, "...", 4, 5], "n": None,
        "sampling_params": {"watermark": {"key": "<r...d>", "enabled": True}},
    }  # fmt: skip
    assert redacted([({"watermark_key": 1},)]) == [({"watermark_key": "<redacted>"},)]


async def test_an_engine_in_the_generators_process_logs_its_groups_and_serves_every_flag(
    model: Path, tmp_path: Path
) -> None:
    """``launch.in_process``: the generator's own groups (no HTTP) are logged as the
    ``/generate`` body they stand for, and the server flags hold as in the engine's own process
    (``--enable-metrics`` was dropped there before)."""
    logs = tmp_path / "logs"
    argv = ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--enable-metrics",
            "--log-requests", "--log-requests-format", "json", "--log-requests-target",
            str(logs)]  # fmt: skip
    engine = InProcessEngine(argv, log=structlog.get_logger())
    await asyncio.wait_for(engine.start(), 60)
    try:
        params = {"max_new_tokens": 3, "temperature": 0}
        futures = engine.submit_groups([[5, 6, 7], [8, 9]], params, [["a0", "a1"], ["b0"]])
        groups = await asyncio.wait_for(asyncio.gather(*futures), 60)
        url = f"http://127.0.0.1:{engine.port}"
        metrics = await asyncio.to_thread(requests.get, url + "/metrics", timeout=10)
        assert metrics.status_code == 200 and "sglang:num_requests" in metrics.text
    finally:
        await asyncio.wait_for(engine.close(), 60)
    events = _events(logs)
    assert [e["event"] for e in events] == ["request.received"] + ["request.finished"] * 3
    assert events[0]["rid"] == ["a0", "a1", "b0"]
    assert events[0]["obj"]["input_ids"] == [[5, 6, 7], [5, 6, 7], [8, 9]]
    finished = {e["rid"]: e for e in events[1:]}
    for rid, result in zip(["a0", "a1", "b0"], [*groups[0], *groups[1]], strict=True):
        assert finished[rid]["out"]["output_ids"] == result.output_ids
        assert finished[rid]["obj"]["input_ids"] == ([8, 9] if rid == "b0" else [5, 6, 7])
        assert finished[rid]["obj"]["sampling_params"] == params


def test_a_reward_model_engine_logs_its_scoring_requests(tmp_path: Path) -> None:
    """The pooling engine (a reward model's): ``/classify`` batches logged per item with the
    scores it answered, ``/v1/classify`` as it came too, ``/configure_logging`` there, and the
    other routes SGLang serves on any model (but ``/slow_down``, which needs a scheduler)."""
    model = make_tiny_classifier(tmp_path / "rm", seed=5)
    logs = tmp_path / "logs"
    flags = ("--log-requests", "--log-requests-format", "json", "--log-requests-target", str(logs))
    with builtin_engine(model, *flags) as url:
        batch = {"input_ids": [[5, 6, 7], [8, 9]], "rid": ["r0", "r1"]}
        answers = requests.post(url + "/classify", json=batch, timeout=30).json()
        openai = {"model": "m", "input": [5, 6]}
        assert requests.post(url + "/v1/classify", json=openai, timeout=30).ok
        quiet = {"log_requests_level": 0}
        assert requests.post(url + "/configure_logging", json=quiet, timeout=10).ok
        assert requests.post(url + "/classify", json={"input_ids": [4], "rid": "q"}).ok
        # what SGLang serves on any model, a reward model's engine too
        state = {"server_args": {"pp_max_micro_batch_size": 2}}
        assert requests.post(url + "/set_internal_state", json=state, timeout=10).json() == [True]
        info = requests.get(url + "/server_info", timeout=10).json()
        assert info["internal_states"][0]["pp_max_micro_batch_size"] == 2
        assert requests.get(url + "/freeze_gc", timeout=30).text == "Garbage collection frozen.\n"
        assert requests.post(url + "/flush_cache", timeout=10).text.startswith("Cache flushed.")
        assert requests.post(url + "/slow_down", json={"forward_sleep_time": 1}).status_code == 404
        split = {"text": "<think>a</think>b", "reasoning_parser": "qwen3"}
        parsed = requests.post(url + "/separate_reasoning", json=split, timeout=10).json()
        assert (parsed["reasoning_text"], parsed["text"]) == ("a", "b")
    events = _events(logs)
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["request.received", "request.finished", "request.finished"]
    assert events[0]["rid"] == ["r0", "r1"] and events[0]["obj"]["input_ids"] == [[5, 6, 7], [8, 9]]
    for event, answer, ids in zip(events[1:3], answers, batch["input_ids"], strict=True):
        assert event["rid"] == answer["meta_info"]["id"] and event["obj"]["input_ids"] == ids
        assert event["out"]["embedding"] == answer["embedding"]
    assert kinds[3:6] == ["request.received.openai", "request.received", "request.finished"]
    assert events[3]["obj"] == openai and events[4]["obj"]["input_ids"] == [5, 6]
    # level 0: no inputs, no embedding
    assert kinds[6:] == ["request.received", "request.finished"]
    assert events[6]["obj"] == {"rid": "q"} and "embedding" not in events[7]["out"]
