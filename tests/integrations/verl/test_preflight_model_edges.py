"""verl.preflight.check_model where test_preflight.py does not reach: a model config without
max_position_embeddings (no length check), a rollout TP that is not a number (read as the default,
1: nothing to divide) and a rollout TP that does not divide the heads."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from cppo_megatron.integrations.verl import preflight


def test_check_model_without_positions_and_with_an_unreadable_tp(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "vocab_size": 101, "num_hidden_layers": 2}))
    OmegaConf.update(config, "actor_rollout_ref.model.path", str(tmp_path), force_add=True)
    OmegaConf.update(config, "data.max_response_length", 10**9, force_add=True)  # no positions: not checked
    OmegaConf.update(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", "two", force_add=True)
    assert preflight._int(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1) == 1
    assert preflight.check_model(config) == []
    OmegaConf.update(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 3)
    assert preflight.check_model(config) == [
        f"actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide the model's 4 attention heads "
        f"({tmp_path / 'config.json'}): use a TP that divides 4"]
