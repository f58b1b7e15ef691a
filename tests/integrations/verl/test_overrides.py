"""The override file (``--cpu FILE``): YAML values in hydra's override grammar, the flag, and the
order of precedence recipe < file < command line (composed by hydra, no Ray)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from cppo_megatron.integrations.verl.main import recipe_args
from cppo_megatron.integrations.verl.overrides import (
    OverrideFileError,
    file_overrides,
    flatten,
    hydra_value,
    split_flag,
)

from .conftest import RECIPES, compose


@pytest.mark.parametrize("value,text", [
    (None, "null"), (True, "true"), (False, "false"), (4, "4"), (1.0e-06, "1e-06"), (0.5, "0.5"),
    ("hf", "'hf'"), ("${cppo_cpu.data_dir}/train.parquet", "'${cppo_cpu.data_dir}/train.parquet'"),
    ("it's a:b,c=d", "'it\\'s a:b,c=d'"), (["console", "file"], "['console','file']"),
    ({"a": 1, "b": [True]}, "{a:1,b:[true]}"), ([], "[]"),
])
def test_values_in_hydra_grammar(value, text):
    assert hydra_value(value) == text


def test_flatten_keeps_file_order_and_treats_lists_and_empty_mappings_as_leaves():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == [("a.b", 1), ("a.c.d", [1, 2]), ("e", {})]
    with pytest.raises(OverrideFileError, match="'a.b'"):
        flatten({"a.b": 1})


def test_split_flag_forms_and_errors():
    assert split_flag(["r.yaml", "--cpu", "f.yaml", "x=1"]) == (["r.yaml", "x=1"], "f.yaml")
    assert split_flag(["r.yaml", "--cpu=f.yaml"]) == (["r.yaml"], "f.yaml")
    assert split_flag(["r.yaml", "x=1"]) == (["r.yaml", "x=1"], None)
    for bad, match in ((["--cpu"], "needs a file"), (["--cpu", "x=1"], "needs a file"), (["--cpu="], "needs a file"),
                       (["--cpu", "a", "--cpu", "b"], "given twice")):
        with pytest.raises(OverrideFileError, match=match):
            split_flag(bad)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(OverrideFileError, match="no such override file"):
        file_overrides(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(OverrideFileError, match="list.yaml: expected a mapping"):
        file_overrides(tmp_path / "list.yaml")
    (tmp_path / "text.yaml").write_text("description: only words\n")
    with pytest.raises(OverrideFileError, match="no keys"):
        file_overrides(tmp_path / "text.yaml")


def test_file_sits_between_recipe_and_command_line(tmp_path, plugin):
    """The file replaces the recipe's values and adds keys the recipe lacks; the command line's
    overrides still win over the file."""
    f = tmp_path / "o.yaml"
    f.write_text("description: x\ntrainer:\n  device: cpu\n  total_training_steps: 2\n"
                 "data:\n  train_batch_size: 4\n  train_files: ${cppo_cpu.d}/t.parquet\n"
                 "cppo_cpu:\n  d: /tmp/data\n")
    args = recipe_args([str(RECIPES / "qwen2.5-7b-math-megatron-cppo.yaml"), "data.train_batch_size=8"],
                       file_overrides(f))
    assert args[:2] == [f"--config-path={RECIPES}", "--config-name=qwen2.5-7b-math-megatron-cppo"]
    assert args[-1] == "data.train_batch_size=8" and "++trainer.device='cpu'" in args
    cfg = compose(RECIPES, "qwen2.5-7b-math-megatron-cppo", [a for a in args if not a.startswith("--")])
    assert cfg.trainer.device == "cpu" and cfg.trainer.total_training_steps == 2  # added / replaced by the file
    assert cfg.data.train_batch_size == 8  # the command line over the file
    assert cfg.data.train_files == "/tmp/data/t.parquet"  # interpolation kept and resolved
    assert OmegaConf.select(cfg, "actor_rollout_ref.actor.ppo_epochs") == 2  # the recipe's own value


def test_cli_dry_run_with_a_bad_override_file_is_one_line(tmp_path, capsys):
    from cppo_megatron import cli

    code = cli.main(["verl", "--cppo-dry-run", str(RECIPES / "qwen2.5-7b-math-megatron-cppo.yaml"),
                     "--cpu", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "no such override file" in err and "Traceback" not in err


def test_a_recipe_file_with_a_flat_key_of_earlier_versions_still_runs_and_is_told_the_new_name(tmp_path, capsys):
    """A recipe's cppo group may add keys (hydra checks the struct only for command-line overrides, which
    the launcher renames: test_runconfig.py): the old flat name is read, over the group's default of the
    new key, with a warning naming it."""
    from cppo_megatron import cli

    recipe = tmp_path / "old.yaml"
    recipe.write_text("defaults:\n  - cppo_ppo_trainer\n  - _self_\ncppo:\n  selective_rollout: true\n")
    with pytest.warns(FutureWarning, match="cppo.selective_rollout is deprecated: write cppo.selective.enabled"):
        assert cli.main(["verl", "--cppo-dry-run", str(recipe)]) == 0
    assert "  gen_batch_size: 1\n" in capsys.readouterr().out  # prepare saw selective rollout on
