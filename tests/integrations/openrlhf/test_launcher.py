"""The launcher's argument handling, its dry run through the CLI, and how the hook reaches Ray workers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations import importhook
from cppo_megatron.integrations.openrlhf import hook
from cppo_megatron.integrations.openrlhf.train import allocate, parse_openrlhf_args, plan, ray_runtime_env, split_argv

pytestmark = pytest.mark.openrlhf
ROOT = Path(__file__).resolve().parents[3]


def test_split_argv_separates_cppo_from_openrlhf_arguments():
    values, dry, fwd = split_argv(
        ["--cppo.pruning_rate", "0.75", "--rollout.batch_size", "8", "--cppo.scope=batch", "--dry-run", "--x"]
    )
    assert values == {"pruning_rate": 0.75, "scope": "batch"} and dry and fwd == ["--rollout.batch_size", "8", "--x"]
    assert split_argv(["--cppo.off", "--a", "1"]) == (None, False, ["--a", "1"])
    assert split_argv(["--cppo.eps", "1e-9", "--cppo.seed", "3", "--cppo.metric", "random"])[0] == {
        "eps": 1e-9, "seed": 3, "metric": "random"}  # YAML 1.1 alone reads 1e-9 as a string
    with pytest.raises(ValueError, match="needs a value"):
        split_argv(["--cppo.seed"])
    with pytest.raises(ValueError, match="--cppo.off together"):
        split_argv(["--cppo.off", "--cppo.seed", "1"])


def test_plan_reports_topping_up_and_refuses_model_rewards():
    base = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm",
            "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "4",
            "--actor.num_gpus_per_node", "4", "--rollout.micro_batch_size", "2", "--train.batch_size", "16"]  # fmt: skip
    args = parse_openrlhf_args(base + ["--reward.remote_url", "r.py"])
    counts = plan(CPPOConfig(pruning_rate=0.75), args)
    assert counts["selected_per_step"] == 8 and counts["kept_per_step"] == 16 and counts["keep_multiple"] == 16
    with pytest.raises(ValueError, match="rewards must come with the rollout"):
        plan(CPPOConfig(), parse_openrlhf_args(base + ["--reward.model_name_or_path", "rm"]))


@pytest.fixture
def dry_run(capsys):
    """`cppo-megatron openrlhf RECIPE --dry-run EXTRA...` in this process: (exit status, stdout, stderr)."""
    from cppo_megatron import cli

    def run(*extra: str):
        rc = cli.main(["openrlhf", str(ROOT / "recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml"), "--dry-run", *extra])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def test_override_of_the_rate_re_derives_the_prompts(dry_run):
    """The doc's own example: P 0.875 -> 0.75 keeps 4 of 16, so 1 x 16/4 = 4 prompts (not 8)
    and the same 16 completions train; a later --rollout.batch_size is the GRPO count."""
    out = dry_run("--cppo.pruning_rate", "0.75")[1]
    assert "--rollout.batch_size 1 -> 4 prompts (x G/k = 16/4)" in out
    assert "4 prompts x 16 = 64 completions generated, 16 selected, 16 kept" in out and "2 optimizer steps" in out
    command = next(line for line in out.splitlines() if line.startswith("openrlhf: python -m"))
    assert command.count("--rollout.batch_size") == 1 and command.endswith("--rollout.batch_size 4")
    out = dry_run("--rollout.batch_size", "2", "--cppo.keep_per_group", "4", "--cppo.pruning_rate", "null")[1]
    assert "--rollout.batch_size 2 -> 8 prompts" in out and "8 prompts x 16 = 128 completions generated, 32 selected" in out
    assert "warning" not in out
    # without allocation 1 prompt x 16 selects 2, which OpenRLHF's multiple of 16 rounds up to all 16
    out = dry_run("--cppo.allocation", "false")[1]
    assert "--rollout.batch_size 1 -> 1 prompts (unchanged)" in out and "1 prompts x 16 = 16 completions generated" in out
    assert "warning: cppo keeps all 16 completions after rounding up to OpenRLHF's multiple of 16" in out


def test_settings_that_prune_nothing_warn(dry_run):
    out = dry_run("--cppo.pruning_rate", "null", "--cppo.keep_per_group", "16")[1]
    assert "warning: cppo keep_per_group=16 keeps 16 of G=16 completions per prompt: nothing is pruned" in out
    assert "--rollout.n_samples_per_prompt (G) > 1" in out
    assert "warning" not in dry_run("--cppo.pruning_rate", "0")[1]  # P = 0: plain GRPO through the hook
    rc, _, err = dry_run("--rollout.n_samples_per_prompt", "1")  # G = 1 is refused outright by the hook's checks
    assert rc == 2 and "--rollout.n_samples_per_prompt must be >= 2, got 1" in err


def test_allocation_that_does_not_divide_is_named():
    args = parse_openrlhf_args(["--actor.model_name_or_path", "m", "--rollout.n_samples_per_prompt", "6",
                                "--rollout.batch_size", "1", "--reward.remote_url", "r.py"])
    with pytest.raises(ValueError, match="rollout.batch_size=1 x --rollout.n_samples_per_prompt=6 / keep=4"):
        allocate(CPPOConfig(keep_per_group=4), ["--rollout.batch_size", "1"], args)


def test_cli_dry_run_of_a_recipe():
    recipe = ROOT / "recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "cppo_megatron.cli", "openrlhf", str(recipe), "--dry-run", "--cppo.scope", "batch",
         "--train.max_epochs", "1"],  # fmt: skip
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "scope=batch" in out and "128 completions generated, 16 selected, 16 kept" in out
    command = next(line for line in out.splitlines() if line.startswith("openrlhf: python -m openrlhf.cli.train_ppo_ray"))
    assert command.index("--train.max_epochs 1") > command.index("--train.max_epochs 2")  # the later flag wins
    exported = next(line for line in out.splitlines() if line.startswith("patched checkout instead: export"))
    cfg = CPPOConfig.from_dict(json.loads(exported.split("=", 1)[1].strip("'")))
    assert cfg.scope == "batch" and cfg.pruning_rate == 0.875


def test_worker_setup_hooks_openrlhf_when_it_is_imported(monkeypatch, orl):
    """What a Ray worker does with the launcher's setup hook: the experience maker gets
    wrapped when the worker first imports it (here: a fresh import of the real module)."""
    monkeypatch.setenv(hook.ENV_CONFIG, json.dumps(CPPOConfig(pruning_rate=0.5, seed=3).to_dict()))
    loaded = sys.modules.pop(hook.TARGET_MODULE)
    try:
        hook.setup_ray_worker()
        hook.setup_ray_worker()  # idempotent: one callback
        assert importhook.pending(hook._install_on_import) == [hook.TARGET_MODULE]
        import importlib

        fresh = importlib.import_module(hook.TARGET_MODULE)
        assert fresh is not loaded and hook.is_installed(fresh.RemoteExperienceMaker)
        assert hook._CONFIG == CPPOConfig(pruning_rate=0.5, seed=3)
        hook.uninstall(fresh.RemoteExperienceMaker)
    finally:
        importhook.remove(hook._install_on_import)
        sys.modules[hook.TARGET_MODULE] = loaded
    assert not hook.is_installed(loaded.RemoteExperienceMaker)


def test_ray_workers_get_the_config_and_the_setup_hook(monkeypatch):
    """The launcher's runtime env on a real local Ray: every worker has the config and the
    import hook before any task runs."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cfg = CPPOConfig(pruning_rate=0.875, scope="batch")
    temp_dir = tempfile.mkdtemp(prefix="cppo-ray-")  # short: Ray's socket paths must stay < 108 bytes
    ray.init(num_cpus=1, include_dashboard=False, runtime_env=ray_runtime_env(cfg), _temp_dir=temp_dir)
    try:

        @ray.remote
        def probe():
            import os

            from cppo_megatron.integrations import importhook as worker_importhook
            from cppo_megatron.integrations.openrlhf import hook as worker_hook

            return (
                os.environ.get(worker_hook.ENV_CONFIG),
                worker_importhook.pending(worker_hook._install_on_import) == [worker_hook.TARGET_MODULE],
            )

        env_value, finder = ray.get(probe.remote(), timeout=120)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert CPPOConfig.from_dict(json.loads(env_value)) == cfg and finder


