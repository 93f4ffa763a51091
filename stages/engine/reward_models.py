"""Reward models whose checkpoints ship code of their own, built here as SGLang 0.5.23 builds
them natively, so that they load without ``--trust-remote-code``.

``Qwen2ForRewardModel`` (Qwen2.5-Math-RM's architecture; ``srt/models/qwen2_rm.py``) and
``Qwen3ForRewardModel`` (``qwen3_rm.py``): the base model (transformers' ``Qwen2Model`` or
``Qwen3Model``), then a two-layer head, ``score`` = ``Linear(hidden, hidden)``, ``ReLU``,
``Linear(hidden, 1)``, read at the prompt's last token (``Pooler(LAST, normalize=False)``). The
checkpoint's tensors keep their names (``model.*``, ``score.0.*``, ``score.2.*``; a causal LM's
``lm_head`` is left unread, as SGLang filters it), so a trainer's weight updates name them as
the checkpoint does. ``InternLM2ForRewardModel`` has no backbone in transformers and stays
refused (``pooling.pooling_kind``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Qwen2Model, Qwen2PreTrainedModel, Qwen3Model, Qwen3PreTrainedModel

from stages.engine.reward_model_names import REWARD_MODEL_NAMES

__all__ = ["REWARD_MODELS", "reward_model_class"]


class _MlpReward:
    """The parts both architectures share (mixed into each one's ``PreTrainedModel``)."""

    model: nn.Module

    def _build(self, config: Any, backbone: type[nn.Module]) -> None:
        self.model = backbone(config)
        hidden = config.hidden_size
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def forward(
        self, input_ids: torch.Tensor | None = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        """The reward at each row's last real token (right-padded rows)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        states = hidden.last_hidden_state
        if attention_mask is None:
            last = torch.full((states.shape[0],), states.shape[1] - 1, device=states.device)
        else:
            last = attention_mask.sum(-1) - 1
        return self.score(states[torch.arange(states.shape[0], device=states.device), last])

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Any:
        """As an auto class builds it (``loader.instantiate``'s ``dummy``/``remote_instance``)."""
        kwargs.pop("trust_remote_code", None)
        return cls._from_config(config, **kwargs)  # type: ignore[attr-defined]


class Qwen2ForRewardModel(_MlpReward, Qwen2PreTrainedModel):
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._build(config, Qwen2Model)
        self.post_init()


class Qwen3ForRewardModel(_MlpReward, Qwen3PreTrainedModel):
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._build(config, Qwen3Model)
        self.post_init()


REWARD_MODELS: dict[str, type] = {
    "Qwen2ForRewardModel": Qwen2ForRewardModel,
    "Qwen3ForRewardModel": Qwen3ForRewardModel,
}
assert set(REWARD_MODELS) == REWARD_MODEL_NAMES


def reward_model_class(architectures: Any) -> type | None:
    """The class this engine builds for a checkpoint of ``architectures`` (None: none here)."""
    for name in architectures or []:
        if name in REWARD_MODELS:
            return REWARD_MODELS[name]
    return None
