"""The generator's engine client (and the weight publisher) against SGLang's API.

Against a real SGLang server when ``INFLIGHT_SGLANG_URL`` names one, started for instance with::

    python -m sglang.launch_server --model-path MODEL_DIR --port 30000 --host 127.0.0.1 \
        --return-hidden-states-mode full --enable-custom-logit-processor

Without it, against the built-in engine, which speaks the same API, started here the way users
start it (``inflight engine``) on a tiny byte-level model with a chat template: what these tests
assume of SGLang is then checked in every run, and a test that only a real server could pass
is caught here, not on the day someone runs it against one.

Environment:

- ``INFLIGHT_SGLANG_URL``: the server, e.g. ``http://127.0.0.1:30000``.
- ``INFLIGHT_SGLANG_MODEL`` (with a URL; optional): a local Hugging Face directory holding the
  *same* model the server serves (its weights are read with transformers and published to the
  server). Without it the tests that need the model's files are skipped. The update sends the
  server's own weights back as a new version, so the server is left serving what it served
  before.
- ``INFLIGHT_SGLANG_BACKEND`` (optional): ``nccl`` (default when this process sees a GPU) or
  ``gloo``; the weight group's backend. With ``nccl`` this process needs a GPU of its own.
- ``INFLIGHT_SGLANG_MASTER_ADDRESS`` (optional, default ``127.0.0.1``): an address of this
  machine the server can reach (the weight group's rendezvous is hosted here, as rank 0).

Token ids are small integers (any real vocabulary has them; the byte-level model has 109); only
the text test decodes (with the served model's tokenizer).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from stages.engine.custom_logits import sglang_string
from stages.generator.client import EngineClient, EngineError
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_byte_model

BYTE_PRINTABLE = "".join(chr(c) for c in range(32, 127))  # the byte-level model's characters

URL = os.environ.get("INFLIGHT_SGLANG_URL", "")
MODEL = os.environ.get("INFLIGHT_SGLANG_MODEL", "")
# the built-in engine's chat template here (any template: the chat test reads no format)
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]
LONG = 1024  # new tokens (at most; less for a short context): still running when paused


def _need_model(served: Served) -> None:
    if not served.model:
        pytest.skip("set INFLIGHT_SGLANG_MODEL to the served model's directory")


def _rid(what: str) -> str:
    return f"inflight-test-{what}-{secrets.token_hex(4)}"


async def _slow_down(client: EngineClient, seconds: float | None) -> None:
    """SGLang's ``/slow_down``: each forward pass sleeps ``seconds`` more (None: none)."""
    body = {"forward_sleep_time": seconds}
    async with client.session.post(client.url + "/slow_down", json=body) as resp:
        assert resp.status == 200, await resp.text()


def _params(max_new_tokens: int, **more) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **more}


@dataclass(frozen=True)
class Served:
    url: str
    model: str  # the served model's directory ("": not known here)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The server under test: INFLIGHT_SGLANG_URL's, else a built-in engine started here."""
    if URL:
        yield Served(URL, MODEL)
        return
    folder = tmp_path_factory.mktemp("sglang_api")
    words = ("<tool_call>", "</tool_call>")  # 109 tokens: PROMPT's ids are in it
    model = make_byte_model(folder / "model", chars=BYTE_PRINTABLE, words=words)
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATE)
    # as a real server must be started
    more = ("--return-hidden-states-mode", "full", "--enable-custom-logit-processor",
            "--enable-lora")  # fmt: skip
    with builtin_engine(model, "--chat-template", str(template), *more) as url:
        yield Served(url, str(model))


@pytest.fixture
async def client(served: Served):
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(served.url, session, timeout_s=300)
        assert await engine.healthy(), f"{served.url}/health does not answer"
        yield engine


async def _long(client: EngineClient) -> int:
    """LONG, or what fits in the server's context length when it says (SGLang may not)."""
    with contextlib.suppress(aiohttp.ClientError, ValueError):
        async with client.session.get(client.url + "/get_server_info") as resp:
            context = (await resp.json(content_type=None)).get("context_length")
            if isinstance(context, int) and context > 0:
                # (SGLang's scheduler keeps 2 of the context: init_req_max_new_tokens)
                return min(LONG, context - len(PROMPT) - 2)
    return LONG


@pytest.mark.timeout(120)
async def test_generate_returns_tokens_logprobs_and_versions(client):
    info = await client.model_info()
    assert info.get("is_generation", True)
    completion = await client.generate(PROMPT, _params(16, temperature=1.0), rid=_rid("generate"))
    assert completion.finish_reason == "length"
    assert len(completion.output_ids) == len(completion.logprobs) == len(completion.versions) == 16
    assert (completion.logprobs <= 0).all()
    assert (completion.versions == completion.weight_version).all()
    # greedy decoding is reproducible
    a = await client.generate(PROMPT, _params(16), rid=_rid("greedy"))
    b = await client.generate(PROMPT, _params(16), rid=_rid("greedy"))
    assert a.output_ids.tolist() == b.output_ids.tolist()


@pytest.mark.timeout(120)
async def test_group_request_returns_one_completion_per_rid(client):
    rids = [_rid(f"group-{i}") for i in range(4)]
    # batched input_ids with a list of rids: SGLang keeps the rids (the client checks that
    # each result answers its own rid, in request order)
    completions = await client.generate_group(PROMPT, _params(16, temperature=1.0), rids=rids)
    assert [c.meta["id"] for c in completions] == rids
    for c in completions:
        assert c.finish_reason == "length" and len(c.output_ids) == len(c.logprobs) == 16
        assert (c.logprobs <= 0).all() and len(c.versions) == 16


@pytest.mark.timeout(120)
async def test_a_next_turn_is_served_from_the_radix_cache_and_stops_at_stop_token_ids(client):
    """A multi-turn episode's second turn (the first turn's context, its output and inserted
    tokens) finds its prefix in SGLang's radix cache (``meta_info.cached_tokens``, the field the
    generator's episodes read), and ``stop_token_ids`` ends a turn as tools need."""
    first = await client.generate(PROMPT * 4, _params(8), rid=_rid("turn-0"))
    context = PROMPT * 4 + first.output_ids.tolist() + PROMPT[:3]
    second = await client.generate(context, _params(8), rid=_rid("turn-1"))
    assert int(second.meta.get("cached_tokens") or 0) >= len(PROMPT * 4)
    tokens = second.output_ids.tolist()
    stop = tokens[2]  # greedy: the same tokens come again, up to the first `stop`
    again = await client.generate(
        context, _params(8, stop_token_ids=[stop], ignore_eos=False), rid=_rid("turn-1-stop")
    )
    assert again.output_ids.tolist() == tokens[: tokens.index(stop) + 1]
    assert again.finish_reason == "stop"


