"""CpuRun, what both hosts' CPU modes prepare: its one line."""

from pathlib import Path

from cppo_megatron.integrations.cpu_run import CpuRun


def test_describe_names_the_paths_what_was_built_and_the_start_models_accuracy():
    run = CpuRun(Path("m"), Path("d"), Path("r"), built_model=True, wrote_data=False, start_model={"accuracy": 0.25})
    assert run.describe() == ("cpu mode: model m (exported now, held-out accuracy 0.250), data d (reused), "
                              "metrics r/metrics.jsonl")
    plain = CpuRun(Path("m"), Path("d"), Path("r"), built_model=False, wrote_data=True, env={"X": "1"})
    assert plain.describe() == "cpu mode: model m (reused), data d (written now), metrics r/metrics.jsonl"
    assert plain.env == {"X": "1"} and plain.start_model is None
