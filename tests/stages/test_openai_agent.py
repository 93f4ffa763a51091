"""The openai_agent rollout: unmodified openai-client agents, through the real proxy server and
the real ``openai`` client, against a scripted engine (what the generator's engine handle
returns is stood in by one that answers scripted texts, so the tokens it sampled are known)."""

from __future__ import annotations

import asyncio
import json
import string
from typing import Any

import numpy as np
import pytest

from stages.rollouts.api import RequestRefused, RolloutConfig, RolloutContext
from stages.rollouts.openai_agent import AgentFailed, openai_agent
from stages.rollouts.trajectory import Generation
from tests.stages.tool_tokenizers import QWEN_LIKE, char_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}}},
}}]  # fmt: skip
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
HERE = "tests.stages.test_openai_agent"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return char_tokenizer(
        string.printable, special=["<|im_start|>", "<|im_end|>"], template=QWEN_LIKE
    )


class ScriptedEngine:
    """Answers each call with the next scripted text (and <|im_end|>), at version 3."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.inputs: list[list[int]] = []
        self.sampling: list[dict] = []
        self.outputs: list[np.ndarray] = []

    async def generate(self, input_ids: list[int], **sampling: Any) -> Generation:
        self.inputs.append(list(input_ids))
        self.sampling.append(sampling)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = [*self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False), end]
        self.outputs.append(np.array(ids))
        n = len(ids)
        return Generation(ids, np.linspace(-0.1, -2, n), [3] * n, "stop", cached_tokens=1)


def _episode(
    tokenizer: Any,
    agent: str,
    texts: list[str],
    prompt: str = "2+3?",
    agents=None,
    sampling: dict | None = None,
    **config,
):
    engine = ScriptedEngine(tokenizer, texts)
    ctx = RolloutContext(
        RolloutConfig(use="openai_agent", agent=f"{HERE}:{agent}", **config),
        tokenizer=tokenizer,
        sampling={"temperature": 1.0, "max_new_tokens": 64, **(sampling or {})},
        group_id="g",
        agents=agents,
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    message = {"prompt_id": "p:1", "input_ids": ids, "meta": {"text": prompt, "answer": "5"}}
    return engine, ctx, openai_agent(message, engine, ctx)


def _sampled(trajectory) -> list[int]:
    return trajectory.completion_ids[trajectory.loss_mask == 1].tolist()


# ------------------------------------------------------------------------------ agents
async def tool_agent(client, task):
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    messages.append(message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
    )
    second = await client.chat.completions.create(
        model="any", messages=messages, tools=TOOLS, extra_body={"lora_path": "an-adapter"}
    )
    return float(second.choices[0].message.content.strip() == task["answer"])


async def responses_agent(client, task):
    """The OpenAI Agents SDK's way: ``/responses``, the function calls it answers and their
    outputs sent back as input items; the second answer streamed."""
    functions = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list[dict] = [{"role": "user", "content": task["prompt"]}]
    first = await client.responses.create(model="any", input=items, tools=functions)
    (call,) = [o for o in first.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    result = str(args["a"] + args["b"])
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    second = await client.responses.create(model="any", input=items, tools=functions, stream=True)
    text = "".join([e.delta async for e in second if e.type == "response.output_text.delta"])
    return float(text.strip() == task["answer"])


async def chained_agent(client, task):
    """The same turns chained by ``previous_response_id``: the proxy's per-episode store
    holds the first response's items."""
    functions = [{"type": "function", **t["function"]} for t in TOOLS]
    first = await client.responses.create(model="any", input=task["prompt"], tools=functions)
    (call,) = [o for o in first.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    answer = {"type": "function_call_output", "call_id": call.call_id,
              "output": str(args["a"] + args["b"])}  # fmt: skip
    second = await client.responses.create(
        model="any", input=[answer], tools=functions, previous_response_id=first.id
    )
    return float(second.output_text.strip() == task["answer"])


async def anthropic_agent(client, task):
    """An agent written for the ``anthropic`` client: its base URL the episode's less ``/v1``;
    the tool's result sent back as a ``tool_result`` block, the second answer streamed."""
    import anthropic

    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    first = await claude.messages.create(model="any", max_tokens=64, messages=messages, tools=tools)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in first.content]})  # fmt: skip
    result = str(use.input["a"] + use.input["b"])
    messages.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": result}]}
    )  # fmt: skip
    second = await claude.messages.create(
        model="any", max_tokens=64, messages=messages, tools=tools, stream=True
    )
    deltas = [e.delta async for e in second if e.type == "content_block_delta"]
    await claude.close()
    return float("".join(d.text for d in deltas).strip() == task["answer"])


