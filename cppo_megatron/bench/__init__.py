"""Benchmarks and the cluster cost model.

- ``bound``: S_max(P), the speedup bound of pruning, shared by every speedup report
- ``report``: JSON + markdown table + PNG output of one benchmark
- ``overhead``: cost of advantages + selection + allocation + balancing per step
- ``balancing``: our balancer vs veRL's and the contiguous split
- ``simulate``: predicted step time per phase and speedup on GPU clusters

The training benchmarks (``speedup``, ``rollout``) and the ``study`` sweep need the
embedded trainer and plug into ``cppo_megatron.commands.bench.BENCHMARKS``.
"""

from .bound import fraction_of_bound, speedup, speedup_bound
from .report import Report, write_report

__all__ = ["Report", "fraction_of_bound", "speedup", "speedup_bound", "write_report"]
