"""Every key docs/trainer.md documents for summary.json is in the file a real run writes."""

import json
from pathlib import Path

from cppo_megatron.trainer import Trainer
from tests.doc_keys import documented_keys, missing_keys


def test_summary_json_has_every_documented_key(micro_recipe):
    recipe = micro_recipe("train.steps=1")
    Trainer(recipe).run()
    data = json.loads((Path(recipe.out_dir) / "summary.json").read_text())
    assert "step_seconds" in documented_keys("summary.json")["top level"]
    assert missing_keys(data, "summary.json") == []
    assert data["step_seconds"] > 0 and data["steps"] == 1