async def thinking_agent(client, task):
    """Reads the answer in ``content`` and the reasoning apart (rollout.reasoning_parser)."""
    out = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": task["prompt"]}]
    )
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "2 and 3 make 5"
    assert out.usage.model_extra["reasoning_tokens"] > 0
    return float(message.content.strip() == task["answer"])


async def one_call(client, task):
    out = await client.completions.create(  # an adapter named: the episode samples the policy
        model="whatever:an-adapter", prompt=task["prompt_ids"], max_tokens=50, temperature=0.1
    )
    return None if out.choices[0].text.strip() else 0.0


async def two_prompts(client, task):
    await client.completions.create(model="policy", prompt=task["prompt"], max_tokens=8)
    stream = await client.completions.create(
        model="policy", prompt="something else", max_tokens=8, stream=True
    )
    return float("".join([c.choices[0].text async for c in stream if c.choices]) == "42")


async def text_turns(client, task):
    first = await client.completions.create(model="policy", prompt=task["prompt"], max_tokens=8)
    again = task["prompt"] + first.choices[0].text + "\nand 1 more?"
    await client.completions.create(model="policy", prompt=again, max_tokens=8)
    return 0.5


async def own_client(client, task):
    """An agent that makes its own client from the base URL: served over HTTP."""
    import openai

    models = await client.models.list()  # through the proxy's server
    assert [m.id for m in models.data] == ["policy"]
    async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="k") as mine:
        out = await mine.completions.create(model="policy", prompt=task["prompt"], max_tokens=4)
        streamed = await mine.completions.create(
            model="policy", prompt=task["prompt"] + out.choices[0].text, stream=True
        )
        text = "".join([c.choices[0].text async for c in streamed if c.choices])
        try:
            await mine.completions.create(model="policy", prompt=task["prompt"], n=2)
        except openai.BadRequestError as exc:
            assert "one completion per call" in str(exc)
        else:
            raise AssertionError("n=2 was served")
    return float(text == "6")


async def stop_string(client, task):
    """Cut at a stop string, it puts the string back before going on (a tool loop in text)."""
    first = await client.completions.create(model="policy", prompt=task["prompt"], stop=["!"])
    assert first.choices[0].text == "5" and first.choices[0].finish_reason == "stop"
    again = task["prompt"] + first.choices[0].text + "! and?"
    await client.completions.create(model="policy", prompt=again)
    return 1.0


async def formatted(client, task):
    """Asks for JSON; told no by the engine (a 400), asks again without."""
    import openai

    messages = [{"role": "user", "content": task["prompt"]}]
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}}
    try:
        await client.chat.completions.create(
            model="any", messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )  # fmt: skip
    except openai.BadRequestError as exc:
        assert "refused" in exc.body["message"], exc.body
        again = await client.chat.completions.create(model="any", messages=messages)
        return float(again.choices[0].message.content == task["answer"])
    return -1.0


async def raises(client, task):
    await client.completions.create(model="policy", prompt=task["prompt"])
    raise RuntimeError("the agent's own bug")


async def hangs(client, task):
    await asyncio.sleep(30)


