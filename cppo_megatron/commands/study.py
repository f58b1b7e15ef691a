"""Sweep pruning rates x metrics x allocation x seeds at equal time budgets, with a
supervised control; see cppo_megatron/bench/study.py and docs/benchmarks.md.

  cppo-megatron study recipes/tiny_cpu.yaml                 # default grid (3 seeds), < 1 h on 2 cores
  cppo-megatron study recipes/tiny_cpu.yaml --full          # every rate, metric (incl. signed), allocation
"""

from ..bench.study import configure, run  # noqa: F401 - the command protocol: configure(parser), run(args)
