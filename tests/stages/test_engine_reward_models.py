"""Reward models whose checkpoints ship their own code (``Qwen2ForRewardModel``, as
Qwen2.5-Math-RM; ``Qwen3ForRewardModel``) served by the built-in engine without
``--trust-remote-code``, as SGLang 0.5.23 builds them (``srt/models/qwen2_rm.py``,
``qwen3_rm.py``: the base model, then ``score`` = ``Linear``, ``ReLU``, ``Linear`` to one
output at the last token; ``lm_head`` tensors left unread). Each checkpoint here is written
tensor by tensor as such a model's files are (its config naming the remote code it ships, which
is absent), and each reward is held to a forward computed from those tensors: transformers'
base model, then the head's two layers by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from stages.engine.pooling import pooling_kind
from tests.numerics import assert_close, forward_terms
from tests.stages.test_engine_server import Engine, _tokenizer, serving
from tests.stages.tiny_model import make_mlp_reward, tiny_config

PROMPTS = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15], [16, 17]]


def _reference(model_dir: Path, prompt: list[int]) -> tuple[float, float]:
    """The reward from the checkpoint's tensors (transformers' base model, the head by hand)
    and its rounding's scale (the last layer's ``|weight * input|`` sum)."""
    base = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = load_file(str(model_dir / "model.safetensors"))
    with torch.no_grad():
        last = base(torch.tensor([prompt])).last_hidden_state[0, -1]
        middle = torch.relu(tensors["score.0.weight"] @ last + tensors["score.0.bias"])
        reward = tensors["score.2.weight"] @ middle + tensors["score.2.bias"]
        scale = float((tensors["score.2.weight"].abs() @ middle.abs()).max())
    return float(reward[0]), scale


@pytest.fixture(scope="module", params=["Qwen2ForRewardModel", "Qwen3ForRewardModel"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp(request.param)
    model = make_mlp_reward(root / "model", request.param, seed=11)
    with serving(model, root / "engine.log") as eng:
        yield eng


@pytest.mark.numerics
@pytest.mark.timeout(90)
def test_a_reward_model_with_its_own_code_scores_as_its_tensors_say(engine: Engine) -> None:
    status, out = engine.request("POST", "/classify", {"input_ids": PROMPTS})
    assert status == 200, out
    config = AutoModel.from_pretrained(engine.model_dir).config
    for prompt, answer in zip(PROMPTS, out, strict=True):
        want, scale = _reference(engine.model_dir, prompt)
        assert len(answer["embedding"]) == 1  # one output (the config's num_labels is 2)
        terms = forward_terms(config, len(prompt))
        assert_close(answer["embedding"], [want], terms=terms, scale=scale)
    status, info = engine.request("GET", "/model_info")
    assert status == 200 and info["is_generation"] is False
    assert info["architectures"] == config.architectures
    # /v1/classify: one output, its label the config's first
    text = _tokenizer(engine).decode(PROMPTS[0])
    status, classified = engine.request("POST", "/v1/classify", {"input": text})
    assert status == 200 and classified["data"][0]["probs"] == [1.0], classified
    assert classified["data"][0]["label"] == "LABEL_0"
    # the tensors keep the checkpoint's names (lm_head unread), so a trainer's updates land:
    # another checkpoint of the same shape, loaded from disk, scores as its own tensors say
    status, checked = engine.request("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200, checked
    names = set(checked["ranks"][0]["checksums"])
    assert {"score.0.weight", "score.2.bias", "model.embed_tokens.weight"} <= names
    assert not any(name.startswith("lm_head") for name in names)
    other = make_mlp_reward(engine.model_dir.parent / "other", config.architectures[0], seed=12)
    status, done = engine.request("POST", "/update_weights_from_disk", {"model_path": str(other)})
    assert status == 200 and done["success"], done
    status, after = engine.request("POST", "/classify", {"input_ids": PROMPTS[0]})
    want, scale = _reference(other, PROMPTS[0])
    terms = forward_terms(config, len(PROMPTS[0]))
    assert_close(after["embedding"], [want], terms=terms, scale=scale)


def test_which_reward_models_are_built_here() -> None:
    for name in ("Qwen2ForRewardModel", "Qwen3ForRewardModel"):
        config = tiny_config()
        config.architectures = [name]
        assert pooling_kind(config, False) == "classify"
    config = tiny_config()
    config.architectures = ["InternLM2ForRewardModel"]
    with pytest.raises(ValueError, match="remote-code reward model"):
        pooling_kind(config, False)