async def no_calls(client, task):
    return 1.0


async def bad_reward(client, task):
    await client.completions.create(model="policy", prompt=task["prompt"])
    return "great"


async def greedy(client, task):
    for _ in range(5):  # a second call is past the budget: the client raises
        await client.completions.create(model="policy", prompt=task["prompt"])
    return 1.0


def not_async(client, task):
    return 1.0


def blocking(client, task):
    """A blocking agent (the sync client): runs in an agent worker."""
    import time

    out = client.completions.create(model="policy", prompt=task["prompt"], max_tokens=4)
    if task["answer"] == "hang":
        time.sleep(60)
    return float(out.choices[0].text == task["answer"])


# ------------------------------------------------------------------------------ tests
@pytest.mark.timeout(60)
async def test_a_tool_agent_trains_exactly_the_tokens_the_engine_sampled(tokenizer) -> None:
    engine, ctx, episode = _episode(tokenizer, "tool_agent", [CALL, "5"], tool_call_parser="qwen25")
    trajectory = await episode
    assert trajectory.reward == 1.0 and trajectory.turns == 2
    # bit for bit: what the learner trains is what the engine sampled, in order
    assert _sampled(trajectory) == np.concatenate(engine.outputs).tolist()
    # the second call continued from the model's own tokens (the template renders the answer
    # without its tool call), then the template's markup and the tool's answer
    second = engine.inputs[1]
    first_context = engine.inputs[0] + engine.outputs[0].tolist()
    assert second[: len(first_context)] == first_context
    assert tokenizer.decode(second[len(first_context) :]).startswith("\n<|im_start|>user")
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(second)
    assert trajectory.context == second + engine.outputs[1].tolist()
    assert ctx.counters["agent_calls_rejoined"] == 1 and not ctx.counters["agent_calls_unjoined"]
    assert trajectory.info == {"agent_calls": 2, "agent_calls_unjoined": 0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent", ["responses_agent", "chained_agent", "anthropic_agent"])
async def test_a_responses_api_agent_trains_exactly_the_tokens_the_engine_sampled(
    tokenizer, agent
) -> None:
    """``/responses`` through the proxy joins the trajectory as the chat route does: its input
    items (or those of the response it chains to) are chat messages, its function calls the
    model's own tokens."""
    engine, ctx, episode = _episode(tokenizer, agent, [CALL, "5"], tool_call_parser="qwen25")
    trajectory = await episode
    assert trajectory.reward == 1.0 and trajectory.turns == 2
    assert _sampled(trajectory) == np.concatenate(engine.outputs).tolist()
    first_context = engine.inputs[0] + engine.outputs[0].tolist()
    assert engine.inputs[1][: len(first_context)] == first_context
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(engine.inputs[1])
    assert ctx.counters["agent_calls_rejoined"] == 1 and not ctx.counters["agent_calls_unjoined"]


ANSWERS: list[Any] = []  # what token_ids_agent's calls answered


async def token_ids_agent(client, task):
    """Asks for the token ids (SGLang 0.5.23's return_token_ids and sglext), as RL code
    written against SGLang does."""
    messages = [{"role": "user", "content": task["prompt"]}]
    ids = {"return_token_ids": True, "return_output_ids_in_sglext": True}
    answer = await client.chat.completions.create(model="any", messages=messages, extra_body=ids)
    ANSWERS.append(answer)
    return 1.0


@pytest.mark.timeout(60)
async def test_an_agent_asking_for_token_ids_gets_what_the_engine_was_given(tokenizer) -> None:
    engine, _, episode = _episode(tokenizer, "token_ids_agent", ["5"])
    await episode
    extra = ANSWERS[-1].choices[0].model_extra
    assert extra["prompt_token_ids"] == engine.inputs[0]
    assert extra["response_token_ids"] == engine.outputs[0].tolist()
    assert ANSWERS[-1].model_extra["sglext"] == {"output_ids": [engine.outputs[0].tolist()]}


@pytest.mark.timeout(60)
async def test_a_one_call_agent_samples_with_the_run_sampling_from_the_prompt(tokenizer) -> None:
    engine, _, episode = _episode(tokenizer, "one_call", ["5"])
    trajectory = await episode
    assert trajectory.reward is None  # left to the scorer
    assert trajectory.prompt_ids.tolist() == tokenizer.encode("2+3?", add_special_tokens=False)
    assert _sampled(trajectory) == engine.outputs[0].tolist()
    # the run's temperature (what the learner trains against), max_tokens held to the run's
    assert engine.sampling[0]["temperature"] == 1.0
    assert engine.sampling[0]["max_new_tokens"] == 50


@pytest.mark.timeout(60)
async def test_a_call_that_does_not_extend_the_trajectory_is_served_not_trained(tokenizer) -> None:
    engine, ctx, episode = _episode(tokenizer, "two_prompts", ["5", "42"])
    trajectory = await episode
    assert trajectory.reward == 1.0  # the streamed call was served whole
    assert _sampled(trajectory) == engine.outputs[0].tolist()
    assert ctx.counters["agent_calls_unjoined"] == 1
    assert trajectory.info["agent_calls"] == 2


@pytest.mark.timeout(60)
async def test_completions_turns_continue_from_the_model_tokens(tokenizer) -> None:
    engine, _, episode = _episode(tokenizer, "text_turns", ["5", "6"])
    trajectory = await episode
    assert trajectory.reward == 0.5
    assert _sampled(trajectory) == np.concatenate(engine.outputs).tolist()
    rest = tokenizer.encode("\nand 1 more?", add_special_tokens=False)
    assert engine.inputs[1] == engine.inputs[0] + engine.outputs[0].tolist() + rest


@pytest.mark.timeout(60)
async def test_a_stop_string_put_back_by_the_agent_is_not_inserted_twice(tokenizer) -> None:
    engine, ctx, episode = _episode(tokenizer, "stop_string", ["5!", "6"])
    trajectory = await episode
    rest = tokenizer.encode(" and?", add_special_tokens=False)
    assert engine.inputs[1] == engine.inputs[0] + engine.outputs[0].tolist() + rest
    assert _sampled(trajectory) == np.concatenate(engine.outputs).tolist()
    assert ctx.counters["agent_calls_rejoined"] == 1


@pytest.mark.timeout(60)
async def test_an_agent_with_a_client_of_its_own_is_served_over_http(tokenizer) -> None:
    engine, ctx, episode = _episode(tokenizer, "own_client", ["5", "6"])
    trajectory = await episode
    assert trajectory.reward == 1.0 and trajectory.turns == 2
    assert _sampled(trajectory) == np.concatenate(engine.outputs).tolist()
    assert ctx.counters["agent_calls_rejoined"] == 1  # its text turn continued the tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("agent", "kind", "config"),
    [
        ("raises", "raised", {}),
        ("hangs", "timeout", {"agent_timeout_s": 0.3}),
        ("no_calls", "no_calls", {}),
        ("bad_reward", "bad_reward", {}),
    ],
)
async def test_a_failing_agent_loses_its_sample_counted(tokenizer, agent, kind, config) -> None:
    _, ctx, episode = _episode(tokenizer, agent, ["5"] * 3, **config)
    with pytest.raises(AgentFailed) as failed:
        await episode
    assert failed.value.kind == kind and ctx.counters[f"agent_{kind}"] == 1


