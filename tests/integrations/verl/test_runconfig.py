"""The cppo group, allocation helper and compatibility checks on the real composed config."""

from __future__ import annotations


import pytest
import torch
from omegaconf import OmegaConf, open_dict

from cppo_megatron.config import CONFIG_KEYS, CPPOConfig, flatten_keys
from cppo_megatron.integrations.verl.hook import _check_single_output_sessions, decide
from cppo_megatron.integrations.verl.runconfig import apply_allocation, check_compatible, cppo_config_from, prepare

from .conftest import compose


def test_yaml_group_matches_cppo_config_defaults(plugin):
    from cppo_megatron.integrations.verl.main import CONFIG_DIR

    node = OmegaConf.load(f"{CONFIG_DIR}/cppo_ppo_trainer.yaml").cppo
    mega = OmegaConf.load(f"{CONFIG_DIR}/cppo_ppo_megatron_trainer.yaml").cppo
    assert node == mega
    defaults = flatten_keys(CPPOConfig().to_dict())  # every key, the selective section's dotted
    group = flatten_keys(OmegaConf.to_container(node))
    assert list(group) == list(defaults) == [*CONFIG_KEYS]
    # None means the default rate; veRL splits batches into equal per-rank parts
    host = {"pruning_rate": 0.875, "equal_size": True}
    for key, value in defaults.items():
        assert group[key] == host.get(key, value), key


def test_allocation_grows_prompts(config):
    plan = apply_allocation(config)  # G = 8, P = 0.75 -> k = 2, x4
    assert (plan.keep, plan.train_batch_size_before, plan.train_batch_size) == (2, 4, 16)
    assert config.data.train_batch_size == 16 and plan.kept_per_step == 32
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 1


def test_no_allocation_shrinks_mini_batches(config):
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    plan = apply_allocation(config)
    assert config.data.train_batch_size == 4
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 1  # 4 x 2/8: mini-batch follows kept
    assert plan.kept_per_step == 8


def test_no_allocation_shrinks_micro_batches_that_no_longer_divide(config):
    # 4 prompts x G=8 keep 2 -> 8 sequences per step, mini-batch 1 prompt x 8 = 8 sequences (1 GPU):
    # a micro-batch of 32 (sized for the unpruned 32 rows) would fail veRL's divisibility assert
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
        config.trainer.n_gpus_per_node = 1
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 32
        config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4
        config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = 12
    plan = apply_allocation(config)
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8
    assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4  # divides 8: kept
    assert config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert plan.micro_batches == (("actor.ppo_micro_batch_size_per_gpu", 32, 8),
                                  ("ref.log_prob_micro_batch_size_per_gpu", 12, 4))
    assert "actor.ppo_micro_batch_size_per_gpu 32 -> 8" in plan.describe()


@pytest.fixture(scope="module")
def megatron_config(plugin):
    """cppo_megatron_trainer (veRL's Megatron engine) at TP 2 x DP 2 on 4 GPUs, G = 2, P = 0.5
    without allocation: 18 prompts keep 18 completions, 9 per DP rank (odd, so a share taken over
    the 4 GPUs instead of the 2 DP ranks divides differently)."""
    from cppo_megatron.integrations.verl.main import CONFIG_DIR

    return compose(CONFIG_DIR, "cppo_megatron_trainer", [
        "actor_rollout_ref.rollout.n=2", "cppo.pruning_rate=0.5", "cppo.allocation=false",
        "data.train_batch_size=18", "actor_rollout_ref.actor.ppo_mini_batch_size=18",
        "trainer.n_gpus_per_node=4", "trainer.nnodes=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=9",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=6",
    ])