@pytest.mark.timeout(120)
async def test_an_episode_named_as_a_session_answers_as_without_and_closes(client):
    """``session_id`` (SGLang 0.5.23's radix-native session, what ``rollout.hold_kv`` sends):
    each turn answers as it does without it, the next turn finds its prefix cached, and
    ``/close_session`` closes the session (an empty 200) whether or not the server holds
    sessions' KV (``--enable-session-radix-cache``), as ``close_sessions`` closes many (SGLang:
    its 404 for ``/close_sessions``, then one close each); with ``session_params`` too: 400."""
    session = _rid("episode")
    first = await client.generate(PROMPT * 4, _params(6), rid=_rid("s-0"), session=session)
    plain = await client.generate(PROMPT * 4, _params(6), rid=_rid("p-0"))
    assert first.output_ids.tolist() == plain.output_ids.tolist()
    context = PROMPT * 4 + first.output_ids.tolist() + PROMPT[:3]
    second = await client.generate(context, _params(6), rid=_rid("s-1"), session=session)
    assert int(second.meta.get("cached_tokens") or 0) >= len(PROMPT * 4)
    await client.close_session(session)
    # many at once: a built-in engine's /close_sessions, else SGLang's one close each
    assert await client.close_sessions([session, _rid("never-used")]) == 0
    both = {"input_ids": PROMPT, "sampling_params": _params(2), "session_id": session,
            "session_params": {"id": session}}  # fmt: skip
    async with client.session.post(client.url + "/generate", json=both) as resp:
        assert resp.status == 400
        assert "session_id and session_params cannot both be set." in await resp.text()


@pytest.mark.timeout(120)
async def test_a_session_turn_continues_the_turn_it_names(client):
    """``/open_session`` and ``session_params``: a turn naming the one before answers as that
    turn's prompt, its output and the new ids sent whole; ``/close_session`` ends it."""
    post = client.session.post
    async with post(client.url + "/open_session", json={"capacity_of_str_len": 4096}) as resp:
        assert resp.status == 200, await resp.text()
        sid = await resp.json()
    first_rid, more = _rid("session-0"), PROMPT[:3]
    first = await _generate_json(
        client,
        {"input_ids": PROMPT, "rid": first_rid, "sampling_params": _params(6),
         "session_params": {"id": sid}},
    )  # fmt: skip
    second = await _generate_json(
        client,
        {"input_ids": more, "rid": _rid("session-1"), "sampling_params": _params(6),
         "session_params": {"id": sid, "rid": first_rid}},
    )  # fmt: skip
    whole = await client.generate(PROMPT + first["output_ids"] + more, _params(6), rid=_rid("w"))
    assert second["meta_info"]["prompt_tokens"] == len(PROMPT) + 6 + len(more)
    assert second["output_ids"] == whole.output_ids.tolist()
    async with post(client.url + "/close_session", json={"session_id": sid}) as resp:
        assert resp.status == 200
    gone = {"input_ids": more, "sampling_params": _params(2), "session_params": {"id": sid}}
    async with post(client.url + "/generate", json=gone) as resp:
        assert resp.status == 400 and "does not exist" in await resp.text()


@pytest.mark.timeout(120)
async def test_a_custom_logit_processor_bans_tokens(client):
    """``custom_logit_processor`` (SGLang's ``DisallowedTokensLogitsProcessor``, named as its
    ``to_str`` names it) with ``custom_params.token_ids``: the greedy answer avoids them, the
    first token differs; a server started without ``--enable-custom-logit-processor`` refuses
    it in SGLang's words."""
    free = await client.generate(PROMPT, _params(6), rid=_rid("free"))
    banned = sorted(set(free.output_ids.tolist()[:2]))
    body = {
        "input_ids": PROMPT,
        "rid": _rid("banned"),
        "sampling_params": _params(6, custom_params={"token_ids": banned}),
        "custom_logit_processor": sglang_string("DisallowedTokensLogitsProcessor"),
    }
    async with client.session.get(client.url + "/server_info") as resp:
        enabled = (await resp.json()).get("enable_custom_logit_processor")
    if not enabled:
        async with client.session.post(client.url + "/generate", json=body) as resp:
            assert resp.status == 400 and "--enable-custom-logit-processor" in await resp.text()
        return
    answer = await _generate_json(client, body)
    assert not set(banned) & set(answer["output_ids"])
    assert answer["output_ids"][0] != free.output_ids.tolist()[0]


