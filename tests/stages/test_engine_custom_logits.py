"""Custom logit processors (``--enable-custom-logit-processor``, ``stages.engine.custom_logits``)
as SGLang 0.5.23 takes them (``custom_logit_processor.py``, ``TokenizerManager.
_validate_one_request``, ``Sampler._preprocess_logits``): the string ``to_str`` writes, loaded
whether the class travels by value (a client's ``__main__``) or by reference (SGLang's module
read as this one); each row's ``custom_params`` with ``__req__``; the refusals in SGLang's
words; and what SGLang would crash on (a string that does not load, a processor that raises or
returns the wrong shape) refused or aborted, the engine serving on.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from openai import OpenAI

from stages.engine import custom_logits
from stages.engine.custom_logits import (
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
    LogitProcessors,
    ProcessorError,
    Qwen3ThinkingBudgetLogitProcessor,
    RequestView,
    ThinkingBudgetLogitProcessor,
    processor_class,
)
from stages.engine.protocol import RequestError, parse_generate
from tests.stages.engine_setup import builtin_engine, load_reference
from tests.stages.tiny_model import make_tiny_model

# a client's script: its classes travel by value (dill pickles what __main__ defines)
_CLIENT = '''
from stages.engine.custom_logits import CustomLogitProcessor

class CountUp(CustomLogitProcessor):
    """Forces custom_params["first"] + how many tokens the row has sampled so far."""

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            req = params["__req__"]
            logits[row, :] = float("-inf")
            logits[row, params["first"] + len(req.output_ids)] = 0.0
        return logits

class Divides(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits / (1 // 0)

class Halves(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits[:, : logits.shape[1] // 2]
'''


def _client_classes() -> dict[str, type]:
    space: dict = {"__name__": "__main__"}
    exec(compile(_CLIENT, "<client>", "exec"), space)
    return {k: v for k, v in space.items() if isinstance(v, type)}


@pytest.fixture(scope="module")
def client() -> dict[str, str]:
    """The client's processors as the strings it sends."""
    return {
        name: cls.to_str()
        for name, cls in _client_classes().items()
        if name != "CustomLogitProcessor"
    }


def _sglang_string(monkeypatch: pytest.MonkeyPatch) -> str:
    """What SGLang's ``DisallowedTokensLogitsProcessor.to_str()`` writes: a reference to
    SGLang's module, made here with a stand-in module of that name (the SGLang-source tests
    hold it to SGLang's own class)."""
    names = custom_logits.SGLANG_MODULE.split(".")
    parent = None
    for i in range(1, len(names) + 1):
        module = types.ModuleType(".".join(names[:i]))
        monkeypatch.setitem(sys.modules, module.__name__, module)
        if parent is not None:
            setattr(parent, names[i - 1], module)
        parent = module
    module = sys.modules[custom_logits.SGLANG_MODULE]
    stand_in = type("DisallowedTokensLogitsProcessor", (CustomLogitProcessor,), {
        "__module__": module.__name__, "__call__": lambda self, x, p=None: x})  # fmt: skip
    module.DisallowedTokensLogitsProcessor = stand_in  # type: ignore[attr-defined]
    return stand_in.to_str()


def test_strings_load_by_value_by_reference_and_from_sglangs_module(
    client: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert processor_class(Qwen3ThinkingBudgetLogitProcessor.to_str()) is (
        Qwen3ThinkingBudgetLogitProcessor
    )
    count_up = processor_class(client["CountUp"])
    assert issubclass(count_up, CustomLogitProcessor) and count_up.__name__ == "CountUp"
    assert processor_class(_sglang_string(monkeypatch)) is DisallowedTokensLogitsProcessor


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "expected the JSON"),
        ('{"callable": 3}', "expected the JSON"),
        ('{"callable": "zz"}', "not hexadecimal"),
        ('{"callable": "00"}', "callable: "),
        ('{"callable": "' + b"\x80\x04\x95\x00".hex() + '"}', "callable: "),
    ],
)
def test_a_string_that_does_not_load_says_why(text: str, says: str) -> None:
    with pytest.raises(ProcessorError, match=says):
        processor_class(text)


def test_a_class_from_a_module_the_engine_lacks_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("client_only_module")
    monkeypatch.setitem(sys.modules, "client_only_module", module)
    space = {"__module__": "client_only_module", "__call__": lambda self, x, p=None: x}
    cls = type("Mine", (CustomLogitProcessor,), space)
    module.Mine = cls  # type: ignore[attr-defined]
    text = cls.to_str()
    monkeypatch.delitem(sys.modules, "client_only_module")
    with pytest.raises(ProcessorError, match=r"cannot be loaded here.*client_only_module"):
        processor_class(text)


