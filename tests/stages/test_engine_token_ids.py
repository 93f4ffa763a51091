"""Token in, token out, as SGLang 0.5.23 serves it: ``/generate``'s
``return_prompt_token_ids`` (``io_struct.GenerateReqInput``; ``TokenizerManager`` adds
``prompt_token_ids`` after ``meta_info`` of each answer and streamed chunk), ``/v1/completions``'
``return_token_ids`` (``serving_completions.py``: ``token_ids`` and ``prompt_token_ids``, the
latter with a choice's first chunk when streamed), and ``/v1/chat/completions``' ``input_ids``,
``return_prompt_token_ids``, ``return_token_ids`` and ``return_meta_info`` (``serving_chat.py``:
``prompt_token_ids``, ``response_token_ids``, ``meta_info`` of each choice; refused with
``stream``). The engine of ``test_engine_chat.py``."""

from __future__ import annotations

import json

import pytest
import requests

from tests.stages.test_engine_chat import HELLO, TEMPLATE, _ids, chat_engine, client  # noqa: F401
from tests.stages.test_engine_server import Engine, serving

GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


def _post(engine: Engine, path: str, body: dict) -> requests.Response:
    return requests.post(engine.url + path, json=body, timeout=30)


def _events(answer: requests.Response) -> list[dict]:
    lines = answer.text.split("\n\n")
    return [json.loads(e[len("data: ") :]) for e in lines if e.startswith("data: {")]


@pytest.mark.timeout(60)
def test_generate_gives_each_answer_its_prompt_ids_after_meta_info(chat_engine: Engine) -> None:  # noqa: F811
    tok_ids = _post(chat_engine, "/v1/tokenize", {"prompt": ["w11 w12", "w13"]}).json()["tokens"]
    body = {"text": ["w11 w12", "w13"], "sampling_params": GREEDY, "return_prompt_token_ids": True}
    answer = _post(chat_engine, "/generate", body)
    assert answer.status_code == 200, answer.text
    first, second = answer.json()
    assert list(first) == ["text", "output_ids", "meta_info", "prompt_token_ids"]
    assert [first["prompt_token_ids"], second["prompt_token_ids"]] == tok_ids
    plain = _post(chat_engine, "/generate", {**body, "return_prompt_token_ids": False}).json()
    assert "prompt_token_ids" not in plain[0]
    assert [p["output_ids"] for p in plain] == [first["output_ids"], second["output_ids"]]
    # streamed: every chunk carries them, before the sample's index (SGLang's order); a slow
    # reader may get a sample's tokens in one chunk, so only both samples' are certain
    chunks = _events(_post(chat_engine, "/generate", {**body, "stream": True}))
    assert {chunk["index"] for chunk in chunks} == {0, 1}
    for chunk in chunks:
        assert list(chunk)[-2:] == ["prompt_token_ids", "index"]
        assert chunk["prompt_token_ids"] == tok_ids[chunk["index"]]
    bad = _post(chat_engine, "/generate", {**body, "return_prompt_token_ids": "yes"})
    assert bad.status_code == 400  # SGLang 0.5.23's JSON contract: a boolean
    assert bad.json() == {"error": 'invalid type: string "yes", expected a boolean'}


@pytest.mark.timeout(60)
def test_completions_return_token_ids_gives_the_prompt_ids_too(chat_engine: Engine) -> None:  # noqa: F811
    prompt = [11, 12, 13]
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 2,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    answer = _post(chat_engine, "/v1/completions", body).json()
    native = chat_engine.generate({"input_ids": prompt, "sampling_params": GREEDY})
    for choice in answer["choices"]:
        assert list(choice)[-2:] == ["token_ids", "prompt_token_ids"]
        assert choice["token_ids"] == native["output_ids"]
        assert choice["prompt_token_ids"] == prompt
    chunks = _events(_post(chat_engine, "/v1/completions", {**body, "stream": True}))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt  # with its first chunk only
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == native["output_ids"]


