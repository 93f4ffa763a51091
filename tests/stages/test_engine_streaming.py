"""Streaming (``stream: true``) from the built-in engine as a real server process: the native
``/generate`` through ``requests`` and ``aiohttp`` (SSE read line by line, as SGLang's own clients
read it) and ``/v1/completions`` through the ``openai`` client. Layouts follow SGLang 0.5:
``http_server.serve_generate_request`` (``data: {json}`` events, then ``data: [DONE]``),
``TokenizerManager._handle_batch_output`` (every chunk cumulative at the default, ``index`` in a
batch: ``_stream_batch_responses``), ``serving_completions._generate_completion_stream`` (text
deltas, a usage chunk with ``stream_options.include_usage``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import time
from typing import Any

import aiohttp
import openai
import pytest
import requests

from tests.stages.engine_setup import sglang_text
from tests.stages.test_engine_server import (  # noqa: F401
    GREEDY,
    Engine,
    _tokenizer,
    engine,
    serving,
)

PROMPT = [21, 22, 23, 24]


def _events(engine: Engine, body: dict[str, Any]) -> tuple[requests.Response, list[Any]]:  # noqa: F811
    """POST ``body`` to /generate and read its server-sent events: each ``data:`` payload
    (JSON, or the string ``[DONE]``)."""
    response = requests.post(engine.url + "/generate", json=body, stream=True, timeout=30)
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return response, events


@pytest.mark.timeout(60)
def test_a_stream_grows_token_by_token_and_ends_with_the_whole_answer(engine: Engine) -> None:  # noqa: F811
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
    }
    whole = engine.generate(body)
    for _ in range(5):  # a loop that falls behind merges what piled up into the newest: again
        response, events = _events(engine, {**body, "stream": True})
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert events[-1] == "[DONE]"
        if len(events) >= 3:
            break
    assert len(events) >= 3, "every try came merged into one chunk: nothing was streamed"
    chunks = events[:-1]
    for before, after in itertools.pairwise(chunks):  # cumulative: each extends the one before
        n = len(before["output_ids"])
        assert after["output_ids"][:n] == before["output_ids"] and len(after["output_ids"]) > n
        assert after["text"].startswith(before["text"])
    for chunk in chunks[:-1]:
        meta = chunk["meta_info"]
        assert meta["finish_reason"] is None and "index" not in chunk
        assert meta["completion_tokens"] == len(chunk["output_ids"])
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert meta["id"] == chunks[-1]["meta_info"]["id"]
        assert meta["num_retractions"] == 0
        assert "queue_time" not in meta  # the time stats need --enable-metrics
    # SGLang stamps the time its first chunk is sent at (TokenizerManager._wait_one_response)
    assert abs(chunks[0]["meta_info"]["response_sent_to_client_ts"] - time.time()) < 60
    assert not [c for c in chunks[1:] if "response_sent_to_client_ts" in c["meta_info"]]
    _, (only, done) = _events(
        engine, {**body, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 1}}
    )
    assert done == "[DONE]" and "response_sent_to_client_ts" in only["meta_info"]
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # each chunk's text as SGLang's detokenizer decodes it: after the prompt's last 5 tokens
    # (with this tokenizer, which joins words with spaces, a space before the first word)
    tokenizer = _tokenizer(engine)
    for chunk in chunks:
        assert chunk["text"] == sglang_text(tokenizer, PROMPT, chunk["output_ids"])
    assert last["text"].startswith(" ")
    for got, want in zip(
        last["meta_info"]["output_token_logprobs"],
        whole["meta_info"]["output_token_logprobs"],
        strict=True,
    ):
        assert got[1] == want[1] and math.isclose(got[0], want[0], abs_tol=1e-5)
    # the chunks before the last carried the same log-probs, token by token
    first = chunks[0]["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in first] == whole["output_ids"][: len(first)]


@pytest.mark.timeout(60)
def test_a_streamed_batch_with_n_tags_chunks_with_their_index(engine: Engine) -> None:  # noqa: F811
    body = {
        "input_ids": [PROMPT, [40, 41, 42]],
        "sampling_params": {**GREEDY, "max_new_tokens": 6, "n": 2},
    }
    whole = engine.generate(body)
    _, events = _events(engine, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    finals: dict[int, Any] = {}
    for chunk in events[:-1]:
        index = chunk["index"]
        assert index not in finals, "a chunk after the sample's last"
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[index] = chunk
    assert sorted(finals) == [0, 1, 2, 3]
    for index, chunk in finals.items():
        assert chunk["output_ids"] == whole[index]["output_ids"]
        assert chunk["text"] == whole[index]["text"]


@pytest.mark.timeout(60)
def test_a_streamed_stop_string_is_trimmed_in_the_last_chunk(engine: Engine) -> None:  # noqa: F811
    greedy = {**GREEDY, "max_new_tokens": 10}
    free = engine.generate({"input_ids": PROMPT, "sampling_params": greedy})
    words = free["text"].split()
    stop = words[2] if len(words) > 3 else None
    if stop is None or free["text"].count(stop) != 1:
        pytest.skip(f"no word of {free['text']!r} stands once")
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": 10, "stop": stop},
        "stream": True,
    }
    _, events = _events(engine, body)
    last = events[-2]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["text"] == free["text"][: free["text"].find(stop)]


@pytest.mark.timeout(60)
def test_a_streamed_chunk_is_held_while_the_text_may_be_ending_in_a_stop_string(
    engine: Engine,  # noqa: F811
) -> None:
    """SGLang 0.5 (``OutputStreamer.accept`` with ``Req.check_match_stop_str_prefix``): no chunk
    goes out while the sample's text ends in the start of a stop string. Here the stop string
    is the text of the 4th to 6th tokens and a character the model never writes: the chunks
    after 4 and 5 tokens are held, and their tokens come with the next one; nothing is lost."""
    greedy = {**GREEDY, "max_new_tokens": 10}
    free = engine.generate({"input_ids": PROMPT, "sampling_params": greedy})
    decode = _tokenizer(engine).decode
    texts = [decode(free["output_ids"][:k]) for k in range(11)]
    if not all(b.startswith(a) for a, b in itertools.pairwise(texts)) or texts[3] == texts[6]:
        pytest.skip(f"{free['text']!r} does not grow token by token")
    stop = texts[6][len(texts[3]) :] + "\u2603"
    starts = [
        k for k in range(1, 10) if any(texts[k].endswith(stop[:i]) for i in range(1, len(stop) + 1))
    ]
    body = {"input_ids": PROMPT, "sampling_params": {**greedy, "stop": stop}, "stream": True}
    assert 4 in starts and 5 in starts, starts
    seen = []
    for _ in range(5):  # chunks a busy client reads late are merged into the newest: try again
        _, events = _events(engine, body)
        chunks, last = events[:-2], events[-2]
        sent = [c["meta_info"]["completion_tokens"] for c in chunks]
        assert not set(sent) & set(starts), (sent, starts)  # held while it could be the stop
        assert last["output_ids"] == free["output_ids"] and last["text"] == free["text"]
        seen += sent
        if sent:
            break
    assert seen, "every chunk came merged into the last in 5 requests: nothing was checked"


@pytest.mark.timeout(60)
def test_a_client_that_goes_away_mid_stream_frees_its_slot_and_is_counted(engine: Engine) -> None:  # noqa: F811
    before = engine.request("GET", "/server_info")[1]["refused_requests"]

    async def read_two_chunks_and_leave() -> list[bytes]:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_new_tokens": 500},
            "stream": True,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(engine.url + "/generate", json=body) as response:
                assert response.status == 200
                lines = []
                async for line in response.content:
                    if line.strip():
                        lines.append(line)
                    if len(lines) == 2:
                        break
                response.close()  # the connection goes, mid-stream
                return lines

    lines = asyncio.run(read_two_chunks_and_leave())
    assert all(line.startswith(b"data: {") for line in lines)
    deadline = time.monotonic() + 20
    while True:  # the engine notices at its next write and aborts the sample
        info = engine.request("GET", "/server_info")[1]
        running = info["internal_states"][0]["num_running_reqs"]
        gone = info["refused_requests"].get("POST /generate 499", 0)
        if running == 0 and gone > before.get("POST /generate 499", 0):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    # and it serves on
    assert engine.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})


def _raw_stream(
    engine: Engine,  # noqa: F811
    body: dict[str, Any],
    version: str,
    *,
    receive_buffer: int = 0,
    read_after: float = 0.0,
) -> bytes:
    """POST ``body`` to /generate over a plain socket as an HTTP ``version`` client, and read
    the answer until the server closes or the chunked body ends; the raw bytes. A slow client:
    a ``receive_buffer`` of that many bytes, and nothing read for ``read_after`` seconds."""
    data = json.dumps(body).encode()
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        if receive_buffer:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        conn.connect((host, int(port)))
        conn.sendall(
            f"POST /generate HTTP/{version}\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        time.sleep(read_after)
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            piece = conn.recv(65536)
            if not piece:
                break
            raw += piece
    return raw


def _unchunked(body: bytes) -> bytes:
    """A chunked transfer-encoded body, decoded (every chunk's size checked)."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        assert body[size : size + 2] == b"\r\n", body[: size + 2]
        out, body = out + body[:size], body[size + 2 :]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_a_stream_reaches_http_1_0_and_1_1_clients_whole(engine, version) -> None:  # noqa: F811
    """After the first, a stream's chunks go straight to the connection (framed as chunks of
    a chunked body) while nothing waits there: an HTTP/1.1 client and an HTTP/1.0 one (no
    chunked encoding, so aiohttp's writes throughout) get the same events, each whole."""
    tokens = 24
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": tokens},
        "return_logprob": True,
    }
    whole = engine.generate(body)
    for _ in range(5):  # a loop that falls behind merges what piled up into the newest: again
        raw = _raw_stream(engine, {**body, "stream": True}, version)
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/{version} 200".encode()), head
        chunked = b"transfer-encoding: chunked" in head.lower()
        assert chunked == (version == "1.1")
        events = (_unchunked(payload) if chunked else payload).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        last, alone = chunks[-1]["meta_info"], whole["meta_info"]
        assert chunks[-1]["output_ids"] == whole["output_ids"]
        assert chunks[-1]["text"] == whole["text"]
        sizes = [len(c["output_ids"]) for c in chunks]  # cumulative (piled-up chunks merge)
        assert sizes == sorted(set(sizes)) and sizes[-1] == tokens, sizes
        if len(sizes) > 4:
            break
    assert len(sizes) > 4 and len(last["output_token_logprobs"]) == tokens
    for got, want in zip(
        last["output_token_logprobs"], alone["output_token_logprobs"], strict=True
    ):
        assert got[1] == want[1] and math.isclose(got[0], want[0], abs_tol=1e-4)


