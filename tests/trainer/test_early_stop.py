"""Early stopping in the embedded trainer (``cppo.early_stop``, trainer/early_stop.py): a planted
predictor stops exactly what the rule names, stopped completions are never scored or trained and
always counted, the predictor never sees the step it decides, its quality is measured with the
predictor that decided, and resume restores it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cppo_megatron.core.early_stop import RUNNING, decide_stops, roc_auc
from cppo_megatron.tasks import Score, build_task
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import RecipeError, load_recipe
from tests.recipes import MICRO

ES = ["rollout.max_new_tokens=8", "cppo.pruning_rate=0.75", "cppo.early_stop.enabled=true",
      "cppo.early_stop.segment_tokens=2", "cppo.early_stop.min_examples=2", "cppo.early_stop.min_confidence=0.55"]


def _recipe(tmp_path, *overrides):
    return load_recipe(None, MICRO + [f"out_dir={tmp_path / 'run'}", *ES, *overrides])


class CountingTask:
    """The micro task with a scorer that knows nothing of arithmetic: a completion succeeds when it
    has an odd number of characters (both outcomes in every step of a random policy). Counts the
    completions it scored; ``flip_at``: the training step whose outcomes are inverted."""

    def __init__(self, recipe) -> None:
        base = build_task(recipe.task)
        self.scored: list[str] = []
        self.flip_at: int | None = None
        self.step = 0
        self.task = dataclasses.replace(base, scorer=self._score)

    def _score(self, text: str, problem) -> Score:
        self.scored.append(text)
        ok = len(text) % 2 == 1
        if self.flip_at == self.step:
            ok = not ok
        return Score(correct=float(ok), formatted=1.0)


class Planted:
    """A predictor whose scores are known: P(success) = 0.9 above the median of the first feature
    (the prefix's mean log-prob) of each call, 0.1 below."""

    fitted = True
    class_means = (0.1, 1.1)
    version = 99

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x[:, 0] > x[:, 0].median(), 0.9, 0.1).to(torch.float64)


def _trainer(tmp_path, *overrides, planted=True, resume=False):
    recipe = _recipe(tmp_path, *overrides)
    counting = CountingTask(recipe)
    t = Trainer(recipe, task=counting.task, resume=resume)
    if planted:
        t.early_stop.predictor = Planted()
        t.early_stop.ready = True
        t.early_stop.history.refit = lambda *a, **k: True  # keep the planted predictor
    t.prepare(initial_eval=False)
    return t, counting


def _step(t, counting, capture: dict | None = None):
    counting.step = t.step
    if capture is not None:
        original, end_step = t.backend.update, t.early_stop.end_step

        def update(rows, *args, **kwargs):
            capture["trained_rows"] = rows.rows.clone()
            return original(rows, *args, **kwargs)

        def end(batch, kept):
            capture["batch"] = batch
            return end_step(batch, kept)

        t.backend.update, t.early_stop.end_step = update, end
    return t.step_once()


def test_a_planted_predictor_stops_exactly_what_the_rule_names(tmp_path):
    t, counting = _trainer(tmp_path, "cppo.early_stop.explore_share=0.25")
    capture: dict = {}
    rec = _step(t, counting, capture)
    es = t.early_stop
    (mon,) = es.monitors
    decided = [r for r in mon.records if "stop" in r]
    assert decided and sum(int(r["stop"].sum()) for r in decided) > 0, "the planted scores stop something"
    for r in decided:  # the monitor hands the rule what it saw, and stops what the rule says
        d = decide_stops(r["decided_q"], r["decided_rows"] // 4, r["decided_status"], min_running=es.min_running,
                         min_confidence=0.55, seed=0, step=0, stream=mon.records.index(r))
        assert torch.equal(d.stop & ~r["explore"], r["stop"])
        assert not r["stop"][r["explore"]].any()  # explore groups run in full
        assert bool((r["decided_status"][r["stop"]] == RUNNING).all())
    # the engine ended exactly those completions, at their boundary, with their tokens so far
    batch = capture["batch"]
    stopped_rows = mon.stopped_at.ge(0)
    assert torch.equal(batch.stopped, stopped_rows) and int(rec["early_stop/stopped"]) == int(stopped_rows.sum())
    assert torch.equal(batch.completion_lengths[stopped_rows], mon.stopped_at[stopped_rows])
    assert set(capture["trained_rows"].tolist()).isdisjoint(stopped_rows.nonzero().squeeze(1).tolist())


