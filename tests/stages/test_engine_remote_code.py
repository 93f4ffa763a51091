"""A model folder that ships its own code (``auto_map``: MiniCPM's, InternLM's...) on the
built-in engine: refused at once without ``--trust-remote-code`` (SGLang's flag), with a
message naming it, where transformers would ask on a terminal; served with it, as transformers
runs that code.

The folder is a tiny Qwen2 model whose config and model classes are subclasses in its own
files, so the engine's answers can be held to the plain model's with the same weights.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from stages.engine.loader import load_model, load_tokenizer
from stages.engine.pooling import model_kind
from tests.stages.engine_setup import (
    ROOT,
    builtin_engine,
    engine_command,
    free_port,
    hf_greedy,
    load_reference,
    post_json,
)
from tests.stages.tiny_model import make_tiny_model, with_own_code

PROMPT = [5, 17, 3, 29, 11, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the plain model, the same weights as a folder with its own config and model code)."""
    root = tmp_path_factory.mktemp("remote-code")
    plain = make_tiny_model(root / "plain", seed=4)
    return plain, with_own_code(plain, root / "custom")


@pytest.mark.timeout(120)
def test_a_folder_with_its_own_code_is_refused_without_the_flag(
    models: tuple[Path, Path],
) -> None:
    """Loading it in process, and ``inflight engine`` on it: a ValueError / exit 2 that names
    --trust-remote-code, at once (no question on a terminal); its tokenizer alone loads."""
    custom = models[1]
    for load in (lambda: load_model(custom), lambda: model_kind(custom, False)):
        with pytest.raises(ValueError, match="--trust-remote-code"):
            load()
    assert load_tokenizer(custom) is not None  # a plain tokenizer needs no code
    done = subprocess.run(
        engine_command(custom, "--port", str(free_port())),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 2
    assert "--trust-remote-code" in done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_the_engine_serves_it_with_the_flag_as_the_plain_model(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """``--trust-remote-code``: the folder's classes run (``/model_info`` names the custom
    architecture) and greedy ``/generate`` gives what transformers gives on the plain model
    with the same weights."""
    plain, custom = models
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies the code
    with builtin_engine(custom, "--trust-remote-code", env=env) as url:
        answer = post_json(
            url + "/generate",
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        )
        with urllib.request.urlopen(url + "/model_info", timeout=30) as response:
            info = json.loads(response.read())
    assert answer["output_ids"] == hf_greedy(load_reference(plain), PROMPT, 8)
    assert (info["model_type"], info["architectures"]) == ("tiny_custom", ["TinyCustomForCausalLM"])
    assert any((tmp_path / "modules").rglob("modeling_tiny.py"))  # the folder's code ran
