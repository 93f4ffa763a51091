"""Parsing SGLang-style /generate responses into completions, and the errors for bad ones; group
requests (body sent, answer checked) against a small in-process HTTP server, with either JSON
codec."""

import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from stages.generator import client as client_module
from stages.generator.client import EngineClient, EngineError, make_session, parse_completion


def _body(**meta):
    return {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 3},
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "weight_version": "4",
            **meta,
        },
    }


def test_per_token_versions_are_used_when_reported():
    c = parse_completion(_body(output_token_weight_versions=[3, 3, 4]))
    assert c.output_ids.dtype == np.int32 and c.output_ids.tolist() == [5, 6, 7]
    assert np.allclose(c.logprobs, [-0.1, -0.2, -0.3]) and c.logprobs.dtype == np.float32
    assert c.versions.tolist() == [3, 3, 4]
    assert c.finish_reason == "length" and c.weight_version == 4


def test_engine_without_per_token_versions_gets_the_final_version_everywhere():
    c = parse_completion(_body())
    assert c.versions.tolist() == [4, 4, 4]


@pytest.mark.parametrize(
    "body",
    [
        {"output_ids": [1]},  # no meta_info
        {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]]}},
        {"output_ids": "x", "meta_info": {}},
    ],
)
def test_malformed_responses_are_final_errors(body):
    with pytest.raises(EngineError) as err:
        parse_completion(body, "http://e")
    assert not err.value.retryable and "http://e" in str(err.value)


def test_version_spans_give_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    c = parse_completion(_body(weight_versions=spans, output_token_weight_versions=[9, 9, 9]))
    assert c.versions.tolist() == [3, 4, 4]  # spans first (SGLang's field, and cheaper)
    assert c.versions.dtype == np.int32


def test_numeric_string_versions_per_token():
    c = parse_completion(_body(output_token_weight_versions=["3", "3", "4"]))
    assert c.versions.tolist() == [3, 3, 4]
    c = parse_completion(_body(output_token_weight_versions=["default", "3", "x"]))
    assert c.versions.tolist() == [0, 3, 0]  # SGLang's unnamed version counts as 0


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "3", "start": 0, "end": 2}],  # covers 2 of 3 tokens
        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 2, "end": 3}],  # a gap
    ],
)
def test_spans_that_do_not_tile_the_output_are_final_errors(spans):
    with pytest.raises(EngineError) as err:
        parse_completion(_body(weight_versions=spans), "http://e")
    assert not err.value.retryable and "weight_versions" in str(err.value)


def test_empty_completion():
    body = {"output_ids": [], "meta_info": {"finish_reason": "abort", "weight_version": "2",
            "weight_versions": [{"version": "2", "start": 0, "end": 0}]}}  # fmt: skip
    c = parse_completion(body)
    assert len(c.output_ids) == len(c.logprobs) == len(c.versions) == 0
    assert c.finish_reason == "abort" and c.weight_version == 2


