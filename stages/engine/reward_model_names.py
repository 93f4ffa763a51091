"""The architectures ``stages.engine.reward_models`` builds (reward models whose checkpoints
ship code of their own), named apart so that reading a config does not import their classes."""

__all__ = ["REWARD_MODEL_NAMES"]

REWARD_MODEL_NAMES = frozenset({"Qwen2ForRewardModel", "Qwen3ForRewardModel"})
