"""What CPPO would do for a run you already have: ``cppo-megatron advise LOG_OR_DIR``.

- ``logs``: a veRL, OpenRLHF or embedded-trainer run's per-step metrics from its console log,
  JSON lines or TensorBoard events (``tfevents``: a reader without TensorBoard installed);
- ``split``: the median phase split over the steps after the warm-up;
- ``recipe``: a recipe's batch and whether its rollout engine holds allocation's larger batch;
- ``advice``: per pruning rate, the bound, the step time to expect, allocation, the recipe change;
- ``report``: the printed text and its JSON.
"""

from .advice import DEFAULT_RATES, GENERATION_BOUND, RateAdvice, advise_rates, recipe_line
from .logs import NoTimingKeys, RunLog, read_run
from .recipe import EngineFit, RecipeFacts, read_recipe
from .report import advice_json, format_advice, generation_warning
from .split import HOSTS, PhaseSplit, phase_split

__all__ = [
    "DEFAULT_RATES",
    "GENERATION_BOUND",
    "HOSTS",
    "EngineFit",
    "NoTimingKeys",
    "PhaseSplit",
    "RateAdvice",
    "RecipeFacts",
    "RunLog",
    "advice_json",
    "advise_rates",
    "format_advice",
    "generation_warning",
    "phase_split",
    "read_recipe",
    "read_run",
    "recipe_line",
]
