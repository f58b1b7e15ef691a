"""Every code snippet in README.md and docs/ runs as written (tests/doc_snippets.py finds them).

- ```python blocks run in a fresh interpreter; a block marked ``<!-- example: PATH -->`` must
  be lines of PATH, in order, and PATH itself runs (test_megatron_example_runs_under_torchrun).
- Shell command lines: cheap ones run as written, in a scratch directory that links the
  repository's recipes and scripts (``--help``, ``--dry-run``, ``--cppo-dry-run``,
  ``--check``, ``--print-recipe``, ``demo``, ``doctor``, ``simulate``, ``example-data``, ``recipes``,
  ``advise``).
  Commands that train or benchmark for minutes are checked up to the expensive part: ``train`` with
  ``--print-recipe`` (recipe and every override validated), ``verl`` / ``openrlhf`` with their
  dry run, ``bench`` / ``study`` / ``megatron-check`` through the real argument parser and
  recipe loader. Installs, environment builds and the test suite itself are listed as not
  run, with the reason; so are blocks marked ``<!-- not-run: REASON -->`` (GPU, cluster).

A command shown in several docs (a guide and its record) runs once, where it first appears.
``pytest -rs tests/test_docs.py`` lists every skipped snippet and why; test ids say
``run`` or ``check``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_snippets import ROOT, Snippet, snippets

ALL = snippets()
CHEAP_FLAGS = {"--help", "-h", "--dry-run", "--cppo-dry-run", "--check", "--print-recipe"}
RUN_COMMANDS = {"demo", "doctor", "simulate", "example-data", "recipes", "advise"}
LINKED = ("recipes", "scripts", "examples", "patches", "requirements", "constraints")
CLI_PREFIXES = ("cppo-megatron", ".venv/bin/cppo-megatron", ".venv-vllm/bin/cppo-megatron", ".venv-bridge/bin/cppo-megatron")
NOT_RUN_SCRIPTS = {
    "main.sh": "runs the main job (~10 minutes of training)",
    "test.sh": "runs the whole test suite and builds .venv-vllm",
    "setup.sh": "builds .venv (installs from PyPI)",
    "setup_vllm.sh": "builds .venv-vllm (a 2.5 GB install from PyPI)",
    "setup_bridge.sh": "builds .venv-bridge (Python 3.12, Megatron-Bridge; a 6.4 GB cached install)",
    "gpu_wheels.sh": "downloads wheels from PyPI",
    "gpu_study_files.sh": "downloads wheels from PyPI and copies the 94 MB model for a GPU machine",
    "gpu_check.sh": "installs into a GPU machine's environment and runs the device checks (needs a GPU)",
    "verl_gpu_smoke.sh": "needs a GPU",
}


def classify(s: Snippet) -> tuple[str, str, list[str]]:
    """(mode, reason, argv): mode "skip" (reason says why), "run" (argv runs as written),
    "check" (argv is the command changed to stop before the expensive part; reason says how)."""
    if s.marker and s.marker[0] == "not-run":
        return "skip", s.marker[1], []
    argv = shlex.split(os.path.expandvars(s.text.replace("$PWD", "{PWD}")), comments=True)
    while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
        argv = argv[1:]  # NAME=value environment assignments
    if any("..." in a or a.startswith("[") for a in argv):
        return "skip", "a template with placeholders, not a command", []
    prog = argv[0]
    if prog == "pip":
        return "skip", "installs packages from PyPI", []
    if prog == "bash":
        script = Path(argv[1]).name
        if script == "test.sh" and "--quick" in argv:
            return "skip", "runs the quick test tier (lint, mypy, pytest): the test suite itself", []
        return "skip", NOT_RUN_SCRIPTS.get(script, f"runs {argv[1]}"), []
    if prog == "grep":
        return "skip", "reads the metrics of the run above", []
    if "pytest" in argv:
        return "skip", "runs tests: the test suite itself", []
    if prog == "torchrun":
        return "skip", "runs examples/megatron_step.py: test_megatron_example_runs_under_torchrun", []
    if prog.endswith("python") and argv[1:2] == ["scripts/zero3_cpu_repro.py"]:
        return "skip", "spawns N DeepSpeed ZeRO-3 processes (.venv-vllm's DeepSpeed; 20-40 s a run)", []
    if prog.endswith("python") and argv[1:3] == ["-m", "cppo_megatron.integrations.verl.main"]:
        cli = ["verl", *argv[3:]]
    elif prog.endswith("python") and argv[1:3] == ["-m", "cppo_megatron.integrations.openrlhf.train"]:
        cli = ["openrlhf-launcher", *argv[3:]]
    elif prog in CLI_PREFIXES:
        cli = argv[1:]
    else:
        raise AssertionError(f"{s.id}: no rule for the command {s.text!r}")
    env_note = (f" (in the main environment; the line names {prog.split('/')[0]})"
                if prog.startswith((".venv-vllm", ".venv-bridge")) else "")
    name, flags = cli[0], set(cli[1:])
    if name == "patch" and flags & {"--apply", "--revert"}:
        return "skip", "changes the installed OpenRLHF package", []
    if flags & CHEAP_FLAGS or name in RUN_COMMANDS:
        return "run", "as written" + env_note, cli
    if name == "train":
        return "check", "with --print-recipe: the recipe and every override validated" + env_note, cli + ["--print-recipe"]
    if name == "verl":
        return "check", "with --cppo-dry-run: composed by hydra against veRL's config, CPPO allocation applied", \
            ["verl", "--cppo-dry-run", *cli[1:]]
    if name in ("openrlhf", "openrlhf-launcher"):
        return "check", "with --dry-run: every flag checked by OpenRLHF's parser, the plan printed", cli + ["--dry-run"]
    # bench, study, megatron-check, and any other command: parsed, its recipe loaded
    return "check", "arguments parsed by the command's parser, a recipe and its overrides loaded" + env_note, cli


def _shell_params():
    params, first = [], {}
    for s in (x for x in ALL if x.kind == "shell"):
        mode, reason, argv = classify(s)
        seen = first.setdefault(" ".join(s.text.split("#")[0].split()), s) if mode != "skip" else s
        if seen is not s:  # a guide and its record may show the same command: it runs once
            mode, reason = "skip", f"the same command as {seen.id}, which runs it"
        marks = [pytest.mark.skip(reason=f"{s.id}: {s.text[:70]!r}: {reason}")] if mode == "skip" else []
        params.append(pytest.param(s, mode, argv, id=f"{mode}:{s.id}", marks=marks))
    return params


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch directory with the repository's inputs linked in: outputs (runs/, hydra's
    outputs/) land here, not in the checkout."""
    d = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (d / name).symlink_to(ROOT / name)
    return d


