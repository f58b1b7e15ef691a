"""Every recipe composes against the pinned veRL's real hydra config: every key exists in
veRL's config with a matching type, veRL's own validate_config passes at the cluster size
the recipe declares, and the CPPO variant's allocation gives the GRPO variant's batch."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from cppo_megatron.integrations.verl.main import CONFIG_DIR
from cppo_megatron.integrations.verl.runconfig import overlay_mismatches, prepare

from .conftest import RECIPES, ROOT, compose

TOY = RECIPES / "cpu_toy.yaml"  # the override set that runs a Megatron cluster recipe on CPU at toy size
NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml")
               if not p.stem.startswith(("tiny_cpu", "worked_cpu")) and p != TOY)  # GPU clusters
MEGATRON = [n for n in NAMES if "megatron" in n]
PAIRS = sorted({re.sub(r"-(grpo|cppo)$", "", n) for n in NAMES})
CPU = ["tiny_cpu_grpo", "tiny_cpu_cppo"]  # veRL's CPU mode (test_cpu_e2e.py runs them)
CPU_ASYNC = ["tiny_cpu_cppo_separate_async"]  # V1 separate_async (test_cpu_e2e.py runs it)
CPU_DAPO = ["tiny_cpu_dapo_cppo"]  # DAPO's filter, then CPPO, V1 (test_cpu_e2e.py runs it)
CPU_SELECTIVE = ["tiny_cpu_selective_cppo"]  # selective rollout, then CPPO, V1 (test_cpu_e2e.py runs it)
# veRL's CPU mode with the Megatron engine (test_cpu_megatron_e2e.py runs them)
CPU_MEGATRON = ["tiny_cpu_megatron_grpo", "tiny_cpu_megatron_cppo"]
# the worked-arithmetic testbed (recipes/worked_cpu.yaml's task): FSDP and Megatron twins
WORKED = [("worked_cpu_grpo", "worked_cpu_cppo"), ("worked_cpu_megatron_grpo", "worked_cpu_megatron_cppo")]


def test_recipe_set_is_complete():
    assert PAIRS == ["qwen2.5-1.5b-gsm8k", "qwen2.5-14b-math-megatron", "qwen2.5-7b-math-megatron"]
    assert NAMES == sorted(f"{p}-{v}" for p in PAIRS for v in ("grpo", "cppo"))


@pytest.fixture(scope="module")
def bases(plugin):
    # the recipes' base (cppo_ppo_*) composed through its primary config (cppo_*)
    return {f"cppo_ppo_{n}": compose(CONFIG_DIR, f"cppo_{n}") for n in ("trainer", "megatron_trainer")}


@pytest.mark.parametrize("name", NAMES)
def test_recipe_composes_and_validates(name, bases, monkeypatch):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl import preflight

    monkeypatch.setenv("HOME", "/home/user")
    raw = OmegaConf.load(RECIPES / f"{name}.yaml")
    text = (RECIPES / f"{name}.yaml").read_text()
    assert re.search(r"^# Cluster: \d+ nodes? x \d+ GPUs", text, re.M), "header must state the cluster"
    base_name = raw.defaults[0]
    assert overlay_mismatches(raw, bases[base_name]) == []
    config = compose(RECIPES, name)
    nodes, gpus = map(int, re.search(r"^# Cluster: (\d+) nodes? x (\d+) GPUs", text, re.M).groups())
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (nodes, gpus)
    plan = prepare(config)
    assert (plan is not None) == name.endswith("-cppo")
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert preflight.check_config(config) == []  # the launcher's preflight passes at the cluster size
    assert config.actor_rollout_ref.rollout.n == 16
    if "megatron" in name:
        assert config.actor_rollout_ref.actor.strategy == "megatron"
        assert config.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 4
        pp = 2 if "14b" in name else 1
        assert config.actor_rollout_ref.actor.megatron.pipeline_model_parallel_size == pp


@pytest.mark.parametrize("pair", PAIRS)
def test_cppo_allocation_keeps_grpo_batch(pair, plugin):
    grpo, cppo = compose(RECIPES, f"{pair}-grpo"), compose(RECIPES, f"{pair}-cppo")
    assert prepare(grpo) is None
    plan = prepare(cppo)
    n = grpo.actor_rollout_ref.rollout.n
    assert cppo.data.train_batch_size == grpo.data.train_batch_size * 8  # 1 / (1 - 0.875)
    assert plan.kept_per_step == grpo.data.train_batch_size * n  # survivors = GRPO's batch
    assert cppo.actor_rollout_ref.actor.ppo_mini_batch_size == grpo.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cppo.cppo.pruning_rate == 0.875 and cppo.algorithm.adv_estimator == "cppo"
    env = cppo.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == "cppo_megatron.integrations.verl"


def test_overlay_check_catches_typos(bases):
    bad = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_epoch": 2, "ppo_epochs": "two"}}, "datta": {}})
    problems = overlay_mismatches(bad, bases["cppo_ppo_trainer"])
    assert any(p.startswith("actor_rollout_ref.actor.ppo_epoch:") for p in problems)
    assert any(p.startswith("actor_rollout_ref.actor.ppo_epochs:") and "'two'" in p for p in problems)
    assert any(p.startswith("datta:") for p in problems)


def test_cpu_recipes_compose_and_allocate(bases, plugin, monkeypatch):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH

    assert sorted(p.stem for p in RECIPES.glob("tiny_cpu*.yaml")) == sorted(CPU + CPU_ASYNC + CPU_DAPO + CPU_SELECTIVE + CPU_MEGATRON)
    raw = OmegaConf.load(RECIPES / "tiny_cpu_grpo.yaml")
    assert overlay_mismatches(raw, bases[raw.defaults[0]]) == []
    grpo, cppo = (compose(RECIPES, n, [SEARCHPATH]) for n in CPU)
    assert grpo.trainer.device == cppo.trainer.device == "cpu"
    assert grpo.actor_rollout_ref.rollout.name == "vllm" and cppo.algorithm.adv_estimator == "cppo"
    assert prepare(grpo) is None
    plan = prepare(cppo)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    assert plan.kept_per_step == grpo.data.train_batch_size * grpo.actor_rollout_ref.rollout.n
    validate_config(cppo, use_reference_policy=need_reference_policy(cppo), use_critic=need_critic(cppo))


def test_cpu_separate_async_recipe_composes_validates_and_allocates_per_local_update(bases, plugin):
    """tiny_cpu_cppo plus veRL's separate_async: a standalone vLLM pool, 2 local updates a step, the
    CPU checkpoint engine chosen by the CPU preparation."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.async_modes import separate_async_rule
    from cppo_megatron.integrations.verl.cpu.prepare import prepare_disaggregated_sync
    from cppo_megatron.integrations.verl.main import SEARCHPATH

    (config,) = (compose(RECIPES, n, [SEARCHPATH]) for n in CPU_ASYNC)
    assert config.trainer.v1.trainer_mode == "separate_async" and config.trainer.use_v1
    assert not config.actor_rollout_ref.hybrid_engine and config.actor_rollout_ref.rollout.name == "vllm"
    assert config.ray_kwargs.ray_init.num_gpus == config.trainer.n_gpus_per_node + config.actor_rollout_ref.rollout.n_gpus_per_node
    plan = prepare(config)
    # 16 prompts = 2 local updates x a mini-batch of 8, before allocation; 128 drawn, 64 per local update
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.actor_mini_batch) == (16, 128, 8)
    assert separate_async_rule(config) == ""
    assert prepare_disaggregated_sync(config) and config.actor_rollout_ref.rollout.checkpoint_engine.backend == "cpu"
    assert prepare_disaggregated_sync(config) == []  # said once
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def test_cpu_dapo_recipe_filters_on_the_v1_sync_loop_and_allocates(bases, plugin):
    """tiny_cpu_cppo plus veRL's group filter: V1 sync (the only loop that filters), metric reward (the
    only one CPPO accepts), the guards pass and allocation grows the batch the filter refills to."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH

    (config,) = (compose(RECIPES, n, [SEARCHPATH]) for n in CPU_DAPO)
    groups = config.algorithm.filter_groups
    assert groups.enable and groups.metric == "reward" and groups.max_inflight_gen_batches == 1
    assert config.trainer.use_v1 and config.trainer.v1.trainer_mode == "sync"
    assert config.algorithm.adv_estimator == "cppo" and config.cppo.pruning_rate == 0.875
    plan = prepare(config)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def test_cpu_selective_recipe_skips_on_the_v1_sync_loop_with_a_training_set_that_comes_back(bases, plugin):
    """tiny_cpu_cppo plus selective rollout: V1 sync (the hooked loop), the guards pass, one prompt per
    fetch after prepare, 256 training prompts (2 steps of 128 allocated prompts a pass)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH
    from cppo_megatron.integrations.verl.runconfig import check_compatible

    (config,) = (compose(RECIPES, n, [SEARCHPATH]) for n in CPU_SELECTIVE)
    assert config.cppo.selective.enabled and config.cppo.selective.p_hard == 0.5  # the defaults
    assert config.trainer.use_v1 and config.trainer.v1.trainer_mode == "sync"
    assert not config.algorithm.filter_groups.enable and config.data.train_max_samples == 256
    plan = prepare(config)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    assert config.data.gen_batch_size == 1
    check_compatible(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def test_cpu_megatron_recipes_compose_validate_and_allocate(bases, plugin, monkeypatch):
    """Actor and reference on veRL's Megatron engine, TP 2 x DP 2 on 4 ranks, mbridge."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH

    raw = OmegaConf.load(RECIPES / "tiny_cpu_megatron_grpo.yaml")
    assert raw.defaults[0] == "cppo_ppo_megatron_trainer"
    assert overlay_mismatches(raw, bases[raw.defaults[0]]) == []
    grpo, cppo = (compose(RECIPES, n, [SEARCHPATH]) for n in CPU_MEGATRON)
    for c in (grpo, cppo):
        assert c.trainer.device == "cpu" and c.actor_rollout_ref.rollout.name == "vllm"
        actor, ref = c.actor_rollout_ref.actor, c.actor_rollout_ref.ref
        assert actor.strategy == ref.strategy == "megatron"
        assert actor.megatron.tensor_model_parallel_size == ref.megatron.tensor_model_parallel_size == 2
        assert actor.megatron.pipeline_model_parallel_size == 1 and c.trainer.n_gpus_per_node == 4  # DP 2
        assert actor.megatron.vanilla_mbridge and ref.megatron.vanilla_mbridge
        assert actor.megatron.use_distributed_optimizer  # veRL's weight sync reads its param buffer
        assert c.cppo_cpu.vocab_multiple % 2 == 0  # the vocabulary splits over TP 2
    assert cppo.algorithm.adv_estimator == "cppo" and cppo.cppo.pruning_rate == 0.875
    assert prepare(grpo) is None
    plan = prepare(cppo)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    validate_config(cppo, use_reference_policy=need_reference_policy(cppo), use_critic=need_critic(cppo))


@pytest.mark.parametrize("grpo_name, cppo_name", WORKED)
def test_worked_recipes_compose_validate_and_allocate(grpo_name, cppo_name, bases, plugin):
    """The worked-arithmetic twins: the engine of the tiny_cpu recipe they build on, the task's
    lengths within the start model's 128 positions, GRPO vs CPPO P = 0.875 with allocation."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH
    from cppo_megatron.trainer.config import load_recipe

    # (worked_cpu_early_stop.yaml, CPPO with early stopping, has its own test below)
    assert sorted(p.stem for p in RECIPES.glob("worked_cpu*.yaml") if p.stem != "worked_cpu_early_stop") == sorted(
        n for pair in WORKED for n in pair)
    grpo, cppo = (compose(RECIPES, n, [SEARCHPATH]) for n in (grpo_name, cppo_name))
    embedded = load_recipe(ROOT / "recipes" / "worked_cpu.yaml")
    megatron = "megatron" in grpo_name
    for c in (grpo, cppo):
        assert c.trainer.device == "cpu" and c.actor_rollout_ref.rollout.name == "vllm"
        assert c.cppo_cpu.warmup_recipe == "worked_cpu.yaml" and list(c.cppo_cpu.warmup_overrides) == []
        assert c.data.max_response_length == embedded.rollout.max_new_tokens == 96
        assert c.actor_rollout_ref.actor.optim.lr == embedded.train.lr == 1e-4
        assert c.data.max_prompt_length + c.data.max_response_length <= embedded.model.max_position
        assert c.actor_rollout_ref.actor.strategy == ("megatron" if megatron else "fsdp2")
        assert c.cppo_cpu.model_dir.endswith("model_vocab8" if megatron else "verl_worked/model")
    assert grpo.algorithm.adv_estimator == "grpo" and cppo.algorithm.adv_estimator == "cppo"
    assert prepare(grpo) is None
    plan = prepare(cppo)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    validate_config(cppo, use_reference_policy=need_reference_policy(cppo), use_critic=need_critic(cppo))

def test_worked_early_stop_recipe_composes_and_selects_the_agent_loop(bases, plugin):
    """worked_cpu_early_stop.yaml: worked_cpu_cppo.yaml on V1 with cppo.early_stop; prepare selects the
    cppo_early_stop agent loop and the rollout log-probs, allocates as CPPO does, veRL validates it."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.main import SEARCHPATH

    c = compose(RECIPES, "worked_cpu_early_stop", [SEARCHPATH])
    assert c.cppo.early_stop.enabled and c.trainer.use_v1 and c.algorithm.adv_estimator == "cppo"
    assert c.actor_rollout_ref.rollout.engine_kwargs.vllm.block_size == 32
    plan = prepare(c)
    assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (16, 128, 256)
    assert c.actor_rollout_ref.rollout.agent.default_agent_loop == "cppo_early_stop"
    assert c.actor_rollout_ref.rollout.calculate_log_probs is True
    validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))


@pytest.mark.parametrize("name", MEGATRON)
def test_cpu_toy_override_set_applies_to_every_megatron_cluster_recipe(name, bases, plugin):
    """recipes/verl/cpu_toy.yaml over each Megatron cluster recipe (as `cppo-megatron verl RECIPE
    --cpu recipes/verl/cpu_toy.yaml` composes it): the file's keys are veRL's (or the CPU group's)
    and take its values, every other key of the recipe keeps the recipe's value, the layout fits
    the CPU run (4 ranks, the tiny model) and veRL's own validation passes."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from cppo_megatron.integrations.verl.diagnostics.keyreport import recipe_leaves
    from cppo_megatron.integrations.verl.main import recipe_args
    from cppo_megatron.integrations.verl.overrides import SKIP, file_overrides, flatten
    from cppo_megatron.trainer.config import load_recipe

    toy_raw = OmegaConf.load(TOY)
    for k in SKIP:
        toy_raw.pop(k, None)
    toy = dict(flatten(OmegaConf.to_container(toy_raw)))
    assert overlay_mismatches(toy_raw, bases["cppo_ppo_megatron_trainer"]) == []  # no typo, veRL's types
    args = recipe_args([str(RECIPES / f"{name}.yaml")], file_overrides(TOY))
    config = compose(RECIPES, name, [a for a in args if not a.startswith("--")])
    tree = OmegaConf.to_container(config, resolve=False)

    def at(key):
        node = tree
        for part in key.split("."):
            node = node[part]
        return node

    for key, value in toy.items():
        assert at(key) == value, key
    kept = [(k, v) for k, v in recipe_leaves(RECIPES / f"{name}.yaml") if k not in toy]
    assert len(kept) >= 20
    for key, value in kept:
        assert at(key) == value, key  # the recipe's own value reaches veRL's config
    # the CPU run: 4 worker ranks on 1 node, actor and reference laid out alike (veRL builds the
    # reference's engine first and its sizes set the process's model-parallel state)
    actor, ref, rollout = (config.actor_rollout_ref[r] for r in ("actor", "ref", "rollout"))
    tp, pp = actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size
    assert (ref.megatron.tensor_model_parallel_size, ref.megatron.pipeline_model_parallel_size) == (tp, pp)
    world = config.trainer.n_gpus_per_node * config.trainer.nnodes
    assert world == 4 and world % (tp * pp) == 0 and config.ray_kwargs.ray_init.num_gpus == world
    assert pp == (2 if "14b" in name else 1)  # the recipe's pipeline size runs as written
    assert rollout.tensor_model_parallel_size == world  # one vLLM replica (TP 4) over the ranks
    model = load_recipe(ROOT / "recipes" / config.cppo_cpu.warmup_recipe).model
    assert model.num_heads % tp == 0 and model.num_kv_heads % tp == 0 and model.num_layers % pp == 0
    assert config.cppo_cpu.vocab_multiple % tp == 0
    assert config.data.max_prompt_length + config.data.max_response_length <= model.max_position
    assert config.trainer.device == "cpu" and rollout.name == "vllm" and actor.megatron.vanilla_mbridge
    assert ref.megatron.vanilla_mbridge  # inherited from the actor's
    plan = prepare(config)
    if name.endswith("-cppo"):
        assert (plan.train_batch_size_before, plan.train_batch_size, plan.kept_per_step) == (4, 32, 64)
    else:
        assert plan is None
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
