"""User errors end in one line and exit status 2 before any work starts (issues 13 and 16).

The CLI runs in-process (``cli.main``), as a user's command does past its interpreter start: the
exact message on stderr, the exit status, no traceback, and no trace of a started run (no out_dir).
The launch itself (``commands.train.start``: the in-process Trainer or torchrun, and
``trainer.launch.run_torchrun``) is stubbed to fail the test, so a check that let a bad recipe
through cannot start a run (tests/launch_guard.py).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cppo_megatron.tasks import Problem, Task, score_math
from cppo_megatron.trainer.config import RecipeError, load_recipe
from cppo_megatron.trainer.preflight import FIT_ERROR_FRACTION, check_inputs, describe_fit, measure_fit
from cppo_megatron.trainer.tokenizer import CharTokenizer

from ..launch_guard import forbid

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
GSM_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
                "her friends in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cppo-megatron train ARGV`` in-process, its launch stubbed: (returncode, stdout, stderr)."""
    from cppo_megatron import cli as cppo_cli

    forbid(monkeypatch, "train")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)

    def run(*argv):
        capsys.readouterr()
        code = cppo_cli.main(["train", *map(str, argv)])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def _one_line_error(proc, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"cppo-megatron train: error: {expected} (--debug shows the traceback)"]


def _gsm_file(path: Path, rows: int = 6) -> Path:
    path.write_text("\n".join(json.dumps(GSM_ROW) for _ in range(rows)) + "\n")
    return path


def test_gsm8k_data_that_does_not_fit_the_default_recipe_fails_before_the_warmup(cli, tmp_path):
    data = _gsm_file(tmp_path / "gsm.jsonl")
    out = tmp_path / "run"
    proc = cli(TINY, "task.name=gsm8k", f"task.path={data}", f"task.test_path={data}", f"out_dir={out}")
    # byte-level tokens: BOS + 170 question bytes, answer 126 bytes + EOS = 298
    _one_line_error(proc, (
        "task gsm8k does not fit the model: 12 of 12 rows need more than model.max_position=32 positions for "
        "prompt + answer (longest 298); 12 of 12 reference answers are longer than rollout.max_new_tokens=6 "
        "tokens (longest 126); raise model.max_position to >= 298 and raise rollout.max_new_tokens to >= 126, "
        "or use shorter data"))
    assert not out.exists()  # nothing started: no warm-up, no metrics, no out_dir


