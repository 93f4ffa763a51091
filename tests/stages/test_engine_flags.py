"""SGLang's server flags on ``inflight engine``, so that a SGLang launch command starts it:
their names (``--model-path``, ``--max-running-requests``, ``--random-seed``,
``--tensor-parallel-size``, ``--dtype half``), the port SGLang listens on by default, and what
they do here (``--tokenizer-path``, ``--skip-tokenizer-init``, ``--context-length`` as
``ModelConfig._derive_context_length`` allows it, ``--disable-radix-cache``, ``--load-format``
``dummy`` as ``initialize_dummy_weights`` draws them, then the real weights from an update), in
process and through a real server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from stages.engine.loader import LONGER_CONTEXT_ENV, load_model, torch_dtype
from stages.engine.server import parse_args
from tests.stages.engine_setup import ROOT, builtin_engine, hf_greedy, load_reference
from tests.stages.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny model with its tokenizer, one of the same vocabulary without)."""
    root = tmp_path_factory.mktemp("flags")
    return make_tiny_model(root / "with", seed=1), make_tiny_model(
        root / "bare", seed=2, with_tokenizer=False
    )


def test_sglangs_names_of_the_engine_flags_are_taken() -> None:
    args = parse_args(
        ["--model-path", "m", "--max-running-requests", "8", "--random-seed", "3",
         "--tensor-parallel-size", "1", "--dtype", "half", "--disable-radix-cache"]
    )  # fmt: skip
    assert (args.model, args.max_running, args.seed, args.port) == (Path("m"), 8, 3, 30000)
    assert args.prefix_cache_tokens == 0 and torch_dtype("cpu", args.dtype) == torch.float16
    assert torch_dtype("cpu", "float") == torch.float32
    assert parse_args(["--model", "m", "--port", "0"]).model == Path("m")
    tuning = ["--mem-fraction-static", "0.8", "--enable-memory-saver", "--skip-server-warmup",
              "--grammar-backend", "llguidance"]  # fmt: skip
    assert parse_args(["--model", "m", *tuning]).mem_fraction_static == 0.8
    assert parse_args(["--model", "org/m", "--revision", "v2"]).model == Path("org/m@v2")
    here = str(ROOT / "configs")  # a local folder is read as it is
    assert parse_args(["--model", here, "--revision", "v2"]).model == Path(here)


@pytest.mark.parametrize(
    "flags",
    [
        ["--grammar-backend", "xgrammar"],
        ["--mem-fraction-static", "1.5"],
        ["--tp-size", "x"],
        ["--model", "org/m@v1", "--revision", "v2"],
    ],
)
def test_sglang_flags_the_engine_cannot_honour_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *flags])


def test_default_chat_template_kwargs_must_be_a_json_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SGLang's ``--default-chat-template-kwargs`` (arg_groups/serving_hook.py:498)."""
    flag = "--default-chat-template-kwargs"
    args = parse_args(["--model", "m", flag, '{"enable_thinking": false}'])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    for bad in ("[1]", "{"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", flag, bad])
    assert "must decode to a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tp-size", "--tensor-parallel-size"])
def test_tensor_parallelism_is_refused_with_its_reason(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", flag, "2"])
    assert "one device" in capsys.readouterr().err


def test_context_length_is_the_models_or_shorter_unless_sglangs_variable_allows_more(
    models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with_tokenizer, _ = models
    own = load_model(with_tokenizer).context_length
    assert load_model(with_tokenizer, context_length=own // 2).context_length == own // 2
    with pytest.raises(ValueError, match=f"set the env var {LONGER_CONTEXT_ENV}=1"):
        load_model(with_tokenizer, context_length=own + 1)
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "true")
    assert load_model(with_tokenizer, context_length=own + 1).context_length == own + 1
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "maybe")
    with pytest.raises(ValueError, match="not a valid boolean"):
        load_model(with_tokenizer, context_length=own + 1)


def test_the_tokenizer_comes_from_tokenizer_path_or_is_skipped(models: tuple[Path, Path]) -> None:
    with_tokenizer, bare = models
    assert load_model(bare).tokenizer is None
    loaded = load_model(bare, tokenizer_path=with_tokenizer)
    assert loaded.tokenizer is not None and loaded.tokenizer_path == with_tokenizer
    assert load_model(with_tokenizer, skip_tokenizer=True).tokenizer is None


def test_dummy_weights_are_sglangs_draws_and_pt_reads_bin_files_only(
    models: tuple[Path, Path],
) -> None:
    """--load-format dummy: every floating tensor uniform in [-1e-3, 1e-3), the same draw each
    time (per-tensor generators seeded 1234), none of the checkpoint's; pt where the folder has
    safetensors alone: refused."""
    real = load_model(models[0]).model.state_dict()
    one, two = (load_model(models[0], load_format="dummy").model.state_dict() for _ in range(2))
    assert one.keys() == real.keys()
    for name, tensor in one.items():
        assert tensor.abs().max() <= 1e-3 and torch.equal(tensor, two[name]), name
        assert not torch.equal(tensor, real[name]), name
    with pytest.raises(OSError):
        load_model(models[0], load_format="pt")


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-output") / "engine.log"


@pytest.fixture(scope="module")
def url(models: tuple[Path, Path], output: Path) -> Iterator[str]:
    with_tokenizer, bare = models
    flags = ("--tokenizer-path", str(with_tokenizer), "--context-length", "40",
             "--max-running-requests", "4", "--disable-radix-cache",
             "--load-format", "dummy", "--mem-fraction-static", "0.7")  # fmt: skip
    with builtin_engine(bare, *flags, output=output) as engine:
        yield engine


@pytest.mark.timeout(120)
def test_a_server_started_with_sglangs_flags_serves_as_they_say(
    url: str, models: tuple[Path, Path], output: Path
) -> None:
    """The tokenizer of --tokenizer-path (text prompts taken, /server_info names it), the
    context of --context-length (a prompt and output past it refused), --max-running-requests
    and --disable-radix-cache in /server_info; dummy weights until /update_weights_from_disk
    brings the checkpoint's, then transformers' greedy tokens; --mem-fraction-static logged as
    changing nothing here."""
    assert "engine_flags_not_applicable" in output.read_text()
    info = requests.get(url + "/server_info", timeout=30).json()
    assert info["tokenizer_path"] == str(models[0])
    assert (info["context_length"], info["max_running_requests"]) == (40, 4)
    assert info["prefix_cache"]["enabled"] is False
    params = {"max_new_tokens": 4, "temperature": 0}
    answer = requests.post(
        url + "/generate", json={"text": "a b c", "sampling_params": params}, timeout=30
    )
    assert answer.status_code == 200 and isinstance(answer.json()["text"], str)
    long = {"input_ids": list(range(5, 42)), "sampling_params": params}
    refused = requests.post(url + "/generate", json=long, timeout=30)
    assert refused.status_code == 400 and "maximum context length of 40 tokens" in refused.text
    prompt = {"input_ids": [5, 17, 33, 8], "sampling_params": {**params, "max_new_tokens": 8}}
    want = hf_greedy(load_reference(models[1]), prompt["input_ids"], 8)
    before = requests.post(url + "/generate", json=prompt, timeout=30).json()["output_ids"]
    update = {"model_path": str(models[1])}
    assert requests.post(url + "/update_weights_from_disk", json=update, timeout=60).ok
    after = requests.post(url + "/generate", json=prompt, timeout=30).json()["output_ids"]
    assert before != want and after == want