class _Answers:
    """A one-route HTTP server answering /generate with whatever the test sets."""

    def __init__(self) -> None:
        self.status, self.body, self.seen = 200, None, []

    async def __aenter__(self) -> EngineClient:
        app = web.Application()

        async def generate(request: web.Request) -> web.Response:
            self.seen.append(await request.json())
            return web.json_response(self.body, status=self.status)

        app.router.add_post("/generate", generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.session = make_session(8)
        return EngineClient(f"http://127.0.0.1:{port}", self.session, timeout_s=10)

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.runner.cleanup()


def _result(rid: str) -> dict:
    return _body(id=rid)


@pytest.fixture(params=["default", "stdlib"])
def codec(request, monkeypatch):
    """The client's JSON codec: the default (orjson when installed) or the standard library."""
    if request.param == "stdlib":
        monkeypatch.setattr(client_module, "_dumps", client_module._std_dumps)
        monkeypatch.setattr(client_module, "_loads", json.loads)
        monkeypatch.setattr(client_module, "_DECODE_ERRORS", (ValueError,))
    return request.param


@pytest.mark.timeout(10)
async def test_group_request_body_and_answer(codec):
    server = _Answers()
    async with server as client:
        server.body = [_result("a"), _result("b")]
        got = await client.generate_group(
            np.array([3, 4], dtype=np.int64), {"x": 1}, rids=["a", "b"]
        )
        assert [c.output_ids.tolist() for c in got] == [[5, 6, 7], [5, 6, 7]]
        assert server.seen == [
            {"input_ids": [[3, 4], [3, 4]], "sampling_params": {"x": 1}, "return_logprob": True,
             "rid": ["a", "b"]}
        ]  # fmt: skip


def test_the_request_fields_are_the_engines() -> None:
    from stages.engine.protocol import REQUEST_LEVEL_FIELDS
    from stages.generator.client import REQUEST_FIELDS

    assert REQUEST_FIELDS == REQUEST_LEVEL_FIELDS


@pytest.mark.timeout(10)
async def test_a_request_field_among_the_sampling_goes_to_the_request(codec):
    """RolloutEngine.generate's keywords are sampling parameters, and require_reasoning,
    max_thinking_tokens and custom_logit_processor, GenerateReqInput's own fields: the body
    carries them at the top level."""
    server = _Answers()
    async with server as client:
        server.body = _result("a")
        await client.generate(
            [3, 4], {"x": 1, "require_reasoning": True, "max_thinking_tokens": 8,
                     "custom_logit_processor": "{}"}, rid="a"
        )  # fmt: skip
        assert server.seen == [
            {"input_ids": [3, 4], "sampling_params": {"x": 1}, "return_logprob": True,
             "rid": "a", "require_reasoning": True, "max_thinking_tokens": 8,
             "custom_logit_processor": "{}"}
        ]  # fmt: skip


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("status", "body", "retryable", "words"),
    [
        (200, _result("a"), False, "expected a list of 2 results"),  # batch not understood
        (200, [_result("a")], False, "a list of 1"),
        (200, [_result("b"), _result("a")], False, "out of request order"),
        (400, {"error": {"message": "input_ids: bad"}}, False, "400"),
        (503, {"error": {"message": "busy"}}, True, "503"),
    ],
)
async def test_group_request_failures_are_sorted(codec, status, body, retryable, words):
    server = _Answers()
    async with server as client:
        server.status, server.body = status, body
        with pytest.raises(EngineError) as err:
            await client.generate_group([3, 4], {}, rids=["a", "b"])
        assert err.value.retryable is retryable and words in str(err.value)


@pytest.mark.timeout(10)
async def test_connection_refused_is_retryable():
    async with aiohttp.ClientSession() as session:
        client = EngineClient("http://127.0.0.1:9", session, timeout_s=5)
        with pytest.raises(EngineError) as err:
            await client.generate([1], {}, rid="r")
        assert err.value.retryable


def test_an_in_process_result_reads_as_its_http_answer_would():
    """``completion_of`` (the in-process engine's results, no JSON) gives what
    ``parse_completion`` reads from the rendered ``/generate`` answer of the same result."""
    from stages.engine.protocol import SequenceResult, render_result
    from stages.generator.client import completion_of, parse_completion

    result = SequenceResult(
        rid="run/p1/0",
        prompt_tokens=5,
        output_ids=[7, 8, 9],
        finish_reason={"type": "stop", "matched": 9},
        weight_version="4",
        output_token_weight_versions=["3", "3", "4"],  # spanned an update
        output_token_logprobs=[-0.5, -0.25, -1.0],
        cached_tokens=2,
        cached_weight_version="3",
        e2e_latency=0.01,
    )
    direct = completion_of(result)
    rendered = render_result(result, decode=None, skip_special_tokens=True, return_logprob=True)
    via_http = parse_completion(rendered)
    for field in ("output_ids", "logprobs", "versions"):
        got, want = getattr(direct, field), getattr(via_http, field)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), field
    assert direct.versions.tolist() == [3, 3, 4]
    assert (
        (direct.finish_reason, direct.weight_version)
        == ("stop", 4)
        == (
            via_http.finish_reason,
            via_http.weight_version,
        )
    )
    for key in ("id", "cached_tokens", "prompt_tokens", "completion_tokens", "finish_reason"):
        assert direct.meta[key] == via_http.meta[key], key