def test_no_allocation_sizes_micro_batches_by_the_dp_share_under_tp(megatron_config):
    import copy

    from cppo_megatron.integrations.verl.layout import dp_size

    config = copy.deepcopy(megatron_config)
    assert (dp_size(config, "actor"), dp_size(config, "ref")) == (2, 2)  # 4 GPUs / TP 2 (the ref follows the actor)
    plan = apply_allocation(config)
    assert (plan.kept_per_step, plan.actor_mini_batch) == (18, 9)  # 18 sequences, 9 per DP rank
    actor, rollout, ref = (config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.actor_rollout_ref.ref)
    # 3 and 9 divide a DP rank's 9 rows: kept (over the world, 18 // 4 = 4 rows, they became 1 and 1);
    # 6 does not: gcd(6, 9) = 3 (over the world it became 2, which veRL's assertion refuses for 9 rows)
    assert (actor.ppo_micro_batch_size_per_gpu, rollout.log_prob_micro_batch_size_per_gpu,
            ref.log_prob_micro_batch_size_per_gpu) == (3, 9, 3)
    assert plan.micro_batches == (("ref.log_prob_micro_batch_size_per_gpu", 6, 3),)


def _with(config, **keys):
    import copy

    out = copy.deepcopy(config)
    for key, value in keys.items():
        OmegaConf.update(out, key.replace("__", "."), value, force_add=True, merge=False)
    return out


def test_dp_size_pp_cp_and_ulysses(megatron_config, config):
    from cppo_megatron.integrations.verl.layout import describe_dp, dp_size

    mega = _with(megatron_config, trainer__n_gpus_per_node=8, trainer__nnodes=2,
                 actor_rollout_ref__actor__megatron__pipeline_model_parallel_size=2,
                 actor_rollout_ref__actor__megatron__context_parallel_size=2,
                 actor_rollout_ref__ref__megatron__tensor_model_parallel_size=4)  # the ref's own: TP 4 x PP 2 x CP 2
    # no KL term: veRL builds no reference engine, so the actor's layout is its own
    assert dp_size(mega, "actor") == 2 and dp_size(mega, "ref") == 1  # 16 / (2 x 2 x 2); 16 / (4 x 2 x 2)
    assert describe_dp(mega, "actor") == "Megatron, 16 ranks / TP 2 x PP 2 x CP 2"
    fsdp = _with(config, trainer__n_gpus_per_node=4, actor_rollout_ref__actor__ulysses_sequence_parallel_size=2)
    assert dp_size(fsdp, "actor") == 2 and describe_dp(fsdp, "actor") == "FSDP, 4 ranks / Ulysses SP 2"
    assert dp_size(_with(mega, actor_rollout_ref__actor__megatron__dynamic_context_parallel=True), "actor") == 1
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 x actor_rollout_ref.actor.megatron."
                                         "pipeline_model_parallel_size=2"):
        dp_size(_with(mega, actor_rollout_ref__actor__megatron__tensor_model_parallel_size=3), "actor")
    with pytest.raises(ValueError, match="fsdp_config.ulysses_sequence_parallel_size=3 does not divide the 4 GPUs"):
        dp_size(_with(config, trainer__n_gpus_per_node=4,
                      actor_rollout_ref__ref__fsdp_config__ulysses_sequence_parallel_size=3), "ref")
    # the deprecated top-level key, when above 1, replaces the fsdp_config one (workers/config/actor.py:328)
    assert dp_size(_with(fsdp, actor_rollout_ref__ref__fsdp_config__ulysses_sequence_parallel_size=3), "ref") == 2
    with pytest.raises(ValueError, match="role must be one of \\('actor', 'ref'\\), got 'critic'"):
        dp_size(fsdp, "critic")


