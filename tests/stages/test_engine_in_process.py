"""The built-in engine inside its caller's process (``stages.engine.in_process``): its HTTP
routes are served by a loop on a thread of their own, so the caller's loop never waits on them
and they never wait on the caller's loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest
import structlog

from stages.engine.in_process import InProcessEngine
from tests.stages.engine_setup import recorded_calls
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(120)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _hold_the_loop(seconds: float) -> None:
    """What a busy caller does to its own loop: nothing else runs on it meanwhile."""
    time.sleep(seconds)


async def test_the_routes_answer_while_the_callers_loop_is_busy_and_stop_with_the_engine(
    tmp_path,
):
    model = make_tiny_model(tmp_path / "model", vocab=32)
    engine = InProcessEngine(
        ["--model", str(model), "--host", "127.0.0.1", "--port", "0"], log=structlog.get_logger()
    )
    await asyncio.wait_for(engine.start(), 60)
    url = f"http://127.0.0.1:{engine.port}"
    try:
        assert "engine-http" in {t.name for t in threading.enumerate()}
        answered: dict[str, float | dict] = {}

        def ask() -> None:
            started = time.monotonic()
            answered["body"] = _post(
                f"{url}/generate",
                {
                    "input_ids": [1, 2, 3],
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                    "return_logprob": True,
                },
            )
            answered["s"] = time.monotonic() - started

        asker = threading.Thread(target=ask)
        asker.start()
        _hold_the_loop(3.0)  # the caller's loop is held for longer than the answer takes
        asker.join(30)
        assert answered["s"] < 2.0, f"the route waited for the caller's loop: {answered['s']} s"
        body = answered["body"]
        assert isinstance(body, dict) and len(body["output_ids"]) == 3
        assert len(body["meta_info"]["output_token_logprobs"]) == 3
        # the caller's own requests still go to the scheduler directly, on its loop
        results = await engine.results(
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
        assert len(results[0].output_ids) == 2
    finally:
        await asyncio.wait_for(engine.close(), 60)
    assert "engine-http" not in {t.name for t in threading.enumerate()}
    with pytest.raises(OSError):
        _post(f"{url}/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})


async def test_the_engine_loads_as_a_server_process_would_with_the_same_options(tmp_path):
    """The loader's options (SGLang's --context-length, --load-format, --trust-remote-code...)
    hold in a generator's process too: a model served there is the one the options describe."""
    model = make_tiny_model(tmp_path / "model", vocab=32)
    argv = ["--model", str(model), "--host", "127.0.0.1", "--port", "0", "--context-length", "24",
            "--load-format", "dummy", "--skip-tokenizer-init"]  # fmt: skip
    engine = InProcessEngine(argv, log=structlog.get_logger())
    await asyncio.wait_for(engine.start(), 60)
    try:
        assert engine.loaded is not None and engine.loaded.context_length == 24
        assert engine.loaded.tokenizer is None
        weights = [p.abs().max().item() for p in engine.loaded.model.parameters()]
        assert max(weights) <= 1e-3  # dummy: drawn, not read
    finally:
        await asyncio.wait_for(engine.close(), 60)


async def _started(tmp_path, *flags: str) -> InProcessEngine:
    """An engine on a tiny model with ``flags``, started in this process."""
    model = make_tiny_model(tmp_path / "model", vocab=32)
    argv = ["--model", str(model), "--host", "127.0.0.1", "--port", "0", *flags]
    engine = InProcessEngine(argv, log=structlog.get_logger())
    await asyncio.wait_for(engine.start(), 60)
    return engine


async def test_group_requests_take_the_request_level_fields_among_the_sampling(tmp_path):
    """A generator's sampling config may hold request-level fields (a custom logit processor, a
    thinking budget): groups handed to the scheduler directly take them for every sample, as
    the body with them at its top level would, and refuse them in the same words."""
    from stages.engine.custom_logits import sglang_string
    from stages.engine.protocol import RequestError

    engine = await _started(tmp_path, "--enable-custom-logit-processor")
    try:
        plain = {"max_new_tokens": 6, "temperature": 0}
        (free,) = await engine.submit_groups([[1, 2, 3]], plain, [["f"]])[0]
        banned = sorted(set(free.output_ids[:2]))
        processor = sglang_string("DisallowedTokensLogitsProcessor")
        params = {**plain, "custom_logit_processor": processor,
                  "custom_params": {"token_ids": banned}}  # fmt: skip
        (group,) = engine.submit_groups([[1, 2, 3]], params, [["a", "b"]])
        for result in await group:
            assert result.output_ids[0] != free.output_ids[0]
            assert not set(banned) & set(result.output_ids)
        with pytest.raises(RequestError, match="--enable-strict-thinking"):
            engine.submit_groups([[1, 2, 3]], {**plain, "max_thinking_tokens": 4}, [["c"]])
    finally:
        await asyncio.wait_for(engine.close(), 60)


async def test_groups_take_the_preferred_sampling_params_and_the_truncation_of_the_engine(
    tmp_path,
):
    """A generator's groups are read as /generate bodies are: --preferred-sampling-params
    under the generator's own sampling config, --allow-auto-truncate cutting a prompt the
    context cannot take to its first context - 6 tokens, with nothing left to generate."""
    preferred = '{"max_new_tokens": 4, "ignore_eos": true}'
    engine = await _started(tmp_path, "--context-length", "24", "--allow-auto-truncate",
                            "--preferred-sampling-params", preferred)  # fmt: skip
    try:
        fours = await engine.submit_groups([[1, 2, 3]], {"temperature": 0}, [["a", "b"]])[0]
        (two,) = await engine.submit_groups([[1, 2, 3]], {"max_new_tokens": 2}, [["c"]])[0]
        assert [len(r.output_ids) for r in (*fours, two)] == [4, 4, 2]
        (cut,) = await engine.submit_groups([list(range(1, 31))], {}, [["d"]])[0]
        assert (cut.prompt_tokens, cut.output_ids) == (18, [])
    finally:
        await asyncio.wait_for(engine.close(), 60)


async def test_an_episodes_session_is_closed_on_the_scheduler_directly(tmp_path):
    """``rollout.hold_kv`` against an engine in the generator's process: the close of an
    episode's session (one only requests named) goes to the scheduler without HTTP and lets go
    of what it held; an ``/open_session`` session of that id is closed by the route."""
    import aiohttp

    from stages.generator.client import InProcessClient

    engine = await _started(tmp_path, "--enable-session-radix-cache")
    try:
        url = f"http://127.0.0.1:{engine.port}"
        async with aiohttp.ClientSession() as http:
            client = InProcessClient(url, http, engine)
            params = {"max_new_tokens": 3, "temperature": 0}
            await client.generate([1, 2, 3, 4], params, rid="e/0", session="e")
            stats = engine.scheduler.prefix_cache_stats()
            assert stats["sessions"] == 1 and stats["session_held_tokens"] > 0
            opened = await http.post(url + "/open_session", json={"capacity_of_str_len": 99,
                                                                  "session_id": "o"})  # fmt: skip
            assert (await opened.json()) == "o"
            sent = recorded_calls(client)
            await client.close_sessions(["e", "o"])
            assert engine.scheduler.prefix_cache_stats()["sessions"] == 0
            # "e" on the scheduler directly; "o", the route's, over HTTP
            assert sent == [("/close_sessions", {"session_ids": ["o"]})]
            again = await http.post(url + "/open_session", json={"capacity_of_str_len": 99,
                                                                 "session_id": "o"})  # fmt: skip
            assert again.status == 200  # closed: its id free again
    finally:
        await asyncio.wait_for(engine.close(), 60)
