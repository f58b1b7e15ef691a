"""A failure the user can fix prints one line on stderr and exits 2 (no traceback unless
--debug), for every command that takes user input: one error per command, through the real
CLI in a fresh interpreter as a user runs it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cppo_megatron.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


CASES = {
    "verl": (["verl", "--cppo-dry-run", "cppo.pruning_rat=0.5"], "pruning_rat"),
    "openrlhf": (["openrlhf", RECIPE, "--dry-run", "--rollout.n_samples_per_promt", "8"], "n_samples_per_promt"),
    "bench": (["bench", "speedup", "recipes/no_such.yaml"], "no_such.yaml"),
    "study": (["study", "recipes/tiny_cpu.yaml", "--seeds", "0"], "--seeds"),
}


@pytest.mark.parametrize("command", list(CASES))
def test_user_error_is_one_line_and_exit_2(command):
    argv, named = CASES[command]
    if command == "verl":
        pytest.importorskip("verl")
    if command == "openrlhf":
        pytest.importorskip("openrlhf", exc_type=ImportError)
    out = _cli(*argv)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"cppo-megatron {command}: error:") and named in lines[0], lines


def test_debug_shows_the_traceback():
    out = _cli("--debug", "study", "recipes/tiny_cpu.yaml", "--seeds", "0")
    assert out.returncode == 1 and "Traceback" in out.stderr and "ValueError: --seeds" in out.stderr


def test_top_help_lists_every_command_and_every_benchmark(capsys):
    from cppo_megatron import cli
    from cppo_megatron.commands.bench import BENCHMARKS

    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"\n  {name} " in text, name
    bench_line = next(line for line in text.splitlines() if line.startswith("  bench "))
    assert all(b in bench_line for b in BENCHMARKS), bench_line
    assert "--debug" in text


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["write-fails-in-print", "write-fails-in-the-last-flush"])
def test_a_reader_that_stops_early_ends_the_command_quietly_with_141(unbuffered):
    """`cppo-megatron verl ... --cppo-dry-run | head -1` printed a BrokenPipeError traceback
    and exited 1; like `yes | head` it now stops quietly with 128 + SIGPIPE: when a print
    writes at once (unbuffered) and when only the flush after the command writes (`recipes`
    prints 6 kB, under a buffered stdout's 8 kB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    proc = subprocess.Popen([sys.executable, "-m", "cppo_megatron.cli", "recipes"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before the command writes (its imports take longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=180) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_stdout_reader_gone_only_for_a_pipe_without_its_reader(monkeypatch):
    from cppo_megatron import cli

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe_out:
        monkeypatch.setattr(sys, "stdout", pipe_out)
        assert cli.stdout_reader_gone() is False  # the reader is still there
        os.close(read_end)
        assert cli.stdout_reader_gone() is True
        monkeypatch.undo()
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no file descriptor (a test's capture, a notebook)
    assert cli.stdout_reader_gone() is False


def test_a_broken_pipe_elsewhere_keeps_its_traceback(monkeypatch):
    """A BrokenPipeError of a socket or a child's pipe is a failure, not a reader that left."""
    from cppo_megatron import cli

    def broken() -> int:
        raise BrokenPipeError(32, "Broken pipe (a Ray worker's socket)")

    monkeypatch.setattr("cppo_megatron.integrations.logs.collapse_repeated_logs", lambda: None)
    monkeypatch.setattr(cli, "main", broken)
    with pytest.raises(BrokenPipeError, match="Ray worker"):
        cli.console()
