"""Each distinct host warning once per process, with a count at exit.

Host libraries log the same warning on every call: a 2-step V1 run of the veRL Megatron CPU
recipe printed TransferQueue's ``target_num_threads 8 should not exceed total physical CPU cores
2`` (``transfer_queue/utils/common.py:103``, on every put and get) 232 times in 1,416 lines.
``collapse_repeated_logs()`` lets the first record of each distinct (logger, level, message) at
WARNING and above through, holds back the repeats, and prints one line per repeated warning with
its count when the process exits. It filters in ``logging.Logger.handle`` (before any handler), so
it also covers the handlers a library adds to its own loggers after the call, which a handler
filter would miss. Installed by the host CPU modes in every process they start and by
``cppo-megatron train``.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections import Counter

from .wrap import wrap

__all__ = ["RepeatCollapser", "collapse_repeated_logs"]

TAG = "logs.collapse"


class RepeatCollapser:
    """Decides, record by record, whether a warning is new; counts the repeats."""

    def __init__(self) -> None:
        self.repeats: Counter[tuple[str, str, str]] = Counter()
        self._seen: set[tuple[str, str, str]] = set()

    def new(self, record: logging.LogRecord) -> bool:
        """True for every record below WARNING and for the first of each distinct warning."""
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelname, record.getMessage())
        if key in self._seen:
            self.repeats[key] += 1
            return False
        self._seen.add(key)
        return True

    def summary(self) -> list[str]:
        """One line per warning that repeated, most repeated first."""
        return [f"cppo: {level} from {name} repeated {n} more time(s), shown once: {msg[:200]}"
                for (name, level, msg), n in sorted(self.repeats.items(), key=lambda kv: (-kv[1], kv[0]))]


_COLLAPSER = RepeatCollapser()


def _print_summary() -> None:
    for line in _COLLAPSER.summary():
        print(line, file=sys.stderr, flush=True)


def _collapsing(handle):
    def collapsing_handle(self: logging.Logger, record: logging.LogRecord) -> None:
        if _COLLAPSER.new(record):
            handle(self, record)
    return collapsing_handle


def collapse_repeated_logs() -> RepeatCollapser:
    """Install the collapse in this process (idempotent); returns the counter."""
    if wrap(logging.Logger, "handle", _collapsing, tag=TAG):
        atexit.register(_print_summary)
    return _COLLAPSER
