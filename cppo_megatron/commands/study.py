"""Sweep pruning rates x metrics x allocation x seeds at equal time budgets, with a
supervised control; with a veRL recipe, GRPO vs CPPO as real veRL runs at equal wall time.
See cppo_megatron/bench/study.py, bench/verl_study.py and docs/benchmarks.md.

  cppo-megatron study recipes/tiny_cpu.yaml                 # default grid (3 seeds), < 1 h on 2 cores
  cppo-megatron study recipes/tiny_cpu.yaml --full          # every rate, metric (incl. signed), allocation
  cppo-megatron study recipes/verl/tiny_cpu_grpo.yaml --seeds 3 --budget 300   # inside veRL, equal wall time
"""

from ..bench.study import configure, run  # noqa: F401 - the command protocol: configure(parser), run(args)