def test_malformed_yaml_names_the_file_line_and_column(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {source: config\n  bad")
    _one_line_error(cli(bad), f"recipe {bad} is not valid YAML (line 2, column 6: expected ',' or '}}', "
                               "but got '<stream end>'); fix the file")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    _one_line_error(cli(listy), f"recipe {listy} must be a YAML mapping of keys (model:, task:, ...), got a "
                                 "ListConfig; see recipes/tiny_cpu.yaml")


def test_missing_data_file_names_the_key(cli, tmp_path):
    missing = tmp_path / "train.jsonl"
    _one_line_error(cli(TINY, "task.name=gsm8k", f"task.path={missing}", f"out_dir={tmp_path / 'run'}"),
                    f"task.path {missing} does not exist; give a .jsonl or .parquet file in GSM8K format "
                    "(docs/trainer.md, Bring your own)")


def test_bad_model_directory_is_named_before_torchrun_starts(cli, tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    expected = (f"model.path {empty} has no config.json, so it is not an HF model directory; give a directory "
                "saved by save_pretrained (config.json, *.safetensors, tokenizer files) with model.source=hf_dir")
    _one_line_error(cli(TINY, "model.source=hf_dir", f"model.path={empty}"), expected)
    # --nproc: checked in the launcher, before torchrun starts four processes
    proc = cli(ROOT / "recipes" / "tiny_cpu_megatron.yaml", "--nproc", "4", "model.source=hf_dir",
                f"model.path={empty}")
    _one_line_error(proc, expected)
    # --debug lets the error through (the CLI then prints its traceback)
    with pytest.raises(RecipeError, match="has no config.json"):
        cli(TINY, "model.source=hf_dir", f"model.path={empty}", "--debug")


def test_model_directory_checks_in_order(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    recipe = load_recipe(TINY, ["model.source=hf_dir", f"model.path={d}"])
    (d / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(RecipeError, match=r"config.json has no model_type"):
        check_inputs(recipe)
    (d / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 64}')
    with pytest.raises(RecipeError, match=r"has no weight files"):
        check_inputs(recipe)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(RecipeError, match=r"has no tokenizer files \(tokenizer.json, "):
        check_inputs(recipe)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(RecipeError, match=r"cannot load its tokenizer"):
        check_inputs(recipe)
    with pytest.raises(RecipeError, match=r"model.path .*nope does not exist"):
        check_inputs(load_recipe(TINY, ["model.source=hf_dir", f"model.path={tmp_path / 'nope'}"]))
    with pytest.raises(RecipeError, match=r"init_checkpoint .*w.pt does not exist"):
        check_inputs(load_recipe(TINY, [f"init_checkpoint={tmp_path / 'w.pt'}"]))
    with pytest.raises(RecipeError, match=r"--resume: no checkpoint under .*checkpoints; check out_dir"):
        check_inputs(load_recipe(TINY, [f"out_dir={tmp_path}"]), resume=True)


def _task(answers: list[str]) -> Task:
    problems = [Problem(f"{i}+{i}=", a) for i, a in enumerate(answers)]
    return Task("t", problems[:-1], problems[-1:], score_math, lambda p: p.answer, alphabet="0123456789+=")


def test_fit_counts_exactly_the_rows_that_do_not_fit():
    tok = CharTokenizer("0123456789+=")
    # prompts "0+0=" .. "3+3=": 1 + 4 tokens; answers of 1, 3, 5, 2 tokens
    task = _task(["1", "123", "12345", "12"])
    fit = measure_fit(task, tok, prompt_template="{question}", max_position=10, max_new_tokens=3)
    # sequences 5 + answer + EOS = 7, 9, 11, 8: one over 10; one answer over 3
    assert (fit.rows, fit.too_long_for_positions, fit.too_long_for_rollout) == (4, 1, 1)
    assert (fit.longest_sequence, fit.longest_answer) == (11, 5)
    assert describe_fit(fit, "t", position_key="model.max_position") == (
        "task t does not fit the model: 1 of 4 rows need more than model.max_position=10 positions for prompt + "
        "answer (longest 11); 1 of 4 reference answers are longer than rollout.max_new_tokens=3 tokens (longest 5); "
        "raise model.max_position to >= 11 and raise rollout.max_new_tokens to >= 5, or use shorter data")
    exact = measure_fit(task, tok, prompt_template="{question}", max_position=11, max_new_tokens=5)
    assert describe_fit(exact, "t", position_key="model.max_position") is None  # the limits are inclusive
    with pytest.raises(RecipeError, match=r"task.prompt_template '\{q\}' cannot be filled"):
        measure_fit(task, tok, prompt_template="{q}", max_position=None, max_new_tokens=3)
    with pytest.raises(RecipeError, match=r"character 'Q' .* change task.prompt_template"):
        measure_fit(task, tok, prompt_template="Q{question}", max_position=None, max_new_tokens=3)


def test_few_unfit_rows_warn_with_the_count_and_most_are_an_error(tmp_path):
    rows = [dict(GSM_ROW, answer=f"short\n#### {i}") for i in range(9)] + [GSM_ROW]
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    base = ["task.name=gsm8k", f"task.path={data}", f"task.test_path={data}", "model.max_position=400"]
    # answers "short\n#### i" are 12 bytes, the real one 126: 2 of 20 rows over 20 tokens
    inputs = check_inputs(load_recipe(TINY, base + ["rollout.max_new_tokens=20"]))
    assert inputs.warnings == (
        "warning: task gsm8k does not fit the model: 2 of 20 reference answers are longer than "
        "rollout.max_new_tokens=20 tokens (longest 126); raise rollout.max_new_tokens to >= 126, or use shorter data",)
    assert 2 < FIT_ERROR_FRACTION * 20
    with pytest.raises(RecipeError, match=r"20 of 20 reference answers are longer than rollout.max_new_tokens=5"):
        check_inputs(load_recipe(TINY, base + ["rollout.max_new_tokens=5"]))
    assert check_inputs(load_recipe(TINY, base + ["rollout.max_new_tokens=126"])).warnings == ()


def test_unfit_rows_at_exactly_the_error_fraction_are_an_error_one_fewer_a_warning(tmp_path):
    """The boundary itself: with 20 rows, 10 unfit (= FIT_ERROR_FRACTION x 20) is an error,
    9 unfit a warning that names the count."""
    assert FIT_ERROR_FRACTION == 0.5  # the counts below sit on this boundary

    def rows(long: int, offset: int) -> list[dict]:  # 10 rows, the first `long` with the 126-byte answer
        return [GSM_ROW if i < long else dict(GSM_ROW, answer=f"short\n#### {offset + i}") for i in range(10)]

    def recipe(train_long: int, test_long: int):
        train, test = tmp_path / f"train{train_long}.jsonl", tmp_path / f"test{test_long}.jsonl"
        train.write_text("\n".join(json.dumps(r) for r in rows(train_long, 0)))
        test.write_text("\n".join(json.dumps(r) for r in rows(test_long, 100)))
        return load_recipe(TINY, ["task.name=gsm8k", f"task.path={train}", f"task.test_path={test}",
                                  "model.max_position=400", "rollout.max_new_tokens=20"])

    def verdict(r) -> tuple:
        try:
            return ("warnings", check_inputs(r).warnings)
        except RecipeError as exc:
            return ("error", str(exc))

    problem = ("task gsm8k does not fit the model: {} of 20 reference answers are longer than "
               "rollout.max_new_tokens=20 tokens (longest 126); raise rollout.max_new_tokens to >= 126, or use "
               "shorter data")
    assert verdict(recipe(5, 5)) == ("error", problem.format(10))
    assert verdict(recipe(5, 4)) == ("warnings", ("warning: " + problem.format(9),))


def test_default_recipe_fits():
    inputs = check_inputs(load_recipe(TINY))
    assert inputs.warnings == () and inputs.fit.too_long_for_rollout == inputs.fit.too_long_for_positions == 0
    assert inputs.fit.rows == 13000


def test_hf_directory_limits_come_from_its_config(tmp_path):
    """A valid HF directory passes the model checks; its max_position_embeddings (not the recipe's
    model.max_position) is the limit, and the message says the model's own limit cannot be raised."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "m"
    d.mkdir()
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(d)
    # llama: AutoTokenizer keeps the saved tokenizer (for qwen2 it would swap in its own class)
    (d / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 200}')
    (d / "model.safetensors").write_bytes(b"")
    data = _gsm_file(tmp_path / "gsm.jsonl", rows=2)
    recipe = load_recipe(TINY, ["model.source=hf_dir", f"model.path={d}", "task.name=gsm8k", f"task.path={data}",
                                f"task.test_path={data}", "rollout.max_new_tokens=200", "model.max_position=4096"])
    with pytest.raises(RecipeError) as err:
        check_inputs(recipe)
    # no BOS in this tokenizer: 170 + 126 + EOS = 297 > 200
    assert str(err.value) == (
        "task gsm8k does not fit the model: 4 of 4 rows need more than max_position_embeddings=200 positions for "
        "prompt + answer (longest 297); shorten the prompts (max_position_embeddings is the model's own limit), "
        "or use shorter data")
