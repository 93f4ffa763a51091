"""Prompts given as embeddings (``/generate``'s ``input_embeds``) on an engine without the prefix
cache, as SGLang 0.5.23 serves them with ``--disable-radix-cache``
(``GenerateReqInput._determine_batch_size``, ``TokenizerManager._tokenize_one_request``,
``Scheduler.handle_generate_request``: stand-in ids of token 1). The embeddings of a prompt's
ids must generate what the ids generate, on both forward paths; other embeddings are held to a
transformers forward given them as ``inputs_embeds``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import load_reference, run_with_retraction
from tests.stages.test_engine_server import GREEDY, Engine, serving
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

PROMPT = [5, 17, 33, 8, 90]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("embeds") / "model", vocab=128, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return load_reference(model_dir)


@pytest.fixture(scope="module", params=["fast", "transformers"])
def engine(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("embeds-log") / "engine.log"
    with serving(model_dir, log, "--disable-radix-cache", "--forward", request.param) as eng:
        yield eng


def _rows(model: torch.nn.Module, ids: list[int]) -> list[list[float]]:
    """The model's embedding rows of ``ids``, as JSON would carry them."""
    return model.get_input_embeddings().weight[ids].detach().float().tolist()


def _refused(engine: Engine) -> int:
    return sum(engine.request("GET", "/server_info")[1]["refused_requests"].values())