def test_dp_size_follows_the_engine_each_role_runs_on(megatron_config, config):
    """The actor's and the reference's DP share as veRL 0.9.1 builds their engines (layout.py): FSDP per
    engine (the reference follows the actor's top-level SP, not its fsdp_config one), LoRA's reference on
    the actor's engine, and Megatron's one parallel state per process, first initialized by the reference
    (the fused worker) or by the actor (separate_async without the hybrid engine)."""
    from cppo_megatron.integrations.verl.layout import describe_dp, dp_size, megatron_layout_problem

    kl = {"actor_rollout_ref__actor__use_kl_loss": True}
    fsdp = _with(config, trainer__n_gpus_per_node=4, **kl)
    assert (dp_size(fsdp, "actor"), dp_size(fsdp, "ref")) == (4, 4)
    own = _with(fsdp, actor_rollout_ref__actor__fsdp_config__ulysses_sequence_parallel_size=2)
    assert (dp_size(own, "actor"), dp_size(own, "ref")) == (2, 4)
    top = _with(fsdp, actor_rollout_ref__actor__ulysses_sequence_parallel_size=2)
    assert (dp_size(top, "actor"), dp_size(top, "ref")) == (2, 2)  # ref/dp_ref.yaml follows this key
    ref_sp = _with(fsdp, actor_rollout_ref__ref__fsdp_config__ulysses_sequence_parallel_size=4)
    assert (dp_size(ref_sp, "actor"), dp_size(ref_sp, "ref")) == (4, 1)
    lora = _with(ref_sp, actor_rollout_ref__model__lora__rank=8)
    assert (dp_size(lora, "actor"), dp_size(lora, "ref")) == (4, 4)  # the reference is the actor's engine
    assert describe_dp(lora, "ref") == "FSDP, 4 ranks / Ulysses SP 1, the actor's engine"
    assert dp_size(_with(ref_sp, actor_rollout_ref__model__lora_adapter_path="/a"), "ref") == 4
    assert dp_size(_with(ref_sp, actor_rollout_ref__model__lora_rank=4), "ref") == 4
    # Megatron: actor TP 2 and reference TP 4 on 4 GPUs with a KL term share one parallel state: the ref's
    mega = _with(megatron_config, actor_rollout_ref__ref__megatron__tensor_model_parallel_size=4, **kl)
    assert (dp_size(mega, "actor"), dp_size(mega, "ref")) == (1, 1)
    assert describe_dp(mega, "actor") == "Megatron, 4 ranks / TP 4 x PP 1 x CP 1, the ref's engine"
    assert "TP x PP x CP = 4 x 1 x 1 differs from actor_rollout_ref.actor.megatron 2 x 1 x 1" in \
        megatron_layout_problem(mega) and "by the ref (built first" in megatron_layout_problem(mega)
    split = _with(mega, trainer__v1__trainer_mode="separate_async", actor_rollout_ref__hybrid_engine=False)
    assert (dp_size(split, "actor"), dp_size(split, "ref")) == (2, 2) and "by the actor" in megatron_layout_problem(split)
    assert megatron_layout_problem(_with(mega, actor_rollout_ref__ref__megatron__tensor_model_parallel_size=2)) is None
    assert megatron_layout_problem(_with(mega, actor_rollout_ref__actor__use_kl_loss=False)) is None  # no reference
    mixed = _with(mega, actor_rollout_ref__ref__strategy="fsdp")  # an FSDP reference keeps its own mesh
    assert (dp_size(mixed, "actor"), dp_size(mixed, "ref")) == (2, 4) and megatron_layout_problem(mixed) is None
    other = _with(fsdp, actor_rollout_ref__actor__strategy="veomni")
    assert dp_size(other, "actor") == 4 and describe_dp(other, "actor") == "veomni, 4 ranks"


