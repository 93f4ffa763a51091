"""Held-out evaluation through the engines: batched requests, and the fallback for engines
that refuse them.

The batched evaluation runs against a real built-in engine (as the generator starts it) and
must give exactly the answers of one request per prompt. An engine that refuses a batched
``/generate`` (an SGLang-API server without batch support: a stand-in here, the built-in
engine and SGLang both take batches) gets one prompt per request from then on, said once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web

from stages.learner import evaluate as evaluate_module
from stages.learner.config import EvalConfig
from stages.learner.evaluate import Evaluator
from stages.light_tokenizer import transformers_tokenizer
from stages.scorer.stage import RewardSpec
from tests.stages.engine_setup import builtin_engine, free_port
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("eval") / "model", vocab=64, seed=3)


@pytest.fixture(scope="module")
def engine_url(model_dir: Path) -> Iterator[str]:
    with builtin_engine(model_dir, "--max-running", "16") as url:
        yield url


def _prompts(n: int, answers: list[str] | None = None) -> list[dict[str, Any]]:
    return [
        {
            "input_ids": [3 + i % 50, 4 + (7 * i) % 50, 5 + (3 * i) % 40],
            "meta": {"answer": answers[i] if answers else "w9"},
        }
        for i in range(n)
    ]


async def _evaluate(evaluator: Evaluator, urls: list[str], step: int = 0) -> dict[str, Any]:
    await evaluator.start()
    try:
        return await evaluator.evaluate(urls, step=step, version=0)
    finally:
        await evaluator.close()


def _config(**kw: Any) -> EvalConfig:
    return EvalConfig(
        rewards=[RewardSpec(fn="exact_match")], max_prompts=40, max_new_tokens=4, **kw
    )


def test_batched_evaluation_gives_the_answers_of_single_requests(
    model_dir: Path, engine_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = transformers_tokenizer(model_dir)  # as the engine reads it
    log = structlog.get_logger()
    # the answers as one request per prompt decodes them: half kept right, half made wrong
    single = Evaluator(_config(concurrency=8), _prompts(40), tokenizer, log)
    single.batched = False
    outputs: list[list[int]] = []
    real_arguments = evaluate_module.reward_arguments

    def remember(tokenizer: Any, prompts: Any, samples: Any) -> dict[str, list]:
        kwargs = real_arguments(tokenizer, prompts, samples)
        outputs.extend(kwargs["completion_ids"])
        return kwargs

    monkeypatch.setattr(evaluate_module, "reward_arguments", remember)
    asyncio.run(_evaluate(single, [engine_url]))
    monkeypatch.undo()
    texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    answers = [t if i % 2 == 0 else t + " w1" for i, t in enumerate(texts)]

    calls: list[int] = []
    real = evaluate_module._generate_batch

    async def counted(client: Any, prompts: Any, *args: Any) -> Any:
        calls.append(len(prompts))
        return await real(client, prompts, *args)

    monkeypatch.setattr(evaluate_module, "_generate_batch", counted)
    batched = Evaluator(_config(concurrency=16), _prompts(40, answers), tokenizer, log)
    result = asyncio.run(_evaluate(batched, [engine_url]))
    assert calls == [16, 16, 8]  # concurrency prompts a request, one engine
    assert result["batched"] is True and result["failed"] == 0
    assert result["accuracy"] == 0.5
    assert result["versions"] == [0]


@pytest.mark.parametrize("workers", [0, 1])
def test_answers_are_scored_in_the_event_loop_or_by_a_worker(
    model_dir: Path, engine_url: str, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    tokenizer = transformers_tokenizer(model_dir)
    children: list[int] = []
    real_arguments = evaluate_module.reward_arguments

    def remember(tokenizer: Any, prompts: Any, samples: Any) -> dict[str, list]:
        children.append(len(multiprocessing.active_children()))
        return real_arguments(tokenizer, prompts, samples)

    monkeypatch.setattr(evaluate_module, "reward_arguments", remember)
    config = _config(concurrency=40, workers=workers)
    evaluator = Evaluator(config, _prompts(40), tokenizer, structlog.get_logger())
    result = asyncio.run(_evaluate(evaluator, [engine_url]))
    assert result["failed"] == 0 and 0.0 <= result["accuracy"] <= 1.0
    # workers 0 (the default config's): no process started for built-in rewards
    assert children == [workers]
    assert multiprocessing.active_children() == []


async def _refusing_engine(seen: list[str], finish: str = "stop") -> web.AppRunner:
    """An SGLang-API engine without batch support: 400 for a list of input_ids."""

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        if isinstance(body["input_ids"][0], list):
            seen.append("batch")
            return web.json_response({"error": "input_ids: expected a list of ints"}, status=400)
        seen.append("single")
        return web.json_response(
            {
                "output_ids": [9, 1],
                "meta_info": {
                    "output_token_logprobs": [[-0.5, 9, None], [-0.1, 1, None]],
                    "finish_reason": {"type": finish},
                    "weight_version": "0",
                },
            }
        )

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


def test_an_engine_refusing_batches_gets_one_prompt_per_request(model_dir: Path) -> None:
    tokenizer = transformers_tokenizer(model_dir)  # as the engine reads it
    seen: list[str] = []

    async def scenario() -> tuple[dict, dict, list[dict]]:
        runner = await _refusing_engine(seen)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        evaluator = Evaluator(
            _config(concurrency=4), _prompts(10), tokenizer, structlog.get_logger()
        )
        await evaluator.start()
        try:
            with structlog.testing.capture_logs() as logs:
                first = await evaluator.evaluate([url], step=0, version=0)
                second = await evaluator.evaluate([url], step=5, version=0)
        finally:
            await evaluator.close()
            await runner.cleanup()
        return first, second, logs

    first, second, logs = asyncio.run(scenario())
    assert seen.count("batch") == 1  # refused once; never asked again
    assert seen.count("single") == 20
    assert first["accuracy"] == second["accuracy"] == 1.0  # "w9" every time
    assert first["failed"] == 0 and first["batched"] is False
    refusals = [e for e in logs if e["event"] == "eval_batches_refused"]
    assert len(refusals) == 1 and "400" in refusals[0]["error"]


def stopped(completions: list[str], finish_reason: list[str], **kw: Any) -> list[float]:
    """A reward of 1 for a completion that ended on its own (not at the token limit)."""
    return [float(r == "stop") for r in finish_reason]


@pytest.mark.parametrize("finish, accuracy", [("stop", 1.0), ("length", 0.0)])
def test_reward_functions_get_each_answers_finish_reason(
    model_dir: Path, finish: str, accuracy: float
) -> None:
    tokenizer = transformers_tokenizer(model_dir)  # as the engine reads it
    config = EvalConfig(
        rewards=[RewardSpec(fn=f"{__name__}:stopped")], max_prompts=4, max_new_tokens=4
    )

    async def scenario() -> dict:
        runner = await _refusing_engine([], finish)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        evaluator = Evaluator(config, _prompts(4), tokenizer, structlog.get_logger())
        try:
            return await _evaluate(evaluator, [f"http://127.0.0.1:{port}"])
        finally:
            await runner.cleanup()

    result = asyncio.wait_for(scenario(), 60)
    assert asyncio.run(result)["accuracy"] == accuracy


class Echo:
    """A test environment: the answer is correct when the model's turn decodes to the
    prompt's ``meta["answer"]``; two turns at most, ``w7`` between them; reward 1 on a match."""

    def reset(self, prompt: dict[str, Any]) -> str:
        self.answer, self.turns = prompt["meta"]["answer"], 0
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.turns += 1
        solved = action.strip() == self.answer
        return "w7", float(solved), solved or self.turns >= 2, {"solved": solved}


