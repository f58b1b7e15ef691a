"""`cppo-megatron megatron-check` end to end on 2 local processes (DP2: pruning, exchange,
log-probs vs HF, round trip, update)."""

import pytest

from ._common import transformers  # noqa: F401 - skips without the extras

from cppo_megatron.cli import main

pytestmark = pytest.mark.megatron


def test_megatron_check_dp2(capsys):
    rc = main(["megatron-check", "--tp", "1", "--pp", "1", "--dp", "2", "--prompts", "3", "--group-size", "4",
               "--pruning-rate", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "weights round trip HF -> megatron -> HF exact: True" in out
    assert "kept 6 of 12 completions" in out
    assert "megatron-check: OK" in out


def test_megatron_check_rejects_bad_sizes(capsys):
    assert main(["megatron-check", "--tp", "0"]) == 2  # one line, exit 2
    assert capsys.readouterr().err.strip() == "cppo-megatron megatron-check: error: --tp must be >= 1, got 0 (--debug shows the traceback)"