@pytest.mark.timeout(120)
def test_the_embeddings_of_ids_generate_what_the_ids_generate(
    engine: Engine, reference: torch.nn.Module
) -> None:
    params = {**GREEDY, "max_new_tokens": 12}
    plain = engine.generate(
        {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True}
    )
    body = {"input_embeds": _rows(reference, PROMPT), "sampling_params": params}
    got = engine.generate({**body, "return_logprob": True, "return_prompt_token_ids": True})
    assert got["output_ids"] == plain["output_ids"]
    meta = got["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    assert got["prompt_token_ids"] == [1] * len(PROMPT)  # SGLang's stand-ins
    mine = [lp for lp, _, _ in meta["output_token_logprobs"]]
    theirs = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) < 1e-5

    # a batch of two (one of them the ids' embeddings) with n = 2: each sample as alone
    other = [[0.01 * (i + j) - 0.05 for j in range(len(body["input_embeds"][0]))] for i in range(3)]
    batch = engine.generate(
        {"input_embeds": [body["input_embeds"], other], "sampling_params": {**params, "n": 2}}
    )
    assert len(batch) == 4
    assert batch[0]["output_ids"] == batch[1]["output_ids"] == plain["output_ids"]
    alone = engine.generate({"input_embeds": other, "sampling_params": params})
    assert batch[2]["output_ids"] == batch[3]["output_ids"] == alone["output_ids"]
    assert batch[2]["meta_info"]["prompt_tokens"] == 3

    # streamed: the last chunk is the whole answer
    response = requests.post(engine.url + "/generate", json={**body, "stream": True}, timeout=30)
    events = [
        json.loads(line[6:]) for line in response.iter_lines() if line and line != b"data: [DONE]"
    ]
    assert events and events[-1]["output_ids"] == plain["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


@pytest.mark.timeout(120)
def test_other_embeddings_score_and_generate_as_transformers_runs_them(
    engine: Engine, reference: torch.nn.Module
) -> None:
    """Rows that are no token's embedding: the prompt's log-probs (of the stand-in id 1, as
    SGLang reports them) and the greedy tokens, against ``model(inputs_embeds=...)``."""
    gen = torch.Generator().manual_seed(3)
    width = reference.get_input_embeddings().embedding_dim
    rows = (torch.randn(6, width, generator=gen) * 0.1).tolist()
    scored = engine.generate(
        {
            "input_embeds": rows,
            "sampling_params": {**GREEDY, "max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )
    assert scored["output_ids"] == []
    entries = scored["meta_info"]["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == [1] * 6 and entries[0][0] is None
    with torch.no_grad():
        embeds = torch.tensor([rows])
        logits = reference(inputs_embeds=embeds).logits[0]
        expected = torch.log_softmax(logits.float(), -1)[:-1, 1].tolist()
    terms = forward_terms(reference.config, len(rows))  # the float rule of such a forward
    assert_close([lp for lp, _, _ in entries[1:]], expected, terms=terms)

    out = engine.generate(
        {"input_embeds": rows, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    )
    with torch.no_grad():
        tokens: list[int] = []
        for _ in range(6):
            so_far = reference.get_input_embeddings()(torch.tensor([tokens], dtype=torch.long))
            step = torch.cat((embeds, so_far), 1)
            tokens.append(int(reference(inputs_embeds=step).logits[0, -1].argmax()))
    assert out["output_ids"] == tokens


@pytest.mark.timeout(120)
def test_bad_embeddings_are_refused_naming_the_row_and_the_engine_serves_on(
    engine: Engine, reference: torch.nn.Module
) -> None:
    width = reference.get_input_embeddings().embedding_dim
    row = [0.0] * width
    params = {"max_new_tokens": 2}
    cases: list[tuple[Any, str]] = [
        (
            [row, row[:-1]],
            f"input_embeds[1]: expected a row of {width} numbers (the model's embedding width), "
            f"got {width - 1} values",
        ),
        (
            [[row], [row, [0.0] * (width + 1)]],
            f"input_embeds[1][1]: expected a row of {width} numbers (the model's embedding "
            f"width), got {width + 1} values",
        ),
        ([[]], "input_embeds[0]: expected a non-empty list"),
        (
            [row] * 4000,
            "input_embeds: The input (4000 tokens) is longer than the model's context length",
        ),
    ]
    before = _refused(engine)
    for embeds, message in cases:
        status, answer = engine.request(
            "POST", "/generate", {"input_embeds": embeds, "sampling_params": params}
        )
        assert status == 400, (embeds[:1], answer)
        assert answer["error"]["message"].startswith(message), answer
    # a value that is not finite (JSON's NaN, which FastAPI's parser takes)
    raw = json.dumps({"input_embeds": [row, [*row[:-1], float("nan")]], "sampling_params": params})
    status, answer = engine.request("POST", "/generate", raw=raw.encode())
    assert status == 400
    assert (
        answer["error"]["message"]
        == f"input_embeds[1][{width - 1}]: expected a finite number, got nan"
    )
    # a session continues ids, not embeddings
    status, answer = engine.request(
        "POST", "/generate", {"input_embeds": [row], "session_params": {"id": "s"}}
    )
    assert status == 400
    assert "a session request gives one prompt, as ids or text" in answer["error"]["message"]
    assert _refused(engine) == before + len(cases) + 2
    assert (
        engine.generate({"input_embeds": [row], "sampling_params": params})["meta_info"][
            "prompt_tokens"
        ]
        == 1
    )


@pytest.mark.timeout(60)
def test_a_retracted_embeddings_prompt_goes_on_where_it_was(reference: torch.nn.Module) -> None:
    """A retraction recomputes the prompt's rows and then the tokens already generated: the
    sample ends as it would have without (SGLang 0.5.23 throws those tokens away instead)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    rows = reference.get_input_embeddings().weight[PROMPT].detach().float().clone()
    outputs = []
    for retract in (False, True):
        scheduler = Scheduler(reference, max_running=4, prefix_cache_tokens=0)
        future = scheduler.submit(
            GenerateInput("e", [1] * len(PROMPT), params, True, input_embeds=rows)
        )
        plain = scheduler.submit(GenerateInput("p", PROMPT, params, True))
        run_with_retraction(scheduler, 5, retract)
        result = future.result(timeout=0)
        assert result.output_ids == plain.result(timeout=0).output_ids
        outputs.append(result.output_ids)
    assert outputs[0] == outputs[1]
