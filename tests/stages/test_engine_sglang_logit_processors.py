"""The custom logit processors held to SGLang 0.5.23's own (``srt/sampling/
custom_logit_processor.py``): the strings its classes write load here as the same processors,
a caller's class built on its base loads too, and the processors SGLang ships change random
logits as SGLang's do, given the same requests.

Runs where SGLang's source is importable (``test_engine_sglang_shapes.py``'s docstring says how:
the wheel unpacked, no install); skipped elsewhere.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
import torch

sglang: Any = pytest.importorskip("sglang.srt.sampling.custom_logit_processor")

from stages.engine import custom_logits  # noqa: E402
from stages.engine.custom_logits import RequestView, processor_class  # noqa: E402

SHIPPED = [
    "DisallowedTokensLogitsProcessor",
    "Glm4MoeThinkingBudgetLogitProcessor",
    "Qwen3ThinkingBudgetLogitProcessor",
    "DeepSeekR1ThinkingBudgetLogitProcessor",
    "InklingThinkingBudgetLogitProcessor",
    "DeepseekOCRNoRepeatNGramLogitProcessor",
]


@pytest.mark.parametrize("name", SHIPPED)
def test_sglangs_strings_load_as_the_same_processors(name: str) -> None:
    assert processor_class(getattr(sglang, name).to_str()) is getattr(custom_logits, name)


@pytest.mark.parametrize("name", custom_logits.SHIPPED)
def test_sglang_string_names_sglangs_class_for_sglang_too(name: str) -> None:
    text = custom_logits.sglang_string(name)
    assert type(sglang.CustomLogitProcessor.from_str(text)) is getattr(sglang, name)
    assert processor_class(text) is getattr(custom_logits, name)


def test_a_class_on_sglangs_base_loads_with_this_base() -> None:
    space: dict = {"__name__": "__main__"}
    source = (
        "from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor\n"
        "class Mine(CustomLogitProcessor):\n"
        "    def __call__(self, logits, custom_param_list=None):\n"
        "        return logits * 2\n"
    )
    exec(compile(source, "<client>", "exec"), space)
    found = processor_class(space["Mine"].to_str())
    assert issubclass(found, custom_logits.CustomLogitProcessor)
    assert torch.equal(found()(torch.ones(1, 3), [None]), torch.full((1, 3), 2.0))


class _Req:
    """SGLang's ``Req`` as its processors read it."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.origin_input_ids, self.output_ids = array("q", prompt), array("q", output)


def _requests(rng: random.Random, special: list[int], vocab: int) -> list[tuple[list, list]]:
    pool = [*special, *special, *range(vocab)]  # the special ids often
    return [
        ([rng.choice(pool) for _ in range(rng.randint(0, 12))],
         [rng.choice(pool) for _ in range(rng.randint(0, 12))])
        for _ in range(rng.randint(1, 8))
    ]  # fmt: skip


def _params(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "budget":
        return {"thinking_budget": rng.choice([None, -1, 0, 1, 3, 6, "2", 2.0, True])}
    return {
        "ngram_size": rng.choice([0, 1, 2, 3, "2", None, "x"]),
        "window_size": rng.choice([0, 2, 5, 20, None]),
        "whitelist_token_ids": rng.choice([None, [], [3, 4], ["5"], ["x"]]),
    }


@pytest.mark.parametrize("name", SHIPPED[1:])
def test_the_shipped_processors_change_logits_as_sglangs(name: str) -> None:
    ours, theirs = getattr(custom_logits, name)(), getattr(sglang, name)()
    kind = "ngram" if "NGram" in name else "budget"
    special = [] if kind == "ngram" else [
        ours.THINKING_START_TOKEN_ID, ours.THINKING_END_TOKEN_ID, ours.NEW_LINE_TOKEN_ID
    ]  # fmt: skip
    vocab = 1 + max([*special, 40])
    rng = random.Random(hash(name) % 1000)
    changed = 0
    for _ in range(200):
        requests = _requests(rng, special, 12)
        params = [_params(rng, kind) for _ in requests]
        logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(1))
        want = theirs(
            logits.clone(),
            [{**p, "__req__": _Req(*r)} for p, r in zip(params, requests, strict=True)],
        )
        got = ours(
            logits.clone(),
            [
                {**p, "__req__": RequestView("r", r[0], lambda r=r: r[1])}
                for p, r in zip(params, requests, strict=True)
            ],
        )
        assert torch.equal(got, want), (requests, params)
        changed += not torch.equal(got, logits)
    assert changed > 25  # the cases that change something are many of them


def test_disallowed_tokens_as_sglangs() -> None:
    logits = torch.randn(3, 20)
    params = [{"token_ids": [1, 7, 19]}] * 3
    want = sglang.DisallowedTokensLogitsProcessor()(logits.clone(), params)
    got = custom_logits.DisallowedTokensLogitsProcessor()(logits.clone(), params)
    assert torch.equal(got, want)
