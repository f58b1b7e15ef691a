"""Suite-wide pytest hooks.

``CPPO_PYTEST_HARD_EXIT=1`` (scripts/test.sh sets it): once the session has printed its summary, a
pytest process that started Ray or ZeroMQ in process leaves with pytest's own exit status through
``os._exit``, skipping the interpreter's finalization; any other pytest process finalizes as usual
(``hard_exit``). Why: one CI run (2026-12-04, 06f2a2f) ended its foreground pytest, after "938
passed, 65 skipped", with a segmentation fault during finalization, which turned the passed suite
into a failure; the C-level teardown of the libraries that tests start in process (Ray's core
worker and gRPC threads after ``ray.init``, ZeroMQ contexts and their I/O threads, veRL's
TransferQueue) is where such a crash comes from, and it says nothing about the tests. It has not
been reproduced: subsets of the suite, and (2026-12-05, without the flag, faulthandler on) the only
modules that start them in the pytest process, tests/integrations/verl/test_cpu_checkpoint_engine.py
(ZeroMQ) 30 times and test_v1_hook.py (Ray, TransferQueue) with it 11 times, all exited 0
(docs/testing.md, "Two CI failures, looked for"). So the workaround
is kept only where its suspect is present: after each test, ``natives_started`` notes whether Ray
is initialised or a ZeroMQ context exists in this process, and ``note_natives`` which test it was
first live after; the hard exit prints that (``hard_exit_line``). scripts/test.sh runs the only two
modules that start them in a pytest of their own, so every other pytest of CI finalizes.
A crash during the session is still a failure: the exit happens only after the last report, and pytest-cov has saved and combined its
data by then (it does so when the test loop ends).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

_STATUS = pytest.StashKey[int]()
_NATIVES: dict[str, str] = {}  # each runtime natives_started saw here -> the first test after which it was live


def natives_started(modules: Mapping[str, Any], thread_names: Iterable[str]) -> set[str]:
    """Which in-process native runtimes whose teardown is suspect are live: ``"ray"`` when the
    imported ``ray`` is initialised, ``"zmq"`` when pyzmq's shared context was created or a
    ZeroMQ I/O thread (named ``ZMQbg/...``) runs. ``modules`` is ``sys.modules``; nothing is imported."""
    found = set()
    ray = modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        found.add("ray")
    zmq = modules.get("zmq")
    if zmq is not None and (getattr(getattr(zmq, "Context", None), "_instance", None) is not None
                            or any(name.startswith("ZMQbg/") for name in thread_names)):
        found.add("zmq")
    return found


def note_natives(seen: dict[str, str], found: set[str], nodeid: str) -> None:
    """Record in ``seen`` the test after which each runtime of ``found`` was first live (the first wins)."""
    for name in sorted(found):
        seen.setdefault(name, nodeid)


def hard_exit_line(seen: dict[str, str]) -> str:
    """The line a hard-exiting pytest prints: which runtime made it skip finalization, first live after which test."""
    return "CPPO_PYTEST_HARD_EXIT: finalization skipped; " + "; ".join(
        f"{name} first live after {nodeid}" for name, nodeid in sorted(seen.items()))


def hard_exit(flag: str | None, natives: set[str] | dict[str, str]) -> bool:
    """Whether the session ends with ``os._exit``: the flag is "1" and a suspect runtime was started."""
    return flag == "1" and bool(natives)


def _thread_names() -> list[str]:
    """The names of this process's threads, native ones included (Linux; none elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        return (yield)
    finally:
        if "ray" in sys.modules or "zmq" in sys.modules:
            found = natives_started(sys.modules, _thread_names() if "zmq" in sys.modules else [])
            note_natives(_NATIVES, found, item.nodeid)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Tests marked ``in_process_dist`` (a gloo group and megatron-core's parallel state in the
    pytest process itself, for branch coverage) run after every other test: a gloo rank forked
    from a process whose own group has run segfaults in megatron-core's
    ``initialize_model_parallel`` (measured 2026-12-05: every ``run_local`` test after
    tests/megatron/test_actor_state.py died with SIGSEGV), even after the group is destroyed."""
    last = [item for item in items if item.get_closest_marker("in_process_dist")]
    if last:
        items[:] = [item for item in items if not item.get_closest_marker("in_process_dist")] + last


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not hard_exit(os.environ.get("CPPO_PYTEST_HARD_EXIT"), _NATIVES) or _STATUS not in config.stash:
        return
    print(hard_exit_line(_NATIVES), file=sys.stderr)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os._exit(config.stash[_STATUS])