async def _generate_json(client: EngineClient, body: dict) -> dict:
    async with client.session.post(client.url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.mark.timeout(180)
async def test_pause_in_place_holds_requests_and_continue_finishes_them(client):
    long = await _long(client)
    task = asyncio.create_task(client.generate(PROMPT, _params(long), rid=_rid("paused")))
    await asyncio.sleep(0.2)
    await client.pause("in_place")
    try:
        if not task.done():
            await asyncio.sleep(1.0)
            assert not task.done(), "a request finished while generation was paused"
    finally:
        await client.resume()
    completion = await asyncio.wait_for(task, 150)
    # in_place keeps the request (and its KV cache): nothing aborted, nothing lost
    assert completion.finish_reason == "length" and len(completion.output_ids) == long


@pytest.mark.timeout(180)
async def test_an_abort_during_an_in_place_pause_waits_for_continue(client):
    """SGLang 0.5.23's paused scheduler marks a running request that is aborted
    (``Scheduler.abort_request``: ``to_finish``) and ends it once generation continues, with
    one token more than its stream had carried (``update_finish_state`` after that token): its
    client has no answer until then (the built-in engine's test of the same, with the tokens
    checked against transformers: ``test_engine_server.py``)."""
    rid = _rid("held-abort")
    body = {"input_ids": PROMPT, "rid": rid, "stream": True,
            "sampling_params": _params(await _long(client))}  # fmt: skip
    chunks: list[dict] = []
    running = asyncio.Event()  # its first chunk came

    async def read() -> None:
        async with client.session.post(client.url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    chunks.append(json.loads(line[6:]))
                    running.set()

    task = asyncio.create_task(read())
    await asyncio.wait_for(running.wait(), 60)
    await client.pause("in_place")
    try:
        assert (await _post(client, "/abort_request", {"rid": rid}))[0] == 200
        await asyncio.sleep(1.0)
        assert not task.done(), "an aborted request ended while generation was paused"
    finally:
        await client.resume()
    await asyncio.wait_for(task, 60)
    *before, held, last = chunks  # held: the last chunk before the pause
    assert all(c["meta_info"]["finish_reason"] is None for c in (*before, held))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] == held["meta_info"]["completion_tokens"] + 1


async def _post(client: EngineClient, path: str, body: dict) -> tuple[int, Any]:
    async with client.session.post(client.url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.timeout(120)
async def test_stop_strings_end_the_text_before_them(client):
    """``sampling_params.stop``: ``finish_reason {type: stop, matched}``, the text cut before
    the string (what the built-in engine's tests check against SGLang's source)."""
    body = {"input_ids": PROMPT, "sampling_params": _params(16)}
    status, free = await _post(client, "/generate", body)
    assert status == 200 and isinstance(free.get("text"), str), free
    text = free["text"]
    stop = text[len(text) // 2 :][:3]
    if not stop.strip():
        pytest.skip(f"the greedy text {text!r} has no usable middle")
    body["sampling_params"] = _params(16, stop=[stop])
    status, out = await _post(client, "/generate", body)
    assert status == 200, out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])


@pytest.mark.timeout(120)
async def test_stop_regex_ends_the_output_and_names_the_pattern(client):
    """``sampling_params.stop_regex`` (what ``test_engine_server.py`` checks the built-in
    engine against): ``finish_reason {type: stop, matched: <the pattern>}``, the output ended
    by the token that completed the match, an invalid pattern a 400."""
    body = {"input_ids": PROMPT, "sampling_params": _params(16)}
    status, free = await _post(client, "/generate", body)
    assert status == 200 and isinstance(free.get("text"), str), free
    text = free["text"]
    middle = text[len(text) // 2 :][:2]
    if not middle.strip() or not middle.isalnum():
        pytest.skip(f"the greedy text {text!r} has no usable middle")
    pattern = f"{middle}(?!$)?"  # never its own text: nothing is trimmed
    body["sampling_params"] = _params(16, stop_regex=pattern)
    status, out = await _post(client, "/generate", body)
    assert status == 200, out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert middle in out["text"] and text.startswith(out["text"])
    assert len(out["output_ids"]) < len(free["output_ids"])
    # SGLang 0.5.23's normalize raises re.error, which its route does not catch as a bad
    # request (not a ValueError): a 500 there, a 400 naming the field on the built-in engine
    body["sampling_params"] = _params(8, stop_regex="(unclosed")
    async with client.session.post(client.url + "/generate", json=body) as resp:
        assert resp.status in (400, 500), await resp.text()
    assert await client.healthy()


@pytest.mark.timeout(120)
async def test_grammars_constrain_the_output(client):
    """``sampling_params.regex``, ``json_schema`` and ``ebnf`` (what ``test_engine_grammar.py``
    checks the built-in engine against): the text follows the grammar and the sample stops
    once it is complete; a grammar that does not compile is refused."""
    import re

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["a"], "additionalProperties": False}  # fmt: skip
    for grammar, check in (
        ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
        ({"ebnf": 'root ::= "1" ("2" | "3")'}, lambda text: text in ("12", "13")),
        ({"json_schema": json.dumps(schema)}, lambda text: 0 <= json.loads(text)["a"] <= 99),
    ):
        body = {"input_ids": PROMPT, "sampling_params": _params(64, **grammar)}
        body["sampling_params"].pop("ignore_eos")
        status, out = await _post(client, "/generate", body)
        assert status == 200, out
        assert check(out["text"]), (grammar, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    body = {"input_ids": PROMPT, "sampling_params": _params(4, regex="(unclosed")}
    async with client.session.post(client.url + "/generate", json=body) as resp:
        assert resp.status == 400, await resp.text()
    assert await client.healthy()


@pytest.mark.timeout(120)
async def test_penalties_and_logit_bias_change_what_is_sampled(client):
    """SGLang's penalizers and ``logit_bias`` (what ``test_engine_penalties.py`` checks the
    built-in engine against): a bias that bans the greedy first token moves it, a large
    frequency penalty keeps a token from coming back, out-of-range values are a 400."""
    status, free = await _post(
        client, "/generate", {"input_ids": PROMPT, "sampling_params": _params(12)}
    )
    assert status == 200, free
    first = free["output_ids"][0]
    banned = _params(12, logit_bias={str(first): -100.0})
    status, out = await _post(client, "/generate", {"input_ids": PROMPT, "sampling_params": banned})
    assert status == 200 and out["output_ids"][0] != first, out
    spread = _params(12, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    status, out = await _post(client, "/generate", {"input_ids": PROMPT, "sampling_params": spread})
    assert status == 200, out
    assert len(set(out["output_ids"])) > len(set(free["output_ids"])) or len(
        set(out["output_ids"])
    ) == len(out["output_ids"]), (free["output_ids"], out["output_ids"])
    for bad in ({"frequency_penalty": 2.5}, {"repetition_penalty": 0}, {"min_new_tokens": 99}):
        body = {"input_ids": PROMPT, "sampling_params": _params(8, **bad)}
        status, out = await _post(client, "/generate", body)
        assert status == 400, (bad, out)


@pytest.mark.timeout(120)
async def test_text_is_decoded_after_the_prompt_as_the_built_in_engine_decodes_it(client, served):
    """SGLang decodes an output after the prompt's last 5 tokens
    (``Req.init_incremental_detokenize``), streamed or not: the text that
    ``stages/engine/incremental_text.py`` makes (and ``engine_setup.sglang_text`` computes)."""
    from transformers import AutoTokenizer

    from stages.detokenize import decoder
    from stages.engine.incremental_text import output_text
    from tests.stages.engine_setup import sglang_text

    _need_model(served)
    tokenizer = AutoTokenizer.from_pretrained(served.model)
    body = {"input_ids": PROMPT, "sampling_params": _params(24)}
    status, whole = await _post(client, "/generate", body)
    assert status == 200, whole
    ids = whole["output_ids"]
    assert whole["text"] == sglang_text(tokenizer, PROMPT, ids)
    assert whole["text"] == output_text(PROMPT, ids, decoder(tokenizer), True, False)
    async with client.session.post(client.url + "/generate", json={**body, "stream": True}) as r:
        events = [line[len(b"data: ") :].strip() async for line in r.content if line.strip()]
    assert json.loads(events[-2])["text"] == whole["text"]


@pytest.mark.timeout(120)
async def test_a_stream_is_cumulative_and_ends_with_the_whole_answer(client):
    """``stream: true`` (what tests/stages/test_engine_streaming.py checks the built-in engine
    against): ``data: {json}`` events, each with the whole output so far, ``finish_reason``
    only on the last, which equals the non-streamed answer; then ``data: [DONE]``."""
    body = {"input_ids": PROMPT, "sampling_params": _params(8)}
    status, whole = await _post(client, "/generate", body)
    assert status == 200, whole
    async with client.session.post(client.url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = [line[len(b"data: ") :].strip() async for line in r.content if line.strip()]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 8
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


@pytest.mark.timeout(120)
async def test_chat_completions_streamed_and_whole_agree(client):
    """``/v1/chat/completions`` (what tests/stages/test_engine_chat.py checks the built-in
    engine against): the streamed deltas add up to the whole answer; role first, finish last."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    status, whole = await _post(client, "/v1/chat/completions", body)
    if status == 400 and "template" in json.dumps(whole):
        pytest.skip(f"the served model has no chat template: {whole}")
    assert status == 200 and whole["object"] == "chat.completion", whole
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert whole["usage"]["completion_tokens"] <= 8
    stream = {**body, "stream": True}
    async with client.session.post(client.url + "/v1/chat/completions", json=stream) as r:
        assert r.status == 200
        events = [line[len(b"data: ") :].strip() async for line in r.content if line.strip()]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] is not None


def _tolerance() -> float:
    """How close two passes' log-probs of the same tokens are: the built-in engine's on CPU
    in float32 agree to rounding; a real server's prefill and decode kernels (bf16 on a GPU)
    differ by more."""
    return 0.1 if URL else 1e-3


@pytest.mark.timeout(120)
async def test_prompt_scoring_gives_the_log_probs_generation_sampled(client):
    """``return_logprob`` with ``top_logprobs_num`` and ``return_text_in_logprobs``: an entry
    ``[logprob, token_id, text]`` per output token, its ``k`` top ones in descending order;
    then prefill-only scoring (``max_new_tokens: 0``) of the prompt and that output from
    ``logprob_start_len`` (``_process_input_token_logprobs``: ``None`` first) gives the same
    log-probs for the output's tokens: how RL code gets reference log-probs."""
    k = 2
    body = {"input_ids": PROMPT, "sampling_params": _params(6), "return_logprob": True,
            "top_logprobs_num": k, "return_text_in_logprobs": True}  # fmt: skip
    status, out = await _post(client, "/generate", body)
    assert status == 200, out
    meta, ids = out["meta_info"], out["output_ids"]
    entries, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [e[1] for e in entries] == ids and all(isinstance(e[2], str) for e in entries)
    assert len(tops) == len(ids)
    for entry, top in zip(entries, tops, strict=True):
        assert len(top) == k and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][1] == entry[1]  # greedy: the token sampled is the likeliest
    start = len(PROMPT) - 1  # the prompt's last token first (None), then the output's
    score = {"input_ids": PROMPT + ids, "sampling_params": {"max_new_tokens": 0},
             "return_logprob": True, "logprob_start_len": start}  # fmt: skip
    status, scored = await _post(client, "/generate", score)
    assert status == 200, scored
    assert scored["output_ids"] == [] and scored["meta_info"]["output_token_logprobs"] == []
    inputs = scored["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inputs] == (PROMPT + ids)[start:] and inputs[0][0] is None
    for scored_entry, sampled in zip(inputs[1:], entries, strict=True):
        assert abs(scored_entry[0] - sampled[0]) <= _tolerance(), (inputs, entries)


@pytest.mark.timeout(120)
async def test_prefill_only_and_v1_score_read_the_distribution_after_the_prompt(client):
    """SGLang 0.5.23: a prefill-only request (``max_new_tokens: 0``) with ``token_ids_logprob``
    and ``top_logprobs_num`` gets one entry of each, the distribution a first token would be
    drawn from (``compute_logprobs_only``), and ``/v1/score`` reads its labels' probabilities
    from the same prefill (``exp`` of the log-probs, or a softmax over the labels)."""
    labels = [PROMPT[0], PROMPT[3], 107]
    asks = {"return_logprob": True, "token_ids_logprob": labels, "top_logprobs_num": 2}
    status, drawn = await _post(
        client, "/generate", {"input_ids": PROMPT, "sampling_params": _params(1), **asks}
    )
    assert status == 200, drawn
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, **asks}
    status, scored = await _post(client, "/generate", body)
    assert status == 200, scored
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["output_token_logprobs"] == []
    ((picked,),) = [meta["output_token_ids_logprobs"]]
    ((first,),) = [drawn["meta_info"]["output_token_ids_logprobs"][:1]]
    assert [e[1] for e in picked] == labels
    for got, want in zip(picked, first, strict=True):
        assert abs(got[0] - want[0]) <= _tolerance(), (picked, first)
    ((top,),) = [meta["output_top_logprobs"]]
    assert top[0][1] == drawn["output_ids"][0]  # greedy drew the likeliest
    request = {"query": PROMPT[:4], "items": [PROMPT[4:], PROMPT[5:]], "label_token_ids": labels}
    status, out = await _post(client, "/v1/score", request)
    assert status == 200 and out["object"] == "scoring", out
    assert len(out["scores"]) == 2 and all(len(row) == 3 for row in out["scores"])
    for score, (lp, _, _) in zip(out["scores"][0], picked, strict=True):
        assert abs(math.log(score) - lp) <= _tolerance()
    status, soft = await _post(client, "/v1/score", {**request, "apply_softmax": True})
    assert status == 200 and all(abs(sum(row) - 1) < 1e-6 for row in soft["scores"]), soft
    status, bad = await _post(client, "/v1/score", {**request, "temperature": 0.5})
    assert status == 400 and "apply_softmax" in bad["message"], bad


@pytest.mark.timeout(120)
async def test_v1_score_embedding_overrides_of_a_tokens_own_row_score_as_that_token(client, served):
    """SGLang 0.5.23's ``/v1/score`` embedding overrides (``_build_token_id_inputs``): a
    placeholder whose row is another token's own embedding scores as that token in its place,
    whatever the prefix cache holds for the placeholder's ids; the setwise readout answers a
    matrix per item, or, with the radix cache on, SGLang's 400 saying it needs it off."""
    _need_model(served)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served.model, dtype="auto")
    labels = [PROMPT[0], PROMPT[3], 107]
    hole, token = PROMPT[1], PROMPT[6]
    row = model.get_input_embeddings().weight[token].float().tolist()
    del model
    query, items = [PROMPT[0], hole, PROMPT[2]], [[PROMPT[4], hole], [PROMPT[5]]]
    plain = {"query": query, "items": items, "label_token_ids": labels}
    status, held = await _post(client, "/v1/score", plain)  # the placeholder's KV cached
    assert status == 200, held
    status, out = await _post(
        client, "/v1/score",
        {**plain, "embed_override_token_id": hole, "query_embed_overrides": [row],
         "item_embed_overrides": [[row], None]},
    )  # fmt: skip
    assert status == 200, out
    swapped = [[token if t == hole else t for t in ids] for ids in (query, *items)]
    status, want = await _post(
        client, "/v1/score", {**plain, "query": swapped[0], "items": swapped[1:]}
    )
    assert status == 200, want
    for got, expected in zip(out["scores"], want["scores"], strict=True):
        for g, e in zip(got, expected, strict=True):
            assert abs(math.log(g) - math.log(e)) <= _tolerance(), (out, want)
    status, bad = await _post(
        client, "/v1/score", {**plain, "embed_override_token_id": hole, "query_embed_overrides": []}
    )
    assert status == 400 and "occurrences of embed_override_token_id" in bad["message"], bad
    from transformers import AutoTokenizer

    anchor = AutoTokenizer.from_pretrained(served.model).convert_ids_to_tokens(PROMPT[4])
    setwise = {**plain, "items": [[PROMPT[4], hole], [PROMPT[5], PROMPT[4]]]}
    status, out = await _post(client, "/v1/score", {**setwise, "score_extraction_token": anchor})
    if status == 400:  # the radix cache on, as servers run by default
        assert "requires --disable-radix-cache" in out["message"], out
    else:
        assert status == 200 and [len(m) for m in out["scores"]] == [1, 1], out


@pytest.mark.timeout(300)
async def test_weights_from_tensor_in_shared_memory_come_back_as_they_were(client, served):
    """``/update_weights_from_tensor`` inside a weight-update session (SGLang 0.5.23): this
    process holds the served model's own weights in shared memory (torch's ``file_system``
    strategy: a server on this machine maps them) and sends their handles, as verl's and
    slime's colocated trainers do; the same greedy tokens after, under the new version."""
    _need_model(served)
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from tests.stages.test_engine_tensor_weights import raw

    model = AutoModelForCausalLM.from_pretrained(served.model, dtype="auto")
    before = await client.generate(PROMPT, _params(16), rid=_rid("before-tensor"))
    version = str(before.weight_version + 1)
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        named = [(n, t.detach()) for n, t in model.state_dict().items()]  # kept until answered
        payload = base64.b64encode(raw(named)).decode()
    finally:
        mp.set_sharing_strategy(strategy)
    status, opened = await _post(client, "/begin_weight_update", {})
    assert status == 200, opened
    try:
        body = {"serialized_named_tensors": [payload], "weight_version": version}
        status, answer = await _post(client, "/update_weights_from_tensor", body)
    finally:
        assert (await _post(client, "/end_weight_update", {}))[0] == 200
    assert status == 200 and answer["success"] is True, answer
    del model, named, payload
    after = await client.generate(PROMPT, _params(16), rid=_rid("after-tensor"))
    assert str(after.weight_version) == version
    assert after.output_ids.tolist() == before.output_ids.tolist()


@pytest.mark.timeout(120)
async def test_v1_completions_greedy_equals_generate(client):
    """``/v1/completions`` on token ids (what ``test_engine_openai.py`` checks the built-in
    engine against): greedy, the same tokens' text and log-probs as ``/generate``'s."""
    status, native = await _post(
        client, "/generate",
        {"input_ids": PROMPT, "sampling_params": _params(8), "return_logprob": True},
    )  # fmt: skip
    assert status == 200, native
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "logprobs": 0, "ignore_eos": True}  # fmt: skip
    status, out = await _post(client, "/v1/completions", body)
    assert status == 200 and out["object"] == "text_completion", out
    choice = out["choices"][0]
    assert choice["text"] == native["text"] and choice["finish_reason"] == "length"
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 8)
    wanted = [e[0] for e in native["meta_info"]["output_token_logprobs"]]
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == 8 and all(
        abs(a - b) <= _tolerance() for a, b in zip(got, wanted, strict=True)
    )


