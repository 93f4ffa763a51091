"""Models with sliding-window layers (gpt-oss alternates them with full attention, as Gemma 3
and 4 do; Qwen2 and Mistral can slide every layer) served by the built-in engine. On its own
passes (``llama_forward``: gpt-oss, Qwen2, Mistral, Gemma 3, Phi-3) a sliding layer attends to its
last ``sliding_window`` positions, counted by real tokens, and the prefix cache serves them; on
transformers' (Gemma 4, ``--forward transformers``) each decode step hands the sliding layers a
mask of their last columns (``scheduler._layer_masks``) and prompts are prefilled whole (no
prefix cache: a cached prefix leaves padding inside the window). Greedy answers equal
transformers' own, whose sliding caches and masks are its reference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.stages.test_engine_server import Engine, serving
from tests.stages.tiny_model import (
    make_gpt_oss_model,
    make_tiny_gemma3_model,
    make_tiny_model,
    make_tiny_phi3_model,
)

WINDOW = 3


def _sliding_qwen2(path: Path) -> Path:
    """A tiny Qwen2 whose every layer slides (``use_sliding_window``: sdpa's boolean masks)."""
    make_tiny_model(path, vocab=128, seed=1)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    config.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _sliding_mistral(path: Path) -> Path:
    """A tiny Mistral with a sliding window (its first models': every layer, no layer types)."""
    make_tiny_model(path, vocab=128, seed=2)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
    for key in ("layer_types", "use_sliding_window", "max_window_layers"):
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _sliding_gemma4(path: Path) -> Path:
    """A tiny Gemma 4 text model (``gemma4_text``: a sliding layer, then a full one)."""
    from transformers import Gemma4TextConfig

    make_tiny_model(path, vocab=128, seed=3)  # its tokenizer; the weights are replaced
    config = Gemma4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(path)
    return path


# the model, and the forward path it must be served on
CASES = {
    "gpt_oss": "fast",
    "gpt_oss-transformers": "transformers",
    "qwen2": "fast",
    "qwen2-transformers": "transformers",
    "mistral": "fast",
    "gemma3": "fast",
    "gemma4": "transformers",
    "phi3": "fast",
}


@pytest.fixture(scope="module", params=sorted(CASES))
def sliding_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """gpt-oss (a sliding layer, then a full one; eager attention's additive masks), a Qwen2
    sliding everywhere (sdpa), a Mistral with a window and no layer types, Gemma 3, Gemma 4 or
    Phi-3 (every layer, half of each head rotated);
    on the engine's passes, or with ``-transformers`` on transformers'."""
    root = tmp_path_factory.mktemp(f"sliding-{request.param}")
    kind = request.param.removesuffix("-transformers")
    if kind == "gpt_oss":
        model_dir = make_gpt_oss_model(root / "model", window=WINDOW)
    elif kind == "qwen2":
        model_dir = _sliding_qwen2(root / "model")
    elif kind == "gemma3":
        model_dir = make_tiny_gemma3_model(root / "model", window=WINDOW)
    elif kind == "gemma4":
        model_dir = _sliding_gemma4(root / "model")
    elif kind == "phi3":
        model_dir = make_tiny_phi3_model(root / "model", window=WINDOW)
    else:
        model_dir = _sliding_mistral(root / "model")
    flags = ("--forward", "transformers") if request.param.endswith("-transformers") else ()
    with serving(model_dir, root / "engine.log", *flags) as eng:
        info = requests.get(eng.url + "/server_info", timeout=30).json()
        assert info["forward_path"] == CASES[request.param], info["forward_fallback_reason"]
        yield eng


def _reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens, each step a whole forward (transformers builds the sliding mask)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.timeout(120)
def test_sliding_window_answers_equal_transformers(sliding_engine: Engine) -> None:
    model = AutoModelForCausalLM.from_pretrained(sliding_engine.model_dir, dtype=torch.float32)
    model.eval()
    prompts = [[5, 17, 33, 8, 20, 9, 11], [7, 3], [12, 30, 4, 4, 29]]  # left-padded together
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    out = sliding_engine.generate(
        {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12},
        }
    )
    with torch.no_grad():
        for prompt, answer in zip(prompts, out, strict=True):
            assert answer["output_ids"] == _reference(model, prompt, 12), prompt
    # a window that mattered: with one wider than the contexts the answers differ
    config = AutoConfig.from_pretrained(sliding_engine.model_dir)
    config.sliding_window = 4096
    full = AutoModelForCausalLM.from_pretrained(
        sliding_engine.model_dir, config=config, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert any(
            a["output_ids"] != _reference(full, p, 12) for p, a in zip(prompts, out, strict=True)
        )


@pytest.mark.timeout(120)
def test_prompts_on_a_cached_prefix_keep_their_window(sliding_engine: Engine) -> None:
    """On the engine's passes the prefix cache serves these models too: prompts that extend
    earlier prompts and answers take their KV from the cache; prefilled together on prefixes of
    different lengths, a row's padding lies between its prefix and its new tokens, which the
    window does not count; answers as transformers'. On transformers' passes nothing is
    cached."""
    info = requests.get(sliding_engine.url + "/server_info", timeout=30).json()
    model = AutoModelForCausalLM.from_pretrained(sliding_engine.model_dir, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
    firsts = [[(7 * i + 3) % vocab for i in range(11)], [(5 * i + 2) % vocab for i in range(5)]]
    outs = sliding_engine.generate({"input_ids": firsts, "sampling_params": params})
    # one new token on the longer prefix, four on the shorter: three columns of padding
    later = [
        [*firsts[0], *outs[0]["output_ids"], 9 % vocab],
        [*firsts[1], *outs[1]["output_ids"], *(t % vocab for t in (4, 8, 15, 16))],
    ]
    both = sliding_engine.generate({"input_ids": later, "sampling_params": params})
    with torch.no_grad():
        for prompt, answer in zip(later, both, strict=True):
            assert answer["output_ids"] == _reference(model, prompt, 6), prompt
    cached = [answer["meta_info"]["cached_tokens"] for answer in both]
    if info["forward_path"] == "fast":
        assert cached[0] >= len(firsts[0]) and cached[1] >= len(firsts[1]), cached
    else:
        assert cached == [0, 0]
