"""Suite-wide pytest hooks.

``CPPO_PYTEST_HARD_EXIT=1`` (scripts/test.sh sets it): once the session has printed its summary,
the process leaves with pytest's own exit status through ``os._exit``, skipping the interpreter's
finalization. Why: one CI run (2026-12-04, 06f2a2f) ended its foreground pytest, after "938 passed,
65 skipped", with a segmentation fault during finalization, which turned the passed suite into a
failure; the C-level teardown of the libraries that tests load in-process (Ray's core worker and
gRPC threads after ``ray.init``, ZeroMQ contexts of veRL's TransferQueue) is where such a crash
comes from, and it says nothing about the tests. Subsets of the suite did not reproduce it. A crash
during the session is still a failure: this runs only after the last report.
"""

from __future__ import annotations

import os
import sys

import pytest

_STATUS = pytest.StashKey[int]()


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
    if os.environ.get("CPPO_PYTEST_HARD_EXIT") != "1" or _STATUS not in config.stash:
        return
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os._exit(config.stash[_STATUS])
