"""bench openrlhf: OpenRLHF GRPO and OpenRLHF + CPPO side by side, from OpenRLHF's own step timings.

Each variant is one real ``cppo-megatron openrlhf RECIPE`` run (its own Ray session; the recipe
needs a ``cpu:`` section on a CPU machine) from the same start model, data and seed, one after
the other in this command:

- ``grpo``: P = 0 through the same hook (every completion kept; the advantages equal OpenRLHF's
  group_norm, tests/integrations/openrlhf/test_cpu_e2e.py), so the runs differ only in P and
  allocation, and each logs its prompt count (``cppo/num_groups``);
- ``cppo P alloc``: P with allocation (prompts per step x 1/(1-P));
- ``cppo P no-alloc``: the same P with the GRPO prompt count (the update batch and its
  micro-batches shrink to k/G of GRPO's, so the survivors are not topped back up);
- ``grpo same batch``: GRPO at the prompts allocation draws (``rollout.batch_size`` x G/k, and
  ``train.batch_size`` x G/k: one optimizer step per rollout, as the recipe's GRPO): the same
  generation batch as ``cppo P alloc``, whose row also reports its speedup against this run with
  S_max from this run's split (``bench/samebatch.py``).

From each run's ``metrics.jsonl`` (OpenRLHF's ``timing/*``; the first ``--skip`` steps dropped,
then medians) the seconds per prompt of a whole step (``timing/step_total``) and per phase.
With the GRPO run's phase split — T_gen = ``timing/generation`` (vLLM rollout; the reward is
computed inside it) + ``timing/broadcast`` (weight sync, a fixed cost per step), T_rest =
``timing/make_experience`` (old-policy / reference forwards; CPPO prunes before them) +
``timing/ppo_train`` (the update) — the bound is S_max(P) = (T_gen + T_rest) /
(T_gen + (1 - P) T_rest) (``bench/bound.py``).

  cppo-megatron bench openrlhf recipes/openrlhf/tiny_cpu_cppo.yaml --rate 0.875 --steps 6

(from the main .venv; the runs use .venv-vllm's interpreter, which has OpenRLHF's CPU stack)
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..recipes import arg_type as recipe_arg
from .hostbench import check_args, compare, extras, notes, run_variants
from .report import Report, plot_step_split, seconds_per_prompt
from .samebatch import GRPO, SAME_BATCH, same_batch_prompts

GEN_KEYS = ("timing/generation", "timing/broadcast")
REST_KEYS = ("timing/make_experience", "timing/ppo_train")
PHASES = ("generation", "make_experience", "ppo_train", "broadcast")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("openrlhf"),
                        help="an OpenRLHF CPU recipe with a cppo section (tiny_cpu_cppo.yaml)")
    parser.add_argument("--flags", default="", metavar="'--name value ...'",
                        help="OpenRLHF flags applied to every run, one quoted string")
    parser.add_argument("--python", default=None,
                        help="interpreter that runs OpenRLHF (default: this one if it has DeepSpeed, else "
                             ".venv-vllm/bin/python of this checkout)")
    parser.add_argument("--rate", type=float, default=0.875, help="pruning rate P of the CPPO runs (default 0.875)")
    parser.add_argument("--allocation", choices=["on", "off", "both"], default="both")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the medians (default 1)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse a variant whose run in --out already logged --steps steps (rerun only the others)")
    parser.add_argument("--no-same-batch", action="store_true",
                        help="leave out GRPO at allocation's prompts per step (the equal-batch baseline)")


def _variants(rate: float, allocation: str, recipe: dict, same_batch: bool = False) -> list[tuple[str, list[str]]]:
    """(name, flags) per run, in running order; ``same_batch`` adds GRPO at allocation's batch
    right after CPPO with allocation."""
    grpo = ["--cppo.pruning_rate", "0.0"]
    out = [(GRPO, grpo)]
    for alloc in ([True, False] if allocation == "both" else [allocation == "on"]):
        flags = ["--cppo.pruning_rate", str(rate), "--cppo.allocation", str(alloc).lower()]
        if not alloc:
            flags += _no_alloc_batches(rate, recipe)
        out.append((f"cppo P={rate:g} {'alloc' if alloc else 'no-alloc'}", flags))
        if alloc and same_batch:
            out.append((SAME_BATCH, grpo + _same_batch_flags(rate, recipe)))
    return out


def _same_batch_flags(rate: float, recipe: dict) -> list[str]:
    """GRPO at the prompts allocation draws: rollout and update batch grown by G/k."""
    from ..core.settings import keep_count

    flags = recipe["openrlhf"]
    g = int(flags["rollout.n_samples_per_prompt"])
    keep = keep_count(g, rate, None)
    b = int(flags["rollout.batch_size"])
    big = same_batch_prompts(b, g, keep, "rollout.batch_size")
    return ["--rollout.batch_size", str(big), "--train.batch_size", str(int(flags["train.batch_size"]) * big // b)]


def _no_alloc_batches(rate: float, recipe: dict) -> list[str]:
    """Without allocation the survivors are k/G of GRPO's batch: the update batch and the
    micro-batches shrink with them (else OpenRLHF's multiple would top the kept count back up
    to GRPO's and nothing would be pruned, hook.minimum_keep_multiple)."""
    flags = recipe["openrlhf"]
    g = int(flags["rollout.n_samples_per_prompt"])
    keep = max(1, round(g * (1 - rate)))
    batch = int(flags["train.batch_size"]) * keep // g
    if batch < 1 or int(flags["train.batch_size"]) * keep % g:
        raise ValueError(f"bench openrlhf: train.batch_size {flags['train.batch_size']} x k/G = {keep}/{g} "
                         "is not whole")
    out = ["--train.batch_size", str(batch)]
    for key in ("rollout.micro_batch_size", "train.micro_batch_size"):
        if key in flags and int(flags[key]) > batch:
            out += [f"--{key}", str(batch)]
    return out


def summarize(rows: list[dict], skip: int) -> dict:
    """Median seconds per prompt (whole step and per phase) over the steps after ``skip``."""
    return seconds_per_prompt(rows, skip, step_key="timing/step_total", phase_prefix="timing/", phases=PHASES,
                              hint="was the run made with a cppo section?")


def _recipe_for(recipe: str, run_dir: Path, steps: int, out: Path, slug: str) -> Path:
    data = yaml.safe_load(Path(recipe).read_text())
    if not isinstance(data, dict) or "cpu" not in data or data.get("cppo") is None:
        raise ValueError(f"bench openrlhf: {recipe} needs a cpu section and a cppo section "
                         "(start from recipes/openrlhf/tiny_cpu_cppo.yaml)")
    base = Path(recipe).resolve().parent
    cpu = dict(data["cpu"] or {})
    for key in ("model_dir", "data_dir"):  # shared by every variant, relative to the working directory
        if key in cpu:
            cpu[key] = str(Path(cpu[key]).expanduser().resolve())
    cpu.update(run_dir=str(run_dir), max_steps=steps, eval_before_train=False)
    data["cpu"] = cpu
    flags = data["openrlhf"]
    for key, value in list(flags.items()):  # the copy lives elsewhere: pin ${RECIPE_DIR} now
        if isinstance(value, str):
            flags[key] = value.replace("${RECIPE_DIR}", str(base))
    path = out / f"openrlhf_{slug}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def openrlhf_python(given: str | None) -> str:
    """The interpreter with OpenRLHF's CPU stack (DeepSpeed, vLLM, Ray 2.55)."""
    import importlib.util

    if given:
        return given
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if not venv.is_file():
        raise ValueError("bench openrlhf: this environment has no DeepSpeed and there is no .venv-vllm; "
                         "run bash scripts/setup_vllm.sh (it installs OpenRLHF's CPU stack) or pass --python")
    return str(venv)


def _run_one(python: str, recipe: Path, flags: list[str], log_path: Path) -> None:
    print(f"bench openrlhf: running {' '.join(flags)} (log {log_path})", flush=True)
    args = [python, "-m", "cppo_megatron.cli", "openrlhf", str(recipe), "--eval.steps", "-1", *flags]
    with open(log_path, "w") as log:
        proc = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"bench openrlhf: the run {' '.join(flags)} failed (exit {proc.returncode}); "
                           f"log: {log_path}")


