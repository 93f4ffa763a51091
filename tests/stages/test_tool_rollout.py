"""The ``tools`` rollout against a scripted engine: turns, inserted answers (mask 0, log-prob
0, version -1), budgets, malformed calls answered as text, max_turns."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from stages.rollouts.api import RolloutConfig, RolloutContext
from stages.rollouts.tool_rollout import tool_rollout
from stages.rollouts.tools import ToolBox
from stages.rollouts.trajectory import Generation
from tests.stages.tool_tokenizers import calc_tokenizer, chat_tokenizer, plain_tokenizer

pytestmark = pytest.mark.timeout(60)  # each test starts tool worker processes

TOOLS = ["tests.stages.test_tools:calc", "tests.stages.test_tools:add"]
SAMPLING = {"max_new_tokens": 200, "stop_token_ids": [1], "temperature": 1.0}


class ScriptedEngine:
    """Answers turn ``k`` with ``script[k]`` (text), as an engine would: up to the first stop
    token id, at most ``max_new_tokens``; log-prob ``-(k + 1) / 10``, version ``10 + k``."""

    def __init__(self, tokenizer: Any, script: Sequence[str]) -> None:
        self.tokenizer, self.script = tokenizer, list(script)
        self.requests: list[tuple[list[int], dict[str, Any]]] = []

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Generation:
        k = len(self.requests)
        self.requests.append((list(input_ids), sampling))
        ids = self.tokenizer.encode(self.script[k], add_special_tokens=False)
        finish = "stop"
        stops = set(sampling.get("stop_token_ids", SAMPLING["stop_token_ids"]))
        ends = [i for i, t in enumerate(ids) if t in stops]
        if ends:
            ids = ids[: ends[0] + 1]
        limit = sampling.get("max_new_tokens", SAMPLING["max_new_tokens"])
        if len(ids) > limit:
            ids, finish = ids[:limit], "length"
        return Generation(ids, np.full(len(ids), -(k + 1) / 10), np.full(len(ids), 10 + k), finish)


@asynccontextmanager
async def _context(tokenizer: Any, **config: Any):
    rollout = RolloutConfig(**{"use": "tools", "tools": TOOLS, "tool_format": "tags", **config})
    box = await ToolBox.start(rollout, tokenizer)
    try:
        yield RolloutContext(rollout, tokenizer=tokenizer, tools=box, sampling=SAMPLING)
    finally:
        await box.aclose()


def _prompt(tokenizer: Any, text: str) -> dict[str, Any]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"prompt_id": "p1", "input_ids": ids, "meta": {"text": text}}


def _text(tokenizer: Any, ids: Any) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


async def test_a_calculator_episode_has_sampled_and_inserted_tokens_laid_out_right():
    tok = calc_tokenizer()
    engine = ScriptedEngine(tok, ["<tool_call>calc(123*456)</tool_call>999", "56088<eos>"])
    async with _context(tok) as ctx:
        prompt = _prompt(tok, "123*456=")
        trajectory = await tool_rollout(prompt, engine, ctx)
    assert trajectory.prompt_ids.tolist() == prompt["input_ids"]  # tags: the prompt unchanged
    call, answer, final = 15, 7, 6  # tokens of each part (the tags are single tokens)
    assert _text(tok, trajectory.completion_ids) == (
        "<tool_call>calc(123*456)</tool_call><tool_response>56088</tool_response>56088<eos>"
    )
    assert trajectory.loss_mask.tolist() == [1] * call + [0] * answer + [1] * final
    assert trajectory.logprobs.tolist() == pytest.approx(
        [-0.1] * call + [0.0] * answer + [-0.2] * final
    )
    assert trajectory.versions.tolist() == [10] * call + [-1] * answer + [11] * final
    assert trajectory.finish_reason == "stop" and trajectory.turns == 2
    assert trajectory.info == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": False}
    assert ctx.counters == {"tool_calls": 1}
    assert _text(tok, trajectory.last_sampled()) == "56088<eos>"
    # the second turn continues from the whole context; the call end is a stop token
    (first_ids, first), (second_ids, _) = engine.requests
    assert first_ids == prompt["input_ids"]
    assert second_ids == prompt["input_ids"] + trajectory.completion_ids[: call + answer].tolist()
    end = tok.convert_tokens_to_ids("</tool_call>")
    assert first == {"stop_token_ids": sorted([1, end])}


async def test_a_malformed_call_is_answered_as_text_and_the_episode_goes_on():
    tok = plain_tokenizer()  # </tool_call> is many tokens here: generation runs past it
    engine = ScriptedEngine(
        tok,
        ["<tool_call>calc 2*3</tool_call>ignored", "<tool_call>mul(2*3)</tool_call>", "6<eos>"],
    )
    async with _context(tok) as ctx:
        trajectory = await tool_rollout(_prompt(tok, "2*3="), engine, ctx)
    assert _text(tok, trajectory.completion_ids) == (
        "<tool_call>calc 2*3</tool_call>"
        "<tool_response>error: malformed tool call: cannot read 'calc 2*3'; write "
        "<tool_call>NAME(ARGS)</tool_call></tool_response>"
        "<tool_call>mul(2*3)</tool_call>"
        "<tool_response>error: unknown tool 'mul'; tools: calc, add</tool_response>"
        "6<eos>"
    )
    assert trajectory.finish_reason == "stop" and trajectory.turns == 3
    assert trajectory.info == {"turns": 3, "tool_calls": 2, "tool_errors": 2, "truncated": False}
    assert ctx.counters == {
        "tool_calls": 2,
        "tool_errors_malformed": 1,
        "tool_errors_unknown_tool": 1,
    }
    assert engine.requests[0][1] == {}  # no one-token call end: nothing added to stop at
    sampled = "<tool_call>calc 2*3</tool_call><tool_call>mul(2*3)</tool_call>6<eos>"
    assert int(trajectory.loss_mask.sum()) == trajectory.sampled_tokens == len(sampled) - 4


async def test_max_turns_ends_an_episode_that_keeps_calling():
    tok = calc_tokenizer()
    engine = ScriptedEngine(tok, ["<tool_call>calc(2*3)</tool_call>"] * 3)
    async with _context(tok, max_turns=2) as ctx:
        trajectory = await tool_rollout(_prompt(tok, "2*3="), engine, ctx)
    assert trajectory.finish_reason == "max_turns" and trajectory.turns == 2
    assert len(engine.requests) == 2
    assert trajectory.info["tool_calls"] == 1  # the last turn's call is not run
    assert ctx.counters == {"tool_calls": 1, "episodes_max_turns": 1}
    assert trajectory.loss_mask.tolist()[-1] == 1  # it ends with the model's turn


async def test_an_answer_over_the_token_budget_is_cut_and_ends_the_episode():
    tok = calc_tokenizer()
    engine = ScriptedEngine(tok, ["<tool_call>calc(123*456)</tool_call>", "56088<eos>"])
    async with _context(tok, max_tokens=18) as ctx:
        trajectory = await tool_rollout(_prompt(tok, "123*456="), engine, ctx)
    assert engine.requests[0][1]["max_new_tokens"] == 18
    assert trajectory.length == 18 and trajectory.finish_reason == "max_tokens"
    assert _text(tok, trajectory.completion_ids[15:]) == "<tool_response>56"
    assert trajectory.loss_mask.tolist() == [1] * 15 + [0] * 3
    assert trajectory.info["truncated"] is True and len(engine.requests) == 1
    assert ctx.counters["episodes_truncated"] == 1


async def test_the_last_turn_gets_what_is_left_of_the_budget():
    tok = calc_tokenizer()
    engine = ScriptedEngine(tok, ["<tool_call>calc(123*456)</tool_call>", "56088<eos>"])
    async with _context(tok, max_tokens=25) as ctx:
        trajectory = await tool_rollout(_prompt(tok, "123*456="), engine, ctx)
    assert [r[1]["max_new_tokens"] for r in engine.requests] == [25, 3]
    assert trajectory.length == 25 and trajectory.finish_reason == "max_tokens"
    assert _text(tok, trajectory.last_sampled()) == "560"
    assert trajectory.info == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": True}


async def test_a_turn_that_hits_max_new_tokens_ends_the_episode_with_length():
    tok = calc_tokenizer()
    engine = ScriptedEngine(tok, ["<tool_call>calc(" + "1*" * 120 + "1)</tool_call>"])
    async with _context(tok) as ctx:
        trajectory = await tool_rollout(_prompt(tok, "1="), engine, ctx)
    assert trajectory.finish_reason == "length" and trajectory.length == 200
    assert trajectory.info == {"turns": 1, "tool_calls": 0, "tool_errors": 0, "truncated": False}
    assert ctx.counters == {}


async def test_a_chat_template_episode_renders_its_prompt_and_runs_several_calls_a_turn():
    tok = chat_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>'
    )
    engine = ScriptedEngine(tok, [turn, "6 and 1.<|im_end|>"])
    async with _context(tok, tool_format="auto") as ctx:
        messages = [{"role": "user", "content": "2*3 and 1+0?"}]
        prompt = {"prompt_id": "p", "input_ids": [5], "meta": {"messages": messages}}
        trajectory = await tool_rollout(prompt, engine, ctx)
    schemas = [s.schema for s in ctx.tools.specs.values()]
    rendered = tok.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=False
    )
    assert _text(tok, trajectory.prompt_ids) == rendered  # not the feeder's input_ids
    assert engine.requests[0][1] == {"stop_token_ids": sorted({1, im_end})}
    text = _text(tok, trajectory.completion_ids)
    assert text.startswith(turn + "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n"
                           "<tool_response>\n1.0\n</tool_response><|im_end|>\n")  # fmt: skip
    assert text.endswith("<|im_start|>assistant\n6 and 1.<|im_end|>")
    assert trajectory.finish_reason == "stop"
    assert trajectory.info == {"turns": 2, "tool_calls": 2, "tool_errors": 0, "truncated": False}
    versions = trajectory.versions
    assert set(versions[trajectory.loss_mask == 0].tolist()) == {-1}
    assert set(versions[trajectory.loss_mask == 1].tolist()) == {10, 11}
