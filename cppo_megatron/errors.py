"""The one exception type commands raise for a failure the user can fix.

Its own module (not ``cli``) so that ``python -m cppo_megatron.cli``, where the CLI module is
``__main__``, still catches the class the commands raise.
"""

from __future__ import annotations


class UsageError(Exception):
    """A failure the user can fix (bad value, missing file, framework config error): the CLI
    prints its message on one line and exits 2, without a traceback unless --debug."""
