"""The built-in engine's OpenAI-compatible routes, through the ``openai`` client as agents and
harnesses call them, checked against the native ``/generate`` of the same engine and against
SGLang 0.5's ``serving_completions.py`` / ``protocol.py`` (the shapes each test names)."""

from __future__ import annotations

import math
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import requests

from tests.stages.engine_setup import ROOT, builtin_engine, engine_command
from tests.stages.test_engine_server import GREEDY, Engine, _tokenizer, engine  # noqa: F401
from tests.stages.tiny_model import make_byte_model

PROMPT = [21, 22, 23, 24]


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.timeout(60)
def test_models_lists_and_retrieves_the_served_model(engine: Engine, client) -> None:  # noqa: F811
    (card,) = client.models.list().data
    assert card.id == str(engine.model_dir) and card.object == "model"
    assert card.owned_by == "sglang" and card.model_extra["max_model_len"] > 0
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.mark.timeout(90)
def test_served_model_name_is_the_models_name_on_the_v1_routes(tmp_path: Path) -> None:
    """SGLang's ``--served-model-name``: what ``/v1/models`` lists and retrieves, what
    ``/v1/responses`` accepts (another name: 404), ``served_model_name`` in ``/model_info`` and
    ``/server_info`` (``model_path`` stays the folder's); a name with a colon is refused at the
    start in SGLang's words (the colon separates ``BASE:ADAPTER``)."""
    model = make_byte_model(tmp_path / "model")
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    flags = ("--served-model-name", "policy-7b", "--chat-template", str(template))
    with builtin_engine(model, *flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        (card,) = client.models.list().data
        assert card.id == "policy-7b" and card.root == "policy-7b"
        assert client.models.retrieve("policy-7b").id == "policy-7b"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.models.retrieve(str(model))
        info = requests.get(url + "/model_info", timeout=30).json()
        assert info["served_model_name"] == "policy-7b" and info["model_path"] == str(model)
        server = requests.get(url + "/server_info", timeout=30).json()
        assert server["served_model_name"] == "policy-7b"
        got = client.responses.create(model="policy-7b", input="ab", max_output_tokens=4)
        assert got.model == "policy-7b" and got.status in ("completed", "incomplete")
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.responses.create(model=str(model), input="ab", max_output_tokens=4)
    refused = subprocess.run(
        engine_command(model, "--port", "0", "--served-model-name", "base:adapter"),
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "served_model_name cannot contain a colon (':') character" in refused.stderr


@pytest.mark.timeout(60)
def test_greedy_completion_equals_generate_for_the_same_ids(engine: Engine, client) -> None:  # noqa: F811
    native = engine.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_new_tokens": 8},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        }
    )
    out = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == "default"
    assert choice.text == native["text"] and choice.finish_reason == "length"
    entries = native["meta_info"]["output_token_logprobs"]
    tokenizer = _tokenizer(engine)
    # [logprob, id, text]: the text of each token alone, special tokens kept (SGLang's
    # detokenize_logprob_tokens)
    assert [e[2] for e in entries] == [tokenizer.decode([e[1]]) for e in entries]
    assert choice.logprobs.tokens == [e[2] for e in entries]
    assert choice.logprobs.text_offset == [-1] * 8 and choice.logprobs.top_logprobs == []
    for got, want in zip(choice.logprobs.token_logprobs, entries, strict=True):
        assert math.isclose(got, want[0], abs_tol=1e-5)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 8)
    assert out.usage.total_tokens == 12
    assert out.model_extra["metadata"]["weight_version"] == native["meta_info"]["weight_version"]
    assert out.id and isinstance(out.created, int)


@pytest.mark.timeout(60)
def test_penalties_and_logit_bias_act_as_on_generate(engine: Engine, client) -> None:  # noqa: F811
    # serving_completions passes them on as sampling params (min_tokens as min_new_tokens)
    greedy = {**GREEDY, "max_new_tokens": 8}
    plain = engine.generate({"input_ids": PROMPT, "sampling_params": greedy})
    banned = plain["output_ids"][0]
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.4}
    native = engine.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {**GREEDY, "max_new_tokens": 8, "min_new_tokens": 3,
                                "logit_bias": {str(banned): -100}, **penalties},
            "return_logprob": True,
        }
    )  # fmt: skip
    out = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
        logit_bias={str(banned): -100}, frequency_penalty=1.5, presence_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.4, "min_tokens": 3,
                    "return_token_ids": True},
    )  # fmt: skip
    (choice,) = out.choices
    assert native["output_ids"][0] != banned and banned not in native["output_ids"]
    assert native["output_ids"] != plain["output_ids"]
    assert choice.model_extra["token_ids"] == native["output_ids"]
    for got, want in zip(
        choice.logprobs.token_logprobs, native["meta_info"]["output_token_logprobs"], strict=True
    ):
        assert math.isclose(got, want[0], abs_tol=1e-5)