@pytest.mark.timeout(60)
async def test_a_call_past_the_budget_ends_the_trajectory_there(tokenizer) -> None:
    engine, ctx, episode = _episode(tokenizer, "greedy", ["5"] * 5, max_turns=2)
    trajectory = await episode
    assert trajectory.finish_reason == "max_turns" and trajectory.reward is None
    assert len(engine.inputs) == 2 and ctx.counters["agent_max_turns"] == 1
    assert _sampled(trajectory) == engine.outputs[0].tolist()  # the second did not extend it


@pytest.mark.timeout(60)
async def test_a_reasoning_agent_reads_the_answer_without_the_reasoning(tokenizer) -> None:
    """rollout.reasoning_parser: the proxy answers as an engine with --reasoning-parser does;
    what is trained is still every token the engine sampled, the reasoning's included."""
    engine, _, episode = _episode(
        tokenizer, "thinking_agent", ["<think>2 and 3 make 5</think>5"], reasoning_parser="qwen3"
    )
    trajectory = await episode
    assert trajectory.reward == 1.0
    assert _sampled(trajectory) == engine.outputs[0].tolist()
    # a thinking call (qwen3, thinking on by default): the engine is told, as the chat route
    # tells it, so that a grammar of the call waits for the end of the reasoning
    assert engine.sampling[0]["require_reasoning"] is True
    assert "max_thinking_tokens" not in engine.sampling[0]


