"""Reward for the arithmetic task (``cppo_megatron.tasks``), loaded by OpenRLHF from
``--reward.remote_url reward_arithmetic.py`` inside its rollout workers.

OpenRLHF calls ``reward_func(queries, prompts, labels)``: ``queries`` are the decoded prompt +
completion (special tokens kept), ``prompts`` the chat-templated prompts. The completion is
scored by the embedded trainer's own checker (an exact integer answer). Reward = 1.0 when
correct, else 0.0 (no format bonus), so OpenRLHF's evaluation ``eval_*_pass1`` with greedy
decoding is exactly held-out accuracy.
"""

from cppo_megatron.integrations.openrlhf.reward import reward_func  # noqa: F401
