"""A first CPU run's preparation (cpu/phases.py, cpu/prepare.py): threads from the free cores,
the warm-up sized by the veRL recipe, each phase timed and printed, the first logged step
reported; and what the CPU recipes default to (the legacy loop, TransferQueue's timeout)."""

from __future__ import annotations

import json
import time

import pytest
from omegaconf import OmegaConf

from tests.recipes import MICRO

from .conftest import RECIPES, ROOT, compose


@pytest.mark.parametrize("cores,load,want", [(2, 0.1, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 9.0, 1), (8, 3.0, 5),
                                             (8, 2.4, 6), (1, 0.0, 1)])
def test_threads_are_the_cores_the_load_leaves_free(cores, load, want):
    from cppo_megatron.integrations.verl.cpu.phases import choose_threads

    assert choose_threads(cores, load) == want


@pytest.mark.parametrize("cores,load,match", [(0, 0.0, "cores"), (2, -1.0, "load"), (2, float("nan"), "load")])
def test_threads_refuse_bad_inputs(cores, load, match):
    from cppo_megatron.integrations.verl.cpu.phases import choose_threads

    with pytest.raises(ValueError, match=match):
        choose_threads(cores, load)


def test_phases_print_what_they_do_and_how_long_it_took():
    from cppo_megatron.integrations.verl.cpu.phases import Phases, fmt_seconds

    lines: list[str] = []
    ph = Phases(t0=time.time(), printer=lines.append)
    with ph.phase("data", "writing the data to X", "writing the data") as note:
        note["result"] = "3 rows"
    assert lines[0] == "cpu mode: writing the data to X ..."
    assert lines[1].startswith("cpu mode: writing the data: done in ") and lines[1].endswith(" s (3 rows)")
    assert 0 <= ph.durations["data"] < 5
    assert (fmt_seconds(41.24), fmt_seconds(182.0)) == ("41.2 s", "3 min 02 s")


def test_first_step_watcher_reads_only_this_runs_lines(tmp_path):
    from cppo_megatron.integrations.verl.cpu.phases import FirstStepWatcher, Phases

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "data": {"timing_s/step": 99.0}}) + "\n")  # an earlier run's
    lines: list[str] = []
    ph = Phases(t0=time.time() - 100.0, printer=lines.append)
    ph.durations.update(startup=5.0, model=40.0, data=1.0, ray=6.0)
    w = FirstStepWatcher(metrics, ph, poll_s=0.05).start()
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 0, "data": {"val-core/cppo_arithmetic/acc/mean@1": 0.25}}) + "\n")
        f.write(json.dumps({"step": 1, "data": {"timing_s/step": 20.5}}) + "\n")
    for _ in range(100):
        if w.summary:
            break
        time.sleep(0.05)
    w.stop()
    assert any("initial validation logged" in x and "(held-out accuracy 0.250)" in x for x in lines), lines
    assert w.summary is not None and w.summary.startswith("first step logged 100.")
    assert "start-up 5.0 s, start model 40.0 s, data 1.0 s, Ray 6.0 s, veRL workers + initial validation " in w.summary
    assert w.summary.endswith("step 1 itself 20.5 s)")


def test_inputs_are_built_with_the_recipes_warmup_and_chosen_threads(tmp_path, monkeypatch):
    from cppo_megatron.integrations.verl.cpu import prepare
    from cppo_megatron.integrations.verl.cpu.phases import Phases

    calls = []

    def build(recipe, model_dir, *, overrides=()):
        calls.append((recipe, overrides))
        (model_dir / "config.json").parent.mkdir(parents=True)
        (model_dir / "config.json").write_text("{}")
        (model_dir / prepare.START_MODEL_INFO).write_text(json.dumps(
            {"accuracy": 0.21, "eval_problems": 200, "sft_steps": 825}))

    monkeypatch.setattr(prepare, "build_start_model", build)
    monkeypatch.setattr(prepare, "choose_threads", lambda: 1)
    monkeypatch.setattr(prepare, "write_data", lambda *a: type("D", (), {"train_rows": 7, "test_rows": 3})())
    group = OmegaConf.create({"warmup_recipe": "tiny_cpu.yaml", "eval_problems": 3,
                              "warmup_overrides": ["warmup.target_accuracy=0.2", "warmup.eval_every=25"]})
    lines: list[str] = []
    ph = Phases(t0=time.time(), printer=lines.append)
    assert prepare.ensure_inputs(group, tmp_path / "m", tmp_path / "d", ph) == (True, True)
    assert calls == [("tiny_cpu.yaml", ("threads=1", "warmup.target_accuracy=0.2", "warmup.eval_every=25"))]
    assert "model" in ph.durations and "data" in ph.durations
    assert any("(held-out accuracy 0.210 on 200 problems after 825 SFT steps)" in x for x in lines), lines
    # an explicit threads=N wins; a model already there is reused
    calls.clear()
    group.warmup_overrides = ["threads=3"]
    assert prepare.ensure_inputs(group, tmp_path / "m2", tmp_path / "d", ph)[0] is True
    assert calls[0][1] == ("threads=3",)
    assert prepare.ensure_inputs(group, tmp_path / "m2", tmp_path / "d", ph)[0] is False


def test_start_model_records_what_the_warmup_reached(tmp_path):
    from cppo_megatron.integrations.verl.cpu.prepare import build_start_model, start_model_info

    micro = [o for o in MICRO if not o.startswith(("warmup.enabled", "threads"))]
    build_start_model(ROOT / "recipes" / "tiny_cpu.yaml", tmp_path / "model",
                      overrides=(*micro, "warmup.max_steps=4", "warmup.eval_every=2", "warmup.eval_problems=10"))
    info = start_model_info(tmp_path / "model")
    assert info["sft_steps"] == 4 and info["eval_problems"] == 10 and 0.0 <= info["accuracy"] <= 1.0
    chosen = [o for o in info["overrides"] if o.startswith("threads=")]
    assert chosen == [f"threads={info['threads']}"] and info["threads"] >= 1  # chosen, not the recipe's 2
    assert (tmp_path / "model" / "config.json").is_file()


def test_cpu_recipes_default_to_the_legacy_loop_with_a_longer_transferqueue_timeout(plugin):
    from cppo_megatron.integrations.verl.main import SEARCHPATH

    for name in ("tiny_cpu_grpo", "tiny_cpu_cppo"):
        cfg = compose(RECIPES, name, [SEARCHPATH])
        assert cfg.trainer.use_v1 is False
        assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT == "1800"
        assert list(cfg.cppo_cpu.warmup_overrides) == ["warmup.target_accuracy=0.2", "warmup.eval_every=25"]
    # the variable is the one TransferQueue 0.1.10 reads for its storage put/get timeout
    import transfer_queue.storage.managers.simple_storage_manager as ssm

    src = open(ssm.__file__).read()
    assert 'os.environ.get("TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT", 200)' in src
