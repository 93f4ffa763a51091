"""The built-in engine as a real server process, spoken to over HTTP as a generator would."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.engine.identity import ENGINE_ID_HEADER
from tests.numerics import assert_close, forward_terms
from tests.stages.engine_setup import EngineProcess, sglang_text
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

ROOT = Path(__file__).resolve().parents[2]


class Engine:
    def __init__(
        self, url: str, model_dir: Path, log_file: Path, engine_id: str | None = None
    ) -> None:
        self.url = url
        self.model_dir = model_dir
        self.log_file = log_file
        self.engine_id = engine_id  # what its /health names it by (stages.engine.identity)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        timeout: float = 30,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = resp.read()
                return resp.status, json.loads(text) if text else None
        except urllib.error.HTTPError as exc:
            text = exc.read()
            return exc.code, json.loads(text) if text else None

    def generate(self, body: dict[str, Any]) -> Any:
        status, out = self.request("POST", "/generate", body)
        assert status == 200, out
        return out


@contextlib.contextmanager
def serving(
    model_dir: Path, log_file: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[Engine]:
    """``inflight engine`` on ``model_dir`` as a user starts it (``extra``: more flags), until
    it answers ``/health``; stopped at the end, and it must exit cleanly."""
    flags = ("--max-running", "8", "--log-file", str(log_file), *extra)
    proc = EngineProcess(model_dir, *flags, env=env, tail=log_file)
    yield Engine(proc.wait_up(60), model_dir, log_file, proc.engine_id)
    assert proc.stop(15) == 0, proc.tail()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("engine")
    model_dir = make_tiny_model(root / "model", vocab=128, seed=1)
    # SGLANG_HEALTH_CHECK_TIMEOUT: what /health_generate waits for a step
    with serving(
        model_dir, root / "engine.log", "--max-request-mb", "2",
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"},
    ) as eng:  # fmt: skip
        yield eng


@pytest.fixture(scope="module")
def ref_model(engine: Engine) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare whole sequences (ignore_eos)
    return model


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.mark.timeout(60)
def test_greedy_matches_transformers_generate(engine: Engine, ref_model: torch.nn.Module) -> None:
    prompt = [5, 17, 33, 8, 90]
    out = engine.generate(
        {
            "input_ids": prompt,
            "rid": "greedy-1",
            "return_logprob": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 24},
        }
    )
    assert out["output_ids"] == _hf_greedy(ref_model, prompt, 24)
    meta = out["meta_info"]
    assert meta["id"] == "greedy-1"
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 24
    assert meta["weight_version"] == "0"
    assert meta["output_token_weight_versions"] == ["0"] * 24
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 24}]
    # no output token: one empty span of the live version (SGLang 0.5.23's
    # weight_versions.py compute_weight_version_spans with num_output_tokens 0)
    scored = engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert scored["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 0}]
    assert (
        out["text"].split() == [f"w{t}" if t > 2 else "" for t in out["output_ids"]] or out["text"]
    )

    # Log-probs: one per token, finite, <= 0, and log_softmax of the model's logits.
    logprobs = meta["output_token_logprobs"]
    assert [row[1] for row in logprobs] == out["output_ids"]
    # logprob_start_len -1 (SGLang's default): no prompt log-probs, the key is there all the same
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 24
    assert all(row[2] is None for row in logprobs)
    with torch.no_grad():
        full = torch.tensor([prompt + out["output_ids"]])
        logits = ref_model(full).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["output_ids"])[:, None])
    got = torch.tensor([row[0] for row in logprobs])
    assert all(math.isfinite(x) and x <= 0 for x in got.tolist())
    assert_close(got, expected[:, 0], terms=forward_terms(ref_model.config, full.shape[1]))


@pytest.mark.timeout(60)
def test_top_logprobs_are_the_most_likely_tokens_of_each_step(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    # SGLang's top_logprobs_num: from the log-probs the sampled token's comes from
    # (srt/layers/sampler.py: log_softmax(logits / T), greedy log_softmax(logits)), most likely
    # first; here against transformers' forward
    prompt, k = [7, 8, 9], 4
    for params in ({**GREEDY}, {"temperature": 0.7, "ignore_eos": True, "sampling_seed": 3}):
        out = engine.generate(
            {
                "input_ids": prompt,
                "return_logprob": True,
                "top_logprobs_num": k,
                "sampling_params": {**params, "max_new_tokens": 6},
            }
        )
        ids, meta = out["output_ids"], out["meta_info"]
        tops = meta["output_top_logprobs"]
        assert len(tops) == 6 and all(len(step) == k for step in tops)
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / (params.get("temperature") or 1.0), -1)
        terms = forward_terms(ref_model.config, len(prompt) + 6)
        for step, row, (lp, tok, _) in zip(
            tops, expected, meta["output_token_logprobs"], strict=True
        ):
            values = [entry[0] for entry in step]
            assert values == sorted(values, reverse=True)
            assert_close(values, row.topk(k).values, terms=terms)
            assert_close([row[e[1]] for e in step], values, terms=terms)  # each id's own
            if not params.get("temperature"):
                # greedy: the argmax was drawn (its log-prob summed in another order)
                assert step[0][1] == tok and math.isclose(step[0][0], lp, abs_tol=1e-6)
    # without return_logprob there are none (SGLang returns them only with it)
    plain = engine.generate(
        {
            "input_ids": prompt,
            "top_logprobs_num": k,
            "sampling_params": {**GREEDY, "max_new_tokens": 2},
        }
    )
    assert "output_top_logprobs" not in plain["meta_info"]
    # and logprob_start_len means nothing without return_logprob (SGLang ignores it then)
    plain = engine.generate(
        {
            "input_ids": prompt,
            "logprob_start_len": 0,
            "sampling_params": {**GREEDY, "max_new_tokens": 2},
        }
    )
    assert "input_token_logprobs" not in plain["meta_info"]


@pytest.mark.timeout(60)
def test_concurrent_staggered_requests_match_each_alone(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    prompts = [[3 + i, 40 + 2 * i, 7, 100 - i][: 1 + i % 4] + [11] * (i % 3) for i in range(10)]
    lengths = [8 + 3 * i for i in range(10)]

    def one(i: int) -> list[int]:
        time.sleep(0.03 * i)  # join while the others are mid-decode
        out = engine.generate(
            {"input_ids": prompts[i], "sampling_params": {**GREEDY, "max_new_tokens": lengths[i]}}
        )
        return out["output_ids"]

    with ThreadPoolExecutor(10) as pool:
        together = list(pool.map(one, range(10)))
    for i in range(10):
        assert together[i] == _hf_greedy(ref_model, prompts[i], lengths[i]), i


@pytest.mark.timeout(60)
def test_batch_input_ids_returns_a_list(engine: Engine, ref_model: torch.nn.Module) -> None:
    prompts = [[4, 5, 6], [70, 71], [9]]
    out = engine.generate(
        {
            "input_ids": prompts,
            "rid": ["b0", "b1", "b2"],
            "sampling_params": {**GREEDY, "max_new_tokens": 6},
        }
    )
    assert [o["meta_info"]["id"] for o in out] == ["b0", "b1", "b2"]
    assert [o["output_ids"] for o in out] == [_hf_greedy(ref_model, p, 6) for p in prompts]


@pytest.mark.timeout(60)
def test_text_input_uses_the_tokenizer(engine: Engine, ref_model: torch.nn.Module) -> None:
    out = engine.generate(
        {"text": "w10 w20 w30", "sampling_params": {**GREEDY, "max_new_tokens": 5}}
    )
    assert out["meta_info"]["prompt_tokens"] == 3
    assert out["output_ids"] == _hf_greedy(ref_model, [10, 20, 30], 5)


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible_and_logprobs_valid(engine: Engine) -> None:
    body = {
        "input_ids": [12, 13, 14],
        "return_logprob": True,
        "sampling_params": {
            "temperature": 0.9,
            "top_p": 0.9,
            "top_k": 50,
            "max_new_tokens": 20,
            "ignore_eos": True,
            "sampling_seed": 7,
        },
    }
    first, second = engine.generate(body), engine.generate(body)
    assert first["output_ids"] == second["output_ids"]
    lps = [row[0] for row in first["meta_info"]["output_token_logprobs"]]
    assert len(lps) == 20 and all(math.isfinite(x) and x <= 0 for x in lps)
    other = engine.generate(
        {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 8}}
    )
    assert other["output_ids"] != first["output_ids"]


@pytest.mark.timeout(60)
def test_stop_token_ids_and_length(engine: Engine, ref_model: torch.nn.Module) -> None:
    prompt = [21, 22, 23]
    free = _hf_greedy(ref_model, prompt, 16)
    stop = free[5]
    first = free.index(stop)
    out = engine.generate(
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [stop]},
        }
    )
    assert out["output_ids"] == free[: first + 1]  # the matched token is part of the output
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # its text is not (SGLang's DetokenizerManager.trim_matched_stop), unless no_stop_trim
    tokenizer = _tokenizer(engine)
    assert out["text"] == sglang_text(tokenizer, prompt, free[:first])
    kept = engine.generate(
        {
            "input_ids": prompt,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 16,
                "stop_token_ids": [stop],
                "no_stop_trim": True,
            },
        }
    )
    assert kept["text"] == sglang_text(tokenizer, prompt, free[: first + 1])
    out = engine.generate({"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 3}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    # a stop token drawn as the last the length allows is the reason (SGLang 0.5.23's
    # Req.update_finish_state: stop strings, then stop tokens, then the length)
    params = {"temperature": 0, "max_new_tokens": first + 1, "stop_token_ids": [stop]}
    out = engine.generate({"input_ids": prompt, "sampling_params": params})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == free[: first + 1]


def _tokenizer(engine: Engine) -> Any:
    """The tokenizer as the engine loads it (the class its config names, not the model type's
    own, which AutoTokenizer would pick: stages.engine.loader)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(engine.model_dir)


