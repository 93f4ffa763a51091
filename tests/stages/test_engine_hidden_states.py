"""``return_hidden_states`` on the built-in engine, as SGLang 0.5.23 returns them: the final
(normed) hidden states, the LM head's input, held to transformers' own ``hidden_states[-1]``.

SGLang's source: ``managers/schedule_batch.py`` (``get_return_hidden_states_mode``: true is
``full``, ``"last"`` the newest only), ``scheduler_components/batch_result_processor.py``
(``_append_prefill_hidden_states``: a prefill's block, every position it computed;
``_append_decode_hidden_states``: one a decode step, or in place of the last),
``output_streamer.py`` (a stream's chunks carry them so far), ``tokenizer_manager.py``
(``_validate_one_request``: refused beyond ``--return-hidden-states-mode``; ``meta_info``) and
``entrypoints/openai/utils.py`` (``process_hidden_states_for_response``: a choice's newest).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch

from stages.engine.protocol import GenerateInput, RequestError, SamplingParams, parse_generate
from stages.engine.scheduler import Scheduler
from tests.stages.engine_setup import (
    builtin_engine,
    load_reference,
    pass_through_template,
    run_with_retraction,
)
from tests.stages.tiny_model import make_tiny_model

PROMPT = [5, 17, 33, 8, 50, 41, 7]
NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=3)


@pytest.fixture(scope="module")
def reference(model: Path) -> torch.nn.Module:
    return load_reference(model)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    template = pass_through_template(model.parent)
    # SGLang's older flag alone: full (the named mode is tested with it below)
    with builtin_engine(
        model, "--enable-return-hidden-states", "--chat-template", str(template)
    ) as engine:
        yield engine


@torch.no_grad()
def _final_hidden(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state of every position of ``ids`` ``[len, hidden]``."""
    return reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _check_full(hidden: list[Any], reference: torch.nn.Module, output: list[int]) -> None:
    """SGLang's ``full`` layout: the prefill's block (every prompt position), then one vector
    a decode step (the state each later token was drawn from), all as transformers has them."""
    want = _final_hidden(reference, PROMPT + output[:-1])
    block, steps = hidden[0], hidden[1:]
    assert len(block) == len(PROMPT) and len(steps) == len(output) - 1
    assert torch.allclose(torch.tensor(block), want[: len(PROMPT)], atol=TOL)
    assert torch.allclose(torch.tensor(steps), want[len(PROMPT) :], atol=TOL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False], ids=["fast-forward", "transformers-forward"])
def test_both_forward_paths_return_transformers_hidden_states(
    model: Path, reference: torch.nn.Module, fast: bool
) -> None:
    """Both of the scheduler's passes, its own and ``model(...)``, in both modes, on rows of
    different prompts and lengths: the short ones finish first, and the rows left move to
    other slots, each still getting its own states."""
    scheduler = Scheduler(
        load_reference(model), max_running=8, hidden_states_mode="full", fast_forward=fast
    )
    prompts = [PROMPT, [9, 3, 60], [22, 23, 24, 25, 26], [40, 2]]
    lengths = [NEW, 2, 9, 4]
    futures = []
    for k, (prompt, new) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        for mode in ("full", "last", None):
            inp = GenerateInput(f"r{k}{mode}", prompt, params, False, hidden_states=mode)
            futures.append((prompt, mode, scheduler.submit(inp)))
    scheduler.run_until_idle()
    for prompt, mode, future in futures:
        result = future.result(timeout=0)
        want = _final_hidden(reference, prompt + result.output_ids[:-1])
        if mode is None:
            assert "hidden_states" not in result.extra
        elif mode == "last":  # the state the last token was drawn from
            assert torch.allclose(torch.tensor(result.extra["hidden_states"]), want[-1], atol=TOL)
        else:  # the prompt's block, then a vector a decode step
            block, *steps = result.extra["hidden_states"]
            assert len(block) == len(prompt) and len(steps) == len(result.output_ids) - 1
            assert torch.allclose(torch.tensor(block), want[: len(prompt)], atol=TOL)
            assert torch.allclose(torch.tensor(steps), want[len(prompt) :], atol=TOL)


