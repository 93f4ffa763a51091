"""SGLang's launch flags on ``inflight engine`` (``stages.engine.sglang_flags``): a command line
written for SGLang 0.5.23 starts the built-in engine, each flag served, taken (logged once) or
refused saying which flag and why, never argparse's "unrecognized arguments"; ``--lora-paths``
loads its adapters before the engine serves."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import requests
import torch

from stages.engine import sglang_flags
from stages.engine.loader import load_model
from stages.engine.lora_routes import lora_refs
from stages.engine.server import _parser, app_options, build_scheduler, parse_args
from tests.stages.engine_setup import ROOT, engine_command
from tests.stages.test_engine_lora import NEW, PROMPTS, _adapter, _greedy, _run
from tests.stages.test_engine_server import serving
from tests.stages.tiny_model import make_tiny_model


def _unchanged(nargs: str, value: object, default: object) -> bool:
    """A switch whose SGLang default is already what it sets."""
    return (nargs, default) in (("0", True), ("no", False))


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_every_flag_of_sglang_is_served_taken_or_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each of SGLang 0.5.23's flags, given a value other than its default, parses into one of
    three answers: the engine's own flag, taken (the tuning of SGLang's GPU runtime), or a
    refusal that names it; never "unrecognized arguments"."""
    own = {
        name
        for name, action in _parser()._option_string_actions.items()
        if not action.dest.startswith("sglang_flag__")
    }
    names = sglang_flags._FLAGS
    assert sglang_flags.TAKEN <= set(names) and set(sglang_flags.REASONS) <= set(names)
    assert len(names) > 500
    answers = {"own": 0, "taken": 0, "refused": 0, "default": 0}
    for name, (nargs, default) in names.items():
        argv = [name] if nargs in ("0", "no") else [name, "7" if default != 7 else "8"]
        if name in own:
            answers["own"] += 1
            continue
        try:
            args = parse_args(["--model", "m", *argv])
        except SystemExit:
            said = capsys.readouterr().err
            assert "unrecognized" not in said and f"{name}" in said, (name, said)
            assert "SGLang's flag, not taken" in said, said
            assert name not in sglang_flags.TAKEN, name
            answers["refused"] += 1
            continue
        value = True if nargs in ("0", "no") else argv[1:] if nargs in "*+" else argv[1]
        if not args.sglang_taken:  # its default: nothing to take
            assert _unchanged(nargs, value, default), name
            answers["default"] += 1
            continue
        assert args.sglang_taken == {name[2:].replace("-", "_"): value}, name
        assert name in sglang_flags.TAKEN, name
        answers["taken"] += 1
    assert min(answers["own"], answers["taken"], answers["refused"]) > 20, answers


def test_a_command_line_written_for_sglang_parses_and_says_what_it_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What an RL framework's launch passes: defaults change nothing, the runtime's tuning is
    taken, and what would answer otherwise is refused, every such flag named at once."""
    args = parse_args(
        ["--model-path", "m", "--tp", "1", "--dp-size", "1", "--kv-cache-dtype", "auto",
         "--mem-fraction-static", "0.8", "--chunked-prefill-size", "8192",
         "--cuda-graph-max-bs-decode", "64", "--disable-cuda-graph", "--attention-backend",
         "fa3", "--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "q_proj",
         "v_proj", "--no-lora-strict-loading", "--log-level", "warning"]
    )  # fmt: skip
    assert args.sglang_taken == {
        "chunked_prefill_size": "8192",
        "cuda_graph_max_bs_decode": "64",
        "disable_cuda_graph": True,
        "attention_backend": "fa3",
        "max_lora_rank": "64",
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    assert not any(k.startswith("sglang_flag__") for k in vars(args))  # (read out of args)
    assert (args.enable_lora, args.lora_by_paths) == (True, False)  # served: the LoRA routes
    given = parse_args(["--model", "m", "--lora-paths", "a=/x"])  # check_lora_server_args
    assert (given.enable_lora, given.lora_by_paths) == (True, True)
    assert parse_args(["--model", "m"]).enable_lora is False
    said = _refusal(
        ["--quantization", "fp8", "--dp-size", "2", "--rl-on-policy-target", "fsdp",
         "--speculative-num-steps", "3", "--chunked-prefill-size", "4096"],
        capsys,
    )  # fmt: skip
    lines = [line.strip() for line in said.split("error:", 1)[1].strip().splitlines()]
    assert lines == [
        "--dp-size 2: SGLang's flag, not taken: one engine serves one replica; run more "
        "engines (a generator's engines)",
        "--quantization fp8: SGLang's flag, not taken: the built-in engine runs the "
        "checkpoint's own weights in --dtype",
        "--rl-on-policy-target fsdp: SGLang's flag, not taken: the built-in engine does not "
        "serve it",
        "--speculative-num-steps 3: SGLang's flag, not taken: the built-in engine does not "
        "serve it",
    ]
    assert "unrecognized arguments: --not-a-flag" in _refusal(["--not-a-flag"], capsys)
    openai = parse_args(["--model", "m", "--sampling-defaults", "openai"])
    assert app_options(openai, None)["sampling_defaults"] == "openai"  # to ChatSettings.of
    assert app_options(args, None)["sampling_defaults"] == "model"


def test_lora_paths_are_read_as_sglang_reads_them(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's LoRAPathAction and check_lora_server_args: NAME=PATH split at the first ``=``,
    a JSON object's names, a bare path its own name."""
    assert lora_refs(
        ["a=/x=y", " /b ", '{"lora_name": "c", "lora_path": "/c", "pinned": true}']
    ) == [("a", "/x=y"), ("/b", "/b"), ("c", "/c")]
    said = _refusal(["--lora-paths", '{"lora_path": "/c"}'], capsys)
    assert "does not contain 'lora_name' and 'lora_path' keys." in said


