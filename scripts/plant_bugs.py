#!/usr/bin/env python3
"""Plant one-line bugs, one at a time, and check that a named test fails on each.

    python scripts/plant_bugs.py                  # every bug in BUGS: caught or SURVIVED, then a summary
    python scripts/plant_bugs.py --only 3,7       # some of them
    python scripts/plant_bugs.py --list           # what each plants, where, and the tests that should fail

Each bug replaces one exact line fragment in one module (it must occur once), runs the given pytest
node ids with ``-x -q``, and puts the module back (also on Ctrl-C). A bug is caught when pytest exits
non-zero. Outside CI: a bug costs one pytest run of its tests. docs/testing.md, "Planted bugs", has
the last table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    module: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


BUGS = (
    Bug("cppo_megatron/trainer/sizing.py", "kind = RankKind(\"the process\", 1, total, hf_copy, total * width, total * 8,",
        "kind = RankKind(\"the process\", 1, total, hf_copy, total * width, total * 4,",
        ("tests/trainer/test_sizing_edges.py",), "HF backend sizing: AdamW counted at 4 B/param instead of 8"),
    Bug("cppo_megatron/trainer/sizing.py",
        "engine = (vllm_bytes + sync_here) if ro.engine == \"vllm\" else hf_gen",
        "engine = vllm_bytes if ro.engine == \"vllm\" else hf_gen",
        ("tests/trainer/test_sizing_edges.py",), "HF backend with vLLM on CPU: the weight sync's copy not counted"),
    Bug("cppo_megatron/megatron/memory.py", "if not d[\"tied\"] or pp > 1:", "if not d[\"tied\"]:",
        ("tests/megatron/test_refusals.py",), "memory: a tied head's copy on the last stage of a pipeline forgotten"),
    Bug("cppo_megatron/integrations/watchdog.py", "if not self._halt.wait(self.interrupt_wait_s):",
        "if self._halt.wait(self.interrupt_wait_s):",
        ("tests/integrations/test_watchdog_loop.py",), "watchdog: a driver that ignores the interrupt is never exited"),
    Bug("cppo_megatron/integrations/watchdog.py", "            if self.first_seen is None:\n",
        "            if True:\n",
        ("tests/integrations/test_watchdog_loop.py",), "watchdog: each new death restarts the grace"),
    Bug("cppo_megatron/integrations/verl/hook.py", "if getattr(trainer, \"use_critic\", False):",
        "if not getattr(trainer, \"use_critic\", False):",
        ("tests/integrations/verl/test_hook_edges.py",), "veRL legacy loop: the critic's mini-batch multiple inverted"),
    Bug("cppo_megatron/integrations/verl/dapo.py", "if not self.failed and seen != self.completions_generated:",
        "if seen != self.completions_generated:",
        ("tests/integrations/verl/test_dapo_edges.py",), "DAPO accounting: a failed group reported as lost completions"),
    Bug("cppo_megatron/integrations/openrlhf/preflight.py", "if cpu_num_gpus is not None and cpu_num_gpus < actors:",
        "if cpu_num_gpus is not None and cpu_num_gpus <= actors:",
        ("tests/integrations/openrlhf/test_accounting_edges.py",), "OpenRLHF preflight: enough logical GPUs refused"),
    Bug("cppo_megatron/integrations/openrlhf/selective.py", "if saved_n is not None and int(saved_n) != self.num_prompts:",
        "if saved_n is not None and int(saved_n) == self.num_prompts:",
        ("tests/integrations/openrlhf/test_selective_edges.py",),
        "OpenRLHF selective rollout: the data-set size warning on the wrong resumes"),
    Bug("cppo_megatron/integrations/wrap.py", "if not isinstance(name, str) or not name:", "if not isinstance(name, str):",
        ("tests/integrations/test_wrap.py",), "wrap: an empty attribute name accepted"),
    Bug("cppo_megatron/integrations/verl/runconfig.py",
        "if bool(OmegaConf.select(config, \"actor_rollout_ref.actor.use_dynamic_bsz\", default=False)):",
        "if False:", ("tests/integrations/verl/test_runconfig_edges.py",),
        "veRL micro-batch roles: fixed sizes shrunk under dynamic batch sizes"),
    Bug("cppo_megatron/megatron/actor.py", "                param_state[\"step\"] = param_state[\"step\"].clone()\n",
        "                pass\n", ("tests/megatron/test_actor_state.py",),
        "Megatron resume: one shared Adam step tensor (megatron-core's) left in place"),
    Bug("cppo_megatron/core/selective.py", "return ~self.decision.skip | self.forced_mask",
        "return ~self.decision.skip",
        ("tests/core/test_selective_run.py",), "selective rollout: a forced keep (the capped fill) not generated"),
    Bug("cppo_megatron/core/balance.py", "best = (max(top - hw[a], loads[j] + hw[a]), a, None, j, float(hw[a]))",
        "best = (max(top - hw[a], loads[j] + hw[a]), a, None, j, float(hw[a]) / 2)",
        ("tests/core/test_edges.py",), "balance: a move books half the moved workload"),
    Bug("cppo_megatron/trainer/checkpoint.py", "        for old in checkpoints(out_dir)[KEEP_LAST:]:",
        "        for old in checkpoints(out_dir)[KEEP_LAST + 1:]:",
        ("tests/trainer/test_selective_checkpoint_edges.py",), "checkpoints: one more than KEEP_LAST kept"),
    Bug("cppo_megatron/distributed/launch.py", "    hint = f\": {_WHY[sig]}\" if sig in _WHY else \"\"",
        "    hint = \"\"", ("tests/distributed/test_launch.py",), "run_local: a dead rank's signal without its hint"),
    # early stopping (issue 41): the three bugs the issue names, and a stopped row trained on
    Bug("cppo_megatron/core/early_stop.py",
        "torch.sort(torch.where(candidate, majority, -1.0)[perm], descending=True, stable=True)",
        "torch.sort(torch.where(candidate, majority, -1.0)[perm], descending=False, stable=True)",
        ("tests/core/test_early_stop.py",), "early stop: the wrong end of the ranking stopped"),
    Bug("cppo_megatron/core/early_stop.py", "pruned_after=(~stop & ~kept_mask).nonzero().squeeze(1))",
        "pruned_after=(~kept_mask).nonzero().squeeze(1))",
        ("tests/core/test_early_stop.py",), "early stop: a stopped completion counted as pruned after generation"),
    Bug("cppo_megatron/trainer/early_stop.py",
        "        metrics = self._step_metrics(batch, kept, y)\n"
        "        self.history.add(self.step, *self._examples(y, batch.rewards.to(torch.float64), batch.stopped))\n"
        "        self.ready = self.history.refit(self.predictor, self.es.min_examples)\n",
        "        self.history.add(self.step, *self._examples(y, batch.rewards.to(torch.float64), batch.stopped))\n"
        "        self.ready = self.history.refit(self.predictor, self.es.min_examples)\n"
        "        metrics = self._step_metrics(batch, kept, y)\n",
        ("tests/trainer/test_early_stop.py",), "early stop: the predictor trained on the current step's rewards first"),
    Bug("cppo_megatron/core/early_stop.py", "    adv = torch.where(stop, torch.zeros_like(adv), adv)\n", "",
        ("tests/core/test_early_stop.py",), "early stop: a stopped completion's advantage not zeroed"),
)


def run(bug: Bug, index: int) -> tuple[bool, float, str]:
    path = ROOT / bug.module
    text = path.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"bug {index}: {bug.old!r} occurs {text.count(bug.old)} times in {bug.module} (expected 1): "
                         "update BUGS")
    path.write_text(text.replace(bug.old, bug.new))
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *bug.tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=1800)
    finally:
        path.write_text(text)
    failed = [ln.split(" - ")[0] for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")]
    return proc.returncode != 0, time.monotonic() - t0, (failed[0][len("FAILED "):] if failed else proc.stdout[-200:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated bug numbers (1-based)")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args(argv)
    chosen = [int(i) for i in args.only.split(",")] if args.only else list(range(1, len(BUGS) + 1))
    if args.list:
        for i in chosen:
            b = BUGS[i - 1]
            print(f"{i:2} {b.module}: {b.what}\n     {b.old.strip()!r} -> {b.new.strip()!r}\n     tests: {' '.join(b.tests)}")
        return 0
    survived = 0
    for i in chosen:
        caught, seconds, detail = run(BUGS[i - 1], i)
        survived += not caught
        print(f"{i:2} {'caught ' if caught else 'SURVIVED'} {seconds:5.0f} s  {BUGS[i - 1].what}: {detail}", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} planted bugs caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
