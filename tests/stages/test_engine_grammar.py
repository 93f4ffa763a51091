"""Constrained decoding on the built-in engine (``json_schema``, ``regex``, ``ebnf``), as a real
server on a tiny model with a byte-level BPE tokenizer, spoken to as SGLang is (``/generate``,
the ``openai`` client); after SGLang 0.5's llguidance backend
(``srt/constrained/llguidance_backend.py``) and ``GrammarManager.process_req_with_grammar``."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch

from stages.engine.grammar import GrammarError, GrammarSet
from stages.engine.openai_chat import ChatSettings, chat_request
from tests.stages.engine_setup import run_with_retraction
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.test_engine_streaming import _events
from tests.stages.tiny_model import EOS_ID, make_arith_model, make_byte_model

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["ab", "cd"]},
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": -9, "maximum": 9},
            "maxItems": 3,
        },
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
PROMPT = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("grammar-engine")
    model_dir = make_byte_model(root / "model", seed=3)
    (root / "template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}:{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    with serving(
        model_dir, root / "engine.log", "--chat-template", str(root / "template.jinja")
    ) as eng:
        yield eng


def _generate(engine: Engine, sampling: dict[str, Any], **more: Any) -> Any:
    body = {"input_ids": PROMPT, "sampling_params": sampling, **more}
    response = requests.post(engine.url + "/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _follows_schema(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) - {"xs"} == {"ok", "n", "tag"}
        and isinstance(value["ok"], bool)
        and type(value["n"]) is int
        and 0 <= value["n"] <= 999
        and value["tag"] in ("ab", "cd")
        and all(type(x) is int and -9 <= x <= 9 for x in value.get("xs", []))
        and len(value.get("xs", [])) <= 3
    )


@pytest.mark.timeout(60)
def test_json_schema_outputs_follow_the_schema_greedy_and_sampled(engine: Engine) -> None:
    schema = json.dumps(SCHEMA)
    greedy = _generate(
        engine, {"json_schema": schema, "temperature": 0, "max_new_tokens": 80}, return_logprob=True
    )
    # the schema allows one first token ("{": no whitespace in this vocabulary): log-prob 0,
    # the distribution reported is the constrained one (SGLang's)
    assert greedy["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(0.0, abs=1e-6)
    sampled = _generate(
        engine, {"json_schema": schema, "temperature": 1.0, "n": 6, "max_new_tokens": 80}
    )
    for out in [greedy, *sampled]:
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}, out
        assert _follows_schema(json.loads(out["text"])), out["text"]
    # the same model unconstrained writes no JSON at all
    free = _generate(engine, {"temperature": 0, "max_new_tokens": 30})
    with pytest.raises(ValueError):
        json.loads(free["text"])


@pytest.mark.timeout(60)
def test_regex_and_ebnf_outputs_match_and_a_complete_grammar_ends_the_sample(
    engine: Engine,
) -> None:
    for sampling, check in (
        ({"regex": r"[a-c]{3}-[0-9]{1,4}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{1,4}", t)),
        ({"ebnf": 'root ::= "x" ("ab" | "cd")+ "y"'}, lambda t: re.fullmatch("x(ab|cd)+y", t)),
    ):
        for temperature in (0.0, 1.0):
            params = {**sampling, "temperature": temperature, "max_new_tokens": 40, "n": 3}
            for out in _generate(engine, params):
                assert check(out["text"]), (sampling, out["text"])
                assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # with ignore_eos the grammar itself ends the sample once complete (SGLang's
    # is_terminated): the EOS it allowed is the last token, trimmed from the text
    out = _generate(engine, {"regex": "abc", "ignore_eos": True, "max_new_tokens": 20})
    assert out["text"] == "abc" and out["output_ids"][-1] == EOS_ID
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    # streamed: the chunks end in the same answer
    sampling = {"regex": r"[0-9]{6}", "temperature": 0, "max_new_tokens": 20}
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": sampling}
    chunks = _events(engine, body)[1][:-1]  # without [DONE]
    assert chunks and re.fullmatch("[0-9]{6}", chunks[-1]["text"])  # (chunks may merge)
    assert chunks[-1]["text"] == _generate(engine, body["sampling_params"])["text"]


@pytest.mark.timeout(60)
def test_a_bad_grammar_is_a_400_naming_the_field_and_the_engine_serves_on(engine: Engine) -> None:
    # GrammarManager: "Failed to compile <json|regex|ebnf> grammar: ..."; SamplingParams.verify
    cases = [
        ({"json_schema": "{not json"}, "sampling_params.json_schema", "Failed to compile json"),
        ({"regex": "(a"}, "sampling_params.regex", "Failed to compile regex"),
        ({"ebnf": 'root ::= "a" | ('}, "sampling_params.ebnf", "Failed to compile ebnf"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params", "Only one of json_schema"),
        ({"structural_tag": "{}"}, "sampling_params.structural_tag", "Failed to compile struc"),
        (
            {"structural_tag": json.dumps({"format": {"type": "token", "token": 1}})},
            "sampling_params.structural_tag",
            "format.type: token formats ('token') not supported",
        ),
    ]
    for sampling, field, words in cases:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **sampling}}
        response = requests.post(engine.url + "/generate", json=body, timeout=30)
        assert response.status_code == 400, (sampling, response.text)
        message = response.json()["error"]["message"]
        assert message.startswith(field) and words in message, message
    for sampling, field, words in cases[:3]:  # streamed: refused before the first event
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"n": 2, **sampling}}
        response = requests.post(engine.url + "/generate", json=body, timeout=30)
        assert response.status_code == 400, (sampling, response.text)
        message = response.json()["error"]["message"]
        assert message.startswith(field) and words in message, message
    # a schema as an object: SGLang 0.5.23's JSON contract wants its text
    body = {"input_ids": PROMPT, "sampling_params": {"json_schema": {"type": "object"}}}
    response = requests.post(engine.url + "/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json() == {"error": "invalid type: map, expected a string"}
    # an empty grammar is none (SGLang: `json_schema or None`)
    assert _generate(engine, {"regex": "", "max_new_tokens": 3})["meta_info"]["completion_tokens"]
    status, info = engine.request("GET", "/server_info")
    assert status == 200 and info["refused_requests"]["POST /generate 400"] >= len(cases)


@pytest.mark.timeout(60)
def test_response_format_on_the_openai_routes(engine: Engine) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "ab"}], max_tokens=80, n=2,
        response_format=fmt,
    )  # fmt: skip
    for choice in chat.choices:
        assert _follows_schema(json.loads(choice.message.content)), choice.message.content
        assert choice.finish_reason == "stop"
    anything = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "ab"}], max_tokens=80, temperature=0,
        response_format={"type": "json_object"},
    ).choices[0].message.content  # fmt: skip
    assert isinstance(json.loads(anything), dict)
    completion = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"regex": "[a-f]{5}"}
    )
    assert re.fullmatch("[a-f]{5}", completion.choices[0].text)
    streamed = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=80, temperature=0, stream=True,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert _follows_schema(json.loads(text)), text
    for stream in (False, True):  # compiled off the loop: refused with the first batch
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="m", prompt=PROMPT, max_tokens=4, stream=stream,
                extra_body={"json_schema": "{oops"},
            )  # fmt: skip
        assert "json_schema" in info.value.body["message"]


def test_a_character_tokenizer_is_constrained_by_its_tokens_texts(tmp_path: Path) -> None:
    """llguidance does not read a ``Fuse`` decoder (the arithmetic models'): each token's text
    stands for its bytes, and the masks allow exactly the tokens that keep the text in the
    grammar."""
    from transformers import PreTrainedTokenizerFast

    model_dir = make_arith_model(tmp_path / "arith")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    grammars = GrammarSet(tokenizer, 16, [tokenizer.eos_token_id])
    constraint = grammars.start("regex", "[0-9]{2}[+*]")
    logits = torch.zeros(1, 16)
    texts = [tokenizer.decode([i]) for i in range(16)]
    for expected in ("0123456789", "0123456789", "+*"):
        grammars.constrain(logits, [0], [constraint])
        allowed = {texts[i] for i in range(16) if math.isfinite(float(logits[0, i]))}
        assert allowed == set(expected), allowed
        token = next(i for i in range(16) if texts[i] == expected[-1])
        assert constraint.accept(token) is None
        logits.zero_()
    grammars.constrain(logits, [0], [constraint])  # complete: only EOS
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [tokenizer.eos_token_id]
    assert constraint.accept(3) is not None or constraint.matcher.is_error()


def test_a_tokenizer_that_spaces_its_words_cannot_be_constrained(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from tests.stages.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "words", vocab=32)
    grammars = GrammarSet(PreTrainedTokenizerFast.from_pretrained(model_dir), 32, [EOS_ID])
    grammars.warm()  # as the server does at start: the refusal is kept, not raised there
    for _ in range(2):  # the same answer every time, found once
        with pytest.raises(GrammarError, match="cannot constrain"):
            grammars.start("json_schema", "{}")


@pytest.mark.timeout(60)
def test_a_constrained_sample_survives_a_retraction(tmp_path: Path) -> None:
    """The grammar state is the sample's own, not its row's: a retraction in the middle (its
    KV dropped, its output recomputed) changes nothing of the result."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler

    model_dir = make_byte_model(tmp_path / "m", seed=5)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    params = SamplingParams(
        temperature=0.0, max_new_tokens=40, grammar=("regex", "[a-e]{4}(-[0-9]{2}){3}")
    )
    results = []
    for retract in (False, True):
        grammars = GrammarSet(tokenizer, vocab, [EOS_ID])
        scheduler = Scheduler(model, max_running=4, eos_token_ids=[EOS_ID], grammars=grammars)
        other = scheduler.submit(
            GenerateInput("other", [5, 6], SamplingParams(temperature=0.0), False)
        )
        future = scheduler.submit(GenerateInput("g", PROMPT, params, True))
        run_with_retraction(scheduler, 5, retract)
        result = future.result(timeout=0)
        assert re.fullmatch("[a-e]{4}(-[0-9]{2}){3}", tokenizer.decode(result.output_ids[:-1]))
        assert result.finish_reason == {"type": "stop", "matched": EOS_ID}
        assert other.result(timeout=0).output_ids  # unconstrained beside it
        results.append(result.output_ids)
    assert results[0] == results[1]


@pytest.mark.timeout(60)
def test_a_new_grammar_compiles_off_the_event_loop_while_its_request_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's scheduler holds a request in its grammar queue until its grammar is compiled
    and serves the others meanwhile; here a caller on an event loop (the server's routes, an
    in-process engine) gets the same: the compile runs on the grammar worker, the loop and the
    scheduler serve on, and the request is queued once its grammar is ready. An abort while it
    compiles ends it as aborted without a token; a grammar that does not compile fails its
    future with the field; a stop fails what is still compiling."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from stages.engine.aborts import ABORTED_COMPILING
    from stages.engine.protocol import GenerateInput, RequestError, SamplingParams
    from stages.engine.scheduler import Scheduler

    model_dir = make_byte_model(tmp_path / "m", seed=5)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    grammars = GrammarSet(tokenizer, model.config.vocab_size, [EOS_ID])
    compile_now = grammars._compile
    compiling = threading.Event()

    def slow_compile(kind: str, text: str) -> Any:  # a large schema: the GIL is free meanwhile
        compiling.set()
        time.sleep(0.5)
        return compile_now(kind, text)

    monkeypatch.setattr(grammars, "_compile", slow_compile)
    scheduler = Scheduler(model, max_running=4, eos_token_ids=[EOS_ID], grammars=grammars)
    scheduler.start()

    def constrained(rid: str, pattern: str) -> GenerateInput:
        params = SamplingParams(temperature=0.0, max_new_tokens=20, grammar=("regex", pattern))
        return GenerateInput(rid, PROMPT, params, True)

    plain = GenerateInput("plain", [5, 6], SamplingParams(temperature=0.0, max_new_tokens=4), True)

    async def main() -> None:
        started = time.perf_counter()
        waiting = scheduler.submit_async([constrained("g", "[a-e]{4}-[0-9]{2}")])
        assert time.perf_counter() - started < 0.25  # the compile (0.5 s) is not on this loop
        (other,) = await scheduler.submit_async([plain])  # served while the grammar compiles
        assert len(other.output_ids) == 4 and not waiting.done()
        (result,) = await waiting
        assert time.perf_counter() - started >= 0.5
        assert re.fullmatch("[a-e]{4}-[0-9]{2}", tokenizer.decode(result.output_ids[:-1]))
        assert grammars.compiled("regex", "[a-e]{4}-[0-9]{2}")
        again = await scheduler.submit_async([constrained("g2", "[a-e]{4}-[0-9]{2}")])
        assert again[0].output_ids == result.output_ids  # kept compiled: queued at once

        compiling.clear()
        cut = scheduler.submit_async([constrained("c", "[0-9]{5}")])
        await asyncio.to_thread(compiling.wait, 5)
        assert await asyncio.wrap_future(scheduler.abort_many(["c"])) == 1
        (aborted,) = await cut
        assert aborted.finish_reason == ABORTED_COMPILING and aborted.output_ids == []

        bad = scheduler.submit_async([plain, constrained("b", "(a")])
        with pytest.raises(RequestError, match=r"^sampling_params\.regex: Failed to compile regex"):
            await bad

        compiling.clear()
        held = scheduler.submit_async([constrained("s", "[f-z]{3}")])
        await asyncio.to_thread(compiling.wait, 5)
        await asyncio.to_thread(scheduler.stop)
        with pytest.raises(RuntimeError, match="shutting down"):
            await held

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_abort_while_the_grammar_compiles_is_sglangs_400(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang fails a request aborted in its grammar queue with a 400 reason
    (grammar_manager.py ``abort_requests``: ``set_finish_with_abort("Aborted by
    AbortReq.")``), which its tokenizer turns into an error answer when not streamed
    (tokenizer_manager.py ``_handle_abort_finish_reason``: a ValueError, the route's
    ``{"error": {"message"}}``; ``/v1/completions``' ``create_error_response``) and streams
    as the last chunk's ``finish_reason`` otherwise; a ``/v1`` stream ends with an error event
    there (serving_chat.py ``_generate_chat_stream``, serving_completions.py: its
    ``HTTPStatus`` reason, ``create_streaming_error_response(message, code.name,
    code.value)``), which the ``openai`` client raises, and Anthropic's with an ``error`` event
    (anthropic/serving.py ``_flush_on_error``)."""
    from aiohttp.test_utils import TestClient, TestServer

    from stages.engine.aborts import ABORTED_COMPILING
    from stages.engine.loader import load_model
    from stages.engine.scheduler import Scheduler
    from stages.engine.server import build_app

    model_dir = make_byte_model(tmp_path / "m", seed=5)
    loaded = load_model(str(model_dir), device="cpu")
    grammars = GrammarSet(loaded.tokenizer, loaded.vocab_size, [EOS_ID])
    compile_now, compiling = grammars._compile, threading.Event()

    def slow_compile(kind: str, text: str) -> Any:
        compiling.set()
        time.sleep(0.3)
        return compile_now(kind, text)

    monkeypatch.setattr(grammars, "_compile", slow_compile)
    scheduler = Scheduler(loaded.model, max_running=4, eos_token_ids=[EOS_ID], grammars=grammars)
    scheduler.start()

    async def aborted(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        compiling.clear()
        sent = asyncio.ensure_future(client.post(path, json=body))
        assert await asyncio.to_thread(compiling.wait, 5)
        answer = await client.post("/abort_request", json={"rid": body.get("rid", "r")})
        assert answer.status == 200 and await answer.read() == b""
        response = await sent
        return response.status, await response.read()

    async def main() -> None:
        app = build_app(loaded, scheduler, chat_template="{{ messages[0].content }}")
        async with TestClient(TestServer(app)) as client:

            def native(regex: str, **more: Any) -> dict[str, Any]:
                params = {"temperature": 0, "max_new_tokens": 8, "regex": regex}
                return {"input_ids": PROMPT, "rid": "r", "sampling_params": params, **more}

            status, body = await aborted(client, "/generate", native("[0-9]{6}"))
            assert (status, json.loads(body)) == (
                400, {"error": {"message": "Aborted by AbortReq."}}
            )  # fmt: skip
            status, body = await aborted(client, "/generate", native("[0-9]{7}", stream=True))
            events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
            assert status == 200 and events[-1] == b"[DONE]", body
            assert json.loads(events[-2])["meta_info"]["finish_reason"] == ABORTED_COMPILING
            completion = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "regex": "[0-9]{8}",
                          "rid": "r"}  # fmt: skip
            status, body = await aborted(client, "/v1/completions", completion)
            assert (status, json.loads(body)) == (400, {
                "object": "error", "message": "Aborted by AbortReq.", "type": "BadRequestError",
                "param": None, "code": 400,
            })  # fmt: skip
            error = {"error": {"object": "error", "message": "Aborted by AbortReq.",
                               "type": "BAD_REQUEST", "param": None, "code": 400}}  # fmt: skip
            completion.update(stream=True, regex="[0-9]{9}")  # a grammar not compiled yet
            status, body = await aborted(client, "/v1/completions", completion)
            assert status == 200 and _sse(body) == [error, "[DONE]"], body
            chat = {"model": "m", "messages": [{"role": "user", "content": "12+3="}],
                    "max_tokens": 8, "regex": "[0-9]{5}", "rid": "r", "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            status, body = await aborted(client, "/v1/chat/completions", chat)
            events = _sse(body)
            assert status == 200 and events[0] == error and events[-1] == "[DONE]", body
            usage = events[1]  # then the usage chunk, no role, content or finish chunk
            assert len(events) == 3 and usage["choices"] == [] and usage["id"] == "r"
            assert usage["usage"]["completion_tokens"] == 0 < usage["usage"]["prompt_tokens"]
            message = {"model": "m", "max_tokens": 8, "stream": True,
                       "messages": [{"role": "user", "content": "12+3="}]}  # fmt: skip
            compiling.clear()
            sent = asyncio.ensure_future(
                client.post("/v1/messages", json={**message, "output_config": {
                    "format": {"type": "json_schema", "schema": {"type": "integer"}}}})
            )  # fmt: skip
            assert await asyncio.to_thread(compiling.wait, 5)
            answer = await client.post("/abort_request", json={"abort_all": True})
            assert answer.status == 200
            response = await sent
            lines = (await response.read()).decode().split("\n\n")
            names = [line.split("\n")[0] for line in lines if line]
            assert names == ["event: message_start", "event: error", "event: message_stop"]
            assert json.loads(lines[1].split("data: ", 1)[1]) == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "Aborted by AbortReq."},
            }
            assert json.loads(lines[0].split("data: ", 1)[1])["message"]["usage"] == {
                "input_tokens": 0, "output_tokens": 0
            }  # fmt: skip

            # the openai client raises the error event
            oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="-")

            async def read_chat() -> list[Any]:
                stream = await oai.chat.completions.create(
                    model="m", messages=chat["messages"], max_tokens=8, stream=True,
                    extra_body={"regex": "[0-9]{4}", "rid": "r"},
                )  # fmt: skip
                return [chunk async for chunk in stream]

            compiling.clear()
            reading = asyncio.ensure_future(read_chat())
            assert await asyncio.to_thread(compiling.wait, 5)
            assert (await client.post("/abort_request", json={"rid": "r"})).status == 200
            with pytest.raises(openai.APIError, match="Aborted by AbortReq"):
                await reading
            await oai.close()
            assert (await client.post("/generate", json=native("[0-9]{6}"))).status == 200

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()


def _sse(body: bytes) -> list[Any]:
    """The ``data:`` payloads of a stream's body: JSON, or the string ``[DONE]``."""
    lines = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    return ["[DONE]" if line == b"[DONE]" else json.loads(line) for line in lines]


def test_a_structural_tag_constrains_what_follows_its_trigger(tmp_path: Path) -> None:
    """SGLang's legacy structural tag (what its llguidance backend takes): free text, and after
    a trigger the structure's ``begin``, a body that follows its schema, and its ``end``."""
    from transformers import PreTrainedTokenizerFast

    model_dir = make_byte_model(tmp_path / "m")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    vocab = len(tokenizer)
    grammars = GrammarSet(tokenizer, vocab, [EOS_ID])
    grammars.warm()  # llguidance's view of the tokenizer, built before any request
    assert grammars._ll is not None and grammars._ll.vocab_size == vocab
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "[x:", "schema": {"enum": [1, 2]}, "end": "]"}],
        "triggers": ["["],
    }
    constraint = grammars.start("structural_tag", json.dumps(tag))
    token = {tokenizer.decode([i]): i for i in range(vocab)}

    def allowed() -> set[str]:
        logits = torch.zeros(1, vocab)
        grammars.constrain(logits, [0], [constraint])
        return {tokenizer.decode([i]) for i in torch.isfinite(logits[0]).nonzero()[:, 0].tolist()}

    assert {"a", "7", "{", "["} <= allowed()  # free text
    for text, after in (("q", None), ("[", {"x"}), ("x", {":"}), (":", {"1", "2"}), ("2", {"]"})):
        assert constraint.accept(token[text]) is None
        if after is not None:  # what may follow ``text``
            assert allowed() == after, text
    assert constraint.accept(token["]"]) is None
    assert {"a", "["} <= allowed()  # free text again after the end
    with pytest.raises(GrammarError, match="structures"):
        grammars.start("structural_tag", json.dumps({"triggers": ["["]}))
    # the newer form (xgrammar's, stages.engine.structural_format): refusals name the field
    for fmt, words in (
        ({"type": "const_string"}, "format.value: a string is required"),
        ({"type": "grammar", "grammar": 'root ::= "a"'}, "format.type: an EBNF grammar element"),
        ({"type": "sequence", "elements": [{"type": "regex", "pattern": "a"}, {"type":
          "json_schema", "json_schema": {}}]}, "format.elements[0]: a regex element is supported"),
        ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string",
          "value": "x"}]}, "format.elements[0]: free text is supported only"),
    ):  # fmt: skip
        with pytest.raises(GrammarError, match=re.escape(words)):
            grammars.start("structural_tag", json.dumps({"format": fmt}))


