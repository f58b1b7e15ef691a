"""Framework-free CPPO core: pure functions over tensors and the CPPO settings type they
take. Imports nothing from the rest of the package (only torch, numpy and the standard
library; ``tests/core/test_layering.py`` keeps it so).

- ``settings``: ``CPPOConfig`` (every field documented; its ``SelectiveConfig`` section) and the
  choice lists its fields allow
- ``advantage``: full-group GRPO / Dr. GRPO advantages and statistics
- ``selection``: which completions survive (metric, scope, seeded tie-breaks)
- ``sampling``: importance sampling (unbiased pruning) and keep_mass counts, vectorised
- ``allocation``: prompts per step so survivors fill the capacity; prompt accounting
- ``balance``: sequences -> data-parallel ranks and micro-batches
- ``loss``: clipped surrogate, KL estimators, loss aggregation over the kept set
- ``pipeline``: ``prune`` = advantages + selection in one call
- ``selective``: selective rollout (GRESO): per-prompt history, pre-rollout skip decisions,
  adaptive exploration rates, batch filling, a step's ``selective/*`` metrics;
  ``selective_run``: ``SelectiveRun``, the driver every host runs over them
- ``early_stop`` (settings: ``settings.EarlyStopConfig``): early stopping inside the rollout engine:
  prefix features, the online predictor and its history, the stop rule, the estimator for
  groups with stopped completions, accounting and predictor quality
- ``two_wave`` (settings: ``settings.TwoWaveConfig``): adaptive group size in two waves: which
  groups get their second wave, where each wave's rows sit, accounting, the estimator
"""

from ._checks import check_int  # public: the int check adapters share with the core
from .advantage import ADV_NORMS, GroupStats, advantages_from_stats, group_advantages
from .allocation import AllocationPlanner, AllocationTotals, PromptSampler
from .balance import (
    Partition,
    balance_partitions,
    lower_bound,
    naive_partition,
    pack_micro_batches,
    sequence_workload,
)
from .early_stop import (
    PrefixPredictor,
    StopAccounting,
    StopDecision,
    StopHistory,
    decide_stops,
    early_stop_prune,
    prefix_features,
)
from .loss import (
    KL_KINDS,
    LOSS_AGG_MODES,
    aggregate_loss,
    clipped_surrogate,
    kl_penalty,
    token_logprobs,
)
from .pipeline import PruneResult, prune
from .sampling import inclusion_probabilities, mass_keep_counts, systematic_sample
from .selection import (
    Selection,
    keep_order,
    seeded_generator,
    select_completions,
)
from .selective import (
    ExplorationRates,
    FilledBatch,
    GroupOutcomes,
    OutcomeCounts,
    RoundCounts,
    SelectiveHistory,
    SkipDecision,
    adapt_exploration,
    adapt_from_config,
    count_rounds,
    decide_skips,
    estimate_tokens_saved,
    fill_batch,
    group_outcomes,
    step_metrics,
    target_shares,
)
from .selective_run import SelectiveRun
from .settings import (
    DEFAULT_PRUNING_RATE,
    METRICS,
    SCOPES,
    CPPOConfig,
    EarlyStopConfig,
    SelectiveConfig,
    TwoWaveConfig,
    keep_count,
)
from .two_wave import TwoWaveAccounting, finish_groups, two_wave_accounting, two_wave_advantages, wave_rows

__all__ = [
    "ADV_NORMS",
    "AllocationPlanner",
    "AllocationTotals",
    "CPPOConfig",
    "DEFAULT_PRUNING_RATE",
    "EarlyStopConfig",
    "TwoWaveAccounting",
    "TwoWaveConfig",
    "ExplorationRates",
    "FilledBatch",
    "GroupOutcomes",
    "GroupStats",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "METRICS",
    "OutcomeCounts",
    "Partition",
    "PrefixPredictor",
    "PromptSampler",
    "PruneResult",
    "RoundCounts",
    "SCOPES",
    "Selection",
    "SelectiveConfig",
    "SelectiveHistory",
    "SelectiveRun",
    "SkipDecision",
    "StopAccounting",
    "StopDecision",
    "StopHistory",
    "adapt_exploration",
    "adapt_from_config",
    "advantages_from_stats",
    "aggregate_loss",
    "balance_partitions",
    "check_int",
    "clipped_surrogate",
    "count_rounds",
    "decide_skips",
    "decide_stops",
    "early_stop_prune",
    "estimate_tokens_saved",
    "fill_batch",
    "group_outcomes",
    "group_advantages",
    "inclusion_probabilities",
    "mass_keep_counts",
    "systematic_sample",
    "keep_count",
    "keep_order",
    "kl_penalty",
    "lower_bound",
    "naive_partition",
    "pack_micro_batches",
    "prefix_features",
    "prune",
    "seeded_generator",
    "select_completions",
    "step_metrics",
    "target_shares",
    "sequence_workload",
    "token_logprobs",
    "finish_groups",
    "two_wave_accounting",
    "two_wave_advantages",
    "wave_rows",
]
