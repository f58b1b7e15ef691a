"""tests/conftest.py's narrowed hard exit: which pytest processes skip the interpreter's finalization
(``CPPO_PYTEST_HARD_EXIT=1`` and Ray or ZeroMQ started in process), decided on stand-in modules,
nothing imported or started; and, once, a real pytest run that leaves through the hook with its
own status while a plain one finalizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import hard_exit, hard_exit_line, natives_started, note_natives

ROOT = Path(__file__).resolve().parents[1]


def ray(initialised: bool) -> SimpleNamespace:
    return SimpleNamespace(is_initialized=lambda: initialised)


def zmq(instance: object | None) -> SimpleNamespace:
    return SimpleNamespace(Context=SimpleNamespace(_instance=instance))


def test_natives_started_names_ray_only_while_it_is_initialised():
    assert natives_started({"ray": ray(True)}, []) == {"ray"}
    assert natives_started({"ray": ray(False)}, []) == set()  # imported (veRL's trainer module) only
    assert natives_started({}, ["ZMQbg/IO/0"]) == set()  # no pyzmq imported: nothing of ours to blame
    assert natives_started({"ray": SimpleNamespace()}, []) == set()  # a stand-in without is_initialized


def test_natives_started_names_zmq_for_its_shared_context_or_an_io_thread():
    assert natives_started({"zmq": zmq(object())}, []) == {"zmq"}  # Context.instance() ran (even if termed)
    assert natives_started({"zmq": zmq(None)}, ["python", "pt_main_thread"]) == set()
    assert natives_started({"zmq": zmq(None)}, ["python", "ZMQbg/Reaper"]) == {"zmq"}  # a context of its own
    assert natives_started({"zmq": zmq(object()), "ray": ray(True)}, []) == {"ray", "zmq"}


def test_hard_exit_needs_the_flag_and_a_suspect_runtime():
    assert hard_exit("1", {"ray"}) and hard_exit("1", {"zmq"})
    assert not hard_exit("1", set())  # a pytest that never started them finalizes as usual
    assert not hard_exit(None, {"ray"}) and not hard_exit("0", {"ray", "zmq"})
    assert hard_exit("1", {"zmq": "t.py::a"}) and not hard_exit("1", {})


def test_the_first_test_after_which_a_runtime_is_live_is_kept_and_named():
    seen: dict[str, str] = {}
    note_natives(seen, set(), "t.py::a")
    note_natives(seen, {"zmq"}, "t.py::b")
    note_natives(seen, {"zmq", "ray"}, "t.py::c")  # zmq is still live: b keeps it
    assert seen == {"zmq": "t.py::b", "ray": "t.py::c"}
    assert hard_exit_line(seen) == ("CPPO_PYTEST_HARD_EXIT: finalization skipped; "
                                    "ray first live after t.py::c; zmq first live after t.py::b")


TEST = '''
import sys, atexit, pytest

def test_one():
    if "{mode}" == "zmq":
        import zmq
        zmq.Context.instance()
    atexit.register(lambda: print("FINALIZED", flush=True))
    assert "{mode}" != "fail"
'''


def test_the_hook_exits_hard_only_after_ray_or_zmq_and_keeps_pytests_status(tmp_path):
    """A pytest under this conftest: with zmq's context started it leaves through ``os._exit``
    (no atexit handler runs) with pytest's status; without a suspect runtime it finalizes."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    env = {**os.environ, "CPPO_PYTEST_HARD_EXIT": "1"}
    seen = {}
    for mode in ("zmq", "plain", "fail"):
        (tmp_path / "test_x.py").write_text(TEST.format(mode=mode))
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", "test_x.py"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        seen[mode] = (out.returncode, "FINALIZED" in out.stdout, "finalization skipped" in out.stderr)
        if mode == "zmq":
            assert "zmq first live after test_x.py::test_one" in out.stderr
    assert seen == {"zmq": (0, False, True), "plain": (0, True, False), "fail": (1, True, False)}