def _free_words(
    engine: Engine, ref_model: torch.nn.Module
) -> tuple[Any, list[int], list[int], list[str]]:
    """The stop tests' run: the engine's tokenizer, a prompt, its 16 greedy tokens without stops
    (the reference model's) and each one's text."""
    tokenizer = _tokenizer(engine)
    prompt = [30, 31, 32]
    free = _hf_greedy(ref_model, prompt, 16)
    return tokenizer, prompt, free, [tokenizer.decode([t]) for t in free]


def _greedy16(engine: Engine, prompt: list[int], **params: Any) -> Any:
    """Up to 16 greedy tokens of ``prompt``, with ``params`` as more sampling parameters."""
    sampling = {**GREEDY, "max_new_tokens": 16, **params}
    return engine.generate({"input_ids": prompt, "sampling_params": sampling})


@pytest.mark.timeout(60)
def test_stop_strings_end_the_output_at_the_token_that_completes_them(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    # after SGLang's Req._check_str_based_finish and DetokenizerManager.trim_matched_stop
    tokenizer, prompt, free, words = _free_words(engine, ref_model)
    stop = f"{words[4]} {words[5]}"  # two tokens' text
    end = next(k for k in range(1, 17) if stop in tokenizer.decode(free[:k]))
    assert end <= 6
    full = sglang_text(tokenizer, prompt, free[:end])

    ask = functools.partial(_greedy16, engine, prompt)

    out = ask(stop=["no such words", stop])
    assert out["output_ids"] == free[:end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.find(stop)] and stop not in out["text"]
    kept = ask(stop=stop, no_stop_trim=True)
    assert kept["output_ids"] == free[:end] and kept["text"].endswith(stop)
    # a stop string completed by the last token the length allows is the reason (SGLang
    # 0.5.23's order: stop strings, stop tokens, the length); a stop string never seen
    # changes nothing
    assert ask(stop=stop, max_new_tokens=end)["meta_info"]["finish_reason"]["matched"] == stop
    assert ask(stop=stop, max_new_tokens=end - 1)["meta_info"]["finish_reason"]["type"] == "length"
    assert ask(stop="no such words")["output_ids"] == free
    # every sample of a batch and of n > 1 looks for its own
    both = engine.generate(
        {
            "input_ids": [prompt, [40, 41]],
            "sampling_params": [{**GREEDY, "max_new_tokens": 16, "stop": stop, "n": 2}] * 2,
        }
    )
    assert [o["output_ids"] for o in both[:2]] == [free[:end]] * 2
    assert all(len(o["output_ids"]) <= 16 for o in both[2:])


@pytest.mark.timeout(60)
def test_stop_regex_ends_the_output_where_the_end_of_its_text_matches(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    # after SGLang's SamplingParams.normalize (the window: get_max_seq_length + 1 tokens),
    # Req._check_str_based_finish (re.search in the decoded tail, after the stop strings) and
    # DetokenizerManager.trim_matched_stop (the pattern looked up as plain text)
    import re

    tokenizer, prompt, free, words = _free_words(engine, ref_model)

    def first_match(pattern: str, window: int) -> int:
        return next(
            k for k in range(1, 17) if re.search(pattern, tokenizer.decode(free[:k][-window:]))
        )

    ask = functools.partial(_greedy16, engine, prompt)

    # bounded: two words with a space or not between them, never written as such in the text
    bounded = rf"{re.escape(words[4])}\s?{re.escape(words[5])}"
    end = first_match(bounded, len(words[4]) + len(words[5]) + 2)
    assert end <= 6
    out = ask(stop_regex=bounded)
    assert out["output_ids"] == free[:end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": bounded}
    # not found as plain text, so nothing is cut: the match stays at the end
    assert out["text"] == sglang_text(tokenizer, prompt, free[:end])
    assert re.search(bounded + "$", out["text"])
    # unbounded (.*): the whole output is searched, so an early word still pairs with a late one
    spread = rf"{re.escape(words[1])}.*{re.escape(words[6])}"
    end = first_match(spread, 16)
    out = ask(stop_regex=["no such words", spread])
    assert out["output_ids"] == free[:end] and end >= 7
    assert out["meta_info"]["finish_reason"]["matched"] == spread
    # a pattern that is its own text is cut from it, as a stop string is (no_stop_trim: kept)
    plain = words[3].strip()
    assert re.escape(plain) == plain, plain
    end = first_match(plain, len(plain) + 1)
    full = sglang_text(tokenizer, prompt, free[:end])
    out = ask(stop_regex=plain)
    assert out["output_ids"] == free[:end] and out["text"] == full[: full.find(plain)]
    assert ask(stop_regex=plain, no_stop_trim=True)["text"].endswith(plain)
    # stop strings come first, the length limit last
    both = ask(stop=f"{words[1]} {words[2]}", stop_regex=plain)
    assert both["meta_info"]["finish_reason"]["matched"] == f"{words[1]} {words[2]}"
    assert (
        ask(stop_regex=plain, max_new_tokens=end)["meta_info"]["finish_reason"]["matched"] == plain
    )
    assert ask(stop_regex=plain, max_new_tokens=1)["meta_info"]["finish_reason"]["type"] == "length"
    assert ask(stop_regex="no such words")["output_ids"] == free


def test_stop_string_requests_are_checked_before_anything_runs() -> None:
    from stages.engine.protocol import RequestError, parse_generate

    def parse(stop: Any, encode: Any = lambda text: text.split()) -> Any:
        body = {"input_ids": [1, 2], "sampling_params": {"stop": stop}}
        return parse_generate(body, vocab_size=8, context_length=512, encode=encode)[0][0].params

    assert parse(["a b", "c"]).stop == ("a b", "c") and parse("a b").stop_window == 4
    assert parse(None).stop == () and parse([]).stop == ()
    for bad, words in (
        (5, "a string or a list"),
        (["a", 3], "a string or a list"),
        (["x"] * 33, "at most 32 stop strings"),
    ):
        with pytest.raises(RequestError, match=words) as info:
            parse(bad)
        assert info.value.field == "sampling_params.stop"
    with pytest.raises(RequestError, match="tokenizer"):
        parse("a", encode=None)


def test_stop_regex_requests_are_checked_before_anything_runs() -> None:
    # SGLang's SamplingParams.normalize: at most 32 patterns of at most 256 bytes
    from stages.engine.protocol import RequestError, parse_generate
    from stages.engine.stop_regex import UNBOUNDED, max_match_length

    def parse(**sampling: Any) -> Any:
        body = {"input_ids": [1, 2], "sampling_params": sampling}
        encode = sampling.pop("encode", lambda text: text.split())
        return parse_generate(body, vocab_size=8, context_length=512, encode=encode)[0][0].params

    assert parse(stop_regex=r"ab{2}|c").stop_regex == (r"ab{2}|c",)
    assert parse(stop_regex=r"ab{2}|c").stop_window == 4  # 3 characters at most, plus one
    assert parse(stop_regex=[r"\d+", "x"]).stop_window == UNBOUNDED + 1
    assert parse(stop_regex="x", stop="a bcdef").stop_window == 8  # one tail for both
    assert parse(stop_regex=None).stop_regex == () and parse(stop_regex=[]).stop_regex == ()
    assert [max_match_length(p) for p in ("^(ab){2,3}$", "a(?:bc)?", "[^a]", "x(?=y)")] == [
        6,
        3,
        UNBOUNDED,
        UNBOUNDED,
    ]
    for bad, words in (
        (5, "a string or a list"),
        (["a", 3], "a string or a list"),
        (["x"] * 33, "at most 32 stop_regex patterns"),
        ("é" * 129, "258 bytes, over the 256-byte limit"),
        ("(ab", "not a valid regular expression"),
        (["a", "b)"], "pattern 1 'b\\)' is not a valid"),
    ):
        with pytest.raises(RequestError, match=words) as info:
            parse(stop_regex=bad)
        assert info.value.field == "sampling_params.stop_regex"
    with pytest.raises(RequestError, match="tokenizer"):
        parse(stop_regex="a", encode=None)


def _wait_running(engine: Engine, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while engine.request("GET", "/get_server_info")[1]["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.002)


@pytest.mark.timeout(60)
def test_pause_in_place_then_continue_finishes_whole(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    prompt, n = [50, 51, 52], 480
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=engine.generate(
                {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": n}}
            )
        )
    )
    worker.start()
    _wait_running(engine)
    paused = engine.request("POST", "/pause_generation", {"mode": "in_place"})
    assert paused == (200, {"message": "Generation paused successfully.", "status": "ok"})
    steps = engine.request("GET", "/get_server_info")[1]["decode_steps"]
    time.sleep(0.2)
    info = engine.request("GET", "/get_server_info")[1]
    assert info["decode_steps"] == steps and info["num_running_reqs"] == 1  # held in place
    assert worker.is_alive()
    # no step within SGLANG_HEALTH_CHECK_TIMEOUT (2 s here): unhealthy, as SGLang says
    assert engine.request("GET", "/health_generate")[0] == 503
    assert engine.request("GET", "/health")[0] == 200  # the process is up
    assert engine.request("GET", "/ping")[0] == 200  # SGLang's /ping: paused is healthy
    # ContinueGenerationReqInput (io_struct.py): torch_empty_cache; unknown fields ignored
    # (msgspec_utils: extra_behavior="ignore"), a field of the wrong type refused in SGLang's
    # validation shape (1 or "yes" would be true: pydantic's lax bool)
    status, answer = engine.request("POST", "/continue_generation", {"torch_empty_cache": "x"})
    assert status == 400 and answer["type"] == "Bad Request", answer
    assert answer["message"].startswith("torch_empty_cache: Input should be a valid boolean")
    continued = engine.request(
        "POST", "/continue_generation", {"torch_empty_cache": False, "not_a_field": 1}
    )
    assert continued == (200, {"message": "Generation continued successfully.", "status": "ok"})
    assert engine.request("GET", "/health_generate")[0] == 200
    worker.join(30)
    out = result["out"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert out["output_ids"] == _hf_greedy(ref_model, prompt, n)


@pytest.mark.timeout(60)
def test_an_abort_during_an_in_place_pause_ends_at_the_first_pass_after_continue(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    """SGLang's paused scheduler marks a running request that is aborted (or whose client
    went away) with ``to_finish`` (scheduler.py ``abort_request``, "Abort method 3") and takes
    it out at its first decode pass after ``/continue_generation``, whose token it keeps
    (``process_batch_result_decode``: ``output_ids.extend``, then ``update_finish_state``
    finishes it with ``to_finish``): the client has no answer until then, and the answer has
    one token more than the pause left it with."""
    long = {**GREEDY, "max_new_tokens": 480}
    plain_prompt, streamed_prompt = [90, 91, 92], [93, 94]
    result: dict[str, Any] = {}
    chunks: list[Any] = []
    plain = threading.Thread(
        target=lambda: result.update(
            out=engine.generate(
                {"input_ids": plain_prompt, "rid": "plain-held", "sampling_params": long}
            )
        )
    )

    def read_stream() -> None:
        body = {"input_ids": streamed_prompt, "rid": "streamed-held", "stream": True,
                "sampling_params": long}  # fmt: skip
        headers = {"Content-Type": "application/json"}
        sent = urllib.request.Request(engine.url + "/generate", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(sent, timeout=30) as answer:
            for line in answer:
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    chunks.append(json.loads(line[6:]))

    streamed = threading.Thread(target=read_stream)
    plain.start()
    streamed.start()
    _wait_running(engine, 2)
    while not chunks:
        time.sleep(0.002)
    assert engine.request("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        for rid in ("plain-held", "streamed-held"):
            assert engine.request("POST", "/abort_request", {"rid": rid}) == (200, None)
        time.sleep(0.3)  # had the aborts ended them, they would have answered by now
        assert plain.is_alive() and streamed.is_alive()
        assert engine.request("GET", "/get_server_info")[1]["num_running_reqs"] == 2
    finally:
        assert engine.request("POST", "/continue_generation", {})[0] == 200
    plain.join(30)
    streamed.join(30)
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    *before, held, last = chunks  # held: the last chunk of a step before the pause
    assert all(c["meta_info"]["finish_reason"] is None for c in [*before, held])
    assert last["meta_info"]["finish_reason"] == aborted
    sent = len(held["output_ids"])
    assert last["output_ids"] == _hf_greedy(ref_model, streamed_prompt, sent + 1)
    out = result["out"]
    assert out["meta_info"]["finish_reason"] == aborted
    n = out["meta_info"]["completion_tokens"]
    assert 1 < n < 480 and out["output_ids"] == _hf_greedy(ref_model, plain_prompt, n)
    assert engine.request("GET", "/get_server_info")[1]["num_running_reqs"] == 0


@pytest.mark.timeout(60)
def test_abort_request_returns_abort(engine: Engine) -> None:
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=engine.generate(
                {
                    "input_ids": [60, 61],
                    "rid": "to-abort",
                    "sampling_params": {**GREEDY, "max_new_tokens": 480},
                }
            )
        )
    )
    worker.start()
    _wait_running(engine)
    # SGLang 0.5.23 answers 200 with an empty body (http_server.abort_request)
    assert engine.request("POST", "/abort_request", {"rid": "to-abort"}) == (200, None)
    worker.join(30)
    meta = result["out"]["meta_info"]
    # SGLang 0.5.23 ends a running request with FINISH_ABORT() (scheduler.py abort_request:
    # req.to_finish = FINISH_ABORT(); schedule_batch.py FINISH_ABORT.to_json)
    assert meta["finish_reason"] == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None
    }  # fmt: skip
    assert meta["completion_tokens"] == len(result["out"]["output_ids"]) < 480


def _send(engine: Engine, results: dict[str, Any], name: str, body: Any) -> threading.Thread:
    """POST ``body`` to /generate on a thread of its own; its answer goes to ``results``."""
    worker = threading.Thread(target=lambda: results.update({name: engine.generate(body)}))
    worker.start()
    return worker


def _wait_waiting(engine: Engine, count: int) -> None:
    deadline = time.monotonic() + 10
    while engine.request("GET", "/get_server_info")[1]["num_waiting_reqs"] < count:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.002)


@pytest.mark.timeout(60)
def test_an_aborted_waiting_request_ends_as_sglangs_tokenizer_ends_it(engine: Engine) -> None:
    """A request aborted while it waits in the queue (here behind a full batch) is answered by
    SGLang's tokenizer, not its scheduler (tokenizer_manager.py ``_handle_abort_req``):
    ``Abort in waiting queue``, and a ``meta_info`` of its fields only; every sample of an
    ``n`` > 1 request alike, a stream's last chunk too."""
    results: dict[str, Any] = {}
    long = {**GREEDY, "max_new_tokens": 480, "n": 8}  # the engine's --max-running: 8
    first = {"input_ids": [72, 73], "rid": "was-running", "sampling_params": long}
    running = _send(engine, results, "running", first)
    _wait_running(engine, 8)
    two = {**GREEDY, "max_new_tokens": 8, "n": 2}
    queued = _send(
        engine, results, "queued", {"input_ids": [74, 75], "rid": "queued", "sampling_params": two}
    )
    streamed: dict[str, Any] = {}
    body = {"input_ids": [76], "rid": "streamed", "stream": True, "return_logprob": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 8}}  # fmt: skip

    def read_stream() -> None:
        sent = urllib.request.Request(
            engine.url + "/generate",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(sent, timeout=30) as answer:
            lines = [line[6:].strip() for line in answer if line.startswith(b"data: ")]
        streamed["events"] = [line if line == b"[DONE]" else json.loads(line) for line in lines]

    stream = threading.Thread(target=read_stream)
    stream.start()
    _wait_waiting(engine, 3)
    for rid in ("queued", "streamed", "was-running"):
        assert engine.request("POST", "/abort_request", {"rid": rid})[0] == 200
    for worker in (queued, stream, running):
        worker.join(30)
    waiting = {"type": "abort", "message": "Abort in waiting queue"}
    # the meta_info of _handle_abort_req, in its order (the log-probs with return_logprob;
    # Inflight's per-token versions after SGLang's spans)
    head = ["id", "finish_reason", "weight_version", "e2e_latency", "weight_versions",
            "output_token_weight_versions"]  # fmt: skip
    tail = ["completion_tokens", "response_sent_to_client_ts"]
    logprobs = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]
    for sample in results["queued"]:
        assert sample["meta_info"]["finish_reason"] == waiting
        assert sample["output_ids"] == [] and sample["meta_info"]["completion_tokens"] == 0
        assert list(sample["meta_info"]) == head + tail
    *_, last, done = streamed["events"]
    assert done == b"[DONE]" and last["meta_info"]["finish_reason"] == waiting
    assert list(last["meta_info"]) == head + logprobs + tail
    for sample in results["running"]:
        assert sample["meta_info"]["finish_reason"]["message"] == "Aborted"


@pytest.mark.timeout(60)
def test_a_pause_holds_new_requests_out_of_an_aborts_reach(engine: Engine) -> None:
    """During a pause SGLang's tokenizer holds a new request before its scheduler
    (tokenizer_manager.py ``generate_request``: ``is_pause_cond``), so neither
    ``/abort_request`` nor ``abort_all`` reaches it, and it runs after
    ``/continue_generation``; a request a retracting pause sent back to the queue is in the
    scheduler, and an abort ends it as waiting, with the tokens SGLang's tokenizer had and
    their version (weight_versions.py ``add_weight_versions_to_meta_info``), not the one live
    then."""
    results: dict[str, Any] = {}
    live = engine.request("GET", "/model_info")[1]["weight_version"]
    long = {**GREEDY, "max_new_tokens": 480}
    first = {"input_ids": [72, 73], "rid": "was-running", "sampling_params": long}
    running = _send(engine, results, "running", first)
    _wait_running(engine)
    try:
        assert engine.request("POST", "/pause_generation", {"mode": "retract"})[0] == 200
        four = {**GREEDY, "max_new_tokens": 4}
        held = _send(
            engine, results, "held", {"input_ids": [74, 75], "rid": "held", "sampling_params": four}
        )
        deadline = time.monotonic() + 10
        while engine.request("GET", "/get_server_info")[1]["num_held_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never came"
            time.sleep(0.002)
        info = engine.request("GET", "/get_server_info")[1]
        assert info["num_waiting_reqs"] == 1  # the retracted one: the held one is not counted
        assert engine.request("POST", "/abort_request", {"rid": "held"}) == (200, None)
        # /update_weight_version's abort_all (its default) ends the retracted one, not the other
        assert engine.request("POST", "/update_weight_version", {"new_version": "w2"})[0] == 200
        running.join(30)
        assert held.is_alive()
    finally:
        engine.request("POST", "/continue_generation", {})
    held.join(30)
    engine.request("POST", "/update_weight_version", {"new_version": live})
    was_running, meta = results["running"], results["running"]["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    count = len(was_running["output_ids"])
    # the tokens SGLang's tokenizer had been sent: every 50 of a request not streamed
    assert count % 50 == 0 and meta["completion_tokens"] == count
    assert meta["weight_version"] == live
    assert meta["weight_versions"] == [{"version": live, "start": 0, "end": count}]
    assert results["held"]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert results["held"]["meta_info"]["weight_version"] == "w2"


def test_a_request_id_in_flight_is_refused_in_sglangs_words(engine: Engine) -> None:
    """tokenizer_manager.py: ``ValueError(f"Duplicate request ID detected: {rid}")`` while
    its ``rid_to_state`` holds the rid: ``/generate``'s ``{"error": {"message"}}``, the
    ``/v1`` routes' ``create_error_response`` (no ``param``); the first request runs on."""
    results: dict[str, Any] = {}
    first = {"input_ids": [72, 73], "rid": "twice", "sampling_params": {**GREEDY,
             "max_new_tokens": 480}}  # fmt: skip
    running = _send(engine, results, "first", first)
    _wait_running(engine)
    try:
        again = {**first, "sampling_params": {**GREEDY, "max_new_tokens": 2}}
        status, answer = engine.request("POST", "/generate", again)
        assert (status, answer) == (
            400,
            {"error": {"message": "Duplicate request ID detected: twice"}},
        )
        body = {"model": "m", "prompt": [72, 73], "max_tokens": 2, "rid": "twice"}
        status, answer = engine.request("POST", "/v1/completions", body)
        assert status == 400 and answer["message"] == "Duplicate request ID detected: twice"
        assert answer["param"] is None and answer["type"] == "BadRequestError", answer
        assert running.is_alive()
    finally:
        engine.request("POST", "/abort_request", {"rid": "twice"})
        running.join(30)
    assert results["first"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_only_an_abort_with_an_error_status_refuses_the_request() -> None:
    """SGLang's ``_handle_abort_finish_reason``: an abort whose ``status_code`` is 400 to 599
    turns a request not streamed into an error answer; other reasons are answered."""
    from stages.engine.aborts import (
        ABORTED_COMPILING,
        ABORTED_RUNNING,
        ABORTED_WAITING,
        raise_aborted_with_error,
    )
    from stages.engine.request_error import AbortedWithError

    answered = [{"type": "length", "length": 3}, ABORTED_RUNNING, ABORTED_WAITING, None]
    raise_aborted_with_error([*answered, {**ABORTED_RUNNING, "status_code": 302}])
    with pytest.raises(AbortedWithError) as refused:
        raise_aborted_with_error([*answered, ABORTED_COMPILING])
    assert (str(refused.value), refused.value.status) == ("Aborted by AbortReq.", 400)
    with pytest.raises(AbortedWithError) as failed:
        raise_aborted_with_error([{"type": "abort", "message": "m", "status_code": 500}])
    assert failed.value.status == 500


@pytest.mark.timeout(60)
def test_update_weight_version_aborts_everything_unless_told_not_to(engine: Engine) -> None:
    # SGLang 0.5's UpdateWeightVersionReqInput: abort_all_requests defaults to true
    for abort_all, version in ((None, "7"), (False, "8")):
        result: dict[str, Any] = {}
        body = {"input_ids": [70, 71], "sampling_params": {**GREEDY, "max_new_tokens": 200}}
        worker = threading.Thread(
            target=lambda body=body, result=result: result.update(out=engine.generate(body))
        )
        worker.start()
        _wait_running(engine)
        update = {"new_version": version}
        if abort_all is not None:
            update["abort_all_requests"] = abort_all
        status, answer = engine.request("POST", "/update_weight_version", update)
        assert status == 200 and answer["success"] is True and answer["new_version"] == version
        worker.join(30)
        reason = result["out"]["meta_info"]["finish_reason"]
        assert reason["type"] == ("abort" if abort_all is None else "length"), reason
        assert engine.request("GET", "/model_info")[1]["weight_version"] == version
    engine.request("POST", "/update_weight_version", {"new_version": "0"})


# the JSON contract gate's refusals: 400 {"error": "<serde's words>"} (generate_contract)
CONTRACT = "contract"
BAD_REQUESTS = [
    (b"{not json", "body.1: JSON decode error"),  # FastAPI's json_invalid, then GenerateReqInput
    (b"[1, 2]", "Input should be a dictionary or an instance of GenerateReqInput"),
    ({"input_ids": []}, "input_ids"),
    (
        {"input_ids": [1, "x"]},
        "input_ids: Value error, contains non-int64 element",
    ),  # GenerateReqInput
    ({"input_ids": [1, 128]}, "input_ids[1]"),
    ({"input_ids": [1, -1]}, "input_ids[1]"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, CONTRACT),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10_000}}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, CONTRACT),
    (
        {"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}},
        "sampling_params.frequency_penalty",
    ),
    ({"input_ids": [1], "sampling_params": "fast"}, "sampling_params.list[dict[str,any]]: "),
    ({"input_ids": [1], "stream": 1}, CONTRACT),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [1], "logprob_start_len": "0"}, CONTRACT),
    ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 129}, "top_logprobs_num"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"text": 5}, "text.list[str]: Input should be a valid list"),
    ({}, "input_ids"),
    # SGLang's rule: every entry of a sampling_params list asks for the same n
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
        "sampling_params[1].n",
    ),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"n": "2"}}, CONTRACT),
    ({"input_ids": [1], "sampling_params": {"n": 2}, "rid": ["a", "b"]}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    # SGLang 0.5.23's fields beyond their neutral values: what the engine does not have
    ({"input_ids": [1], "data_parallel_rank": 1}, "data_parallel_rank"),
    ({"input_ids": [1], "extra_key": 5}, "extra_key.list[str]: Input should be a valid list"),
    ({"input_ids": [[1], [2]], "cache_salt": ["a"]}, "cache_salt"),
    ({"input_ids": [1], "max_thinking_tokens": 64}, "max_thinking_tokens"),
    # routed experts: taken without --enable-return-routed-experts (none come, as SGLang
    # answers without its capturer), the start checked all the same
    (
        {"input_ids": [1], "return_routed_experts": True, "routed_experts_start_len": 2},
        "routed_experts_start_len",
    ),
    # SGLang 0.5.23's beam search (sampling_params.beam_width > 1); below 1 its own refusal
    ({"input_ids": [1], "sampling_params": {"beam_width": 2}}, "sampling_params.beam_width"),
    ({"input_ids": [1], "sampling_params": {"beam_width": 0}}, "sampling_params.beam_width"),
    # SGLang 0.5.23's watermark: this engine, as SGLang without --enable-watermark, serves
    # none or one turned off (test_a_watermark_is_served_off_and_refused_on says the words)
    ({"input_ids": [1], "watermark": {"enabled": True}}, "watermark"),
    ({"input_ids": [[1], [2]], "watermark": [None]}, "watermark"),
    ({"input_ids": [1], "sampling_params": {"watermark": {"key": "ab"}}}, "sampling_params"),
    # priority: a signed 64-bit integer (TokenizerManager._set_default_priority)
    ({"input_ids": [1], "priority": 1 << 63}, "priority"),
    ({"input_ids": [1], "priority": "high"}, "priority: Input should be a valid integer"),
    # read as FastAPI reads a body (Python's json): NaN, Infinity and integers past 64 bits
    # reach the checks (orjson refused the first two and read the last as floats)
    (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "sampling_params.temp"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": Infinity}}', CONTRACT),
    (b'{"input_ids": [1, 100000000000000000000]}', "input_ids: Value error, contains non-int64"),
    (
        b'{"input_ids": [1], "sampling_params": {"sampling_seed": 9223372036854775808}}',
        "sampling_params.sampling_seed",
    ),  # SamplingParams.verify's range
    # a lone surrogate, which no text holds: refused as no JSON (SGLang's pydantic: not a str)
    (b'{"text": "\\ud800"}', "body.10: JSON decode error"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("body", "field"), BAD_REQUESTS)
def test_bad_requests_get_400_naming_the_field(engine: Engine, body: Any, field: str) -> None:
    """In SGLang 0.5.23's three shapes: GenerateReqInput's types (its validation handler's
    ErrorResponse, ``type: "Bad Request"``), the JSON contract (``{error: text}``, its words
    checked in test_the_contract_gate_answers_in_sglangs_words), the route's own checks
    (``{error: {message}}``, the field first)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = engine.request("POST", "/generate", raw=raw)
    assert status == 400, answer
    if field == CONTRACT:
        assert isinstance(answer["error"], str), answer
        assert answer["error"].startswith(("invalid type", "unknown field")), answer
    elif ":" in field or field.startswith("Input should"):
        assert answer["type"] == "Bad Request" and answer["param"] is None, answer
        assert answer["message"].startswith(field), answer
    else:
        assert answer["error"]["message"].startswith(field), answer
    assert engine.request("GET", "/health")[0] == 200


@pytest.mark.timeout(60)
def test_values_past_any_vocabulary_or_64_bits_are_served(engine: Engine) -> None:
    """A ``top_k`` past the vocabulary keeps every token and ``stop_token_ids`` that no
    vocabulary has never match (SGLang takes both), however large: once they failed the
    scheduler's step (no tensor holds 2**70) and every request in it; a negative one masked a
    token from the vocabulary's end under ``min_new_tokens``."""
    plain = {"input_ids": [5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    status, greedy = engine.request("POST", "/generate", plain)
    assert status == 200
    big = 1 << 70
    for params in (
        {"top_k": big, "temperature": 1.0},
        {"stop_token_ids": [big, -3], "min_new_tokens": 2},
        {"top_k": big, "temperature": 0, "stop_token_ids": [-big]},
    ):
        body = {**plain, "sampling_params": {**plain["sampling_params"], **params}}
        status, answer = engine.request("POST", "/generate", body)
        assert status == 200, answer
        if params.get("temperature") == 0:  # nothing of it changes a greedy answer
            assert answer["output_ids"] == greedy["output_ids"]
    # ids no vocabulary has mask nothing under min_new_tokens: the same distributions
    held = {**plain, "return_logprob": True}
    held["sampling_params"] = {**plain["sampling_params"], "min_new_tokens": 4}
    answers = []
    for stops in ([], [-1, -2]):
        held["sampling_params"]["stop_token_ids"] = stops
        status, answer = engine.request("POST", "/generate", held)
        assert status == 200, answer
        answers.append(answer["meta_info"]["output_token_logprobs"])
    assert answers[0] == answers[1]
    status, answer = engine.request("POST", "/generate", {**plain, "sampling_params": {
        "sampling_seed": 1 << 63}})  # fmt: skip
    assert answer["error"]["message"] == (  # SamplingParams.verify's words
        "sampling_params.sampling_seed: sampling_seed must be in [-2**63, 2**63 - 1], got "
        f"{1 << 63}."
    )
    assert engine.request("GET", "/health_generate")[0] == 200


@pytest.mark.timeout(60)
def test_sglangs_other_fields_at_their_defaults_change_nothing(engine: Engine) -> None:
    """What a client written for SGLang 0.5.23 may send along (``io_struct.GenerateReqInput``):
    defaults, logging and routing keys, ``priority`` (left, as SGLang leaves it without
    --enable-priority-scheduling), ``return_entropy`` (SGLang 0.5.23 returns nothing for it)."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    plain = engine.generate(body)
    along = {
        "data_parallel_rank": 0, "session_id": None, "extra_key": None,
        "return_routed_experts": False, "sampling_logprobs_mode": None, "background": False,
        "no_logs": True, "custom_labels": {"team": "rl"}, "routing_key": "k1",
        "conversation_id": "c1", "priority": -3, "return_entropy": True, "log_metrics": False,
        # the multimodal processor's settings: SGLang reads them for images, video, audio only
        "max_dynamic_patch": 6, "min_dynamic_patch": 1, "image_max_dynamic_patch": 4,
        "video_max_dynamic_patch": 2, "images_config": {"image_mode": "base"},
        "video_config": {"fps": 2}, "mm_processor_kwargs": {"do_resize": False},
        "use_audio_in_video": True, "watermark": {"enabled": False, "context_window": 2},
    }  # fmt: skip
    sampling = {**body["sampling_params"], "beam_width": 1, "spaces_between_special_tokens": False}
    got = engine.generate({**body, **along, "sampling_params": sampling})
    assert got["output_ids"] == plain["output_ids"] and got["text"] == plain["text"]
    assert set(got) == set(plain) and set(got["meta_info"]) == set(plain["meta_info"])


@pytest.mark.timeout(60)
def test_input_embeds_are_answered_as_sglang_answers_them(engine: Engine) -> None:
    """``input_embeds`` beside ``input_ids`` or ``text`` is dropped (SGLang's
    ``_determine_batch_size``); as the prompt, with the radix cache on (the default), it is
    SGLang's 400 (``TokenizerManager._tokenize_one_request``), counted as refused."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    plain = engine.generate(body)
    embeds = [[0.5, -0.5], [0.25, 0.0]]
    assert engine.generate({**body, "input_embeds": embeds})["output_ids"] == plain["output_ids"]
    refused = sum(engine.request("GET", "/server_info")[1]["refused_requests"].values())
    alone = {"input_embeds": embeds, "sampling_params": body["sampling_params"]}
    status, answer = engine.request("POST", "/generate", alone)
    assert status == 400
    assert answer["error"]["message"] == (
        "input_embeds: input_embeds is provided while disable_radix_cache is False. Please add "
        "`--disable-radix-cache` when you launch the server if you want to use input_embeds "
        "as inputs."
    )
    assert sum(engine.request("GET", "/server_info")[1]["refused_requests"].values()) == refused + 1


def _abandoned(engine: Engine, path: str, body: dict[str, Any]) -> None:
    """Send ``body`` to ``path`` and go away before the answer (the socket closed)."""
    data = json.dumps(body).encode()
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + data)
        time.sleep(0.3)  # running by now


def _running(engine: Engine) -> int:
    return engine.request("GET", "/v1/loads")[1]["loads"][0]["num_running_reqs"]


@pytest.mark.timeout(90)
def test_a_request_whose_client_went_away_is_aborted_unless_background(engine: Engine) -> None:
    """As SGLang's ``_wait_one_response``: a request not streamed whose client disconnected is
    aborted (here within ``client_watch.DISCONNECT_POLL_S``), counted as a 499; with
    ``background: true`` it runs on to its end."""
    slow = {"forward_sleep_time": 0.05}  # 200 tokens: 10 s
    assert engine.request("POST", "/slow_down", slow)[0] == 200
    try:
        counts = engine.request("GET", "/server_info")[1]["refused_requests"]
        params = {"max_new_tokens": 200, "ignore_eos": True}
        _abandoned(engine, "/generate", {"input_ids": [5, 6, 7], "sampling_params": params})
        completion = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 200,
                      "ignore_eos": True}  # fmt: skip
        _abandoned(engine, "/v1/completions", completion)
        deadline = time.monotonic() + 5
        while _running(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(engine) == 0
        after = engine.request("GET", "/server_info")[1]["refused_requests"]
        assert after.get("POST /generate 499", 0) == counts.get("POST /generate 499", 0) + 1
        v1 = "POST /v1/completions 499"
        assert after.get(v1, 0) == counts.get(v1, 0) + 1

        _abandoned(engine, "/generate", {"input_ids": [5, 6, 7], "sampling_params": params,
                                         "background": True, "rid": "kept"})  # fmt: skip
        time.sleep(2.5)
        assert _running(engine) == 1  # still running for nobody, as asked
        assert engine.request("POST", "/abort_request", {"rid": "kept"})[0] == 200
    finally:
        engine.request("POST", "/slow_down", {"forward_sleep_time": None})
    status, answer = engine.request("POST", "/generate", {"input_ids": [5], "background": "maybe"})
    assert status == 400  # read as FastAPI reads GenerateReqInput's bool (pydantic's words)
    assert (
        answer["message"]
        == "background: Input should be a valid boolean, unable to interpret input"
    )


@pytest.mark.timeout(60)
def test_keys_sglang_does_not_know_are_ignored_counted_and_logged(engine: Engine) -> None:
    """SGLang's request models ignore the keys they do not name (``/generate``'s dataclass
    too): answered as if absent, and here counted by route and key in ``/server_info``'s
    ``ignored_fields`` and logged, so that a misspelt field is not lost unseen."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    before = engine.request("GET", "/server_info")[1]["ignored_fields"]
    plain = engine.generate(body)
    for _ in range(2):
        got = engine.generate({**body, "return_logprobs": True, "zz_newer_field": [1]})
        assert (
            got["output_ids"] == plain["output_ids"]
            and "output_token_logprobs" not in got["meta_info"]
        )
    status, _ = engine.request("POST", "/abort_request", {"rid": "nothing", "abort_everything": 1})
    assert status == 200
    ignored = engine.request("GET", "/server_info")[1]["ignored_fields"]
    counted = {k: v - before.get(k, 0) for k, v in ignored.items() if v != before.get(k, 0)}
    assert counted == {
        "POST /generate return_logprobs": 2,
        "POST /generate zz_newer_field": 2,
        "POST /abort_request abort_everything": 1,
    }
    events = [json.loads(line) for line in engine.log_file.read_text().splitlines()]
    logged = {e["request"] for e in events if e["event"] == "request_field_ignored"}
    assert set(counted) <= logged
    # random keys cannot grow the counts without bound: past 1024 kinds, "(other keys)"
    engine.generate({**body, **{f"k{i}": i for i in range(1100)}})
    ignored = engine.request("GET", "/server_info")[1]["ignored_fields"]
    assert len(ignored) == 1025 and ignored["POST /generate (other keys)"] >= 76


@pytest.mark.timeout(60)
def test_a_watermark_is_served_off_and_refused_on(engine: Engine) -> None:
    """SGLang 0.5.23's per-request ``watermark`` (``watermarking/core.py``) on a server that
    does not watermark (SGLang without ``--enable-watermark``): none, or one turned off, is
    served; the rest is refused in its words, at the top (one per prompt of a batch) or in
    ``sampling_params``, not both."""
    ids = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    plain = engine.generate(ids)
    off = engine.generate({**ids, "watermark": {"enabled": False}})
    assert off["output_ids"] == plain["output_ids"]
    batch = {"input_ids": [[5, 6], [7]], "watermark": [{"enabled": False}, None]}
    assert len(engine.generate(batch)) == 2
    inner = {**ids["sampling_params"], "watermark": {"enabled": False}}
    assert engine.generate({**ids, "sampling_params": inner})["output_ids"] == plain["output_ids"]
    refusals = [
        ({"watermark": {"enabled": True}},
         "request watermarking requires the server to enable --enable-watermark"),
        ({"watermark": {"key": "0xBEEF"}},
         "request watermarking requires the server to enable --enable-watermark"),
        ({"watermark": {}}, "request watermark must set enabled or key"),
        ({"watermark": "on"}, "watermark must be an object"),
        ({"watermark": {"enabled": False, "key": "ab"}},
         "request watermark key cannot be combined with enabled=false"),
        ({"watermark": {"enabled": False, "salt": 1}}, "watermark contains unknown fields"),
        ({"watermark": {"enabled": 1}}, "watermark enabled must be a boolean"),
        ({"watermark": {"key": "xyz"}}, "watermark key must contain only hex digits"),
        ({"watermark": {"key": "0x"}}, "watermark key must contain 1 to 16 hex digits"),
        ({"watermark": {"enabled": False, "context_window": 0}},
         "watermark context_window must be a positive integer"),
        ({"watermark": {"enabled": False, "context_window": 5}},
         "request watermark context_window cannot exceed the server's watermark context_window"),
        ({"watermark": {"enabled": False}, "sampling_params": inner},
         "watermark must be provided either at the request top level or inside "
         "sampling_params, not both"),
    ]  # fmt: skip
    for extra, words in refusals:
        status, answer = engine.request("POST", "/generate", {**ids, **extra})
        assert status == 400 and answer["error"]["message"].endswith(words), (extra, answer)
    assert engine.request("GET", "/health")[0] == 200


@pytest.mark.timeout(60)
def test_control_routes_reject_bad_input(engine: Engine) -> None:
    assert engine.request("POST", "/pause_generation", {"mode": "nap"})[0] == 400
    assert engine.request("POST", "/abort_request", {"rid": 3})[0] == 400
    # AbortReq (io_struct.py): no rid is rid "", which names nothing; SGLang answers 200, no body
    assert engine.request("POST", "/abort_request", {}) == (200, None)
    status, body = engine.request(
        "POST", "/update_weights_from_distributed", {"names": ["x"], "dtypes": [], "shapes": []}
    )
    assert status == 400 and body["success"] is False and "names" in body["message"]
    update = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
    # SGLang 0.5.23 (scheduler_components/weight_updater.py): buckets load inside a session only
    status, body = engine.request("POST", "/update_weights_from_distributed", update)
    assert status == 400 and body == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and "
        "end_weight_update()",
    }
    assert engine.request("POST", "/begin_weight_update", {"selector": "draft"})[0] == 200
    status, body = engine.request("POST", "/begin_weight_update", {})
    assert status == 400 and "already open" in body["message"]
    status, body = engine.request("POST", "/update_weights_from_distributed", update)
    assert status == 400 and "group" in body["message"]
    assert engine.request("POST", "/end_weight_update", {}) == (
        200,
        {"success": True, "message": "Success"},
    )
    status, body = engine.request("POST", "/end_weight_update", {})
    assert status == 400 and "no weight-update session is open" in body["message"]
    assert engine.request("POST", "/begin_weight_update", {"selector": "x"})[0] == 400
    # Still serving.
    out = engine.generate({"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert len(out["output_ids"]) == 2


@pytest.mark.timeout(60)
def test_native_bodies_are_read_as_sglangs_request_structs(engine: Engine) -> None:
    """``control_fields``: each native route's body read as FastAPI reads SGLang 0.5.23's
    ``io_struct`` struct for it, before the route runs: lax values converted and used, other
    types and missing fields a 400 in its validation answer, unknown keys ignored, an empty
    body refused unless the struct parameter is optional there."""

    def refused(path: str, body: Any, words: str, raw: bytes | None = None) -> None:
        status, answer = engine.request("POST", path, body, raw=raw)
        assert status == 400 and answer["type"] == "Bad Request", (path, answer)
        assert answer["message"] == words, (path, answer)

    refused("/pause_generation", None, "body: Field required")  # PauseGenerationReqInput
    refused("/continue_generation", None, "body: Field required", raw=b"")
    refused("/pause_generation", None, "body.1: JSON decode error", raw=b"{x")
    refused("/pause_generation", None, "Input should be a valid dictionary", raw=b"[]")
    for content_type in (None, "text/plain"):  # read as JSON only when sent as JSON: bytes
        request = urllib.request.Request(engine.url + "/pause_generation", b"{}", method="POST")
        if content_type:
            request.add_header("Content-Type", content_type)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        answer = json.loads(info.value.read())
        assert answer["message"] == "Input should be a valid dictionary", answer
    refused("/begin_weight_update", {"selector": "x"}, "selector: Input should be 'target', "
            "'draft' or 'all'")  # fmt: skip
    refused("/load_lora_adapter", {"lora_name": "a"}, "lora_path: Field required")
    refused(
        "/parse_function_call",
        {"text": "x", "tools": [{"function": {"name": 1}}]},
        "tools.0.function.name: Input should be a valid string",
    )  # io_struct.Tool
    refused("/update_weights_from_tensor", {"serialized_named_tensors": ["!"]},
            "serialized_named_tensors: Value error, Expected base64-encoded bytes")  # fmt: skip
    refused("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 1.5},
            "truncate_size: Input should be a valid integer, got a number with a fractional "
            "part")  # fmt: skip
    # converted as pydantic converts them, and used
    status, rows = engine.request(
        "POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "2"}
    )
    assert status == 200 and len(rows) == 2
    status, answer = engine.request(
        "POST",
        "/separate_reasoning",
        {"text": "a</think>b", "reasoning_parser": "deepseek-r1", "return_blocks": "yes"},
    )
    assert status == 200 and answer["text_blocks"] == ["b"], answer
    # optional structs take no body (/weights_checker: CheckWeightsReqInput or None)
    status, answer = engine.request("POST", "/weights_checker", raw=b"")
    assert status == 200 and answer["success"] is True
    # unknown keys ignored, as the structs ignore them: the route's own answer comes, here
    # SGLang's for a server without --enable-lora (tokenizer_control_mixin.py:839), which then
    # refuses a request naming an adapter in its words (tokenizer_manager.py:3729)
    status, answer = engine.request("POST", "/unload_lora_adapter", {"lora_name": "a", "x": 1})
    assert (status, answer) == (400, {
        "success": False, "loaded_adapters": None,
        "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
    })  # fmt: skip
    status, answer = engine.request("POST", "/generate", {"input_ids": [1, 2], "lora_path": "a"})
    assert status == 400 and (
        "LoRA adapter 'a' was requested, but LoRA is not enabled. Please launch the server "
        "with --enable-lora flag" in str(answer)
    ), answer
    out = engine.generate({"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert len(out["output_ids"]) == 2


@pytest.mark.timeout(60)
def test_model_info_and_health(engine: Engine) -> None:
    assert engine.request("GET", "/health")[0] == 200
    with urllib.request.urlopen(engine.url + "/health", timeout=10) as resp:
        # the id its launcher gave it: a launcher tells its engine from another on the port
        assert resp.headers[ENGINE_ID_HEADER] == engine.engine_id is not None
    status, info = engine.request("GET", "/model_info")
    assert status == 200
    assert info["model_path"] == str(engine.model_dir)
    assert info["tokenizer_path"] == str(engine.model_dir)
    assert info["is_generation"] is True and info["served_model_name"] == str(engine.model_dir)
    assert info["weight_version"] == "0"
    assert engine.request("GET", "/get_model_info") == (200, info)  # SGLang's older name
    assert engine.request("GET", "/health_generate")[0] == 200  # one token of [0]
    assert engine.request("GET", "/ready")[0] == 200
    status, body = engine.request("GET", "/server_info")
    assert status == 200 and body["max_running_requests"] == 8 and body["stream_interval"] == 1
    assert body["version"].startswith("inflight-rl ") and body["context_length"] > 0
    assert body["max_total_num_tokens"] == 8 * body["context_length"]
    (state,) = body["internal_states"]
    assert state["num_running_reqs"] == body["num_running_reqs"] == 0
    assert engine.request("GET", "/get_server_info")[1]["max_running_requests"] == 8
    # The port it listens on is logged as a structured event.
    events = [json.loads(line) for line in engine.log_file.read_text().splitlines()]
    started = [e for e in events if e["event"] == "engine_started"]
    assert started and started[0]["port"] == int(engine.url.rsplit(":", 1)[1])


@pytest.mark.timeout(60)
def test_n_samples_and_batches_answer_sglang_lists(
    engine: Engine, ref_model: torch.nn.Module
) -> None:
    params = {**GREEDY, "max_new_tokens": 5}
    # one prompt, n > 1: a list of n, sample ids from the caller's rid
    out = engine.generate(
        {
            "input_ids": [8, 9, 10],
            "rid": "grp",
            "return_logprob": True,
            "sampling_params": {**params, "n": 3},
        }
    )
    expected = _hf_greedy(ref_model, [8, 9, 10], 5)
    assert [o["meta_info"]["id"] for o in out] == ["grp_0", "grp_1", "grp_2"]
    assert all(o["output_ids"] == expected for o in out)  # shared prefill, same greedy tokens
    assert all([t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == expected for o in out)
    # B prompts x n: prompt-major order [p0 s0, p0 s1, p1 s0, p1 s1]
    prompts = [[20, 21], [30, 31, 32, 33]]
    out = engine.generate(
        {"input_ids": prompts, "rid": ["a", "b"], "sampling_params": {**params, "n": 2}}
    )
    assert [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "b_0", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 4, 4]
    assert [o["output_ids"] for o in out] == [
        _hf_greedy(ref_model, p, 5) for p in prompts for _ in "ab"
    ]
    # a group as the generator sends it: identical input_ids, one rid each
    out = engine.generate(
        {"input_ids": [[40, 41]] * 4, "rid": [f"s{i}" for i in range(4)], "sampling_params": params}
    )
    assert [o["meta_info"]["id"] for o in out] == ["s0", "s1", "s2", "s3"]
    assert all(o["output_ids"] == _hf_greedy(ref_model, [40, 41], 5) for o in out)
    # a batch with one rid string: SGLang's f"{rid}_{i}"
    out = engine.generate({"input_ids": [[1, 2], [3]], "rid": "bt", "sampling_params": params})
    assert [o["meta_info"]["id"] for o in out] == ["bt_0", "bt_1"]


@pytest.mark.timeout(60)
def test_abort_by_the_callers_rid_stops_every_sample(engine: Engine) -> None:
    result: dict[str, Any] = {}
    body = {
        "input_ids": [60, 62],
        "rid": "many",
        "sampling_params": {**GREEDY, "max_new_tokens": 480, "n": 2},
    }
    worker = threading.Thread(target=lambda: result.update(out=engine.generate(body)))
    worker.start()
    _wait_running(engine, 2)
    assert engine.request("POST", "/abort_request", {"rid": "many"}) == (200, None)
    worker.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in result["out"]] == ["abort"] * 2
    assert [o["meta_info"]["id"] for o in result["out"]] == ["many_0", "many_1"]


def _status(engine: Engine, path: str, raw: bytes) -> int:
    """The status of a POST whose answer may not be read (a 413 may close the connection)."""
    req = urllib.request.Request(engine.url + path, data=raw, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


POST_ROUTES = [
    "/generate",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/update_weight_version",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
]
GARBAGE = {
    "random bytes": bytes(random.Random(7).randrange(256) for _ in range(512)),
    "truncated JSON": b'{"input_ids": [1, 2',
    "not an object": b"[1, 2, 3]",
    "wrong types": json.dumps(
        {
            "input_ids": "one two",
            "rid": 5,
            "mode": 3,
            "weight_version": [],
            "group_name": 7,
            "names": "x",
            "master_port": "p",
        }
    ).encode(),
}


@pytest.mark.timeout(120)
def test_garbage_on_every_route_is_refused_counted_and_logged_sparsely(engine: Engine) -> None:
    before = engine.request("GET", "/get_server_info")[1]["refused_requests"]
    refused = 0
    for route in POST_ROUTES:
        for name, raw in GARBAGE.items():
            status, answer = engine.request("POST", route, raw=raw)
            assert 400 <= status < 500, (route, name, status, answer)
            refused += 1
    # token ids outside the vocabulary (128), a body over --max-request-mb (2), no such route
    assert engine.request("POST", "/generate", {"input_ids": [1, 5000]})[0] == 400
    try:
        assert _status(engine, "/generate", b" " * (3 * 2**20)) == 413
    except (ConnectionError, urllib.error.URLError):
        pass  # the server may close the connection before the client has sent it all
    assert _status(engine, "/no_such_route", b'{"a": 1}') == 404
    # as FastAPI answers SGLang's unknown routes and methods: JSON, with Allow
    assert engine.request("GET", "/no_such_route") == (404, {"detail": "Not Found"})
    assert engine.request("DELETE", "/generate") == (405, {"detail": "Method Not Allowed"})
    refused += 5
    status, info = engine.request("GET", "/get_server_info")
    counts = info["refused_requests"]
    assert sum(counts.values()) - sum(before.values()) == refused, counts
    assert counts["POST /generate 413"] >= 1 and counts["POST /generate 400"] >= 5, counts
    # every refusal counted; each kind logged at its 1st, 2nd, 4th ... occurrence only
    logged = [
        e
        for e in map(json.loads, engine.log_file.read_text().splitlines())
        if e["event"] == "request_refused"
    ]
    for key, n in counts.items():
        assert len([e for e in logged if e["request"] == key]) == n.bit_length(), key
    # still serving
    assert engine.request("GET", "/health")[0] == 200
    out = engine.generate({"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert len(out["output_ids"]) == 2
    body = {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 2}}
    status, put = engine.request("PUT", "/generate", body)  # SGLang's route takes PUT too
    assert status == 200 and put["output_ids"] == out["output_ids"]


@pytest.mark.timeout(60)
def test_weight_group_routes_take_sglangs_defaults(engine: Engine) -> None:
    """InitWeightsUpdateGroupReqInput and DestroyWeightsUpdateGroupReqInput (io_struct.py):
    ``group_name`` defaults to ``weight_update_group`` (``backend`` to ``nccl``); the engine
    joins as rank 1 of a gloo group whose rank 0 is this test, and leaves it by that name."""
    from stages.weights.group import init_weight_group
    from transport.address import rendezvous_port

    port = rendezvous_port("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        rank0 = pool.submit(
            init_weight_group,
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="weight_update_group",
            timeout_s=30,
        )
        joined = engine.request(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "gloo",
            },
        )
        group = rank0.result(timeout=30)
    try:
        assert joined[0] == 200 and joined[1]["success"] is True, joined
        left = engine.request("POST", "/destroy_weights_update_group", {})
        assert left == (200, {"success": True, "message": "Succeeded to destroy group."})
    finally:
        group.destroy()


@pytest.mark.timeout(60)
def test_freeze_gc_and_slow_down_answer_as_sglang(engine: Engine) -> None:
    """SGLang 0.5.23's maintenance routes (``http_server.py``): ``/freeze_gc`` answers its
    text; ``/slow_down`` (``Scheduler.slow_down``) sleeps before each step until null ends it,
    answering ``null``; its one field is required."""
    request = urllib.request.Request(engine.url + "/freeze_gc", method="POST")
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert (resp.status, resp.read()) == (200, b"Garbage collection frozen.\n")
    body = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    assert engine.request("POST", "/slow_down", {"forward_sleep_time": 0.05}) == (200, None)
    slowed = engine.generate(body)["meta_info"]["e2e_latency"]
    assert slowed >= 0.25  # 6 steps (the prefill's among them), 0.05 s before each
    assert engine.request("POST", "/slow_down", {"forward_sleep_time": None}) == (200, None)
    assert engine.generate(body)["meta_info"]["e2e_latency"] < slowed
    # SlowDownReqInput: its one field required, a number or null (pydantic's lax float:
    # "0.01" is 0.01), else its validation shape
    for bad, words in (({}, "Field required"), ({"forward_sleep_time": "x"}, "Input should")):
        status, answer = engine.request("POST", "/slow_down", bad)
        assert status == 400 and answer["type"] == "Bad Request", answer
        assert answer["message"].startswith("forward_sleep_time: " + words), answer
    assert engine.request("POST", "/slow_down", {"forward_sleep_time": "0.01"}) == (200, None)
    assert engine.request("POST", "/slow_down", {"forward_sleep_time": None}) == (200, None)