@pytest.mark.timeout(60)
def test_a_stream_interval_sends_the_first_token_then_one_chunk_every_k(engine: Engine) -> None:  # noqa: F811
    # SGLang 0.5, scheduler_output_processor_mixin (stream_output_generation): with a stream
    # interval k > 1 a streamed request's output goes out when len(output_ids) % k == 1, and
    # whole once it finishes; sampling_params.stream_interval overrides --stream-interval
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 11}}
    whole = engine.generate(body)
    for k in (3, 4):
        params = {**body["sampling_params"], "stream_interval": k}
        for _attempt in range(5):
            _, events = _events(engine, {**body, "sampling_params": params, "stream": True})
            assert events[-1] == "[DONE]"
            *partial, last = events[:-1]
            counts = [chunk["meta_info"]["completion_tokens"] for chunk in partial]
            # chunks that pile up while the client reads merge into the newest: never another
            # count; on a loaded machine all 11 tokens may be done before the first chunk is
            # written, and then the last chunk is the only one (asked again)
            assert all(n % k == 1 for n in counts), (k, counts)
            if counts:
                break
        assert counts, k
        assert counts == sorted(set(counts))
        for chunk in partial:  # every token sampled so far, held ones included
            assert chunk["output_ids"] == whole["output_ids"][: len(chunk["output_ids"])]
        assert last["output_ids"] == whole["output_ids"]


