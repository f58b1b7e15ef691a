"""Config in one place: each recipe field's help, choices and range live in its dataclass
metadata; validation, --help-recipe and docs/trainer.md all follow from it."""

import dataclasses
import re
from pathlib import Path

import pytest

from cppo_megatron.cli import main
from cppo_megatron.config import CPPOConfig
from cppo_megatron.core import KL_KINDS, LOSS_AGG_MODES, METRICS, SCOPES
from cppo_megatron.trainer.config import RECIPE_KEYS, RecipeError, load_recipe, recipe_fields, recipe_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def _documented_keys() -> list[str]:
    text = DOC.read_text()
    section = text.split("\n## Recipe keys\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def test_docs_list_every_recipe_key_and_no_other():
    documented = _documented_keys()
    assert len(documented) == len(set(documented)), "a key is listed twice"
    missing = sorted(set(RECIPE_KEYS) - set(documented))
    unknown = sorted(set(documented) - set(RECIPE_KEYS))
    assert not missing and not unknown, (
        f"docs/trainer.md 'Recipe keys' misses {missing} and lists keys that do not exist {unknown}; "
        "regenerate the tables with recipe_markdown()")
    assert "cppo.pruning_rate" in RECIPE_KEYS and "task.arithmetic.ops" in RECIPE_KEYS  # nested sections flatten


def test_every_field_has_help_and_the_docs_table_is_generated_from_it():
    fields = dict(recipe_fields())
    assert all(f.metadata.get("help") for f in fields.values()), [k for k, f in fields.items() if not f.metadata.get("help")]
    doc = DOC.read_text()
    # every generated row appears verbatim: the table shows the code's help text
    stale = [row for row in recipe_markdown().splitlines() if row.startswith("| `") and row not in doc]
    assert not stale, f"docs/trainer.md rows differ from recipe_markdown(): {stale[:3]}"


def test_choice_lists_are_the_core_tuples():
    fields = dict(recipe_fields())
    assert fields["train.kl_type"].metadata["choices"] is KL_KINDS
    assert fields["train.loss_agg"].metadata["choices"] is LOSS_AGG_MODES
    assert fields["cppo.metric"].metadata["choices"] is METRICS
    assert fields["cppo.scope"].metadata["choices"] is SCOPES


@pytest.mark.parametrize("override, message", [
    ("train.kl_type=k9", "recipe key train.kl_type must be one of ['k1', 'k2', 'k3', 'low_var_kl'], got 'k9'"),
    ("rollout.top_p=0", "recipe key rollout.top_p must be in (0, 1], got 0.0"),
    ("train.mu=0", "recipe key train.mu must be > 0, got 0"),
    ("eval.every=-1", "recipe key eval.every must be >= 0, got -1"),
    ("cppo.scope=rank", "recipe key cppo: CPPOConfig.scope must be one of ['group', 'batch'], got 'rank'"),
])
def test_validation_reads_the_field_metadata(override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, [override])
    assert str(err.value) == message


def test_help_recipe_prints_every_key_and_exits(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-recipe"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\S+) = ", out, flags=re.M)
    assert listed == list(RECIPE_KEYS)
    assert "  train.kl_type = 'k3'  [k1|k2|k3|low_var_kl]\n      KL estimator\n" in out
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-recipe", "cppo"])
    listed = re.findall(r"^  (\S+) = ", capsys.readouterr().out, flags=re.M)
    # every CPPO field, a nested section's (cppo.early_stop) by its leaf keys
    assert listed == [k for k in RECIPE_KEYS if k.startswith("cppo.")]
    assert [k.split(".")[1] for k in listed if k.count(".") == 1] + ["early_stop"] == [
        f.name for f in dataclasses.fields(CPPOConfig)]
    with pytest.raises(SystemExit) as done:
        main(["train", "--help-recipe", "cpo"])
    assert done.value.code == 2
    assert capsys.readouterr().err.startswith("cppo-megatron train: --help-recipe cpo: no recipe key starts with 'cpo'")