@pytest.mark.parametrize(("snippet", "mode", "argv"), _shell_params())
def test_shell_command(snippet, mode, argv, workdir, monkeypatch, capsys):
    from cppo_megatron import cli

    monkeypatch.chdir(workdir)
    argv = [a.replace("{PWD}", str(workdir)) for a in argv]
    if argv[0] == "verl":
        pytest.importorskip("verl")
    if argv[0] in ("openrlhf", "openrlhf-launcher") or argv[:2] == ["patch", "openrlhf"]:
        if importlib.util.find_spec("openrlhf") is None:
            pytest.skip("OpenRLHF is not installed here")
    if mode == "check" and argv[0] not in ("train", "verl", "openrlhf", "openrlhf-launcher"):
        _, args = cli.parse_command(argv[0], argv[1:])  # argparse exits 2 on a bad option
        if getattr(args, "recipe", None):
            load_any_recipe(args)
        return
    if argv[0] == "openrlhf-launcher":
        from cppo_megatron.integrations.openrlhf.train import main as launcher

        rc = launcher(argv[1:])
    else:
        try:
            rc = cli.main(argv)
        except SystemExit as exc:  # argparse's --help
            rc = exc.code or 0
    out = capsys.readouterr()
    assert rc == 0, f"{snippet.id}: `{snippet.text}` exited {rc}:\n{out.out[-2000:]}\n{out.err[-2000:]}"


def _python_params():
    params = []
    for s in (x for x in ALL if x.kind == "python"):
        marks = [pytest.mark.skip(reason=f"{s.id}: {s.marker[1]}")] if s.marker and s.marker[0] == "not-run" else []
        mode = "excerpt" if s.marker and s.marker[0] == "example" else "run"
        params.append(pytest.param(s, id=f"{mode}:{s.id}", marks=marks))
    return params


@pytest.mark.parametrize("snippet", _python_params())
def test_python_snippet(snippet, workdir):
    if snippet.marker and snippet.marker[0] == "example":
        source = [line.strip() for line in (ROOT / snippet.marker[1]).read_text().splitlines()]
        pos = 0
        for line in (x.strip() for x in snippet.text.splitlines() if x.strip()):
            assert line in source[pos:], f"{snippet.id}: not a line of {snippet.marker[1]} (after line {pos}): {line!r}"
            pos = source.index(line, pos) + 1
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", snippet.text], cwd=workdir, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{snippet.id} failed:\n{out.stderr[-3000:]}"


def test_the_docs_have_snippets_of_every_kind():
    kinds = {(s.kind, classify(s)[0] if s.kind == "shell" else "python") for s in ALL}
    assert {("python", "python"), ("shell", "run"), ("shell", "check"), ("shell", "skip")} <= kinds
    assert any(s.doc == "README.md" and s.kind == "python" and not s.marker for s in ALL)  # the core snippet runs


@pytest.mark.megatron
def test_megatron_example_runs_under_torchrun(workdir):
    """examples/megatron_step.py, which docs/integrations/megatron.md quotes, on 2 gloo processes (DP 2)."""
    pytest.importorskip("megatron.core")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples/megatron_step.py"), "--tp", "1"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: 32 rollouts" in out.stdout and "kept 8 of 64" in out.stdout
        assert f"rank {rank}: MegatronActor.step done" in out.stdout