@pytest.mark.timeout(120)
async def test_token_ids_come_back_from_generate_completions_and_chat(client):
    """Token in, token out (SGLang 0.5.23): ``/generate``'s ``return_prompt_token_ids``,
    ``/v1/completions``' ``return_token_ids`` and the chat route's ``input_ids``,
    ``return_token_ids`` and ``return_meta_info``, greedy, the same ids each way."""
    status, native = await _post(
        client, "/generate",
        {"input_ids": PROMPT, "sampling_params": _params(6), "return_prompt_token_ids": True},
    )  # fmt: skip
    assert status == 200 and native["prompt_token_ids"] == PROMPT, native
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, out = await _post(client, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["token_ids"] == native["output_ids"] and choice["prompt_token_ids"] == PROMPT
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "input_ids": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_meta_info": True}  # fmt: skip
    status, out = await _post(client, "/v1/chat/completions", chat)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert choice["response_token_ids"] == native["output_ids"]
    assert choice["meta_info"]["completion_tokens"] == 6
    status, refused = await _post(client, "/v1/chat/completions", {**chat, "stream": True})
    assert status == 400 and "not supported with streaming" in refused["message"], refused


@pytest.mark.timeout(60)
async def test_info_routes_answer_under_their_current_names(client):
    """``/server_info`` (with ``version``, ``max_total_num_tokens``), ``/model_info``,
    ``/health_generate`` and ``/v1/models``: what launchers and routers poll."""
    for path in ("/server_info", "/model_info", "/health_generate", "/v1/models"):
        async with client.session.get(client.url + path) as resp:
            assert resp.status == 200, (path, await resp.text())
            if path == "/server_info":
                info = await resp.json(content_type=None)
                assert isinstance(info["version"], str) and info["max_total_num_tokens"] > 0
            elif path == "/model_info":
                info = await resp.json(content_type=None)
                assert info["is_generation"] is True and "model_path" in info
            elif path == "/v1/models":
                models = await resp.json(content_type=None)
                assert models["object"] == "list" and models["data"][0]["object"] == "model"


@pytest.mark.timeout(60)
async def test_deployment_routes_of_features_not_enabled_say_so(client):
    """What a server started without n-gram speculation, HiCache storage, a PD role switch or
    a transfer engine answers to their routes (``http_server.py`` 1043-1218, 1366-1400, 1635;
    ``tokenizer_control_mixin.py`` 217-312, 920; ``scheduler.py`` 5552): a router probing
    for a feature reads "not enabled", not a 404. Only what SGLang answers with a 4xx or 200
    (its 500s, and the routes whose refusal ends its scheduler, are left out)."""

    async def call(method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with client.session.request(method, client.url + path, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)

    ngram_off = "Ngram speculative decoding is not enabled."
    assert await call("GET", "/list_external_corpora") == (
        400,
        {"success": False, "corpus_token_counts": {}, "message": ngram_off},
    )
    assert await call("POST", "/remove_external_corpus", json={"corpus_id": "c1"}) == (
        400,
        {"success": False, "message": ngram_off},
    )
    status, body = await call("POST", "/add_external_corpus", json={"documents": ["1 2"]})
    assert status == 400 and body["message"] == ngram_off and body["success"] is False
    status, layout = await call("GET", "/get_hicache_l3_cache_layout")
    assert status == 200 and layout["enabled"] is False and layout["backend"] is None
    status, body = await call("POST", "/pd_role_switch", json={"new_role": "decode"})
    assert status == 400 and body["success"] is False
    assert body["message"] == "--enable-pd-role-switch is not set on this server"
    for path in (
        "/remote_instance_transfer_engine_info",
        "/get_remote_instance_transfer_engine_info",
    ):
        assert await call("GET", path) == (
            400,
            {"error": {"message": "Missing or invalid rank parameter"}},
        )
        assert await call("GET", path + "?rank=0") == (
            400,
            {"error": {"message": "Failed to get transfer engine info for rank 0"}},
        )


@pytest.mark.timeout(60)
async def test_a_thinking_budget_needs_strict_thinking(client):
    """``max_thinking_tokens`` on a server started without ``--enable-strict-thinking`` (as
    above): SGLang 0.5.23's 400 (``TokenizerManager.generate_request``), its words."""
    body = {"input_ids": [5, 6], "max_thinking_tokens": 8, "sampling_params": _params(2)}
    async with client.session.post(client.url + "/generate", json=body) as resp:
        assert resp.status == 400
        text = await resp.text()
    assert "max_thinking_tokens requires the server to be launched with" in text
    assert "--enable-strict-thinking" in text


@pytest.mark.timeout(120)
async def test_responses_streamed_and_whole_agree(client):
    """``/v1/responses`` (what ``test_engine_responses.py`` checks the built-in engine
    against): a ``message`` item with one ``output_text`` part; streamed, ``event:`` /
    ``data:`` pairs numbered from 0, from ``response.created`` to the whole response, whose
    text the deltas add up to."""
    async with client.session.get(client.url + "/v1/models") as resp:
        model = (await resp.json(content_type=None))["data"][0]["id"]
    body = {"model": model, "input": "Count to five.", "max_output_tokens": 10,
            "temperature": 0}  # fmt: skip
    status, whole = await _post(client, "/v1/responses", body)
    if status == 400 and "template" in json.dumps(whole):
        pytest.skip(f"the served model has no chat template: {whole}")
    assert status == 200 and whole["object"] == "response", whole
    assert whole["status"] in ("completed", "incomplete") and whole["id"].startswith("resp_")
    messages = [item for item in whole["output"] if item["type"] == "message"]
    text = "".join(part["text"] for m in messages for part in m["content"])
    assert whole["usage"]["output_tokens"] <= 8  # max_output_tokens less SGLang's 2
    async with client.session.post(
        client.url + "/v1/responses", json={**body, "stream": True}
    ) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        lines = [line.decode().strip() async for line in r.content if line.strip()]
    kinds = [line[len("event: ") :] for line in lines[0::2]]
    events = [json.loads(line[len("data: ") :]) for line in lines[1::2]]
    assert [e["type"] for e in events] == kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole['status']}"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text
    final = events[-1]["response"]["output"]
    assert [p["text"] for m in final if m["type"] == "message" for p in m["content"]] == [
        p["text"] for m in messages for p in m["content"]
    ]


@pytest.mark.timeout(120)
async def test_anthropic_messages_streamed_and_whole_agree(client):
    """``/v1/messages`` (what ``test_engine_messages.py`` checks the built-in engine
    against): a ``message`` with a text block, ``stop_reason`` ``max_tokens`` at the limit;
    streamed, ``event:`` / ``data:`` pairs from ``message_start`` to ``message_stop`` whose
    text deltas add up to the whole text; ``count_tokens`` the prompt's tokens."""
    async with client.session.get(client.url + "/v1/models") as resp:
        model = (await resp.json(content_type=None))["data"][0]["id"]
    body = {"model": model, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to five."}]}  # fmt: skip
    status, whole = await _post(client, "/v1/messages", body)
    if status == 400 and "template" in json.dumps(whole):
        pytest.skip(f"the served model has no chat template: {whole}")
    assert status == 200 and whole["type"] == "message" and whole["role"] == "assistant", whole
    assert whole["id"].startswith("msg_") and whole["usage"]["output_tokens"] <= 6
    text = "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    if whole["usage"]["output_tokens"] == 6:
        assert whole["stop_reason"] == "max_tokens"
    async with client.session.post(client.url + "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        lines = [line.decode().strip() async for line in r.content if line.strip()]
    kinds = [line[len("event: ") :] for line in lines[0::2]]
    events = [json.loads(line[len("data: ") :]) for line in lines[1::2]]
    assert [e["type"] for e in events] == kinds
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == text
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    counted = {"model": model, "messages": body["messages"]}
    status, tokens = await _post(client, "/v1/messages/count_tokens", counted)
    usage = whole["usage"]  # (with --enable-cache-report, SGLang's input_tokens less the cached)
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert status == 200 and tokens["input_tokens"] == prompt, tokens
    status, refused = await _post(client, "/v1/messages", {**body, "max_tokens": 0})
    assert status == 400 and refused["type"] == "error", refused
    assert refused["error"]["type"] == "invalid_request_error"


@pytest.mark.timeout(180)
async def test_update_weight_version_keeps_requests_only_when_told(client):
    """``abort_all_requests`` defaults to true: the publisher says false, or every publish
    would abort the generation in flight."""
    long = await _long(client)
    version = str((await client.model_info())["weight_version"])
    task = asyncio.create_task(client.generate(PROMPT, _params(long), rid=_rid("kept")))
    await asyncio.sleep(0.2)
    update = {"new_version": version, "abort_all_requests": False}
    status, answer = await _post(client, "/update_weight_version", update)
    assert status == 200 and answer["success"] is True, answer
    completion = await asyncio.wait_for(task, 150)
    assert completion.finish_reason == "length" and len(completion.output_ids) == long


@pytest.mark.timeout(120)
async def test_memory_released_between_rollouts_comes_back_as_it_was(client):
    """A colocated trainer's round trip (verl's, slime's): the KV cache and weights released
    while idle, taken back weights first, each answered 200 ``null``; greedy generation then
    as before. (A SGLang server started with ``--enable-memory-saver`` needs
    ``--enable-weights-cpu-backup`` for that: without it the weights come back empty.)"""
    before = await client.generate(PROMPT, _params(8), rid=_rid("before-release"))
    steps = (
        ("/release_memory_occupation", ["kv_cache", "weights"]),
        ("/resume_memory_occupation", ["weights"]),
        ("/resume_memory_occupation", ["kv_cache"]),
    )
    for path, tags in steps:
        assert await _post(client, path, {"tags": tags}) == (200, None), path
    if not URL:  # SGLang's scheduler raises a KeyError there: not asked of a real server
        status, answer = await _post(client, "/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "'weights' is not released" in answer["error"]["message"]
    after = await client.generate(PROMPT, _params(8), rid=_rid("after-release"))
    assert after.output_ids.tolist() == before.output_ids.tolist()


@pytest.mark.timeout(120)
async def test_abort_ends_a_running_request(client):
    rid, long = _rid("aborted"), await _long(client)
    # a step of at least 10 ms (SGLang's /slow_down): a small model on a fast machine would
    # otherwise finish its tokens within the wait below
    await _slow_down(client, 0.01)
    try:
        task = asyncio.create_task(client.generate(PROMPT, _params(long), rid=rid))
        await asyncio.sleep(0.2)
        assert not task.done(), "the request finished before it could be aborted"
        await client.abort(rid)
        try:
            completion = await asyncio.wait_for(task, 60)
        except EngineError as exc:
            # SGLang versions differ: an aborted request is an error answer in some of them
            assert exc.status is not None, exc
        else:
            assert completion.finish_reason == "abort" and len(completion.output_ids) < long
    finally:
        await _slow_down(client, None)
    # the server goes on serving
    after = await client.generate(PROMPT, _params(4), rid=_rid("after-abort"))
    assert len(after.output_ids) == 4


@pytest.mark.timeout(120)
async def test_an_aborted_request_ends_with_sglangs_reason(client):
    """The finish reasons of an abort as SGLang 0.5.23 writes them: a running request's
    ``FINISH_ABORT()`` (``message: Aborted``, null status), one sent back to wait by a
    retracting pause its tokenizer's ``Abort in waiting queue`` (its tokens: those SGLang's
    tokenizer had been sent, every 50th, here as there)."""
    long = await _long(client)
    await _slow_down(client, 0.01)
    reasons = []
    try:
        for pause in (None, "retract"):
            rid = _rid(f"abort-{pause}")
            body = {"input_ids": PROMPT, "rid": rid, "sampling_params": _params(long)}
            sent = asyncio.create_task(_post(client, "/generate", body))
            await asyncio.sleep(0.2)
            assert not sent.done(), "the request finished before it could be aborted"
            if pause:
                assert (await _post(client, "/pause_generation", {"mode": pause}))[0] == 200
            assert (await _post(client, "/abort_request", {"rid": rid}))[0] == 200
            status, answer = await asyncio.wait_for(sent, 60)
            assert status == 200, answer
            reasons.append(answer["meta_info"]["finish_reason"])
            await _post(client, "/continue_generation", {})
    finally:
        await _post(client, "/continue_generation", {})
        await _slow_down(client, None)
    assert reasons == [
        {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        {"type": "abort", "message": "Abort in waiting queue"},
    ]


async def _publish_own_weights(served: Served, version: int):
    """The served model's own weights (read from INFLIGHT_SGLANG_MODEL) published to the server
    over a weight group, as ``version``: the publisher's stats."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.weights.publisher import WeightPublisher

    backend = os.environ.get("INFLIGHT_SGLANG_BACKEND") or (
        "nccl" if torch.cuda.is_available() else "gloo"
    )
    device = "cuda" if backend == "nccl" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(served.model, dtype="auto")
    weights = [(name, t.detach().to(device)) for name, t in model.state_dict().items()]
    del model
    group = f"inflight_test_{secrets.token_hex(4)}"
    publisher = WeightPublisher(
        [served.url],
        backend=backend,
        master_address=os.environ.get("INFLIGHT_SGLANG_MASTER_ADDRESS", "127.0.0.1"),
        group_name=group,
        bucket_mb=256,
        timeout_s=240,
    )
    try:
        await publisher.connect()
        return await publisher.publish(weights, version=version)
    finally:
        await publisher.close()
        # let a later run form a group again (older servers lack the route: no matter)
        async with aiohttp.ClientSession() as session:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(
                    served.url.rstrip("/") + "/destroy_weights_update_group",
                    json={"group_name": group},
                ):
                    pass


@pytest.mark.timeout(300)
async def test_weight_update_over_the_weight_group(client, served):
    _need_model(served)
    before = await client.generate(PROMPT, _params(16), rid=_rid("before-update"))
    version = before.weight_version + 1
    stats = await _publish_own_weights(served, version)
    assert stats.version == version and stats.buckets >= 1
    after = await client.generate(PROMPT, _params(16), rid=_rid("after-update"))
    assert after.weight_version == version
    # the same weights came back: the same greedy tokens
    assert after.output_ids.tolist() == before.output_ids.tolist()


@pytest.mark.timeout(120)
async def test_each_token_comes_with_its_sampling_support(client):
    """``return_sampling_mask`` (SGLang 0.5.23): per output token the tokens top-k left the
    draw (at most top_k, the drawn one among them) and the drawn token's log-prob under the
    truncated distribution; with ``sampling_logprobs_mode: support`` each one's, summing to 1."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": _params(8, temperature=1.0, top_k=5, sampling_seed=11),
        "return_sampling_mask": True,
    }
    answers = []
    for mode in (None, "support"):
        sent = body if mode is None else {**body, "sampling_logprobs_mode": mode}
        async with client.session.post(client.url + "/generate", json=sent) as resp:
            assert resp.status == 200, await resp.text()
            answers.append(await resp.json())
    selected, support = answers
    ids, meta = selected["output_ids"], selected["meta_info"]
    masks = meta["output_token_sampling_mask"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(ids) == 8
    for token, mask, lp in zip(ids, masks, meta["output_token_sampling_logprobs"], strict=True):
        assert 1 <= len(mask) <= 5 and token in mask and lp <= 0
    assert support["output_ids"] == ids  # the same sampling_seed: the same tokens
    values = support["meta_info"]["output_token_sampling_logprobs"]
    for mask, row in zip(masks, values, strict=True):
        assert len(row) == len(mask)
        assert math.fsum(math.exp(v) for v in row) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.timeout(120)
async def test_ollamas_routes_answer_in_ollamas_shape(client):
    """``/api/chat``, ``/api/generate`` (not streamed and streamed) and ``/api/tags``: what
    SGLang's Ollama routes and the built-in engine's agree on."""
    options = {"num_predict": 4, "temperature": 0}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": options}
    generate = {"model": "m", "prompt": "hi", "options": options}
    for route, body, field in (
        ("/api/chat", chat, "message"),
        ("/api/generate", generate, "response"),
    ):
        async with client.session.post(client.url + route, json={**body, "stream": False}) as resp:
            assert resp.status == 200, await resp.text()
            whole = await resp.json(content_type=None)
        assert whole["done"] is True and whole["eval_count"] <= 4
        text = whole[field]["content"] if field == "message" else whole[field]
        async with client.session.post(client.url + route, json=body) as resp:  # streamed
            lines = [json.loads(line) for line in (await resp.read()).splitlines() if line]
        assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])
        parts = [line[field]["content"] if field == "message" else line[field] for line in lines]
        assert text.startswith("".join(parts[:-1]))  # SGLang leaves out its last chunk's text
    async with client.session.get(client.url + "/api/tags") as resp:
        (listed,) = (await resp.json(content_type=None))["models"]
    assert listed["size"] == 0 and listed["details"]["format"] == "sglang"


@pytest.mark.timeout(60)
async def test_loads_answer_the_core_keys_and_sections_in_sglangs_layout(client):
    """``/v1/loads`` (``v1_loads.get_loads``): one load per data-parallel rank, the core keys
    of ``LoadSnapshot`` in its order (alone with ``include=core``, as slime asks), an
    idle server's requests none; ``format=prometheus`` a gauge per number."""
    from tests.stages.test_engine_loads import CORE

    async with client.session.get(client.url + "/v1/loads") as resp:
        assert resp.status == 200
        answer = await resp.json(content_type=None)
    assert list(answer) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    for load in answer["loads"]:
        assert list(load)[: len(CORE)] == CORE
        assert set(load) - set(CORE) <= {
            "memory",
            "speculative",
            "lora",
            "disaggregation",
            "queues",
        }
        assert "queues" in load and "disaggregation" in load
    for _ in range(100):  # SGLang publishes its load every few steps: the last tests' aborts
        async with client.session.get(client.url + "/v1/loads?include=core&dp_rank=0") as resp:
            (load,) = (await resp.json(content_type=None))["loads"]
        if load["num_running_reqs"] + load["num_waiting_reqs"] == 0:
            break
        await asyncio.sleep(0.1)
    assert list(load) == CORE and load["dp_rank"] == 0
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0
    async with client.session.get(client.url + "/v1/loads?format=prometheus") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0\n' in text


@pytest.mark.timeout(60)
async def test_hidden_states_come_in_sglangs_layout(client):
    """``return_hidden_states`` (``_append_prefill_hidden_states``,
    ``_append_decode_hidden_states``): true, the prefill's block of every position it computed
    and a vector a decode step; ``"last"`` refused by /generate's JSON contract; a sample of
    ``n`` > 1, the block of its last position only (the warm-up request cached its prompt);
    each ``/v1`` choice its newest (``process_hidden_states_for_response``)."""
    async with client.session.get(client.url + "/server_info") as resp:
        if (await resp.json(content_type=None)).get("return_hidden_states_mode") != "full":
            pytest.skip("start the server with --return-hidden-states-mode full")
    await client.session.post(client.url + "/flush_cache")
    body = {"input_ids": PROMPT, "sampling_params": _params(4), "return_hidden_states": True}
    async with client.session.post(client.url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    block, *steps = out["meta_info"]["hidden_states"]
    width = len(block[0])
    assert len(block) == len(PROMPT) and len(steps) == len(out["output_ids"]) - 1 == 3
    assert all(len(row) == width for row in [*block, *steps])
    async with client.session.post(  # "last": SGLang 0.5.23's JSON contract wants a boolean
        client.url + "/generate", json={**body, "return_hidden_states": "last"}
    ) as resp:
        assert resp.status == 400 and "BoolOrList" in (await resp.json())["error"]
    parallel = {**body, "sampling_params": _params(2, n=2)}
    async with client.session.post(client.url + "/generate", json=parallel) as resp:
        assert resp.status == 200, await resp.text()
        samples = await resp.json()
    assert len(samples) == 2
    for sample in samples:
        assert len(sample["meta_info"]["hidden_states"][0]) == 1
    completion = {"model": "default", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    completion["return_hidden_states"] = True
    async with client.session.post(client.url + "/v1/completions", json=completion) as resp:
        (choice,) = (await resp.json())["choices"]
    assert len(choice["hidden_states"]) == width


@pytest.mark.timeout(60)
async def test_flat_top_logprobs_hold_the_nested_ones_numbers(client):
    """``return_flat_raw_top_logprobs`` and ``_output_``, in base64
    (``tokenizer_manager._build_flat_top_logprobs_fields``): float32 and int32 arrays of
    ``[rows, k]`` after a null prefix, the numbers of the nested answer."""
    import base64

    import numpy as np

    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "sampling_params": _params(4),
    }
    async with client.session.post(client.url + "/generate", json=body) as resp:
        nested = (await resp.json())["meta_info"]
    flags = {
        "return_flat_raw_top_logprobs": True,
        "return_flat_raw_output_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True,
    }
    async with client.session.post(client.url + "/generate", json={**body, **flags}) as resp:
        assert resp.status == 200, await resp.text()
        flat = (await resp.json())["meta_info"]
    for side in ("input", "output"):
        steps = nested[f"{side}_top_logprobs"]
        null = flat[f"{side}_top_logprobs_null_prefix"]
        assert all(not step for step in steps[:null]) and all(steps[null:])
        assert flat[f"{side}_top_logprobs_shape"] == [len(steps) - null, 2]
        values = np.frombuffer(base64.b64decode(flat[f"{side}_top_logprobs_val_flat_b64"]), "<f4")
        ids = np.frombuffer(base64.b64decode(flat[f"{side}_top_logprobs_idx_flat_b64"]), "<i4")
        assert ids.tolist() == [e[1] for step in steps[null:] for e in step]
        assert np.allclose(values, [e[0] for step in steps[null:] for e in step], atol=1e-3)
        assert f"{side}_top_logprobs" not in flat


async def _check_weights(client: EngineClient, body: dict | None) -> tuple[int, dict]:
    async with client.session.post(client.url + "/weights_checker", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.timeout(120)
async def test_weights_checker_answers_digests_in_sglangs_layout(client):
    """``/weights_checker``'s ``checksum`` (``http_server.check_weights``): a digest of 16 hex
    digits per tensor, each rank's ``per_gpu_checksum`` over them, ``per_engine_checksum`` over
    the ranks'; an action it does not know is a 400 in the same layout."""
    import hashlib

    from stages.engine.weight_checker import overall_checksum

    status, answer = await _check_weights(client, None)
    assert status == 200 and answer["success"] is True and answer["message"] == "Success."
    engine = hashlib.sha256()
    for rank in answer["ranks"]:
        digests = rank["checksums"]
        assert digests and all(len(d) == 16 and int(d, 16) >= 0 for d in digests.values())
        assert rank["per_gpu_checksum"] == overall_checksum(digests)
        assert rank["parallelism_info"][0]["role"] == "target"
        engine.update(rank["per_gpu_checksum"].encode())
    assert answer["per_engine_checksum"] == engine.hexdigest()
    status, answer = await _check_weights(client, {"action": "wipe"})
    assert (status, answer) == (400, {"success": False, "message": "Unsupported action='wipe'"})


@pytest.mark.timeout(300)
async def test_weights_checker_proves_the_publisher_brings_every_weight_back(client, served):
    """slime's check of an update path: snapshot, every weight overwritten with random values,
    the model's own weights published over the weight group, compare: bitwise equal, or the
    compare names each tensor the publisher missed or wrote wrong."""
    _need_model(served)
    assert await _check_weights(client, {"action": "snapshot"}) == (
        200, {"success": True, "message": "Success."},
    )  # fmt: skip
    assert (await _check_weights(client, {"action": "reset_tensors"}))[0] == 200
    status, answer = await _check_weights(client, {"action": "compare"})
    assert status == 400 and answer["message"].startswith("check tensor equality failed")
    version = (await client.generate(PROMPT, _params(1), rid=_rid("v"))).weight_version + 1
    await _publish_own_weights(served, version)
    assert await _check_weights(client, {"action": "compare"}) == (
        200, {"success": True, "message": "Success."},
    )  # fmt: skip


@pytest.mark.timeout(300)
async def test_lora_adapters_as_files_load_by_name_and_requests_name_them(client, served, tmp_path):
    """``publish.lora_transport: files`` against SGLang: needs INFLIGHT_SGLANG_MODEL (the
    adapters' shapes come from its config) and a server started with ``--enable-lora
    --max-lora-rank 8 --lora-target-modules q_proj v_proj``, which reads ``tmp_path`` (the
    same machine). Versions load by name, the older one is unloaded, and a request naming the
    adapter samples something other than the base model."""
    _need_model(served)
    import torch
    from transformers import AutoConfig

    from stages.weights.adapter_files import AdapterFilePublisher

    config = AutoConfig.from_pretrained(served.model)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    outs = {"q_proj": config.num_attention_heads * head_dim}
    outs["v_proj"] = config.num_key_value_heads * head_dim
    gen = torch.Generator().manual_seed(0)

    def adapters() -> list:
        named = []
        for i in range(layers):
            for proj, out in outs.items():
                module = f"model.layers.{i}.self_attn.{proj}"
                a = torch.randn(8, hidden, generator=gen) * 0.05
                named += [(f"{module}.lora_A.weight", a.to(torch.bfloat16))]
                b = torch.randn(out, 8, generator=gen) * 0.05
                named += [(f"{module}.lora_B.weight", b.to(torch.bfloat16))]
        return named

    publisher = AdapterFilePublisher([served.url], tmp_path / "adapters", base=served.model)
    await publisher.connect()
    try:
        await publisher.publish(adapters(), 1)
        base = await client.generate(PROMPT, _params(16), rid=_rid("base"))
        client.adapter = lambda: ("policy-v1", 1)
        adapted = await client.generate(PROMPT, _params(16), rid=_rid("lora"))
        assert adapted.output_ids.tolist() != base.output_ids.tolist()
        assert set(adapted.versions.tolist()) == {1}
        await publisher.publish(adapters(), 2)
        client.adapter = lambda: ("policy-v1", 1)  # unloaded since: refused
        with pytest.raises(EngineError):
            await client.generate(PROMPT, _params(4), rid=_rid("gone"))
        client.adapter = lambda: ("policy-v2", 2)
        assert (await client.generate(PROMPT, _params(4), rid=_rid("v2"))).weight_version == 2
    finally:
        client.adapter = None
        await publisher.close()


@pytest.mark.timeout(120)
async def test_native_bodies_are_read_as_sglangs_request_structs(client):
    """SGLang 0.5.23 reads each native route's body into its ``io_struct`` struct (FastAPI,
    pydantic's lax mode) before the route: values pydantic converts are taken, other types and
    a missing body are 400s in its validation answer, and keys the struct does not name are
    ignored (``/generate``'s too)."""

    async def post(path: str, body=None, **kw) -> tuple[int, Any]:
        async with client.session.post(client.url + path, json=body, **kw) as resp:
            return resp.status, await resp.json(content_type=None)

    status, rows = await post(
        "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "2"}
    )
    assert status == 200 and len(rows) == 2, rows  # "2": an int to pydantic
    for path, body, words in (
        ("/pause_generation", None, "Field required"),  # no body: FastAPI's
        ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 1.5}, "integer"),
        ("/parse_function_call", {"text": "x", "tools": [{"function": {"name": 1}}]}, "string"),
        ("/abort_request", {"rid": ["a"]}, "string"),
    ):
        status, answer = await post(path, body)
        assert status == 400 and answer["type"] == "Bad Request", (path, answer)
        assert words in answer["message"], (path, answer)
    status, answer = await post(
        "/separate_reasoning",
        {"text": "a</think>b", "reasoning_parser": "deepseek-r1", "return_blocks": "yes"},
    )
    assert status == 200 and answer["text_blocks"] == ["b"], answer
    plain = await client.generate(PROMPT, _params(4), rid=_rid("plain"))
    body = {"input_ids": PROMPT, "sampling_params": _params(4), "return_logprobs": True}
    status, answer = await post("/generate", {**body, "rid": _rid("ignored")})
    assert status == 200 and answer["output_ids"] == list(plain.output_ids), answer
    assert "output_token_logprobs" not in answer["meta_info"]  # a misspelt key: ignored
    if not URL:  # FastAPI 0.132 and later read JSON only when it is sent as JSON
        status, answer = await post(
            "/generate", data=json.dumps(body), headers={"Content-Type": "text/plain"}
        )
        assert status == 400 and "dictionary" in answer["message"], answer