@pytest.mark.timeout(60)
async def test_a_thinking_call_takes_the_runs_thinking_budget(tokenizer) -> None:
    """sampling.max_thinking_tokens: a thinking call carries the run's budget to the engine;
    a call that does not think (no reasoning parser) carries neither."""
    budget = {"max_thinking_tokens": 16, "require_reasoning": True}  # as_params' pair
    engine, _, episode = _episode(
        tokenizer, "thinking_agent", ["<think>2 and 3 make 5</think>5"],
        reasoning_parser="qwen3", sampling=budget,
    )  # fmt: skip
    await episode
    assert engine.sampling[0]["require_reasoning"] is True
    assert engine.sampling[0]["max_thinking_tokens"] == 16
    engine, _, episode = _episode(tokenizer, "one_call", ["5"], sampling=budget)
    await episode
    assert "max_thinking_tokens" not in engine.sampling[0]
    assert "require_reasoning" not in engine.sampling[0]


@pytest.mark.timeout(60)
async def test_an_agents_calls_take_the_runs_custom_logit_processor(tokenizer) -> None:
    """sampling.custom_logit_processor and custom_params: every call of an agent carries the
    run's to the engine, as the generator's own requests do."""
    run = {"custom_logit_processor": '{"callable": "00"}', "custom_params": {"token_ids": [3]}}
    engine, _, episode = _episode(tokenizer, "one_call", ["5"], sampling=run)
    await episode
    assert {k: engine.sampling[0][k] for k in run} == run


def test_agent_config_errors() -> None:
    with pytest.raises(ValueError, match="needs `agent`"):
        RolloutConfig(use="openai_agent")
    with pytest.raises(ValueError, match="must be an async function"):
        RolloutConfig(use="openai_agent", agent=f"{HERE}:not_async")
    with pytest.raises(ValueError, match="is for rollout 'openai_agent'"):
        RolloutConfig(agent=f"{HERE}:one_call")
    with pytest.raises(ValueError, match="reasoning_parser 'beam': one of deepseek-r1"):
        RolloutConfig(use="openai_agent", agent=f"{HERE}:one_call", reasoning_parser="beam")
    with pytest.raises(ValueError, match="tool_call_parser 'x': one of qwen25"):
        RolloutConfig(use="openai_agent", agent=f"{HERE}:one_call", tool_call_parser="x")
    with pytest.raises(ValueError, match="are for 'openai_agent'"):
        RolloutConfig(reasoning_parser="qwen3")


