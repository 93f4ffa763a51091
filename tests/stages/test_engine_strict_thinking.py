"""``--enable-strict-thinking`` and ``max_thinking_tokens``, as SGLang 0.5.23 filters a thinking
sample (``srt/constrained/reasoner_grammar_backend.py``: ``ReasonerGrammarObject.fill_vocab_mask``,
``_can_think_more``, ``transfer_state``; ``ReasonerGrammarBackend._get_think_excluded_token_ids``;
``srt/parser/reasoning_parser.py``: ``Qwen3Detector``'s ``think_excluded_tokens``;
``srt/managers/tokenizer_manager.py``: ``generate_request``'s refusal without the flag and the
request's budget put in ``custom_params["thinking_budget"]``; ``srt/environ.py``:
``SGLANG_MAX_THINK_TOKENS``), through a real engine, natively and by the ``openai`` client."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer

from stages.engine.protocol import RequestError, parse_generate
from stages.engine.strict_thinking import BUDGET_ENV, StrictThinking
from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import make_tagged_byte_model

# byte-level, every character in the tiny model's alphabet; Qwen3's toggle
TEMPLATE = (
    "{%- for m in messages %}{{ m.content }}.{% endfor %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}-{% endif %}"
    "{%- if add_generation_prompt %}:{% endif %}"
)
HELLO = [{"role": "user", "content": "hi"}]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>"]
SERVER_BUDGET = 5  # the engine's SGLANG_MAX_THINK_TOKENS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("strict-thinking-model")
    model = make_tagged_byte_model(root / "model", tuple(TAGS))
    (root / "template.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module")
def ids(model_dir: Path) -> dict[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {tag: tokenizer.convert_tokens_to_ids(tag) for tag in TAGS}


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    flags = (
        "--chat-template", str(model_dir.parent / "template.jinja"),
        "--reasoning-parser", "qwen3", "--enable-strict-thinking",
    )  # fmt: skip
    env = {BUDGET_ENV: str(SERVER_BUDGET)}
    with serving(model_dir, model_dir.parent / "engine.log", *flags, env=env) as eng:
        yield eng


def _thinking(budget: int | None = None, **params) -> dict:
    body = {
        "input_ids": [29, 30, 9, 7],
        "require_reasoning": True,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, **params},
    }
    if budget is not None:
        body["max_thinking_tokens"] = budget
    return body


# -- the filter on its own ----------------------------------------------------------------------


def test_the_parsers_tags_and_the_servers_budget(model_dir: Path, ids: dict[str, int]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    strict = StrictThinking.of("qwen3", tokenizer, {BUDGET_ENV: "7"})
    assert strict.end == (ids["</think>"],) and strict.budget == 7
    # Qwen3Detector.think_excluded_tokens, each tag's ids
    assert strict.excluded == tuple(ids[t] for t in TAGS[2:])
    # a request's budget wins; below -1 it is none (max(budget, -1))
    assert (strict.limit(None), strict.limit(2), strict.limit(-9)) == (7, 2, -1)
    # DeepSeek-R1's detector excludes nothing; no budget set: none
    r1 = StrictThinking.of("deepseek-r1", tokenizer, {})
    assert r1.excluded == () and r1.budget == -1
    # GLM-4.5's own tags: a tag the tokenizer encodes to nothing is refused at start
    with pytest.raises(ValueError, match="think_excluded_token '<eop>'"):
        StrictThinking.of("glm45", _Nothing(tokenizer, "<eop>"), {})
    # ids beyond the model's logits: an excluded one is left out, an end tag refused
    small = StrictThinking.of("qwen3", tokenizer, {}, vocab_size=ids["<|im_end|>"])
    assert small.excluded == (ids["<tool_call>"], ids["</tool_call>"])
    with pytest.raises(ValueError, match="beyond the model's"):
        StrictThinking.of("qwen3", tokenizer, {}, vocab_size=ids["</think>"])
    with pytest.raises(ValueError, match=BUDGET_ENV):
        StrictThinking.of("qwen3", tokenizer, {BUDGET_ENV: "lots"})


class _Nothing:
    """A tokenizer that encodes one tag to nothing."""

    def __init__(self, tokenizer, tag: str) -> None:
        self.tokenizer, self.tag = tokenizer, tag

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [] if text == self.tag else self.tokenizer.encode(text, add_special_tokens=False)


def test_free_rows_lose_the_excluded_tags_and_forced_rows_all_but_the_end() -> None:
    strict = StrictThinking(end=(5, 6), excluded=(1, 2))
    logits = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    strict.mask(logits, free=[0, 2], forced=[3], ends=[6])
    inf = -math.inf
    assert logits[0].tolist() == [0, inf, inf, 3, 4, 5, 6, 7]
    assert logits[1].tolist() == list(range(8, 16))  # not thinking: untouched
    assert logits[2].tolist() == [16, inf, inf, 19, 20, 21, 22, 23]
    assert logits[3].tolist() == [inf] * 6 + [30, inf]
    one = torch.zeros(2, 8)
    strict.mask(one, free=[1], forced=[], ends=[])
    assert one[0].tolist() == [0] * 8 and one[1].tolist() == [0, inf, inf, 0, 0, 0, 0, 0]


def test_a_budget_without_the_flag_is_refused_in_sglangs_words() -> None:
    body = {"input_ids": [1, 2], "max_thinking_tokens": 8}
    with pytest.raises(RequestError) as err:
        parse_generate(body, vocab_size=16, context_length=512, encode=None)
    assert err.value.field == "max_thinking_tokens"
    assert "requires the server to be launched with --enable-strict-thinking" in str(err.value)
    (inp,), _ = parse_generate(
        body, vocab_size=16, context_length=512, encode=None, strict_thinking=True
    )
    assert inp.max_thinking_tokens == 8


@pytest.mark.timeout(60)
def test_a_thinking_sample_keeps_its_count_over_a_retraction(
    model_dir: Path, ids: dict[str, int]
) -> None:
    """The count is the sample's own, not its row's: a retraction in the middle of its
    reasoning (its KV dropped, its output recomputed) changes nothing of where the end is
    forced."""
    from transformers import AutoModelForCausalLM

    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler
    from tests.stages.engine_setup import run_with_retraction

    end = ids["</think>"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=12, ignore_eos=True, logit_bias=((end, -100.0),)
    )
    strict = StrictThinking(end=(end,), excluded=(ids["<tool_call>"],))
    results = []
    for retract in (False, True):
        scheduler = Scheduler(model, max_running=4, strict_thinking=strict)
        inp = GenerateInput("t", [29, 30, 9, 7], params, False, require_reasoning=True)
        inp.max_thinking_tokens = 7
        future = scheduler.submit(inp)
        other = scheduler.submit(GenerateInput("o", [5, 6], params, False))  # not thinking
        run_with_retraction(scheduler, 4, retract)
        out = future.result(timeout=0).output_ids
        assert out.index(end) == 7 and out.count(end) == 1, out
        assert end not in other.result(timeout=0).output_ids
        results.append(out)
    assert results[0] == results[1]


@pytest.mark.timeout(60)
def test_a_server_budget_that_is_not_an_integer_stops_the_engine_saying_so(
    model_dir: Path,
) -> None:
    from tests.stages.engine_setup import engine_command

    flags = ("--reasoning-parser", "qwen3", "--enable-strict-thinking", "--port", "0")
    done = subprocess.run(
        engine_command(model_dir, *flags),
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "OMP_NUM_THREADS": "1", BUDGET_ENV: "lots"},
    )
    assert done.returncode == 2
    assert f"{BUDGET_ENV}='lots': expected an integer" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_an_end_tag_of_two_tokens_is_forced_from_where_the_sample_is_in_it(
    model_dir: Path,
) -> None:
    """A multi-token end tag (SGLang's TokenSequenceMatcher): at the budget the next of its
    tokens is forced, from the start or from where the last tokens already are in it, and a
    broken partial match counts as thinking."""
    from transformers import AutoModelForCausalLM

    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler

    a, b = 20, 21  # the end tag [a, b]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scheduler = Scheduler(
        model, max_running=4, strict_thinking=StrictThinking(end=(a, b), excluded=())
    )

    def sample(bias: dict[int, float], budget: int) -> list[int]:
        params = SamplingParams(
            temperature=0.0, max_new_tokens=10, ignore_eos=True, logit_bias=tuple(bias.items())
        )
        inp = GenerateInput(f"t{budget}{bias}", [29, 30, 9], params, False, require_reasoning=True)
        inp.max_thinking_tokens = budget
        future = scheduler.submit(inp)
        scheduler.run_until_idle()
        return future.result(timeout=0).output_ids

    # neither drawn freely: both forced, one after the other, at the budget
    out = sample({a: -100.0, b: -100.0}, 3)
    assert out[3:5] == [a, b] and a not in out[:3] and out[5:].count(b) == 0, out
    # a favoured, b not: every token so far is a (the start of the tag), then b is forced
    out = sample({a: 100.0, b: -100.0}, 4)
    assert out[:4] == [a] * 4 and out[4] == b and b not in out[5:], out


# -- through the engine -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_budget_forces_the_end_of_the_reasoning(engine: Engine, ids: dict[str, int]) -> None:
    """Once a sample has thought its budget only </think> can be drawn, though its logit bias
    says never (the filter comes first): the reasoning ends there, its log-prob 0 (the
    filtered distribution's), and it counts as the reasoning's last token."""
    end = ids["</think>"]
    never = {str(end): -100}
    for budget in (0, 3):
        out = engine.generate(_thinking(budget, logit_bias=never))
        assert out["output_ids"].index(end) == budget, out["output_ids"]
        assert out["output_ids"].count(end) == 1
        assert out["meta_info"]["output_token_logprobs"][budget][0] == 0.0
        assert out["meta_info"]["reasoning_tokens"] == budget + 1
    # no request budget: the server's (SGLANG_MAX_THINK_TOKENS); -1 (none at all inside, as
    # SGLang's reasoner grammar reads it) is refused by /generate's JSON contract (a u64)
    out = engine.generate(_thinking(None, logit_bias=never))
    assert out["output_ids"].index(end) == SERVER_BUDGET
    # not thinking (no require_reasoning): nothing is filtered
    plain = {k: v for k, v in _thinking(2, logit_bias=never).items() if k != "require_reasoning"}
    assert end not in engine.generate(plain)["output_ids"]
    # every sample of a batch and of n, sampled
    batch = _thinking(2, logit_bias=never, temperature=1.0, n=3)
    batch["input_ids"] = [[29, 30, 9, 7], [12, 13]]
    outs = engine.generate(batch)
    assert len(outs) == 6 and all(o["output_ids"].index(end) == 2 for o in outs)


@pytest.mark.timeout(60)
def test_excluded_tags_are_never_drawn_while_thinking(engine: Engine, ids: dict[str, int]) -> None:
    """Qwen3's excluded tags (a tool call, an end of turn) cannot be drawn inside the
    reasoning, however much they are favoured; after </think> they can."""
    end = ids["</think>"]
    excluded = {ids[t] for t in TAGS[2:]}
    favoured = {str(t): 60 for t in excluded}
    out = engine.generate(_thinking(4, logit_bias=favoured))["output_ids"]
    cut = out.index(end)
    assert cut <= 4 and not set(out[:cut]) & excluded, out
    assert out[cut + 1] in excluded  # free again
    plain = {k: v for k, v in _thinking(4, logit_bias=favoured).items() if k != "require_reasoning"}
    assert engine.generate(plain)["output_ids"][0] in excluded


@pytest.mark.timeout(60)
def test_a_streamed_sample_is_filtered_as_a_whole_one(engine: Engine, ids: dict[str, int]) -> None:
    body = _thinking(3, logit_bias={str(ids["</think>"]): -100})
    whole = engine.generate(body)
    reply = requests.post(engine.url + "/generate", json=body | {"stream": True}, timeout=30)
    events = [
        json.loads(line[6:]) for line in reply.iter_lines() if line[6:] not in (b"", b"[DONE]")
    ]
    assert events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["reasoning_tokens"] == 4


@pytest.mark.timeout(60)
def test_a_thinking_chat_request_gets_the_servers_budget(
    engine: Engine, ids: dict[str, int]
) -> None:
    """The chat route has no max_thinking_tokens of its own (SGLang 0.5.23's): a thinking
    request (require_reasoning) thinks the server's budget; one that does not think is free."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    never = {str(ids["</think>"]): -100}
    ask = dict(model="m", messages=HELLO, max_tokens=12, temperature=0, logit_bias=never)
    out = client.chat.completions.create(**ask)
    assert out.usage.model_extra["reasoning_tokens"] == SERVER_BUDGET + 1
    reasoning = out.choices[0].message.model_extra["reasoning_content"]
    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    assert len(tokenizer.encode(reasoning)) == SERVER_BUDGET
    off = client.chat.completions.create(**ask, reasoning_effort="none")
    assert off.usage.model_extra["reasoning_tokens"] == 0
    assert "</think>" not in off.choices[0].message.content


@pytest.mark.timeout(60)
def test_a_budget_that_is_not_an_integer_is_refused(engine: Engine) -> None:
    # GenerateReqInput's Optional[int] (its validation handler's 400), then the JSON
    # contract's u64 ({error: text}), as SGLang 0.5.23 checks them
    for bad, words in (
        ("3", 'invalid type: string "3", expected u64'),
        (True, "invalid type: boolean `true`, expected u64"),
        (-1, "invalid value: integer `-1`, expected u64"),
    ):
        status, answer = engine.request(
            "POST", "/generate", _thinking() | {"max_thinking_tokens": bad}
        )
        assert status == 400 and answer == {"error": words}, answer
    for bad in (2.5, [3]):
        status, answer = engine.request(
            "POST", "/generate", _thinking() | {"max_thinking_tokens": bad}
        )
        assert status == 400 and answer["type"] == "Bad Request", answer
        assert answer["message"].startswith("max_thinking_tokens: Input should be"), answer
    status, info = engine.request("GET", "/server_info")
    assert status == 200 and info["enable_strict_thinking"] is True
    assert info["refused_requests"]["POST /generate 400"] >= 5