def run(args: argparse.Namespace) -> Report:
    from ..integrations.openrlhf.metrics import read

    check_args(args)
    python = openrlhf_python(args.python)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    same = not args.no_same_batch and args.allocation != "off"

    def launch(slug: str, run_dir: Path, extra: list[str]) -> list[dict]:
        recipe = _recipe_for(args.recipe, run_dir, args.steps, out, slug)
        _run_one(python, recipe, [*shlex.split(args.flags), *extra], out / f"openrlhf_{slug}.log")
        return read(run_dir / "metrics.jsonl")

    variants = _variants(args.rate, args.allocation, yaml.safe_load(Path(args.recipe).read_text()), same)
    results = run_variants(variants, host="openrlhf", runs_dir=out / "openrlhf_runs", step_key="timing/step_total",
                           steps=args.steps, skip=args.skip, reuse=args.reuse, read=read, launch=launch,
                           summarize=summarize)
    table, split = compare(results, args.rate, GEN_KEYS, REST_KEYS)
    for row in table:
        s = results[row["run"]][1]
        row.update({"ms/prompt gen": 1e3 * s["generation_s_per_prompt"],
                    "ms/prompt exp+train": 1e3 * (s["make_experience_s_per_prompt"] + s["ppo_train_s_per_prompt"]),
                    **{f"raw_{k}": v for k, v in s.items()}})
    t_gen, t_rest = split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"]
    return Report(
        name="openrlhf_speedup",
        title=f"OpenRLHF train_ppo_ray: GRPO vs CPPO P={args.rate:g}, {Path(args.recipe).name} "
              f"({args.steps} steps per run, first {args.skip} skipped)",
        params={"recipe": args.recipe, "flags": args.flags, "rate": args.rate, "allocation": args.allocation,
                "steps": args.steps, "skip": args.skip, "same_batch": same},
        columns=["run", "prompts/step", "trained/step", "ms/prompt", "speedup", "bound", "of bound",
                 "speedup same batch", "bound same batch", "of bound same batch", "ms/prompt gen",
                 "ms/prompt exp+train"],
        rows=table,
        notes=notes(f"GRPO phase split per prompt: T_gen (timing/generation + timing/broadcast) {1e3 * t_gen:.2f} ms, "
                    f"T_rest (timing/make_experience + timing/ppo_train) {1e3 * t_rest:.2f} ms", table,
                    "OpenRLHF processes", t0),
        extras=extras(split, results),
        plot=lambda fig: plot_step_split(fig, table, gen_label="timing/generation",
                                         title="OpenRLHF step time per prompt"),
    )

