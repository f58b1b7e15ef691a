"""Run one function on W local processes joined in a gloo process group.

For tests and CPU experiments: ``run_local(fn, 4, *args)`` forks four workers, each calls
``fn(rank, world_size, *args)`` after ``init_process_group("gloo")``, and the return
values come back as a list indexed by rank. A failure on any rank raises with that
rank's traceback. Forking (the default) reuses the parent's imports, which matters for
megatron-core (~9 s to import); each worker runs torch on one thread.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_local"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn, rank, world, port, queue, args, threads):
    # a crash in native code reports nothing through the queue: print this rank's Python stacks instead,
    # on file descriptor 2 (sys.stderr may be a stream without one: pytest's capture, a notebook)
    faulthandler.enable(file=sys.__stderr__ if sys.__stderr__ is not None else 2)
    try:
        torch.set_num_threads(threads)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        )
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        # plain pickle: torch's queue reducers share tensors through file descriptors that
        # vanish when the worker exits
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


# where to look when a rank was ended by one of these signals
_WHY = {signal.SIGKILL: "the kernel's OOM killer sends it (see dmesg), or another process did",
        signal.SIGSEGV: "a crash in native code; its Python stacks are on stderr (faulthandler)",
        signal.SIGABRT: "an abort in native code; its Python stacks are on stderr (faulthandler)"}


def _silent(rank: int, code: int) -> str:
    """One line for a rank that ended without reporting: its exit code, the signal and where to look."""
    try:
        sig = signal.Signals(-code)
    except ValueError:  # an exit status, or no signal this platform names
        return f"rank {rank} exited with code {code} without reporting"
    hint = f": {_WHY[sig]}" if sig in _WHY else ""
    return f"rank {rank} exited with code {code} ({sig.name}) without reporting{hint}"


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    start_method: str = "fork",
    threads: int = 1,
) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results.

    Args:
        fn: a picklable function run on every rank inside an initialised process group.
        world_size: int >= 1. args: passed to every rank.
        timeout: seconds for the whole run; a failing rank gives its peers 5 s to report.
        start_method: multiprocessing start method. threads: torch threads per process.

    Returns:
        ``world_size`` results, ``fn``'s return value of rank 0 first.

    Raises:
        RuntimeError with every failing rank's traceback (or the timeout).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    ctx: Any = mp.get_context(start_method)  # a context of start_method; its stubs lack Process
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, threads), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    failed: set[int] = set()  # ranks that reported an error
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, payload = queue.get()
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                failed.add(rank)
                # peers usually fail too (closed connections) or block in a collective:
                # give them a moment to report, then stop them below
                deadline = min(deadline, time.monotonic() + 5.0)
            continue
        if time.monotonic() > deadline:
            if not errors:
                errors.append(f"timed out after {timeout:.0f} s; finished ranks: {sorted(results)}")
            break
        if all(not p.is_alive() for p in procs) and queue.empty():
            errors.append(f"workers exited without reporting; exit codes {[p.exitcode for p in procs]}")
            break
        time.sleep(0.02)
    reported = set(results) | failed
    for p in procs:
        if errors and p.is_alive():
            p.terminate()
        p.join(timeout=10)
    if errors:
        # a rank killed by a signal (a crash in native code) reports nothing: its peers then fail with
        # "connection closed by peer"; name it, with its exit code, so the first cause is on record
        silent = [_silent(r, p.exitcode) for r, p in enumerate(procs)
                  if r not in reported and p.exitcode not in (None, 0, -signal.SIGTERM)]
        raise RuntimeError("\n".join(silent + errors))
    return [results[r] for r in range(world_size)]