def test_stopped_completions_are_never_scored_or_trained_and_always_counted(tmp_path):
    t, counting = _trainer(tmp_path)
    capture: dict = {}
    rec = _step(t, counting, capture)
    (mon,) = t.early_stop.monitors
    N = mon.N
    stopped = mon.stopped_at.ge(0)
    S = int(stopped.sum())
    assert S > 0
    assert len(counting.scored) == N - S  # a partial completion is never rewarded
    assert rec["early_stop/started"] == N == rec["rollout/completions"]
    assert rec["early_stop/kept"] + rec["early_stop/pruned_after"] + rec["early_stop/stopped"] == N
    assert rec["early_stop/kept"] == rec["cppo/num_kept"] and rec["cppo/num_pruned"] == N - rec["cppo/num_kept"]
    assert rec["early_stop/tokens_generated"] == rec["rollout/tokens"]
    assert rec["early_stop/tokens_budget"] == N * 8
    # stopped completions end at a boundary (2, 4 or 6 tokens) and their tokens are counted
    at = mon.stopped_at[stopped]
    assert set(at.tolist()) <= {2, 4, 6}
    assert rec["early_stop/tokens_stopped"] == float(at.sum())
    assert set(capture["trained_rows"].tolist()).isdisjoint(stopped.nonzero().squeeze(1).tolist())
    # CPPO's k = floor(4 x 0.25) = 1 per group, chosen among the finished rows
    assert rec["cppo/kept_per_group_max"] == 1.0
    assert rec["early_stop/min_running"] == 2.0
    assert rec["early_stop/total_stopped"] == S
    # the audit line: each stopped row with its boundary, the kept rows, every row's prompt
    import json

    (line,) = [json.loads(x) for x in (t.out / "early_stop.jsonl").read_text().splitlines()]
    assert [r for r, _, _ in line["stopped"]] == stopped.nonzero().squeeze(1).tolist()
    assert [b for _, b, _ in line["stopped"]] == mon.stopped_at[stopped].tolist()
    assert set(line["kept"]).isdisjoint(r for r, _, _ in line["stopped"]) and line["step"] == 1
    assert len(line["prompt_ids"]) == N // 4 and line["predictor_version"] == 99


def test_the_predictor_never_sees_the_step_it_decides(tmp_path):
    """Step 1's rewards are inverted in run B only: step 1's stop decisions are those of run A (they
    were made before any step-1 reward existed), and only afterwards does B's predictor differ."""
    runs = []
    for flip in (None, 1):
        t, counting = _trainer(tmp_path / f"flip{flip}", "cppo.early_stop.explore_share=0.5", planted=False)
        counting.flip_at = flip
        stops, versions = [], []
        for _ in range(3):
            _step(t, counting)
            (mon,) = t.early_stop.monitors
            stops.append(mon.stopped_at.clone())
            versions.append(t.early_stop.predictor.state_dict())
        runs.append((stops, versions))
    (stops_a, ver_a), (stops_b, ver_b) = runs
    assert torch.equal(stops_a[1], stops_b[1])
    assert int(stops_a[1].ge(0).sum()) > 0, "the predictor fitted on step 0 stops something in step 1"
    assert torch.equal(ver_a[0]["weights"], ver_b[0]["weights"])
    assert not torch.equal(ver_a[1]["weights"], ver_b[1]["weights"])  # learned step 1 only after it


