"""What bench verl and bench openrlhf share (cppo_megatron.bench.hostbench): the argument checks,
the variant loop's reuse-or-launch decision (a launch stubbed at our own boundary: nothing runs),
and an OpenRLHF report assembled from reused runs through it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cppo_megatron.bench import hostbench
from cppo_megatron.bench import openrlhf as bench_openrlhf

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml"


def _args(**kw):
    base = {"rate": 0.875, "steps": 4, "skip": 1, "recipe": str(RECIPE)}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw,message", [
    ({"rate": 1.0}, r"--rate must be in \(0, 1\), got 1.0"),
    ({"rate": 0.0}, r"--rate must be in \(0, 1\), got 0.0"),
    ({"steps": 2, "skip": 2}, r"--steps \(2\) must exceed --skip \(2\)"),
    ({"recipe": "nope.yaml"}, "recipe 'nope.yaml' not found"),
])
def test_check_args_refuses_naming_the_flag(kw, message):
    hostbench.check_args(_args())  # the defaults pass
    with pytest.raises(ValueError, match=message):
        hostbench.check_args(_args(**kw))


def _write(path: Path, steps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "t/step": 1.0}) + "\n" for s in range(1, steps + 1)))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_finished_run_is_reused_a_short_one_is_launched_afresh(tmp_path, capsys):
    runs = tmp_path / "runs"
    _write(runs / "grpo" / "metrics.jsonl", 4)  # enough steps: reused
    _write(runs / "cppo_P0.5_alloc" / "metrics.jsonl", 2)  # cut short: run again
    launched = []

    def launch(slug, run_dir, extra):
        assert not (run_dir / "metrics.jsonl").exists()  # the old file is gone: the host's logger appends
        launched.append((slug, run_dir, extra))
        _write(run_dir / "metrics.jsonl", 4)
        return _read(run_dir / "metrics.jsonl")

    variants = [("grpo", ["a=0"]), ("cppo P=0.5 alloc", ["a=1"]), ("cppo P=0.5 no-alloc", ["a=2"])]
    out = hostbench.run_variants(variants, host="x", runs_dir=runs, step_key="t/step", steps=4, skip=1, reuse=True,
                                 read=_read, launch=launch, summarize=lambda rows, skip: {"n": len(rows) - skip})
    assert list(out) == ["grpo", "cppo P=0.5 alloc", "cppo P=0.5 no-alloc"]
    assert [(s, e) for s, _d, e in launched] == [("cppo_P0.5_alloc", ["a=1"]), ("cppo_P0.5_no-alloc", ["a=2"])]
    assert launched[0][1] == (runs / "cppo_P0.5_alloc").resolve()
    assert all(v[1] == {"n": 3} and len(v[0]) == 4 for v in out.values())
    assert f"bench x: reusing grpo from {(runs / 'grpo').resolve()}" in capsys.readouterr().out
    launched.clear()  # without --reuse every variant runs again
    hostbench.run_variants(variants[:1], host="x", runs_dir=runs, step_key="t/step", steps=4, skip=1, reuse=False,
                           read=_read, launch=launch, summarize=lambda rows, skip: {})
    assert [s for s, _d, _e in launched] == ["grpo"]


def _openrlhf_rows(prompts, trained, gen, rest, steps=4):
    return "".join(json.dumps({"step": s, "kind": "train", "time": 0.0, "data": {
        "timing/step_total": gen + rest, "timing/generation": gen, "timing/make_experience": rest / 2,
        "timing/ppo_train": rest / 2, "cppo/num_groups": prompts, "cppo/num_kept": trained}}) + "\n"
        for s in range(1, steps + 1))


def test_openrlhf_report_from_reused_runs(tmp_path, monkeypatch):
    def no_launch(*a, **kw):
        raise AssertionError("a reused run was launched")

    monkeypatch.setattr(bench_openrlhf, "_run_one", no_launch)
    runs = {"grpo": _openrlhf_rows(16, 256, gen=2.0, rest=3.0),
            "cppo_P0.875_alloc": _openrlhf_rows(128, 256, gen=14.0, rest=3.0)}
    for slug, text in runs.items():
        (tmp_path / "openrlhf_runs" / slug).mkdir(parents=True)
        (tmp_path / "openrlhf_runs" / slug / "metrics.jsonl").write_text(text)
    args = argparse.Namespace(recipe=str(RECIPE), flags="", python="python", rate=0.875, allocation="on", steps=4,
                              skip=1, reuse=True, out=str(tmp_path), no_same_batch=True)
    report = bench_openrlhf.run(args)
    rows = {r["run"]: r for r in report.rows}
    assert list(rows) == ["grpo", "cppo P=0.875 alloc"]
    assert list(report.extras["runs"]) == list(rows) and report.extras["phase_split_same_batch"] is None
    assert len(report.extras["runs"]["grpo"]) == 4  # every step's row, the skipped one too
    assert report.extras["phase_split"] == {"t_gen_per_prompt_s": pytest.approx(2 / 16),
                                            "t_rest_per_prompt_s": pytest.approx(3 / 16)}
    assert rows["cppo P=0.875 alloc"]["speedup"] == pytest.approx((5 / 16) / (17 / 128))
    assert rows["cppo P=0.875 alloc"]["ms/prompt exp+train"] == pytest.approx(1e3 * 3 / 128)
    assert report.notes[0] == ("GRPO phase split per prompt: T_gen (timing/generation + timing/broadcast) 125.00 ms, "
                               "T_rest (timing/make_experience + timing/ppo_train) 187.50 ms")
    assert report.notes[1].startswith("bound S_max(P) = (T_gen + T_rest)")
    assert "runs are sequential OpenRLHF processes from the same start model and seed (not interleaved)" in report.notes