def test_failures_abort_the_rows_and_leave_the_logits(client: dict[str, str]) -> None:
    """A processor that raises, returns the wrong shape or leaves a row nothing to draw: why,
    counted per row; the logits as they were."""
    processors = LogitProcessors()
    logits = torch.randn(3, 16)
    before = logits.clone()
    view = RequestView("r", [1, 2], lambda: [])
    why = processors.apply(logits, client["Divides"], [0, 2], [None, None])
    assert why == (
        "custom logit processor Divides: raised ZeroDivisionError: integer division or modulo "
        "by zero"
    )
    why = processors.apply(logits, client["Halves"], [1], [None])
    assert why is not None and "returned (1, 8), expected a tensor (1, 16)" in why
    banned = DisallowedTokensLogitsProcessor.to_str()
    why = processors.apply(logits, banned, [1], [{"token_ids": list(range(16)), "__req__": view}])
    assert why is not None and "no token to draw" in why
    assert torch.equal(logits, before) and processors.failures == 4
    assert processors.apply(logits, banned, [1], [{"token_ids": [3, 4], "__req__": view}]) is None
    assert math.isinf(logits[1, 3]) and math.isinf(logits[1, 4])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_thinking_budget_closes_an_open_block_with_a_newline_first() -> None:
    class Budget(ThinkingBudgetLogitProcessor):
        THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 9, 10, 11

    def view(prompt: list[int], out: list[int]) -> dict:
        return {"thinking_budget": 2, "__req__": RequestView("r", prompt, lambda: out)}

    rows = [
        view([1, 9], [5]),  # one token thought: free
        view([1, 9], [5, 6]),  # two: a newline first
        view([1, 9], [5, 11]),  # two, the last a newline: the end
        view([9, 3, 10], [5, 6, 7]),  # the block closed: free
        {"thinking_budget": -1, "__req__": RequestView("r", [9], lambda: [1, 2, 3])},
        None,
    ]
    out = Budget()(torch.zeros(len(rows), 16), rows)
    forced = [int(r.argmax()) if bool(torch.isinf(r).any()) else None for r in out]
    assert forced == [None, 11, 10, None, None, None]


def test_the_refusals_are_sglangs() -> None:
    body = {
        "input_ids": [1, 2, 3],
        "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
    }
    common = {"vocab_size": 64, "context_length": 512, "encode": None}
    with pytest.raises(RequestError, match="--enable-custom-logit-processor"):
        parse_generate(body, **common)
    listed = {**body, "custom_logit_processor": [body["custom_logit_processor"]],
              "sampling_params": {"n": 2}}  # fmt: skip
    with pytest.raises(RequestError, match="Cannot use list custom_logit_processor with parallel"):
        parse_generate(listed, **common, custom_logits=True)
    budget = {**body, "custom_logit_processor": Qwen3ThinkingBudgetLogitProcessor.to_str(),
              "return_sampling_mask": True, "sampling_params": {"top_k": 1}}  # fmt: skip
    with pytest.raises(RequestError, match="only supports DisallowedTokensLogitsProcessor"):
        parse_generate(budget, **common, custom_logits=True)
    masked = {**budget, "custom_logit_processor": body["custom_logit_processor"]}
    assert parse_generate(masked, **common, custom_logits=True)[0][0].logit_processor
    bad = {**body, "custom_logit_processor": ["x", None], "input_ids": [[1], [2]]}
    with pytest.raises(RequestError, match="cannot load the processor") as refused:
        parse_generate(bad, **common, custom_logits=True)
    assert refused.value.field == "custom_logit_processor[0]"
    # no processor (none, or "") is no processor, with or without the flag
    assert (
        parse_generate({**body, "custom_logit_processor": ""}, **common)[0][0].logit_processor
        is None
    )


def test_max_thinking_tokens_is_the_processors_thinking_budget() -> None:
    body = {
        "input_ids": [1, 2],
        "custom_logit_processor": Qwen3ThinkingBudgetLogitProcessor.to_str(),
        "sampling_params": {"custom_params": {"x": 1}},
        "max_thinking_tokens": 7,
    }
    (one,), _ = parse_generate(body, vocab_size=64, context_length=512, encode=None,
                               strict_thinking=True, custom_logits=True)  # fmt: skip
    assert one.custom_params == {"x": 1, "thinking_budget": 7}