def test_held_out_prompts_are_played_as_greedy_episodes_of_the_rollout(
    model_dir: Path, engine_url: str
) -> None:
    """With eval.rollout, each prompt is one greedy episode: the first turn's greedy answer
    decides it (a repeat of it on the second turn cannot change the verdict), and the result
    says how many turns were played and how many were solved."""
    from stages.rollouts.api import RolloutConfig

    tokenizer = transformers_tokenizer(model_dir)  # as the engine reads it
    log = structlog.get_logger()
    n = 12
    # the prompts' greedy first answers: half of them are made the answer to find
    answers = _greedy_answers(engine_url, _prompts(n), tokenizer)
    chosen = [a if i % 2 == 0 else "w63 w62 w61 w60" for i, a in enumerate(answers)]
    rollout = RolloutConfig(
        use="environment",
        environment="tests.stages.test_learner_evaluate:Echo",
        tokenizer=str(model_dir),
        max_turns=4,
    )
    config = EvalConfig(
        rewards=[RewardSpec(fn="env_reward")], max_prompts=n, max_new_tokens=4, rollout=rollout
    )
    evaluator = Evaluator(config, _prompts(n, chosen), tokenizer, log, model=str(model_dir))
    result = asyncio.run(_evaluate(evaluator, [engine_url]))
    assert result["failed"] == 0 and result["prompts"] == n
    assert result["accuracy"] == pytest.approx(0.5) and result["solved"] == pytest.approx(0.5)
    # solved ones end after one turn; the others play their second (last) turn
    assert result["turns_mean"] == pytest.approx(1.5)
    assert result["finish_reasons"] == {"done": n} and result["tool_use"] == 0.0


def _greedy_answers(url: str, prompts: list[dict[str, Any]], tokenizer: Any) -> list[str]:
    import json

    answers = []
    for i, p in enumerate(prompts):
        body = json.dumps(
            {
                "input_ids": p["input_ids"],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
                "return_logprob": True,
                "rid": f"probe/{i}",
            }
        ).encode()
        request = urllib.request.Request(
            url + "/generate", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            ids = json.loads(resp.read())["output_ids"]
        answers.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
    return answers


def test_held_out_prompts_are_spread_over_the_eval_split() -> None:
    from stages.learner.evaluate import spread

    assert spread(list(range(10)), 20) == list(range(10))
    assert spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert spread(list(range(1000)), 3) == [0, 333, 666]
    picked = spread(list(range(7)), 3)
    assert len(picked) == len(set(picked)) == 3 and picked[0] == 0
