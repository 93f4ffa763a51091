"""Rollouts: how a prompt becomes a trajectory (one completion, tool calls, an environment's turns).

``api.py`` (the plugin interface and its config), ``trajectory.py`` (sampled and inserted tokens),
``single_turn.py`` (the default), ``tools.py`` / ``tool_format.py`` / ``tool_rollout.py`` (tool
calls), ``environments.py`` / ``env_rollout.py`` (multi-turn environments), ``openai_agent.py`` /
``agent_proxy.py`` (agents written for the ``openai`` client, through an OpenAI-compatible proxy),
``examples.py`` (the ``calc`` tool, the ``guess_number`` game and the ``one_completion`` agent).
"""