# ---- a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("custom-logits") / "m", seed=5)


@pytest.fixture(scope="module")
def url(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    flags = ("--enable-custom-logit-processor", "--chat-template", str(template))
    with builtin_engine(model, *flags) as engine:
        yield engine


@torch.no_grad()
def _greedy_without(model: torch.nn.Module, prompt: list[int], n: int, banned: list[int]):
    """transformers' greedy tokens and their log-probs with ``banned`` at ``-inf``."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[banned] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        lps.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return out, lps


def _generate(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=60)


@pytest.mark.timeout(180)
def test_a_processor_bans_tokens_as_transformers_would_without_them(
    url: str, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DisallowedTokensLogitsProcessor, sent as SGLang's class writes it: greedy tokens and
    log-probs as transformers' with those logits at -inf; a batch's other prompt unchanged."""
    prompt, plain = [5, 17, 33, 8], [9, 12, 40]
    params = {"max_new_tokens": 8, "temperature": 0}
    free = _generate(url, {"input_ids": prompt, "sampling_params": params}).json()["output_ids"]
    banned = sorted(set(free[:3]))
    body = {
        "input_ids": [prompt, plain],
        "sampling_params": [{**params, "custom_params": {"token_ids": banned}}, params],
        "custom_logit_processor": [_sglang_string(monkeypatch), None],
        "return_logprob": True,
    }
    answer = _generate(url, body)
    assert answer.status_code == 200, answer.text
    first, second = answer.json()
    want, want_lps = _greedy_without(load_reference(model), prompt, 8, banned)
    assert first["output_ids"] == want and not set(banned) & set(want)
    got_lps = [entry[0] for entry in first["meta_info"]["output_token_logprobs"]]
    assert got_lps == pytest.approx(want_lps, abs=1e-4)
    alone = _generate(url, {"input_ids": plain, "sampling_params": params}).json()
    assert second["output_ids"] == alone["output_ids"]


@pytest.mark.timeout(180)
def test_a_clients_own_class_reads_its_request_each_step(url: str, client: dict[str, str]) -> None:
    """A class of the client's __main__: ``__req__`` shows the tokens sampled so far (none at
    the prefill's), streamed too; the forced tokens have log-prob 0."""
    body = {
        "input_ids": [[3, 4, 5], [6]],
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 1.0,
            "custom_params": {"first": 20},
        },
        "custom_logit_processor": client["CountUp"],
        "return_logprob": True,
    }
    for answer in _generate(url, body).json():
        assert answer["output_ids"] == [20, 21, 22, 23, 24]
        assert [e[0] for e in answer["meta_info"]["output_token_logprobs"]] == [0.0] * 5
    streamed = requests.post(url + "/generate", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200 and b'"output_ids":[20,21,22,23,24]' in streamed.content


@pytest.mark.timeout(180)
def test_a_failing_processor_aborts_its_request_and_the_engine_serves_on(
    url: str, client: dict[str, str]
) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    failed = _generate(url, {"input_ids": [1, 2, 3], "sampling_params": params,
                             "custom_logit_processor": client["Divides"]}).json()  # fmt: skip
    reason = failed["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "Divides: raised ZeroDivisionError" in reason["message"]
    refused = _generate(url, {"input_ids": [1, 2], "custom_logit_processor": '{"callable": "00"}'})
    assert refused.status_code == 400 and "custom_logit_processor" in refused.text
    info = requests.get(url + "/server_info", timeout=30).json()
    assert info["enable_custom_logit_processor"] is True
    assert info["custom_logit_processor_failures"] >= 1
    fine = _generate(url, {"input_ids": [1, 2, 3], "sampling_params": params}).json()
    assert fine["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.timeout(180)
def test_the_openai_routes_take_a_processor_and_its_params(
    url: str, client: dict[str, str]
) -> None:
    openai = OpenAI(base_url=url + "/v1", api_key="none")
    name = openai.models.list().data[0].id
    done = openai.completions.create(
        model=name,
        prompt=[7, 8, 9],
        max_tokens=4,
        temperature=0,
        extra_body={
            "custom_logit_processor": client["CountUp"],
            "custom_params": {"first": 30},
            "return_text_in_logprobs": False,
        },
        logprobs=0,
    )
    assert done.choices[0].logprobs.token_logprobs == [0.0] * 4
    tokens = requests.post(url + "/v1/detokenize", json={"tokens": [30, 31, 32, 33]}, timeout=30)
    assert done.choices[0].text.split() == tokens.json()["text"].split()
    chat = openai.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "w7 w8"}], max_tokens=3, n=2,
        temperature=1.0,
        extra_body={"custom_logit_processor": client["CountUp"], "custom_params": {"first": 40}},
    )  # fmt: skip
    for choice in chat.choices:
        assert choice.message.content.split() == ["w40", "w41", "w42"]


