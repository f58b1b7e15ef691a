"""The ``cppo`` advantage estimator for veRL (``algorithm.adv_estimator=cppo``).

GRPO's outcome advantage, but from the statistics of the FULL group recorded when the batch
was pruned (``stats.record_groups``), never recomputed over the survivors: with rewards
[1,0,0,0,0,0,0,0] and 4 kept, the full-group advantages are +2.47 / -0.35, survivor
statistics would give +1.50 / -0.50.
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import ESTIMATOR_NAME
from ...core import advantages_from_stats
from .stats import lookup, recorded_uids

__all__ = ["ESTIMATOR_NAME", "compute_cppo_outcome_advantage", "register_estimator"]


def compute_cppo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config=None,
    **_unused,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of the kept completions from full-group statistics.

    Args:
        token_level_rewards: [N, T] as veRL passes them; the outcome reward is the row sum.
        response_mask: [N, T].
        index: [N] prompt uids (veRL's ``uid``).
        config: veRL's ``algorithm`` config (unused: the settings were recorded at pruning).

    Returns:
        (advantages, returns): [N, T] each, the scalar advantage broadcast over the response
        tokens, as ``compute_grpo_outcome_advantage``. Loss-free padding rows (response mask
        all zero, uid not recorded) get 0.
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [N, T]"
        )
    n = token_level_rewards.shape[0]
    if index is None or len(index) != n:
        raise ValueError(
            f"the cppo estimator needs index (the prompt uid of each row) with {n} entries, got "
            f"{None if index is None else len(index)}"
        )
    scores = token_level_rewards.sum(dim=-1)
    has_tokens = response_mask.sum(dim=-1) > 0
    mean = torch.zeros(n, dtype=torch.float64)
    std = torch.ones(n, dtype=torch.float64)
    real = torch.zeros(n, dtype=torch.bool)
    adv_norm, eps = None, None
    for i, uid in enumerate(index):
        rec = lookup(uid)
        if rec is None:
            if bool(has_tokens[i]):
                known = recorded_uids()
                raise ValueError(
                    f"cppo estimator: row {i} (uid {uid!r}) has no full-group statistics. The CPPO "
                    "pruning hook did not see this batch: run through `python -m "
                    "cppo_megatron.integrations.verl.main` or load the plugin "
                    "(VERL_USE_EXTERNAL_MODULES=cppo_megatron.integrations.verl) in the trainer "
                    f"process. Recorded uids: {known[:4]}{' ...' if len(known) > 4 else ''}"
                )
            continue  # loss-free padding row
        if adv_norm is None:
            adv_norm, eps = rec.adv_norm, rec.eps
        mean[i], std[i], real[i] = rec.mean, rec.std, True
    adv = torch.zeros(n, dtype=scores.dtype, device=scores.device)
    if bool(real.any()):
        rows = real.nonzero().squeeze(-1)
        assert adv_norm is not None and eps is not None  # a real row's record set them above
        adv_real = advantages_from_stats(
            scores[rows.to(scores.device)].detach().cpu(), mean[rows], std[rows], adv_norm=adv_norm, eps=eps
        )
        adv[rows.to(scores.device)] = adv_real.to(device=scores.device, dtype=scores.dtype)
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


def register_estimator() -> None:
    """Register ``cppo`` in veRL's advantage-estimator registry (idempotent)."""
    from verl.trainer.ppo import core_algos

    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    current = registry.get(ESTIMATOR_NAME)
    if current is compute_cppo_outcome_advantage:
        return
    if current is not None and getattr(current, "__qualname__", None) == compute_cppo_outcome_advantage.__qualname__:
        registry[ESTIMATOR_NAME] = compute_cppo_outcome_advantage  # a reloaded copy of this module
        return
    core_algos.register_adv_est(ESTIMATOR_NAME)(compute_cppo_outcome_advantage)