@pytest.mark.timeout(90)
async def test_agents_in_worker_processes_blocking_ones_included(tokenizer) -> None:
    from stages.rollouts.openai_agent import agent_pool

    config = RolloutConfig(
        use="openai_agent", agent=f"{HERE}:blocking", agent_workers=1, agent_timeout_s=5.0
    )
    pool = await agent_pool(config, log=None)
    try:
        engine, ctx, episode = _episode(
            tokenizer, "blocking", ["5"], agents=pool, agent_workers=1, agent_timeout_s=5.0
        )
        trajectory = await episode
        assert trajectory.reward == 1.0  # "5" is the answer
        assert _sampled(trajectory) == engine.outputs[0].tolist()
        # one that hangs has its worker killed at agent_timeout_s and loses its sample
        engine = ScriptedEngine(tokenizer, ["5"])
        ctx = RolloutContext(config, tokenizer=tokenizer, agents=pool,
                             sampling={"temperature": 1.0})  # fmt: skip
        ids = tokenizer.encode("2+3?", add_special_tokens=False)
        hang = {"prompt_id": "p:2", "input_ids": ids, "meta": {"text": "2+3?", "answer": "hang"}}
        with pytest.raises(AgentFailed) as failed:
            await openai_agent(hang, engine, ctx)
        assert failed.value.kind == "timeout" and pool.counts["timeouts"] == 1
    finally:
        await pool.aclose()
    with pytest.raises(ValueError, match="agent_workers"):
        RolloutConfig(use="openai_agent", agent=f"{HERE}:blocking")  # not async: needs workers


class RefusingEngine(ScriptedEngine):
    """Refuses a call with a grammar, as an engine whose tokenizer cannot be constrained."""

    async def generate(self, input_ids: list[int], **sampling: Any) -> Generation:
        if "json_schema" in sampling:
            self.sampling.append(sampling)
            raise RequestRefused("POST /generate answered 400: grammars cannot constrain it")
        return await super().generate(input_ids, **sampling)


@pytest.mark.timeout(60)
async def test_an_engine_s_400_reaches_the_agent_which_goes_on(tokenizer) -> None:
    """A call the engine refuses (here a grammar, which the proxy forwards as the engine's
    ``json_schema``) is the agent's 400, as from a server; the episode goes on."""
    engine = RefusingEngine(tokenizer, ["5"])
    ctx = RolloutContext(
        RolloutConfig(use="openai_agent", agent=f"{HERE}:formatted"),
        tokenizer=tokenizer,
        sampling={"temperature": 1.0, "max_new_tokens": 64},
        group_id="g",
    )
    ids = tokenizer.encode("2+3?", add_special_tokens=False)
    message = {"prompt_id": "p:1", "input_ids": ids, "meta": {"text": "2+3?", "answer": "5"}}
    trajectory = await openai_agent(message, engine, ctx)
    assert trajectory.reward == 1.0 and _sampled(trajectory) == engine.outputs[0].tolist()
    assert '"sum"' in engine.sampling[0]["json_schema"]  # response_format, forwarded
    assert "json_schema" not in engine.sampling[1]


def test_an_episode_renders_with_the_runs_chat_settings_whole() -> None:
    """Each episode records its prompts on the run's chat settings shared (``shared_as``):
    every field kept (a model's chat encoding, the default template kwargs) and nothing
    parsed from the template again for it."""
    from stages.engine.openai_chat import ChatSettings
    from stages.rollouts.agent_proxy import Episode

    tokenizer = char_tokenizer(string.printable, template=QWEN_LIKE)
    settings = ChatSettings(
        tokenizer, None, default_kwargs={"enable_thinking": False}, encoding="dsv32"
    )
    episodes = [
        Episode(None, tokenizer, sampling={}, max_calls=2, max_tokens=0, context_length=64,
                chat=settings, counters=None)
        for _ in range(2)
    ]  # fmt: skip
    first, second = (episode.chat for episode in episodes)
    assert first is not second and first.rendered is not second.rendered
    for chat in (first, second):
        assert chat.encoding == "dsv32" and chat.default_kwargs == {"enable_thinking": False}
        assert chat.renderer is settings.renderer and chat.toggle is settings.toggle