def test_the_engine_keeps_a_bounded_number_of_processor_classes() -> None:
    """A client sending new classes forever does not grow the engine forever: the newest
    ``MAX_LOADED`` stay loaded, an older one is loaded again when it comes back."""
    texts = []
    for i in range(custom_logits.MAX_LOADED + 6):
        space: dict = {"__name__": "__main__"}
        source = (
            "from stages.engine.custom_logits import CustomLogitProcessor\n"
            f"class P{i}(CustomLogitProcessor):\n"
            "    def __call__(self, logits, custom_param_list=None):\n"
            "        return logits\n"
        )
        exec(compile(source, "<client>", "exec"), space)
        texts.append(space[f"P{i}"].to_str())
    for text in texts:
        processor_class(text)
    assert len(custom_logits._LOADED) == custom_logits.MAX_LOADED
    assert texts[0] not in custom_logits._LOADED and texts[-1] in custom_logits._LOADED
    assert processor_class(texts[0]).__name__ == "P0"


@pytest.mark.timeout(120)
async def test_the_generators_sampling_config_sends_a_processor_by_name(url: str) -> None:
    """``stages.generator.sampling.custom_logit_processor`` (a shipped class by name) and
    ``custom_params``: the generator's client sends them as SGLang's fields, and a group's
    samples never draw the banned tokens (drawn often without)."""
    import aiohttp

    from stages.generator.client import EngineClient
    from stages.generator.stage import SamplingConfig

    plain = SamplingConfig(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(url, session)
        rids = [f"free-{i}" for i in range(8)]
        free = await client.generate_group([5, 17, 33], plain.as_params(), rids=rids)
        counts: dict[int, int] = {}
        for sample in free:
            for token in sample.output_ids.tolist():
                counts[token] = counts.get(token, 0) + 1
        banned = sorted(counts, key=counts.get, reverse=True)[:3]  # the most drawn
        config = SamplingConfig(
            temperature=1.0, max_new_tokens=8, ignore_eos=True,
            custom_logit_processor="DisallowedTokensLogitsProcessor",
            custom_params={"token_ids": banned},
        )  # fmt: skip
        rids = [f"banned-{i}" for i in range(8)]
        samples = await client.generate_group([5, 17, 33], config.as_params(), rids=rids)
    drawn = {token for sample in samples for token in sample.output_ids.tolist()}
    assert drawn and not drawn & set(banned)
    with pytest.raises(ValueError, match="one of SGLang's shipped processors"):
        SamplingConfig(custom_logit_processor="NoSuchProcessor")


@pytest.mark.timeout(120)
def test_a_processor_reads_the_whole_output_after_a_retracting_pause(
    url: str, client: dict[str, str]
) -> None:
    """A request retracted by ``/pause_generation`` (mode retract) and prefilled again after
    ``/continue_generation``: its processor's ``__req__.output_ids`` still holds every token
    sampled before, so the forced count goes on where it stopped."""
    import threading
    import time

    body = {
        "input_ids": [3, 4],
        "sampling_params": {"max_new_tokens": 60, "temperature": 1.0,
                            "custom_params": {"first": 10}},
        "custom_logit_processor": client["CountUp"],
    }  # fmt: skip
    answer: dict[str, Any] = {}
    assert requests.post(url + "/slow_down", json={"forward_sleep_time": 0.02}).ok
    sender = threading.Thread(target=lambda: answer.update(_generate(url, body).json()))
    sender.start()
    try:
        deadline = time.monotonic() + 30
        while requests.get(url + "/server_info").json()["num_running_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        time.sleep(0.2)  # some tokens sampled
        paused = requests.post(url + "/pause_generation", json={"mode": "retract"})
        assert paused.ok
        assert requests.get(url + "/server_info").json()["num_waiting_reqs"] == 1
    finally:
        requests.post(url + "/continue_generation", json={})
        requests.post(url + "/slow_down", json={"forward_sleep_time": None})
    sender.join(60)
    assert answer["output_ids"] == list(range(10, 70))
    assert answer["meta_info"]["num_retractions"] == 1
