"""core.keep_order ranks completions exactly as select_completions does."""

from __future__ import annotations

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import group_advantages, keep_order, select_completions


@pytest.mark.parametrize("metric", ["smallest", "largest", "random"])
def test_batch_scope_selection_is_a_prefix_of_keep_order(metric):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 3, (64,), generator=gen).float()  # many ties
    groups = torch.arange(64) // 8
    adv, _ = group_advantages(rewards, groups)
    for step in (0, 5):
        for p in (0.5, 0.875):
            cfg = CPPOConfig(pruning_rate=p, scope="batch", metric=metric, seed=7)
            order = keep_order(adv, cfg, step=step)
            assert sorted(order.tolist()) == list(range(64))
            kept = select_completions(adv, groups, cfg, step=step).kept
            assert sorted(order[: kept.numel()].tolist()) == kept.tolist()


def test_keep_order_rejects_bad_settings():
    with pytest.raises(TypeError, match="cfg must be a cppo_megatron.config.CPPOConfig, got C"):
        keep_order(torch.zeros(3), type("C", (), {"metric": "smallest"})())
    cfg = CPPOConfig()
    cfg.metric = "median"  # reassigned after construction: validated again on use
    with pytest.raises(ValueError, match="CPPOConfig.metric must be one of"):
        keep_order(torch.zeros(3), cfg)
    with pytest.raises(ValueError, match="step"):
        keep_order(torch.zeros(3), CPPOConfig(), step=-1)
