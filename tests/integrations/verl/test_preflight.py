"""Preflight of host configs in ``cppo-megatron verl``: each check fed its bad value, through the
real launcher (hydra composition, allocation, then the check), in-process: one line on stderr
naming the key and the fix, exit status 2, before Ray or any worker starts. The launch itself
(``main.launch``: the vLLM re-exec, the CPU mode's start model, veRL's main_ppo) is stubbed to fail
the test: a check that let a bad config through cannot start anything (tests/launch_guard.py)."""

from __future__ import annotations

import json

import pytest

from ...launch_guard import forbid
from .conftest import RECIPES, compose

pytestmark = pytest.mark.verl


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    return forbid(monkeypatch, "verl")

MEGATRON = RECIPES / "tiny_cpu_megatron_cppo.yaml"
FSDP = RECIPES / "tiny_cpu_cppo.yaml"
TOY = RECIPES / "cpu_toy.yaml"
CLUSTER_14B = RECIPES / "qwen2.5-14b-math-megatron-cppo.yaml"
# the FSDP recipe on 4 logical GPUs with a KL term (so a reference pass) and micro-batches of 128 rows
FSDP_4 = ("trainer.n_gpus_per_node=4", "ray_kwargs.ray_init.num_gpus=4", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A model directory with only a config.json (heads 4, KV heads 2, 4 layers, 24 rows, 32 positions):
    what the preflight reads; no weights needed because no run starts."""
    d = tmp_path_factory.mktemp("cfgonly")
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "vocab_size": 24, "max_position_embeddings": 32, "hidden_size": 128}))
    return d


def launch(capsys, recipe, *overrides):
    """``cppo-megatron verl RECIPE overrides``: (exit status, stderr lines)."""
    from cppo_megatron import cli

    rc = cli.main(["verl", str(recipe), *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


CASES = {
    # the example: a 2-step run of the Megatron recipe (lr_warmup_steps 5)
    "lr_warmup": ((MEGATRON, "trainer.total_training_steps=2"),
                  ["actor_rollout_ref.actor.optim.lr_warmup_steps=5", "trainer.total_training_steps=2",
                   "optimizer_param_scheduler.py:157", "lr_warmup_steps=1 (or fewer)"]),
    # megatron-core asserts warm-up < decay: equal steps fail too
    "lr_equal": ((MEGATRON, "trainer.total_training_steps=5"),
                 ["lr_warmup_steps=5 is not below", "trainer.total_training_steps=5", "lr_warmup_steps=4 (or fewer)"]),
    "lr_decay_key": ((MEGATRON, "actor_rollout_ref.actor.optim.lr_decay_steps=3"),
                     ["lr_warmup_steps=5", "actor_rollout_ref.actor.optim.lr_decay_steps=3", "lr_warmup_steps=2"]),
    "micro_batch_update": ((MEGATRON, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"),
                           ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "128 rows",
                            "2 data-parallel ranks", "ppo_micro_batch_size_per_gpu=1"]),
    "micro_batch_logprob": ((MEGATRON, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=96",
                             "actor_rollout_ref.actor.use_kl_loss=true"),  # a KL term: the reference pass runs
                            ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=96", "128 rows",
                             "log_prob_micro_batch_size_per_gpu=32"]),
    # the reference's own FSDP layout: SP 1 (set) beside the actor's SP 2, so 4 DP ranks of 64 rows, not 2 of 128
    "micro_batch_ref_layout": ((FSDP, *FSDP_4, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
                                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128"),
                               ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128 does not divide the 64 rows "
                                "each of the 4 data-parallel ranks of the ref (FSDP, 4 ranks / Ulysses SP 1)",
                                "log_prob_micro_batch_size_per_gpu=64 (a divisor of 64)"]),
    # a Megatron reference on another TP than the actor's: one megatron-core parallel state per worker process
    "megatron_ref_layout": ((MEGATRON, "actor_rollout_ref.actor.use_kl_loss=true",
                             "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"),
                            ["actor_rollout_ref.ref.megatron TP x PP x CP = 1 x 1 x 1 differs from "
                             "actor_rollout_ref.actor.megatron 2 x 1 x 1", "initialized once, by the ref",
                             "remove the actor_rollout_ref.ref.megatron parallel sizes"]),
    "layout_world": ((MEGATRON, "trainer.n_gpus_per_node=3"),
                     ["1 x 3 = 3 ranks", "TP 2 x PP 1 x CP 1 = 2", "trainer.n_gpus_per_node"]),
    "layout_rollout_tp": ((FSDP, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
                          ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "does not divide the 1 ranks"]),
    "layout_ray_gpus": ((CLUSTER_14B, "--cpu", str(TOY), "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                         "ray_kwargs.ray_init.num_gpus=2"),
                        ["ray_kwargs.ray_init.num_gpus=2 logical GPUs", "= 4", "ray_kwargs.ray_init.num_gpus=4",
                         "ray_kwargs.ray_init.address"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_check_stops_the_launcher_with_one_line(case, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be built: the check comes before the start model
    args, wanted = CASES[case]
    rc, err = launch(capsys, *args)
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("cppo-megatron verl: error: preflight: "), err
    for text in wanted:
        assert text in err[0], (text, err[0])
    assert not (tmp_path / "runs").exists()  # stopped before the CPU mode built anything


MODEL_CASES = {
    "tp_heads": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=8", "trainer.n_gpus_per_node=8",
                  "ray_kwargs.ray_init.num_gpus=8"],
                 ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8", "4 attention heads"]),
    "tp_kv_heads": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4"],
                    ["tensor_model_parallel_size=4", "2 KV heads"]),
    "tp_vocab": (["+cfg.vocab_size=25"], ["vocabulary of 25 rows", "tensor_parallel/utils.py:118",
                                          "cppo_cpu.vocab_multiple"]),
    "pp_layers": (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3", "trainer.n_gpus_per_node=6",
                   "ray_kwargs.ray_init.num_gpus=6", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256"],
                  ["pipeline_model_parallel_size=3", "4 layers", "divides 4"]),
    "positions": (["data.max_response_length=30"],
                  ["data.max_prompt_length + data.max_response_length = 8 + 30 = 38", "max_position_embeddings=32",
                   "data.max_response_length to 24"]),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_check_stops_the_launcher_with_one_line(case, capsys, monkeypatch, tmp_path, local_model):
    monkeypatch.chdir(tmp_path)
    overrides, wanted = MODEL_CASES[case]
    model = local_model
    if any(o.startswith("+cfg.vocab_size=") for o in overrides):  # a model whose vocabulary TP 2 cannot split
        model = tmp_path / "model25"
        model.mkdir()
        cfg = json.loads((local_model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": 25}))
        overrides = [o for o in overrides if not o.startswith("+cfg.")]
    rc, err = launch(capsys, MEGATRON, f"cppo_cpu.model_dir={model}", *overrides)
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("cppo-megatron verl: error: preflight: "), err
    for text in wanted:
        assert text in err[0], (text, err[0])


def test_the_toy_set_passes_the_preflight_on_one_and_two_nodes(plugin):
    """The 14B cluster recipe under the toy set passes on 1 node x 4 and on 2 nodes x 2 with a cluster
    address (the recipes as shipped: test_recipes.py runs the preflight over each)."""
    from cppo_megatron.integrations.verl import preflight
    from cppo_megatron.integrations.verl.main import recipe_args
    from cppo_megatron.integrations.verl.overrides import file_overrides
    from cppo_megatron.integrations.verl.runconfig import prepare

    toy = [a for a in recipe_args([str(CLUSTER_14B)], file_overrides(str(TOY))) if not a.startswith("--")]
    for extra in ([], ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "+ray_kwargs.ray_init.address=127.0.0.1:1"]):
        config = compose(RECIPES, CLUSTER_14B.stem, [*toy, *extra])
        prepare(config)
        assert preflight.check_config(config) == [], extra


ACCEPTED = {
    # veRL's reference follows the actor's top-level SP but not its fsdp_config one: actor 2 ranks of 128 rows,
    # reference 4 of 64 (a single DP size for both refused the rollout's 128 against 4 x 64)
    "fsdp_ref_own_layout": (FSDP, [*FSDP_4, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64"], (2, 4)),
    # no KL term: veRL builds no reference, so neither its micro-batch nor its Megatron layout matters
    "megatron_no_reference": (MEGATRON, ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=96",
                                         "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"], (2, 4)),
    # LoRA: the reference log-probs run on the actor's engine, with the actor's micro-batch
    "lora_ref_in_actor": (FSDP, [*FSDP_4, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                                 "actor_rollout_ref.model.lora.rank=8",
                                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=96"], (2, 2)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_layouts_veRL_runs_pass_with_each_roles_own_dp_share(case, plugin):
    """(actor, reference) DP sizes as veRL's engines derive them (layout.py), and no preflight problem."""
    from cppo_megatron.integrations.verl import preflight
    from cppo_megatron.integrations.verl.layout import dp_size
    from cppo_megatron.integrations.verl.main import SEARCHPATH
    from cppo_megatron.integrations.verl.runconfig import prepare

    recipe, overrides, dps = ACCEPTED[case]
    config = compose(RECIPES, recipe.stem, [SEARCHPATH, *overrides])
    prepare(config)
    assert (dp_size(config, "actor"), dp_size(config, "ref")) == dps
    assert preflight.check_config(config) == []


def test_model_config_never_downloads(plugin):
    from cppo_megatron.integrations.verl import preflight

    config = compose(RECIPES, "qwen2.5-7b-math-megatron-cppo")
    hf, why = preflight.model_config(config)
    assert hf is None and "not a local model directory" in why  # Qwen/Qwen2.5-7B-Instruct: a hub name
    assert preflight.check_model(config) == []


def test_micro_batch_checks_name_a_layout_that_cannot_split(plugin):
    """A Ulysses SP that does not divide the world, rows that do not split over the DP ranks, and an
    unset micro-batch (dynamic sizes or veRL's default: nothing to check) by value."""
    from cppo_megatron.integrations.verl import layout, preflight
    from cppo_megatron.integrations.verl.main import SEARCHPATH
    from cppo_megatron.integrations.verl.runconfig import prepare

    def problems(*overrides):
        config = compose(RECIPES, FSDP.stem, [SEARCHPATH, *overrides])
        prepare(config)
        return preflight.check_config(config)

    assert problems(*FSDP_4, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3") == [
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3 does not divide the 4 GPUs "
        "(trainer.n_gpus_per_node x trainer.nnodes) of actor_rollout_ref.actor; pick parallel sizes whose product "
        "divides the world"]
    assert problems("trainer.n_gpus_per_node=3", "ray_kwargs.ray_init.num_gpus=3") == [
        "256 rows per mini-batch (ppo_mini_batch_size x n) do not split over the 3 data-parallel ranks of the actor "
        "(FSDP, 3 ranks / Ulysses SP 1): make actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n a multiple of 3"]
    assert problems(*FSDP_4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null") == []
    config = compose(RECIPES, FSDP.stem, [SEARCHPATH, "actor_rollout_ref.model.lora.rank=x"])
    assert layout._int(config, "actor_rollout_ref.model.lora.rank", 0) == 0 and not layout.ref_in_actor(config)