def _results():
    from stages.engine.protocol import SequenceResult

    def one(index: int, ids: list[int], versions: list[str], reason: dict) -> SequenceResult:
        return SequenceResult(
            rid=f"run/p1/{index}",
            prompt_tokens=5,
            output_ids=ids,
            finish_reason=reason,
            weight_version=versions[-1] if versions else "0",
            output_token_weight_versions=versions,
            output_token_logprobs=[-0.5] * len(ids),
        )

    return [
        one(0, [7, 8, 9], ["3", "3", "4"], {"type": "stop", "matched": 9}),
        one(1, [5], ["4"], {"type": "length", "length": 1}),
    ]


def test_a_group_s_results_kept_as_columns_read_as_their_completions():
    """``InProcessClient.finished`` (a group's results as the columns its rollout group
    carries) gives per sample what ``completion_of`` gives, and the newest version."""
    from stages.generator.client import InProcessClient, completion_of
    from stages.rollout_batch import Finished

    client = InProcessClient("http://e", session=None, engine=None)
    results = _results()
    done, newest = client.finished(results, None, "http://e", (0.25, 0.5))
    assert isinstance(done, Finished) and len(done) == 2 and done.tokens == 4 and newest == 4
    for sample, result in zip(done.maps(), results, strict=True):
        want = completion_of(result)
        assert sample["completion_ids"].tolist() == want.output_ids.tolist()
        assert sample["sampler_logprobs"].dtype == want.logprobs.dtype
        assert sample["versions"].tolist() == want.versions.tolist()
        assert sample["finish_reason"] == want.finish_reason
        assert sample["engine"] == "http://e"
        assert sample["timings"] == {"queued_s": 0.25, "generate_s": 0.5}
    pinned, newest = client.finished(results, 9, "http://e", (0.0, 0.0))  # a LoRA adapter's
    assert [s["versions"].tolist() for s in pinned.maps()] == [[9, 9, 9], [9]] and newest == 9


def test_a_result_without_a_log_prob_per_token_is_an_engine_error():
    from stages.generator.client import InProcessClient

    results = _results()
    results[1].output_token_logprobs = []
    client = InProcessClient("http://e", session=None, engine=None)
    with pytest.raises(EngineError, match="1 tokens, 0 log-probs and 1 versions") as err:
        client.finished(results, None, "http://e", (0.0, 0.0))
    assert not err.value.retryable


async def test_an_in_process_engine_s_version_is_read_as_model_info_gives_it(tmp_path):
    """``InProcessClient.weight_version`` reads the scheduler instead of asking its own
    ``/model_info``: the same answer, before and after a version change."""
    import asyncio

    import structlog

    from stages.engine.in_process import InProcessEngine
    from stages.generator.client import InProcessClient
    from tests.stages.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", vocab=32)
    engine = InProcessEngine(
        ["--model", str(model), "--host", "127.0.0.1", "--port", "0"], log=structlog.get_logger()
    )
    await asyncio.wait_for(engine.start(), 60)
    session = make_session(4)
    try:
        client = InProcessClient(f"http://127.0.0.1:{engine.port}", session, engine)
        for version in ("0", "7"):
            if version != "0":
                await asyncio.wrap_future(engine.scheduler.set_weight_version(version))
            direct = await client.weight_version()
            over_http = await EngineClient.weight_version(client)
            assert direct == over_http == int(version)
    finally:
        await session.close()
        await asyncio.wait_for(engine.close(), 30)