def test_predictor_quality_is_measured_with_the_predictor_that_decided(tmp_path):
    t, counting = _trainer(tmp_path, "cppo.early_stop.explore_share=0.5", planted=False)
    seen = 0
    for _ in range(3):
        rec = _step(t, counting)
        (mon,) = t.early_stop.monitors
        if not mon.ready:
            assert rec["early_stop/predictor_ready"] == 0.0
            continue
        qs, ys = [], []
        labels = _labels(t, counting, mon)
        for r in mon.records:
            ex = mon.explore[r["rows"] // 4] & ~labels["stopped"][r["rows"]]
            qs.append(r["q"][ex])
            ys.append(labels["y"][r["rows"][ex]])
        assert rec["early_stop/predictor_auc"] == pytest.approx(roc_auc(torch.cat(qs), torch.cat(ys)))
        seen += 1
    assert seen >= 1


def _labels(t, counting, mon):
    """The step's outcomes per row, as the scorer decided them (stopped rows: 0, never read)."""
    stopped = mon.stopped_at.ge(0)
    y = torch.zeros(mon.N)
    texts = iter(counting.scored[-int((~stopped).sum()):])
    for row in range(mon.N):
        if not stopped[row]:
            y[row] = float(len(next(texts)) % 2 == 1)
    return {"stopped": stopped, "y": y}


def test_resume_restores_the_predictor_and_its_decisions(tmp_path):
    straight, c1 = _trainer(tmp_path / "a", planted=False)
    for _ in range(3):
        _step(straight, c1)
    (mon_straight,) = straight.early_stop.monitors
    first, c2 = _trainer(tmp_path / "b", planted=False)
    for _ in range(2):
        _step(first, c2)
    first._checkpoint()
    state = first.early_stop.state_dict()
    resumed, c3 = _trainer(tmp_path / "b", planted=False, resume=True)
    assert torch.equal(resumed.early_stop.predictor.state_dict()["weights"], state["predictor"]["weights"])
    assert resumed.early_stop.history.completions() == first.early_stop.history.completions()
    assert resumed.early_stop.totals == first.early_stop.totals and resumed.early_stop.ready == first.early_stop.ready
    c3.step = 2
    _step(resumed, c3)
    (mon_resumed,) = resumed.early_stop.monitors
    assert torch.equal(mon_resumed.stopped_at, mon_straight.stopped_at)


def test_refusals_name_the_key(tmp_path):
    with pytest.raises(RecipeError, match="backend=hf"):
        _recipe(tmp_path, "backend=megatron")
    with pytest.raises(RecipeError, match="dynamic_sampling"):
        _recipe(tmp_path, "cppo.dynamic_sampling=true")
    with pytest.raises(RecipeError, match="needs pruning"):
        _recipe(tmp_path, "cppo.pruning_rate=0.0")


def test_early_stopping_refuses_what_it_cannot_account_for(tmp_path):
    from cppo_megatron.config import CPPOConfig
    from cppo_megatron.trainer.early_stop import EarlyStopping

    with pytest.raises(ValueError, match="enabled=true"):
        EarlyStopping(CPPOConfig(pruning_rate=0.5), group_size=4, max_new_tokens=8)
    es = EarlyStopping(CPPOConfig(pruning_rate=0.5, early_stop={"enabled": True}), group_size=4, max_new_tokens=8)
    es.begin_step(0)
    es.monitor(0, 2)  # 8 rows
    batch = type("B", (), {"num_rows": 12})()
    with pytest.raises(RuntimeError, match="monitors cover 8 rows, the batch has 12"):
        es.end_step(batch, torch.tensor([0]))
    with pytest.raises(ValueError, match="'history' missing"):
        es.load_state_dict({"predictor": es.predictor.state_dict()})


def test_resume_from_a_checkpoint_without_early_stopping_state_says_so(tmp_path, capsys):
    plain, c1 = _trainer(tmp_path, planted=False)
    _step(plain, c1)
    plain._checkpoint()
    state_file = next((tmp_path / "run" / "checkpoints").glob("step_*")) / "trainer.pt"
    state = torch.load(state_file, weights_only=False)
    state.pop("early_stop")
    torch.save(state, state_file)
    resumed, _ = _trainer(tmp_path, planted=False, resume=True)
    assert not resumed.early_stop.ready and resumed.early_stop.history.steps == []
    assert "no early-stopping state" in capsys.readouterr().err


def test_a_step_that_ends_before_its_first_boundary_measures_no_score_and_counts_its_outcomes(tmp_path,
                                                                                                monkeypatch):
    """Every completion ended before the first boundary (the monitor was never called): no score to
    measure (``predictor_auc`` NaN, no other quality metric), the 8 finished rows join the history as
    4 failures and 4 successes without features, so nothing is refitted (not ready; fitting on no rows
    used to raise); without an audit path no audit line is written anywhere."""
    from types import SimpleNamespace

    from cppo_megatron.config import CPPOConfig
    from cppo_megatron.trainer.early_stop import EarlyStopping

    monkeypatch.chdir(tmp_path)
    es = EarlyStopping(CPPOConfig(pruning_rate=0.5, early_stop={"enabled": True, "min_examples": 2}), group_size=4,
                       max_new_tokens=8)
    es.predictor, es.ready = Planted(), True  # ready from earlier steps
    es.begin_step(3)
    es.monitor(0, 2)  # 8 rows, no boundary reached
    batch = SimpleNamespace(num_rows=8, rewards=torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1]),
                            stopped=torch.zeros(8, dtype=torch.bool), completion_lengths=torch.tensor([1, 2, 1, 1, 2, 1, 1, 1]),
                            group_ids=torch.arange(8) // 4, prompt_ids=torch.tensor([5, 9]))
    m = es.end_step(batch, torch.tensor([0, 1, 6, 7]))
    assert torch.isnan(torch.tensor(m["early_stop/predictor_auc"]))
    assert not [k for k in m if k.startswith(("early_stop/predictor_first_", "early_stop/predictor_all_"))]
    assert (m["early_stop/started"], m["early_stop/stopped"], m["early_stop/kept"]) == (8.0, 0.0, 4.0)
    assert es.history.completions() == (4, 4) and [s["step"] for s in es.history.steps] == [3]
    assert es.history.steps[0]["x"].shape[0] == 0 and not es.ready
    assert list(tmp_path.iterdir()) == []
