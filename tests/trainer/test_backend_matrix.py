"""One matrix over both policy backends: ``hf`` (one process) and ``megatron`` (TP 2 x DP 2
and PP 2 x DP 2 on four gloo processes, forked by ``run_local`` so megatron-core is
imported once).

Per layout, three runs of the same micro recipe: uninterrupted (3 steps); interrupted by
a signal during step 1 (the step finishes, a checkpoint is written, the run stops); and
resumed from that checkpoint. The capacity makes 3.5 prompts per step, so the allocation
planner carries a fractional prompt across the checkpoint. Checked:

- the resumed run's per-step metrics (data order, draw counts, rewards, loss) equal the
  uninterrupted run's;
- the step records carry the same metric names on every backend;
- identity of what the passes see: every sequence entering a log-prob pass or the update
  is a survivor (prompt + completion of a real row), each carries the advantage of an
  independent full-group computation over the step's rewards, each group's survivors
  are its k largest |A|, every survivor is trained exactly once per optimizer step.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.logger import read_metrics
from tests.recipes import LAYOUTS, MICRO

STEPS, G, K = 3, 4, 2
MATRIX = [o for o in MICRO if not o.startswith(("train.capacity", "train.steps"))] + [
    "train.capacity=7",  # k = 2 of G = 4: 3.5 prompts per step, a carry of 0.5 after step 1
    f"train.steps={STEPS}",
    "train.beta=0.04",  # the reference pass runs too
]
# (phase, signal) of the interrupted run, per layout: each kind is exercised once
INTERRUPT = {"hf": ("update", "sigterm"), "tp2-dp2": ("update", "sigint"), "pp2-dp2": ("rollout", "sigterm")}
COMPARE = ("reward/mean", "alloc/prompts_drawn", "alloc/total_prompts_drawn", "alloc/prompts_planned",
           "cppo/num_kept", "rollout/tokens", "train/loss", "train/grad_norm", "train/lr", "data/epoch")


# ----------------------------------------------------------------------------- capture
class _Capture:
    """Records, per step, the rollout batch and what each pass was handed (sequences and
    advantages), at the level where the backends feed their models."""

    def __init__(self):
        self.steps: list[dict] = []

    def install(self, mp, megatron: bool = False):
        import cppo_megatron.trainer.loop as loop
        from cppo_megatron.trainer.policy import HFPolicy

        real_select = loop.select_survivors
        cap = self

        def select(batch, cfg, planner, *, step):
            cap.steps.append({"batch": _batch_view(batch), "logprobs": [], "update": []})
            return real_select(batch, cfg, planner, step=step)

        mp(loop, "select_survivors", select)
        real_lp, real_up = HFPolicy.logprobs, HFPolicy.update

        def hf_logprobs(self, batch, mbs, **kw):
            cap.steps[-1]["logprobs"].append([p + c for p, c in zip(batch.prompts, batch.completions)])
            return real_lp(self, batch, mbs, **kw)

        def hf_update(self, batch, mbs, advantages, *a, **kw):
            cap.steps[-1]["update"].append(([p + c for p, c in zip(batch.prompts, batch.completions)],
                                            advantages.tolist()))
            return real_up(self, batch, mbs, advantages, *a, **kw)

        mp(HFPolicy, "logprobs", hf_logprobs)
        mp(HFPolicy, "update", hf_update)
        if not megatron:
            return
        from cppo_megatron.megatron import MegatronActor

        m_lp, m_up = MegatronActor.logprobs, MegatronActor.update

        def meg_logprobs(self, sequences, counter=None, **kw):
            cap.steps[-1]["logprobs"].append([s.tolist() for s in sequences])
            return m_lp(self, sequences, counter, **kw)

        def meg_update(self, sequences, masks, advantages, *a, **kw):
            cap.steps[-1]["update"].append(([s.tolist() for s in sequences], torch.as_tensor(advantages).tolist()))
            return m_up(self, sequences, masks, advantages, *a, **kw)

        mp(MegatronActor, "logprobs", meg_logprobs)
        mp(MegatronActor, "update", meg_update)


def _batch_view(batch) -> dict:
    return {"rewards": batch.rewards.tolist(), "valid_groups": batch.valid_groups.tolist(),
            "rows": {int(r): p + c for r, p, c in zip(batch.local_rows.tolist(), batch.prompts, batch.completions)}}


def _setattr(obj, name, value):
    setattr(obj, name, value)


# ----------------------------------------------------------------------------- runs
def _recipe(out, layout, *extra):
    return load_recipe(None, MATRIX + LAYOUTS.get(layout, []) + [f"out_dir={out}", *extra])


def _three_runs(root, layout: str, capture: _Capture) -> dict:
    """Uninterrupted, interrupted during step 1, resumed; each rank returns what it saw."""
    t = Trainer(_recipe(root / "full", layout))
    t.run()
    t.close()
    full_capture = list(capture.steps)
    phase, sig = INTERRUPT[layout]
    rank = int(os.environ.get("RANK", 0))
    os.environ["CPPO_MEGATRON_FAULT"] = f"{phase}:1:0:{sig}"
    try:
        t = Trainer(_recipe(root / "part", layout))
        result = t.run()
    finally:
        del os.environ["CPPO_MEGATRON_FAULT"]
    t.close()
    resumed = Trainer(_recipe(root / "part", layout), resume=True)
    resumed.run()
    resumed.close()
    out = {"rank": rank, "interrupted": result, "capture": full_capture}
    if rank == 0:
        out["full"] = _steps(root / "full")
        out["part"] = _steps(root / "part")
        out["checkpoints"] = sorted(p.name for p in (root / "part" / "checkpoints").iterdir())
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            out["mp_rank"] = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
            out["dp_rank"] = ps.get_data_parallel_rank()
            ps.destroy_model_parallel()
    except ImportError:
        pass
    return out


def _steps(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]


def _megatron_worker(rank, world, root, layout):
    cap = _Capture()
    cap.install(_setattr, megatron=True)
    return _three_runs(root, layout, cap)


@pytest.fixture(scope="module", params=["hf", "tp2-dp2", "pp2-dp2"])
def layout_runs(request, tmp_path_factory):
    layout = request.param
    root = tmp_path_factory.mktemp(layout)
    if layout == "hf":
        mp = pytest.MonkeyPatch()
        cap = _Capture()
        cap.install(mp.setattr)
        try:
            results = [_three_runs(root, layout, cap)]
        finally:
            mp.undo()
    else:
        pytest.importorskip("megatron.core")
        from cppo_megatron.distributed import run_local

        results = run_local(_megatron_worker, 4, root, layout, timeout=420)
    return layout, results


# ----------------------------------------------------------------------------- checks
def test_resume_after_an_interrupt_repeats_the_uninterrupted_run(layout_runs):
    layout, results = layout_runs
    r0 = results[0]
    assert r0["interrupted"]["interrupted"] and r0["interrupted"]["step"] == 1  # the step finished first
    assert r0["checkpoints"][0] == "step_000001"
    full, part = r0["full"], r0["part"]
    assert [s["step"] for s in full] == [s["step"] for s in part] == [1, 2, 3]
    # 3.5 prompts per step: the carry survives the checkpoint after step 1
    assert [s["alloc/prompts_drawn"] for s in full] == [3, 4, 3]
    for a, b in zip(full, part):
        for key in COMPARE:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (layout, a["step"], key)


_NAMES: dict = {}


def test_metric_names_are_the_same_on_every_backend(layout_runs):
    layout, results = layout_runs
    names = frozenset(results[0]["full"][0])
    _NAMES[layout] = names
    for other, theirs in _NAMES.items():
        assert names == theirs, (layout, other, sorted(names ^ theirs))
    for key in ("train/clipfrac", "train/loss", "train/ratio_max", "time/update", "cppo/exchange_imbalance",
                "rank/forwarded_sequences"):
        assert key in names


def test_passes_see_exactly_the_survivors_with_full_group_advantages(layout_runs):
    layout, results = layout_runs
    # one view per DP rank (TP / PP peers see the same rows)
    views = [r for r in results if r.get("mp_rank", (0, 0)) == (0, 0)]
    for step in range(STEPS):
        batch = views[0]["capture"][step]["batch"]
        rows = {}
        for v in views:
            rows.update(v["capture"][step]["batch"]["rows"])
        rewards = batch["rewards"]
        assert sorted(rows) == list(range(len(rewards)))  # every row is held by one DP rank
        adv = _full_group_advantages(rewards, batch["valid_groups"], eps=1e-6)
        expected_k = K * len(batch["valid_groups"])
        for kind in ("logprobs", "update"):
            calls = [v["capture"][step][kind] for v in views]
            n_calls = {len(c) for c in calls}
            assert len(n_calls) == 1, (layout, kind, n_calls)
            for i in range(n_calls.pop()):
                if kind == "update":
                    seqs = [s for c in calls for s in c[i][0]]
                    advs = [a for c in calls for a in c[i][1]]
                else:
                    seqs = [s for c in calls for s in c[i]]
                    advs = None
                assert len(seqs) == expected_k, (layout, step, kind, len(seqs))
                _check_survivors(seqs, advs, rows, adv, layout, step, kind)


def _full_group_advantages(rewards, valid_groups, eps):
    """(r - mean) / (std + eps) over each whole group, unbiased std, without the core."""
    out = {}
    for g in valid_groups:
        grp = rewards[g * G : (g + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        for j, x in enumerate(grp):
            out[g * G + j] = (x - mean) / (std + eps)
    return out


def _check_survivors(seqs, advs, rows, adv, layout, step, kind):
    free = {r: s for r, s in rows.items() if r in adv}
    taken: dict = {}
    for i, s in enumerate(seqs):
        # the row this sequence is: same tokens and (for the update) the same advantage
        match = [r for r, toks in free.items() if toks == s and (advs is None or abs(adv[r] - advs[i]) < 1e-4)]
        assert match, (layout, step, kind, "a sequence that is no valid row, or carries a wrong advantage", i)
        r = min(match, key=lambda r: -abs(adv[r]))
        taken.setdefault(r // G, []).append(abs(adv[r]))
        del free[r]
    for g, kept in taken.items():
        group = sorted((abs(adv[g * G + j]) for j in range(G)), reverse=True)
        assert sorted(kept, reverse=True) == pytest.approx(group[:K], abs=1e-5), (layout, step, kind, g)


def test_signal_during_rollout_hf_resumes_identically(micro_recipe, tmp_path):
    """SIGINT while generating (hf): the step finishes, checkpoint, resume = uninterrupted."""
    full = micro_recipe("train.steps=3", "train.capacity=7", f"out_dir={tmp_path / 'full'}")
    Trainer(full).run()
    part = micro_recipe("train.steps=3", "train.capacity=7", f"out_dir={tmp_path / 'part'}")
    os.environ["CPPO_MEGATRON_FAULT"] = "rollout:2:0:sigint"
    before = signal.getsignal(signal.SIGINT)
    try:
        res = Trainer(part).run()
    finally:
        del os.environ["CPPO_MEGATRON_FAULT"]
    assert res["interrupted"] and res["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    Trainer(part, resume=True).run()
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert [s["step"] for s in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in COMPARE:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)