def test_allocation_errors_name_the_value(config):
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 3
    with pytest.raises(ValueError, match="ppo_mini_batch_size=3"):
        apply_allocation(config)
    with open_dict(config):
        config.cppo.typo = 1
    with pytest.raises(ValueError, match="cppo.typo is not a CPPO setting"):
        cppo_config_from(config)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("algorithm.use_kl_in_reward", True, "use_kl_in_reward"),
        ("algorithm.norm_adv_by_std_in_grpo", False, "cppo.adv_norm=none"),
        ("cppo.metric", "importance", "metric=importance is not supported under veRL"),
        ("trainer.v1.separate_async.parameter_sync_step", 2,
         r"separate_async: data.train_batch_size=4 must equal .*parameter_sync_step=2 x actor.ppo_mini_batch_size=1 "
         r".*set data.train_batch_size=2"),
    ],
)
def test_incompatible_settings(config, key, value, match):
    if key.startswith("trainer.v1.separate_async"):
        OmegaConf.update(config, "trainer.v1.trainer_mode", "separate_async")
    OmegaConf.update(config, key, value, force_add=True)
    with pytest.raises(ValueError, match=match):
        check_compatible(config)


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_the_v1_modes_and_the_legacy_loop_pass(config, mode):  # separate_async: 4 prompts = 4 syncs x 1
    OmegaConf.update(config, "trainer.v1.trainer_mode", mode)
    check_compatible(config)
    with open_dict(config):  # the legacy loop has no trainer modes
        config.trainer.use_v1 = False
        config.trainer.v1.trainer_mode = "separate_async"
    check_compatible(config)


def test_keep_mass_is_refused(config):
    with open_dict(config):
        config.cppo.pruning_rate = None
        config.cppo.keep_mass = 0.9
    with pytest.raises(ValueError, match="keep_mass=0.9 is not supported under veRL"):
        check_compatible(config)


def test_legacy_loop_needs_balance_batch(config):
    with open_dict(config):
        config.trainer.use_v1 = False
        config.trainer.balance_batch = False
    with pytest.raises(ValueError, match="balance_batch"):
        prepare(config)


def test_grpo_run_is_left_alone(config):
    with open_dict(config):
        config.algorithm.adv_estimator = "grpo"
    assert prepare(config) is None and config.data.train_batch_size == 4


def test_decide_is_deterministic_and_order_independent_of_names():
    rewards = torch.tensor([1.0, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0, 1, 1, 1])
    uids = ["b"] * 4 + ["a"] * 4 + ["c"] * 4
    cfg = CPPOConfig(pruning_rate=0.5)
    r1, rec1 = decide(uids, rewards, cfg, step=3)
    r2, rec2 = decide(uids, rewards, cfg, step=3)
    assert torch.equal(r1.selection.kept, r2.selection.kept) and rec1 == rec2
    assert rec1["b"].mean == pytest.approx(0.5) and rec1["b"].size == 4 and rec1["b"].kept == 2
    assert rec1["a"].std == 0.0  # zero-variance group: still k kept in group scope
    assert set(rec1) == {"a", "b", "c"}
    batch_scope, rec = decide(uids, rewards, CPPOConfig(pruning_rate=0.5, scope="batch"), step=3)
    assert "a" not in rec  # all-zero-advantage group vanishes in batch scope: no record needed
    assert batch_scope.selection.num_kept == 6


def test_multi_output_sessions_rejected():
    _check_single_output_sessions(["u1_0_0", "u1_1_0", "u2_0_0"])
    with pytest.raises(ValueError, match="two outputs of one agent session"):
        _check_single_output_sessions(["u1_0_0", "u1_0_1"])


def test_settings_veRL_cannot_honour_are_refused(config):
    """cppo.dynamic_sampling and cppo.equal_size=false were accepted and ignored; now refused."""
    with open_dict(config):
        config.cppo.dynamic_sampling = True
    with pytest.raises(ValueError, match=r"^cppo.dynamic_sampling=true is not supported under veRL: .* set "
                                         r"cppo.dynamic_sampling=false"):
        prepare(config)
    with open_dict(config):
        config.cppo.dynamic_sampling = False
        config.cppo.equal_size = False
    with pytest.raises(ValueError, match=r"^cppo.equal_size=false cannot be honoured under veRL: .* set "
                                         r"cppo.equal_size=true$"):
        prepare(config)
    with open_dict(config):
        config.cppo.equal_size = True
        config.cppo.two_wave = {"enabled": True}
    with pytest.raises(ValueError, match=r"^cppo.two_wave.enabled=true is not built for veRL: .* set "
                                         r"cppo.two_wave.enabled=false"):
        prepare(config)
    assert config.data.train_batch_size == 4  # refused before anything changed


