"""run_local's error report: a rank that dies in native code (killed by a signal) reports nothing
itself; its peers then fail with "connection closed by peer". The report must name the dead rank
and its exit code first, so the first cause of such a failure is on record."""

import os
import signal

import pytest
import torch.distributed as dist

from cppo_megatron.distributed import run_local


def _dies_on_rank_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a segfault would: no Python error, no report
    dist.barrier()
    return rank


def _ok(rank, world):
    return rank * 10


def test_a_rank_killed_by_a_signal_is_named_with_its_exit_code():
    with pytest.raises(RuntimeError) as err:
        run_local(_dies_on_rank_1, 2, timeout=60)
    first = str(err.value).splitlines()[0]
    assert first == (f"rank 1 exited with code {-signal.SIGKILL} (SIGKILL) without reporting: the kernel's OOM "
                     "killer sends it (see dmesg), or another process did"), str(err.value)


def _segfaults_on_rank_0(rank, world):
    if rank == 0:
        import faulthandler

        faulthandler._sigsegv()  # a crash in native code
    dist.barrier()
    return rank


def test_a_rank_that_crashes_in_native_code_leaves_its_python_stack(capfd):
    with pytest.raises(RuntimeError) as err:
        run_local(_segfaults_on_rank_0, 2, timeout=60)
    first = str(err.value).splitlines()[0]
    assert first == (f"rank 0 exited with code {-signal.SIGSEGV} (SIGSEGV) without reporting: a crash in native "
                     "code; its Python stacks are on stderr (faulthandler)"), str(err.value)
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in stderr and "_segfaults_on_rank_0" in stderr, stderr[-3000:]


def test_results_come_back_in_rank_order():
    assert run_local(_ok, 2, timeout=60) == [0, 10]