@pytest.mark.timeout(60)
def test_logprobs_k_gives_the_k_most_likely_tokens_of_each_step(engine: Engine, client) -> None:  # noqa: F811
    out = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # greedy: the argmax was drawn (its log-prob summed in another order by the sampler)
        assert len(top) == 3 and math.isclose(max(top.values()), logprob, abs_tol=1e-6)
        assert math.isclose(top[token], logprob, abs_tol=1e-6)


@pytest.mark.timeout(60)
def test_text_prompts_n_echo_and_stop(engine: Engine, client) -> None:  # noqa: F811
    tokenizer = _tokenizer(engine)
    texts = [tokenizer.decode(PROMPT), tokenizer.decode([40, 41])]
    out = client.completions.create(
        model="default", prompt=texts, max_tokens=5, temperature=0, n=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(out.choices):  # prompt-major, each prompt's text in front
        assert choice.text.startswith(texts[i // 2]) and choice.logprobs is None
    assert out.choices[0].text == out.choices[1].text  # greedy: the same twice
    assert out.usage.prompt_tokens == 4 + 2 and out.usage.completion_tokens == 4 * 5
    free = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    words = free.text.split()
    stop = words[2] if len(words) > 3 else None
    if stop is None or free.text.count(stop) != 1:
        pytest.skip(f"no word of {free.text!r} stands once")
    stopped = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.model_extra["matched_stop"] == stop
    assert stopped.text == free.text[: free.text.find(stop)]
    # stop_regex (SGLang's extension, a native sampling parameter): the pattern is matched_stop
    pattern = rf"{re.escape(stop)}\s?"
    by_regex = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_regex": pattern},
    ).choices[0]  # fmt: skip
    assert by_regex.finish_reason == "stop" and by_regex.model_extra["matched_stop"] == pattern
    assert by_regex.text.rstrip().endswith(stop) and free.text.startswith(by_regex.text.rstrip())


@pytest.mark.timeout(60)
def test_what_sglang_refuses_or_the_engine_cannot_do_yet_is_a_400(engine: Engine, client) -> None:  # noqa: F811
    cases = [
        ({"prompt": []}, "Prompt cannot be empty"),
        ({"prompt": [[], []]}, "Prompt cannot be empty"),
        ({"prompt": PROMPT, "stream": "maybe"}, "stream"),
        ({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": PROMPT, "max_tokens": 8, "extra_body": {"min_tokens": 40}}, "min_tokens"),
        ({"prompt": PROMPT, "extra_body": {"stop_regex": "(a"}}, "stop_regex"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1, 999]}, "prompt[1]"),
        # what SGLang 0.5.23 honours (or refuses without its server flag) and this engine has
        # not: refused naming the field, on both routes, as /generate refuses it
        ({"prompt": PROMPT, "extra_body": {"return_hidden_states": True}}, "return_hidden_states"),
        ({"prompt": PROMPT, "extra_body": {"data_parallel_rank": 1}}, "data_parallel_rank"),
        # a session goes on to the sessions, which refuse one they do not hold in SGLang's words
        (
            {"prompt": PROMPT, "extra_body": {"session_params": {"id": "s"}}},
            "Invalid request: session id s does not exist",
        ),
    ]
    for body, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="default", **body)
        error = info.value.body
        assert words in error["message"], (body, error)
        assert error["object"] == "error" and error["code"] == 400
    neutral = {"return_hidden_states": False, "data_parallel_rank": 0, "session_params": None}
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=1, extra_body=neutral)
    # fields SGLang ignores are ignored; the engine serves on
    ok = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=2, user="me", extra_body={"bogus": 1}
    )
    assert ok.usage.completion_tokens <= 2
    request = urllib.request.Request(
        engine.url + "/v1/completions", b'{"prompt": [1]}', {"Content-Type": "text/plain"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