def test_selective_rollout_passes_prepare_and_its_parameters_warn_when_it_is_off(config):
    """Selective rollout runs on the V1 sync loop (selective.py; its refusals: test_selective.py)."""
    with open_dict(config):
        config.cppo.selective.enabled = True
    prepare(config)
    assert config.data.gen_batch_size == 1  # one prompt per dataloader fetch
    with open_dict(config):
        config.cppo.selective.enabled = False
        config.cppo.selective.p_hard = 0.2
    with pytest.warns(UserWarning) as caught:
        prepare(config)
    assert [str(w.message) for w in caught if "cppo." in str(w.message)] == [
        "cppo.selective.p_hard=0.2 has no effect under veRL: it belongs to cppo.selective.enabled, which is off; "
        "set cppo.selective.enabled=true or remove it"]


def test_the_flat_selective_keys_of_earlier_versions_are_read_with_a_warning(config):
    """A recipe's cppo group with the old flat names (force-added: veRL's struct has only the new ones), and
    the launcher's hydra overrides of them, renamed before hydra sees them."""
    from cppo_megatron.integrations.verl.main import renamed_override
    from cppo_megatron.integrations.verl.runconfig import cppo_config_from, selective_enabled

    OmegaConf.update(config, "cppo.selective_rollout", True, force_add=True)
    OmegaConf.update(config, "cppo.selective_p_hard", 0.2, force_add=True)
    with pytest.warns(FutureWarning, match="cppo.selective_rollout is deprecated: write cppo.selective.enabled"):
        # the group also holds selective.enabled and .p_hard at their defaults: the old names win
        assert selective_enabled(config) and cppo_config_from(config).selective.p_hard == 0.2
    with pytest.warns(FutureWarning, match="cppo.selective_p_min is deprecated: write cppo.selective.p_min=0.1"):
        assert renamed_override("+cppo.selective_p_min=0.1") == "+cppo.selective.p_min=0.1"
    assert renamed_override("cppo.pruning_rate=0.5") == "cppo.pruning_rate=0.5"
    assert renamed_override("recipes/verl/tiny_cpu_cppo.yaml") == "recipes/verl/tiny_cpu_cppo.yaml"


def test_refill_rounds_without_dynamic_sampling_warn_and_prepare_marks_the_workers(config):
    import warnings

    from cppo_megatron.integrations.verl.runconfig import PREPARED_ENV

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(config)
    assert not [w for w in caught if "cppo." in str(w.message)]  # the packaged defaults warn about nothing
    assert config.ray_kwargs.ray_init.runtime_env.env_vars[PREPARED_ENV] == "1"
    with open_dict(config):
        config.cppo.max_refill_rounds = 5
        config.data.train_batch_size = 4
    with pytest.warns(UserWarning) as caught:
        prepare(config)
    assert [str(w.message) for w in caught if "cppo." in str(w.message)] == [
        "cppo.max_refill_rounds=5 has no effect under veRL: refill rounds belong to cppo.dynamic_sampling, which "
        "veRL runs do not support; remove it"]


def test_settings_that_prune_nothing_warn(config):
    assert apply_allocation(copy_of(config)).warning == ""  # G = 8, P = 0.75: keeps 2 of 8
    with open_dict(config):
        config.actor_rollout_ref.rollout.n = 1
    plan = apply_allocation(copy_of(config))
    assert plan.keep == 1 and "G=1" in plan.warning and plan.describe().endswith(plan.warning)
    with open_dict(config):
        config.actor_rollout_ref.rollout.n = 8
        config.cppo.pruning_rate = None
        config.cppo.keep_per_group = 8
    assert "keeps 8 of G=8" in apply_allocation(copy_of(config)).warning
    with open_dict(config):
        config.cppo.pruning_rate = 0.0  # plain GRPO through the same path: nothing to warn about
        config.cppo.keep_per_group = None
    assert apply_allocation(copy_of(config)).warning == ""


def copy_of(config):
    import copy

    return copy.deepcopy(config)