@pytest.mark.timeout(60)
def test_chat_returns_the_prompt_and_answer_ids_and_meta_info(chat_engine: Engine) -> None:  # noqa: F811
    ids = _ids(chat_engine, HELLO)
    native = chat_engine.generate({"input_ids": ids, "sampling_params": GREEDY})
    body = {"model": "m", "messages": HELLO, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    plain = _post(chat_engine, "/v1/chat/completions", body).json()["choices"][0]
    assert {"prompt_token_ids", "response_token_ids", "meta_info"}.isdisjoint(plain)
    both = _post(chat_engine, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    (choice,) = both["choices"]
    assert list(choice)[-2:] == ["prompt_token_ids", "response_token_ids"]
    assert (
        choice["prompt_token_ids"] == ids and choice["response_token_ids"] == native["output_ids"]
    )
    only = _post(chat_engine, "/v1/chat/completions", {**body, "return_prompt_token_ids": True})
    (choice,) = only.json()["choices"]
    assert choice["prompt_token_ids"] == ids and "response_token_ids" not in choice
    meta = _post(chat_engine, "/v1/chat/completions", {**body, "return_meta_info": True}).json()
    info = meta["choices"][0]["meta_info"]
    assert info["id"] == meta["id"] and info["completion_tokens"] == 5
    assert info["prompt_tokens"] == len(ids) and info["finish_reason"]["type"] == "length"
    # none of them with stream: SGLang's 400 and words
    for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
        refused = _post(chat_engine, "/v1/chat/completions", {**body, flag: True, "stream": True})
        assert refused.status_code == 400
        assert refused.json()["message"].startswith(f"{flag} is not supported with streaming")
        wrong = _post(chat_engine, "/v1/chat/completions", {**body, flag: "maybe"})
        assert wrong.status_code == 400 and wrong.json()["type"] == "Bad Request"
        assert wrong.json()["message"].startswith(f"{flag}: Input should be a valid boolean")


@pytest.mark.timeout(60)
def test_chat_input_ids_are_the_prompt_as_given(chat_engine: Engine) -> None:  # noqa: F811
    ids = _ids(chat_engine, HELLO)
    body = {"model": "m", "messages": HELLO, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    templated = _post(chat_engine, "/v1/chat/completions", body).json()
    other = [{"role": "user", "content": "w90"}]  # the messages no longer make the prompt
    given = _post(
        chat_engine, "/v1/chat/completions", {**body, "messages": other, "input_ids": ids}
    ).json()
    assert given["choices"][0]["prompt_token_ids"] == ids
    assert given["choices"][0]["message"] == templated["choices"][0]["message"]
    assert given["usage"]["prompt_tokens"] == len(ids)
    raw = [11, 12]  # no template around them at all
    bare = _post(chat_engine, "/v1/chat/completions", {**body, "input_ids": raw}).json()
    native = chat_engine.generate({"input_ids": raw, "sampling_params": GREEDY})
    assert bare["choices"][0]["response_token_ids"] == native["output_ids"]
    for wrong in ("w11", [1.5], [None, 2]):  # [true, 2] is [1, 2] to pydantic
        refused = _post(chat_engine, "/v1/chat/completions", {**body, "input_ids": wrong})
        assert refused.status_code == 400 and refused.json()["type"] == "Bad Request"
        assert refused.json()["message"].startswith("input_ids")
    empty = _post(chat_engine, "/v1/chat/completions", {**body, "messages": [], "input_ids": ids})
    assert empty.status_code == 400  # SGLang: messages still required


@pytest.mark.timeout(60)
def test_chat_sglext_gives_the_prompt_and_each_choice_s_ids_streamed_or_not(
    chat_engine: Engine,  # noqa: F811
) -> None:
    """``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext`` (or SGLang's
    ``x-sglext-return-*-ids: 1`` headers): the response's ``sglext`` ``{input_ids,
    output_ids}``; streamed, a chunk of its own after the choices' last (no choices, ``usage``
    null), before the usage chunk."""
    ids = _ids(chat_engine, HELLO)
    body = {"model": "m", "messages": HELLO, "max_tokens": 4, "temperature": 0, "n": 2,
            "ignore_eos": True, "return_input_ids_in_sglext": True,
            "return_output_ids_in_sglext": True}  # fmt: skip
    native = chat_engine.generate(
        {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 4}}
    )
    whole = _post(chat_engine, "/v1/chat/completions", body).json()
    assert list(whole)[-1] == "sglext"
    assert whole["sglext"] == {"input_ids": ids, "output_ids": [native["output_ids"]] * 2}
    asked = {"return_input_ids_in_sglext": False, "return_output_ids_in_sglext": False}
    plain = _post(chat_engine, "/v1/chat/completions", {**body, **asked}).json()
    assert "sglext" not in plain
    headers = {"x-sglext-return-output-ids": "1"}
    by_header = requests.post(
        chat_engine.url + "/v1/chat/completions", json={**body, **asked}, headers=headers,
        timeout=30,
    ).json()  # fmt: skip
    assert by_header["sglext"] == {"output_ids": [native["output_ids"]] * 2}
    streamed = _events(
        _post(chat_engine, "/v1/chat/completions",
              {**body, "stream": True, "stream_options": {"include_usage": True}})
    )  # fmt: skip
    *_, ext, usage = streamed
    assert ext["choices"] == [] and ext["usage"] is None and ext["id"] == streamed[-3]["id"]
    assert ext["sglext"] == whole["sglext"]
    assert usage["usage"]["completion_tokens"] == 8 and "sglext" not in usage
    wrong = _post(chat_engine, "/v1/chat/completions", {**body, "return_input_ids_in_sglext": 2})
    assert wrong.status_code == 400  # 1 is true to pydantic, as to SGLang; 2 is nothing
    assert wrong.json()["message"].startswith("return_input_ids_in_sglext: Input should be")
    # x-sglext-ids-framed: 1: the ids as a named event, the rest as before
    framed = requests.post(
        chat_engine.url + "/v1/chat/completions", json={**body, "stream": True},
        headers={"x-sglext-ids-framed": "1"}, timeout=30,
    ).text.split("\n\n")  # fmt: skip
    named = [e for e in framed if e.startswith("event: ")]
    assert len(named) == 1 and named[0].startswith("event: sglext_ids\ndata: {")
    assert json.loads(named[0].split("data: ", 1)[1])["sglext"] == whole["sglext"]
    plain_events = [e for e in framed if e.startswith("data: {")]
    assert all("sglext" not in json.loads(e[len("data: ") :]) for e in plain_events)
    assert framed[-2] == "data: [DONE]"


@pytest.mark.timeout(60)
def test_v1_routes_pass_the_cache_namespace_and_priority_on(chat_engine: Engine) -> None:  # noqa: F811
    """``extra_key``, ``cache_salt`` and ``priority`` go on to ``/generate`` as SGLang passes
    them: a chat turn repeated under its own namespace reuses its prefix, under another not."""
    body = {"model": "m", "messages": [{"role": "user", "content": "w40 w41 w42 w43"}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_meta_info": True}  # fmt: skip

    def cached(**more: object) -> int:
        answer = _post(chat_engine, "/v1/chat/completions", {**body, **more})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["meta_info"]["cached_tokens"]

    cached(extra_key="t1")
    assert cached(extra_key="t2") == 0 and cached(extra_key="t1", cache_salt="s") == 0
    assert cached(extra_key="t1") > 0 and cached(extra_key="t1", priority=5) > 0
    completion = {"model": "m", "prompt": [60, 61, 62, 63], "max_tokens": 2, "temperature": 0}
    for more in ({"priority": 1 << 63}, {"extra_key": 7}):
        for path, asked in (("/v1/chat/completions", body), ("/v1/completions", completion)):
            refused = _post(chat_engine, path, {**asked, **more})
            assert refused.status_code == 400 and next(iter(more)) in refused.text


@pytest.mark.timeout(90)
def test_the_servers_flags_give_every_chat_answer_its_sglext_ids(
    chat_engine: Engine,  # noqa: F811
    tmp_path,
) -> None:
    """SGLang 0.5.23's ``--return-input-ids`` and ``--return-output-ids``
    (``serving_chat._should_return_input_ids``: the request's field or the flag): every chat
    answer, streamed or not, has the ``sglext`` ids its request did not ask for, even one that
    said false; a completion has none (a chat route's fields)."""
    ids = _ids(chat_engine, HELLO)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ("--chat-template", str(template), "--return-input-ids", "--return-output-ids")
    body = {"model": "m", "messages": HELLO, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with serving(chat_engine.model_dir, tmp_path / "engine.log", *flags) as eng:
        whole = _post(eng, "/v1/chat/completions", body).json()
        assert whole["sglext"]["input_ids"] == ids and len(whole["sglext"]["output_ids"][0]) == 4
        said_no = {**body, "return_input_ids_in_sglext": False}
        assert _post(eng, "/v1/chat/completions", said_no).json()["sglext"] == whole["sglext"]
        *_, ext = _events(_post(eng, "/v1/chat/completions", {**body, "stream": True}))
        assert ext["choices"] == [] and ext["sglext"] == whole["sglext"]
        completion = {"model": "m", "prompt": ids, "max_tokens": 2}
        assert "sglext" not in _post(eng, "/v1/completions", completion).json()
    assert "sglext" not in _post(chat_engine, "/v1/chat/completions", body).json()