@pytest.mark.timeout(60)
def test_a_structural_tag_in_the_newer_form_constrains_the_samples(engine: Engine) -> None:
    """``{type: structural_tag, format: {...}}`` as SGLang's default backend (xgrammar) takes
    it: a forced tag (``triggered_tags`` with ``at_least_one`` and ``stop_after_first``), and a
    tag whose content is free text up to its end."""
    tag = {"type": "tag", "begin": "[x:", "content": {"type": "json_schema",
           "json_schema": {"enum": [1, 2]}}, "end": "]"}  # fmt: skip
    forced = {"type": "triggered_tags", "triggers": ["["], "tags": [tag],
              "at_least_one": True, "stop_after_first": True}  # fmt: skip
    free = {"type": "sequence", "elements": [{"type": "const_string", "value": "a"},
            {"type": "tag", "begin": "{", "content": {"type": "any_text", "excludes": ["x"]},
             "end": "}"}]}  # fmt: skip
    ended = 0
    pattern_tag = {"type": "tag", "begin": "[", "end": "]",
                   "content": {"type": "regex", "pattern": r"[a-c]{2}\d"}}  # fmt: skip
    cases = ((forced, r"\[x:[12]\]"), (free, r"a\{[^}x]*\}"), (pattern_tag, r"\[[a-c]{2}\d\]"))
    for fmt, pattern in cases:
        text = json.dumps({"type": "structural_tag", "format": fmt})
        params = {"structural_tag": text, "temperature": 1.0, "max_new_tokens": 60, "n": 8}
        for out in _generate(engine, params):
            if out["meta_info"]["finish_reason"]["type"] == "length":  # free text cut short
                assert fmt is free and re.fullmatch(r"a\{[^}x]*", out["text"]), out
                continue
            ended += fmt is free
            assert re.fullmatch(pattern, out["text"]), (fmt["type"], out)
    assert ended  # some free text reached its end (each token has a chance of it)
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "ab"}], max_tokens=20, n=3,
        response_format={"type": "structural_tag", "format": forced},  # type: ignore[arg-type]
    )  # fmt: skip
    for choice in chat.choices:
        assert re.fullmatch(r"\[x:[12]\]", choice.message.content or ""), choice


