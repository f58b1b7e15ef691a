"""Reward for the worked-arithmetic task (``cppo_megatron.tasks.worked``), loaded by OpenRLHF from
``--reward.remote_url reward_worked.py`` inside its rollout workers.

OpenRLHF calls ``reward_func(queries, prompts, labels)``. The completion (the worked solution after
the prompt) is scored by the embedded trainer's own checker against the question in the prompt:
1.0 when the answer in its <answer> tags is right, else 0.0 (no format bonus), so OpenRLHF's
evaluation ``eval_*_pass1`` with greedy decoding is exactly held-out accuracy.
"""

from cppo_megatron.integrations.openrlhf.reward import reward_func_worked as reward_func  # noqa: F401