@pytest.mark.timeout(60)
def test_streamed_requests_are_checked_before_anything_is_sent(engine: Engine) -> None:  # noqa: F811
    for body, field in [
        ({"input_ids": PROMPT, "stream": "yes"}, "expected a boolean"),  # the JSON contract
        ({"input_ids": PROMPT, "stream": True, "sampling_params": {"stream_interval": "2"}},
         "expected i64"),
        ({"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": -1}},
         "max_new_tokens"),
        ({"input_ids": [999], "stream": True}, "input_ids"),
    ]:  # fmt: skip
        status, out = engine.request("POST", "/generate", body)
        error = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
        assert status == 400 and field in error, (body, out)


# ---- /v1/completions --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.timeout(60)
def test_streamed_completion_deltas_add_up_to_the_whole_completion(engine: Engine, client) -> None:  # noqa: F811
    options = {"model": "default", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
               "logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**options)
    chunks = list(
        client.completions.create(**options, stream=True, stream_options={"include_usage": True})
    )
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == 4 and usage.usage.total_tokens == 14
    deltas = chunks[:-1]
    assert all(c.object == "text_completion" and c.usage is None for c in deltas)
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    tokens = [t for c in deltas if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
    logprobs = [
        lp for c in deltas if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    for got, want in zip(logprobs, whole.choices[0].logprobs.token_logprobs, strict=True):
        assert math.isclose(got, want, abs_tol=1e-5)
    tops = [t for c in deltas if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert len(tops) == 10 and all(len(t) == 2 for t in tops)


@pytest.mark.timeout(60)
def test_streamed_completions_with_n_and_echo(engine: Engine, client) -> None:  # noqa: F811
    tokenizer = _tokenizer(engine)
    text = tokenizer.decode(PROMPT)
    options = {"model": "default", "prompt": text, "max_tokens": 5, "temperature": 0, "n": 2,
               "echo": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**options)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**options, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert texts[0].startswith(text)


@pytest.mark.timeout(60)
def test_a_streamed_completion_that_stops_ends_as_the_whole_one(engine: Engine, client) -> None:  # noqa: F811
    # serving_completions._generate_completion_stream: the last chunk's finish_reason and
    # matched_stop, token_ids per chunk (return_token_ids) and usage in every chunk
    # (stream_options.continuous_usage_stats) as the answer without streaming has them
    options = {"model": "default", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
               "logprobs": 1}  # fmt: skip
    free = client.completions.create(**options, extra_body={"ignore_eos": True}).choices[0].text
    # inside a word: a stop string across the space in front of the first token (SGLang's text
    # has it, its stop check's tail decode does not) would cut everything
    words = free.split()
    stop = words[len(words) // 2][1:3]
    extra = {"ignore_eos": True, "return_token_ids": True, "stop": [stop]}
    whole = client.completions.create(**options, extra_body=extra).choices[0]
    assert whole.finish_reason == "stop" and whole.model_extra["matched_stop"] == stop
    chunks = list(
        client.completions.create(
            **options, extra_body=extra, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.text for d in deltas) == whole.text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]
    assert deltas[-1].model_extra["matched_stop"] == stop
    ids = [t for d in deltas for t in d.model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"]
    assert [t for d in deltas if d.logprobs for t in d.logprobs.tokens] == whole.logprobs.tokens
    used = [c.usage.completion_tokens for c in chunks if c.choices]
    assert used == sorted(used) and used[-1] == len(ids)


@pytest.mark.timeout(90)
def test_a_client_that_falls_behind_gets_merged_chunks_then_the_stream_goes_on(
    engine: Engine,  # noqa: F811
) -> None:
    """A client with a small receive window that reads nothing for a while: the chunks back
    up on the connection, the engine stops writing straight to it, waits for the client and
    merges what piled up meanwhile into the newest chunk (SGLang's queue drain), then writes
    straight again. The client still gets every event whole, cumulative, ending in the whole
    answer."""
    tokens = 400  # with log-probs, ~2.5 MB of events in all: more than the buffers take
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": tokens},
        "return_logprob": True,
    }
    whole = engine.generate(body)
    raw = _raw_stream(engine, {**body, "stream": True}, "1.1", receive_buffer=2048, read_after=2)
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = _unchunked(payload).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    sizes = [len(c["output_ids"]) for c in chunks]
    assert sizes == sorted(set(sizes)) and sizes[-1] == tokens, sizes
    assert len(sizes) < tokens, "no chunk was merged: the client never fell behind"
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    # it serves on
    assert engine.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})


@pytest.mark.timeout(120)
def test_incremental_streaming_output_sends_what_is_new_in_each_chunk(
    engine: Engine,  # noqa: F811
    tmp_path,
) -> None:
    """``--incremental-streaming-output`` (SGLang 0.5.23's ``_handle_batch_output`` and
    ``_slice_streaming_output_meta_info``): each chunk's ``text`` and ``output_ids`` are what
    is new since the sample's last, its output log-prob lists from its first new token on, and
    the rest whole (``completion_tokens`` so far, the prompt's log-probs); a batch's samples
    each their own; joined up, a sample's chunks are the whole answer (its stop string trimmed),
    as the same stream without the flag ends with it."""
    params = {**GREEDY, "max_new_tokens": 10, "stream_interval": 3}
    body = {
        "input_ids": [PROMPT, [30, 31, 32]],
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    free = engine.generate(
        {**body, "input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": 10}}
    )
    words = free["text"].split()
    stop = words[2] if len(words) > 3 and free["text"].count(words[2]) == 1 else None
    with serving(
        engine.model_dir, tmp_path / "engine.log", "--incremental-streaming-output"
    ) as inc:
        assert inc.request("GET", "/server_info")[1]["incremental_streaming_output"] is True
        cases = [body] + ([{**body, "sampling_params": {**params, "stop": stop}}] if stop else [])
        for case in cases:
            whole = engine.generate(case)  # (not streamed: the same either way)
            _, cumulative = _events(engine, {**case, "stream": True})
            for _ in range(5):  # chunks that piled up come merged (as SGLang's): again
                response, events = _events(inc, {**case, "stream": True})
                if len(events) >= 5 or case is not body:
                    break
            assert events[-1] == "[DONE]" and response.status_code == 200
            assert len(events) >= (5 if case is body else 3)  # (10 tokens, a chunk every 3)
            for index, answer in enumerate(whole):
                chunks = [e for e in events[:-1] if e["index"] == index]
                assert [i for c in chunks for i in c["output_ids"]] == answer["output_ids"]
                assert "".join(c["text"] for c in chunks) == answer["text"]
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    joined = [e for c in chunks for e in c["meta_info"][key]]
                    assert joined == answer["meta_info"][key], key
                sent = 0
                for chunk in chunks:
                    meta = chunk["meta_info"]
                    sent += len(chunk["output_ids"])
                    assert meta["completion_tokens"] == sent
                    assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
                    assert (
                        meta["input_token_logprobs"] == answer["meta_info"]["input_token_logprobs"]
                    )
                assert (
                    chunks[-1]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
                )
                # without the flag the same stream's last chunk is the whole answer
                last = [e for e in cumulative[:-1] if e["index"] == index][-1]
                assert last["output_ids"] == answer["output_ids"]
                if len(chunks) > 1:  # (its last chunk: only what is new)
                    assert len(chunks[-1]["output_ids"]) < len(answer["output_ids"])