def _help_examples() -> list:
    """`cppo-megatron ...` example lines of `--help` texts: the top-level epilog and every
    command's description (its module docstring; study's and bench's own modules too)."""
    import importlib
    import re

    from cppo_megatron import cli

    texts = {"cppo-megatron --help": cli.EPILOG}
    for name, (module, _) in cli.COMMANDS.items():
        texts[f"cppo-megatron {name} --help"] = importlib.import_module(module).__doc__ or ""
    texts["cppo_megatron/bench/study.py"] = importlib.import_module("cppo_megatron.bench.study").__doc__ or ""
    params = []
    for where, text in texts.items():
        for line in text.splitlines():
            line = re.sub(r"\s+\(.*$|\s+#.*$", "", line.strip())  # trailing "(explanation)" / "# comment"
            if not line.startswith("cppo-megatron "):
                continue
            placeholder = "..." in line or "[" in line or re.search(r"\b[A-Z]{4,}\b", line)
            marks = [pytest.mark.skip(reason=f"{where}: {line!r}: a template")] if placeholder else []
            params.append(pytest.param(line, id=f"{where}: {line}", marks=marks))
    return params


def load_any_recipe(args) -> None:
    """Load a command's recipe with its overrides: an embedded-trainer recipe, or for
    `bench verl` and a study on a veRL recipe a veRL recipe composed by hydra (the dry run of
    `cppo-megatron verl`)."""
    from cppo_megatron.bench.verl_study import is_verl_recipe

    if getattr(args, "benchmark", None) == "openrlhf":  # its runs are OpenRLHF recipe runs: dry-run one
        if importlib.util.find_spec("openrlhf") is None:
            pytest.skip("OpenRLHF is not installed here")
        from cppo_megatron import cli

        assert cli.main(["openrlhf", args.recipe, *shlex.split(args.flags), "--dry-run"]) == 0
        return
    if getattr(args, "benchmark", None) == "verl" or is_verl_recipe(args.recipe):  # bench verl, study on veRL
        pytest.importorskip("verl")
        from cppo_megatron import cli

        assert cli.main(["verl", "--cppo-dry-run", args.recipe, *args.overrides]) == 0
        return
    from cppo_megatron.trainer.config import load_recipe

    load_recipe(args.recipe, args.overrides)


@pytest.mark.parametrize("line", _help_examples())
def test_help_example_parses(line, workdir, monkeypatch):
    """Every example a --help text shows is accepted by its command's parser, and its recipe
    and overrides load (none of them is run: some train for minutes)."""
    from cppo_megatron import cli

    monkeypatch.chdir(workdir)
    argv = shlex.split(line.replace("$PWD", str(workdir)))[1:]
    _, args = cli.parse_command(argv[0], argv[1:])  # argparse exits 2 on a bad option
    recipe = getattr(args, "recipe", None)
    if recipe and argv[0] in ("train", "study", "bench"):
        load_any_recipe(args)
    elif recipe and argv[0] == "openrlhf":
        from cppo_megatron.integrations.openrlhf.recipe import load_recipe as load_openrlhf_recipe

        load_openrlhf_recipe(recipe)
    elif argv[0] == "verl" and args.passthrough:  # a recipe file or a shipped recipe's name exists
        from cppo_megatron.integrations.verl.main import _find_recipe, _names_a_recipe

        if _names_a_recipe(args.passthrough[0]):
            assert Path(_find_recipe(args.passthrough[0])).is_file(), line
    for arg in argv:
        if arg.startswith("--config-path="):
            name = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-name="))
            assert (Path(arg.split("=", 1)[1]) / f"{name}.yaml").is_file(), line


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    """A link of README.md or docs/ to another doc (and its #anchor) points at a file and heading
    that exist: moving a section to a records file must carry its links along."""
    import re

    anchors: dict[Path, set[str]] = {}

    def anchors_of(path: Path) -> set[str]:
        if path not in anchors:
            text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
            anchors[path] = {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
        return anchors[path]

    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_each_command_runs_once_where_it_first_appears():
    """A command a guide and its record both show is run (or checked) once, not twice, and none is
    left out: the runnable parameters are exactly the distinct runnable commands of the docs."""
    def key(s: Snippet) -> str:
        return " ".join(s.text.split("#")[0].split())

    params = _shell_params()
    runnable = [p.values[0] for p in params if not p.marks]
    wanted = [s for s in ALL if s.kind == "shell" and classify(s)[0] != "skip"]
    assert sorted({key(s) for s in runnable}) == sorted({key(s) for s in wanted})
    assert len(runnable) == len({key(s) for s in runnable}), "a command runs twice"
    firsts = {}
    for s in wanted:
        firsts.setdefault(key(s), s)
    assert all(firsts[key(s)] is s for s in runnable), "a command runs at a later appearance, not its first"
