"""The reward scorer: rollouts grouped per prompt, scored by reward functions (``stage.py``)."""
