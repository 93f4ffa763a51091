"""``protocol.parse_groups``: several groups checked as the ``/generate`` body that lists each
prompt once per sample would be (what an in-process engine takes from its generator), with the
same results and the same error for each problem, but each prompt checked once."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stages.engine.protocol import (
    RequestError,
    parse_generate,
    parse_groups,
    parse_sampling_params,
)

VOCAB, CONTEXT = 50, 32
PARAMS = {"temperature": 0.7, "max_new_tokens": 5, "stop_token_ids": [3]}


def _body(prompts: list[Any], rids: list[list[str]], lora: str | None = None) -> dict[str, Any]:
    body = {
        "input_ids": [p for p, group in zip(prompts, rids, strict=True) for _ in group],
        "sampling_params": dict(PARAMS),
        "return_logprob": True,
        "rid": [rid for group in rids for rid in group],
    }
    if lora is not None:
        body["lora_path"] = lora
    return body


def _both(
    prompts: list[Any], rids: list[list[str]], lora: str | None = None, adapters=()
) -> tuple[Any, Any]:
    """What each path gives (its inputs, flat) or raises (field and message)."""
    out = []
    for path in ("body", "groups"):
        try:
            if path == "body":
                got, _ = parse_generate(
                    _body(prompts, rids, lora),
                    vocab_size=VOCAB,
                    context_length=CONTEXT,
                    encode=None,
                    adapters=adapters,
                )
            else:
                groups = parse_groups(
                    prompts,
                    parse_sampling_params(dict(PARAMS)),
                    rids,
                    vocab_size=VOCAB,
                    context_length=CONTEXT,
                    lora=lora,
                    adapters=adapters,
                )
                assert [len(g) for g in groups] == [len(r) for r in rids]
                got = [inp for group in groups for inp in group]
            out.append(got)
        except RequestError as exc:
            out.append((exc.field, str(exc)))
    return out[0], out[1]


def test_random_groups_give_the_inputs_the_body_gives() -> None:
    rng = random.Random(0)
    for trial in range(50):
        count = rng.randint(1, 6)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(count)]
        rids = [[f"t{trial}/g{i}/{j}" for j in range(rng.randint(0, 4))] for i in range(count)]
        if not any(rids):
            rids[0].append(f"t{trial}/only")
        body, groups = _both(prompts, rids)
        assert groups == body


@pytest.mark.parametrize(
    ("prompts", "rids", "lora", "field"),
    [
        ([[1, 2], [1, VOCAB]], [["a", "b"], ["c", "d"]], None, "input_ids[2][1]"),  # out of range
        ([[1, 2], [1, -1]], [["a"], ["c"]], None, "input_ids[1][1]"),
        ([[1, 2], [1, 2.5]], [["a"], ["c"]], None, "input_ids[1][1]"),  # not an integer
        ([[1], []], [["a"], ["b"]], None, "input_ids[1]"),  # empty
        ([[1], list(range(1, 30))], [["a"], ["b"]], None, "input_ids[1]"),  # too long
        ([[1], [2]], [["a", "b"], ["c", "b"]], None, "rid[3]"),  # a repeated request id
        ([[1], [2]], [["a"], ["b"]], "nope", "lora_path"),  # no such adapter
        ([[1], [2]], [[], []], None, "input_ids"),  # nothing at all
    ],
)
def test_each_problem_is_refused_with_the_bodys_error(prompts, rids, lora, field) -> None:
    body, groups = _both(prompts, rids, lora)
    assert isinstance(body, tuple) and body[0] == field
    assert groups == body


def test_a_group_without_samples_is_not_checked_as_the_body_does_not_list_it() -> None:
    body, groups = _both([[1, 2], [VOCAB + 3], [4]], [["a"], [], ["c"]])
    assert not isinstance(body, tuple) and groups == body


def test_an_adapter_loaded_is_taken() -> None:
    body, groups = _both([[1, 2]], [["a", "b"]], "ad", adapters={"ad"})
    assert not isinstance(body, tuple) and groups == body
    assert {inp.lora for inp in groups} == {"ad"}


def test_sampling_params_are_checked_as_the_route_checks_them() -> None:
    with pytest.raises(RequestError) as bad:
        parse_sampling_params({"temperature": "hot"})
    assert bad.value.field == "sampling_params.temperature"
    with pytest.raises(RequestError) as several:
        parse_sampling_params({"n": 2})
    assert several.value.field == "sampling_params.n"
    with pytest.raises(RequestError) as kind:
        parse_sampling_params([{"temperature": 1.0}])  # type: ignore[arg-type]
    assert kind.value.field == "sampling_params"


def test_a_request_is_fitted_to_the_context_as_sglang_fits_it() -> None:
    """SGLang 0.5.23: a prompt as long as the context is refused, and so is a given
    ``max_new_tokens`` the context cannot hold (``TokenizerManager._validate_one_request``)
    and a prompt of the context less 6 or more (``validate_input_length``); each sample then
    generates at most ``context - 2 - prompt`` tokens (``init_req_max_new_tokens``), so an
    unset ``max_new_tokens`` (128) is cut, not refused, and ``min_new_tokens`` with it. The
    in-process path takes its parameters as given."""

    def fitted(prompt: list[int], **sampling: Any) -> tuple[int, int]:
        body = {"input_ids": [prompt, [7]], "sampling_params": sampling}
        inputs, _ = parse_generate(body, vocab_size=VOCAB, context_length=CONTEXT, encode=None)
        # (each prompt of a batch its own: [7] leaves 29)
        assert inputs[1].params.max_new_tokens == min(sampling.get("max_new_tokens", 128), 29)
        return inputs[0].params.max_new_tokens, inputs[0].params.min_new_tokens

    def refused(prompt: list[int], **sampling: Any) -> str:
        body = {"input_ids": prompt, "sampling_params": sampling}
        with pytest.raises(RequestError) as exc:
            parse_generate(body, vocab_size=VOCAB, context_length=CONTEXT, encode=None)
        return str(exc.value)

    assert fitted([5] * 10) == (20, 0)  # 32 - 2 - 10, where 128 was refused
    assert fitted([5] * 10, min_new_tokens=25) == (20, 20)
    assert fitted([5] * 25) == (5, 0)
    assert fitted([5] * 10, max_new_tokens=22) == (20, 0)  # given, fits: cut by the margin
    assert fitted([5] * 10, max_new_tokens=12) == (12, 0)
    assert refused([5] * 10, max_new_tokens=23).endswith(
        "Requested token count exceeds the model's maximum context length of 32 tokens. You "
        "requested a total of 33 tokens: 10 tokens from the input messages and 23 tokens for "
        "the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
    said = refused([5] * 26, max_new_tokens=0)
    assert "Input length (26 tokens) exceeds the maximum allowed length (26 tokens)" in said
    said = refused([5] * 32, max_new_tokens=0)
    assert "The input (32 tokens) is longer than the model's context length (32 tokens)." in said
    (group,) = parse_groups(
        [[5] * 10], parse_sampling_params({"max_new_tokens": 22}), [["a", "b"]],
        vocab_size=VOCAB, context_length=CONTEXT,
    )  # fmt: skip
    assert [inp.params.max_new_tokens for inp in group] == [20, 20]
    with pytest.raises(RequestError, match="You requested a total of 33 tokens"):
        parse_groups(
            [[5] * 10], parse_sampling_params({"max_new_tokens": 23}), [["a"]],
            vocab_size=VOCAB, context_length=CONTEXT,
        )  # fmt: skip


def test_allow_auto_truncate_cuts_what_the_context_cannot_take_as_sglang_does() -> None:
    """SGLang 0.5.23 with --allow-auto-truncate refuses nothing: the tokenizer cuts a prompt
    to the context and an overflowing max_new_tokens to what the context leaves
    (``_validate_one_request``); the scheduler gives each sample at most the context less 2
    less that prompt (``init_req_max_new_tokens``), then keeps the prompt's first
    ``max_req_input_len`` (context - 6) tokens (``validate_input_length``), in that order, so
    a long prompt is cut and generates what its sent length left."""

    def fitted(prompt: list[int], **sampling: Any) -> tuple[list[int], int, int]:
        body = {"input_ids": [prompt, [7]], "sampling_params": sampling}
        inputs, _ = parse_generate(
            body, vocab_size=VOCAB, context_length=CONTEXT, encode=None, auto_truncate=True
        )
        assert list(inputs[1].input_ids) == [7]
        params = inputs[0].params
        return list(inputs[0].input_ids), params.max_new_tokens, params.min_new_tokens

    long = list(range(40))
    assert fitted(long) == (long[:26], 0, 0)  # 40 >= 32: cut; nothing left to generate
    assert fitted(long, max_new_tokens=5, min_new_tokens=3) == (long[:26], 0, 0)
    assert fitted(long[:32]) == (long[:26], 0, 0)
    assert fitted(long[:28], max_new_tokens=9) == (long[:26], 2, 0)  # 32 - 2 - 28
    assert fitted(long[:26]) == (long[:26], 4, 0)  # as long as it takes: 32 - 2 - 26
    assert fitted(long[:25], max_new_tokens=30, min_new_tokens=30) == (long[:25], 5, 5)
    assert fitted(long[:10], max_new_tokens=23) == (long[:10], 20, 0)  # was refused: cut
    (group,) = parse_groups(
        [long], parse_sampling_params({"max_new_tokens": 3}), [["a", "b"]],
        vocab_size=VOCAB, context_length=CONTEXT, auto_truncate=True,
    )  # fmt: skip
    assert [(list(i.input_ids), i.params.max_new_tokens) for i in group] == [(long[:26], 0)] * 2
    (group,) = parse_groups(
        [long[:10]], parse_sampling_params({"max_new_tokens": 23}), [["a"]],
        vocab_size=VOCAB, context_length=CONTEXT, auto_truncate=True,
    )  # fmt: skip
    assert group[0].params.max_new_tokens == 20 and len(group[0].input_ids) == 10
    # a logprob_start_len is checked against the prompt as cut, as SGLang's scheduler checks it
    body = {"input_ids": long, "return_logprob": True, "logprob_start_len": 30}
    with pytest.raises(RequestError, match="30 is higher than the number of input tokens 26"):
        parse_generate(
            body, vocab_size=VOCAB, context_length=CONTEXT, encode=None, auto_truncate=True
        )
