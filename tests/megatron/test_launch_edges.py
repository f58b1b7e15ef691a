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
