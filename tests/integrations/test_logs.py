"""integrations/logs.py: a repeated host warning is shown once, with its count at exit."""

import subprocess
import sys

SCRIPT = r'''
import logging
from cppo_megatron.integrations.logs import collapse_repeated_logs
collapse_repeated_logs(); collapse_repeated_logs()  # a second install changes nothing
# a library's own logger with its own handler, added AFTER the install (TransferQueue's get_logger)
lib = logging.getLogger("transfer_queue.utils.common")
h = logging.StreamHandler(); h.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s")); lib.addHandler(h)
lib.propagate = False
for _ in range(50):
    lib.warning("target_num_threads 8 should not exceed total physical CPU cores 2. Setting to 2.")
lib.warning("another warning")
lib.setLevel(logging.INFO)
for i in range(3):
    lib.info("info lines pass: %d", 7)
print("done", flush=True)
'''


def test_a_warning_repeated_50_times_is_shown_once_and_counted_at_exit():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    shown = [ln for ln in lines if ln.startswith("WARNING transfer_queue.utils.common target_num_threads")]
    assert len(shown) == 1
    assert lines.count("WARNING transfer_queue.utils.common another warning") == 1
    assert lines.count("INFO transfer_queue.utils.common info lines pass: 7") == 3  # below WARNING: untouched
    summary = [ln for ln in lines if ln.startswith("cppo: ")]
    assert summary == ["cppo: WARNING from transfer_queue.utils.common repeated 49 more time(s), shown once: "
                       "target_num_threads 8 should not exceed total physical CPU cores 2. Setting to 2."]