@pytest.mark.timeout(120)
def test_an_engine_started_with_sglangs_lora_flags_serves_the_adapters_it_was_given(
    tmp_path: Path,
) -> None:
    """``inflight engine --enable-lora --max-lora-rank 4 --lora-paths a=FOLDER``, as SGLang is
    started for LoRA: the adapter is loaded before the engine answers /health, a request
    naming it computes what the merged model does, the taken flags are logged once; an
    adapter that does not fit stops the engine at start, saying why."""
    model_dir = make_tiny_model(tmp_path / "m", seed=3)
    merged = _adapter(model_dir, tmp_path / "a", seed=1, targets="all-linear")
    want = _run(*_greedy(merged, PROMPTS))
    flags = ("--enable-lora", "--max-lora-rank", "4", "--lora-paths", f"a={tmp_path / 'a'}")
    log_file = tmp_path / "engine.log"
    with serving(model_dir, log_file, *flags) as eng, torch.inference_mode():
        body = {
            "input_ids": PROMPTS, "lora_path": "a",
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }  # fmt: skip
        answers = requests.post(eng.url + "/generate", json=body, timeout=60).json()
        assert [a["output_ids"] for a in answers] == [ids for ids, _ in want]
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    (taken,) = [e for e in events if e["event"] == "engine_flags_not_applicable"]
    assert taken["flags"] == {"max_lora_rank": "4"}
    bad = tmp_path / "bad"
    bad.mkdir()
    proc = _start_refused(model_dir, "--lora-paths", f"b={bad}")
    assert "engine_lora_paths_failed" in proc and "no adapter_config.json" in proc
    assert "--enable-lora is set to True because --lora-paths is provided." in proc


