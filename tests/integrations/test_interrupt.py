"""The e2e tests' process runner leaves nothing of a run behind (tests/integrations/interrupt.py)."""

from __future__ import annotations

import os
import sys
import time

from . import interrupt


def test_a_killed_run_leaves_no_process_of_its_session(tmp_path):
    # a child in a process group of its own (as Ray's workers make), then the driver SIGKILLed
    script = "import os, subprocess, sys, time\n" \
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], process_group=0)\n" \
             "open('child.pid', 'w').write(str(p.pid))\n" \
             "time.sleep(300)\n"
    pidfile = tmp_path / "child.pid"

    def when():
        return interrupt.kill_driver if pidfile.is_file() and pidfile.read_text() else None

    out = interrupt.run([sys.executable, "-c", script], env=dict(os.environ), cwd=tmp_path,
                        log_path=tmp_path / "log.txt", when=when, timeout=60)
    assert out.struck == "driver" and out.returncode == -9
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie waiting for init counts as gone
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"pid {child} of the killed run is still running")