def test_many_rows_masks_computed_together_equal_each_rows_own(tmp_path: Path) -> None:
    """From ``_PARALLEL_ROWS`` rows a step the masks come from llguidance's executor; they are
    the masks each row gets alone."""
    from transformers import PreTrainedTokenizerFast

    from stages.engine import grammar

    tokenizer = PreTrainedTokenizerFast.from_pretrained(make_byte_model(tmp_path / "m"))
    vocab = len(tokenizer)
    grammars = GrammarSet(tokenizer, vocab, [EOS_ID])
    rows = grammar._PARALLEL_ROWS + 3
    kinds = [
        ("regex", "[a-c]{2}[0-9]+"),
        ("json_schema", json.dumps(SCHEMA)),
        ("ebnf", 'root ::= "x" ("ab" | "cd")*'),
    ]
    constraints = [grammars.start(*kinds[i % 3]) for i in range(rows)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        together = torch.randn(rows + 2, vocab, generator=gen)
        alone = together.clone()
        grammars.constrain(together, list(range(2, rows + 2)), constraints)
        for i, constraint in enumerate(constraints):
            grammars.constrain(alone, [i + 2], [constraint])
        assert torch.equal(together, alone)
        assert torch.isfinite(together[:2]).all()  # rows not named are untouched
        for i, constraint in enumerate(constraints):
            assert constraint.accept(int(together[i + 2].argmax())) is None


def _tool(name: str) -> dict[str, Any]:
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    parameters = {
        "type": "object",
        "properties": {"a": digit, "b": digit},
        "required": ["a", "b"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # a random model's JSON stays short
    }
    return {
        "type": "function",
        "function": {"name": name, "strict": True, "parameters": parameters},
    }


TOOLS = [_tool("add"), _tool("mul")]


@pytest.fixture(scope="module", params=[None, "qwen25"])
def tool_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A byte-level model whose vocabulary writes the Qwen 2.5 tool-call format (``<tool_call>``
    a token, as in Qwen's), with a template that names that format; the format named again by
    ``--tool-call-parser`` or not."""
    from tests.stages.tiny_model import BYTE_CHARS

    root = tmp_path_factory.mktemp("tool-engine")
    model_dir = make_byte_model(
        root / "model", seed=4, chars=BYTE_CHARS + " <>_/\n", words=("<tool_call>", "</tool_call>")
    )
    (root / "template.jinja").write_text(TOOL_TEMPLATE)
    named = () if request.param is None else ("--tool-call-parser", request.param)
    with serving(
        model_dir, root / "engine.log", "--chat-template", str(root / "template.jinja"), *named
    ) as eng:
        eng.parser = request.param  # type: ignore[attr-defined]
        yield eng


TOOL_TEMPLATE = (
    "{# tool calls: <tool_call> {json} </tool_call> #}"
    "{% for m in messages %}{{ m.content }}:{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


@pytest.mark.timeout(60)
def test_tool_choice_required_or_named_answers_with_tool_calls(tool_engine: Engine) -> None:
    """``tool_choice`` ``required`` or a named function: the answer is tool calls in the
    parser's format and nothing else (SGLang's constraint for the Qwen 2.5 format: each call
    ``<tool_call>\\n{"name":"NAME", "arguments":`` ... ``}\\n</tool_call>``, a strict tool's
    arguments following its parameters); without ``--tool-call-parser`` SGLang's JSON array,
    left in the content (no parser, no parsing)."""
    client = openai.OpenAI(base_url=tool_engine.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "m", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 120}
    for choice, names in (
        ("required", {"add", "mul"}),
        ({"type": "function", "function": {"name": "mul"}}, {"mul"}),
    ):
        out = client.chat.completions.create(**ask, tools=TOOLS, tool_choice=choice, n=4)
        for c in out.choices:
            if tool_engine.parser is None:  # SGLang without a parser: its JSON array, unread
                assert not c.message.tool_calls and c.finish_reason in ("stop", "length"), c
                if c.finish_reason == "stop":  # (SGLang's items of a named tool are untyped)
                    assert isinstance(json.loads(c.message.content), list), c
                continue
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name in names and set(arguments) == {"a", "b"}
                assert all(0 <= v <= 9 for v in arguments.values())
    # the structural tag SGLang sends for it (what a SGLang engine behind the agent proxy gets)
    native = chat_request(
        {"messages": ask["messages"], "tools": TOOLS, "tool_choice": "required"},
        ChatSettings.of(
            _tokenizer(tool_engine),
            tool_engine.model_dir,
            chat_template=TOOL_TEMPLATE,
            tool_call_parser="qwen25",
        ),
        512,
    )[0]["sampling_params"]
    tag = json.loads(native["structural_tag"])
    assert tag["at_least_one"] is True and tag["triggers"] == ["<tool_call>"]
    assert tag["structures"][0] == {
        "begin": '<tool_call>\n{"name":"add", "arguments":',
        "schema": TOOLS[0]["function"]["parameters"],
        "end": "}\n</tool_call>",
    }
    # streamed: the pieces add up to the calls
    if tool_engine.parser is None:
        return
    streamed = client.chat.completions.create(
        **ask, tools=TOOLS, tool_choice="required", temperature=0, stream=True
    )
    pieces: dict[int, dict[str, str]] = {}
    for chunk in streamed:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            call = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    whole = client.chat.completions.create(
        **ask, tools=TOOLS, tool_choice="required", temperature=0
    )
    assert [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls
    ] == [pieces[i] for i in sorted(pieces)]
    # what SGLang refuses (OpenAIServingChat._validate_request, to_sampling_params)
    for more, words in (
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "div"}}},
         "Tool 'div' not found in tools list."),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined with response_format"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, **more)
        assert words in info.value.body["message"] and info.value.body["param"] == "tool_choice"


@pytest.mark.timeout(60)
def test_a_strict_tool_holds_the_calls_of_an_auto_answer_to_its_schema(
    tool_engine: Engine,
) -> None:
    """``tool_choice`` ``auto`` with a ``strict`` tool and ``--tool-call-parser``
    (function_call_parser.py get_structure_constraint: ``should_constrain_auto``; serving_chat:
    only with a parser): the structural tag of the format's calls without ``at_least_one``
    (get_legacy_structural_tag(at_least_one=False)), so the answer is free text in which each
    ``<tool_call>`` begins a call that follows its tool's parameters; no tag where no tool is
    strict, with ``tool_choice`` none, with another constraint (protocol.py to_sampling_params:
    that one alone), or without a parser (SGLang constrains nothing then)."""
    client = openai.OpenAI(base_url=tool_engine.url + "/v1", api_key="unused", max_retries=0)
    tok = _tokenizer(tool_engine)
    trigger = tok.convert_tokens_to_ids("<tool_call>")
    ask = {"model": "m", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 100,
           "logit_bias": {str(trigger): 100}}  # fmt: skip
    out = client.chat.completions.create(**ask, tools=TOOLS, n=4)
    named = tool_engine.parser is not None  # type: ignore[attr-defined]
    valid = 0
    for c in out.choices:  # the bias writes <tool_call>; the grammar writes the call after it
        assert bool(c.message.tool_calls) or not named, c
        for call in c.message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            assert call.function.name in {"add", "mul"} and set(arguments) == {"a", "b"}
            assert all(0 <= v <= 9 for v in arguments.values())
            valid += 1
    assert valid == 0 or named  # a random model writes no call unconstrained
    settings = ChatSettings.of(
        tok, tool_engine.model_dir, chat_template=TOOL_TEMPLATE, tool_call_parser="qwen25"
    )
    unnamed = ChatSettings.of(tok, tool_engine.model_dir, chat_template=TOOL_TEMPLATE)
    assert unnamed is not None and unnamed.tool_parser is None
    body = {"messages": ask["messages"], "tools": TOOLS}
    assert "structural_tag" not in chat_request(body, unnamed, 512)[0]["sampling_params"]

    def sampling(**more: Any) -> dict[str, Any]:
        body = {"messages": ask["messages"], "tools": TOOLS, **more}
        return chat_request(body, settings, 512)[0]["sampling_params"]

    tag = json.loads(sampling()["structural_tag"])
    assert tag["at_least_one"] is False and tag["triggers"] == ["<tool_call>"]
    assert tag["structures"][1] == {
        "begin": '<tool_call>\n{"name":"mul", "arguments":',
        "schema": TOOLS[1]["function"]["parameters"],
        "end": "}\n</tool_call>",
    }
    loose = [{"type": "function", "function": {**t["function"], "strict": False}} for t in TOOLS]
    assert "structural_tag" not in sampling(tools=loose)
    assert "structural_tag" not in sampling(tool_choice="none")
    constrained = sampling(response_format={"type": "json_object"})
    assert "structural_tag" not in constrained and "json_schema" in constrained
    assert "structural_tag" not in sampling(regex="[0-9]+")


@pytest.mark.timeout(60)
def test_a_structural_tags_tokens_are_the_tokenizers_own_or_their_text(tmp_path: Path) -> None:
    """A trigger, begin or end holding one of the tokenizer's added tokens written ``<...>``
    (Qwen's ``<tool_call>``, ``</tool_call>``) takes that token there, as the model writes it
    (xgrammar matches a token by its text; llguidance would have the model spell it out), free
    or forced (``at_least_one``); a tokenizer that has it only as a vocabulary word (or spells
    it) gets the same text: either way the structure is held after the trigger."""
    from transformers import PreTrainedTokenizerFast

    from tests.stages.tiny_model import make_tagged_byte_model

    def tag(at_least_one: bool) -> str:
        return json.dumps(
            {"type": "structural_tag", "triggers": ["<tool_call>"], "at_least_one": at_least_one,
             "structures": [{"begin": "<tool_call>[", "schema": {"type": "integer"},
                             "end": "]</tool_call>"}]}
        )  # fmt: skip

    words = ("<tool_call>", "</tool_call>")
    for model_dir in (
        make_tagged_byte_model(tmp_path / "added", words),
        make_byte_model(tmp_path / "word", words=words),
    ):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        grammars = GrammarSet(tokenizer, len(tokenizer), [EOS_ID])
        ids = tokenizer.convert_tokens_to_ids
        for free in ("a", "b", "1"):  # text before the trigger is free
            constraint = grammars.start("structural_tag", tag(False))
            assert constraint.accept(ids(free)) is None
            assert constraint.accept(ids("<tool_call>")) is None
            assert constraint.accept(ids("a")) is not None  # "[" is due after the trigger
        for at_least_one in (False, True):
            constraint = grammars.start("structural_tag", tag(at_least_one))
            if at_least_one:  # forced: the structure at once
                assert grammars.start("structural_tag", tag(True)).accept(ids("a")) is not None
            for token in ("<tool_call>", "[", "7", "]", "</tool_call>"):
                assert constraint.accept(ids(token)) is None, (model_dir.name, token)


def test_a_grammar_that_spells_a_special_tokens_text_is_held_by_ordinary_tokens(
    tmp_path: Path,
) -> None:
    """A regex whose text is a special token's (``<|open|>`` written out): llguidance forces
    the tokens its tokenizer gives that text, which for a special token's text is the special
    token, one its matcher then refuses (llguidance 1.9), aborting the sample; the engine's
    view of the tokenizer (``grammar._PlainText``) spells it with ordinary tokens instead, as
    xgrammar, SGLang's default, which never takes a special token for text, has them."""
    from transformers import AutoTokenizer

    model_dir = make_byte_model(tmp_path / "special", chars="abcdefghijklmnopqrstuvwxyz<>|",
                                words=("<|open|>",))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|open|>"]})
    special = tokenizer.convert_tokens_to_ids("<|open|>")
    grammars = GrammarSet(tokenizer, len(tokenizer), [EOS_ID])
    constraint = grammars.start("regex", r"<\|open\|>ab")
    tokens: list[int] = []
    while not tokens or tokens[-1] != EOS_ID:
        logits = torch.zeros(1, len(tokenizer))
        grammars.constrain(logits, [0], [constraint])
        allowed = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
        assert special not in allowed and not constraint.stuck, allowed
        tokens.append(allowed[0])
        assert constraint.accept(tokens[-1]) is None
        assert len(tokens) < 20
    assert tokenizer.decode(tokens[:-1]) == "<|open|>ab" and special not in tokens


@pytest.mark.timeout(120)
def test_json_whitespace_follows_sglangs_two_flags(tmp_path: Path) -> None:
    """``--constrained-json-disable-any-whitespace`` and ``--constrained-json-whitespace-pattern``
    as SGLang's llguidance backend takes them (``GuidanceBackend.dispatch_json``'s defaults):
    by default a JSON schema's output may have whitespace between its tokens; with the first
    none; with a pattern, what it matches. A pattern llguidance cannot compile stops the
    engine at start, naming the flag; an engine started with the first writes no whitespace
    however much the model favours it."""
    from transformers import PreTrainedTokenizerFast

    from stages.engine.server import json_whitespace, parse_args
    from tests.stages.tiny_model import BYTE_CHARS

    model = make_byte_model(tmp_path / "m", chars=BYTE_CHARS + " \n")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    vocab = len(tokenizer)
    space, newline = tokenizer.convert_tokens_to_ids(["Ġ", "Ċ"])
    brace = tokenizer.encode("{")[0]
    schema = json.dumps(SCHEMA)
    flags = {
        (): (True, True),
        ("--constrained-json-disable-any-whitespace",): (False, False),
        ("--constrained-json-whitespace-pattern", "[\n]*"): (False, True),
        ("--constrained-json-disable-any-whitespace",
         "--constrained-json-whitespace-pattern", "[\n]*"): (False, True),
    }  # fmt: skip
    for given, allowed in flags.items():
        args = parse_args(["--model", str(model), *given])
        grammars = GrammarSet(tokenizer, vocab, [EOS_ID], json_whitespace=json_whitespace(args))
        constraint = grammars.start("json_schema", schema)
        assert constraint.accept(brace) is None
        logits = torch.zeros(1, vocab)
        grammars.constrain(logits, [0], [constraint])
        seen = tuple(math.isfinite(float(logits[0, t])) for t in (space, newline))
        assert seen == allowed, given
    with pytest.raises(ValueError, match=r"--constrained-json-whitespace-pattern '\[\\n'"):
        json_whitespace(
            parse_args(["--model", "m", "--constrained-json-whitespace-pattern", "[\n"])
        )
    with serving(
        model, tmp_path / "engine.log", "--constrained-json-disable-any-whitespace"
    ) as eng:
        bias = {"logit_bias": {str(space): 40.0, str(newline): 40.0}, "max_new_tokens": 60}
        free = _generate(eng, {"regex": "[ab ]{8}", "temperature": 0, **bias})
        assert " " in free["text"]  # (the bias holds where whitespace is allowed)
        answer = _generate(eng, {"json_schema": schema, "temperature": 0, **bias})
        assert _follows_schema(json.loads(answer["text"])) and not re.search(r"\s", answer["text"])