def _start_refused(model_dir: Path, *flags: str) -> str:
    done = subprocess.run(
        [*engine_command(model_dir, *flags), "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def test_the_table_is_sglangs_own_command_line() -> None:
    """Where SGLang imports, its parser (``ServerArgs.add_cli_args``) has exactly the table's
    flags, each taking as many values as the table says."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    theirs = {
        name: action
        for action in parser._actions
        for name in action.option_strings
        if name.startswith("--") and name != "--help"
    }
    assert set(theirs) == set(sglang_flags._FLAGS)
    for name, action in theirs.items():
        nargs, _ = sglang_flags._FLAGS[name]
        want = 0 if nargs in ("0", "no") else None if nargs == "1" else nargs
        assert (action.nargs or 0 if want == 0 else action.nargs) == want, name


def test_json_model_override_args_change_the_config_before_the_model_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's ``--json-model-override-args``, set as its ``get_config`` sets it: a key
    replaced, a sub-config updated, ``rope_parameters`` merged; the engine's context follows
    ``max_position_embeddings``, and the weights load as before."""
    from transformers import AutoConfig

    from stages.engine.loader import override_config

    config = AutoConfig.for_model(
        "qwen3_5",
        text_config={"hidden_size": 64, "num_hidden_layers": 2},
        tie_word_embeddings=False,
    )
    rope = dict(config.text_config.rope_parameters)
    override_config(
        config,
        {"text_config": {"num_hidden_layers": 3}, "tie_word_embeddings": True},
    )
    assert config.text_config.num_hidden_layers == 3 and config.text_config.hidden_size == 64
    assert config.tie_word_embeddings is True
    override_config(config.text_config, {"rope_parameters": {"rope_theta": 5.0}})
    assert config.text_config.rope_parameters == {**rope, "rope_theta": 5.0}

    model_dir = make_tiny_model(tmp_path / "m", seed=3)
    plain = load_model(model_dir)
    loaded = load_model(model_dir, overrides={"max_position_embeddings": 48})
    assert (plain.context_length, loaded.context_length) == (
        plain.model.config.max_position_embeddings,
        48,
    )
    for (name, a), (_, b) in zip(
        plain.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    args = parse_args(["--model", "m", "--json-model-override-args", '{"a": {"b": 1}}'])
    assert args.json_model_override_args == {"a": {"b": 1}}
    assert "must decode to a JSON object" in _refusal(["--json-model-override-args", "[1]"], capsys)


def test_auto_truncate_and_preferred_sampling_params_as_sglang_serves_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--allow-auto-truncate`` (context 40): a 45-token prompt keeps its first 34 tokens
    (``max_req_input_len``) and generates nothing, a given max_new_tokens past the context is
    cut to what it leaves (tokenizer_manager.py:1339-1368, managers/utils.py:260); and
    ``--preferred-sampling-params``: /generate takes its keys where a request names none
    (tokenizer_manager.py:1549), /v1/completions only those its builder leaves out
    (serving_completions._build_sampling_params), and /model_info reports it."""
    model_dir = make_tiny_model(tmp_path / "m", seed=3)
    preferred = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
    flags = ("--context-length", "40", "--allow-auto-truncate",
             "--preferred-sampling-params", json.dumps(preferred))  # fmt: skip
    with serving(model_dir, tmp_path / "engine.log", *flags) as eng:
        info = requests.get(eng.url + "/server_info", timeout=30).json()
        assert (info["allow_auto_truncate"], info["max_req_input_len"]) == (True, 34)
        assert info["preferred_sampling_params"] == preferred
        assert (
            requests.get(eng.url + "/model_info", timeout=30).json()["preferred_sampling_params"]
            == preferred
        )

        def generate(prompt: list[int], **sampling: object) -> dict:
            body = {"input_ids": prompt, "sampling_params": sampling,
                    "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
            answer = requests.post(eng.url + "/generate", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()

        long = [5 + i % 100 for i in range(45)]
        out = generate(long)
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], out["output_ids"]) == (34, [])
        assert [tok for _, tok, _ in meta["input_token_logprobs"]] == long[:34]
        assert len(generate(long[:30])["output_ids"]) == 3  # preferred max_new_tokens
        greedy = generate(long[:30], max_new_tokens=20)  # 40 - 2 - 30 of them, greedy
        assert len(greedy["output_ids"]) == 8
        completion = requests.post(
            eng.url + "/v1/completions",
            json={"prompt": long[:30], "ignore_eos": True},
            timeout=60,
        ).json()  # 16 by default, not the preferred 3: cut to the 8 the context leaves;
        # sampled at its default temperature 1, not the preferred 0 (this model draws its 8
        # greedy tokens at temperature 1 with probability 2.7e-6)
        assert completion["usage"]["completion_tokens"] == 8, completion
        assert completion["choices"][0]["text"] != greedy["text"]
    said = _refusal(["--preferred-sampling-params", '{"watermark": {}}'], capsys)
    assert "watermark is not supported in --preferred-sampling-params" in said
    assert "the samples a request asks for" in _refusal(
        ["--preferred-sampling-params", '{"n": 2}'], capsys
    )
    args = parse_args(["--model", str(model_dir), "--preferred-sampling-params", '{"top_k": -5}'])
    with pytest.raises(ValueError, match=r"^--preferred-sampling-params: sampling_params\.top_k"):
        build_scheduler(args, load_model(model_dir))  # main: engine_settings_refused, exit 2


def test_model_impl_picks_the_forward_path_as_sglang_picks_the_implementation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SGLang 0.5.23's ``--model-impl`` (``get_model_architecture``): ``auto`` and ``sglang``
    its own implementation where there is one, else transformers' (the engine's own passes,
    which fall back by themselves); ``transformers`` transformers' alone; ``mindspore``
    refused, naming why."""
    forward = {impl: parse_args(["--model", "m", "--model-impl", impl]).forward
               for impl in ("auto", "sglang", "transformers")}  # fmt: skip
    assert forward == {"auto": "fast", "sglang": "fast", "transformers": "transformers"}
    assert parse_args(["--model", "m"]).forward == "fast"
    said = _refusal(["--model-impl", "mindspore"], capsys)
    assert "--model-impl mindspore: the built-in engine runs PyTorch models" in said
