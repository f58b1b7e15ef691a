"""End-of-run report: a markdown summary and PNG plots from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from .logger import read_metrics
from .metrics import PHASES


def summarize(records: list[dict]) -> dict:
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    phase_totals = {p: sum(r.get(f"time/{p}", 0.0) for r in steps) for p in PHASES}
    step_times = sorted(r["time/step"] for r in steps)
    total = sum(phase_totals.values())
    last = steps[-1] if steps else {}
    return {
        "steps": len(steps),
        "accuracy_before": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
        "accuracy_stderr": evals[-1].get("eval/stderr") if evals else None,
        "rl_wall_s": last.get("wall", 0.0),
        "step_seconds": step_times[len(step_times) // 2] if step_times else None,  # median
        "phase_seconds": phase_totals,
        "phase_share": {p: (v / total if total else 0.0) for p, v in phase_totals.items()},
        "prompts_drawn": last.get("alloc/total_prompts_drawn"),
        "completions_generated": last.get("alloc/total_completions_generated"),
        "completions_trained": last.get("alloc/total_completions_kept"),
        "peak_rss_mb": max((r.get("sys/peak_rss_mb", 0.0) for r in records), default=0.0),
    }


def write_report(out_dir: Path, title: str, plots: bool = True, balance: bool = False) -> dict:
    """report.md (+ report.png) and summary.json from metrics.jsonl; ``balance`` adds the
    rank-balance section and ``balance/*`` figures (runs with several ranks)."""
    records = read_metrics(out_dir / "metrics.jsonl")
    s = summarize(records)
    if balance:
        s.update(balance_summary(records))
    warm = [r for r in records if "warmup/accuracy" in r]
    lines = [f"# {title}", ""]
    if warm:
        lines.append(
            f"- warm-up (SFT): accuracy {warm[0]['warmup/accuracy']:.3f} -> {warm[-1]['warmup/accuracy']:.3f}"
            + (f" in {warm[-1].get('warmup/time', 0):.0f} s" if "warmup/time" in warm[-1] else "")
        )
    if s["accuracy_before"] is not None:
        lines.append(
            f"- held-out greedy accuracy: {s['accuracy_before']:.3f} before RL -> {s['accuracy_after']:.3f} after "
            f"(± {s['accuracy_stderr']:.3f} evaluation stderr)"
        )
    lines.append(f"- RL: {s['steps']} steps in {s['rl_wall_s']:.1f} s")
    if s["prompts_drawn"] is not None:
        lines.append(
            f"- prompts drawn {s['prompts_drawn']:.0f}, completions generated {s['completions_generated']:.0f}, "
            f"trained {s['completions_trained']:.0f}"
        )
    lines.append(f"- peak RSS {s['peak_rss_mb']:.0f} MB")
    lines += ["", "| phase | seconds | share |", "|---|---|---|"]
    for p in PHASES:
        lines.append(f"| {p} | {s['phase_seconds'][p]:.1f} | {s['phase_share'][p]:.1%} |")
    if plots and _plot(records, out_dir / "report.png", title):
        lines += ["", "![report](report.png)"]
    if balance:
        lines += _balance_lines(s)
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    # machine-readable too: `cppo-megatron bench overhead --step-seconds OUT_DIR/summary.json`
    (out_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    return s


def _plot(records: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot([r["step"] for r in steps], [r["reward/mean"] for r in steps], lw=1)
    ax[0, 0].set(title="mean reward (sampled)", xlabel="step")
    ax[0, 1].plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-")
    ax[0, 1].set(title="held-out greedy accuracy", xlabel="step", ylim=(0, 1))
    ax[1, 0].plot([r["wall"] for r in evals], [r["eval/accuracy"] for r in evals], "o-")
    ax[1, 0].set(title="accuracy vs RL wall time", xlabel="seconds", ylim=(0, 1))
    bottom = [0.0] * len(steps)
    for p in PHASES:
        vals = [r.get(f"time/{p}", 0.0) for r in steps]
        if any(vals):
            ax[1, 1].bar([r["step"] for r in steps], vals, bottom=bottom, label=p, width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax[1, 1].set(title="time per step by phase", xlabel="step", ylabel="s")
    ax[1, 1].legend(fontsize=7)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def balance_summary(records: list[dict]) -> dict:
    """Mean over RL steps of the balance metrics (what the report and the docs quote)."""
    steps = [r for r in records if r.get("kind") == "step"]
    if not steps:
        return {}

    def mean(key):
        vals = [r[key] for r in steps if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    world = len(steps[0].get("rank/wait_seconds", []))
    return {
        "balance/imbalance": mean("cppo/exchange_imbalance"),
        "balance/imbalance_without": mean("cppo/exchange_imbalance_without"),
        "balance/max_load": mean("cppo/exchange_max_load"),
        "balance/max_load_without": mean("cppo/exchange_max_load_without"),
        "balance/mean_load": mean("cppo/exchange_mean_load"),
        "balance/moved_sequences": mean("cppo/exchange_moved_sequences"),
        "balance/rank_time_imbalance": mean("cppo/rank_time_imbalance"),
        "balance/rank_wait_mean": mean("cppo/rank_wait_mean"),
        "balance/rank_wait_max": mean("cppo/rank_wait_max"),
        "balance/rank_wait_fraction": mean("cppo/rank_wait_fraction"),
        "balance/old_logprob_imbalance": mean("rank/old_logprob_imbalance"),
        "balance/old_logprob_wait_mean": mean("rank/old_logprob_wait_mean"),
        "balance/rank_wait_per_rank": [sum(r["rank/wait_seconds"][i] for r in steps) / len(steps)
                                       for i in range(world)],
        "balance/pass_seconds_per_rank": [sum(r["rank/pass_seconds"][i] for r in steps) / len(steps)
                                          for i in range(world)],
    }


def _balance_lines(s: dict) -> list[str]:
    if "balance/imbalance" not in s:
        return []
    return [
        "", "## Rank balance (means over RL steps)", "",
        f"- workload max/mean over DP ranks: {s['balance/imbalance']:.4f} with redistribution, "
        f"{s['balance/imbalance_without']:.4f} if survivors had stayed on their rank "
        f"(max load {s['balance/max_load']:.0f} vs {s['balance/max_load_without']:.0f}, mean "
        f"{s['balance/mean_load']:.0f}; {s['balance/moved_sequences']:.1f} sequences moved per step)",
        f"- measured pass time max/mean: {s['balance/rank_time_imbalance']:.3f}; wait at the step barrier: mean "
        f"{s['balance/rank_wait_mean']:.3f} s, max {s['balance/rank_wait_max']:.3f} s "
        f"({s['balance/rank_wait_fraction']:.1%} of rank time)",
        f"- old-policy log-prob pass (no DP collective inside): time max/mean "
        f"{s['balance/old_logprob_imbalance']:.3f}, mean wait for the slowest "
        f"{s['balance/old_logprob_wait_mean']:.3f} s",
        "- per rank: wait " + ", ".join(f"{w:.3f}" for w in s["balance/rank_wait_per_rank"]) + " s; passes "
        + ", ".join(f"{w:.3f}" for w in s["balance/pass_seconds_per_rank"]) + " s",
    ]