@pytest.mark.timeout(60)
def test_a_retracted_sample_gets_a_block_for_its_second_prefill(
    model: Path, reference: torch.nn.Module
) -> None:
    """SGLang keeps a retracted request's hidden states and appends its re-prefill's block
    (``reset_for_retract`` leaves them): every vector is still the state at its position."""
    scheduler = Scheduler(load_reference(model), max_running=4, hidden_states_mode="full")
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    future = scheduler.submit(GenerateInput("r", PROMPT, params, False, hidden_states="full"))
    run_with_retraction(scheduler, 3, True)
    result = future.result(timeout=0)
    assert result.retractions == 1
    want = _final_hidden(reference, PROMPT + result.output_ids[:-1])
    items = result.extra["hidden_states"]
    assert sum(isinstance(item[0], list) for item in items) == 2  # the prompt's, the re-prefill's
    position = 0  # the next position whose state comes
    for item in items:
        rows = item if isinstance(item[0], list) else [item]
        if rows is item and position:  # the re-prefill's block: the last positions it computed,
            position += 1 - len(rows)  # up to the one of the last token sampled before
        assert torch.allclose(torch.tensor(rows), want[position : position + len(rows)], atol=TOL)
        position += len(rows)
    assert position == len(want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cached", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_samples_of_one_prompt_get_what_sglangs_parallel_sampling_gives(
    model: Path, reference: torch.nn.Module, cached: bool
) -> None:
    """With a prefix cache, SGLang's warm-up request caches the prompt of ``n`` > 1 samples
    and each computes its last position alone; without one (``--disable-radix-cache``),
    each computes the whole prompt."""
    scheduler = Scheduler(
        load_reference(model),
        max_running=4,
        hidden_states_mode="full",
        prefix_cache_tokens=32768 if cached else 0,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    futures = [
        scheduler.submit(GenerateInput(f"s{k}", PROMPT, params, False, hidden_states="full",
                                       parallel=True))
        for k in range(2)
    ]  # fmt: skip
    scheduler.run_until_idle()
    want = _final_hidden(reference, PROMPT)
    for future in futures:
        block = torch.tensor(future.result(timeout=0).extra["hidden_states"][0])
        assert torch.allclose(block, want[-1:] if cached else want, atol=TOL)


# SGLang 0.5.23's JSON contract gate on "last" (api_types.decode_BoolOrList)
GATE_LAST = 'invalid type: string "last", expected a value or an array of values for BoolOrList'


@pytest.mark.timeout(60)
def test_generate_answers_them_in_meta_info(url: str, reference: torch.nn.Module) -> None:
    requests.post(url + "/flush_cache", timeout=30)  # the whole prompt computed: its block
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_hidden_states": True}
    out = requests.post(url + "/generate", json=body, timeout=60).json()
    _check_full(out["meta_info"]["hidden_states"], reference, out["output_ids"])
    # "last" (the state the last token was drawn from, a vector): GenerateReqInput takes it,
    # SGLang 0.5.23's JSON contract gate (a BoolOrList) refuses it on /generate; the /v1
    # routes ask for it past the gate
    last = {**body, "return_hidden_states": "last"}
    refused = requests.post(url + "/generate", json=last, timeout=60)
    assert refused.status_code == 400 and refused.json() == {"error": GATE_LAST}
    completion = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                  "return_hidden_states": "last", "return_token_ids": True}  # fmt: skip
    (choice,) = requests.post(url + "/v1/completions", json=completion, timeout=60).json()[
        "choices"
    ]
    want = _final_hidden(reference, PROMPT + choice["token_ids"][:-1])[-1]
    assert torch.allclose(torch.tensor(choice["hidden_states"]), want, atol=TOL)
    # a cached prompt is not computed again: its block holds what this prefill computed
    again = requests.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    assert again["cached_tokens"] > 0
    assert len(again["hidden_states"][0]) == len(PROMPT) - again["cached_tokens"]
    # a batch says it per prompt; false, or absent, returns none
    batch = {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": GREEDY}
    outs = requests.post(
        url + "/generate", json={**batch, "return_hidden_states": [False, True]}, timeout=60
    ).json()
    assert "hidden_states" not in outs[0]["meta_info"]
    steps = outs[1]["meta_info"]["hidden_states"][1:]  # after the prompt's block
    want = _final_hidden(reference, PROMPT[:4] + outs[1]["output_ids"][:-1])[-1]
    assert torch.allclose(torch.tensor(steps[-1]), want, atol=TOL)
    # n > 1: SGLang prefills the prompt in a warm-up request, so each sample's own prefill
    # computes its last position alone (TokenizerManager, parallel sampling)
    requests.post(url + "/flush_cache", timeout=30)
    samples = requests.post(
        url + "/generate",
        json={**body, "sampling_params": {**GREEDY, "n": 2}},
        timeout=60,
    ).json()
    prompt_states = _final_hidden(reference, PROMPT)
    for sample in samples:
        block = sample["meta_info"]["hidden_states"][0]
        assert len(block) == 1
        assert torch.allclose(torch.tensor(block[0]), prompt_states[-1], atol=TOL)
    # prefill-only (max_new_tokens 0): the states of the prompt's uncached rest, no token
    # drawn (SGLang's radix cache serves a prefill-only request as any other: all but the
    # last token of the prompt the samples above left, Req._compute_max_prefix_len)
    prefill_only = {**body, "sampling_params": {**GREEDY, "max_new_tokens": 0}}
    scored = requests.post(url + "/generate", json=prefill_only, timeout=60).json()
    assert scored["output_ids"] == []
    assert scored["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    (block,) = scored["meta_info"]["hidden_states"]
    assert torch.allclose(torch.tensor(block), prompt_states[-1:], atol=TOL)
    requests.post(url + "/flush_cache", timeout=30)  # nothing cached: the whole prompt's
    scored = requests.post(url + "/generate", json=prefill_only, timeout=60).json()["meta_info"]
    assert scored["cached_tokens"] == 0
    assert torch.allclose(torch.tensor(scored["hidden_states"][0]), prompt_states, atol=TOL)


@pytest.mark.timeout(60)
def test_a_stream_carries_them_so_far_in_every_chunk(url: str, reference: torch.nn.Module) -> None:
    requests.post(url + "/flush_cache", timeout=30)
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_hidden_states": True}
    chunks = []
    slowed = requests.post(url + "/slow_down", json={"forward_sleep_time": 0.03}, timeout=30)
    assert slowed.status_code == 200  # a chunk a step
    try:
        with requests.post(url + "/generate", json={**body, "stream": True}, stream=True) as r:
            for line in r.iter_lines():
                if line and line != b"data: [DONE]":
                    chunks.append(json.loads(line.removeprefix(b"data: ")))
    finally:
        requests.post(url + "/slow_down", json={"forward_sleep_time": None}, timeout=30)
    assert len(chunks) > 2
    for chunk in chunks:  # the block, then a vector a token after the first
        hidden = chunk["meta_info"]["hidden_states"]
        assert len(hidden) == len(chunk["output_ids"])
        assert len(hidden[0]) == len(PROMPT)
    _check_full(chunks[-1]["meta_info"]["hidden_states"], reference, chunks[-1]["output_ids"])
    # "last": refused before anything is sent, as SGLang 0.5.23's contract gate refuses it
    last = {**body, "stream": True, "return_hidden_states": "last"}
    refused = requests.post(url + "/generate", json=last, timeout=60)
    assert refused.status_code == 400 and refused.json() == {"error": GATE_LAST}


@pytest.mark.timeout(60)
def test_the_openai_routes_give_each_choice_its_newest(
    url: str, reference: torch.nn.Module
) -> None:
    """``process_hidden_states_for_response``: a choice's ``hidden_states`` is its newest
    vector; streamed, a chunk of its own after the choices' last, before the usage."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    extra = {"return_hidden_states": True}
    done = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body=extra
    )
    choice = done.choices[0].model_dump()
    ids = requests.post(
        url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=60
    ).json()["output_ids"]
    want = _final_hidden(reference, PROMPT + ids[:-1])[-1]
    assert torch.allclose(torch.tensor(choice["hidden_states"]), want, atol=TOL)
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=NEW,
        temperature=0,
        extra_body={"return_hidden_states": "last"},
    )
    assert len(chat.choices[0].model_dump()["hidden_states"]) == reference.config.hidden_size
    with pytest.raises(openai.BadRequestError, match=r"return_hidden_states\.bool: Input should"):
        client.completions.create(  # a list, as /generate takes per prompt: SGLang's 400
            model="default", prompt=PROMPT, max_tokens=2, extra_body={"return_hidden_states": [1]}
        )
    one = client.completions.create(  # one token: only the prompt's block, so [] (SGLang's)
        model="default", prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra
    )
    assert one.choices[0].model_dump()["hidden_states"] == []
    for route, body in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
    ):
        asked = {"model": "default", "max_tokens": NEW, "temperature": 0, "n": 2, "stream": True}
        asked.update(return_hidden_states=True, stream_options={"include_usage": True})
        stream = requests.post(f"{url}/v1/{route}", json={**body, **asked}, timeout=60)
        events = [
            json.loads(line.removeprefix(b"data: "))
            for line in stream.iter_lines()
            if line and line != b"data: [DONE]"
        ]
        *rest, usage = events
        assert usage["usage"] is not None and not usage["choices"]
        tail = rest[-2:]  # one a choice, after every content and finish chunk
        assert sorted(e["choices"][0]["index"] for e in tail) == [0, 1]
        for event in tail:  # as SGLang's pydantic stream responses write them
            choice = event["choices"][0]
            assert event["usage"] is None and choice["finish_reason"] is None
            if route.startswith("chat"):
                carried = choice["delta"]
                assert carried["role"] is None and carried["content"] is None
            else:
                carried = choice
                assert choice["text"] == "" and choice["logprobs"] is None
            assert len(carried["hidden_states"]) == reference.config.hidden_size
        assert not any("hidden_states" in json.dumps(e) for e in rest[:-2])
        if route == "completions":  # greedy: both choices end in the same state
            want_last = torch.tensor(tail[0]["choices"][0]["hidden_states"])
            assert torch.allclose(want_last, want, atol=TOL)


@pytest.mark.timeout(60)
def test_what_the_server_does_not_return_is_refused_in_sglangs_words(model: Path) -> None:
    # a mode named wins over the older flag (its full), as SGLang's
    flags = ("--return-hidden-states-mode", "last", "--enable-return-hidden-states")
    with builtin_engine(model, *flags) as url:
        info = requests.get(url + "/server_info", timeout=30).json()
        assert info["return_hidden_states_mode"] == "last"
        assert info["enable_return_hidden_states"] is True  # as SGLang resolves them
        body = {"input_ids": PROMPT, "sampling_params": GREEDY}
        # "last" reaches it through the /v1 routes only (/generate's contract gate refuses it)
        completion = {"prompt": PROMPT, "max_tokens": 2, "return_hidden_states": "last"}
        ok = requests.post(url + "/v1/completions", json=completion, timeout=60)
        assert ok.status_code == 200 and "hidden_states" in ok.json()["choices"][0]
        refused = requests.post(url + "/generate", json={**body, "return_hidden_states": True})
        assert refused.status_code == 400
        assert "exceeds the server maximum `last`" in refused.text
        # the engine serves on
        assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200


def test_a_request_without_the_servers_flag_or_with_another_value_is_refused() -> None:
    def parse(value: Any, cap: str | None) -> list[str | None]:
        body = {"input_ids": [PROMPT, PROMPT], "return_hidden_states": value}
        inputs, _ = parse_generate(
            body, vocab_size=64, context_length=512, encode=None, hidden_cap=cap
        )
        return [inp.hidden_states for inp in inputs]

    assert parse(True, "full") == ["full", "full"]
    assert parse([False, "last"], "last") == [None, "last"]
    assert parse(False, None) == [None, None]
    with pytest.raises(RequestError, match="not configured to return hidden states"):
        parse("last", None)
    with pytest.raises(RequestError, match="a boolean or the string literal 'last'"):
        parse("full", "full")
    with pytest.raises(RequestError, match="equal to the batch size"):
        parse([True], "full")