def test_launch_runs_openrlhfs_own_main_with_the_forwarded_arguments(monkeypatch, capsys, orl):
    """launch() hands the arguments to train_ppo_ray's __main__ block (real module, real parser);
    --help stops it before it would start models."""
    from cppo_megatron.integrations.openrlhf.train import launch

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as done:
        launch(["--help"], None)
    assert done.value.code == 0
    assert "--rollout.n_samples_per_prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit) as failed:
        launch(["--rollout.no_such_flag", "1"], None)
    assert failed.value.code == 2 and "--rollout.no_such_flag" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--cppo.dynamic_sampling", "true"],
     "error: cppo.dynamic_sampling=true is not supported under OpenRLHF: the hook prunes a finished rollout and "
     "cannot draw replacement prompts; remove it and use OpenRLHF's own --algo.dynamic_filtering_enable, which "
     "replaces filtered prompts before the hook sees the rollout"),
    (["--cppo.selective.enabled", "true", "--train.async_enable"],
     "error: cppo.selective.enabled=true with --train.async_enable: the asynchronous trainer draws prompts in "
     "another actor, steps ahead of the one that records their groups, so the skip decisions could not see the "
     "history they depend on (not built); remove --train.async_enable or cppo.selective.enabled"),
    (["--cppo.equal_size", "false"],
     "error: cppo.equal_size=false cannot be honoured under OpenRLHF: each actor gets an equal consecutive chunk "
     "of the survivors, so they are always balanced into equal-size parts; remove it"),
    (["--cppo.early_stop.enabled", "true", "--train.async_enable"],
     "error: cppo.early_stop.enabled=true with --train.async_enable: the asynchronous trainer generates ahead of "
     "the step whose predictor must decide; remove the flag"),
    (["--cppo.two_wave.enabled", "true"],
     "error: cppo.two_wave.enabled=true is not built for OpenRLHF: the integration sends each prompt's G "
     "requests whole, before any reward; remove it, or run two waves in the embedded trainer "
     "(cppo-megatron train, backend=hf)"),
    (["--cppo.adv_norm", "none"],
     "error: cppo.adv_norm=none conflicts with --algo.advantage.estimator group_norm, whose advantage "
     "normalisation (std) the hook follows; remove cppo.adv_norm or use --algo.advantage.estimator dr_grpo"),
])
def test_settings_openrlhf_cannot_honour_are_refused(flags, message, capsys):
    """These were accepted and silently ignored (adv_norm silently replaced by the estimator's; early
    stopping never ran)."""
    from cppo_megatron.integrations.openrlhf.train import main

    recipe = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm",
              "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "4", "--reward.remote_url", "r.py"]
    assert main([*flags, "--dry-run", *recipe]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert main(["--cppo.max_refill_rounds", "5", "--dry-run", *recipe]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "warning: cppo.max_refill_rounds=5 has no effect under OpenRLHF: refill rounds belong to "
        "cppo.dynamic_sampling, which OpenRLHF runs do not support; remove it")
    assert main(["--cppo.selective.p_easy", "0.2", "--dry-run", *recipe]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "warning: cppo.selective.p_easy=0.2 has no effect: it belongs to cppo.selective.enabled, which is off; "
        "set cppo.selective.enabled=true or remove it")
    # the flat name of earlier versions is still read, with a warning naming the new key
    with pytest.warns(FutureWarning, match="cppo.selective_p_easy is deprecated: write cppo.selective.p_easy"):
        assert main(["--cppo.selective_p_easy", "0.2", "--dry-run", *recipe]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("warning: cppo.selective.p_easy=0.2 has no")
    assert main(["--cppo.equal_size", "true", "--cppo.adv_norm", "std", "--dry-run", *recipe]) == 0  # honoured
